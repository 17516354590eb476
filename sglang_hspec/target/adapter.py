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

Batch-invariant mode (`TargetAdapter(..., batch_invariant=True)`): the attention of every forward runs
through `batch_invariant_attention`, whose reductions are sequential left-to-right sums in fp32 per
query row, so a row's result does not depend on how many tokens share its forward or on how many
masked key columns follow its own. Hugging Face's SDPA path does: a one-token decode packs the GQA
groups into the query axis while an 8-token verify repeats K/V, and in bf16 the two differ by an
ulp often enough to flip a greedy near-tie. Linear layers are left as they are: see
`linear_rows_are_batch_invariant`; target/row_invariant.py pads the ones whose lone row takes another kernel
and keeps SDPA for prefills (docs/results.md, "bf16 greedy identity").
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from functools import cached_property

import torch
from torch import nn
from transformers.cache_utils import Cache, CacheLayerMixin

from sglang_hspec.target.geometry import TargetGeometry
from sglang_hspec.target.hf_compat import cache_kwarg, call_with_cache, forward_with_kv
from sglang_hspec.target.kv_view import TargetKVView, window_indices

BATCH_INVARIANT_ATTENTION = "hspec_batch_invariant"
# padded tokens per prefill forward (TargetAdapter.prefill): 32 MT-Bench prompts prefill in 5 s in groups
# of <= 1024 tokens on a 2-core CPU, 17 s in one forward
PREFILL_FORWARD_TOKENS = 1024
# KV storage is allocated in whole multiples of this many tokens (TargetAdapter.reset)
KV_CAPACITY_GRANULE = 64

_QUERY_CHUNK = 8  # queries per chunk: bounds the [chunk, keys, head_dim] products; rows are independent


@dataclass
class TreeKeyLayout:
    """Each tree node's keys in line, as a one-token decode at its position reads them: index [B, M, T] into
    the forward's key time axis (the row's committed prefix, then the node's ancestors and itself in depth
    order), valid [B, M, T] (False past them). Set by `TargetAdapter.extend_tree` on a row-invariant half-
    precision target for the length of its forward, read by target/row_invariant.py's attention."""

    index: torch.Tensor
    valid: torch.Tensor
    # [B, M]: nodes whose ancestors do not already sit in line at time prefix + 0, 1, ... (the chain from the
    # root at node indices 0, 1, 2, ... does; its rows in the tree's own layout are a verify's rows)
    gathered: torch.Tensor

    @cached_property
    def gathered_nodes(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows, nodes) of `gathered`, found once per forward rather than once per layer."""
        return self.gathered.nonzero(as_tuple=True)


TREE_KEY_LAYOUT: list[TreeKeyLayout] = []  # the active layout (at most one), set around a tree forward


def tree_key_layout(parents: torch.Tensor, depth: torch.Tensor, start: torch.Tensor) -> TreeKeyLayout:
    """TreeKeyLayout of trees parents / depth [B, M] whose rows' prefixes hold `start` [B] keys and whose node
    i sits at time index start + i: node i's line is [0, start) then start + (its ancestor at depth 0, 1, ...,
    itself)."""
    b, m = parents.shape
    top = int(depth.max()) + 1 if m else 1
    at_depth = torch.zeros((b, m, top), dtype=torch.long, device=parents.device)  # ancestor node per depth
    batch = torch.arange(b, device=parents.device)
    for i in range(m):
        at_depth[:, i] = at_depth[batch, parents[:, i].clamp_min(0)]
        at_depth[batch, i, depth[:, i]] = i
    width = int(start.max()) + top if b else top
    j = torch.arange(width, device=parents.device)[None, None, :]
    s = start[:, None, None]
    k = (j - s).clamp(0, top - 1)
    index = torch.where(j < s, j, s + at_depth.gather(2, k.expand(b, m, width)))
    valid = j <= s + depth[:, :, None]
    levels = torch.arange(top, device=parents.device)
    in_line = ((at_depth == levels) | (levels > depth[:, :, None])).all(-1)
    return TreeKeyLayout(index=torch.where(valid, index, torch.zeros_like(index)), valid=valid, gathered=~in_line)


def _sequential_sum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Sum over `dim` in a fixed left-to-right order (a CPU cumsum is a sequential scan per line), so a
    value's partial sums never depend on the length of the line past it or on the other lines."""
    return x.cumsum(dim).select(dim, -1)


