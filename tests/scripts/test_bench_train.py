"""scripts/bench_train.py: the order of the rows in each round, and ratios paired within a round."""

import pytest


@pytest.fixture(scope="module")
def bench(load_script):
    return load_script("bench_train")


ROWS = [("baseline", []), ("all_exact", ["x"]), ("feature_cache", ["y"]), ("bf16", ["z"])]


def test_one_round_runs_the_rows_as_listed(bench):
    assert bench.round_order(ROWS, 0, 1) == ROWS


def test_rounds_are_seeded_permutations_that_move_every_row(bench):
    orders = [bench.round_order(ROWS, r, 5) for r in range(5)]
    assert all(sorted(o) == sorted(ROWS) for o in orders)
    assert orders == [bench.round_order(ROWS, r, 5) for r in range(5)]  # the same in every run
    for row in ROWS:
        assert len({o.index(row) for o in orders}) >= 2


def test_ratios_pair_each_round_with_its_own_baseline(bench):
    # round 2 ran on a machine twice as slow: unpaired medians would read 100 / 40 = 2.5x, paired 3x every round
    rates = {"baseline": [40.0, 50.0, 20.0], "all_exact": [120.0, 150.0, 60.0], "noisy": [40.0, 100.0, 30.0]}
    got = bench.paired_ratios(rates, "baseline")
    assert got["baseline"] == (1.0, 1.0, 1.0)
    assert got["all_exact"] == pytest.approx((3.0, 3.0, 3.0))
    assert got["noisy"] == pytest.approx((1.5, 1.0, 2.0))  # ratios 1.0, 2.0, 1.5


def test_ratios_need_the_same_rounds_for_every_row(bench):
    with pytest.raises(ValueError, match="'all_exact' has 2 rounds, the baseline 3"):
        bench.paired_ratios({"baseline": [1.0, 2.0, 3.0], "all_exact": [1.0, 2.0]}, "baseline")

