"""The shipped drafter's lineage: held-out tau against training blocks over every continuation it went through.

    python scripts/plot_lineage.py --lineage docs/results/lineage/lineage.json --out docs/results/lineage \
        [--target-tau 2.0]

The shipped H-Spec drafter was never trained from scratch twice: each release continued the previous one on
more data (ShareGPT as is, then the target's own replies). `lineage.json` lists each evaluated checkpoint with
its cumulative training blocks, the data its last stretch trained on, and its pooled held-out tau from one
eval protocol (`protocol`). For each stretch the table gives the slope per doubling of blocks (two points:
their difference over log2 of their ratio), the least-squares slope per data kind, and how many more doublings
(and blocks) the last point needs to reach --target-tau at the slope of its own data kind. Writes
<out>/lineage.md and <out>/lineage.png (atomically) and prints the table.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from sglang_hspec.core.atomic import atomic_write_text
from sglang_hspec.training.eval import save_tau_curve, tau_per_doubling


def stretch_slope(b0: int, t0: float, b1: int, t1: float) -> float:
    """tau gained per doubling of blocks between two checkpoints of one lineage."""
    return (t1 - t0) / math.log2(b1 / b0)


def doublings_to(target: float, tau: float, slope: float) -> float | None:
    """Doublings of blocks that take `tau` to `target` at `slope` per doubling; None when the slope is not
    positive (no amount of such data gets there)."""
    return (target - tau) / slope if slope > 0 else None


def kind_slopes(points: list[dict]) -> dict[str, float]:
    """Least-squares slope per data kind, over each kind's stretches chained with the checkpoint each started
    from (a stretch is credited to the data it trained on)."""
    out = {}
    for kind in dict.fromkeys(p["data"] for p in points[1:]):
        idx = [i for i in range(1, len(points)) if points[i]["data"] == kind]
        chain = sorted({j for i in idx for j in (i - 1, i)})
        s = tau_per_doubling([points[j]["blocks"] for j in chain], [points[j]["pooled_tau"] for j in chain])
        if s is not None:
            out[kind] = s
    return out


def blocks_text(n: float) -> str:
    return f"{n / 1e6:.1f} M" if n >= 1e6 else f"{n / 1e3:.0f}k"


def table(points: list[dict], *, target: float) -> list[str]:
    lines = ["| checkpoint | blocks | data of the stretch | pooled tau | stretch slope / doubling |",
             "|---|---|---|---|---|"]
    for i, p in enumerate(points):
        s = "" if i == 0 else f"{stretch_slope(points[i - 1]['blocks'], points[i - 1]['pooled_tau'], p['blocks'], p['pooled_tau']):+.3f}"
        lines.append(f"| {p['label']} | {p['blocks']:,} | {p['data'] if i else '(first release)'} | "
                     f"{p['pooled_tau']:.3f} | {s} |")
    slopes, last = kind_slopes(points), points[-1]
    lines += ["", "| data kind | least-squares slope / doubling |", "|---|---|"]
    lines += [f"| {k} | {v:+.3f} |" for k, v in slopes.items()]
    s = slopes.get(last["data"])
    d = None if s is None else doublings_to(target, last["pooled_tau"], s)
    lines += ["", f"From {last['label']} (tau {last['pooled_tau']:.3f} at {last['blocks']:,} blocks) to tau {target}: "
              + ("not reachable at that slope" if d is None else
                 f"{d:.1f} more doublings of {last['data']} data at {s:+.3f} per doubling, "
                 f"~{blocks_text(last['blocks'] * 2 ** d)} blocks in all")]
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lineage", required=True, help="lineage.json: protocol and points (label, blocks, data, pooled_tau)")
    ap.add_argument("--out", required=True, help="directory for lineage.md and lineage.png")
    ap.add_argument("--target-tau", type=float, default=2.0)
    args = ap.parse_args(argv)
    path = Path(args.lineage)
    try:
        lineage = json.loads(path.read_text())
        points = sorted(lineage["points"], key=lambda p: p["blocks"])
        for p in points:
            _ = (p["label"], int(p["blocks"]), p["data"], float(p["pooled_tau"]))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        ap.error(f"--lineage {path}: {exc!r}; expected JSON with 'protocol' and 'points' of "
                 "{label, blocks, data, pooled_tau}")
    if len(points) < 2 or len({p["blocks"] for p in points}) < len(points):
        ap.error(f"--lineage {path}: needs at least two points with distinct block counts")
    lines = [f"Eval: {lineage.get('protocol', '?')}", "", *table(points, target=args.target_tau)]
    print("\n".join(lines))
    atomic_write_text(Path(args.out) / "lineage.md", "\n".join(lines) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([p["blocks"] for p in points], [p["pooled_tau"] for p in points], color="0.6", lw=1, zorder=1)
    slopes = kind_slopes(points)
    for kind in dict.fromkeys(p["data"] for p in points[1:]):
        pts = [p for p in points[1:] if p["data"] == kind]
        s = slopes.get(kind)
        ax.scatter([p["blocks"] for p in pts], [p["pooled_tau"] for p in pts], zorder=2,
                   label=kind if s is None else f"{kind} ({s:+.3f} / doubling)")
    ax.scatter([points[0]["blocks"]], [points[0]["pooled_tau"]], color="k", marker="s", zorder=2, label="first release")
    ax.axhline(args.target_tau, color="r", ls=":", lw=1)
    save_tau_curve(fig, ax, Path(args.out) / "lineage.png", title="the shipped drafter's lineage, one eval protocol",
                   xlabel="training blocks seen (cumulative)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
