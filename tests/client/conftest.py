from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
from fake_sglang import Behaviour, FakeSGLangServer


@pytest.fixture
def behaviour() -> Behaviour:
    return Behaviour()


@pytest.fixture
def fake_server(behaviour: Behaviour):
    with FakeSGLangServer(behaviour) as server:
        yield server


@pytest.fixture(scope="module")
def real_sglang_url(tmp_path_factory: pytest.TempPathFactory):
    """A real SGLang 0.5.23 server on CPU (the tests/sglang_cpu tier): the tiny Qwen3 target with a
    speculative DSPARK bigram draft, float32, on a free loopback port; stopped after the module."""
    if importlib.util.find_spec("sglang") is None:
        pytest.skip("sglang is not installed in this interpreter: run with the SGLang environment "
                    "(make test-sglang, or .venv-sglang/bin/python -m pytest tests/client -m sglang)")
    tests_dir = Path(__file__).resolve().parents[1]
    if str(tests_dir) not in sys.path:
        sys.path.insert(0, str(tests_dir))
    from sglang_cpu import builders
    from sglang_cpu import server as cpu_server

    root = tmp_path_factory.mktemp("client_real")
    target = builders.build_tiny_target(root / "target")
    draft = builders.build_bigram_draft(root / "bigram", target)
    srv = cpu_server.launch(target, log_path=root / "server.log", plugins=(cpu_server.CPU_PLUGIN_ENTRY,),
                            args=["--speculative-algorithm", "DSPARK", "--speculative-draft-model-path", str(draft)])
    try:
        yield srv.url
    finally:
        srv.stop()
