"""What one speculative step costs on the reference engine, in plain decode steps, and where its time goes.

Plain decoding and speculation (chain, and with --tree a tree of that many verify rows) run over the same
prompts (--datasets, the first --limit of each, first turns), --batch-size requests at a time, interleaved
per batch and repeated for --rounds. Every call of the
drafter's `propose` and of the target's forwards (`extend`, `extend_tree`) is timed; what is left of a step is
the engine's host work (acceptance, KV commit, bookkeeping). Prints the machine and, per engine: ms per
(batch) step, its draft / target / host parts, the step cost (ms per speculative step over ms per plain
decode step), tau (tokens per row and step) and the speedup (tokens per second over plain decoding's). To see what a change to the step buys, run this script from two checkouts
side by side (PYTHONPATH=<other checkout> python scripts/bench_step_cost.py ...), alternating.

    python scripts/bench_step_cost.py --dtype bf16 --limit 4 --max-new-tokens 64 --rounds 2 --out out/step.json
    python scripts/bench_step_cost.py --tree 16 --datasets mtbench,gsm8k,humaneval,mbpp,math500 --limit 16 \
        --batch-size 4 --rounds 1 --out out/tree_b4.json

Benchmark on a quiet machine: the parts are paired within a run, but a busy core still moves them.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict


class PhaseTimer:
    """Wall seconds per phase, accumulated by wrapping bound methods of live objects."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    def wrap(self, obj, method: str, phase: str) -> None:
        inner = getattr(obj, method)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds[phase] += time.perf_counter() - start

        setattr(obj, method, timed)


