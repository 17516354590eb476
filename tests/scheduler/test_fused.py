"""AutoPolicy's compiled passes (scheduler/fused.py) against the plain-Python references of switch.py
and planner.py: a hand-computed decision, random cases with ties, unknown rows, the prior, min_survival
and capacity, the matured-snapshot write, and the validation of confidences."""

import math
import random

import numpy as np
import pytest
from sglang_hspec.scheduler import fused, planner, switch
from sglang_hspec.scheduler.sps import SpsCostTable


def cost_table(verify, plain, draft, *, max_batch_tokens=None) -> SpsCostTable:
    probes = list(range(1, len(verify) + 1))
    return SpsCostTable(sample_batch_tokens=probes, sample_steps_per_sec=verify,
                        max_batch_tokens=max_batch_tokens or probes[-1],
                        plain_batch_sizes=list(range(1, len(plain) + 1)), plain_steps_per_sec=plain,
                        draft_seconds=draft)


def run_decide(costs, conf, gen, slots, gens, ratios, prior, min_survival=0.0):
    n, k = len(slots), conf.shape[0]
    verify = costs.verify_seconds_upto(end=n * (k + 1) + 1, num_reqs=n)
    return fused.best_speculation(conf, gen, np.asarray(slots, dtype=np.int64), np.asarray(gens, dtype=np.int64),
                             np.asarray(ratios, dtype=np.float64),
                             np.asarray(prior if prior is not None else ratios, dtype=np.float64),
                             prior is not None, verify, costs.draft_seconds(n), min_survival, np.empty(n * k + 1))


def test_best_speculation_hand_computed():
    # one request, last drafted [0.5, 0.4, 0.5] (survivals 0.5, 0.2, 0.1), audit ratios 1; draft 0.02 s;
    # verify 1/10, 1/8, 1/5, 1/4 s at 1..4 tokens: spec(0) = 1 / 0.12 = 8.33, spec(1) = 1.5 / 0.145 = 10.34,
    # spec(2) = 1.7 / 0.22 = 7.73, spec(3) = 1.8 / 0.27 = 6.67 -> n* = 1
    costs = switch.StepCosts(cost_table([10, 8, 5, 4], plain=[10], draft=[0.02]))
    conf = np.array([[0.5], [0.4], [0.5]])
    got = run_decide(costs, conf, np.array([3]), [0], [3], [1.0, 1.0, 1.0], None)
    assert got[:3] == (1, 1, 1) and got[3] == pytest.approx(1.5 / 0.145, rel=1e-12)
    # a new request in the slot (generation 4): nothing known, no prior -> nothing to decide on
    assert run_decide(costs, conf, np.array([3]), [0], [4], [1.0] * 3, None) == (0, 0, 0, 0.0)
    # ... with a prior of [0.5, 0.4, 0.5] it decides as if the request were known
    got = run_decide(costs, conf, np.array([3]), [0], [4], [1.0] * 3, [0.5, 0.4, 0.5])
    assert got[:3] == (0, 1, 1) and got[3] == pytest.approx(1.5 / 0.145, rel=1e-12)


