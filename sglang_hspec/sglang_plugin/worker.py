"""`HSpecWorkerV2`: SGLang's DSpark worker with H-Spec's drafter (shared/reference/sglang-integration.md
§5-§8). Inherited unchanged: block proposal, Markov/confidence heads, STS, SPS planner, verify/accept,
overlap relay and `_forward_prefill` / `_forward_decode`; the planner's two decisions (verify budget,
per-request lengths) come from `sglang_hspec.scheduler.planner` through `planner_hooks.py`. Replaced:

- memory: no drafter KV pool. The draft runner gets a dummy 64-token pool for SGLang's bookkeeping and
  is then bound to the target's pool, before the attention backends capture it (§7);
- context: per-request projected target hidden states (`ContextState`) instead of injected drafter KV,
  written from the prefill capture (last prompt row) and the verify capture (row commit_lens - 1);
- draft model: architectures ["HSpecDraftModel"], whose attention reads the target KV pool in place
  (`context.pool_kv_view`, TargetKVView layout "thd").

Imports SGLang; imported only by the worker factory inside the scheduler process.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import torch
from sglang.srt.speculative.base_spec_worker import HiCacheDraftPlan
from sglang.srt.speculative.dspark_components.dspark_verify import TargetVerifyExecutor
from sglang.srt.speculative.dspark_components.dspark_worker_v2 import DSparkWorkerV2

from .context import ContextState, drafter_kv_bytes_saved, prefill_last_rows, verify_commit_rows

logger = logging.getLogger(__name__)

DUMMY_DRAFT_POOL_TOKENS = 64
# SGLang's step recorder drops step times over 1 s as idle gaps (INFO_DUMP_MAX_STEP_CPU_SECONDS). A CPU verify
# of dozens of requests can take longer (0.7 s at 16 requests on the embedded target, 2 idle cores), and the
# SPS profiler then finds no records at all.
CPU_MAX_STEP_SECONDS = 300.0


def allow_slow_cpu_steps(observers, device) -> None:
    """On CPU, let SGLang's step recorder keep step times up to CPU_MAX_STEP_SECONDS. Idle gaps are still
    excluded: a prefill or idle step resets the recorder's clock."""
    dumper = getattr(observers, "_info_dumper", None)
    if dumper is None or torch.device(device).type != "cpu":
        return
    dumper._max_step_cpu_seconds = max(dumper._max_step_cpu_seconds, CPU_MAX_STEP_SECONDS)


def register_draft_model_class() -> None:
    """Make `architectures: ["HSpecDraftModel"]` loadable by SGLang's draft runner (idempotent)."""
    from sglang.srt.models.registry import ModelRegistry

    from .draft_model import ARCHITECTURE, HSpecDraftModel

    ModelRegistry.models[ARCHITECTURE] = HSpecDraftModel


class PrefillRows(NamedTuple):
    last_rows: torch.Tensor  # [bs] rows of the packed prefill capture
    req_pool_indices: torch.Tensor  # [bs]

    @property
    def positions(self) -> torch.Tensor:
        return self.last_rows  # DSpark's prefill reads `placement.positions.device`


class HSpecContextInjector:
    """Duck-typed stand-in for DSpark's TargetHiddenKvInjector: instead of writing drafter KV it writes
    one projected context row per request."""

    swa_ring_size = None  # no drafter SWA ring

    def __init__(self, *, draft_model, draft_model_runner, model_runner, state: ContextState):
        self.draft_model = draft_model
        self.draft_model_runner = draft_model_runner
        self.model_runner = model_runner
        self.state = state

    def ids_for(self, plan, *, cols=None) -> torch.Tensor:
        return plan.write_ids(self.draft_model_runner.kv_index_translator, cols=cols)

    def place_prefill(self, batch) -> PrefillRows:
        # Reads host lists only; runs before the target forward, as DSpark's placement does.
        if batch.extend_lens is None:
            raise RuntimeError("HSPEC prefill expected extend_lens in extend mode, got None")
        device = torch.device(self.model_runner.device)
        return PrefillRows(prefill_last_rows(batch.extend_lens, device), batch.req_pool_indices)

    def inject_prefill(self, placement: PrefillRows, *, target_hidden: torch.Tensor, token_indices,
                       target_hidden_is_projected: bool) -> None:
        if token_indices is not None or target_hidden_is_projected:
            raise RuntimeError("HSPEC needs the full, unprojected prefill capture (no hidden-state token "
                               "selection, no target-side projection)")
        self.state.write(placement.req_pool_indices, target_hidden[placement.last_rows])

    def inject_target_hidden(self, **_):
        raise RuntimeError("HSPEC keeps no drafter KV; verify commits go through HSpecVerifyExecutor")

    inject_ragged = inject_target_hidden


