"""Decode steps without drafting inside SGLang's DSpark worker (HSPEC servers, compact verify mode).

`HSPEC_SPECULATION=auto` (speculation_policy.py) lets the HSPEC worker skip the drafter on a step where
plain decoding is expected to commit more tokens per second than speculation (the decision is
`sglang_hspec.scheduler.switch.decide_speculation`, as in the reference engine's `auto` policy);
`never` skips it on every step, `always` (the default) on none.

A no-draft step is read at stride 1 by the worker (`HSpecWorkerV2._forward_plain`, plain_step.py), whose
results equal this path's; where it does not apply (grammars, logprobs, ...: `_plain_fallback_reason`), the
step runs DSpark's own decode path with two stand-ins for that step only:

- `AnchorOnlyProposer` instead of `DraftBlockProposer`: no drafter forward, no heads; the block ids are the
  anchor (the previous bonus token) followed by mask tokens, drafted "by argmax" (one-hot draft
  distribution) and with no confidences, so nothing is relayed to the planner for this step;
- `AnchorOnlyPlanner` instead of `DSparkVerifyPlanner`: every request's verify length is 1 (the anchor
  only), in a compact layout (cached per batch size); everything else is DSpark's planner.

Why it is lossless: with verify length 1 no draft token is ever compared or committed. Greedy: the bonus
is the argmax of the anchor row, which is what plain decoding emits. Sampling: SGLang's chain sampler
accepts the first draft token x with probability min(1, p(x) / q(x)) = p(x) (q one-hot), else draws from
the residual max(p - q, 0) renormalised = p without x; the emitted token is then distributed as p either
way, the target's own distribution at the anchor, and the length cap keeps nothing beyond it. The context
row (the drafter's projected hidden state) is still written from the verify capture (row 0), so the next
drafting step starts from the current prefix. The decision reads only stale, host-side values (the
survivals SGLang's budget planner derived on the host from relayed confidences, the batch size and the
switch's own counters), so overlap scheduling keeps its no-sync rule.

Imports SGLang: imported only from the worker inside the scheduler process.
"""

from __future__ import annotations

import logging
import time

import torch
from sglang.srt.speculative.dspark_components.dspark_draft import (
    DraftBlockResult,
    DraftProposal,
    resolve_greedy_mask,
)
from sglang.srt.speculative.dspark_components.dspark_planner import (
    HostConfidenceBudgetPlanner,
    ragged_layout_exceeds_captured_grid,
    verify_layout_graph_num_tokens_floor,
    verify_layout_grid,
)
from sglang.srt.speculative.ragged_verify import RaggedVerifyLayout, RaggedVerifyMode

from .readback import AsyncSums
from .sglang_names import block_size_of
from .speculation_policy import POLICIES

logger = logging.getLogger(__name__)

class AnchorOnlyProposer:
    """`DraftBlockProposer.propose` for a step without drafting: the anchor and mask tokens, no forward."""

    def __init__(self, proposer):
        self._proposer = proposer
        self._mask_buf: torch.Tensor | None = None

    def __getattr__(self, name):
        return getattr(self._proposer, name)

    def _masks(self, bs: int, device) -> torch.Tensor:
        buf = self._mask_buf
        if buf is None or buf.shape[0] < bs or buf.device != torch.device(device):
            buf = torch.full((bs, block_size_of(self._proposer)), int(self._proposer._mask_token_id), dtype=torch.long,
                             device=device)
            self._mask_buf = buf
        return buf[:bs]

    def propose(self, *, batch, draft_input, verify_window, bs, device, target_model, sampling_info,
                anchor_prepared: bool = False) -> DraftProposal:
        block_ids = self._proposer.draft_block_ids_view(bs=bs, device=batch.seq_lens.device)
        if not anchor_prepared:
            block_ids[:, 0].copy_(draft_input.bonus_tokens.view(-1))
        temperatures = (torch.ones(bs, dtype=torch.float32, device=device) if sampling_info is None
                        else sampling_info.temperatures.view(-1)[:bs].to(torch.float32).clamp(min=1e-5))
        block = DraftBlockResult(
            draft_tokens=self._masks(bs, block_ids.device), corrected_logits=None,
            greedy_mask=resolve_greedy_mask(bs=bs, sampling_info=sampling_info, device=device),
            temperatures=temperatures, greedy_draft=True,
        )
        return DraftProposal(draft_block_ids=block_ids, draft_block=block, confidence=None)


