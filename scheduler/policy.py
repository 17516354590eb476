"""Verify-length policies: the objects an engine calls once per speculative step.

Every policy has the same call:

    verify_lengths = policy.plan(confidences=c, slot_ids=s, generations=g)

- confidences [B, block_size] float: calibrated per-slot probabilities (after STS), c[r, j] = P(slot j
  accepted | slots < j accepted);
- slot_ids [B] long: the engine's request slot (row of its KV pool, may be reused after a request ends);
- generations [B] long: a counter the engine bumps whenever a slot gets a new request;
- verify_lengths [B] long in 0..block_size: draft tokens verified after the anchor (the engine always
  verifies the anchor, so the verify batch is B_tokens = sum_r (1 + verify_lengths[r])).

`policy.stats()` returns a `PolicyStats` struct (JSON-ready) for logs and `/metrics`.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable

import msgspec
import numpy as np
import torch

from . import fused, planner, switch
from .sps import SpsCurve, SpsTable

logger = logging.getLogger(__name__)

_NEVER = -(2**62)  # 'step' of a draft that never happened


class PolicyStats(msgspec.Struct, frozen=True):
    policy: str
    steps: int
    last_budget: int  # draft tokens verified in the last step (sum of the verify lengths)
    total_budget: int
    fallback: bool  # True when an uninitialised SPS table made the policy verify everything
    fallback_reason: str
    unknown_rows: int  # stale policy: rows planned without 2-step-old confidences (new requests)
    speculative_steps: int = -1  # auto policy: steps that ran the drafter (-1: every step drafts)
    probes: int = 0  # auto policy: of those, probes (drafted to refresh the estimates)


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

    def _record(self, verify_lengths: torch.Tensor) -> torch.Tensor:
        self._steps += 1
        self._last = int(verify_lengths.sum())
        self._total += self._last
        return verify_lengths

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
    """Verify `verify_length` drafts of every request, at most its whole block (the classic static
    speculative decoding: verify_length = block_size)."""

    name = "fixed"

    def __init__(self, verify_length: int) -> None:
        super().__init__()
        if verify_length < 0:
            raise ValueError(f"FixedPolicy verify_length must be >= 0, got {verify_length}")
        self.verify_length = verify_length

    def plan(self, *, confidences: torch.Tensor, slot_ids: torch.Tensor, generations: torch.Tensor):
        _check_ids(confidences, slot_ids, generations)
        b, block_size = confidences.shape
        return self._record(torch.full((b,), min(self.verify_length, block_size), dtype=torch.long))


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
        b, block_size = confidences.shape
        return self._record(torch.full((b,), block_size, dtype=torch.long))


class ExactPolicy(_SpsPolicy):
    """DSpark Algorithm 1 on this step's confidences, with the early stop (non-anticipating)."""

    name = "exact"

    def __init__(self, sps_table: SpsTable, *, allow_uninitialised: bool = False) -> None:
        super().__init__(sps_table, allow_uninitialised=allow_uninitialised)

    def plan(self, *, confidences: torch.Tensor, slot_ids: torch.Tensor, generations: torch.Tensor):
        _check_ids(confidences, slot_ids, generations)
        if self._fallback_reason:
            return self._verify_all(confidences)
        verify_lengths, _ = planner.exact_lengths(confidences=confidences, sps=self.sps)
        return self._record(verify_lengths)


