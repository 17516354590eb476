import msgspec
import numpy as np
import pytest
import sglang_hspec.calibration.fit as fit_module
from sglang_hspec.calibration import (
    StsTemperatureIntervals,
    bootstrap_sts_intervals,
    fit_sts,
    intervals_path,
    load_intervals,
    save_intervals,
)
from sglang_hspec.calibration.synthetic import overconfident_records


@pytest.fixture(scope="module")
def issue_records():
    # the reference data: 20,000 records, 7 slots, over-confident by exactly T = 2.5; with seed 249 SGLang's
    # grid fit gives the reference's [2.51, 2.51, 2.24, 2.51, 2.82, 2.24, 2.51]
    return overconfident_records(n=20_000, block_size=7, temperature=2.5, seed=249)


def test_issue_case_grid_is_a_step_off_and_the_default_fit_is_not(issue_records):
    grid, _, _ = fit_sts(
        confidence_logits=issue_records.logits, prefix_mask=issue_records.prefix_mask, method="grid"
    )
    assert [round(t, 2) for t in grid] == [2.51, 2.51, 2.24, 2.51, 2.82, 2.24, 2.51]
    refined, _, _ = fit_sts(confidence_logits=issue_records.logits, prefix_mask=issue_records.prefix_mask)
    # what is left is sampling noise (the bootstrap below puts it at 2-4 % per slot at 20k records): slot 0
    # lands 4.3 % low on this data set, the grid's quantisation (12 % steps) is gone
    errors = np.abs(np.array(refined) / 2.5 - 1)
    grid_errors = np.abs(np.array(grid) / 2.5 - 1)
    assert errors.max() < 0.05 and grid_errors.max() > 0.1
    assert np.sqrt(np.mean(errors**2)) < 0.5 * np.sqrt(np.mean(grid_errors**2))


def test_intervals_cover_the_true_temperature_and_are_informative():
    """One data set of the reference's size (seed 0, the default everywhere here). For exact 95 % intervals all 7
    cover with probability ~0.7 (on the seed-249 data above slot 0's misses); the coverage rate itself is
    tested over 84 intervals below."""
    records = overconfident_records(n=20_000, block_size=7, temperature=2.5, seed=0)
    intervals = bootstrap_sts_intervals(
        confidence_logits=records.logits, prefix_mask=records.prefix_mask, num_resamples=200, seed=0
    )
    lower, upper = np.array(intervals.lower), np.array(intervals.upper)
    point = np.array(intervals.temperatures)
    assert (lower <= 2.5).all() and (2.5 <= upper).all(), (lower, upper)
    assert (lower <= point).all() and (point <= upper).all()
    assert ((upper - lower) / point < 0.15).all()  # +-7 % at most: 20k rows pin each slot down
    assert intervals.num_resamples == 200 and intervals.confidence == 0.95
    assert intervals.method == "nll" and intervals.num_samples == 20_000
    refit, _, _ = fit_sts(confidence_logits=records.logits, prefix_mask=records.prefix_mask)
    assert intervals.temperatures == refit


@pytest.mark.slow
def test_interval_coverage_is_near_nominal():
    """12 data sets x 7 slots = 84 intervals at 95 %: expect ~80 to cover T = 2.5. Asserting >= 72 fails
    with probability < 1e-3 for exact intervals (binomial, slots treated as independent) and catches
    intervals half as wide as they should be (~68 % coverage: >= 72 of 84 has probability < 5 %)."""
    covered = 0
    for seed in range(12):
        records = overconfident_records(n=4_000, block_size=7, temperature=2.5, seed=1000 + seed)
        intervals = bootstrap_sts_intervals(
            confidence_logits=records.logits, prefix_mask=records.prefix_mask, num_resamples=100, seed=seed
        )
        covered += sum(lo <= 2.5 <= hi for lo, hi in zip(intervals.lower, intervals.upper))
    assert covered >= 72, covered


