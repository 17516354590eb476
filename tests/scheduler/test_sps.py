import json

import msgspec
import pytest
import torch
from sglang_hspec.scheduler.sps import (
    SpsAdditiveCostTable,
    SpsCostTable,
    SpsCurve,
    load_sps_table,
    save_sps_table,
    sps_table_from_json,
    synthetic_sps_table,
)

FLOOR = '{"sample_batch_tokens":[1,64,128],"sample_steps_per_sec":[100.0,80.0,50.0],"max_batch_tokens":256}'
ADDITIVE = ('{"bias_seconds":0.01,"bs_probes":[1,8],"alpha_seconds":[0.0,0.007],'
            '"m_probes":[1,101],"theta_seconds":[0.0,0.01]}')


def test_floor_table_round_trips_sglang_layout_byte_for_byte(tmp_path):
    t = sps_table_from_json(FLOOR)
    assert isinstance(t, SpsCostTable)
    assert msgspec.json.encode(t).decode() == FLOOR
    save_sps_table(t, tmp_path / "sps.json")
    assert load_sps_table(tmp_path / "sps.json") == t


def test_floor_lookup_is_bisect_right_minus_one():
    t = sps_table_from_json(FLOOR)
    assert [t.lookup(b) for b in (0, 1, 63, 64, 127, 128, 256)] == [100, 100, 100, 80, 80, 50, 50]
    curve = SpsCurve(t)
    got = curve.steps_per_sec(batch_tokens=torch.tensor([1, 63, 64, 128, 256, 257]), num_reqs=1)
    assert got.tolist() == [100, 100, 80, 50, 50, 0]  # past capacity: 0, never planned


def test_additive_table_step_time_and_curve():
    t = sps_table_from_json(ADDITIVE)
    assert isinstance(t, SpsAdditiveCostTable)
    assert msgspec.json.encode(t).decode() == ADDITIVE
    # 4 requests, budget 47: 0.01 + alpha(4)=0.003 + theta(51)=0.005
    assert t.step_time(num_reqs=4, budget=47) == pytest.approx(0.018)
    curve = SpsCurve(t)
    got = curve.steps_per_sec(batch_tokens=torch.tensor([51, 500]), num_reqs=4)
    assert got.tolist() == pytest.approx([1 / 0.018, 1 / 0.023])
    assert curve.scalar(batch_tokens=51, num_reqs=4) == pytest.approx(1 / 0.018)


@pytest.mark.parametrize(
    "text, match",
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "JSON object"),
        ('{"sample_batch_tokens":[1,128,64],"sample_steps_per_sec":[1,2,3],"max_batch_tokens":256}',
         "strictly increasing"),
        ('{"sample_batch_tokens":[1,64,64],"sample_steps_per_sec":[1,2,3],"max_batch_tokens":256}',
         "strictly increasing"),
        ('{"sample_batch_tokens":[1,64],"sample_steps_per_sec":[1.0],"max_batch_tokens":256}', "equal length"),
        ('{"sample_batch_tokens":[1,64],"sample_steps_per_sec":[1.0,0.0],"max_batch_tokens":256}', "> 0"),
        ('{"sample_batch_tokens":[1,64],"sample_steps_per_sec":[1.0,2.0],"max_batch_tokens":32}',
         "max_batch_tokens"),
        ('{"sample_batch_tokens":[],"sample_steps_per_sec":[],"max_batch_tokens":32}', "at least one probe"),
        ('{"sample_batch_tokens":[1,64],"sample_steps_per_sec":[1.0,2.0]}', "max_batch_tokens"),
        ('{"sample_batch_tokens":[1],"sample_steps_per_sec":[1.0],"max_batch_tokens":4,"extra":1}', "extra"),
        ('{"bias_seconds":0,"bs_probes":[1],"alpha_seconds":[0],"m_probes":[1],"theta_seconds":[0]}',
         "bias_seconds"),
        ('{"bias_seconds":0.1,"bs_probes":[1,2],"alpha_seconds":[0],"m_probes":[1],"theta_seconds":[0]}',
         "equal length"),
    ],
)
def test_corrupt_tables_get_clear_errors(text, match):
    with pytest.raises(ValueError, match=match):
        sps_table_from_json(text, source="x.json")


def test_missing_file_names_the_fix(tmp_path):
    with pytest.raises(FileNotFoundError, match="hspec profile-sps"):
        load_sps_table(tmp_path / "nope.json")


def test_uninitialised_detection():
    assert sps_table_from_json(
        '{"sample_batch_tokens":[1],"sample_steps_per_sec":[1.0],"max_batch_tokens":64}').uninitialised
    assert not sps_table_from_json(FLOOR).uninitialised
    assert not sps_table_from_json(ADDITIVE).uninitialised


def test_synthetic_curve_has_plateaus_and_cliffs():
    t = synthetic_sps_table()
    json.loads(msgspec.json.encode(t))  # plain JSON
    assert t.lookup(17) == t.lookup(32) and t.lookup(33) != t.lookup(32)
    assert t.lookup(t.max_batch_tokens) < t.lookup(1) / 2


def test_a_directory_is_not_a_table(tmp_path):
    from sglang_hspec.scheduler.sps import load_sps_table

    with pytest.raises(IsADirectoryError, match="is a directory; pass the table's JSON file"):
        load_sps_table(tmp_path)
