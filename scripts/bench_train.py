"""Training throughput, each lever on its own and together, side by side in one run.

    python scripts/bench_train.py --data data/smollm2/train.jsonl [--config configs/train_hspec_smollm2.yaml]
        [--steps 4] [--max-length 512] [--out runs/bench_train] [section.key=value ...]

Every row trains the same drafter from the same seed on the same examples for --steps steps and reports
training tokens/s and anchored blocks/s (per-step tokens and blocks over the median step time, the
first step with its one-off allocations left out), their
ratios to the baseline, and the loss per block after the last step (the weighted slot loss of the same
batches: a lever that keeps it equal changes the speed only). Rows:

  baseline            the trainer before these levers: target softmax per slot, padded anchors computed,
                      one context window copied per block, the target run every step, model.init=random
  target_probs_once   the target's softmax once per position, shared by the slots reading it
  sequence_attention  attention reads each sequence's target KV in place for all its blocks, instead of
                      copying one context window per block (model/hspec.py, sequence_block_attention)
  pack_anchors        no drafter or loss compute on padded anchors and masked slots
  feature_cache       target features read back from data.feature_cache (built by a cold run first, whose
                      time and disk cost are printed); the target's LM head still runs on final_hidden
  anchors_512         more anchors per target forward (data.num_anchors=512; changes the batch, so the loss)
  bf16                bf16 target and autocast, only where the CPU computes bf16 natively (every other row
                      pins fp32, which the recipe's `auto` would not pick on such a CPU)
  all_exact (full softmax)
                      target_probs_once + pack_anchors + sequence_attention + feature_cache (loss unchanged
                      up to float rounding), the target's softmax over the full vocabulary
  all_exact           and cached_log_partition: the cache also holds each position's log-partition, and a
                      warm step runs only the draft-vocabulary rows of the target's LM head (the difference
                      to the row above is this lever on its own: it needs target_probs_once and the cache)
  all_exact + bf16    and bf16 (its own bf16 feature cache: a bf16 target is another target to the cache)
  all + anchors_512   and more anchors per target forward
  init=target_layers  all_exact with the drafter initialised from the target's layers (loss-slope lever)
  fused_optimizer     AdamW as torch's fused kernel instead of its per-tensor loop (every row but the baseline has it)
  all_exact + data_parallel, all_exact + bf16 + data_parallel
                      all_exact (+ bf16) trained by torchrun over --ranks processes of one thread each (the trainer's own
                      DistributedDataParallel, gloo on a CPU), each with the batch / ranks sequences: the same global
                      batch and loss, one process per core instead of one process's threads over the cores
  all_exact + compile, all_exact + bf16 + compile
                      and training.compile: the block attention's and the loss's elementwise cores under
                      torch.compile (inductor; trainer.use_compiled_kernels). Its one-off
                      cost (compiling on the first steps; cached on disk by torch, so a second run pays less)
                      is printed per row as the steps' time beyond the median, and left out of the rates

--rounds N runs the rows N times, each round in its own seeded order, and reads each ratio as the median
over rounds of the row's rate over the baseline's in the same round (with the range): on a VM whose step
times drift by +-20 % between rows, one pass ranks rows by when they ran, not by what they do.

Prints the CPU model, its flags that matter (avx2 / avx512f / avx512_bf16 / amx_bf16), torch's
capability string, the ISA caps set in the environment (`ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2
MKL_ENABLE_INSTRUCTIONS=AVX2` runs an AVX-512 machine as an AVX2-only one), threads, the load average (a shared
machine makes every number provisional) and the dtype; writes the rows to <out>/bench_train.json and a bar
chart to <out>/bench_train.png.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from sglang_hspec.target.dtypes import (
    SPEED_FLAGS,
    bf16_is_fast,
    cpu_flags,
    cpu_model,
    isa_caps,
    resolve_dtype,
)
from sglang_hspec.training.config import load_config
from sglang_hspec.training.trainer import data_parallel_command, rank_overrides, single_thread_env, train

# fp32 pinned: the recipe's `auto` dtypes pick bf16 where it is native, which is a lever of its own here
FP32 = ["model.target_dtype=fp32", "training.bf16=false"]
BF16 = ["model.target_dtype=bf16", "training.bf16=true"]
BASELINE = ["training.target_probs_once=false", "training.pack_anchors=false", "training.sequence_attention=false",
            *FP32, "training.cached_log_partition=false", "training.fused_optimizer=false"]
EXACT = ["training.target_probs_once=true", "training.pack_anchors=true", "training.sequence_attention=true", *FP32,
         "training.cached_log_partition=true", "training.fused_optimizer=true"]
DATA_PARALLEL = "all_exact + data_parallel"


def round_order(rows: list, r: int, rounds: int) -> list:
    """The rows run in round r: as listed when there is one round, else a permutation seeded by the round (the
    same in every run of the bench), so no row keeps a position or a neighbour."""
    return list(rows) if rounds == 1 else random.Random(r).sample(rows, len(rows))


def paired_ratios(rates: dict[str, list[float]], baseline: str) -> dict[str, tuple[float, float, float]]:
    """Per row: (median, min, max) over rounds of its rate over the baseline's rate in the same round. `rates`
    holds one rate per round for every row, the baseline's included."""
    base = rates[baseline]
    out = {}
    for name, values in rates.items():
        if len(values) != len(base):
            raise ValueError(f"row {name!r} has {len(values)} rounds, the baseline {len(base)}")
        ratios = [v / b for v, b in zip(values, base, strict=True)]
        out[name] = (statistics.median(ratios), min(ratios), max(ratios))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/train_hspec_smollm2.yaml")
    ap.add_argument("--data", default=None, help="data.train_path (JSONL from `hspec data build`)")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--max-length", type=int, default=None, help="data.max_length (default: the config's)")
    ap.add_argument("--out", default="runs/bench_train")
    ap.add_argument("--rows", default=None, help="comma-separated subset of the rows (default: all)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run the rows this many times, each round in a seeded order; ratios are medians over "
                         "rounds of the row over the baseline in the same round")
    ap.add_argument("--ranks", type=int, default=len(os.sched_getaffinity(0)),
                    help="processes of the data_parallel rows (default: the cores this process may use)")
    ap.add_argument("overrides", nargs="*", help="dotted config overrides applied to every row")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error(f"--rounds {args.rounds}: give at least 1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    out = Path(args.out)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    cache_dir = out / "feature_cache"
    # no row touches the config's own feature cache: the cache rows use a fresh one under --out
    common = ["data.feature_cache=null", *args.overrides, f"training.max_steps={args.steps}", "training.save_every=0",
              "training.log_every=0"]
    if args.data:
        common.append(f"data.train_path={args.data}")
    if args.max_length:
        common.append(f"data.max_length={args.max_length}")
    cache = [f"data.feature_cache={cache_dir}"]
    # a bf16 target is another target to the cache (its fingerprint differs): a cache of its own, stored in bf16
    cache_bf16 = [f"data.feature_cache={out / 'feature_cache_bf16'}", "data.feature_cache_dtype=bf16"]
    native_bf16 = bf16_is_fast("cpu", "batch")
    rows = [
        ("baseline", BASELINE),
        ("target_probs_once", ["training.target_probs_once=true", "training.pack_anchors=false",
                               "training.sequence_attention=false", *FP32]),
        ("pack_anchors", ["training.target_probs_once=false", "training.pack_anchors=true",
                          "training.sequence_attention=false", *FP32]),
        ("sequence_attention", BASELINE[:2] + ["training.sequence_attention=true", *FP32]),
        ("feature_cache", BASELINE + cache),
        ("anchors_512", BASELINE + ["data.num_anchors=512"]),
        ("bf16", BASELINE[:3] + BF16),
        ("all_exact (full softmax)", EXACT + cache + ["training.cached_log_partition=false"]),
        ("fused_optimizer", BASELINE[:-1] + ["training.fused_optimizer=true"]),
        ("all_exact", EXACT + cache),
        (DATA_PARALLEL, EXACT + cache),
        ("all_exact + bf16", EXACT[:3] + BF16 + EXACT[-2:] + cache_bf16),
        ("all_exact + bf16 + data_parallel", EXACT[:3] + BF16 + EXACT[-2:] + cache_bf16),
        ("all + anchors_512", EXACT + cache + ["data.num_anchors=512"]),
        ("init=target_layers", EXACT + cache + ["model.init=target_layers"]),
        ("all_exact + compile", EXACT + cache + ["training.compile=true"]),
        ("all_exact + bf16 + compile", EXACT[:3] + BF16 + cache_bf16 + ["training.compile=true"]),
    ]
    if args.rows:
        wanted = [r.strip() for r in args.rows.split(",")]
        unknown = sorted(set(wanted) - {name for name, _ in rows})
        if unknown:
            ap.error(f"--rows {unknown} unknown; choose from {[name for name, _ in rows]}")
        rows = [r for r in rows if r[0] in wanted or r[0] == "baseline"]

    base_cfg = load_config(args.config, common)
    if any(name.endswith("+ data_parallel") for name, _ in rows):
        try:
            rank_overrides(batch_size=base_cfg.data.batch_size, ranks=args.ranks)
        except ValueError as e:
            ap.error(str(e))
    flags = cpu_flags()
    print(f"cpu: {cpu_model()} | flags: {' '.join(f for f in SPEED_FLAGS if f in flags)}"
          f" | torch capability {torch.backends.cpu.get_cpu_capability()} | threads {torch.get_num_threads()}"
          f" | load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}"
          + (f" | ISA capped by {caps}" if (caps := isa_caps()) else ""))
    dtype = resolve_dtype(base_cfg.model.target_dtype, "cpu", workload="batch")
    print(f"dtype: fp32 except the bf16 rows (the recipe's target_dtype={base_cfg.model.target_dtype} would pick "
          f"{dtype} here); bf16 native on this CPU: {native_bf16} | "
          f"{args.config}: kind {base_cfg.model.kind}, block_size {base_cfg.model.block_size}, "
          f"batch {base_cfg.data.batch_size}, max_length {base_cfg.data.max_length}, "
          f"num_anchors {base_cfg.data.num_anchors}, {args.steps} steps per row, {args.rounds} round(s); "
          f"the data-parallel row: {args.ranks} ranks x 1 thread")

    from sglang_hspec.target.loading import load_target

    loaded = {}

    def target_for(cfg):
        key = cfg.model.target_dtype
        if key not in loaded:
            adapter = load_target(cfg.model.target, dtype=key, tiny_kwargs=cfg.model.target_kwargs)
            loaded[key] = (adapter.model, adapter.tokenizer)
        return loaded[key]

    def run(name: str, extra: list[str]):
        if name.endswith("+ data_parallel"):
            return run_ranks(name, extra)
        run_dir = out / name.replace(" ", "")
        cfg = load_config(args.config, common + extra + [f"training.output_dir={run_dir}"])
        model, tok = target_for(cfg)
        t0 = time.perf_counter()
        res = train(cfg, target=model, tokenizer=tok, progress=True)
        secs = time.perf_counter() - t0
        # the trainer's final checkpoint (weights + optimizer state, ~330 MB here) is no result of the bench:
        # kept, 3 rounds of 5 rows filled 6 GB
        shutil.rmtree(run_dir, ignore_errors=True)
        return res, secs

    def run_ranks(name: str, extra: list[str]):
        """The trainer under torchrun, one thread per rank; its rank 0 logs every step's global tokens and
        blocks to train_log.jsonl, read back as the in-process rows' history."""
        run_dir = out / name.replace(" ", "")
        cmd = data_parallel_command(config=args.config, overrides=[*common, *extra, "training.log_every=1",
                                                                   f"training.output_dir={run_dir}"],
                                    ranks=args.ranks, batch_size=base_cfg.data.batch_size, progress=False)
        t0 = time.perf_counter()
        done = subprocess.run(cmd, env=single_thread_env(dict(os.environ)), capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"[{name}] torchrun exited {done.returncode}:\n{done.stderr[-4000:]}")
        log = [json.loads(line) for line in (run_dir / "train_log.jsonl").read_text().splitlines()]
        history = [SimpleNamespace(**{k: m[k] for k in ("seconds", "tokens", "blocks", "loss", "tau_prob")}) for m in log]
        shutil.rmtree(run_dir, ignore_errors=True)  # its final checkpoint, as in run()
        return SimpleNamespace(history=history), time.perf_counter() - t0

    cache_notes: list[str] = []
    built: set[tuple] = set()  # the feature caches a cold run has built
    skipped: dict[str, str] = {}
    rounds: dict[str, list[dict]] = {name: [] for name, _ in rows}
    for r in range(args.rounds):
        for name, extra in round_order(rows, r, args.rounds):
            bf16 = "bf16" in name
            if bf16 and not native_bf16:
                skipped[name] = "bf16 is not native on this CPU (no avx512_bf16 / amx_bf16)"
                continue
            cache_extra = tuple(e for e in extra if e.startswith("data.feature_cache"))
            if cache_extra and cache_extra not in built:
                cold, secs = run(f"feature_cache_build{'_bf16' if bf16 else ''}",
                                 BASELINE[:3] + (BF16 if bf16 else FP32) + list(cache_extra))
                per_token = cold.cache_stats["disk_bytes"] / max(1, sum(m.tokens for m in cold.history))
                built.add(cache_extra)
                cache_notes.append(f"cold cache run ({'bf16' if bf16 else 'fp32'} target, builds it): "
                                   f"{secs:.1f} s for {args.steps} steps, {cold.cache_stats['disk_bytes'] / 2**20:.1f} "
                                   f"MiB on disk = {per_token / 1024:.1f} KiB per token")
                print(cache_notes[-1])
            res, _ = run(name if args.rounds == 1 else f"{name} r{r}", extra)
            # median step time after the first: robust to the spikes other processes put on a shared machine
            secs = statistics.median(m.seconds for m in (res.history[1:] or res.history))
            last = res.history[-1]
            tp = {"tokens_per_s": statistics.mean(m.tokens for m in res.history) / secs,
                  "blocks_per_s": statistics.mean(m.blocks for m in res.history) / secs}
            # what the steps took beyond the median: the compile rows' one-off compilation (and any first-step cost)
            one_off = sum(m.seconds for m in res.history) - secs * len(res.history)
            rounds[name].append({**tp, "loss": last.loss, "tau_prob": last.tau_prob,
                                 "blocks_per_step": last.blocks, "tokens_per_step": last.tokens,
                                 "one_off_seconds": one_off, "step_seconds": [m.seconds for m in res.history]})
            print(f"[{name}{f' round {r}' if args.rounds > 1 else ''}] {tp['tokens_per_s']:.1f} tokens/s, "
                  f"{tp['blocks_per_s']:.1f} blocks/s, loss {last.loss:.4f}, one-off {one_off:.1f} s, "
                  f"step seconds {[m.seconds for m in res.history]}", flush=True)

    ran = [name for name, _ in rows if rounds[name]]
    x_tokens = paired_ratios({n: [x["tokens_per_s"] for x in rounds[n]] for n in ran}, "baseline")
    x_blocks = paired_ratios({n: [x["blocks_per_s"] for x in rounds[n]] for n in ran}, "baseline")
    results = []
    for name, _ in rows:
        if name in skipped:
            results.append({"row": name, "skipped": skipped[name]})
            continue
        per_round = rounds[name]
        losses = [x["loss"] for x in per_round]
        results.append({
            "row": name, **{k: per_round[-1][k] for k in ("tau_prob", "blocks_per_step", "tokens_per_step")},
            "tokens_per_s": statistics.median(x["tokens_per_s"] for x in per_round),
            "blocks_per_s": statistics.median(x["blocks_per_s"] for x in per_round),
            # the same seed and batches every round: a loss that moves between rounds is a bug, not noise
            "loss": losses[-1], "loss_spread": max(losses) - min(losses),
            "one_off_seconds": statistics.median(x["one_off_seconds"] for x in per_round),
            "step_seconds": per_round[-1]["step_seconds"],
            "x_tokens": x_tokens[name][0], "x_blocks": x_blocks[name][0],
            "x_blocks_range": list(x_blocks[name][1:]), "rounds": per_round})

    print(f"\n{'row':<28} {'tokens/s':>9} {'blocks/s':>9} {'x tok/s':>8} {'x blk/s':>8} {'loss@N':>8} {'one-off s':>9}  note")
    print("-" * 96)
    for r in results:
        if "skipped" in r:
            print(f"{r['row']:<28} {'-':>9} {'-':>9} {'-':>8} {'-':>8} {'-':>8} {'-':>9}  skipped: {r['skipped']}")
            continue
        lo, hi = r["x_blocks_range"]
        note = f"x blk/s {lo:.2f}-{hi:.2f} over {args.rounds} rounds" if args.rounds > 1 else ""
        if r["loss_spread"] > 1e-4:
            note += f" LOSS MOVED {r['loss_spread']:.2e} BETWEEN ROUNDS"
        print(f"{r['row']:<28} {r['tokens_per_s']:>9.1f} {r['blocks_per_s']:>9.1f} {r['x_tokens']:>7.2f}x "
              f"{r['x_blocks']:>7.2f}x {r['loss']:>8.4f} {r['one_off_seconds']:>9.1f}  {note}")
    for note in cache_notes:
        print(note)
    payload = {"cpu": cpu_model(), "isa_caps": isa_caps(),
               "flags": sorted(f for f in flags if "avx" in f or "amx" in f),
               "capability": torch.backends.cpu.get_cpu_capability(), "threads": torch.get_num_threads(),
               "loadavg": os.getloadavg(), "dtype": str(dtype), "steps": args.steps, "rounds": args.rounds, "config": args.config,
               "overrides": common, "cache": cache_notes, "rows": results}
    tmp = out / ".bench_train.json.tmp"
    tmp.write_text(json.dumps(payload, indent=1))
    os.replace(tmp, out / "bench_train.json")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        shown = [r for r in results if "skipped" not in r]
        fig, ax = plt.subplots(figsize=(9, 4))
        x = range(len(shown))
        ax.bar([i - 0.2 for i in x], [r["x_tokens"] for r in shown], 0.4, label="tokens/s")
        # the range over rounds as an error bar (none with one round)
        err = [[r["x_blocks"] - r["x_blocks_range"][0] for r in shown], [r["x_blocks_range"][1] - r["x_blocks"] for r in shown]]
        ax.bar([i + 0.2 for i in x], [r["x_blocks"] for r in shown], 0.4, yerr=err, capsize=3,
               label="blocks/s (median over rounds, range)" if args.rounds > 1 else "blocks/s")
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xticks(list(x), [r["row"] for r in shown], rotation=30, ha="right")
        ax.set_ylabel("x baseline")
        ax.set_title(f"training throughput, {cpu_model()}, {dtype}, {args.steps} steps x {args.rounds} round(s)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "bench_train.png", dpi=120)
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)
    print(f"wrote {out / 'bench_train.json'} and {out / 'bench_train.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
