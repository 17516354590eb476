"""Where an HSPEC decode step's time goes on the SGLang CPU tier, at one request (C = 1).

Starts the servers on the embedded SmolLM2 target (float32, the CPU tier of tests/sglang_cpu), sends each
MT-Bench prompt (greedy, `ignore_eos`, one request at a time) to each server in turn, so the machine's load
reaches all of them alike, and prints side by side:

- per server: output tok/s, ms per decode step, the step's cost in plain decode steps (ms per step over
  the plain server's ms per token, measured in the same run), tau;
- for the HSPEC servers, where the step's wall time went, as shares of (step + scheduler loop), from the
  worker's `HSPEC_STEP_PROFILE` segments (sglang_plugin/step_timer.py); `ours` is the plugin's own share:
  the drafter (draft: runner forward, H-Spec model, KV view, heads), the planner segment (SGLang's budget
  and layout code with our planner hooks inside), the stale-budget preparation and the context-row commit.
  `verify` (target forward + SGLang's scatter), `accept`, `observe` and `loop` (SGLang's scheduler and
  output processing) are SGLang's own CPU path.

Servers (`--servers`, default all): none (no speculation), static (HSPEC, full-block verify), compact
(HSPEC, SGLANG_RAGGED_VERIFY_MODE=compact with --sps/--sts), never (compact, every step without drafting:
what a no-draft step costs), auto (compact, HSPEC_SPECULATION=auto; needs an SPS table with plain probes).

    .venv-sglang/bin/python scripts/profile_sglang_step.py --prompts 4 --max-tokens 48 --out /tmp/prof

Absolute times depend on the machine's load; shares and ratios from one run are what to compare.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))  # the CPU tier (tests/sglang_cpu)

from tqdm import tqdm  # noqa: E402

from sglang_hspec.sglang_plugin.step_timer import ENV as PROFILE_ENV  # noqa: E402
from sglang_hspec.sglang_plugin.step_timer import snapshot_delta  # noqa: E402
from sglang_hspec.target.dtypes import describe_machine as cpu_description  # noqa: E402

DRAFTER = REPO / "sglang_hspec" / "checkpoints" / "hspec-smollm2"
STS = REPO / "docs" / "results" / "calibration" / "sts_hspec_smollm2.json"
SPS = REPO / "docs" / "results" / "serving" / "2026-12-05_epyc-zen5_fp32" / "sps_auto_profiled.json"
SERVERS = ("none", "static", "compact", "never", "auto")
# (segment, label, ours?) in the order of the table; shares of step + loop
SEGMENTS = (
    ("draft", "draft (drafter + heads)", True),
    ("draft.forward", "  draft runner forward", True),
    ("draft.model", "    HSpecDraftModel.forward", True),
    ("draft.kv_view", "      KV view + gather", True),
    ("draft.base_logits", "  base logits (draft vocab)", True),
    ("draft.markov", "  Markov sampler (SGLang)", True),
    ("draft.confidence", "  confidence head", True),
    ("draft.rest", "  rest of the proposer (SGLang)", True),
    ("planner", "planner (budget, layout, hooks)", True),
    ("loop.prepare", "stale-budget prepare", True),
    ("commit", "context-row commit", True),
    ("verify", "target verify (SGLang)", False),
    ("accept", "accept (SGLang)", False),
    ("observe", "step observers (SGLang)", False),
    ("other", "rest of the worker step (SGLang)", False),
    ("loop.sglang", "scheduler loop (SGLang)", False),
)
OURS_TOP = ("draft", "planner", "loop.prepare", "commit")


def server_config(name: str, *, sps: Path, sts: Path) -> tuple[list[str], dict[str, str], tuple[str, ...]]:
    if name == "none":
        return [], {}, ("sglang_cpu_testing",)
    args = ["--speculative-algorithm", "HSPEC", "--speculative-draft-model-path", str(DRAFTER)]
    env = {"SGLANG_RAGGED_VERIFY_MODE": "static"}
    if name != "static":
        env = {"SGLANG_RAGGED_VERIFY_MODE": "compact"}
        args += ["--speculative-dspark-sps-table-path", str(sps), "--speculative-dspark-confidence-sts-path", str(sts)]
        env["HSPEC_SPECULATION"] = {"compact": "always", "never": "never", "auto": "auto"}[name]
    return args, env, ("sglang_cpu_testing", "hspec")


def run_servers(names: list[str], *, target: Path, prompts: list[str], max_tokens: int, out: Path, sps: Path,
                sts: Path, threads: int, startup_timeout: float) -> list[dict]:
    """Start every server (idle ones sleep: --sleep-on-idle), then send each prompt to each server in turn,
    so that the machine's load changes reach all of them alike; stop them all."""
    from sglang_cpu import server as cpu_server

    servers, profiles = {}, {}
    try:
        for name in names:
            args, env, plugins = server_config(name, sps=sps, sts=sts)
            profiles[name] = out / f"{name}.steps.json"
            profiles[name].unlink(missing_ok=True)
            env = {**env, "OMP_NUM_THREADS": str(threads)}
            if name != "none":
                env[PROFILE_ENV] = str(profiles[name])
            print(f"[{name}] starting", flush=True)
            servers[name] = cpu_server.launch(target, log_path=out / f"{name}.log", args=args, plugins=plugins,
                                              env_extra=env, timeout=startup_timeout)
            servers[name].generate([prompts[0]], 8)  # warm-up
        read = {n: (lambda p=profiles[n]: json.loads(p.read_text()) if p.exists() else None) for n in names}
        before = {n: read[n]() for n in names}
        stats = {n: {"tokens": 0, "verify_ct": 0, "wall_s": 0.0} for n in names}
        for prompt in tqdm(prompts, desc="prompts x servers", unit="prompt"):
            for name in names:
                t0 = time.perf_counter()
                meta = servers[name].generate([prompt], max_tokens)[0]["meta_info"]
                stats[name]["wall_s"] += time.perf_counter() - t0
                stats[name]["tokens"] += int(meta["completion_tokens"])
                stats[name]["verify_ct"] += int(meta.get("spec_verify_ct") or 0)
        after = {n: read[n]() for n in names}
    finally:
        for srv in servers.values():
            srv.stop()
    return [{"name": n, "requests": len(prompts), **stats[n],
             "profile": snapshot_delta(after[n], before[n]) if after[n] else None} for n in names]


