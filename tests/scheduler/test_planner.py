import random

import pytest
import torch
from sglang_hspec.scheduler import planner
from sglang_hspec.scheduler.sps import SpsAdditiveCostTable, SpsCostTable, SpsCurve


def table(sps: list[float], *, max_batch_tokens: int | None = None) -> SpsCurve:
    """Probes at 1, 2, 3, ... tokens with the given steps/s."""
    probes = list(range(1, len(sps) + 1))
    return SpsCurve(SpsCostTable(sample_batch_tokens=probes, sample_steps_per_sec=sps,
                                 max_batch_tokens=max_batch_tokens or probes[-1]))


def both(conf: list[list[float]], curve: SpsCurve, k: int | None = None):
    t = torch.tensor(conf, dtype=torch.float64).reshape(len(conf), k if k is not None else len(conf[0]))
    lengths, budget = planner.exact_lengths(confidences=t, sps=curve)
    ref_lengths, ref_budget = planner.exact_lengths_reference(confidences=conf, sps=lambda b, n: curve.scalar(
        batch_tokens=b, num_reqs=n))
    assert lengths.tolist() == ref_lengths and budget == ref_budget
    surv = planner.survivals(confidences=t)
    kstar = planner.argmax_budget(survival=surv, sps=curve)
    assert kstar == planner.argmax_budget_reference(
        survival=surv.tolist(), sps=lambda b, n: curve.scalar(batch_tokens=b, num_reqs=n))
    return lengths.tolist(), budget, kstar


def test_one_request_hand_computed():
    # survivals 0.9, 0.45, 0.225; Theta(n) = 100, 1.9*90=171, 2.35*80=188, 2.575*70=180.25
    lengths, budget, kstar = both([[0.9, 0.5, 0.5]], table([100, 90, 80, 70]))
    assert (lengths, budget, kstar) == ([2], 2, 2)


def test_jagged_curve_early_stop_and_argmax_differ():
    # survivals 0.5, 0.45, 0.405; Theta = 100, 1.5*60=90 (drop: exact stops), 117, 141.3 (argmax: 3)
    lengths, budget, kstar = both([[0.5, 0.9, 0.9]], table([100, 60, 60, 60]))
    assert (lengths, budget) == ([0], 0)
    assert kstar == 3
    surv = planner.survivals(confidences=torch.tensor([[0.5, 0.9, 0.9]]))
    assert planner.topk_lengths(survival=surv, budget=kstar).tolist() == [3]


def test_ties_break_to_earlier_slot_then_lower_request():
    # all survivals 0.5: order (r0,j0), (r1,j0), (r0,j1), (r1,j1)
    conf = [[0.5, 1.0], [0.5, 1.0]]
    surv = planner.survivals(confidences=torch.tensor(conf))
    assert [planner.topk_lengths(survival=surv, budget=n).tolist() for n in range(5)] == [
        [0, 0], [1, 0], [1, 1], [2, 1], [2, 2]]
    # N=2: Theta = 2*100=200, 2.5*90=225, 3*60=180 -> exactly one admitted, to request 0
    lengths, budget, _ = both(conf, table([100, 100, 90, 60, 60]))
    assert (lengths, budget) == ([1, 0], 1)


def test_all_zero_confidences_verify_only_anchors():
    lengths, budget, kstar = both([[0.0] * 3] * 2, table([100.0] * 8))
    assert (lengths, budget, kstar) == ([0, 0], 0, 0)


def test_all_one_confidences_verify_max_k():
    # N=2: Theta(n) = (2+n) * (100 - 5n) rises up to n=6 = 2k: every slot verified, never above k
    lengths, budget, kstar = both([[1.0] * 3] * 2, table([100, 100, 95, 90, 85, 80, 75, 70]))
    assert (lengths, budget, kstar) == ([3, 3], 6, 6)


def test_capacity_stops_admission():
    # beyond max_batch_tokens SPS is 0: at most 3 tokens for 2 requests = one draft token
    lengths, budget, kstar = both([[1.0] * 3] * 2, table([100, 100, 100]))
    assert (lengths, budget, kstar) == ([1, 0], 1, 1)


def test_empty_batch():
    lengths, budget = planner.exact_lengths(confidences=torch.zeros(0, 7), sps=table([100, 90]))
    assert lengths.shape == (0,) and budget == 0
    assert planner.argmax_budget(survival=torch.zeros(0, 7, dtype=torch.float64), sps=table([1.0, 2.0])) == 0
    assert planner.topk_lengths(survival=torch.zeros(0, 7), budget=5).shape == (0,)


