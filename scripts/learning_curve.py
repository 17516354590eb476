"""Held-out tau against training blocks seen, for several drafter kinds trained with one recipe.

    python scripts/learning_curve.py --out runs/curve_sharegpt --data data/smollm2_prompts/train.jsonl
        [--kinds hspec,dspark] [--points 38,75,150,300,600,1200,2400] [--max-steps 3000]
        [--limit 4] [--max-new-tokens 64] [--eval-dtype fp32] [--threads N] [section.key=value ...]
    python scripts/learning_curve.py --out runs/levers --data data/smollm2_prompts/train.jsonl --points 38,75,150,300 \
        --arm anchors_all=hspec data.num_anchors=512 --arm lr_1.2e-3=hspec training.lr=1.2e-3

Each `--arm LABEL=KIND [section.key=value ...]` is one curve: model.kind KIND with its own overrides (on top of
the shared ones), trained in <out>/LABEL; `--kinds a,b` is short for `--arm a=a --arm b=b`. Lever runs compare
an arm against the baseline curve (docs/results/drafter/2026-12-02_epyc-bf16_learning-curve/curve.json).

Each kind trains once over the whole `--max-steps` schedule (configs/train_<kind>_smollm2.yaml plus the
overrides; cosine learning rate over --max-steps, so intermediate points are not annealed), in slices:
`hspec train ... training.stop_after=<point> training.resume_from=auto`, the kinds side by side
(cores / kinds threads each: 2 one-thread runs train ~1.5x more blocks in all than one run after the
other on 2 threads, where a 1421x576x1536 matmul runs 55 GFLOP/s on one thread and 73 on two). At every point all kinds are
evaluated together by one `hspec eval --drafter <first> --compare <others>` (MT-Bench, GSM8K and
HumanEval first turns, T=0, block_size 7, one plain baseline per prompt shared by the kinds), and the
point is appended to <out>/curve.json. Kill it at any time: a rerun skips the finished points and resumes
the training slice from its last checkpoint (data regeneration and benchmarks should not share the cores).

Writes <out>/curve.json, <out>/curve.md (pooled tau per point, the ratio of each kind to the last kind,
the least-squares slope per doubling of blocks) and <out>/curve.png. Prints the CPU, its flags and dtype.
Slices checkpoint every 25 steps, so a kill loses at most 25 steps; after each slice only the newest
trainer state is kept, and every checkpoint keeps its drafter directory.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from tqdm import tqdm

from sglang_hspec.core.atomic import atomic_write_text
from sglang_hspec.target.dtypes import SPEED_FLAGS, cpu_flags, cpu_model
from sglang_hspec.training.eval import pooled_tau, save_tau_curve, tau_per_doubling

DATASETS = "mtbench,gsm8k,humaneval"


def machine() -> dict:
    import torch

    flags = cpu_flags()
    return {"cpu": cpu_model(), "flags": [f for f in SPEED_FLAGS if f in flags],
            "torch_capability": torch.backends.cpu.get_cpu_capability(), "cores": os.cpu_count()}


def blocks_seen(run_dir: Path, step: int) -> tuple[int, int]:
    """(anchored blocks, tokens) summed over steps 1..step of the run's train_log.jsonl (log_every=1)."""
    blocks = tokens = seen = 0
    for line in (run_dir / "train_log.jsonl").read_text().splitlines():
        row = json.loads(line)
        if row["step"] <= step:
            blocks, tokens, seen = blocks + row["blocks"], tokens + row["tokens"], seen + 1
    if seen != step:
        raise RuntimeError(f"{run_dir}/train_log.jsonl holds {seen} of steps 1..{step}; the curve needs every "
                           "step logged (training.log_every=1): delete the run directory and rerun")
    return blocks, tokens


