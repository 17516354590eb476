"""`hspec calibrate {fit,report,synth}`: fit STS temperatures from confidence records, report metrics.

Wiring: `sglang_hspec.calibration.cli.add_parser(subparsers)` registers `calibrate` and sets
`func=run` (returns the exit code). Standalone: `python -m sglang_hspec.calibration {fit,report,synth} ...`."""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

from .fit import FIT_METHODS, bootstrap_sts_intervals, default_temperature_grid, fit_sts_calibration
from .metrics import ConfidenceMetrics, records_metrics, records_reliability
from .plots import check_png_path, render_reliability_png, save_reliability_png
from .records import ConfidenceRecords, load_records, save_records
from .sts import (
    StsCalibration,
    StsTemperatureIntervals,
    intervals_path,
    load_intervals,
    load_sts,
    save_intervals,
    save_sts,
    write_bytes_atomic,
)
from .synthetic import drafter_like_records, overconfident_records


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


# draft slots per block: the drafter config's bound (sglang_hspec/model/config.py BLOCK_SIZE_MAX), restated
# here because calibration/ imports nothing from sglang_hspec
BLOCK_SIZE_MAX = 64


def _block_size(text: str) -> int:
    value = int(text)
    if not 1 <= value <= BLOCK_SIZE_MAX:
        raise argparse.ArgumentTypeError(f"must be in 1..{BLOCK_SIZE_MAX} (draft slots per block), got {value}")
    return value


def _check_writable(path: Path, flag: str) -> None:
    """A file written at the end of the command: refuse, before any work, one that could never be written."""
    if path.is_dir():
        raise ValueError(f"{flag} {str(path)!r} is a directory; give a file path")
    probe = path.parent
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    if not probe.is_dir():
        raise ValueError(f"{flag} {str(path)!r} cannot be written: {probe} is a file, not a directory; pick another "
                         f"{flag}")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {str(path)!r} cannot be written: permission denied in {probe}; pick another {flag}")


class _DeprecatedGamma(argparse.Action):
    """`--gamma` (SGLang's name for the block size), kept as a hidden alias of `--block-size`."""

    def __call__(self, parser, namespace, values, option_string=None):
        print("warning: --gamma is deprecated, use --block-size", file=sys.stderr)
        setattr(namespace, self.dest, values)


def _add_block_size(p: argparse.ArgumentParser, *, default: int | None, help: str) -> None:
    p.add_argument("--block-size", type=_block_size, default=default, help=help)
    p.add_argument(
        "--gamma", dest="block_size", type=_block_size, action=_DeprecatedGamma, help=argparse.SUPPRESS
    )


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--data",
        nargs="+",
        required=True,
        metavar="GLOB",
        help="confidence record shards: globs (quote them), directories (their *.pt) or files",
    )
    p.add_argument("--num-bins", type=_positive_int, default=15, help="equal-width ECE bins (default 15)")
    p.add_argument("--plot", type=Path, help="write a before/after reliability diagram to this .png")


def configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="calibrate_command", required=True, metavar="{fit,report,synth}")

    fit = sub.add_parser("fit", help="fit STS temperatures; writes SGLang's DSparkStsCalibration JSON")
    _add_common(fit)
    _add_block_size(fit, default=None, help="draft slots per block, required (7 for H-Spec)")
    fit.add_argument(
        "--out", type=Path, required=True, help="STS JSON to write (--speculative-dspark-confidence-sts-path)"
    )
    fit.add_argument(
        "--method",
        choices=FIT_METHODS,
        default="nll",
        help="nll (default): log loss of the cumulative survival, minimised continuously in T; "
        "ece: SGLang's ECE objective, refined continuously; grid: SGLang's fitter exactly (grid points only)",
    )
    fit.add_argument(
        "--bootstrap",
        type=_non_negative_int,
        default=200,
        metavar="N",
        help="resamples for each slot's 95%% percentile interval, written to <out stem>.intervals.json "
        "(default 200; 0 skips it)",
    )
    fit.add_argument(
        "--grid-min", type=float, default=0.1, help="smallest temperature of the grid and the search (0.1)"
    )
    fit.add_argument(
        "--grid-max", type=float, default=10.0, help="largest temperature of the grid and the search (10)"
    )
    fit.add_argument("--grid-points", type=_positive_int, default=41, help="log-spaced grid points (41)")
    fit.add_argument(
        "--min-samples",
        type=_positive_int,
        default=1,
        help="records that must reach a slot to fit it; fewer keeps T = 1 with a warning",
    )
    fit.add_argument(
        "--dataset", default=None, help="dataset label stored in the JSON (default: the --data globs)"
    )
    fit.add_argument(
        "--holdout-fraction",
        type=float,
        default=0.0,
        help="hold out this random fraction of records; metrics and plot are then on held-out rows",
    )
    fit.add_argument("--seed", type=_non_negative_int, default=0, help="seed of the held-out split and the bootstrap")

    report = sub.add_parser("report", help="confidence metrics of records, raw and after an STS file")
    _add_common(report)
    report.add_argument("--sts", type=Path, required=True, help="STS JSON (ours or SGLang's)")
    _add_block_size(report, default=None, help="expected block size (default: the STS file's)")
    report.add_argument(
        "--json", type=Path, default=None, help="also write the metrics (raw and after) as JSON"
    )

    synth = sub.add_parser("synth", help="write synthetic records (demo / smoke test; no drafter needed)")
    synth.add_argument("--out-stem", type=Path, required=True, help="shards land at <stem>.<k>.pt")
    synth.add_argument("--kind", choices=("drafter-like", "overconfident"), default="drafter-like")
    synth.add_argument("-n", "--num-records", type=_positive_int, default=50_000)
    _add_block_size(synth, default=7, help="draft slots per block (7)")
    synth.add_argument(
        "--temperature", type=float, default=2.5, help="true over-confidence (--kind overconfident)"
    )
    synth.add_argument("--shards", type=_positive_int, default=4)
    synth.add_argument("--seed", type=_non_negative_int, default=0)


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "calibrate",
        help="STS calibration of the confidence head (fit / report)",
        description="Sequential temperature scaling of the drafter's confidence head, in SGLang's STS format.",
    )
    configure(parser)
    parser.set_defaults(func=run)
    return parser


def _fmt(value: float | None, spec: str = ".2%") -> str:
    return "-" if value is None else format(value, spec)


def format_table(
    before: ConfidenceMetrics,
    after: ConfidenceMetrics,
    temperatures: list[float],
    intervals: StsTemperatureIntervals | None = None,
) -> str:
    """Per-slot table; with `intervals`, each slot's temperature is followed by its bootstrap interval."""
    interval_header = f"{intervals.confidence:.0%} interval" if intervals is not None else ""
    width = 18 if intervals is not None else 0
    lines = [
        f"{'slot':>4} {'T':>7} {interval_header:>{width}} {'n':>8} {'ECE raw':>8} {'ECE sts':>8} {'AUROC':>6} "
        f"{'Brier raw':>9} {'Brier sts':>9} {'pred raw':>8} {'pred sts':>8} {'observed':>8}"
    ]
    for j in range(before.block_size):
        interval = f"[{intervals.lower[j]:.3f}, {intervals.upper[j]:.3f}]" if intervals is not None else ""
        lines.append(
            f"{j:>4} {temperatures[j]:>7.3f} {interval:>{width}} {before.num_observed[j]:>8} "
            f"{_fmt(before.ece[j]):>8} {_fmt(after.ece[j]):>8} {_fmt(after.auroc[j], '.3f'):>6} "
            f"{_fmt(before.brier[j], '.4f'):>9} {_fmt(after.brier[j], '.4f'):>9} "
            f"{_fmt(before.mean_predicted[j], '.3f'):>8} {_fmt(after.mean_predicted[j], '.3f'):>8} "
            f"{_fmt(before.mean_observed[j], '.3f'):>8}"
        )
    lines.append(
        f" all {'':>7} {'':>{width}} {before.num_samples:>8} {before.overall_ece:>8.2%} {after.overall_ece:>8.2%} "
        f"{_fmt(after.overall_auroc, '.3f'):>6} {before.overall_brier:>9.4f} {after.overall_brier:>9.4f} "
        f"{before.overall_mean_predicted:>8.3f} {after.overall_mean_predicted:>8.3f} "
        f"{before.overall_mean_observed:>8.3f}"
    )
    lines.append(f"mean per-slot ECE: raw {before.mean_slot_ece:.2%} -> STS {after.mean_slot_ece:.2%}")
    if intervals is not None:
        lines.append(
            f"T intervals: {intervals.confidence:.0%} percentile bootstrap over {intervals.num_resamples} "
            f"resamples of the {intervals.num_samples} fit records (method {intervals.method}, seed {intervals.seed})"
        )
    return "\n".join(lines)


