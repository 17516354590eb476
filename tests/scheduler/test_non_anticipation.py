"""DSpark Appendix A: a verify-length decision that reads c_{j+1} (which depends on the drafted x_j
through the Markov feature) decides *which already-drawn tokens* get verified, and biases the output.

Toy step: target p = (0.7, 0.3) over {0, 1}; the drafter draws x_1 ~ q = (0.5, 0.5); c_1 is 0.5 or 0.9
(context noise, independent of x_1); c_2 = 0.95 if x_1 == 0 else 0.05. If x_1 is verified, standard
speculative sampling (accept w.p. min(1, p/q), else resample from (p - q)+) emits exactly p; if not,
the target samples p directly. Only a decision that depends on x_1 itself can bias the first token.
"""

import random

import pytest
import torch
from scipy.stats import chisquare
from sglang_hspec.scheduler import planner
from sglang_hspec.scheduler.policy import ExactPolicy, StalePolicy
from sglang_hspec.scheduler.sps import SpsCostTable

P, Q = (0.7, 0.3), (0.5, 0.5)
TABLE = SpsCostTable(sample_batch_tokens=[1, 2, 3], sample_steps_per_sec=[100.0, 60.0, 60.0], max_batch_tokens=3)
N = 8000


def first_token(x1: int, verify_len: int, rng: random.Random) -> int:
    if verify_len >= 1:
        if rng.random() < min(1.0, P[x1] / Q[x1]):
            return x1
        return 0  # residual (p - q)+ = (0.2, 0) -> always 0
    return 0 if rng.random() < P[0] else 1


def run(plan) -> list[int]:
    rng = random.Random(1234)
    counts = [0, 0]
    for _ in range(N):
        c1 = rng.choice([0.5, 0.9])
        x1 = 0 if rng.random() < Q[0] else 1
        conf = torch.tensor([[c1, 0.95 if x1 == 0 else 0.05]], dtype=torch.float64)
        counts[first_token(x1, plan(conf), rng)] += 1
    return counts


def p_value(counts: list[int]) -> float:
    return float(chisquare(counts, [N * P[0], N * P[1]]).pvalue)


def anticipating(conf):
    # argmax of Theta over this step's survivals: reads c_2, hence x_1, before deciding on x_1
    surv = planner.survivals_reference(confidences=conf.tolist())
    budget = planner.argmax_budget_reference(survival=surv, sps=lambda b, n: TABLE.lookup(b))
    return planner.topk_lengths_reference(survival=surv, budget=budget)[0]


def test_anticipating_planner_biases_the_output():
    counts = run(anticipating)
    # exact bias: c_1 = 0.5 -> verify iff x_1 = 0 -> P(0) = 0.85; c_1 = 0.9 -> verify all -> 0.7
    assert counts[0] / N == pytest.approx(0.775, abs=0.01)
    assert p_value(counts) < 1e-12


def test_exact_planner_with_early_stop_keeps_the_target_distribution():
    policy = ExactPolicy(TABLE)
    ids = torch.zeros(1, dtype=torch.long)
    lens = []

    def plan(conf):
        lens.append(int(policy.plan(confidences=conf, slot_ids=ids, generations=ids)[0]))
        return lens[-1]

    counts = run(plan)
    assert 0 in lens and 2 in lens  # it does verify x_1 in some steps and not in others
    assert p_value(counts) > 0.01


def test_stale_planner_keeps_the_target_distribution():
    policy = StalePolicy(TABLE, lag=2)
    ids = torch.zeros(1, dtype=torch.long)
    lens = []

    def plan(conf):
        lens.append(int(policy.plan(confidences=conf, slot_ids=ids, generations=ids)[0]))
        return lens[-1]

    counts = run(plan)
    assert lens.count(0) > N // 10 and lens.count(2) > N // 10  # the 2-step-old budget varies
    assert p_value(counts) > 0.01
