"""The one parser of the plugin's on/off environment variables (`HSPEC_LOOKUP`, `HSPEC_AUTO_PROFILE_SPS`,
`HSPEC_SPS_PROFILING_SERVER`, `HSPEC_SPECULATION_GUARD`): `1` or `0`, unset or blank for the default; any other
value (a typo such as `yes1`, or `true`) stops the launch naming the variable, both values and what each does,
instead of reading as off. Pure Python: no SGLang import."""

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


__all__ = ["env_switch"]
