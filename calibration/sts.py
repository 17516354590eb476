"""The STS artifact (SGLang's `DSparkStsCalibration` JSON layout) and the runtime function that applies it.

`StsCalibration` mirrors SGLang 0.5.23's `DSparkStsCalibration` field for field (same names, order,
defaults and `omit_defaults`), so a file written here loads with `--speculative-dspark-confidence-sts-path`
and one fitted by `python -m sglang.benchmark.dspark_sts_fit` loads here. Our load is stricter: finite
temperatures, unknown fields rejected, optional block-size check. (SGLang calls the block size `gamma`; the
JSON field names stay SGLang's.) `StsTemperatureIntervals` is our sidecar with each slot's bootstrap interval,
kept out of the STS file so that both loaders keep reading it."""

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
                "STS calibration needs at least one temperature (one per draft slot, block_size in all)"
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
    def block_size(self) -> int:
        return len(self.temperatures)

    def to_json(self) -> str:
        return msgspec.json.encode(self).decode("utf-8")

    @classmethod
    def from_json(
        cls, data: str | bytes, *, block_size: int | None = None, source: str = "STS JSON"
    ) -> StsCalibration:
        raw = data.encode("utf-8") if isinstance(data, str) else data
        try:
            calibration = msgspec.json.decode(raw, type=cls)
        except msgspec.DecodeError as exc:
            # ValidationError is a DecodeError: wrong types, missing fields and __post_init__ failures land here.
            raise ValueError(
                f"{source} is not a valid STS calibration ({exc}); expected SGLang's DSparkStsCalibration "
                'layout {"temperatures": [block_size positive floats], "dataset", "num_samples", "ece_before", '
                '"ece_after"}, as written by `hspec calibrate fit`'
            ) from None
        if block_size is not None and calibration.block_size != block_size:
            raise ValueError(
                f"{source} holds {calibration.block_size} temperatures but the drafter's block size is "
                f"{block_size}; refit with `hspec calibrate fit --block-size {block_size}` on records from "
                "this drafter"
            )
        return calibration


def load_sts(path: str | os.PathLike, *, block_size: int | None = None) -> StsCalibration:
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise FileNotFoundError(f"cannot read STS calibration {str(path)!r}: {exc.strerror}") from None
    return StsCalibration.from_json(data, block_size=block_size, source=str(path))


def save_sts(calibration: StsCalibration, path: str | os.PathLike) -> Path:
    """Atomic write (temp file + rename) so a crash never leaves a half-written artifact."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_bytes_atomic(path, calibration.to_json().encode("utf-8") + b"\n")
    return path


class StsTemperatureIntervals(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Each slot's fitted temperature with its bootstrap percentile interval (`hspec calibrate fit` writes
    it next to the STS file as `<name>.intervals.json`; see `intervals_path`)."""

    method: str
    confidence: float
    num_resamples: int
    seed: int
    num_samples: int
    temperatures: list[float]
    lower: list[float]
    upper: list[float]

    def __post_init__(self) -> None:
        if not 0 < self.confidence < 1:
            raise ValueError(f"interval confidence must be in (0, 1), got {self.confidence}")
        if not (len(self.temperatures) == len(self.lower) == len(self.upper) >= 1):
            raise ValueError(
                f"intervals need one temperature, lower and upper bound per slot, got {len(self.temperatures)}, "
                f"{len(self.lower)} and {len(self.upper)} entries"
            )
        for slot, (t, lo, hi) in enumerate(zip(self.temperatures, self.lower, self.upper)):
            if not all(math.isfinite(v) and v > 0 for v in (t, lo, hi)) or lo > hi:
                raise ValueError(
                    f"slot {slot}: interval [{lo}, {hi}] around T = {t} must be finite, > 0, lo <= hi"
                )

    @property
    def block_size(self) -> int:
        return len(self.temperatures)

    def to_json(self) -> str:
        return msgspec.json.encode(self).decode("utf-8")


def intervals_path(sts_path: str | os.PathLike) -> Path:
    """`sts.json` -> `sts.intervals.json`: the sidecar stays beside the file it describes."""
    path = Path(sts_path)
    return path.with_name(f"{path.stem}.intervals.json")


def save_intervals(intervals: StsTemperatureIntervals, path: str | os.PathLike) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_bytes_atomic(path, msgspec.json.format(intervals.to_json().encode("utf-8")) + b"\n")
    return path


def load_intervals(path: str | os.PathLike) -> StsTemperatureIntervals:
    path = Path(path)
    try:
        return msgspec.json.decode(path.read_bytes(), type=StsTemperatureIntervals)
    except OSError as exc:
        raise FileNotFoundError(f"cannot read STS intervals {str(path)!r}: {exc.strerror}") from None
    except msgspec.DecodeError as exc:
        raise ValueError(
            f"{path} is not a valid STS interval file ({exc}); rewrite it with `hspec calibrate fit`"
        ) from None


def write_bytes_atomic(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())  # on disk before the rename: a power cut never leaves an empty file
        os.replace(tmp, path)
    except BaseException as e:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(e, OSError):  # a full disk: the previous file, if any, is unchanged
            raise OSError(e.errno, f"could not write {path}: {e.strerror or e}; the disk may be full "
                          "(the previous file, if any, is unchanged)") from e
        raise


def _temperature_list(
    temperatures: StsCalibration | Sequence[float] | torch.Tensor | np.ndarray,
) -> list[float]:
    if isinstance(temperatures, StsCalibration):
        return list(temperatures.temperatures)
    if isinstance(temperatures, torch.Tensor | np.ndarray):
        return [float(t) for t in temperatures.reshape(-1).tolist()]
    return [float(t) for t in temperatures]


def _check_temperatures(values: list[float], block_size: int) -> None:
    if len(values) != block_size:
        raise ValueError(
            f"confidence logits have block_size={block_size} slots but {len(values)} temperatures were given; "
            "use the STS file fitted for this drafter's block size"
        )
    if any(not math.isfinite(t) or t <= 0 for t in values):
        raise ValueError(f"temperatures must be finite and > 0, got {values}")


def calibrated_confidence(
    *,
    confidence_logits: torch.Tensor,
    temperatures: StsCalibration | Sequence[float] | torch.Tensor | None,
) -> torch.Tensor:
    """Per-slot conditional confidence c_j = sigmoid(z_j / T_j) over the last dim of raw logits [..., block_size]
    (what the scheduler's planners take; `calibrated_survival` is its cumulative product).

    `temperatures=None` means uncalibrated (all T = 1). float32 on the logits' device."""
    block_size = confidence_logits.shape[-1]
    z = confidence_logits.float()
    if temperatures is not None:
        values = _temperature_list(temperatures)
        _check_temperatures(values, block_size)
        z = z / torch.tensor(values, dtype=torch.float32, device=z.device)
    return torch.sigmoid(z)


def calibrated_survival(
    *,
    confidence_logits: torch.Tensor,
    temperatures: StsCalibration | Sequence[float] | torch.Tensor | None,
) -> torch.Tensor:
    """Cumulative survival a_j = prod_{i<=j} sigmoid(z_i / T_i) over the last dim of raw logits [..., block_size].

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
