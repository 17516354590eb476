import argparse
import json

import pytest
import torch
from sglang_hspec.calibration import fit_sts, load_intervals, load_records, load_sts
from sglang_hspec.calibration.cli import add_parser, main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_synth_fit_report_end_to_end(tmp_path, capsys):
    train, held = tmp_path / "rec" / "train", tmp_path / "rec" / "held"
    assert main(["synth", "--out-stem", str(train), "-n", "8000", "--seed", "1", "--shards", "3"]) == 0
    assert main(["synth", "--out-stem", str(held), "-n", "8000", "--seed", "2", "--shards", "2"]) == 0
    out, plot = tmp_path / "sts.json", tmp_path / "fit.png"
    fit_argv = ["fit", "--data", f"{train}.*.pt", "--block-size", "7", "--out", str(out), "--plot", str(plot)]
    assert main([*fit_argv, "--bootstrap", "40"]) == 0
    sts = load_sts(out, block_size=7)
    assert sts.num_samples == 8000 and sts.dataset == f"{train}.*.pt"
    assert all(t > 1.0 for t in sts.temperatures)
    assert sum(sts.ece_after) < sum(sts.ece_before)
    assert plot.read_bytes().startswith(PNG_MAGIC)
    # the STS file keeps SGLang's fields only; the intervals go to the sidecar and into the table
    assert set(json.loads(out.read_text())) == {
        "temperatures",
        "dataset",
        "num_samples",
        "ece_before",
        "ece_after",
    }
    intervals = load_intervals(tmp_path / "sts.intervals.json")
    assert intervals.temperatures == sts.temperatures and intervals.num_resamples == 40
    printed = capsys.readouterr().out
    assert "mean per-slot ECE" in printed and "95% interval" in printed
    slot_3 = next(line for line in printed.splitlines() if line.startswith("   3 "))
    assert f"[{intervals.lower[3]:.3f}, {intervals.upper[3]:.3f}]" in slot_3

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
    assert report["intervals"]["upper"] == intervals.upper  # the sidecar beside --sts is picked up
    assert "95% interval" in capsys.readouterr().out
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
            "--block-size",
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
    assert (tmp_path / "s.intervals.json").is_file()


def test_grid_method_deprecated_gamma_and_no_bootstrap(tmp_path, capsys):
    main(["synth", "--out-stem", str(tmp_path / "r"), "-n", "3000", "--shards", "1", "--gamma", "5"])
    assert "--gamma is deprecated, use --block-size" in capsys.readouterr().err
    out = tmp_path / "s.json"
    argv = ["fit", "--data", str(tmp_path / "r.*.pt"), "--gamma", "5", "--out", str(out), "--method", "grid"]
    assert main([*argv, "--bootstrap", "0"]) == 0
    captured = capsys.readouterr()
    assert "--gamma is deprecated" in captured.err and "interval" not in captured.out
    assert not (tmp_path / "s.intervals.json").exists()
    records = load_records(data=str(tmp_path / "r.*.pt"))
    grid, _, _ = fit_sts(confidence_logits=records.logits, prefix_mask=records.prefix_mask, method="grid")
    assert load_sts(out, block_size=5).temperatures == grid


