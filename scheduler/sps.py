"""Steps-per-second (SPS) cost tables, JSON-compatible with SGLang's DSpark layouts.

Two layouts, byte-for-byte the field names of `sglang/srt/speculative/dspark_components/dspark_sps.py`:

- `SpsCostTable{sample_batch_tokens, sample_steps_per_sec, max_batch_tokens}`: a floor step function
  (the probe at `bisect_right - 1`), clamped to the first probe below it.
- `SpsAdditiveCostTable{bias_seconds, bs_probes, alpha_seconds, m_probes, theta_seconds}`: step time
  `bias + alpha(num_reqs) + theta(num_reqs + budget)`, each term linearly interpolated and clamped.

Batch tokens count what the target verifies in one forward: B = sum_r (1 + verify_length_r), the
anchor plus verify_length_r draft tokens per request.

The floor table may also carry the rest of a step's cost, so that speculation can be weighed against
plain decoding (`sglang_hspec.scheduler.switch`): `plain_batch_sizes` (requests, one token each),
`plain_steps_per_sec` (plain decode steps/s at that many requests) and `draft_seconds` (the drafter's
propose forward at that many requests). The fields are optional (empty = not profiled) and SGLang's
`SpsCostTable` ignores keys it does not know, so an extended file still loads there unchanged. `SpsCurve` turns either table into a vectorised torch lookup; beyond
`max_batch_tokens` a floor table reports 0 steps/s so planners never plan past capacity.
"""

from __future__ import annotations

import bisect
import json
import math
import os
from pathlib import Path

import msgspec
import numpy as np
import torch


def _check_probes(name: str, probes: list[int], values: list[float], values_name: str) -> None:
    if not probes:
        raise ValueError(f"{name} is empty: an SPS table needs at least one probe (run `hspec profile-sps`)")
    if any(p < 1 for p in probes):
        raise ValueError(f"{name} must hold batch sizes >= 1, got {probes}")
    if any(b <= a for a, b in zip(probes, probes[1:])):
        raise ValueError(
            f"{name} must be strictly increasing, got {probes}; sort the probes and median repeated "
            "measurements of one size into a single probe"
        )
    if len(probes) != len(values):
        raise ValueError(
            f"{name} and {values_name} must have equal length, got {len(probes)} vs {len(values)}"
        )
    bad = [v for v in values if not math.isfinite(v)]
    if bad:
        raise ValueError(f"{values_name} must be finite, got {bad}")


