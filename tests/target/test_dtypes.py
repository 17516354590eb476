import json

import pytest
import torch

from sglang_hspec.target import dtypes


@pytest.fixture
def fake_cpu(monkeypatch):
    """Pretend to run on a CPU with the given /proc/cpuinfo flags and torch capability string."""

    def set_cpu(flags, capability="AVX2", speedup=2.3):
        """`speedup`: what the bf16 micro-benchmark would measure (fp32 time / bf16 time)."""
        monkeypatch.setattr(dtypes, "cpu_flags", lambda: frozenset(flags))
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
        probes = []
        monkeypatch.setattr(dtypes, "cpu_bf16_speedup",
                            lambda workload="decode": probes.append(workload) or speedup)
        monkeypatch.delenv("HSPEC_CPU_BF16", raising=False)
        dtypes.bf16_is_fast.cache_clear()
        return probes

    yield set_cpu
    dtypes.bf16_is_fast.cache_clear()


@pytest.mark.parametrize("flags, capability, want", [
    ({"avx", "avx2", "fma"}, "AVX2", torch.float32),  # this CI machine: AVX2-only AMD EPYC
    ({"avx2", "avx512f", "avx512bw"}, "AVX512", torch.float32),  # AVX-512 without bf16 (Skylake-SP)
    ({"avx2", "avx512f", "avx512_bf16"}, "AVX512", torch.bfloat16),  # Zen 4 EPYC: torch says only "AVX512"
    ({"avx2", "avx512f", "amx_bf16", "amx_tile"}, "AVX512", torch.bfloat16),  # Sapphire Rapids
])
def test_auto_dtype_follows_the_cpu_flags_not_the_capability_string(fake_cpu, flags, capability, want):
    probes = fake_cpu(flags, capability)
    assert dtypes.resolve_dtype("auto", "cpu") == want
    # only a CPU whose flags allow bf16 is measured; emulated bf16 needs no benchmark to lose
    assert len(probes) == (want == torch.bfloat16)
    assert dtypes.resolve_dtype("fp32", "cpu") == torch.float32 and dtypes.resolve_dtype("bf16", "cpu") == torch.bfloat16


@pytest.mark.parametrize("speedup, want", [(2.3, torch.bfloat16), (1.1, torch.bfloat16), (1.05, torch.float32),
                                           (0.61, torch.float32)])
def test_bf16_flags_are_not_enough_the_measured_speedup_decides(fake_cpu, speedup, want):
    """0.61: the Intel Xeon with avx512_bf16 listed where fp32 ran SmolLM2's MLP matmul faster."""
    fake_cpu({"avx2", "avx512f", "avx512_bf16"}, "AVX512", speedup=speedup)
    assert dtypes.resolve_dtype("auto", "cpu") == want


def test_hspec_cpu_bf16_overrides_the_measurement(fake_cpu, monkeypatch):
    probes = fake_cpu({"avx2", "avx512f", "avx512_bf16"}, "AVX512", speedup=0.5)
    monkeypatch.setenv("HSPEC_CPU_BF16", "1")
    assert dtypes.resolve_dtype("auto", "cpu") == torch.bfloat16 and probes == []
    dtypes.bf16_is_fast.cache_clear()
    monkeypatch.setenv("HSPEC_CPU_BF16", "yes")
    with pytest.raises(ValueError, match="HSPEC_CPU_BF16='yes'.*1.*0"):
        dtypes.resolve_dtype("auto", "cpu")


def fake_probe(monkeypatch, seconds_per_row):
    """Replace the timed matmul: `seconds_per_row[dtype](rows)` seconds; returns the (rows, dtype) timed."""
    timed = []
    monkeypatch.setattr(dtypes, "_probe_weights", lambda: torch.zeros(2, 3, 4))  # no 0.5 GB in a test
    monkeypatch.setattr(dtypes, "_matmul_seconds",
                        lambda rows, weights: timed.append((rows, weights.dtype)) or seconds_per_row[weights.dtype](rows))
    return timed


def test_the_speedup_is_measured_once_and_cached_per_cpu(monkeypatch, tmp_path):
    monkeypatch.setenv("HSPEC_CACHE_DIR", str(tmp_path))
    for name in dtypes.ISA_CAP_ENV:
        monkeypatch.delenv(name, raising=False)
    timed = fake_probe(monkeypatch, {torch.float32: lambda rows: 2.0 * rows, torch.bfloat16: lambda rows: 1.0 * rows})
    assert dtypes.cpu_bf16_speedup() == pytest.approx(2.0)
    assert sorted({rows for rows, _ in timed}) == sorted(dtypes.BF16_PROBE_ROWS)
    timed.clear()
    assert dtypes.cpu_bf16_speedup() == pytest.approx(2.0) and timed == []  # read back from the cache
    assert dtypes.cpu_bf16_speedup("batch") == pytest.approx(2.0) and timed == []  # one probe serves both workloads
    monkeypatch.setattr(dtypes, "cpu_model", lambda: "another CPU")
    dtypes.cpu_bf16_speedup()
    assert timed  # another CPU model is measured anew
    timed.clear()
    dtypes.cpu_bf16_speedup()
    assert timed == []
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")  # the same CPU with oneDNN capped is another machine
    dtypes.cpu_bf16_speedup()
    assert timed
    timed.clear()
    monkeypatch.setattr(torch, "get_num_threads", lambda: 7)  # and so is another thread count
    dtypes.cpu_bf16_speedup()
    assert timed


