"""Draft-block attention over the target's paged KV pool, read in place.

The H-Spec drafter's attention layers have no KV cache of their own: each reads one target layer's
post-RoPE K/V from SGLang's paged pool. `paged_block_attention` is that read:

    queries   q        [B, Hq, L, D]   the block's L = block_size queries of request b, already rotated,
                                       at continued positions n+1 .. n+L (n = seq_lens[b] - 1)
    block K/V k_block  [B, Hkv, L, D]  the block's own post-RoPE keys and values at the same positions
              v_block
    context   PagedKVWindow (paged_kv) key/value storage [num_slots, Hkv, D] (SGLang's k_buffer[layer],
                                       NHD), slots req_to_token[req_pool_indices[b], position]
    returns            [B, Hq, L, D]   in q's dtype

Masking rule: every block query sees the same context, the target keys at positions
max(0, n+1-W) .. n (W = sliding_window, the newest W committed tokens), then the block's own keys
j <= i for query i (j < L when `causal` is False). Query head h reads KV head h // (Hq // Hkv), as
`F.scaled_dot_product_attention(enable_gqa=True)`. FP8 storage (e4m3 / e5m2, SGLang's
`--kv-cache-dtype fp8_*`) holds k / k_scale (SGLang's `set_kv_buffer` divides before the cast), so
keys read back as stored * k_scale and values as stored * v_scale; the block's own K/V are unscaled.

On CUDA this runs the Triton kernel in `triton_block_attention.py` (one pass, online softmax, GQA
without expanding K/V, FP8 dequantised in registers). Everywhere else, and as the kernel's reference,
it runs `paged_block_attention_reference`: gather the window, concatenate the block, one masked SDPA
(the same computation as `Attention.forward` over a gathered `WindowKV`).
"""

from __future__ import annotations

import functools
import math
from typing import Literal

import torch
import torch.nn.functional as F

from .paged_kv import PagedKVWindow

Backend = Literal["auto", "triton", "torch"]


def _check_shapes(q: torch.Tensor, k_block: torch.Tensor, v_block: torch.Tensor, kv: PagedKVWindow) -> None:
    if q.dim() != 4 or k_block.dim() != 4 or k_block.shape != v_block.shape:
        raise ValueError(f"q must be [B, Hq, L, D] and k_block / v_block [B, Hkv, L, D]; got q {tuple(q.shape)}, "
                         f"k_block {tuple(k_block.shape)}, v_block {tuple(v_block.shape)}")
    B, Hq, L, D = q.shape
    if k_block.shape != (B, kv.num_kv_heads, L, D) or kv.head_dim != D or kv.batch_size != B:
        raise ValueError(f"shape mismatch: q {tuple(q.shape)}, k_block {tuple(k_block.shape)}, pool "
                         f"[slots, kv_heads, head_dim] = {tuple(kv.key_buffer.shape)}, {kv.batch_size} requests; "
                         "the block must have the pool's kv_heads and head_dim and one row per request")
    if Hq % kv.num_kv_heads:
        raise ValueError(f"{Hq} query heads is not a multiple of {kv.num_kv_heads} KV heads (GQA needs Hq = G * Hkv)")


def paged_block_attention_reference(q: torch.Tensor, k_block: torch.Tensor, v_block: torch.Tensor,
                                    kv: PagedKVWindow, *, causal: bool = True,
                                    sm_scale: float | None = None) -> torch.Tensor:
    """Torch twin of the Triton kernel (same contract): gather the window, append the block's K/V, one
    masked SDPA in q's dtype. This is the CPU path; in float64 it is the kernel's test oracle."""
    _check_shapes(q, k_block, v_block, kv)
    B, Hq, L, _ = q.shape
    ctx_k, ctx_v, ctx_valid = kv.gather(q.dtype)
    block_mask = torch.ones(L, L, dtype=torch.bool, device=q.device)
    if causal:
        block_mask = block_mask.tril()
    mask = torch.cat([ctx_valid[:, None, :].expand(B, L, -1), block_mask.expand(B, L, L)], dim=2)
    k = torch.cat([ctx_k, k_block.to(q.dtype)], dim=2)
    v = torch.cat([ctx_v, v_block.to(q.dtype)], dim=2)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], scale=sm_scale,
                                          enable_gqa=kv.num_kv_heads != Hq)


@functools.cache
def triton_available() -> bool:
    """Whether the Triton kernel can be imported here (Triton is a CUDA-side dependency: SGLang's
    environment has it, the CPU reference environment does not)."""
    try:
        from . import triton_block_attention  # noqa: F401
    except ImportError:
        return False
    return True


def paged_block_attention(q: torch.Tensor, k_block: torch.Tensor, v_block: torch.Tensor, kv: PagedKVWindow, *,
                          causal: bool = True, sm_scale: float | None = None,
                          backend: Backend = "auto") -> torch.Tensor:
    """Attention of the draft block over the target's paged KV window plus its own causal K/V (the
    contract is in this module's docstring). backend "auto": the Triton kernel for CUDA tensors when
    Triton is installed, else the torch reference; "triton" / "torch" force one (the Triton kernel also
    runs on CPU tensors under TRITON_INTERPRET=1, which is how the tests check it without a GPU)."""
    if backend not in ("auto", "triton", "torch"):
        raise ValueError(f"backend must be 'auto', 'triton' or 'torch', got {backend!r}")
    use_triton = backend == "triton" or (backend == "auto" and q.is_cuda and triton_available())
    if not use_triton:
        return paged_block_attention_reference(q, k_block, v_block, kv, causal=causal, sm_scale=sm_scale)
    if not triton_available():
        raise RuntimeError("paged_block_attention(backend='triton') needs the `triton` package (installed with "
                           "sglang); use backend='torch' or 'auto' without it")
    from .triton_block_attention import triton_paged_block_attention

    _check_shapes(q, k_block, v_block, kv)
    scale = 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else float(sm_scale)
    return triton_paged_block_attention(q, k_block, v_block, kv, causal=causal, sm_scale=scale)
