"""The speculate-or-decode switch (scheduler/switch.py) and AutoPolicy: hand-computed cases, the audit,
the probe schedule and the lag (the compiled twins of AutoPolicy's hot path: tests/scheduler/test_fused.py)."""

import random

import pytest
import torch
from sglang_hspec.scheduler import planner, switch
from sglang_hspec.scheduler.policy import AutoPolicy
from sglang_hspec.scheduler.sps import SpsCostTable, load_sps_table, save_sps_table, sps_table_from_json


def cost_table(verify, plain=None, draft=None, *, max_batch_tokens=None) -> SpsCostTable:
    """Verify probes at 1, 2, 3, ... batch tokens; plain / draft probes at 1, 2, 3, ... requests."""
    probes = list(range(1, len(verify) + 1))
    extra = {}
    if plain is not None:
        extra = dict(plain_batch_sizes=list(range(1, len(plain) + 1)), plain_steps_per_sec=plain,
                     draft_seconds=draft or [])
    return SpsCostTable(sample_batch_tokens=probes, sample_steps_per_sec=verify,
                        max_batch_tokens=max_batch_tokens or probes[-1], **extra)


def decide(survival, costs: switch.StepCosts, **kw):
    t = torch.tensor(survival, dtype=torch.float64).reshape(len(survival), len(survival[0]) if survival else 0)
    return switch.decide_speculation(survival=t, costs=costs, **kw)


KNOWN = dict(known_rows=1, steps_since_draft=0, probe_interval=16)


def test_one_request_hand_computed():
    # plain: 1 x 10 = 10 tok/s. draft 0.02 s; verify 1/10, 1/8, 1/5 s at 1, 2, 3 tokens.
    # spec(0) = 1/0.12 = 8.33, spec(1) = 1.9/0.145 = 13.10, spec(2) = 2.71/0.22 = 12.32 -> n* = 1
    costs = switch.StepCosts(cost_table([10, 8, 5], plain=[10], draft=[0.02]))
    d = decide([[0.9, 0.9]], costs, **KNOWN)
    assert (d.speculate, d.budget, d.probe, d.draft_rows, d.best_budget) == (True, 1, False, 1, 1)
    assert d.spec_tokens_per_sec == pytest.approx(1.9 / 0.145)
    assert d.plain_tokens_per_sec == 10.0


def test_guard_scales_hand_computed():
    # the costs above: spec(1) = 1.9 / 0.145 = 13.103 tok/s against plain 10 x (1 + 0.05) = 10.5.
    # spec_scale 0.80: 10.483 < 10.5 -> plain; 0.81: 10.614 > 10.5 -> speculate.
    # plain_scale 1.25: 1.05 x 12.5 = 13.125 > 13.103 -> plain; 1.24: 13.02 < 13.103 -> speculate.
    costs = switch.StepCosts(cost_table([10, 8, 5], plain=[10], draft=[0.02]))
    for spec_scale, plain_scale, speculate in ((0.80, 1.0, False), (0.81, 1.0, True), (1.0, 1.25, False),
                                               (1.0, 1.24, True)):
        d = decide([[0.9, 0.9]], costs, spec_scale=spec_scale, plain_scale=plain_scale, **KNOWN)
        assert d.speculate is speculate and d.best_budget == 1
        assert d.spec_tokens_per_sec == pytest.approx(spec_scale * 1.9 / 0.145)
        assert d.plain_tokens_per_sec == pytest.approx(plain_scale * 10.0)
    with pytest.raises(ValueError, match="spec_scale > 0"):
        decide([[0.9, 0.9]], costs, spec_scale=0.0, **KNOWN)


def test_poor_drafts_decode_plainly():
    # survival 0.3: spec(1) = 1.3/0.145 = 8.97 < 10, spec(2) = 1.39/0.22 = 6.3 -> plain
    costs = switch.StepCosts(cost_table([10, 8, 5], plain=[10], draft=[0.02]))
    d = decide([[0.3, 0.3]], costs, **KNOWN)
    assert (d.speculate, d.budget, d.probe, d.draft_rows, d.best_budget) == (False, 0, False, 0, 1)


