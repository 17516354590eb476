"""The SGLang side of "never slower than plain decoding": the HSPEC_SPECULATION policy, its launch checks,
the plain-decode probes of the auto-profile and the step timer (no server here; the served behaviour is in
test_sglang_speculation_switch.py). The pieces that subclass SGLang's planner need SGLang (marked)."""

from __future__ import annotations

import json

import pytest
import torch
from sglang_hspec.scheduler.sps import SpsCostTable

from sglang_hspec.sglang_plugin import sps_cache, step_timer
from sglang_hspec.sglang_plugin.speculation_policy import speculation_policy
from sglang_hspec.sglang_plugin.sps_profile import greedy_table_path, with_plain_probes


# ---- HSPEC_SPECULATION ----
@pytest.mark.parametrize("raw, policy", [(None, "always"), ("", "always"), ("auto", "auto"), (" Never ", "never")])
def test_policy_values(raw, policy):
    assert speculation_policy({} if raw is None else {"HSPEC_SPECULATION": raw}) == policy


def test_policy_typo_names_variable_and_choices():
    with pytest.raises(ValueError, match=r"HSPEC_SPECULATION='sometimes'.*always, auto, never"):
        speculation_policy({"HSPEC_SPECULATION": "sometimes"})


def test_auto_needs_compact_mode():
    with pytest.raises(ValueError, match="SGLANG_RAGGED_VERIFY_MODE=compact"):
        sps_cache.check_speculation_policy(policy="auto", mode="static", has_table=True, auto_profile=False)


def test_auto_needs_a_table_or_the_auto_profile():
    with pytest.raises(ValueError, match="HSPEC_AUTO_PROFILE_SPS=1"):
        sps_cache.check_speculation_policy(policy="auto", mode="compact", has_table=False, auto_profile=False)
    sps_cache.check_speculation_policy(policy="auto", mode="compact", has_table=False, auto_profile=True)
    sps_cache.check_speculation_policy(policy="always", mode="static", has_table=False, auto_profile=False)


class _Args:
    speculative_dspark_sps_table_path = None


def test_launch_refuses_a_given_table_without_plain_probes(tmp_path):
    from sglang_hspec.scheduler.sps import save_sps_table

    path = tmp_path / "sps.json"
    save_sps_table(SpsCostTable(sample_batch_tokens=[8, 16], sample_steps_per_sec=[5.0, 4.0], max_batch_tokens=64),
                   path)
    args = _Args()
    args.speculative_dspark_sps_table_path = str(path)
    env = {"HSPEC_SPECULATION": "auto", "SGLANG_RAGGED_VERIFY_MODE": "compact"}
    with pytest.raises(ValueError, match=r"no plain-decode probes.*HSPEC_AUTO_PROFILE_SPS=1"):
        sps_cache.resolve_sps_table(args, block_size=7, environ=env)
    assert sps_cache.resolve_sps_table(args, block_size=7, environ={**env, "HSPEC_SPECULATION": "always"}) == path


