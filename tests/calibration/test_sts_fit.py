import math
import warnings

import numpy as np
import pytest
from sglang_hspec.calibration import (
    ConfidenceRecords,
    default_temperature_grid,
    expected_calibration_error,
    fit_sts,
    records_metrics,
)
from sglang_hspec.calibration.fit import _cumulative_log_loss, _fit_temperatures, fit_sts_calibration
from sglang_hspec.calibration.synthetic import drafter_like_records, overconfident_records

# halfway (in log T) between the grid points 10**0.35 = 2.239 and 10**0.40 = 2.512: 5.6 % from both
OFF_GRID_T = 10**0.375


def sglang_grid_fit(logits, prefix_mask, grid, num_bins=15):
    """Reference twin of SGLang's `fit_sts_temperatures`: a plain loop over the grid, strict `<` (so ties
    keep the smallest T), cumulative survival on every row."""
    survival = np.ones(len(logits))
    temperatures = []
    for slot in range(logits.shape[1]):
        best_t, best_ece = None, math.inf
        for t in grid:
            candidate = survival / (1.0 + np.exp(-logits[:, slot].astype(np.float64) / t))
            ece = expected_calibration_error(probs=candidate, labels=prefix_mask[:, slot], num_bins=num_bins)
            if ece < best_ece:
                best_t, best_ece = float(t), ece
        temperatures.append(best_t)
        survival = survival / (1.0 + np.exp(-logits[:, slot].astype(np.float64) / best_t))
    return temperatures


def test_default_grid_is_sglangs():
    grid = default_temperature_grid()
    assert grid.shape == (41,) and grid[0] == pytest.approx(0.1) and grid[-1] == pytest.approx(10.0)
    np.testing.assert_allclose(np.diff(np.log10(grid)), 0.05)
    with pytest.raises(ValueError, match="0 < low < high"):
        default_temperature_grid(low=2.0, high=1.0)


def test_log_loss_objective_hand_computed():
    # slot survival before: 0.5 and 1.0; logits ln 3 and 0; labels accepted, rejected; T = 1 and 2
    log_before = np.log([0.5, 1.0])
    logits = np.array([math.log(3.0), 0.0])
    got = _cumulative_log_loss(
        log_survival_before=log_before,
        slot_logits=logits,
        labels=np.array([1.0, 0.0]),
        candidates=np.array([1.0, 2.0]),
    )
    # T = 1: accepted row -log(0.75) (its -log 0.5 prefix does not depend on T), rejected row -log(1 - 0.5)
    # T = 2: sigmoid(ln 3 / 2) = sqrt 3 / (1 + sqrt 3); the rejected row still has sigmoid(0) = 0.5
    c = math.sqrt(3.0) / (1.0 + math.sqrt(3.0))
    expected = [(-math.log(0.75) - math.log(0.5)) / 2, (-math.log(c) - math.log(0.5)) / 2]
    np.testing.assert_allclose(got, expected, rtol=1e-12)


def test_default_fit_recovers_known_overconfidence_within_3_percent():
    records = overconfident_records(n=200_000, block_size=7, temperature=2.5, seed=0)
    temperatures, before, after = fit_sts(confidence_logits=records.logits, prefix_mask=records.prefix_mask)
    assert all(abs(t / 2.5 - 1) < 0.03 for t in temperatures), temperatures
    assert all(b >= 4 * a for b, a in zip(before, after))
    # reported ECE after the fit equals the metrics library on the same data
    m = records_metrics(records, temperatures=temperatures)
    np.testing.assert_allclose(m.ece, after, rtol=1e-9)


def test_refinement_finds_temperatures_between_grid_points():
    """Fails if the refinement is skipped: the truth is 5.6 % from the nearest grid point."""
    records = overconfident_records(n=200_000, block_size=7, temperature=OFF_GRID_T, seed=0)
    grid = default_temperature_grid()
    on_grid, _, _ = fit_sts(confidence_logits=records.logits, prefix_mask=records.prefix_mask, method="grid")
    assert min(abs(g / OFF_GRID_T - 1) for g in grid) > 0.05
    assert all(abs(t / OFF_GRID_T - 1) > 0.05 for t in on_grid), on_grid
    refined, _, _ = fit_sts(confidence_logits=records.logits, prefix_mask=records.prefix_mask)
    assert all(abs(t / OFF_GRID_T - 1) < 0.03 for t in refined), refined
    assert not set(refined) & set(grid.tolist())


def test_grid_method_reproduces_sglangs_grid_fit():
    # the reference case: 20,000 records, 7 slots, true T = 2.5
    records = overconfident_records(n=20_000, block_size=7, temperature=2.5, seed=0)
    grid = default_temperature_grid()
    ours, _, _ = fit_sts(confidence_logits=records.logits, prefix_mask=records.prefix_mask, method="grid")
    assert ours == sglang_grid_fit(records.logits, records.prefix_mask, grid)
    drafter_like = drafter_like_records(n=5_000, seed=3)
    ours, _, _ = fit_sts(
        confidence_logits=drafter_like.logits, prefix_mask=drafter_like.prefix_mask, method="grid"
    )
    assert ours == sglang_grid_fit(drafter_like.logits, drafter_like.prefix_mask, grid)
    assert set(ours) <= set(grid.tolist())