def test_draft_cost_decides():
    # the same drafts pay with a free drafter (1.3 / 0.125 = 10.4 > 10.5? no: margin 0 here) ...
    costs_free = switch.StepCosts(cost_table([10, 8, 5], plain=[10], draft=[0.0]))
    assert decide([[0.3, 0.3]], costs_free, margin=0.0, **KNOWN).speculate
    # ... and the margin demands 5 % more: 10.4 < 10.5
    assert not decide([[0.3, 0.3]], costs_free, margin=0.05, **KNOWN).speculate
    # the override replaces the table's drafter column
    assert decide([[0.3, 0.3]], switch.StepCosts(cost_table([10, 8, 5], plain=[10], draft=[0.02]),
                                               draft_seconds=0.0), margin=0.0, **KNOWN).speculate


def test_plain_falls_back_to_anchor_only_verify_without_plain_probes():
    costs = switch.StepCosts(cost_table([10, 8, 5]))
    assert costs.plain_steps_per_sec(1) == 10 and costs.draft_seconds(1) == 0.0
    assert costs.plain_steps_per_sec(4) == 0.0  # past capacity


def test_probe_when_due_and_only_then():
    costs = switch.StepCosts(cost_table([10, 8, 5, 4, 3, 2, 1, 1, 1, 1], plain=[10, 9, 8, 7, 6], draft=[0.02] * 5))
    poor = [[0.1, 0.01]] * 5
    assert not decide(poor, costs, known_rows=5, steps_since_draft=15, probe_interval=16).speculate
    d = decide(poor, costs, known_rows=5, steps_since_draft=16, probe_interval=16, probe_rows=2)
    # a probe drafts 2 rows and verifies at least as many drafts as rows
    assert (d.speculate, d.probe, d.draft_rows, d.budget) == (True, True, 2, 2)
    # nothing known: decode plainly, probe when due (the first step: steps_since_draft is huge)
    d = decide(poor, costs, known_rows=0, steps_since_draft=3, probe_interval=16)
    assert (d.speculate, d.best_budget) == (False, 0)
    assert decide(poor, costs, known_rows=0, steps_since_draft=2**40, probe_interval=16).probe


def test_capacity_and_empty_batch():
    costs = switch.StepCosts(cost_table([10, 9], plain=[10, 9], draft=[0.0, 0.0]))
    # 2 requests: B = 2 + n, capacity 2 -> no draft fits (spec(n > 0) = 0)
    d = decide([[1.0], [1.0]], costs, **KNOWN)
    assert (d.speculate, d.best_budget) == (False, 0)
    assert decide([], costs, **KNOWN) == switch.SpeculationDecision(False, 0, False, 0, 0, 0.0, 0.0)


def test_min_survival_and_nan_never_counted():
    costs = switch.StepCosts(cost_table([10, 9.9, 9.8, 9.7], plain=[10], draft=[0.0]))
    d = decide([[0.5, float("nan"), 1e-9]], costs, min_survival=1e-6, margin=0.0, **KNOWN)
    assert d.best_budget == 1


def test_a_step_over_n_requests_costs_at_least_the_table_at_n_requests():
    # SGLang's auto-profile of the embedded target (AMD EPYC, float32, 2026-12-02): whole drafting steps of
    # 1, 2, 4, 8, 16 requests x 8 tokens, and plain steps of as many requests; no drafter column
    table = SpsCostTable(sample_batch_tokens=[8, 16, 32, 64, 128], sample_steps_per_sec=[9.37, 7.80, 5.72, 3.70, 2.10],
                         max_batch_tokens=384, plain_batch_sizes=[1, 2, 4, 8, 16],
                         plain_steps_per_sec=[19.16, 12.31, 12.54, 10.79, 7.07])
    surv = [[0.6, 0.36, 0.216]] * 16  # 16 requests, tau 2.18 each if every draft is verified
    # read by batch tokens alone, 16 + 16 tokens is the 2-request probe (7.80 steps/s): a drafting step of
    # 16 requests would look cheaper than their plain step (1 / 7.07 s) and speculation would win
    bare = switch.StepCosts(table)
    assert bare.verify_floor_seconds(16) == pytest.approx(1 / 7.07)  # the plain floor alone
    assert bare.verify_seconds_range(start=16, count=2, num_reqs=16) == pytest.approx([1 / 7.07, 1 / 7.07])
    assert decide(surv, bare, **KNOWN).speculate  # (16 + 9.6) / (1 / 7.07) = 181 > 1.05 x 113.1
    # the table's drafting step of 16 requests is 1 / 2.10 s: (16 + 18.8) / 0.476 = 73 < 113 -> decode plainly
    costs = switch.StepCosts(table, block_size=7)
    assert costs.verify_floor_seconds(16) == pytest.approx(1 / 2.10)
    assert costs.verify_floor_seconds(1) == pytest.approx(1 / 9.37)
    assert costs.verify_floor_seconds(64) == float("inf")  # 512 tokens: past capacity, never speculate
    d = decide(surv, costs, **KNOWN)
    assert (d.speculate, d.best_budget) == (False, 48)
    assert d.spec_tokens_per_sec == pytest.approx((16 + 16 * (0.6 + 0.36 + 0.216)) * 2.10)
    # one request speculates once its drafts beat plain decoding by 2.15x: tau 2.18 does, tau 1.6 does not
    assert decide(surv[:1], costs, **KNOWN).speculate
    assert not decide([[0.4, 0.16, 0.064]], costs, **KNOWN).speculate
    with pytest.raises(ValueError, match="block_size"):
        switch.StepCosts(table, block_size=-1)


