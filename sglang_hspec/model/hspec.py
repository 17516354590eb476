"""H-Spec block drafter: hybrid Mamba-2 / attention, no drafter-side KV cache.

One forward drafts a block of k tokens: the input is the anchor (the target's last sampled token, at
position n+1) followed by k-1 mask tokens; slot j predicts the token at n+2+j.
- Mamba-2 layers start their scan from a state projected from the target hidden states of 5 layers at
  position n (one projection shared by all layers, computed once per forward).
- Attention layers read the target's own post-RoPE K/V of one mapped target layer in place (positions
  max(0, n+1-W)..n) plus the block's own keys causally, in one SDPA call; heads, head_dim and RoPE
  are the target's, with continued position ids n+1..n+k.
- 4 pre-norm residual layers: 3 x (Mamba2 > attention > MLP) + 1 x (Mamba2 > MLP); then the target's
  frozen LM head restricted to the draft vocabulary, a low-rank Markov bias on the previous token
  and a confidence head.

The same classes build the ablations (`hspec_kv_only`, `hspec_last_token_only`); dflash.py subclasses
`DraftModel` for the DFlash family. Target embedding and LM head are shared, frozen and never saved.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from sglang_hspec.core.sampling import sample_from, sampling_probs
from sglang_hspec.core.types import DraftContext, DraftProposal, SamplingParams
from sglang_hspec.kernels import PagedKVWindow, paged_block_attention
from sglang_hspec.model.config import HSpecConfig
from sglang_hspec.model.ssd import mamba_block
from sglang_hspec.target.kv_view import TargetKVView, dense_window_view


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)  # float64 stays float64 (oracle tests)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.to(_compute_dtype(x.dtype))
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.to(xf.dtype)).to(x.dtype)


# ---------------------------------------------------------------- RoPE (the target's, continued)
def rope_inv_freq(head_dim: int, theta: float, scaling: dict) -> torch.Tensor:
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv
    if kind == "linear":
        return inv / scaling["factor"]
    if kind == "llama3":  # Llama-3.1's frequency-dependent interpolation
        factor, lo, hi = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old / lo, inv / factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old / hi) & (wavelen <= old / lo)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(
        f"RoPE type {kind!r} is not supported by the drafter (supported: default, linear, llama3); "
        "the drafter must rotate queries exactly as the target rotated its cached keys"
    )


def apply_rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """x [N, heads, L, D], positions [N, L] (HF rotate-half layout); inv_freq float64 on x's device (the
    drafter's buffer: no copy here, so a CUDA graph can capture it)."""
    ang = positions.to(inv_freq.dtype)[..., None] * inv_freq
    ang = torch.cat([ang, ang], dim=-1)[:, None]  # [N, 1, L, D]
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


