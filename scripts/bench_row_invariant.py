"""The row-invariant bf16 path (target/row_invariant.py): what it costs and what it buys, in one run.

On one bf16 embedded target, toggled in place between the stock fast path and the row-invariant path, each
round runs (in a seeded shuffled order) plain decoding and `shipped+lookup` speculation under both, one request
at a time over the same prompts: MT-Bench (the demo's set) and prompts of the other evaluation sets. It prints
the machine, the probe's verdict per linear shape, plain tok/s of each path and their ratio per round (the
path's cost), speculation's speedup under each path, and how many speculative outputs equal plain decoding's.

    python scripts/bench_row_invariant.py --limit 8 --other 12 --max-new-tokens 96 --rounds 3 --out out/ri.json

Benchmark on a quiet machine: the ratios are paired within a round, but a busy core still moves them.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time

import torch


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--limit", type=int, default=8, help="MT-Bench prompts (the demo's)")
    ap.add_argument("--other", type=int, default=12, help="prompts of gsm8k, humaneval, mbpp, math500 (spread evenly)")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--drafter", default="shipped+lookup")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="JSON file for the results")
    args = ap.parse_args(argv)
    if args.limit < 1 or args.other < 0 or args.rounds < 1 or args.max_new_tokens < 1:
        ap.error("--limit, --rounds and --max-new-tokens must be >= 1, --other >= 0")
    if args.threads:
        torch.set_num_threads(args.threads)

    from sglang_hspec.assets.prompts import chat_input_ids, load_prompts
    from sglang_hspec.core.types import SamplingParams
    from sglang_hspec.engine.drafters import NoDrafter
    from sglang_hspec.engine.engine import SpeculativeEngine
    from sglang_hspec.engine.identity import compare_greedy
    from sglang_hspec.engine.loading import load_drafter_spec
    from sglang_hspec.target.adapter import linear_shapes
    from sglang_hspec.target.dtypes import describe_machine
    from sglang_hspec.target.loading import load_target
    from sglang_hspec.target.row_invariant import linear_row_modes, make_row_invariant, restore_fast_path

    adapter = load_target("embedded", dtype="bf16", batch_invariant="off")
    machine = describe_machine()
    modes = {f"{k}x{n}": m for (k, n), m in linear_row_modes(linear_shapes(adapter.model), dtype=adapter.dtype).items()}
    print(f"machine: {machine}\nlinear shapes (in x out): {modes}", flush=True)
    t0 = time.perf_counter()
    holds = make_row_invariant(adapter)
    probe_seconds = time.perf_counter() - t0
    restore_fast_path(adapter)
    print(f"row-invariant path holds here: {holds} (probe + check {probe_seconds:.1f} s)", flush=True)

    sets = {"mtbench": load_prompts("mtbench", limit=args.limit)}
    others = ("gsm8k", "humaneval", "mbpp", "math500")
    for i, name in enumerate(others):
        n = args.other // len(others) + (i < args.other % len(others))
        if n:
            sets[name] = load_prompts(name, limit=n)
    prompts = {name: [chat_input_ids(adapter.tokenizer, it.messages(0)) for it in items] for name, items in sets.items()}
    flat = [p for ps in prompts.values() for p in ps]
    sampling = SamplingParams(temperature=0.0, max_new_tokens=args.max_new_tokens)
    engines = {"plain": SpeculativeEngine(adapter, NoDrafter()),
               "spec": SpeculativeEngine(adapter, load_drafter_spec(args.drafter, adapter))}
    paths = ("stock", "row_invariant") if holds else ("stock",)
    rng = random.Random(args.seed)
    rows = []
    outputs: dict[tuple[str, str], list[list[int]]] = {}
    for r in range(args.rounds):
        order = [(p, e) for p in paths for e in engines]
        rng.shuffle(order)
        for path, eng in order:
            (make_row_invariant if path == "row_invariant" else restore_fast_path)(adapter)
            tokens, seconds, outs = 0, 0.0, []
            for prompt in flat:
                t = time.perf_counter()
                res = engines[eng].generate([prompt], sampling)[0]
                seconds += time.perf_counter() - t
                tokens += len(res.output_ids)
                outs.append(res.output_ids)
            outputs[(path, eng)] = outs
            rows.append({"round": r, "path": path, "engine": eng, "tokens": tokens, "seconds": round(seconds, 3),
                         "tokens_per_second": round(tokens / seconds, 2)})
            print(json.dumps(rows[-1]), flush=True)
    restore_fast_path(adapter)

    def tps(r, path, eng):
        return next(x["tokens_per_second"] for x in rows if (x["round"], x["path"], x["engine"]) == (r, path, eng))

    summary = {"machine": machine, "linear_shapes": modes, "row_invariant_holds": holds,
               "probe_seconds": round(probe_seconds, 2), "prompts": {k: len(v) for k, v in prompts.items()},
               "max_new_tokens": args.max_new_tokens, "drafter": args.drafter, "rounds": rows}
    for path in paths:
        summary[f"speedup_{path}"] = statistics.median(tps(r, path, "spec") / tps(r, path, "plain")
                                                       for r in range(args.rounds))
        identical = {}
        start = 0
        for name, ps in prompts.items():
            cmp = compare_greedy(ps, outputs[(path, "plain")][start:start + len(ps)],
                                 outputs[(path, "spec")][start:start + len(ps)])
            identical[name] = cmp.label()
            start += len(ps)
        summary[f"identical_{path}"] = identical
    if holds:
        summary["plain_cost_ratio"] = statistics.median(tps(r, "row_invariant", "plain") / tps(r, "stock", "plain")
                                                        for r in range(args.rounds))
        summary["plain_row_invariant_vs_stock_identical"] = compare_greedy(
            flat, outputs[("stock", "plain")], outputs[("row_invariant", "plain")]).label()
    print(json.dumps({k: v for k, v in summary.items() if k != "rounds"}, indent=1))
    if args.out:
        from sglang_hspec.core.atomic import atomic_write_text

        atomic_write_text(args.out, json.dumps(summary, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
