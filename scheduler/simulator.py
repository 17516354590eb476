"""Discrete-time serving simulator for verify-length policies.

Each step every running request drafts block_size tokens. Its true per-slot acceptance probabilities come
from its domain's profile (code accepts more than chat), shifted in logit space by a per-request
offset and a per-step difficulty; the drafter reports confidences that are noisy but calibrated
estimates of them (logit noise). The policy picks verify lengths; the step takes 1 / SPS(B) seconds with
B = sum_r (1 + verify_length_r) (the floor table clamps beyond its last probe: an over-capacity batch runs at the
last measured speed); each request emits its accepted prefix plus one target token.

Load: closed loop (C requests always running; a finished request's slot is reused at once with a new
generation, which exercises the stale policy's guard) or open loop (Poisson arrivals, FIFO, at most
`max_running` running).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import msgspec
import torch
from tqdm import tqdm

from .policy import ExactPolicy, FixedPolicy, StalePolicy, ThresholdPolicy
from .profiler import finite_at_least, int_at_least, probe_sizes_list
from .sps import SpsCostTable, SpsCurve, SpsTable, load_sps_table, synthetic_sps_table

DOMAINS = {
    # per-slot conditional acceptance (slot j accepted | slots < j accepted)
    "code": (0.93, 0.91, 0.89, 0.87, 0.85, 0.83, 0.81),
    "chat": (0.75, 0.69, 0.64, 0.60, 0.57, 0.54, 0.52),
}


class SimConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    block_size: int = 7
    concurrency: int = 16  # closed loop; ignored when arrival_rate is set
    arrival_rate: float | None = None  # requests/s (Poisson, open loop)
    max_running: int = 256
    steps: int = 300
    output_tokens: int = 128  # mean (geometric-ish spread 0.5x..1.5x)
    code_fraction: float = 0.5
    request_logit_sd: float = 0.6
    step_logit_sd: float = 0.8
    confidence_logit_sd: float = 0.4
    seed: int = 0

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size > len(DOMAINS["code"]):
            raise ValueError(f"block_size must be in 1..{len(DOMAINS['code'])}, got {self.block_size}")
        if self.concurrency < 1 or self.max_running < 1 or self.steps < 1 or self.output_tokens < 1:
            raise ValueError("concurrency, max_running, steps and output_tokens must be >= 1")
        if self.arrival_rate is not None and self.arrival_rate <= 0:
            raise ValueError(f"arrival_rate must be > 0 requests/s, got {self.arrival_rate}")
        if not 0 <= self.code_fraction <= 1:
            raise ValueError(f"code_fraction must be in [0, 1], got {self.code_fraction}")


class SimResult(msgspec.Struct, frozen=True):
    policy: str
    concurrency: int
    arrival_rate: float | None
    throughput: float  # emitted tokens / simulated second
    user_tps_p50: float  # per finished request: tokens / (finish - start)
    user_tps_p90: float
    wasted_fraction: float  # verified draft tokens that were rejected / verified draft tokens
    tokens_per_step: float  # mean emitted tokens per request-step (tau)
    drafts_per_request: float  # mean verified draft tokens per request-step
    finished: int
    sim_seconds: float


def make_policy(name: str, *, block_size: int, sps_table: SpsTable, threshold: float = 0.3):
    if name == "fixed":
        return FixedPolicy(block_size)
    if name == "threshold":
        return ThresholdPolicy(threshold)
    if name == "exact":
        return ExactPolicy(sps_table)
    if name == "stale":
        return StalePolicy(sps_table, lag=2)
    raise ValueError(f"unknown policy {name!r}; choose fixed, threshold, exact or stale")


def simulate(*, config: SimConfig, sps_table: SpsTable, policy, progress: bool = False) -> SimResult:
    cfg = config
    gen = torch.Generator().manual_seed(cfg.seed)
    base = {d: torch.logit(torch.tensor(v[: cfg.block_size], dtype=torch.float64)) for d, v in DOMAINS.items()}
    cap = cfg.max_running if cfg.arrival_rate is not None else cfg.concurrency
    # per-slot state (a slot holds at most one request; -1 length = empty)
    remaining = torch.full((cap,), -1, dtype=torch.long)
    emitted = torch.zeros(cap, dtype=torch.long)
    start = torch.zeros(cap, dtype=torch.float64)
    offset = torch.zeros(cap, cfg.block_size, dtype=torch.float64)
    generations = torch.zeros(cap, dtype=torch.long)
    now, total_tokens, verified, wasted, req_steps = 0.0, 0, 0, 0, 0
    user_tps: list[float] = []
    next_arrival = 0.0
    queue: list[float] = []  # arrival times waiting for a slot

    def admit(slots: torch.Tensor, arrival: torch.Tensor) -> None:
        n = slots.numel()
        if n == 0:
            return
        code = torch.rand(n, generator=gen) < cfg.code_fraction
        prof = torch.where(code[:, None], base["code"], base["chat"])
        offset[slots] = prof + cfg.request_logit_sd * torch.randn(n, 1, generator=gen, dtype=torch.float64)
        length = cfg.output_tokens * (0.5 + torch.rand(n, generator=gen, dtype=torch.float64))
        remaining[slots] = length.round().long().clamp(min=1)
        emitted[slots] = 0
        start[slots] = arrival
        generations[slots] += 1

    if cfg.arrival_rate is None:
        admit(torch.arange(cap), torch.zeros(cap, dtype=torch.float64))
    for _ in tqdm(range(cfg.steps), desc=f"simulate {policy.name}", disable=not progress, leave=False):
        if cfg.arrival_rate is not None:
            while next_arrival <= now:
                queue.append(next_arrival)
                next_arrival += float(torch.empty(()).exponential_(cfg.arrival_rate, generator=gen))
            free = torch.nonzero(remaining < 0).flatten()[: len(queue)]
            admit(free, torch.tensor(queue[: free.numel()], dtype=torch.float64))
            del queue[: free.numel()]
        active = torch.nonzero(remaining > 0).flatten()
        if active.numel() == 0:  # idle until the next arrival
            now = max(now, next_arrival)
            continue
        n = active.numel()
        logits = offset[active] + cfg.step_logit_sd * torch.randn(n, 1, generator=gen, dtype=torch.float64)
        p_true = torch.sigmoid(logits)
        conf = torch.sigmoid(logits + cfg.confidence_logit_sd * torch.randn(n, cfg.block_size, generator=gen,
                                                                           dtype=torch.float64))
        accepted_run = torch.cumprod((torch.rand(n, cfg.block_size, generator=gen, dtype=torch.float64) < p_true).long(),
                                     dim=1).sum(1)
        verify_lengths = policy.plan(confidences=conf, slot_ids=active, generations=generations[active])
        accepted = torch.minimum(accepted_run, verify_lengths)
        tokens = torch.minimum(accepted + 1, remaining[active])
        batch_tokens = int(verify_lengths.sum()) + n
        now += 1.0 / sps_table_lookup(sps_table, batch_tokens=batch_tokens, num_reqs=n)
        total_tokens += int(tokens.sum())
        verified += int(verify_lengths.sum())
        wasted += int((verify_lengths - accepted).sum())
        req_steps += n
        emitted[active] += tokens
        remaining[active] -= tokens
        done = active[remaining[active] == 0]
        for s in done.tolist():
            user_tps.append(float(emitted[s]) / max(now - float(start[s]), 1e-9))
        remaining[done] = -1
        if cfg.arrival_rate is None:
            admit(done, torch.full((done.numel(),), now, dtype=torch.float64))
    if not user_tps:  # nothing finished: report the in-flight rates
        act = torch.nonzero(remaining > 0).flatten()
        user_tps = (emitted[act].double() / (now - start[act]).clamp(min=1e-9)).tolist()
    tps = torch.tensor(user_tps or [0.0], dtype=torch.float64)
    return SimResult(
        policy=policy.name, concurrency=cfg.concurrency if cfg.arrival_rate is None else 0,
        arrival_rate=cfg.arrival_rate, throughput=total_tokens / max(now, 1e-9),
        user_tps_p50=float(tps.quantile(0.5)), user_tps_p90=float(tps.quantile(0.9)),
        wasted_fraction=wasted / max(verified, 1), tokens_per_step=total_tokens / max(req_steps, 1),
        drafts_per_request=verified / max(req_steps, 1), finished=len(user_tps), sim_seconds=now,
    )


def sps_table_lookup(table: SpsTable, *, batch_tokens: int, num_reqs: int) -> float:
    if isinstance(table, SpsCostTable):
        return table.lookup(batch_tokens)  # floor clamp, no capacity cut-off (see module doc)
    return SpsCurve(table).scalar(batch_tokens=batch_tokens, num_reqs=num_reqs)


def sweep(*, sps_table: SpsTable, policies: list[str], concurrencies: list[int], base: SimConfig,
          threshold: float = 0.3, progress: bool = True) -> list[SimResult]:
    runs = [(p, c) for c in concurrencies for p in policies]
    out = []
    for p, c in tqdm(runs, desc="simulate", unit="run", disable=not progress):
        cfg = msgspec.structs.replace(base, concurrency=c)
        out.append(simulate(config=cfg, sps_table=sps_table,
                            policy=make_policy(p, block_size=cfg.block_size, sps_table=sps_table, threshold=threshold)))
    return out


def results_table(results: list[SimResult]) -> str:
    rows = ["| policy | C | throughput tok/s | user tok/s p50 | user tok/s p90 | tau/step | drafts/req | wasted |",
            "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        rows.append(f"| {r.policy} | {r.concurrency} | {r.throughput:.0f} | {r.user_tps_p50:.1f} | "
                    f"{r.user_tps_p90:.1f} | {r.tokens_per_step:.2f} | {r.drafts_per_request:.2f} | "
                    f"{100 * r.wasted_fraction:.0f}% |")
    return "\n".join(rows)


def plot_frontier(results: list[SimResult], path: str | Path, *, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.0, 4.6))
    for name in dict.fromkeys(r.policy for r in results):
        rs = [r for r in results if r.policy == name]
        ax.plot([r.user_tps_p50 for r in rs], [r.throughput for r in rs], "o-", label=name)
        for r in rs:
            ax.annotate(str(r.concurrency), (r.user_tps_p50, r.throughput), fontsize=7,
                        textcoords="offset points", xytext=(3, 3))
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("per-user tokens/s (p50)")
    ax.set_ylabel("throughput tokens/s")
    ax.set_title(title)
    ax.grid(alpha=0.3, which="both")
    ax.legend()
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("simulate", help="serving simulator: verify-length policies across load")
    p.add_argument("--sps-table", default=None, help="SPS table JSON (default: synthetic jagged GPU-like curve)")
    p.add_argument("--policies", default="fixed,threshold,exact,stale")
    p.add_argument("--concurrency", type=probe_sizes_list("concurrencies"), default=[2**i for i in range(9)],
                   help="closed-loop concurrencies (default 1,2,4,...,256)")
    p.add_argument("--arrival-rate", type=finite_at_least(0, "Poisson requests/s", above=True), default=None,
                   help="Poisson requests/s (one open-loop run)")
    p.add_argument("--block-size", type=int_at_least(1, "draft tokens per request per step"), default=7,
                   help="draft tokens proposed per request per step")
    p.add_argument("--steps", type=int_at_least(1, "simulated steps per run"), default=300)
    p.add_argument("--threshold", type=finite_at_least(0, "a survival probability", at_most=1), default=0.3,
                   help="survival threshold of the threshold policy")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", required=True, help="writes simulate.md, simulate.json, simulate.png")
    p.set_defaults(func=run_simulate)
    return p


def _out_dir_problem(path: Path) -> str | None:
    """Why --out-dir can never be created, without creating anything (it is written after every run)."""
    probe = path
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    return None if probe.is_dir() else f"{probe} is a file, not a directory"


def run_simulate(args: argparse.Namespace) -> int:
    if args.sps_table and Path(args.sps_table).is_dir():
        raise ValueError(f"--sps-table {args.sps_table} is a directory; pass the SPS table JSON file itself")
    problem = _out_dir_problem(Path(args.out_dir))
    if problem:
        raise ValueError(f"--out-dir {args.out_dir} cannot be created: {problem}; pick another --out-dir")
    table = load_sps_table(args.sps_table) if args.sps_table else synthetic_sps_table()
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    for p in policies:
        make_policy(p, block_size=args.block_size, sps_table=table)  # fail fast on a bad name or table
    base = SimConfig(block_size=args.block_size, steps=args.steps, seed=args.seed, arrival_rate=args.arrival_rate)
    concurrencies = [math.inf] if args.arrival_rate else args.concurrency
    if args.arrival_rate:
        results = [simulate(config=base, sps_table=table,
                            policy=make_policy(p, block_size=args.block_size, sps_table=table, threshold=args.threshold))
                   for p in policies]
    else:
        results = sweep(sps_table=table, policies=policies, concurrencies=concurrencies, base=base,
                        threshold=args.threshold)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    md = results_table(results)
    (out / "simulate.md").write_text(md + "\n")
    (out / "simulate.json").write_bytes(msgspec.json.encode(results))
    plot_frontier(results, out / "simulate.png", title=f"block_size={args.block_size}, {args.sps_table or 'synthetic SPS curve'}")
    print(md)
    print(f"wrote {out / 'simulate.md'}, {out / 'simulate.json'}, {out / 'simulate.png'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sglang_hspec.scheduler.simulator")
    add_parser(parser.add_subparsers(dest="cmd", required=True))
    args = parser.parse_args(["simulate", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
