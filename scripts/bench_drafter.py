"""Drafter forward time side by side: hspec vs dflash vs dspark on CPU, over context N and batch.

    python scripts/bench_drafter.py [--config configs/hspec-smollm2-135m-instruct.json] [--reps 3]

Prints ms per propose call (best of --reps) at N in {256, 1024, 4096} and batch in {1, 8, 32}, the
ratio time(N=4096)/time(N=256) per drafter, and drafter-side KV bytes per context token (bf16).
dflash/dspark calls include appending 4 newly committed positions to their drafter KV (a typical
accepted-length + bonus), which is the per-step injection cost H-Spec removes. Random weights."""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

from sglang_hspec.core.types import DraftContext, SamplingParams
from sglang_hspec.model import HSpecConfig, build_drafter
from sglang_hspec.target.kv_view import dense_window_view

NEW_ROWS = 4


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/hspec-smollm2-135m-instruct.json")
    ap.add_argument("--contexts", default="256,1024,4096")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = HSpecConfig.from_json(args.config)
    t = cfg.target
    embed, lm_head = nn.Embedding(t.vocab_size, t.hidden_size), nn.Linear(t.hidden_size, t.vocab_size, bias=False)
    kinds = ("hspec", "dflash", "dspark")
    models = {k: build_drafter(k, cfg, embed, lm_head).eval() for k in kinds}
    contexts = [int(x) for x in args.contexts.split(",")]
    batches = [int(x) for x in args.batches.split(",")]
    times: dict[tuple[str, int, int], float] = {}
    kv_per_token: dict[str, float] = {}
    for B in batches:
        for N in contexts:
            n = torch.full((B,), N - 1)
            K = torch.randn(B, t.num_key_value_heads, N, t.head_dim)
            hidden = torch.randn(B, NEW_ROWS, 5, t.hidden_size)
            for kind, model in models.items():
                views = {lid: dense_window_view(K, K, n, model.sliding_window) for lid in model.kv_layer_ids}
                ctx = DraftContext(torch.full((B,), 5), n, hidden[:, -1] if model.target_layer_ids else None, views)
                best = float("inf")
                for _ in range(args.reps):
                    if kind != "hspec":  # untimed: the cache holds positions 0..N-1-NEW_ROWS, capacity N
                        model.reset()
                        model.extend_context(torch.zeros(B, N, 5, t.hidden_size))
                        model.crop(torch.full((B,), N - NEW_ROWS))
                    start = time.perf_counter()
                    with torch.no_grad():
                        if kind != "hspec":
                            model.extend_context(hidden)
                        model.propose(ctx, SamplingParams())
                    best = min(best, time.perf_counter() - start)
                times[kind, B, N] = best * 1e3
                cap = model.state.keys[0].shape[2] if getattr(model, "state", None) else 1
                kv_per_token[kind] = model.owned_state_bytes() / (B * cap) / 4 * 2  # float32 -> bf16 bytes
                model.reset()
            print(f"B={B:>3} N={N:>5}  " + "  ".join(f"{k} {times[k, B, N]:8.2f} ms" for k in kinds), flush=True)
    print(f"\nms per propose (best of {args.reps}), {args.threads} thread(s):")
    header = f"{'B':>3} {'N':>5} | " + " | ".join(f"{k:>10}" for k in kinds) + " | hspec/dspark"
    print(header)
    for B in batches:
        for N in contexts:
            row = " | ".join(f"{times[k, B, N]:10.2f}" for k in kinds)
            print(f"{B:>3} {N:>5} | {row} | {times['hspec', B, N] / times['dspark', B, N]:12.2f}")
    lo, hi = min(contexts), max(contexts)
    print(f"\ntime(N={hi}) / time(N={lo}) per drafter:")
    for B in batches:
        print(f"  B={B:>3}  " + "  ".join(f"{k} {times[k, B, hi] / times[k, B, lo]:5.2f}" for k in kinds))
    print("\ndrafter-side KV bytes per context token (bf16): "
          + "  ".join(f"{k} {kv_per_token[k]:.0f}" for k in kinds))


if __name__ == "__main__":
    main()
