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
