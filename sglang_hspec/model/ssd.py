"""Mamba-2 SSD scan over a short block from a given initial state (pure PyTorch, CPU exact).

Shapes follow mamba_ssm's `mamba_chunk_scan_combined`: x [b, L, h, p], dt [b, L, h] (already
dt_bias + softplus), A [h] (negative), B/C [b, L, g, n] (head i uses group i // (h/g)), D [h],
initial_state [b, h, p, n]. Recurrence per head: S_t = exp(dt_t A) S_{t-1} + dt_t x_t B_t^T,
y_t = S_t C_t + D x_t. Returns (y [b, L, h, p], final_state [b, h, p, n]).

`ssd_block` is the single-chunk matrix form (the one the drafter runs; k = 7 tokens is one chunk).
`ssd_naive` is the token-by-token recurrence, the oracle for tests. `mamba_block` is what the drafter
calls: the torch block form on CPU, a Triton kernel on CUDA (see `scan_backend`).
"""

from __future__ import annotations

import logging
import os

import torch
import torch.nn.functional as F


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


def ssd_block(x, dt, A, B, C, D, initial_state, *, final_state: bool = True):
    """The block's outputs and (when `final_state`) its final state; inference drops the state (H-Spec starts
    every block from the projected state), which saves an einsum over the whole state."""
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
    if not final_state:
        return y, None
    last = cum[:, -1]  # [b, h]
    final = torch.exp(last)[..., None, None] * initial_state + torch.einsum(
        "bsh,bshp,bshn->bhpn", torch.exp(last[:, None] - cum) * dt, x, Bh
    )
    return y, final


# ---------------------------------------------------------------- kernel dispatch
# GPU paths, chosen once per process (logged): SGLang's Triton `selective_state_update` over the whole
# block (multi-token, state read but not written: forward only, one elementwise kernel, no autotune, so
# CUDA-graph capturable; ships wherever SGLang does) for inference, and mamba_ssm's
# `mamba_chunk_scan_combined` (forward + backward, `gpu` extra) for training. SGLang's own chunk scan is
# not used: with `initial_states` it only runs on its varlen path (batch 1 + seq_idx + chunk indices);
# without them its chunk-scan kernel loads from a None `chunk_indices` pointer (ssd_chunk_scan.py:248).
SCAN_ENV = "HSPEC_MAMBA_SCAN"
SCAN_CHOICES = ("auto", "sglang", "mamba_ssm", "torch")
log = logging.getLogger(__name__)

_KERNELS: dict[str, object] = {}  # backend -> kernel function or the ImportError that kept it out
_LOGGED: set[tuple[str, str]] = set()
SCANS_RUN: set[str] = set()  # backends that actually ran in this process (scripts/gpu_check.py reads it)


class ScanUnavailableError(RuntimeError):
    """A CUDA forward found no Triton Mamba scan and the torch fallback was not asked for."""


def _kernel(backend: str):
    if backend not in _KERNELS:
        try:
            if backend == "sglang":
                from sglang.kernels.ops.mamba.triton_ops.mamba_ssm import selective_state_update as fn
            else:
                from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined as fn
        except ImportError as e:
            fn = e
        _KERNELS[backend] = fn
    return _KERNELS[backend]


def _choice() -> str:
    choice = os.environ.get(SCAN_ENV, "auto").strip().lower() or "auto"
    if choice not in SCAN_CHOICES:
        raise ValueError(f"{SCAN_ENV}={choice!r} is not a Mamba scan backend; use one of {', '.join(SCAN_CHOICES)}")
    return choice


