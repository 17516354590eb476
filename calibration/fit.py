"""Sequential temperature scaling (DSpark STS): for slot j left to right, pick T_j minimising a score of the
cumulative survival prod_{i<=j} sigmoid(z_i / T_i) against the accepted-prefix indicator on the rows that
verified slot j, earlier temperatures held fixed.

Methods (`method=`):
- "nll" (default): log loss of the cumulative survival (why: `_cumulative_log_loss`), minimised
  continuously in log T: the best point of the log-spaced grid, then Newton (bounded Brent between the
  grid point's neighbours if Newton fails);
- "ece": SGLang's objective (binned ECE of the cumulative survival), best grid point refined by Brent;
- "grid": SGLang's fitter exactly: the grid point of least ECE, ties to the smallest T.

`bootstrap_sts_intervals` refits on row resamples and gives each slot's percentile interval."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import numpy as np
from scipy.optimize import minimize_scalar
from tqdm.auto import tqdm

from .metrics import batched_ece, expected_calibration_error, record_arrays
from .records import ConfidenceRecords
from .sts import StsCalibration, StsTemperatureIntervals

FitMethod = Literal["nll", "ece", "grid"]
FIT_METHODS: tuple[str, ...] = ("nll", "ece", "grid")

# Brent and Newton stop at this step on log T: 1e-6 relative in T, far below sampling noise.
_LOG_T_TOLERANCE = 1e-6
# rows scored on the grid to find the log loss's basin before Newton runs on all rows
_BASIN_ROWS = 20_000


def default_temperature_grid(*, low: float = 0.1, high: float = 10.0, num: int = 41) -> np.ndarray:
    """Log-spaced grid, SGLang's default (0.1 .. 10, 41 points; 1.0 and 10**0.4 ~ 2.51 lie on it)."""
    if not (math.isfinite(low) and math.isfinite(high) and 0 < low < high):
        raise ValueError(f"temperature grid needs finite 0 < low < high, got low={low}, high={high}")
    if num < 2:
        raise ValueError(f"temperature grid needs at least 2 points, got {num}")
    return np.logspace(math.log10(low), math.log10(high), num)


def _sigmoid(z: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * z))


def _log_sigmoid(z: np.ndarray) -> np.ndarray:
    return -np.logaddexp(0.0, -z)


def _cumulative_log_loss(
    *, log_survival_before: np.ndarray, slot_logits: np.ndarray, labels: np.ndarray, candidates: np.ndarray
) -> np.ndarray:
    """Mean log loss of survival exp(log_survival_before) * sigmoid(z / T) for each candidate temperature T of
    one slot, candidates [G] -> [G].

    Why this objective: the scheduler reads the cumulative survival as an absolute probability, and the log
    loss is a strictly proper score of exactly that forecast, so its minimiser is consistent (it recovers the
    true T when the head is over-confident by a temperature) and, unlike the binned ECE, smooth in T: a 1-D
    search finds its minimum instead of a point on a bin-induced plateau. Scoring the cumulative product on
    every verified row (not the conditional on the rows that reached slot j) keeps STS's sequential nature:
    T_j also corrects miscalibration that earlier slots pass on, e.g. when a request's difficulty is shared
    by its whole block and per-slot calibrated confidences multiply into an over-confident survival."""
    log_conditional = _log_sigmoid(slot_logits[None, :] / candidates[:, None])
    accepted = labels > 0
    # accepted rows: -log s_{j-1} does not depend on T_j, so it is left out
    loss_accepted = -log_conditional[:, accepted].sum(axis=1)
    log_survival = log_survival_before[~accepted][None, :] + log_conditional[:, ~accepted]
    # rejected rows: -log(1 - s) = -log(-expm1(log s)); the cap keeps s == 1 in float64 finite (loss ~690)
    loss_rejected = -np.log(-np.expm1(np.minimum(log_survival, -1e-300))).sum(axis=1)
    return (loss_accepted + loss_rejected) / max(labels.size, 1)


