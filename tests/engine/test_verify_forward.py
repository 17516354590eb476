"""The verify forward of a step where few rows verify drafts: all anchors as one plain decode step, then
the drafting rows' drafts over those rows only. Held to the one padded extend it replaces: the same
logits and hidden states at every real position, the same KV cache and lengths."""

import pytest
import torch

from sglang_hspec.assets.tiny import tiny_target
from sglang_hspec.engine.engine import verify_forward
from sglang_hspec.target.adapter import TargetAdapter

PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11, 12], [13, 14, 15, 16], [17], [18, 19, 20, 21, 22]]
HIDDEN = (0, 2)


def prefilled(model) -> TargetAdapter:
    adapter = TargetAdapter(model)
    adapter.reset(len(PROMPTS), capacity=32)
    longest = max(map(len, PROMPTS))
    tokens = torch.zeros((len(PROMPTS), longest), dtype=torch.long)
    for i, p in enumerate(PROMPTS):
        tokens[i, : len(p)] = torch.tensor(p)
    adapter.extend(tokens, num_tokens=torch.tensor([len(p) for p in PROMPTS]), last_logits_only=True)
    return adapter


class CountingAdapter:
    """Counts extend calls and the tokens each computes (padded [B, L] = B x L)."""

    def __init__(self, adapter: TargetAdapter) -> None:
        self.adapter, self.tokens = adapter, []

    def extend(self, tokens, **kw):
        self.tokens.append(tokens.numel())
        return self.adapter.extend(tokens, **kw)


@pytest.mark.parametrize(("rows", "verify_lengths", "forward_tokens"), [
    # 2 of 6 rows draft: padding 4 x 3 = 12 >= 6 tokens -> split (6 anchors, 2 x 3)
    ([0, 1, 2, 3, 4, 5], [0, 3, 0, 0, 1, 0], [6, 6]),
    ([0, 1, 2, 3, 4, 5], [3, 3, 2, 3, 1, 3], [24]),  # every row drafts: one padded forward, 6 x 4
    ([0, 1, 2, 3, 4, 5], [0, 1, 0, 0, 0, 0], [12]),  # padding 5 x 1 = 5 < 6: not worth a second forward
    ([0, 1, 2, 3, 4, 5], [0, 2, 0, 1, 0, 0], [6, 4]),  # padding 4 x 2 = 8 >= 6 -> split
    # active rows 1, 3, 4, 5 of 6 (finished requests leave gaps): rows index the cache, positions the block
    ([1, 3, 4, 5], [0, 0, 3, 0], [4, 3]),
])
def test_split_verify_matches_the_padded_forward(rows, verify_lengths, forward_tokens):
    model = tiny_target("qwen3", vocab_size=48, num_layers=4)
    padded, split = prefilled(model), prefilled(model)
    rows, verify_lengths = torch.tensor(rows), torch.tensor(verify_lengths)
    longest = int(verify_lengths.max())
    block = torch.randint(0, 48, (len(rows), 1 + longest), generator=torch.Generator().manual_seed(0))
    want = padded.extend(block, num_tokens=1 + verify_lengths, rows=rows, hidden_layer_ids=HIDDEN)
    counting = CountingAdapter(split)
    got = verify_forward(counting, block, verify_lengths=verify_lengths, rows=rows, hidden_layer_ids=HIDDEN)
    assert counting.tokens == forward_tokens
    assert got.logits.shape == want.logits.shape and got.hidden.shape == want.hidden.shape
    for b, vl in enumerate(verify_lengths.tolist()):
        torch.testing.assert_close(got.logits[b, : 1 + vl], want.logits[b, : 1 + vl], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got.hidden[b, : 1 + vl], want.hidden[b, : 1 + vl], atol=1e-5, rtol=1e-5)
    assert torch.equal(split.lengths, padded.lengths)
    expected = torch.tensor([len(p) for p in PROMPTS])
    expected[rows] += 1 + verify_lengths
    assert torch.equal(split.lengths, expected)
    for lid in range(4):
        for b, n in enumerate(split.lengths.tolist()):
            for name in ("keys", "values"):
                torch.testing.assert_close(getattr(split.cache.layers[lid], name)[b, :, :n],
                                           getattr(padded.cache.layers[lid], name)[b, :, :n], atol=1e-5, rtol=1e-5)
