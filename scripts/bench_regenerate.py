"""Regeneration throughput side by side on the same ShareGPT first-turn prompts (what `hspec data
regenerate` runs): plain decoding continuously batched (`continuous`: `ContinuousDecoder`, what regenerate
uses with drafter none; the batch is its number of rows), plain decoding through the reference engine in
fixed batches (`none`: each batch runs until its longest reply ends) and n-gram speculation (`ngram`).

    python scripts/bench_regenerate.py [--prompts 32] [--batches 16,32] [--max-new-tokens 128]
        [--drafters continuous,none,ngram] [--temperature 0.8]

Prints generated tokens per wall second and per CPU second of this process (the one to compare on a
shared machine) for each (drafter, batch), their ratios to the first row, the number of outputs that
end in a repetition loop, the CPU model, its flags and the dtype."""

from __future__ import annotations

import argparse
import time

import torch

from sglang_hspec.assets.prompts import chat_input_ids, iter_sharegpt
from sglang_hspec.core.types import SamplingParams
from sglang_hspec.engine.continuous import ContinuousDecoder
from sglang_hspec.engine.engine import SpeculativeEngine
from sglang_hspec.engine.loading import load_drafter_spec
from sglang_hspec.target.dtypes import describe_machine as cpu_description
from sglang_hspec.target.loading import load_target
from sglang_hspec.training.regenerate import repetition_loop


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="embedded")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--batches", default="16,32")
    ap.add_argument("--drafters", default="continuous,none,ngram")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--max-prompt-tokens", type=int, default=256)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    adapter = load_target(args.target, dtype=args.dtype)
    tok = adapter.tokenizer
    prompts = []
    for conv in iter_sharegpt(limit=20 * args.prompts):
        if conv[0]["role"] == "user":
            ids = chat_input_ids(tok, conv[:1])
            if len(ids) <= args.max_prompt_tokens:
                prompts.append(ids)
        if len(prompts) == args.prompts:
            break
    prompts.sort(key=len)
    sampling = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_new_tokens=args.max_new_tokens,
                              seed=0)
    print(f"CPU: {cpu_description()}; torch threads {args.threads}; dtype {adapter.dtype}; "
          f"{len(prompts)} ShareGPT prompts (mean {sum(map(len, prompts)) / len(prompts):.0f} tokens); "
          f"T={args.temperature} top_p={args.top_p} max_new_tokens={args.max_new_tokens}", flush=True)
    rows = []
    for name in args.drafters.split(","):
        engine = None if name == "continuous" else SpeculativeEngine(adapter, load_drafter_spec(name, adapter))
        for b in (int(x) for x in args.batches.split(",")):
            tokens, loops, start, cpu = 0, 0, time.perf_counter(), time.process_time()
            calls = [ContinuousDecoder(adapter, slots=b).generate(prompts, sampling)] if engine is None else \
                (engine.generate(prompts[s:s + b], sampling) for s in range(0, len(prompts), b))
            for results in calls:
                for r in results:
                    tokens += len(r.output_ids)
                    loops += repetition_loop(r.output_ids) is not None
            rows.append((name, b, tokens, tokens / (time.perf_counter() - start),
                         tokens / (time.process_time() - cpu), loops))
            # each row as soon as it is measured (a shared machine may stop the run early)
            name, b, tokens, tps, tpc, loops = rows[-1]
            if len(rows) == 1:
                print(f"{'drafter':10} {'batch':>5} {'tokens':>7} {'tok/s':>7} {'ratio':>6} {'tok/cpu-s':>9} "
                      f"{'ratio':>6} {'loops':>5}")
            # tokens per CPU second of this process compare across runs on a shared machine; wall tok/s does not
            print(f"{name:10} {b:5d} {tokens:7d} {tps:7.1f} {tps / rows[0][3]:5.2f}x {tpc:9.1f} "
                  f"{tpc / rows[0][4]:5.2f}x {loops:5d}", flush=True)


if __name__ == "__main__":
    main()
