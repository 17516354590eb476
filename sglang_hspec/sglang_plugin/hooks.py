"""HookRegistry patches of SGLang 0.5.23 for HSPEC (docs/architecture.md, "SGLang internals we hook").

Drafter-KV reservation (docs/architecture.md, "No drafter KV"). HSPEC impersonates the DFlash family, so SGLang's target resolves
`spec_aux_config.dflash_draft_num_layers` / `draft_kv_num_layers` from the drafter's config.json and
sizes its KV pool as if a drafter pool of that many layers shared the budget
(`pool_configurator.py` scales the per-token cost by (L_target + L_draft) / L_target, or adds the
draft's own bytes/token from `kv_cache_configurator.py`). HSPEC's drafter reads the target's KV and
owns none, so that share of the budget was never used. The hook clears both counts on the target
runner, right after they are resolved and before the pool is sized. Every reader guards None (the
pool configurator's DFlash branch, the draft cell size, fused-draft placement); the one unguarded
reader is DeepSeek-V4 encoder replay, a target HSPEC refuses. The capture ids and
`draft_model_config` (read by the DSpark worker's parallel layout) stay as they are.

Qwen2 targets (`add_qwen2_capture`). SGLang 0.5.23's Qwen2ForCausalLM (Qwen2 and Qwen2.5 checkpoints) has
EAGLE3's `set_eagle3_layers_to_capture` but not `set_dflash_layers_to_capture`, so the target runner's
`configure_aux_hidden_state_capture` (model_runner_components/attention_backend_setup.py, called first thing in
`ModelRunner.init_attention_backends`, before any CUDA graph is captured) raised for an HSPEC server. Its
`Qwen2Model.forward` already captures the input of every layer in `layers_to_capture` (the EAGLE3 path, the
same loop as Qwen3Model.forward), and Qwen2ForCausalLM.forward returns them with the logits once
`capture_aux_hidden_states` is set. The BEFORE hook gives an HSPEC target's Qwen2ForCausalLM instance the
method Qwen3ForCausalLM has, line for line; other models and servers are left to SGLang.

Importing this module imports SGLang: call `install_hooks()` from `register()` only.
"""

from __future__ import annotations

import logging
import types

logger = logging.getLogger(__name__)

AUX_HIDDEN_TARGET = "sglang.srt.model_executor.model_runner.ModelRunner.init_spec_aux_hidden_state"
ALLOC_POOL_TARGET = "sglang.srt.model_executor.model_runner.ModelRunner.alloc_memory_pool"
INIT_BACKENDS_TARGET = "sglang.srt.model_executor.model_runner.ModelRunner.init_attention_backends"

_installed = False


def tokens_with_reservation(*, tokens: int, target_layers: int, draft_layers: int, page_size: int = 1) -> int:
    """The pool size SGLang would have chosen from the same budget had it also reserved `draft_layers`
    drafter layers of the target's KV geometry: the budget (~ tokens x per-layer cost x target_layers)
    divided by the cost of target + draft layers, floored to a page."""
    return tokens * target_layers // (target_layers + draft_layers) // page_size * page_size


def _is_hspec_target(runner) -> bool:
    from .algo import HSpecSpecAlgo

    return not runner.is_draft_worker and isinstance(runner.spec_algorithm, HSpecSpecAlgo)


def drop_drafter_kv_reservation(result, runner, *args, **kwargs):
    """AFTER ModelRunner.init_spec_aux_hidden_state: on an HSPEC target, reserve no drafter KV."""
    if not _is_hspec_target(runner):
        return None
    aux = runner.spec_aux_config
    if aux.dflash_draft_num_layers is None:
        return None  # already cleared (idempotent)
    runner._hspec_dropped_draft_kv_layers = int(aux.dflash_draft_num_layers)
    aux.dflash_draft_num_layers = None
    aux.draft_kv_num_layers = None
    return None


