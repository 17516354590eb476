"""Confidence calibration: sequential temperature scaling (STS), confidence metrics, records, CLI.

Artifacts use SGLang's `DSparkStsCalibration` JSON layout and `StsDataRecorder` shard layout."""

from .fit import FIT_METHODS, bootstrap_sts_intervals, default_temperature_grid, fit_sts, fit_sts_calibration
from .metrics import (
    ConfidenceMetrics,
    ReliabilityBins,
    confidence_metrics,
    expected_calibration_error,
    records_metrics,
    records_reliability,
    reliability_bins,
    survival_metrics,
)
from .records import ConfidenceRecorder, ConfidenceRecords, load_records, load_shard, save_records
from .sts import (
    StsCalibration,
    StsTemperatureIntervals,
    calibrated_confidence,
    calibrated_survival,
    calibrated_survival_np,
    intervals_path,
    load_intervals,
    load_sts,
    save_intervals,
    save_sts,
)

__all__ = [
    "FIT_METHODS",
    "ConfidenceMetrics",
    "ConfidenceRecorder",
    "ConfidenceRecords",
    "ReliabilityBins",
    "StsCalibration",
    "StsTemperatureIntervals",
    "bootstrap_sts_intervals",
    "calibrated_confidence",
    "calibrated_survival",
    "calibrated_survival_np",
    "confidence_metrics",
    "default_temperature_grid",
    "expected_calibration_error",
    "fit_sts",
    "fit_sts_calibration",
    "intervals_path",
    "load_intervals",
    "load_records",
    "load_shard",
    "load_sts",
    "records_metrics",
    "records_reliability",
    "reliability_bins",
    "save_intervals",
    "save_records",
    "save_sts",
    "survival_metrics",
]
