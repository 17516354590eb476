"""Test-only import shim for `sgl_kernel` on CPU machines (tests/sglang_cpu/README.md, "The sgl_kernel shim").

The PyPI `sglang-kernel` wheel is CUDA-only (`common_ops` needs libcuda) and SGLang's `*_cpu` kernels
are a source build. With `SGLANG_USE_CPU_ENGINE=1` SGLang imports `sgl_kernel` on the memory-pool and
speculative paths, so this package, first on PYTHONPATH, stands in for it: it serves the wheel's own
Python modules (package path pointed at the wheel), skips loading CUDA libraries, and registers the
few `*_cpu` ops the DSpark path calls in plain PyTorch. Active only when its directory is on
PYTHONPATH; nothing is written to site-packages.

`convert_weight_packed` is deliberately left undefined: its absence makes SGLang treat AMX as
unavailable, so `intel_amx` falls back to `torch_native`.
"""

import ctypes
import os
import sys
import types

import torch

_SHIM_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _find_wheel_package() -> str:
    for entry in sys.path:
        root = os.path.abspath(entry or os.getcwd())
        if root == _SHIM_ROOT:
            continue
        init = os.path.join(root, "sgl_kernel", "__init__.py")
        if os.path.isfile(init):
            return os.path.dirname(init)
    raise ImportError(
        "sgl_kernel CPU shim: the sglang-kernel wheel is not installed in this environment "
        "(pip install sglang==0.5.23 brings sglang-kernel 0.4.10)"
    )


_WHEEL_DIR = _find_wheel_package()
__path__[:] = [_WHEEL_DIR]  # noqa: F821  (package path: submodules now come from the wheel)


# ---- pure-PyTorch CPU ops (schemas mark mutated arguments) ----

_lib = torch.library.Library("sgl_kernel", "FRAGMENT")


def _segments(start_offset: torch.Tensor, end_offset: torch.Tensor):
    starts, ends = start_offset.tolist(), end_offset.tolist()
    out = 0
    for i, (s, e) in enumerate(zip(starts, ends)):
        yield i, int(s), int(e), out
        out += int(e) - int(s)


def _assign_req_to_token_pool_cpu(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc,
                                  pool_len):
    # Batch order: request i takes the next (end-start) entries of the flat out_cache_loc.
    rows = req_pool_indices.tolist()
    for i, s, e, o in _segments(start_offset, end_offset):
        req_to_token[rows[i], s:e] = out_cache_loc[o:o + e - s].to(req_to_token.dtype)


def _assign_extend_cache_locs_cpu(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc,
                                  pool_len):
    # The inverse: consecutive segments of out_cache_loc from req_to_token[r, start:end].
    rows = req_pool_indices.tolist()
    for i, s, e, o in _segments(start_offset, end_offset):
        out_cache_loc[o:o + e - s] = req_to_token[rows[i], s:e].to(out_cache_loc.dtype)


def _copy_all_layer_kv_cache_cpu(data_ptrs, strides, tgt_loc, src_loc):
    # Each layer buffer is (raw base address, row bytes); copy row src_loc[i] -> tgt_loc[i], reading all
    # sources before writing (overlap-safe).
    if src_loc.numel() == 0:
        return
    src, tgt = src_loc.long(), tgt_loc.long()
    rows = int(torch.maximum(src.max(), tgt.max()).item()) + 1
    for ptr, stride in zip(data_ptrs.tolist(), strides.tolist()):
        raw = (ctypes.c_uint8 * (rows * int(stride))).from_address(int(ptr))
        buf = torch.frombuffer(raw, dtype=torch.uint8).view(rows, int(stride))
        buf[tgt] = buf[src].clone()


for _schema, _fn in (
    ("assign_req_to_token_pool_cpu(Tensor req_pool_indices, Tensor(a!) req_to_token, Tensor start_offset, "
     "Tensor end_offset, Tensor out_cache_loc, int pool_len) -> ()", _assign_req_to_token_pool_cpu),
    ("assign_extend_cache_locs_cpu(Tensor req_pool_indices, Tensor req_to_token, Tensor start_offset, "
     "Tensor end_offset, Tensor(a!) out_cache_loc, int pool_len) -> ()", _assign_extend_cache_locs_cpu),
    ("copy_all_layer_kv_cache_cpu(Tensor data_ptrs, Tensor strides, Tensor tgt_loc, Tensor src_loc) -> ()",
     _copy_all_layer_kv_cache_cpu),
):
    _name = _schema.split("(", 1)[0]
    if not hasattr(torch.ops.sgl_kernel, _name):
        _lib.define(_schema)
        _lib.impl(_name, _fn, "CPU")


# ---- the wheel's own __init__, minus CUDA library loading ----

from sgl_kernel import load_utils as _load_utils  # noqa: E402  (resolved inside the wheel now)

_load_utils._load_architecture_specific_ops = lambda: types.ModuleType("sgl_kernel.common_ops")
_load_utils._preload_cuda_library = lambda: None

_init = os.path.join(_WHEEL_DIR, "__init__.py")
with open(_init) as _fh:
    exec(compile(_fh.read(), _init, "exec"), globals())  # noqa: S102
