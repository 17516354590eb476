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