# ---------------------------------------------------------------- layers
class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Mamba2(nn.Module):
    """Mamba-2 mixer over a block, from a given initial SSM state (conv left context is zero)."""

    def __init__(self, cfg: HSpecConfig):
        super().__init__()
        d, h, p = cfg.hidden_size, cfg.mamba_num_heads, cfg.mamba_head_dim
        self.nheads, self.headdim, self.ngroups, self.dstate = h, p, cfg.mamba_groups, cfg.mamba_state_dim
        self.d_inner = h * p
        self.conv_dim = self.d_inner + 2 * self.ngroups * self.dstate
        self.chunk_size = cfg.mamba_chunk_size
        self.in_proj = nn.Linear(d, 2 * self.d_inner + 2 * self.ngroups * self.dstate + h, bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, cfg.mamba_conv_kernel, groups=self.conv_dim,
                                padding=cfg.mamba_conv_kernel - 1)
        # HF/mamba_ssm init: A = -(1..h), D = 1, dt_bias = softplus^-1(log-uniform dt in [dt_min, dt_max])
        self.A_log = nn.Parameter(torch.log(torch.arange(1, h + 1, dtype=torch.float32)))
        self.D = nn.Parameter(torch.ones(h))
        dt = torch.exp(torch.rand(h) * (math.log(cfg.mamba_dt_max) - math.log(cfg.mamba_dt_min))
                       + math.log(cfg.mamba_dt_min))
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))
        self.norm = nn.Parameter(torch.ones(self.d_inner))  # gated RMSNorm weight
        self.out_proj = nn.Linear(self.d_inner, d, bias=False)

    def split(self, u: torch.Tensor):
        """in_proj + causal depthwise conv + SiLU -> z, x [b,L,h,p], B, C [b,L,g,n], raw dt [b,L,h]."""
        b, L, _ = u.shape
        z, xbc, dt = torch.split(self.in_proj(u), [self.d_inner, self.conv_dim, self.nheads], dim=-1)
        xbc = F.silu(self.causal_conv(xbc))
        x, B, C = torch.split(xbc, [self.d_inner, self.ngroups * self.dstate, self.ngroups * self.dstate], dim=-1)
        return (z, x.reshape(b, L, self.nheads, self.headdim), B.reshape(b, L, self.ngroups, self.dstate),
                C.reshape(b, L, self.ngroups, self.dstate), dt)

    def causal_conv(self, xbc: torch.Tensor) -> torch.Tensor:
        """The depthwise causal conv1d over [b, L, C] (zero left context) as K shifted multiply-adds in
        the channels-last layout: the same sum as `self.conv1d`, without its transposes, and its
        backward is elementwise (a depthwise Conv1d backward cost a fifth of a CPU training step)."""
        w, K, L = self.conv1d.weight[:, 0], self.conv1d.kernel_size[0], xbc.shape[1]
        padded = F.pad(xbc, (0, 0, K - 1, 0))
        out = padded[:, K - 1:K - 1 + L] * w[:, K - 1].to(xbc.dtype)
        for i in range(K - 1):
            out = out + padded[:, i:i + L] * w[:, i].to(xbc.dtype)
        return out if self.conv1d.bias is None else out + self.conv1d.bias.to(xbc.dtype)

    def gated_norm_out(self, y: torch.Tensor, z: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
        # Mamba2's rule: RMSNorm(y * silu(z)) per group (norm_before_gate=False), eps 1e-5
        b, L = y.shape[:2]
        g = (y.reshape(b, L, -1) * F.silu(z)).to(_compute_dtype(y.dtype))
        g = g.reshape(b, L, self.ngroups, -1)
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + eps)
        g = g.reshape(b, L, -1) * self.norm.to(g.dtype)
        return self.out_proj(g.to(z.dtype))

    def forward(self, u: torch.Tensor, initial_state: torch.Tensor, *,
                final_state: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Mixer output and the final SSM state (None from SGLang's serving kernel, which returns none, and
        where `final_state` is False)."""
        z, x, B, C, dt = self.split(u)
        A = -torch.exp(self.A_log.float() if u.dtype != torch.float64 else self.A_log)
        y, final = mamba_block(x, dt, A, B, C, self.D, self.dt_bias, initial_state, chunk_size=self.chunk_size,
                               final_state=final_state)
        return self.gated_norm_out(y, z), final


@dataclass
class WindowKV:
    """Context K/V for one attention layer, gathered from a TargetKVView: [N, kv, W, D] + mask [N, W]."""

    key: torch.Tensor
    value: torch.Tensor
    mask: torch.Tensor


@dataclass
class SequenceKV:
    """Context K/V for one attention layer in training: every sequence's whole K/V [B, kv, T, D] (time
    index == position), read by block rows `rows` [N] (their sequence) whose last committed position is
    `last_position` [N]; a row sees the keys at positions in (n - window, n]. Nothing is gathered per
    block: `sequence_block_attention` reads each sequence's keys once for all its blocks."""

    key: torch.Tensor
    value: torch.Tensor
    rows: torch.Tensor
    last_position: torch.Tensor
    window: int