def test_best_speculation_matches_reference():
    rng = random.Random(0)
    for case in range(400):
        n, k, slots_total = rng.randint(1, 9), rng.randint(1, 6), rng.randint(9, 14)
        verify = sorted((rng.uniform(1, 100) for _ in range(rng.randint(2, 40))), reverse=rng.random() < 0.8)
        plain = [rng.uniform(1, 120) for _ in range(rng.randint(1, 10))]
        draft = [rng.choice([0.0, rng.uniform(0, 0.05)]) for _ in plain]
        costs = switch.StepCosts(cost_table(verify, plain, draft, max_batch_tokens=len(verify) + rng.choice([0, 5, 50])))
        pool = [0.0, 1.0, 0.5, 1e-9]
        conf = np.array([[rng.choice(pool + [rng.random()]) for _ in range(slots_total)] for _ in range(k)])
        gen = np.array([rng.randint(0, 2) for _ in range(slots_total)])
        slots = rng.sample(range(slots_total), n)
        gens = [rng.randint(0, 2) for _ in range(n)]
        ratios = [rng.choice([1.0, rng.uniform(0, 2)]) for _ in range(k)]
        prior = [rng.random() for _ in range(k)] if rng.random() < 0.3 else None
        eps = rng.choice([0.0, 1e-6])
        known = [int(gen[s]) == g for s, g in zip(slots, gens)]
        if not any(known) and prior is not None:
            survival = switch.estimated_survival_reference(confidences=[prior] * n, known=[True] * n, ratios=ratios)
            known_rows = n
        else:
            survival = switch.estimated_survival_reference(confidences=[conf[:, s].tolist() for s in slots],
                                                           known=known, ratios=ratios)
            known_rows = sum(known)
        want = switch.decide_speculation_reference(
            survival=survival, sps=costs.scalar_fn(), plain_steps_per_sec=costs.plain_steps_per_sec(n),
            draft_seconds=costs.draft_seconds(n), known_rows=known_rows, steps_since_draft=0, probe_interval=1,
            min_survival=eps)
        num_known, rows, best_n, best_rate = run_decide(costs, conf, gen, slots, gens, ratios, prior, eps)
        assert (num_known, rows) == (sum(known), known_rows), case
        assert best_n == want.best_budget, case
        assert best_rate == pytest.approx(want.spec_tokens_per_sec, rel=1e-12, abs=0.0), case


def test_plan_pass_matches_reference_with_ties():
    rng = random.Random(1)
    for case in range(400):
        b, k = rng.randint(1, 8), rng.randint(1, 6)
        pool = [0.0, 0.5, 0.5, 1.0, rng.random()]
        conf = [[rng.choice(pool) for _ in range(k)] for _ in range(b)]
        ratios = [rng.choice([1.0, 1.0, rng.uniform(0.2, 2)]) for _ in range(k)]
        budget = rng.randint(-1, b * k + 2)
        for dtype in (np.float64, np.float32):
            c = np.array(conf, dtype=dtype)
            corrected = [[min(x * r, 1.0) for x, r in zip(row, ratios)] for row in c.astype(np.float64).tolist()]
            want = planner.topk_lengths_reference(survival=planner.survivals_reference(confidences=corrected),
                                                  budget=budget)
            conf_out, lengths = np.full((k, b), -1.0), np.full(b, -1, dtype=np.int64)
            slots, drafted = np.arange(b, dtype=np.int64)[::-1].copy(), np.full(b + 2, -5, dtype=np.int64)
            total = fused.plan_pass(c, np.array(ratios), budget, conf_out, lengths, slots, drafted, 11)
            assert lengths.tolist() == want and total == sum(want), case
            np.testing.assert_array_equal(conf_out, c.T.astype(np.float64))
            assert drafted.tolist() == [11] * b + [-5, -5]


@pytest.mark.parametrize("bad", [math.nan, 1.5, -0.1])
def test_plan_pass_rejects_what_is_not_a_probability(bad):
    conf = np.array([[0.5, 0.5], [0.2, bad]])
    drafted = np.full(2, -5, dtype=np.int64)
    assert fused.plan_pass(conf, np.ones(2), 2, np.empty((2, 2)), np.empty(2, dtype=np.int64),
                           np.arange(2, dtype=np.int64), drafted, 3) == -1
    assert drafted.tolist() == [-5, -5]  # nothing recorded for a step that is refused


