"""Contracts between the reference engine, drafters (`Drafter`) and verify-length policies (`VerifyPolicy`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from sglang_hspec.target.kv_view import TargetKVView


@dataclass(frozen=True)
class SamplingParams:
    """temperature == 0 means greedy. top_k == 0 and top_p == 1 disable those filters."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 128
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0 or self.temperature != self.temperature:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class DraftContext:
    """Everything a drafter may read for one speculative step of B requests.

    Position convention: the target KV cache holds positions 0..n of request b (n = last committed
    position, `last_position[b]`); the anchor is the last token sampled by the target (its bonus
    token), not yet in the KV cache, at position n+1. Slot j (0-based) of the block predicts the token
    at position n+2+j ("anchor then block_size-1 masks", DSpark's slot convention)."""

    anchor_tokens: torch.Tensor  # [B] long
    last_position: torch.Tensor  # [B] long, n
    # target hidden states at position n for the drafter's target layer ids, [B, num_ids, hidden]
    # (id L = output of decoder layer L); None when the drafter asked for no layers
    target_hidden: torch.Tensor | None
    # layer id -> read-only window over that target layer's post-RoPE KV cache
    kv_views: dict[int, TargetKVView] = field(default_factory=dict)
    # committed token ids per request (prompt + generated, excluding the anchor), for n-gram drafters
    token_history: list[list[int]] | None = None
    # stable per-request ids (engine row index) for drafters that keep per-request state (dflash family)
    row_ids: torch.Tensor | None = None
    # hidden states (same layer ids as target_hidden) of the positions committed since the previous
    # propose of each row: [B, L, num_ids, hidden], row b valid for its first new_hidden_lengths[b]
    # entries, which end at position n. Prefill passes the whole prompt. Drafters with a growing
    # drafter-side KV cache (dflash, dspark) read it; one that sets `reads_new_hidden = False` (H-Spec,
    # which reads target_hidden) gets None, and the engine skips building it.
    new_hidden: torch.Tensor | None = None
    new_hidden_lengths: torch.Tensor | None = None


@dataclass
class DraftProposal:
    tokens: torch.Tensor  # [B, block_size] long, target vocabulary ids
    # draft distributions over the target vocabulary [B, block_size, V], after the engine's sampling
    # transforms (temperature/top-k/top-p); None = deterministic proposal (q is one-hot on tokens)
    q: torch.Tensor | None = None
    # raw (pre-sigmoid, pre-STS) confidence logits per slot [B, block_size]; None when the drafter has no head
    confidence_logits: torch.Tensor | None = None
    # real proposals per row [B] (<= block_size); None = block_size for every row (n-gram drafters may find fewer)
    lengths: torch.Tensor | None = None


@runtime_checkable
class Drafter(Protocol):
    name: str
    block_size: int  # tokens proposed per step
    target_layer_ids: tuple[int, ...]  # hidden states the engine must capture at position n
    kv_layer_ids: tuple[int, ...]  # target layers whose KV the drafter reads
    sliding_window: int  # KV window (positions max(0, n+1-W)..n)
    # optional `reads_new_hidden: bool` (absent: True): whether propose reads DraftContext.new_hidden

    def propose(
        self, ctx: DraftContext, sampling: SamplingParams, generator: torch.Generator | None
    ) -> DraftProposal: ...

    def reset(self) -> None:
        """Forget per-request state (the engine calls it at the start of each generate call)."""
        ...


@runtime_checkable
class VerifyPolicy(Protocol):
    """How many drafts each request verifies, step by step: the engine calls `decide` before drafting,
    `plan` for the rows that drafted, and `observe` after the verify (sglang_hspec/engine/policies.py
    holds the implementations: fixed, the scheduler's exact / stale planners, and auto).

    Ids are per active row of the step: row_ids [B] long (the engine's request row, stable for a request),
    generations [B] long (changes whenever a row holds a new request)."""

    def decide(self, *, row_ids: torch.Tensor, generations: torch.Tensor) -> torch.Tensor:
        """The batch positions [D] long (ascending) of the rows that draft this step: all B, some (a
        probe), or none (a plain decode step: every row verifies its anchor alone)."""
        ...

    def plan(self, *, confidences: torch.Tensor | None, proposal_lengths: torch.Tensor, row_ids: torch.Tensor,
             generations: torch.Tensor) -> torch.Tensor:
        """The verify lengths [D] long (0..proposal_lengths) of the drafted rows. confidences [D, block_size]:
        calibrated per-slot probabilities, None for a drafter without a confidence head; proposal_lengths
        [D]: the real proposals per row; row_ids / generations: the drafted rows'."""
        ...

    def observe(self, *, row_ids: torch.Tensor, generations: torch.Tensor, verify_lengths: torch.Tensor,
                num_accepted: torch.Tensor) -> None:
        """The outcome of the drafted rows' verify: verify_lengths [D] as verified (after the engine's
        cap at the tokens a request may still emit), num_accepted [D] drafts kept."""
        ...
