"""`HSpecWorkerV2`: SGLang's DSpark worker with H-Spec's drafter (docs/architecture.md,
"One request through the SGLang worker"). Inherited unchanged: block proposal (argmax drafts on all-greedy steps:
`greedy_drafts_for_greedy_batches`), Markov/confidence heads, STS, SPS planner, verify/accept,
overlap relay and `_forward_prefill` / `_forward_decode` (of drafting steps); the planner's two decisions (verify
budget, per-request lengths) come from `sglang_hspec.scheduler.planner` through `planner_hooks.py`. Replaced:

- memory: no drafter KV pool. The draft runner gets a dummy 64-token pool for SGLang's bookkeeping and
  is then bound to the target's pool, before the attention backends capture it (docs/architecture.md, "No drafter KV");
- context: per-request projected target hidden states (`ContextState`) instead of injected drafter KV,
  written from the prefill capture (last prompt row) and the verify capture (row commit_lens - 1);
- draft model: architectures ["HSpecDraftModel"], whose attention reads the target KV pool in place
  (`PagedKVWindow`: sglang_hspec/kernels, Triton on CUDA, FP8 pools with the target's k/v scales);
- steps without drafting (HSPEC_SPECULATION, speculation_switch.py): one target forward over the anchors read
  at stride 1 (`_forward_plain`, plain_step.py), else DSpark's decode path with the anchor-only stand-ins.

Imports SGLang; imported only by the worker factory inside the scheduler process.
"""

from __future__ import annotations

import functools
import logging
from typing import NamedTuple

import torch
from sglang.srt.managers.utils import GenerationBatchResult
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardMode
from sglang.srt.runtime_context import get_parallel
from sglang.srt.speculative.base_spec_worker import HiCacheDraftPlan
from sglang.srt.speculative.dflash_info_v2 import DFlashDraftInputV2
from sglang.srt.speculative.dflash_utils import apply_dflash_verify_logits_adjustments
from sglang.srt.speculative.dspark_components.dspark_draft import make_next_draft_input
from sglang.srt.speculative.dspark_components.dspark_observability import InfoSegment
from sglang.srt.speculative.dspark_components.dspark_verify import TargetVerifyExecutor
from sglang.srt.speculative.dspark_components.dspark_worker_v2 import DSparkWorkerV2
from sglang.srt.speculative.spec_tp_sync import SpecTpSyncSite

from sglang_hspec.model import hspec as _hspec_model
from sglang_hspec.model.tensor_parallel import local_kv_heads

from .context import ContextState, drafter_kv_bytes_saved, prefill_last_rows, verify_commit_rows
from .lookup_splice import LOOKUP_ENV, lookup_enabled, splice_lookup_into_argmax_blocks
from .plain_step import anchor_window, draw_anchor_bonus, plain_step_forward
from .sglang_names import block_size_of, sglang_verify_lens
from .speculation_policy import speculation_guard, speculation_policy
from .speculation_switch import (
    AnchorOnlyPlanner,
    AnchorOnlyProposer,
    RecordingBudgetPlanner,
    SpeculationSwitch,
)
from .step_timer import StepTimer

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


def greedy_drafts_for_greedy_batches(proposer) -> None:
    """Make `proposer` (DSpark's `DraftBlockProposer`) draft by argmax on steps where every request is
    greedy, as SGLANG_DSPARK_USE_GREEDY_DRAFT=1 does on every step.

    Its sampled mode draws Philox noise over the whole target vocabulary at each Markov step and keeps the
    step logits, even for rows at temperature 0, whose drafts are the argmax either way (SGLang's sampler
    keys temperature-0 rows by their logits alone); an all-greedy batch is verified by argmax, which reads
    no draft logits. So the drafts and the verify are unchanged and the noise is skipped. Batches with a
    sampled request keep the sampled drafts (they accept more at temperature > 0)."""
    always_greedy = bool(proposer._greedy_draft)
    propose = proposer.propose

    @functools.wraps(propose)
    def propose_greedy_when_all_greedy(*args, sampling_info, **kwargs):
        proposer._greedy_draft = drafts_by_argmax(always_greedy=always_greedy, sampling_info=sampling_info)
        return propose(*args, sampling_info=sampling_info, **kwargs)

    proposer.propose = propose_greedy_when_all_greedy
    proposer.always_greedy_draft = always_greedy  # what the switch reads to cost the step (`step_costs`)


