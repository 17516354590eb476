"""Anchor sampling, slot masks and the DSpark block loss (0.1 CE + 0.9 TV + 1.0 BCE), chunked over rows.

The target side of the loss has no gradient, so its distribution is computed once per target position
(`target_draft_probs`: softmax over the full vocabulary, restricted to the draft vocabulary, plus the mass
outside it) and shared by every slot that reads that position; `per_slot_terms` is the reference twin that
recomputes it per slot from the full-vocabulary logits (what the trainer did before; `training.
target_probs_once=false`). Only slots inside the slot mask are computed (`compact`).

Slot convention (DeepSpec / SGLang, written into drafter configs): the block of anchor position a
is fed token a then k-1 masks; slot j (0-based) predicts token a+1+j, and its target distribution is
the frozen target's next-token distribution at position a+j. The drafter's target context is strictly
before the anchor (positions <= a-1), exactly as at serving time (DraftContext: KV 0..n, anchor n+1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


def valid_anchor_mask(*, loss_mask: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """[B, T] bool: positions a that may anchor a block. Needs a >= 1 (some target context before the
    anchor), a+1 < length, and the first label a+1 inside the loss mask (an assistant token)."""
    B, T = loss_mask.shape
    pos = torch.arange(T, device=loss_mask.device)
    nxt = torch.zeros_like(loss_mask, dtype=torch.bool)
    nxt[:, :-1] = loss_mask[:, 1:].bool()
    return nxt & (pos[None, :] >= 1) & (pos[None, :] + 1 < lengths[:, None])


def sample_anchors(
    *, loss_mask: torch.Tensor, lengths: torch.Tensor, num_anchors: int, seeds: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample up to `num_anchors` distinct valid anchor positions per sequence, sorted ascending.

    Each row draws from its own generator seeded by `seeds[b]`, so a sequence gets the same anchors
    whichever rank or micro-batch it lands in (DDP equals the doubled single-process batch).
    Returns (anchors [B, A] long, anchor_valid [B, A] bool); padded entries hold position 1 and
    are invalid."""
    valid = valid_anchor_mask(loss_mask=loss_mask, lengths=lengths)
    B = valid.shape[0]
    anchors = torch.ones(B, num_anchors, dtype=torch.long)
    ok = torch.zeros(B, num_anchors, dtype=torch.bool)
    for b in range(B):
        cand = torch.nonzero(valid[b].cpu(), as_tuple=False).flatten()
        if cand.numel() > num_anchors:
            g = torch.Generator().manual_seed(int(seeds[b]))
            cand = cand[torch.randperm(cand.numel(), generator=g)[:num_anchors]].sort().values
        anchors[b, : cand.numel()] = cand
        ok[b, : cand.numel()] = True
    return anchors.to(loss_mask.device), ok.to(loss_mask.device)


def slot_mask(
    *, anchors: torch.Tensor, anchor_valid: torch.Tensor, loss_mask: torch.Tensor, lengths: torch.Tensor,
    block_size: int,
) -> torch.Tensor:
    """[B, A, k] bool: slot j of anchor a counts iff its label a+1+j lies before the sequence end and
    inside the loss mask, and so did every earlier slot (a block never continues past a turn's end)."""
    j = torch.arange(block_size, device=anchors.device)
    label_pos = anchors[..., None] + 1 + j  # [B, A, k]
    T = loss_mask.shape[1]
    in_seq = label_pos < lengths[:, None, None]
    in_mask = torch.gather(loss_mask.bool(), 1, label_pos.clamp_max(T - 1).flatten(1)).view_as(label_pos)
    ok = in_seq & in_mask & anchor_valid[..., None]
    return torch.cumprod(ok.long(), dim=-1).bool()


def position_weights(*, block_size: int, gamma_decay: float, device=None) -> torch.Tensor:
    """w_j = exp(-(j-1)/gamma_decay) for 1-based slot j."""
    return torch.exp(-torch.arange(block_size, device=device, dtype=torch.float32) / gamma_decay)