def test_estimated_survival_hand_computed():
    # row 0 known: min(1, 0.8*1.5)=1, 0.5*0.5=0.25 -> 1, 0.25; row 1 unknown: the known mean (1, 0.25)
    got = switch.estimated_survival(confidences=torch.tensor([[0.8, 0.5], [0.0, 0.0]]),
                                    known=torch.tensor([True, False]), ratios=torch.tensor([1.5, 0.5]))
    assert got.tolist() == [[1.0, 0.25], [1.0, 0.25]]
    none_known = switch.estimated_survival(confidences=torch.zeros(1, 2), known=torch.tensor([False]),
                                           ratios=torch.tensor([0.5, 2.0]))
    assert none_known.tolist() == [[0.5, 0.5]]
    # no row known, a prior [0.5, 0.75]: clip(0.5 x 1) = 0.5, clip(0.75 x 0.5) = 0.375 -> 0.5, 0.1875
    from_prior = switch.estimated_survival(confidences=torch.zeros(1, 2), known=torch.tensor([False]),
                                           ratios=torch.tensor([1.0, 0.5]), prior=torch.tensor([0.5, 0.75]))
    assert from_prior.tolist() == [[0.5, 0.1875]]


def test_audit_counts_hand_computed():
    conf = [[0.9, 0.8, 0.7], [0.6, 0.5, 0.4], [0.3, 0.2, 0.1]]
    verify, accepted = [3, 2, 0], [1, 2, 0]
    # row 0: slot 0 kept, slot 1 rejected (attempted); row 1: slots 0, 1 kept (slot 2 not verified)
    acc, pred = switch.audit_counts(confidences=torch.tensor(conf), verify_lengths=torch.tensor(verify),
                                    num_accepted=torch.tensor(accepted))
    assert acc.tolist() == [2.0, 1.0, 0.0]
    assert pred.tolist() == pytest.approx([1.5, 1.3, 0.0])


def test_probe_interval_doubles_and_resets():
    probe = switch.SpeculationDecision(True, 1, True, 1, 0, 0.0, 1.0)
    pays = switch.SpeculationDecision(True, 3, False, 2, 3, 2.0, 1.0)
    plain = switch.SpeculationDecision(False, 0, False, 0, 0, 0.0, 1.0)
    kw = dict(initial=16, maximum=64)
    assert switch.next_probe_interval(decision=probe, probe_interval=16, **kw) == 32
    assert switch.next_probe_interval(decision=probe, probe_interval=64, **kw) == 64
    assert switch.next_probe_interval(decision=pays, probe_interval=64, **kw) == 16
    assert switch.next_probe_interval(decision=plain, probe_interval=32, **kw) == 32


def test_decision_rejects_device_or_bad_arguments():
    costs = switch.StepCosts(cost_table([10, 8]))
    with pytest.raises(ValueError, match="survival must be"):
        switch.decide_speculation(survival=torch.zeros(3), costs=costs, **KNOWN)
    with pytest.raises(ValueError, match="probe_interval"):
        switch.decide_speculation(survival=torch.zeros(1, 1), costs=costs, known_rows=1, steps_since_draft=0,
                                  probe_interval=0)
    with pytest.raises(ValueError, match="draft_seconds"):
        switch.StepCosts(cost_table([10, 8]), draft_seconds=-1.0)


# ---- the extended SPS table ---------------------------------------------------------------------


