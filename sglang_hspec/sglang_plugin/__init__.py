"""SGLang plugin: `python -m sglang.launch_server --speculative-algorithm HSPEC ...`.

SGLang's `load_plugins()` calls `register()` through the `sglang.srt.plugins` entry point (pyproject)
in the launcher, scheduler and detokenizer processes. Importing this package never imports SGLang, so
the rest of sglang_hspec works without the `sglang` extra; `register()` imports it lazily.
"""

from __future__ import annotations

import logging
from importlib import metadata

logger = logging.getLogger(__name__)

# The worker subclasses private DSpark internals of exactly this release.
SGLANG_VERSION = "0.5.23"
SGLANG_KERNEL_VERSION = "0.4.10"

_registered = False


def check_sglang_version() -> None:
    """Raise a clear error unless sglang==0.5.23 (and its sglang-kernel 0.4.10, when installed)."""
    try:
        found = metadata.version("sglang")
    except metadata.PackageNotFoundError as e:
        raise RuntimeError(f"the HSPEC plugin needs SGLang: pip install 'sglang-hspec[sglang]' "
                           f"(sglang=={SGLANG_VERSION})") from e
    if found != SGLANG_VERSION:
        raise RuntimeError(
            f"the HSPEC plugin supports sglang=={SGLANG_VERSION} only (it subclasses private DSpark "
            f"internals), found sglang {found}; pip install sglang=={SGLANG_VERSION}"
        )
    try:
        kernel = metadata.version("sglang-kernel")
    except metadata.PackageNotFoundError:
        return  # CPU / non-CUDA installs may lack it
    if kernel != SGLANG_KERNEL_VERSION:
        raise RuntimeError(
            f"sglang {SGLANG_VERSION} pins sglang-kernel=={SGLANG_KERNEL_VERSION}, found {kernel}; "
            f"pip install sglang-kernel=={SGLANG_KERNEL_VERSION}"
        )


def register() -> None:
    """Register `HSPEC` with SGLang. Idempotent within a process (SGLang loads plugins once per
    process, but in-process engines and tests may call it again)."""
    global _registered
    if _registered:
        return
    from .server_args import register_launch_checks

    register_launch_checks()  # first: a launch with HSPEC reports a wrong version itself (server_args.py)
    check_sglang_version()
    from .algo import register_algorithm
    from .hooks import install_hooks

    register_algorithm()
    install_hooks()  # the target reserves no drafter KV (hooks.py)
    from .sps_hooks import install as install_sps_hooks

    install_sps_hooks()  # SGLang's SPS profiler accepts HSPEC where it is imported (sps_hooks.py)
    from .planner_hooks import install as install_planner_hooks

    install_planner_hooks()  # HSPEC's verify budget and lengths come from sglang_hspec.scheduler (planner_hooks.py)
    _registered = True
    logger.info("sglang-hspec: speculative algorithm HSPEC registered")


__all__ = ["SGLANG_VERSION", "SGLANG_KERNEL_VERSION", "check_sglang_version", "register"]
