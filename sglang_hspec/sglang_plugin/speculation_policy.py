"""`HSPEC_SPECULATION`: whether an HSPEC server drafts on every decode step (no SGLang import).

- `always` (default): every decode step drafts, as SGLang's DSpark worker does;
- `auto`: the worker skips the drafter on steps where plain decoding is expected to commit more tokens per
  second (`sglang_hspec.scheduler.switch.decide_speculation` over stale confidences and the server's SPS
  table with plain-decode probes), probing while off (speculation_switch.py); needs
  SGLANG_RAGGED_VERIFY_MODE=compact and such a table (`HSPEC_AUTO_PROFILE_SPS=1` profiles one);
- `never`: no step drafts (anchor-only verify): what the auto-profile measures plain decode steps with.

`HSPEC_SPECULATION_GUARD` (auto only; `1`, the default, or `0`): correct the switch's predicted rates by the
rates the server realizes (`sglang_hspec.scheduler.switch.RateGuard`); `0` trusts the table and the stale
estimates alone (for side-by-side benchmarks of the guard).

Read in the launcher (launch checks: sps_cache.py) and in the scheduler process (the worker); set it in the
launcher's environment, which the scheduler inherits.
"""

from __future__ import annotations

import os

from .env import env_switch

POLICY_ENV = "HSPEC_SPECULATION"
POLICIES = ("always", "auto", "never")
GUARD_ENV = "HSPEC_SPECULATION_GUARD"


def speculation_policy(environ=None) -> str:
    """The policy in `environ` (default: this process's); a bad value names the variable and the choices."""
    env = os.environ if environ is None else environ
    raw = env.get(POLICY_ENV)
    value = (raw or "always").strip().lower()
    if value not in POLICIES:
        raise ValueError(f"{POLICY_ENV}={raw!r} is not a speculation policy; use one of {', '.join(POLICIES)} "
                         "(auto: skip the drafter on steps where plain decoding is faster)")
    return value


def speculation_guard(environ=None) -> bool:
    """Whether `auto` audits its realized rates (`HSPEC_SPECULATION_GUARD`, default on)."""
    return env_switch(GUARD_ENV, environ, default=True, on="correct the auto switch by the rates this server realizes",
                      off="trust the SPS table and the stale estimates alone")


__all__ = ["GUARD_ENV", "POLICIES", "POLICY_ENV", "speculation_guard", "speculation_policy"]