def sequence_block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context: SequenceKV, *,
                             causal: bool) -> torch.Tensor:
    """Softmax attention of block queries q [N, nh, L, D] over [its sequence's context window ; the block's
    own keys k, v [N, nkv, L, D]] (GQA as SDPA's enable_gqa), the same function as the gathered-window SDPA
    path. The blocks are laid out per sequence, padded to the longest [B, A, ...], so the context scores
    are one batched matmul against each sequence's K; the two key sets share one softmax (a common row
    max, one denominator). Returns [N, nh, L, D]."""
    N, nh, L, D = q.shape
    B, nkv, T, _ = context.key.shape
    g = nh // nkv
    rows, n = context.rows, context.last_position
    counts = torch.bincount(rows, minlength=B)
    A = int(counts.max()) if N else 0
    order = torch.argsort(rows, stable=True)
    starts = torch.cumsum(counts, 0) - counts
    slot = torch.empty_like(rows)
    slot[order] = torch.arange(N, device=rows.device) - starts[rows[order]]
    # [B, A, ...] padded layout; padded blocks have last position -1 (no context) and zero queries
    qp = q.new_zeros(B, A, nh, L, D).index_put((rows, slot), q)
    kp = k.new_zeros(B, A, nkv, L, D).index_put((rows, slot), k)
    vp = v.new_zeros(B, A, nkv, L, D).index_put((rows, slot), v)
    n_pad = n.new_full((B, A), -1).index_put((rows, slot), n)
    out = _block_attention_core(qp.view(B, A, nkv, g, L, D), context.key, context.value, kp, vp, n_pad,
                                context.window, causal)
    # back to [N, nh, L, D]
    return out.permute(0, 3, 1, 2, 4, 5).reshape(B, A, nh, L, D)[rows, slot]


def block_attention_core(qg: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kp: torch.Tensor,
                         vp: torch.Tensor, n_pad: torch.Tensor, window: int, causal: bool) -> torch.Tensor:
    """The shape-stable, elementwise-heavy part of `sequence_block_attention`: queries qg [B, A, nkv, g, L, D]
    against each sequence's K/V [B, nkv, T, D] (window (n - window, n] of n_pad [B, A]) and the blocks' own
    kp/vp [B, A, nkv, L, D], one softmax. Returns [B, nkv, g, A, L, D]."""
    B, A, nkv, g, L, D = qg.shape
    T = key.shape[2]
    dtype = qg.dtype
    qg = qg * D ** -0.5
    # context part: [B, nkv, g, A, L, T]
    s_ctx = torch.einsum("baKgld,bKtd->bKgalt", qg, key.to(dtype)).float()
    t = torch.arange(T, device=qg.device)
    seen = (t <= n_pad[..., None]) & (t > n_pad[..., None] - window)  # [B, A, T]
    s_ctx = s_ctx.masked_fill(~seen[:, None, None, :, None, :], float("-inf"))
    # block part: [B, nkv, g, A, L, L]
    s_blk = torch.einsum("baKgld,baKsd->bKgals", qg, kp).float()
    if causal:
        s_blk = s_blk.masked_fill(~torch.ones(L, L, dtype=torch.bool, device=qg.device).tril(), float("-inf"))
    top = torch.maximum(s_ctx.amax(-1, keepdim=True), s_blk.amax(-1, keepdim=True)).detach()
    p_ctx, p_blk = torch.exp(s_ctx - top), torch.exp(s_blk - top)
    denom = p_ctx.sum(-1, keepdim=True) + p_blk.sum(-1, keepdim=True)
    return (torch.einsum("bKgalt,bKtd->bKgald", p_ctx.to(dtype), value.to(dtype))
            + torch.einsum("bKgals,baKsd->bKgald", p_blk.to(dtype), vp)) / denom.to(dtype)


_block_attention_core = block_attention_core  # torch.compile'd by `compile_training_kernels`


def compile_training_kernels(backend: str | None = "inductor") -> None:
    """`training.compile`: run the training forward's elementwise-heavy cores (`block_attention_core` here,
    the loss's per-row terms in training/losses.py) under torch.compile with dynamic shapes (blocks and
    sequence length change every step), process-wide; backend None restores eager. Only these shape-stable
    functions are compiled: the rest of the step has data-dependent shapes that would recompile every step."""
    global _block_attention_core
    _block_attention_core = (block_attention_core if backend is None
                             else torch.compile(block_attention_core, dynamic=True, backend=backend))


def gather_window(view: TargetKVView, last_position: torch.Tensor, sliding_window: int) -> WindowKV:
    k, v = view.gather()
    # the view may be wider than the drafter's window: keys older than n+1-W are masked here
    mask = (view.valid & (view.positions > last_position[:, None] - sliding_window)
            & (view.positions <= last_position[:, None]))
    return WindowKV(k, v, mask)


