"""Fixtures for the SGLang plugin tests: tiny checkpoints and loopback CPU servers.

Tests that need SGLang are marked `sglang` and skip (with the reason) when it is not importable in
the test interpreter; run them with the SGLang environment, e.g.
`.venv-sglang/bin/python -m pytest tests/sglang_plugin`.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

TESTS_DIR = Path(__file__).resolve().parents[1]
if str(TESTS_DIR) not in sys.path:
    sys.path.insert(0, str(TESTS_DIR))  # the CPU tier package: tests/sglang_cpu

HAS_SGLANG = importlib.util.find_spec("sglang") is not None
SKIP_NO_SGLANG = "sglang is not installed in this interpreter (pip install 'sglang-hspec[sglang]')"


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason=SKIP_NO_SGLANG)
    for item in items:
        if "sglang" in item.keywords and not HAS_SGLANG:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory):
    """Tiny Qwen3 target, random, bigram and exported (ours -> SGLang layout) DSpark drafts (built once)."""
    from sglang_cpu import builders

    root = tmp_path_factory.mktemp("sglang_tiny")
    target = builders.build_tiny_target(root / "target")
    return {
        "target": target,
        # the same target with its LM head x8: temperature 1 samples what `target` samples at 1/8 (peaked), so
        # sampling tests run at temperature 1 with drafts that are accepted (builders.build_tiny_target)
        "target_x8": builders.build_tiny_target(root / "target_x8", logit_scale=8),
        "dspark": builders.build_dspark_draft(root / "dspark", target),
        "bigram": builders.build_bigram_draft(root / "bigram", target),
        # our dspark baseline exported to SGLang's DSpark layout (sglang_plugin/export_dspark.py)
        "dspark_exported": builders.build_exported_dspark_draft(root / "dspark_exported", target),
    }


@pytest.fixture(scope="session")
def tiny_hspec_pair(tmp_path_factory):
    """(tiny Qwen3 target, a random H-Spec drafter for it): the parallelism tests' checkpoints (built once)."""
    from sglang_cpu import builders

    root = tmp_path_factory.mktemp("sglang_hspec_pair")
    target = builders.build_tiny_target(root / "target")
    return target, builders.build_hspec_draft(root / "hspec", target)


@pytest.fixture
def sglang_server(tmp_path):
    """Factory: `sglang_server(model_path, args=[...])` starts a CPU server on a free loopback port and
    waits until it is healthy (`max_total_tokens=None`: SGLang sizes the KV pool from its budget); every
    server it started is stopped at teardown (process group SIGTERM, then SIGKILL), and its log is printed
    on failure."""
    from sglang_cpu import server as cpu_server

    started = []

    def launch(model_path, *, args=(), plugins=(cpu_server.CPU_PLUGIN_ENTRY,), env_extra=None, name="server",
               max_total_tokens=4096, dtype="float32"):
        srv = cpu_server.launch(model_path, log_path=tmp_path / f"{name}.log", args=list(args),
                                plugins=tuple(plugins), env_extra=env_extra, max_total_tokens=max_total_tokens,
                                dtype=dtype)
        started.append(srv)
        return srv

    yield launch
    for srv in started:
        srv.stop()
