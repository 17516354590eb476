"""GPU path (skipped on CPU): the Triton scan gives the CPU reference's outputs and initial-state grads."""

import pytest
import torch

from sglang_hspec.model.ssd import gpu_scan, ssd_block

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or gpu_scan() is None,
                                reason="needs CUDA and mamba_ssm (scripts/gpu_check.sh runs the full parity)")


def test_triton_scan_matches_cpu_reference():
    g = torch.Generator().manual_seed(0)
    b, L, h, p, n, ng = 4, 7, 8, 64, 4, 4
    x, B, C = (torch.randn(*s, generator=g, dtype=torch.float64) for s in ((b, L, h, p), (b, L, ng, n), (b, L, ng, n)))
    dt = torch.randn(b, L, h, generator=g, dtype=torch.float64) - 1
    A, D, s0 = -torch.rand(h, dtype=torch.float64) - 0.5, torch.randn(h, dtype=torch.float64), torch.randn(b, h, p, n)
    s0 = s0.double().requires_grad_(True)
    y, s = ssd_block(x, torch.nn.functional.softplus(dt), A, B, C, D, s0)
    (y.sum() + s.sum()).backward()
    s0g = s0.detach().float().cuda().requires_grad_(True)
    yg, sg = gpu_scan()(x.float().cuda(), dt.float().cuda(), A.float().cuda(), B.float().cuda(), C.float().cuda(),
                        256, D=D.float().cuda(), dt_softplus=True, initial_states=s0g, return_final_states=True)
    (yg.sum() + sg.sum()).backward()
    for got, ref in ((yg, y), (sg, s), (s0g.grad, s0.grad)):
        assert (got.double().cpu() - ref).abs().max() / ref.abs().max() < 1e-3