def target_to_draft_map(*, d2t: torch.Tensor, target_vocab_size: int) -> torch.Tensor:
    """[V] long: the draft id of each target id, -1 where the draft vocabulary lacks it."""
    t2d = torch.full((target_vocab_size,), -1, dtype=torch.long, device=d2t.device)
    t2d[d2t] = torch.arange(d2t.numel(), device=d2t.device)
    return t2d


def _chunk_terms(
    draft_logits: torch.Tensor, target_logits: torch.Tensor, draft_labels: torch.Tensor, d2t: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row CE (0 where the label is not in the draft vocab) and TV over the full target vocab.

    TV = 0.5 * ||scatter(p_d, d2t) - p_t||_1 = 0.5 * (sum_i |p_d[i] - p_t[d2t[i]]| + (1 - sum_i p_t[d2t[i]])):
    target ids outside the draft vocab have p_d = 0, so the scatter never needs materialising."""
    logp_d = torch.log_softmax(draft_logits.float(), dim=-1)
    p_t = torch.softmax(target_logits.float(), dim=-1)
    p_t_in = p_t.index_select(-1, d2t)
    tv = 0.5 * ((logp_d.exp() - p_t_in).abs().sum(-1) + (1.0 - p_t_in.sum(-1)).clamp_min(0.0))
    has = draft_labels >= 0
    ce = -torch.gather(logp_d, -1, draft_labels.clamp_min(0)[:, None]).squeeze(-1) * has
    return ce, tv


def per_slot_terms(
    *, draft_logits: torch.Tensor, target_logits: torch.Tensor, label_index: torch.Tensor,
    labels: torch.Tensor, d2t: torch.Tensor, chunk_rows: int = 2048,
) -> tuple[torch.Tensor, torch.Tensor]:
    """CE and TV per slot, [...] shaped like `labels`.

    draft_logits [..., V_d]; target_logits [N_t, V] (flattened target positions); label_index [...]
    rows of target_logits holding each slot's target distribution; labels [...] target-vocab ids.
    Rows are processed in chunks (recomputed in backward) so no [rows, V] float32 tensor beyond one
    chunk is kept alive."""
    shape = labels.shape
    dl = draft_logits.reshape(-1, draft_logits.shape[-1])
    idx, lab = label_index.reshape(-1), labels.reshape(-1)
    t2d = target_to_draft_map(d2t=d2t, target_vocab_size=target_logits.shape[-1])
    draft_labels = t2d[lab]
    ces, tvs = [], []
    for s in range(0, dl.shape[0], chunk_rows):
        sl = slice(s, s + chunk_rows)
        tl = target_logits.index_select(0, idx[sl])
        if torch.is_grad_enabled() and dl.requires_grad:
            ce, tv = checkpoint(_chunk_terms, dl[sl], tl, draft_labels[sl], d2t, use_reentrant=False)
        else:
            ce, tv = _chunk_terms(dl[sl], tl, draft_labels[sl], d2t)
        ces.append(ce)
        tvs.append(tv)
    return torch.cat(ces).view(shape), torch.cat(tvs).view(shape)


@dataclass
class TargetProbs:
    """The frozen target's next-token distribution at each of N positions, over the draft vocabulary."""

    probs: torch.Tensor  # [N, V_d] float32: p_t[d2t[i]]
    outside: torch.Tensor  # [N] float32: probability mass on target ids outside the draft vocabulary


@torch.no_grad()
def lm_head_log_partition(*, hidden: torch.Tensor, lm_head_weight: torch.Tensor,
                          lm_head_bias: torch.Tensor | None = None, chunk_rows: int = 2048) -> torch.Tensor:
    """[...] float32 logsumexp of the full-vocabulary logits lm_head(hidden) of every position (the log of
    the softmax normaliser), computed a chunk of rows at a time."""
    flat = hidden.reshape(-1, hidden.shape[-1])
    out = torch.empty(flat.shape[0], dtype=torch.float32, device=flat.device)
    for s in range(0, flat.shape[0], chunk_rows):
        logits = F.linear(flat[s: s + chunk_rows].to(lm_head_weight.dtype), lm_head_weight, lm_head_bias)
        out[s: s + chunk_rows] = torch.logsumexp(logits.float(), dim=-1)
    return out.reshape(hidden.shape[:-1])


@torch.no_grad()
def target_draft_probs(
    *, d2t: torch.Tensor, logits: torch.Tensor | None = None, hidden: torch.Tensor | None = None,
    lm_head_weight: torch.Tensor | None = None, lm_head_bias: torch.Tensor | None = None, chunk_rows: int = 2048,
    log_partition: torch.Tensor | None = None,
) -> TargetProbs:
    """`TargetProbs` of every position, from full-vocabulary `logits` [..., V] or from final-norm `hidden`
    [..., d] and the target's LM head (then no [positions, V] logits tensor beyond one chunk is held).
    Row for row the same float32 softmax as `per_slot_terms`, so the loss does not change.

    With `hidden` and its `log_partition` [...] (`lm_head_log_partition` of the same hidden, e.g. from the
    feature cache), only the draft-vocabulary rows of the LM head run: p_t[d2t[i]] = exp(logit_i - log_partition),
    the same softmax up to float rounding at V_d / V of the matmul (1/6 for SmolLM2's 8,192 of 49,152)."""
    if (logits is None) == (hidden is None):
        raise ValueError("pass exactly one of logits and hidden (with lm_head_weight)")
    if log_partition is not None:
        if hidden is None or log_partition.shape != hidden.shape[:-1]:
            raise ValueError(f"log_partition {tuple(log_partition.shape)} needs hidden of shape [..., d] with the "
                             f"same leading shape, got {None if hidden is None else tuple(hidden.shape)}")
        return _draft_rows_probs(d2t=d2t, hidden=hidden, lm_head_weight=lm_head_weight, lm_head_bias=lm_head_bias,
                                 log_partition=log_partition, chunk_rows=chunk_rows)
    src = logits if logits is not None else hidden
    src = src.reshape(-1, src.shape[-1])
    probs = torch.empty(src.shape[0], d2t.numel(), dtype=torch.float32, device=src.device)
    outside = torch.empty(src.shape[0], dtype=torch.float32, device=src.device)
    for s in range(0, src.shape[0], chunk_rows):
        part = src[s: s + chunk_rows]
        if hidden is not None:
            part = F.linear(part.to(lm_head_weight.dtype), lm_head_weight, lm_head_bias)
        p_in = torch.softmax(part.float(), dim=-1).index_select(-1, d2t)
        probs[s: s + chunk_rows] = p_in
        outside[s: s + chunk_rows] = (1.0 - p_in.sum(-1)).clamp_min(0.0)
    return TargetProbs(probs=probs, outside=outside)


def _draft_rows_probs(*, d2t, hidden, lm_head_weight, lm_head_bias, log_partition, chunk_rows) -> TargetProbs:
    weight = lm_head_weight.index_select(0, d2t)
    bias = None if lm_head_bias is None else lm_head_bias.index_select(0, d2t)
    flat = hidden.reshape(-1, hidden.shape[-1])
    lse = log_partition.reshape(-1, 1).to(torch.float32)
    probs = torch.empty(flat.shape[0], d2t.numel(), dtype=torch.float32, device=flat.device)
    for s in range(0, flat.shape[0], chunk_rows):
        part = F.linear(flat[s: s + chunk_rows].to(weight.dtype), weight, bias).float()
        torch.exp(part.sub_(lse[s: s + chunk_rows]), out=probs[s: s + chunk_rows])
    return TargetProbs(probs=probs, outside=(1.0 - probs.sum(-1)).clamp_min(0.0))


def _draft_terms(
    draft_logits: torch.Tensor, p_t_in: torch.Tensor, outside: torch.Tensor, draft_labels: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`_chunk_terms` given the target's draft-vocabulary probabilities (no gradient on the target side)."""
    logp_d = torch.log_softmax(draft_logits.float(), dim=-1)
    tv = 0.5 * ((logp_d.exp() - p_t_in).abs().sum(-1) + outside)
    has = draft_labels >= 0
    ce = -torch.gather(logp_d, -1, draft_labels.clamp_min(0)[:, None]).squeeze(-1) * has
    return ce, tv


_draft_terms_fn = _draft_terms  # torch.compile'd by `compile_loss_kernels`


def compile_loss_kernels(backend: str | None = "inductor") -> None:
    """`training.compile`: `_draft_terms` (log-softmax, TV and CE over the draft vocabulary, per row) under
    torch.compile with dynamic rows, process-wide; backend None restores eager."""
    global _draft_terms_fn
    _draft_terms_fn = _draft_terms if backend is None else torch.compile(_draft_terms, dynamic=True, backend=backend)


def slot_terms(
    *, draft_logits: torch.Tensor, target: TargetProbs, label_index: torch.Tensor, labels: torch.Tensor,
    d2t: torch.Tensor, target_vocab_size: int, chunk_rows: int = 2048,
) -> tuple[torch.Tensor, torch.Tensor]:
    """CE and TV per slot like `per_slot_terms`, reading the per-position `TargetProbs` (rows of
    target.probs indexed by label_index)."""
    shape = labels.shape
    dl = draft_logits.reshape(-1, draft_logits.shape[-1])
    idx, lab = label_index.reshape(-1), labels.reshape(-1)
    draft_labels = target_to_draft_map(d2t=d2t, target_vocab_size=target_vocab_size)[lab]
    ces, tvs = [], []
    for s in range(0, dl.shape[0], chunk_rows):
        sl = slice(s, s + chunk_rows)
        p_in, out = target.probs.index_select(0, idx[sl]), target.outside.index_select(0, idx[sl])
        if torch.is_grad_enabled() and dl.requires_grad:
            ce, tv = checkpoint(_draft_terms_fn, dl[sl], p_in, out, draft_labels[sl], use_reentrant=False)
        else:
            ce, tv = _draft_terms_fn(dl[sl], p_in, out, draft_labels[sl])
        ces.append(ce)
        tvs.append(tv)
    if not ces:
        return dl.new_zeros(shape, dtype=torch.float32), dl.new_zeros(shape, dtype=torch.float32)
    return torch.cat(ces).view(shape), torch.cat(tvs).view(shape)


@dataclass
class BlockLoss:
    """Sums over the micro-batch (divide by a global weight total to get means)."""

    loss_sum: torch.Tensor  # weighted 0.1 CE + 0.9 TV + 1.0 BCE, summed over valid slots
    weight_sum: torch.Tensor  # sum of w_j over valid slots
    ce_sum: torch.Tensor
    tv_sum: torch.Tensor
    bce_sum: torch.Tensor
    tau_sum: torch.Tensor  # sum over valid anchors of tau_prob
    num_anchors: torch.Tensor
    accept_sum: torch.Tensor  # [k] sum of (1 - TV) over valid slots per position
    accept_count: torch.Tensor  # [k]


def block_loss(
    *, draft_logits: torch.Tensor, confidence_logits: torch.Tensor | None, input_ids: torch.Tensor,
    anchors: torch.Tensor, mask: torch.Tensor, d2t: torch.Tensor, target_logits: torch.Tensor | None = None,
    target_probs: TargetProbs | None = None, target_vocab_size: int | None = None, compact: bool = False,
    gamma_decay: float = 4.0, ce_weight: float = 0.1, tv_weight: float = 0.9, conf_weight: float = 1.0,
    chunk_rows: int = 2048,
) -> BlockLoss:
    """DSpark loss of a batch of blocks.

    draft_logits [B, A, k, V_d]; confidence_logits [B, A, k] or None (no head: BCE term is 0);
    input_ids [B, T]; anchors [B, A]; mask [B, A, k] from `slot_mask`; d2t [V_d] target ids of the
    draft vocabulary. The target side is either target_logits [B, T, V] (recomputed per slot: the
    reference path) or target_probs over the B*T positions (`target_draft_probs`, with
    target_vocab_size). Slot j of anchor a: label input_ids[a+1+j], target distribution
    softmax(target_logits[a+j]); confidence label stop_grad(1 - TV). compact=True computes CE / TV only
    for slots inside the mask (the others are exactly 0 and weigh 0 either way)."""
    if (target_logits is None) == (target_probs is None):
        raise ValueError("pass exactly one of target_logits and target_probs")
    B, A, block_size, _ = draft_logits.shape
    T = input_ids.shape[1]
    j = torch.arange(block_size, device=anchors.device)
    pos = (anchors[..., None] + j).clamp_max(T - 2)  # a+j; masked slots are clamped harmlessly
    labels = torch.gather(input_ids, 1, (pos + 1).flatten(1)).view(B, A, block_size)
    label_index = pos + (torch.arange(B, device=pos.device) * T)[:, None, None]
    keep = mask.reshape(-1).nonzero().squeeze(-1) if compact else None
    rows_logits = draft_logits.reshape(B * A * block_size, -1)
    rows_index, rows_labels = label_index.reshape(-1), labels.reshape(-1)
    if keep is not None:
        rows_logits, rows_index, rows_labels = rows_logits[keep], rows_index[keep], rows_labels[keep]
    if target_probs is not None:
        if target_vocab_size is None:
            raise ValueError("target_probs needs target_vocab_size (the full target vocabulary)")
        ce, tv = slot_terms(draft_logits=rows_logits, target=target_probs, label_index=rows_index,
                            labels=rows_labels, d2t=d2t, target_vocab_size=target_vocab_size, chunk_rows=chunk_rows)
    else:
        ce, tv = per_slot_terms(draft_logits=rows_logits, target_logits=target_logits.reshape(B * T, -1),
                                label_index=rows_index, labels=rows_labels, d2t=d2t, chunk_rows=chunk_rows)
    if keep is not None:
        ce = ce.new_zeros(B * A * block_size).index_copy(0, keep, ce)
        tv = tv.new_zeros(B * A * block_size).index_copy(0, keep, tv)
    ce, tv = ce.view(B, A, block_size), tv.view(B, A, block_size)
    m = mask.float()
    w = position_weights(block_size=block_size, gamma_decay=gamma_decay, device=m.device) * m
    accept = (1.0 - tv).clamp(0.0, 1.0)
    if confidence_logits is not None:
        bce = F.binary_cross_entropy_with_logits(
            confidence_logits.float(), accept.detach(), reduction="none"
        )
    else:
        bce = torch.zeros_like(tv)
    per_slot = ce_weight * ce + tv_weight * tv + conf_weight * bce
    with torch.no_grad():
        anchor_ok = mask[..., 0]
        # tau_prob = 1 + sum_j prod_{i<=j} (1 - TV_i); a masked slot counts as a rejection
        tau = 1.0 + torch.cumprod(accept.detach() * m, dim=-1).sum(-1)
        stats = dict(
            ce_sum=(ce * w).sum(), tv_sum=(tv * w).sum(), bce_sum=(bce * w).sum(),
            tau_sum=(tau * anchor_ok).sum(), num_anchors=anchor_ok.sum(),
            accept_sum=(accept.detach() * m).sum((0, 1)), accept_count=m.sum((0, 1)),
        )
    return BlockLoss(loss_sum=(per_slot * w).sum(), weight_sum=w.sum().detach(), **stats)

