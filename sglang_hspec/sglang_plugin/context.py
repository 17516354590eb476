"""H-Spec's per-request drafter context inside SGLang (pure torch; no SGLang import).

H-Spec keeps no drafter KV cache. Its context is (a) the target's own KV pool, read in place through a
`TargetKVView` (layout "thd": storage `k_buffer[layer]` [num_slots, kv_heads, head_dim], slots
`req_to_token[req_pool_idx, positions]`), and (b) one projected vector per request: the target hidden
states of the drafter's target layers at the request's last committed position, fused to `rank`
values when they are captured (prefill: the last prompt row; verify: row commit_lens - 1), so the
buffer is [req_pool_size, rank] and a request-slot reuse is safe (every admission starts with a
prefill that overwrites its row).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from sglang_hspec.target.kv_view import TargetKVView, window_indices


def pool_kv_view(*, key_buffer: torch.Tensor, value_buffer: torch.Tensor, req_to_token: torch.Tensor,
                 req_pool_indices: torch.Tensor, prefix_lens: torch.Tensor, window: int) -> TargetKVView:
    """The last `window` committed positions (prefix_lens - window .. prefix_lens - 1) of each request
    in one target layer of SGLang's paged pool, without copying the pool. Positions are token-level,
    so any page size works."""
    last = prefix_lens.to(torch.long) - 1
    positions, valid = window_indices(last, window)
    slots = req_to_token[req_pool_indices.to(torch.long)[:, None], positions].to(torch.long)
    return TargetKVView(key=key_buffer, value=value_buffer, token_index=slots, positions=positions,
                        valid=valid, layout="thd")


def prefill_last_rows(extend_lens: list[int], device: torch.device) -> torch.Tensor:
    """Row of each request's last prompt token in a packed prefill capture [sum(extend_lens), K*H].
    Built on the host and copied once (no device sync in the forward path); with chunked prefill the
    last chunk's row wins, which is the row the next draft needs."""
    ends = torch.tensor(extend_lens, dtype=torch.long).cumsum(0) - 1
    pin = device.type == "cuda"
    return (ends.pin_memory() if pin else ends).to(device, non_blocking=pin)


def verify_commit_rows(hidden: torch.Tensor, commit_lens: torch.Tensor, bs: int) -> torch.Tensor:
    """From a verify capture viewed [bs, stride, K*H], the row of each request's last committed token
    (commit_lens counts the anchor and the accepted drafts; the bonus token is the next anchor)."""
    strided = hidden.view(bs, -1, hidden.shape[-1])
    rows = (commit_lens[:bs].to(torch.long) - 1).clamp_min(0)
    return strided[torch.arange(bs, device=hidden.device), rows]


class ContextState:
    """[req_pool_size, rank] buffer of projected target hidden states, one row per request slot."""

    def __init__(self, *, req_pool_size: int, rank: int, project: Callable[[torch.Tensor], torch.Tensor],
                 device: torch.device | str, dtype: torch.dtype):
        self.project = project
        self.buffer = torch.zeros(req_pool_size, rank, device=device, dtype=dtype)

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    def write(self, req_pool_indices: torch.Tensor, hidden_rows: torch.Tensor) -> None:
        if hidden_rows.shape[0] != req_pool_indices.shape[0]:
            raise ValueError(f"{hidden_rows.shape[0]} hidden rows for {req_pool_indices.shape[0]} requests")
        self.buffer[req_pool_indices.to(torch.long)] = self.project(hidden_rows).to(self.buffer.dtype)

    def read(self, req_pool_indices: torch.Tensor) -> torch.Tensor:
        return self.buffer[req_pool_indices.to(torch.long)]


def drafter_kv_bytes_saved(*, max_total_tokens: int, num_attention_layers: int, num_kv_heads: int,
                           head_dim: int, dtype_bytes: int) -> int:
    """K+V bytes a drafter with its own KV cache would need for the pool's token capacity."""
    return 2 * max_total_tokens * num_attention_layers * num_kv_heads * head_dim * dtype_bytes
