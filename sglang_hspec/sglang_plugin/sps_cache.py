"""Which SPS table an HSPEC server uses, and the per-machine cache of auto-profiled tables.

`resolve_sps_table` runs in the launcher from `handle_server_args`, before any server process starts:

- `--speculative-dspark-sps-table-path` given: it is checked with our strict loader and used;
- none, and `HSPEC_AUTO_PROFILE_SPS=1`: the table cached for (device name, target model, drafter, TP size,
  dtype) under `$HSPEC_CACHE_DIR/sps` (default `~/.cache/sglang-hspec/sps`) is used; when there is none,
  a short-lived profiling server with the same arguments is measured once with SGLang's own profiler
  (`sps_profile.profile_with_server`), the table is cached and used;
- none and no auto-profile: a WARNING says that every request verifies its full block and how to get a
  table. Never silent.

With `HSPEC_SPECULATION=auto` (speculation_policy.py) the table must also carry plain-decode probes: the
auto-profile then measures a second, never-drafting profiling server (`profile_with_server(plain_probes=
True)`), a cached table without them is re-profiled, and a given one without them, a non-compact mode or
no table at all stop the launch with the fix. The auto-profile of `auto` also measures the drafting server at
temperature 0 into the table's greedy twin (`sps_profile.greedy_table_path`, `<stem>.greedy.json`): argmax
drafting skips the sampled draft's noise, so the switch costs all-greedy steps by it (worker.py, `step_costs`);
a cached table without its twin is re-profiled; a given table's twin is used where it exists beside it.

The table reaches SGLang's planner as `speculative_dspark_sps_table_path` (a declared server-argument write).
No SGLang import here: the key and path logic is unit-tested anywhere.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from sglang_hspec.core.atomic import atomic_write_text
from sglang_hspec.target.dtypes import cpu_model

from . import sps_profile  # one way: sps_profile never imports this module
from .env import env_switch
from .speculation_policy import POLICY_ENV, speculation_policy

logger = logging.getLogger(__name__)

AUTO_PROFILE_ENV = "HSPEC_AUTO_PROFILE_SPS"
BATCH_SIZES_ENV = "HSPEC_AUTO_PROFILE_SPS_BATCH_SIZES"  # e.g. "1,2,4,8"; default: up to the server's capacity
STEADY_STEPS_ENV = "HSPEC_AUTO_PROFILE_SPS_STEADY_STEPS"
STEADY_SECONDS_ENV = "HSPEC_AUTO_PROFILE_SPS_STEADY_SECONDS"
RAGGED_MODE_ENV = "SGLANG_RAGGED_VERIFY_MODE"
SCHEDULED_MODES = ("compact", "cap-accept")  # SGLang's modes whose planner reads the SPS table
CACHE_SUBDIR = "sps"

# What a user runs by hand; printed in the warnings.
PROFILE_COMMAND = (
    "launch the server once with SGLANG_RAGGED_VERIFY_MODE=static SGLANG_DSPARK_ENABLE_SPS_RECORD=1 "
    "SGLANG_SIMULATE_ACC_LEN=1.0, run `hspec profile-sps --url http://HOST:PORT --out sps.json`, then "
    "serve with --speculative-dspark-sps-table-path sps.json"
)


def auto_profile_enabled(environ: dict[str, str] | None = None) -> bool:
    """`HSPEC_AUTO_PROFILE_SPS`: 1 profiles (and caches) a table at startup where none is given; 0 or unset
    does not."""
    return env_switch(AUTO_PROFILE_ENV, environ, on="profile an SPS table once at startup and cache it",
                      off="do not profile; serve with the given table, or none")


def is_profiling_server(environ: dict[str, str] | None = None) -> bool:
    """`HSPEC_SPS_PROFILING_SERVER`: set to 1 by the auto-profile on its own short-lived measuring server."""
    return env_switch(sps_profile.PROFILING_SERVER_ENV, environ,
                      on="this is the auto-profile's measuring server: no table of its own",
                      off="a serving server; leave it unset")


def sps_cache_dir() -> Path:
    """`$HSPEC_CACHE_DIR/sps`, else `~/.cache/sglang-hspec/sps`."""
    from sglang_hspec.assets.embedded import default_cache_dir

    return default_cache_dir() / CACHE_SUBDIR


def model_identity(path: str | os.PathLike | None) -> str:
    """A local checkpoint by its absolute path, a hub id as given."""
    if path is None:
        return ""
    p = Path(path).expanduser()
    return str(p.resolve()) if p.exists() else str(path)


def drafter_identity(path: str | os.PathLike | None) -> str:
    """A local drafter by its architecture (a digest of its config.json): what a step's time depends on. Copies
    of one drafter share a table; a drafter with another config.json at the same path does not reuse it."""
    if path is None:
        return ""
    config = Path(path).expanduser() / "config.json"
    if config.is_file():
        return "config sha256 " + hashlib.sha256(config.read_bytes()).hexdigest()[:16]
    return model_identity(path)


def device_name(device: str | None, gpu_id: int = 0) -> str:
    """The accelerator's marketing name (`NVIDIA H200`), or `cpu <model name>` on CPU."""
    kind = (device or "").split(":")[0]
    if kind in ("", "cuda"):
        try:
            import torch

            if torch.cuda.is_available():
                return torch.cuda.get_device_name(int(gpu_id or 0))
        except Exception as exc:  # a broken driver must not stop the server: the key just says so
            logger.debug("no CUDA device name (%s)", exc)
        if kind == "cuda":
            return "cuda unknown"
    if kind in ("", "cpu"):
        return f"cpu {cpu_model()}"
    return kind


