"""Where prompt lookup splices into a drafter's blocks, and what those blocks accept (reference engine, batch 1).

    python scripts/splice_stats.py --drafter shipped --datasets mtbench,gsm8k,humaneval,mbpp,math500 --limit 4 \
        --max-new-tokens 64 --dtype fp32 --out docs/results/lookup_s24/splice_stats.json

Runs `<drafter>+lookup` greedily on the named prompt sets and splits its steps into spliced blocks (the
lookup agreed with the drafter's slot-1 token and supplied slots 2..k) and the drafter's own blocks: steps,
tau and per-slot conditional acceptance of each. The fixed confidence that spliced slots carry
(LookupSpliceDrafter's lookup_confidence) is checked against the spliced slots' acceptance here.
"""

from __future__ import annotations

import argparse
import json
import sys

from tqdm.auto import tqdm


def block_stats(steps: list[tuple[bool, int]], block_size: int) -> dict:
    """steps: (spliced, drafts kept) per verify step -> {"spliced"/"drafter": steps, tau, alpha per slot}."""
    out = {}
    for kind, flag in (("spliced", True), ("drafter", False)):
        kept = [a for s, a in steps if s == flag]
        attempts = [sum(a >= j for a in kept) for j in range(block_size)]
        accepts = [sum(a > j for a in kept) for j in range(block_size)]
        out[kind] = {
            "steps": len(kept),
            "tau": (sum(kept) + len(kept)) / len(kept) if kept else None,
            "alpha": [c / n if n else None for c, n in zip(accepts, attempts)],
            "slot_attempts": attempts,
            "slot_accepts": accepts,
        }
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--drafter", default="shipped", help="a learned drafter (shipped or a checkpoint directory)")
    ap.add_argument("--datasets", default="mtbench,gsm8k,humaneval,mbpp,math500")
    ap.add_argument("--limit", type=int, default=4, help="prompts per set")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--target", default="embedded")
    ap.add_argument("--out", default=None, help="write the statistics as JSON")
    args = ap.parse_args(argv)

    from sglang_hspec.assets.prompts import chat_input_ids
    from sglang_hspec.core.types import SamplingParams
    from sglang_hspec.engine.engine import SpeculativeEngine
    from sglang_hspec.engine.loading import LOOKUP_SUFFIX, load_drafter_spec
    from sglang_hspec.target.dtypes import describe_machine
    from sglang_hspec.target.loading import load_target
    from sglang_hspec.training.eval import load_eval_prompts

    adapter = load_target(args.target, dtype=args.dtype)
    drafter = load_drafter_spec(args.drafter.removesuffix(LOOKUP_SUFFIX) + LOOKUP_SUFFIX, adapter)
    flags: list[bool] = []
    propose = drafter.propose

    def recording_propose(ctx, sampling, generator=None):
        proposal = propose(ctx, sampling, generator)
        flags.append(bool(drafter.last_spliced[0]))
        return proposal

    drafter.propose = recording_propose
    engine = SpeculativeEngine(adapter, drafter)
    grouped = load_eval_prompts(datasets=args.datasets, prompts_file=None, limit=args.limit)
    items = [it for group in grouped.values() for it in group]
    steps: list[tuple[bool, int]] = []
    params = SamplingParams(temperature=0.0, max_new_tokens=args.max_new_tokens)
    for item in tqdm(items, desc="prompts"):
        flags.clear()
        [result] = engine.generate([chat_input_ids(adapter.tokenizer, item.messages(0))], params)
        kept = [n - 1 for n in result.stats.accept_lengths]
        if len(kept) != len(flags):
            raise RuntimeError(f"{len(flags)} proposals for {len(kept)} verify steps: the engine's step accounting changed")
        steps.extend(zip(flags, kept))
    stats = block_stats(steps, drafter.block_size)
    stats.update(machine=describe_machine(), dtype=str(adapter.dtype), drafter_spec=args.drafter, datasets=args.datasets,
                 limit=args.limit, max_new_tokens=args.max_new_tokens,
                 lookup_confidence=drafter.lookup_confidence)
    print(f"machine: {stats['machine']}, target dtype {stats['dtype']}")
    for kind in ("spliced", "drafter"):
        s = stats[kind]
        alpha = " ".join("-" if a is None else f"{a:.2f}" for a in s["alpha"])
        tau = "-" if s["tau"] is None else f"{s['tau']:.2f}"
        print(f"{kind:<8} steps {s['steps']:>5}  tau {tau:>5}  alpha {alpha}")
    if args.out:
        from sglang_hspec.core.atomic import atomic_write_text

        atomic_write_text(args.out, json.dumps(stats, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