def test_extended_table_round_trips_and_validates(tmp_path):
    t = cost_table([10, 8, 5], plain=[11, 10], draft=[0.02, 0.03])
    save_sps_table(t, tmp_path / "sps.json")
    assert load_sps_table(tmp_path / "sps.json") == t
    assert list(tmp_path.iterdir()) == [tmp_path / "sps.json"]  # the temp file was renamed away
    assert (t.plain_lookup(1), t.plain_lookup(5), t.draft_lookup(2)) == (11, 10, 0.03)
    # a table without the columns writes exactly SGLang's three fields
    plain_only = cost_table([10, 8])
    assert set(__import__("json").loads(__import__("msgspec").json.encode(plain_only))) == {
        "sample_batch_tokens", "sample_steps_per_sec", "max_batch_tokens"}
    for bad, match in [
        ('"plain_batch_sizes":[1,2],"plain_steps_per_sec":[1.0]', "equal length"),
        ('"plain_batch_sizes":[2,1],"plain_steps_per_sec":[1.0,1.0]', "strictly increasing"),
        ('"plain_batch_sizes":[1],"plain_steps_per_sec":[0.0]', "plain_steps_per_sec must be > 0"),
        ('"plain_batch_sizes":[1],"plain_steps_per_sec":[1.0],"draft_seconds":[1.0,2.0]', "draft_seconds must be"),
        ('"plain_batch_sizes":[1],"plain_steps_per_sec":[1.0],"draft_seconds":[-1.0]', "finite and >= 0"),
    ]:
        text = '{"sample_batch_tokens":[1],"sample_steps_per_sec":[1.0],"max_batch_tokens":4,' + bad + "}"
        with pytest.raises(ValueError, match=match):
            sps_table_from_json(text, source="x.json")


def test_sglang_loader_reads_the_extended_table(tmp_path):
    sps = pytest.importorskip("sglang.srt.speculative.dspark_components.dspark_sps")
    t = cost_table([10, 8, 5], plain=[11, 10], draft=[0.02, 0.03])
    save_sps_table(t, tmp_path / "sps.json")
    theirs = sps.load_sps_table_from_path(str(tmp_path / "sps.json"))
    assert theirs.sample_batch_tokens == [1, 2, 3] and theirs.lookup(2) == 8


# ---- AutoPolicy --------------------------------------------------------------------------------


def run_auto(policy: AutoPolicy, *, steps: int, n: int, k: int, confidence: float, accept: int, clock=None,
             spec_seconds=None):
    """Drive the policy like an engine; every drafted row keeps `accept` drafts (capped by its length).
    With a `clock` (FakeClock) each step also takes time on it: a plain step 1 / plain rate as predicted, a
    speculative step the seconds the table predicts for its budget (or `spec_seconds`), a probe 1 s."""
    slots, gens = torch.arange(n), torch.zeros(n, dtype=torch.long)
    trace = []
    for _ in range(steps):
        decision, rows = policy.decide(slot_ids=slots, generations=gens)
        tokens = n
        if decision.speculate:
            conf = torch.full((rows.numel(), k), confidence)
            lengths = policy.plan(confidences=conf, slot_ids=slots[rows], generations=gens[rows])
            accepted = lengths.clamp_max(accept)
            policy.observe(slot_ids=slots[rows], generations=gens[rows], confidences=conf, verify_lengths=lengths,
                           num_accepted=accepted)
            tokens += int(accepted.sum())
        if clock is not None:
            if decision.probe:
                clock.now += 1.0
            elif decision.speculate:
                predicted = policy.costs.draft_seconds(n) + float(policy.costs.verify_seconds_range(
                    start=n + decision.budget, count=1, num_reqs=n)[0])
                clock.now += spec_seconds if spec_seconds is not None else predicted
            else:
                clock.now += n / decision.plain_tokens_per_sec
        trace.append("P" if decision.probe else ("S" if decision.speculate else "."))
    return "".join(trace)


