"""Planner time per step for 64 / 256 / 1024 requests, k = 7 (torch, CPU, one thread).

Prints, side by side in one run: the exact planner, the stale policy's full plan call (ring-buffer
lookup + argmax budget + top-K), the plain-Python reference, and two yardsticks measured alongside
(one elementwise torch op, one torch.sort of the B*k survivals) so numbers from a loaded machine can
be read as ratios. Usage: python scripts/bench_planner.py [--repeats 300] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from sglang_hspec.scheduler import planner
from sglang_hspec.scheduler.policy import ExactPolicy, StalePolicy
from sglang_hspec.scheduler.sps import synthetic_sps_table


def per_call_us(fn, *, repeats: int, sync) -> float:
    for _ in range(20):
        fn()
    times = []
    for _ in range(5):
        sync()
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        sync()
        times.append((time.perf_counter() - start) / repeats * 1e6)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    torch.set_num_threads(1)
    dev = torch.device(args.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    k = 7
    table = synthetic_sps_table(tiers=tuple(2**i for i in range(4, 14)))  # capacity 8192 >= 1024 * 8
    print(f"device={dev} threads={torch.get_num_threads()} k={k} (median of 5 x {args.repeats} calls, us)")
    print(f"{'requests':>8} {'exact':>9} {'stale':>9} {'py ref':>10} {'1 op':>7} {'sort':>7} "
          f"{'stale/sort':>10} {'stale/op':>8}")
    gen = torch.Generator().manual_seed(0)
    for b in (64, 256, 1024):
        print(bench_one(b=b, k=k, table=table, dev=dev, gen=gen, repeats=args.repeats, sync=sync))


def bench_one(*, b, k, table, dev, gen, repeats, sync) -> str:
    conf = (0.3 + 0.7 * torch.rand(b, k, generator=gen, dtype=torch.float64)).to(dev)
    ids, gens = torch.arange(b, device=dev), torch.zeros(b, dtype=torch.long, device=dev)
    exact, stale = ExactPolicy(table), StalePolicy(table)
    t_exact = per_call_us(lambda: exact.plan(confidences=conf, slot_ids=ids, generations=gens),
                          repeats=repeats, sync=sync)
    t_stale = per_call_us(lambda: stale.plan(confidences=conf, slot_ids=ids, generations=gens),
                          repeats=repeats, sync=sync)
    rows = conf.cpu().tolist()
    t_ref = per_call_us(lambda: planner.exact_lengths_reference(
        confidences=rows, sps=lambda bt, n: exact.sps.scalar(batch_tokens=bt, num_reqs=n)),
        repeats=max(1, repeats // 20), sync=sync)
    flat = conf.reshape(-1)
    t_op = per_call_us(lambda: flat + 1, repeats=repeats, sync=sync)
    t_sort = per_call_us(lambda: torch.sort(flat, descending=True, stable=True), repeats=repeats, sync=sync)
    return (f"{b:>8} {t_exact:>9.1f} {t_stale:>9.1f} {t_ref:>10.1f} {t_op:>7.1f} {t_sort:>7.1f} "
            f"{t_stale / t_sort:>10.2f} {t_stale / t_op:>8.1f}")

if __name__ == "__main__":
    main()
