"""GPU path (skipped without CUDA): each Triton Mamba scan gives the CPU float64 reference's outputs
(SGLang's serving kernel) and gradients (mamba_ssm's training kernel); a CUDA drafter forward picks one
of them, never the torch fallback. scripts/gpu_check.sh runs the full parity on a GPU machine."""

import pytest
import torch
import torch.nn.functional as F

from sglang_hspec.model import ssd

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _inputs(b=4, L=7, h=8, p=64, n=4, g=4):
    gen = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    x, B, C, dt = r(b, L, h, p), r(b, L, g, n), r(b, L, g, n), r(b, L, h) - 1
    return x, dt, -torch.exp(r(h) * 0.5), B, C, r(h), r(h) * 0.5, r(b, h, p, n)


def _rel(got, ref):
    return float((got.double().cpu() - ref).abs().max() / ref.abs().max())


def test_sglang_serving_kernel_matches_cpu_reference():
    if isinstance(ssd._kernel("sglang"), ImportError):
        pytest.skip(f"SGLang is not importable here: {ssd._kernel('sglang')}")
    x, dt, A, B, C, D, dt_bias, s0 = _inputs()
    y_ref, _ = ssd.ssd_block(x, F.softplus(dt + dt_bias), A, B, C, D, s0)
    s0_gpu = s0.float().cuda()
    y = ssd.sglang_block_scan(*(t.float().cuda() for t in (x, dt, A, B, C, D, dt_bias)), s0_gpu)
    assert _rel(y, y_ref) < 1e-3
    assert torch.equal(s0_gpu.cpu(), s0.float())  # the state is read, never written


def test_mamba_ssm_training_kernel_matches_cpu_reference_and_grads():
    if isinstance(ssd._kernel("mamba_ssm"), ImportError):
        pytest.skip(f"mamba_ssm is not importable here: {ssd._kernel('mamba_ssm')}")
    cpu = [t.clone().requires_grad_(True) for t in _inputs()]
    y_ref, s_ref = ssd.ssd_block(cpu[0], F.softplus(cpu[1] + cpu[6]), cpu[2], cpu[3], cpu[4], cpu[5], cpu[7])
    (y_ref.sum() + s_ref.sum()).backward()
    gpu = [t.detach().float().cuda().requires_grad_(True) for t in cpu]
    y, s = ssd.mamba_block(*gpu, chunk_size=256)
    (y.sum() + s.sum()).backward()
    assert _rel(y, y_ref) < 1e-3 and _rel(s, s_ref) < 1e-3
    for got, ref in zip(gpu, cpu):
        assert _rel(got.grad, ref.grad) < 1e-2


def test_cuda_forward_runs_a_triton_kernel(monkeypatch):
    monkeypatch.delenv(ssd.SCAN_ENV, raising=False)
    x, dt, A, B, C, D, dt_bias, s0 = (t.float().cuda() for t in _inputs())
    ssd.SCANS_RUN.clear()
    with torch.no_grad():
        ssd.mamba_block(x, dt, A, B, C, D, dt_bias, s0, chunk_size=256)
    assert ssd.SCANS_RUN and "torch" not in ssd.SCANS_RUN
