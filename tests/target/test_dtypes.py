import pytest
import torch

from sglang_hspec.target import dtypes


@pytest.fixture
def fake_cpu(monkeypatch):
    """Pretend to run on a CPU with the given /proc/cpuinfo flags and torch capability string."""

    def set_cpu(flags, capability="AVX2"):
        monkeypatch.setattr(dtypes, "cpu_flags", lambda: frozenset(flags))
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
        dtypes.bf16_is_fast.cache_clear()

    yield set_cpu
    dtypes.bf16_is_fast.cache_clear()


@pytest.mark.parametrize("flags, capability, want", [
    ({"avx", "avx2", "fma"}, "AVX2", torch.float32),  # this CI machine: AVX2-only AMD EPYC
    ({"avx2", "avx512f", "avx512bw"}, "AVX512", torch.float32),  # AVX-512 without bf16 (Skylake-SP)
    ({"avx2", "avx512f", "avx512_bf16"}, "AVX512", torch.bfloat16),  # Zen 4 EPYC: torch says only "AVX512"
    ({"avx2", "avx512f", "amx_bf16", "amx_tile"}, "AVX512", torch.bfloat16),  # Sapphire Rapids
])
def test_auto_dtype_follows_the_cpu_flags_not_the_capability_string(fake_cpu, flags, capability, want):
    fake_cpu(flags, capability)
    assert dtypes.resolve_dtype("auto", "cpu") == want
    assert dtypes.resolve_dtype("fp32", "cpu") == torch.float32 and dtypes.resolve_dtype("bf16", "cpu") == torch.bfloat16


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
