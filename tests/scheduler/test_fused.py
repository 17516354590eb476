"""AutoPolicy's compiled passes (scheduler/fused.py): hand-computed cases, and one randomized property
test that holds each pass to the torch function stating its rule (switch.estimated_survival,
switch.best_speculation / decide_speculation, switch.audit_counts, planner.topk_lengths), to the bit,
over random inputs with ties, unknown rows, the prior, min_survival, capacity and the floors."""

import math
import random

import numpy as np
import pytest
import torch
from sglang_hspec.scheduler import fused, planner, switch
from sglang_hspec.scheduler.sps import SpsAdditiveCostTable, SpsCostTable


def cost_table(verify, plain, draft, *, max_batch_tokens=None) -> SpsCostTable:
    probes = list(range(1, len(verify) + 1))
    return SpsCostTable(sample_batch_tokens=probes, sample_steps_per_sec=verify,
                        max_batch_tokens=max_batch_tokens or probes[-1],
                        plain_batch_sizes=list(range(1, len(plain) + 1)), plain_steps_per_sec=plain,
                        draft_seconds=draft)


def run_decide(costs, conf, gen, slots, gens, ratios, prior, min_survival=0.0):
    n, block_size = len(slots), conf.shape[0]
    verify = costs.verify_seconds_upto(end=n * (block_size + 1) + 1, num_reqs=n)
    return fused.best_speculation(conf, gen, np.asarray(slots, dtype=np.int64), np.asarray(gens, dtype=np.int64),
                                  np.asarray(ratios, dtype=np.float64),
                                  np.asarray(prior if prior is not None else ratios, dtype=np.float64),
                                  prior is not None, verify, costs.draft_seconds(n), min_survival,
                                  np.empty(n * block_size + 1))


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


@pytest.mark.parametrize("bad", [math.nan, 1.5, -0.1])
def test_plan_pass_rejects_what_is_not_a_probability(bad):
    conf = np.array([[0.5, 0.5], [0.2, bad]])
    drafted = np.full(2, -5, dtype=np.int64)
    assert fused.plan_pass(conf, np.ones(2), 2, np.empty((2, 2)), np.empty(2, dtype=np.int64),
                           np.arange(2, dtype=np.int64), drafted, 3) == -1
    assert drafted.tolist() == [-5, -5]  # nothing recorded for a step that is refused


def test_mature_pass_shrinks_each_request_mean_survival_toward_the_prior():
    conf, gen = np.zeros((2, 4)), np.full(4, -1, dtype=np.int64)
    surv_sum, count = np.zeros((2, 4)), np.zeros(4, dtype=np.int64)
    prior, prior_surv = np.zeros(2), np.zeros(2)

    def mature(slots, gens, matured, has_prior, strength=2.0):
        return fused.mature_pass(conf, gen, surv_sum, count, prior_surv, prior, np.array(slots), np.array(gens),
                                 np.array(matured), has_prior, strength)

    # [k=2, rows=2] for slots 3 and 1: survivals [0.2, 0.08] and [0.6, 0.6], their mean [0.4, 0.34] is the prior
    assert mature([3, 1], [7, 8], [[0.2, 0.6], [0.4, 1.0]], False)
    assert gen.tolist() == [-1, 8, -1, 7] and count.tolist() == [0, 1, 0, 1]
    assert prior_surv.tolist() == pytest.approx([0.4, 0.34], abs=1e-15)
    assert prior.tolist() == pytest.approx([0.4, 0.85], abs=1e-15)  # conditionals of the mean survival
    # slot 3: (2 x [0.4, 0.34] + [0.2, 0.08]) / 3 = [1/3, 0.76/3] -> conditionals [1/3, 0.76]
    assert conf[:, 3].tolist() == pytest.approx([1 / 3, 0.76], abs=1e-15)
    assert conf[:, 1].tolist() == pytest.approx([1.4 / 3, 1.28 / 1.4], abs=1e-15)
    # the same request again: sums [0.7, 0.08] over 2 drafts; prior 0.9 [0.4, 0.34] + 0.1 [0.5, 0] = [0.41, 0.306]
    assert mature([3], [7], [[0.5], [0.0]], True)
    assert count[3] == 2 and prior_surv.tolist() == pytest.approx([0.41, 0.306], abs=1e-15)
    assert conf[:, 3].tolist() == pytest.approx([1.52 / 4, 0.692 / 1.52], abs=1e-15)
    # a new generation in slot 3 starts afresh: one draft, survivals [1, 0.5]
    assert mature([3], [9], [[1.0], [0.5]], True)
    assert count[3] == 1 and gen[3] == 9
    assert prior_surv.tolist() == pytest.approx([0.469, 0.3254], abs=1e-15)
    assert conf[:, 3].tolist() == pytest.approx([1.938 / 3, 1.1508 / 1.938], abs=1e-15)
    assert conf[:, 1].tolist() == pytest.approx([1.4 / 3, 1.28 / 1.4], abs=1e-15)  # untouched
    # strength 0 is the request's own mean; past a zero survival the conditionals are 0, not NaN
    assert mature([0], [5], [[0.0], [0.7]], True, strength=0.0)
    assert conf[:, 0].tolist() == [0.0, 0.0]
    assert not mature(np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64), np.zeros((2, 0)), True)
    assert count[3] == 1  # an empty snapshot changes nothing


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
    survival = switch.estimated_survival(confidences=torch.ones(1, 4), known=torch.tensor([True]),
                                         ratios=torch.from_numpy(ratios))
    assert survival[0].tolist() == pytest.approx([rho0, rho0**2 / 3, rho0**3 / 9, rho0**4 / 27], rel=1e-12)


