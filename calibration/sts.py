"""The STS artifact (SGLang's `DSparkStsCalibration` JSON layout) and the runtime function that applies it.

`StsCalibration` mirrors SGLang 0.5.23's `DSparkStsCalibration` field for field (same names, order,
defaults and `omit_defaults`), so a file written here loads with `--speculative-dspark-confidence-sts-path`
and one fitted by `python -m sglang.benchmark.dspark_sts_fit` loads here. Our load is stricter: finite
temperatures, unknown fields rejected, optional gamma check."""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

import msgspec
import numpy as np
import torch


class StsCalibration(msgspec.Struct, frozen=True, omit_defaults=True, forbid_unknown_fields=True):
    temperatures: list[float]
    dataset: str = ""
    num_samples: int = 0
    ece_before: list[float] = []
    ece_after: list[float] = []

    def __post_init__(self) -> None:
        if not self.temperatures:
            raise ValueError(
                "STS calibration needs at least one temperature (one per draft slot, gamma in all)"
            )
        for slot, temperature in enumerate(self.temperatures):
            if not math.isfinite(temperature) or temperature <= 0:
                raise ValueError(
                    f"STS temperature for slot {slot} must be finite and > 0, got {temperature}; "
                    "refit with `hspec calibrate fit`"
                )
        if self.num_samples < 0:
            raise ValueError(f"num_samples must be >= 0, got {self.num_samples}")
        for name in ("ece_before", "ece_after"):
            values = getattr(self, name)
            if values and len(values) != len(self.temperatures):
                raise ValueError(
                    f"{name} has {len(values)} entries but there are {len(self.temperatures)} temperatures; "
                    "it must be empty or one entry per slot"
                )
            if any(not math.isfinite(v) or v < 0 for v in values):
                raise ValueError(f"{name} entries must be finite and >= 0, got {values}")

    @property
    def gamma(self) -> int:
        return len(self.temperatures)

    def to_json(self) -> str:
        return msgspec.json.encode(self).decode("utf-8")

    @classmethod
    def from_json(
        cls, data: str | bytes, *, gamma: int | None = None, source: str = "STS JSON"
    ) -> StsCalibration:
        raw = data.encode("utf-8") if isinstance(data, str) else data
        try:
            calibration = msgspec.json.decode(raw, type=cls)
        except msgspec.DecodeError as exc:
            # ValidationError is a DecodeError: wrong types, missing fields and __post_init__ failures land here.
            raise ValueError(
                f"{source} is not a valid STS calibration ({exc}); expected SGLang's DSparkStsCalibration "
                'layout {"temperatures": [gamma positive floats], "dataset", "num_samples", "ece_before", '
                '"ece_after"}, as written by `hspec calibrate fit`'
            ) from None
        if gamma is not None and calibration.gamma != gamma:
            raise ValueError(
                f"{source} holds {calibration.gamma} temperatures but gamma is {gamma}; "
                f"refit with `hspec calibrate fit --gamma {gamma}` on records from this drafter"
            )
        return calibration


def load_sts(path: str | os.PathLike, *, gamma: int | None = None) -> StsCalibration:
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise FileNotFoundError(f"cannot read STS calibration {str(path)!r}: {exc.strerror}") from None
    return StsCalibration.from_json(data, gamma=gamma, source=str(path))


def save_sts(calibration: StsCalibration, path: str | os.PathLike) -> Path:
    """Atomic write (temp file + rename) so a crash never leaves a half-written artifact."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_bytes_atomic(path, calibration.to_json().encode("utf-8") + b"\n")
    return path


def write_bytes_atomic(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _temperature_list(
    temperatures: StsCalibration | Sequence[float] | torch.Tensor | np.ndarray,
) -> list[float]:
    if isinstance(temperatures, StsCalibration):
        return list(temperatures.temperatures)
    if isinstance(temperatures, torch.Tensor | np.ndarray):
        return [float(t) for t in temperatures.reshape(-1).tolist()]
    return [float(t) for t in temperatures]


def _check_temperatures(values: list[float], gamma: int) -> None:
    if len(values) != gamma:
        raise ValueError(
            f"confidence logits have gamma={gamma} slots but {len(values)} temperatures were given; "
            "use the STS file fitted for this drafter's block size"
        )
    if any(not math.isfinite(t) or t <= 0 for t in values):
        raise ValueError(f"temperatures must be finite and > 0, got {values}")


def calibrated_confidence(
    *,
    confidence_logits: torch.Tensor,
    temperatures: StsCalibration | Sequence[float] | torch.Tensor | None,
) -> torch.Tensor:
    """Per-slot conditional confidence c_j = sigmoid(z_j / T_j) over the last dim of raw logits [..., gamma]
    (what the scheduler's planners take; `calibrated_survival` is its cumulative product).

    `temperatures=None` means uncalibrated (all T = 1). float32 on the logits' device."""
    gamma = confidence_logits.shape[-1]
    z = confidence_logits.float()
    if temperatures is not None:
        values = _temperature_list(temperatures)
        _check_temperatures(values, gamma)
        z = z / torch.tensor(values, dtype=torch.float32, device=z.device)
    return torch.sigmoid(z)


def calibrated_survival(
    *,
    confidence_logits: torch.Tensor,
    temperatures: StsCalibration | Sequence[float] | torch.Tensor | None,
) -> torch.Tensor:
    """Cumulative survival a_j = prod_{i<=j} sigmoid(z_i / T_i) over the last dim of raw logits [..., gamma].

    `temperatures=None` means uncalibrated (all T = 1). Computed in float32 (the head's dtype in SGLang)
    and returned in float32 on the logits' device."""
    return torch.cumprod(
        calibrated_confidence(confidence_logits=confidence_logits, temperatures=temperatures), dim=-1
    )


def calibrated_survival_np(
    *,
    confidence_logits: np.ndarray,
    temperatures: StsCalibration | Sequence[float] | np.ndarray | None,
) -> np.ndarray:
    """numpy twin of `calibrated_survival` in float64 (the fit and the metrics run in numpy)."""
    z = np.asarray(confidence_logits, dtype=np.float64)
    if temperatures is not None:
        values = _temperature_list(temperatures)
        _check_temperatures(values, z.shape[-1])
        z = z / np.asarray(values, dtype=np.float64)
    # 0.5 * (1 + tanh(z / 2)) is sigmoid without overflow warnings for large |z|
    return np.cumprod(0.5 * (1.0 + np.tanh(0.5 * z)), axis=-1)
