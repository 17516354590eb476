"""H-Spec scheduler: SPS tables, hardware-aware prefix planners, verify-length policies, simulator.

Pure functions over tensors; no SGLang import. See docs/scheduler.md."""

from .planner import argmax_budget, exact_lengths, survivals, threshold_lengths, topk_lengths
from .policy import ExactPolicy, FixedPolicy, PolicyStats, StalePolicy, ThresholdPolicy
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

__all__ = [
    "ExactPolicy", "FixedPolicy", "PolicyStats", "SpsAdditiveCostTable", "SpsCostTable", "SpsCurve",
    "StalePolicy", "ThresholdPolicy", "argmax_budget", "exact_lengths", "load_sps_table", "plot_sps",
    "profile_sps", "save_sps_table", "sps_table_from_json", "sps_table_to_json", "survivals",
    "synthetic_sps_table", "threshold_lengths", "topk_lengths",
]