class StalePolicy(_SpsPolicy):
    """Budget from confidences `lag` steps old (argmax of Theta), verify lengths = top-K of this step's.

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

    def _ensure_ring(self, *, slots: int, block_size: int, device: torch.device) -> None:
        if self._ring_surv and self._ring_surv[0].shape[1] != block_size:
            raise ValueError(f"StalePolicy was planning block_size={self._ring_surv[0].shape[1]} slots, got "
                             f"block_size={block_size}")
        have = self._ring_surv[0].shape[0] if self._ring_surv else 0
        if slots <= have:
            return
        size = max(slots, 2 * have, 64)
        surv = [torch.ones(size, block_size, dtype=torch.float64, device=device) for _ in range(self.lag)]
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
        b, block_size = surv.shape
        if b == 0:
            return self._record(torch.zeros(0, dtype=torch.long))
        self._ensure_ring(slots=int(slot_ids.max()) + 1, block_size=block_size, device=surv.device)
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


class AutoPolicy(_SpsPolicy):
    """Speculate only when it beats plain decoding (scheduler/switch.py states the rule and why it
    is lossless); when it does, verify the top-K of this step's survivals with K from estimates
    `lag` steps old, like `StalePolicy`.

    Two calls per step instead of one:

        decision, rows = policy.decide(slot_ids=s, generations=g)   # before drafting
        # draft only the batch positions `rows` (all of them, a few on a probe, none: plain decode)
        verify_lengths = policy.plan(confidences=c, slot_ids=s[rows], generations=g[rows])
        policy.observe(slot_ids=s[rows], generations=g[rows], confidences=c, verify_lengths=verify_lengths,
                       num_accepted=a)   # after the verify, for the audit

    Information enters the decision only `lag` steps after it was produced (drafts and verify
    outcomes alike), so under overlap scheduling the decision for step t never waits for step t-1.
    A request's estimate is the mean survival of its matured drafts, shrunk toward the running mean of
    all matured drafts by `estimate_strength` drafts' worth (fused.mature_pass): a step's confidences say
    much about that step's acceptance and next to nothing about the step two later. Requests never
    drafted take the mean of the known rows of the batch; a batch of only new requests (requests served
    one at a time) takes the running mean.
    The audit forgets with `audit_decay` per observed step (recent acceptance counts most).

    `guard=True` audits what the table says steps cost (`switch.RateGuard`): each step's wall time (decide to
    next decide, on `clock`) against the seconds the table predicted, per kind of step, as `audit_ratios`
    audits acceptance against the confidences; the switch compares the corrected rates: speculate iff
    g_spec x spec > (1 + margin) x g_plain x plain, g = (predicted tokens + guard_prior) / (realized seconds x
    predicted rate + guard_prior) per request, sums decayed by `guard_decay`. A speculative step is credited
    the tokens the estimates predicted, not those it committed: the acceptance audit already corrects those,
    and counting them twice shut speculation off for good after a few unlucky drafts. Timings only change
    which tokens are verified, never which are accepted."""

    name = "auto"

    def __init__(
        self,
        sps_table: SpsTable,
        *,
        lag: int = 2,
        draft_seconds: float | None = None,
        margin: float = 0.05,
        probe_interval: int = 16,
        max_probe_interval: int = 256,
        probe_rows: int = 4,
        audit_prior: float = 4.0,
        audit_decay: float = 0.95,
        estimate_strength: float = 8.0,
        guard: bool = False,
        guard_prior: float = switch.GUARD_PRIOR,
        guard_decay: float = 0.97,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        super().__init__(sps_table, allow_uninitialised=False)
        if lag < 1:
            raise ValueError(f"lag must be >= 1 (2 for overlap scheduling), got {lag}")
        if not 1 <= probe_interval <= max_probe_interval:
            raise ValueError(f"need 1 <= probe_interval <= max_probe_interval, got {probe_interval}, "
                             f"{max_probe_interval}")
        if audit_prior <= 0 or not 0 < audit_decay <= 1:
            raise ValueError(f"need audit_prior > 0 and 0 < audit_decay <= 1, got {audit_prior}, {audit_decay}")
        if not estimate_strength >= 0:
            raise ValueError(f"estimate_strength must be >= 0 (drafts' worth of the prior), got {estimate_strength}")
        self.estimate_strength = float(estimate_strength)
        self.costs = switch.StepCosts(sps_table, draft_seconds=draft_seconds)
        self.lag, self.margin, self.probe_rows = lag, margin, probe_rows
        self.initial_interval, self.max_interval = probe_interval, max_probe_interval
        self.audit_prior, self.audit_decay = audit_prior, audit_decay
        self.guard = guard
        # the realized-rate audit; its tokens arrive before the next decide (observe), so token_lag=0
        self._rate_guard = switch.RateGuard(prior=guard_prior, decay=guard_decay, token_lag=0, clock=clock)
        self.probe_interval = probe_interval
        self.last_decision: switch.SpeculationDecision | None = None
        self._block_size: int | None = None
        # host state, numpy, read by the compiled passes of fused.py (the decision runs every step: one numpy
        # call costs ~1 us, a torch op several; the passes do a step's work in one call each)
        # [block_size, slots] each request's estimate as conditionals (slot-major: contiguous per slot j), from
        # the sum of its matured survivals and their count, shrunk toward the prior (fused.mature_pass)
        self._conf = np.zeros((0, 0))
        self._surv_sum = np.zeros((0, 0))
        self._count = np.zeros(0, dtype=np.int64)
        self._gen = np.full(0, -1, dtype=np.int64)  # generation those belong to (-1: none)
        self._drafted_at = np.full(0, _NEVER, dtype=np.int64)  # step of the slot's last draft
        self._pending: deque = deque()  # (step, slot_ids, generations, confidences), not yet matured
        self._pending_audit: deque = deque()  # (step, accepted [block_size], predicted [block_size])
        self._accepted = np.zeros(0)
        self._predicted = np.zeros(0)
        self._ratios = np.zeros(0)
        self._prior = np.zeros(0)  # conditionals of the running mean survival (once _has_prior)
        self._prior_surv = np.zeros(0)  # the running mean survival of matured drafts, per slot
        self._has_prior = False
        self._last_draft_step = _NEVER
        self._probes = self._spec_steps = 0
        self._clock = 0  # steps decided so far (decide() owns it)
        self._rows_cache: dict[int, torch.Tensor] = {}  # n -> arange(n): the rows of a step that drafts all
        # plan()'s input and its [block_size, B] host copy
        self._planned: tuple[torch.Tensor, np.ndarray] | None = None
        self._scratch = np.empty(0)  # survival_pass's survivals
        self._decided_ids: tuple | None = None
        fused.warm_up()

    # ---- state ---------------------------------------------------------------------------------

    def _ensure(self, *, slots: int, block_size: int | None) -> None:
        if block_size is not None and self._block_size is None:
            self._block_size = block_size
            self._conf = np.zeros((block_size, self._conf.shape[1]))
            self._surv_sum = np.zeros((block_size, self._conf.shape[1]))
            self._prior, self._prior_surv = np.zeros(block_size), np.zeros(block_size)
            self._accepted, self._predicted = np.zeros(block_size), np.zeros(block_size)
            self._ratios = np.ones(block_size)
        elif block_size is not None and block_size != self._block_size:
            raise ValueError(f"AutoPolicy was planning block_size={self._block_size} slots, got "
                             f"block_size={block_size}")
        have = self._gen.shape[0]
        if slots > have:
            size = max(slots, 2 * have, 64)
            conf = np.zeros((self._block_size or 0, size))
            conf[:, :have] = self._conf
            surv_sum = np.zeros((self._block_size or 0, size))
            surv_sum[:, :have] = self._surv_sum
            count = np.zeros(size, dtype=np.int64)
            count[:have] = self._count
            gen = np.full(size, -1, dtype=np.int64)
            gen[:have] = self._gen
            drafted = np.full(size, _NEVER, dtype=np.int64)
            drafted[:have] = self._drafted_at
            self._conf, self._gen, self._drafted_at = conf, gen, drafted
            self._surv_sum, self._count = surv_sum, count

    def _mature(self, step: int) -> None:
        while self._pending and self._pending[0][0] <= step - self.lag:
            _, slots, gens, conf = self._pending.popleft()  # conf [block_size, rows]
            # each request's shrunk mean survival, and the running mean (the estimate for a batch of requests
            # never drafted)
            self._has_prior |= fused.mature_pass(self._conf, self._gen, self._surv_sum, self._count,
                                                 self._prior_surv, self._prior, slots, gens, conf, self._has_prior,
                                                 self.estimate_strength)
        while self._pending_audit and self._pending_audit[0][0] <= step - self.lag:
            _, acc, pred = self._pending_audit.popleft()
            fused.fold_audit(self._accepted, self._predicted, acc, pred, self.audit_decay, self.audit_prior,
                             self._ratios)

    def audit_ratios(self) -> torch.Tensor:
        """rho_j = (accepted_j + prior x rho_{j-1}) / (predicted_j + prior), rho_{-1} = 1, over matured outcomes."""
        return torch.from_numpy(self._ratios.copy())

    @staticmethod
    def _host_ids(confidences_rows: int, slot_ids: torch.Tensor, generations: torch.Tensor):
        for name, t in (("slot_ids", slot_ids), ("generations", generations)):
            if t.dim() != 1 or t.shape[0] != confidences_rows or t.dtype != torch.long:
                raise ValueError(f"{name} must be a [B={confidences_rows}] long tensor, got {tuple(t.shape)} "
                                 f"{t.dtype}")
        s, g = slot_ids.cpu().numpy(), generations.cpu().numpy()
        if not s.size:
            return s, g, 0
        low, high = fused.index_bounds(s)
        if low < 0:
            raise ValueError("slot_ids must be >= 0")
        return s, g, int(high) + 1

    # ---- the three calls -----------------------------------------------------------------------

    def decide(self, *, slot_ids: torch.Tensor, generations: torch.Tensor):
        """(SpeculationDecision, batch positions to draft [D] long, ascending)."""
        n = slot_ids.shape[0]
        s, g, slots = self._host_ids(n, slot_ids, generations)
        self._decided_ids = (slot_ids, generations, s, g, slots)  # plan() of an all-rows step reuses them
        step = self._clock
        self._clock += 1
        self._ensure(slots=slots, block_size=None)
        self._mature(step)
        block_size = self._block_size or 0
        if n and block_size:
            verify = self.costs.verify_seconds_upto(end=n * (block_size + 1) + 1, num_reqs=n)
            if self._scratch.size < n * block_size:
                self._scratch = np.empty(2 * n * block_size)
            num_known, _, best_n, best_rate = fused.best_speculation(
                self._conf, self._gen, s, g, self._ratios, self._prior, self._has_prior, verify,
                self.costs.draft_seconds(n), 0.0, self._scratch)
        else:
            num_known = int(np.count_nonzero(self._gen.take(s) == g))
            best_n, best_rate = 0, 0.0
        plain_rate = n * self.costs.plain_steps_per_sec(n) if n else 0.0
        if self.guard:
            self._rate_guard.end()
        if n:
            decision = switch.decision_from_best(
                num_reqs=n, best_n=best_n, best_rate=best_rate * self.guard_spec,
                plain_rate=plain_rate * self.guard_plain, steps_since_draft=step - self._last_draft_step,
                probe_interval=self.probe_interval, probe_rows=self.probe_rows, margin=self.margin)
        else:
            decision = switch.SpeculationDecision(False, 0, False, 0, 0, 0.0, 0.0)
        if self.guard:
            kind = "probe" if decision.probe else ("spec" if decision.speculate else "plain")
            if n:
                # the guard audits seconds only: a speculative step is credited the tokens it was predicted to
                # commit, so its scale is predicted / realized wall time. Acceptance has its own audit (the
                # ratios), and a guard that counted the accepted tokens too would charge one shortfall twice
                # (it kept single-request speculation off after a few unlucky drafts)
                tokens = float(n)
                if kind == "spec":
                    tokens = best_rate * (self.costs.draft_seconds(n) + float(verify[n + best_n]))
                self._rate_guard.begin(kind=kind, predicted_rate=best_rate if kind == "spec" else plain_rate,
                                       num_reqs=n, tokens=tokens)
        self.probe_interval = switch.next_probe_interval(decision=decision, probe_interval=self.probe_interval,
                                                         initial=self.initial_interval, maximum=self.max_interval)
        if decision.probe:  # the rows whose information is oldest (never drafted first), then lower index
            known = self._gen.take(s) == g
            age = step - np.where(known, self._drafted_at[s], _NEVER)
            rows = torch.from_numpy(np.sort(np.argsort(-age, kind="stable")[: decision.draft_rows]))
        elif decision.speculate:
            rows = self._rows_upto(n)
        else:
            rows = self._rows_upto(0)
        if decision.speculate:
            self._last_draft_step = step
            self._probes += decision.probe
            self._spec_steps += 1
        else:  # a plain step: plan() is not called
            self._steps += 1
            self._last = 0
        self.last_decision = decision
        self._unknown += n - num_known
        return decision, rows

    @property
    def guard_spec(self) -> float:
        """Realized / predicted rate of speculative steps (1: nothing measured)."""
        return self._rate_guard.scale("spec")

    @property
    def guard_plain(self) -> float:
        """Realized / predicted rate of plain steps (1: nothing measured)."""
        return self._rate_guard.scale("plain")

    def _rows_upto(self, n: int) -> torch.Tensor:
        """torch.arange(n), from a cache (one torch op costs as much as several numpy steps here)."""
        if n not in self._rows_cache:
            if len(self._rows_cache) > 64:
                self._rows_cache.clear()
            self._rows_cache[n] = torch.arange(n)
        return self._rows_cache[n]

    def plan(self, *, confidences: torch.Tensor, slot_ids: torch.Tensor, generations: torch.Tensor):
        """The verify lengths of the drafted rows of the step `decide` just planned."""
        if confidences.dim() != 2:
            raise ValueError(f"confidences must be [B, block_size], got shape {tuple(confidences.shape)}")
        b, block_size = confidences.shape
        ids = self._decided_ids
        if ids is not None and ids[0] is slot_ids and ids[1] is generations:  # the tensors decide() just read
            s, g, slots = ids[2:]
        else:
            s, g, slots = self._host_ids(b, slot_ids, generations)
        decision = self.last_decision
        if decision is None or not decision.speculate:
            raise ValueError("AutoPolicy.plan: call decide() first, and draft only when it says speculate")
        if self._block_size is not None and block_size != self._block_size:
            raise ValueError(f"AutoPolicy was planning block_size={self._block_size} slots, got "
                             f"block_size={block_size}")
        conf = np.empty((block_size, b))  # [block_size, B] float64, a copy: the pending snapshot owns it
        verify_lengths = np.empty(b, dtype=np.int64)
        ratios = self._ratios if self._block_size is not None else np.ones(block_size)
        self._ensure(slots=slots, block_size=None)
        step = self._clock - 1
        host = confidences if not confidences.is_cuda else confidences.cpu()
        total = fused.plan_pass((host.detach() if host.requires_grad else host).numpy(), ratios, decision.budget,
                                conf, verify_lengths, s, self._drafted_at, step)
        if total < 0:
            raise ValueError("confidences must be calibrated probabilities in [0, 1] (apply sigmoid/STS to the raw "
                             "confidence logits first); got values outside [0, 1] or NaN")
        if self._block_size is None:
            self._ensure(slots=0, block_size=block_size)
        self._pending.append((step, s.copy(), g.copy(), conf))
        self._planned = (confidences, conf)
        if decision.probe and block_size:  # a probe verifies its rows' whole blocks: the audit learns every slot
            verify_lengths[:] = block_size
            total = b * block_size
        self._steps += 1
        self._last = total
        self._total += self._last
        verify_lengths = torch.from_numpy(verify_lengths)
        return verify_lengths if confidences.device.type == "cpu" else verify_lengths.to(confidences.device)

    def observe(self, *, slot_ids: torch.Tensor, generations: torch.Tensor, confidences: torch.Tensor,
                verify_lengths: torch.Tensor, num_accepted: torch.Tensor) -> None:
        """Outcomes of the rows `plan` just planned (confidences as passed to plan)."""
        if confidences.shape[0] == 0:
            return
        planned = self._planned
        if planned is not None and planned[0] is confidences:  # plan's host copy, [block_size, B]
            acc, pred = np.empty(planned[1].shape[0]), np.empty(planned[1].shape[0])
            fused.audit_pass(planned[1], verify_lengths.cpu().numpy().astype(np.int64, copy=False),
                             num_accepted.cpu().numpy().astype(np.int64, copy=False), acc, pred)
        else:
            acc, pred = (t.numpy() for t in switch.audit_counts(
                confidences=confidences, verify_lengths=verify_lengths, num_accepted=num_accepted))
        self._pending_audit.append((self._clock - 1, acc, pred))

    def stats(self) -> PolicyStats:
        return msgspec.structs.replace(super().stats(), speculative_steps=self._spec_steps, probes=self._probes)