class AnchorOnlyPlanner:
    """DSpark's verify planner for a step without drafting: verify length 1 for every request."""

    def __init__(self, planner, *, model_runner):
        self._planner = planner
        self._model_runner = model_runner
        self._layouts: dict[tuple[int, str], RaggedVerifyLayout] = {}

    def __getattr__(self, name):
        return getattr(self._planner, name)

    def resolve_verify_token_budget(self, **_) -> None:
        return None

    def layout(self, *, bs: int, device) -> RaggedVerifyLayout:
        key = (bs, str(device))
        if key not in self._layouts:
            lens = [1] * bs
            width = self._planner.verify_num_draft_tokens
            if ragged_layout_exceeds_captured_grid(num_reqs=bs, verify_num_draft_tokens=width,
                                                   model_runner=self._model_runner, tier_tokens_hint=bs):
                grid, floor = [bs], 0  # past the captured verify graphs: eager, as SGLang's own layouts
            else:
                grid = verify_layout_grid(verify_lens_cpu=lens, ragged_verify_mode=RaggedVerifyMode.COMPACT,
                                          model_runner=self._model_runner)
                floor = verify_layout_graph_num_tokens_floor(
                    num_reqs=bs, ragged_verify_mode=RaggedVerifyMode.COMPACT, verify_num_draft_tokens=width,
                    model_runner=self._model_runner, tier_num_tokens=bs)
            self._layouts[key] = RaggedVerifyLayout.from_verify_lens(verify_lens_cpu=lens, device=device, grid=grid,
                                                                     graph_num_tokens_floor=floor)
        return self._layouts[key]

    def schedule_layout(self, *, req_pool_indices, device, **_) -> RaggedVerifyLayout:
        return self.layout(bs=int(req_pool_indices.shape[0]), device=device)

    def should_run_compact(self, *, layout) -> bool:
        return layout is not None


