"""Verify-length policies on the reference engine against plain decoding, side by side in one run.

For each batch size B (concurrent requests), each drafter and each policy (fixed, exact, stale, auto),
serve the same stream of requests (`--requests` MT-Bench first turns, `--dataset`, B at a time, through one engine
per run) and report throughput (tokens/s over the batch), its ratio to plain
decoding of the same batch in the same round (median over `--repeats` interleaved rounds, with its
range), the ratio of its median tok/s to plain's ("x med"), "x best" (its ratio to the better of plain decoding
and the same drafter's `fixed` in the same round: the yardstick of `auto`), tau, drafted steps and verified draft tokens
per step. The greedy outputs are checked against
plain decoding. The CPU model, its flags (avx2 / avx512_bf16 / amx), torch threads and dtype are printed
with the table. Drafters: `shipped`, a checkpoint directory, `random`
(the shipped architecture, untrained: matrices re-drawn N(0, 0.02), confidence head included) or `ngram`.

`--control` adds a second plain-decoding run to every round ("plain-aa", the A/A control): its ratio to
plain is what this machine's run-to-run noise alone gives, the yardstick for every other ratio (on a
shared 2-core VM identical runs differ by up to +-20 % and a median of 6 rounds by up to 6 %).

The SPS table: `--sps-table sps.json` (from `hspec profile-sps`, with the plain-decode and drafter columns
the auto policy weighs), or none, and the script profiles one first on this target (`--profile-*`).

    python scripts/bench_policies.py --drafters shipped,random --batch-sizes 1,4,16,32 --max-new-tokens 48
    python scripts/bench_policies.py --drafters random --batch-sizes 1,4 --max-new-tokens 16 --policies fixed,auto
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from sglang_hspec.assets.prompts import chat_input_ids, load_prompts
from sglang_hspec.core.types import SamplingParams
from sglang_hspec.engine.drafters import NoDrafter
from sglang_hspec.engine.engine import SpeculativeEngine
from sglang_hspec.engine.loading import load_drafter_spec
from sglang_hspec.engine.policies import make_policy
from sglang_hspec.target.dtypes import describe_machine as cpu_description
from sglang_hspec.target.loading import load_target


def load_drafter(spec: str, adapter):
    if spec != "random":
        return load_drafter_spec(spec, adapter)
    drafter = load_drafter_spec("shipped", adapter)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in drafter.parameters():
            if p.requires_grad and p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    drafter.name = "random"
    return drafter


def profile_table(args, out: Path) -> str:
    from sglang_hspec.scheduler.profiler import profile_sps
    from sglang_hspec.scheduler.sps import save_sps_table

    from sglang_hspec.engine.profile import make_step_fn

    sizes = [int(x) for x in args.batch_sizes.split(",")]
    batch_tokens = sorted({1, 2, 4, 8} | {b * f for b in sizes for f in (1, 2, 4, 8)})
    step_fn = make_step_fn(max_batch_tokens=max(batch_tokens), target=args.target, dtype=args.dtype,
                           context=args.profile_context, max_requests=max(sizes), drafter="shipped",
                           batch_invariant=args.batch_invariant)
    table = profile_sps(step_fn=step_fn, batch_tokens=batch_tokens, plain_fn=step_fn.plain_fn,
                        draft_fn=step_fn.draft_fn, plain_batch_sizes=sorted(set(sizes)), warmup=1,
                        repeats=args.profile_repeats, steps_per_repeat=2)
    save_sps_table(table, out)
    del step_fn
    return str(out)


def add_paired_ratios(rows: list[dict]) -> None:
    """Each row's ratios to runs of the same batch and round: x_plain (over plain decoding) and x_best (over the
    better of plain decoding and always drafting, `fixed`, with the same drafter: what `auto` should reach;
    None where the round has no `fixed` run of that drafter)."""
    plain = {(r["batch"], r["round"]): r["throughput_tok_s"] for r in rows if r["policy"] == "plain"}
    always = {(r["batch"], r["round"], r["drafter"]): r["throughput_tok_s"] for r in rows if r["policy"] == "fixed"}
    for r in rows:
        key = (r["batch"], r["round"])
        r["x_plain"] = r["throughput_tok_s"] / plain[key]
        best = always.get((*key, r["drafter"]))
        r["x_best"] = None if best is None else r["throughput_tok_s"] / max(best, plain[key])


def summarize(rows: list[dict]) -> list[dict]:
    """One row per (batch, drafter, policy): medians over the rounds (x_plain: of the per-round ratios),
    the ratio's range, and whether every round's greedy outputs matched plain decoding."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["batch"], r["drafter"], r["policy"]), []).append(r)
    out = []
    for (b, spec, name), rs in groups.items():
        ratios = [r["x_plain"] for r in rs]
        same = [r["same_as_plain"] for r in rs]
        out.append({
            "batch": b, "drafter": spec, "policy": name, "rounds": len(rs),
            "throughput_tok_s": statistics.median(r["throughput_tok_s"] for r in rs),
            "x_plain": statistics.median(ratios), "x_plain_min": min(ratios), "x_plain_max": max(ratios),
            "x_best": None if rs[0].get("x_best") is None else statistics.median(r["x_best"] for r in rs),
            "x_best_min": None if rs[0].get("x_best") is None else min(r["x_best"] for r in rs),
            "tau": statistics.median(r["tau"] for r in rs), "steps": rs[0]["steps"],
            "drafted_steps": rs[0]["drafted_steps"],
            "verified_drafts_per_step": statistics.median(r["verified_drafts_per_step"] for r in rs),
            "same_as_plain": None if same[0] is None else all(same),
        })
    return out


