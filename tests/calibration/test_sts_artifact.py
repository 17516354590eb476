import math

import msgspec
import numpy as np
import pytest
import torch
from sglang_hspec.calibration import (
    StsCalibration,
    calibrated_confidence,
    calibrated_survival,
    calibrated_survival_np,
    load_sts,
    save_sts,
)


class SglangDSparkStsCalibration(msgspec.Struct, frozen=True, omit_defaults=True):
    """Field-for-field restatement of SGLang 0.5.23's DSparkStsCalibration (sglang/srt/speculative/dspark_components/dspark_sts.py in the sglang 0.5.23 wheel)."""

    temperatures: list[float]
    dataset: str = ""
    num_samples: int = 0
    ece_before: list[float] = []
    ece_after: list[float] = []


def test_json_round_trip_and_sglang_layout(tmp_path):
    sts = StsCalibration(
        temperatures=[1.5, 2.0, 2.5],
        dataset="d",
        num_samples=10,
        ece_before=[0.1, 0.2, 0.3],
        ece_after=[0.0, 0.01, 0.02],
    )
    path = save_sts(sts, tmp_path / "sub" / "sts.json")
    assert load_sts(path, block_size=3) == sts
    raw = msgspec.json.decode(path.read_bytes())
    assert list(raw) == ["temperatures", "dataset", "num_samples", "ece_before", "ece_after"]
    theirs = msgspec.json.decode(path.read_bytes(), type=SglangDSparkStsCalibration)
    assert theirs.temperatures == [1.5, 2.0, 2.5] and theirs.ece_after == [0.0, 0.01, 0.02]


def test_loads_minimal_sglang_file(tmp_path):
    # SGLang omits default fields when it writes
    path = tmp_path / "sts.json"
    path.write_bytes(msgspec.json.encode(SglangDSparkStsCalibration(temperatures=[1.0, 3.0])))
    sts = load_sts(path)
    assert sts.temperatures == [1.0, 3.0] and sts.num_samples == 0 and sts.block_size == 2


@pytest.mark.parametrize(
    "text, message",
    [
        ('{"temperatures": []}', "at least one temperature"),
        ('{"temperatures": [1.0, 0.0]}', "slot 1 must be finite and > 0"),
        ('{"temperatures": [1.0, -2.0]}', "slot 1"),
        ('{"temperatures": [1.0, 1e999]}', "out of range"),
        ('{"temperatures": "warm"}', "Expected `array`"),
        ('{"temperatures": [1.0], "num_samples": "many"}', "Expected `int`"),
        ('{"temperatures": [1.0], "typo": 1}', "unknown field"),
        ('{"dataset": "x"}', "missing required field"),
        ('{"temperatures": [1.0, 2.0], "ece_after": [0.1]}', "one entry per slot"),
        ('{"temperatures": [1.0, NaN]}', "not a valid STS"),
        ('{"temperatures": [1.0,', "not a valid STS"),
    ],
)
def test_strict_load_rejects_bad_files(tmp_path, text, message):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(ValueError, match="hspec calibrate fit|refit") as info:
        load_sts(path)
    assert message in str(info.value)
    assert str(path) in str(info.value)


def test_construction_rejects_non_finite():
    for bad in (float("inf"), float("nan")):
        with pytest.raises(ValueError, match="finite and > 0"):
            StsCalibration(temperatures=[1.0, bad])


def test_block_size_mismatch_and_missing_file(tmp_path):
    path = save_sts(StsCalibration(temperatures=[1.0] * 5), tmp_path / "sts.json")
    with pytest.raises(ValueError, match="holds 5 temperatures but the drafter.s block size is 7"):
        load_sts(path, block_size=7)
    with pytest.raises(FileNotFoundError, match="cannot read STS"):
        load_sts(tmp_path / "absent.json")


def test_calibrated_survival_hand_computed():
    logits = torch.tensor([[0.0, math.log(3.0)], [math.log(3.0), 0.0]])
    raw = calibrated_survival(confidence_logits=logits, temperatures=None)
    torch.testing.assert_close(raw, torch.tensor([[0.5, 0.375], [0.75, 0.375]]))
    # sigmoid(ln 3 / 2) = sqrt(3) / (1 + sqrt(3))
    c = math.sqrt(3.0) / (1.0 + math.sqrt(3.0))
    scaled = calibrated_survival(confidence_logits=logits, temperatures=[1.0, 2.0])
    torch.testing.assert_close(scaled, torch.tensor([[0.5, 0.5 * c], [0.75, 0.75 * 0.5]]))
    per_slot = calibrated_confidence(confidence_logits=logits, temperatures=[1.0, 2.0])
    torch.testing.assert_close(per_slot, torch.tensor([[0.5, c], [0.75, 0.5]]))


def test_torch_and_numpy_twins_agree_on_batched_input():
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 4, size=(3, 5, 7)).astype(np.float32)
    sts = StsCalibration(temperatures=[0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 10.0])
    t = calibrated_survival(confidence_logits=torch.from_numpy(logits), temperatures=sts)
    n = calibrated_survival_np(confidence_logits=logits, temperatures=sts.temperatures)
    assert t.dtype == torch.float32 and t.shape == (3, 5, 7)
    np.testing.assert_allclose(t.numpy(), n, rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="block_size=7 slots but 3 temperatures"):
        calibrated_survival(confidence_logits=torch.from_numpy(logits), temperatures=[1.0, 1.0, 1.0])
    with pytest.raises(ValueError, match="finite and > 0"):
        calibrated_survival_np(confidence_logits=logits, temperatures=[1.0] * 6 + [0.0])


def test_calibration_preserves_rankings():
    rng = np.random.default_rng(1)
    logits = rng.normal(1.0, 3.0, size=(500, 7))
    temps = np.array([0.7, 1.3, 2.0, 2.5, 3.1, 4.0, 6.0])
    raw = calibrated_survival_np(confidence_logits=logits, temperatures=None)
    cal = calibrated_survival_np(confidence_logits=logits, temperatures=temps)
    # per-slot conditional confidence sigmoid(z/T) keeps the order of requests at each slot
    for j in range(7):
        assert (
            np.argsort(logits[:, j] / temps[j], kind="stable") == np.argsort(logits[:, j], kind="stable")
        ).all()
    # within a request, survival stays non-increasing in depth (the scheduler's prefix property)
    assert (np.diff(cal, axis=1) <= 0).all()
    # one shared temperature keeps the global order of all (request, slot) survivals exactly
    common = calibrated_survival_np(confidence_logits=logits, temperatures=np.full(7, 2.5))
    assert (np.argsort(raw[:, 0], kind="stable") == np.argsort(common[:, 0], kind="stable")).all()
    # first slot: ranking by calibrated survival equals ranking by raw survival
    assert (np.argsort(cal[:, 0], kind="stable") == np.argsort(raw[:, 0], kind="stable")).all()
