"""Verify-length policies for the reference engine: thin adapters over sglang_hspec.scheduler
(the same planners the SGLang worker uses) and sglang_hspec.calibration (STS)."""

from __future__ import annotations

from collections.abc import Callable

import torch


def make_policy(name: str, *, block_size: int, sps_table: str | None = None,
                sts: str | None = None) -> tuple[Callable, Callable[[torch.Tensor], torch.Tensor]]:
    """(policy, confidence transform) for `SpeculativeEngine`.

    fixed: verify the whole proposal. exact: DSpark's Algorithm 1 with early stop on this step's
    confidences. stale: budget from confidences two steps old, lengths = top-K of the current ones.
    The transform turns raw confidence logits [B, k] into per-slot probabilities (sigmoid, or the
    STS-calibrated sigmoid(z / T_j))."""
    from sglang_hspec.calibration.sts import calibrated_confidence, load_sts

    temperatures = load_sts(sts, gamma=block_size) if sts is not None else None
    # per-slot sigmoid(z_j / T_j): the planners take the running product themselves
    transform = lambda logits: calibrated_confidence(confidence_logits=logits, temperatures=temperatures)
    if name == "fixed":
        from sglang_hspec.engine.engine import full_block_policy

        return full_block_policy(block_size=block_size), transform
    if name not in ("exact", "stale"):
        raise ValueError(f"unknown verify-length policy {name!r}; choose fixed, exact or stale")
    if sps_table is None:
        raise ValueError(f"--policy {name} needs an SPS table: profile one with `hspec profile-sps --out sps.json` "
                         "and pass --sps-table sps.json")
    from sglang_hspec.scheduler.policy import ExactPolicy, StalePolicy
    from sglang_hspec.scheduler.sps import load_sps_table

    table = load_sps_table(sps_table)
    planner = ExactPolicy(table) if name == "exact" else StalePolicy(table, lag=2)

    def scheduled(*, confidences, proposal_lengths, row_ids, generations):
        if confidences is None:
            raise ValueError(f"--policy {name} needs a drafter with a confidence head (hspec or dspark)")
        lengths = planner.plan(confidences=confidences.float().cpu(), slot_ids=row_ids.long().cpu(),
                               generations=generations.long().cpu())
        return torch.minimum(lengths.to(proposal_lengths.device), proposal_lengths)

    scheduled.planner = planner
    return scheduled, transform
