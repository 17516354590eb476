"""Verify-length policies for the reference engine (`sglang_hspec.core.types.VerifyPolicy`): thin
adapters over sglang_hspec.scheduler (the same planners the SGLang worker uses) and
sglang_hspec.calibration (STS)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from sglang_hspec.core.types import VerifyPolicy


def make_policy(name: str, *, block_size: int, sps_table: str | None = None, sts: str | None = None,
                guard: bool = True, guard_prior: float | None = None
                ) -> tuple[VerifyPolicy, Callable[[torch.Tensor], torch.Tensor]]:
    """(policy, confidence transform) for `SpeculativeEngine`.

    fixed: verify the whole proposal. exact: DSpark's Algorithm 1 with early stop on this step's
    confidences. stale: budget from confidences two steps old, verify lengths = top-K of the current
    ones. auto: stale, plus the switch of scheduler/switch.py: decode plainly (no draft forward,
    anchor-only verify) whenever that is expected to be faster, probing now and then. The transform
    turns raw confidence logits [B, block_size] into per-slot probabilities (sigmoid, or the
    STS-calibrated sigmoid(z / T_j)). guard (auto only): correct the switch by the rates this engine
    realizes (scheduler/policy.py, AutoPolicy); off, its decisions depend on the table and estimates
    alone; guard_prior: the guard's prior in tokens per request (None: scheduler.switch.GUARD_PRIOR;
    larger: slower to react, harder to fool by one noisy step)."""
    from sglang_hspec.calibration.sts import calibrated_confidence, load_sts

    calibration = load_sts(sts, block_size=block_size) if sts is not None else None
    temperatures = None if calibration is None else calibration.temperatures
    # per-slot sigmoid(z_j / T_j): the planners take the running product themselves
    transform = lambda logits: calibrated_confidence(confidence_logits=logits, temperatures=temperatures)
    if name == "fixed":
        return FixedVerifyPolicy(block_size=block_size), transform
    if name not in ("exact", "stale", "auto"):
        raise ValueError(f"unknown verify-length policy {name!r}; choose fixed, exact, stale or auto")
    if sps_table is None:
        raise ValueError(f"--policy {name} needs an SPS table: profile one with `hspec profile-sps --out sps.json` "
                         "and pass --sps-table sps.json")
    from sglang_hspec.scheduler.policy import AutoPolicy, ExactPolicy, StalePolicy
    from sglang_hspec.scheduler.sps import load_sps_table
    from sglang_hspec.scheduler.switch import GUARD_PRIOR

    table = load_sps_table(sps_table)
    if name == "auto":
        prior = GUARD_PRIOR if guard_prior is None else guard_prior
        return AutoVerifyPolicy(AutoPolicy(table, lag=2, guard=guard, guard_prior=prior),
                                block_size=block_size), transform
    planner = ExactPolicy(table) if name == "exact" else StalePolicy(table, lag=2)
    return ScheduledVerifyPolicy(planner, name=name), transform


class _EveryRowDrafts(VerifyPolicy):
    """decide: every row drafts, every step; observe: nothing to learn."""

    def decide(self, *, row_ids: torch.Tensor, generations: torch.Tensor) -> torch.Tensor:
        return torch.arange(row_ids.shape[0])

    def observe(self, *, row_ids: torch.Tensor, generations: torch.Tensor, verify_lengths: torch.Tensor,
                num_accepted: torch.Tensor) -> None:
        return None


class FixedVerifyPolicy(_EveryRowDrafts):
    """`--policy fixed`: verify every proposed token (at most block_size)."""

    def __init__(self, *, block_size: int) -> None:
        self.block_size = block_size

    def plan(self, *, confidences: torch.Tensor | None, proposal_lengths: torch.Tensor, row_ids: torch.Tensor,
             generations: torch.Tensor) -> torch.Tensor:
        return proposal_lengths.clamp_max(self.block_size)


class ScheduledVerifyPolicy(_EveryRowDrafts):
    """`--policy exact` / `stale`: the scheduler's planner (`ExactPolicy`, `StalePolicy`) picks the verify
    lengths over the calibrated confidences."""

    def __init__(self, planner, *, name: str) -> None:
        self.planner = planner
        self.name = name

    def plan(self, *, confidences: torch.Tensor | None, proposal_lengths: torch.Tensor, row_ids: torch.Tensor,
             generations: torch.Tensor) -> torch.Tensor:
        if confidences is None:
            raise ValueError(f"--policy {self.name} needs a drafter with a confidence head (hspec or dspark)")
        verify_lengths = self.planner.plan(confidences=confidences.float().cpu(), slot_ids=row_ids.long().cpu(),
                                           generations=generations.long().cpu())
        return torch.minimum(verify_lengths.to(proposal_lengths.device), proposal_lengths)


class AutoVerifyPolicy(VerifyPolicy):
    """`--policy auto` in the engine's terms (`AutoPolicy`): `decide` before drafting (which rows draft),
    `plan` for the drafted rows' verify lengths, `observe` after the verify (feeds the acceptance audit).

    A drafter without a confidence head (n-gram, random) counts as confidence 1 on each proposed
    slot and 0 past its proposal, so the audit's ratio becomes its observed acceptance rate."""

    def __init__(self, planner, *, block_size: int) -> None:
        self.planner = planner
        self.block_size = block_size
        self._confidences: torch.Tensor | None = None

    def decide(self, *, row_ids: torch.Tensor, generations: torch.Tensor) -> torch.Tensor:
        _, rows = self.planner.decide(slot_ids=row_ids.long().cpu(), generations=generations.long().cpu())
        return rows

    def plan(self, *, confidences: torch.Tensor | None, proposal_lengths: torch.Tensor, row_ids: torch.Tensor,
             generations: torch.Tensor) -> torch.Tensor:
        if confidences is None:
            slot = torch.arange(self.block_size, device=proposal_lengths.device)[None, :]
            confidences = (slot < proposal_lengths[:, None]).float()
        self._confidences = confidences.float().cpu()
        verify_lengths = self.planner.plan(confidences=self._confidences, slot_ids=row_ids.long().cpu(),
                                           generations=generations.long().cpu())
        return torch.minimum(verify_lengths.to(proposal_lengths.device), proposal_lengths)

    def observe(self, *, row_ids: torch.Tensor, generations: torch.Tensor, verify_lengths: torch.Tensor,
                num_accepted: torch.Tensor) -> None:
        self.planner.observe(slot_ids=row_ids.long().cpu(), generations=generations.long().cpu(),
                             confidences=self._confidences, verify_lengths=verify_lengths.long().cpu(),
                             num_accepted=num_accepted.long().cpu())