def test_mature_pass_writes_the_snapshot_and_folds_the_prior():
    conf, gen = np.zeros((2, 4)), np.full(4, -1, dtype=np.int64)
    prior = np.zeros(2)
    matured = np.array([[0.2, 0.6], [0.4, 1.0]])  # [k=2, rows=2] for slots 3 and 1
    assert fused.mature_pass(conf, gen, np.array([3, 1]), np.array([7, 8]), matured, prior, False)
    assert gen.tolist() == [-1, 8, -1, 7] and conf[:, 3].tolist() == [0.2, 0.4] and conf[:, 1].tolist() == [0.6, 1.0]
    assert prior.tolist() == pytest.approx([0.4, 0.7], abs=1e-15)  # the first snapshot's mean
    assert fused.mature_pass(conf, gen, np.array([0]), np.array([9]), np.array([[1.0], [0.0]]), prior, True)
    assert prior.tolist() == pytest.approx([0.9 * 0.4 + 0.1, 0.9 * 0.7], abs=1e-15)
    assert not fused.mature_pass(conf, gen, np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64),
                                 np.zeros((2, 0)), prior, True)


def test_fold_audit_and_index_bounds_hand_computed():
    accepted, predicted, ratios = np.array([2.0, 0.0]), np.array([4.0, 1.0]), np.ones(2)
    fused.fold_audit(accepted, predicted, np.array([1.0, 0.0]), np.array([0.5, 0.5]), 0.5, 1.0, ratios)
    # accepted 2 * 0.5 + 1 = 2, predicted 4 * 0.5 + 0.5 = 2.5 -> (2 + 1) / (2.5 + 1); slot 1 shrinks
    # toward slot 0's ratio, not toward 1: (0 + 1 x 3 / 3.5) / (1 + 1)
    assert accepted.tolist() == [2.0, 0.0] and predicted.tolist() == [2.5, 1.0]
    assert ratios.tolist() == pytest.approx([3 / 3.5, 3 / 7], abs=1e-15)
    assert fused.index_bounds(np.array([4, -1, 9, 3])) == (-1, 9)
    assert fused.index_bounds(np.array([5])) == (5, 5)


def test_fold_audit_unseen_slots_inherit_the_last_seen_slots_correction():
    # a head that claims 1 on every slot; slot 0 verified 20 times with 2 accepts, slot 1 twice, none
    # accepted, slots 2-3 never: rho_0 = 3 / 21, rho_1 = rho_0 / 3, rho_2 = rho_3 = rho_1 (prior 1, decay 1)
    accepted, predicted, ratios = np.zeros(4), np.zeros(4), np.ones(4)
    fused.fold_audit(accepted, predicted, np.array([2.0, 0.0, 0.0, 0.0]), np.array([20.0, 2.0, 0.0, 0.0]), 1.0,
                     1.0, ratios)
    rho0 = 3 / 21
    assert ratios.tolist() == pytest.approx([rho0, rho0 / 3, rho0 / 3, rho0 / 3], abs=1e-15)
    # the survivals the switch reads from them (confidence 1 everywhere) fall geometrically with the slot
    survival = switch.estimated_survival_numpy(confidences=np.ones((1, 4)), known=np.array([True]), ratios=ratios)
    assert survival[0].tolist() == pytest.approx([rho0, rho0**2 / 3, rho0**3 / 9, rho0**4 / 27], rel=1e-12)


def test_audit_pass_matches_reference():
    rng = random.Random(2)
    for _ in range(200):
        b, k = rng.randint(1, 8), rng.randint(1, 6)
        conf = [[rng.random() for _ in range(k)] for _ in range(b)]
        verify = [rng.randint(0, k) for _ in range(b)]
        accepted_n = [rng.randint(0, v) for v in verify]
        want = switch.audit_counts_reference(confidences=conf, verify_lengths=verify, num_accepted=accepted_n)
        accepted, predicted = np.full(k, 9.0), np.full(k, 9.0)
        fused.audit_pass(np.array(conf).T.copy(), np.array(verify), np.array(accepted_n), accepted, predicted)
        assert accepted.tolist() == want[0] and predicted.tolist() == want[1]
