"""A CPU proof that a forward is CUDA-graph safe: run it on the meta device under `forbid_host_sync`.

CUDA-graph capture fails on a host-to-device copy and on any read of a device value by the host
(`.item()`, `nonzero`, `bool(tensor)`, ...); outside capture both stall the host. With parameters and
inputs on the meta device a stray CPU tensor (a frequency table left on the host, a `torch.tensor(...)`
built in the forward) shows up as an operand on another device, and a host read has no value to read.
The mode raises at the first such op, naming it, so the traceback points at the offending line."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

# ops whose result the host must read (data-dependent shape or a Python value)
HOST_READS = {
    torch.ops.aten._local_scalar_dense.default,
    torch.ops.aten.nonzero.default,
    torch.ops.aten.nonzero_static.default,
    torch.ops.aten.masked_select.default,
    torch.ops.aten.is_nonzero.default,
    torch.ops.aten.equal.default,
    torch.ops.aten._unique2.default,
    torch.ops.aten.unique_consecutive.default,
    torch.ops.aten.unique_dim.default,
}


class HostSyncError(AssertionError):
    """An op that a CUDA graph cannot capture (host read or host-to-device copy)."""


class forbid_host_sync(TorchDispatchMode):  # noqa: N801 - used as a context manager, like torch's modes
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in HOST_READS:
            raise HostSyncError(f"{func} reads a device value on the host (not capturable in a CUDA graph)")
        flat, _ = tree_flatten((args, kwargs))
        cpu = [t for t in flat if isinstance(t, torch.Tensor) and t.device.type == "cpu"]
        if cpu:
            shapes = [tuple(t.shape) for t in cpu]
            raise HostSyncError(f"{func} reads host tensors {shapes}: a host-to-device copy in the forward "
                                "(keep the tensor on the model's device: a buffer)")
        return func(*args, **kwargs)