def log_recovered_kv(result, runner, *args, **kwargs):
    """AFTER ModelRunner.alloc_memory_pool: log what dropping the reservation bought (startup only)."""
    from sglang.srt.runtime_context import get_schedule

    draft_layers = getattr(runner, "_hspec_dropped_draft_kv_layers", None)
    if draft_layers is None or not _is_hspec_target(runner):
        return None
    pool = runner.token_to_kv_pool
    tokens = int(runner.max_total_num_tokens)
    target_layers = int(pool.layer_num)
    k_bytes, v_bytes = pool.get_kv_size_bytes()
    per_token = (k_bytes + v_bytes) // pool.get_key_buffer(0).shape[0]  # all target layers, K + V
    draft_bytes_per_token = per_token * draft_layers // target_layers
    cap = get_schedule().max_total_tokens  # --max-total-tokens, as the pool configurator reads it
    if cap is not None and tokens >= cap // pool.page_size * pool.page_size:
        logger.info(
            "HSPEC: the KV pool reserves no drafter KV (SGLang would reserve %d drafter layers, %d B/token); "
            "--max-total-tokens caps the pool at %d tokens, which now take %.1f MiB less of the KV budget",
            draft_layers, draft_bytes_per_token, tokens, tokens * draft_bytes_per_token / 2**20)
    else:
        before = tokens_with_reservation(tokens=tokens, target_layers=target_layers, draft_layers=draft_layers,
                                         page_size=pool.page_size)
        logger.info(
            "HSPEC: the KV pool reserves no drafter KV: %d KV tokens instead of ~%d with SGLang's reservation "
            "of %d drafter layers (%d B/token): %d tokens, %.1f MiB recovered",
            tokens, before, draft_layers, draft_bytes_per_token, tokens - before,
            before * draft_bytes_per_token / 2**20)
    runner._hspec_dropped_draft_kv_layers = None  # log once per pool
    return None


def set_qwen2_dflash_layers_to_capture(model, layer_ids) -> None:
    """Qwen3ForCausalLM.set_dflash_layers_to_capture (SGLang 0.5.23, models/qwen3.py) for a Qwen2ForCausalLM:
    SGLang captures the input of layer i, so the output of target layer k is captured before layer k + 1."""
    if not model.pp_group.is_last_rank:
        return
    if layer_ids is None:
        raise ValueError("DFLASH requires explicit layer_ids for aux hidden capture.")
    model.capture_aux_hidden_states = True
    model.model.layers_to_capture = [val + 1 for val in layer_ids]
    logger.info("HSPEC: Qwen2ForCausalLM captures target layers %s for the drafter (the inputs of decoder layers "
                "%s)", list(layer_ids), model.model.layers_to_capture)


def add_qwen2_capture(runner, *args, **kwargs):
    """BEFORE ModelRunner.init_attention_backends: an HSPEC target that is SGLang's Qwen2ForCausalLM gets
    `set_dflash_layers_to_capture` (bound to the instance), which SGLang then calls to set up the capture."""
    if not _is_hspec_target(runner):
        return None
    model = runner.model
    if hasattr(model, "set_dspark_layers_to_capture") or hasattr(model, "set_dflash_layers_to_capture"):
        return None
    from sglang.srt.models.qwen2 import Qwen2ForCausalLM

    if isinstance(model, Qwen2ForCausalLM):
        model.set_dflash_layers_to_capture = types.MethodType(set_qwen2_dflash_layers_to_capture, model)
    return None


def install_hooks() -> None:
    """Register the HSPEC hooks with SGLang's HookRegistry (applied by `load_plugins()`). Idempotent."""
    global _installed
    if _installed:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(AUX_HIDDEN_TARGET, drop_drafter_kv_reservation, HookType.AFTER)
    HookRegistry.register(ALLOC_POOL_TARGET, log_recovered_kv, HookType.AFTER)
    HookRegistry.register(INIT_BACKENDS_TARGET, add_qwen2_capture, HookType.BEFORE)
    _installed = True
