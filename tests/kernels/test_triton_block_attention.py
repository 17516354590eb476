"""The Triton kernel against the float64 torch reference, under TRITON_INTERPRET on CPU (compiled on a
GPU): random shapes, ragged lengths, windows shorter and longer than the context, GQA ratios 1/3/4,
non-power-of-two head dims, SGLang page tables (token-granular req_to_token rows over pages handed out
in random order), FP8 pools with per-layer scales, fp32 and bf16 inputs. Small shapes: the interpreter
runs each program in numpy."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed in this environment (it ships with sglang: "
                                     "run `make test-sglang`, which runs tests/kernels in .venv-sglang)")

from _pool import block_inputs, paged_pool, to_device, with_storage  # noqa: E402

from sglang_hspec.kernels import paged_block_attention, paged_block_attention_reference  # noqa: E402
from sglang_hspec.kernels.triton_block_attention import triton_paged_block_attention  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Max abs errors measured at these shapes (interpreter): fp32 <= 6e-7 (IEEE dots); bf16 <= 0.015, about one
# bf16 ulp at |out| ~ 2 (both sides see the same bf16 inputs; the kernel also rounds P to bf16 for the
# P @ V dot, as flash attention does, which is ~2x the error of torch's bf16 SDPA on CPU).
ATOL = {torch.float32: 2e-6, torch.bfloat16: 2.5e-2}

CASES = [  # seq_lens, sliding_window, q_heads, kv_heads, head_dim, page_size, block_size
    ([13, 1, 30, 7], 8, 6, 2, 32, 1, 7),  # W shorter than most contexts, GQA 3, a 1-token request
    ([5, 40, 22], 64, 4, 4, 16, 16, 7),  # every context inside the window, MHA, page 16
    ([33, 9], 16, 8, 2, 24, 4, 7),  # GQA 4, head_dim 24 (not a power of two)
    ([50], 20, 2, 1, 16, 8, 3),  # a block size other than 7; multi-query (1 KV head)
]


def _run(case, dtype, *, causal=True, kv_dtype=None, k_scale=1.0, v_scale=1.0, seed=0):
    seq_lens, window, hq, hkv, d, page, L = case
    kv = paged_pool(seq_lens=seq_lens, kv_heads=hkv, head_dim=d, page_size=page, sliding_window=window,
                    dtype=kv_dtype or dtype, k_scale=k_scale, v_scale=v_scale, seed=seed)
    q, k, v = block_inputs(batch=len(seq_lens), q_heads=hq, kv_heads=hkv, block_size=L, head_dim=d, dtype=dtype,
                           seed=seed + 1)
    ref = paged_block_attention_reference(q.double(), k.double(), v.double(),
                                          with_storage(kv, kv.key_buffer, kv.value_buffer), causal=causal)
    dev = to_device(kv, DEVICE)
    # block_n 16: several context tiles per request, so the online-softmax rescaling is exercised
    out = triton_paged_block_attention(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), dev, causal=causal,
                                       sm_scale=d ** -0.5, block_n=16)
    assert out.dtype == dtype and out.shape == q.shape
    return out.cpu().double(), ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", CASES, ids=["gqa3-short-window", "mha-page16", "gqa4-d24", "mqa-L3"])
def test_kernel_matches_the_float64_reference(case, dtype):
    out, ref = _run(case, dtype)
    err = (out - ref).abs().max().item()
    assert err < ATOL[dtype], f"max abs error {err:.3g}"
    if dtype == torch.float32:  # the bound is tight enough to see a one-position window shift
        shifted, _ = _run((case[0], case[1] + 1, *case[2:]), dtype)
        if any(n > case[1] for n in case[0]):
            assert (shifted - ref).abs().max().item() > 100 * ATOL[dtype]


def test_non_causal_block():
    out, ref = _run(CASES[0], torch.float32, causal=False)
    assert (out - ref).abs().max().item() < ATOL[torch.float32]


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fp8_pool_with_scales(kv_dtype, dtype):
    """The reference reads the same FP8 bytes times the scales: the kernel's only extra error is its
    own arithmetic (FP8 values are exact in bf16 and fp32)."""
    out, ref = _run(CASES[2], dtype, kv_dtype=kv_dtype, k_scale=0.5, v_scale=2.0)
    assert (out - ref).abs().max().item() < 2 * ATOL[dtype]


def test_output_is_laid_out_for_the_output_projection_and_dispatch_follows_the_device():
    kv = paged_pool(seq_lens=[9, 4], kv_heads=2, head_dim=16, page_size=1, sliding_window=8)
    q, k, v = block_inputs(batch=2, q_heads=4, kv_heads=2, block_size=7, head_dim=16)
    out = paged_block_attention(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), to_device(kv, DEVICE), backend="triton")
    assert out.transpose(1, 2).is_contiguous()  # [B, L, Hq, D] storage: o_proj's reshape is free
    auto = paged_block_attention(q, k, v, kv)  # CPU tensors: the torch reference
    assert torch.equal(auto, paged_block_attention_reference(q, k, v, kv))
    torch.testing.assert_close(out.cpu(), auto, rtol=0, atol=ATOL[torch.float32])
    if DEVICE == "cuda":  # CUDA tensors: the kernel
        assert torch.equal(paged_block_attention(q.cuda(), k.cuda(), v.cuda(), to_device(kv, "cuda")), out)
    with pytest.raises(ValueError, match="float32 / bfloat16 / float16 queries"):
        paged_block_attention(q.double(), k.double(), v.double(), kv, backend="triton")
