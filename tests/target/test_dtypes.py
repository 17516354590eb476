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
        monkeypatch.setattr(dtypes, "cpu_bf16_speedup", lambda: probes.append(1) or speedup)
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


def test_the_speedup_is_measured_once_and_cached_per_cpu(monkeypatch, tmp_path):
    monkeypatch.setenv("HSPEC_CACHE_DIR", str(tmp_path))
    for name in dtypes.ISA_CAP_ENV:
        monkeypatch.delenv(name, raising=False)
    timed = []
    monkeypatch.setattr(dtypes, "_matmul_seconds",
                        lambda rows, dtype: timed.append(rows) or (2.0 if dtype == torch.float32 else 1.0) * rows)
    assert dtypes.cpu_bf16_speedup() == pytest.approx(2.0)
    assert sorted(set(timed)) == sorted(dtypes.BF16_PROBE_ROWS)
    timed.clear()
    assert dtypes.cpu_bf16_speedup() == pytest.approx(2.0) and timed == []  # read back from the cache
    monkeypatch.setattr(dtypes, "cpu_model", lambda: "another CPU")
    dtypes.cpu_bf16_speedup()
    assert timed  # another CPU model is measured anew
    timed.clear()
    dtypes.cpu_bf16_speedup()
    assert timed == []
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")  # the same CPU with oneDNN capped is another machine
    dtypes.cpu_bf16_speedup()
    assert timed


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
