"""scripts/plot_levers.py: a lever arm against the baseline curve, by hand."""

from __future__ import annotations

import json

import pytest


@pytest.fixture(scope="module")
def levers(load_script):
    return load_script("plot_levers")


def _curve(arm: str, rows: list[tuple[int, int, float]], **extra) -> dict:
    return {"machine": {"cpu": "test cpu", "flags": ["avx2"]}, "dtype": "float32", "kinds": [arm], **extra,
            "points": [{"step": s, "kinds": {arm: {"blocks": b, "pooled_tau": t}}} for s, b, t in rows]}


BASE = [(38, 1000, 1.0), (75, 2000, 1.1), (150, 4000, 1.2), (300, 8000, 1.3)]


def test_interpolation_is_linear_in_log2_blocks_and_blank_outside(levers):
    assert levers.interpolate(BASE, 2000) == pytest.approx(1.1)
    assert levers.interpolate(BASE, round(2000 * 2 ** 0.5)) == pytest.approx(1.15, abs=1e-4)
    assert levers.interpolate(BASE, 1000) == pytest.approx(1.0)
    assert levers.interpolate(BASE, 999) is None and levers.interpolate(BASE, 8001) is None


def test_lever_row_against_the_baseline(levers, tmp_path):
    base = tmp_path / "base.json"
    base.write_text(json.dumps(_curve("hspec", BASE)))
    # 4x the blocks per step (every position an anchor): at step 38 it has seen the baseline's 150-step blocks
    lever = tmp_path / "lever.json"
    lever.write_text(json.dumps(_curve("anchors", [(38, 4000, 1.25), (75, 8000, 1.45)],
                                       train_seconds={"anchors": 750.0},
                                       arms={"anchors": {"kind": "hspec", "overrides": ["data.num_anchors=512"]}})))
    assert levers.main(["--baseline", f"{base}:hspec", "--levers", str(lever), "--out", str(tmp_path / "o")]) == 0
    md = (tmp_path / "o" / "levers.md").read_text()
    row = next(line for line in md.splitlines() if line.startswith("| anchors"))
    # deltas 1.25 - 1.2 and 1.45 - 1.3; slope 0.2 per doubling; baseline 38..75 slope 0.1; 750 s / 75 steps
    assert row == "| anchors | 38, 75 | 4,000-8,000 | 1.250 / 1.450 | +0.050 / +0.150 | +0.200 | +0.100 | 10.0 |"
    assert "- anchors: data.num_anchors=512" in md
    assert (tmp_path / "o" / "levers.png").read_bytes()[:4] == b"\x89PNG"


def test_a_missing_baseline_arm_names_the_flag(levers, tmp_path, capsys):
    base = tmp_path / "base.json"
    base.write_text(json.dumps(_curve("hspec", BASE)))
    with pytest.raises(SystemExit):
        levers.main(["--baseline", f"{base}:dspark", "--levers", str(base), "--out", str(tmp_path / "o")])
    assert "--baseline" in capsys.readouterr().err
