"""scripts/bench_policies.py: the order in which each round runs its configurations, and the policy variants."""

import pytest


@pytest.fixture(scope="module")
def bench(load_script):
    return load_script("bench_policies")


CONFIGS = [("none", "plain"), ("none", "plain-aa"), ("shipped", "auto"), ("random", "auto")]


def test_warm_up_runs_plain_alone(bench):
    assert bench.round_order(CONFIGS, -1, "shuffle") == [("none", "plain")]
    assert bench.round_order(CONFIGS, -1, "alternate") == [("none", "plain")]


def test_alternate_reverses_odd_rounds(bench):
    assert bench.round_order(CONFIGS, 0, "alternate") == CONFIGS
    assert bench.round_order(CONFIGS, 3, "alternate") == CONFIGS[::-1]


def test_shuffle_is_a_seeded_permutation_that_moves_every_configuration(bench):
    rounds = [bench.round_order(CONFIGS, r, "shuffle") for r in range(7)]
    assert all(sorted(o) == sorted(CONFIGS) for o in rounds)
    assert rounds == [bench.round_order(CONFIGS, r, "shuffle") for r in range(7)]  # same in every run
    # the seeds 0-6 put each configuration in at least two different positions, and plain first at most 3 times
    for c in CONFIGS:
        assert len({o.index(c) for o in rounds}) >= 2
    assert sum(o[0] == ("none", "plain") for o in rounds) <= 3


def test_policy_variants_name_the_guard_and_its_prior(bench):
    assert bench.policy_variant("auto") == ("auto", True, None)
    assert bench.policy_variant("auto-unguarded") == ("auto", False, None)
    assert bench.policy_variant("auto-prior4") == ("auto", True, 4.0)
    assert bench.policy_variant("auto-prior0.5") == ("auto", True, 0.5)
    assert bench.policy_variant("fixed") == ("fixed", True, None)
    for bad in ("auto-prior", "auto-prior0", "auto-priorx"):
        with pytest.raises(SystemExit, match="auto-prior<N> with a prior N > 0"):
            bench.policy_variant(bad)


def test_paired_ratios_divide_by_plain_and_by_the_better_of_plain_and_always_drafting(bench):
    rows = [{"batch": 1, "round": 0, "drafter": "none", "policy": "plain", "throughput_tok_s": 10.0},
            {"batch": 1, "round": 0, "drafter": "d", "policy": "fixed", "throughput_tok_s": 15.0},
            {"batch": 1, "round": 0, "drafter": "d", "policy": "auto", "throughput_tok_s": 12.0},
            {"batch": 1, "round": 1, "drafter": "none", "policy": "plain", "throughput_tok_s": 20.0},
            {"batch": 1, "round": 1, "drafter": "d", "policy": "fixed", "throughput_tok_s": 16.0},
            {"batch": 1, "round": 1, "drafter": "d", "policy": "auto", "throughput_tok_s": 19.0},
            {"batch": 1, "round": 1, "drafter": "e", "policy": "auto", "throughput_tok_s": 30.0}]
    bench.add_paired_ratios(rows)
    assert [r["x_plain"] for r in rows] == [1.0, 1.5, 1.2, 1.0, 0.8, 0.95, 1.5]
    # round 0: always drafting wins (15); round 1: plain wins (20); drafter e ran no fixed: no yardstick
    assert [r["x_best"] for r in rows] == [None, 1.0, 0.8, None, 0.8, 0.95, None]  # plain rows: no drafter
    summary = {(r["drafter"], r["policy"]): r for r in bench.summarize(
        [{**r, "tau": 1.0, "steps": 1, "drafted_steps": 1, "verified_drafts_per_step": 0.0, "same_as_plain": True}
         for r in rows])}
    assert summary[("d", "auto")]["x_best"] == pytest.approx(0.875)  # median of 0.8 and 0.95
    assert summary[("d", "auto")]["x_best_min"] == 0.8
    assert summary[("e", "auto")]["x_best"] is None


def test_request_waves_serve_the_stream_batch_by_batch(bench):
    assert bench.request_waves(80, batch_size=1, requests=3) == [[0], [1], [2]]
    assert bench.request_waves(80, batch_size=4, requests=6) == [[0, 1, 2, 3], [4, 5, 6, 7]]  # whole batches
    assert bench.request_waves(80, batch_size=32, requests=16) == [list(range(32))]  # at least one batch
    assert bench.request_waves(3, batch_size=2, requests=4) == [[0, 1], [2, 0]]  # prompts reused in turn
    with pytest.raises(ValueError, match="batch_size, requests and prompts >= 1"):
        bench.request_waves(3, batch_size=0, requests=4)
