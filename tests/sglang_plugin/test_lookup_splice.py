"""`HSPEC_LOOKUP=1` (sglang_plugin/lookup_splice.py) on a stand-in for DSpark's proposer, without SGLang: the
wrapper splices the lookup into argmax-drafted blocks in place (draft tokens, calibrated and raw confidences,
the folded [anchor | drafts] ids), leaves sampled blocks alone, and the flag and launch checks name the fix."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from sglang_hspec.sglang_plugin.lookup_splice import (
    LOOKUP_CONFIDENCE,
    check_lookup_server_args,
    lookup_enabled,
    splice_lookup_into_argmax_blocks,
)


class StandInProposer:
    """Returns a fixed [bs, 4] block with confidences, as DSpark's DraftBlockProposer.propose does."""

    gamma = 4

    def __init__(self, drafts, *, greedy: bool, folded: bool):
        self.drafts, self._greedy_draft, self.folded = drafts, greedy, folded

    def propose(self, *, batch, draft_input=None, bs=None, **_):
        drafts = torch.tensor(self.drafts)
        anchors = torch.full((drafts.shape[0], 1), 99)  # the graph tail's anchor column, left as it is
        return SimpleNamespace(
            draft_block=SimpleNamespace(draft_tokens=drafts.clone()),
            confidence=torch.full(drafts.shape, 0.3), confidence_raw=torch.full(drafts.shape, -0.5),
            verify_ids=torch.cat([anchors, drafts], dim=1) if self.folded else None)


def batch_of(*histories):
    """Requests whose prompt is all but the last two tokens of the history (the last is the anchor)."""
    return SimpleNamespace(reqs=[SimpleNamespace(origin_input_ids=h[:-2], output_ids=h[-2:]) for h in histories])


@pytest.mark.parametrize("folded", [False, True])
def test_argmax_blocks_get_the_lookup_after_slot_one(folded):
    proposer = StandInProposer([[8, 1, 1, 1], [7, 1, 1, 1], [8, 2, 2, 2]], greedy=True, folded=folded)
    splice_lookup_into_argmax_blocks(proposer, block_size=4)
    batch = batch_of([5, 6, 7, 5, 6, 8, 5, 6], [5, 6, 7, 5, 6, 8, 5, 6], [3, 3, 8, 1, 3])
    out = proposer.propose(batch=batch, bs=3)
    # the engine's hand-computed case (tests/engine/test_lookup_splice.py): rows 0 and 2 agree on slot 1
    assert out.draft_block.draft_tokens.tolist() == [[8, 5, 6, 8], [7, 1, 1, 1], [8, 1, 3, 8]]
    p = LOOKUP_CONFIDENCE
    torch.testing.assert_close(out.confidence, torch.tensor([[0.3, p, p, p], [0.3] * 4, [0.3, p, p, p]]))
    raw = math.log(p / (1 - p))
    torch.testing.assert_close(out.confidence_raw, torch.tensor([[-0.5, raw, raw, raw], [-0.5] * 4,
                                                                 [-0.5, raw, raw, raw]]))
    if folded:
        assert out.verify_ids.tolist() == [[99, 8, 5, 6, 8], [99, 7, 1, 1, 1], [99, 8, 1, 3, 8]]


def test_sampled_blocks_and_rows_without_requests_keep_the_drafts():
    sampled = StandInProposer([[8, 1, 1, 1]], greedy=False, folded=True)
    splice_lookup_into_argmax_blocks(sampled, block_size=4)
    out = sampled.propose(batch=batch_of([5, 6, 7, 5, 6, 8, 5, 6]), bs=1)
    assert out.draft_block.draft_tokens.tolist() == [[8, 1, 1, 1]]
    assert torch.equal(out.confidence, torch.full((1, 4), 0.3))

    padded = StandInProposer([[8, 1, 1, 1], [8, 1, 1, 1]], greedy=True, folded=False)  # two rows, one request
    splice_lookup_into_argmax_blocks(padded, block_size=4)
    out = padded.propose(batch=batch_of([5, 6, 7, 5, 6, 8, 5, 6]), bs=2)
    assert out.draft_block.draft_tokens.tolist() == [[8, 5, 6, 8], [8, 1, 1, 1]]


def test_flag_and_launch_check_name_the_fix():
    assert lookup_enabled({}) is False and lookup_enabled({"HSPEC_LOOKUP": "1"}) is True
    assert lookup_enabled({"HSPEC_LOOKUP": "0"}) is False
    with pytest.raises(ValueError, match="HSPEC_LOOKUP='yes': use 1"):
        lookup_enabled({"HSPEC_LOOKUP": "yes"})
    with pytest.raises(ValueError, match="--disable-overlap-schedule"):
        check_lookup_server_args(SimpleNamespace(disable_overlap_schedule=False))
    check_lookup_server_args(SimpleNamespace(disable_overlap_schedule=True))
