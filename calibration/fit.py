"""Sequential temperature scaling (DSpark STS): for slot j left to right, pick T_j on a grid minimising
the ECE of the cumulative survival prod_{i<=j} sigmoid(z_i / T_i) against the accepted-prefix indicator,
earlier temperatures held fixed. Ties go to the smallest T on the grid (SGLang's fitter does the same)."""

from __future__ import annotations

import math
import warnings

import numpy as np

from .metrics import batched_ece, expected_calibration_error, record_arrays
from .records import ConfidenceRecords
from .sts import StsCalibration


def default_temperature_grid(*, low: float = 0.1, high: float = 10.0, num: int = 41) -> np.ndarray:
    """Log-spaced grid, SGLang's default (0.1 .. 10, 41 points; 1.0 and 10**0.4 ~ 2.51 lie on it)."""
    if not (math.isfinite(low) and math.isfinite(high) and 0 < low < high):
        raise ValueError(f"temperature grid needs finite 0 < low < high, got low={low}, high={high}")
    if num < 2:
        raise ValueError(f"temperature grid needs at least 2 points, got {num}")
    return np.logspace(math.log10(low), math.log10(high), num)


def _sigmoid(z: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * z))


def fit_sts(
    *,
    confidence_logits: np.ndarray,
    prefix_mask: np.ndarray,
    observed_mask: np.ndarray | None = None,
    grid: np.ndarray | None = None,
    num_bins: int = 15,
    min_samples: int = 1,
) -> tuple[list[float], list[float], list[float]]:
    """Returns (temperatures, ece_before, ece_after), one entry per slot.

    A slot is fitted only if at least `min_samples` observed rows reached it (all earlier slots accepted);
    otherwise it keeps T = 1 with a warning. Per-slot ECE is NaN where no row observed the slot."""
    logits, labels = record_arrays(confidence_logits, prefix_mask, name="logits", purpose="fit")
    if not np.isfinite(logits).all():
        raise ValueError("confidence logits hold NaN or inf; drop those rows before fitting")
    grid = default_temperature_grid() if grid is None else np.asarray(grid, dtype=np.float64).reshape(-1)
    if grid.size == 0 or not np.isfinite(grid).all() or (grid <= 0).any():
        raise ValueError("temperature grid must be non-empty, finite and > 0")
    if min_samples < 1:
        raise ValueError(f"min_samples must be >= 1, got {min_samples}")
    n, gamma = logits.shape
    observed = np.ones((n, gamma), bool) if observed_mask is None else np.asarray(observed_mask, bool)

    temperatures: list[float] = []
    ece_before: list[float] = []
    ece_after: list[float] = []
    survival_raw = np.ones(n)
    survival_fit = np.ones(n)
    for slot in range(gamma):
        rows = observed[:, slot]
        reached = rows if slot == 0 else rows & (labels[:, slot - 1] > 0)
        y = labels[rows, slot]
        survival_raw = survival_raw * _sigmoid(logits[:, slot])
        ece_before.append(expected_calibration_error(probs=survival_raw[rows], labels=y, num_bins=num_bins))
        if reached.sum() < min_samples:
            warnings.warn(
                f"STS slot {slot}: {int(reached.sum())} observed records reached it (< min_samples={min_samples});"
                " keeping T = 1. Record more verify steps (or full-block verification) to calibrate it.",
                stacklevel=2,
            )
            best_t = 1.0
        else:
            # [G, n_rows] candidate survivals for the whole grid at once
            candidates = survival_fit[rows][None, :] * _sigmoid(logits[rows, slot][None, :] / grid[:, None])
            eces = batched_ece(probs=candidates, labels=y, num_bins=num_bins)
            best_t = float(grid[int(np.argmin(eces))])
        temperatures.append(best_t)
        survival_fit = survival_fit * _sigmoid(logits[:, slot] / best_t)
        ece_after.append(expected_calibration_error(probs=survival_fit[rows], labels=y, num_bins=num_bins))
    return temperatures, ece_before, ece_after


def fit_sts_calibration(
    records: ConfidenceRecords,
    *,
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
