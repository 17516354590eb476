"""Lossless acceptance of a draft block against the target (greedy and rejection sampling)."""

from __future__ import annotations

import torch


def accept_block(
    *,
    draft_tokens: torch.Tensor,
    verify_lengths: torch.Tensor,
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    greedy: bool,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decide how many draft tokens each row keeps and draw the next token.

    draft_tokens [B, L] (row b verified its first verify_lengths[b] <= L), target_probs [B, L+1, V]:
    the target's (sampling-transformed) distribution at each draft slot and one past it; draft_probs
    [B, L, V] or None for a deterministic drafter (q one-hot on its token).

    Greedy reads only the argmax of target_probs (the target's logits serve as well as its one-hot).
    Greedy: the longest prefix equal to the target argmax, then the target's argmax at the first
    mismatch (or past the block). Sampling: standard speculative rejection sampling: keep slot j
    with probability min(1, p(x)/q(x)); at the first rejection draw from normalise((p - q)+); when
    all verified slots are kept draw the bonus token from p. Returns (num_accepted [B], next_token [B]).
    """
    b, length = draft_tokens.shape
    device = target_probs.device
    slot = torch.arange(length, device=device)[None, :]
    in_block = slot < verify_lengths[:, None]
    rows = torch.arange(b, device=device)
    if greedy:
        target_argmax = target_probs.argmax(-1)  # [B, L+1]
        keep = (draft_tokens == target_argmax[:, :length]) & in_block
        num_accepted = keep.long().cumprod(1).sum(1)
        return num_accepted, target_argmax[rows, num_accepted]

    p_draft = target_probs[:, :length].gather(-1, draft_tokens[..., None]).squeeze(-1)
    if draft_probs is None:
        q_draft = torch.ones_like(p_draft)
    else:
        q_draft = draft_probs.gather(-1, draft_tokens[..., None]).squeeze(-1)
    u = torch.rand(p_draft.shape, generator=generator, device=device)
    # u < p/q without dividing (q > 0 for a token the drafter actually sampled)
    keep = (u * q_draft < p_draft) & in_block
    num_accepted = keep.long().cumprod(1).sum(1)

    p_next = target_probs[rows, num_accepted]  # [B, V]
    rejected = num_accepted < verify_lengths
    if bool(rejected.any()):
        j = num_accepted.clamp_max(max(length - 1, 0))
        if draft_probs is None:
            q_at = torch.zeros_like(p_next)
            q_at[rows, draft_tokens[rows, j]] = 1.0
        else:
            q_at = draft_probs[rows, j]
        residual = (p_next - q_at).clamp_min(0.0)
        mass = residual.sum(-1, keepdim=True)
        # p == q exactly leaves no residual mass; then any draw from p is correct
        residual = torch.where(mass > 0, residual / mass.clamp_min(1e-30), p_next)
        p_next = torch.where(rejected[:, None], residual, p_next)
    next_token = torch.multinomial(p_next, 1, generator=generator).squeeze(-1)
    return num_accepted, next_token