def _evaluate(
    records: ConfidenceRecords, sts: StsCalibration, *, num_bins: int, plot: Path | None, title: str
) -> tuple[ConfidenceMetrics, ConfidenceMetrics, bytes | None]:
    before = records_metrics(records, temperatures=None, num_bins=num_bins)
    after = records_metrics(records, temperatures=sts, num_bins=num_bins)
    png = None
    if plot is not None:
        png = render_reliability_png(
            before=(records_reliability(records, temperatures=None, num_bins=num_bins), before),
            after=(records_reliability(records, temperatures=sts, num_bins=num_bins), after),
            title=title,
        )
    return before, after, png


def run_fit(args: argparse.Namespace) -> int:
    if args.block_size is None:
        raise ValueError("--block-size is required: the drafter's draft slots per block (7 for H-Spec)")
    if args.plot is not None:
        check_png_path(args.plot)
    if args.out.is_dir():
        raise ValueError(f"--out {str(args.out)!r} is a directory; give a file path such as sts.json")
    _check_writable(args.out, "--out")
    if args.plot is not None:
        _check_writable(args.plot, "--plot")
    if not 0 <= args.holdout_fraction < 1:
        raise ValueError(f"--holdout-fraction must be in [0, 1), got {args.holdout_fraction}")
    for flag, value in (("--grid-min", args.grid_min), ("--grid-max", args.grid_max)):
        if not math.isfinite(value) or value <= 0:
            raise ValueError(f"{flag} must be a finite temperature > 0, got {value}")
    if args.grid_min >= args.grid_max:
        raise ValueError(f"--grid-min ({args.grid_min}) must be below --grid-max ({args.grid_max}): they bound the "
                         "temperature search (defaults 0.1 and 10)")
    if args.bootstrap == 1:
        raise ValueError("--bootstrap needs at least 2 resamples (200 is the default; 0 skips the intervals)")
    grid = default_temperature_grid(low=args.grid_min, high=args.grid_max, num=args.grid_points)
    records = load_records(data=args.data, block_size=args.block_size, progress=True)
    fit_rows, eval_rows = records, records
    if args.holdout_fraction > 0:
        fit_rows, eval_rows = records.split(holdout_fraction=args.holdout_fraction, seed=args.seed)
    dataset = args.dataset if args.dataset is not None else ",".join(args.data)
    started = time.perf_counter()
    sts = fit_sts_calibration(
        fit_rows,
        method=args.method,
        grid=grid,
        num_bins=args.num_bins,
        min_samples=args.min_samples,
        dataset=dataset,
    )
    fit_seconds = time.perf_counter() - started
    intervals = None
    if args.bootstrap > 0:
        started = time.perf_counter()
        intervals = bootstrap_sts_intervals(
            confidence_logits=fit_rows.logits,
            prefix_mask=fit_rows.prefix_mask,
            observed_mask=fit_rows.observed_mask,
            temperatures=sts.temperatures,
            method=args.method,
            grid=grid,
            num_bins=args.num_bins,
            min_samples=args.min_samples,
            num_resamples=args.bootstrap,
            seed=args.seed,
            progress=True,
        )
        bootstrap_seconds = time.perf_counter() - started
    where = "held-out" if args.holdout_fraction > 0 else "fit"
    before, after, png = _evaluate(
        eval_rows,
        sts,
        num_bins=args.num_bins,
        plot=args.plot,
        title=f"{dataset}: {eval_rows.num_samples} {where} records, block size {records.block_size}",
    )
    # everything computed: only now touch the file system
    save_sts(sts, args.out)
    if intervals is not None:
        save_intervals(intervals, intervals_path(args.out))
    if png is not None:
        save_reliability_png(args.plot, png)
    timing = f"fit {fit_seconds:.1f} s"
    if intervals is not None:
        timing += f", bootstrap {args.bootstrap} resamples {bootstrap_seconds:.1f} s"
    print(
        f"fitted STS ({args.method}) on {fit_rows.num_samples} records (block size {records.block_size}, "
        f"{len(records.sources)} shard(s)) in {timing} -> {args.out}"
    )
    if intervals is not None:
        print(f"temperature intervals -> {intervals_path(args.out)}")
    print(f"metrics on {eval_rows.num_samples} {where} records:")
    print(format_table(before, after, sts.temperatures, intervals))
    if png is not None:
        print(f"reliability diagram -> {args.plot}")
    return 0