@dataclass(frozen=True)
class SpsCacheKey:
    """What a measured SPS table depends on. The step time includes the drafter's forward, so the
    drafter's architecture is part of the key (`drafter_identity`)."""

    device_name: str
    model: str
    draft_model: str
    tp_size: int
    dtype: str

    @classmethod
    def from_server_args(cls, server_args: Any) -> SpsCacheKey:
        get = lambda name, default=None: getattr(server_args, name, default)  # noqa: E731
        return cls(
            device_name=device_name(get("device"), get("base_gpu_id", 0) or 0),
            model=model_identity(get("model_path")),
            draft_model=drafter_identity(get("speculative_draft_model_path")),
            tp_size=int(get("tp_size", 1) or 1),
            dtype=str(get("dtype", "auto") or "auto"),
        )

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()

    def file_name(self) -> str:
        """`<device>__<model>__tp<N>__<dtype>-<hash12>.json`: readable, and unique by the full key."""
        def slug(text: str) -> str:
            return re.sub(r"[^A-Za-z0-9.]+", "-", text).strip("-")[:40] or "x"

        model = Path(self.model.rstrip("/")).name or self.model
        return (f"{slug(self.device_name)}__{slug(model)}__tp{self.tp_size}__{slug(self.dtype)}"
                f"-{self.digest()[:12]}.json")


def table_path_for(key: SpsCacheKey, cache_dir: str | os.PathLike | None = None) -> Path:
    """Where the table for `key` lives (a sidecar `<name>.key.json` records the key in full)."""
    return (Path(cache_dir) if cache_dir is not None else sps_cache_dir()) / key.file_name()


def key_sidecar(table_path: Path) -> Path:
    return table_path.with_name(table_path.stem + ".key.json")


