"""Where the speculate-or-decode switch (scheduler/switch.py) speculates: a map over batch size N and
tau, the expected tokens per step of a full block (1 = nothing accepted, block_size + 1 = all).

Each cell gives every request the same survivals a_j = alpha^(j+1), alpha solved from tau, and asks
`decide_speculation` (everything known, no probe due). Two SPS tables, both synthetic unless
`--sps-table` names a measured one (then one panel):
- "CPU-like": the reference engine on 2 AVX2 cores, fp32 (a plain step 70 ms at one request; a verify
  of B tokens 70 ms x (1 + 0.17 (B - 1)) below 8 tokens per request, rising with the batch; a draft
  forward 0.4 plain steps), shaped after docs/results.md;
- "GPU-like": `synthetic_sps_table()` (CUDA-graph tiers), plain = the anchor-only verify, a draft 2 ms.
A measured table without a drafter column (SGLang's profiler: whole drafting steps) is costed as the HSPEC
worker costs it, `StepCosts(block_size=block_size)`.

    python scripts/plot_switch_boundary.py --out docs/scheduler_switch.png
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
from scipy.optimize import brentq
from sglang_hspec.scheduler.sps import SpsCostTable, load_sps_table, synthetic_sps_table
from sglang_hspec.scheduler.switch import StepCosts, decide_speculation


def cpu_like_table(max_batch_tokens: int = 4096) -> SpsCostTable:
    plain = 0.070
    probes = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096]
    # small batches are weight-bound (a token costs 17 % of a step), large ones compute-bound (~linear)
    seconds = [plain * (1 + 0.17 * (b - 1)) if b <= 8 else plain * 2.2 * (b / 8) ** 0.85 for b in probes]
    sizes = [1, 2, 4, 8, 16, 32, 64, 128, 256]
    plain_seconds = [plain * (1 + 0.02 * (n - 1)) if n <= 8 else plain * 1.14 * (n / 8) ** 0.8 for n in sizes]
    return SpsCostTable(sample_batch_tokens=probes, sample_steps_per_sec=[1 / t for t in seconds],
                        max_batch_tokens=max_batch_tokens, plain_batch_sizes=sizes,
                        plain_steps_per_sec=[1 / t for t in plain_seconds],
                        draft_seconds=[0.4 * t for t in plain_seconds])


def alpha_for_tau(tau: float, block_size: int) -> float:
    if tau <= 1.0:
        return 0.0
    if tau >= block_size + 1:
        return 1.0
    return brentq(lambda a: sum(a**j for j in range(block_size + 1)) - tau, 0.0, 1.0)


def decision_map(costs: StepCosts, *, batch_sizes, taus, block_size: int) -> np.ndarray:
    out = np.zeros((len(taus), len(batch_sizes)))
    for i, tau in enumerate(taus):
        alpha = alpha_for_tau(tau, block_size)
        row = torch.tensor([alpha ** (j + 1) for j in range(block_size)], dtype=torch.float64)
        for j, n in enumerate(batch_sizes):
            d = decide_speculation(survival=row.expand(n, block_size).contiguous(), costs=costs, known_rows=n,
                                   steps_since_draft=0, probe_interval=1 << 30)
            out[i, j] = d.budget / n if d.speculate else 0.0  # drafts verified per request (0 = plain)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sps-table", default=None, help="a measured table (hspec profile-sps) instead of the synthetic two")
    ap.add_argument("--block-size", type=int, default=7)
    ap.add_argument("--out", default="docs/scheduler_switch.png")
    args = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if args.sps_table:
        table = load_sps_table(args.sps_table)
        # no drafter column: SGLang's profile of whole drafting steps, costed as the HSPEC worker does
        whole_steps = not getattr(table, "draft_seconds", [1.0])
        costs = StepCosts(table, block_size=args.block_size if whole_steps else None)
        name = args.sps_table.rsplit("/", 1)[-1]
        panels = [(f"measured: {name}" + (" (whole drafting steps)" if whole_steps else ""), costs)]
    else:
        panels = [("synthetic CPU-like (2 AVX2 cores, fp32)", StepCosts(cpu_like_table())),
                  ("synthetic GPU-like (CUDA-graph tiers)", StepCosts(synthetic_sps_table(), draft_seconds=0.002))]
    batch_sizes = [1, 2, 4, 8, 16, 32, 64, 128, 256]
    taus = np.linspace(1.0, args.block_size + 1.0, 57)
    fig, axes = plt.subplots(1, len(panels), figsize=(6.0 * len(panels), 4.4), squeeze=False)
    for ax, (title, costs) in zip(axes[0], panels):
        grid = decision_map(costs, batch_sizes=batch_sizes, taus=taus, block_size=args.block_size)
        mesh = ax.pcolormesh(np.arange(len(batch_sizes) + 1) - 0.5, np.append(taus, taus[-1] + taus[1] - taus[0]),
                             grid, cmap="viridis", vmin=0, vmax=args.block_size, shading="flat")
        ax.contour(np.arange(len(batch_sizes)), taus, (grid > 0).astype(float), levels=[0.5], colors="white")
        ax.set_xticks(range(len(batch_sizes)), [str(b) for b in batch_sizes])
        ax.set_xlabel("batch size N (requests)")
        ax.set_ylabel(f"tau of a full block ({args.block_size} drafts + bonus)")
        ax.set_title(title, fontsize=10)
        ax.text(0.02, 0.97, "speculate", transform=ax.transAxes, va="top", color="white")
        ax.text(0.98, 0.03, "decode plainly", transform=ax.transAxes, ha="right", color="white")
        fig.colorbar(mesh, ax=ax, label="draft tokens verified per request (0 = plain decode)")
    fig.suptitle("speculate-or-decode switch: decision over batch size and tau", fontsize=11)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