def batch_invariant_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                              attention_mask: torch.Tensor | None, scaling: float | None = None,
                              dropout: float = 0.0, **kwargs) -> tuple[torch.Tensor, None]:
    """Attention with Hugging Face's attention-function signature (query [B, H, L, D], key / value
    [B, kv_heads, T, D], additive or boolean mask [B, 1, L, T]) whose result for one query row is the same
    whatever L and T are: scores, softmax denominator and the weighted sum of V are fp32 sequential
    sums; masked keys get probability exactly 0 and so add exactly 0. Returns [B, L, H, D] in the
    query's dtype. Slower than SDPA (elementwise products instead of GEMMs): a correctness mode."""
    if kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None or kwargs.get("sliding_window"):
        raise ValueError("batch-invariant attention supports plain softmax attention only (no softcap, attention "
                         "sinks or sliding window): load the target without batch_invariant")
    if dropout:
        raise ValueError("batch-invariant attention is an inference mode: dropout must be 0")
    b, h, length, d = query.shape
    groups = h // key.shape[1]
    acc = torch.promote_types(query.dtype, torch.float32)  # fp32, or fp64 for a float64 model
    k = key.to(acc).repeat_interleave(groups, dim=1)[:, :, None]  # [B, H, 1, T, D]
    v = value.to(acc).repeat_interleave(groups, dim=1)[:, :, None]
    scale = d ** -0.5 if scaling is None else scaling
    t = k.shape[3]
    if attention_mask is None and length > 1 and kwargs.get("is_causal", getattr(module, "is_causal", True)):
        # HF skips the mask of a purely causal forward (SDPA's is_causal): queries are the last `length` keys
        attention_mask = (torch.arange(t, device=query.device)[None, :]
                          <= torch.arange(t - length, t, device=query.device)[:, None])[None, None]
    out = query.new_empty((b, length, h, d))
    for lo in range(0, length, _QUERY_CHUNK):
        q = query[:, :, lo:lo + _QUERY_CHUNK].to(acc)
        scores = _sequential_sum(q[:, :, :, None, :] * k, dim=-1) * scale  # [B, H, l, T]
        if attention_mask is not None:
            m = attention_mask[:, :, lo:lo + _QUERY_CHUNK, :t]
            scores = scores.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else scores + m.to(acc)
        probs = torch.exp(scores - scores.amax(dim=-1, keepdim=True))
        denom = _sequential_sum(probs, dim=-1)
        weighted = _sequential_sum(probs[..., None] * v, dim=3)  # [B, H, l, D]
        out[:, lo:lo + _QUERY_CHUNK] = (weighted / denom[..., None]).transpose(1, 2).to(query.dtype)
    return out, None


def _register_batch_invariant_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(BATCH_INVARIANT_ATTENTION, batch_invariant_attention)
    # masks HF builds itself (training's 2-D padding masks) come in SDPA's boolean form, which it reads
    AttentionMaskInterface.register(BATCH_INVARIANT_ATTENTION, sdpa_mask)


# SmolLM2-135M's projections: q and o, k and v, the MLP's gate / up and its down, the LM head
TARGET_LINEAR_SHAPES = ((576, 576), (576, 192), (576, 1536), (1536, 576), (576, 49152))


