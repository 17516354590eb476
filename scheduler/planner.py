"""Hardware-aware prefix planners: how many draft tokens each request verifies this step.

Objective (DSpark): Theta = tau* x SPS(B). With N requests and n admitted draft tokens,
tau* = N + (sum of the admitted survivals) and B = N + n, i.e. B = sum_r (1 + verify_length_r): every request
verifies its anchor. Survival a_{r,j} = prod_{i<=j} c_{r,i} is non-increasing in j, so admitting
candidates in one global descending order always yields per-request prefixes.

Candidate order (the tie-break, shared by every function here): higher survival, then earlier slot j,
then lower request index r. All planners are keyword-only pure functions; the `*_reference` twins are
plain Python loops that the tests hold the torch versions to.

- exact (Algorithm 1): admit in order and stop at the first candidate that does not raise Theta. The
  decision to verify slot j never reads c_{j+1}, which depends on the drafted token x_j through the
  Markov feature, so the output distribution stays the target's (non-anticipation, Appendix A).
- stale (production): the budget K is the argmax of Theta over all prefixes of survivals two steps old
  (no early stop needed: old confidences cannot leak this step's tokens); the verify lengths are the top-K of
  this step's survivals.

- tree (engine/tree.py): every request verifies its root and the tree's main branch; of the other nodes,
  whose values (the estimated probability that the target reaches and keeps them) never exceed their
  parent's, the n best by value are verified, n maximising Theta over every n. The best n of a set closed
  under "value <= parent's value" is itself a tree (ties go to the earlier node).

`min_survival` (argmax_budget / topk_lengths and their references; DSpark's `survival_eps`, 1e-6 in
SGLang): candidates with a lower survival (or NaN) are never admitted, neither counted in the Theta
curve nor verified. The SGLang plugin passes SGLang's value (sglang_plugin/planner_hooks.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np
import torch

from .sps import SpsCurve

# (batch_tokens, num_reqs) -> steps/s
SpsFn = Callable[[int, int], float]


def check_confidences(confidences: torch.Tensor) -> None:
    if confidences.dim() != 2:
        raise ValueError(f"confidences must be [B, block_size], got shape {tuple(confidences.shape)}")
    if not confidences.is_floating_point():
        raise ValueError(f"confidences must be floating point probabilities, got {confidences.dtype}")
    # One reduction (NaN fails too): this runs on every step's hot path.
    if confidences.numel() and not bool((confidences - 0.5).abs_().max() <= 0.5):
        raise ValueError(
            "confidences must be calibrated probabilities in [0, 1] (apply sigmoid/STS to the raw "
            "confidence logits first); got values outside [0, 1] or NaN"
        )


def survivals(*, confidences: torch.Tensor) -> torch.Tensor:
    """a_{r,j} = prod_{i<=j} c_{r,i}, float64 [B, block_size]."""
    check_confidences(confidences)
    return torch.cumprod(confidences.to(torch.float64), dim=1)


def candidate_order(*, survival: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted survivals, flat indices m = j * B + r), in the shared tie-break order."""
    # Slot-major flattening + a stable descending sort = ties go to the earlier slot, then lower r.
    flat = survival.t().reshape(-1)
    values, order = torch.sort(flat, descending=True, stable=True)
    return values, order


def theta_curve(*, sorted_survival: torch.Tensor, num_reqs: int, sps: SpsCurve) -> torch.Tensor:
    """Theta(n) for n = 0..M admitted candidates, float64 [M + 1] (tau summed in float64 whatever
    the survivals' dtype)."""
    sorted_survival = sorted_survival.to(torch.float64)
    tau = torch.cat([sorted_survival.new_zeros(1), torch.cumsum(sorted_survival, 0)]).add_(num_reqs)
    sps_values = sps.steps_per_sec_range(start=num_reqs, count=sorted_survival.numel() + 1, num_reqs=num_reqs)
    return tau.mul_(sps_values.to(tau.device))


def _lengths_from_order(
    *, order: torch.Tensor, budget: int, num_reqs: int, admitted: torch.Tensor | None = None
) -> torch.Tensor:
    # scatter_add, not bincount: bincount on CUDA reads the max index back to the host (a sync).
    rows = order[:budget] % num_reqs
    counts = torch.ones_like(rows) if admitted is None else admitted[:budget].to(rows.dtype)
    return torch.zeros(num_reqs, dtype=torch.long, device=order.device).scatter_add_(0, rows, counts)


def _below_to_neg_inf(survival: torch.Tensor, min_survival: float) -> torch.Tensor:
    """Candidates under `min_survival` (and NaN) become -inf: last in the order, never admitted."""
    return torch.where(survival >= min_survival, survival, survival.new_full((), float("-inf")))