def test_bad_confidences_are_rejected():
    with pytest.raises(ValueError, match="calibrated probabilities"):
        planner.exact_lengths(confidences=torch.tensor([[0.5, 1.5]]), sps=table([1.0, 2.0]))
    with pytest.raises(ValueError, match=r"\[B, block_size\]"):
        planner.exact_lengths(confidences=torch.tensor([0.5]), sps=table([1.0, 2.0]))


@pytest.mark.parametrize("seed", range(30))
def test_torch_matches_reference_on_random_jagged_cases(seed):
    rng = random.Random(seed)
    n, k = rng.randint(1, 9), rng.randint(1, 7)
    # dyadic values: exact float sums, so ties are real ties in both implementations
    conf = [[rng.choice([0.0, 0.25, 0.5, 0.75, 0.875, 1.0]) for _ in range(k)] for _ in range(n)]
    probes = sorted(rng.sample(range(1, n * (k + 1) + 4), rng.randint(2, 6)))
    if probes[0] != 1:
        probes[0] = 1
    curve = SpsCurve(SpsCostTable(sample_batch_tokens=probes,
                                  sample_steps_per_sec=[float(rng.choice([40, 55, 60, 80, 100])) for _ in probes],
                                  max_batch_tokens=probes[-1] + rng.randint(0, 30)))
    lengths, budget, kstar = both(conf, curve)
    surv = planner.survivals(confidences=torch.tensor(conf))
    for b in (budget, kstar, rng.randint(0, n * k)):
        assert planner.topk_lengths(survival=surv, budget=b).tolist() == planner.topk_lengths_reference(
            survival=surv.tolist(), budget=b)
    assert all(0 <= x <= k for x in lengths) and sum(lengths) == budget <= kstar


@pytest.mark.parametrize("seed", range(10))
def test_additive_table_torch_matches_reference(seed):
    rng = random.Random(100 + seed)
    n, k = rng.randint(1, 12), 7
    conf = [[rng.choice([0.25, 0.5, 0.75, 0.875, 1.0]) for _ in range(k)] for _ in range(n)]
    curve = SpsCurve(SpsAdditiveCostTable(bias_seconds=0.01, bs_probes=[1, 16], alpha_seconds=[0.0, 0.004],
                                          m_probes=[1, 32, 33, 128], theta_seconds=[0.0, 0.004, 0.012, 0.03]))
    lengths, budget, kstar = both(conf, curve)
    # early stop halts at the first local maximum of Theta, never after the first global one
    assert sum(lengths) == budget <= kstar


def test_budget_choice_hand_computed():
    # survivals 0.9, 0.45, 0.225 (one request): Theta = 100, 171, 188, 180.25 -> n = 2 at 80 steps/s
    surv = planner.survivals(confidences=torch.tensor([[0.9, 0.5, 0.5]]))
    choice = planner.budget_choice(survival=surv, sps=table([100, 90, 80, 70]))
    assert choice == planner.BudgetChoice(budget=2, theta=pytest.approx(188.0), steps_per_sec=80.0)
    # float32 survivals (SGLang's) give the same decision: tau is summed in float64 either way
    assert planner.budget_choice(survival=surv.float(), sps=table([100, 90, 80, 70])).budget == 2


def test_min_survival_never_admits_a_candidate_below_it():
    # survivals r0: 0.5, 1e-7 | r1: 1e-7, 1e-7; a curve that rises with tokens would admit all four
    surv = torch.tensor([[0.5, 1e-7], [1e-7, 1e-7]], dtype=torch.float64)
    rising = table([10, 20, 30, 40, 50, 60])
    assert planner.argmax_budget(survival=surv, sps=rising) == 4
    assert planner.argmax_budget(survival=surv, sps=rising, min_survival=1e-6) == 1
    assert planner.topk_lengths(survival=surv, budget=4).tolist() == [2, 2]
    assert planner.topk_lengths(survival=surv, budget=4, min_survival=1e-6).tolist() == [1, 0]
    # NaN is never admitted either, nor takes an admitted candidate's place (a plain sort puts it first)
    nan = torch.tensor([[float("nan")], [0.5]], dtype=torch.float64)
    assert planner.topk_lengths(survival=nan, budget=1).tolist() == [0, 1]
    assert planner.argmax_budget(survival=nan, sps=rising) == 1