@torch.no_grad()
def cancelling_inputs(in_features: int, out_features: int, rows: int, *, dtype, device, generator: torch.Generator):
    """x [rows, in], w [out, in] whose paired columns carry large exactly-cancelling products (x, x against w, -w,
    64 times larger than the rest): the product is the small terms' sum, so any other summation order leaves a
    residue of many ulps, where a random input would hide it."""
    pairs = in_features // 4
    big_x = torch.randn(rows, pairs, generator=generator) * 64
    big_w = torch.randn(out_features, pairs, generator=generator) * 64
    small_x = torch.randn(rows, in_features - 2 * pairs, generator=generator)
    small_w = torch.randn(out_features, in_features - 2 * pairs, generator=generator)
    x = torch.cat([big_x, small_x, big_x], 1).to(device=device, dtype=dtype)
    w = torch.cat([big_w, small_w, -big_w], 1).to(device=device, dtype=dtype)
    return x, w


def linear_rows_are_batch_invariant(*, dtype: torch.dtype, shapes: tuple[tuple[int, int], ...] = TARGET_LINEAR_SHAPES,
                                    rows: tuple[int, ...] = (2, 8, 9, 33), device: str | torch.device = "cpu",
                                    seed: int = 0) -> bool:
    """Whether this machine's `F.linear` gives every row the same bits whether it runs alone or among other rows
    (M = 1 against each of `rows`), for every (in_features, out_features) in `shapes`: the property the
    batch-invariant mode relies on for the linear layers and leaves to the GEMM library.

    Random inputs hide a different accumulation order: its fp32 rounding residue seldom moves a bf16 result by
    an ulp (the embedded target's 1536 -> 576 down projection passed such a probe on a Zen 5 EPYC and still
    gave 2 of 8 verify rows other bits than one-token decodes). So half of the input columns come in pairs whose
    products cancel exactly (x, x against w, -w, 64 times larger than the rest): the result is the small terms'
    sum, and any other order leaves a residue of the large partial sums' rounding, many ulps of it."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    m = max(rows)
    for in_features, out_features in shapes:
        x, weight = cancelling_inputs(in_features, out_features, m, dtype=dtype, device=device, generator=gen)
        alone = torch.cat([torch.nn.functional.linear(x[r:r + 1], weight) for r in range(m)])
        if not all(torch.equal(torch.nn.functional.linear(x[:n], weight), alone[:n]) for n in rows):
            return False
    return True


def linear_shapes(model: nn.Module) -> tuple[tuple[int, int], ...]:
    """The distinct (in_features, out_features) of a model's linear layers, in the order they appear."""
    return tuple(dict.fromkeys((m.in_features, m.out_features) for m in model.modules() if isinstance(m, nn.Linear)))


def consecutive_span(rows: torch.Tensor) -> tuple[int, int] | None:
    """(lo, hi) when `rows` is lo, lo + 1, ..., hi - 1 (the forward may read the cache rows as a view), else None."""
    n = rows.numel()
    if n == 0:
        return None
    lo = int(rows[0])
    return (lo, lo + n) if bool((rows == torch.arange(lo, lo + n, device=rows.device)).all()) else None


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
                 dtype: torch.dtype, device: torch.device | str,
                 storage: list[tuple[torch.Tensor, torch.Tensor]] | None = None):
        """`storage`: per layer (keys, values) [rows, kv_heads, capacity, head_dim] to use as they are
        (`first_rows`); zeros are allocated without it."""
        layers = [_RaggedLayer(self) for _ in range(num_layers)]
        super().__init__(layers=layers)
        shape = (rows, num_kv_heads, capacity, head_dim)
        for i, layer in enumerate(self.layers):
            if storage is None:
                layer.keys = torch.zeros(shape, dtype=dtype, device=device)
                layer.values = torch.zeros(shape, dtype=dtype, device=device)
            else:
                layer.keys, layer.values = storage[i]
            layer.is_initialized = True
        self.lengths = torch.zeros(rows, dtype=torch.long, device=device)
        self.capacity = capacity
        # set by TargetAdapter around each forward: which rows, at which time indices
        self._rows: torch.Tensor | None = None
        self._write_index: torch.Tensor | None = None
        self._read_len = 0
        self._writes = 0  # layer updates during the current forward (0 = the model ignored this cache)
        self._row_span: tuple[int, int] | None = None  # (lo, hi) when the forward's rows are lo..hi-1 in order

    @property
    def rows(self) -> int:
        return self.lengths.shape[0]

    def first_rows(self, rows: int) -> RaggedKVCache:
        """A cache over the first `rows` rows of this one's storage (views), every length 0."""
        keys = self.layers[0].keys
        return RaggedKVCache(num_layers=len(self.layers), rows=rows, num_kv_heads=keys.shape[1],
                             head_dim=keys.shape[3], capacity=self.capacity, dtype=keys.dtype, device=keys.device,
                             storage=[(layer.keys[:rows], layer.values[:rows]) for layer in self.layers])

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
        span = self._row_span
        if span is not None:  # consecutive rows: a view, no copy
            return layer.keys[span[0]:span[1], :, :t], layer.values[span[0]:span[1], :, :t]
        # any other subset is gathered: a copy of every layer's K/V per forward (+50 % on a 32-row decode step)
        return layer.keys[rows, :, :t], layer.values[rows, :, :t]