class Attention(nn.Module):
    """Target-geometry attention: block queries over [context window ; block keys] in one SDPA call."""

    def __init__(self, cfg: HSpecConfig):
        super().__init__()
        t = cfg.target
        d, self.nh, self.nkv, self.hd = cfg.hidden_size, t.num_attention_heads, t.num_key_value_heads, t.head_dim
        self.q_proj = nn.Linear(d, self.nh * self.hd, bias=False)
        self.k_proj = nn.Linear(d, self.nkv * self.hd, bias=False)
        self.v_proj = nn.Linear(d, self.nkv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.nh * self.hd, d, bias=False)
        self.q_norm = RMSNorm(self.hd, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.hd, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.causal = cfg.block_causal

    def project_kv(self, x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor):
        """Post-RoPE keys and values [N, kv, L, D] of hidden rows x [N, L, d] at `positions`."""
        N, L, _ = x.shape
        k = self.k_proj(x).view(N, L, self.nkv, self.hd)
        if self.k_norm is not None:
            k = self.k_norm(k)
        k = apply_rope(k.transpose(1, 2), positions, inv_freq)
        return k, self.v_proj(x).view(N, L, self.nkv, self.hd).transpose(1, 2)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
                context: WindowKV | SequenceKV | PagedKVWindow | None) -> torch.Tensor:
        N, L, _ = x.shape
        q = self.q_proj(x).view(N, L, self.nh, self.hd)
        if self.q_norm is not None:
            q = self.q_norm(q)
        q = apply_rope(q.transpose(1, 2), positions, inv_freq)
        k, v = self.project_kv(x, positions, inv_freq)
        if isinstance(context, SequenceKV):
            out = sequence_block_attention(q, k, v, context, causal=self.causal)
        elif isinstance(context, PagedKVWindow):
            # SGLang's paged pool, read in place: the Triton kernel on CUDA, its torch twin elsewhere
            out = paged_block_attention(q, k, v, context, causal=self.causal)
        else:
            block_mask = torch.ones(L, L, dtype=torch.bool, device=x.device)
            if self.causal:
                block_mask = block_mask.tril()
            mask = block_mask.expand(N, L, L)
            if context is not None:
                k = torch.cat([context.key.to(q.dtype), k], dim=2)
                v = torch.cat([context.value.to(q.dtype), v], dim=2)
                mask = torch.cat([context.mask[:, None, :].expand(N, L, -1), mask], dim=2)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], enable_gqa=self.nkv != self.nh)
        return self.o_proj(out.transpose(1, 2).reshape(N, L, self.nh * self.hd))


class Layer(nn.Module):
    def __init__(self, cfg: HSpecConfig, pattern: str):
        super().__init__()
        eps = cfg.rms_norm_eps
        self.mamba_norm = RMSNorm(cfg.hidden_size, eps) if "M" in pattern else None
        self.mamba = Mamba2(cfg) if "M" in pattern else None
        self.attn_norm = RMSNorm(cfg.hidden_size, eps) if "A" in pattern else None
        self.attn = Attention(cfg) if "A" in pattern else None
        self.mlp_norm = RMSNorm(cfg.hidden_size, eps)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x, positions, inv_freq, state0, context):
        if self.mamba is not None:
            # every layer starts from state0: the block's final state is never read
            x = x + self.mamba(self.mamba_norm(x), state0, final_state=False)[0]
        if self.attn is not None:
            x = x + self.attn(self.attn_norm(x), positions, inv_freq, context)
        return x + self.mlp(self.mlp_norm(x))