def test_bootstrap_is_reproducible_and_seeded():
    records = overconfident_records(n=3_000, block_size=3, temperature=2.0, seed=7)
    run = lambda seed: bootstrap_sts_intervals(
        confidence_logits=records.logits, prefix_mask=records.prefix_mask, num_resamples=30, seed=seed
    )
    first, again, other = run(0), run(0), run(1)
    assert first == again
    assert first.lower != other.lower and first.temperatures == other.temperatures


def test_newton_fast_path_equals_the_full_search(monkeypatch):
    records = overconfident_records(n=3_000, block_size=4, temperature=2.5, seed=3)
    observed = np.arange(4)[None, :] < np.random.default_rng(0).integers(1, 5, size=(3_000, 1))
    args = dict(
        confidence_logits=records.logits,
        prefix_mask=records.prefix_mask & observed,
        observed_mask=observed,
        num_resamples=20,
    )
    fast = bootstrap_sts_intervals(**args)
    # without Newton every resample goes through the grid + Brent search of the point fit
    monkeypatch.setattr(fit_module, "_newton_log_loss", lambda **kwargs: None)
    slow = bootstrap_sts_intervals(**args)
    np.testing.assert_allclose(fast.lower, slow.lower, rtol=1e-5)
    np.testing.assert_allclose(fast.upper, slow.upper, rtol=1e-5)


@pytest.mark.parametrize("method", ["grid", "ece"])
def test_other_methods_resample_the_same_way(method):
    records = overconfident_records(n=2_000, block_size=2, temperature=2.5, seed=5)
    intervals = bootstrap_sts_intervals(
        confidence_logits=records.logits, prefix_mask=records.prefix_mask, method=method, num_resamples=10
    )
    assert intervals.method == method and intervals.block_size == 2
    assert all(lo <= t <= hi for t, lo, hi in zip(intervals.temperatures, intervals.lower, intervals.upper))


def test_interval_file_round_trip_and_validation(tmp_path):
    intervals = StsTemperatureIntervals(
        method="nll",
        confidence=0.95,
        num_resamples=200,
        seed=0,
        num_samples=10,
        temperatures=[2.0, 2.5],
        lower=[1.9, 2.3],
        upper=[2.1, 2.8],
    )
    assert intervals_path(tmp_path / "sts.json") == tmp_path / "sts.intervals.json"
    path = save_intervals(intervals, intervals_path(tmp_path / "sts.json"))
    assert load_intervals(path) == intervals
    assert msgspec.json.decode(path.read_bytes())["lower"] == [1.9, 2.3]
    with pytest.raises(ValueError, match="slot 1: interval"):
        StsTemperatureIntervals(**{**msgspec.structs.asdict(intervals), "lower": [1.9, 2.9]})
    with pytest.raises(ValueError, match="one temperature, lower and upper bound per slot"):
        StsTemperatureIntervals(**{**msgspec.structs.asdict(intervals), "upper": [2.1]})
    (tmp_path / "bad.intervals.json").write_text('{"method": "nll"}')
    with pytest.raises(ValueError, match="bad.intervals.json is not a valid STS interval file"):
        load_intervals(tmp_path / "bad.intervals.json")


def test_bootstrap_rejects_bad_settings():
    logits, prefix = np.zeros((4, 2)), np.zeros((4, 2))
    with pytest.raises(ValueError, match="at least 2 resamples"):
        bootstrap_sts_intervals(confidence_logits=logits, prefix_mask=prefix, num_resamples=1)
    with pytest.raises(ValueError, match=r"confidence level must be in \(0, 1\)"):
        bootstrap_sts_intervals(confidence_logits=logits, prefix_mask=prefix, confidence=95)
    with pytest.raises(ValueError, match="3 temperatures given for 2 slots"):
        bootstrap_sts_intervals(confidence_logits=logits, prefix_mask=prefix, temperatures=[1.0] * 3)
