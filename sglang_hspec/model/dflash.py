"""DFlash-family baselines on the same framework and heads as H-Spec.

- `dflash`: 5 x (attention > MLP). The 5 target hidden states at every context position are fused
  (fc + RMSNorm) and projected by each layer's own k/v projections into a drafter-side KV cache that
  grows with the context (the per-request cost H-Spec removes). The block attends to it bidirectionally.
- `dspark`: dflash + Markov + confidence heads.
- `dflash_target_kv`: the same 5 layers read the target's KV of the 5 target layers in place, no
  hidden-state injection. It needs no subclass: `DraftModel` with the dflash pattern does it.

The drafter KV cache (`DFlashState`) is keyed by the engine's row id and follows the committed context
by itself: every `propose` appends `DraftContext.new_hidden` (the hidden rows of the positions committed
since that row's previous propose, ending at n) at positions n+1-count..n. Only committed positions are
ever appended, so rejected drafts never enter the cache and rollback is implicit.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from sglang_hspec.core.types import DraftContext
from sglang_hspec.model.config import HSpecConfig
from sglang_hspec.model.hspec import DraftModel, RMSNorm, SequenceKV, WindowKV, gather_window
from sglang_hspec.target.kv_view import dense_window_view


@dataclass
class DFlashState:
    """Drafter-side KV cache: per attention layer K/V [rows, kv, capacity, D] at time index == absolute
    position; engine row r holds positions 0..lengths[r]-1 (rows never seen have length 0)."""

    keys: list[torch.Tensor] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)
    lengths: torch.Tensor | None = None

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)


def _grow(t: torch.Tensor, rows: int, capacity: int) -> torch.Tensor:
    """t [R, kv, T, D] zero-padded to at least [rows, kv, capacity, D] (geometric growth per dim:
    amortised O(1) per appended token)."""
    R, _, T, _ = t.shape
    new_r = R if rows <= R else max(rows, 2 * R)
    new_t = T if capacity <= T else max(capacity, 2 * T)
    if (new_r, new_t) == (R, T):
        return t
    out = t.new_zeros(new_r, t.shape[1], new_t, t.shape[3])
    out[:R, :, :T] = t
    return out


class DFlashDraftModel(DraftModel):
    def __init__(self, config: HSpecConfig, target_embed: nn.Embedding, target_lm_head: nn.Linear):
        if config.kind not in ("dflash", "dspark"):
            raise ValueError(f"DFlashDraftModel builds dflash/dspark, got {config.kind!r}; use build_drafter")
        super().__init__(config, target_embed, target_lm_head)
        d = config.hidden_size
        self.fc = nn.Linear(len(config.target_layer_ids) * d, d, bias=False)
        self.hidden_norm = RMSNorm(d, config.rms_norm_eps)
        self.state: DFlashState | None = None
        self.reads_new_hidden = True  # its drafter-side cache grows by DraftContext.new_hidden

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

    def context_lengths(self, rows: torch.Tensor) -> torch.Tensor:
        """Positions held in the drafter KV cache per engine row (0 for rows never seen)."""
        st = self.state
        if st is None or st.lengths.numel() == 0:
            return torch.zeros_like(rows)
        known = rows < st.lengths.shape[0]
        return torch.where(known, st.lengths[rows.clamp_max(st.lengths.shape[0] - 1)], 0)

    @torch.no_grad()
    def _write_context(self, rows: torch.Tensor, hidden: torch.Tensor, counts: torch.Tensor,
                       start: torch.Tensor) -> None:
        """Write hidden[b, :counts[b]] (target rows [B, t, 5, d]) at positions start[b].. of engine row
        rows[b]; the row then holds exactly positions 0..start[b]+counts[b]-1."""
        dev = hidden.device
        rows, counts, start = rows.to(dev).long(), counts.to(dev).long(), start.to(dev).long()
        have = self.context_lengths(rows)
        gap = start > have
        if bool(gap.any()):
            b = int(gap.nonzero()[0, 0])
            raise ValueError(
                f"{self.name}'s drafter KV cache for row {int(rows[b])} holds positions 0..{int(have[b]) - 1} but "
                f"the new target hidden rows start at position {int(start[b])}; pass every committed position "
                "once (DraftContext.new_hidden: the whole prompt at prefill, then anchor + accepted drafts)"
            )
        t = hidden.shape[1]
        end = start + counts
        if self.state is None:
            self.state = DFlashState(lengths=torch.zeros(0, dtype=torch.long, device=dev))
        st = self.state
        num_rows = max(int(rows.max()) + 1, st.lengths.shape[0]) if rows.numel() else st.lengths.shape[0]
        need = int(end.max()) if end.numel() else 0
        if num_rows > st.lengths.shape[0]:
            st.lengths = torch.cat([st.lengths, st.lengths.new_zeros(num_rows - st.lengths.shape[0])])
        positions = start[:, None] + torch.arange(t, device=dev)
        keep = torch.arange(t, device=dev)[None, :] < counts[:, None]
        b_idx, j_idx = keep.nonzero(as_tuple=True)
        r_idx, p_idx = rows[b_idx], positions[b_idx, j_idx]
        for i, (k, v) in enumerate(self.context_kv(hidden, positions)):
            if i >= len(st.keys):
                st.keys.append(k.new_zeros(0, k.shape[1], 0, k.shape[3]))
                st.values.append(v.new_zeros(0, v.shape[1], 0, v.shape[3]))
            st.keys[i] = _grow(st.keys[i], num_rows, need)
            st.values[i] = _grow(st.values[i], num_rows, need)
            st.keys[i][r_idx, :, p_idx] = k[b_idx, :, j_idx]
            st.values[i][r_idx, :, p_idx] = v[b_idx, :, j_idx]
        # positions past `end` (rejected drafts of an earlier step, or a longer earlier request) are dropped
        st.lengths[rows] = end

    def extend_context(self, hidden_rows: torch.Tensor, counts: torch.Tensor | None = None,
                       rows: torch.Tensor | None = None) -> DFlashState:
        """Append target hidden rows [B, t, 5, d] (the next positions of engine rows `rows`, default
        0..B-1; only the first counts[b] rows of request b are used) after what each row holds.
        `propose` does this itself from DraftContext.new_hidden; benchmarks call it directly."""
        B, t = hidden_rows.shape[:2]
        dev = hidden_rows.device
        rows = torch.arange(B, device=dev) if rows is None else rows.to(dev)
        counts = torch.full((B,), t, device=dev) if counts is None else counts.to(dev)
        self._write_context(rows, hidden_rows, counts, self.context_lengths(rows))
        return self.state

    def crop(self, lengths: torch.Tensor, rows: torch.Tensor | None = None) -> None:
        """Keep positions 0..lengths[b]-1 of engine rows `rows` (default 0..B-1)."""
        if self.state is not None:
            rows = torch.arange(lengths.shape[0]) if rows is None else rows
            rows = rows.to(self.state.lengths.device)
            self.state.lengths[rows] = torch.minimum(self.state.lengths[rows], lengths.to(rows.device))

    def propose_contexts(self, ctx: DraftContext) -> dict[int, WindowKV]:
        n = ctx.last_position
        rows = ctx.row_ids if ctx.row_ids is not None else torch.arange(n.shape[0], device=n.device)
        rows = rows.to(n.device)
        if ctx.new_hidden is not None:
            t = ctx.new_hidden.shape[1]
            counts = ctx.new_hidden_lengths
            counts = torch.full_like(n, t) if counts is None else counts.to(n.device)
            self._write_context(rows, ctx.new_hidden, counts, n + 1 - counts)
        elif ctx.target_hidden is not None:
            # no new rows given: position n alone may be missing (a caller that tracks only position n)
            self.crop(n + 1, rows)
            one_short = self.context_lengths(rows) == n
            if bool(one_short.any()):
                self._write_context(rows, ctx.target_hidden[:, None], one_short.long(), n)
        have = self.context_lengths(rows)
        if bool((have != n + 1).any()):
            raise ValueError(
                f"{self.name} needs target hidden rows for every context position 0..n={n.tolist()}, its cache "
                f"holds {have.tolist()} positions; pass the positions committed since the previous propose as "
                "DraftContext.new_hidden [B, t, 5, d] with new_hidden_lengths (the engine does this)"
            )
        st = self.state
        return {i: gather_window(dense_window_view(k, v, n, self.sliding_window, row_index=rows), n, self.sliding_window)
                for i, (k, v) in enumerate(zip(st.keys, st.values))}

    def train_contexts(self, hidden, kv, input_ids, last_position, rows, *,
                       gather_windows: bool = False) -> dict[int, WindowKV | SequenceKV]:
        if hidden is None:
            raise ValueError(f"{self.name} needs features.hidden [B, T, 5, d] for layers {self.target_layer_ids}")
        B, T = hidden.shape[:2]
        positions = torch.arange(T, device=hidden.device).expand(B, T)
        out = {}
        for i, (k, v) in enumerate(self.context_kv(hidden, positions)):
            out[i] = self.sequence_context(k, v, last_position, rows, gather_windows=gather_windows)
        return out