def scan_backend(*, device: torch.device, needs_grad: bool) -> str:
    """The scan a Mamba-2 layer runs for tensors on `device`: "torch" on CPU (exact, the reference);
    on CUDA "sglang" (inference) or "mamba_ssm" (training or no SGLang). Raises ScanUnavailableError on
    CUDA without a kernel unless HSPEC_MAMBA_SCAN=torch; HSPEC_MAMBA_SCAN forces one backend anywhere."""
    choice = _choice()
    if choice == "auto" and device.type != "cuda":
        picked, why = "torch", "reference scan off CUDA"
    elif choice == "torch":
        picked, why = "torch", f"{SCAN_ENV}=torch"
    elif choice != "auto":
        if isinstance(_kernel(choice), ImportError):
            raise ScanUnavailableError(f"{SCAN_ENV}={choice} but it cannot be imported: {_kernel(choice)}")
        if needs_grad and choice == "sglang":
            raise ScanUnavailableError(f"{SCAN_ENV}=sglang has no backward (SGLang's kernel is forward-only); "
                                       f"train with {SCAN_ENV}=mamba_ssm (the `gpu` extra) or torch")
        picked, why = choice, f"{SCAN_ENV}={choice}"
    else:
        order = ("mamba_ssm",) if needs_grad else ("sglang", "mamba_ssm")
        picked = next((b for b in order if not isinstance(_kernel(b), ImportError)), None)
        if picked is None:
            reasons = "; ".join(f"{b}: {_kernel(b)}" for b in order)
            need = ("training needs mamba_ssm's scan (it has a backward): pip install 'sglang-hspec[gpu]'"
                    if needs_grad else "install SGLang (pip install 'sglang-hspec[sglang]') or mamba_ssm "
                    "(pip install 'sglang-hspec[gpu]')")
            raise ScanUnavailableError(f"no Triton Mamba-2 scan for a CUDA forward ({reasons}); {need}, or set "
                                       f"{SCAN_ENV}=torch to run the pure-PyTorch scan (exact, slower)")
        why = "training (backward needed)" if needs_grad else "inference"
    if (picked, why) not in _LOGGED:
        _LOGGED.add((picked, why))
        log.info("Mamba-2 scan on %s: %s (%s)", device.type, picked, why)
    return picked


def sglang_block_scan(x, dt, A, B, C, D, dt_bias, initial_state):
    """SGLang's Triton selective_state_update over all L tokens of the block from `initial_state`, with
    the state left unwritten. Raw dt (the kernel adds dt_bias and applies softplus, threshold 20).
    Head-wise A / dt / D / dt_bias enter as stride-0 views over head_dim (the kernel's tied-head path)."""
    b, L, h, p = x.shape
    n = B.shape[-1]
    out = torch.empty_like(x)
    _kernel("sglang")(initial_state.float(), x, dt[..., None].expand(b, L, h, p), A.float()[:, None, None].expand(h, p, n),
                      B, C, D=D.float()[:, None].expand(h, p), dt_bias=dt_bias.float()[:, None].expand(h, p),
                      dt_softplus=True, out=out, disable_state_update=True)
    return out


def mamba_block(x, dt, A, B, C, D, dt_bias, initial_state, *, chunk_size: int, final_state: bool = True):
    """The Mamba-2 scan of a block with the backend `scan_backend` picks: (y [b, L, h, p] in x.dtype,
    final state [b, h, p, n] or None where the kernel does not return it: SGLang's serving kernel; or where
    `final_state` is False: H-Spec re-derives the state every round). dt is raw (before dt_bias and softplus)."""
    needs_grad = torch.is_grad_enabled() and any(
        t.requires_grad for t in (x, dt, A, B, C, D, dt_bias, initial_state))
    backend = scan_backend(device=x.device, needs_grad=needs_grad)
    SCANS_RUN.add(backend)
    if backend == "sglang":
        return sglang_block_scan(x.contiguous(), dt.contiguous(), A, B.contiguous(), C.contiguous(), D, dt_bias,
                                 initial_state.contiguous()), None
    if backend == "mamba_ssm":
        y, final = _kernel("mamba_ssm")(x.contiguous(), dt.contiguous(), A.float(), B.contiguous(), C.contiguous(),
                                        chunk_size, D=D.float(), dt_bias=dt_bias.float(), dt_softplus=True,
                                        initial_states=initial_state.float().contiguous(), return_final_states=True)
        return y.to(x.dtype), final if final_state else None
    ct = torch.promote_types(x.dtype, torch.float32)  # float64 stays float64 (oracle tests)
    dtp = F.softplus((dt + dt_bias).to(ct))  # threshold 20, as the kernels
    y, final = ssd_block(x.to(ct), dtp, A.to(ct), B.to(ct), C.to(ct), D.to(ct), initial_state.to(ct),
                         final_state=final_state)
    return y.to(x.dtype), final