def prune_states(run_dir: Path, keep: int, points: list[int]) -> None:
    """Keep checkpoint `keep` whole and the drafters of the curve's points; drop the other checkpoints and
    the optimizer/RNG state of the points (~0.3 GB each)."""
    for ckpt in run_dir.glob("checkpoint-*"):
        if ckpt.name == f"checkpoint-{keep}":
            continue
        if ckpt.name in {f"checkpoint-{p}" for p in points}:
            (ckpt / "trainer_state.pt").unlink(missing_ok=True)
        else:
            shutil.rmtree(ckpt)


def slopes(points: list[dict], kind: str) -> float | None:
    """Least-squares pooled tau per doubling of blocks (None with fewer than two points)."""
    rows = [p["kinds"][kind] for p in points if kind in p["kinds"]]
    return tau_per_doubling([r["blocks"] for r in rows], [r["pooled_tau"] for r in rows])


def write_report(out: Path, state: dict) -> None:
    kinds, points = state["kinds"], state["points"]
    ref = kinds[-1]
    lines = [f"Machine: {state['machine']['cpu']}, {state['machine']['cores']} cores, flags "
             f"{' '.join(state['machine']['flags']) or 'none'}, training dtype {state.get('dtype', '?')}, eval dtype "
             f"{state.get('eval_dtype', 'auto')}; data "
             f"{state['data']}; eval: {DATASETS}, {state['limit']} prompts each x {state['max_new_tokens']} "
             "tokens, T=0, block_size 7.", "",
             "| step | " + " | ".join(f"{k} blocks | {k} tau | {k} train h" for k in kinds)
             + "".join(f" | {k}/{ref}" for k in kinds[:-1]) + " |",
             "|---|" + "---|---|---|" * len(kinds) + "---|" * (len(kinds) - 1)]
    for p in points:
        cells = []
        for k in kinds:
            r = p["kinds"][k]
            cells.append(f"{r['blocks']:,} | {r['pooled_tau']:.3f} | {r['train_seconds'] / 3600:.2f}")
        ratios = [f"{p['kinds'][k]['pooled_tau'] / p['kinds'][ref]['pooled_tau']:.3f}" for k in kinds[:-1]]
        lines.append(f"| {p['step']} | " + " | ".join(cells) + "".join(f" | {r}" for r in ratios) + " |")
    lines.append("")
    for k in kinds:
        s = slopes(points, k)
        lines.append(f"- {k}: {'n/a' if s is None else f'{s:+.3f}'} pooled tau per doubling of blocks")
    atomic_write_text(out / "curve.md", "\n".join(lines) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for k in kinds:
        xs = [p["kinds"][k]["blocks"] for p in points]
        ys = [p["kinds"][k]["pooled_tau"] for p in points]
        s = slopes(points, k)
        ax.plot(xs, ys, marker="o", label=k if s is None else f"{k} ({s:+.3f} / doubling)")
    save_tau_curve(fig, ax, out / "curve.png", title=f"learning curve, {state['machine']['cpu']}, {state.get('dtype', '?')}")


def eval_args(drafters: list[str], *, out: Path, limit: int, max_new_tokens: int, dtype: str) -> list[str]:
    """`hspec eval` arguments of one point: every kind's drafter, one plain baseline, T=0."""
    cmd = ["eval", "--drafter", drafters[0], "--datasets", DATASETS, "--limit", str(limit), "--max-new-tokens",
           str(max_new_tokens), "--temperature", "0", "--dtype", dtype, "--out", str(out), "--no-progress"]
    for d in drafters[1:]:
        cmd += ["--compare", d]
    return cmd


def train_args(arm: dict, *, out_dir: Path, data: str, max_steps: int, stop_after: int,
               overrides: list[str]) -> list[str]:
    """`hspec train` arguments of one slice of one arm: the shared overrides, then the arm's own."""
    return [sys.executable, "-m", "sglang_hspec.cli", "train", "--config", f"configs/train_{arm['kind']}_smollm2.yaml",
            f"data.train_path={data}", "data.feature_cache=null", f"training.max_steps={max_steps}",
            f"training.stop_after={stop_after}", "training.resume_from=auto", f"training.output_dir={out_dir}",
            "training.save_every=25", "training.log_every=1", *overrides, *arm["overrides"]]


def run(cmds: list[list[str]], logs: list[Path], threads: int) -> None:
    """Run the commands side by side, `threads` torch threads each (one process per core trains faster
    in all than one process on every core: small matmuls do not scale across threads)."""
    env = {**os.environ, "HSPEC_TRAIN_THREADS": str(threads), "OMP_NUM_THREADS": str(threads)}
    procs = []
    for cmd, log in zip(cmds, logs):
        f = open(log, "a")
        f.write(f"\n$ {' '.join(cmd)}\n")
        f.flush()
        procs.append((cmd, log, f, subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)))
    failed = []
    for cmd, log, f, proc in procs:
        if proc.wait() != 0:
            failed.append(f"{cmd[3]} exited {proc.returncode} (see {log})")
        f.close()
    if failed:
        raise SystemExit("; ".join(failed) + ". Fix it and rerun: finished points are kept")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--data", required=True, help="data.train_path (JSONL from `hspec data build` / `regenerate`)")
    ap.add_argument("--kinds", default=None, help="comma-separated model.kind values, one arm each (default "
                    "hspec,dspark); the last is the reference of the ratios")
    ap.add_argument("--arm", action="append", nargs="+", default=None, metavar=("LABEL=KIND", "KEY=VALUE"),
                    help="one curve: a label (its directory under --out), its model.kind and its own dotted "
                    "overrides; repeat for several arms (instead of --kinds)")
    ap.add_argument("--points", default="38,75,150,300,600,1200,2400", help="steps at which to evaluate")
    ap.add_argument("--max-steps", type=int, default=3000, help="training.max_steps: the schedule's length")
    ap.add_argument("--limit", type=int, default=4, help="prompts per eval dataset")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--eval-dtype", default="fp32", choices=["fp32", "bf16", "auto"],
                    help="the eval's target/drafter dtype (training uses the recipe's): float32 by default, so that "
                    "points measured on CPUs with and without native bf16 compare, and outputs match plain decoding")
    ap.add_argument("--threads", type=int, default=None, help="torch threads per training run (default: the "
                    "cores over the arms, one process per core); two curves side by side: --threads 1 each")
    ap.add_argument("overrides", nargs="*", help="dotted config overrides for every kind")
    return ap