def test_help_hides_gamma(capsys):
    with pytest.raises(SystemExit):
        main(["fit", "--help"])
    help_text = capsys.readouterr().out
    assert (
        "--block-size" in help_text and "--gamma" not in help_text and "--method {nll,ece,grid}" in help_text
    )


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
        ["fit", "--data", str(tmp_path / "*.pt"), "--block-size", "7", "--out", out],
        "no confidence record shards matched",
    )
    torch.save({"logits": torch.zeros(0, 7), "prefix_mask": torch.zeros(0, 7)}, tmp_path / "empty.0.pt")
    _assert_failed_cleanly(
        tmp_path,
        capsys,
        ["fit", "--data", str(tmp_path / "empty.*.pt"), "--block-size", "7", "--out", out],
        "hold no records",
    )
    torch.save({"logits": torch.zeros(5, 5), "prefix_mask": torch.zeros(5, 5)}, tmp_path / "g5.0.pt")
    _assert_failed_cleanly(
        tmp_path,
        capsys,
        ["fit", "--data", str(tmp_path / "g5.*.pt"), "--block-size", "7", "--out", out, "--plot", plot],
        "block_size=5 slots but --block-size 7",
    )
    logits = torch.zeros(5, 7)
    logits[2, 3] = float("nan")
    torch.save({"logits": logits, "prefix_mask": torch.zeros(5, 7)}, tmp_path / "nan.0.pt")
    _assert_failed_cleanly(
        tmp_path,
        capsys,
        ["fit", "--data", str(tmp_path / "nan.*.pt"), "--block-size", "7", "--out", out],
        "NaN or infinite",
    )
    (tmp_path / "corrupt.0.pt").write_bytes(b"\x00garbage")
    _assert_failed_cleanly(
        tmp_path,
        capsys,
        ["fit", "--data", str(tmp_path / "corrupt.*.pt"), "--block-size", "7", "--out", out],
        "not a readable confidence record shard",
    )
    _assert_failed_cleanly(
        tmp_path,
        capsys,
        [
            "fit",
            "--data",
            str(tmp_path / "g5.*.pt"),
            "--block-size",
            "5",
            "--out",
            out,
            "--plot",
            str(tmp_path / "r.jpg"),
        ],
        "must end in .png",
    )
    _assert_failed_cleanly(
        tmp_path,
        capsys,
        ["fit", "--data", str(tmp_path / "g5.*.pt"), "--out", out],
        "--block-size is required",
    )
    (tmp_path / "sts_bad.json").write_text('{"temperatures": [1.0, -1.0, 1.0, 1.0, 1.0]}')
    _assert_failed_cleanly(
        tmp_path,
        capsys,
        ["report", "--data", str(tmp_path / "g5.*.pt"), "--sts", str(tmp_path / "sts_bad.json")],
        "must be finite and > 0",
    )


def test_bad_flag_values_name_the_flag_and_write_nothing(tmp_path, capsys):
    """Each bad value is refused before any record is read or file written, naming the flag and its range."""
    torch.save({"logits": torch.zeros(5, 5), "prefix_mask": torch.zeros(5, 5)}, tmp_path / "g5.0.pt")
    blocker = tmp_path / "afile"
    blocker.write_text("x")
    data = ["--data", str(tmp_path / "g5.*.pt")]
    fit = ["fit", *data, "--block-size", "5", "--out", str(tmp_path / "sts.json")]
    for argv, message in [
        ([*fit, "--grid-min", "0"], "error: --grid-min must be a finite temperature > 0, got 0.0"),
        ([*fit, "--grid-max", "nan"], "error: --grid-max must be a finite temperature > 0, got nan"),
        ([*fit, "--grid-min", "5", "--grid-max", "1"],
         "error: --grid-min (5.0) must be below --grid-max (1.0): they bound the temperature search (defaults 0.1 and 10)"),
        (["fit", *data, "--block-size", "5", "--out", str(blocker / "sts.json")],
         f"error: --out '{blocker / 'sts.json'}' cannot be written: {blocker} is a file, not a directory; pick "
         "another --out"),
        (["report", *data, "--sts", str(tmp_path / "missing.json"), "--json", str(blocker / "m.json")],
         f"error: --json '{blocker / 'm.json'}' cannot be written: {blocker} is a file, not a directory"),
        (["synth", "--out-stem", str(tmp_path / "syn"), "--kind", "overconfident", "--temperature", "-1"],
         "error: --temperature must be a finite number > 0 (the true over-confidence; 1 = calibrated), got -1.0"),
        (["synth", "--out-stem", str(tmp_path / "syn"), "-n", "2", "--shards", "5"],
         "error: --shards 5 exceeds --num-records 2: some shards would be empty; lower --shards"),
        (["synth", "--out-stem", str(blocker / "syn")],
         f"error: --out-stem '{blocker / 'syn.0.pt'}' cannot be written: {blocker} is a file, not a directory"),
    ]:
        _assert_failed_cleanly(tmp_path, capsys, argv, message)
    for argv, message in [
        ([*fit[:3], "--block-size", "100000", *fit[5:]], "argument --block-size: must be in 1..64 (draft slots per "
                                                         "block), got 100000"),
        ([*fit, "--seed", "-1"], "argument --seed: must be >= 0, got -1"),
        (["synth", "--out-stem", str(tmp_path / "syn"), "--seed", "-1"], "argument --seed: must be >= 0, got -1"),
    ]:
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        assert exit_.value.code == 2 and message in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "g5.0.pt"] and blocker.read_text() == "x"
