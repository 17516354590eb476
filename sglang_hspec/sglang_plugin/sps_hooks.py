"""HookRegistry hooks that let SGLang's own SPS profiler (`sglang.benchmark.dspark_sps_profiler`) measure an
HSPEC server (docs/architecture.md, "SGLang internals we hook").

The profiler reads DSpark's per-step records from `/server_info` (`SGLANG_DSPARK_ENABLE_SPS_RECORD=1`).
HSPEC's worker is DSpark's worker (`is_dspark()` is True), so an HSPEC server records the same steps; only
three client-side checks stand in the way, each relaxed here and nothing else:

- `fetch_server_context` demands `speculative_algorithm == "DSPARK"`: HSPEC is accepted too;
- it refuses `disable_cuda_graph`: a CPU server has no CUDA graphs to keep, so a CPU server passes (a GPU
  server without graphs is still refused, as SGLang intends);
- `start_load` draws random prompt ids from [1000, vocab - 1000), which is empty below 2001 ids: small
  vocabularies (test targets) draw from the middle three quarters instead;
- a server that never drafts (`HSPEC_SPECULATION=never`, profiled for the plain-decode probes) verifies
  one token per request, and the profiler refuses a round with fewer than requests x
  `speculative_num_draft_tokens` verify tokens: inside `anchor_only_profile()` the server reads as
  verifying 1 token per request, which is what it does.

The profiler module costs ~10 s to import, so `install()` registers the hooks only in a process that has
already imported it (the `hspec profile-sps --url` client and the launcher's auto-profile); server
processes never import it. Imports SGLang lazily.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any

PROFILER_MODULE = "sglang.benchmark.dspark_sps_profiler"
HSPEC_ALGORITHM = "HSPEC"
RECORD_PAYLOAD_KEY = "dspark_info_record"  # the profiler's INFO_RECORD_PAYLOAD_KEY: a rank's step-record state

_installed = False
_anchor_only = False  # inside anchor_only_profile(): the profiled server verifies the anchor only


@contextlib.contextmanager
def anchor_only_profile():
    """Profile a server that never drafts: its steps verify 1 token per request (the anchor), so the
    profiler must expect requests x 1 verify tokens, and files a probe of N requests under N tokens."""
    global _anchor_only
    saved, _anchor_only = _anchor_only, True
    try:
        yield
    finally:
        _anchor_only = saved


def server_info_for_profiler(info: dict[str, Any], *, anchor_only: bool | None = None) -> dict[str, Any]:
    """`/server_info` as SGLang's profiler should judge it: HSPEC runs DSpark's verify and step records,
    so it reads as DSPARK; on CPU there are no CUDA graphs to require; a never-drafting server
    (`anchor_only`, default: inside `anchor_only_profile()`) verifies 1 token per request."""
    out = dict(info)
    if str(out.get("speculative_algorithm") or "").upper() == HSPEC_ALGORITHM:
        out["speculative_algorithm"] = "DSPARK"
    if _anchor_only if anchor_only is None else anchor_only:
        out["speculative_num_draft_tokens"] = 1
        states = []  # the profiler reads the width from each rank's step-record payload
        for state in out.get("internal_states") or []:
            state = dict(state)
            if isinstance(state.get(RECORD_PAYLOAD_KEY), dict):
                state[RECORD_PAYLOAD_KEY] = {**state[RECORD_PAYLOAD_KEY], "verify_num_draft_tokens": 1}
            states.append(state)
        if states:
            out["internal_states"] = states
    if str(out.get("device") or "").startswith("cpu"):
        out["disable_cuda_graph"] = False
        # No graphs on CPU: every batch size runs the same eager path, so the sweep's bound is the running
        # cap, not a captured graph size (SGLang may still report its default capture list).
        states = []
        for state in out.get("internal_states") or []:
            state = dict(state)
            cap = state.get("effective_max_running_requests_per_dp")
            if isinstance(cap, int) and cap > 0:
                state["cuda_graph_config"] = {"decode": {"max_bs": cap}}
            states.append(state)
        if states:
            out["internal_states"] = states
    return out


def prompt_id_range(vocab_size: int, low: int, high_margin: int) -> tuple[int, int]:
    """(low, high_margin) for the profiler's random prompt ids: SGLang's own when they leave a range,
    else the middle three quarters of the vocabulary."""
    if vocab_size - high_margin > low:
        return low, high_margin
    if vocab_size < 8:
        raise ValueError(f"vocab_size={vocab_size} is too small to draw random profiling prompts")
    return vocab_size // 8, vocab_size // 8


class _Response:
    def __init__(self, response):
        self._response = response

    def __getattr__(self, name):
        return getattr(self._response, name)

    def json(self, *args, **kwargs):
        return server_info_for_profiler(self._response.json(*args, **kwargs))


class _Requests:
    """The `requests` module as `fetch_server_context` sees it: `/server_info` answers go through
    `server_info_for_profiler`."""

    def __init__(self, requests_module):
        self._requests = requests_module

    def __getattr__(self, name):
        return getattr(self._requests, name)

    def get(self, url, *args, **kwargs):
        response = self._requests.get(url, *args, **kwargs)
        return _Response(response) if str(url).rstrip("/").endswith("/server_info") else response


def fetch_server_context_around(original, *args, **kwargs):
    module = sys.modules[PROFILER_MODULE]
    real = module.requests
    module.requests = _Requests(real)  # only for this call (once per profile, before the load threads)
    try:
        return original(*args, **kwargs)
    finally:
        module.requests = real


def start_load_around(original, *args, **kwargs):
    module = sys.modules[PROFILER_MODULE]
    saved = module.RANDOM_TOKEN_LOW, module.RANDOM_TOKEN_HIGH_MARGIN
    low, margin = prompt_id_range(int(kwargs["vocab_size"]), *saved)
    module.RANDOM_TOKEN_LOW, module.RANDOM_TOKEN_HIGH_MARGIN = low, margin
    try:
        return original(*args, **kwargs)  # draws the prompts before it returns; the POST runs in a thread
    finally:
        module.RANDOM_TOKEN_LOW, module.RANDOM_TOKEN_HIGH_MARGIN = saved


HOOKS = (("fetch_server_context", fetch_server_context_around), ("start_load", start_load_around))


def install() -> bool:
    """Register the AROUND hooks when SGLang's profiler is imported in this process (idempotent); the
    caller (`load_plugins()`, or `apply()`) applies them. Returns whether they are registered."""
    global _installed
    if _installed:
        return True
    if PROFILER_MODULE not in sys.modules:
        return False
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for name, hook in HOOKS:
        HookRegistry.register(f"{PROFILER_MODULE}.{name}", hook, HookType.AROUND)
    _installed = True
    return True


def apply():
    """Import SGLang's profiler, install and apply the hooks; returns the profiler module."""
    import importlib

    module = importlib.import_module(PROFILER_MODULE)
    install()
    from sglang.srt.plugins.hook_registry import HookRegistry

    HookRegistry.apply_hooks()  # already-patched targets are skipped
    return module


__all__ = ["PROFILER_MODULE", "anchor_only_profile", "apply", "install", "prompt_id_range", "server_info_for_profiler"]