@dataclass
class ExtendOutput:
    logits: torch.Tensor  # [B, L, V] float32 (rows padded past num_tokens hold garbage); [B, 1, V]: last_logits_only
    hidden: torch.Tensor | None  # [B, L, n_ids, hidden] at the requested layer ids


@dataclass
class TargetFeatures:
    """Full-sequence target features for drafter training (one frozen forward)."""

    hidden: torch.Tensor  # [B, T, n_ids, hidden], ids in the order requested
    kv: dict[int, tuple[torch.Tensor, torch.Tensor]]  # layer id -> (K post-RoPE, V), [B, kv_heads, T, head_dim]
    final_hidden: torch.Tensor  # [B, T, hidden] after the final norm (logits = lm_head(final_hidden))
    logits: torch.Tensor | None = None  # [B, T, V] float32 when requested
    # [B, T] float32 log of each position's softmax normaliser over the full vocabulary, read back from the
    # feature cache (training.cached_log_partition): the draft-vocabulary probabilities then need only the
    # draft rows of the LM head
    log_partition: torch.Tensor | None = None


class TargetAdapter:
    """A frozen Hugging Face causal LM (Llama / Qwen2 / Qwen3 families) for batches of sequences."""

    def __init__(self, model: nn.Module, *, tokenizer=None, batch_invariant: bool = False):
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
        self.batch_invariant = bool(batch_invariant)
        # set by target/row_invariant.make_row_invariant: whether a verify now matches one-token decodes bit for bit
        self.row_invariant: bool | None = None
        if self.batch_invariant:  # the model object itself switches: every forward of it, ours or not
            _register_batch_invariant_attention()
            model.set_attn_implementation(BATCH_INVARIANT_ATTENTION)

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
        """Drop all cached state and hold storage for `rows` sequences of up to `capacity` tokens.

        The previous storage is reused when it is large enough (its first `rows` rows, a view): every
        entry in it is zero or a K/V the model wrote, finite either way, and entries past a row's length
        are masked. Allocating it afresh (32 rows x 316 tokens x 30 layers: 466 MB of zeros) cost 0.2-1.4 s
        of page faults per generate call on a 2-core CPU, as much as 9 decode steps.

        New storage holds `capacity` rounded up to a multiple of KV_CAPACITY_GRANULE tokens, so calls
        that differ by a few tokens (a drafter's block of headroom, plain decoding's none) share it."""
        old = self.cache
        if old is not None and old.rows >= rows and old.capacity >= capacity:
            self.cache = old.first_rows(rows)
            return
        self.cache = None  # free the old storage before allocating the new
        g = self.geometry
        capacity = -(-capacity // KV_CAPACITY_GRANULE) * KV_CAPACITY_GRANULE
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
               rows: torch.Tensor | None = None, hidden_layer_ids=(), commit: bool = True,
               last_logits_only: bool = False) -> ExtendOutput:
        """Run `tokens` [B, L] (right-padded; row b has num_tokens[b] real tokens) on top of each row's
        cache, at positions lengths[row] + 0..L-1. Writes their KV; with commit=True the rows' lengths
        grow by num_tokens (use `truncate` afterwards to keep only an accepted prefix).

        `last_logits_only`: logits [B, 1, V] at each row's last real token only. A prefill needs no
        more, and projecting every padded position onto the vocabulary is most of its cost (32 prompts
        x 256 tokens: 1.6 GB of fp32 logits)."""
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
        keep = {}
        if last_logits_only:
            # HF's logits_to_keep takes one index set for all rows: the distinct last positions
            kept_positions, kept_of_row = torch.unique(num_tokens.to(self.device) - 1, return_inverse=True)
            keep = {"logits_to_keep": kept_positions}
        cache._rows, cache._write_index, cache._read_len, cache._writes = rows, positions, end, 0
        cache._row_span = consecutive_span(rows)
        try:
            with self._capture_hidden(hidden_layer_ids) as captured:
                out = call_with_cache(self.model, cache, cache_arg=self._cache_arg, input_ids=tokens,
                                      attention_mask=mask[:, None], position_ids=positions, **keep)
        finally:
            cache._rows = cache._write_index = cache._row_span = None
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
        logits = out.logits
        if last_logits_only:
            logits = logits[torch.arange(b, device=self.device), kept_of_row][:, None]
        return ExtendOutput(logits=logits.float(), hidden=hidden)

    @torch.no_grad()
    def prefill(self, prompts: list[list[int]], *, rows: torch.Tensor | None = None, hidden_layer_ids=(),
                last_hidden_only: bool = False, max_forward_tokens: int = PREFILL_FORWARD_TOKENS) -> ExtendOutput:
        """Extend each row by its whole prompt, in forwards of consecutive rows holding at most
        `max_forward_tokens` padded tokens each (one row per forward when a prompt alone is longer),
        every group padded only to its own longest prompt.

        One padded forward over every prompt costs 3x more on a 2-core CPU (32 MT-Bench prompts: 17 s
        against 5 s in groups of <= 1024 tokens): its activations are tens of MB per layer, which the
        allocator maps fresh and the kernel faults in page by page (a third of the CPU time in sys),
        and short prompts pay for the longest one's padding.

        Returns logits [B, 1, V] at each prompt's last token and, for `hidden_layer_ids`, hidden
        states [B, longest prompt, n_ids, hidden] (meaningless past a row's prompt), or [B, 1, n_ids,
        hidden] at each prompt's last token with `last_hidden_only` (all a drafter without a drafter-side
        cache reads)."""
        if max_forward_tokens < 1:
            raise ValueError(f"max_forward_tokens must be >= 1, got {max_forward_tokens}")
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("prefill needs at least one prompt, each of at least one token")
        n = len(prompts)
        if rows is None:
            rows = torch.arange(n, device=self.device)
        if rows.shape[0] != n:
            raise ValueError(f"{n} prompts but {rows.shape[0]} cache rows were given")
        lengths = [len(p) for p in prompts]
        logits, hidden = [], None
        start = 0
        while start < n:
            end, longest = start + 1, lengths[start]
            while end < n and (end + 1 - start) * max(longest, lengths[end]) <= max_forward_tokens:
                longest = max(longest, lengths[end])
                end += 1
            tokens = torch.zeros((end - start, longest), dtype=torch.long)
            for j in range(start, end):
                tokens[j - start, : lengths[j]] = torch.tensor(prompts[j], dtype=torch.long)
            out = self.extend(tokens, num_tokens=torch.tensor(lengths[start:end], device=self.device),
                              rows=rows[start:end], hidden_layer_ids=hidden_layer_ids, last_logits_only=True)
            logits.append(out.logits)
            if out.hidden is not None:
                if hidden is None:
                    width = 1 if last_hidden_only else max(lengths)
                    hidden = out.hidden.new_zeros((n, width, *out.hidden.shape[2:]))
                if last_hidden_only:
                    last = torch.tensor(lengths[start:end], device=self.device) - 1
                    hidden[start:end, 0] = out.hidden[torch.arange(end - start, device=self.device), last]
                else:
                    hidden[start:end, :longest] = out.hidden
            start = end
        return ExtendOutput(logits=torch.cat(logits), hidden=hidden)

    # ------------------------------------------------------------------ tree verify

    @torch.no_grad()
    def extend_tree(self, tokens: torch.Tensor, *, parents: torch.Tensor, rows: torch.Tensor | None = None,
                    hidden_layer_ids=()) -> ExtendOutput:
        """Run one token tree per row [B, M] on top of each row's cache in one forward; commits nothing.

        parents [B, M]: node i's parent node (0 <= parents[b, i] < i), -1 for a root. Node 0 is the root
        (the anchor); a row with fewer nodes pads with roots (-1), which see only the prefix and themselves.
        Node i of row b (prefix length s = lengths[row]) sits at position s + depth(i), writes its K/V at
        time index s + i, and attends to the committed prefix [0, s) and to its own ancestors and itself,
        so its logits are those of a chain forward of its root-to-node path. `commit_path` then keeps one
        root-to-node path per row. Returns logits [B, M, V] and hidden states [B, M, n_ids, hidden]."""
        cache = self.cache
        if cache is None:
            raise RuntimeError("call reset(rows) before extend_tree")
        tokens, parents = tokens.to(self.device), parents.to(self.device)
        b, m = tokens.shape
        if parents.shape != tokens.shape:
            raise ValueError(f"parents {tuple(parents.shape)} must have the shape of tokens {tuple(tokens.shape)}")
        node = torch.arange(m, device=self.device)
        if m and (bool((parents[:, 0] != -1).any()) or bool(((parents >= node) | (parents < -1)).any())):
            raise ValueError("extend_tree needs parents[:, 0] == -1 and -1 <= parents[b, i] < i (nodes in "
                             "topological order, node 0 the root)")
        if rows is None:
            rows = torch.arange(cache.rows, device=self.device)
        rows = rows.to(self.device)
        if rows.shape[0] != b:
            raise ValueError(f"tokens has {b} rows but {rows.shape[0]} cache rows were given")
        self.check_layer_ids(hidden_layer_ids)
        # depth and ancestor-or-self sets, node by node (a parent precedes its children)
        depth = torch.zeros((b, m), dtype=torch.long, device=self.device)
        ancestors = torch.zeros((b, m, m), dtype=torch.bool, device=self.device)
        batch = torch.arange(b, device=self.device)
        for i in range(m):
            par = parents[:, i]
            has = par >= 0
            pi = par.clamp_min(0)
            depth[:, i] = torch.where(has, depth[batch, pi] + 1, 0)
            ancestors[:, i] = ancestors[batch, pi] & has[:, None]
            ancestors[:, i, i] = True
        start = cache.lengths[rows]
        positions = start[:, None] + depth
        write_index = start[:, None] + node[None, :]
        end = int(write_index.max().item()) + 1 if b and m else 0
        if b and m and int(positions.max().item()) + 1 > self.max_context:
            raise ValueError(f"the tree would reach position {int(positions.max())}, beyond the target's context "
                             f"of {self.max_context}; shorten the prompt or lower max_new_tokens")
        cache.ensure_capacity(end)
        cols = torch.arange(end, device=self.device)
        rel = cols[None, :] - start[:, None]  # [B, T]: key column's node index within the row's tree
        in_tree = (rel >= 0) & (rel < m)
        tree_seen = ancestors.gather(2, rel.clamp(0, max(m - 1, 0))[:, None, :].expand(b, m, end))
        allowed = (rel < 0)[:, None, :] | (in_tree[:, None, :] & tree_seen)
        mask = torch.zeros(allowed.shape, dtype=self.dtype, device=self.device)
        mask.masked_fill_(~allowed, torch.finfo(self.dtype).min)
        cache._rows, cache._write_index, cache._read_len, cache._writes = rows, write_index, end, 0
        cache._row_span = consecutive_span(rows)
        in_line = self.row_invariant and self.dtype in (torch.bfloat16, torch.float16)
        if in_line:  # half precision: each node's attention reads its keys in a decode's order (TreeKeyLayout)
            TREE_KEY_LAYOUT.append(tree_key_layout(parents, depth, start))
        try:
            with self._capture_hidden(hidden_layer_ids) as captured:
                out = call_with_cache(self.model, cache, cache_arg=self._cache_arg, input_ids=tokens,
                                      attention_mask=mask[:, None], position_ids=positions)
        finally:
            cache._rows = cache._write_index = cache._row_span = None
            if in_line:
                TREE_KEY_LAYOUT.pop()
        if cache._writes != self.num_layers:
            raise RuntimeError(
                f"the target wrote {cache._writes} of its {self.num_layers} layers' K/V into the ragged cache: "
                "its forward ignored the cache argument (see sglang_hspec.target.hf_compat)"
            )
        hidden = None
        if len(hidden_layer_ids):
            hidden = torch.stack([captured[int(i)] for i in hidden_layer_ids], dim=2)
        return ExtendOutput(logits=out.logits.float(), hidden=hidden)

    @torch.no_grad()
    def commit_path(self, path: torch.Tensor, *, path_lengths: torch.Tensor, rows: torch.Tensor | None = None) -> None:
        """After `extend_tree`: keep each row's accepted root-to-node path and drop the rest of its tree.

        path [B, A]: row b's first path_lengths[b] entries are the node indices of its path from the root
        (path[b, 0] == 0, each the parent of the next). Node path[b, t] sits at position s + t, so its K/V
        (written at time index s + path[b, t]) is copied to time index s + t: O(accepted) copies per layer,
        only where a node is not already in place; the row's length becomes s + path_lengths[b]. The cache
        then holds what a chain extend of the path would have written."""
        cache = self.cache
        if rows is None:
            rows = torch.arange(cache.rows, device=self.device)
        rows, path, path_lengths = rows.to(self.device), path.to(self.device), path_lengths.to(self.device)
        b, a = path.shape
        if b != rows.shape[0] or path_lengths.shape != (b,):
            raise ValueError(f"path {tuple(path.shape)}, path_lengths {tuple(path_lengths.shape)} and rows "
                             f"{tuple(rows.shape)} must agree on the batch")
        slot = torch.arange(a, device=self.device)[None, :]
        valid = slot < path_lengths[:, None]
        if bool((path_lengths < 1).any()) or bool((path[:, 0] != 0).any()) or bool((valid & (path < slot)).any()):
            raise ValueError("commit_path needs every path to start at the root (node 0) and hold >= 1 node, "
                             "node indices non-decreasing in depth (path[b, t] >= t)")
        start = cache.lengths[rows]
        moved = valid & (path != slot)
        if bool(moved.any()):
            r, t = moved.nonzero(as_tuple=True)
            src, dst = start[r] + path[r, t], start[r] + t
            for layer in cache.layers:
                # the sources are read before any write (advanced indexing copies); a source never lies below
                # another moved node's destination, so the order does not matter
                layer.keys[rows[r], :, dst] = layer.keys[rows[r], :, src]
                layer.values[rows[r], :, dst] = layer.values[rows[r], :, src]
        cache.lengths[rows] = start + path_lengths

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
