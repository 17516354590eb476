"""Pick a compute dtype that is actually fast on this machine.

bf16 matmuls are fast on GPUs and on CPUs with AVX512-BF16 / AMX, but on an AVX2-only CPU PyTorch
emulates them about 50x slower than fp32 (measured: 1.3 vs 78 GFLOP/s on one core). `auto` therefore
means bf16 where it is native and fp32 elsewhere.

On CPU the answer comes from the CPU's own feature flags (/proc/cpuinfo `avx512_bf16` or `amx_bf16`):
torch's reported capability is no guide (an AMD EPYC with avx512_bf16 reports plain "AVX512", where
bf16 ran a 512x576x1536 matmul 2.3x faster than fp32). Without /proc/cpuinfo (not Linux) the
capability string decides."""

from __future__ import annotations

import functools
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


def describe_machine() -> str:
    """One line for every benchmark and results table: CPU model, cores, the speed flags present, torch's
    CPU capability and threads (the CPU differs between machines: print it, never assume it)."""
    import os

    shown = [f for f in SPEED_FLAGS if f in cpu_flags()]
    return (f"{cpu_model()}, {os.cpu_count()} cores, flags: {' '.join(shown) or 'none of ' + '/'.join(SPEED_FLAGS)}, "
            f"torch {torch.__version__} capability {torch.backends.cpu.get_cpu_capability()}, "
            f"{torch.get_num_threads()} threads")


@functools.cache
def bf16_is_fast(device_type: str = "cpu") -> bool:
    if device_type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    flags = cpu_flags()
    if flags:
        return any(f in flags for f in NATIVE_BF16_CPU_FLAGS)
    capability = torch.backends.cpu.get_cpu_capability().upper()
    return "AVX512_BF16" in capability or "AMX" in capability


def resolve_dtype(name: str | torch.dtype, device_type: str = "cpu") -> torch.dtype:
    """'auto' | 'bf16' | 'fp32' (or a torch dtype) -> torch dtype."""
    if isinstance(name, torch.dtype):
        return name
    table = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32, "float32": torch.float32}
    if name == "auto":
        return torch.bfloat16 if bf16_is_fast(device_type) else torch.float32
    try:
        return table[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; choose auto, bf16 or fp32") from None
