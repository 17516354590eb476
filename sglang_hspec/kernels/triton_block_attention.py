"""Triton kernel for the draft block's attention over the target's paged KV (contract:
`paged_block_attention.py`). Imports triton: import it through `paged_block_attention`, which falls back
to the torch reference where Triton is missing.

Why it is shaped this way
- One program per (request, KV head). Its rows are the block's L queries x the G = Hq / Hkv query heads
  that share the KV head (row r = query r // G, head kv_head * G + r % G): each K/V tile is loaded once
  for all of them, so GQA never expands K/V, and L * G rows (7 x 4 = 28 for a Qwen3-8B-like target)
  fill a tensor-core tile (M >= 16) that one query row per program could not.
- The window is read through the page table inside the kernel (slot = req_to_token[row, position]),
  token-granular, so any SGLang page size and any slot order work and nothing is gathered in memory.
- One pass with online softmax (flash-attention): context tiles first, then the block's own K/V as a
  last tile with the causal mask. Scores use exp2 with log2(e) folded into the scale.
- FP8 storage is converted to the query dtype in registers (e4m3 / e5m2 are exact in bf16 / fp16 /
  fp32); k_scale is folded into the score scale and v_scale into the context tiles' P @ V output, so
  dequantisation costs two multiplies per tile, not one per element.
- fp32 inputs use IEEE dot products (Triton's default would be TF32, ~1e-3 relative error).
- No split over the window (split-K): the grid is B x Hkv programs; at serving batch sizes (tens of
  requests x 8 KV heads) that already covers the GPU. Under TRITON_INTERPRET the dot operands are
  upcast to fp32 after rounding to the GPU's operand dtype (the interpreter multiplies bf16 bit
  patterns as integers), so the interpreter checks the same roundings as the GPU path.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .paged_kv import FP8_DTYPES, PagedKVWindow

LOG2E = 1.4426950408889634


@triton.jit
def _mma(a, b, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _paged_block_attention_kernel(
    Q, K_blk, V_blk, K_buf, V_buf, Out, ReqToToken, ReqPoolIndices, SeqLens,
    qk_scale, k_scale, v_scale, sliding_window,
    stride_qb, stride_qh, stride_ql, stride_qd,
    stride_kbb, stride_kbh, stride_kbl, stride_kbd,
    stride_vbb, stride_vbh, stride_vbl, stride_vbd,
    stride_ks, stride_kh, stride_kd,
    stride_vs, stride_vh, stride_vd,
    stride_ob, stride_oh, stride_ol, stride_od,
    stride_r2t_row, stride_r2t_pos,
    BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_L: tl.constexpr,
    IS_CAUSAL: tl.constexpr, UPCAST_DOT: tl.constexpr, IEEE: tl.constexpr,
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    query = rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = rows < BLOCK_SIZE * GROUP
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM

    q_ptrs = Q + b * stride_qb + head[:, None] * stride_qh + query[:, None] * stride_ql + d[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    dtype = q.dtype

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    # context: positions max(0, n+1-W) .. n with n + 1 = seq_len, the same for every block query
    seq_len = tl.load(SeqLens + b).to(tl.int32)
    start = tl.maximum(seq_len - sliding_window, 0)
    table = ReqToToken + tl.load(ReqPoolIndices + b).to(tl.int64) * stride_r2t_row
    ctx_k_scale = qk_scale * k_scale
    for tile in range(start, seq_len, BLOCK_N):
        pos = tile + tl.arange(0, BLOCK_N)
        pos_ok = pos < seq_len
        slot = tl.load(table + pos * stride_r2t_pos, mask=pos_ok, other=0).to(tl.int64)
        kt = tl.load(K_buf + slot[None, :] * stride_ks + kv_head * stride_kh + d[:, None] * stride_kd,
                     mask=pos_ok[None, :] & d_ok[:, None], other=0.0).to(dtype)  # [D, N]
        s = _mma(q, kt, UPCAST_DOT, IEEE) * ctx_k_scale
        s = tl.where(pos_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V_buf + slot[:, None] * stride_vs + kv_head * stride_vh + d[None, :] * stride_vd,
                    mask=pos_ok[:, None] & d_ok[None, :], other=0.0).to(dtype)  # [N, D]
        acc = acc * alpha[:, None] + _mma(p.to(dtype), v, UPCAST_DOT, IEEE) * v_scale
        m_i = m_new

    # the block's own keys at n+1 .. n+L: query i sees j <= i (all j < L when not causal)
    j = tl.arange(0, BLOCK_L)
    j_ok = j < BLOCK_SIZE
    kt = tl.load(K_blk + b * stride_kbb + kv_head * stride_kbh + j[None, :] * stride_kbl + d[:, None] * stride_kbd,
                 mask=j_ok[None, :] & d_ok[:, None], other=0.0).to(dtype)
    s = _mma(q, kt, UPCAST_DOT, IEEE) * qk_scale
    seen = j_ok[None, :]
    if IS_CAUSAL:  # padded rows (query >= L) see every block key: finite, never stored
        seen = seen & (j[None, :] <= query[:, None])
    s = tl.where(seen, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(V_blk + b * stride_vbb + kv_head * stride_vbh + j[:, None] * stride_vbl + d[None, :] * stride_vbd,
                mask=j_ok[:, None] & d_ok[None, :], other=0.0).to(dtype)
    acc = acc * alpha[:, None] + _mma(p.to(dtype), v, UPCAST_DOT, IEEE)

    out = acc / l_i[:, None]
    o_ptrs = Out + b * stride_ob + head[:, None] * stride_oh + query[:, None] * stride_ol + d[None, :] * stride_od
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_paged_block_attention(q: torch.Tensor, k_block: torch.Tensor, v_block: torch.Tensor, kv: PagedKVWindow,
                                 *, causal: bool, sm_scale: float, block_n: int = 64) -> torch.Tensor:
    """Launch the kernel (shapes already checked by `paged_block_attention`). Returns [B, Hq, L, D] as a
    transposed view of [B, L, Hq, D] storage, so the caller's `transpose(1, 2).reshape` to the output
    projection costs no copy. block_n: context keys per tile (a power of two >= 16)."""
    if q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"the Triton kernel takes float32 / bfloat16 / float16 queries, got {q.dtype}; "
                         "use backend='torch' for other dtypes")
    if kv.key_buffer.dtype not in (q.dtype, *FP8_DTYPES) or kv.value_buffer.dtype != kv.key_buffer.dtype:
        raise ValueError(f"KV pool dtype {kv.key_buffer.dtype} / {kv.value_buffer.dtype} is not supported with "
                         f"{q.dtype} queries: the kernel reads the query dtype or float8 (e4m3 / e5m2) pools "
                         "(--kv-cache-dtype auto, fp8_e4m3 or fp8_e5m2)")
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"block_n must be a power of two >= 16, got {block_n}")
    B, Hq, L, D = q.shape
    Hkv = kv.num_kv_heads
    group = Hq // Hkv
    out = torch.empty(B, L, Hq, D, device=q.device, dtype=q.dtype).transpose(1, 2)
    if B == 0:
        return out
    block_m = max(16, triton.next_power_of_2(L * group))
    grid = (B, Hkv)
    _paged_block_attention_kernel[grid](
        q, k_block, v_block, kv.key_buffer, kv.value_buffer, out,
        kv.req_to_token, kv.req_pool_indices, kv.seq_lens,
        sm_scale * LOG2E, float(kv.k_scale), float(kv.v_scale), int(kv.sliding_window),
        *q.stride(), *k_block.stride(), *v_block.stride(),
        *kv.key_buffer.stride(), *kv.value_buffer.stride(), *out.stride(),
        *kv.req_to_token.stride(),
        BLOCK_SIZE=L, GROUP=group, HEAD_DIM=D,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=max(16, triton.next_power_of_2(D)),
        BLOCK_L=max(16, triton.next_power_of_2(L)),
        IS_CAUSAL=causal, UPCAST_DOT=_interpreting(), IEEE=q.dtype == torch.float32,
        num_warps=4 if block_m * D <= 64 * 128 else 8,
    )
    return out
