"""Learning-slope levers against the baseline curve: held-out tau per doubling of training blocks, one arm each.

    python scripts/plot_levers.py --baseline docs/results/learning_curve/curve.json:hspec \
        --levers runs/levers/curve.json --out docs/results/levers

Both inputs are `scripts/learning_curve.py` outputs (curve.json). For each lever arm the table gives its
points, its least-squares slope per doubling of blocks, the baseline's slope over the baseline points in the
same step range, the arm's tau minus the baseline's at equal blocks (the baseline interpolated in log2
blocks; blank outside its range) and the arm's training wall seconds per step (the time its curve recorded,
over its last step: slices trained before a restart into a new --out are not counted, so it reads low then). Writes <out>/levers.md and
<out>/levers.png (atomically) and prints the table.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from sglang_hspec.core.atomic import atomic_write_text
from sglang_hspec.training.eval import save_tau_curve, tau_per_doubling


def series(curve: dict, arm: str) -> list[tuple[int, int, float]]:
    """(step, blocks, pooled tau) of one arm, by step."""
    return sorted((p["step"], p["kinds"][arm]["blocks"], p["kinds"][arm]["pooled_tau"]) for p in curve["points"]
                  if arm in p["kinds"])


def slope(points: list[tuple[int, int, float]]) -> float | None:
    """Least-squares tau per doubling of blocks; None with fewer than two points."""
    return tau_per_doubling([b for _, b, _ in points], [t for _, _, t in points])


def interpolate(points: list[tuple[int, int, float]], blocks: int) -> float | None:
    """The baseline's tau at `blocks`, linear in log2(blocks) between its points; None outside them."""
    for (_, b0, t0), (_, b1, t1) in zip(points, points[1:]):
        if b0 <= blocks <= b1:
            w = (math.log2(blocks) - math.log2(b0)) / (math.log2(b1) - math.log2(b0)) if b1 > b0 else 0.0
            return t0 + w * (t1 - t0)
    return points[0][2] if points and points[0][1] == blocks else None


def table(baseline: list[tuple[int, int, float]], arms: dict[str, dict]) -> list[str]:
    fmt = lambda s: "n/a" if s is None else f"{s:+.3f}"  # noqa: E731
    lines = ["| arm | steps | blocks | pooled tau | tau - baseline at equal blocks | slope / doubling | "
             "baseline slope, same steps | s / step |", "|---|---|---|---|---|---|---|---|"]
    steps = {s for s, _, _ in baseline}
    lines.append(f"| baseline | {', '.join(str(s) for s, _, _ in baseline)} | {baseline[0][1]:,}-{baseline[-1][1]:,} "
                 f"| {' / '.join(f'{t:.3f}' for _, _, t in baseline)} | | {fmt(slope(baseline))} | | |")
    for label, arm in arms.items():
        pts = arm["points"]
        last = max(s for s, _, _ in pts)
        same = [p for p in baseline if p[0] <= last and p[0] in steps]
        deltas = [interpolate(baseline, b) for _, b, _ in pts]
        delta = " / ".join("" if d is None else f"{t - d:+.3f}" for (_, _, t), d in zip(pts, deltas))
        per_step = arm["train_seconds"] / last if arm.get("train_seconds") else None
        lines.append(f"| {label} | {', '.join(str(s) for s, _, _ in pts)} | {pts[0][1]:,}-{pts[-1][1]:,} | "
                     f"{' / '.join(f'{t:.3f}' for _, _, t in pts)} | {delta} | {fmt(slope(pts))} | "
                     f"{fmt(slope(same))} | {'' if per_step is None else f'{per_step:.1f}'} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", required=True, help="CURVE_JSON:ARM, the reference curve and its arm label")
    ap.add_argument("--levers", required=True, nargs="+", help="curve.json files of lever arms (every arm of each)")
    ap.add_argument("--out", required=True, help="directory for levers.md and levers.png")
    args = ap.parse_args(argv)
    path, sep, base_arm = args.baseline.rpartition(":")
    if not sep or not Path(path).is_file():
        ap.error(f"--baseline {args.baseline}: expected CURVE_JSON:ARM with an existing curve.json")
    base_curve = json.loads(Path(path).read_text())
    baseline = series(base_curve, base_arm)
    if not baseline:
        ap.error(f"--baseline {args.baseline}: {path} has no points of arm {base_arm!r}")
    arms: dict[str, dict] = {}
    machines = {f"baseline: {base_curve['machine']['cpu']} {' '.join(base_curve['machine']['flags'])}, "
                f"{base_curve.get('dtype', '?')}"}
    for lever in args.levers:
        if not Path(lever).is_file():
            ap.error(f"--levers {lever}: no such file (scripts/learning_curve.py writes <out>/curve.json)")
        curve = json.loads(Path(lever).read_text())
        machines.add(f"levers: {curve['machine']['cpu']} {' '.join(curve['machine']['flags'])}, {curve.get('dtype', '?')}")
        for label in curve["kinds"]:
            pts = series(curve, label)
            if pts:
                arms[label] = {"points": pts, "train_seconds": curve.get("train_seconds", {}).get(label),
                               "overrides": curve.get("arms", {}).get(label, {}).get("overrides", [])}
    if not arms:
        ap.error(f"--levers {' '.join(args.levers)}: no arm has a finished point yet")
    lines = [f"Machines: {'; '.join(sorted(machines))}.", "", *table(baseline, arms), ""]
    lines += [f"- {label}: {' '.join(a['overrides']) or '(no overrides)'}" for label, a in arms.items()]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "levers.md", "\n".join(lines) + "\n")
    print("\n".join(lines))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)
        return 0
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, pts in [("baseline", baseline), *((k, a["points"]) for k, a in arms.items())]:
        s = slope(pts)
        ax.plot([b for _, b, _ in pts], [t for _, _, t in pts], marker="o", ls="--" if label == "baseline" else "-",
                label=label if s is None else f"{label} ({s:+.3f} / doubling)")
    save_tau_curve(fig, ax, out / "levers.png", title="learning-slope levers vs the baseline recipe (hspec)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
