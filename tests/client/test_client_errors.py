"""Error paths against a real loopback server that refuses, fails, garbles or stalls."""

from __future__ import annotations

import asyncio
import socket

import pytest
from fake_sglang import Behaviour, FakeSGLangServer, start_listening_later

from sglang_hspec.client import (
    AsyncHSpecClient,
    HSpecClient,
    MalformedResponseError,
    RequestTimeoutError,
    ServerHTTPError,
    ServerUnavailableError,
)

MSG = [{"role": "user", "content": "hi"}]


@pytest.fixture
def closed_port():
    # Bound but never listening: the kernel refuses connections, and no other process can take it.
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]


def _all_calls(client: HSpecClient):
    return {
        "generate": lambda: client.generate("Hello world", max_new_tokens=4),
        "generate_stream": lambda: list(client.generate_stream("Hello world", max_new_tokens=4)),
        "chat": lambda: client.chat(MSG, max_tokens=4),
        "chat_stream": lambda: list(client.chat_stream(MSG, max_tokens=4)),
        "server_info": client.server_info,
    }


def test_connection_refused_names_the_url_and_the_fix(closed_port: int) -> None:
    url = f"http://127.0.0.1:{closed_port}"
    with HSpecClient(url, retries=1) as client:
        for name, call in _all_calls(client).items():
            with pytest.raises(ServerUnavailableError) as info:
                call()
            assert url in str(info.value), name
            assert "launch_server" in str(info.value) and "after 1 retries" in str(info.value), name
        assert client.health() is False


def test_connection_refused_async(closed_port: int) -> None:
    url = f"http://127.0.0.1:{closed_port}"

    async def run():
        async with AsyncHSpecClient(url, retries=0) as client:
            with pytest.raises(ServerUnavailableError, match="cannot connect"):
                await client.generate("x")
            with pytest.raises(ServerUnavailableError, match="cannot connect"):
                [c async for c in client.chat_stream(MSG)]
            assert await client.health() is False

    asyncio.run(run())


def test_connection_errors_are_retried_until_the_server_listens() -> None:
    # httpx retries refused connects with backoff 0 s, 0.5 s, 1 s, ...: listening after 0.2 s is
    # reached by the third attempt, well inside retries=4.
    with FakeSGLangServer(listen=False) as server:
        start_listening_later(server, 0.2)
        with HSpecClient(server.url, retries=4) as client:
            r = client.generate("Hello world", max_new_tokens=3, ignore_eos=True)
        assert r.completion_tokens == 3
        assert len(server.behaviour.requests) == 1  # retried connects, not a repeated generation


def test_no_retries_fails_at_once_on_refusal() -> None:
    with FakeSGLangServer(listen=False) as server:
        with HSpecClient(server.url, retries=0) as client:
            with pytest.raises(ServerUnavailableError):
                client.generate("Hello world", max_new_tokens=3)


def test_http_500_keeps_status_and_server_message() -> None:
    with FakeSGLangServer(Behaviour(mode="http500")) as server, HSpecClient(server.url) as client:
        for name, call in _all_calls(client).items():
            if name == "server_info":
                continue  # GETs are served normally
            with pytest.raises(ServerHTTPError) as info:
                call()
            assert info.value.status_code == 500, name
            assert "HTTP 500: CUDA error: device-side assert" in str(info.value), name
            assert '"error"' in info.value.body


def test_http_404_for_a_wrong_path_is_an_http_error() -> None:
    with FakeSGLangServer() as server, HSpecClient(server.url + "/v2") as client:
        with pytest.raises(ServerHTTPError, match="HTTP 404: Not Found") as info:
            client.generate("x")
    assert info.value.status_code == 404


def test_malformed_json_is_quoted_in_the_error() -> None:
    with FakeSGLangServer(Behaviour(mode="malformed")) as server, HSpecClient(server.url) as client:
        with pytest.raises(MalformedResponseError, match="not valid JSON.*half a respo"):
            client.generate("x")
        with pytest.raises(MalformedResponseError, match="not valid JSON"):
            client.chat(MSG)
        with pytest.raises(MalformedResponseError):
            list(client.generate_stream("x"))