def _cumulative_ece(
    *,
    log_survival_before: np.ndarray,
    slot_logits: np.ndarray,
    labels: np.ndarray,
    candidates: np.ndarray,
    num_bins: int,
) -> np.ndarray:
    """The binned ECE of the survival for each candidate temperature of one slot, candidates [G] -> [G]."""
    survival = np.exp(log_survival_before)[None, :] * _sigmoid(slot_logits[None, :] / candidates[:, None])
    return batched_ece(probs=survival, labels=labels, num_bins=num_bins)


def _fit_slot(objective: Callable[[np.ndarray], np.ndarray], grid: np.ndarray, *, refine: bool) -> float:
    """Best grid point (ties to the smallest T), then, if refine, bounded Brent on log T between its two
    neighbours. The grid pass guards against the local minima the ECE can have; the refined value is kept
    only if it scores at least as well as the grid point, so refining never makes the fit worse."""
    scores = objective(grid)
    best = int(np.argmin(scores))
    if not refine or grid.size < 2:
        return float(grid[best])
    low, high = np.log(grid[max(best - 1, 0)]), np.log(grid[min(best + 1, grid.size - 1)])
    result = minimize_scalar(
        lambda log_t: float(objective(np.array([math.exp(log_t)]))[0]),
        bounds=(low, high),
        method="bounded",
        options={"xatol": _LOG_T_TOLERANCE},
    )
    return float(math.exp(result.x)) if result.fun <= scores[best] else float(grid[best])


def _newton_log_loss(
    *,
    z_accepted: np.ndarray,
    weight_accepted: np.ndarray | float,
    z_rejected: np.ndarray,
    weight_rejected: np.ndarray | float,
    log_survival_rejected: np.ndarray,
    start: float,
    bounds: tuple[float, float],
    max_steps: int = 30,
) -> float | None:
    """Newton's method on log T for the weighted `_cumulative_log_loss` (weights = how often a bootstrap
    resample drew each row), from `start`: a resample starts from the full-data fit, a few percent away, and
    converges in 3-4 steps instead of a grid pass plus ~20 Brent evaluations. Returns None, and the caller
    falls back to the grid + Brent search, if the curvature is not positive, a step leaves `bounds` (log T)
    or it has not converged: the log loss of a product need not be convex in log T, only near its minimum."""
    prior = np.exp(log_survival_rejected)  # a = s_{j-1} on the rejected rows
    prior_complement = -np.expm1(log_survival_rejected)  # 1 - a without cancellation
    log_t = math.log(start)
    # elementwise products and sums, not np.dot: OpenBLAS threads on short vectors cost 40x on a busy machine
    for _ in range(max_steps):
        scale = math.exp(-log_t)
        # l(x) with x = z / T: accepted -log sigmoid(x); rejected -log(1 - a sigmoid(x)).
        # d/d(log T) = -x l'(x), d2/d(log T)2 = x^2 l''(x) + x l'(x).
        x = z_accepted * scale
        reject_prob = _sigmoid(-x)
        d1 = -reject_prob
        d2 = reject_prob * (1.0 - reject_prob)
        gradient = -float((weight_accepted * x * d1).sum())
        curvature = float((weight_accepted * x * (x * d2 + d1)).sum())
        x = z_rejected * scale
        reject_prob = _sigmoid(-x)
        accept_prob = 1.0 - reject_prob
        # r = a s / (1 - a s), with 1 - a s = (1 - a) + a (1 - s)
        ratio = prior * accept_prob / (prior_complement + prior * reject_prob)
        d1 = ratio * reject_prob
        d2 = d1 * (reject_prob * (1.0 + ratio) - accept_prob)
        gradient -= float((weight_rejected * x * d1).sum())
        curvature += float((weight_rejected * x * (x * d2 + d1)).sum())
        if not curvature > 0:
            return None
        step = gradient / curvature
        log_t -= step
        if not bounds[0] <= log_t <= bounds[1]:
            return None
        if abs(step) < _LOG_T_TOLERANCE:
            return math.exp(log_t)
    return None


