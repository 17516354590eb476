"""Soak an HSPEC server on CPU (loopback only, bounded): random requests for --minutes with --abort-fraction
of them aborted mid-generation, outputs of the unaborted ones compared with a non-speculative server of the
same target and dtype (greedy). Prints the machine, then writes (atomically) and prints a JSON summary:
requests, completed, aborted, failed, mismatched, KV tokens leaked (/v1/loads after draining), server RSS
at start and end, every minute between, and its growth over the second half (after the warm-up).

--model tiny (default): the tiny Qwen3 target with a bigram H-Spec drafter, KV pool 1024 tokens.
--model embedded: what users run (scripts/bench_serve_cpu.sh's HSPEC+auto+lookup): the embedded
SmolLM2-135M-Instruct target, the shipped drafter, HSPEC_SPECULATION=auto (compact verify, the shipped STS,
an SPS table with plain-decode probes: --sps-table) and prompt lookup spliced in (HSPEC_LOOKUP=1, overlap
scheduling off), MT-Bench first turns under the chat template, KV pool 4096 tokens.

In float32 any output differing from the plain server fails the run. In bfloat16 the differing outputs are
counted and reported, not failed: bf16 near-ties (a top-2 logit gap of ~1 ulp) flip between the two
servers' differently shaped forwards, and between a request decoded alone and in a batch;
--plain-soak-minutes puts the same load on the plain server first, to count what batching alone changes.

  .venv-sglang/bin/python scripts/soak_sglang.py --minutes 10 --out docs/results/serving/2026-12-01_epyc-avx2_soak/soak.json
  .venv-sglang/bin/python scripts/soak_sglang.py --model embedded --minutes 30 --out soak_embedded_fp32.json
  .venv-sglang/bin/python scripts/soak_sglang.py --model embedded --dtype bfloat16 --minutes 30 \
      --plain-soak-minutes 10 --out soak_embedded_bf16.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

SHIPPED_STS = ROOT / "docs" / "results" / "calibration" / "sts_hspec_smollm2.json"
# HSPEC_AUTO_PROFILE_SPS=1's table for the embedded target and the shipped drafter (float32, 2-core EPYC),
# plain probes included; `--sps-table auto` profiles this machine instead (once, then cached)
MEASURED_SPS = ROOT / "docs" / "results" / "serving" / "2026-12-05_epyc-zen5_fp32" / "sps_auto_profiled.json"
DEFAULT_KV_POOL = {"tiny": 1024, "embedded": 4096}


def tiny_setup(root: Path, args) -> dict:
    from sglang_cpu import builders

    target = builders.build_tiny_target(root / "target")
    drafter = builders.build_hspec_draft(root / "hspec_bigram", target, bigram=True)
    return {"target": target, "prompts": list(builders.PROMPTS), "env": {},
            "args": ["--speculative-algorithm", "HSPEC", "--speculative-draft-model-path", str(drafter)],
            "describe": "tiny Qwen3 target, bigram H-Spec drafter"}


def embedded_setup(root: Path, args) -> dict:
    from transformers import AutoTokenizer

    from sglang_hspec.assets.embedded import embedded_target_dir
    from sglang_hspec.assets.prompts import load_prompts
    from sglang_hspec.engine.loading import SHIPPED_DRAFTER_DIR

    target = embedded_target_dir()
    tok = AutoTokenizer.from_pretrained(target)
    prompts = [tok.apply_chat_template(it.messages(0), tokenize=False, add_generation_prompt=True)
               for it in load_prompts("mtbench", limit=args.prompts)]
    env = {"SGLANG_RAGGED_VERIFY_MODE": "compact", "HSPEC_SPECULATION": "auto", "HSPEC_LOOKUP": "1"}
    spec = ["--speculative-algorithm", "HSPEC", "--speculative-draft-model-path", str(SHIPPED_DRAFTER_DIR),
            "--speculative-dspark-confidence-sts-path", str(SHIPPED_STS), "--disable-overlap-schedule"]
    if args.sps_table == "auto":
        env["HSPEC_AUTO_PROFILE_SPS"] = "1"
        table = "auto-profiled (HSPEC_AUTO_PROFILE_SPS=1, cached per machine)"
    else:
        spec += ["--speculative-dspark-sps-table-path", str(args.sps_table)]
        table = str(Path(args.sps_table).resolve().relative_to(ROOT) if Path(args.sps_table).resolve().is_relative_to(ROOT)
                    else args.sps_table)
    return {"target": target, "prompts": prompts, "env": env, "args": spec,
            "describe": f"embedded SmolLM2-135M-Instruct target, shipped drafter, HSPEC_SPECULATION=auto, "
                        f"HSPEC_LOOKUP=1, SPS table {table}, {len(prompts)} MT-Bench prompts"}


def main() -> int:
    from sglang_cpu import load
    from sglang_cpu import server as cpu_server

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=("tiny", "embedded"), default="tiny",
                    help="tiny: tiny Qwen3 + bigram drafter; embedded: SmolLM2 + the shipped drafter, auto + lookup")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                    help="both servers' --dtype; float32 fails on any differing output, bfloat16 reports them")
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--abort-fraction", type=float, default=0.1)
    ap.add_argument("--max-total-tokens", type=int, default=None,
                    help=f"the HSPEC server's KV pool (default {DEFAULT_KV_POOL})")
    ap.add_argument("--prompts", type=int, default=16, help="--model embedded: MT-Bench prompts used")
    ap.add_argument("--sps-table", default=str(MEASURED_SPS),
                    help="--model embedded: the SPS table (with plain probes), or `auto` to profile this machine")
    ap.add_argument("--plain-soak-minutes", type=float, default=0.0,
                    help="first soak the plain server as long against its own one-by-one outputs (plain_control): "
                         "in bfloat16, the differing outputs that batching alone causes")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="write the summary JSON here (atomically)")
    args = ap.parse_args()
    from sglang_hspec.core.atomic import atomic_write_text
    from sglang_hspec.target.dtypes import describe_machine

    kv_pool = args.max_total_tokens or DEFAULT_KV_POOL[args.model]
    root = Path(tempfile.mkdtemp(prefix="hspec_soak_"))
    setup = (tiny_setup if args.model == "tiny" else embedded_setup)(root, args)
    machine = describe_machine()
    print(f"machine: {machine}; servers --dtype {args.dtype}; {setup['describe']}; logs in {root}", flush=True)
    prompts = setup["prompts"]
    plain = cpu_server.launch(setup["target"], log_path=root / "plain.log", dtype=args.dtype)
    plain_control = None
    try:  # the reference: the same target without speculation, one request at a time
        reference = [load.generate(plain.url, p, 64)["output_ids"] for p in prompts]
        if args.plain_soak_minutes > 0:  # the same load on the plain server: what batching alone changes
            plain_control = load.soak(plain.url, prompts=prompts, reference=reference,
                                      duration_s=60 * args.plain_soak_minutes, concurrency=args.concurrency,
                                      max_new_tokens=(1, 64), abort_fraction=args.abort_fraction, seed=args.seed)
            plain_control["minutes"] = args.plain_soak_minutes
    finally:
        plain.stop()
    srv = cpu_server.launch(setup["target"], log_path=root / "hspec.log", plugins=("sglang_cpu_testing", "hspec"),
                            max_total_tokens=kv_pool, dtype=args.dtype, env_extra=setup["env"], args=setup["args"],
                            timeout=1800.0 if args.sps_table == "auto" else 300.0)
    try:
        stats = load.soak(srv.url, prompts=prompts, reference=reference, duration_s=60 * args.minutes,
                          concurrency=args.concurrency, max_new_tokens=(1, 64), abort_fraction=args.abort_fraction,
                          seed=args.seed, server_pid=srv.proc.pid)
        stats["tracebacks_in_log"] = srv.serving_log().count("Traceback")  # once ready (see Server.serving_log)
        stats["server_ready_s"] = round(srv.ready_s, 1)
        # tokens per verify step over the server's recent requests: drafting (and lookup) really ran
        state = (srv.get("/server_info").get("internal_states") or [{}])[0]
        stats["avg_spec_accept_length"] = state.get("avg_spec_accept_length")
    finally:
        srv.stop()
    if plain_control is not None:
        stats["plain_control"] = plain_control
    stats.update(model=args.model, server=setup["describe"], minutes=args.minutes, concurrency=args.concurrency,
                 abort_fraction=args.abort_fraction, max_total_tokens=kv_pool, machine=machine, dtype=args.dtype,
                 mismatch_fails=args.dtype == "float32")
    print(json.dumps(stats, indent=2))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(args.out, json.dumps(stats, indent=2) + "\n")
    exact = stats["mismatched"] == 0 or args.dtype == "bfloat16"  # bf16: reported, not failed
    ok = stats["failed"] == 0 and exact and stats["kv_tokens_leaked"] == 0 and stats["left_running"] == 0
    return 0 if ok and stats["tracebacks_in_log"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
