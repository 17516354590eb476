"""The block-parallel SSD scan equals the token-by-token recurrence from a non-zero state."""

import pytest
import torch

from sglang_hspec.model.ssd import ssd_block, ssd_naive


def _inputs(dtype, b=3, L=7, h=8, p=16, n=4, g=4, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def r(*s, scale=1.0):
        return (torch.randn(*s, generator=gen, dtype=torch.float64) * scale).to(dtype)

    x, B, C = r(b, L, h, p), r(b, L, g, n), r(b, L, g, n)
    dt = torch.nn.functional.softplus(r(b, L, h) - 1.0)
    A = -torch.exp(r(h, scale=0.5))
    D, s0 = r(h), r(b, h, p, n)
    return x, dt, A, B, C, D, s0


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
def test_block_scan_equals_recurrence(dtype, tol):
    args = _inputs(dtype)
    assert args[-1].abs().max() > 0.5 and args[3].shape[2] > 1  # non-zero initial state, groups > 1
    y_ref, s_ref = ssd_naive(*_inputs(torch.float64))
    y, s = ssd_block(*args)
    assert y.dtype == dtype
    scale_y, scale_s = y_ref.abs().max(), s_ref.abs().max()
    assert (y.double() - y_ref).abs().max() / scale_y < tol
    assert (s.double() - s_ref).abs().max() / scale_s < tol


def test_initial_state_matters_and_groups_are_per_head():
    x, dt, A, B, C, D, s0 = _inputs(torch.float64)
    y0, _ = ssd_block(x, dt, A, B, C, D, torch.zeros_like(s0))
    y1, _ = ssd_block(x, dt, A, B, C, D, s0)
    assert (y1 - y0).abs().max() > 1e-2
    # changing group 1's B only changes heads 2..3 (h=8, g=4: heads 2i, 2i+1 share group i)
    B2 = B.clone()
    B2[:, :, 1] += 1.0
    y2, _ = ssd_block(x, dt, A, B2, C, D, s0)
    changed = (y2 - y1).abs().amax(dim=(0, 1, 3)) > 1e-9
    assert changed.tolist() == [False, False, True, True, False, False, False, False]


def test_two_blocks_carry_state():
    x, dt, A, B, C, D, s0 = _inputs(torch.float64, L=10)
    y, s = ssd_block(x, dt, A, B, C, D, s0)
    ya, sa = ssd_block(x[:, :4], dt[:, :4], A, B[:, :4], C[:, :4], D, s0)
    yb, sb = ssd_block(x[:, 4:], dt[:, 4:], A, B[:, 4:], C[:, 4:], D, sa)
    torch.testing.assert_close(torch.cat([ya, yb], 1), y, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(sb, s, rtol=1e-12, atol=1e-12)


def test_gradcheck_initial_state():
    x, dt, A, B, C, D, s0 = _inputs(torch.float64, b=2, L=5, h=4, p=3, n=2, g=2)
    s0.requires_grad_(True)
    x.requires_grad_(True)

    def f(s0, x):
        y, s = ssd_block(x, dt, A, B, C, D, s0)
        return y, s

    assert torch.autograd.gradcheck(f, (s0, x))


# ---- kernel dispatch (CPU-testable logic; the kernels themselves: test_ssd_triton.py, test_gpu.py) ----
from sglang_hspec.model import ssd  # noqa: E402

CUDA = torch.device("cuda")  # only passed around: nothing here touches a GPU


@pytest.fixture
def kernels(monkeypatch):
    """Pretend which kernels import: {backend: True/False}; clears the once-per-process log."""
    monkeypatch.delenv(ssd.SCAN_ENV, raising=False)
    monkeypatch.setattr(ssd, "_LOGGED", set())

    def set_(**present):
        table = {b: (object() if ok else ImportError(f"No module named {b!r}")) for b, ok in present.items()}
        monkeypatch.setattr(ssd, "_KERNELS", table)
    return set_


def test_cpu_runs_the_torch_scan(kernels):
    kernels(sglang=True, mamba_ssm=True)
    assert ssd.scan_backend(device=torch.device("cpu"), needs_grad=False) == "torch"
    args = _inputs(torch.float64)
    raw_dt = torch.randn(args[1].shape, dtype=torch.float64)
    bias = torch.zeros(args[0].shape[2], dtype=torch.float64)
    ssd.SCANS_RUN.clear()
    y, s = ssd.mamba_block(args[0], raw_dt, *args[2:5], args[5], bias, args[6], chunk_size=256)
    y_ref, s_ref = ssd_naive(args[0], torch.nn.functional.softplus(raw_dt), *args[2:5], args[5], args[6])
    torch.testing.assert_close((y, s), (y_ref, s_ref), rtol=1e-10, atol=1e-10)
    assert ssd.SCANS_RUN == {"torch"}


def test_cuda_prefers_sglang_for_inference_and_mamba_ssm_for_training(kernels, caplog):
    kernels(sglang=True, mamba_ssm=True)
    with caplog.at_level("INFO", logger=ssd.__name__):
        assert ssd.scan_backend(device=CUDA, needs_grad=False) == "sglang"
        assert ssd.scan_backend(device=CUDA, needs_grad=False) == "sglang"
        assert ssd.scan_backend(device=CUDA, needs_grad=True) == "mamba_ssm"
    logged = [r.getMessage() for r in caplog.records]
    assert logged == ["Mamba-2 scan on cuda: sglang (inference)",
                      "Mamba-2 scan on cuda: mamba_ssm (training (backward needed))"]  # once per choice
    kernels(sglang=False, mamba_ssm=True)
    assert ssd.scan_backend(device=CUDA, needs_grad=False) == "mamba_ssm"


@pytest.mark.parametrize("needs_grad,missing", [(False, "sglang-hspec[sglang]"), (True, "sglang-hspec[gpu]")])
def test_cuda_without_a_kernel_is_an_error_naming_the_opt_in(kernels, monkeypatch, needs_grad, missing):
    kernels(sglang=False, mamba_ssm=False)
    with pytest.raises(ssd.ScanUnavailableError, match=r"HSPEC_MAMBA_SCAN=torch") as err:
        ssd.scan_backend(device=CUDA, needs_grad=needs_grad)
    assert missing in str(err.value) and "No module named 'mamba_ssm'" in str(err.value)
    monkeypatch.setenv(ssd.SCAN_ENV, "torch")
    assert ssd.scan_backend(device=CUDA, needs_grad=needs_grad) == "torch"


def test_training_with_only_sglang_is_an_error(kernels):
    kernels(sglang=True, mamba_ssm=False)  # SGLang's kernel has no backward: never picked for training
    with pytest.raises(ssd.ScanUnavailableError, match=r"training needs mamba_ssm"):
        ssd.scan_backend(device=CUDA, needs_grad=True)


def test_scan_env_is_validated_and_forces_a_backend(kernels, monkeypatch):
    kernels(sglang=True, mamba_ssm=False)
    monkeypatch.setenv(ssd.SCAN_ENV, "triton")
    with pytest.raises(ValueError, match=r"HSPEC_MAMBA_SCAN='triton' is not a Mamba scan backend; use one of auto"):
        ssd.scan_backend(device=CUDA, needs_grad=False)
    monkeypatch.setenv(ssd.SCAN_ENV, "mamba_ssm")
    with pytest.raises(ssd.ScanUnavailableError, match=r"HSPEC_MAMBA_SCAN=mamba_ssm but it cannot be imported"):
        ssd.scan_backend(device=CUDA, needs_grad=False)
    monkeypatch.setenv(ssd.SCAN_ENV, "sglang")
    assert ssd.scan_backend(device=torch.device("cpu"), needs_grad=False) == "sglang"  # forced: the interpreter test
    with pytest.raises(ssd.ScanUnavailableError, match=r"no backward"):
        ssd.scan_backend(device=CUDA, needs_grad=True)


def test_no_placeholder_modules_are_planted():
    import sys

    ssd._kernel("mamba_ssm")
    mod = sys.modules.get("mamba_ssm")
    assert mod is None or getattr(mod, "__file__", None) is not None  # a real package or nothing


def test_without_the_final_state_the_outputs_are_the_same_bits():
    args = _inputs(torch.float32)
    y, s = ssd_block(*args)
    y_only, none = ssd_block(*args, final_state=False)
    assert none is None and s is not None and torch.equal(y_only, y)
