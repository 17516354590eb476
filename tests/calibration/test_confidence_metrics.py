import numpy as np
import pytest
from sglang_hspec.calibration import (
    confidence_metrics,
    expected_calibration_error,
    reliability_bins,
    survival_metrics,
)
from sglang_hspec.calibration.metrics import batched_ece
from sklearn.calibration import calibration_curve
from sklearn.metrics import roc_auc_score


def test_ece_hand_computed():
    # 2 bins: {0.1, 0.2} -> |0.15 - 0.5| * 2/4 = 0.175 ; {0.7, 0.9} -> |0.8 - 1.0| * 2/4 = 0.1
    ece = expected_calibration_error(
        probs=np.array([0.1, 0.2, 0.7, 0.9]), labels=np.array([0, 1, 1, 1]), num_bins=2
    )
    assert ece == pytest.approx(0.275, abs=1e-12)
    # a single perfectly calibrated bin: 0 error; everything over-confident: the whole gap
    assert (
        expected_calibration_error(probs=np.full(4, 0.5), labels=np.array([0, 1, 0, 1]), num_bins=15) == 0.0
    )
    assert expected_calibration_error(
        probs=np.full(10, 0.95), labels=np.zeros(10), num_bins=15
    ) == pytest.approx(0.95)
    assert np.isnan(expected_calibration_error(probs=np.array([]), labels=np.array([])))


def _ece_from_sklearn(probs, labels, num_bins):
    prob_true, prob_pred = calibration_curve(labels, probs, n_bins=num_bins, strategy="uniform")
    counts, _ = np.histogram(probs, bins=np.linspace(0, 1, num_bins + 1))
    counts = counts[counts > 0]
    return float(np.sum(counts / len(probs) * np.abs(prob_true - prob_pred)))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_ece_matches_sklearn_calibration_curve(seed):
    rng = np.random.default_rng(seed)
    probs = rng.beta(2.0, 1.2, size=5000)
    labels = (rng.random(5000) < probs**1.7).astype(int)  # miscalibrated on purpose
    ours = expected_calibration_error(probs=probs, labels=labels, num_bins=15)
    assert ours > 0.05
    assert ours == pytest.approx(_ece_from_sklearn(probs, labels, 15), rel=1e-9)
    bins = reliability_bins(probs=probs, labels=labels, num_bins=15)
    prob_true, prob_pred = calibration_curve(labels, probs, n_bins=15, strategy="uniform")
    filled = np.asarray(bins.count) > 0
    np.testing.assert_allclose(np.asarray(bins.observed)[filled], prob_true, rtol=1e-12)
    np.testing.assert_allclose(np.asarray(bins.mean_predicted)[filled], prob_pred, rtol=1e-12)
    assert sum(bins.count) == 5000


def test_batched_ece_equals_row_by_row():
    rng = np.random.default_rng(3)
    probs = rng.random((6, 400))
    labels = (rng.random(400) < 0.4).astype(float)
    batched = batched_ece(probs=probs, labels=labels, num_bins=15)
    single = [expected_calibration_error(probs=p, labels=labels, num_bins=15) for p in probs]
    np.testing.assert_allclose(batched, single, rtol=1e-12)


def test_calibrated_data_has_small_ece():
    rng = np.random.default_rng(4)
    probs = rng.random(200_000)
    labels = rng.random(200_000) < probs
    assert expected_calibration_error(probs=probs, labels=labels, num_bins=15) < 0.005


def test_survival_metrics_per_slot_and_overall():
    survival = np.array([[0.9, 0.6], [0.8, 0.3], [0.4, 0.1], [0.7, 0.5]])
    prefix = np.array([[1, 1], [1, 0], [0, 0], [1, 0]], dtype=bool)
    m = survival_metrics(survival=survival, prefix_mask=prefix, num_bins=15)
    assert m.num_samples == 4 and m.block_size == 2 and m.num_observed == [4, 4]
    assert m.brier[0] == pytest.approx(np.mean((survival[:, 0] - prefix[:, 0]) ** 2))
    assert m.brier[1] == pytest.approx((0.4**2 + 0.3**2 + 0.1**2 + 0.5**2) / 4)
    assert m.mean_predicted == pytest.approx([0.7, 0.375]) and m.mean_observed == pytest.approx([0.75, 0.25])
    assert m.auroc[0] == pytest.approx(1.0) and m.auroc[1] == pytest.approx(1.0)
    assert m.overall_auroc == pytest.approx(roc_auc_score(prefix.reshape(-1), survival.reshape(-1)))
    assert m.overall_ece == pytest.approx(
        expected_calibration_error(probs=survival.reshape(-1), labels=prefix.reshape(-1), num_bins=15)
    )
    assert m.mean_slot_ece == pytest.approx((m.ece[0] + m.ece[1]) / 2)


def test_observed_mask_and_undefined_auroc():
    survival = np.array([[0.9, 0.6], [0.8, 0.3], [0.4, 0.1]])
    prefix = np.array([[1, 1], [1, 0], [0, 0]], dtype=bool)
    observed = np.array([[1, 1], [1, 0], [1, 0]], dtype=bool)
    m = survival_metrics(survival=survival, prefix_mask=prefix, observed_mask=observed)
    assert m.num_observed == [3, 1]
    assert m.auroc[1] is None  # one observed label at slot 1: AUROC undefined
    assert m.mean_predicted[1] == pytest.approx(0.6) and m.brier[1] == pytest.approx(0.16)
    assert m.overall_mean_observed == pytest.approx(3 / 4)
    with pytest.raises(ValueError, match="no records"):
        survival_metrics(survival=np.zeros((0, 2)), prefix_mask=np.zeros((0, 2), bool))


def test_confidence_metrics_applies_temperatures():
    logits = np.array([[2.0, 1.0], [-1.0, 3.0]])
    prefix = np.array([[1, 0], [0, 0]], dtype=bool)
    m = confidence_metrics(confidence_logits=logits, prefix_mask=prefix, temperatures=[2.0, 1.0])
    s0 = 1 / (1 + np.exp(-1.0))
    assert m.mean_predicted[0] == pytest.approx((s0 + 1 / (1 + np.exp(0.5))) / 2)