class StaleConfidences:
    """What the switch knows of each request slot's confidences (STS-calibrated; relayed and two steps old
    under overlap, the last drafting step's without: `RecordingBudgetPlanner`), with whether they belong to
    the slot's current request (SGLang's generation guard). Written only by the planner (before a step, under
    overlap; after drafting, without), so every read is stale by construction.

    What it keeps is not the last snapshot but, per request, the mean survival of the snapshots it was handed,
    shrunk toward the running mean survival of all requests by `strength` snapshots' worth, read back as
    conditionals (the reference engine's rule, sglang_hspec/scheduler/fused.py `mature_pass`): a step's
    confidences predict that step's acceptance and next to nothing of the step two later, so one low snapshot
    held a request plain until its next probe (docs/scheduler.md, "Estimates, two steps stale")."""

    def __init__(self, *, req_pool_size: int, block_size: int, strength: float = 8.0):
        if not strength >= 0:
            raise ValueError(f"strength must be >= 0 (snapshots' worth of the prior), got {strength}")
        self.strength = float(strength)
        self.confidence = torch.ones(req_pool_size, block_size, dtype=torch.float32)
        self.generation = torch.full((req_pool_size,), -1, dtype=torch.int64)
        self._surv_sum = torch.zeros(req_pool_size, block_size, dtype=torch.float64)
        self._count = torch.zeros(req_pool_size, dtype=torch.float64)
        self._prior_surv: torch.Tensor | None = None  # [block_size] running mean survival of every snapshot

    def write(self, *, rows: torch.Tensor, confidence: torch.Tensor, generation: torch.Tensor,
              known: torch.Tensor) -> None:
        rows = rows.to(torch.long)
        known = known.view(-1).to(torch.bool)
        generation = torch.where(known, generation.to(torch.int64), -1)
        fresh = self.generation[rows] != generation  # a new request in the slot (or none): start afresh
        self._surv_sum[rows[fresh]] = 0.0
        self._count[rows[fresh]] = 0.0
        self.generation[rows] = generation
        rows, conf = rows[known], confidence[known, : self.confidence.shape[1]].to(torch.float64)
        if not rows.numel():
            return
        surv = torch.cumprod(conf, dim=1)
        self._surv_sum[rows] += surv
        self._count[rows] += 1.0
        mean = surv.mean(dim=0)
        self._prior_surv = mean if self._prior_surv is None else 0.9 * self._prior_surv + 0.1 * mean
        from sglang_hspec.scheduler.switch import conditionals_of_survival

        est = (self.strength * self._prior_surv + self._surv_sum[rows]) / (self.strength + self._count[rows])[:, None]
        self.confidence[rows] = conditionals_of_survival(est).to(torch.float32)

    def read(self, *, rows: torch.Tensor, generation: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(confidences [N, k], known [N] bool) for the slots `rows` whose current generations are given."""
        rows = rows.to(torch.long)
        known = (self.generation[rows] == generation.to(torch.int64)) & (generation >= 1)
        return self.confidence[rows], known

    def prior(self) -> torch.Tensor | None:
        """[k] float64: the conditionals of the running mean survival of every snapshot so far (None before
        the first): the estimate for a batch of only new requests (requests served one at a time)."""
        from sglang_hspec.scheduler.switch import conditionals_of_survival

        return None if self._prior_surv is None else conditionals_of_survival(self._prior_surv)


class RecordingBudgetPlanner(HostConfidenceBudgetPlanner):
    """SGLang's host budget planner; also keeps the confidences it is handed (`StaleConfidences`).
    Installed by `__class__` on the planner SGLang built (same state, one more side effect).

    What it is handed is already on the host: under overlap scheduling the relay's confidences, two steps
    old (the planner runs before every decode step, drafting or not); without overlap the confidences of
    the step just drafted, copied to the host by SGLang's synchronous budget (`compute_budget_sync`), which
    its planner then delays by its carry ring to mimic the overlap's lag. The switch keeps them as handed:
    without overlap the planner runs only on drafting steps, and a ring indexed by planner calls would make
    a request wait for its third probe before the switch knew anything of it (measured at one request,
    32-token answers: 9 of 246 steps drafted, probes only)."""

    stale_confidences: StaleConfidences | None = None

    def compute_budget(self, *, confidence, generation, current_generation, req_pool_indices_cpu) -> int:
        if self.stale_confidences is not None:
            current = current_generation.to(torch.int64)
            known = (current >= 1) & (generation.to(torch.int64) == current)
            self.stale_confidences.write(rows=req_pool_indices_cpu, confidence=confidence, generation=current,
                                         known=known)
        return super().compute_budget(confidence=confidence, generation=generation,
                                      current_generation=current_generation,
                                      req_pool_indices_cpu=req_pool_indices_cpu)


class SpeculationSwitch:
    """Per-step draft-or-not for one HSPEC worker (host state only): `decide_speculation` over the stale
    confidences of the batch's requests and the server's step costs, probing while off (the interval
    doubles from `initial_probe_interval` up to `max_probe_interval` while speculation keeps not paying).
    A probe drafts every request of the batch (one batched draft forward) and lets SGLang's planner choose
    the verify lengths; its confidences reach the planner through SGLang's relay like any step's.

    `guard` (auto only): the switch's rates corrected by the rates this server realizes
    (`sglang_hspec.scheduler.switch.RateGuard`, as the reference engine's `auto` policy does): a step runs
    from one decision to the next, a plain step commits one token per request, a drafting step the sum of its
    commit lengths (`note_committed`), read back without a device sync (`readback.AsyncSums`; a step waits
    while fewer than `guard_token_lag` later steps have ended for its count).
    `interrupt` drops the open step when a prefill or idle step ran inside it."""

    def __init__(self, *, policy: str, costs, block_size: int, req_pool_size: int, min_survival: float,
                 greedy_costs=None,
                 margin: float = 0.05, initial_probe_interval: int = 4, max_probe_interval: int = 256,
                 guard: bool = True, guard_prior: float | None = None, guard_decay: float = 0.97,
                 guard_token_lag: int = 8, clock=time.perf_counter):
        if policy not in POLICIES:
            raise ValueError(f"unknown speculation policy {policy!r}; use one of {', '.join(POLICIES)}")
        if policy == "auto" and costs is None:
            raise ValueError("HSPEC_SPECULATION=auto needs the step costs of this server (an SPS table with plain-"
                             "decode probes)")
        from sglang_hspec.scheduler.switch import GUARD_PRIOR, RateGuard

        self.policy = policy
        self.costs = costs
        self.greedy_costs = greedy_costs
        self.block_size = block_size
        self.min_survival = float(min_survival)
        self.margin = float(margin)
        self.initial_probe_interval = int(initial_probe_interval)
        self.max_probe_interval = int(max_probe_interval)
        self.probe_interval = self.initial_probe_interval
        self.steps_since_draft = 1 << 30  # nothing drafted yet: the first step may probe
        self.stale = StaleConfidences(req_pool_size=req_pool_size, block_size=block_size)
        self.ratios = torch.ones(block_size, dtype=torch.float64)
        self.last_decision = None
        self.counts = {"draft": 0, "probe": 0, "plain": 0}
        prior = GUARD_PRIOR if guard_prior is None else guard_prior
        self.guard = (RateGuard(prior=prior, decay=guard_decay, token_lag=guard_token_lag, clock=clock)
                      if guard and policy == "auto" else None)
        self._guard_step: list | None = None  # the open step's handle
        self._readback = AsyncSums(capacity=max(1, guard_token_lag))  # drafting steps' committed tokens

    def should_draft(self, *, rows: torch.Tensor, generation: torch.Tensor, greedy: bool = False) -> bool:
        """Whether this step runs the drafter. `rows`: the batch's request slots (host), `generation`:
        their current generations (host); `greedy`: the step would draft by argmax (an all-greedy batch),
        costed by `greedy_costs` where given."""
        if self.policy == "always":
            return True
        if self.policy == "never":
            self.counts["plain"] += 1
            return False
        from sglang_hspec.scheduler.switch import decide_speculation, estimated_survival, next_probe_interval

        confidence, known = self.stale.read(rows=rows, generation=generation)
        num_reqs = int(rows.numel())
        # a batch of only new requests (served one at a time) rests on earlier requests' mean, as the reference
        # engine's does: without it each request of a C = 1 stream decoded plainly until a probe
        prior = self.stale.prior() if not bool(known.any()) else None
        survival = estimated_survival(confidences=confidence, known=known, ratios=self.ratios, prior=prior)
        known_rows = num_reqs if prior is not None else int(known.sum())
        guard = self.guard
        spec_scale = plain_scale = 1.0
        if guard is not None:  # the step decided last ends here; its realized rate is in the scales
            self._collect_tokens()
            self._guard_step = None
            guard.end()
            spec_scale, plain_scale = guard.scale("spec"), guard.scale("plain")
        decision = decide_speculation(
            survival=survival, costs=self.greedy_costs if greedy and self.greedy_costs is not None else self.costs,
            known_rows=known_rows,
            steps_since_draft=self.steps_since_draft, probe_interval=self.probe_interval,
            probe_rows=max(1, num_reqs), margin=self.margin, min_survival=self.min_survival,
            spec_scale=spec_scale, plain_scale=plain_scale,
        )
        if guard is not None and num_reqs:
            kind = "probe" if decision.probe else "spec" if decision.speculate else "plain"
            # the guard compares realized rates with the table's own predictions, not the scaled ones
            predicted = (decision.spec_tokens_per_sec / spec_scale if kind == "spec"
                         else decision.plain_tokens_per_sec / plain_scale)
            self._guard_step = guard.begin(kind=kind, predicted_rate=predicted, num_reqs=num_reqs,
                                           tokens=num_reqs if kind == "plain" else None)
        self.probe_interval = next_probe_interval(decision=decision, probe_interval=self.probe_interval,
                                                  initial=self.initial_probe_interval,
                                                  maximum=self.max_probe_interval)
        self.steps_since_draft = 0 if decision.speculate else self.steps_since_draft + 1
        self.counts["probe" if decision.probe else "draft" if decision.speculate else "plain"] += 1
        self.last_decision = decision
        return decision.speculate

    def note_committed(self, commit_lens: torch.Tensor) -> None:
        """The tokens the drafting step just run commits per request ([bs], on its device), for the guard;
        never waits for the device (readback.py)."""
        step = self._guard_step
        if self.guard is not None and step is not None and step[1] == "spec":
            self._readback.push(step, commit_lens)

    def interrupt(self) -> None:
        """A step that is not a decode step (prefill, idle) ran: the open step's wall time is not its own."""
        if self.guard is not None:
            self.guard.interrupt()
            self._guard_step = None

    def _collect_tokens(self) -> None:
        for step, tokens in self._readback.ready():
            self.guard.set_tokens(step, tokens)


__all__ = ["AnchorOnlyPlanner", "AnchorOnlyProposer", "RecordingBudgetPlanner", "SpeculationSwitch",
           "StaleConfidences"]