class HSpecVerifyExecutor(TargetVerifyExecutor):
    """DSpark's verify executor; only the commit writes H-Spec's context row instead of drafter KV."""

    def commit_hidden(self, *, batch, layout, hidden_strided, verify_window, logits_output, commit_lens, bs,
                      run_compact) -> None:
        hidden = hidden_strided if run_compact else logits_output.hidden_states
        if hidden is None:
            raise RuntimeError("HSPEC verify requires the target hidden-state capture, got None")
        rows = verify_commit_rows(hidden[: bs * self.verify_num_draft_tokens], commit_lens, bs)
        self.kv_injector.state.write(batch.req_pool_indices[:bs], rows)


class HSpecWorkerV2(DSparkWorkerV2):
    def __init__(self, server_args, gpu_id, nccl_port, target_worker, **kwargs):
        register_draft_model_class()
        super().__init__(server_args, gpu_id, nccl_port, target_worker, **kwargs)
        allow_slow_cpu_steps(getattr(self, "_observers", None), self.device)
        if not self._hosts_draft:
            return
        # The context state is sized by the request pool, which exists only at alloc_memory_pool.
        self._context = None
        self._kv_injector = HSpecContextInjector(
            draft_model=self.draft_model, draft_model_runner=self.draft_model_runner,
            model_runner=self.model_runner, state=None,
        )
        self._verify_executor.__class__ = HSpecVerifyExecutor  # same state, H-Spec's commit
        self._verify_executor.kv_injector = self._kv_injector

    # ---- memory: no drafter KV (§7) ----
    def alloc_memory_pool(self, memory_pool_config=None, req_to_token_pool=None,
                          token_to_kv_pool_allocator=None):
        if not self._hosts_draft:
            return
        from dataclasses import replace

        page = max(1, int(self.page_size or 1))
        dummy_tokens = -(-DUMMY_DRAFT_POOL_TOKENS // page) * page
        self._draft_worker.alloc_memory_pool(
            memory_pool_config=replace(memory_pool_config, max_total_num_tokens=dummy_tokens),
            req_to_token_pool=req_to_token_pool,
            token_to_kv_pool_allocator=token_to_kv_pool_allocator,
        )
        target_pool = self.model_runner.token_to_kv_pool
        # Before init_attention_backends: backends (and CUDA graphs) capture the pool they are built on.
        self.draft_model_runner.token_to_kv_pool = target_pool
        req_to_token = req_to_token_pool.req_to_token
        self.draft_model.bind_target_kv(target_pool, req_to_token)
        cfg = self.draft_model.hspec_config
        self._context = ContextState(
            req_pool_size=req_to_token.shape[0], rank=cfg.fusion_rank, project=self.draft_model.project_context,
            device=self.device, dtype=self.model_runner.dtype,
        )
        self._kv_injector.state = self._context
        self.draft_model.context_state = self._context
        saved = drafter_kv_bytes_saved(
            max_total_tokens=memory_pool_config.max_total_num_tokens,
            num_attention_layers=cfg.num_attention_layers, num_kv_heads=cfg.target.num_key_value_heads,
            head_dim=cfg.target.head_dim, dtype_bytes=target_pool.get_key_buffer(0).element_size(),
        )
        logger.info("HSPEC: drafter reads the target KV pool in place; no drafter KV cache allocated "
                    "(%.1f MiB saved for %d tokens x %d attention layers)", saved / 2**20,
                    memory_pool_config.max_total_num_tokens, cfg.num_attention_layers)

    @property
    def primary_draft_kv_pool(self):
        return None  # the target's pool; HiCache must not register it twice

    def _build_hicache_draft_plan(self) -> HiCacheDraftPlan:
        return HiCacheDraftPlan()