def _int_list(text: str, name: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise ValueError(f"{name}={text!r}: expected comma-separated request counts >= 1, e.g. 1,2,4,8")
    return values


def _number(text: str, cast):
    try:
        return cast(text)
    except ValueError:
        return None


def auto_profile_settings(environ: dict[str, str] | None = None) -> dict[str, Any]:
    """The auto-profile's small grid: keyword arguments for `sps_profile.profile_server`."""
    env = os.environ if environ is None else environ
    out: dict[str, Any] = {"min_steady_steps": 16, "min_steady_seconds": 2.0}
    if env.get(BATCH_SIZES_ENV, "").strip():
        out["batch_sizes"] = _int_list(env[BATCH_SIZES_ENV], BATCH_SIZES_ENV)
    if env.get(STEADY_STEPS_ENV, "").strip():
        raw = env[STEADY_STEPS_ENV]
        steps = _number(raw, int)
        if steps is None or steps < 1:
            raise ValueError(f"{STEADY_STEPS_ENV}={raw!r}: expected an integer >= 1 (decode steps each probe "
                             "measures at steady state), e.g. 16; unset, it is 16")
        out["min_steady_steps"] = steps
    if env.get(STEADY_SECONDS_ENV, "").strip():
        raw = env[STEADY_SECONDS_ENV]
        seconds = _number(raw, float)
        if seconds is None or not (math.isfinite(seconds) and seconds >= 0):  # nan and inf would never end a probe
            raise ValueError(f"{STEADY_SECONDS_ENV}={raw!r}: expected a finite number of seconds >= 0 (the least "
                             "steady-state time each probe measures; 0: steps only), e.g. 2; unset, it is 2")
        out["min_steady_seconds"] = seconds
    return out


def no_table_warning(*, mode: str, block_size: int | None, auto_profile: bool) -> str:
    block = f"its full block of {block_size} draft tokens" if block_size else "its full draft block"
    if mode not in SCHEDULED_MODES:
        why = (f"{RAGGED_MODE_ENV}={mode}: every request verifies {block} (fixed k); the SPS table only "
               f"feeds the prefix scheduler of {RAGGED_MODE_ENV}=compact (or cap-accept).")
        if auto_profile:
            return (f"HSPEC: {why} {AUTO_PROFILE_ENV}=1 is ignored in {mode} mode. To schedule per-request "
                    f"verify lengths, serve with {RAGGED_MODE_ENV}=compact.")
        return (f"HSPEC: {why} To schedule per-request verify lengths, serve with {RAGGED_MODE_ENV}=compact "
                f"and an SPS table: set {AUTO_PROFILE_ENV}=1 (profiled once, cached under {sps_cache_dir()}), "
                f"or {PROFILE_COMMAND}.")
    return (f"HSPEC: no SPS table (--speculative-dspark-sps-table-path): the verify planner sees a flat cost "
            f"curve, so every request verifies {block} (fixed k) and the prefix scheduler gains nothing. Get "
            f"a table: set {AUTO_PROFILE_ENV}=1 (profiled once at startup, cached under {sps_cache_dir()}), "
            f"or {PROFILE_COMMAND}.")


def _check_table(path: str | os.PathLike, *, need_plain: bool = False) -> None:
    from sglang_hspec.scheduler import load_sps_table

    table = load_sps_table(path)  # ValueError naming the field and the fix
    if table.uninitialised:
        raise ValueError(f"SPS table {path} is SGLang's one-probe placeholder (a flat curve): the planner "
                         "would verify every block in full; profile a real table (hspec profile-sps --url)")
    if need_plain and not getattr(table, "has_plain", False):
        raise ValueError(f"SPS table {path} has no plain-decode probes (plain_batch_sizes), which "
                         f"{POLICY_ENV}=auto weighs speculation against: profile one with {AUTO_PROFILE_ENV}=1 "
                         f"(it measures both), or `hspec profile-sps --url ... --plain-url ...`")


def check_speculation_policy(*, policy: str, mode: str, has_table: bool, auto_profile: bool) -> None:
    """Launch check of `HSPEC_SPECULATION=auto`: it needs compact verify (confidences and anchor-only
    layouts) and a table with plain-decode probes (given, or auto-profiled)."""
    if policy != "auto":
        return
    if mode != "compact":
        raise ValueError(f"{POLICY_ENV}=auto skips the drafter where plain decoding is faster, which needs "
                         f"{RAGGED_MODE_ENV}=compact (got {mode!r}): set {RAGGED_MODE_ENV}=compact")
    if not has_table and not auto_profile:
        raise ValueError(f"{POLICY_ENV}=auto needs this server's step costs: set {AUTO_PROFILE_ENV}=1 (profiled "
                         f"once, with plain-decode probes, cached under {sps_cache_dir()}) or pass "
                         "--speculative-dspark-sps-table-path with a table from `hspec profile-sps --url ... "
                         "--plain-url ...`")


def resolve_sps_table(server_args: Any, *, block_size: int | None = None,
                      environ: dict[str, str] | None = None) -> Path | None:
    """Decide the server's SPS table (module docstring); sets `server_args.speculative_dspark_sps_table_path`
    when a cached or freshly profiled table is used. Returns the table path, or None."""
    env = os.environ if environ is None else environ
    if is_profiling_server(env):
        return None  # this is the auto-profile's own measuring server
    given = getattr(server_args, "speculative_dspark_sps_table_path", None)
    mode = env.get(RAGGED_MODE_ENV, "static").strip() or "static"
    auto = auto_profile_enabled(env)
    settings = auto_profile_settings(env)  # a bad value stops the launch here, not inside the profile's try
    policy = speculation_policy(env)
    check_speculation_policy(policy=policy, mode=mode, has_table=bool(given), auto_profile=auto)
    need_plain = policy == "auto"
    if given:
        _check_table(given, need_plain=need_plain)
        logger.info("HSPEC: SPS table %s (--speculative-dspark-sps-table-path)", given)
        return Path(given)
    if not auto or mode not in SCHEDULED_MODES:
        logger.warning(no_table_warning(mode=mode, block_size=block_size, auto_profile=auto))
        return None
    key = SpsCacheKey.from_server_args(server_args)
    path = table_path_for(key)
    if path.is_file():
        try:
            _check_table(path, need_plain=need_plain)
            if need_plain:  # auto costs all-greedy steps by the greedy twin
                twin = sps_profile.greedy_table_path(path)
                if not twin.is_file():
                    raise ValueError(f"no greedy twin {twin.name} (profiled before the switch costed argmax drafts)")
                _check_table(twin, need_plain=True)
        except ValueError as e:
            logger.warning("HSPEC: cached SPS table %s is unusable (%s); profiling a new one", path, e)
        else:
            logger.info("HSPEC: reusing cached SPS table %s (%s)", path, key)
            server_args.speculative_dspark_sps_table_path = str(path)
            return path

    logger.warning("HSPEC: %s=1 and no cached SPS table for %s: profiling once with a short-lived server "
                   "(this start takes longer; later starts reuse %s)", AUTO_PROFILE_ENV, key, path)
    try:
        sps_profile.profile_with_server(out=path, settings=settings, plain_probes=need_plain,
                                        greedy_probes=need_plain)
    except Exception as e:  # the server still starts, without a table, and says so
        if need_plain:
            raise RuntimeError(f"HSPEC: SPS auto-profile failed ({e}); {POLICY_ENV}=auto cannot run without "
                               "the step costs it measures") from e
        logger.error("HSPEC: SPS auto-profile failed (%s). %s", e,
                     no_table_warning(mode=mode, block_size=block_size, auto_profile=False))
        return None
    atomic_write_text(key_sidecar(path), json.dumps(asdict(key), indent=2) + "\n")
    logger.info("HSPEC: profiled SPS table cached at %s", path)
    server_args.speculative_dspark_sps_table_path = str(path)
    return path


__all__ = [
    "AUTO_PROFILE_ENV", "SpsCacheKey", "auto_profile_enabled", "auto_profile_settings", "check_speculation_policy",
    "device_name", "is_profiling_server", "model_identity", "no_table_warning", "resolve_sps_table", "sps_cache_dir",
    "table_path_for",
]