def step_rows(totals: dict[str, dict[str, float]]) -> list[dict]:
    """Per engine, from its summed step seconds (prefills excluded), (batch) steps, row steps (a row's share
    of the steps; = steps at batch 1), accepted tokens, output tokens and the seconds spent in the drafter
    and in the target's forwards (prefills included): ms per step and its draft / target / host parts, the
    step cost in plain decode steps ("plain" is the first engine's row), tau (accepted per row step) and
    the speedup (output tokens per second over plain's)."""
    plain = totals["plain"]
    plain_ms = 1e3 * plain["seconds"] / plain["steps"]
    plain_rate = plain["tokens"] / plain["seconds"]
    rows = []
    for name, t in totals.items():
        ms = 1e3 * t["seconds"] / t["steps"]
        target_ms = 1e3 * (t["target"] - t["prefill"]) / t["steps"]  # the prefill's forward is outside the steps
        draft_ms = 1e3 * t["draft"] / t["steps"]
        tau = t["accepted"] / t.get("row_steps", t["steps"])
        rows.append({"engine": name, "steps": int(t["steps"]), "tokens": int(t["tokens"]), "ms_per_step": ms,
                     "draft_ms": draft_ms, "target_ms": target_ms, "host_ms": ms - draft_ms - target_ms,
                     "step_cost": ms / plain_ms, "tau": tau, "speedup": t["tokens"] / t["seconds"] / plain_rate})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="auto", help="target dtype: auto, bf16, fp32")
    ap.add_argument("--drafter", default="shipped+lookup")
    ap.add_argument("--tree", type=int, default=0, help="also run tree verification with this many verify rows")
    ap.add_argument("--sps-table", default=None, help="with --tree: also run the tree sized by this SPS table "
                    "(`hspec profile-sps`; engine/tree.py size_trees)")
    ap.add_argument("--batch-invariant", default="auto", choices=("auto", "on", "off"))
    ap.add_argument("--datasets", default="mtbench", help="comma-separated prompt sets (first turns)")
    ap.add_argument("--limit", type=int, default=4, help="prompts of each set")
    ap.add_argument("--batch-size", type=int, default=1, help="requests decoded together")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--out", default=None, help="JSON file for the results")
    args = ap.parse_args(argv)
    if args.limit < 1 or args.rounds < 1 or args.batch_size < 1 or args.max_new_tokens < 2 or args.tree < 0:
        ap.error("--limit, --rounds and --batch-size must be >= 1, --max-new-tokens >= 2, --tree >= 0")
    if args.sps_table and not args.tree:
        ap.error("--sps-table sizes the tree: give --tree ROWS too")

    import torch

    from sglang_hspec.assets.prompts import PROMPT_SETS, chat_input_ids, load_prompts
    from sglang_hspec.core.types import SamplingParams
    from sglang_hspec.engine.engine import SpeculativeEngine
    from sglang_hspec.engine.loading import load_drafter_spec
    from sglang_hspec.target.dtypes import describe_machine
    from sglang_hspec.target.loading import load_target

    if args.threads:
        torch.set_num_threads(args.threads)
    adapter = load_target("embedded", dtype=args.dtype, batch_invariant=args.batch_invariant)
    datasets = [d.strip() for d in args.datasets.split(",") if d.strip()]
    unknown = [d for d in datasets if d not in PROMPT_SETS]
    if unknown or not datasets:
        ap.error(f"--datasets: unknown {unknown or 'empty list'}; valid names: {', '.join(PROMPT_SETS)}")
    items = [(d, it) for d in datasets for it in load_prompts(d, limit=args.limit)]
    prompts = [chat_input_ids(adapter.tokenizer, it.messages(0)) for _, it in items]
    batches = [list(range(i, min(i + args.batch_size, len(prompts)))) for i in range(0, len(prompts), args.batch_size)]
    sampling = SamplingParams(max_new_tokens=args.max_new_tokens)
    engines = {"plain": SpeculativeEngine(adapter, load_drafter_spec("none", adapter)),
               "chain": SpeculativeEngine(adapter, load_drafter_spec(args.drafter, adapter))}
    if args.tree:
        from sglang_hspec.engine.tree import TreeSpec

        engines[f"tree {args.tree}"] = SpeculativeEngine(adapter, load_drafter_spec(args.drafter, adapter),
                                                         tree=TreeSpec(max_rows=args.tree))
        if args.sps_table:
            engines[f"tree {args.tree} sized"] = SpeculativeEngine(
                adapter, load_drafter_spec(args.drafter, adapter),
                tree=TreeSpec(max_rows=args.tree, sps_table=args.sps_table))
    timers = {name: PhaseTimer() for name in engines}
    totals = {name: defaultdict(float) for name in engines}
    for name, engine in engines.items():
        if engine.tree is None:
            timers[name].wrap(engine.drafter, "propose", "draft")
        else:  # a tree runs the learned drafter's backbone and base head once, then its own per-node heads (host)
            model = getattr(engine.drafter, "drafter", engine.drafter)
            for method in ("backbone", "base_logits"):
                timers[name].wrap(model, method, "draft")
    for method in ("extend", "extend_tree"):
        if hasattr(adapter, method):
            inner = getattr(adapter, method)

            def routed(*a, _inner=inner, **kw):
                start = time.perf_counter()
                try:
                    return _inner(*a, **kw)
                finally:
                    timers[current].seconds["target"] += time.perf_counter() - start

            setattr(adapter, method, routed)
    from tqdm.auto import tqdm

    per_set = {name: defaultdict(lambda: [0, 0]) for name in engines}  # accepted, row steps per prompt set
    for _ in tqdm(range(args.rounds), desc="rounds", unit="round"):
        for batch in tqdm(batches, desc="batches", unit="batch", leave=False):
            for current, engine in engines.items():  # noqa: B007 (read by `routed`)
                before = dict(timers[current].seconds)
                start = time.perf_counter()
                results = engine.generate([prompts[i] for i in batch], sampling)
                wall = time.perf_counter() - start
                t = totals[current]
                prefill = results[0].stats.prefill_seconds  # one prefill for the batch
                t["seconds"] += wall - prefill
                t["prefill"] += prefill
                t["steps"] += max(r.stats.num_steps for r in results)
                for i, r in zip(batch, results):
                    t["row_steps"] += r.stats.num_steps
                    t["accepted"] += sum(r.stats.accept_lengths)
                    t["tokens"] += len(r.output_ids)
                    cell = per_set[current][items[i][0]]
                    cell[0] += sum(r.stats.accept_lengths)
                    cell[1] += r.stats.num_steps
                for phase in ("draft", "target"):
                    t[phase] += timers[current].seconds[phase] - before.get(phase, 0.0)
    rows = step_rows(totals)
    machine = describe_machine()
    dtype = str(adapter.dtype).replace("torch.", "")
    print(f"\nmachine: {machine}\ntarget: embedded ({dtype}{', row-invariant' if adapter.row_invariant else ''}), "
          f"drafter {args.drafter}, {len(prompts)} prompts of {', '.join(datasets)} x {args.max_new_tokens} tokens x "
          f"{args.rounds} rounds, batch {args.batch_size}\n")
    head = f"{'engine':<14} {'ms/step':>8} {'draft':>7} {'target':>7} {'host':>6} {'step cost':>9} {'tau':>5} {'speedup':>8}"
    print(head + "\n" + "-" * len(head))
    for r in rows:
        print(f"{r['engine']:<14} {r['ms_per_step']:>8.1f} {r['draft_ms']:>7.1f} {r['target_ms']:>7.1f} "
              f"{r['host_ms']:>6.1f} {r['step_cost']:>9.2f} {r['tau']:>5.2f} {r['speedup']:>7.2f}x")
    set_tau = {name: {d: a / max(n, 1) for d, (a, n) in cells.items()} for name, cells in per_set.items()}
    if len(datasets) > 1:
        print("\ntau per set: " + "; ".join(f"{name}: " + ", ".join(f"{d} {v:.2f}" for d, v in taus.items())
                                         for name, taus in set_tau.items()))
    if args.out:
        from sglang_hspec.core.atomic import atomic_write_text

        atomic_write_text(args.out, json.dumps({"machine": machine, "dtype": dtype, "row_invariant": adapter.row_invariant,
                                                "args": vars(args), "rows": rows, "tau_per_set": set_tau},
                                               indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
