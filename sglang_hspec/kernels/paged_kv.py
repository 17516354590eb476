"""`PagedKVWindow`: one target layer's paged KV pool as the draft block reads it (SGLang's layout), and
its dense gather for the torch path. The attention over it is in `paged_block_attention.py`."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang_hspec.target.kv_view import window_indices

# per-tensor-scaled FP8 pools (SGLang's --kv-cache-dtype fp8_e4m3 / fp8_e5m2 on CUDA)
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


@dataclass(frozen=True)
class PagedKVWindow:
    """One target layer's KV pool as the draft block reads it (no copy of the pool).

    key_buffer / value_buffer [num_slots, kv_heads, head_dim]: SGLang's `get_key_buffer(layer)` /
    `get_value_buffer(layer)` (any strides; float8 views for an FP8 pool). req_to_token [pool_rows,
    max_context] int32/int64: SGLang's token-granular page table (slot of each position, any page
    size). req_pool_indices [B]: each request's row. seq_lens [B]: committed tokens n+1 per request.
    sliding_window: W. k_scale / v_scale: SGLang's per-layer `k_scale_float` / `v_scale_float`
    (1.0 when the pool is not FP8 or the checkpoint has no scales)."""

    key_buffer: torch.Tensor
    value_buffer: torch.Tensor
    req_to_token: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    sliding_window: int
    k_scale: float = 1.0
    v_scale: float = 1.0

    def __post_init__(self) -> None:
        for name in ("key_buffer", "value_buffer"):
            buf = getattr(self, name)
            if buf.dim() != 3:
                raise ValueError(f"PagedKVWindow.{name} must be [num_slots, kv_heads, head_dim] (SGLang's NHD "
                                 f"pool layout), got shape {tuple(buf.shape)}")
            if buf.dtype == torch.uint8:
                raise ValueError(f"PagedKVWindow.{name} is uint8 storage; pass it viewed as its float8 dtype "
                                 "(SGLang's get_key_buffer / get_value_buffer return that view)")
        if self.key_buffer.shape != self.value_buffer.shape:
            raise ValueError(f"key_buffer {tuple(self.key_buffer.shape)} and value_buffer "
                             f"{tuple(self.value_buffer.shape)} must have the same shape")
        if self.req_to_token.dim() != 2:
            raise ValueError(f"req_to_token must be [pool_rows, max_context], got {tuple(self.req_to_token.shape)}")
        if self.req_pool_indices.dim() != 1 or self.seq_lens.shape != self.req_pool_indices.shape:
            raise ValueError(f"req_pool_indices {tuple(self.req_pool_indices.shape)} and seq_lens "
                             f"{tuple(self.seq_lens.shape)} must both be [B]")
        if self.sliding_window <= 0:
            raise ValueError(f"sliding_window must be positive, got {self.sliding_window}")
        if not (self.k_scale > 0 and self.v_scale > 0):
            raise ValueError(f"k_scale / v_scale must be positive, got {self.k_scale} / {self.v_scale}")

    @property
    def batch_size(self) -> int:
        return self.req_pool_indices.shape[0]

    @property
    def num_kv_heads(self) -> int:
        return self.key_buffer.shape[1]

    @property
    def head_dim(self) -> int:
        return self.key_buffer.shape[2]

    def gather(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The window as dense K, V [B, kv_heads, W', D] in `dtype` (dequantised) and a mask [B, W'].

        W' = min(W, max_context) so that the shape does not depend on the lengths (no device sync, CUDA
        graph safe); on CPU, where reading the lengths is free, W' also stops at the longest context
        instead of gathering a mostly-masked 2048-wide window."""
        width = min(self.sliding_window, self.req_to_token.shape[1])
        if self.seq_lens.device.type == "cpu" and self.batch_size > 0:
            width = max(1, min(width, int(self.seq_lens.max())))
        last = self.seq_lens.to(torch.long) - 1
        positions, valid = window_indices(last, width)
        slots = self.req_to_token[self.req_pool_indices.to(torch.long)[:, None], positions].to(torch.long)
        key = self.key_buffer[slots].transpose(1, 2).to(dtype)  # [B, W', kv, D] -> [B, kv, W', D]
        value = self.value_buffer[slots].transpose(1, 2).to(dtype)
        if self.k_scale != 1.0:
            key = key * self.k_scale
        if self.v_scale != 1.0:
            value = value * self.v_scale
        return key, value, valid
