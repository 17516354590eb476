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