def exact_lengths(*, confidences: torch.Tensor, sps: SpsCurve) -> tuple[torch.Tensor, int]:
    """DSpark Algorithm 1 with early stop. Returns (verify lengths [B] long in 0..block_size, admitted budget)."""
    surv = survivals(confidences=confidences)
    num_reqs = surv.shape[0]
    if surv.numel() == 0:
        return torch.zeros(num_reqs, dtype=torch.long), 0
    values, order = candidate_order(survival=surv)
    theta = theta_curve(sorted_survival=values, num_reqs=num_reqs, sps=sps)
    # First n whose successor does not raise Theta; a trailing True stops after the last candidate.
    stop = torch.cat([theta[1:] <= theta[:-1], torch.ones(1, dtype=torch.bool)])
    budget = int(torch.argmax(stop.to(torch.uint8)))
    return _lengths_from_order(order=order, budget=budget, num_reqs=num_reqs), budget


class BudgetChoice(NamedTuple):
    budget: int  # admitted draft tokens n (batch tokens N + n)
    theta: float  # Theta(n) = tau* x SPS(N + n)
    steps_per_sec: float  # SPS(N + n)


def budget_choice(*, survival: torch.Tensor, sps: SpsCurve, min_survival: float = 0.0) -> BudgetChoice:
    """The n maximising Theta over every prefix of the sorted survivals (first maximum on ties),
    with Theta and SPS there. Host-side: reads the argmax back."""
    num_reqs = survival.shape[0]
    values, _ = candidate_order(survival=_below_to_neg_inf(survival, min_survival))
    values = values[: int(torch.count_nonzero(values != float("-inf")))]
    theta = theta_curve(sorted_survival=values, num_reqs=num_reqs, sps=sps)
    n = int(torch.argmax(theta))
    steps = sps.steps_per_sec_range(start=num_reqs + n, count=1, num_reqs=num_reqs)
    return BudgetChoice(budget=n, theta=float(theta[n]), steps_per_sec=float(steps[0]))


def tree_extra_budget(*, extra_values: torch.Tensor, forced_tau: float, forced_tokens: int, num_reqs: int,
                      sps: SpsCurve, fixed_seconds: float = 0.0) -> int:
    """How many of the trees' optional nodes to verify: the n maximising Theta(n) = (forced_tau + the n
    largest `extra_values`) / (1 / SPS(forced_tokens + n) + fixed_seconds) (first maximum on ties).
    forced_tokens: the rows every request verifies anyway (its root and main branch), forced_tau: their
    expected tokens (1 per request for the bonus token plus the main branch's values); fixed_seconds: what a
    step costs besides its verify whatever the rows (the drafter's forward: the SPS table's draft column),
    which makes an extra row relatively cheaper."""
    if fixed_seconds < 0:
        raise ValueError(f"fixed_seconds must be >= 0, got {fixed_seconds}")
    values = torch.sort(extra_values.detach().double().flatten().cpu(), descending=True).values
    tau = torch.cat([values.new_zeros(1), torch.cumsum(values, 0)]).add_(forced_tau)
    steps = sps.steps_per_sec_range(start=forced_tokens, count=values.numel() + 1, num_reqs=num_reqs).to(tau.dtype)
    if fixed_seconds:
        steps = torch.where(steps > 0, 1.0 / (1.0 / steps + fixed_seconds), steps)
    return int(torch.argmax(tau * steps))


def argmax_budget(*, survival: torch.Tensor, sps: SpsCurve, min_survival: float = 0.0) -> int:
    """The n maximising Theta over every prefix of the sorted survivals (first maximum on ties)."""
    if survival.numel() == 0:
        return 0
    return budget_choice(survival=survival, sps=sps, min_survival=min_survival).budget


def topk_lengths(*, survival: torch.Tensor, budget: int, min_survival: float = 0.0) -> torch.Tensor:
    """Per-request verify lengths when the `budget` best candidates (shared order) are verified. No host
    read-back: runs on the survivals' device without a sync (`budget` is a host int). On the CPU a
    selection replaces the sort (same verify lengths, ties included)."""
    num_reqs = survival.shape[0]
    if survival.numel() == 0 or budget <= 0:
        return torch.zeros(num_reqs, dtype=torch.long, device=survival.device)
    if survival.device.type == "cpu":
        return torch.from_numpy(_topk_lengths_numpy(survival.detach().numpy(), budget, min_survival))
    values, order = candidate_order(survival=_below_to_neg_inf(survival, min_survival))
    take = min(budget, order.numel())
    return _lengths_from_order(order=order, budget=take, num_reqs=num_reqs,
                               admitted=values[:take] != float("-inf"))


def _topk_lengths_numpy(survival: np.ndarray, budget: int, min_survival: float) -> np.ndarray:
    """topk_lengths without a sort, on a [B, k] array."""
    return topk_lengths_slot_major(survival.T.ravel(), num_reqs=survival.shape[0], budget=budget,
                                   min_survival=min_survival)


