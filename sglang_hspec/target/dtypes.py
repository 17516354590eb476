"""Pick a compute dtype that is actually fast on this machine.

bf16 matmuls are fast on GPUs and on some CPUs with AVX512-BF16 / AMX, but on an AVX2-only CPU PyTorch
emulates them about 50x slower than fp32 (measured: 1.3 vs 78 GFLOP/s on one core). `auto` therefore
means bf16 where it is fast and fp32 elsewhere.

On CPU the flags are necessary, not sufficient. Without `avx512_bf16` / `amx_bf16` in /proc/cpuinfo bf16
is emulated and fp32 wins. With them, which is faster depends on the chip, on which kernels the
hypervisor lets oneDNN use and on how many rows each matmul has: an AMD EPYC with avx512_bf16 ran a
512x576x1536 matmul 2.3x faster in bf16; an Intel Xeon (family 6 model 207, avx512_bf16 listed, no amx
flags) ran SmolLM2's MLP matmul 1.3-1.7x *slower* in bf16 than fp32 at 1-2048 rows; the same model with
amx_bf16 ran SmolLM2 about as fast in bf16 as in fp32 at one row and 3.5x faster at 2 x 512 (AMX tiles
pay only with many rows). So where the flags allow bf16, a one-off micro-benchmark decides
(`cpu_bf16_speedup`: SmolLM2's MLP shape at 1, 8 and 256 rows, bf16 against fp32, streaming through as
many distinct weights as the embedded target holds, since a model's weights never sit in cache), cached
per CPU model, flags, torch version and thread count under `$HSPEC_CACHE_DIR/dtype_probe.json`, per workload:
`decode` (the engine at small batches: one-row decodes, 8-row verifies, a prefill; the median of the three
ratios) and `batch` (training, regeneration, anything with hundreds of rows per matmul: the 256-row ratio).
`HSPEC_CPU_BF16=1` / `0` overrides both. torch's reported capability is no guide (that EPYC reports
plain "AVX512"); without /proc/cpuinfo (not Linux) the capability string decides."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import time
from pathlib import Path

import torch

NATIVE_BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where it does not exist)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.split(":", 1)[0].strip() == "flags":
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


# the flags that decide CPU speed here: which matmul dtypes are native
SPEED_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), else what the platform says."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.split(":", 1)[0].strip() == "model name":
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine() or "unknown CPU"


# environment variables that cap which instructions torch's own kernels, oneDNN and MKL use: with them a
# CPU computes like an older one (ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2
# runs an AVX-512 machine as an AVX2-only one), so they are part of what a timing or a dtype probe measured
ISA_CAP_ENV = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")


def isa_caps() -> str:
    """The ISA caps set in this process's environment, as `NAME=value` words ('' when none)."""
    return " ".join(f"{name}={os.environ[name]}" for name in ISA_CAP_ENV if os.environ.get(name, "").strip())


def describe_machine() -> str:
    """One line for every benchmark and results table: CPU model, cores, the speed flags present, torch's
    CPU capability, threads and what `--dtype auto` picks here (the CPU differs between machines: print
    it, never assume it), for both workloads where they differ."""
    shown = [f for f in SPEED_FLAGS if f in cpu_flags()]
    picks = {w: "bf16" if bf16_is_fast("cpu", w) else "fp32" for w in WORKLOADS}
    auto = picks["decode"] if len(set(picks.values())) == 1 else ", ".join(f"{d} ({w})" for w, d in picks.items())
    return (f"{cpu_model()}, {os.cpu_count()} cores, flags: {' '.join(shown) or 'none of ' + '/'.join(SPEED_FLAGS)}, "
            f"torch {torch.__version__} capability {torch.backends.cpu.get_cpu_capability()}, "
            f"{torch.get_num_threads()} threads, auto dtype {auto}"
            + (f", ISA capped by {caps}" if (caps := isa_caps()) else ""))


BF16_PROBE_ROWS = (1, 8, 256)  # a decode step, a verify block, a training / prefill batch
BF16_MIN_SPEEDUP = 1.1  # bf16 must beat fp32 by this much to be picked
# decode: the engine at small batches (median over the probe rows, so one disturbed timing cannot decide);
# batch: training, regeneration and other work with hundreds of rows per matmul
WORKLOADS = ("decode", "batch")
PROBE_VERSION = 2  # 2: streams distinct weights (1 timed one cache-resident matrix, which favoured fp32)
PROBE_WEIGHT_BYTES = 512 << 20  # ~ the embedded target's fp32 weights: more than any L3 this runs on


