"""Verify-length policies: the objects an engine calls once per speculative step.

Every policy has the same call:

    lengths = policy.plan(confidences=c, slot_ids=s, generations=g)

- confidences [B, k] float: calibrated per-slot probabilities (after STS), c[r, j] = P(slot j accepted |
  slots < j accepted);
- slot_ids [B] long: the engine's request slot (row of its KV pool, may be reused after a request ends);
- generations [B] long: a counter the engine bumps whenever a slot gets a new request;
- lengths [B] long in 0..k: draft tokens verified after the anchor (the engine always verifies the
  anchor, so the verify batch is B_tokens = sum_r (1 + lengths[r])).

`policy.stats()` returns a `PolicyStats` struct (JSON-ready) for logs and `/metrics`.
"""

from __future__ import annotations

import logging

import msgspec
import torch

from . import planner
from .sps import SpsCurve, SpsTable

logger = logging.getLogger(__name__)


class PolicyStats(msgspec.Struct, frozen=True):
    policy: str
    steps: int
    last_budget: int  # draft tokens verified in the last step (sum of lengths)
    total_budget: int
    fallback: bool  # True when an uninitialised SPS table made the policy verify everything
    fallback_reason: str
    unknown_rows: int  # stale policy: rows planned without 2-step-old confidences (new requests)


def _check_ids(confidences: torch.Tensor, slot_ids: torch.Tensor, generations: torch.Tensor) -> None:
    planner.check_confidences(confidences)
    n = confidences.shape[0]
    for name, t in (("slot_ids", slot_ids), ("generations", generations)):
        if t.dim() != 1 or t.shape[0] != n or t.dtype != torch.long:
            raise ValueError(f"{name} must be a [B={n}] long tensor, got {tuple(t.shape)} {t.dtype}")
    if n and int(slot_ids.min()) < 0:
        raise ValueError("slot_ids must be >= 0")


class _Policy:
    name = "policy"

    def __init__(self) -> None:
        self._steps = 0
        self._last = 0
        self._total = 0
        self._unknown = 0
        self._fallback_reason = ""

    def _record(self, lengths: torch.Tensor) -> torch.Tensor:
        self._steps += 1
        self._last = int(lengths.sum())
        self._total += self._last
        return lengths

    def stats(self) -> PolicyStats:
        return PolicyStats(
            policy=self.name,
            steps=self._steps,
            last_budget=self._last,
            total_budget=self._total,
            fallback=bool(self._fallback_reason),
            fallback_reason=self._fallback_reason,
            unknown_rows=self._unknown,
        )


class FixedPolicy(_Policy):
    """Verify all drafted tokens, capped at k (the classic static speculative decoding)."""

    name = "fixed"

    def __init__(self, k: int) -> None:
        super().__init__()
        if k < 0:
            raise ValueError(f"FixedPolicy k must be >= 0, got {k}")
        self.k = k

    def plan(self, *, confidences: torch.Tensor, slot_ids: torch.Tensor, generations: torch.Tensor):
        _check_ids(confidences, slot_ids, generations)
        b, k = confidences.shape
        return self._record(torch.full((b,), min(self.k, k), dtype=torch.long))


class ThresholdPolicy(_Policy):
    """Verify the slots whose survival (cumulative confidence) is at least `threshold`."""

    name = "threshold"

    def __init__(self, threshold: float) -> None:
        super().__init__()
        if not 0.0 <= threshold <= 1.0:
            raise ValueError(f"threshold must be in [0, 1], got {threshold}")
        self.threshold = threshold

    def plan(self, *, confidences: torch.Tensor, slot_ids: torch.Tensor, generations: torch.Tensor):
        _check_ids(confidences, slot_ids, generations)
        return self._record(planner.threshold_lengths(confidences=confidences, threshold=self.threshold))


