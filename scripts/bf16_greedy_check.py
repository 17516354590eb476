"""bf16 greedy identity: speculation vs plain decoding, with and without the batch-invariant target.

For each mode (the target's ordinary SDPA attention, then `batch_invariant=True`) every prompt is
decoded greedily by plain decoding and by the drafter, one request at a time, interleaved per prompt:
the script prints per prompt whether the outputs match, where they first differ and the target's
logit gap there, and the tokens/s of all four runs side by side (ratios from this one run), with the
CPU model, its bf16 flags, torch's CPU capability and whether this machine's bf16 linear layers give a
row the same bits whatever the number of rows (`linear_rows_are_batch_invariant`).

    .venv/bin/python scripts/bf16_greedy_check.py                          # 8 MT-Bench prompts x 64 tokens
    .venv/bin/python scripts/bf16_greedy_check.py --target tiny --drafter ngram --limit 4 --max-new-tokens 16

On an AVX2-only CPU bf16 is emulated: the embedded run took 12 min per mode on one thread of a 2-core AMD EPYC.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

from sglang_hspec.core.types import SamplingParams  # noqa: E402
from sglang_hspec.engine.drafters import NoDrafter  # noqa: E402
from sglang_hspec.engine.engine import SpeculativeEngine  # noqa: E402
from sglang_hspec.engine.identity import compare_greedy  # noqa: E402
from sglang_hspec.engine.loading import load_drafter_spec  # noqa: E402
from sglang_hspec.target.adapter import TargetAdapter, linear_rows_are_batch_invariant  # noqa: E402
from sglang_hspec.target.dtypes import NATIVE_BF16_CPU_FLAGS, cpu_flags, cpu_model  # noqa: E402
from sglang_hspec.target.loading import load_target  # noqa: E402


def prompts_for(adapter: TargetAdapter, target: str, dataset: str, limit: int, seed: int) -> list[list[int]]:
    if adapter.tokenizer is None:  # the tiny random target has no tokenizer: random prompts
        gen = torch.Generator().manual_seed(seed)
        return [torch.randint(3, adapter.geometry.vocab_size, (12 + i,), generator=gen).tolist()
                for i in range(limit)]
    from sglang_hspec.assets.prompts import chat_input_ids, load_prompts

    return [chat_input_ids(adapter.tokenizer, it.messages(0)) for it in load_prompts(dataset, limit=limit)]


def run_mode(adapter: TargetAdapter, drafter_spec: str, prompts, sampling, *, desc: str) -> dict:
    drafter = load_drafter_spec(drafter_spec, adapter)
    plain = SpeculativeEngine(adapter, NoDrafter())
    spec = SpeculativeEngine(adapter, drafter)
    outs = {"plain": [], "spec": []}
    secs = {"plain": 0.0, "spec": 0.0}
    steps = accepted = 0
    for ids in tqdm(prompts, desc=desc, unit="prompt"):
        for name, engine in (("plain", plain), ("spec", spec)):
            t0 = time.perf_counter()
            r = engine.generate([ids], sampling)[0]
            secs[name] += time.perf_counter() - t0
            outs[name].append(r.output_ids)
            if name == "spec":
                steps += r.stats.num_steps
                accepted += sum(r.stats.accept_lengths)
    eos = sorted(spec.eos_token_ids)[0] if spec.eos_token_ids else None
    cmp = compare_greedy(prompts, outs["plain"], outs["spec"], adapter=adapter, eos_token_id=eos)
    tps = {k: sum(map(len, outs[k])) / secs[k] if secs[k] else 0.0 for k in outs}
    return {"drafter": drafter.name, "batch_invariant": adapter.batch_invariant, "tau": accepted / max(1, steps),
            "plain_tokens_per_second": tps["plain"], "spec_tokens_per_second": tps["spec"],
            **cmp.to_dict(), "label": cmp.label()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="embedded")
    p.add_argument("--drafter", default="shipped")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--dataset", default="mtbench")
    p.add_argument("--limit", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--modes", default="sdpa,batch-invariant",
                   help="comma list of sdpa (HF's attention) and batch-invariant, run in this order")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in ("sdpa", "batch-invariant")]
    if bad:
        raise SystemExit(f"error: --modes {bad} unknown: use sdpa and/or batch-invariant")

    base = load_target(args.target, dtype=args.dtype)
    dtype = base.dtype
    flags = cpu_flags()
    header = {
        "cpu": cpu_model(), "torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "bf16_flags": {f: f in flags for f in NATIVE_BF16_CPU_FLAGS}, "dtype": str(dtype).replace("torch.", ""),
        "threads": torch.get_num_threads(), "target": args.target, "prompts": args.limit,
        "max_new_tokens": args.max_new_tokens,
        "linear_rows_batch_invariant": linear_rows_are_batch_invariant(dtype=dtype),
    }
    print(json.dumps(header), file=sys.stderr)
    prompts = prompts_for(base, args.target, args.dataset, args.limit, args.seed)
    sampling = SamplingParams(temperature=0.0, max_new_tokens=args.max_new_tokens)
    results = []
    for mode in modes:  # sdpa first: the batch-invariant adapter switches the model object for good
        adapter = base if mode == "sdpa" else TargetAdapter(base.model, tokenizer=base.tokenizer, batch_invariant=True)
        results.append(dict(run_mode(adapter, args.drafter, prompts, sampling, desc=mode), mode=mode))

    print(f"\n{args.target} target, {header['dtype']}, {header['cpu']} (capability {header['cpu_capability']}, "
          f"{', '.join(f'{k}={v}' for k, v in header['bf16_flags'].items())}), {header['threads']} threads; "
          f"bf16 linear rows batch-invariant here: {header['linear_rows_batch_invariant']}")
    print(f"{args.limit} {args.dataset} prompts x {args.max_new_tokens} tokens, greedy, batch 1\n")
    ref = results[0]["plain_tokens_per_second"] or 1.0
    print(f"{'mode':<16} {'drafter':<14} {'tau':>5} {'plain tok/s':>11} {'spec tok/s':>10} "
          f"{'plain x':>8} {'spec x':>7}  same as plain")
    for r in results:
        print(f"{r['mode']:<16} {r['drafter']:<14} {r['tau']:>5.2f} {r['plain_tokens_per_second']:>11.2f} "
              f"{r['spec_tokens_per_second']:>10.2f} {r['plain_tokens_per_second'] / ref:>7.2f}x "
              f"{r['spec_tokens_per_second'] / ref:>6.2f}x  {r['label']}")
        for d in r["divergences"]:
            gap = "-" if d["logit_gap"] is None else f"{d['logit_gap']:.4f}"
            print(f"    prompt {d['prompt_index']}: first diff at token {d['token_index']} "
                  f"(plain {d['plain_token']}, spec {d['spec_token']}, logit gap {gap})")
    print(f"\n(x: tokens/s relative to plain decoding in the {results[0]['mode']} mode of this run)")
    if args.json_out:
        from sglang_hspec.core.atomic import atomic_write_text

        atomic_write_text(args.json_out, json.dumps({**header, "results": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
