"""`sglang_cpu_testing`: a general SGLang plugin that lets the speculative path run end to end on CPU,
for tests only (tests/sglang_cpu/README.md, "The CPU fixes"). Loaded by `load_plugins()` in the launcher,
scheduler and detokenizer when this directory is on PYTHONPATH (its `.dist-info` declares the entry
point) and `SGLANG_PLUGINS` names it; inert unless `SGLANG_USE_CPU_ENGINE=1`.

Fixes (numbers as in the reference):
1. `_handle_dspark` refuses CPU: let its device check pass (stock DSPARK only; HSPEC has its own hook).
2. `torch_native` is not a draft attention backend: add it to the public choices.
3. `torch_native` has no TARGET_VERIFY: a subclass adds it (`cpu_attention.py`).
4. DSpark's fused Triton K-norm+RoPE+KV write: disabled for CPU pools (SGLang's torch path runs).
5. `Tensor.record_stream` rejects CPU streams: no-op for CPU tensors.
6. DFlash attention's Triton table-QK-norm-RoPE: disabled on CPU (the `else` branch runs).
7. The "torch" accept path still calls a Triton chain-sampling kernel: CPU inputs go to a torch port.
8. (opt-in, `SGLANG_CPU_TESTING_KV_BUDGET_MB`) a fixed KV-pool byte budget. On CPU SGLang sizes the pool
   from the host's free RAM, which other processes move between two launches; a fixed budget makes the
   pool size a pure function of the configuration, so servers can be compared at the same budget.
9. (opt-in, `SGLANG_CPU_TESTING_FORK=1`) scheduler and detokenizer fork from the launcher instead of spawning.
10. DSpark's per-request step dump (`SGLANG_DSPARK_DEBUG_DUMP=reqs`) stages through a device stream: on CPU
   the tensors are copied at once.
"""

from __future__ import annotations

import logging
import os
from importlib import metadata

logger = logging.getLogger(__name__)

SGLANG_VERSION = "0.5.23"
SGLANG_KERNEL_VERSION = "0.4.10"
_registered = False


def _check_versions() -> None:
    # Every fix patches a private internal of these exact versions.
    found = {name: metadata.version(name) for name in ("sglang", "sglang-kernel")}
    want = {"sglang": SGLANG_VERSION, "sglang-kernel": SGLANG_KERNEL_VERSION}
    if found != want:
        raise RuntimeError(
            f"sglang_cpu_testing patches private internals of {want}, found {found}; "
            f"install sglang=={SGLANG_VERSION} (it pins sglang-kernel=={SGLANG_KERNEL_VERSION})"
        )


class _CpuPassesAcceleratorCheck(str):
    """'cpu' that answers yes to `startswith(("cuda", "npu", "xpu"))` (and only to tuples with cuda)."""

    def startswith(self, prefix, *args):
        if isinstance(prefix, tuple) and "cuda" in prefix:
            return True
        return str.startswith(self, prefix, *args)


class _DeviceView:
    __slots__ = ("_view",)

    def __init__(self, view):
        object.__setattr__(self, "_view", view)

    def __getattr__(self, name):
        value = getattr(object.__getattribute__(self, "_view"), name)
        if name == "device" and value == "cpu":
            return _CpuPassesAcceleratorCheck(value)
        return value


def _handle_dspark_on_cpu(original, server_args, *args, **kwargs):
    from sglang.srt.arg_groups import speculative_hook

    view_fn = speculative_hook.resolving_view
    speculative_hook.resolving_view = lambda sa: _DeviceView(view_fn(sa))
    try:
        return original(server_args, *args, **kwargs)
    finally:
        speculative_hook.resolving_view = view_fn


def _no_fused_kv_write_on_cpu(original, self, pool, *args, **kwargs):
    if str(getattr(pool, "device", "")).startswith("cpu"):
        return None  # SGLang's per-layer torch path (set_kv_buffer) takes over
    return original(self, pool, *args, **kwargs)


def _no_table_qk_norm_rope_on_cpu(result, self, *args, **kwargs):
    from sglang.srt.utils import is_cpu

    if is_cpu():
        self.use_table_qk_norm_rope = False
    return result


def _chain_sampling_dispatch(original, *args, **kwargs):
    from .sampling import chain_speculative_sampling_torch

    candidates = args[3] if len(args) > 3 else kwargs["candidates"]
    if candidates.is_cuda:
        return original(*args, **kwargs)
    return chain_speculative_sampling_torch(*args, **kwargs)


_DUMPER = "sglang.srt.speculative.dspark_components.dspark_observability.DsparkInfoDumper"