class StateProjection(nn.Module):
    """5 target hidden states at position n -> initial Mamba state [N, heads, head_dim, state_dim]."""

    def __init__(self, cfg: HSpecConfig):
        super().__init__()
        n_ids, d = len(cfg.target_layer_ids), cfg.hidden_size
        # per-layer RMSNorm: target layers differ in scale by orders of magnitude
        self.norm_weight = nn.Parameter(torch.ones(n_ids, d))
        self.eps = cfg.rms_norm_eps
        self.fuse = nn.Linear(n_ids * d, cfg.fusion_rank, bias=False)
        self.to_state = nn.Linear(cfg.fusion_rank, cfg.mamba_inner * cfg.mamba_state_dim, bias=False)
        self.shape = (cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.mamba_state_dim)

    def fused(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, 5, d] -> the rank-r context row [N, r] (what a server keeps per request)."""
        hf = hidden.to(_compute_dtype(hidden.dtype))
        hf = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + self.eps) * self.norm_weight.to(hf.dtype)
        return self.fuse(hf.flatten(1).to(self.fuse.weight.dtype))

    def state(self, fused: torch.Tensor) -> torch.Tensor:
        """Context row [N, r] -> initial Mamba state [N, heads, head_dim, state_dim]."""
        return self.to_state(fused.to(self.to_state.weight.dtype)).view(fused.shape[0], *self.shape)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.state(self.fused(hidden))


class MarkovHead(nn.Module):
    """Vanilla low-rank first-order bias B(x_prev, .) = W1[x_prev] W2 over the draft vocabulary.
    Row V_d of W1 stands for every previous token outside the draft vocabulary."""

    def __init__(self, draft_vocab: int, rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(draft_vocab + 1, rank)
        self.markov_w2 = nn.Linear(rank, draft_vocab, bias=False)
        nn.init.zeros_(self.markov_w2.weight)  # start as "no bias": the backbone's logits unchanged


@dataclass
class DraftOutput:
    logits: torch.Tensor  # [..., k, V_d] over the draft vocabulary, Markov bias included
    confidence_logits: torch.Tensor | None  # [..., k]


# ---------------------------------------------------------------- the drafter
class DraftModel(nn.Module):
    """Shared framework: block backbone + draft-vocab LM head + Markov + confidence heads."""

    def __init__(self, config: HSpecConfig, target_embed: nn.Embedding, target_lm_head: nn.Linear):
        super().__init__()
        cfg = self.config = config
        t = cfg.target
        if tuple(target_embed.weight.shape) != (t.vocab_size, t.hidden_size):
            raise ValueError(f"target embedding is {tuple(target_embed.weight.shape)}, the config's target "
                             f"expects ({t.vocab_size}, {t.hidden_size}); pass the matching target's embed_tokens")
        if target_lm_head.weight.shape[1] != t.hidden_size or target_lm_head.weight.shape[0] < t.vocab_size:
            raise ValueError(f"target lm_head is {tuple(target_lm_head.weight.shape)}, expected "
                             f"({t.vocab_size}, {t.hidden_size}); pass the matching target's lm_head")
        # a tuple is not registered by nn.Module: shared, frozen, never in state_dict / parameters()
        self._target = (target_embed, target_lm_head)
        self.name = cfg.kind
        self.block_size = cfg.block_size
        self.sliding_window = cfg.sliding_window
        self.target_layer_ids = cfg.hidden_layer_ids
        self.kv_layer_ids = cfg.kv_reuse_layer_ids if cfg.reads_target_kv else ()
        # reads DraftContext.target_hidden only; the engine then skips the new-positions hidden states
        self.reads_new_hidden = False
        self.layers = nn.ModuleList(Layer(cfg, p) for p in cfg.layer_pattern)
        self.state_proj = StateProjection(cfg) if cfg.injects_state else None
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.markov = MarkovHead(cfg.draft_vocab_size, cfg.markov_rank) if cfg.markov_rank else None
        self.confidence = (nn.Linear(cfg.hidden_size + cfg.markov_rank, 1) if cfg.confidence_head else None)
        self.register_buffer("d2t", torch.arange(cfg.draft_vocab_size), persistent=True)
        # float64 RoPE frequencies on the model's device (a graph-captured forward copies nothing from the
        # host); not saved (derived from the target's config) and kept float64 by `_apply`
        self.register_buffer("inv_freq", rope_inv_freq(t.head_dim, t.rope_theta, t.rope_scaling), persistent=False)
        self._lm_cache: tuple | None = None
        self._t2d_cache: tuple | None = None

    def _apply(self, fn, recurse=True):
        """Module moves and casts (.to, .cuda, .half, to_empty, ...) move inv_freq but never round it:
        it is recomputed exactly on the new device, so model.to(bfloat16) keeps float64 frequencies."""
        inv = self._buffers.pop("inv_freq")
        try:
            super()._apply(fn, recurse)
        finally:
            self._buffers["inv_freq"] = inv
        device = fn(torch.empty(0, device=inv.device)).device
        if device != inv.device or inv.dtype != torch.float64:
            t = self.config.target
            self._buffers["inv_freq"] = rope_inv_freq(t.head_dim, t.rope_theta, t.rope_scaling).to(device)
        return self

    # ---- vocabulary ----
    def set_draft_vocab(self, d2t: torch.Tensor) -> None:
        d2t = torch.as_tensor(d2t, dtype=torch.long)
        if d2t.shape != self.d2t.shape or d2t.min() < 0 or d2t.max() >= self.config.target.vocab_size:
            raise ValueError(f"d2t must be {tuple(self.d2t.shape)} target ids in 0..{self.config.target.vocab_size - 1}")
        if d2t.unique().numel() != d2t.numel():
            raise ValueError("d2t has repeated target ids; build it with build_draft_vocab")
        self.d2t.copy_(d2t)
        self._lm_cache = None

    def target_to_draft(self) -> torch.Tensor:
        """[V] target id -> draft id, V_d (W1's spare row) outside the draft vocabulary. Cached per d2t
        version and device (d2t changes by set_draft_vocab or load_state_dict)."""
        key = (self.d2t._version, self.d2t.device, self.d2t.data_ptr())
        if self._t2d_cache is None or self._t2d_cache[0] != key:
            V, Vd = self.config.target.vocab_size, self.config.draft_vocab_size
            t2d = torch.full((V,), Vd, dtype=torch.long, device=self.d2t.device)
            t2d[self.d2t] = torch.arange(Vd, device=self.d2t.device)
            self._t2d_cache = (key, t2d)
        return self._t2d_cache[1]

    def to_draft_ids(self, target_ids: torch.Tensor, oov: int | None = None) -> torch.Tensor:
        """Target ids -> draft ids; ids outside the draft vocabulary -> `oov` (default V_d, W1's spare row)."""
        ids = self.target_to_draft()[target_ids.clamp(0, self.config.target.vocab_size - 1)]
        if oov is not None and oov != self.config.draft_vocab_size:
            ids = ids.masked_fill(ids == self.config.draft_vocab_size, oov)
        return ids

    def _draft_lm_weight(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The target LM head's draft-vocabulary rows (weight [V_d, d], bias), gathered once and cached."""
        lm = self._target[1]
        key = (lm.weight.data_ptr(), lm.weight._version, self.d2t._version, self.d2t.device)
        if self._lm_cache is None or self._lm_cache[0] != key:
            bias = None if getattr(lm, "bias", None) is None else lm.bias.detach()[self.d2t]
            self._lm_cache = (key, lm.weight.detach()[self.d2t], bias)
        return self._lm_cache[1], self._lm_cache[2]

    def base_logits(self, h: torch.Tensor) -> torch.Tensor:
        w, b = self._draft_lm_weight()
        return F.linear(h.to(w.dtype), w, b).float()

    def head_outputs(self, h: torch.Tensor, prev_tokens: torch.Tensor,
                     base: torch.Tensor | None = None) -> DraftOutput:
        """Heads for hidden rows h [..., d] (normed) given the previous slot's token prev_tokens [...]
        (target ids: the anchor for slot 0, then teacher-forced or sampled tokens)."""
        logits = self.base_logits(h) if base is None else base
        emb = None
        if self.markov is not None:
            emb = self.markov.markov_w1(self.to_draft_ids(prev_tokens))
            logits = logits + self.markov.markov_w2(emb).float()
        conf = None
        if self.confidence is not None:
            # nothing is detached: the confidence loss also trains the backbone (the trainer may detach)
            feats = h if emb is None else torch.cat([h, emb.to(h.dtype)], dim=-1)
            conf = self.confidence(feats.to(self.confidence.weight.dtype)).squeeze(-1).float()
        return DraftOutput(logits, conf)

    # ---- backbone ----
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self._target[0](ids)

    def initial_state(self, hidden_last: torch.Tensor | None, n: int, like: torch.Tensor,
                      fused_context: torch.Tensor | None = None) -> torch.Tensor:
        cfg = self.config
        if self.state_proj is not None:
            if fused_context is not None:  # a server's per-request context row (StateProjection.fused)
                return self.state_proj.state(fused_context)
            if hidden_last is None:
                raise ValueError(f"{cfg.kind} needs the target hidden states of layers {cfg.target_layer_ids} "
                                 "at position n (DraftContext.target_hidden [B, 5, hidden])")
            return self.state_proj(hidden_last.to(like.dtype))
        return like.new_zeros(n, cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.mamba_state_dim)

    def backbone(self, anchor_tokens: torch.Tensor, last_position: torch.Tensor,
                 hidden_last: torch.Tensor | None, contexts: dict[int, WindowKV], *,
                 fused_context: torch.Tensor | None = None) -> torch.Tensor:
        """The block forward shared by propose, training and the SGLang model class. anchor_tokens /
        last_position [N]; hidden_last [N, 5, d] or, already fused, fused_context [N, fusion_rank] (ignored
        unless the state is injected); contexts: attention layer index -> its context window (missing =
        block only). Returns normed hidden [N, k, d]."""
        cfg, N, k = self.config, anchor_tokens.shape[0], self.block_size
        ids = torch.full((N, k), cfg.mask_token_id, dtype=torch.long, device=anchor_tokens.device)
        ids[:, 0] = anchor_tokens
        x = self.embed(ids).to(self.norm.weight.dtype)
        positions = last_position[:, None] + 1 + torch.arange(k, device=x.device)
        state0 = self.initial_state(hidden_last, N, x, fused_context) if cfg.uses_mamba else None
        return self.run_layers(x, positions, state0, contexts)

    def run_layers(self, x: torch.Tensor, positions: torch.Tensor, state0: torch.Tensor | None,
                   contexts: dict[int, WindowKV]) -> torch.Tensor:
        """The layer stack over block embeddings x [N, k, d] at absolute positions [N, k], from the initial
        Mamba state; contexts: attention layer index -> its window (missing = block only). Normed output."""
        attn_index = 0
        for layer in self.layers:
            ctx = None
            if layer.attn is not None:
                ctx = contexts.get(attn_index)
                attn_index += 1
            x = layer(x, positions, self.inv_freq, state0, ctx)
        return self.norm(x)

    # ---- context sources (overridden by the DFlash family) ----
    def propose_contexts(self, ctx: DraftContext) -> dict[int, WindowKV]:
        out = {}
        for i, layer_id in enumerate(self.kv_layer_ids):
            if layer_id not in ctx.kv_views:
                raise ValueError(f"{self.name} reads target layer {layer_id}'s KV but DraftContext.kv_views has "
                                 f"{sorted(ctx.kv_views)}; build views for drafter.kv_layer_ids")
            out[i] = gather_window(ctx.kv_views[layer_id], ctx.last_position, self.sliding_window)
        return out

    def train_contexts(self, hidden, kv, input_ids, last_position, rows, *,
                       gather_windows: bool = False) -> dict[int, WindowKV | SequenceKV]:
        out = {}
        for i, layer_id in enumerate(self.kv_layer_ids):
            if layer_id not in kv:
                raise ValueError(f"features.kv lacks target layer {layer_id}; request kv_layer_ids={self.kv_layer_ids}")
            out[i] = self.sequence_context(*kv[layer_id], last_position, rows, gather_windows=gather_windows)
        return out

    def sequence_context(self, K: torch.Tensor, V: torch.Tensor, last_position: torch.Tensor, rows: torch.Tensor, *,
                         gather_windows: bool = False) -> WindowKV | SequenceKV:
        """Per-sequence K/V [B, kv, T, D] as the context of block rows `rows`: read in place (training's
        default) or, with gather_windows, copied into one window per block (the inference layout; the
        reference twin in tests)."""
        if not gather_windows:
            return SequenceKV(K, V, rows, last_position, self.sliding_window)
        view = dense_window_view(K, V, last_position, self.sliding_window, row_index=rows)
        return gather_window(view, last_position, self.sliding_window)

    # ---- engine API ----
    def reset(self) -> None:
        """H-Spec keeps no per-request state."""

    @torch.no_grad()
    def propose(self, ctx: DraftContext, sampling: SamplingParams,
                generator: torch.Generator | None = None) -> DraftProposal:
        n = ctx.last_position.to(self.d2t.device)
        h = self.backbone(ctx.anchor_tokens, n, ctx.target_hidden, self.propose_contexts(ctx))
        base = self.base_logits(h)  # [B, k, V_d]
        B, k, V = h.shape[0], self.block_size, self.config.target.vocab_size
        tokens = torch.empty(B, k, dtype=torch.long, device=h.device)
        q = None if sampling.greedy else torch.zeros(B, k, V, device=h.device)
        conf = torch.empty(B, k, device=h.device) if self.confidence is not None else None
        prev = ctx.anchor_tokens.to(h.device)
        for j in range(k):  # the sequential part is only the Markov bias, confidence and sampling
            out = self.head_outputs(h[:, j], prev, base[:, j])
            if sampling.greedy:  # the argmax itself: sampling_probs' one-hot would only be argmaxed again
                draft_tok = out.logits.argmax(-1)
            else:
                probs = sampling_probs(out.logits, sampling)
                draft_tok = sample_from(probs, generator)
                q[:, j].scatter_(-1, self.d2t.expand(B, -1), probs)
            prev = tokens[:, j] = self.d2t[draft_tok]
            if conf is not None:
                conf[:, j] = out.confidence_logits
        return DraftProposal(tokens=tokens, q=q, confidence_logits=conf)

    # ---- trainer API ----
    def forward_train(self, features, input_ids: torch.Tensor, anchors: torch.Tensor,
                      anchor_valid: torch.Tensor | None = None, *, gather_windows: bool = False) -> DraftOutput:
        """Teacher-forced forward over many anchors per sequence, in one batched call.

        features: TargetFeatures-like with `.hidden` [B, T, 5, d] for drafter.target_layer_ids (may be
        None when target_layer_ids is empty) and `.kv` {layer_id: (K, V) [B, kv, T, D] post-RoPE} for
        drafter.kv_layer_ids. anchors [B, A] (>= 1): anchor position a, last committed n = a-1, the block
        input is input_ids[a] + masks, slot j predicts input_ids[a+1+j] (see `block_labels`).
        anchor_valid [B, A] bool (optional): only those blocks are computed (padded anchors cost
        nothing); the others' outputs are 0. gather_windows: copy each block's context window out of the
        sequence's KV (the inference layout) instead of reading it in place (`sequence_block_attention`).
        Returns logits [B, A, k, V_d] and confidence logits [B, A, k]."""
        B, T = input_ids.shape
        A = anchors.shape[1]
        if anchors.min() < 1 or anchors.max() >= T:
            raise ValueError(f"anchors must lie in 1..T-1 = 1..{T - 1} (the block needs position a-1 committed)")
        rows = torch.arange(B, device=input_ids.device).repeat_interleave(A)
        a = anchors.reshape(-1)
        keep = None if anchor_valid is None else anchor_valid.reshape(-1).nonzero().squeeze(-1)
        if keep is not None:
            rows, a = rows[keep], a[keep]
        n = a - 1
        hidden = getattr(features, "hidden", None)
        hidden_last = hidden[rows, n] if (hidden is not None and self.state_proj is not None) else None
        contexts = self.train_contexts(hidden, getattr(features, "kv", {}) or {}, input_ids, n, rows,
                                       gather_windows=gather_windows)
        h = self.backbone(input_ids[rows, a], n, hidden_last, contexts)
        k = self.block_size
        prev_pos = (a[:, None] + torch.arange(k, device=a.device)).clamp_max(T - 1)
        out = self.head_outputs(h, input_ids[rows[:, None], prev_pos])
        logits, conf = out.logits, out.confidence_logits
        if keep is not None:
            logits = logits.new_zeros(B * A, *logits.shape[1:]).index_copy(0, keep, logits)
            conf = None if conf is None else conf.new_zeros(B * A, k).index_copy(0, keep, conf)
        conf = None if conf is None else conf.view(B, A, k)
        return DraftOutput(logits.view(B, A, k, -1), conf)

    def block_labels(self, input_ids: torch.Tensor, anchors: torch.Tensor, ignore_index: int = -100):
        """(target ids [B, A, k], draft ids [B, A, k]) of the tokens each slot predicts (a+1+j);
        positions past the sequence end, and draft ids of tokens outside the draft vocab, are ignore_index."""
        T = input_ids.shape[1]
        pos = anchors[..., None] + 1 + torch.arange(self.block_size, device=anchors.device)
        inside = pos < T
        tgt = torch.gather(input_ids, 1, pos.clamp_max(T - 1).flatten(1)).view_as(pos)
        tgt = tgt.masked_fill(~inside, ignore_index)
        draft = self.to_draft_ids(tgt, oov=ignore_index).masked_fill(~inside, ignore_index)
        return tgt, draft

    # ---- accounting ----
    def num_trainable_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters() if p.requires_grad)

    def owned_state_bytes(self) -> int:
        """Bytes of per-request state the drafter holds (H-Spec: none)."""
        return 0
