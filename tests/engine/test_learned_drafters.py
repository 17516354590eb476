"""The learned drafters (H-Spec, its ablations, the DFlash family) inside the reference engine.

Random-init drafters on a tiny target: greedy output equals plain decoding, sampling runs, every
proposal the engine obtains equals a proposal from a from-scratch recompute of the committed context
(so the dflash drafter KV cache follows the context exactly), and only the dflash family owns
per-request memory that grows with the context."""

import copy

import pytest
import torch

from sglang_hspec.assets.tiny import tiny_target
from sglang_hspec.core.types import DraftContext, SamplingParams
from sglang_hspec.engine.drafters import NoDrafter
from sglang_hspec.engine.engine import SpeculativeEngine
from sglang_hspec.model import KINDS, HSpecConfig, build_drafter
from sglang_hspec.target.adapter import TargetAdapter
from sglang_hspec.target.geometry import TargetGeometry
from sglang_hspec.target.kv_view import dense_window_view

VOCAB = 96
PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 9, 10, 11, 12, 13, 14], [9, 10, 11], [40, 41, 42, 40, 41, 42, 43]]


def make_drafter(kind, model, *, window=8, seed=1):
    cfg = HSpecConfig(target=TargetGeometry.from_hf_config(model.config), target_layer_ids=(0, 1, 2, 3, 5),
                      mask_token_id=3, intermediate_size=96, block_size=4, mamba_num_heads=4, mamba_head_dim=8,
                      mamba_groups=2, fusion_rank=32, markov_rank=16, draft_vocab_size=VOCAB,
                      sliding_window=window)
    torch.manual_seed(seed)
    drafter = build_drafter(kind, cfg, model.model.embed_tokens, model.lm_head).to(model.dtype)
    with torch.no_grad():  # the Markov head starts at zero; give it a trained-looking bias
        if drafter.markov is not None:
            drafter.markov.markov_w2.weight.normal_(0, 0.5)
    return drafter.eval()


class RecomputeCheck:
    """Wraps a learned drafter. At each greedy propose it also proposes from scratch for every row:
    one full target forward over the committed history, a fresh copy of the drafter given the whole
    context at once, and asserts the same block and confidences. Sampling proposals get q checked."""

    def __init__(self, drafter, adapter):
        self.inner, self.adapter, self.fresh = drafter, adapter, copy.deepcopy(drafter)
        for attr in ("name", "block_size", "target_layer_ids", "kv_layer_ids", "sliding_window", "reads_new_hidden"):
            setattr(self, attr, getattr(drafter, attr))
        self.checks = 0
        self.last_position: dict[int, int] = {}

    def reset(self):
        self.inner.reset()

    def propose(self, ctx, sampling, generator=None):
        # the engine builds the new positions' hidden states only for drafters that read them
        assert (ctx.new_hidden is not None) == self.reads_new_hidden, self.name
        prop = self.inner.propose(ctx, sampling, generator)
        for b, row in enumerate(ctx.row_ids.tolist()):
            self.last_position[row] = int(ctx.last_position[b])
        if not sampling.greedy:
            torch.testing.assert_close(prop.q.sum(-1), torch.ones(prop.q.shape[:2], dtype=prop.q.dtype))
            assert prop.q.gather(-1, prop.tokens[..., None]).min() > 0
            return prop
        for b, hist in enumerate(ctx.token_history):
            n = len(hist) - 1
            assert int(ctx.last_position[b]) == n
            feats = self.adapter.full_forward(torch.tensor([hist]), hidden_layer_ids=self.target_layer_ids,
                                              kv_layer_ids=self.kv_layer_ids)
            last = torch.tensor([n])
            views = {lid: dense_window_view(*feats.kv[lid], last, self.sliding_window) for lid in self.kv_layer_ids}
            hidden = feats.hidden
            self.fresh.reset()
            ref = self.fresh.propose(DraftContext(
                ctx.anchor_tokens[b:b + 1], last, None if hidden is None else hidden[:, n], views,
                row_ids=torch.tensor([0]), new_hidden=hidden, new_hidden_lengths=torch.tensor([n + 1])), sampling)
            assert prop.tokens[b].tolist() == ref.tokens[0].tolist(), (self.name, b, n)
            if ref.confidence_logits is not None:
                torch.testing.assert_close(prop.confidence_logits[b], ref.confidence_logits[0], rtol=1e-9, atol=1e-9)
            self.checks += 1
        return prop


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_equals_plain_decode_and_sampling_runs(kind):
    model = tiny_target("qwen3", vocab_size=VOCAB, seed=2)
    adapter = TargetAdapter(model)
    greedy = SamplingParams(max_new_tokens=20, ignore_eos=True)
    plain = SpeculativeEngine(adapter, NoDrafter()).generate(PROMPTS, greedy)
    drafter = make_drafter(kind, model)
    engine = SpeculativeEngine(adapter, drafter)
    spec = engine.generate(PROMPTS, greedy)
    assert [r.output_ids for r in spec] == [r.output_ids for r in plain]
    for r in spec:
        assert sum(r.stats.accept_lengths) + 1 == len(r.output_ids)  # + the prefill token
        # the fixed policy verifies the whole block unless fewer tokens may still be emitted
        emitted = [1 + sum(r.stats.accept_lengths[:s]) for s in range(r.stats.num_steps)]
        assert r.stats.verify_lengths == [min(drafter.block_size, 20 - e - 1) for e in emitted]

    sampling = SamplingParams(temperature=1.0, top_k=20, max_new_tokens=16, ignore_eos=True, seed=3)
    first = engine.generate(PROMPTS, sampling)
    again = engine.generate(PROMPTS, sampling)
    assert [len(r.output_ids) for r in first] == [16] * 3
    assert [r.output_ids for r in first] == [r.output_ids for r in again]
    assert all(0 <= t < VOCAB for r in first for t in r.output_ids)


