"""HookRegistry hooks: on HSPEC servers, SGLang's DSpark planner takes its two decisions from
`sglang_hspec.scheduler.planner`, the code the reference engine and the scheduler tests run
(docs/architecture.md, "SGLang internals we hook").

SGLang 0.5.23 computes them in two pure functions, which are the seams (AROUND hooks; every other server
runs SGLang's own):

- budget: `dspark_planner.compute_verify_token_budget(history_survival_probs, sps_table, cfg)`, called by
  `HostConfidenceBudgetPlanner.compute_budget` on the host with the survivals it derived from the relayed
  confidences (lag ring, generation guard: unknown rows count as survival 1) -> `planner.budget_choice`
  (argmax of tau* x SPS over every prefix);
- lengths: `ScheduleVerifyLensTopk.execute(confidence, budget, cfg)`, called by
  `DSparkVerifyPlanner._schedule_verify_lens` with this step's confidences (on the device on a GPU) and the
  budget (after SGLang's optional graph-tier fill) -> `planner.topk_lengths` over SGLang's float32 sort
  survival. Sync-free: no host read-back (SGLang's TP sync, invariant check and debug log follow, unchanged).

Everything around them stays SGLang's: the confidence relay and its pinned ring, the lag-2 carry, the
generation guard, forced budgets (`set_dspark_forced_budget_frac`), the graph-tier alignment, the layouts.
Both modes that schedule (compact, cap-accept) go through these two functions.

Conventions translated here: SGLang's verify length counts the anchor (`min_verify_len` + admitted draft
tokens, clamped to [max(min_verify_len, 1), max_verify_len]); candidates beyond `max_verify_len` columns are
not offered; `survival_eps` is our `min_survival`. The SPS table object SGLang loaded (either layout) is
converted field by field into our validated struct once per table object (no second parse) for `SpsCurve`. Two differences from SGLang's arithmetic remain, both
documented in docs/scheduler.md: our floor table reads 0 steps/s beyond `max_batch_tokens` (SGLang keeps
the last probe), so the budget never plans past the table's capacity (a WARNING at first use when that is
below the server's verify capacity); additive tables interpolate with `np.interp` (equal up to rounding).

With `SGLANG_DSPARK_DEBUG_CONFIDENCE_PREFIX_SCHEDULER=1` each decision is logged as `[HSPEC-PLANNER] ...`
next to SGLang's `[DSPARK-CPS]` lines. Importing this module imports no SGLang; `install()` does.
"""

from __future__ import annotations

import logging

import msgspec
import torch

from sglang_hspec.scheduler import planner
from sglang_hspec.scheduler.sps import SpsAdditiveCostTable, SpsCostTable, SpsCurve

from .sglang_names import block_size_of

logger = logging.getLogger(__name__)

ALGORITHM = "HSPEC"
BUDGET_TARGET = "sglang.srt.speculative.dspark_components.dspark_planner.compute_verify_token_budget"
LENGTHS_TARGET = "sglang.kernels.ops.speculative.dspark.dspark_schedule.ScheduleVerifyLensTopk.execute"
LOG_TAG = "[HSPEC-PLANNER]"

_installed = False
_announced = False
_curve_cache: tuple[object, SpsCurve] | None = None  # (SGLang's table object, our curve): one table per server


def serves_hspec() -> bool:
    """Whether this process serves `--speculative-algorithm HSPEC` (SGLang's published server arguments;
    False where none are published, e.g. the launcher before resolution or a test process)."""
    from sglang.srt.runtime_context import get_spec

    try:
        algorithm = get_spec().speculative_algorithm
    except ValueError:  # "config namespace 'spec' not published"
        return False
    return str(algorithm or "").upper() == ALGORITHM


def _debug_log() -> bool:
    from sglang.srt.environ import envs

    return bool(envs.SGLANG_DSPARK_DEBUG_CONFIDENCE_PREFIX_SCHEDULER.get())


def sps_curve(sps_table) -> SpsCurve:
    """Our `SpsCurve` over the table SGLang loaded (`SpsCostTable` or `SpsAdditiveCostTable`, its JSON
    layout is ours), converted once per table object."""
    global _curve_cache
    if _curve_cache is not None and _curve_cache[0] is sps_table:
        return _curve_cache[1]
    kind = SpsAdditiveCostTable if hasattr(sps_table, "bias_seconds") else SpsCostTable
    try:  # SGLang's struct has our field names: convert its attributes, validated by our __post_init__
        ours = msgspec.convert(sps_table, type=kind, from_attributes=True)
    except (msgspec.ValidationError, ValueError) as e:
        raise ValueError(f"the SPS table SGLang's DSpark planner loaded is not a valid {kind.__name__}: {e}; "
                         "re-profile it with `hspec profile-sps --url`") from e
    curve = SpsCurve(ours)
    _curve_cache = (sps_table, curve)
    return curve


