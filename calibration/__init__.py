"""Confidence calibration: sequential temperature scaling (STS), confidence metrics, records, CLI.

Artifacts use SGLang's `DSparkStsCalibration` JSON layout and `StsDataRecorder` shard layout."""

from .fit import default_temperature_grid, fit_sts, fit_sts_calibration
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
    calibrated_confidence,
    calibrated_survival,
    calibrated_survival_np,
    load_sts,
    save_sts,
)

__all__ = [
    "ConfidenceMetrics",
    "ConfidenceRecorder",
    "ConfidenceRecords",
    "ReliabilityBins",
    "StsCalibration",
    "calibrated_confidence",
    "calibrated_survival",
    "calibrated_survival_np",
    "confidence_metrics",
    "default_temperature_grid",
    "expected_calibration_error",
    "fit_sts",
    "fit_sts_calibration",
    "load_records",
    "load_shard",
    "load_sts",
    "records_metrics",
    "records_reliability",
    "reliability_bins",
    "save_records",
    "save_sts",
    "survival_metrics",
]