class _SpsPolicy(_Policy):
    def __init__(self, sps_table: SpsTable, *, allow_uninitialised: bool) -> None:
        super().__init__()
        self.sps = SpsCurve(sps_table)
        if sps_table.uninitialised:
            if not allow_uninitialised:
                raise ValueError(
                    f"{type(self).__name__}: the SPS table has a single probe "
                    f"({sps_table.sample_batch_tokens}), i.e. it was never profiled; a flat curve would "
                    "make every draft token look free. Profile one with `hspec profile-sps`, or pass "
                    "allow_uninitialised=True to verify all tokens (logged, flagged in stats)."
                )
            self._fallback_reason = "uninitialised SPS table (one probe): verifying all draft tokens"
            logger.warning("!!! %s: %s; run `hspec profile-sps` to enable the scheduler !!!",
                           type(self).__name__, self._fallback_reason)

    def _verify_all(self, confidences: torch.Tensor) -> torch.Tensor:
        b, k = confidences.shape
        return self._record(torch.full((b,), k, dtype=torch.long))


class ExactPolicy(_SpsPolicy):
    """DSpark Algorithm 1 on this step's confidences, with the early stop (non-anticipating)."""

    name = "exact"

    def __init__(self, sps_table: SpsTable, *, allow_uninitialised: bool = False) -> None:
        super().__init__(sps_table, allow_uninitialised=allow_uninitialised)

    def plan(self, *, confidences: torch.Tensor, slot_ids: torch.Tensor, generations: torch.Tensor):
        _check_ids(confidences, slot_ids, generations)
        if self._fallback_reason:
            return self._verify_all(confidences)
        lengths, _ = planner.exact_lengths(confidences=confidences, sps=self.sps)
        return self._record(lengths)


class StalePolicy(_SpsPolicy):
    """Budget from confidences `lag` steps old (argmax of Theta), lengths = top-K of this step's.

    A ring of `lag` survival snapshots indexed by slot id; an entry counts only if the slot held the
    same generation `lag` steps ago. Rows without one (new or reused slots) are planned as if every
    slot survived (survival 1), as SGLang does: never starve a new request, at worst overspend."""

    name = "stale"

    def __init__(self, sps_table: SpsTable, *, lag: int = 2, allow_uninitialised: bool = False) -> None:
        super().__init__(sps_table, allow_uninitialised=allow_uninitialised)
        if lag < 1:
            raise ValueError(f"lag must be >= 1 (2 for overlap scheduling), got {lag}")
        self.lag = lag
        self._ring_surv: list[torch.Tensor] = []
        self._ring_gen: list[torch.Tensor] = []
        self.last_planned_budget = 0

    def _ensure_ring(self, *, slots: int, k: int, device: torch.device) -> None:
        if self._ring_surv and self._ring_surv[0].shape[1] != k:
            raise ValueError(f"StalePolicy was planning k={self._ring_surv[0].shape[1]} slots, got k={k}")
        have = self._ring_surv[0].shape[0] if self._ring_surv else 0
        if slots <= have:
            return
        size = max(slots, 2 * have, 64)
        surv = [torch.ones(size, k, dtype=torch.float64, device=device) for _ in range(self.lag)]
        gen = [torch.full((size,), -1, dtype=torch.long, device=device) for _ in range(self.lag)]
        for i in range(len(self._ring_surv)):
            surv[i][:have] = self._ring_surv[i]
            gen[i][:have] = self._ring_gen[i]
        self._ring_surv, self._ring_gen = surv, gen

    def plan(self, *, confidences: torch.Tensor, slot_ids: torch.Tensor, generations: torch.Tensor):
        _check_ids(confidences, slot_ids, generations)
        if self._fallback_reason:
            return self._verify_all(confidences)
        surv = planner.survivals(confidences=confidences)
        b, k = surv.shape
        if b == 0:
            return self._record(torch.zeros(0, dtype=torch.long))
        self._ensure_ring(slots=int(slot_ids.max()) + 1, k=k, device=surv.device)
        slot = self._steps % self.lag  # written `lag` steps ago, overwritten now
        ring_surv, ring_gen = self._ring_surv[slot], self._ring_gen[slot]
        known = ring_gen[slot_ids] == generations
        old = torch.where(known[:, None], ring_surv[slot_ids], torch.ones_like(surv))
        self._unknown += int(b - known.sum())
        budget = planner.argmax_budget(survival=old, sps=self.sps)
        # Forget rows absent this step, so a slot that skips steps never reads a snapshot > lag old.
        ring_gen.fill_(-1)
        ring_gen[slot_ids] = generations
        ring_surv[slot_ids] = surv
        self.last_planned_budget = budget
        return self._record(planner.topk_lengths(survival=surv, budget=budget))