def drafts_by_argmax(*, always_greedy: bool, sampling_info) -> bool:
    """Whether a step with this batch's `sampling_info` drafts by argmax (`greedy_drafts_for_greedy_batches`)."""
    return always_greedy or sampling_info is None or bool(sampling_info.is_all_greedy)


def register_draft_model_class() -> None:
    """Make `architectures: ["HSpecDraftModel"]` loadable by SGLang's draft runner (idempotent)."""
    from sglang.srt.models.registry import ModelRegistry

    from .draft_model import ARCHITECTURE, HSpecDraftModel

    ModelRegistry.models[ARCHITECTURE] = HSpecDraftModel


def draft_worker_class(*, target_dtype: torch.dtype, server_dtype: str, base=None):
    """The draft TpModelWorker class DSpark's worker builds the drafter with (`draft_worker_cls`): SGLang's own,
    except that the drafter's model dtype is the target's. SGLang derives the draft's dtype from the drafter's
    config.json alone (configs/model_config.py `_get_and_verify_dtype`: a float32 or unmarked checkpoint becomes
    float16 under --dtype auto), while the drafter's attention reads the target's KV pool and its context rows
    come from the target's hidden states, both in the target's dtype (the Triton kernel refuses fp16 queries
    over a bf16 pool)."""
    if base is None:
        from sglang.srt.managers.tp_worker import TpModelWorker as base

    class HSpecDraftTpWorker(base):
        def _init_model_config(self):
            super()._init_model_config()
            derived = self.model_config.dtype
            self.model_config.dtype = target_dtype  # read when the model is built (set_default_torch_dtype)
            logger.info("HSPEC: drafter dtype %s (the target's; --dtype %s)%s", target_dtype, server_dtype,
                        "" if derived == target_dtype else f"; SGLang would have loaded it as {derived}")

    return HSpecDraftTpWorker


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
    def weight_update_runners(self) -> list:
        """None: SGLang's weight updates (`/update_weights_from_disk` and the rest) hand their checkpoint to every
        runner, but the drafter is its own checkpoint, not a slice of the target's. The target's weights change;
        the drafter keeps its own, and verification keeps the outputs the new target's."""
        return []

    def __init__(self, server_args, gpu_id, nccl_port, target_worker, **kwargs):
        register_draft_model_class()
        kwargs["draft_worker_cls"] = draft_worker_class(
            target_dtype=target_worker.model_runner.model_config.dtype,
            server_dtype=str(getattr(server_args, "dtype", "auto")), base=kwargs.get("draft_worker_cls"))
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
        # Steps without drafting (speculation_switch.py); the switch needs the request pool, built later.
        self._speculation_policy = speculation_policy()
        self._switch: SpeculationSwitch | None = None
        greedy_drafts_for_greedy_batches(self._proposer)
        if lookup_enabled():  # prompt lookup spliced into argmax-drafted blocks (lookup_splice.py)
            splice_lookup_into_argmax_blocks(self._proposer, block_size=block_size_of(self._proposer))
            logger.info("HSPEC: prompt lookup spliced into argmax-drafted blocks (%s=1)", LOOKUP_ENV)
        self._anchor_only_proposer = AnchorOnlyProposer(self._proposer)
        self._anchor_only_planner = AnchorOnlyPlanner(self._verify_planner, model_runner=self.model_runner)
        budget_planner = getattr(self._verify_planner, "_budget_planner", None)
        if budget_planner is not None:
            budget_planner.__class__ = RecordingBudgetPlanner  # same state; keeps the stale confidences it reads
        if self._speculation_policy == "auto" and not self._verify_planner.carries_confidence:
            raise RuntimeError(
                "HSPEC_SPECULATION=auto decides from the drafter's relayed confidences, which SGLang computes only "
                "with a ragged verify mode: launch with SGLANG_RAGGED_VERIFY_MODE=compact")
        self._plain_paths_logged: set[str] = set()
        self._plain_step_forward = plain_step_forward()
        self._step_timer = StepTimer.from_env()
        if self._step_timer is not None:
            self._instrument(self._step_timer)

    # ---- memory: no drafter KV (docs/architecture.md, "No drafter KV") ----
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
        # the target model's attention layers hold the FP8 pool's k/v scales
        self.draft_model.bind_target_kv(target_pool, req_to_token, target_model=self.model_runner.model)
        cfg = self.draft_model.hspec_config
        self._context = ContextState(
            req_pool_size=req_to_token.shape[0], rank=cfg.fusion_rank, project=self.draft_model.project_context,
            device=self.device, dtype=self.model_runner.dtype,
        )
        self._kv_injector.state = self._context
        self.draft_model.context_state = self._context
        self._switch = self._build_switch(req_pool_size=req_to_token.shape[0])
        saved = drafter_kv_bytes_saved(
            max_total_tokens=memory_pool_config.max_total_num_tokens,
            num_attention_layers=cfg.num_attention_layers, num_kv_heads=local_kv_heads(cfg.target.num_key_value_heads, self.draft_model.drafter),
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

    # ---- steps without drafting (speculation_switch.py) ----
    def _build_switch(self, *, req_pool_size: int) -> SpeculationSwitch | None:
        policy = self._speculation_policy
        if policy == "always":
            return None
        block_size = block_size_of(self)
        costs, greedy_costs = step_costs(block_size=block_size) if policy == "auto" else (None, None)
        switch = SpeculationSwitch(policy=policy, costs=costs, greedy_costs=greedy_costs, block_size=block_size,
                                   req_pool_size=req_pool_size,
                                   min_survival=self._verify_planner._schedule_cfg.survival_eps,
                                   guard=speculation_guard())
        budget_planner = getattr(self._verify_planner, "_budget_planner", None)
        if budget_planner is not None:
            budget_planner.stale_confidences = switch.stale
        logger.info("HSPEC: speculation policy %s (HSPEC_SPECULATION): %s", policy,
                    ("decode without drafting where plain decoding is faster, probing while off"
                     + ("; rates audited by the realized ones" if switch.guard is not None else "")) if policy == "auto"
                    else "every decode step without drafting (anchor-only verify)")
        return switch

    def _draft_this_step(self, batch) -> bool:
        if self._switch is None:
            return True
        rows = batch.req_pool_indices_cpu
        if rows is None:
            self._switch.interrupt()  # a step the switch did not decide: the guard times none of it
            return True  # no host copy of the slots: deciding would need a device read-back
        generation = self.model_runner.req_to_token_pool.req_generation[rows.to(torch.long)]
        greedy = drafts_by_argmax(always_greedy=self._proposer.always_greedy_draft, sampling_info=batch.sampling_info)
        return self._switch.should_draft(rows=rows, generation=generation, greedy=greedy)

    def _forward_decode(self, batch, on_publish, grammar_barrier=None, coordination_plan=None):
        timer = self._step_timer
        if batch.forward_mode.is_idle() or coordination_plan is not None:
            if timer is not None:
                timer.note_non_decode_step()
            if self._switch is not None:
                self._switch.interrupt()
            return super()._forward_decode(batch, on_publish, grammar_barrier, coordination_plan)
        draft = self._draft_this_step(batch)
        if timer is not None:
            timer.begin_step(kind="draft" if draft else "plain")
        try:
            if draft:
                result = super()._forward_decode(batch, on_publish, grammar_barrier, coordination_plan)
                if self._switch is not None:
                    self._switch.note_committed(result.accept_lens)  # the guard's count, read back without a sync
                return result
            fallback = self._plain_fallback_reason(batch)
            if fallback is None:
                return self._forward_plain(batch, on_publish)
            self._log_once(f"HSPEC: a step without drafting takes DSpark's anchor-only path: {fallback}")
            # DSpark's own decode path, with the proposer and planner of a step without drafting
            proposer, planner = self._proposer, self._verify_planner
            self._proposer, self._verify_planner = self._anchor_only_proposer, self._anchor_only_planner
            try:
                return super()._forward_decode(batch, on_publish, grammar_barrier, coordination_plan)
            finally:
                self._proposer, self._verify_planner = proposer, planner
        finally:
            if timer is not None:
                timer.end_step()

    # ---- a step without drafting at stride 1 (plain_step.py) ----
    def _plain_fallback_reason(self, batch) -> str | None:
        """Why this step without drafting must take DSpark's anchor-only path (the stand-ins) instead of
        `_forward_plain`, or None. The stand-in path handles everything DSpark handles; `_forward_plain`
        only what it reproduces exactly, without reading a device value on the host."""
        if self._target_is_mambaish:
            return "hybrid (mamba) target: its verify state commit is DSpark's"
        if get_parallel().attn_dp_enabled or get_parallel().pp_size > 1:
            return "DP attention or pipeline parallelism"
        if (self._simulate_acc_len > 0 and self._simulate_acc_len != 1.0) or self._sim_draw_ahead:
            # SGLANG_SIMULATE_ACC_LEN=1.0 (the SPS profiler's) commits the bonus alone: a step without drafting
            return "SGLANG_SIMULATE_ACC_LEN other than 1.0"
        if self._verify_inputs_ready is not None:
            return "early verify metadata (SGLANG_OPT_DSV41_TARGET_METADATA_EARLY)"
        if self._observers._block_accept_recorder is not None:
            return "the block-accept estimator (SGLANG_DSPARK_BLOCK_ACCEPT_ESTIMATE_PATH) records drafts"
        if self.model_runner.ngram_embedding_manager.engram_hasher is not None:
            return "engram target: its history commit is DSpark's"
        if not isinstance(batch.spec_info, DFlashDraftInputV2):
            return "no DSpark draft input on the batch"
        if batch.has_grammar:
            return "grammar-constrained request"
        if batch.return_logprob:
            return "logprobs requested"
        info = batch.sampling_info
        if info is not None and info.has_custom_logit_processor:
            return "custom logit processor"
        if info is not None and info.sampling_mask_batch_indices is not None:
            return "sampling masks requested"
        return None

    def _log_once(self, message: str) -> None:
        """Which path steps without drafting take, logged the first time each is taken."""
        if message not in self._plain_paths_logged:
            self._plain_paths_logged.add(message)
            logger.info(message)

    def _forward_plain(self, batch, on_publish) -> GenerationBatchResult:
        """A decode step without drafting (plain_step.py): one target forward over each request's anchor, the
        bonus drawn from the anchor row, one committed token per request; the result has stride 1."""
        draft_input, sampling_info = batch.spec_info, batch.sampling_info
        prefix_lens = batch.seq_lens
        bs = len(prefix_lens)
        prefix_lens.record_stream(torch.get_device_module(self.device).current_stream())
        self._observers.begin_step()
        anchor = draft_input.bonus_tokens.view(-1)
        layout = self._anchor_only_planner.layout(bs=bs, device=self.device)  # cached per batch size
        with self._observers.segment(InfoSegment.TARGET_VERIFY):
            logits_output, can_run_cuda_graph = self._plain_forward(batch, layout=layout, anchor=anchor, bs=bs)
        bonus = self._plain_bonus(logits_output.next_token_logits, sampling_info, draft_input)
        ones = torch.ones(bs, dtype=torch.int32, device=self.device)  # tokens committed per request: the anchor
        new_seq_lens = prefix_lens + 1
        if on_publish is not None:
            on_publish(new_seq_lens)  # no confidences: nothing was drafted
        self._plain_commit(batch, logits_output.hidden_states)
        logits_output.hidden_states = None
        zeros = torch.zeros(bs, dtype=torch.int32, device=self.device)  # drafts accepted, trimmed by the cap
        self._observers.observe_verify_step(
            forward_ct=int(batch.forward_iter), reqs=batch.reqs, bs=bs, proposal_folded=False,
            verify_ids_2d=anchor[:, None], target_logits=logits_output.next_token_logits, layout=layout,
            confidence=None, confidence_raw=None, prefix_lens=prefix_lens,
            draft_tokens=anchor.new_empty((bs, 0)), draft_block=None,  # read only by the block-accept estimator
            sampling_info=sampling_info, correct_len=zeros, cap_trim_lens=zeros, bonus=bonus, commit_lens=ones,
            verify_token_budget=None, req_pool_indices=batch.req_pool_indices,
            verify_tier_num_tokens=int(batch.spec_verify_tier_num_tokens), dp_tier_num_tokens=None,
        )
        return GenerationBatchResult(
            logits_output=logits_output, next_token_ids=bonus, accept_lens=ones, block_accept_lens=ones,
            cap_lens=ones, can_run_cuda_graph=can_run_cuda_graph,
            next_draft_input=make_next_draft_input(bonus_tokens=bonus, new_seq_lens=new_seq_lens),
            speculative_num_draft_tokens=int(self.verify_num_draft_tokens), speculative_output_stride=1,
            new_seq_lens=new_seq_lens,
        )

    def _plain_forward(self, batch, *, layout, anchor, bs):
        """The target forward over each request's anchor: its logits and captured hidden states [bs, ...] (row i
        is request i), with the sampling logit adjustments (penalties, logit bias) applied as DSpark's verify
        applies them to each of its rows. The scheduler's forward isolation restores the batch fields changed
        here, as it does for DSpark's verify."""
        if self._plain_decodes(batch):
            self._log_once("HSPEC: steps without drafting run the anchors as a DECODE forward, read at stride 1")
            out = self._decode_anchors(batch, anchor=anchor)
        else:
            self._log_once("HSPEC: steps without drafting verify the anchors (TARGET_VERIFY, compact layout), read "
                           "at stride 1")
            out = self._verify_anchors(batch, layout=layout, anchor=anchor)
        logits_output = out.logits_output
        if logits_output.hidden_states is None:
            raise RuntimeError("HSPEC verify requires the target hidden-state capture, got None")
        logits_output.next_token_logits = logits_output.next_token_logits[:bs]
        logits_output.hidden_states = logits_output.hidden_states[:bs]
        apply_dflash_verify_logits_adjustments(next_token_logits=logits_output.next_token_logits,
                                               sampling_info=batch.sampling_info, draft_token_num=1)
        return logits_output, out.can_run_cuda_graph

    def _plain_decodes(self, batch) -> bool:
        """Whether the anchors run as an ordinary DECODE forward: on CPU without a CUDA graph runner, unless
        HSPEC_PLAIN_STEP_FORWARD=verify (plain_step.py). With a graph runner, SGLang captured the target's graphs
        in TARGET_VERIFY mode only, and a DECODE batch would pass their size check and replay a verify graph;
        the 1-token compact verify replays a captured graph instead."""
        return (self._plain_step_forward == "auto" and torch.device(self.device).type == "cpu"
                and self.model_runner.decode_cuda_graph_runner is None and batch.seq_lens_cpu is not None)

    def _decode_anchors(self, batch, *, anchor):
        """The anchors as a DECODE batch, what a server without speculation runs: each request's anchor at
        position prefix_len, written to the slot the scheduler reserved there (`req_to_token`), with the
        drafter's hidden-state capture and no sampling (`is_verify`)."""
        prefix_lens = batch.seq_lens
        req_to_token = self.model_runner.req_to_token_pool.req_to_token
        batch.out_cache_loc = req_to_token[batch.req_pool_indices, prefix_lens].to(torch.int64)
        batch.forward_mode = ForwardMode.DECODE
        batch.input_ids = anchor
        batch.spec_info = None
        batch.seq_lens = prefix_lens + 1  # a decode batch's lengths count the token it decodes
        batch.seq_lens_cpu = batch.seq_lens_cpu + 1
        batch.seq_lens_sum = int(batch.seq_lens_cpu.sum())
        return self.target_worker.forward_batch_generation(batch, capture_hidden_mode=CaptureHiddenMode.FULL,
                                                           is_verify=True)

    def _verify_anchors(self, batch, *, layout, anchor):
        """DSpark's ragged verify forward (TARGET_VERIFY) over the packed anchors in the stand-ins' compact layout,
        on a width-1 KV window: each request's slot at its prefix length, reserved by the scheduler's decode
        preparation."""
        seq_lens_cpu = batch.seq_lens_cpu if batch.seq_lens_cpu is not None else batch.spec_info.nxt_kv_lens_cpu
        plan = self.model_runner.kv_index_translator.plan_uniform_extend(
            req_pool_indices=batch.req_pool_indices, seq_lens=batch.seq_lens, seq_lens_cpu=seq_lens_cpu, width=1)
        window = anchor_window(anchor=anchor, prefix_lens=batch.seq_lens, write_loc=plan.write_virtual,
                               num_tokens=layout.graph_num_tokens)
        epilogue = self._verify_executor.verify_epilogue
        if epilogue is not None:
            epilogue.begin_step(sglang_verify_lens(layout), armed=False)  # its in-graph accept commits nothing
        return self._verify_executor._run_ragged(batch=batch, layout=layout, ragged_window=window,
                                                 sampling_info=batch.sampling_info, kv_loc_plan=plan)

    def _plain_bonus(self, logits, sampling_info, draft_input) -> torch.Tensor:
        bonus = draw_anchor_bonus(logits=logits, sampling_info=sampling_info, draft_input=draft_input,
                                  fused_argmax=self._verify_executor._fused_argmax)
        greedy = sampling_info is None or sampling_info.is_all_greedy
        site = SpecTpSyncSite.DSPARK_ACCEPT_GREEDY if greedy else SpecTpSyncSite.DSPARK_ACCEPT_SAMPLE
        return self._tp_sync.sync(site, bonus)  # every TP rank commits rank 0's token

    def _plain_commit(self, batch, hidden) -> None:
        """The context row of the anchor, the request's last committed token."""
        self._context.write(batch.req_pool_indices, hidden)

    # ---- HSPEC_STEP_PROFILE (step_timer.py) ----
    def _instrument(self, timer: StepTimer) -> None:
        """Time SGLang's components of a decode step (bound methods of this worker's objects only)."""
        wrap = timer.wrap
        for proposer in (self._proposer, self._anchor_only_proposer):
            proposer.propose = wrap(proposer.propose, "draft")
        self.draft_model_runner.forward = wrap(self.draft_model_runner.forward, "draft.forward")
        self.draft_model.forward = wrap(self.draft_model.forward, "draft.model")
        # the heads, split: base logits (ours), SGLang's Markov sampler (module global, looked up per call), and
        # the confidence head (SGLang's, on our features)
        self.draft_model.compute_base_logits = wrap(self.draft_model.compute_base_logits, "draft.base_logits")
        self.draft_model.compute_confidence = wrap(self.draft_model.compute_confidence, "draft.confidence")
        from sglang.srt.speculative.dspark_components import dspark_draft

        if not hasattr(dspark_draft.sample_draft_block, "__wrapped__"):
            dspark_draft.sample_draft_block = wrap(dspark_draft.sample_draft_block, "draft.markov")
        # the window read is fused into the attention over the pool (sglang_hspec/kernels): time that call
        _hspec_model.paged_block_attention = wrap(_hspec_model.paged_block_attention, "draft.kv_view")
        for planner in (self._verify_planner, self._anchor_only_planner):
            planner.resolve_verify_token_budget = wrap(planner.resolve_verify_token_budget, "planner")
            planner.schedule_layout = wrap(planner.schedule_layout, "planner")
        executor = self._verify_executor
        executor.run_compact = wrap(executor.run_compact, "verify")
        executor.run_non_compact = wrap(executor.run_non_compact, "verify")
        executor.accept_and_finalize = wrap(executor.accept_and_finalize, "accept")
        executor.commit_hidden = wrap(executor.commit_hidden, "commit")
        self._observers.observe_verify_step = wrap(self._observers.observe_verify_step, "observe")
        # a step without drafting at stride 1: the same segment names as the stand-in path's pieces
        self._plain_forward = wrap(self._plain_forward, "verify")
        self._plain_bonus = wrap(self._plain_bonus, "accept")
        self._plain_commit = wrap(self._plain_commit, "commit")

    def get_confidence_budget_prepare(self):
        prepare = super().get_confidence_budget_prepare()
        timer = getattr(self, "_step_timer", None)
        if prepare is None or timer is None:
            return prepare
        return timer.wrap(prepare, "prepare")

    def forward_batch_generation(self, batch, on_publish=None, grammar_barrier=None, *, pp_proxy_tensors=None):
        timer = getattr(self, "_step_timer", None)
        if batch.forward_mode.is_extend() or batch.is_extend_in_batch:
            if timer is not None:
                timer.note_non_decode_step()
            if getattr(self, "_switch", None) is not None:
                self._switch.interrupt()
        return super().forward_batch_generation(batch, on_publish, grammar_barrier,
                                                pp_proxy_tensors=pp_proxy_tensors)


def step_costs(*, block_size: int):
    """`StepCosts` of this server for `HSPEC_SPECULATION=auto`, sampled and greedy: the SPS table SGLang's
    planner was given, read with our loader (it keeps the plain-decode probes SGLang's struct drops), and its
    greedy twin (`sps_profile.greedy_table_path`: the same steps at temperature 0, argmax drafts) where one
    lies beside it, else None (all-greedy steps are costed as sampled ones, which overprices them). A table
    without a drafter column is SGLang's profile of whole drafting steps at block_size + 1 verify tokens per
    request, so a drafting step over N requests costs at least its step of N requests
    (`StepCosts(block_size=)`)."""
    from sglang.srt.runtime_context import get_spec

    from sglang_hspec.scheduler.sps import load_sps_table
    from sglang_hspec.scheduler.switch import StepCosts

    from .sps_profile import greedy_table_path

    path = get_spec().speculative_dspark_sps_table_path
    if not path:
        raise RuntimeError("HSPEC_SPECULATION=auto weighs speculation against plain decoding with this server's SPS "
                           "table, and none was given: set HSPEC_AUTO_PROFILE_SPS=1 (profiled and cached at launch) "
                           "or pass --speculative-dspark-sps-table-path from `hspec profile-sps --url`")
    def costs_of(table_path) -> StepCosts:
        table = load_sps_table(table_path)
        if not getattr(table, "has_plain", False):
            raise RuntimeError(f"HSPEC_SPECULATION=auto needs plain-decode probes in the SPS table, and {table_path} "
                               "has none (profiled before they existed, or by SGLang's profiler alone): re-profile it "
                               "(delete the cached table and restart with HSPEC_AUTO_PROFILE_SPS=1, or `hspec "
                               "profile-sps --url`)")
        return StepCosts(table, block_size=None if table.draft_seconds else block_size)

    costs = costs_of(path)
    twin = greedy_table_path(path)
    if not twin.is_file():
        logger.info("HSPEC: no greedy SPS twin %s: all-greedy steps are costed by the sampled table", twin)
        return costs, None
    greedy_costs = costs_of(twin)
    logger.info("HSPEC: all-greedy steps are costed by the greedy SPS twin %s", twin)
    return costs, greedy_costs
