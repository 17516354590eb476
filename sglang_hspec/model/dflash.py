"""DFlash-family baselines on the same framework and heads as H-Spec.

- `dflash`: 5 x (attention > MLP). The 5 target hidden states at every context position are fused
  (fc + RMSNorm) and projected by each layer's own k/v projections into a drafter-side KV cache that
  grows with the context (the per-request cost H-Spec removes). The block attends to it bidirectionally.
- `dspark`: dflash + Markov + confidence heads.
- `dflash_target_kv`: the same 5 layers read the target's KV of the 5 target layers in place, no
  hidden-state injection. It needs no subclass: `DraftModel` with the dflash pattern does it.

The drafter KV cache is an explicit per-request object (`DFlashState`) the engine can hold; it must
follow the committed context: `extend_context` appends target hidden rows, `crop` rolls back.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from sglang_hspec.engine.types import DraftContext
from sglang_hspec.model.config import HSpecConfig
from sglang_hspec.model.hspec import DraftModel, RMSNorm, WindowKV, gather_window
from sglang_hspec.target.kv_view import dense_window_view


@dataclass
class DFlashState:
    """Drafter-side KV cache of B requests: per attention layer K/V [B, kv, capacity, D] at time index ==
    absolute position; request b holds positions 0..lengths[b]-1."""

    keys: list[torch.Tensor] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)
    lengths: torch.Tensor | None = None

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)


class DFlashDraftModel(DraftModel):
    def __init__(self, config: HSpecConfig, target_embed: nn.Embedding, target_lm_head: nn.Linear):
        if config.kind not in ("dflash", "dspark"):
            raise ValueError(f"DFlashDraftModel builds dflash/dspark, got {config.kind!r}; use build_drafter")
        super().__init__(config, target_embed, target_lm_head)
        d = config.hidden_size
        self.fc = nn.Linear(len(config.target_layer_ids) * d, d, bias=False)
        self.hidden_norm = RMSNorm(d, config.rms_norm_eps)
        self.state: DFlashState | None = None

    def _attn_layers(self):
        return [layer.attn for layer in self.layers if layer.attn is not None]

    def context_kv(self, hidden: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """hidden [B, t, 5, d] target rows at positions [B, t] -> per layer post-RoPE (K, V) [B, kv, t, D]."""
        feat = self.hidden_norm(self.fc(hidden.flatten(2).to(self.fc.weight.dtype)))
        return [attn.project_kv(feat, positions, self.inv_freq) for attn in self._attn_layers()]

    # ---- per-request drafter KV cache ----
    def reset(self) -> None:
        self.state = None

    def owned_state_bytes(self) -> int:
        return 0 if self.state is None else self.state.nbytes()

    @torch.no_grad()
    def extend_context(self, hidden_rows: torch.Tensor, counts: torch.Tensor | None = None) -> DFlashState:
        """Append target hidden rows [B, t, 5, d] (the next positions of each request; only the first
        counts[b] rows of request b are used) to the drafter KV cache."""
        B, t = hidden_rows.shape[:2]
        dev = hidden_rows.device
        counts = torch.full((B,), t, device=dev) if counts is None else counts.to(dev)
        if self.state is None:
            self.state = DFlashState(lengths=torch.zeros(B, dtype=torch.long, device=dev))
        st = self.state
        if st.lengths.shape[0] != B:
            raise ValueError(f"drafter state holds {st.lengths.shape[0]} requests, got {B}; call reset() first")
        positions = st.lengths[:, None] + torch.arange(t, device=dev)
        new_len = st.lengths + counts
        need = int(new_len.max())
        kvs = self.context_kv(hidden_rows, positions)
        for i, (k, v) in enumerate(kvs):
            if i >= len(st.keys):
                st.keys.append(k.new_zeros(B, k.shape[1], 0, k.shape[3]))
                st.values.append(v.new_zeros(B, v.shape[1], 0, v.shape[3]))
            cap = st.keys[i].shape[2]
            if need > cap:  # grow geometrically: amortised O(1) per appended token
                grow = max(need, 2 * cap) - cap
                st.keys[i] = torch.cat([st.keys[i], k.new_zeros(B, k.shape[1], grow, k.shape[3])], dim=2)
                st.values[i] = torch.cat([st.values[i], v.new_zeros(B, v.shape[1], grow, v.shape[3])], dim=2)
            keep = torch.arange(t, device=dev)[None, :] < counts[:, None]
            b_idx, j_idx = keep.nonzero(as_tuple=True)
            st.keys[i][b_idx, :, positions[b_idx, j_idx]] = k[b_idx, :, j_idx]
            st.values[i][b_idx, :, positions[b_idx, j_idx]] = v[b_idx, :, j_idx]
        st.lengths = new_len
        return st

    def crop(self, lengths: torch.Tensor) -> None:
        """Keep positions 0..lengths[b]-1 (after verification rejected drafted tokens)."""
        if self.state is not None:
            self.state.lengths = torch.minimum(self.state.lengths, lengths.to(self.state.lengths.device))

    def propose_contexts(self, ctx: DraftContext) -> dict[int, WindowKV]:
        n = ctx.last_position
        st = self.state
        if st is None and ctx.target_hidden is not None and bool((n == 0).all()):
            self.extend_context(ctx.target_hidden[:, None])
            st = self.state
        elif st is not None:
            self.crop(n + 1)
            one_short = st.lengths == n
            if bool(one_short.any()) and ctx.target_hidden is not None:
                self.extend_context(ctx.target_hidden[:, None], counts=one_short.long())
        if st is None or bool((st.lengths != n + 1).any()):
            have = None if st is None else st.lengths.tolist()
            raise ValueError(
                f"{self.name} needs target hidden rows for every context position 0..n={n.tolist()}, its cache "
                f"holds {have} positions; call drafter.extend_context(hidden_rows [B, t, 5, d], counts) with the "
                "newly committed positions before propose (DraftContext carries only position n)"
            )
        rows = torch.arange(n.shape[0], device=n.device)
        return {i: gather_window(dense_window_view(k, v, n, self.window, row_index=rows), n, self.window)
                for i, (k, v) in enumerate(zip(st.keys, st.values))}

    def train_contexts(self, hidden, kv, input_ids, last_position, rows) -> dict[int, WindowKV]:
        if hidden is None:
            raise ValueError(f"{self.name} needs features.hidden [B, T, 5, d] for layers {self.target_layer_ids}")
        B, T = hidden.shape[:2]
        positions = torch.arange(T, device=hidden.device).expand(B, T)
        out = {}
        for i, (k, v) in enumerate(self.context_kv(hidden, positions)):
            view = dense_window_view(k, v, last_position, self.window, row_index=rows)
            out[i] = gather_window(view, last_position, self.window)
        return out
