from __future__ import annotations

import pytest
from fake_sglang import Behaviour, FakeSGLangServer


@pytest.fixture
def behaviour() -> Behaviour:
    return Behaviour()


@pytest.fixture
def fake_server(behaviour: Behaviour):
    with FakeSGLangServer(behaviour) as server:
        yield server


@pytest.fixture
def real_sglang_url(request: pytest.FixtureRequest) -> str:
    """Base URL of the real SGLang server that the CPU tier's ``sglang_server`` fixture launches."""
    try:
        server = request.getfixturevalue("sglang_server")
    except pytest.FixtureLookupError:
        pytest.skip(
            "needs the `sglang_server` fixture of the SGLang CPU tier (tests/sglang_cpu), which is not "
            "available here; install the `sglang` extra and run with that tier's conftest loaded"
        )
    if isinstance(server, str):
        return server
    for attr in ("url", "base_url"):
        if isinstance(getattr(server, attr, None), str):
            return getattr(server, attr)
    raise TypeError(f"sglang_server fixture gave {server!r}; expected a URL string or an object with .url")
