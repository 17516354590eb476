"""Batch-invariant target mode: attention against SDPA, row results independent of the forward's shape,
greedy speculation token-identical to plain decoding in bf16, and the exact same-as-plain report."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sglang_hspec.assets.tiny import tiny_target
from sglang_hspec.core.types import SamplingParams
from sglang_hspec.engine.drafters import NGramDrafter, NoDrafter
from sglang_hspec.engine.engine import SpeculativeEngine
from sglang_hspec.engine.identity import compare_greedy, first_difference, logit_gap
from sglang_hspec.target.adapter import (
    BATCH_INVARIANT_ATTENTION,
    TargetAdapter,
    batch_invariant_attention,
    linear_rows_are_batch_invariant,
)


class _Module:  # the attention function reads nothing from its module
    pass


def _causal_mask(positions: torch.Tensor, keys: int, dtype) -> torch.Tensor:
    allowed = torch.arange(keys)[None, :] <= positions[:, None]
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, torch.finfo(dtype).min)[None, None]


@pytest.mark.parametrize("boolean_mask", [False, True])
def test_attention_matches_sdpa_in_float64(boolean_mask):
    gen = torch.Generator().manual_seed(0)
    b, h, kv_heads, length, keys, d = 2, 4, 2, 5, 11, 8
    q = torch.randn(b, h, length, d, generator=gen, dtype=torch.float64)
    k = torch.randn(b, kv_heads, keys, d, generator=gen, dtype=torch.float64)
    v = torch.randn(b, kv_heads, keys, d, generator=gen, dtype=torch.float64)
    mask = _causal_mask(torch.arange(keys - length, keys), keys, torch.float64).expand(b, 1, length, keys)
    ref = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                         attn_mask=mask, scale=0.3).transpose(1, 2)
    got, _ = batch_invariant_attention(_Module(), q, k, v, mask == 0 if boolean_mask else mask, scaling=0.3)
    assert got.shape == (b, length, h, d) and got.dtype == torch.float64
    torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-10)


def test_attention_row_is_bitwise_independent_of_queries_and_masked_keys():
    """A verify row (8 queries, keys up to the block's end) equals the same row decoded alone (1 query,
    keys up to its own position) bit for bit in bf16; 20 prefixes, 8 rows each."""
    gen = torch.Generator().manual_seed(1)
    h, kv_heads, d = 9, 3, 64  # SmolLM2-135M's attention geometry
    for prefix in range(5, 105, 5):
        keys = prefix + 8
        q = torch.randn(1, h, 8, d, generator=gen).bfloat16()
        k = torch.randn(1, kv_heads, keys, d, generator=gen).bfloat16()
        v = torch.randn(1, kv_heads, keys, d, generator=gen).bfloat16()
        mask = _causal_mask(prefix + torch.arange(8), keys, torch.bfloat16)
        block, _ = batch_invariant_attention(_Module(), q, k, v, mask, scaling=d ** -0.5)
        for j in range(8):
            n = prefix + j + 1
            alone, _ = batch_invariant_attention(_Module(), q[:, :, j:j + 1], k[:, :, :n], v[:, :, :n],
                                                 mask[:, :, j:j + 1, :n], scaling=d ** -0.5)
            assert torch.equal(block[:, j], alone[:, 0]), (prefix, j)


def test_attention_rejects_what_it_does_not_implement():
    q = torch.zeros(1, 2, 1, 4)
    with pytest.raises(ValueError, match="softcap"):
        batch_invariant_attention(_Module(), q, q, q, None, softcap=30.0)
    with pytest.raises(ValueError, match="dropout"):
        batch_invariant_attention(_Module(), q, q, q, None, dropout=0.1)


def _bf16_adapter(batch_invariant: bool) -> TargetAdapter:
    return TargetAdapter(tiny_target("llama", seed=3, dtype=torch.bfloat16, num_layers=3),
                         batch_invariant=batch_invariant)


def test_adapter_switches_the_model_and_keeps_float64_results():
    adapter = TargetAdapter(tiny_target("qwen3", dtype=torch.float64, num_layers=2), batch_invariant=True)
    assert adapter.batch_invariant and adapter.model.config._attn_implementation == BATCH_INVARIANT_ATTENTION
    reference = TargetAdapter(tiny_target("qwen3", dtype=torch.float64, num_layers=2))
    ids = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    for a in (adapter, reference):
        a.reset(2, capacity=16)
    torch.testing.assert_close(adapter.extend(ids).logits, reference.extend(ids).logits, rtol=1e-9, atol=1e-9)
    # training's full forward builds its own (boolean) mask: same logits as SDPA
    torch.testing.assert_close(adapter.full_forward(ids, return_logits=True).logits,
                               reference.full_forward(ids, return_logits=True).logits, rtol=1e-9, atol=1e-9)


def test_the_linear_probe_tells_a_row_wise_gemm_from_one_that_reorders_its_sum(monkeypatch):
    """linear_rows_are_batch_invariant against two stand-in GEMMs: one that runs every row alone (invariant by
    construction) and one whose multi-row path sums the inner dimension in two halves (another order only;
    its results are right to float rounding). The probe's cancelling columns must expose the second, in every
    row it compares, and pass the first."""
    real = F.linear

    def row_wise(x, w, b=None):
        return torch.cat([real(x[r:r + 1], w, b) for r in range(x.shape[0])])

    def split_sum(x, w, b=None):  # fp32 accumulation in another order, rounded once to the input's dtype
        if x.shape[0] == 1:
            return real(x, w, b)
        h = x.shape[1] // 2
        return (real(x[:, :h].float(), w[:, :h].float()) + real(x[:, h:].float(), w[:, h:].float())).to(x.dtype)

    shapes = ((64, 128), (128, 64), (1536, 576))
    monkeypatch.setattr(torch.nn.functional, "linear", row_wise)
    assert linear_rows_are_batch_invariant(dtype=torch.bfloat16, shapes=shapes)
    monkeypatch.setattr(torch.nn.functional, "linear", split_sum)
    # each shape on its own is caught in bf16, where an order's fp32 residue seldom moves a random input's
    # result by an ulp (a probe of random inputs passed this GEMM at all three shapes)
    for shape in shapes:
        assert not linear_rows_are_batch_invariant(dtype=torch.bfloat16, shapes=(shape,))


def test_linear_shapes_of_the_tiny_target_by_hand():
    from sglang_hspec.target.adapter import linear_shapes

    # hidden 64, 4 heads x 16 = 64 (q, o), 2 kv heads x 16 = 32 (k, v), MLP 128, vocabulary 128 (the LM head)
    assert linear_shapes(tiny_target("llama", num_layers=2)) == ((64, 64), (64, 32), (64, 128), (128, 64))


def test_verify_forward_equals_one_token_decodes_bitwise_in_bf16():
    if not linear_rows_are_batch_invariant(dtype=torch.bfloat16, shapes=((64, 128), (128, 64))):
        pytest.skip("this CPU's bf16 GEMM gives a row different bits with other rows present; the mode makes "
                    "attention invariant only (docs/results.md, 'bf16 greedy identity')")
    adapter = _bf16_adapter(True)
    gen = torch.Generator().manual_seed(2)
    prompt, block = torch.randint(3, 128, (1, 30), generator=gen), torch.randint(3, 128, (1, 8), generator=gen)
    adapter.reset(1, capacity=64)
    adapter.extend(prompt)
    verify = adapter.extend(block, hidden_layer_ids=[0, 1, 2]).logits[0]
    adapter.truncate(torch.tensor([30]))
    for j in range(8):
        single = adapter.extend(block[:, j:j + 1]).logits[0, 0]
        assert torch.equal(verify[j], single), j


def test_bf16_greedy_speculation_is_token_identical_to_plain():
    """bf16 tiny target, n-gram drafter (repetitive prompts, so blocks are long and partly accepted):
    6 prompts x 40 tokens, every output equal to plain decoding's. The same run with batch_invariant=False
    gives 5/6 on this AVX2 CPU (first diff at token 3, logit gap 0.0156: one bf16 ulp)."""
    if not linear_rows_are_batch_invariant(dtype=torch.bfloat16, shapes=((64, 128), (128, 64))):
        pytest.skip("this CPU's bf16 GEMM is not row-invariant (see the test above)")
    adapter = _bf16_adapter(True)
    gen = torch.Generator().manual_seed(4)
    prompts = [(torch.randint(3, 128, (6,), generator=gen).tolist() * 4)[: 14 + i] for i in range(6)]
    sampling = SamplingParams(temperature=0.0, max_new_tokens=40, ignore_eos=True)
    plain = SpeculativeEngine(adapter, NoDrafter(), eos_token_ids=[]).generate(prompts, sampling)
    spec = SpeculativeEngine(adapter, NGramDrafter(7), eos_token_ids=[]).generate(prompts, sampling)
    assert sum(sum(r.stats.accept_lengths) - r.stats.num_steps for r in spec) > 0  # drafts were accepted
    cmp = compare_greedy(prompts, [r.output_ids for r in plain], [r.output_ids for r in spec])
    assert cmp.exact and cmp.label() == "6/6", cmp


def test_first_difference_and_label_by_hand():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2, 3, 4], [1, 2]) == 2  # the speculative output stopped at index 2
    cmp = compare_greedy([[9], [9], [9]], [[1, 2, 3], [1, 2, 3], [4, 4, 4, 4]], [[1, 2, 3], [1, 7, 3], [4, 4]],
                         eos_token_id=0)
    assert (cmp.prompts, cmp.identical, cmp.exact) == (3, 1, False)
    assert [(d.prompt_index, d.token_index, d.plain_token, d.spec_token) for d in cmp.divergences] == \
        [(1, 1, 2, 7), (2, 2, 4, 0)]
    assert cmp.label() == "1/3 (first diff @1)"
    assert cmp.to_dict()["identical_to_plain"] is False
    with pytest.raises(ValueError, match="one output of each per prompt"):
        compare_greedy([[1]], [[1]], [])


def test_logit_gap_is_the_targets_own_logit_difference():
    adapter = TargetAdapter(tiny_target("llama", dtype=torch.float64, num_layers=2))
    prompt, prefix = [5, 6, 7], [8, 9]
    logits = adapter.full_forward(torch.tensor([prompt + prefix]), return_logits=True).logits[0, -1]
    assert logit_gap(adapter, prompt, prefix, 10, 11) == pytest.approx(float(logits[10] - logits[11]), abs=1e-12)
    cmp = compare_greedy([prompt], [prefix + [10]], [prefix + [11]], adapter=adapter)
    gap = cmp.divergences[0].logit_gap
    assert cmp.label() == f"0/1 (first diff @2, gap {gap:.3g})"


def test_demo_and_eval_report_counts_not_a_bare_bool():
    from sglang_hspec.cli import format_table
    from sglang_hspec.training.eval import same_as_plain_cell

    row = {"drafter": "hspec", "tau": 1.3, "tokens": 64, "tokens_per_second": 1.0, "speedup": 0.9,
           "same_as_plain": "5/8 (first diff @9, gap 0.031)"}
    assert format_table([row]).splitlines()[-1].endswith("5/8 (first diff @9, gap 0.031)")
    assert same_as_plain_cell({"identical_to_plain": False, "prompts": 8, "identical_prompts": 5,
                               "first_divergence": 9}) == "NO: 5/8 (first diff @9)"
    assert same_as_plain_cell({"identical_to_plain": True, "prompts": 8, "identical_prompts": 8,
                               "first_divergence": None}) == "yes (8/8)"
    assert same_as_plain_cell({"identical_to_plain": None, "prompts": 8}) == "n/a"