def step_shares(delta: dict) -> tuple[dict[str, float], float, dict[str, int]]:
    """Seconds per segment summed over both step kinds, with `other` and `loop.sglang` derived, and the
    total (step + loop)."""
    sec: dict[str, float] = {}
    for values in delta["seconds"].values():
        for k, v in values.items():
            sec[k] = sec.get(k, 0.0) + v
    top = ("draft", "planner", "verify", "accept", "commit", "observe")
    sec["other"] = sec.get("step", 0.0) - sum(sec.get(k, 0.0) for k in top)
    sec["loop.sglang"] = sec.get("loop", 0.0) - sec.get("loop.prepare", 0.0)
    heads = ("draft.forward", "draft.base_logits", "draft.markov", "draft.confidence")
    sec["draft.rest"] = sec.get("draft", 0.0) - sum(sec.get(k, 0.0) for k in heads)
    return sec, sec.get("step", 0.0) + sec.get("loop", 0.0), delta["steps"]


def report(results: list[dict], *, cpu: str, threads: int) -> str:
    lines = [f"CPU: {cpu}; dtype float32; C = 1; OMP threads per server = {threads}",
             "(shared machine: absolute times are provisional, compare the ratios and shares of one run)", ""]
    plain = next((r for r in results if r["name"] == "none"), None)
    plain_ms = 1000.0 * plain["wall_s"] / plain["tokens"] if plain else None
    lines.append(f"{'server':<8} {'tok/s':>7} {'vs none':>8} {'steps':>6} {'tau':>5} {'ms/step':>8} "
                 f"{'plain steps':>11} {'draft/plain steps':>17}")
    for r in results:
        steps = r["verify_ct"] or r["tokens"]
        ms_step = 1000.0 * r["wall_s"] / steps
        tau = r["tokens"] / steps
        kinds = (r["profile"] or {}).get("steps", {})
        cost = f"{ms_step / plain_ms:11.2f}" if plain_ms else f"{'-':>11}"
        ratio = f"{r['tokens'] / r['wall_s'] / (plain['tokens'] / plain['wall_s']):7.2f}x" if plain else "-"
        lines.append(f"{r['name']:<8} {r['tokens'] / r['wall_s']:7.2f} {ratio:>8} {steps:6d} {tau:5.2f} "
                     f"{ms_step:8.1f} {cost} {kinds.get('draft', 0):>8d}/{kinds.get('plain', 0):<8d}")
    profiled = [r for r in results if r["profile"]]
    if profiled:
        lines += ["", "share of an HSPEC decode step (step + scheduler loop), from HSPEC_STEP_PROFILE:", ""]
        lines.append(f"{'segment':<34}" + "".join(f"{r['name']:>10}" for r in profiled))
        shares = [step_shares(r["profile"]) for r in profiled]
        for key, label, _ in SEGMENTS:
            lines.append(f"{label:<34}" + "".join(f"{100 * sec.get(key, 0.0) / total:9.1f}%" for sec, total, _ in shares))
        lines.append(f"{'ours (draft+planner+prepare+commit)':<34}"
                     + "".join(f"{100 * sum(sec.get(k, 0.0) for k in OURS_TOP) / total:9.1f}%"
                               for sec, total, _ in shares))
        lines.append(f"{'ms per step (step + loop)':<34}"
                     + "".join(f"{1000 * total / max(1, sum(n.values())):10.1f}" for _, total, n in shares))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--servers", default=",".join(SERVERS), help=f"comma-separated, from {', '.join(SERVERS)}")
    p.add_argument("--prompts", type=int, default=4, help="MT-Bench prompts (first turns), one at a time")
    p.add_argument("--max-tokens", type=int, default=48, help="new tokens per request (ignore_eos)")
    p.add_argument("--sps", type=Path, default=SPS, help="SPS table of the compact/never/auto servers")
    p.add_argument("--sts", type=Path, default=STS, help="STS file of the compact/never/auto servers")
    p.add_argument("--threads", type=int, default=1, help="OMP threads per server (default 1: servers and "
                   "other jobs share the cores)")
    p.add_argument("--startup-timeout", type=float, default=1200.0, help="seconds a server may take to start")
    p.add_argument("--out", type=Path, default=Path("profile_sglang_step"), help="logs, step profiles, report")
    args = p.parse_args(argv)
    names = [n.strip() for n in args.servers.split(",") if n.strip()]
    if bad := [n for n in names if n not in SERVERS]:
        p.error(f"unknown server(s) {bad}; choose from {', '.join(SERVERS)}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    from sglang_hspec.assets.embedded import embedded_target_dir
    from sglang_hspec.assets.prompts import load_prompts

    target = embedded_target_dir()
    prompts = [item.turns[0] for item in load_prompts("mtbench", limit=args.prompts)]
    args.out.mkdir(parents=True, exist_ok=True)
    results = run_servers(names, target=target, prompts=prompts, max_tokens=args.max_tokens, out=args.out,
                          sps=args.sps, sts=args.sts, threads=args.threads, startup_timeout=args.startup_timeout)
    text = report(results, cpu=cpu_description(), threads=args.threads)
    print(text)
    (args.out / "report.txt").write_text(text + "\n")
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
