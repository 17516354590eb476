"""The planner hooks (sglang_plugin/planner_hooks.py): on HSPEC servers SGLang's DSpark planner takes its
verify budget and per-request verify lengths from sglang_hspec.scheduler.planner.

Two properties: (1) behaviour is SGLang's: on random survivals, confidences, budgets and SPS tables the hooked
functions return exactly what SGLang's own `compute_verify_token_budget` and `schedule_verify_lens_topk`
return (one documented difference: a floor table's capacity); (2) the hooked path really runs our code:
SGLang's own planner objects, with the hooks applied through HookRegistry, call the recorded
`planner.budget_choice` / `planner.topk_lengths`, and do not on a non-HSPEC server.
test_sglang_planner.py checks the same on a live server."""

from __future__ import annotations

import inspect
import logging
import random
from types import SimpleNamespace

import pytest
import torch

pytestmark = pytest.mark.sglang


@pytest.fixture(scope="module")
def sg():
    from sglang.kernels.ops.speculative.dspark import dspark_schedule
    from sglang.srt.speculative.dspark_components import dspark_planner, dspark_sps

    return SimpleNamespace(
        planner=dspark_planner, sps=dspark_sps,
        # SGLang's own functions, whether or not another test of this session applied our hooks
        budget=inspect.unwrap(dspark_planner.compute_verify_token_budget),
        lengths=dspark_schedule.schedule_verify_lens_topk,
    )


@pytest.fixture
def hooks():
    from sglang_hspec.sglang_plugin import planner_hooks

    return planner_hooks


def random_confidences(rng: random.Random, n: int, gamma: int) -> torch.Tensor:
    """Mixes what the planner meets: smooth values, exact ties (dyadic), zeros, ones, and values whose
    products fall under SGLang's survival_eps (1e-6)."""
    kind = rng.random()
    rows = []
    for _ in range(n):
        if kind < 0.3:
            row = [rng.choice([0.0, 0.25, 0.5, 0.75, 1.0]) for _ in range(gamma)]
        elif kind < 0.5:
            row = [rng.choice([1e-4, 5e-3, 0.3, 0.9]) for _ in range(gamma)]
        else:
            row = [rng.random() for _ in range(gamma)]
        rows.append(row)
    return torch.tensor(rows, dtype=torch.float32)


def random_table(rng: random.Random, sg, *, capacity: int):
    if rng.random() < 0.3:
        bs = sorted(rng.sample(range(1, 64), rng.randint(1, 4)))
        m = sorted(rng.sample(range(1, capacity + 40), rng.randint(1, 6)))
        return sg.sps.SpsAdditiveCostTable(
            bias_seconds=rng.uniform(1e-3, 2e-2), bs_probes=bs, alpha_seconds=[rng.uniform(0, 5e-3) for _ in bs],
            m_probes=m, theta_seconds=sorted(rng.uniform(0, 3e-2) for _ in m))
    probes = sorted(rng.sample(range(1, capacity + 8), rng.randint(1, 8)))
    sps = [float(rng.choice([20, 35, 50, 60, 80, 100])) if rng.random() < 0.5 else rng.uniform(10, 100)
           for _ in probes]
    # at least the verify capacity of the batch (see test_capacity_differs_from_sglang for below it)
    return sg.sps.SpsCostTable(sample_batch_tokens=probes, sample_steps_per_sec=sps,
                               max_batch_tokens=max(probes[-1], capacity) + rng.randint(0, 20))


@pytest.mark.parametrize("seed", range(60))
def test_budget_equals_sglang(seed, sg, hooks):
    rng = random.Random(seed)
    n, gamma = rng.randint(1, 48), rng.randint(1, 7)
    cfg = sg.planner.DSparkScheduleConfig(gamma=gamma)
    survival = torch.cumprod(random_confidences(rng, n, gamma), dim=1)
    survival[torch.rand(n, generator=torch.Generator().manual_seed(seed)) < 0.2] = 1.0  # unknown rows (guard)
    table = random_table(rng, sg, capacity=n * (gamma + 1))
    want = sg.budget(history_survival_probs=survival, sps_table=table, cfg=cfg)
    got = hooks.hspec_verify_token_budget(history_survival_probs=survival, sps_table=table, cfg=cfg)
    assert got.budget == want.budget, (n, gamma, table)
    assert got.predicted_theta == pytest.approx(want.predicted_theta, rel=1e-12)
    assert got.predicted_step_seconds == pytest.approx(want.predicted_step_seconds, rel=1e-12)
    if isinstance(table, sg.sps.SpsCostTable):  # same arithmetic, bit for bit
        assert (got.predicted_theta, got.predicted_step_seconds) == (want.predicted_theta,
                                                                      want.predicted_step_seconds)


