"""Argmax drafts on all-greedy steps (`worker.greedy_drafts_for_greedy_batches`) change nothing but the cost.

- SGLang's Markov sampler (`sample_draft_block`, DSpark's draft path) over the tiny H-Spec drafter's own
  heads: for rows at temperature 0 its sampled mode and its greedy mode draft the same tokens, and only the
  sampled mode keeps step logits; rows at temperature 1 in sampled mode do draw noise (their drafts leave
  the argmax), so the equality is not the trivial one of a sampler that never samples;
- the wrapper sets the proposer's mode per call: greedy when the batch has no sampling info or every
  request is greedy, sampled otherwise, and always greedy when SGLANG_DSPARK_USE_GREEDY_DRAFT=1 set it so.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytestmark = pytest.mark.sglang


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    import os

    from safetensors.torch import load_file
    from sglang_cpu import builders
    from transformers import AutoConfig

    from sglang_hspec.sglang_plugin.draft_model import HSpecDraftModel

    root = tmp_path_factory.mktemp("greedy_draft")
    target_dir = builders.build_tiny_target(root / "target")
    draft_dir = builders.build_hspec_draft(root / "hspec", target_dir)
    target = builders.load_target(target_dir)
    os.environ["SGLANG_RAGGED_VERIFY_MODE"] = "compact"
    try:
        model = HSpecDraftModel(AutoConfig.from_pretrained(draft_dir))
    finally:
        del os.environ["SGLANG_RAGGED_VERIFY_MODE"]
    model.load_weights(load_file(str(draft_dir / "model.safetensors")).items())
    model.attach_shared_modules(embed_tokens=target.get_input_embeddings(), lm_head=target.lm_head)
    return model.eval()


def _draft(model, base, anchors, temperatures, *, greedy_draft: bool):
    from sglang.srt.speculative.dspark_components.dspark_draft import DraftNoise, sample_draft_block

    bs = base.shape[0]
    info = SimpleNamespace(temperatures=temperatures.view(bs, 1),
                           top_ks=torch.where(temperatures == 0, 1, 1 << 30).to(torch.int32))
    return sample_draft_block(
        base_logits=base, anchor_tokens=anchors, draft_hidden=None, sampling_info=info,
        markov_head=model.markov_head, noise=DraftNoise(key=7, offset=torch.zeros(1, dtype=torch.int64)),
        device=torch.device("cpu"), tp_sync=SimpleNamespace(sync=lambda site, x: x), greedy_draft=greedy_draft,
    )


@torch.no_grad()
def test_greedy_rows_draft_the_same_tokens_in_both_modes(adapter):
    cfg = adapter.hspec_config
    bs, k = 16, cfg.block_size
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(bs * k, cfg.hidden_size, generator=gen)
    base, _ = adapter.compute_base_logits(hidden)
    base = base.view(bs, k, -1)
    d2t = adapter.drafter.d2t
    anchors = d2t[torch.randint(d2t.numel(), (bs,), generator=gen)]
    greedy_t = torch.zeros(bs)
    sampled = _draft(adapter, base, anchors, greedy_t, greedy_draft=False)
    greedy = _draft(adapter, base, anchors, greedy_t, greedy_draft=True)
    assert torch.equal(sampled.draft_tokens, greedy.draft_tokens)
    assert greedy.corrected_logits is None and sampled.corrected_logits.shape == base.shape
    # the same rows at temperature 1: the sampled mode draws noise, so its drafts leave the argmax
    noisy = _draft(adapter, base, anchors, torch.ones(bs), greedy_draft=False)
    assert (noisy.draft_tokens != greedy.draft_tokens).float().mean() > 0.2
    assert torch.isin(noisy.draft_tokens, d2t).all()  # samples stay in the draft vocabulary (-inf elsewhere)


def test_the_wrapper_picks_argmax_drafts_only_for_all_greedy_batches():
    from sglang_hspec.sglang_plugin.worker import greedy_drafts_for_greedy_batches

    class Proposer:
        def __init__(self, greedy_draft: bool):
            self._greedy_draft = greedy_draft
            self.modes: list[bool] = []

        def propose(self, *, batch, sampling_info):
            self.modes.append(self._greedy_draft)
            return batch

    batches = [None, SimpleNamespace(is_all_greedy=True), SimpleNamespace(is_all_greedy=False), None]
    proposer = Proposer(greedy_draft=False)
    greedy_drafts_for_greedy_batches(proposer)
    assert [proposer.propose(batch=i, sampling_info=s) for i, s in enumerate(batches)] == [0, 1, 2, 3]
    assert proposer.modes == [True, True, False, True]
    forced = Proposer(greedy_draft=True)  # SGLANG_DSPARK_USE_GREEDY_DRAFT=1
    greedy_drafts_for_greedy_batches(forced)
    for s in batches:
        forced.propose(batch=None, sampling_info=s)
    assert forced.modes == [True] * 4