def request_waves(num_prompts: int, *, batch_size: int, requests: int) -> list[list[int]]:
    """Prompt indices of the generate() calls of one run: `requests` prompts (at least one batch) served
    `batch_size` at a time in turn, prompts reused from the start when the set runs out."""
    if batch_size < 1 or requests < 1 or num_prompts < 1:
        raise ValueError(f"need batch_size, requests and prompts >= 1, got {batch_size}, {requests}, {num_prompts}")
    total = -(-max(requests, batch_size) // batch_size) * batch_size
    order = [i % num_prompts for i in range(total)]
    return [order[i : i + batch_size] for i in range(0, total, batch_size)]


def round_order(configs: list, r: int, order: str) -> list:
    """The configurations run in round r (r = -1: the warm-up, plain decoding alone). 'alternate': odd rounds
    reversed, so none always runs first; but at the turn between rounds the last one runs twice in a row, and
    its neighbours never change (at B = 1 that favoured `plain` by ~5 %). 'shuffle': a permutation seeded by
    the round, the same in every run of the bench."""
    if r < 0:
        return configs[:1]
    if order == "shuffle":
        return random.Random(r).sample(configs, len(configs))
    return configs if r % 2 == 0 else configs[::-1]


def policy_variant(name: str) -> tuple[str, bool, float | None]:
    """(make_policy name, guard, guard_prior or None for the default) of a --policies entry: auto-unguarded,
    auto-prior<N>, or a plain name."""
    if name == "auto-unguarded":
        return "auto", False, None
    if name.startswith("auto-prior"):
        try:
            prior = float(name.removeprefix("auto-prior"))
        except ValueError:
            prior = -1.0
        if not prior > 0:
            raise SystemExit(f"--policies {name}: write auto-prior<N> with a prior N > 0 in tokens per request, "
                             "e.g. auto-prior4")
        return "auto", True, prior
    return name, True, None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="embedded")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--batch-invariant", default="auto", choices=("auto", "on", "off"),
                    help="the target's row-invariant mode, as the engine's default (auto: on for bf16 on a CPU where "
                         "it holds, so greedy speculation is token-identical to plain); the SPS table it profiles "
                         "uses the same mode")
    ap.add_argument("--drafters", default="shipped,random", help="comma-separated: shipped, random, ngram, DIR")
    ap.add_argument("--sps-table", default=None, help="SPS table JSON; default: profile one first")
    ap.add_argument("--profile-context", type=int, default=128)
    ap.add_argument("--profile-repeats", type=int, default=3)
    ap.add_argument("--sts", default=None)
    ap.add_argument("--batch-sizes", default="1,4,16,32")
    ap.add_argument("--policies", default="fixed,stale,auto",
                    help="comma-separated: fixed, exact, stale, auto, auto-unguarded (auto without its realized-rate "
                         "guard, scheduler/policy.py), auto-prior<N> (auto with the guard's prior at N tokens per "
                         "request; default scheduler.switch.GUARD_PRIOR)")
    ap.add_argument("--dataset", default="mtbench", help="prompt set (sglang_hspec/assets/prompts.py), e.g. gsm8k")
    ap.add_argument("--requests", type=int, default=16,
                    help="requests per run, served --batch-sizes at a time by one engine (so `auto` learns from "
                         "earlier requests, as in a server); a batch larger than this runs once")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's; 1 on a shared box)")
    ap.add_argument("--repeats", type=int, default=3,
                    help="rounds per batch size: every configuration once per round, in turn, so drift hits all "
                         "alike; a ratio is the median over rounds of throughput / plain's in the same round")
    ap.add_argument("--control", action="store_true",
                    help="also run plain decoding a second time each round (policy plain-aa): the A/A noise floor")
    ap.add_argument("--order", choices=["alternate", "shuffle"], default="shuffle",
                    help="order of the configurations within a round: shuffle (default; a permutation per round, "
                         "seeded by the round: no configuration keeps a position or a neighbour) or alternate (odd "
                         "rounds reversed; it ran plain right after itself across rounds and favoured it by ~5 %% "
                         "at B = 1)")
    ap.add_argument("--out", default=None, help="JSON with every row (and the SPS table path)")
    args = ap.parse_args(argv)
    for name in args.policies.split(","):  # a misspelt variant fails before the target loads
        policy_variant(name)
    if args.threads:
        torch.set_num_threads(args.threads)

    sps_table = args.sps_table or profile_table(args, Path(args.out or "bench_policies.json").with_suffix(".sps.json"))
    adapter = load_target(args.target, dtype=args.dtype, batch_invariant=args.batch_invariant)
    drafters = {spec: load_drafter(spec, adapter) for spec in args.drafters.split(",")}
    items = load_prompts(args.dataset)
    prompts = [chat_input_ids(adapter.tokenizer, it.messages(0)) for it in items]
    sampling = SamplingParams(temperature=args.temperature, max_new_tokens=args.max_new_tokens, ignore_eos=True,
                              seed=0)
    rows = []
    sizes = [int(x) for x in args.batch_sizes.split(",")]
    names = args.policies.split(",")
    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    plain_names = ["plain", "plain-aa"] if args.control else ["plain"]
    configs = [(spec, name) for spec in ["none", *drafters] for name in (plain_names if spec == "none" else names)]
    runs = [(b, r, spec, name) for b in sizes for r in range(-1, args.repeats)
            for spec, name in round_order(configs, r, args.order)]
    plain_out: dict[int, list] = {}
    for b, round_, spec, name in tqdm(runs, desc="runs"):
        waves = request_waves(len(prompts), batch_size=b, requests=args.requests)
        if spec == "none":
            engine = SpeculativeEngine(adapter, NoDrafter())
        else:
            drafter = drafters[spec]
            base, guard, prior = policy_variant(name)
            policy, transform = make_policy(base, block_size=drafter.block_size, sps_table=sps_table, sts=args.sts,
                                            guard=guard, guard_prior=prior)
            engine = SpeculativeEngine(adapter, drafter, policy=policy, confidence_transform=transform)
        res, steps = [], 0
        t0 = time.perf_counter()
        for wave in waves:  # one engine: its policy's state carries from request to request, as in a server
            out = engine.generate([prompts[i] for i in wave], sampling)
            res += out
            steps += max(r.stats.num_steps for r in out)
        wall = time.perf_counter() - t0
        tokens = sum(len(r.output_ids) for r in res)
        outputs = [r.output_ids for r in res]
        if name == "plain":
            plain_out[b] = outputs
        stats = getattr(getattr(engine.policy, "planner", None), "stats", None)
        drafted = stats().speculative_steps if stats and stats().speculative_steps >= 0 else (0 if spec == "none" else steps)
        if round_ < 0:
            continue  # warm-up
        rows.append({
            "batch": b, "round": round_, "drafter": spec, "policy": name, "throughput_tok_s": tokens / wall,
            "wall_s": wall,
            "tau": sum(sum(r.stats.accept_lengths) for r in res) / max(1, sum(r.stats.num_steps for r in res)),
            "steps": steps, "drafted_steps": drafted,
            "verified_drafts_per_step": sum(sum(r.stats.verify_lengths) for r in res) / max(1, steps),
            "same_as_plain": outputs == plain_out[b] if args.temperature == 0 else None,
        })
    add_paired_ratios(rows)
    summary = summarize(rows)
    # a second estimate: median tok/s over plain's median tok/s (each configuration's own median, so
    # not the noise of two runs per round, but not paired against drift either)
    plain_median = {r["batch"]: r["throughput_tok_s"] for r in summary if r["policy"] == "plain"}
    for r in summary:
        r["x_plain_of_medians"] = r["throughput_tok_s"] / plain_median[r["batch"]]
    print(f"\n{cpu_description()} | torch threads {torch.get_num_threads()} | dtype {adapter.dtype}"
          f"{' batch-invariant' if adapter.batch_invariant else ''} | "
          f"{args.dataset} | {args.requests} requests per run | max_new_tokens {args.max_new_tokens} | T={args.temperature} | SPS table {sps_table} | "
          f"median of {args.repeats} interleaved rounds "
          + ("(a seeded permutation per round)" if args.order == "shuffle" else "(odd rounds in reverse order)"))
    print(f"{'B':>4} {'drafter':<10} {'policy':<7} {'tok/s':>8} {'x plain':>8} {'(min-max)':>11} {'x med':>6} {'tau':>6} "
          f"{'drafted':>9} {'drafts/step':>12} {'same':>5} {'x best':>7}")
    for r in summary:
        print(f"{r['batch']:>4} {r['drafter']:<10} {r['policy']:<7} {r['throughput_tok_s']:>8.1f} "
              f"{r['x_plain']:>8.2f} {r['x_plain_min']:>5.2f}-{r['x_plain_max']:<5.2f} {r['x_plain_of_medians']:>6.2f} "
              f"{r['tau']:>6.2f} "
              f"{r['drafted_steps']:>4}/{r['steps']:<4} {r['verified_drafts_per_step']:>12.2f} "
              f"{'' if r['same_as_plain'] is None else str(r['same_as_plain']):>5} "
              f"{'' if r['x_best'] is None else format(r['x_best'], '.2f'):>7}")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"cpu": cpu_description(), "device": str(adapter.device), "dtype": str(adapter.dtype),
                       "batch_invariant": adapter.batch_invariant,
                       "threads": torch.get_num_threads(), "sps_table": sps_table, "repeats": args.repeats,
                       "order": args.order, "dataset": args.dataset, "requests": args.requests,
                       "max_new_tokens": args.max_new_tokens,
                       "summary": summary, "rows": rows}, fh, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
