"""The torch path of the draft block's attention over SGLang's paged KV pool (the CPU path and the
Triton kernel's reference): the window and masking rule by hand, a naive float64 oracle over ragged
requests, FP8 dequantisation, and the drafter's Attention layer giving the same output through the
pool as through a gathered window."""

from __future__ import annotations

import math

import pytest
import torch
from _pool import block_inputs, paged_pool, to_device, with_storage

from sglang_hspec.kernels import PagedKVWindow, paged_block_attention, paged_block_attention_reference

needs_triton = pytest.mark.skipif(
    not __import__("sglang_hspec.kernels", fromlist=["triton_available"]).triton_available(),
    reason="triton is not installed in this environment (it ships with sglang: run in .venv-sglang)")


def naive_attention(q, k_block, v_block, kv: PagedKVWindow, *, causal: bool = True) -> torch.Tensor:
    """Loop-per-query float64 oracle of the contract: context positions max(0, n+1-W)..n read through
    req_to_token, then block keys j <= i; query head h reads KV head h // G."""
    B, Hq, L, D = q.shape
    G = Hq // kv.num_kv_heads
    out = torch.zeros(B, Hq, L, D, dtype=torch.float64)
    for b in range(B):
        n1 = int(kv.seq_lens[b])
        lo = max(0, n1 - kv.sliding_window)
        slots = kv.req_to_token[int(kv.req_pool_indices[b]), lo:n1].long()
        ctx_k = kv.key_buffer[slots].double() * kv.k_scale
        ctx_v = kv.value_buffer[slots].double() * kv.v_scale
        for h in range(Hq):
            kh = h // G
            for i in range(L):
                seen = i + 1 if causal else L
                keys = torch.cat([ctx_k[:, kh], k_block[b, kh, :seen].double()])
                vals = torch.cat([ctx_v[:, kh], v_block[b, kh, :seen].double()])
                w = torch.softmax(keys @ q[b, h, i].double() / math.sqrt(D), dim=0)
                out[b, h, i] = w @ vals
    return out


BACKENDS = ["torch", pytest.param("triton", marks=needs_triton)]


@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_queries_average_exactly_the_window_and_the_causal_block(backend):
    """q = 0 gives uniform weights, so each output is the mean of the values it sees. Values hold their
    position: the means below are computed by hand from the masking rule."""
    W, L, n = 4, 3, 9  # committed positions 0..9; the window keeps 6..9
    kv = paged_pool(seq_lens=[10, 2], kv_heads=1, head_dim=16, page_size=4, sliding_window=W)
    value = torch.full_like(kv.value_buffer, -1000.0)  # any slot read by mistake shows up
    for b, n1 in enumerate(kv.seq_lens.tolist()):
        slots = kv.req_to_token[int(kv.req_pool_indices[b]), :n1].long()
        value[slots] = torch.arange(n1, dtype=value.dtype)[:, None, None]
    kv = with_storage(kv, kv.key_buffer, value)
    q = torch.zeros(2, 2, L, 16)  # GQA 2:1
    k_block = torch.randn(2, 1, L, 16)
    v_block = (100 + torch.arange(L, dtype=torch.float32))[None, None, :, None].expand(2, 1, L, 16).contiguous()
    if backend == "triton" and torch.cuda.is_available():  # compiled on a GPU, interpreted on CPU tensors otherwise
        kv = to_device(kv, "cuda")
        q, k_block, v_block = q.cuda(), k_block.cuda(), v_block.cuda()
    out = paged_block_attention(q, k_block, v_block, kv, backend=backend).cpu()
    ctx = [sum(range(n - W + 1, n + 1)), 0 + 1]  # request 0: 6+7+8+9; request 1 (n=1, shorter than W): 0+1
    count = [W, 2]
    for b in range(2):
        for i in range(L):
            expected = (ctx[b] + sum(100 + j for j in range(i + 1))) / (count[b] + i + 1)
            torch.testing.assert_close(out[b, :, i], torch.full((2, 16), expected), rtol=0, atol=1e-4)
    non_causal = paged_block_attention(q, k_block, v_block, kv, causal=False, backend=backend).cpu()
    expected = (ctx[0] + 100 + 101 + 102) / (W + 3)  # every block key, for every query
    torch.testing.assert_close(non_causal[0, :, 0], torch.full((2, 16), expected), rtol=0, atol=1e-4)


@pytest.mark.parametrize(("seq_lens", "window", "q_heads", "kv_heads", "page_size"), [
    ([13, 1, 30, 7], 8, 6, 2, 1),  # windows shorter and longer than the context, GQA 3
    ([5, 40, 22], 64, 4, 4, 16),  # whole context inside the window, MHA, SGLang page 16
    ([33, 9], 16, 8, 2, 4),  # GQA 4
])
def test_reference_matches_the_naive_oracle(seq_lens, window, q_heads, kv_heads, page_size):
    kv = paged_pool(seq_lens=seq_lens, kv_heads=kv_heads, head_dim=16, page_size=page_size,
                    sliding_window=window, dtype=torch.float64)
    q, k, v = block_inputs(batch=len(seq_lens), q_heads=q_heads, kv_heads=kv_heads, block_size=7, head_dim=16,
                           dtype=torch.float64)
    for causal in (True, False):
        out = paged_block_attention_reference(q, k, v, kv, causal=causal)
        torch.testing.assert_close(out, naive_attention(q, k, v, kv, causal=causal), rtol=0, atol=1e-12)