def _fit_log_loss_slot(
    *, log_survival_before: np.ndarray, slot_logits: np.ndarray, labels: np.ndarray, grid: np.ndarray
) -> float:
    """The "nll" search for one slot: the grid pass picks the basin (on an evenly strided subsample of at
    most _BASIN_ROWS rows, enough to choose a grid cell), Newton on all rows finishes from there; the grid +
    Brent search on all rows takes over if Newton fails or ends scoring worse than its starting grid point."""
    stride = max(1, labels.size // _BASIN_ROWS)
    coarse = _cumulative_log_loss(
        log_survival_before=log_survival_before[::stride],
        slot_logits=slot_logits[::stride],
        labels=labels[::stride],
        candidates=grid,
    )
    start = float(grid[int(np.argmin(coarse))])
    accepted = labels > 0
    best_t = _newton_log_loss(
        z_accepted=slot_logits[accepted],
        weight_accepted=1.0,
        z_rejected=slot_logits[~accepted],
        weight_rejected=1.0,
        log_survival_rejected=log_survival_before[~accepted],
        start=start,
        bounds=(math.log(grid[0]), math.log(grid[-1])),
    )
    objective = lambda t: _cumulative_log_loss(
        log_survival_before=log_survival_before, slot_logits=slot_logits, labels=labels, candidates=t
    )
    if best_t is not None and objective(np.array([best_t]))[0] <= objective(np.array([start]))[0]:
        return best_t
    return _fit_slot(objective, grid, refine=True)


@dataclass(frozen=True)
class _SlotRows:
    """One slot's rows, split once for all resamples: reached (for min_samples), accepted and rejected
    among the verified rows, with their logits."""

    logits: np.ndarray
    reached: np.ndarray
    accepted: np.ndarray
    rejected: np.ndarray
    z_accepted: np.ndarray
    z_rejected: np.ndarray

    @classmethod
    def split(cls, logits: np.ndarray, labels: np.ndarray, observed: np.ndarray) -> list[_SlotRows]:
        slots = []
        for slot in range(logits.shape[1]):
            rows = observed[:, slot]
            reached = rows if slot == 0 else rows & (labels[:, slot - 1] > 0)
            accepted = np.flatnonzero(rows & (labels[:, slot] > 0))
            rejected = np.flatnonzero(rows & ~(labels[:, slot] > 0))
            z = np.ascontiguousarray(logits[:, slot])
            slots.append(cls(z, np.flatnonzero(reached), accepted, rejected, z[accepted], z[rejected]))
        return slots


def _resampled_log_loss_fit(
    slots: list[_SlotRows],
    counts: np.ndarray,
    *,
    start: list[float],
    grid: np.ndarray,
    min_samples: int,
) -> list[float]:
    """The "nll" fit of one bootstrap resample given as per-row draw counts: the same as fitting the rows
    repeated `counts` times, without copying them (Newton from `start`, else the full grid + Brent search)."""
    bounds = (math.log(grid[0]), math.log(grid[-1]))
    temperatures: list[float] = []
    log_survival = np.zeros(counts.size)
    for slot, rows in enumerate(slots):
        best_t = 1.0
        if counts[rows.reached].sum() >= min_samples:
            best_t = _newton_log_loss(
                z_accepted=rows.z_accepted,
                weight_accepted=counts[rows.accepted],
                z_rejected=rows.z_rejected,
                weight_rejected=counts[rows.rejected],
                log_survival_rejected=log_survival[rows.rejected],
                start=start[slot],
                bounds=bounds,
            )
            if best_t is None:
                drawn = np.repeat(np.arange(counts.size), counts.astype(np.int64))
                verified = np.sort(np.concatenate([rows.accepted, rows.rejected]))
                drawn = drawn[np.isin(drawn, verified)]
                labels = np.isin(drawn, rows.accepted).astype(np.float64)
                inputs = dict(
                    log_survival_before=log_survival[drawn], slot_logits=rows.logits[drawn], labels=labels
                )
                best_t = _fit_slot(
                    lambda t, inputs=inputs: _cumulative_log_loss(**inputs, candidates=t), grid, refine=True
                )
        temperatures.append(best_t)
        log_survival = log_survival + _log_sigmoid(rows.logits / best_t)
    return temperatures


def _check_inputs(
    confidence_logits, prefix_mask, observed_mask, grid, method, min_samples
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    logits, labels = record_arrays(confidence_logits, prefix_mask, name="logits", purpose="fit")
    if not np.isfinite(logits).all():
        raise ValueError("confidence logits hold NaN or inf; drop those rows before fitting")
    if method not in FIT_METHODS:
        raise ValueError(f"unknown STS fit method {method!r}; choose one of {', '.join(FIT_METHODS)}")
    grid = default_temperature_grid() if grid is None else np.asarray(grid, dtype=np.float64).reshape(-1)
    if grid.size == 0 or not np.isfinite(grid).all() or (grid <= 0).any():
        raise ValueError("temperature grid must be non-empty, finite and > 0")
    grid = np.sort(grid)  # "ties to the smallest T" and the refinement bracket need ascending order
    if min_samples < 1:
        raise ValueError(f"min_samples must be >= 1, got {min_samples}")
    n, block_size = logits.shape
    observed = np.ones((n, block_size), bool) if observed_mask is None else np.asarray(observed_mask, bool)
    if observed.shape != logits.shape:
        raise ValueError(
            f"observed_mask {observed.shape} and logits {logits.shape} must both be [n, block_size]"
        )
    return logits, labels, observed, grid


def _fit_temperatures(
    logits: np.ndarray,
    labels: np.ndarray,
    observed: np.ndarray,
    *,
    grid: np.ndarray,
    method: str,
    num_bins: int,
    min_samples: int,
    warn: bool,
) -> list[float]:
    n, block_size = logits.shape
    temperatures: list[float] = []
    log_survival = np.zeros(n)
    for slot in range(block_size):
        rows = observed[:, slot]
        reached = rows if slot == 0 else rows & (labels[:, slot - 1] > 0)
        if reached.sum() < min_samples:
            if warn:
                warnings.warn(
                    f"STS slot {slot}: {int(reached.sum())} observed records reached it "
                    f"(< min_samples={min_samples}); keeping T = 1. Record more verify steps (or full-block "
                    "verification) to calibrate it.",
                    stacklevel=3,
                )
            best_t = 1.0
        else:
            inputs = dict(
                log_survival_before=log_survival[rows],
                slot_logits=logits[rows, slot],
                labels=labels[rows, slot],
            )
            if method == "nll":
                best_t = _fit_log_loss_slot(**inputs, grid=grid)
            else:
                objective = lambda t, inputs=inputs: _cumulative_ece(
                    **inputs, candidates=t, num_bins=num_bins
                )
                best_t = _fit_slot(objective, grid, refine=method != "grid")
        temperatures.append(best_t)
        log_survival = log_survival + _log_sigmoid(logits[:, slot] / best_t)
    return temperatures


def fit_sts(
    *,
    confidence_logits: np.ndarray,
    prefix_mask: np.ndarray,
    observed_mask: np.ndarray | None = None,
    method: FitMethod = "nll",
    grid: np.ndarray | None = None,
    num_bins: int = 15,
    min_samples: int = 1,
) -> tuple[list[float], list[float], list[float]]:
    """Returns (temperatures, ece_before, ece_after), one entry per slot; ECE is always the binned ECE of the
    cumulative survival on the rows that verified the slot, whatever the method.

    The search is bounded by the grid's ends (0.1 .. 10 by default). A slot is fitted only if at least
    `min_samples` observed rows reached it (all earlier slots accepted); otherwise it keeps T = 1 with a
    warning. Per-slot ECE is NaN where no row observed the slot."""
    logits, labels, observed, grid = _check_inputs(
        confidence_logits, prefix_mask, observed_mask, grid, method, min_samples
    )
    temperatures = _fit_temperatures(
        logits,
        labels,
        observed,
        grid=grid,
        method=method,
        num_bins=num_bins,
        min_samples=min_samples,
        warn=True,
    )
    ece_before: list[float] = []
    ece_after: list[float] = []
    survival_raw = np.ones(logits.shape[0])
    survival_fit = np.ones(logits.shape[0])
    for slot, temperature in enumerate(temperatures):
        rows, y = observed[:, slot], labels[observed[:, slot], slot]
        survival_raw = survival_raw * _sigmoid(logits[:, slot])
        survival_fit = survival_fit * _sigmoid(logits[:, slot] / temperature)
        ece_before.append(expected_calibration_error(probs=survival_raw[rows], labels=y, num_bins=num_bins))
        ece_after.append(expected_calibration_error(probs=survival_fit[rows], labels=y, num_bins=num_bins))
    return temperatures, ece_before, ece_after


def bootstrap_sts_intervals(
    *,
    confidence_logits: np.ndarray,
    prefix_mask: np.ndarray,
    observed_mask: np.ndarray | None = None,
    temperatures: list[float] | None = None,
    method: FitMethod = "nll",
    grid: np.ndarray | None = None,
    num_bins: int = 15,
    min_samples: int = 1,
    num_resamples: int = 200,
    confidence: float = 0.95,
    seed: int = 0,
    progress: bool = False,
) -> StsTemperatureIntervals:
    """Per-slot percentile bootstrap interval of the fitted temperatures: rows (whole verify steps, so a
    block's slots stay together) are drawn with replacement and the whole sequential fit is rerun on each
    resample, so the spread of earlier slots' temperatures propagates into later ones.

    `temperatures`: the fit on all rows with the same settings, if already computed (else it is refitted).
    Rows are treated as independent; steps of one request are not, so with few long requests the interval
    is optimistic. A slot that fewer than `min_samples` rows of a resample reached keeps T = 1 there."""
    if num_resamples < 2:
        raise ValueError(f"the bootstrap needs at least 2 resamples, got {num_resamples}")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence level must be in (0, 1), got {confidence}")
    logits, labels, observed, grid = _check_inputs(
        confidence_logits, prefix_mask, observed_mask, grid, method, min_samples
    )
    fit = lambda rows: _fit_temperatures(
        logits[rows],
        labels[rows],
        observed[rows],
        grid=grid,
        method=method,
        num_bins=num_bins,
        min_samples=min_samples,
        warn=False,
    )
    n = logits.shape[0]
    if temperatures is None:
        point = fit(np.arange(n))
    else:
        point = [float(t) for t in temperatures]
        if len(point) != logits.shape[1]:
            raise ValueError(f"{len(point)} temperatures given for {logits.shape[1]} slots")
    rng = np.random.default_rng(seed)
    slots = _SlotRows.split(logits, labels, observed) if method == "nll" else []
    samples = []
    for _ in tqdm(range(num_resamples), desc="bootstrap STS", unit="resample", disable=not progress):
        rows = rng.integers(0, n, size=n)
        if method == "nll":
            counts = np.bincount(rows, minlength=n).astype(np.float64)
            samples.append(
                _resampled_log_loss_fit(slots, counts, start=point, grid=grid, min_samples=min_samples)
            )
        else:
            samples.append(fit(rows))
    samples = np.array(samples)
    tail = (1.0 - confidence) / 2.0
    lower, upper = np.quantile(samples, [tail, 1.0 - tail], axis=0)
    return StsTemperatureIntervals(
        method=method,
        confidence=confidence,
        num_resamples=num_resamples,
        seed=seed,
        num_samples=n,
        temperatures=[float(t) for t in point],
        lower=lower.tolist(),
        upper=upper.tolist(),
    )


def fit_sts_calibration(
    records: ConfidenceRecords,
    *,
    method: FitMethod = "nll",
    grid: np.ndarray | None = None,
    num_bins: int = 15,
    min_samples: int = 1,
    dataset: str = "",
) -> StsCalibration:
    """Fit and package as the SGLang-loadable artifact. Unobserved slots' ECE (NaN) is written as 0.0
    because JSON has no NaN and SGLang's struct wants floats."""
    temperatures, before, after = fit_sts(
        confidence_logits=records.logits,
        prefix_mask=records.prefix_mask,
        observed_mask=records.observed_mask,
        method=method,
        grid=grid,
        num_bins=num_bins,
        min_samples=min_samples,
    )
    clean = lambda values: [0.0 if math.isnan(v) else float(v) for v in values]
    return StsCalibration(
        temperatures=temperatures,
        dataset=dataset,
        num_samples=records.num_samples,
        ece_before=clean(before),
        ece_after=clean(after),
    )