def test_budget_on_sglangs_placeholder_table_verifies_everything(sg, hooks):
    # no table given: SGLang's one-probe flat curve; every candidate above survival_eps is admitted
    cfg = sg.planner.DSparkScheduleConfig(gamma=3)
    table = sg.sps.build_uninitialized_sps_table(max_batch_tokens=48 * 4)
    survival = torch.cumprod(torch.tensor([[0.9, 0.5, 1e-7], [1.0, 1.0, 1.0]]), dim=1)
    got = hooks.hspec_verify_token_budget(history_survival_probs=survival, sps_table=table, cfg=cfg)
    assert got.budget == 5 == sg.budget(history_survival_probs=survival, sps_table=table, cfg=cfg).budget


@pytest.mark.parametrize("seed", range(60))
def test_verify_lens_equal_sglang(seed, sg, hooks):
    rng = random.Random(1000 + seed)
    n, gamma = rng.randint(1, 48), rng.randint(1, 7)
    cfg = sg.planner.DSparkScheduleConfig(gamma=gamma)
    confidence = random_confidences(rng, n, gamma)
    for budget in sorted({0, 1, rng.randint(0, n * gamma), n * gamma, n * gamma + 3}):
        want = sg.lengths(confidence=confidence, budget=budget, cfg=cfg)
        got = hooks.hspec_verify_lens(confidence=confidence, budget=budget, cfg=cfg)
        assert got.dtype == want.dtype == torch.int32
        assert got.tolist() == want.tolist(), (budget, confidence)


def test_verify_lens_hand_computed(sg, hooks):
    # survivals: r0 0.5 0.25 | r1 0.5 0.5 | r2 1e-7 ... (under survival_eps: never verified)
    cfg = sg.planner.DSparkScheduleConfig(gamma=2)
    confidence = torch.tensor([[0.5, 0.5], [0.5, 1.0], [1e-7, 1.0]])
    lens = [hooks.hspec_verify_lens(confidence=confidence, budget=b, cfg=cfg).tolist() for b in range(6)]
    # order: (r0,j0)=0.5, (r1,j0)=0.5, (r1,j1)=0.5 [tie: earlier slot, then lower request], (r0,j1)=0.25
    assert lens == [[1, 1, 1], [2, 1, 1], [2, 2, 1], [2, 3, 1], [3, 3, 1], [3, 3, 1]]


def test_capacity_differs_from_sglang(sg, hooks, monkeypatch, caplog):
    # A floor table below the batch's verify capacity: ours reads 0 steps/s past max_batch_tokens and stops
    # there; SGLang's extrapolates the last probe. A WARNING says so at first use.
    from sglang.srt import runtime_context

    cfg = sg.planner.DSparkScheduleConfig(gamma=3)
    table = sg.sps.SpsCostTable(sample_batch_tokens=[1, 4], sample_steps_per_sec=[100.0, 90.0], max_batch_tokens=6)
    survival = torch.ones(2, 3)  # 2 requests, all drafts certain
    monkeypatch.setattr(runtime_context, "get_schedule", lambda: SimpleNamespace(max_running_requests=48))
    monkeypatch.setattr(hooks, "_announced", False)
    with caplog.at_level(logging.INFO, logger=hooks.__name__):
        got = hooks.hspec_verify_token_budget(history_survival_probs=survival, sps_table=table, cfg=cfg)
    assert got.budget == 4  # 2 anchors + 4 = 6 = max_batch_tokens
    assert sg.budget(history_survival_probs=survival, sps_table=table, cfg=cfg).budget == 6
    assert "verify budget and per-request verify lengths from sglang_hspec.scheduler.planner" in caplog.text
    assert "max_batch_tokens=6 is below this server's verify capacity (192" in caplog.text


def test_sglang_tables_convert_once_both_layouts(sg, hooks):
    from sglang_hspec.scheduler.sps import SpsAdditiveCostTable, SpsCostTable

    floor = sg.sps.SpsCostTable(sample_batch_tokens=[1, 9], sample_steps_per_sec=[50.0, 5.0], max_batch_tokens=40)
    additive = sg.sps.SpsAdditiveCostTable(bias_seconds=0.01, bs_probes=[1], alpha_seconds=[0.0], m_probes=[1, 64],
                                           theta_seconds=[0.0, 0.02])
    curve = hooks.sps_curve(floor)
    assert hooks.sps_curve(floor) is curve  # cached per table object
    assert curve.table == SpsCostTable(sample_batch_tokens=[1, 9], sample_steps_per_sec=[50.0, 5.0],
                                       max_batch_tokens=40)
    assert isinstance(hooks.sps_curve(additive).table, SpsAdditiveCostTable)
    # SGLang accepts tables that our loader refuses (the launcher checks given files with ours first)
    with pytest.raises(ValueError, match="sample_steps_per_sec must be > 0"):
        hooks.sps_curve(sg.sps.SpsCostTable(sample_batch_tokens=[1, 2], sample_steps_per_sec=[1.0, 0.0],
                                            max_batch_tokens=2))


def test_serves_hspec_reads_the_published_server_args(hooks, monkeypatch):
    from sglang.srt import runtime_context

    assert hooks.serves_hspec() is False  # this test process published no server arguments
    for algorithm, want in (("HSPEC", True), ("hspec", True), ("DSPARK", False), (None, False)):
        monkeypatch.setattr(runtime_context, "get_spec", lambda a=algorithm: SimpleNamespace(speculative_algorithm=a))
        assert hooks.serves_hspec() is want, algorithm


