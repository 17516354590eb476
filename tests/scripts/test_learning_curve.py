"""scripts/learning_curve.py: the eval command it builds parses as `hspec eval` (a wrong --dtype value once
stopped a curve after its first training slice), and the slope per doubling, by hand."""

from __future__ import annotations

import pytest

from sglang_hspec.cli import build_parser


@pytest.fixture(scope="module")
def curve(load_script):
    return load_script("learning_curve")


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


def test_arms_train_their_own_kind_with_the_shared_then_their_own_overrides(curve, tmp_path):
    ap = curve.build_parser()
    args = ap.parse_args(["--out", "o", "--data", "d.jsonl", "training.seed=1", "--arm", "base=hspec",
                          "--arm", "r256=hspec", "model.drafter.markov_rank=256", "training.seed=2",
                          "--arm", "ds=dspark"])
    arms = curve.parse_arms(ap, args)
    assert list(arms) == ["base", "r256", "ds"]
    assert arms["r256"] == {"kind": "hspec", "overrides": ["model.drafter.markov_rank=256", "training.seed=2"]}
    argv = curve.train_args(arms["r256"], out_dir=tmp_path / "r256", data="d.jsonl", max_steps=3000, stop_after=75,
                            overrides=args.overrides)
    assert argv[3:6] == ["train", "--config", "configs/train_hspec_smollm2.yaml"]
    # the arm's own overrides come last, so they win over the shared ones
    assert argv[-3:] == ["training.seed=1", "model.drafter.markov_rank=256", "training.seed=2"]
    assert f"training.output_dir={tmp_path / 'r256'}" in argv and "training.stop_after=75" in argv
    assert list(curve.parse_arms(ap, ap.parse_args(["--out", "o", "--data", "d", "--kinds", "hspec,dspark"]))) == [
        "hspec", "dspark"]


@pytest.mark.parametrize("argv, message", [
    (["--arm", "hspec"], "LABEL=KIND"),
    (["--arm", "a=hspec", "--arm", "a=dspark"], "LABEL=KIND"),
    (["--arm", "a=hspec", "lr"], "not a section.key=value"),
    (["--kinds", "hspec", "--arm", "a=hspec"], "not both"),
])
def test_bad_arms_name_the_flag(curve, argv, message, capsys):
    ap = curve.build_parser()
    with pytest.raises(SystemExit):
        curve.parse_arms(ap, ap.parse_args(["--out", "o", "--data", "d", *argv]))
    assert message in capsys.readouterr().err
