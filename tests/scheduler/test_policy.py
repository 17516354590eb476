import logging
import random

import pytest
import torch
from sglang_hspec.scheduler import planner
from sglang_hspec.scheduler.policy import ExactPolicy, FixedPolicy, StalePolicy, ThresholdPolicy
from sglang_hspec.scheduler.sps import SpsCostTable, SpsCurve

# Theta for one request with survivals (s1, s2, ...): 100, (1+s1)*60, (1+s1+s2)*60, ...
JAGGED = SpsCostTable(sample_batch_tokens=[1, 2, 3, 4], sample_steps_per_sec=[100.0, 60.0, 60.0, 60.0],
                      max_batch_tokens=4)
UNINIT = SpsCostTable(sample_batch_tokens=[1], sample_steps_per_sec=[1.0], max_batch_tokens=64)


def call(policy, conf, slots, gens):
    return policy.plan(confidences=torch.tensor(conf, dtype=torch.float64),
                       slot_ids=torch.tensor(slots, dtype=torch.long),
                       generations=torch.tensor(gens, dtype=torch.long)).tolist()


HIGH = [[0.99, 0.99, 0.99]]  # Theta 100, 119.4, 178.2, 236.4: verify all
LOW = [[0.2, 0.2, 0.2]]  # Theta 100, 72, 74.4, 74.9: verify none


def test_stale_uses_confidences_exactly_two_steps_old():
    p = StalePolicy(JAGGED, lag=2)
    # steps 0, 1: no history -> unknown rows count as survival 1 -> budget 3 -> top-3 of current
    assert call(p, LOW, [0], [0]) == [3]
    assert call(p, HIGH, [0], [0]) == [3]
    assert p.stats().unknown_rows == 2
    # step 2 plans its budget with step 0's LOW confidences: 0, whatever today's confidences say
    assert call(p, HIGH, [0], [0]) == [0]
    assert p.last_planned_budget == 0
    # step 3 reads step 1 (HIGH): budget 3, applied to today's LOW row (top-3 of one row = 3)
    assert call(p, LOW, [0], [0]) == [3]
    assert p.stats().unknown_rows == 2 and p.stats().steps == 4


def test_generation_guard_reused_slot_never_inherits_confidences():
    p = StalePolicy(JAGGED, lag=2)
    call(p, LOW, [5], [0])  # request A in slot 5 (would give budget 0 two steps later)
    call(p, LOW, [5], [0])
    # request B reuses slot 5 with a new generation: A's LOW history must not be used
    assert call(p, HIGH, [5], [1]) == [3]
    assert p.stats().unknown_rows == 3
    # while request A (same generation) would have been planned from its own history:
    q = StalePolicy(JAGGED, lag=2)
    call(q, LOW, [5], [0]), call(q, LOW, [5], [0])
    assert call(q, HIGH, [5], [0]) == [0]


def test_slot_absent_for_a_step_does_not_read_older_snapshot():
    p = StalePolicy(JAGGED, lag=2)
    call(p, LOW, [0], [0])  # step 0 writes slot 0
    call(p, HIGH, [1], [0])  # step 1: slot 0 absent
    call(p, HIGH, [1], [0])  # step 2 overwrites ring entry 0: slot 0's step-0 row is forgotten
    call(p, HIGH, [1], [0])
    assert call(p, HIGH, [0], [0]) == [3]  # step 4: unknown (would be 0 if the step-0 LOW leaked)


def test_stale_many_requests_top_k_of_current_survivals():
    p = StalePolicy(SpsCostTable(sample_batch_tokens=[1, 3, 4], sample_steps_per_sec=[100.0, 100.0, 10.0],
                                 max_batch_tokens=8), lag=2)
    conf = [[0.9, 0.9], [0.5, 0.5]]
    # unknown rows -> survivals all 1: Theta(n) = (2+n)*100 for B=2+n <= 3, then *10 -> budget 1
    assert call(p, conf, [0, 1], [0, 0]) == [1, 0]
    assert call(p, [[0.5, 0.5], [0.9, 0.9]], [0, 1], [0, 0]) == [0, 1]  # the best current slot wins


def test_exact_policy_and_fixed_and_threshold():
    assert call(ExactPolicy(JAGGED), HIGH, [0], [0]) == [3]
    assert call(ExactPolicy(JAGGED), LOW, [0], [0]) == [0]
    assert call(FixedPolicy(2), LOW * 2, [0, 1], [0, 0]) == [2, 2]
    assert call(FixedPolicy(9), LOW, [0], [0]) == [3]
    # survivals 0.9, 0.72, 0.36 -> threshold 0.5 keeps two
    assert call(ThresholdPolicy(0.5), [[0.9, 0.8, 0.5]], [0], [0]) == [2]


def test_uninitialised_table_is_an_error_or_a_loud_visible_fallback(caplog):
    for cls in (ExactPolicy, StalePolicy):
        with pytest.raises(ValueError, match="never profiled"):
            cls(UNINIT)
        with caplog.at_level(logging.WARNING):
            p = cls(UNINIT, allow_uninitialised=True)
        assert "uninitialised SPS table" in caplog.text
        assert call(p, LOW * 2, [0, 1], [0, 0]) == [3, 3]
        s = p.stats()
        assert s.fallback and "uninitialised" in s.fallback_reason and s.last_budget == 6
        caplog.clear()
    assert not StalePolicy(JAGGED).stats().fallback


def test_bad_ids_are_rejected():
    p = StalePolicy(JAGGED)
    with pytest.raises(ValueError, match="slot_ids must be a"):
        p.plan(confidences=torch.ones(2, 3), slot_ids=torch.tensor([0]), generations=torch.tensor([0, 0]))
    with pytest.raises(ValueError, match="block_size=3"):
        call(p, HIGH, [0], [0])
        call(p, [[0.5, 0.5]], [0], [0])


def stale_reference(steps, *, table, lag, k):
    """Plain-Python StalePolicy: history[t] = {slot: (generation, survival row)}."""
    sps = lambda b, n: SpsCurve(table).scalar(batch_tokens=b, num_reqs=n)
    history, out = [], []
    for conf, slots, gens in steps:
        surv = planner.survivals_reference(confidences=conf)
        old_step = history[-lag] if len(history) >= lag else {}
        old = [old_step[s][1] if s in old_step and old_step[s][0] == g else [1.0] * k
               for s, g in zip(slots, gens)]
        budget = planner.argmax_budget_reference(survival=old, sps=sps)
        out.append(planner.topk_lengths_reference(survival=surv, budget=budget))
        history.append({s: (g, row) for s, g, row in zip(slots, gens, surv)})
    return out


@pytest.mark.parametrize("seed", range(5))
def test_stale_policy_matches_reference_with_slot_reuse_and_gaps(seed):
    rng = random.Random(seed)
    table = SpsCostTable(sample_batch_tokens=[1, 6, 12, 20], sample_steps_per_sec=[100.0, 80.0, 85.0, 50.0],
                         max_batch_tokens=40)
    k, gens, steps = 3, [0] * 6, []
    for _ in range(40):
        slots = sorted(rng.sample(range(6), rng.randint(1, 5)))  # some slots skip steps
        for s in slots:
            if rng.random() < 0.15:
                gens[s] += 1  # the slot is reused by a new request
        conf = [[rng.choice([0.25, 0.5, 0.75, 1.0]) for _ in range(k)] for _ in slots]
        steps.append((conf, slots, [gens[s] for s in slots]))
    policy = StalePolicy(table, lag=2)
    got = [call(policy, conf, slots, g) for conf, slots, g in steps]
    assert got == stale_reference(steps, table=table, lag=2, k=k)