class FakeRunner:
    """What HostConfidenceBudgetPlanner reads from the model runner: the request pool's row count."""

    def __init__(self, rows: int):
        self.req_to_token_pool = SimpleNamespace(req_to_token=torch.zeros(rows, 1))


@pytest.fixture
def applied(hooks, monkeypatch):
    """Our hooks applied to SGLang through HookRegistry (as load_plugins() does), our two planner functions
    wrapped to record their calls, and a switch for "this process serves HSPEC"."""
    from sglang.srt.plugins.hook_registry import HookRegistry
    from sglang_hspec.scheduler import planner

    hooks.install()
    HookRegistry.apply_hooks()  # targets patched earlier in this session are skipped
    calls = {"budget_choice": [], "topk_lengths": []}
    for name in calls:
        real = getattr(planner, name)

        def record(*args, _real=real, _name=name, **kwargs):
            out = _real(*args, **kwargs)
            calls[_name].append(out)
            return out

        monkeypatch.setattr(planner, name, record)
    state = SimpleNamespace(hspec=True, calls=calls)
    monkeypatch.setattr(hooks, "serves_hspec", lambda: state.hspec)
    return state


def test_sglang_planner_objects_run_our_planner(sg, applied):
    from sglang.kernels.ops.speculative.dspark.dspark_schedule import ScheduleVerifyLensTopk

    gamma, rows = 3, 16
    cfg = sg.planner.DSparkScheduleConfig(gamma=gamma)
    table = sg.sps.SpsCostTable(sample_batch_tokens=[1, 10], sample_steps_per_sec=[100.0, 1.0], max_batch_tokens=192)
    hooked = sg.planner.compute_verify_token_budget
    assert hooked is not sg.budget and inspect.unwrap(hooked) is sg.budget  # hooked, SGLang's underneath

    def run_steps(hspec: bool) -> list[tuple[int, list[int]]]:
        applied.hspec = hspec
        # SGLang's own budget planner: lag ring (relay lag 0 -> it carries 2 steps itself), generation guard
        budget_planner = sg.planner.HostConfidenceBudgetPlanner(sps_table=table, cfg=cfg,
                                                                 model_runner=FakeRunner(rows), relay_lag_steps=0)
        gen = random.Random(11)
        out = []
        for step in range(8):
            n = gen.randint(1, 6)
            slots = torch.tensor(gen.sample(range(rows), n), dtype=torch.int64)
            generation = torch.tensor([1 + (step > 4 and i == 0) for i in range(n)], dtype=torch.int64)
            confidence = torch.tensor([[gen.random() for _ in range(gamma)] for _ in range(n)])
            budget = budget_planner.compute_budget(confidence=confidence, generation=generation,
                                                   current_generation=generation, req_pool_indices_cpu=slots)
            lens = ScheduleVerifyLensTopk.execute(confidence=confidence, budget=budget, cfg=cfg)
            out.append((budget, lens.tolist()))
        return out

    ours = run_steps(True)
    assert len(applied.calls["budget_choice"]) == 8 and len(applied.calls["topk_lengths"]) == 8
    assert [c.budget for c in applied.calls["budget_choice"]] == [b for b, _ in ours]
    assert [(t + 1).tolist() for t in applied.calls["topk_lengths"]] == [lens for _, lens in ours]
    for calls in applied.calls.values():
        calls.clear()
    sglangs = run_steps(False)  # a DSPARK (or any non-HSPEC) server: SGLang's own functions, ours untouched
    assert applied.calls == {"budget_choice": [], "topk_lengths": []}
    assert ours == sglangs
    assert any(b < 3 * len(lens) for b, lens in ours) and any(len(set(lens)) > 1 for _, lens in ours)


def test_decisions_are_logged_under_sglangs_debug_flag(sg, hooks, monkeypatch, caplog):
    cfg = sg.planner.DSparkScheduleConfig(gamma=2)
    table = sg.sps.SpsCostTable(sample_batch_tokens=[1, 4], sample_steps_per_sec=[100.0, 1.0], max_batch_tokens=12)
    monkeypatch.setenv("SGLANG_DSPARK_DEBUG_CONFIDENCE_PREFIX_SCHEDULER", "1")
    with caplog.at_level(logging.INFO, logger=hooks.__name__):
        hooks.hspec_verify_token_budget(history_survival_probs=torch.ones(2, 2), sps_table=table, cfg=cfg)
        hooks.hspec_verify_lens(confidence=torch.tensor([[0.9, 0.9], [0.5, 0.5]]), budget=1, cfg=cfg)
    assert "[HSPEC-PLANNER] budget_choice num_reqs=2 budget=1 " in caplog.text
    assert "[HSPEC-PLANNER] topk_lengths num_reqs=2 budget=1 verify_lens=[2, 1]" in caplog.text
