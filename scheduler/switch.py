"""Speculate or decode plainly: the per-step switch that keeps speculation from ever losing to plain decoding.

A speculative step over N requests costs a draft forward plus a verify of B = N + n tokens and commits
N + (admitted survivals) tokens in expectation; a plain decode step costs one forward of N tokens and
commits N. The switch compares the two rates, with every cost taken from the profiled table
(`StepCosts`: verify steps/s, plain-decode steps/s and the drafter's seconds, `SpsCostTable`):

    spec(n)  = (N + S(n)) / (draft_seconds(N) + verify(N, N + n))     S(n) = sum of the n largest survivals
    verify(N, B) = max(1 / SPS(B), floor(N))       floor(N): the least the table says a step over N requests costs
    plain    = N x plain_steps_per_sec(N)
    speculate  iff  max_n spec(n) > (1 + margin) x plain  and the argmax n* > 0; then verify n* drafts.

The survivals it reads are estimates from information at least `lag` steps old (the two-step-stale rule
of `StalePolicy`, so the switch works under overlap scheduling): each request's estimated calibrated
confidences (AutoPolicy and the SGLang switch: the mean survival of its drafts, shrunk toward all requests'
mean), corrected per slot by an acceptance audit `rho_j = (accepted_j + prior x rho_{j-1}) /
(predicted_j + prior)`, rho_{-1} = 1 (observed accepts over the confidences predicted for the same
verified slots, each slot shrunk toward the slot before it, so slots seldom verified inherit the
correction of the ones that are; an untrained or miscalibrated head that promises 0.5 and delivers 0 is
caught within a few verified slots), and for
requests never drafted the mean of the known ones (`estimated_survival`; both fall back to the running mean
survival of earlier requests when no request of the batch is known).

While it decodes plainly no confidences arrive, so it probes: when `probe_interval` steps have passed
since the last draft (and at the very first step), it drafts `probe_rows` requests (those whose
information is oldest) and verifies their drafts (AutoPolicy: whole blocks), which refreshes both their
confidences and the audit. The interval doubles after every probe that does not switch speculation back
on, up to a maximum, and resets when it does (`next_probe_interval`): a probe costs one draft forward over
a few rows, so over T plain steps the probes cost O(log T) draft forwards.

Lossless: the switch only changes how many tokens are verified, never which are accepted. Every input
of the decision is fixed before this step's drafts exist, the per-request lengths are the top-K of this
step's survivals in the planners' order (non-anticipating, as for `StalePolicy`), and a step with verify
length 0 is exactly a plain decode step: the target's distribution at the anchor, sampled the same way.

Entry points (keyword-only, pure, torch on the host): `decide_speculation` (= `best_speculation`, the
rate argmax, then `decision_from_best`, the comparison and the probe), `estimated_survival`,
`audit_counts`, `next_probe_interval`; `StepCosts` is the vectorised cost lookup. Each rule is written
here once. The stateful wrapper an engine calls is `AutoPolicy` (scheduler/policy.py); its per-step host
work runs as the compiled twins of these functions (scheduler/fused.py, faster per step), which
tests/scheduler/test_fused.py holds to them on random inputs, and decides with the same
`decision_from_best`. The decision runs on host tensors (no device read-back); the lengths of a
speculative step come from `planner.topk_lengths`, which stays on the device without a sync.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch

from .planner import check_confidences
from .sps import SpsCostTable, SpsCurve, SpsTable


class StepCosts:
    """Everything a step costs, from one SPS table: verify seconds at B batch tokens, plain-decode
    seconds and draft seconds at N requests (dense numpy caches: O(1) per lookup on the hot path).

    `draft_seconds` overrides the table's drafter column (e.g. a drafter that costs nothing, n-gram
    lookup, or a table profiled without a drafter). Without plain probes (SGLang's own tables) a plain
    step costs what the anchor-only verify of N tokens costs.

    A verify probe of B tokens was measured over the fewest requests that fill it (B / tokens per
    request), and a step over more requests costs more (per-request attention and bookkeeping, and the
    drafter's rows), so the verify seconds of a step over N requests are floored by what the table
    measured at N requests (`verify_floor_seconds`):

    - with plain probes, a plain step of N requests: a verify of N + n >= N tokens over N requests costs
      at least as much;
    - with `block_size` (the drafts per request of the table's probes, when its step times are whole
      drafting steps, the draft forward included: SGLang's profiler, which measures N x (block_size + 1)
      tokens over N requests and leaves no drafter column), the profiled step of N requests at full
      blocks: the table holds nothing cheaper for a drafting step over N requests. Conservative in
      compact mode, where a step verifies fewer tokens than a full block."""

    def __init__(self, table: SpsTable, *, draft_seconds: float | None = None,
                 block_size: int | None = None) -> None:
        if draft_seconds is not None and not (draft_seconds >= 0 and np.isfinite(draft_seconds)):
            raise ValueError(f"draft_seconds must be finite and >= 0, got {draft_seconds}")
        if block_size is not None and block_size < 0:
            raise ValueError(f"block_size must be >= 0 drafts per request, got {block_size}")
        self.table = table
        self.sps = SpsCurve(table)
        self._draft_override = draft_seconds
        self._block_size = block_size
        self._verify_seconds = np.zeros(0)
        self._verify_reqs: int | None = None
        self._floored = np.zeros(0)
        self._base_version = 0  # bumped when the base cache is rebuilt
        self._floored_key: tuple[int, int] | None = None  # (num_reqs, base version) it was built from

    def plain_steps_per_sec(self, num_reqs: int) -> float:
        t = self.table
        if isinstance(t, SpsCostTable):
            return t.plain_lookup(num_reqs)
        return 1.0 / t.step_time(num_reqs=num_reqs, budget=0)

    def draft_seconds(self, num_reqs: int) -> float:
        if self._draft_override is not None:
            return self._draft_override
        t = self.table
        return t.draft_lookup(num_reqs) if isinstance(t, SpsCostTable) else 0.0

    def verify_floor_seconds(self, num_reqs: int) -> float:
        """The least a verify over `num_reqs` requests costs, by the table (0: no floor; inf: past capacity)."""
        t = self.table
        floor = 0.0
        if isinstance(t, SpsCostTable) and t.has_plain:
            floor = 1.0 / t.plain_lookup(num_reqs)
        if self._block_size is not None:
            full = self.sps.scalar(batch_tokens=num_reqs * (self._block_size + 1), num_reqs=num_reqs)
            floor = max(floor, 1.0 / full if full > 0 else float("inf"))
        return floor

    def _base_verify_seconds(self, *, upto: int, num_reqs: int) -> np.ndarray:
        additive = not isinstance(self.table, SpsCostTable)
        if upto > self._verify_seconds.size or (additive and num_reqs != self._verify_reqs):
            sps = self.sps.steps_per_sec_range(start=0, count=max(upto, 2 * self._verify_seconds.size, 64),
                                               num_reqs=num_reqs).numpy()
            with np.errstate(divide="ignore"):
                self._verify_seconds = 1.0 / sps  # 0 steps/s (past capacity) -> inf seconds
            self._verify_reqs = num_reqs
            self._base_version += 1
        return self._verify_seconds

    def verify_seconds_upto(self, *, end: int, num_reqs: int) -> np.ndarray:
        """Verify seconds over `num_reqs` requests indexed by batch tokens, floored (the class docstring),
        at least `end` long (a cache: AutoPolicy's compiled decision reads it whole)."""
        base = self._base_verify_seconds(upto=end, num_reqs=num_reqs)
        floor = self.verify_floor_seconds(num_reqs)
        if floor <= 0.0:
            return base
        key = (num_reqs, self._base_version)
        if self._floored_key != key:
            self._floored = np.maximum(base, floor)
            self._floored_key = key
        return self._floored

    def verify_seconds_range(self, *, start: int, count: int, num_reqs: int) -> np.ndarray:
        """Seconds of a verify of start, start+1, ..., start+count-1 batch tokens over `num_reqs` requests
        (inf past capacity)."""
        return self.verify_seconds_upto(end=start + count, num_reqs=num_reqs)[start : start + count]


class SpeculationDecision(NamedTuple):
    speculate: bool  # run the drafter this step (always True on a probe)
    budget: int  # draft tokens to verify in all (0 when decoding plainly)
    probe: bool  # speculating to refresh the estimates, not because it pays
    draft_rows: int  # requests to draft: all N when it pays, probe_rows on a probe, 0 otherwise
    best_budget: int  # argmax n of spec(n) over the estimates
    spec_tokens_per_sec: float  # spec(best_budget), draft cost included
    plain_tokens_per_sec: float  # N x plain steps/s


def decide_speculation(
    *,
    survival: torch.Tensor,
    costs: StepCosts,
    known_rows: int,
    steps_since_draft: int,
    probe_interval: int,
    probe_rows: int = 4,
    margin: float = 0.05,
    min_survival: float = 0.0,
    spec_scale: float = 1.0,
    plain_scale: float = 1.0,
) -> SpeculationDecision:
    """One step's switch over N requests (see the module docstring for the rule).

    survival [N, block_size] float (host tensor): estimated survivals from information >= lag steps old
    (`estimated_survival`); known_rows: how many of the N rows those estimates rest on (0 = nothing
    is known yet: decode plainly, probe when due); steps_since_draft: steps since any request was
    last drafted (a large number before the first draft); probe_interval >= 1; probe_rows >= 1;
    margin >= 0: how much faster speculation must look before it is chosen; min_survival: candidates
    below it (or NaN) are never counted (SGLang's survival_eps); spec_scale, plain_scale > 0: the
    realized-rate corrections (`RateGuard.scale`) both rates are multiplied by before they are compared
    (the decision's rates are the scaled ones; the argmax n* does not depend on them)."""
    if survival.dim() != 2:
        raise ValueError(f"survival must be [N, block_size], got shape {tuple(survival.shape)}")
    if survival.device.type != "cpu":
        raise ValueError("decide_speculation reads host tensors (stale estimates live on the host); "
                         "pass survival.cpu() computed off the critical path, not a device tensor")
    if probe_interval < 1 or probe_rows < 1 or margin < 0:
        raise ValueError(f"need probe_interval >= 1, probe_rows >= 1, margin >= 0; got {probe_interval}, "
                         f"{probe_rows}, {margin}")
    if not (spec_scale > 0 and plain_scale > 0):
        raise ValueError(f"need spec_scale > 0 and plain_scale > 0; got {spec_scale}, {plain_scale}")
    num_reqs = survival.shape[0]
    if num_reqs == 0:
        return SpeculationDecision(False, 0, False, 0, 0, 0.0, 0.0)
    best_n, best_rate = 0, 0.0
    if known_rows > 0:
        best_n, best_rate = best_speculation(survival=survival, costs=costs, min_survival=min_survival)
    return decision_from_best(num_reqs=num_reqs, best_n=best_n, best_rate=best_rate * spec_scale,
                              plain_rate=num_reqs * costs.plain_steps_per_sec(num_reqs) * plain_scale,
                              steps_since_draft=steps_since_draft, probe_interval=probe_interval,
                              probe_rows=probe_rows, margin=margin)


def best_speculation(*, survival: torch.Tensor, costs: StepCosts, min_survival: float = 0.0) -> tuple[int, float]:
    """(n*, spec(n*)): the first n maximising spec(n) = (N + a_1 + ... + a_n) / (draft_seconds(N) +
    verify(N, N + n)) over the survivals [N, block_size] (host) that are >= min_survival, taken in
    descending order; tau(n) is summed left to right (fused.best_rate_pass is its compiled twin)."""
    num_reqs = survival.shape[0]
    values = survival.detach().reshape(-1).to(torch.float64)
    values = values[values >= min_survival]  # drops NaN too
    tau = torch.empty(values.numel() + 1, dtype=torch.float64)
    tau[0] = num_reqs
    tau[1:] = torch.sort(values, descending=True).values
    tau = torch.cumsum(tau, 0)
    seconds = costs.verify_seconds_range(start=num_reqs, count=tau.numel(), num_reqs=num_reqs)
    rate = tau / (costs.draft_seconds(num_reqs) + torch.from_numpy(seconds))
    best_n = int(torch.argmax(rate))  # the first maximum
    return best_n, float(rate[best_n])


def decision_from_best(*, num_reqs: int, best_n: int, best_rate: float, plain_rate: float, steps_since_draft: int,
                       probe_interval: int, probe_rows: int, margin: float) -> SpeculationDecision:
    """The switch once the best speculative rate is known: speculate when it beats plain decoding by
    the margin, else probe when due, else decode plainly."""
    if best_n > 0 and best_rate > (1.0 + margin) * plain_rate:
        return SpeculationDecision(True, best_n, False, num_reqs, best_n, best_rate, plain_rate)
    if steps_since_draft >= probe_interval:
        rows = min(probe_rows, num_reqs)
        return SpeculationDecision(True, max(best_n, rows), True, rows, best_n, best_rate, plain_rate)
    return SpeculationDecision(False, 0, False, 0, best_n, best_rate, plain_rate)


def conditionals_of_survival(survival: torch.Tensor) -> torch.Tensor:
    """The per-slot conditionals c_j = S_j / S_{j-1} (S_{-1} = 1; 0 past a zero survival) of survivals
    [..., block_size]: how an estimate kept as a mean survival is handed to the rules above, which take
    conditionals (fused.mature_pass is its compiled twin)."""
    previous = torch.cat([torch.ones_like(survival[..., :1]), survival[..., :-1]], dim=-1)
    return torch.where(previous > 0, survival / previous.clamp_min(1e-300), torch.zeros_like(survival))


def sum_rows_in_order(values: torch.Tensor) -> torch.Tensor:
    """values [R, ...] summed over the rows one after the other, left to right (a reduction may reorder
    the additions; the compiled twins in fused.py add in row order, and the twins agree to the bit)."""
    if values.shape[0] == 0:
        return values.new_zeros(values.shape[1:])
    return torch.cumsum(values, 0)[-1]


def estimated_survival(*, confidences: torch.Tensor, known: torch.Tensor, ratios: torch.Tensor,
                       prior: torch.Tensor | None = None) -> torch.Tensor:
    """Survival estimates [N, block_size] float64 for the switch (host tensors).

    confidences [N, block_size]: each row's estimated calibrated per-slot confidences (any values
    where the row is unknown); known [N] bool; ratios [block_size]: the audit's per-slot correction
    rho_j; prior [block_size]: the per-slot confidences assumed when no row is known (None: 1). Known
    rows: cumprod(clip(c_j x rho_j, 0, 1)); unknown rows: the same over the per-slot mean of the known
    rows' clip(c_j x rho_j, 0, 1), or over clip(prior_j x rho_j, 0, 1) when no row is known
    (fused.survival_pass is its compiled twin)."""
    if confidences.dim() != 2 or known.shape != confidences.shape[:1] or ratios.shape != confidences.shape[1:]:
        raise ValueError(f"need confidences [N, block_size], known [N], ratios [block_size]; got "
                         f"{tuple(confidences.shape)}, {tuple(known.shape)}, {tuple(ratios.shape)}")
    if prior is not None and prior.shape != ratios.shape:
        raise ValueError(f"prior must be [block_size={ratios.shape[0]}], got {tuple(prior.shape)}")
    ratios = ratios.detach().to(torch.float64)
    corrected = (confidences.detach().to(torch.float64) * ratios).clamp_(0.0, 1.0)
    known = known.to(torch.bool)
    num_known = int(known.sum())
    if num_known < known.numel():
        if num_known:
            fill = sum_rows_in_order(corrected[known]) / num_known
        else:
            fill = (ratios if prior is None else prior.detach().to(torch.float64) * ratios).clamp(0.0, 1.0)
        corrected[~known] = fill
    return torch.cumprod(corrected, dim=1)


def audit_counts(
    *, confidences: torch.Tensor, verify_lengths: torch.Tensor, num_accepted: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(accepted [block_size], predicted [block_size]) float64 of one verified step: slot j of row r
    counts when it was verified with every earlier slot kept (j < min(verify_length, num_accepted + 1));
    accepted adds 1 if it was kept, predicted adds its calibrated confidence c_{r,j} (fused.audit_pass
    is its compiled twin)."""
    check_confidences(confidences)
    slot = torch.arange(confidences.shape[1], device=confidences.device)[None, :]
    num_accepted = num_accepted.to(confidences.device)[:, None]
    attempted = slot < torch.minimum(verify_lengths.to(confidences.device)[:, None], num_accepted + 1)
    kept = attempted & (slot < num_accepted)
    accepted = kept.to(torch.float64).sum(0)  # whole numbers: any order is exact
    predicted = sum_rows_in_order(torch.where(attempted, confidences.detach().to(torch.float64), 0.0))
    return accepted, predicted


def next_probe_interval(*, decision: SpeculationDecision, probe_interval: int, initial: int, maximum: int) -> int:
    """Double after a probe (speculation still does not pay), back to `initial` once it pays."""
    if decision.probe:
        return min(2 * probe_interval, maximum)
    if decision.speculate:
        return initial
    return probe_interval


# the guard's prior, in tokens per request: ~2 steps of evidence before a realized shortfall moves a decision.
# Swept on the engine (docs/results.md, "Speculate or decode"): 4 kept every cell within 6 % of plain decoding,
# 16 and 64 lost 14-15 % at 4 requests on MT-Bench (they needed ~10 speculative steps to react)
GUARD_PRIOR = 4.0


class RateGuard:
    """The switch's realized-rate audit (host state, keyword-only calls): per kind of step, speculative or
    plain, the tokens committed against the tokens the switch's predicted rate would have committed in the
    step's wall time. The table and the survival estimates can both be off (a table profiled on random tokens,
    a noisy probe, stale estimates that overshoot), and the switch then speculates where it loses; this closes
    the loop on what the switch is for, tokens per second. A caller that audits acceptance on its own
    (AutoPolicy's ratios) credits a speculative step the tokens it predicted, so that the scale audits seconds
    only and a shortfall of accepted drafts is not charged twice.

    A step runs from one `begin` to the next `begin` (or `end`) on `clock`: under overlap scheduling that is
    the pipeline's step period. Its tokens may arrive later than its end (`set_tokens`, e.g. once an
    asynchronous device-to-host copy has landed): an ended step waits while fewer than `token_lag` later
    steps have ended, and is dropped after. Its predicted tokens are bounded to [1/4, 4] x the committed ones,
    so that a step that also ran a prefill cannot swing the sums; `interrupt` drops the open step outright (a
    prefill ran between two decode steps). Probe steps feed neither kind (their shape is not the switch's).

        scale('plain') = (committed + prior) / (predicted + prior)   sums decayed by `decay` per step of that kind
        scale('spec') = (committed + prior x scale('plain')) / (predicted + prior)

    and the switch compares scale('spec') x spec against (1 + margin) x scale('plain') x plain. Both sums are
    per request (a step's tokens divided by its requests), so that the prior and the decay weigh steps whatever
    their batch: the noise of a step's wall time does not shrink with the batch (counted in tokens, a step of
    32 requests outweighed the prior alone and one noisy step could switch speculation off). A speculative
    step's scale shrinks toward plain's, not toward 1: a machine that runs its plain steps 14 % faster than
    when the table was profiled runs its drafting steps faster too, and a switch that had measured only plain
    steps favoured them by that much. Once speculation is off scale('spec') keeps its measured bias relative
    to plain: the bias of this machinery on this machine, and speculation comes back when the estimates rise
    past it (a scale drifting back to 1 retried every few steps and lost each time). Timings only change
    which tokens are verified, never which are accepted."""

    KINDS = ("spec", "plain", "probe")

    def __init__(self, *, prior: float = GUARD_PRIOR, decay: float = 0.97, token_lag: int = 0,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        if not prior > 0 or not 0 < decay <= 1 or token_lag < 0:
            raise ValueError(f"need guard_prior > 0, 0 < guard_decay <= 1 and token_lag >= 0; got {prior}, {decay}, "
                             f"{token_lag}")
        self.prior, self.decay, self.token_lag, self.clock = float(prior), float(decay), int(token_lag), clock
        self._sums = {"spec": [0.0, 0.0], "plain": [0.0, 0.0]}  # [committed, predicted] per kind
        self._open: list | None = None  # [start, kind, predicted tok/s, tokens or None, seconds, end number, requests]
        self._ended: deque = deque()  # steps ended, waiting for their tokens
        self._ends = 0  # steps ended so far

    def begin(self, *, kind: str, predicted_rate: float, num_reqs: int, tokens: int | None = None) -> list:
        """Ends the open step and opens one of `kind` over `num_reqs` requests whose predicted rate is
        `predicted_rate` tokens/s; the handle is what `set_tokens` takes."""
        if kind not in self.KINDS:
            raise ValueError(f"kind must be one of {self.KINDS}, got {kind!r}")
        if num_reqs < 1:
            raise ValueError(f"num_reqs must be >= 1, got {num_reqs}")
        now = self.clock()
        self._end(now)
        self._open = [now, kind, float(predicted_rate), tokens, None, None, int(num_reqs)]
        return self._open

    def end(self) -> None:
        """Ends the open step (if any) now, and folds what can be folded."""
        self._end(self.clock())

    def interrupt(self) -> None:
        """Drops the open step: something else ran in its wall time."""
        self._open = None

    @staticmethod
    def set_tokens(step: list, tokens: int) -> None:
        step[3] = int(tokens)

    def scale(self, kind: str) -> float:
        """Realized / predicted rate of `kind` steps: plain's shrinks toward 1, a speculative step's toward
        plain's (1: nothing measured)."""
        self._fold()
        committed, predicted = self._sums[kind]
        anchor = 1.0 if kind == "plain" else self.scale("plain")
        return (committed + self.prior * anchor) / (predicted + self.prior)

    def _end(self, now: float) -> None:
        step, self._open = self._open, None
        if step is not None:
            step[4], step[5] = now - step[0], self._ends
            self._ends += 1
            self._ended.append(step)
        self._fold()

    def _fold(self) -> None:
        ended = self._ended
        while ended:
            _, kind, predicted, tokens, seconds, ended_at, num_reqs = ended[0]
            if tokens is None and kind != "probe" and self._ends - 1 - ended_at < self.token_lag:
                return  # fewer than token_lag steps have ended since: its tokens may still come
            ended.popleft()
            if kind == "probe" or tokens is None or predicted <= 0 or seconds <= 0:
                continue
            sums = self._sums[kind]
            expected = min(4.0 * tokens, max(0.25 * tokens, seconds * predicted))
            sums[0] = self.decay * sums[0] + tokens / num_reqs
            sums[1] = self.decay * sums[1] + expected / num_reqs