def random_costs(rng: random.Random, *, block_size: int) -> switch.StepCosts:
    if rng.random() < 0.2:  # SGLang's additive layout: no plain or drafter columns
        table = SpsAdditiveCostTable(bias_seconds=rng.uniform(0.005, 0.02), bs_probes=[1, 16],
                                     alpha_seconds=[0.0, rng.uniform(0, 0.01)], m_probes=[1, 128],
                                     theta_seconds=[0.0, rng.uniform(0, 0.05)])
    else:
        verify = sorted((rng.uniform(1, 100) for _ in range(rng.randint(2, 40))), reverse=rng.random() < 0.8)
        plain = [rng.uniform(1, 120) for _ in range(rng.randint(1, 10))]
        draft = [rng.choice([0.0, rng.uniform(0, 0.05)]) for _ in plain]
        table = cost_table(verify, plain, draft, max_batch_tokens=len(verify) + rng.choice([0, 5, 50]))
    return switch.StepCosts(table, block_size=rng.choice([None, None, 0, block_size]),
                            draft_seconds=rng.choice([None, None, 0.0, 0.01]))


def test_compiled_passes_are_twins_of_the_torch_rules():
    """One property, 600 seeded random cases: every compiled pass computes exactly (==, not approx) what
    the torch function that states its rule computes, and the estimates are survivals."""
    rng = random.Random(0)
    pool = [0.0, 1.0, 0.5, 0.25, 1e-9]  # exact ties and zeros, besides random values
    for case in range(600):
        block_size, n, slots_total = rng.randint(1, 6), rng.randint(0, 9), rng.randint(9, 14)
        costs = random_costs(rng, block_size=block_size)
        conf = np.array([[rng.choice(pool + [rng.random()]) for _ in range(slots_total)] for _ in range(block_size)])
        gen = np.array([rng.randint(0, 2) for _ in range(slots_total)], dtype=np.int64)
        slots = np.array(rng.sample(range(slots_total), n), dtype=np.int64)
        gens = np.array([rng.randint(0, 2) for _ in range(n)], dtype=np.int64)
        ratios = np.array([rng.choice([1.0, rng.uniform(0, 2)]) for _ in range(block_size)])
        prior = np.array([rng.random() for _ in range(block_size)]) if rng.random() < 0.3 else None
        eps = rng.choice([0.0, 1e-6])

        # the stale estimates and the rate argmax (AutoPolicy.decide) against estimated_survival + best_speculation
        known = torch.from_numpy(gen[slots] == gens)
        num_known = int(known.sum())
        from_prior = num_known == 0 and prior is not None
        survival = switch.estimated_survival(
            confidences=torch.from_numpy(conf[:, slots].T.copy()), known=known, ratios=torch.from_numpy(ratios),
            prior=None if prior is None else torch.from_numpy(prior))
        assert survival.dtype == torch.float64 and tuple(survival.shape) == (n, block_size), case
        assert bool(((survival >= 0) & (survival <= 1)).all()), case
        assert bool((survival[:, 1:] <= survival[:, :-1]).all()), case  # a survival never rises along the block
        known_rows = n if from_prior else num_known
        want = (0, 0.0) if known_rows == 0 or n == 0 else switch.best_speculation(
            survival=survival, costs=costs, min_survival=eps)
        scratch = np.empty(n * block_size + 1)
        got = run_decide(costs, conf, gen, slots, gens, ratios, prior, eps)
        assert got == (num_known, known_rows if n else 0, *want), case
        count = fused.survival_pass(conf, gen, slots, gens, ratios, ratios if prior is None else prior,
                                    prior is not None, eps, scratch)[2]
        admitted = survival.reshape(-1)[survival.reshape(-1) >= eps] if known_rows else survival.new_zeros(0)
        assert sorted(scratch[:count].tolist()) == sorted(admitted.tolist()), case
        # ... and the public rule decides what AutoPolicy decides from the compiled argmax
        if n:
            kw = dict(steps_since_draft=rng.randint(0, 40), probe_interval=rng.randint(1, 32),
                      probe_rows=rng.randint(1, 5), margin=rng.choice([0.0, 0.05]))
            plain_rate = n * costs.plain_steps_per_sec(n)
            assert switch.decide_speculation(survival=survival, costs=costs, known_rows=known_rows, min_survival=eps,
                                             **kw) == switch.decision_from_best(
                num_reqs=n, best_n=got[2], best_rate=got[3], plain_rate=plain_rate, **kw), case

        # this step's verify lengths (AutoPolicy.plan) against topk_lengths over every row's estimate
        rows = rng.randint(0, 8)
        step_conf = np.array([[rng.choice(pool + [rng.random()]) for _ in range(block_size)] for _ in range(rows)],
                             dtype=rng.choice([np.float64, np.float32])).reshape(rows, block_size)
        budget = rng.randint(-1, rows * block_size + 2)
        conf_out, verify_lengths = np.full((block_size, rows), -1.0), np.full(rows, -1, dtype=np.int64)
        drafted = np.full(rows + 2, -5, dtype=np.int64)
        total = fused.plan_pass(step_conf, ratios, budget, conf_out, verify_lengths,
                                np.arange(rows, dtype=np.int64)[::-1].copy(), drafted, 11)
        current = switch.estimated_survival(confidences=torch.from_numpy(step_conf),
                                            known=torch.ones(rows, dtype=torch.bool), ratios=torch.from_numpy(ratios))
        want_lengths = planner.topk_lengths(survival=current, budget=budget).tolist()
        assert verify_lengths.tolist() == want_lengths and total == sum(want_lengths), case
        np.testing.assert_array_equal(conf_out, step_conf.T.astype(np.float64))
        assert drafted.tolist() == [11] * rows + [-5, -5], case

        # the audit of the verified step (AutoPolicy.observe) against audit_counts
        verify = [rng.randint(0, block_size) for _ in range(rows)]
        accepted_n = [rng.randint(0, v) for v in verify]
        accepted, predicted = np.full(block_size, 9.0), np.full(block_size, 9.0)
        fused.audit_pass(conf_out, np.array(verify, dtype=np.int64), np.array(accepted_n, dtype=np.int64), accepted,
                         predicted)
        want_acc, want_pred = switch.audit_counts(confidences=torch.from_numpy(step_conf),
                                                  verify_lengths=torch.tensor(verify, dtype=torch.long),
                                                  num_accepted=torch.tensor(accepted_n, dtype=torch.long))
        assert accepted.tolist() == want_acc.tolist() and predicted.tolist() == want_pred.tolist(), case
