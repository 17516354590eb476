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

Importing this module imports SGLang: call `install_hooks()` from `register()` only.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

AUX_HIDDEN_TARGET = "sglang.srt.model_executor.model_runner.ModelRunner.init_spec_aux_hidden_state"
ALLOC_POOL_TARGET = "sglang.srt.model_executor.model_runner.ModelRunner.alloc_memory_pool"

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


def install_hooks() -> None:
    """Register the HSPEC hooks with SGLang's HookRegistry (applied by `load_plugins()`). Idempotent."""
    global _installed
    if _installed:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(AUX_HIDDEN_TARGET, drop_drafter_kv_reservation, HookType.AFTER)
    HookRegistry.register(ALLOC_POOL_TARGET, log_recovered_kv, HookType.AFTER)
    _installed = True