def test_wrong_shape_is_a_malformed_response(fake_server: FakeSGLangServer) -> None:
    # A chat body on /generate's parser (and vice versa) is valid JSON of the wrong shape.
    from sglang_hspec.client.types import parse_chat, parse_generate

    with pytest.raises(MalformedResponseError, match="meta_info"):
        parse_generate({"text": "hi"}, client_latency_s=1.0)
    with pytest.raises(MalformedResponseError, match="batch"):
        parse_generate([{"text": "hi"}], client_latency_s=1.0)
    with pytest.raises(MalformedResponseError, match="no choices"):
        parse_chat({"id": "a", "model": "m", "choices": [], "usage": {}}, client_latency_s=1.0)
    with pytest.raises(MalformedResponseError, match="completion_tokens"):
        parse_generate(
            {"text": "", "meta_info": {"id": "a", "prompt_tokens": 1, "completion_tokens": "many"}},
            client_latency_s=1.0,
        )


def test_stall_past_the_timeout_raises_a_timeout() -> None:
    with FakeSGLangServer(Behaviour(mode="stall", stall_s=3.0)) as server:
        with HSpecClient(server.url, timeout=0.3) as client:
            with pytest.raises(RequestTimeoutError, match=r"no data from the server for 0\.3 s"):
                client.generate("x")
            with pytest.raises(RequestTimeoutError):
                list(client.chat_stream(MSG))


def test_stall_mid_stream_raises_a_timeout_after_partial_output() -> None:
    with FakeSGLangServer(Behaviour(mode="stall_mid_stream", stall_s=3.0)) as server:
        with HSpecClient(server.url, timeout=0.3) as client:
            received = []
            with pytest.raises(RequestTimeoutError):
                for chunk in client.generate_stream("Hello world", max_new_tokens=8, ignore_eos=True):
                    received.append(chunk)
            assert len(received) == 1 and len(received[0].output_ids_delta) == 1

    async def run():
        with FakeSGLangServer(Behaviour(mode="stall_mid_stream", stall_s=3.0)) as server:
            async with AsyncHSpecClient(server.url, timeout=0.3) as client:
                with pytest.raises(RequestTimeoutError):
                    [c async for c in client.generate_stream("Hello world", max_new_tokens=8)]

    asyncio.run(run())


def test_connection_dropped_mid_stream() -> None:
    with FakeSGLangServer(Behaviour(mode="drop_mid_stream")) as server, HSpecClient(server.url) as client:
        with pytest.raises(ServerUnavailableError, match="dropped the connection"):
            list(client.generate_stream("Hello world", max_new_tokens=8, ignore_eos=True))


def test_stream_without_a_final_event_is_malformed() -> None:
    with FakeSGLangServer(Behaviour(mode="no_final")) as server, HSpecClient(server.url) as client:
        with pytest.raises(MalformedResponseError, match="before the final event"):
            list(client.generate_stream("Hello world", max_new_tokens=8, ignore_eos=True))


def test_error_object_inside_a_stream() -> None:
    with FakeSGLangServer(Behaviour(mode="stream_error")) as server, HSpecClient(server.url) as client:
        with pytest.raises(ServerHTTPError, match="error inside the stream: boom") as info:
            list(client.generate_stream("Hello world", max_new_tokens=8, ignore_eos=True))
    assert info.value.status_code == 400


# -- a server process killed while answering ---------------------------------------------------------

# The most a killed server may cost a call: the kernel closes the dead process's sockets at once, so the
# client sees the connection end (or refused) and must not wait for its 60 s data timeout.
KILLED_SERVER_BOUND_S = 5.0
# Serves fake_sglang in its own process, held mid-answer for 60 s, and prints its URL once listening.
_FAKE_SERVER_PROCESS = (
    "import sys, time; sys.path.insert(0, sys.argv[1]);"
    "from fake_sglang import Behaviour, FakeSGLangServer;"
    "server = FakeSGLangServer(Behaviour(mode=sys.argv[2], stall_s=60.0));"
    "print(server.url, flush=True); time.sleep(600)"
)


