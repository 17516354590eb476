"""Merge `hspec eval` results of several runs into one comparison table and one alpha_j plot.

    python scripts/compare_table.py out/eval_a.json out/eval_b.json \
        --markdown out/compare.md --alpha-plot out/compare_alpha.png

Each file is an `hspec eval --out` JSON: one drafter's payload, or `{"runs": [...]}` from `--compare`.
Speedups stay those of their own run (each run measured its own plain baseline); tau does not depend
on machine speed. All runs must share prompts, block size, new-token budget and temperatures.
`--paired` adds each run's per-prompt tau difference from the first run (mean, SE, prompts up / down):
the test of whether a new drafter really beats the old one on these prompts.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from sglang_hspec.training.eval import comparison_table, paired_table, plot_alpha


def file_names(paths: list[str]) -> list[str]:
    """The shortest path tails that tell the files apart: `a/x.json b/y.json` -> x, y; `a/eval.json b/eval.json`
    -> a/eval, b/eval."""
    parts = [Path(p).with_suffix("").parts for p in paths]
    for depth in range(1, max(map(len, parts)) + 1):
        names = ["/".join(q[-depth:]) for q in parts]
        if len(set(names)) == len(names):
            return names
    return [str(p) for p in paths]


def load_runs(paths: list[str]) -> list[dict]:
    runs = []
    for path, name in zip(paths, file_names(paths)):
        data = json.loads(Path(path).read_text())
        found = data["runs"] if "runs" in data else [data]
        for run in found:  # several files of one drafter kind: name the columns and paired rows by file
            run["label"] = f"{run['drafter']} ({name})" if len(found) == 1 else run["drafter"]
        runs.extend(found)
    first = runs[0]
    for run in runs[1:]:
        for key in ("block_size", "max_new_tokens", "temperatures"):
            if run[key] != first[key]:
                raise SystemExit(f"{run['drafter']}: {key} {run[key]} differs from {first['drafter']}'s {first[key]}")
        mine = [(r["dataset"], r["prompts"]) for r in run["results"]]
        if mine != [(r["dataset"], r["prompts"]) for r in first["results"]]:
            raise SystemExit(f"{run['drafter']} was evaluated on other prompts than {first['drafter']}")
    return runs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+")
    p.add_argument("--baseline", default="dspark")
    p.add_argument("--markdown")
    p.add_argument("--alpha-plot")
    p.add_argument("--paired", action="store_true", help="per-prompt tau differences from the first run")
    args = p.parse_args()
    runs = load_runs(args.runs)
    table = comparison_table(runs, baseline=args.baseline)
    if args.paired:
        table += "\n" + paired_table(runs)
    print(table)
    if args.markdown:
        Path(args.markdown).write_text(table)
    if args.alpha_plot:
        plot_alpha(runs, args.alpha_plot)


if __name__ == "__main__":
    main()