def test_ece_refinement_never_scores_worse_than_its_grid_point():
    records = drafter_like_records(n=20_000, seed=4)
    eces = {}
    for method in ("grid", "ece"):
        temperatures, _, after = fit_sts(
            confidence_logits=records.logits, prefix_mask=records.prefix_mask, method=method
        )
        eces[method] = after
    # slot 0 has the same (empty) prefix for both, so the refined ECE is at most the grid one there
    assert eces["ece"][0] <= eces["grid"][0]
    assert np.mean(eces["ece"]) < np.mean(eces["grid"])


def test_calibrated_head_keeps_unit_temperature():
    records = overconfident_records(n=100_000, block_size=3, temperature=1.0, seed=1)
    grid, _, _ = fit_sts(confidence_logits=records.logits, prefix_mask=records.prefix_mask, method="grid")
    assert grid == pytest.approx([1.0, 1.0, 1.0])
    refined, _, _ = fit_sts(confidence_logits=records.logits, prefix_mask=records.prefix_mask)
    assert refined == pytest.approx([1.0, 1.0, 1.0], rel=0.03)


def test_held_out_ece_on_drafter_like_records():
    fit_rows = drafter_like_records(n=50_000, seed=1)
    held_out = drafter_like_records(n=50_000, seed=2)
    sts = fit_sts_calibration(fit_rows, dataset="drafter-like")
    raw = records_metrics(held_out)
    cal = records_metrics(held_out, temperatures=sts)
    assert raw.mean_slot_ece > 0.03  # the raw head is over-confident, as DSpark reports (3-8%)
    assert cal.mean_slot_ece <= 0.015 and cal.overall_ece <= 0.015
    assert max(e for e in cal.ece if e is not None) <= 0.015
    assert all(t > 1.0 for t in sts.temperatures)  # over-confidence -> softening temperatures
    assert sts.num_samples == 50_000 and len(sts.ece_after) == 7


def test_log_loss_of_the_product_not_of_each_slot():
    """Shared per-request difficulty makes per-slot calibrated confidences multiply into an over-confident
    survival; the cumulative objective corrects it, the conditional one (each slot alone, on the rows that
    reached it) does not."""
    fit_rows = drafter_like_records(n=50_000, seed=1)
    held_out = drafter_like_records(n=50_000, seed=2)
    logits, labels = fit_rows.logits.astype(np.float64), fit_rows.prefix_mask.astype(np.float64)
    grid = default_temperature_grid()
    conditional = []
    for slot in range(fit_rows.block_size):
        reached = np.ones(len(logits), bool) if slot == 0 else labels[:, slot - 1] > 0
        # the first slot alone with a zero prefix is the conditional log loss on the reached rows
        conditional += _fit_temperatures(
            logits[reached][:, [slot]],
            labels[reached][:, [slot]],
            np.ones((reached.sum(), 1), bool),
            grid=grid,
            method="nll",
            num_bins=15,
            min_samples=1,
            warn=False,
        )
    cumulative, _, _ = fit_sts(confidence_logits=logits, prefix_mask=labels)
    assert records_metrics(held_out, temperatures=cumulative).mean_slot_ece <= 0.01
    assert records_metrics(held_out, temperatures=conditional).mean_slot_ece >= 0.012


def test_slot_without_data_keeps_unit_temperature_with_warning():
    rng = np.random.default_rng(0)
    logits = rng.normal(2.0, 2.0, size=(500, 4)).astype(np.float32)
    prefix = np.zeros((500, 4), bool)
    prefix[:, 0] = rng.random(500) < 0.5  # nobody gets past slot 0, so slots 2 and 3 are never reached
    for method in ("nll", "grid"):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            temperatures, _, _ = fit_sts(confidence_logits=logits, prefix_mask=prefix, method=method)
        assert [str(w.message).split(":")[0] for w in caught] == ["STS slot 2", "STS slot 3"]
        assert "0 observed records reached it" in str(caught[0].message)
        assert temperatures[2:] == [1.0, 1.0]


def test_censored_slots_are_not_counted_as_rejections():
    records = overconfident_records(n=100_000, block_size=4, temperature=2.5, seed=2)
    rng = np.random.default_rng(5)
    caps = rng.integers(1, 5, size=(records.num_samples, 1))  # verified drafts per row (compact verify)
    observed = np.arange(4)[None, :] < caps
    censored = ConfidenceRecords(records.logits, records.prefix_mask & observed, observed)
    fitted, _, _ = fit_sts(
        confidence_logits=censored.logits,
        prefix_mask=censored.prefix_mask,
        observed_mask=censored.observed_mask,
    )
    naive, _, _ = fit_sts(confidence_logits=censored.logits, prefix_mask=censored.prefix_mask)
    assert all(abs(t / 2.5 - 1) < 0.05 for t in fitted), fitted
    # treating unverified slots as rejections fakes extra over-confidence: a far too soft temperature
    assert naive[-1] > 5.0


def test_fit_rejects_bad_input():
    with pytest.raises(ValueError, match="no records"):
        fit_sts(confidence_logits=np.zeros((0, 3)), prefix_mask=np.zeros((0, 3)))
    with pytest.raises(ValueError, match="NaN or inf"):
        fit_sts(confidence_logits=np.array([[np.nan, 0.0]]), prefix_mask=np.zeros((1, 2)))
    with pytest.raises(ValueError, match="grid"):
        fit_sts(confidence_logits=np.zeros((2, 2)), prefix_mask=np.zeros((2, 2)), grid=np.array([1.0, -1.0]))
    with pytest.raises(ValueError, match="unknown STS fit method 'brent'; choose one of nll, ece, grid"):
        fit_sts(confidence_logits=np.zeros((2, 2)), prefix_mask=np.zeros((2, 2)), method="brent")
