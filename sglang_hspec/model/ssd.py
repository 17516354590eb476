"""Mamba-2 SSD scan over a short block from a given initial state (pure PyTorch, CPU exact).

Shapes follow mamba_ssm's `mamba_chunk_scan_combined`: x [b, L, h, p], dt [b, L, h] (already
dt_bias + softplus), A [h] (negative), B/C [b, L, g, n] (head i uses group i // (h/g)), D [h],
initial_state [b, h, p, n]. Recurrence per head: S_t = exp(dt_t A) S_{t-1} + dt_t x_t B_t^T,
y_t = S_t C_t + D x_t. Returns (y [b, L, h, p], final_state [b, h, p, n]).

`ssd_block` is the single-chunk matrix form (the one the drafter runs; k = 7 tokens is one chunk).
`ssd_naive` is the token-by-token recurrence, the oracle for tests. On CUDA with mamba_ssm present
the drafter calls `mamba_chunk_scan_combined(initial_states=...)` instead (see `gpu_scan`).
"""

from __future__ import annotations

import importlib.util
import sys
import types

import torch


def _heads(t: torch.Tensor, nheads: int) -> torch.Tensor:
    """[b, L, g, n] -> [b, L, h, n] (each group shared by h/g consecutive heads)."""
    return t.repeat_interleave(nheads // t.shape[2], dim=2)


def ssd_naive(x, dt, A, B, C, D, initial_state):
    h = x.shape[2]
    Bh, Ch = _heads(B, h), _heads(C, h)
    state = initial_state
    ys = []
    for t in range(x.shape[1]):
        decay = torch.exp(dt[:, t] * A)  # [b, h]
        state = decay[..., None, None] * state + (dt[:, t, :, None, None] * x[:, t, :, :, None]
                                                   * Bh[:, t, :, None, :])
        ys.append(torch.einsum("bhpn,bhn->bhp", state, Ch[:, t]) + D[:, None] * x[:, t])
    return torch.stack(ys, dim=1), state


def ssd_block(x, dt, A, B, C, D, initial_state):
    b, L, h, p = x.shape
    g = B.shape[2]
    a = dt * A  # [b, L, h], <= 0
    cum = torch.cumsum(a, dim=1)  # Lambda_l
    # decay from s to l (s <= l): exp(Lambda_l - Lambda_s); masked before exp so s > l never overflows
    seg = cum[:, :, None, :] - cum[:, None, :, :]  # [b, l, s, h]
    causal = torch.ones(L, L, dtype=torch.bool, device=x.device).tril()
    seg = seg.masked_fill(~causal[None, :, :, None], float("-inf"))
    cb = torch.einsum("blgn,bsgn->blsg", C, B).repeat_interleave(h // g, dim=3)  # [b, l, s, h]
    w = cb * torch.exp(seg) * dt[:, None, :, :]
    y = torch.einsum("blsh,bshp->blhp", w, x)
    Ch, Bh = _heads(C, h), _heads(B, h)
    y = y + torch.einsum("blhn,bhpn->blhp", Ch * torch.exp(cum)[..., None], initial_state)
    y = y + D[None, None, :, None] * x
    last = cum[:, -1]  # [b, h]
    final = torch.exp(last)[..., None, None] * initial_state + torch.einsum(
        "bsh,bshp,bshn->bhpn", torch.exp(last[:, None] - cum) * dt, x, Bh
    )
    return y, final


# ---- GPU path: mamba_ssm's Triton kernel, imported lazily and without running mamba_ssm/__init__ ----
_GPU_SCAN = None


def gpu_scan():
    """mamba_chunk_scan_combined, or None when CUDA or mamba_ssm is missing. The package __init__
    imports CUDA extensions we do not need, so a bare package object is registered instead (mamba2.md §6)."""
    global _GPU_SCAN
    if _GPU_SCAN is not None:
        return _GPU_SCAN or None
    _GPU_SCAN = False
    if not torch.cuda.is_available():
        return None
    spec = importlib.util.find_spec("mamba_ssm")
    if spec is None or not spec.submodule_search_locations:
        return None
    try:
        if "mamba_ssm" not in sys.modules:
            pkg = types.ModuleType("mamba_ssm")
            pkg.__path__ = list(spec.submodule_search_locations)
            sys.modules["mamba_ssm"] = pkg
        from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined
    except Exception:  # noqa: BLE001 - any import failure means "no GPU kernel": fall back to torch
        return None
    _GPU_SCAN = mamba_chunk_scan_combined
    return _GPU_SCAN