class SpsCostTable(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """Floor step table: steps/s measured at strictly increasing batch-token probes, optionally with
    plain-decode steps/s and the drafter's seconds per propose at strictly increasing request counts."""

    sample_batch_tokens: list[int]
    sample_steps_per_sec: list[float]
    max_batch_tokens: int
    plain_batch_sizes: list[int] = []
    plain_steps_per_sec: list[float] = []
    draft_seconds: list[float] = []

    def __post_init__(self) -> None:
        if self.plain_batch_sizes or self.plain_steps_per_sec or self.draft_seconds:
            _check_probes("plain_batch_sizes", self.plain_batch_sizes, self.plain_steps_per_sec,
                          "plain_steps_per_sec")
            if any(v <= 0 for v in self.plain_steps_per_sec):
                raise ValueError(f"plain_steps_per_sec must be > 0, got {self.plain_steps_per_sec}")
            if self.draft_seconds and len(self.draft_seconds) != len(self.plain_batch_sizes):
                raise ValueError(
                    f"draft_seconds must be empty (drafter not profiled) or one per plain_batch_sizes "
                    f"entry, got {len(self.draft_seconds)} vs {len(self.plain_batch_sizes)}; re-run "
                    "`hspec profile-sps`"
                )
            if any(not (math.isfinite(v) and v >= 0) for v in self.draft_seconds):
                raise ValueError(f"draft_seconds must be finite and >= 0, got {self.draft_seconds}")
        _check_probes("sample_batch_tokens", self.sample_batch_tokens, self.sample_steps_per_sec,
                      "sample_steps_per_sec")
        if any(v <= 0 for v in self.sample_steps_per_sec):
            raise ValueError(f"sample_steps_per_sec must be > 0, got {self.sample_steps_per_sec}")
        if self.max_batch_tokens < self.sample_batch_tokens[-1]:
            raise ValueError(
                f"max_batch_tokens ({self.max_batch_tokens}) is below the largest probe "
                f"({self.sample_batch_tokens[-1]}); set it to the engine's verify capacity"
            )

    @property
    def uninitialised(self) -> bool:
        # SGLang's no-profile placeholder has one probe: a flat curve makes every token look free.
        return len(self.sample_batch_tokens) <= 1

    def lookup(self, batch_tokens: int) -> float:
        """Floor lookup (SGLang semantics: below the first probe, the first probe's value)."""
        idx = bisect.bisect_right(self.sample_batch_tokens, batch_tokens) - 1
        return self.sample_steps_per_sec[max(0, idx)]

    @property
    def has_plain(self) -> bool:
        return bool(self.plain_batch_sizes)

    def plain_lookup(self, num_reqs: int) -> float:
        """Plain decode steps/s at `num_reqs` requests (floor lookup, like `lookup`). Without plain
        probes: the anchor-only verify step (B = num_reqs), which is what a plain step computes."""
        if not self.plain_batch_sizes:
            return 0.0 if num_reqs > self.max_batch_tokens else self.lookup(num_reqs)
        idx = bisect.bisect_right(self.plain_batch_sizes, num_reqs) - 1
        return self.plain_steps_per_sec[max(0, idx)]

    def draft_lookup(self, num_reqs: int) -> float:
        """Seconds of one draft forward over `num_reqs` requests (floor lookup; 0 if not profiled)."""
        if not self.draft_seconds:
            return 0.0
        idx = bisect.bisect_right(self.plain_batch_sizes, num_reqs) - 1
        return self.draft_seconds[max(0, idx)]


class SpsAdditiveCostTable(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Additive step-time model: bias + alpha(num_reqs) + theta(num_reqs + budget), in seconds."""

    bias_seconds: float
    bs_probes: list[int]
    alpha_seconds: list[float]
    m_probes: list[int]
    theta_seconds: list[float]

    def __post_init__(self) -> None:
        _check_probes("bs_probes", self.bs_probes, self.alpha_seconds, "alpha_seconds")
        _check_probes("m_probes", self.m_probes, self.theta_seconds, "theta_seconds")
        if not (math.isfinite(self.bias_seconds) and self.bias_seconds > 0):
            raise ValueError(f"bias_seconds must be > 0, got {self.bias_seconds}")

    @property
    def uninitialised(self) -> bool:
        return False

    def step_time(self, *, num_reqs: int, budget: int) -> float:
        return (
            self.bias_seconds
            + _interp_clamped(self.bs_probes, self.alpha_seconds, float(num_reqs))
            + _interp_clamped(self.m_probes, self.theta_seconds, float(num_reqs + budget))
        )


def _interp_clamped(xs: list[int], ys: list[float], x: float) -> float:
    if x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        return ys[-1]
    hi = bisect.bisect_right(xs, x)
    frac = (x - xs[hi - 1]) / (xs[hi] - xs[hi - 1])
    return ys[hi - 1] + frac * (ys[hi] - ys[hi - 1])


SpsTable = SpsCostTable | SpsAdditiveCostTable


def sps_table_to_json(table: SpsTable) -> str:
    return msgspec.json.encode(table).decode()


def sps_table_from_json(text: str, *, source: str = "<string>") -> SpsTable:
    """Decode either layout (picked by its keys, as SGLang does) and validate it."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"SPS table {source} is not valid JSON ({e}); re-run `hspec profile-sps`") from e
    if not isinstance(raw, dict):
        raise ValueError(f"SPS table {source} must be a JSON object, got {type(raw).__name__}")
    kind = SpsAdditiveCostTable if "bias_seconds" in raw else SpsCostTable
    try:
        return msgspec.json.decode(text.encode(), type=kind)
    except (msgspec.ValidationError, ValueError) as e:
        fields = ", ".join(kind.__struct_fields__)
        raise ValueError(f"SPS table {source} is not a valid {kind.__name__} ({fields}): {e}") from e


def load_sps_table(path: str | Path) -> SpsTable:
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"SPS table {path} is a directory; pass the table's JSON file (`hspec profile-sps "
                                f"--out {path / 'sps.json'}` writes one)")
    if not path.is_file():
        raise FileNotFoundError(f"SPS table {path} does not exist; create it with `hspec profile-sps --out {path}`")
    return sps_table_from_json(path.read_text(), source=str(path))


def save_sps_table(table: SpsTable, path: str | Path) -> None:
    """Atomic write (temp file + os.replace): a reader never sees half a table."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(sps_table_to_json(table) + "\n")
        os.replace(tmp, path)
    except OSError as e:  # a full disk: drop the partial temp file, keep the previous table
        tmp.unlink(missing_ok=True)
        raise OSError(e.errno, f"could not write SPS table {path}: {e.strerror or e}; the disk may be full "
                      "(the previous table, if any, is unchanged)") from e


class SpsCurve:
    """Vectorised steps/s lookup over batch tokens, dense and cached (one gather per plan)."""

    def __init__(self, table: SpsTable) -> None:
        self.table = table
        self._dense = torch.zeros(0, dtype=torch.float64)
        self._dense_reqs: int | None = None

    def _build(self, *, upto: int, num_reqs: int) -> torch.Tensor:
        t = self.table
        bt = torch.arange(upto + 1, dtype=torch.float64)
        if isinstance(t, SpsCostTable):
            probes = torch.tensor(t.sample_batch_tokens, dtype=torch.float64)
            idx = (torch.searchsorted(probes, bt, right=True) - 1).clamp(min=0)
            sps = torch.tensor(t.sample_steps_per_sec, dtype=torch.float64)[idx]
            return torch.where(bt > t.max_batch_tokens, torch.zeros_like(sps), sps)
        alpha = _interp_clamped(t.bs_probes, t.alpha_seconds, float(num_reqs))
        theta = torch.from_numpy(np.interp(bt.numpy(), t.m_probes, t.theta_seconds))
        return 1.0 / (t.bias_seconds + alpha + theta)

    def _dense_upto(self, *, upto: int, num_reqs: int) -> torch.Tensor:
        additive = isinstance(self.table, SpsAdditiveCostTable)
        if upto >= self._dense.numel() or (additive and num_reqs != self._dense_reqs):
            self._dense = self._build(upto=max(upto, 2 * self._dense.numel(), 64), num_reqs=num_reqs)
            self._dense_reqs = num_reqs
        return self._dense

    def steps_per_sec(self, *, batch_tokens: torch.Tensor, num_reqs: int) -> torch.Tensor:
        """float64 steps/s at each entry of `batch_tokens` (long) for a batch of `num_reqs` requests."""
        upto = int(batch_tokens.max()) if batch_tokens.numel() else 0
        return self._dense_upto(upto=upto, num_reqs=num_reqs)[batch_tokens]

    def steps_per_sec_range(self, *, start: int, count: int, num_reqs: int) -> torch.Tensor:
        """steps/s at batch tokens start, start+1, ..., start+count-1 (a view: no gather on the hot path)."""
        return self._dense_upto(upto=start + count, num_reqs=num_reqs)[start : start + count]

    def scalar(self, *, batch_tokens: int, num_reqs: int) -> float:
        """Plain-Python lookup (the reference planners' source of truth)."""
        t = self.table
        if isinstance(t, SpsCostTable):
            return 0.0 if batch_tokens > t.max_batch_tokens else t.lookup(batch_tokens)
        return 1.0 / t.step_time(num_reqs=num_reqs, budget=batch_tokens - num_reqs)


def synthetic_sps_table(
    *,
    tiers: tuple[int, ...] = (16, 32, 64, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048),
    base_seconds: float = 0.012,
    seconds_per_token: float = 12e-6,
    jitter: float = 0.06,
    seed: int = 0,
) -> SpsCostTable:
    """A GPU-like curve: flat plateaus inside each CUDA-graph tier, a cliff at each tier edge.

    Step time within tier (lo, hi] is that of `hi` tokens (padding to the graph size), plus a
    seeded +-jitter so some plateaus sit lower than their successors (the jagged case)."""
    gen = torch.Generator().manual_seed(seed)
    probes, sps = [1], []
    for i, hi in enumerate(tiers):
        noise = 1.0 + jitter * (2 * float(torch.rand((), generator=gen)) - 1)
        sps.append(1.0 / ((base_seconds + seconds_per_token * hi) * noise))
        if i + 1 < len(tiers):
            probes.append(hi + 1)
    return SpsCostTable(sample_batch_tokens=probes, sample_steps_per_sec=sps, max_batch_tokens=tiers[-1])
