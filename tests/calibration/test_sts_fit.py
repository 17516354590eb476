import warnings

import numpy as np
import pytest
from sglang_hspec.calibration import ConfidenceRecords, default_temperature_grid, fit_sts, records_metrics
from sglang_hspec.calibration.fit import fit_sts_calibration
from sglang_hspec.calibration.synthetic import drafter_like_records, overconfident_records


def test_default_grid_is_sglangs():
    grid = default_temperature_grid()
    assert grid.shape == (41,) and grid[0] == pytest.approx(0.1) and grid[-1] == pytest.approx(10.0)
    np.testing.assert_allclose(np.diff(np.log10(grid)), 0.05)
    with pytest.raises(ValueError, match="0 < low < high"):
        default_temperature_grid(low=2.0, high=1.0)


def test_recovers_synthetic_overconfidence_at_every_slot():
    records = overconfident_records(n=200_000, gamma=7, temperature=2.5, seed=0)
    temperatures, before, after = fit_sts(confidence_logits=records.logits, prefix_mask=records.prefix_mask)
    assert all(abs(t / 2.5 - 1) < 0.10 for t in temperatures), temperatures
    assert np.mean(before) >= 4 * np.mean(after)
    assert all(b >= 4 * a for b, a in zip(before, after))
    # reported ECE after the fit equals the metrics library on the same data
    m = records_metrics(records, temperatures=temperatures)
    np.testing.assert_allclose(m.ece, after, rtol=1e-9)


def test_calibrated_head_keeps_unit_temperature():
    records = overconfident_records(n=100_000, gamma=3, temperature=1.0, seed=1)
    temperatures, _, _ = fit_sts(confidence_logits=records.logits, prefix_mask=records.prefix_mask)
    assert temperatures == pytest.approx([1.0, 1.0, 1.0])


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


def test_slot_without_data_keeps_unit_temperature_with_warning():
    rng = np.random.default_rng(0)
    logits = rng.normal(2.0, 2.0, size=(500, 4)).astype(np.float32)
    prefix = np.zeros((500, 4), bool)
    prefix[:, 0] = rng.random(500) < 0.5  # nobody gets past slot 0, so slots 2 and 3 are never reached
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        temperatures, _, _ = fit_sts(confidence_logits=logits, prefix_mask=prefix)
    assert [str(w.message).split(":")[0] for w in caught] == ["STS slot 2", "STS slot 3"]
    assert "0 observed records reached it" in str(caught[0].message)
    assert temperatures[2:] == [1.0, 1.0]


def test_censored_slots_are_not_counted_as_rejections():
    records = overconfident_records(n=100_000, gamma=4, temperature=2.5, seed=2)
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
    assert all(abs(t / 2.5 - 1) < 0.15 for t in fitted), fitted
    # treating unverified slots as rejections fakes extra over-confidence: a far too soft temperature
    assert naive[-1] > 5.0


def test_fit_rejects_bad_input():
    with pytest.raises(ValueError, match="no records"):
        fit_sts(confidence_logits=np.zeros((0, 3)), prefix_mask=np.zeros((0, 3)))
    with pytest.raises(ValueError, match="NaN or inf"):
        fit_sts(confidence_logits=np.array([[np.nan, 0.0]]), prefix_mask=np.zeros((1, 2)))
    with pytest.raises(ValueError, match="grid"):
        fit_sts(confidence_logits=np.zeros((2, 2)), prefix_mask=np.zeros((2, 2)), grid=np.array([1.0, -1.0]))
