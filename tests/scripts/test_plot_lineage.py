"""scripts/plot_lineage.py: the shipped drafter's lineage, slopes by hand."""

from __future__ import annotations

import json

import pytest


@pytest.fixture(scope="module")
def lineage(load_script):
    return load_script("plot_lineage")


# blocks are powers of two, so log2 is 10 .. 14
POINTS = [{"label": "r0", "blocks": 1024, "data": "x", "pooled_tau": 1.0},
          {"label": "r1", "blocks": 2048, "data": "sharegpt", "pooled_tau": 1.1},
          {"label": "r2", "blocks": 4096, "data": "sharegpt", "pooled_tau": 1.2},
          {"label": "r3", "blocks": 8192, "data": "regen", "pooled_tau": 1.5},
          {"label": "r4", "blocks": 16384, "data": "regen", "pooled_tau": 1.7}]


def test_slopes_by_hand(lineage):
    assert lineage.stretch_slope(1024, 1.2, 4096, 1.5) == pytest.approx(0.15)  # +0.3 over two doublings
    # sharegpt: its two stretches chained from r0: (10, 1.0) (11, 1.1) (12, 1.2) -> 0.1 per doubling;
    # regen: from r2, (12, 1.2) (13, 1.5) (14, 1.7): covariance 0.5 over variance 2 -> 0.25
    assert lineage.kind_slopes(POINTS) == pytest.approx({"sharegpt": 0.1, "regen": 0.25})
    assert lineage.doublings_to(2.0, 1.7, 0.25) == pytest.approx(1.2)
    assert lineage.doublings_to(2.0, 1.7, 0.0) is None and lineage.doublings_to(2.0, 1.7, -0.1) is None


def test_table_and_plot_written(lineage, tmp_path):
    src = tmp_path / "lineage.json"
    src.write_text(json.dumps({"protocol": "p", "points": POINTS[::-1]}))  # any order: sorted by blocks
    assert lineage.main(["--lineage", str(src), "--out", str(tmp_path / "o")]) == 0
    md = (tmp_path / "o" / "lineage.md").read_text().splitlines()
    assert "| r3 | 8,192 | regen | 1.500 | +0.300 |" in md
    assert md[-1].endswith("1.2 more doublings of regen data at +0.250 per doubling, ~38k blocks in all")
    assert (tmp_path / "o" / "lineage.png").read_bytes()[:4] == b"\x89PNG"


def test_bad_lineage_names_the_file(lineage, tmp_path, capsys):
    src = tmp_path / "bad.json"
    src.write_text(json.dumps({"points": [{"label": "a", "blocks": 1}]}))
    with pytest.raises(SystemExit):
        lineage.main(["--lineage", str(src), "--out", str(tmp_path / "o")])
    assert f"--lineage {src}: KeyError('data')" in capsys.readouterr().err
    src.write_text(json.dumps({"points": POINTS[:1]}))
    with pytest.raises(SystemExit):
        lineage.main(["--lineage", str(src), "--out", str(tmp_path / "o")])
    assert "needs at least two points" in capsys.readouterr().err