def _matching_intervals(sts_path: Path, sts: StsCalibration) -> StsTemperatureIntervals | None:
    """The sidecar written with this STS file, if it is there and still describes these temperatures."""
    path = intervals_path(sts_path)
    if not path.is_file():
        return None
    intervals = load_intervals(path)
    if intervals.temperatures != sts.temperatures:
        print(f"note: {path} belongs to another fit (its temperatures differ); not shown", file=sys.stderr)
        return None
    return intervals


def run_report(args: argparse.Namespace) -> int:
    if args.plot is not None:
        check_png_path(args.plot)
        _check_writable(args.plot, "--plot")
    if args.json is not None:
        _check_writable(args.json, "--json")
    sts = load_sts(args.sts, block_size=args.block_size)
    intervals = _matching_intervals(args.sts, sts)
    records = load_records(data=args.data, block_size=sts.block_size, progress=True)
    before, after, png = _evaluate(
        records,
        sts,
        num_bins=args.num_bins,
        plot=args.plot,
        title=f"{','.join(args.data)}: {records.num_samples} records, STS {args.sts.name}",
    )
    if args.json is not None:
        import msgspec

        args.json.parent.mkdir(parents=True, exist_ok=True)
        payload = {"sts": sts, "raw": before, "calibrated": after}
        if intervals is not None:
            payload["intervals"] = intervals
        write_bytes_atomic(args.json, msgspec.json.format(msgspec.json.encode(payload)) + b"\n")
    if png is not None:
        save_reliability_png(args.plot, png)
    print(
        f"{records.num_samples} records (block size {records.block_size}) from {len(records.sources)} shard(s); "
        f"STS {args.sts}"
    )
    print(format_table(before, after, sts.temperatures, intervals))
    return 0


def run_synth(args: argparse.Namespace) -> int:
    if not math.isfinite(args.temperature) or args.temperature <= 0:
        raise ValueError(f"--temperature must be a finite number > 0 (the true over-confidence; 1 = calibrated), "
                         f"got {args.temperature}")
    if args.shards > args.num_records:
        raise ValueError(f"--shards {args.shards} exceeds --num-records {args.num_records}: some shards would be "
                         "empty; lower --shards")
    _check_writable(Path(f"{args.out_stem}.0.pt"), "--out-stem")
    if args.kind == "overconfident":
        records = overconfident_records(
            n=args.num_records, block_size=args.block_size, temperature=args.temperature, seed=args.seed
        )
    else:
        records = drafter_like_records(n=args.num_records, block_size=args.block_size, seed=args.seed)
    meta = {"source": "synthetic", "kind": args.kind, "seed": args.seed}
    paths = save_records(records, args.out_stem, num_shards=args.shards, meta=meta)
    print(
        f"wrote {records.num_samples} {args.kind} records (block size {records.block_size}) to {len(paths)} shard(s): "
        f"{paths[0]} ..."
    )
    return 0


def run(args: argparse.Namespace) -> int:
    handlers = {"fit": run_fit, "report": run_report, "synth": run_synth}
    try:
        return handlers[args.calibrate_command](args)
    except (ValueError, FileNotFoundError, FileExistsError) as exc:
        print(f"hspec calibrate {args.calibrate_command}: error: {exc}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sglang_hspec.calibration", description=__doc__)
    configure(parser)
    return run(parser.parse_args(argv))
