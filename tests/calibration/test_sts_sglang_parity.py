"""Parity with SGLang 0.5.23's own STS fitter and loader (SGLang tier: skipped where sglang is not installed)."""

import json

import numpy as np
import pytest
import torch
from sglang_hspec.calibration import (
    default_temperature_grid,
    fit_sts,
    fit_sts_calibration,
    load_sts,
    save_records,
    save_sts,
)
from sglang_hspec.calibration.synthetic import drafter_like_records, overconfident_records

sglang_fit = pytest.importorskip("sglang.benchmark.dspark_sts_fit")
sglang_sts = pytest.importorskip("sglang.srt.speculative.dspark_components.dspark_sts")


@pytest.mark.parametrize(
    "records",
    [
        overconfident_records(n=20_000, block_size=7, temperature=2.5, seed=249),
        drafter_like_records(n=10_000, seed=3),
    ],
    ids=["overconfident-T2.5", "drafter-like"],
)
def test_grid_method_is_sglangs_fitter(records):
    grid = sglang_fit.default_temperature_grid()  # float32 logspace in SGLang
    theirs = sglang_fit.fit_sts_temperatures(
        logits=torch.from_numpy(records.logits),
        prefix_mask=torch.from_numpy(records.prefix_mask.astype(np.float32)),
        grid=grid,
    )
    ours = fit_sts(
        confidence_logits=records.logits,
        prefix_mask=records.prefix_mask,
        method="grid",
        grid=grid.to(torch.float64).numpy(),
    )
    assert ours[0] == theirs["temperatures"]
    np.testing.assert_allclose(ours[1], theirs["ece_before"], rtol=1e-9)
    np.testing.assert_allclose(ours[2], theirs["ece_after"], rtol=1e-9)
    np.testing.assert_allclose(default_temperature_grid(), grid.double().numpy(), rtol=1e-6)


def test_files_load_both_ways(tmp_path):
    records = drafter_like_records(n=5_000, seed=4)
    # ours (default continuous fit) -> SGLang's loader
    ours = save_sts(fit_sts_calibration(records, dataset="drafter-like"), tmp_path / "ours.json")
    loaded = sglang_sts.load_sts_calibration_from_path(str(ours))
    assert loaded.temperatures == load_sts(ours, block_size=7).temperatures
    # SGLang's CLI fit on our shards -> our strict loader
    save_records(records, tmp_path / "rec" / "r", num_shards=2)
    theirs = tmp_path / "theirs.json"
    sglang_fit.fit(data_glob=str(tmp_path / "rec" / "r.*.pt"), out=theirs, gamma=7)
    assert set(json.loads(theirs.read_text())) <= {
        "temperatures",
        "dataset",
        "num_samples",
        "ece_before",
        "ece_after",
    }
    grid, _, _ = fit_sts(confidence_logits=records.logits, prefix_mask=records.prefix_mask, method="grid")
    np.testing.assert_allclose(load_sts(theirs, block_size=7).temperatures, grid, rtol=1e-6)
