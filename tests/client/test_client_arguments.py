"""Bad client arguments are refused before any request, with an error naming the URL and the fix."""

from __future__ import annotations

import asyncio
import math

import httpx
import pytest
from fake_sglang import FakeSGLangServer

from sglang_hspec.client import AsyncHSpecClient, HSpecClient, HSpecClientError, InvalidArgumentError


@pytest.mark.parametrize(
    "base_url, problem",
    [
        ("http://127.0.0.1:99999", "port 99999 is outside 1-65535"),
        ("http://127.0.0.1:65536", "port 65536 is outside 1-65535"),
        ("http://127.0.0.1:0", "port 0 is outside 1-65535"),
        ("http://127.0.0.1:-1", "port -1 is outside 1-65535"),
        ("http://127.0.0.1:abc", "is not a valid URL (Invalid port: 'abc')"),
        ("http://127.0.0.1:8.5", "is not a valid URL (Invalid port: '8.5')"),
        ("http://:30000", "has no host"),
        ("http://my host:30000", "contains whitespace"),
        ("http://127.0.0.1:30000?debug=1", "has a ?query or #fragment"),
        ("127.0.0.1:30000", "must start with http:// or https://"),
        (30000, "base_url must be a string"),
    ],
)
def test_bad_base_urls_are_refused(base_url, problem: str) -> None:
    for cls in (HSpecClient, AsyncHSpecClient):
        with pytest.raises(InvalidArgumentError) as info:
            cls(base_url)
        assert problem in str(info.value), (cls, str(info.value))
        assert repr(base_url) in str(info.value) and "http://127.0.0.1:30000" in str(info.value)
        # Existing `except ValueError` code keeps working, and so does `except HSpecClientError`.
        assert isinstance(info.value, ValueError) and isinstance(info.value, HSpecClientError)


@pytest.mark.parametrize("base_url", ["http://127.0.0.1:1", "http://127.0.0.1:65535/", "https://[::1]:30000"])
def test_edge_ports_and_hosts_are_accepted(base_url: str) -> None:
    with HSpecClient(base_url) as client:
        assert client.base_url == base_url.rstrip("/")


@pytest.mark.parametrize(
    "kwargs, problem",
    [
        ({"timeout": math.nan}, "timeout=nan must be a finite number of seconds > 0"),
        ({"timeout": math.inf}, "timeout=inf must be a finite number"),
        ({"timeout": 0}, "timeout=0 must be"),
        ({"connect_timeout": -1.0}, "connect_timeout=-1.0 must be"),
        ({"timeout": "30"}, "timeout='30' must be"),
        ({"timeout": True}, "timeout=True must be"),
        ({"retries": 2.5}, "retries=2.5 must be a whole number >= 0"),
        ({"retries": -1}, "retries=-1 must be a whole number >= 0"),
        ({"max_connections": 0}, "max_connections=0 must be a whole number >= 1"),
        ({"model": ""}, "model='' must be a non-empty string"),
        ({"api_key": "sk-1\nX-Injected: 1"}, "api_key must be a string of printable ASCII characters"),
    ],
)
def test_bad_options_are_refused(kwargs: dict, problem: str) -> None:
    for cls in (HSpecClient, AsyncHSpecClient):
        with pytest.raises(InvalidArgumentError) as info:
            cls("http://127.0.0.1:30000", **kwargs)
        assert str(info.value).startswith(f"{cls.__name__}('http://127.0.0.1:30000'): ")
        assert problem in str(info.value), str(info.value)


def test_a_transport_of_the_other_kind_is_refused() -> None:
    with pytest.raises(InvalidArgumentError, match="must be an httpx.AsyncBaseTransport, got HTTPTransport"):
        AsyncHSpecClient("http://127.0.0.1:30000", transport=httpx.HTTPTransport())
    with pytest.raises(InvalidArgumentError, match="must be an httpx.BaseTransport, got AsyncHTTPTransport"):
        HSpecClient("http://127.0.0.1:30000", transport=httpx.AsyncHTTPTransport())


def test_bad_call_arguments_name_the_endpoint_and_send_nothing(fake_server: FakeSGLangServer) -> None:
    url = fake_server.url
    with HSpecClient(url) as client:
        with pytest.raises(InvalidArgumentError, match=f"^{url}/generate: pass exactly one of prompt="):
            client.generate("x", input_ids=[1, 2])
        with pytest.raises(InvalidArgumentError, match=f"^{url}/generate: pass exactly one"):
            client.generate_stream()  # refused at the call, before the first chunk is asked for
        with pytest.raises(InvalidArgumentError, match=f"^{url}/v1/chat/completions: messages must be"):
            client.chat_stream([])

    async def run() -> None:
        async with AsyncHSpecClient(url) as client:
            with pytest.raises(InvalidArgumentError, match="pass exactly one"):
                await client.generate()
            with pytest.raises(InvalidArgumentError, match="messages must be"):
                client.chat_stream([])

    asyncio.run(run())
    assert fake_server.behaviour.requests == []
