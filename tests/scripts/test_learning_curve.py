"""scripts/learning_curve.py: the eval command it builds parses as `hspec eval` (a wrong --dtype value once
stopped a curve after its first training slice), and the slope per doubling, by hand."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from sglang_hspec.cli import build_parser

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "learning_curve.py"


@pytest.fixture(scope="module")
def curve():
    spec = importlib.util.spec_from_file_location("learning_curve", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _choices(parser, dest: str) -> list[str]:
    return next(a.choices for a in parser._actions if a.dest == dest)


def test_the_eval_command_parses_for_every_eval_dtype(curve, tmp_path):
    eval_parser = build_parser()._subparsers._group_actions[0].choices["eval"]
    curve_dtypes = _choices(curve.build_parser(), "eval_dtype")
    assert set(curve_dtypes) <= set(_choices(eval_parser, "dtype"))
    for dtype in curve_dtypes:
        argv = curve.eval_args(["runs/a/drafter", "runs/b/drafter"], out=tmp_path / "e.json", limit=4,
                               max_new_tokens=64, dtype=dtype)
        args = build_parser().parse_args(argv)
        assert (args.dtype, args.limit, args.max_new_tokens, args.datasets) == (dtype, 4, 64, curve.DATASETS)
        assert args.drafter == "runs/a/drafter" and args.compare == ["runs/b/drafter"]


def test_slope_per_doubling_by_hand(curve):
    points = [{"kinds": {"hspec": {"blocks": b, "pooled_tau": t}}} for b, t in
              [(1000, 1.0), (2000, 1.1), (4000, 1.2), (8000, 1.3)]]
    assert curve.slopes(points, "hspec") == pytest.approx(0.1)
    points[1]["kinds"]["hspec"]["pooled_tau"] = 1.2  # least squares over log2(blocks) 0..3: 0.45 / 5
    assert curve.slopes(points, "hspec") == pytest.approx(0.09)
    assert curve.slopes(points[:1], "hspec") is None