@pytest.mark.parametrize("kind", KINDS)
def test_engine_proposals_equal_from_scratch_recompute(kind):
    """float64 so that the two paths (ragged cache vs one full forward) agree to the last bit of argmax."""
    model = tiny_target("llama", vocab_size=VOCAB, seed=4, dtype=torch.float64)
    adapter = TargetAdapter(model)
    checked = RecomputeCheck(make_drafter(kind, model, window=6), adapter)
    out = SpeculativeEngine(adapter, checked).generate(PROMPTS, SamplingParams(max_new_tokens=14, ignore_eos=True))
    assert checked.checks >= 3 * len(out[0].stats.accept_lengths)
    if kind in ("dflash", "dspark"):  # the cache holds exactly the committed positions at the last propose
        rows = torch.arange(len(PROMPTS))
        expected = [checked.last_position[r] + 1 for r in range(len(PROMPTS))]
        assert checked.inner.context_lengths(rows).tolist() == expected


def test_only_dflash_family_owns_bytes_that_grow_with_context():
    model = tiny_target("qwen3", vocab_size=VOCAB, seed=2)
    adapter = TargetAdapter(model)
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    short, long = [p[:3] for p in PROMPTS], [p * 12 for p in PROMPTS]
    for kind in KINDS:
        drafter = make_drafter(kind, model)
        engine = SpeculativeEngine(adapter, drafter)
        engine.generate(short, params)
        at_short = drafter.owned_state_bytes()
        engine.generate(long, params)
        at_long = drafter.owned_state_bytes()
        if kind in ("dflash", "dspark"):
            # 5 layers x (K, V) x kv heads x head_dim x fp32 bytes per cached position and row
            per_position = 5 * 2 * model.config.num_key_value_heads * model.config.head_dim * 4
            assert at_short >= 3 * (3 + 1) * per_position
            assert at_long >= 3 * (3 * 12 + 1) * per_position > at_short
            drafter.reset()
            assert drafter.owned_state_bytes() == 0
        else:
            assert at_short == at_long == 0, kind