def _announce(*, sps_table, cfg) -> None:
    global _announced
    if _announced:
        return
    _announced = True
    logger.info("HSPEC: verify budget and per-request verify lengths from sglang_hspec.scheduler.planner "
                "(budget_choice over the survivals SGLang relays with its lag, topk_lengths over this step's)")
    table_capacity = getattr(sps_table, "max_batch_tokens", None)  # floor tables only
    block_size = block_size_of(cfg)
    try:
        from sglang.srt.runtime_context import get_schedule

        capacity = int(get_schedule().max_running_requests or 0) * (block_size + 1)
    except ValueError:  # no server arguments published (not a server process)
        capacity = 0
    if table_capacity is not None and table_capacity < capacity:
        logger.warning(
            "HSPEC: the SPS table's max_batch_tokens=%d is below this server's verify capacity (%d = "
            "max running requests x %d verify tokens): the planner never plans past %d batch tokens "
            "(anchor only beyond). Profile the table for this configuration (hspec profile-sps --url).",
            table_capacity, capacity, block_size + 1, table_capacity)


def hspec_verify_token_budget(*, history_survival_probs: torch.Tensor, sps_table, cfg):
    """`compute_verify_token_budget` by our planner: the budget (draft tokens above the anchors) that
    maximises tau* x SPS over SGLang's lagged survivals [N, block_size] (host)."""
    from sglang.srt.speculative.dspark_components.dspark_planner import VerifyBudgetDecision

    _announce(sps_table=sps_table, cfg=cfg)
    survival = history_survival_probs[:, : cfg.resolved_max_verify_len()]
    choice = planner.budget_choice(survival=survival, sps=sps_curve(sps_table), min_survival=cfg.survival_eps)
    if _debug_log():
        logger.info("%s budget_choice num_reqs=%d budget=%d theta=%.6g sps=%.6g", LOG_TAG, survival.shape[0],
                    choice.budget, choice.theta, choice.steps_per_sec)
    return VerifyBudgetDecision(
        budget=choice.budget,
        predicted_step_seconds=1.0 / choice.steps_per_sec if choice.steps_per_sec > 0 else None,
        predicted_theta=choice.theta,
    )


def hspec_verify_lens(*, confidence: torch.Tensor, budget: int, cfg) -> torch.Tensor:
    """`ScheduleVerifyLensTopk.execute` by our planner: int32 [N] verify lengths (anchor included) on the
    confidences' device, the `budget` best draft tokens of this step's survivals."""
    from sglang.kernels.ops.speculative.dspark.dspark_schedule import compute_sort_survival

    max_len = cfg.resolved_max_verify_len()
    survival = compute_sort_survival(confidence)[:, :max_len]  # float32 cumprod, as SGLang sorts
    extra = planner.topk_lengths(survival=survival, budget=int(budget), min_survival=cfg.survival_eps)
    lens = (extra + cfg.min_verify_len).clamp_(min=max(cfg.min_verify_len, 1), max=max_len).to(torch.int32)
    if _debug_log():  # SGLang's [DSPARK-CPS] log reads the lengths back under the same flag
        logger.info("%s topk_lengths num_reqs=%d budget=%d verify_lens=%s", LOG_TAG, lens.shape[0], int(budget),
                    lens.tolist())
    return lens


def budget_around(original, *, history_survival_probs, sps_table, cfg):
    """AROUND `compute_verify_token_budget` (keyword-only in SGLang)."""
    if not serves_hspec():
        return original(history_survival_probs=history_survival_probs, sps_table=sps_table, cfg=cfg)
    return hspec_verify_token_budget(history_survival_probs=history_survival_probs, sps_table=sps_table, cfg=cfg)


def lengths_around(original, cls, *, confidence, budget, cfg):
    """AROUND the classmethod `ScheduleVerifyLensTopk.execute` (SGLang's one caller passes keywords)."""
    if not serves_hspec():
        return original(cls, confidence=confidence, budget=budget, cfg=cfg)
    return hspec_verify_lens(confidence=confidence, budget=budget, cfg=cfg)


def install() -> None:
    """Register both AROUND hooks (applied by `load_plugins()`); idempotent. Imports SGLang's hook
    registry only: the targets are resolved when the hooks are applied."""
    global _installed
    if _installed:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(BUDGET_TARGET, budget_around, HookType.AROUND)
    HookRegistry.register(LENGTHS_TARGET, lengths_around, HookType.AROUND)
    _installed = True


__all__ = ["BUDGET_TARGET", "LENGTHS_TARGET", "LOG_TAG", "budget_around", "hspec_verify_lens",
           "hspec_verify_token_budget", "install", "lengths_around", "serves_hspec", "sps_curve"]
