"""Hugging Face causal LM wrapped for speculative decoding and drafter training.

Layer-id convention: target layer id L means the output of decoder layer L (0-based), i.e. the
residual stream after layer L and before the final norm; Hugging Face's `output_hidden_states`
tuple holds it at index L + 1 (for L < num_layers - 1; HF applies the final norm to its last entry,
we never do).

Inference keeps the KV cache in a `RaggedKVCache`: preallocated storage [rows, kv_heads, capacity,
head_dim] per layer where row b holds its tokens at time index == absolute position, valid in
[0, lengths[b]). Requests of different lengths share one batch without holes, rollback after a
rejected draft is O(1) (`truncate` just lowers `lengths`; stale entries are masked, then
overwritten), and a drafter reads any layer's post-RoPE keys in place through a `TargetKVView`.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn
from transformers.cache_utils import Cache, CacheLayerMixin

from sglang_hspec.target.geometry import TargetGeometry
from sglang_hspec.target.hf_compat import cache_kwarg, call_with_cache, forward_with_kv
from sglang_hspec.target.kv_view import TargetKVView, window_indices


class _RaggedLayer(CacheLayerMixin):
    is_compileable = False
    is_croppable = False

    def __init__(self, owner: RaggedKVCache):
        super().__init__()
        self.owner = owner

    def lazy_initialization(self, key_states, value_states) -> None:  # storage is preallocated
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        return self.owner._write(self, key_states, value_states)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.capacity, 0

    def get_seq_length(self) -> int:
        return int(self.owner.lengths.max().item()) if self.owner.lengths.numel() else 0

    def get_max_length(self) -> int:
        return self.owner.capacity


class RaggedKVCache(Cache):
    """Per-row KV storage with per-row lengths (see module docstring)."""

    def __init__(self, *, num_layers: int, rows: int, num_kv_heads: int, head_dim: int, capacity: int,
                 dtype: torch.dtype, device: torch.device | str):
        layers = [_RaggedLayer(self) for _ in range(num_layers)]
        super().__init__(layers=layers)
        shape = (rows, num_kv_heads, capacity, head_dim)
        for layer in self.layers:
            layer.keys = torch.zeros(shape, dtype=dtype, device=device)
            layer.values = torch.zeros(shape, dtype=dtype, device=device)
            layer.is_initialized = True
        self.lengths = torch.zeros(rows, dtype=torch.long, device=device)
        self.capacity = capacity
        # set by TargetAdapter around each forward: which rows, at which time indices
        self._rows: torch.Tensor | None = None
        self._write_index: torch.Tensor | None = None
        self._read_len = 0
        self._writes = 0  # layer updates during the current forward (0 = the model ignored this cache)

    @property
    def rows(self) -> int:
        return self.lengths.shape[0]

    def ensure_capacity(self, needed: int) -> None:
        if needed <= self.capacity:
            return
        new_cap = max(needed, 2 * self.capacity)
        for layer in self.layers:
            for name in ("keys", "values"):
                old = getattr(layer, name)
                new = old.new_zeros((old.shape[0], old.shape[1], new_cap, old.shape[3]))
                new[:, :, : self.capacity] = old
                setattr(layer, name, new)
        self.capacity = new_cap

    def _write(self, layer: _RaggedLayer, key_states: torch.Tensor, value_states: torch.Tensor):
        rows, idx = self._rows, self._write_index
        self._writes += 1
        # storage[rows, :, idx] has shape [B, L, H, D]; the new states are [B, H, L, D]
        layer.keys[rows[:, None], :, idx] = key_states.transpose(1, 2).to(layer.keys.dtype)
        layer.values[rows[:, None], :, idx] = value_states.transpose(1, 2).to(layer.values.dtype)
        t = self._read_len
        if rows.numel() == self.rows and bool((rows == torch.arange(self.rows, device=rows.device)).all()):
            return layer.keys[:, :, :t], layer.values[:, :, :t]
        return layer.keys[rows, :, :t], layer.values[rows, :, :t]


@dataclass
class ExtendOutput:
    logits: torch.Tensor  # [B, L, V] float32 (rows padded past num_tokens hold garbage)
    hidden: torch.Tensor | None  # [B, L, n_ids, hidden] at the requested layer ids


@dataclass
class TargetFeatures:
    """Full-sequence target features for drafter training (one frozen forward)."""

    hidden: torch.Tensor  # [B, T, n_ids, hidden], ids in the order requested
    kv: dict[int, tuple[torch.Tensor, torch.Tensor]]  # layer id -> (K post-RoPE, V), [B, kv_heads, T, head_dim]
    final_hidden: torch.Tensor  # [B, T, hidden] after the final norm (logits = lm_head(final_hidden))
    logits: torch.Tensor | None = None  # [B, T, V] float32 when requested


class TargetAdapter:
    """A frozen Hugging Face causal LM (Llama / Qwen2 / Qwen3 families) for batches of sequences."""

    def __init__(self, model: nn.Module, *, tokenizer=None):
        self.model = model.eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.tokenizer = tokenizer
        self.config = model.config
        self.geometry = TargetGeometry.from_hf_config(model.config)
        if self.geometry.sliding_window is not None:
            raise ValueError(
                f"sliding-window targets are not supported by the reference engine (sliding_window="
                f"{self.geometry.sliding_window}); use a full-attention target"
            )
        self.decoder_layers = model.model.layers
        self.embed_tokens: nn.Embedding = model.get_input_embeddings()
        self.lm_head: nn.Linear = model.get_output_embeddings()
        self.cache: RaggedKVCache | None = None
        # looked up once (every decode step passes it); fails now on a model that takes no KV cache
        self._cache_arg = cache_kwarg(model)

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def num_layers(self) -> int:
        return self.geometry.num_hidden_layers

    @property
    def max_context(self) -> int:
        return self.geometry.max_position_embeddings

    def check_layer_ids(self, layer_ids) -> None:
        bad = [i for i in layer_ids if not 0 <= int(i) < self.num_layers]
        if bad:
            raise ValueError(
                f"target layer ids {bad} out of range: this target has {self.num_layers} decoder layers "
                f"(valid ids 0..{self.num_layers - 1}; id L = output of decoder layer L)"
            )

    @contextmanager
    def _capture_hidden(self, layer_ids):
        """Forward hooks storing decoder-layer outputs for the requested ids."""
        captured: dict[int, torch.Tensor] = {}
        handles = []
        for lid in dict.fromkeys(int(i) for i in layer_ids):
            def hook(_mod, _inp, out, lid=lid):
                captured[lid] = out[0] if isinstance(out, tuple) else out
            handles.append(self.decoder_layers[lid].register_forward_hook(hook))
        try:
            yield captured
        finally:
            for h in handles:
                h.remove()

    # ------------------------------------------------------------------ inference

    def reset(self, rows: int, *, capacity: int = 256) -> None:
        """Drop all cached state and allocate storage for `rows` sequences."""
        g = self.geometry
        self.cache = RaggedKVCache(num_layers=g.num_hidden_layers, rows=rows, num_kv_heads=g.num_key_value_heads,
                                   head_dim=g.head_dim, capacity=capacity, dtype=self.dtype, device=self.device)

    @property
    def lengths(self) -> torch.Tensor:
        """Committed KV length per row (positions 0..length-1 are valid)."""
        if self.cache is None:
            raise RuntimeError("call reset(rows) before using the KV cache")
        return self.cache.lengths

    @torch.no_grad()
    def extend(self, tokens: torch.Tensor, *, num_tokens: torch.Tensor | None = None,
               rows: torch.Tensor | None = None, hidden_layer_ids=(), commit: bool = True) -> ExtendOutput:
        """Run `tokens` [B, L] (right-padded; row b has num_tokens[b] real tokens) on top of each row's
        cache, at positions lengths[row] + 0..L-1. Writes their KV; with commit=True the rows' lengths
        grow by num_tokens (use `truncate` afterwards to keep only an accepted prefix)."""
        cache = self.cache
        if cache is None:
            raise RuntimeError("call reset(rows) before extend")
        tokens = tokens.to(self.device)
        b, length = tokens.shape
        if rows is None:
            rows = torch.arange(cache.rows, device=self.device)
        rows = rows.to(self.device)
        if rows.shape[0] != b:
            raise ValueError(f"tokens has {b} rows but {rows.shape[0]} cache rows were given")
        if num_tokens is None:
            num_tokens = torch.full((b,), length, dtype=torch.long, device=self.device)
        self.check_layer_ids(hidden_layer_ids)
        start = cache.lengths[rows]
        positions = start[:, None] + torch.arange(length, device=self.device)[None, :]
        end = int(positions.max().item()) + 1 if b else 0
        if end > self.max_context:
            raise ValueError(
                f"sequence would reach {end} tokens, beyond the target's context of {self.max_context}; "
                "shorten the prompt or lower max_new_tokens"
            )
        cache.ensure_capacity(end)
        # key column t is visible to the query at position p iff t <= p (own row's valid prefix + causal)
        cols = torch.arange(end, device=self.device)
        allowed = cols[None, None, :] <= positions[:, :, None]
        mask = torch.zeros(allowed.shape, dtype=self.dtype, device=self.device)
        mask.masked_fill_(~allowed, torch.finfo(self.dtype).min)
        cache._rows, cache._write_index, cache._read_len, cache._writes = rows, positions, end, 0
        try:
            with self._capture_hidden(hidden_layer_ids) as captured:
                out = call_with_cache(self.model, cache, cache_arg=self._cache_arg, input_ids=tokens,
                                      attention_mask=mask[:, None], position_ids=positions)
        finally:
            cache._rows = cache._write_index = None
        if cache._writes != self.num_layers:
            raise RuntimeError(
                f"the target wrote {cache._writes} of its {self.num_layers} layers' K/V into the ragged cache: "
                "its forward ignored the cache argument (see sglang_hspec.target.hf_compat)"
            )
        if commit:
            cache.lengths[rows] = start + num_tokens.to(self.device)
        hidden = None
        if len(hidden_layer_ids):
            hidden = torch.stack([captured[int(i)] for i in hidden_layer_ids], dim=2)
        return ExtendOutput(logits=out.logits.float(), hidden=hidden)

    def truncate(self, lengths: torch.Tensor, rows: torch.Tensor | None = None) -> None:
        """Roll rows back to `lengths` committed tokens (O(1): entries past the length are masked and
        later overwritten)."""
        cache = self.cache
        if rows is None:
            rows = torch.arange(cache.rows, device=self.device)
        lengths = lengths.to(self.device)
        if bool((lengths > cache.lengths[rows]).any()):
            raise ValueError("truncate can only shorten rows (a longer length has no cached KV)")
        cache.lengths[rows] = lengths

    def kv_view(self, layer_id: int, *, window: int, rows: torch.Tensor | None = None) -> TargetKVView:
        """Read-only window over layer `layer_id`'s cached K/V: positions max(0, n+1-W)..n for each row's
        last committed position n = lengths - 1. No copy of the cache is made."""
        self.check_layer_ids([layer_id])
        cache = self.cache
        if rows is None:
            rows = torch.arange(cache.rows, device=self.device)
        last = cache.lengths[rows] - 1
        if bool((last < 0).any()):
            raise ValueError("kv_view needs at least one committed token per row")
        w = max(1, min(int(window), int(last.max().item()) + 1))
        pos, valid = window_indices(last, w)
        layer = cache.layers[int(layer_id)]
        return TargetKVView(key=layer.keys, value=layer.values, token_index=pos, positions=pos, valid=valid,
                            layout="bhtd", row_index=rows)

    def kv_bytes_allocated(self) -> int:
        if self.cache is None:
            return 0
        return sum(layer.keys.numel() * layer.keys.element_size() * 2 for layer in self.cache.layers)

    # ------------------------------------------------------------------ training

    @torch.no_grad()
    def full_forward(self, input_ids: torch.Tensor, *, attention_mask: torch.Tensor | None = None,
                     hidden_layer_ids=(), kv_layer_ids=(), return_logits: bool = False) -> TargetFeatures:
        """One frozen forward over right-padded sequences [B, T]: hidden states at `hidden_layer_ids`,
        post-RoPE K/V of `kv_layer_ids`, final-norm hidden (and logits when asked)."""
        self.check_layer_ids(list(hidden_layer_ids) + list(kv_layer_ids))
        input_ids = input_ids.to(self.device)
        if attention_mask is not None:
            attention_mask = attention_mask.to(self.device)
        with self._capture_hidden(hidden_layer_ids) as captured:
            out, kv = forward_with_kv(self.model.model, kv_layer_ids=kv_layer_ids, input_ids=input_ids,
                                      attention_mask=attention_mask)
        hidden = torch.stack([captured[int(i)] for i in hidden_layer_ids], dim=2) if len(hidden_layer_ids) else None
        final = out.last_hidden_state
        logits = self.lm_head(final).float() if return_logits else None
        return TargetFeatures(hidden=hidden, kv=kv, final_hidden=final, logits=logits)