def test_cached_table_without_plain_probes_is_reprofiled_with_them(tmp_path, monkeypatch):
    from sglang_hspec.scheduler.sps import load_sps_table, save_sps_table

    monkeypatch.setenv("HSPEC_CACHE_DIR", str(tmp_path))

    class Args(_Args):
        device, model_path, speculative_draft_model_path, tp_size, dtype = "cpu", "/m", "/d", 1, "float32"

    args = Args()
    cached = sps_cache.table_path_for(sps_cache.SpsCacheKey.from_server_args(args))
    old = SpsCostTable(sample_batch_tokens=[8], sample_steps_per_sec=[5.0], max_batch_tokens=64)
    save_sps_table(old, cached)
    calls = []

    def fake_profile(*, out, settings, plain_probes, greedy_probes):
        calls.append((plain_probes, greedy_probes))
        probes = dict(sample_batch_tokens=[8, 16], max_batch_tokens=64, plain_batch_sizes=[1, 2],
                      plain_steps_per_sec=[12.0, 10.0])
        save_sps_table(SpsCostTable(sample_steps_per_sec=[6.0, 5.0], **probes), greedy_table_path(out))
        save_sps_table(SpsCostTable(sample_steps_per_sec=[5.0, 4.0], **probes), out)

    monkeypatch.setattr(sps_cache.sps_profile, "profile_with_server", fake_profile)
    env = {"HSPEC_SPECULATION": "auto", "SGLANG_RAGGED_VERIFY_MODE": "compact", "HSPEC_AUTO_PROFILE_SPS": "1"}
    assert sps_cache.resolve_sps_table(args, block_size=7, environ=env) == cached
    assert calls == [(True, True)]
    assert load_sps_table(cached).plain_steps_per_sec == [12.0, 10.0]
    assert load_sps_table(cached.with_name(cached.stem + ".greedy.json")).sample_steps_per_sec == [6.0, 5.0]
    # the next start reuses both
    assert sps_cache.resolve_sps_table(Args(), block_size=7, environ=env) == cached and calls == [(True, True)]
    # a table cached before the greedy twin existed (plain probes, no twin) is profiled again
    greedy_table_path(cached).unlink()
    assert sps_cache.resolve_sps_table(Args(), block_size=7, environ=env) == cached
    assert calls == [(True, True)] * 2 and greedy_table_path(cached).is_file()
    # without auto (the planner alone) the twin is not needed
    greedy_table_path(cached).unlink()
    assert sps_cache.resolve_sps_table(Args(), block_size=7, environ={**env, "HSPEC_SPECULATION": "always"}) == cached
    assert len(calls) == 2


# ---- plain-decode probes ----
def test_with_plain_probes_maps_batch_tokens_to_request_counts():
    spec = SpsCostTable(sample_batch_tokens=[8, 16, 32], sample_steps_per_sec=[5.0, 4.0, 3.0], max_batch_tokens=384)
    plain = SpsCostTable(sample_batch_tokens=[8, 16, 32], sample_steps_per_sec=[12.5, 11.0, 9.0], max_batch_tokens=384)
    out = with_plain_probes(spec, plain, verify_tokens=8)
    assert out.sample_batch_tokens == [8, 16, 32] and out.sample_steps_per_sec == [5.0, 4.0, 3.0]
    assert out.plain_batch_sizes == [1, 2, 4] and out.plain_steps_per_sec == [12.5, 11.0, 9.0]
    assert out.draft_seconds == []  # SGLang's step times already include the draft forward
    assert out.plain_lookup(3) == 11.0


def test_with_plain_probes_of_an_anchor_only_profile_are_per_request():
    # the launcher profiles the never-drafting server with anchor_only: N requests filed under N tokens
    spec = SpsCostTable(sample_batch_tokens=[8, 16], sample_steps_per_sec=[5.0, 4.0], max_batch_tokens=384)
    plain = SpsCostTable(sample_batch_tokens=[1, 2, 4], sample_steps_per_sec=[12.5, 11.0, 9.0], max_batch_tokens=384)
    out = with_plain_probes(spec, plain)
    assert out.plain_batch_sizes == [1, 2, 4] and out.plain_steps_per_sec == [12.5, 11.0, 9.0]


def test_with_plain_probes_refuses_other_verify_widths():
    spec = SpsCostTable(sample_batch_tokens=[8], sample_steps_per_sec=[5.0], max_batch_tokens=64)
    plain = SpsCostTable(sample_batch_tokens=[6], sample_steps_per_sec=[9.0], max_batch_tokens=64)
    with pytest.raises(ValueError, match="not multiples of 8 verify tokens"):
        with_plain_probes(spec, plain, verify_tokens=8)