def test_auto_policy_switches_off_for_a_head_that_overpromises_and_probes_rarely():
    # verify of 2 tokens costs 1.25 plain steps, a draft 0.2: confidence 0.5 would pay (1.5 / 1.45 > 1),
    # but nothing is ever accepted; after the first probe's outcome (rho_0 = 4 / 4.5 with the audit's prior of
    # 4: spec(1) = 1.44 / 0.145 = 9.96 < 10.5) the policy stays plain, probing at intervals 32, 64, 64 (16
    # doubled per probe, capped)
    table = cost_table([10, 8, 6, 5, 4, 3, 2, 2], plain=[10], draft=[0.02])
    policy = AutoPolicy(table, lag=2, probe_interval=16, max_probe_interval=64, probe_rows=1)
    trace = run_auto(policy, steps=200, n=1, k=3, confidence=0.5, accept=0)
    assert [i for i, c in enumerate(trace) if c != "."] == [0, 32, 96, 160]
    assert set(trace) == {"P", "."}
    assert policy.stats().speculative_steps == 4 and policy.stats().probes == 4
    # four probes, each slot 1 predicted 0.5 and rejected, forgotten 0.95 per observed step
    assert float(policy.audit_ratios()[0]) == pytest.approx(4 / (4 + 0.5 * (1 + 0.95 + 0.95 ** 2 + 0.95 ** 3)))


def test_auto_policy_speculates_every_step_when_drafts_pay():
    table = cost_table([10, 9.5, 9, 8.5, 8, 7.5, 7, 6.5], plain=[10], draft=[0.01])
    policy = AutoPolicy(table, lag=2, probe_rows=1)
    trace = run_auto(policy, steps=30, n=1, k=3, confidence=0.9, accept=3)
    # probe at 0, nothing known at 1, from step 2 on (the probe's outcome has matured) every step speculates
    assert trace == "P." + "S" * 28
    assert policy.stats().total_budget == 3 + 28 * 3  # the probe verifies its row's whole block


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_auto_guard_keeps_decisions_where_the_engine_realizes_the_predicted_rates():
    table = cost_table([10, 9.5, 9, 8.5, 8, 7.5, 7, 6.5], plain=[10], draft=[0.01])
    clock = FakeClock()
    policy = AutoPolicy(table, lag=2, probe_rows=1, guard=True, clock=clock)
    assert run_auto(policy, steps=30, n=1, k=3, confidence=0.9, accept=3, clock=clock) == "P." + "S" * 28  # as without the guard
    assert policy.guard_spec == pytest.approx(1.0) and policy.guard_plain == pytest.approx(1.0)


def test_auto_guard_audits_seconds_and_leaves_acceptance_to_the_audit():
    # steps take what the table predicts, but each row keeps 1 of its 3 drafts where 0.9 each was promised:
    # the acceptance audit corrects the estimates (rho_1 < 1), the guard stays at 1 (it audits seconds only).
    # It credited a step its committed tokens once, and so charged the same shortfall twice
    table = cost_table([10, 9.5, 9, 8.5, 8, 7.5, 7, 6.5], plain=[10], draft=[0.01])
    clock = FakeClock()
    policy = AutoPolicy(table, lag=2, probe_rows=1, guard=True, clock=clock)
    trace = run_auto(policy, steps=40, n=1, k=3, confidence=0.9, accept=1, clock=clock)
    assert policy.guard_spec == pytest.approx(1.0) and policy.guard_plain == pytest.approx(1.0)
    ratios = policy.audit_ratios()
    assert float(ratios[0]) > 1.0 and float(ratios[1]) < 0.5
    # 2 tokens in 0.01 + 1 / 9.5 s = 17.4 tok/s still beats plain's 10: it keeps speculating, verifying 1 draft
    assert trace[:2] == "P." and set(trace[2:]) == {"S"}


def test_auto_guard_switches_off_speculation_that_loses_in_wall_time():
    # the table and the estimates say speculating pays (4 tokens at ~31 tok/s against 10 tok/s plain), but on
    # this machine a speculative step takes 0.5 s: 8 tok/s, slower than plain decoding
    table = cost_table([10, 9.5, 9, 8.5, 8, 7.5, 7, 6.5], plain=[10], draft=[0.01])
    blind = AutoPolicy(table, lag=2, probe_rows=1)
    assert run_auto(blind, steps=100, n=1, k=3, confidence=0.9, accept=3) == "P." + "S" * 98
    clock = FakeClock()
    policy = AutoPolicy(table, lag=2, probe_rows=1, guard=True, clock=clock)
    trace = run_auto(policy, steps=100, n=1, k=3, confidence=0.9, accept=3, clock=clock,
                     spec_seconds=0.5)
    first_plain = trace.index(".", 2)
    # each speculative step was predicted to commit ~4 tokens in ~0.13 s and takes 0.5 s: in its wall time the
    # predicted rate would have committed ~15.6, so g_spec ~ (4m + 4) / (15.6m + 4) with the prior of 4
    # (switch.GUARD_PRIOR) falls below 10.5 / 31.1 = 0.338 after 3 of them (m = 1, 1.97, 2.91: 0.41, 0.34, 0.32);
    # ~10 with a prior of 16; then plain decoding, probing now and then (the acceptance audit, rising above 1 as
    # every draft is kept, may buy one more speculative step right at the boundary)
    assert switch.GUARD_PRIOR == 4.0
    assert trace[:2] == "P." and set(trace[2:first_plain]) == {"S"} and 2 <= first_plain - 2 <= 5
    assert trace.count("S") <= 5 and set(trace[12:]) <= {".", "P"}
    # the guard is what holds it off (the audit, every draft kept, says 27-31 tok/s against 10.5)
    assert policy.guard_spec < 0.4
    assert policy.guard_plain == pytest.approx(1.0)
    with pytest.raises(ValueError, match="guard_prior"):
        AutoPolicy(table, guard=True, guard_prior=0.0)
    with pytest.raises(ValueError, match="guard_decay"):
        AutoPolicy(table, guard=True, guard_decay=1.5)


