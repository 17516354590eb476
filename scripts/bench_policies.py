"""Verify-length policies on the reference engine, side by side in one run.

For each batch size B (concurrent requests) and each policy (fixed k, exact, stale), generate the same
MT-Bench prompts with the same drafter and report throughput (tokens/s over the batch), per-user
tokens/s, tau, and verified draft tokens per step. Needs a drafter with a confidence head and an SPS
table profiled for this engine (`hspec profile-sps --out sps.json`).

    python scripts/bench_policies.py --drafter runs/hspec_smollm2/checkpoint-300/drafter \
        --sps-table docs/sps_smollm2_cpu.json --batch-sizes 1,4,16,32 --max-new-tokens 48 --out out.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from tqdm.auto import tqdm

from sglang_hspec.assets.prompts import chat_input_ids, load_prompts
from sglang_hspec.engine.engine import SpeculativeEngine
from sglang_hspec.engine.loading import load_drafter_spec, load_target
from sglang_hspec.engine.policies import make_policy
from sglang_hspec.engine.types import SamplingParams


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="embedded")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--drafter", required=True)
    ap.add_argument("--sps-table", required=True)
    ap.add_argument("--sts", default=None)
    ap.add_argument("--batch-sizes", default="1,4,16,32")
    ap.add_argument("--policies", default="fixed,exact,stale")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    adapter = load_target(args.target, dtype=args.dtype)
    drafter = load_drafter_spec(args.drafter, adapter)
    items = load_prompts("mtbench")
    prompts = [chat_input_ids(adapter.tokenizer, it.messages(0)) for it in items]
    sampling = SamplingParams(temperature=args.temperature, max_new_tokens=args.max_new_tokens, ignore_eos=True,
                              seed=0)
    rows = []
    sizes = [int(x) for x in args.batch_sizes.split(",")]
    names = args.policies.split(",")
    for b in tqdm(sizes, desc="batch sizes"):
        batch = (prompts * ((b + len(prompts) - 1) // len(prompts)))[:b]
        outputs = {}
        for name in names:  # same batch, policies back to back
            policy, transform = make_policy(name, block_size=drafter.block_size, sps_table=args.sps_table,
                                            sts=args.sts)
            engine = SpeculativeEngine(adapter, drafter, policy=policy, confidence_transform=transform)
            t0 = time.perf_counter()
            res = engine.generate(batch, sampling)
            wall = time.perf_counter() - t0
            tokens = sum(len(r.output_ids) for r in res)
            steps = sum(r.stats.num_steps for r in res)
            verified = sum(sum(r.stats.verify_lengths) for r in res)
            outputs[name] = [r.output_ids for r in res]
            rows.append({
                "batch": b, "policy": name, "throughput_tok_s": tokens / wall,
                "per_user_tok_s": sum(len(r.output_ids) / wall for r in res) / b,
                "tau": sum(sum(r.stats.accept_lengths) for r in res) / max(1, steps),
                "verified_drafts_per_step": verified / max(1, steps), "wall_s": wall,
                "same_output_as_fixed": outputs[name] == outputs[names[0]] if args.temperature == 0 else None,
            })
    base = {r["batch"]: r["throughput_tok_s"] for r in rows if r["policy"] == names[0]}
    print(f"\n{'B':>4} {'policy':<7} {'tok/s':>8} {'x fixed':>8} {'user tok/s':>11} {'tau':>6} {'drafts/step':>12}")
    for r in rows:
        print(f"{r['batch']:>4} {r['policy']:<7} {r['throughput_tok_s']:>8.1f} {r['throughput_tok_s'] / base[r['batch']]:>8.2f} "
              f"{r['per_user_tok_s']:>11.2f} {r['tau']:>6.2f} {r['verified_drafts_per_step']:>12.2f}")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"device": str(adapter.device), "dtype": str(adapter.dtype), "threads": torch.get_num_threads(),
                       "rows": rows}, fh, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