def parse_arms(ap: argparse.ArgumentParser, args: argparse.Namespace) -> dict[str, dict]:
    """{label: {"kind": model.kind, "overrides": [...]}} from --arm (or --kinds), in order; errors name the flag."""
    if args.arm and args.kinds:
        ap.error("give --kinds or --arm, not both")
    if not args.arm:
        kinds = [k.strip() for k in (args.kinds or "hspec,dspark").split(",") if k.strip()]
        return {k: {"kind": k, "overrides": []} for k in kinds}
    arms: dict[str, dict] = {}
    for label_kind, *overrides in args.arm:
        label, sep, kind = label_kind.partition("=")
        if not sep or not label or not kind or "/" in label or label in arms:
            ap.error(f"--arm {label_kind}: the first word must be LABEL=KIND with a new label and no '/' "
                     "(e.g. --arm rank256=hspec model.drafter.markov_rank=256)")
        bad = [o for o in overrides if "=" not in o]
        if bad:
            ap.error(f"--arm {label_kind}: {bad[0]!r} is not a section.key=value override")
        arms[label] = {"kind": kind, "overrides": overrides}
    return arms


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    arms = parse_arms(ap, args)
    kinds = list(arms)  # arm labels: the curve's columns and run directories
    points = sorted({int(p) for p in args.points.split(",")})
    if not kinds or not points or points[0] < 1 or points[-1] > args.max_steps:
        ap.error(f"--kinds must name at least one kind and --points lie in 1..--max-steps={args.max_steps}")
    for label, arm in arms.items():
        if not Path(f"configs/train_{arm['kind']}_smollm2.yaml").is_file():
            ap.error(f"--arm/--kinds {label}: configs/train_{arm['kind']}_smollm2.yaml does not exist")
    if not Path(args.data).is_file():
        ap.error(f"--data {args.data} does not exist; build it with `hspec data build`")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    state_path = out / "curve.json"
    settings = {"kinds": kinds, "data": args.data, "max_steps": args.max_steps, "limit": args.limit,
                "max_new_tokens": args.max_new_tokens, "overrides": args.overrides, "eval_dtype": args.eval_dtype}
    if args.arm:  # older curves (--kinds only) have no "arms" entry
        settings["arms"] = arms
    if state_path.exists():
        state = json.loads(state_path.read_text())
        old = {k: state.get(k, "auto" if k == "eval_dtype" else None) for k in settings}  # older runs: auto
        if old != settings:
            raise SystemExit(f"{state_path} was made with {old}, not {settings}: use another --out or the same flags")
    else:
        state = {**settings, "machine": machine(), "points": []}
    from sglang_hspec.target.dtypes import resolve_dtype

    state["dtype"] = str(resolve_dtype("auto", "cpu", workload="batch")).replace("torch.", "")
    print(f"cpu: {state['machine']['cpu']} | flags: {' '.join(state['machine']['flags'])} | dtype {state['dtype']} | "
          f"kinds {kinds} | points {points} of {args.max_steps} steps", flush=True)
    done = {p["step"] for p in state["points"]}
    hspec = [sys.executable, "-m", "sglang_hspec.cli"]
    log = out / "curve.log"
    for step in tqdm(points, desc="learning curve", unit="point", initial=0):
        if step in done:
            continue
        record = {"step": step, "kinds": {}}
        t0 = time.perf_counter()
        todo = [k for k in kinds if not (out / k / f"checkpoint-{step}" / "drafter" / "model.safetensors").is_file()]
        run([train_args(arms[k], out_dir=out / k, data=args.data, max_steps=args.max_steps, stop_after=step,
                        overrides=args.overrides) for k in todo],
            [out / f"train_{k}.log" for k in todo], threads=args.threads or max(1, (os.cpu_count() or 1) // len(kinds)))
        spent = time.perf_counter() - t0
        for k in kinds:  # wall time of the slices, the kinds side by side on one core each
            state.setdefault("train_seconds", {})[k] = state.get("train_seconds", {}).get(k, 0.0) + spent * (k in todo)
            prune_states(out / k, keep=step, points=points)
            blocks, tokens = blocks_seen(out / k, step)
            record["kinds"][k] = {"blocks": blocks, "tokens": tokens, "train_seconds": state["train_seconds"][k],
                                  "checkpoint": str(out / k / f"checkpoint-{step}" / "drafter")}
        atomic_write_text(state_path, json.dumps(state, indent=1) + "\n")  # the time survives a kill
        eval_json = out / f"eval_{step}.json"
        drafters = [f"{record['kinds'][k]['checkpoint']}" for k in kinds]
        cmd = [*hspec, *eval_args(drafters, out=eval_json, limit=args.limit, max_new_tokens=args.max_new_tokens,
                                  dtype=args.eval_dtype)]
        run([cmd], [log], threads=os.cpu_count() or 1)
        payload = json.loads(eval_json.read_text())
        payloads = payload["runs"] if "runs" in payload else [payload]
        for k, p in zip(kinds, payloads):
            rows = [r for r in p["results"] if r["temperature"] == 0.0]
            record["kinds"][k].update(pooled_tau=pooled_tau(p, 0.0), tau={r["dataset"]: r["tau"] for r in rows},
                                      identical=all(r["identical_to_plain"] for r in rows))
        state["points"].append(record)
        atomic_write_text(state_path, json.dumps(state, indent=1) + "\n")
        write_report(out, state)
        print(" | ".join([f"step {step}", *(f"{k} {record['kinds'][k]['blocks']:,} blocks tau "
                                            f"{record['kinds'][k]['pooled_tau']:.3f}" for k in kinds)]), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