def test_rate_guard_hand_computed():
    clock = FakeClock()
    guard = switch.RateGuard(prior=2.0, decay=0.5, token_lag=1, clock=clock)
    assert guard.scale("spec") == 1.0 and guard.scale("plain") == 1.0
    s0 = guard.begin(kind="spec", predicted_rate=10.0, num_reqs=2)  # tokens come later (an asynchronous read-back)
    clock.now = 1.0
    guard.begin(kind="plain", predicted_rate=4.0, num_reqs=2, tokens=2)  # s0 ended: 1 s, waits for its tokens
    assert guard.scale("spec") == 1.0
    guard.set_tokens(s0, 5)
    clock.now = 1.5
    guard.end()
    # spec: 5 committed where 1 s x 10 tok/s = 10 were predicted, over 2 requests: 2.5 and 5 per request;
    # plain: 2 where 0.5 s x 4 = 2
    assert guard.scale("spec") == pytest.approx((2.5 + 2) / (5 + 2))
    assert guard.scale("plain") == pytest.approx(1.0)
    clock.now = 2.0
    guard.begin(kind="spec", predicted_rate=10.0, num_reqs=1)  # its tokens never come
    clock.now = 4.0
    guard.begin(kind="probe", predicted_rate=10.0, num_reqs=1)  # probes feed neither kind
    clock.now = 5.0
    s4 = guard.begin(kind="spec", predicted_rate=100.0, num_reqs=1)  # the tokenless spec step has waited its one step: dropped
    assert guard.scale("spec") == pytest.approx(4.5 / 7)
    guard.set_tokens(s4, 3)
    clock.now = 10.0
    guard.end()  # 5 s x 100 tok/s = 500 predicted, bounded to 4 x 3 = 12
    assert guard.scale("spec") == pytest.approx((0.5 * 2.5 + 3 + 2) / (0.5 * 5 + 12 + 2))
    guard.begin(kind="plain", predicted_rate=4.0, num_reqs=1, tokens=1)
    guard.interrupt()  # a prefill ran inside it
    clock.now = 20.0
    guard.end()
    assert guard.scale("plain") == pytest.approx(1.0)
    with pytest.raises(ValueError, match="kind"):
        guard.begin(kind="draft", predicted_rate=1.0, num_reqs=1)
    with pytest.raises(ValueError, match="num_reqs"):
        guard.begin(kind="spec", predicted_rate=1.0, num_reqs=0)
    with pytest.raises(ValueError, match="token_lag"):
        switch.RateGuard(token_lag=-1)


def test_rate_guard_spec_scale_shrinks_toward_the_plain_scale():
    # a machine faster than when the table was profiled: plain steps realize 2x their predicted tokens. With no
    # drafting step measured, the spec scale is plain's (1.2), not 1; measured steps then count against it
    clock = FakeClock()
    guard = switch.RateGuard(prior=2.0, decay=1.0, clock=clock)
    guard.begin(kind="plain", predicted_rate=4.0, num_reqs=1, tokens=1)
    clock.now = 0.125
    guard.end()  # 1 committed where 0.125 s x 4 tok/s = 0.5 were predicted
    assert guard.scale("plain") == pytest.approx((1 + 2) / (0.5 + 2))
    assert guard.scale("spec") == pytest.approx(1.2)
    guard.begin(kind="spec", predicted_rate=10.0, num_reqs=1, tokens=5)
    clock.now = 1.125
    guard.end()  # 5 where 10 were predicted
    assert guard.scale("spec") == pytest.approx((5 + 2 * 1.2) / (10 + 2))
    assert guard.scale("plain") == pytest.approx(1.2)


