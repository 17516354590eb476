"""The one parser of the plugin's on/off environment variables (`HSPEC_LOOKUP`, `HSPEC_AUTO_PROFILE_SPS`,
`HSPEC_SPS_PROFILING_SERVER`, `HSPEC_SPECULATION_GUARD`): `1` or `0`, unset or blank for the default; any other
value (a typo such as `yes1`, or `true`) stops the launch naming the variable, both values and what each does,
instead of reading as off. Also `HSPEC_PLAIN_STEP_FORWARD`'s, which the worker reads, so that the launcher
checks it too (server_args.check_environment). Pure Python: no SGLang import."""

from __future__ import annotations

import os
from collections.abc import Mapping


def env_switch(name: str, environ: Mapping[str, str] | None = None, *, on: str, off: str,
               default: bool = False) -> bool:
    """Whether the on/off variable `name` is on in `environ` (default: this process's environment); `on` and
    `off` say what each value does, for the error."""
    raw = (os.environ if environ is None else environ).get(name, "").strip()
    if raw == "":
        return default
    if raw not in ("0", "1"):
        raise ValueError(f"{name}={raw!r}: use 1 ({on}) or 0 ({off}); unset, it is {int(default)}")
    return raw == "1"


FORWARD_ENV = "HSPEC_PLAIN_STEP_FORWARD"
FORWARDS = ("auto", "verify")


def plain_step_forward(environ: Mapping[str, str] | None = None) -> str:
    """The forward of steps without drafting from HSPEC_PLAIN_STEP_FORWARD (unset: auto)."""
    raw = (os.environ if environ is None else environ).get(FORWARD_ENV, "").strip().lower() or "auto"
    if raw not in FORWARDS:
        raise ValueError(f"{FORWARD_ENV}={raw!r} is not a forward of steps without drafting; use one of "
                         f"{', '.join(FORWARDS)} (auto: DECODE on CPU without CUDA graphs, else TARGET_VERIFY)")
    return raw


__all__ = ["FORWARDS", "FORWARD_ENV", "env_switch", "plain_step_forward"]