# ---- HSPEC_STEP_PROFILE ----
class _Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_step_timer_segments_loop_and_kinds(tmp_path, monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(step_timer.time, "perf_counter", clock)
    timer = step_timer.StepTimer(tmp_path / "steps.json")
    timer.begin_step(kind="draft")
    with timer.segment("draft"):
        clock.now += 0.030
    clock.now += 0.050
    timer.end_step()  # step 0.080, no loop before the first step
    clock.now += 0.010  # scheduler loop
    timer.add("prepare", 0.002)  # the stale-budget preparation inside the loop
    timer.begin_step(kind="plain")
    clock.now += 0.040
    timer.end_step()
    snap = json.loads((tmp_path / "steps.json").read_text())
    assert snap["steps"] == {"draft": 1, "plain": 1}
    draft, plain = snap["seconds"]["draft"], snap["seconds"]["plain"]
    assert draft["step"] == pytest.approx(0.080) and draft["draft"] == pytest.approx(0.030) and draft["loop"] == 0
    assert plain["step"] == pytest.approx(0.040) and plain["loop"] == pytest.approx(0.010)
    assert plain["loop.prepare"] == pytest.approx(0.002)
    # a prefill in between: the next gap is not a decode loop
    timer.note_non_decode_step()
    clock.now += 5.0
    timer.begin_step(kind="plain")
    timer.end_step()
    later = json.loads((tmp_path / "steps.json").read_text())
    delta = step_timer.snapshot_delta(later, snap)
    assert delta["steps"] == {"draft": 0, "plain": 1}
    assert delta["seconds"]["plain"]["loop"] == pytest.approx(0.0)


def test_step_timer_rejects_unknown_kind(tmp_path):
    with pytest.raises(ValueError, match="step kind"):
        step_timer.StepTimer(tmp_path / "x.json").begin_step(kind="spec")


# ---- SGLang's planner with the recording subclass (needs SGLang) ----
@pytest.mark.sglang
@pytest.mark.parametrize("relay_lag_steps", [2, 0])  # overlap scheduling (the relay's lag of 2), and without it
def test_recording_budget_planner_keeps_the_confidences_it_is_handed_and_the_same_budget(relay_lag_steps):
    from sglang.srt.speculative.dspark_components import dspark_planner as dp

    from sglang_hspec.sglang_plugin.speculation_switch import RecordingBudgetPlanner, StaleConfidences

    class Runner:  # what the planner reads of the model runner: the request pool size
        class req_to_token_pool:
            req_to_token = torch.zeros(8, 4)

    table = dp.SpsCostTable(sample_batch_tokens=[1, 4, 8], sample_steps_per_sec=[10.0, 9.0, 4.0],
                            max_batch_tokens=32)
    cfg = dp.DSparkScheduleConfig(gamma=3)
    kwargs = dict(sps_table=table, cfg=cfg, model_runner=Runner(), relay_lag_steps=relay_lag_steps)
    theirs, ours = dp.HostConfidenceBudgetPlanner(**kwargs), dp.HostConfidenceBudgetPlanner(**kwargs)
    ours.__class__ = RecordingBudgetPlanner
    ours.stale_confidences = StaleConfidences(req_pool_size=8, block_size=3, strength=0.0)
    gen = torch.manual_seed(0)
    rows = torch.tensor([5, 2, 7])
    handed = []
    for step in range(4):
        conf = torch.rand(3, 3, generator=gen)
        generation = torch.tensor([1, 1, 0 if step < 2 else 2])  # slot 7: never admitted, then a new request
        current = torch.tensor([1, 1, 2])
        args = dict(confidence=conf, generation=generation, current_generation=current, req_pool_indices_cpu=rows)
        assert ours.compute_budget(**args) == theirs.compute_budget(**args)
        stored, known = ours.stale_confidences.read(rows=rows, generation=current)
        assert torch.equal(known, torch.tensor([True, True, step >= 2]))
        # what it was handed (the relay's, already two steps old, under overlap; without it this drafting
        # step's, where SGLang's planner itself reads them two planner calls late, its carry ring), kept as the
        # request's mean survival (strength 0: no shrinking toward the prior), read back as conditionals
        handed.append(conf[:2].double())
        mean = torch.stack([torch.cumprod(c, dim=1) for c in handed]).mean(dim=0)
        want = mean / torch.cat([torch.ones(2, 1, dtype=torch.float64), mean[:, :-1]], dim=1)
        assert torch.allclose(stored[:2].double(), want, rtol=1e-6, atol=0)
        if step == 0:
            assert torch.equal(stored[:2], conf[:2].to(torch.float32))
    assert ours.carry_steps == (0 if relay_lag_steps == 2 else 2)


@pytest.mark.sglang
def test_stale_confidences_keep_each_request_mean_survival_shrunk_toward_all_requests():
    from sglang_hspec.sglang_plugin.speculation_switch import StaleConfidences

    stale = StaleConfidences(req_pool_size=4, block_size=2, strength=2.0)
    one = torch.tensor([1, 1])
    # survivals [0.5, 0.25] and [1, 0]: the running mean [0.75, 0.125]; row 0 = (2 x mean + own) / 3 = [2, 0.5] / 3
    stale.write(rows=torch.tensor([0, 1]), confidence=torch.tensor([[0.5, 0.5], [1.0, 0.0]]), generation=one,
                known=torch.tensor([True, True]))
    conf, known = stale.read(rows=torch.tensor([0, 1]), generation=one)
    assert known.tolist() == [True, True]
    assert conf.flatten().tolist() == pytest.approx([2 / 3, 0.25, 2.5 / 3, 0.1], rel=1e-6)
    # a snapshot that keeps nothing does not zero the request: mean 0.9 [0.75, 0.125] = [0.675, 0.1125], and
    # row 0 = (2 x [0.675, 0.1125] + [0.5, 0.25] + [0, 0]) / 4 = [1.85, 0.475] / 4
    stale.write(rows=torch.tensor([0]), confidence=torch.tensor([[0.0, 0.9]]), generation=torch.tensor([1]),
                known=torch.tensor([True]))
    conf, _ = stale.read(rows=torch.tensor([0]), generation=torch.tensor([1]))
    assert conf.flatten().tolist() == pytest.approx([1.85 / 4, 0.475 / 1.85], rel=1e-6)
    # a request not yet admitted (known False) is nobody's: unknown, and the slot starts afresh
    stale.write(rows=torch.tensor([1]), confidence=torch.tensor([[0.9, 0.9]]), generation=torch.tensor([2]),
                known=torch.tensor([False]))
    assert stale.read(rows=torch.tensor([1]), generation=torch.tensor([2]))[1].tolist() == [False]
    with pytest.raises(ValueError, match="strength"):
        StaleConfidences(req_pool_size=1, block_size=1, strength=-1.0)


@pytest.mark.sglang
def test_anchor_only_planner_layout_verifies_one_token_per_request():
    from sglang_hspec.sglang_plugin.speculation_switch import AnchorOnlyPlanner

    class Runner:
        decode_cuda_graph_runner = None

    class Planner:
        verify_num_draft_tokens = 8
        mode_value = "compact"

    planner = AnchorOnlyPlanner(Planner(), model_runner=Runner())
    layout = planner.schedule_layout(req_pool_indices=torch.arange(5), device=torch.device("cpu"), confidence=None,
                                     budget=3)
    assert layout.verify_lens.tolist() == [1] * 5 and layout.total_verify_tokens == 5
    assert planner.should_run_compact(layout=layout) and planner.resolve_verify_token_budget(confidence=None) is None
    assert planner.schedule_layout(req_pool_indices=torch.arange(5), device=torch.device("cpu")) is layout  # cached
    assert planner.mode_value == "compact"  # everything else is the wrapped planner's


# ---- the worker's switch and its realized-rate guard (needs SGLang) ----
@pytest.mark.parametrize("raw, on", [(None, True), ("1", True), (" 0 ", False)])
def test_guard_env_values(raw, on):
    from sglang_hspec.sglang_plugin.speculation_policy import speculation_guard

    assert speculation_guard({} if raw is None else {"HSPEC_SPECULATION_GUARD": raw}) is on


def test_guard_env_typo_names_variable():
    from sglang_hspec.sglang_plugin.speculation_policy import speculation_guard

    with pytest.raises(ValueError, match=r"HSPEC_SPECULATION_GUARD='yes': use 1 \(correct the auto switch"):
        speculation_guard({"HSPEC_SPECULATION_GUARD": "yes"})


@pytest.mark.sglang
def test_switch_drafts_a_new_request_served_alone_on_earlier_requests_mean():
    from sglang_hspec.sglang_plugin.speculation_switch import SpeculationSwitch

    # requests one at a time (C = 1): a request the switch has no snapshot of rests on the running mean of earlier
    # ones. 0.9 at every slot: 1 + 0.9 + ... + 0.9^7 = 5.7 tokens at 0.01 + 1 / 6.5 s, 34.8 tok/s against 10 plain.
    # Without that prior it decoded plainly until its probe (the first step, then 4, 8, ... steps after a draft)
    kw = dict(policy="auto", costs=_switch_costs(), block_size=7, req_pool_size=4, min_survival=0.0, guard=False)
    cold = SpeculationSwitch(**kw)
    assert cold.should_draft(rows=torch.tensor([0]), generation=torch.tensor([1])) and cold.last_decision.probe
    switch = SpeculationSwitch(**kw)
    switch.steps_since_draft = 0  # a request just served, drafting
    switch.stale.write(rows=torch.tensor([0]), confidence=torch.full((1, 7), 0.9), generation=torch.tensor([1]),
                       known=torch.tensor([True]))
    assert switch.should_draft(rows=torch.tensor([1]), generation=torch.tensor([1]))  # a new request, slot 1
    d = switch.last_decision
    assert not d.probe and d.best_budget == 7
    assert d.spec_tokens_per_sec == pytest.approx(sum(0.9 ** j for j in range(8)) / (0.01 + 1 / 6.5), rel=1e-6)
    unknown = SpeculationSwitch(**kw)  # nothing written yet, not due to probe: plain
    unknown.steps_since_draft = 0
    assert not unknown.should_draft(rows=torch.tensor([1]), generation=torch.tensor([1]))


def _drive_switch(switch, *, steps, clock, spec_seconds=None, committed=4):
    """One request (slot 0, generation 1) whose stale confidences are 0.9 at every slot; a drafting step
    commits `committed` tokens and takes `spec_seconds` (default: those tokens at the predicted rate), a plain
    step one token at the predicted rate, a probe 1 s."""
    rows, generation = torch.tensor([0]), torch.tensor([1])
    switch.stale.write(rows=rows, confidence=torch.full((1, 7), 0.9), generation=generation,
                       known=torch.tensor([True]))
    trace = []
    for _ in range(steps):
        draft = switch.should_draft(rows=rows, generation=generation)
        decision = switch.last_decision
        if draft:
            switch.note_committed(torch.tensor([committed], dtype=torch.int32))
        if decision.probe:
            clock.now += 1.0
        elif draft:
            clock.now += spec_seconds if spec_seconds is not None else committed / decision.spec_tokens_per_sec
        else:
            clock.now += 1 / decision.plain_tokens_per_sec
        trace.append("P" if decision.probe else "S" if draft else ".")
    return "".join(trace)


def _switch_costs():
    from sglang_hspec.scheduler.switch import StepCosts

    table = SpsCostTable(sample_batch_tokens=list(range(1, 9)), sample_steps_per_sec=[10, 9.5, 9, 8.5, 8, 7.5, 7, 6.5],
                         max_batch_tokens=8, plain_batch_sizes=[1], plain_steps_per_sec=[10.0], draft_seconds=[0.01])
    return StepCosts(table)


@pytest.mark.sglang
def test_switch_guard_keeps_decisions_where_the_server_realizes_the_predicted_rates():
    from sglang_hspec.sglang_plugin.speculation_switch import SpeculationSwitch

    clock = _Clock()
    kw = dict(policy="auto", costs=_switch_costs(), block_size=7, req_pool_size=4, min_survival=0.0)
    blind = SpeculationSwitch(**kw, guard=False)
    assert blind.guard is None and _drive_switch(blind, steps=40, clock=clock) == "S" * 40
    guarded = SpeculationSwitch(**kw, clock=clock)
    assert _drive_switch(guarded, steps=40, clock=clock) == "S" * 40
    assert guarded.guard.scale("spec") == pytest.approx(1.0)


@pytest.mark.sglang
def test_switch_guard_turns_off_speculation_that_loses_in_wall_time():
    from sglang_hspec.sglang_plugin.speculation_switch import SpeculationSwitch

    # predicted: 1 + 0.9 + ... + 0.9^7 = 5.7 tokens in 0.01 + 1 / 6.5 s, 34.76 tok/s against 10 plain; on this
    # server a drafting step takes 0.5 s for 4 tokens: 8 tok/s, slower than plain decoding
    clock = _Clock()
    switch = SpeculationSwitch(policy="auto", costs=_switch_costs(), block_size=7, req_pool_size=4, min_survival=0.0,
                               clock=clock)
    trace = _drive_switch(switch, steps=120, clock=clock, spec_seconds=0.5)
    # each drafting step: 4 committed, 0.5 s x 34.76 = 17.4 predicted, bounded to 4 x 4 = 16. After s of them
    # (all folded by the next decision: their counts are host tensors) the decayed count is m = 0.97 m + 1, and
    # the switch drafts while (4m + P) / (16m + P) x 34.76 > 1.05 x 10, P the guard's prior (4: 4 steps; 16: 17)
    from sglang_hspec.scheduler.switch import GUARD_PRIOR

    m, expected = 0.0, 0
    rate = sum(0.9 ** j for j in range(8)) / (0.01 + 1 / 6.5)
    while (4 * m + GUARD_PRIOR) / (16 * m + GUARD_PRIOR) * rate > 1.05 * 10:
        m, expected = 0.97 * m + 1, expected + 1
    assert expected == {4.0: 4, 16.0: 17}[GUARD_PRIOR]
    assert trace.index(".") == expected and set(trace[:expected]) == {"S"}
    assert set(trace[expected:]) == {".", "P"} and switch.counts["plain"] > 90  # then plain, probing now and then
    assert switch.guard.scale("spec") < 10.5 / rate and switch.guard.scale("plain") == pytest.approx(1.0)
    switch.interrupt()  # a prefill: the open step is dropped, nothing folded
    assert switch.guard.scale("plain") == pytest.approx(1.0)


def _flat_costs(spec_steps_per_sec: float):
    """One request: a verify of 1-8 tokens at `spec_steps_per_sec` whatever its width, plain decoding at
    10 steps/s, a drafter that costs nothing beyond the verify step."""
    from sglang_hspec.scheduler.switch import StepCosts

    table = SpsCostTable(sample_batch_tokens=list(range(1, 9)), sample_steps_per_sec=[spec_steps_per_sec] * 8,
                         max_batch_tokens=8, plain_batch_sizes=[1], plain_steps_per_sec=[10.0], draft_seconds=[0.0])
    return StepCosts(table)


@pytest.mark.sglang
def test_switch_costs_all_greedy_steps_by_the_greedy_table():
    from sglang_hspec.sglang_plugin.speculation_switch import SpeculationSwitch

    # confidences 0.6 at every slot: tau(7) = 1 + 0.6 + ... + 0.6^7 = 2.4580 tokens per step. Sampled drafting
    # steps at 4 steps/s: 9.83 tok/s, under 1.05 x 10 plain; greedy (argmax) steps at 6 steps/s: 14.75 tok/s
    tau = sum(0.6 ** j for j in range(8))
    rows, generation = torch.tensor([0]), torch.tensor([1])

    def switch(greedy_costs):
        sw = SpeculationSwitch(policy="auto", costs=_flat_costs(4.0), greedy_costs=greedy_costs, block_size=7,
                               req_pool_size=4, min_survival=0.0, guard=False)
        sw.stale.write(rows=rows, confidence=torch.full((1, 7), 0.6), generation=generation, known=torch.tensor([True]))
        sw.steps_since_draft = 0  # no probe due: each decision is the rates' alone
        return sw

    both = switch(_flat_costs(6.0))
    assert both.should_draft(rows=rows, generation=generation, greedy=True)
    assert both.last_decision.spec_tokens_per_sec == pytest.approx(6.0 * tau)
    assert not both.should_draft(rows=rows, generation=generation, greedy=False)
    assert both.last_decision.spec_tokens_per_sec == pytest.approx(4.0 * tau)
    assert not both.last_decision.probe
    # without a greedy table an all-greedy step is costed as a sampled one
    sampled_only = switch(None)
    assert not sampled_only.should_draft(rows=rows, generation=generation, greedy=True)
    assert sampled_only.last_decision.spec_tokens_per_sec == pytest.approx(4.0 * tau)