def test_auto_policy_uses_information_exactly_lag_steps_old():
    table = cost_table([10, 9.5, 9, 8.5], plain=[10], draft=[0.0])
    for lag in (1, 2, 3):
        policy = AutoPolicy(table, lag=lag, probe_rows=1)
        trace = run_auto(policy, steps=8, n=1, k=3, confidence=0.9, accept=3)
        assert trace == "P" + "." * (lag - 1) + "S" * (8 - lag), lag


def test_auto_policy_reused_slot_does_not_inherit_confidences():
    # slot 0 drafted 0.99 (every draft kept), slot 1 drafted 0.01; then slot 0 gets a new request. It must
    # borrow the known rows' mean (slot 1's 0.01: nothing worth verifying), not its predecessor's 0.99.
    # estimate_strength=0: each request's own mean, so that the shrinkage toward the prior (the next tests)
    # does not blur the two rows
    table = cost_table([10, 9.9, 9.8, 9.7, 9.6, 9.5, 9.4, 9.3], plain=[10, 10], draft=[0.0, 0.0])
    policy = AutoPolicy(table, lag=1, probe_rows=2, margin=0.0, estimate_strength=0.0)
    slots, conf = torch.arange(2), torch.tensor([[0.99] * 3, [0.01] * 3])
    for _ in range(3):
        gens = torch.zeros(2, dtype=torch.long)
        d, rows = policy.decide(slot_ids=slots, generations=gens)
        if d.speculate:
            lengths = policy.plan(confidences=conf[rows], slot_ids=slots[rows], generations=gens[rows])
            policy.observe(slot_ids=slots[rows], generations=gens[rows], confidences=conf[rows],
                           verify_lengths=lengths, num_accepted=torch.tensor([3, 0])[rows].minimum(lengths))
    assert d.speculate and d.best_budget == 3  # slot 0's three drafts pay, slot 1's do not
    d, _ = policy.decide(slot_ids=slots, generations=torch.tensor([1, 0]))  # a new request in slot 0
    assert d.best_budget == 0 and not d.speculate
    assert policy.stats().unknown_rows == 2 + 1  # the cold step's two rows, then the new request


def test_auto_policy_new_requests_alone_use_earlier_requests_confidences():
    # requests served one at a time: each new one is unknown, but the running mean of the earlier
    # requests' drafts (all kept) says speculating pays, so it speculates at once instead of waiting
    table = cost_table([10, 9.5, 9, 8.5], plain=[10], draft=[0.0])
    policy = AutoPolicy(table, lag=1, probe_rows=1)
    run_auto(policy, steps=4, n=1, k=3, confidence=0.9, accept=3)
    d, rows = policy.decide(slot_ids=torch.tensor([0]), generations=torch.tensor([1]))
    assert d.speculate and not d.probe and rows.tolist() == [0]


def test_auto_policy_one_low_snapshot_does_not_hold_a_request_plain():
    # a step's confidences predict that step, not the one two later (docs/scheduler.md, "Estimates, two
    # steps stale"): a request that drafted 0.9 (all kept) five times and then 0.05 once keeps speculating on its
    # shrunk mean. Holding its latest snapshot instead, it decoded plainly until the next probe.
    table = cost_table([10, 9.5, 9, 8.5], plain=[10], draft=[0.0])
    policy = AutoPolicy(table, lag=1, probe_rows=1)
    slots, gens = torch.tensor([0]), torch.zeros(1, dtype=torch.long)
    trace = []
    for c in [0.9] * 5 + [0.05] + [0.9] * 4:
        d, rows = policy.decide(slot_ids=slots, generations=gens)
        trace.append("P" if d.probe else "S" if d.speculate else ".")
        if d.speculate:
            conf = torch.full((1, 3), c)
            lengths = policy.plan(confidences=conf, slot_ids=slots, generations=gens)
            accepted = lengths.clamp_max(3 if c > 0.5 else 0)
            policy.observe(slot_ids=slots, generations=gens, confidences=conf, verify_lengths=lengths,
                           num_accepted=accepted)
    assert "".join(trace) == "P" + "S" * 9
    # estimate_strength=0 is the request's own mean: 5 x [0.9, 0.81, 0.729] + [0.05, 0.0025, 0.000125] over 6
    own = AutoPolicy(table, lag=1, probe_rows=1, estimate_strength=0.0)
    run_auto(own, steps=5, n=1, k=3, confidence=0.9, accept=3)
    own.plan(confidences=torch.full((1, 3), 0.05), slot_ids=slots, generations=gens)
    own.decide(slot_ids=slots, generations=gens)  # matures the 0.05 snapshot
    mean = [(5 * 0.9 + 0.05) / 6, (5 * 0.81 + 0.0025) / 6, (5 * 0.729 + 0.000125) / 6]
    # (the confidences are float32: 0.9 is 0.89999998)
    assert own._conf[:, 0].tolist() == pytest.approx([mean[0], mean[1] / mean[0], mean[2] / mean[1]], rel=1e-6)


