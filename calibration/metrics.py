"""Confidence metrics on cumulative survival vs the accepted-prefix indicator (library, used by eval too).

Per slot j: ECE (equal-width bins, SGLang's binning: bin = floor(p * bins) after clamping p to
[1e-8, 1 - 1e-8]), AUROC (scikit-learn), Brier score, mean predicted vs observed survival. "Overall"
pools every observed (row, slot) pair; `mean_slot_ece` is the plain mean over slots (DSpark's number)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import msgspec
import numpy as np
from sklearn.metrics import roc_auc_score

from .records import ConfidenceRecords
from .sts import StsCalibration, calibrated_survival_np

_EPS_PROB = 1e-8


def record_arrays(values, prefix_mask, *, name: str, purpose: str) -> tuple[np.ndarray, np.ndarray]:
    """(values, prefix_mask) as float64 [n, block_size] arrays, checked to match and be non-empty."""
    values = np.asarray(values, dtype=np.float64)
    labels = np.asarray(prefix_mask).astype(np.float64)
    if values.ndim != 2 or values.shape != labels.shape:
        raise ValueError(f"{name} {values.shape} and prefix_mask {labels.shape} must both be [n, block_size]")
    if values.shape[0] == 0:
        raise ValueError(f"no records to {purpose}; record some verify steps first")
    return values, labels


def _bin_index(probs: np.ndarray, num_bins: int) -> np.ndarray:
    clamped = np.clip(probs, _EPS_PROB, 1.0 - _EPS_PROB)
    return np.minimum((clamped * num_bins).astype(np.int64), num_bins - 1)


def expected_calibration_error(*, probs: np.ndarray, labels: np.ndarray, num_bins: int = 15) -> float:
    """sum_b |B_b|/N * |mean(p in b) - mean(y in b)|; NaN when there are no samples."""
    probs = np.asarray(probs, dtype=np.float64).reshape(-1)
    labels = np.asarray(labels, dtype=np.float64).reshape(-1)
    if probs.shape != labels.shape:
        raise ValueError(f"probs {probs.shape} and labels {labels.shape} differ in size")
    if num_bins < 1:
        raise ValueError(f"num_bins must be >= 1, got {num_bins}")
    if probs.size == 0:
        return float("nan")
    return float(batched_ece(probs=probs[None, :], labels=labels, num_bins=num_bins)[0])


def batched_ece(*, probs: np.ndarray, labels: np.ndarray, num_bins: int) -> np.ndarray:
    """ECE of each row of probs [G, n] against the same labels [n] (the fit scores a whole grid at once).

    |B| * |mean p - mean y| = |sum over the bin of (p - y)|, so only per-bin residual sums are needed."""
    num_rows, n = probs.shape
    flat = (_bin_index(probs, num_bins) + num_bins * np.arange(num_rows)[:, None]).reshape(-1)
    residual = (np.clip(probs, _EPS_PROB, 1.0 - _EPS_PROB) - labels[None, :]).reshape(-1)
    per_bin = np.bincount(flat, weights=residual, minlength=num_rows * num_bins).reshape(num_rows, num_bins)
    return np.abs(per_bin).sum(axis=1) / n


class ReliabilityBins(msgspec.Struct, frozen=True):
    """Equal-width bins: edges [num_bins + 1]; per bin count, mean predicted and observed frequency
    (NaN for empty bins)."""

    edges: list[float]
    count: list[int]
    mean_predicted: list[float]
    observed: list[float]


def reliability_bins(*, probs: np.ndarray, labels: np.ndarray, num_bins: int = 15) -> ReliabilityBins:
    probs = np.asarray(probs, dtype=np.float64).reshape(-1)
    labels = np.asarray(labels, dtype=np.float64).reshape(-1)
    index = _bin_index(probs, num_bins)
    count = np.bincount(index, minlength=num_bins)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean_pred = np.bincount(index, weights=probs, minlength=num_bins) / count
        observed = np.bincount(index, weights=labels, minlength=num_bins) / count
    return ReliabilityBins(
        edges=np.linspace(0.0, 1.0, num_bins + 1).tolist(),
        count=count.tolist(),
        mean_predicted=mean_pred.tolist(),
        observed=observed.tolist(),
    )


class ConfidenceMetrics(msgspec.Struct, frozen=True):
    """Per-slot lists have block_size entries; None where a slot has no observed rows (or one label class,
    for AUROC)."""

    num_samples: int
    num_bins: int
    num_observed: list[int]
    ece: list[float | None]
    auroc: list[float | None]
    brier: list[float | None]
    mean_predicted: list[float | None]
    mean_observed: list[float | None]
    overall_ece: float
    overall_auroc: float | None
    overall_brier: float
    overall_mean_predicted: float
    overall_mean_observed: float
    mean_slot_ece: float

    @property
    def block_size(self) -> int:
        return len(self.ece)


def _auroc(labels: np.ndarray, scores: np.ndarray) -> float | None:
    if labels.size == 0 or labels.all() or not labels.any():
        return None  # undefined with one class
    return float(roc_auc_score(labels, scores))


def _none_if_nan(value: float) -> float | None:
    return None if math.isnan(value) else float(value)


def survival_metrics(
    *,
    survival: np.ndarray,
    prefix_mask: np.ndarray,
    observed_mask: np.ndarray | None = None,
    num_bins: int = 15,
) -> ConfidenceMetrics:
    """Metrics of cumulative survival [n, block_size] against prefix_mask [n, block_size] (observed slots only)."""
    survival, labels = record_arrays(survival, prefix_mask, name="survival", purpose="score")
    observed = np.ones(labels.shape, bool) if observed_mask is None else np.asarray(observed_mask, bool)
    per_slot: dict[str, list] = {k: [] for k in ("n", "ece", "auroc", "brier", "pred", "obs")}
    for slot in range(survival.shape[1]):
        rows = observed[:, slot]
        p, y = survival[rows, slot], labels[rows, slot]
        per_slot["n"].append(int(rows.sum()))
        per_slot["ece"].append(_none_if_nan(expected_calibration_error(probs=p, labels=y, num_bins=num_bins)))
        per_slot["auroc"].append(_auroc(y, p))
        per_slot["brier"].append(float(np.mean((p - y) ** 2)) if p.size else None)
        per_slot["pred"].append(float(p.mean()) if p.size else None)
        per_slot["obs"].append(float(y.mean()) if p.size else None)
    p_all, y_all = survival[observed], labels[observed]
    slot_eces = [e for e in per_slot["ece"] if e is not None]
    return ConfidenceMetrics(
        num_samples=int(survival.shape[0]),
        num_bins=num_bins,
        num_observed=per_slot["n"],
        ece=per_slot["ece"],
        auroc=per_slot["auroc"],
        brier=per_slot["brier"],
        mean_predicted=per_slot["pred"],
        mean_observed=per_slot["obs"],
        overall_ece=expected_calibration_error(probs=p_all, labels=y_all, num_bins=num_bins),
        overall_auroc=_auroc(y_all, p_all),
        overall_brier=float(np.mean((p_all - y_all) ** 2)),
        overall_mean_predicted=float(p_all.mean()),
        overall_mean_observed=float(y_all.mean()),
        mean_slot_ece=float(np.mean(slot_eces)),
    )


def confidence_metrics(
    *,
    confidence_logits: np.ndarray,
    prefix_mask: np.ndarray,
    observed_mask: np.ndarray | None = None,
    temperatures: StsCalibration | Sequence[float] | None = None,
    num_bins: int = 15,
) -> ConfidenceMetrics:
    """Metrics of raw confidence logits [n, block_size], optionally after STS temperatures (None = raw)."""
    survival = calibrated_survival_np(confidence_logits=confidence_logits, temperatures=temperatures)
    return survival_metrics(
        survival=survival, prefix_mask=prefix_mask, observed_mask=observed_mask, num_bins=num_bins
    )


def records_metrics(
    records: ConfidenceRecords,
    *,
    temperatures: StsCalibration | Sequence[float] | None = None,
    num_bins: int = 15,
) -> ConfidenceMetrics:
    return confidence_metrics(
        confidence_logits=records.logits,
        prefix_mask=records.prefix_mask,
        observed_mask=records.observed_mask,
        temperatures=temperatures,
        num_bins=num_bins,
    )


def records_reliability(
    records: ConfidenceRecords,
    *,
    temperatures: StsCalibration | Sequence[float] | None = None,
    num_bins: int = 15,
) -> ReliabilityBins:
    """Reliability bins pooled over every observed (row, slot) pair."""
    survival = calibrated_survival_np(confidence_logits=records.logits, temperatures=temperatures)
    observed = np.ones(survival.shape, bool) if records.observed_mask is None else records.observed_mask
    return reliability_bins(probs=survival[observed], labels=records.prefix_mask[observed], num_bins=num_bins)