@pytest.mark.parametrize("seed", range(20))
def test_min_survival_torch_matches_reference(seed):
    rng = random.Random(500 + seed)
    n, k = rng.randint(1, 9), rng.randint(1, 7)
    surv = [[rng.choice([0.0, 1e-7, 1e-3, 0.25, 0.5, 1.0]) for _ in range(k)] for _ in range(n)]
    curve = SpsCurve(SpsCostTable(sample_batch_tokens=[1, 4, 9, 20], max_batch_tokens=20 + rng.randint(0, 60),
                                  sample_steps_per_sec=[float(rng.choice([40, 60, 80, 100])) for _ in range(4)]))
    t = torch.tensor(surv, dtype=torch.float64)
    for eps in (0.0, 1e-6, 0.3):
        assert planner.argmax_budget(survival=t, sps=curve, min_survival=eps) == planner.argmax_budget_reference(
            survival=surv, sps=lambda b, m: curve.scalar(batch_tokens=b, num_reqs=m), min_survival=eps)
        for b in range(n * k + 2):
            assert planner.topk_lengths(survival=t, budget=b, min_survival=eps).tolist() == \
                planner.topk_lengths_reference(survival=surv, budget=b, min_survival=eps)


def test_tree_extra_budget_hand_computed():
    # forced: root + 2 main nodes (3 rows, 1 + 0.9 + 0.5 = 2.4 tokens); extras sorted 0.3, 0.2, 0.05:
    # Theta = 2.4 * 100 = 240, 2.7 * 90 = 243, 2.9 * 80 = 232, 2.95 * 50 = 147.5 -> 1 extra
    curve = table([100, 100, 100, 90, 80, 50])
    kw = dict(forced_tau=2.4, forced_tokens=3, num_reqs=1)
    assert planner.tree_extra_budget(extra_values=torch.tensor([0.3, 0.05, 0.2]), sps=curve, **kw) == 1
    assert planner.tree_extra_budget_reference(extra_values=[0.3, 0.05, 0.2], **kw,
                                               sps=lambda b, n: curve.scalar(batch_tokens=b, num_reqs=n)) == 1
    # a flat curve admits every extra; a cliff right after the forced rows admits none
    assert planner.tree_extra_budget(extra_values=torch.tensor([0.3, 0.05, 0.2]), sps=table([100] * 6), **kw) == 3
    assert planner.tree_extra_budget(extra_values=torch.tensor([0.3, 0.05, 0.2]), sps=table([100, 100, 100, 10]), **kw) == 0
    assert planner.tree_extra_budget(extra_values=torch.tensor([]), sps=curve, **kw) == 0
    # a fixed 10 ms a step besides the verify: step 20, 21.1, 22.5, 30 ms for n = 0..3; Theta = 2.4 / 0.02 = 120,
    # 2.7 / 0.02111 = 127.9, 2.9 / 0.0225 = 128.9, 2.95 / 0.03 = 98.3 -> 2 extras (without it: 1)
    assert planner.tree_extra_budget(extra_values=torch.tensor([0.3, 0.05, 0.2]), sps=curve, fixed_seconds=0.01,
                                     **kw) == 2


def test_tree_extra_budget_matches_its_reference_on_random_trees():
    rng = random.Random(0)
    for _ in range(200):
        sps = sorted((rng.uniform(10, 100) for _ in range(rng.randint(2, 40))), reverse=True)
        curve = table(sps, max_batch_tokens=len(sps) + rng.randint(0, 8))  # beyond the largest: 0 steps/s
        num_reqs = rng.randint(1, 4)
        forced_tokens = min(len(sps), num_reqs * rng.randint(1, 4))
        extras = [rng.random() ** 2 for _ in range(rng.randint(0, 30))]
        kw = dict(forced_tau=num_reqs + rng.uniform(0, 3), forced_tokens=forced_tokens, num_reqs=num_reqs,
                  fixed_seconds=rng.choice([0.0, rng.uniform(0, 0.05)]))
        got = planner.tree_extra_budget(extra_values=torch.tensor(extras, dtype=torch.float64), sps=curve, **kw)
        want = planner.tree_extra_budget_reference(extra_values=extras, sps=lambda b, n, c=curve: c.scalar(
            batch_tokens=b, num_reqs=n), **kw)
        assert got == want