def test_fp8_pool_reads_stored_times_scale():
    """SGLang stores k / k_scale in FP8; the reference reads stored * k_scale (and v alike): equal to the
    float64 pool of the dequantised values, and far from ignoring the scales."""
    kv8 = paged_pool(seq_lens=[12, 5], kv_heads=2, head_dim=16, page_size=1, sliding_window=8,
                     dtype=torch.float8_e4m3fn, k_scale=0.25, v_scale=3.0)
    dequant = with_storage(kv8, kv8.key_buffer.double() * 0.25, kv8.value_buffer.double() * 3.0,
                           k_scale=1.0, v_scale=1.0)
    q, k, v = block_inputs(batch=2, q_heads=4, kv_heads=2, block_size=7, head_dim=16, dtype=torch.float64)
    out = paged_block_attention_reference(q, k, v, kv8)
    torch.testing.assert_close(out, paged_block_attention_reference(q, k, v, dequant), rtol=0, atol=1e-12)
    torch.testing.assert_close(out, naive_attention(q, k, v, kv8), rtol=0, atol=1e-12)
    unscaled = paged_block_attention_reference(q, k, v, with_storage(kv8, kv8.key_buffer, kv8.value_buffer,
                                                                      k_scale=1.0, v_scale=1.0))
    assert (unscaled - out).abs().max() > 0.5


def test_cpu_dispatch_is_the_reference_and_the_attention_layer_reads_the_pool_in_place():
    """On CPU `paged_block_attention` is the reference, and the drafter's Attention layer gives bitwise
    the output of the gathered-window path it replaces in serving (pool_kv_view + gather_window)."""
    from sglang_hspec.model import HSpecConfig
    from sglang_hspec.model.hspec import Attention, gather_window, rope_inv_freq
    from sglang_hspec.sglang_plugin.context import pool_kv_view
    from sglang_hspec.target.geometry import TargetGeometry

    geometry = TargetGeometry(model_type="qwen3", num_hidden_layers=6, hidden_size=64, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=16, vocab_size=128, rope_theta=10000.0, qk_norm=True)
    cfg = HSpecConfig(target=geometry, target_layer_ids=(0, 1, 2, 3, 5),
                      mask_token_id=3, intermediate_size=96, mamba_num_heads=4, mamba_head_dim=8, mamba_groups=2,
                      mamba_state_dim=4, fusion_rank=32, markov_rank=16, draft_vocab_size=100)
    t = cfg.target
    torch.manual_seed(0)
    attn = Attention(cfg).eval()
    kv = paged_pool(seq_lens=[11, 3, 26], kv_heads=t.num_key_value_heads, head_dim=t.head_dim, page_size=4,
                    sliding_window=16)
    last = kv.seq_lens - 1
    L = cfg.block_size
    x = torch.randn(3, L, cfg.hidden_size)
    positions = last[:, None] + 1 + torch.arange(L)
    inv_freq = rope_inv_freq(t.head_dim, t.rope_theta, t.rope_scaling)
    view = pool_kv_view(key_buffer=kv.key_buffer, value_buffer=kv.value_buffer, req_to_token=kv.req_to_token,
                        req_pool_indices=kv.req_pool_indices, prefix_lens=kv.seq_lens,
                        window=min(kv.sliding_window, int(kv.seq_lens.max())))
    with torch.no_grad():
        gathered = attn(x, positions, inv_freq, gather_window(view, last, kv.sliding_window))
        paged = attn(x, positions, inv_freq, kv)
    assert torch.equal(paged, gathered)
    q, k, v = block_inputs(batch=3, q_heads=t.num_attention_heads, kv_heads=t.num_key_value_heads,
                           block_size=L, head_dim=t.head_dim)
    assert torch.equal(paged_block_attention(q, k, v, kv), paged_block_attention_reference(q, k, v, kv))


def test_bad_inputs_name_the_problem():
    kv = paged_pool(seq_lens=[4], kv_heads=2, head_dim=16, page_size=1, sliding_window=8)
    with pytest.raises(ValueError, match="uint8 storage"):
        with_storage(kv, kv.key_buffer.to(torch.float8_e4m3fn).view(torch.uint8), kv.value_buffer)
    with pytest.raises(ValueError, match=r"\[num_slots, kv_heads, head_dim\]"):
        with_storage(kv, kv.key_buffer[None], kv.value_buffer[None])
    with pytest.raises(ValueError, match="sliding_window must be positive"):
        with_storage(kv, kv.key_buffer, kv.value_buffer, sliding_window=0)
    with pytest.raises(ValueError, match="k_scale / v_scale must be positive"):
        with_storage(kv, kv.key_buffer, kv.value_buffer, k_scale=-1.0)
    q, k, v = block_inputs(batch=1, q_heads=3, kv_heads=2, block_size=7, head_dim=16)
    with pytest.raises(ValueError, match="not a multiple of 2 KV heads"):
        paged_block_attention(q, k, v, kv)
    q, k, v = block_inputs(batch=1, q_heads=4, kv_heads=2, block_size=7, head_dim=8)
    with pytest.raises(ValueError, match="head_dim"):
        paged_block_attention(q, k, v, kv)
    with pytest.raises(ValueError, match="backend must be"):
        paged_block_attention(q, k, v, kv, backend="cuda")
