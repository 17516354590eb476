import argparse
import json

import torch
from sglang_hspec.calibration import load_sts
from sglang_hspec.calibration.cli import add_parser, main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_synth_fit_report_end_to_end(tmp_path, capsys):
    train, held = tmp_path / "rec" / "train", tmp_path / "rec" / "held"
    assert main(["synth", "--out-stem", str(train), "-n", "8000", "--seed", "1", "--shards", "3"]) == 0
    assert main(["synth", "--out-stem", str(held), "-n", "8000", "--seed", "2", "--shards", "2"]) == 0
    out, plot = tmp_path / "sts.json", tmp_path / "fit.png"
    rc = main(["fit", "--data", f"{train}.*.pt", "--gamma", "7", "--out", str(out), "--plot", str(plot)])
    assert rc == 0
    sts = load_sts(out, gamma=7)
    assert sts.num_samples == 8000 and sts.dataset == f"{train}.*.pt"
    assert all(t > 1.0 for t in sts.temperatures)
    assert sum(sts.ece_after) < sum(sts.ece_before)
    assert plot.read_bytes().startswith(PNG_MAGIC)
    assert "mean per-slot ECE" in capsys.readouterr().out

    metrics_json, report_png = tmp_path / "m.json", tmp_path / "held.png"
    rc = main(
        [
            "report",
            "--data",
            f"{held}.*.pt",
            "--sts",
            str(out),
            "--json",
            str(metrics_json),
            "--plot",
            str(report_png),
        ]
    )
    assert rc == 0
    report = json.loads(metrics_json.read_text())
    assert report["sts"]["temperatures"] == sts.temperatures
    assert report["raw"]["num_samples"] == 8000 and len(report["calibrated"]["ece"]) == 7
    assert report["calibrated"]["mean_slot_ece"] < report["raw"]["mean_slot_ece"]
    assert report_png.read_bytes().startswith(PNG_MAGIC)


def test_fit_with_holdout_and_registered_as_subcommand(tmp_path):
    main(["synth", "--out-stem", str(tmp_path / "r"), "-n", "4000", "--shards", "1"])
    parser = argparse.ArgumentParser(prog="hspec")
    add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(
        [
            "calibrate",
            "fit",
            "--data",
            str(tmp_path),
            "--gamma",
            "7",
            "--out",
            str(tmp_path / "s.json"),
            "--holdout-fraction",
            "0.25",
            "--grid-points",
            "21",
        ]
    )
    assert args.func(args) == 0
    assert load_sts(tmp_path / "s.json").num_samples == 3000


def _assert_failed_cleanly(tmp_path, capsys, argv, message):
    before = sorted(p.name for p in tmp_path.iterdir())
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "error:" in err and message in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing written


def test_errors_are_clear_and_write_nothing(tmp_path, capsys):
    out, plot = str(tmp_path / "sts.json"), str(tmp_path / "r.png")
    _assert_failed_cleanly(
        tmp_path,
        capsys,
        ["fit", "--data", str(tmp_path / "*.pt"), "--gamma", "7", "--out", out],
        "no confidence record shards matched",
    )
    torch.save({"logits": torch.zeros(0, 7), "prefix_mask": torch.zeros(0, 7)}, tmp_path / "empty.0.pt")
    _assert_failed_cleanly(
        tmp_path,
        capsys,
        ["fit", "--data", str(tmp_path / "empty.*.pt"), "--gamma", "7", "--out", out],
        "hold no records",
    )
    torch.save({"logits": torch.zeros(5, 5), "prefix_mask": torch.zeros(5, 5)}, tmp_path / "g5.0.pt")
    _assert_failed_cleanly(
        tmp_path,
        capsys,
        ["fit", "--data", str(tmp_path / "g5.*.pt"), "--gamma", "7", "--out", out, "--plot", plot],
        "gamma=5 slots but --gamma 7",
    )
    logits = torch.zeros(5, 7)
    logits[2, 3] = float("nan")
    torch.save({"logits": logits, "prefix_mask": torch.zeros(5, 7)}, tmp_path / "nan.0.pt")
    _assert_failed_cleanly(
        tmp_path,
        capsys,
        ["fit", "--data", str(tmp_path / "nan.*.pt"), "--gamma", "7", "--out", out],
        "NaN or infinite",
    )
    (tmp_path / "corrupt.0.pt").write_bytes(b"\x00garbage")
    _assert_failed_cleanly(
        tmp_path,
        capsys,
        ["fit", "--data", str(tmp_path / "corrupt.*.pt"), "--gamma", "7", "--out", out],
        "not a readable confidence record shard",
    )
    _assert_failed_cleanly(
        tmp_path,
        capsys,
        [
            "fit",
            "--data",
            str(tmp_path / "g5.*.pt"),
            "--gamma",
            "5",
            "--out",
            out,
            "--plot",
            str(tmp_path / "r.jpg"),
        ],
        "must end in .png",
    )
    (tmp_path / "sts_bad.json").write_text('{"temperatures": [1.0, -1.0, 1.0, 1.0, 1.0]}')
    _assert_failed_cleanly(
        tmp_path,
        capsys,
        ["report", "--data", str(tmp_path / "g5.*.pt"), "--sts", str(tmp_path / "sts_bad.json")],
        "must be finite and > 0",
    )
