"""Soak an HSPEC server on CPU (loopback only, bounded): random requests for --minutes with --abort-fraction
of them aborted mid-generation, outputs of the unaborted ones compared with a non-speculative server of the
same target (greedy, float32). Prints and writes a JSON summary: requests, completed, aborted, failed,
mismatched, KV tokens leaked (/v1/loads after draining), server RSS at start and end.

  .venv-sglang/bin/python scripts/soak_sglang.py --minutes 10 --out docs/results/serving/2026-12-01_epyc-avx2_soak/soak.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


def main() -> int:
    from sglang_cpu import builders, load
    from sglang_cpu import server as cpu_server

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--abort-fraction", type=float, default=0.1)
    ap.add_argument("--max-total-tokens", type=int, default=1024, help="the HSPEC server's KV pool")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="write the summary JSON here")
    args = ap.parse_args()
    from sglang_hspec.core.atomic import atomic_write_text
    from sglang_hspec.target.dtypes import describe_machine

    machine = describe_machine()
    print(f"machine: {machine}; float32; tiny Qwen3 target, bigram H-Spec drafter")
    root = Path(tempfile.mkdtemp(prefix="hspec_soak_"))
    target = builders.build_tiny_target(root / "target")
    drafter = builders.build_hspec_draft(root / "hspec_bigram", target, bigram=True)
    prompts = list(builders.PROMPTS)
    plain = cpu_server.launch(target, log_path=root / "plain.log")
    try:  # the reference: the same target without speculation, one request at a time
        reference = [load.generate(plain.url, p, 64)["output_ids"] for p in prompts]
    finally:
        plain.stop()
    srv = cpu_server.launch(target, log_path=root / "hspec.log", plugins=("sglang_cpu_testing", "hspec"),
                            max_total_tokens=args.max_total_tokens,
                            args=["--speculative-algorithm", "HSPEC", "--speculative-draft-model-path", str(drafter)])
    try:
        stats = load.soak(srv.url, prompts=prompts, reference=reference, duration_s=60 * args.minutes,
                          concurrency=args.concurrency, max_new_tokens=(1, 64), abort_fraction=args.abort_fraction,
                          seed=args.seed, server_pid=srv.proc.pid)
        stats["tracebacks_in_log"] = srv.serving_log().count("Traceback")  # once ready (see Server.serving_log)
    finally:
        srv.stop()
    stats.update(minutes=args.minutes, concurrency=args.concurrency, abort_fraction=args.abort_fraction,
                 max_total_tokens=args.max_total_tokens, machine=machine, dtype="float32")
    print(json.dumps(stats, indent=2))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(args.out, json.dumps(stats, indent=2) + "\n")
    ok = stats["failed"] == 0 and stats["mismatched"] == 0 and stats["kv_tokens_leaked"] == 0
    return 0 if ok and stats["tracebacks_in_log"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