@pytest.fixture
def killable_server():
    """Factory: `killable_server(mode)` starts a fake SGLang server process that holds every answer (mode
    "stall": before the first byte; "stall_mid_stream": after a stream's first event); returns
    (url, kill), where kill() SIGKILLs the process and waits for it."""
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    procs = []

    def start(mode: str):
        proc = subprocess.Popen([sys.executable, "-c", _FAKE_SERVER_PROCESS, str(Path(__file__).parent), mode],
                                stdout=subprocess.PIPE, text=True)
        procs.append(proc)
        url = proc.stdout.readline().strip()
        assert url.startswith("http://127.0.0.1:"), url

        def kill() -> None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)

        return url, kill

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


def _raises_within(call, error: type[Exception], bound_s: float) -> Exception:
    """Run `call` in a thread; it must raise `error` within `bound_s` (a hang fails the test, not the run)."""
    import threading

    outcome: dict[str, object] = {}

    def run() -> None:
        try:
            outcome["returned"] = call()
        except BaseException as exc:  # noqa: BLE001 - the test inspects what was raised
            outcome["raised"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(bound_s)
    assert not thread.is_alive(), f"the call still hangs {bound_s:g} s after the server was killed"
    assert "raised" in outcome, f"the call returned {outcome.get('returned')!r} instead of raising"
    assert isinstance(outcome["raised"], error), repr(outcome["raised"])
    return outcome["raised"]


def test_server_killed_mid_stream_raises_unavailable_promptly(killable_server) -> None:
    import threading
    import time

    url, kill = killable_server("stall_mid_stream")
    with HSpecClient(url, timeout=60.0, retries=1) as client:
        stream = client.generate_stream("Hello world", max_new_tokens=8, ignore_eos=True)
        first = next(stream)
        assert len(first.output_ids_delta) == 1  # the server is mid-stream: one event sent, the rest held
        threading.Timer(0.2, kill).start()
        t0 = time.monotonic()
        err = _raises_within(lambda: list(stream), ServerUnavailableError, KILLED_SERVER_BOUND_S)
        assert time.monotonic() - t0 < KILLED_SERVER_BOUND_S
        assert "dropped the connection" in str(err) and url in str(err)
        # the dead server afterwards: refused at once, after the retry's backoff
        err = _raises_within(lambda: client.generate("x", max_new_tokens=2), ServerUnavailableError,
                             KILLED_SERVER_BOUND_S)
        assert "cannot connect" in str(err) and "after 1 retries" in str(err)
        assert _raises_within(lambda: list(client.chat_stream(MSG)), ServerUnavailableError, KILLED_SERVER_BOUND_S)
        assert client.health() is False


def test_server_killed_before_answering_raises_unavailable_promptly(killable_server) -> None:
    import threading

    url, kill = killable_server("stall")
    with HSpecClient(url, timeout=60.0, retries=0) as client:
        threading.Timer(0.5, kill).start()  # the request is held server-side by then
        err = _raises_within(lambda: client.generate("Hello world", max_new_tokens=4), ServerUnavailableError,
                             KILLED_SERVER_BOUND_S)
        assert "dropped the connection" in str(err)


def test_server_killed_mid_stream_async(killable_server) -> None:
    url, kill = killable_server("stall_mid_stream")

    async def run() -> None:
        async with AsyncHSpecClient(url, timeout=60.0, retries=0) as client:
            stream = client.generate_stream("Hello world", max_new_tokens=8, ignore_eos=True)
            first = await stream.__anext__()
            assert len(first.output_ids_delta) == 1
            asyncio.get_running_loop().call_later(0.2, kill)
            with pytest.raises(ServerUnavailableError, match="dropped the connection"):
                await asyncio.wait_for(stream.__anext__(), KILLED_SERVER_BOUND_S)
            with pytest.raises(ServerUnavailableError, match="cannot connect"):
                await asyncio.wait_for(client.generate("x", max_new_tokens=2), KILLED_SERVER_BOUND_S)

    asyncio.run(run())