def topk_lengths_slot_major(flat: np.ndarray, *, num_reqs: int, budget: int, min_survival: float) -> np.ndarray:
    """topk_lengths on the slot-major flattening (m = j * B + r) of float64 survivals: the budget-th
    largest value by selection, then the ties at it taken in the shared order (earlier slot, then
    lower request)."""
    admissible = flat >= min_survival  # NaN fails too
    count = int(np.count_nonzero(admissible))
    if budget <= 0 or not flat.size:
        return np.zeros(num_reqs, dtype=np.int64)
    if budget >= count:
        chosen = admissible
    else:
        values = np.where(admissible, flat, -np.inf)
        threshold = np.partition(values, values.size - budget)[values.size - budget]
        chosen = values >= threshold
        if int(np.count_nonzero(chosen)) != budget:  # ties at the threshold: the first ones in the order
            chosen = values > threshold
            ties = np.flatnonzero(values == threshold)[: budget - int(np.count_nonzero(chosen))]
            chosen[ties] = True
    return chosen.reshape(-1, num_reqs).sum(axis=0, dtype=np.int64)


def threshold_lengths(*, confidences: torch.Tensor, threshold: float) -> torch.Tensor:
    """Static policy: verify every slot whose survival is at least `threshold`."""
    return (survivals(confidences=confidences) >= threshold).sum(dim=1)


# ---- plain-Python references -------------------------------------------------------------------


def survivals_reference(*, confidences: Sequence[Sequence[float]]) -> list[list[float]]:
    out = []
    for row in confidences:
        acc, surv = 1.0, []
        for c in row:
            acc *= float(c)
            surv.append(acc)
        out.append(surv)
    return out


def candidate_order_reference(*, survival: Sequence[Sequence[float]]) -> list[tuple[int, int, float]]:
    cands = [(r, j, a) for r, row in enumerate(survival) for j, a in enumerate(row)]
    return sorted(cands, key=lambda c: (-c[2], c[1], c[0]))


def exact_lengths_reference(
    *, confidences: Sequence[Sequence[float]], sps: SpsFn
) -> tuple[list[int], int]:
    num_reqs = len(confidences)
    verify_lengths = [0] * num_reqs
    tau, batch = float(num_reqs), num_reqs
    theta = tau * sps(batch, num_reqs)
    admitted = 0
    for r, _j, a in candidate_order_reference(survival=survivals_reference(confidences=confidences)):
        new_theta = (tau + a) * sps(batch + 1, num_reqs)
        if new_theta <= theta:
            break
        tau, batch, theta = tau + a, batch + 1, new_theta
        verify_lengths[r] += 1
        admitted += 1
    return verify_lengths, admitted


def _admissible(survival: Sequence[Sequence[float]], min_survival: float) -> list[tuple[int, int, float]]:
    kept = [[a if a >= min_survival else None for a in row] for row in survival]  # NaN fails >= too
    cands = [(r, j, a) for r, row in enumerate(kept) for j, a in enumerate(row) if a is not None]
    return sorted(cands, key=lambda c: (-c[2], c[1], c[0]))


def argmax_budget_reference(
    *, survival: Sequence[Sequence[float]], sps: SpsFn, min_survival: float = 0.0
) -> int:
    num_reqs = len(survival)
    tau, best_n, best_theta = float(num_reqs), 0, float(num_reqs) * sps(num_reqs, num_reqs)
    for n, (_r, _j, a) in enumerate(_admissible(survival, min_survival), start=1):
        tau += a
        theta = tau * sps(num_reqs + n, num_reqs)
        if theta > best_theta:
            best_n, best_theta = n, theta
    return best_n


def topk_lengths_reference(
    *, survival: Sequence[Sequence[float]], budget: int, min_survival: float = 0.0
) -> list[int]:
    verify_lengths = [0] * len(survival)
    for r, _j, _a in _admissible(survival, min_survival)[: max(budget, 0)]:
        verify_lengths[r] += 1
    return verify_lengths


def tree_extra_budget_reference(*, extra_values: Sequence[float], forced_tau: float, forced_tokens: int,
                                num_reqs: int, sps: SpsFn, fixed_seconds: float = 0.0) -> int:
    def rate(tokens: int) -> float:
        steps = sps(tokens, num_reqs)
        return 1.0 / (1.0 / steps + fixed_seconds) if steps > 0 else 0.0

    best_n, best_theta, tau = 0, forced_tau * rate(forced_tokens), forced_tau
    for n, v in enumerate(sorted((float(v) for v in extra_values), reverse=True), 1):
        tau += v
        theta = tau * rate(forced_tokens + n)
        if theta > best_theta:
            best_n, best_theta = n, theta
    return best_n