def test_auto_policy_prior_is_the_mean_survival_not_the_product_of_mean_conditionals():
    # one probe drafts two requests, [1, 1, 1] (all kept) and [0, 0, 0]: the mean survival is 0.5 at every
    # slot, so a new request alone expects 1 + 3 x 0.5 = 2.5 tokens from 3 drafts, at 8.5 steps/s: 21.25
    # tok/s. The product of the mean conditionals (0.5 each) would expect 1 + 0.5 + 0.25 + 0.125 and 15.9 tok/s
    # (lookup-spliced blocks vary together like this: their mean survival was 0.85, that product 0.70)
    table = cost_table([10, 9.5, 9, 8.5], plain=[10, 10], draft=[0.0, 0.0])
    policy = AutoPolicy(table, lag=1, probe_rows=2)
    slots, gens = torch.arange(2), torch.zeros(2, dtype=torch.long)
    d, rows = policy.decide(slot_ids=slots, generations=gens)
    assert d.probe and rows.tolist() == [0, 1]
    conf = torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    lengths = policy.plan(confidences=conf, slot_ids=slots, generations=gens)
    policy.observe(slot_ids=slots, generations=gens, confidences=conf, verify_lengths=lengths,
                   num_accepted=torch.tensor([3, 0]).minimum(lengths))
    d, _ = policy.decide(slot_ids=torch.tensor([2]), generations=torch.tensor([0]))  # never drafted: the prior
    assert policy.audit_ratios().tolist() == [1.0, 1.0, 1.0]
    assert d.speculate and d.best_budget == 3 and d.spec_tokens_per_sec == pytest.approx(2.5 * 8.5, rel=1e-12)


def test_auto_policy_plan_without_decide_is_an_error():
    policy = AutoPolicy(cost_table([10, 9]))
    with pytest.raises(ValueError, match="call decide"):
        policy.plan(confidences=torch.zeros(1, 1), slot_ids=torch.tensor([0]), generations=torch.tensor([0]))


def test_topk_lengths_cpu_selection_matches_reference_with_ties():
    # the CPU path selects instead of sorting: ties at the threshold must still go to the earlier
    # slot, then the lower request; NaN and values under min_survival are never taken
    rng = random.Random(3)
    for _ in range(300):
        n, k = rng.randint(1, 7), rng.randint(1, 5)
        pool = [0.0, 0.25, 0.5, 0.5, 1.0, float("nan"), 1e-9, rng.random()]
        surv = [sorted((rng.choice(pool) for _ in range(k)), key=lambda v: -v if v == v else 1) for _ in range(n)]
        budget, eps = rng.randint(0, n * k + 2), rng.choice([0.0, 1e-6])
        for dtype in (torch.float64, torch.float32):
            got = planner.topk_lengths(survival=torch.tensor(surv, dtype=dtype), budget=budget, min_survival=eps)
            want = planner.topk_lengths_reference(survival=torch.tensor(surv, dtype=dtype).tolist(), budget=budget,
                                                  min_survival=eps)
            assert got.tolist() == want and got.dtype == torch.long


def test_conditionals_of_survival_hand_computed():
    surv = torch.tensor([[0.5, 0.25, 0.0, 0.0], [1.0, 0.9, 0.45, 0.09]], dtype=torch.float64)
    got = switch.conditionals_of_survival(surv).flatten().tolist()
    assert got == pytest.approx([0.5, 0.5, 0.0, 0.0, 1.0, 0.9, 0.5, 0.2], rel=1e-12)
    assert switch.conditionals_of_survival(surv[0]).tolist() == got[:4]  # any leading shape