def _dumper_without_d2h_stream_on_cpu(original, self, *args, components, device, **kwargs):
    # torch.cpu.Stream takes no device: build without the reqs component (no d2h stream), then add it back
    if getattr(device, "type", str(device)) != "cpu" or "reqs" not in {str(getattr(c, "value", c)) for c in components}:
        return original(self, *args, components=components, device=device, **kwargs)
    rest = {c for c in components if str(getattr(c, "value", c)) != "reqs"} or {"core"}
    original(self, *args, components=rest, device=device, **kwargs)
    from sglang.srt.speculative.dspark_components.dspark_observability import InfoComponent

    self._components.add(InfoComponent.REQS)
    self.enabled = self.attn_tp_rank == 0


class _Copied:
    def __init__(self, data):
        self._data = data

    def wait(self):
        return self._data


def _stage_reqs_on_cpu(original, self, obs, *args, **kwargs):
    if self._d2h_stream is not None or obs.draft_tokens.device.type != "cpu":
        return original(self, obs, *args, **kwargs)
    names = ("req_pool_indices", "prefix_lens", "draft_tokens", "bonus_tokens", "correct_len", "cap_trim_lens",
             "commit_lens")
    out = {k: getattr(obs, k).detach().clone() for k in names}
    for k in ("verify_lens", "confidence"):
        if getattr(obs, k) is not None:
            out[k] = getattr(obs, k).detach().clone()
    return _Copied(out)


KV_BUDGET_ENV = "SGLANG_CPU_TESTING_KV_BUDGET_MB"


def _fixed_kv_budget(original, self, *args, **kwargs):
    # Stands in for SGLang's "free memory after weights - (1 - mem_fraction_static) slack" (fix 8).
    budget_mb = os.environ.get(KV_BUDGET_ENV)
    if not budget_mb:
        return original(self, *args, **kwargs)
    return int(float(budget_mb) * 2**20)


def _patch_record_stream() -> None:
    import torch

    original = torch.Tensor.record_stream
    if getattr(original, "_cpu_testing_patched", False):
        return

    def record_stream(self, stream):
        if self.device.type == "cpu":
            return None  # no cross-stream reuse hazard on CPU; torch.cpu.Stream is not accepted
        return original(self, stream)

    record_stream._cpu_testing_patched = True
    torch.Tensor.record_stream = record_stream


def _fork_subprocesses(*args, **kwargs):
    # SGLang forces "spawn" (CUDA cannot be forked); on CPU each spawned scheduler and detokenizer then
    # imports sglang again, ~25 CPU-seconds apiece on the test machine. A fork starts them from the
    # launcher's imported modules instead.
    import multiprocessing

    multiprocessing.set_start_method("fork", force=True)


def register() -> None:
    """Idempotent: load_plugins() runs once per process, but tests may call it again."""
    global _registered
    if _registered:
        return
    if os.environ.get("SGLANG_USE_CPU_ENGINE") != "1":
        logger.info("sglang_cpu_testing: SGLANG_USE_CPU_ENGINE is not 1, nothing patched")
        return
    _check_versions()
    from sglang.srt.arg_groups.choices import (
        DRAFT_ATTENTION_BACKEND_CHOICES,
        add_draft_attention_backend_choices,
    )
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from .cpu_attention import TorchNativeAttnBackendWithVerify

    if "torch_native" not in DRAFT_ATTENTION_BACKEND_CHOICES:
        add_draft_attention_backend_choices(["torch_native"])  # fix 2
    hooks = [
        ("sglang.srt.arg_groups.speculative_hook._handle_dspark", _handle_dspark_on_cpu, HookType.AROUND),
        ("sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend",
         TorchNativeAttnBackendWithVerify, HookType.REPLACE),
        ("sglang.srt.models.dspark.DSparkDraftMixin._build_fused_kv_write_bundle", _no_fused_kv_write_on_cpu,
         HookType.AROUND),
        ("sglang.srt.models.dflash.DFlashAttention.__init__", _no_table_qk_norm_rope_on_cpu, HookType.AFTER),
        ("sglang.kernels.ops.speculative.reject_sampling.chain_speculative_sampling_triton",
         _chain_sampling_dispatch, HookType.AROUND),
        ("sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._profile_available_bytes",
         _fixed_kv_budget, HookType.AROUND),
        (_DUMPER + ".__init__", _dumper_without_d2h_stream_on_cpu, HookType.AROUND),  # fix 10
        (_DUMPER + "._stage_reqs", _stage_reqs_on_cpu, HookType.AROUND),
    ]
    for target, fn, kind in hooks:
        HookRegistry.register(target, fn, kind)
    if os.environ.get("SGLANG_CPU_TESTING_FORK") == "1":
        HookRegistry.register("sglang.srt.entrypoints.engine._set_envs_and_config", _fork_subprocesses,
                              HookType.AFTER)  # fix 9
    _patch_record_stream()  # fix 5
    _registered = True
    logger.info("sglang_cpu_testing: CPU fixes registered (pid %d)", os.getpid())