def test_each_workload_reads_its_own_rows_of_the_probe(monkeypatch, tmp_path):
    """The AMX Xeon (family 6 model 207, amx_bf16): the probe's fp32/bf16 ratios were ~0.85 / 2.05 / 3.25 at
    1 / 8 / 256 rows; with ratios 0.6 / 1.05 / 3.3 decode (median 1.05 < 1.1) stays fp32 while training
    (256 rows: 3.3) gets bf16, and the machine line names both."""
    monkeypatch.setenv("HSPEC_CACHE_DIR", str(tmp_path))
    ratio = {1: 0.6, 8: 1.05, 256: 3.3}
    fake_probe(monkeypatch, {torch.float32: lambda rows: ratio[rows], torch.bfloat16: lambda rows: 1.0})
    monkeypatch.setattr(dtypes, "cpu_flags", lambda: frozenset({"avx2", "avx512f", "avx512_bf16", "amx_bf16"}))
    monkeypatch.delenv("HSPEC_CPU_BF16", raising=False)
    dtypes.bf16_is_fast.cache_clear()
    try:
        assert dtypes.cpu_bf16_speedup("decode") == pytest.approx(1.05)
        assert dtypes.cpu_bf16_speedup("batch") == pytest.approx(3.3)
        assert dtypes.resolve_dtype("auto", "cpu") == torch.float32
        assert dtypes.resolve_dtype("auto", "cpu", workload="batch") == torch.bfloat16
        assert "auto dtype fp32 (decode), bf16 (batch)" in dtypes.describe_machine()
        with pytest.raises(ValueError, match="workload 'train': choose one of decode, batch"):
            dtypes.resolve_dtype("auto", "cpu", workload="train")
    finally:
        dtypes.bf16_is_fast.cache_clear()


def test_a_probe_cached_by_the_older_method_is_measured_anew(monkeypatch, tmp_path):
    """Probe v1 timed one cache-resident matrix (fp32 looked 1.7x better than it is at one row); its entries
    carry no version and must not decide."""
    monkeypatch.setenv("HSPEC_CACHE_DIR", str(tmp_path))
    for name in dtypes.ISA_CAP_ENV:
        monkeypatch.delenv(name, raising=False)
    old_key = (f"{dtypes.cpu_model()} | {' '.join(sorted(f for f in dtypes.SPEED_FLAGS if f in dtypes.cpu_flags()))}"
               f" | torch {torch.__version__}")
    (tmp_path / "dtype_probe.json").write_text(
        json.dumps({old_key: {"speedup": 0.5, "per_rows": {"1": 0.5, "8": 0.5, "256": 0.5}}}))
    timed = fake_probe(monkeypatch, {torch.float32: lambda rows: 3.0, torch.bfloat16: lambda rows: 1.0})
    assert dtypes.cpu_bf16_speedup() == pytest.approx(3.0) and timed


def test_isa_caps_are_named_in_the_machine_line(monkeypatch):
    for name in dtypes.ISA_CAP_ENV:
        monkeypatch.delenv(name, raising=False)
    assert dtypes.isa_caps() == "" and "ISA capped" not in dtypes.describe_machine()
    monkeypatch.setenv("MKL_ENABLE_INSTRUCTIONS", "AVX2")
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    assert dtypes.isa_caps() == "ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2"
    assert dtypes.describe_machine().endswith(", ISA capped by ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2")


def test_without_proc_cpuinfo_the_capability_string_decides(fake_cpu):
    fake_cpu(set(), "AVX512_BF16")
    assert dtypes.bf16_is_fast("cpu")
    fake_cpu(set(), "AVX2")
    assert not dtypes.bf16_is_fast("cpu")


def test_cpu_flags_reads_this_machine():
    flags = dtypes.cpu_flags()
    if not flags:
        pytest.skip("no /proc/cpuinfo flags on this platform")
    # x86 Linux lists its SIMD extensions there; sse2 is part of x86-64 itself
    assert "sse2" in flags


def test_unknown_dtype_is_a_clear_error():
    with pytest.raises(ValueError, match="choose auto, bf16 or fp32"):
        dtypes.resolve_dtype("fp8")