def _probe_weights(*, in_features: int = 576, out_features: int = 1536) -> torch.Tensor:
    """[n, out, in] fp32 weights, `PROBE_WEIGHT_BYTES` in all (values only need to be ordinary floats)."""
    n = max(1, PROBE_WEIGHT_BYTES // (in_features * out_features * 4))
    gen = torch.Generator().manual_seed(0)
    return torch.empty(n, out_features, in_features).uniform_(-0.05, 0.05, generator=gen)


def _matmul_seconds(rows: int, weights: torch.Tensor) -> float:
    """Best of 2 timings of `F.linear` per weight matrix at `rows` rows, each call on the next of `weights`
    (as a forward walks its layers), in the weights' dtype."""
    x = torch.rand(rows, weights.shape[-1], generator=torch.Generator().manual_seed(0)).to(weights.dtype)
    calls = weights.shape[0] if rows < 64 else max(8, weights.shape[0] // 16)  # many rows: compute-bound
    torch.nn.functional.linear(x, weights[0])  # warm-up: oneDNN picks and caches its kernel
    best = float("inf")
    for _ in range(2):
        t = time.perf_counter()
        for i in range(calls):
            torch.nn.functional.linear(x, weights[i])
        best = min(best, (time.perf_counter() - t) / calls)
    return best


def _measure_bf16_ratios() -> dict[int, float]:
    """fp32 time over bf16 time per probe row count (~2 s, 0.8 GB transient)."""
    fp32 = _probe_weights()
    bf16 = fp32.to(torch.bfloat16)
    return {rows: _matmul_seconds(rows, fp32) / _matmul_seconds(rows, bf16) for rows in BF16_PROBE_ROWS}


def _check_workload(workload: str) -> None:
    if workload not in WORKLOADS:
        raise ValueError(f"workload {workload!r}: choose one of {', '.join(WORKLOADS)}")


def _speedup_for(ratios: dict[int, float], workload: str) -> float:
    """The probe's ratio for `workload`: the median over its rows (decode) or its largest row count (batch)."""
    if workload == "decode":
        return float(sorted(ratios.values())[len(ratios) // 2])
    return float(ratios[max(ratios)])


def cpu_bf16_speedup(workload: str = "decode") -> float:
    """fp32 time over bf16 time of SmolLM2's MLP matmul for `workload` (> 1: bf16 is faster here; see the
    module docstring). Measured once per CPU model, flags, torch version, thread count and ISA caps
    (`isa_caps`; ~2 s) and cached on disk."""
    from sglang_hspec.assets.embedded import default_cache_dir

    _check_workload(workload)  # before any timing
    # threads are part of the machine too: one thread and two read different ratios (AMX Xeon: 2.18 vs 1.50 at 8 rows)
    key = (f"{cpu_model()} | {' '.join(sorted(f for f in SPEED_FLAGS if f in cpu_flags()))} | torch {torch.__version__}"
           f" | {torch.get_num_threads()} threads | probe v{PROBE_VERSION}")
    if caps := isa_caps():  # a capped ISA is another machine to the probe
        key += f" | {caps}"
    path = default_cache_dir() / "dtype_probe.json"
    try:
        cached = json.loads(path.read_text())
    except (OSError, ValueError):
        cached = {}
    entry = cached.get(key)
    if isinstance(entry, dict) and isinstance(entry.get("per_rows"), dict):
        try:
            return _speedup_for({int(k): float(v) for k, v in entry["per_rows"].items()}, workload)
        except (TypeError, ValueError):
            pass  # a damaged entry is measured anew
    ratios = _measure_bf16_ratios()
    cached[key] = {"per_rows": {str(k): round(v, 3) for k, v in ratios.items()},
                   **{w: round(_speedup_for(ratios, w), 3) for w in WORKLOADS}}
    # target/ sits below core/, so this is the few-line equivalent of core/atomic.py's atomic_open;
    # a cache that cannot be written costs one probe per process, nothing else
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(cached, indent=1))
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
    return _speedup_for(ratios, workload)


@functools.cache
def bf16_is_fast(device_type: str = "cpu", workload: str = "decode") -> bool:
    """Whether bf16 computes faster than fp32 here for `workload` ('decode' | 'batch', module docstring)."""
    _check_workload(workload)
    if device_type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    forced = os.environ.get("HSPEC_CPU_BF16", "").strip()
    if forced in ("0", "1"):
        return forced == "1"
    if forced:
        raise ValueError(f"HSPEC_CPU_BF16={forced!r}: set it to 1 (bf16 on CPU), 0 (fp32) or leave it unset (measure)")
    flags = cpu_flags()
    if flags:
        native = any(f in flags for f in NATIVE_BF16_CPU_FLAGS)
    else:
        capability = torch.backends.cpu.get_cpu_capability().upper()
        native = "AVX512_BF16" in capability or "AMX" in capability
    return native and cpu_bf16_speedup(workload) >= BF16_MIN_SPEEDUP


def resolve_dtype(name: str | torch.dtype, device_type: str = "cpu", *, workload: str = "decode") -> torch.dtype:
    """'auto' | 'bf16' | 'fp32' (or a torch dtype) -> torch dtype; 'auto' decides for `workload`
    ('decode': the engine at small batches; 'batch': training and regeneration)."""
    if isinstance(name, torch.dtype):
        return name
    table = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32, "float32": torch.float32}
    if name == "auto":
        return torch.bfloat16 if bf16_is_fast(device_type, workload) else torch.float32
    try:
        return table[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; choose auto, bf16 or fp32") from None
