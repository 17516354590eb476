"""Planner time per step for 64 / 256 / 1024 requests, k = 7 (torch, CPU, one thread).

Prints, side by side in one run: the exact planner, the stale policy's full plan call (ring-buffer
lookup + argmax budget + top-K), the auto policy's whole per-step decision while it speculates
(`decide`: estimates, speculate-or-decode switch and budget; `plan`: top-K lengths; `observe`: the
acceptance audit) and while it
decodes plainly (`decide` alone), the plain-Python reference, and two yardsticks measured alongside
(one elementwise torch op, one torch.sort of the B*k survivals) so numbers from a loaded machine can
be read as ratios. The CPU model and flags are printed. Target: auto <= 50 us at 256 requests.
Usage: python scripts/bench_planner.py [--repeats 300] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from sglang_hspec.scheduler import planner
from sglang_hspec.scheduler.policy import AutoPolicy, ExactPolicy, StalePolicy
from sglang_hspec.scheduler.sps import synthetic_sps_table

from sglang_hspec.target.dtypes import describe_machine as cpu_description

CLOCK = time.perf_counter


def per_call_us(fn, *, repeats: int, sync) -> float:
    for _ in range(20):
        fn()
    times = []
    for _ in range(5):
        sync()
        start = CLOCK()
        for _ in range(repeats):
            fn()
        sync()
        times.append((CLOCK() - start) / repeats * 1e6)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--clock", choices=["wall", "thread"], default="wall",
                    help="thread = this thread's CPU time (CPU only): time spent waiting for a core on a shared "
                         "machine is not counted")
    args = ap.parse_args()
    global CLOCK
    if args.clock == "thread":
        if args.device != "cpu":
            raise SystemExit("--clock thread measures CPU time; use --clock wall with --device cuda")
        CLOCK = time.thread_time
    torch.set_num_threads(1)
    dev = torch.device(args.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    k = 7
    table = synthetic_sps_table(tiers=tuple(2**i for i in range(4, 14)))  # capacity 8192 >= 1024 * 8
    print(f"{cpu_description()} | device={dev} threads={torch.get_num_threads()} k={k} float64 "
          f"(median of 5 x {args.repeats} calls, us, {args.clock} clock)")
    print(f"{'requests':>8} {'exact':>9} {'stale':>9} {'auto':>9} {'auto off':>9} {'py ref':>10} {'1 op':>7} "
          f"{'sort':>7} {'auto/sort':>9} {'auto/op':>8}")
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
    t_auto = t_auto_off = float("nan")
    if dev.type == "cpu":  # the switch reads host tensors by design (stale estimates live on the host)
        auto = AutoPolicy(table, margin=0.0)
        cheap = synthetic_sps_table(tiers=tuple(2**i for i in range(4, 14)), seconds_per_token=1.0)
        off = AutoPolicy(cheap, probe_interval=2**20, max_probe_interval=2**20)  # verifying never pays

        def auto_step(policy):  # the whole per-step policy work: decide, plan, and the audit's observe
            decision, rows = policy.decide(slot_ids=ids, generations=gens)
            if decision.speculate:
                every = rows.numel() == b  # engines pass the batch's own tensors when every row drafts
                c, s, g = (conf, ids, gens) if every else (conf[rows], ids[rows], gens[rows])
                lengths = policy.plan(confidences=c, slot_ids=s, generations=g)
                policy.observe(slot_ids=s, generations=g, confidences=c, verify_lengths=lengths,
                               num_accepted=lengths)

        for policy in (auto, off):
            for _ in range(4):  # past the cold probe and the lag
                auto_step(policy)
        assert auto.last_decision.speculate and not off.last_decision.speculate
        t_auto = per_call_us(lambda: auto_step(auto), repeats=repeats, sync=sync)
        t_auto_off = per_call_us(lambda: auto_step(off), repeats=repeats, sync=sync)
    rows = conf.cpu().tolist()
    t_ref = per_call_us(lambda: planner.exact_lengths_reference(
        confidences=rows, sps=lambda bt, n: exact.sps.scalar(batch_tokens=bt, num_reqs=n)),
        repeats=max(1, repeats // 20), sync=sync)
    flat = conf.reshape(-1)
    t_op = per_call_us(lambda: flat + 1, repeats=repeats, sync=sync)
    t_sort = per_call_us(lambda: torch.sort(flat, descending=True, stable=True), repeats=repeats, sync=sync)
    return (f"{b:>8} {t_exact:>9.1f} {t_stale:>9.1f} {t_auto:>9.1f} {t_auto_off:>9.1f} {t_ref:>10.1f} "
            f"{t_op:>7.1f} {t_sort:>7.1f} {t_auto / t_sort:>9.2f} {t_auto / t_op:>8.1f}")


if __name__ == "__main__":
    main()
