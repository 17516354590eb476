"""`hspec`: the command-line entry point. Subcommands import their modules lazily."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from sglang_hspec.engine.options import add_engine_args as _add_engine_args
from sglang_hspec.engine.options import check_engine_flags


def _add_sampling_args(p: argparse.ArgumentParser, *, max_new_tokens: int) -> None:
    p.add_argument("--max-new-tokens", type=int, default=max_new_tokens)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)


def _sampling(args, **overrides):
    from sglang_hspec.core.types import SamplingParams

    kw = dict(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
              max_new_tokens=args.max_new_tokens, seed=args.seed)
    kw.update(overrides)
    return SamplingParams(**kw)


def _drafter_spec(args) -> str:
    from sglang_hspec.engine.loading import default_drafter_spec

    # the shipped drafter fits the embedded target only; other targets default to prompt lookup
    return args.drafter or (default_drafter_spec() if args.target == "embedded" else "ngram")


def build_engine(args, adapter=None, drafter_spec: str | None = None, tree: int | None = None):
    """Target + drafter + policy (+ STS, + tree verification) from parsed CLI arguments (`tree`: verify rows
    of a tree, overriding --tree; 0 = the chain)."""
    from sglang_hspec.engine.engine import SpeculativeEngine
    from sglang_hspec.engine.loading import load_drafter_spec
    from sglang_hspec.engine.policies import make_policy
    from sglang_hspec.target.loading import load_target

    adapter = adapter or load_target(args.target, dtype=args.dtype,
                                     batch_invariant=getattr(args, "batch_invariant", False))
    spec = drafter_spec or _drafter_spec(args)
    drafter = load_drafter_spec(spec, adapter, block_size=None if spec == "none" else args.block_size)
    if spec == "none":  # plain decoding (the demo's baseline): nothing to schedule or calibrate
        policy, transform = make_policy("fixed", block_size=drafter.block_size)
    else:
        policy, transform = make_policy(args.policy, block_size=drafter.block_size, sps_table=args.sps_table,
                                        sts=args.sts)
    rows = getattr(args, "tree", 0) if tree is None else tree
    tree_spec = None
    if rows and spec != "none":
        from sglang_hspec.engine.tree import TreeSpec

        tree_spec = TreeSpec(max_rows=rows, sps_table=getattr(args, "sps_table", None))
    return SpeculativeEngine(adapter, drafter, policy=policy, confidence_transform=transform, tree=tree_spec)


# ---------------------------------------------------------------------------- flag validation
# Checked before the target loads (seconds, or ~30 s on the first embedded run): a bad flag is
# answered at once, naming the flag, the problem and the fix.



def check_sampling_flags(args) -> None:
    t = args.temperature
    if not t == t or t < 0 or t == float("inf"):  # nan fails t == t
        raise ValueError(f"--temperature must be a finite number >= 0 (0 = greedy), got {t}")
    if not 0 < args.top_p <= 1:
        raise ValueError(f"--top-p must be in (0, 1] (1 disables nucleus sampling), got {args.top_p}")
    if args.top_k < 0:
        raise ValueError(f"--top-k must be >= 0 (0 disables it), got {args.top_k}")
    if t == 0 and (args.top_p < 1 or args.top_k > 0):
        flag = f"--top-p {args.top_p}" if args.top_p < 1 else f"--top-k {args.top_k}"
        raise ValueError(f"{flag} has no effect with --temperature 0 (greedy decoding): set --temperature > 0 "
                         f"to sample, or drop {flag.split()[0]}")
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    for stop in getattr(args, "stop", None) or ():
        if not stop:
            raise ValueError("--stop '' is empty: it would end every output after its first token; "
                             "give a non-empty stop string")


def check_output_file(path: str, *, flag: str) -> None:
    """A file the command writes at its end: refuse, before any work, one that could never be written."""
    from sglang_hspec.training.config import output_dir_problem

    file = Path(path)
    if file.is_dir():
        raise ValueError(f"{flag} {path} is a directory; give a file path such as {file / 'out.json'}")
    problem = output_dir_problem(file.parent)
    if problem:
        raise ValueError(f"{flag} {path} cannot be written: {problem}; pick another {flag}")


# ---------------------------------------------------------------------------- generate

def _read_prompts(args) -> list[list[dict]]:
    if args.prompt is not None:
        if not args.prompt.strip():
            raise SystemExit("error: --prompt is empty; give some text")
        return [[{"role": "user", "content": args.prompt}]]
    path = Path(args.prompt_file)
    if path.is_dir():
        raise SystemExit(f"error: prompt file {path} is a directory; pass a text file (one prompt per line) or a "
                         "JSONL of {id, turns}")
    if not path.is_file():
        raise SystemExit(f"error: prompt file {path} does not exist")
    if path.suffix == ".jsonl":
        from sglang_hspec.assets.prompts import load_prompt_file

        return [item.messages(0) for item in load_prompt_file(path)]
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise SystemExit(f"error: prompt file {path} is not UTF-8 text (byte {e.start}); pass a text file, one "
                         "prompt per line") from None
    lines = [ln for ln in text.splitlines() if ln.strip()]
    if not lines:
        raise SystemExit(f"error: prompt file {path} holds no prompts (one per line, or JSONL of {{id, turns}})")
    return [[{"role": "user", "content": ln}] for ln in lines]


def check_text_target(args) -> None:
    """generate / demo / bench engine turn text into tokens: the tiny test target has no tokenizer."""
    if args.target == "tiny":
        raise ValueError("--target tiny is a random test model without a tokenizer, so it cannot read a prompt: use "
                         "--target embedded or a local Hugging Face model directory")


def cmd_generate(args) -> int:
    from sglang_hspec.assets.prompts import chat_input_ids

    check_text_target(args)
    check_sampling_flags(args)
    check_engine_flags(args, _drafter_spec(args))
    conversations = _read_prompts(args)
    engine = build_engine(args)
    tok = engine.adapter.tokenizer
    if args.raw:
        prompts = [tok.encode(c[0]["content"]) for c in conversations]
    else:
        prompts = [chat_input_ids(tok, c) for c in conversations]
    sampling = _sampling(args, stop=tuple(args.stop or ()))
    results = engine.generate(prompts, sampling, progress=not args.json and len(prompts) > 1)
    if args.json:
        payload = [dict(r.to_dict(), drafter=engine.drafter.name) for r in results]
        print(json.dumps(payload[0] if len(payload) == 1 else payload))
        return 0
    for r in results:
        print(r.text)
        s = r.stats
        print(f"\n[{engine.drafter.name}] {len(r.output_ids)} tokens, finish={r.finish_reason}, tau={s.tau:.2f}, "
              f"steps={s.num_steps}, {r.tokens_per_second:.1f} tok/s", file=sys.stderr)
    return 0


def add_generate_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate text with speculative decoding on the reference engine")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="one user message")
    src.add_argument("--prompt-file", help="text file (one prompt per line) or JSONL of {id, turns}")
    _add_engine_args(p)
    _add_sampling_args(p, max_new_tokens=128)
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--raw", action="store_true", help="do not apply the chat template")
    p.add_argument("--json", action="store_true", help="print one JSON object with the text and the stats")
    p.set_defaults(func=cmd_generate)


# ---------------------------------------------------------------------------- demo / bench engine

def run_side_by_side(engine_by_name: dict, prompts: list[list[int]], sampling, *, desc: str) -> list[dict]:
    """Run every engine over the same prompts one request at a time (batch 1), interleaved per
    prompt so machine-speed drift hits all of them alike. Returns one row per engine; under greedy
    decoding each row says exactly how many outputs matched the first engine's (plain decoding) and
    where the earliest one did not (engine/identity.py); under sampling that comparison is n/a."""
    from tqdm.auto import tqdm

    from sglang_hspec.engine.identity import compare_greedy

    totals = {name: {"tokens": 0, "seconds": 0.0, "steps": 0, "accepted": 0, "outputs": []}
              for name in engine_by_name}
    for prompt in tqdm(prompts, desc=desc, unit="prompt"):
        for name, engine in engine_by_name.items():
            t0 = time.perf_counter()
            r = engine.generate([prompt], sampling)[0]
            dt = time.perf_counter() - t0
            t = totals[name]
            t["tokens"] += len(r.output_ids)
            t["seconds"] += dt
            t["steps"] += r.stats.num_steps
            t["accepted"] += sum(r.stats.accept_lengths)
            t["outputs"].append(r.output_ids)
    base = next(iter(totals.values()))
    base_engine = next(iter(engine_by_name.values()))
    eos = min(base_engine.eos_token_ids) if base_engine.eos_token_ids else None
    rows = []
    for name, t in totals.items():
        same = None
        if sampling.greedy:
            same = compare_greedy(prompts, base["outputs"], t["outputs"], adapter=base_engine.adapter,
                                  eos_token_id=eos)
        tps = t["tokens"] / t["seconds"] if t["seconds"] else 0.0
        base_tps = base["tokens"] / base["seconds"] if base["seconds"] else 0.0
        rows.append({
            "drafter": name,
            "tau": t["accepted"] / max(1, t["steps"]),
            "tokens": t["tokens"],
            "seconds": t["seconds"],
            "tokens_per_second": tps,
            "speedup": tps / base_tps if base_tps else 0.0,
            # seconds per step (draft + verify) in plain decode steps: speedup = tau / step_cost
            "step_cost": ((t["seconds"] / t["steps"]) / (base["seconds"] / base["steps"])
                          if t["steps"] and base["steps"] and base["seconds"] else 0.0),
            # True only when every output matched token for token; None under sampling
            "identical_to_plain": None if same is None else same.exact,
            "same_as_plain": "n/a (sampling)" if same is None else same.label(),
            "divergences": [] if same is None else [d.__dict__ for d in same.divergences],
        })
    return rows


def format_table(rows: list[dict]) -> str:
    width = max([14, *(len(r["drafter"]) for r in rows)])
    head = f"{'drafter':<{width}} {'tau':>5} {'step cost':>9} {'tokens':>6} {'tok/s':>7} {'speedup':>8}  same-as-plain"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['drafter']:<{width}} {r['tau']:>5.2f} {r.get('step_cost', 0.0):>9.2f} {r['tokens']:>6d} "
                     f"{r['tokens_per_second']:>7.1f} {r['speedup']:>7.2f}x  {r['same_as_plain']}")
    return "\n".join(lines)


def cmd_demo(args) -> int:
    from sglang_hspec.assets.prompts import chat_input_ids, load_prompts
    from sglang_hspec.engine.loading import default_drafter_spec
    from sglang_hspec.target.dtypes import describe_machine
    from sglang_hspec.target.loading import load_target

    spec = args.drafter or default_drafter_spec()
    names = ["none"] + [s for s in dict.fromkeys([spec, *(args.also or [])]) if s != "none"]
    if args.limit < 1:
        raise ValueError(f"--limit must be >= 1 (MT-Bench questions to run), got {args.limit}")
    check_text_target(args)
    if args.json_out:
        check_output_file(args.json_out, flag="--json-out")
    check_sampling_flags(args)
    for name in names[1:]:  # the plain-decoding baseline takes no speculation flags
        check_engine_flags(args, name)
    print("loading the target; the first run converts the embedded model once (~30 s)...", file=sys.stderr)
    adapter = load_target(args.target, dtype=args.dtype, batch_invariant=args.batch_invariant)
    items = load_prompts("mtbench", limit=args.limit)
    prompts = [chat_input_ids(adapter.tokenizer, it.messages(0)) for it in items]
    engines = {}
    for name in names:
        label = name if name in ("none", "ngram") else Path(name).name or name
        # with --tree, each speculative drafter runs twice: its chain, then its tree (side by side in one run)
        for rows in ((0, args.tree) if args.tree and name != "none" else (0,)):
            eng = build_engine(args, adapter=adapter, drafter_spec=name, tree=rows)
            base = eng.drafter.name if name in ("none", "ngram") else label
            engines[f"{base} tree {rows}" if rows else base] = eng
    sampling = _sampling(args)
    rows = run_side_by_side(engines, prompts, sampling, desc="MT-Bench")
    print(f"\nMT-Bench, {len(prompts)} prompts x {args.max_new_tokens} new tokens, {args.target} target "
          f"({str(adapter.dtype).replace('torch.', '')}{', row-invariant' if adapter.batch_invariant else ''}), "
          f"batch 1, temperature {args.temperature}\nmachine: {describe_machine()}\n"
          "step cost: seconds per speculative step (draft + verify) in plain decode steps, so speedup = tau / "
          "step cost; same-as-plain: prompts whose outputs are identical token for token\n")
    print(format_table(rows))
    if args.json_out:
        from sglang_hspec.core.atomic import atomic_write_text

        atomic_write_text(args.json_out, json.dumps(rows, indent=2) + "\n")
    return 0


def add_demo_parser(sub) -> None:
    p = sub.add_parser("demo", help="the embedded default: MT-Bench on SmolLM2, plain decode vs speculation")
    _add_engine_args(p)
    _add_sampling_args(p, max_new_tokens=96)
    p.add_argument("--limit", type=int, default=8, help="MT-Bench questions (first turns)")
    p.add_argument("--also", action="append", help="extra drafter to compare (repeatable), e.g. --also ngram")
    p.add_argument("--json-out", default=None, help="also write the table as JSON")
    p.set_defaults(func=cmd_demo)


def cmd_bench_engine(args) -> int:
    args.drafter = args.drafter or "ngram"
    args.also = None
    return cmd_demo(args)


def add_bench_parser(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks that print side-by-side ratios")
    bsub = p.add_subparsers(dest="bench_command", required=True)
    e = bsub.add_parser("engine", help="plain decode vs speculation (n-gram by default), tokens/s and tau")
    _add_engine_args(e, drafter_default="ngram")
    _add_sampling_args(e, max_new_tokens=96)
    e.add_argument("--limit", type=int, default=8)
    e.add_argument("--json-out", default=None)
    e.set_defaults(func=cmd_bench_engine)
    try:
        from sglang_hspec.client.bench import add_parser as add_serve

        add_serve(bsub)
    except ImportError:  # pragma: no cover - optional client deps
        pass


def add_export_dspark_parser(sub) -> None:
    p = sub.add_parser("export-dspark", add_help=False,
                       help="write a dspark baseline checkpoint in SGLang's DSpark layout (served by DSPARK)")
    p.add_argument("argv", nargs=argparse.REMAINDER)

    def run(args) -> int:
        from sglang_hspec.sglang_plugin.export_dspark import main as export_main

        export_main(args.argv)
        return 0

    p.set_defaults(func=run)


# ---------------------------------------------------------------------------- wiring

def _optional(sub, module: str, attr: str = "add_parser") -> None:
    import importlib

    try:
        getattr(importlib.import_module(module), attr)(sub)
    except ModuleNotFoundError as exc:  # an optional part that is not installed / not written yet
        if exc.name != module:
            print(f"warning: {module} unavailable: {exc}", file=sys.stderr)
    except (ImportError, AttributeError) as exc:  # keep the CLI usable while one module is broken
        print(f"warning: {module} unavailable: {exc}", file=sys.stderr)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hspec", description="H-Spec speculative decoding (reference engine, "
                                     "training, calibration, scheduling)")
    sub = parser.add_subparsers(dest="command", required=True)
    add_generate_parser(sub)
    add_demo_parser(sub)
    add_bench_parser(sub)
    add_export_dspark_parser(sub)
    _optional(sub, "sglang_hspec.training.data_cli")
    _optional(sub, "sglang_hspec.training.trainer")
    _optional(sub, "sglang_hspec.training.eval")
    _optional(sub, "sglang_hspec.calibration.cli")
    from sglang_hspec.engine.profile import make_step_fn
    from sglang_hspec.scheduler.profiler import add_parser as add_profile_sps

    profile_sps = add_profile_sps(sub, step_fn_factory=make_step_fn)  # the reference engine's verify forwards
    from sglang_hspec.sglang_plugin.sps_profile import add_server_arguments

    add_server_arguments(profile_sps)  # --url: a running SGLang server (HSPEC or DSPARK), SGLang's profiler
    _optional(sub, "sglang_hspec.scheduler.simulator")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["export-dspark"]:  # its own parser owns every flag, --help included
        from sglang_hspec.sglang_plugin.export_dspark import main as export_main

        sys.argv[0] = "hspec export-dspark"
        export_main(argv[1:])
        return 0
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "profile-sps":
            check_output_file(args.out, flag="--out")  # written only after minutes of probes
        return int(args.func(args) or 0)
    except (ValueError, OSError) as exc:  # OSError: a missing or unreadable file, a full disk
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
