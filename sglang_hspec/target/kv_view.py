"""A read-only window into one target layer's KV cache, read in place.

The same drafter attention code reads a dense Hugging Face-style cache (our reference engine) and
SGLang's paged KV pool. Both are described by the storage tensors plus integer indices; `gather`
materialises only the W window entries per request for the attention call (as a paged-attention
kernel would), the cache itself is never copied or re-projected.

Layouts
- "bhtd": key/value storage [rows, kv_heads, T_capacity, head_dim] (our RaggedKVCache); request b
  reads storage row `row_index[b]` at time indices `token_index[b]`.
- "thd": key/value storage [num_slots, kv_heads, head_dim] (SGLang's `k_buffer[layer]`); request b
  reads slots `token_index[b]` (= req_to_token[req_pool_index, positions]).

Keys are post-RoPE (as the target stored them). `positions[b, w]` is the absolute position of the
entry; `valid[b, w]` masks the left padding of requests whose context is shorter than W.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch


@dataclass(frozen=True)
class TargetKVView:
    key: torch.Tensor
    value: torch.Tensor
    token_index: torch.Tensor  # [B, W] long
    positions: torch.Tensor  # [B, W] long, absolute positions of the entries
    valid: torch.Tensor  # [B, W] bool
    layout: Literal["bhtd", "thd"] = "bhtd"
    row_index: torch.Tensor | None = None  # [B] long, "bhtd" only

    def __post_init__(self) -> None:
        if self.layout not in ("bhtd", "thd"):
            raise ValueError(f"unknown KV layout {self.layout!r}; expected 'bhtd' or 'thd'")
        if self.layout == "bhtd" and (self.key.dim() != 4 or self.row_index is None):
            raise ValueError("'bhtd' views need 4-D storage [rows, kv_heads, T, head_dim] and row_index")
        if self.layout == "thd" and self.key.dim() != 3:
            raise ValueError("'thd' views need 3-D storage [num_slots, kv_heads, head_dim]")
        if self.token_index.shape != self.positions.shape or self.token_index.shape != self.valid.shape:
            raise ValueError("token_index, positions and valid must share the shape [B, W]")

    @property
    def batch_size(self) -> int:
        return self.token_index.shape[0]

    @property
    def window(self) -> int:
        return self.token_index.shape[1]

    @property
    def num_kv_heads(self) -> int:
        return self.key.shape[1]

    @property
    def head_dim(self) -> int:
        return self.key.shape[-1]

    def gather(self) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the window as [B, kv_heads, W, head_dim] (invalid entries hold arbitrary values:
        mask them with `valid`)."""
        idx = self.token_index.clamp_min(0)
        if self.layout == "bhtd":
            rows = self.row_index[:, None].expand_as(idx)
            # storage[rows, :, idx] -> [B, W, H, D] (advanced indices around a slice go first)
            k = self.key[rows, :, idx]
            v = self.value[rows, :, idx]
        else:
            k = self.key[idx]
            v = self.value[idx]
        return k.transpose(1, 2), v.transpose(1, 2)

    def select(self, batch_index: torch.Tensor) -> TargetKVView:
        """The view restricted to some requests (no storage copy)."""
        return TargetKVView(
            key=self.key,
            value=self.value,
            token_index=self.token_index[batch_index],
            positions=self.positions[batch_index],
            valid=self.valid[batch_index],
            layout=self.layout,
            row_index=None if self.row_index is None else self.row_index[batch_index],
        )


def window_indices(last_position: torch.Tensor, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions max(0, n+1-W) .. n for each request's last committed position n, right-aligned in a
    [B, W] grid: returns (positions clamped at 0, valid mask)."""
    offsets = torch.arange(window - 1, -1, -1, device=last_position.device)
    pos = last_position[:, None] - offsets[None, :]
    valid = pos >= 0
    return pos.clamp_min(0), valid


def dense_window_view(
    key: torch.Tensor,
    value: torch.Tensor,
    last_position: torch.Tensor,
    window: int,
    row_index: torch.Tensor | None = None,
) -> TargetKVView:
    """A "bhtd" view over dense storage [rows, kv_heads, T, head_dim] where row b holds request b's
    tokens at time index == absolute position (left-aligned, as in RaggedKVCache)."""
    if row_index is None:
        row_index = torch.arange(last_position.shape[0], device=last_position.device)
    if window <= 0:
        raise ValueError(f"window must be positive, got {window}")
    w = int(min(window, int(last_position.max().item()) + 1)) if last_position.numel() else 1
    pos, valid = window_indices(last_position, w)
    return TargetKVView(key=key, value=value, token_index=pos, positions=pos, valid=valid,
                        layout="bhtd", row_index=row_index)
