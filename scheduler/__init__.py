"""H-Spec scheduler: SPS tables, hardware-aware prefix planners, verify-length policies, simulator.

Pure functions over tensors; no SGLang import. See docs/scheduler.md."""

from .planner import argmax_budget, exact_lengths, survivals, threshold_lengths, topk_lengths
from .policy import AutoPolicy, ExactPolicy, FixedPolicy, PolicyStats, StalePolicy, ThresholdPolicy
from .profiler import plot_sps, profile_sps
from .sps import (
    SpsAdditiveCostTable,
    SpsCostTable,
    SpsCurve,
    load_sps_table,
    save_sps_table,
    sps_table_from_json,
    sps_table_to_json,
    synthetic_sps_table,
)
from .switch import SpeculationDecision, StepCosts, decide_speculation

__all__ = [
    "AutoPolicy", "ExactPolicy", "FixedPolicy", "PolicyStats", "SpeculationDecision", "SpsAdditiveCostTable",
    "SpsCostTable", "SpsCurve", "StalePolicy", "StepCosts", "ThresholdPolicy", "argmax_budget",
    "decide_speculation", "exact_lengths", "load_sps_table", "plot_sps", "profile_sps", "save_sps_table",
    "sps_table_from_json", "sps_table_to_json", "survivals", "synthetic_sps_table", "threshold_lengths",
    "topk_lengths",
]
