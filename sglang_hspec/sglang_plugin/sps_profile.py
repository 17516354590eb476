"""SPS tables for SGLang servers, measured by SGLang's own profiler (`sglang.benchmark.dspark_sps_profiler`).

`profile_server(url=...)` profiles a running HSPEC or DSPARK server: per request count bs it holds bs
requests running (random prompts, `ignore_eos`), reads the server's per-step records from `/server_info`
and takes SPS = 1 / median step time over the steady steps, at batch tokens = bs x verify tokens. The
server must run `SGLANG_RAGGED_VERIFY_MODE=static SGLANG_DSPARK_ENABLE_SPS_RECORD=1
SGLANG_SIMULATE_ACC_LEN=1.0` (every step advances every request by one token: deterministic KV growth); the
profiler refuses anything else with the reason. HSPEC is accepted through the hooks of `sps_hooks`. The
fit is SGLang's (`SpsCostTable` JSON, what `--speculative-dspark-sps-table-path` reads), checked with our
strict loader; a PNG is written next to it.

`profile_with_server(out=...)` is the auto-profile: from the launcher, it starts a short-lived server
with this launcher's own command line and the profiling environment, profiles it, and stops it.

`hspec profile-sps --url http://HOST:PORT --out sps.json` is the CLI (`add_server_arguments`).
Imports SGLang lazily (only `profile_server` needs it).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

GREEDY_TABLE_SUFFIX = ".greedy.json"  # greedy_table_path

# The profiling environment SGLang's profiler checks on the server (fetch_server_context).
# Set in the profiling server's environment: it must neither profile itself nor warn about its missing table.
PROFILING_SERVER_ENV = "HSPEC_SPS_PROFILING_SERVER"
PROFILING_SERVER_ENVIRONMENT = {
    "SGLANG_RAGGED_VERIFY_MODE": "static",
    "SGLANG_DSPARK_ENABLE_SPS_RECORD": "1",
    "SGLANG_SIMULATE_ACC_LEN": "1.0",
}
# Server flags the profiling server must not inherit from the launcher's command line.
_DROPPED_FLAGS = ("--host", "--port", "--speculative-dspark-sps-table-path", "--api-key", "--admin-api-key")
POWERS_OF_TWO = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


def _get_json(url: str, timeout: float = 60.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def default_batch_sizes(info: dict[str, Any]) -> list[int]:
    """Request counts 1, 2, 4, ... up to the server's capacity: the running-request cap, and on a GPU the
    largest captured decode CUDA graph (beyond it steps run eager: another cost regime)."""
    state = (info.get("internal_states") or [{}])[0]
    cap = int(state.get("effective_max_running_requests_per_dp") or info.get("max_running_requests") or 0)
    if cap < 1:
        raise ValueError("the server reports no max_running_requests; pass --batch-size 1,2,4,...")
    graphs = (state.get("cuda_graph_config") or {}).get("decode") or {}
    if not info.get("disable_cuda_graph") and graphs.get("bs"):
        cap = min(cap, max(int(b) for b in graphs["bs"]))
    return sorted({b for b in POWERS_OF_TWO if b <= cap} | {cap})


def capacity_batch_tokens(info: dict[str, Any]) -> int | None:
    """Verify capacity of the server: running-request cap x verify tokens per request."""
    state = (info.get("internal_states") or [{}])[0]
    cap = state.get("effective_max_running_requests_per_dp") or info.get("max_running_requests")
    tokens = info.get("speculative_num_draft_tokens")
    return int(cap) * int(tokens) if cap and tokens else None


def profile_server(*, url: str, out: str | os.PathLike, batch_sizes: list[int] | None = None,
                   input_len: int = 16, temperature: float = 1.0, min_steady_steps: int = 32,
                   min_steady_seconds: float = 10.0, round_timeout: float = 300.0, repeats: int = 1,
                   max_batch_tokens: int | None = None, tokenizer_path: str | None = None, plot: bool = True,
                   anchor_only: bool = False):
    """Profile the server at `url` with SGLang's profiler; write the table to `out` (plus SGLang's
    `<stem>.rounds.jsonl`, `<stem>.records.jsonl`, `<out>.manifest.json`, and our `<stem>.png`).
    `anchor_only`: the server never drafts (`HSPEC_SPECULATION=never`): a probe of N requests verifies N
    tokens and is filed under N batch tokens. Returns the table as loaded by
    `sglang_hspec.scheduler.load_sps_table`."""
    from sglang_hspec.scheduler import load_sps_table, plot_sps

    from .sps_hooks import anchor_only_profile, apply

    url = url.rstrip("/")
    out = Path(out)
    try:
        info = _get_json(url + "/server_info")
    except (urllib.error.URLError, OSError) as e:
        raise ValueError(f"cannot reach the SGLang server at {url} ({e}); start it first (the profiler "
                         "never launches one) and pass its base URL, e.g. http://127.0.0.1:30000") from e
    if importlib.util.find_spec("sglang") is None:
        raise ValueError("profiling a server runs SGLang's own profiler, which is not installed in this "
                         "environment: pip install 'sglang-hspec[sglang]' (or run hspec from the server's env)")
    batch_sizes = sorted(set(batch_sizes)) if batch_sizes else default_batch_sizes(info)
    capacity = capacity_batch_tokens(info)
    if max_batch_tokens is None and capacity is not None:
        max_batch_tokens = max(capacity, max(batch_sizes) * int(info["speculative_num_draft_tokens"]))
    prof = apply()  # SGLang's profiler, with the HSPEC hooks
    prof_logger = logging.getLogger(prof.__name__)
    if prof_logger.getEffectiveLevel() > logging.INFO:
        prof_logger.setLevel(logging.INFO)  # one line per round: its progress
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.WARNING, format="%(message)s")
    settings = prof.RoundSettings(input_len=input_len, temperature=temperature, min_steady_steps=min_steady_steps,
                                  min_steady_seconds=min_steady_seconds, round_timeout_seconds=round_timeout)
    logger.info("profiling %s (%s): request counts %s", url, info.get("speculative_algorithm"), batch_sizes)
    out.parent.mkdir(parents=True, exist_ok=True)
    with anchor_only_profile() if anchor_only else contextlib.nullcontext():
        prof.run_profile(base_url=url, batch_sizes=batch_sizes, settings=settings, out=str(out), repeats=repeats,
                         local_tokenizer_path=tokenizer_path, fracs=None)
    prof.fit_profile(out=str(out), max_batch_tokens=max_batch_tokens, self_check=True, plot=False)
    table = load_sps_table(out)
    if plot:
        plot_sps(table, out.with_suffix(".png"),
                 title=f"{info.get('speculative_algorithm')} steps/s vs verify tokens ({info.get('device')})")
    return table


# ------------------------------------------------------------------ auto-profile: a short-lived server

def relaunch_argv(argv: list[str] | None = None, *, port: int) -> list[str]:
    """This launcher's command line (`python -m sglang.launch_server ...` or `sglang serve ...`) for the
    profiling server: loopback host, its own port, no SPS table, no API keys."""
    argv = list(sys.argv if argv is None else argv)
    prog = Path(argv[0]).name if argv else ""
    if not (prog == "launch_server.py" or (prog == "sglang" and argv[1:2] == ["serve"])):
        raise RuntimeError(
            f"the SPS auto-profile relaunches the server's command line, but this process was started as "
            f"{argv[0]!r} (an in-process engine?); launch with python -m sglang.launch_server or sglang serve, "
            "or profile a running server with hspec profile-sps --url and pass --speculative-dspark-sps-table-path"
        )
    serve = argv[1:2] == ["serve"]
    # launch_server.py runs as a module (as a script, its folder would shadow top-level imports)
    head, rest = ([argv[0], "serve"], argv[2:]) if serve else (["-m", "sglang.launch_server"], argv[1:])
    kept, skip = [], False
    for arg in rest:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in _DROPPED_FLAGS:
            skip = "=" not in arg
            continue
        kept.append(arg)
    if "--skip-server-warmup" not in kept:
        kept.append("--skip-server-warmup")  # the profiler runs its own warm-up round
    return [sys.executable, *head, *kept, "--host", "127.0.0.1", "--port", str(port)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(proc: subprocess.Popen, timeout: float = 60.0) -> None:
    for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)  # the launcher's own process group: scheduler and detokenizer too
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            continue


def _wait_ready(proc: subprocess.Popen, url: str, log_path: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the profiling server exited with {proc.returncode}; log {log_path}:\n"
                               f"{log_path.read_text(errors='replace')[-4000:]}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"the profiling server was not ready after {timeout:.0f} s; log {log_path}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            pass
        time.sleep(1.0)


def with_plain_probes(spec, plain, *, verify_tokens: int = 1):
    """`spec` (an HSPEC server's SGLang-profiled table) extended with the plain-decode probes of `plain`
    (the same server profiled with `HSPEC_SPECULATION=never`: every step verifies the anchor only). SGLang's
    profiler files a probe of bs requests under bs x verify_tokens batch tokens (1 for a table profiled
    with `anchor_only`); plain probes are per request count. No drafter column: SGLang's step times
    already include the draft forward."""
    import msgspec

    from sglang_hspec.scheduler.sps import SpsCostTable

    if verify_tokens < 1:
        raise ValueError(f"verify_tokens must be >= 1, got {verify_tokens}")
    sizes = [bt // verify_tokens for bt in plain.sample_batch_tokens]
    if any(bt % verify_tokens for bt in plain.sample_batch_tokens):
        raise ValueError(f"the plain profile's batch tokens {plain.sample_batch_tokens} are not multiples of "
                         f"{verify_tokens} verify tokens per request; profile both servers with one configuration")
    if not isinstance(spec, SpsCostTable):
        raise ValueError(f"plain-decode probes extend floor SPS tables only, got {type(spec).__name__}")
    return msgspec.structs.replace(spec, plain_batch_sizes=sizes, plain_steps_per_sec=list(plain.sample_steps_per_sec))


def greedy_table_path(table: str | os.PathLike) -> Path:
    """Where the greedy twin of the SPS table `table` lives: `<stem>.greedy.json` beside it. Its probes are
    the same server's steps at temperature 0, where the worker drafts by argmax (worker.py,
    `greedy_drafts_for_greedy_batches`) and skips the sampled draft's noise: a cheaper step (a bf16 CPU
    measured 1.17-1.25x at four requests; docs/serving.md), which the switch weighs on all-greedy batches."""
    table = Path(table)
    return table.with_name(table.stem + GREEDY_TABLE_SUFFIX)


def _profile_once(*, cmd: list[str], port: int, outs: list[tuple[Path, dict[str, Any]]], log_path: Path,
                  env: dict[str, str], startup_timeout: float) -> int:
    """One profiling server: start, profile it into each (out, settings) in turn, stop. Returns its verify
    tokens per request."""
    logger.info("HSPEC SPS auto-profile: starting a profiling server on port %d (log %s)", port, log_path)
    with open(log_path, "wb") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_ready(proc, url, log_path, startup_timeout)
        verify_tokens = int(_get_json(url + "/server_info")["speculative_num_draft_tokens"])
        for out, settings in outs:
            profile_server(url=url, out=out, **settings)
    finally:
        _stop(proc)
    return verify_tokens


def profile_with_server(*, out: str | os.PathLike, settings: dict[str, Any] | None = None,
                        argv: list[str] | None = None, startup_timeout: float = 1800.0,
                        plain_probes: bool = False, greedy_probes: bool = False) -> None:
    """Start a profiling server from this launcher's command line, profile it into `out`, stop it. With
    `plain_probes`, a second profiling server that never drafts (`HSPEC_SPECULATION=never`) measures plain
    decode steps at the same request counts, and the table gains `plain_batch_sizes` /
    `plain_steps_per_sec` (what `HSPEC_SPECULATION=auto` weighs speculation against). With `greedy_probes`,
    the drafting server is also profiled at temperature 0 (argmax drafts) into `greedy_table_path(out)`,
    with the same plain probes. `out` is profiled at the settings' temperature (SGLang's default 1: sampled
    drafts, what its planner expects). Tables are written under temporary names and moved into place, `out`
    last, so a reader never sees a partial file."""
    from sglang_hspec.scheduler.sps import load_sps_table, save_sps_table

    from .speculation_policy import POLICY_ENV

    out = Path(out)
    settings = dict(settings or {})
    out.parent.mkdir(parents=True, exist_ok=True)
    work = out.parent / f".{out.stem}.tmp-{os.getpid()}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    env = {**os.environ, **PROFILING_SERVER_ENVIRONMENT, PROFILING_SERVER_ENV: "1", POLICY_ENV: "always"}
    table = work / out.name
    greedy = work / "greedy" / out.name
    runs = [(table, settings)]
    if greedy_probes:
        greedy.parent.mkdir()
        runs.append((greedy, {**settings, "temperature": 0.0, "plot": False}))
    port = _free_port()
    _profile_once(cmd=relaunch_argv(argv, port=port), port=port, outs=runs,
                  log_path=out.with_name(out.stem + ".server.log"), env=env, startup_timeout=startup_timeout)
    if plain_probes:
        plain = work / "plain" / out.name
        plain.parent.mkdir()
        port = _free_port()
        _profile_once(cmd=relaunch_argv(argv, port=port), port=port,
                      outs=[(plain, {**settings, "plot": False, "anchor_only": True})],
                      log_path=out.with_name(out.stem + ".plain.server.log"), env={**env, POLICY_ENV: "never"},
                      startup_timeout=startup_timeout)
        for spec in (table, greedy) if greedy_probes else (table,):
            save_sps_table(with_plain_probes(load_sps_table(spec), load_sps_table(plain)), spec)
        shutil.rmtree(plain.parent, ignore_errors=True)
    if greedy_probes:
        os.replace(greedy, work / greedy_table_path(out).name)
        shutil.rmtree(greedy.parent, ignore_errors=True)
    for f in sorted(work.iterdir(), key=lambda p: p == table):  # the table last
        os.replace(f, out.parent / f.name)
    shutil.rmtree(work, ignore_errors=True)


# ------------------------------------------------------------------ CLI: hspec profile-sps --url

def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    """Add `--url` (and its options) to `hspec profile-sps`: with --url it profiles that SGLang server,
    without it the reference engine as before. Each number is range-checked as it is parsed, before the
    server is reached (a nan or inf wait would never end a probe)."""
    from sglang_hspec.scheduler.profiler import finite_at_least, int_at_least, probe_sizes_list

    engine_defaults = {name: parser.get_default(name) for name in ("batch_tokens", "repeats")}
    engine_run = parser.get_default("func")
    g = parser.add_argument_group(
        "profile a running SGLang server (HSPEC or DSPARK)",
        "launched with SGLANG_RAGGED_VERIFY_MODE=static SGLANG_DSPARK_ENABLE_SPS_RECORD=1 "
        "SGLANG_SIMULATE_ACC_LEN=1.0; measured by SGLang's own profiler")
    g.add_argument("--url", default=None, help="base URL of the server, e.g. http://127.0.0.1:30000")
    g.add_argument("--batch-size", type=probe_sizes_list("request counts"), default=None,
                   help="running-request counts to probe, e.g. 1,2,4,8 (batch tokens = count x verify tokens; "
                        "default 1,2,4,... up to the server's capacity)")
    g.add_argument("--input-len", type=int_at_least(1, "prompt tokens per request"), default=16,
                   help="prompt tokens per request (default 16)")
    g.add_argument("--temperature", type=finite_at_least(0, "the load's sampling temperature; 0 = greedy"),
                   default=1.0, help="sampling temperature of the load (default 1)")
    g.add_argument("--min-steady-steps", type=int_at_least(1, "steady decode steps each probe measures"), default=32,
                   help="steady steps per probe (default 32)")
    g.add_argument("--min-steady-seconds", type=finite_at_least(0, "steady seconds each probe measures; 0: steps only"),
                   default=10.0, help="steady seconds per probe (default 10)")
    g.add_argument("--round-timeout", type=finite_at_least(0, "seconds per probe before giving up", above=True),
                   default=300.0, help="seconds per probe before giving up")
    g.add_argument("--tokenizer-path", default=None, help="tokenizer, if the server's path is not readable here")
    g.add_argument("--plain-url", default=None,
                   help="base URL of the same server configuration launched with HSPEC_SPECULATION=never: its "
                        "steps are plain decode steps, stored as the table's plain-decode probes (what "
                        "HSPEC_SPECULATION=auto needs)")
    parser.set_defaults(batch_tokens=None, repeats=None)

    def run(args: argparse.Namespace) -> int:
        if args.url is None:
            for name, value in engine_defaults.items():
                if getattr(args, name) is None:
                    setattr(args, name, value)
            return engine_run(args)
        if args.step_fn or args.factory_arg or args.batch_tokens is not None:
            raise ValueError("--step-fn, --factory-arg and --batch-tokens profile the reference engine; with "
                             "--url give the running-request counts with --batch-size")
        common = dict(batch_sizes=args.batch_size, input_len=args.input_len, temperature=args.temperature,
                      min_steady_steps=args.min_steady_steps, min_steady_seconds=args.min_steady_seconds,
                      round_timeout=args.round_timeout, repeats=args.repeats or 1,
                      max_batch_tokens=args.max_batch_tokens, tokenizer_path=args.tokenizer_path)
        table = profile_server(url=args.url, out=args.out, **common)
        if args.plain_url:
            from sglang_hspec.scheduler.sps import save_sps_table

            plain_out = Path(args.out).with_name(Path(args.out).stem + ".plain.json")
            plain = profile_server(url=args.plain_url, out=plain_out, plot=False, anchor_only=True, **common)
            table = with_plain_probes(table, plain)
            save_sps_table(table, args.out)
            for n, s in zip(table.plain_batch_sizes, table.plain_steps_per_sec):
                print(f"{n:>7d} requests {s:10.2f} plain steps/s")
        for bt, s in zip(table.sample_batch_tokens, table.sample_steps_per_sec):
            print(f"{bt:>7d} tokens  {s:10.2f} steps/s")
        out = Path(args.out)
        print(f"wrote {out} and {out.with_suffix('.png')}; serve with --speculative-dspark-sps-table-path {out} "
              "and SGLANG_RAGGED_VERIFY_MODE=compact")
        return 0

    parser.set_defaults(func=run)


__all__ = ["GREEDY_TABLE_SUFFIX", "add_server_arguments", "default_batch_sizes", "greedy_table_path", "profile_server",
           "profile_with_server", "relaunch_argv", "with_plain_probes"]
