"""How well an SPS table predicts what a verify step really costs on the reference engine.

`--policy auto` speculates only when the table says a speculative step commits tokens faster than a plain
one (scheduler/switch.py). This times the engine's real verify forwards (`verify_forward`, the padded
[N, 1 + lmax] block, or its anchor-then-drafts split) over N requests for a few draft layouts, beside the
seconds `StepCosts` predicts for the same step from the table, and prints both with their ratio. A ratio
above 1 is a step the switch thinks cheaper than it is: where it decides "speculate" on such a step, it
can lose to plain decoding.

    python scripts/check_step_costs.py --sps-table docs/results/policies/2026-12-05_epyc-zen5/policies_mtbench.sps.json --dtype fp32
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def layouts(num_reqs: int, block_size: int) -> list[list[int]]:
    """Per-request draft counts a step may verify: one draft for one / all requests, two for all,
    a skewed top-n (lengths 3, 2, 1, 0, ...), and full blocks for all."""
    out = [[1] + [0] * (num_reqs - 1), [1] * num_reqs, [2] * num_reqs,
           [max(0, 3 - i) for i in range(num_reqs)], [block_size] * num_reqs]
    seen, unique = set(), []
    for lay in out:
        if tuple(lay) not in seen:
            seen.add(tuple(lay))
            unique.append(lay)
    return unique


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sps-table", required=True, help="SPS table JSON with plain probes (bench_policies.py writes one)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--context", type=int, default=128, help="prompt tokens per request (the table's profile context)")
    ap.add_argument("--batch-sizes", default="1,4,16,32")
    ap.add_argument("--block-size", type=int, default=7)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from sglang_hspec.scheduler.sps import load_sps_table
    from sglang_hspec.scheduler.switch import StepCosts

    from sglang_hspec.engine.engine import verify_forward
    from sglang_hspec.engine.profile import make_step_fn
    from sglang_hspec.target.dtypes import describe_machine

    table = load_sps_table(args.sps_table)
    costs = StepCosts(table)
    sizes = [int(x) for x in args.batch_sizes.split(",")]
    k = args.block_size
    step_fn = make_step_fn(max_batch_tokens=max(sizes) * (k + 1), tokens_per_request=k + 1, dtype=args.dtype,
                           context=args.context, max_requests=max(sizes), drafter="none")
    adapter = step_fn.adapter
    gen = torch.Generator().manual_seed(1)
    print(f"{describe_machine()} | torch threads {torch.get_num_threads()} | dtype {adapter.dtype} | "
          f"context {args.context} | table {args.sps_table}")
    print(f"{'N':>3} {'drafts per request':<24} {'tokens':>6} {'real ms':>8} {'table ms':>9} {'real/table':>10}")
    for n_req in sizes:
        for lay in layouts(n_req, k):
            verify_len = torch.tensor(lay)
            block = torch.randint(3, adapter.geometry.vocab_size, (n_req, 1 + max(lay)), generator=gen)
            rows = torch.arange(n_req)
            start_lengths = adapter.lengths[rows].clone()
            times = []
            for _ in range(args.repeats + 1):
                t0 = time.perf_counter()
                verify_forward(adapter, block, verify_lengths=verify_len, rows=rows, hidden_layer_ids=[])
                times.append(time.perf_counter() - t0)
                adapter.truncate(start_lengths, rows=rows)  # the verify committed its positions: undo
            real = statistics.median(times[1:])  # the first call warms the shape up
            drafts = int(verify_len.sum())
            table_s = float(costs.verify_seconds_range(start=n_req + drafts, count=1, num_reqs=n_req)[0])
            shown = ",".join(map(str, lay)) if n_req <= 4 else f"{lay[0]},{lay[1]},... ({drafts} in all)"
            print(f"{n_req:>3} {shown:<24} {n_req + drafts:>6} {1e3 * real:>8.1f} {1e3 * table_s:>9.1f} "
                  f"{real / table_s:>10.2f}")


if __name__ == "__main__":
    main()
