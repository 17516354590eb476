"""Bad server answers (garbled compression, impossible counters, odd /server_info, redirects, a stream
that is not SSE) raise an HSpecClientError naming the URL, the problem and the fix, from both clients."""

from __future__ import annotations

import asyncio
import math

import httpx
import pytest
from fake_sglang import Behaviour, FakeSGLangServer

from sglang_hspec.client import (
    AsyncHSpecClient,
    HSpecClient,
    MalformedResponseError,
    ServerHTTPError,
)
from sglang_hspec.client.types import parse_generate

PROMPT = "Hello world"
MSG = [{"role": "user", "content": PROMPT}]
# PROMPT with 10 tokens and ignore_eos (see test_client_sdk): verify_ct 4, correct drafts 5,
# proposed 28, tau 10 / 4 = 2.5, histogram (2, 0, 1, 1, 0, 0, 0, 0).


def _generate_calls(client: HSpecClient, max_new_tokens: int = 10):
    return {
        "generate": lambda: client.generate(PROMPT, max_new_tokens=max_new_tokens, ignore_eos=True),
        "generate_stream": lambda: list(
            client.generate_stream(PROMPT, max_new_tokens=max_new_tokens, ignore_eos=True)
        ),
    }


def _chat_calls(client: HSpecClient):
    return {
        "chat": lambda: client.chat(MSG, max_tokens=10, extra_body={"ignore_eos": True}),
        "chat_stream": lambda: list(client.chat_stream(MSG, max_tokens=10, extra_body={"ignore_eos": True})),
    }


async def _async_generate(url: str, max_new_tokens: int = 10) -> None:
    async with AsyncHSpecClient(url) as client:
        await client.generate(PROMPT, max_new_tokens=max_new_tokens, ignore_eos=True)


def test_gzip_header_on_a_plain_body_is_a_malformed_response() -> None:
    with FakeSGLangServer(Behaviour(mode="bad_gzip")) as server, HSpecClient(server.url) as client:
        calls = {**_generate_calls(client), **_chat_calls(client), "server_info": client.server_info}
        for name, call in calls.items():
            with pytest.raises(MalformedResponseError) as info:
                call()
            message = str(info.value)
            assert message.startswith(server.url + "/"), name
            assert "Content-Encoding" in message and "proxy" in message, name
            assert isinstance(info.value.__cause__, httpx.DecodingError), name
        with pytest.raises(MalformedResponseError, match="Content-Encoding"):
            asyncio.run(_async_generate(server.url))


@pytest.mark.parametrize(
    "final_meta, max_new_tokens, problem",
    [
        ({"completion_tokens": -5}, 10, "completion_tokens=-5 is negative"),
        ({"prompt_tokens": -1}, 10, "prompt_tokens=-1 is negative"),
        ({"cached_tokens": -3}, 10, "cached_tokens=-3 is negative"),
        ({"completion_tokens": 400}, 1, "completion_tokens=400 but the response carries 1 output ids"),
        ({"e2e_latency": -0.5}, 10, "e2e_latency=-0.5 is not a duration >= 0"),
        ({"spec_accept_rate": 5.0}, 10, "spec_accept_rate=5.0 is not a fraction in [0, 1]"),
        ({"spec_accept_length": 0.5}, 10, "spec_accept_length=0.5 is not a number >= 1"),
        # 9 tokens per step over 4 steps is 36 tokens, but only 10 were generated.
        ({"spec_accept_length": 9.0}, 10, "is 36 tokens, more than completion_tokens=10"),
        ({"spec_verify_ct": -2}, 10, "spec_verify_ct=-2 is negative"),
        ({"spec_verify_ct": 11}, 10, "spec_verify_ct=11 exceeds completion_tokens=10"),
        (
            {"spec_num_correct_drafts": 29},
            10,
            "spec_num_correct_drafts=29 exceeds spec_num_proposed_drafts=28",
        ),
        ({"spec_num_proposed_drafts": -28}, 10, "spec_num_proposed_drafts=-28 is negative"),
        ({"spec_cap_length": -1.0}, 10, "spec_cap_length=-1.0 is not a length > 0"),
        ({"spec_correct_drafts_histogram": [2, 0, 1, 0]}, 10, "counts 3 verify steps, spec_verify_ct=4"),
        ({"spec_correct_drafts_histogram": [1, 1, 1, 1]}, 10, "accounts for 6 accepted drafts"),
        ({"spec_correct_drafts_histogram": [5, -1]}, 10, "has a negative count"),
    ],
)
def test_impossible_generate_counters_are_refused(
    final_meta: dict, max_new_tokens: int, problem: str
) -> None:
    with FakeSGLangServer(Behaviour(final_meta=final_meta)) as server, HSpecClient(server.url) as client:
        for name, call in _generate_calls(client, max_new_tokens).items():
            with pytest.raises(MalformedResponseError) as info:
                call()
            message = str(info.value)
            assert problem in message, (name, message)
            assert message.startswith(f"{server.url}/generate"), name
            assert "impossible counters for request gen-" in message and "server bug" in message, name
        with pytest.raises(MalformedResponseError, match="impossible counters"):
            asyncio.run(_async_generate(server.url, max_new_tokens))


@pytest.mark.parametrize(
    "behaviour, problem",
    [
        (Behaviour(spec_details={"spec_accept_rate": 5.0}), "spec_accept_rate=5.0 is not a fraction"),
        (Behaviour(spec_details={"spec_accept_length": 0.0}), "spec_accept_length=0.0 is not a number >= 1"),
        # A negative step count is refused, not read as "no speculation".
        (Behaviour(spec_details={"spec_verify_ct": -4}), "spec_verify_ct=-4 is negative"),
        (Behaviour(usage={"completion_tokens": -5}), "completion_tokens=-5 is negative"),
        (Behaviour(usage={"prompt_tokens": -3}), "prompt_tokens=-3 is negative"),
    ],
)
def test_impossible_chat_counters_are_refused(behaviour: Behaviour, problem: str) -> None:
    with FakeSGLangServer(behaviour) as server, HSpecClient(server.url) as client:
        for name, call in _chat_calls(client).items():
            with pytest.raises(MalformedResponseError) as info:
                call()
            assert problem in str(info.value), (name, str(info.value))
            assert str(info.value).startswith(f"{server.url}/v1/chat/completions"), name


def test_counters_on_the_bounds_are_accepted() -> None:
    # Every draft wrong (rate 0), or every draft right (rate 1): both can happen.
    for rate in (0.0, 1.0):
        with (
            FakeSGLangServer(Behaviour(final_meta={"spec_accept_rate": rate})) as server,
            HSpecClient(server.url) as client,
        ):
            r = client.generate(PROMPT, max_new_tokens=10, ignore_eos=True)
        assert (r.spec.accept_rate, r.spec.tau * r.spec.verify_ct) == (rate, 10.0)


def test_nan_counters_are_refused() -> None:
    # Python's json writes NaN as a bare token, which is not JSON; already-decoded NaN is impossible.
    with (
        FakeSGLangServer(Behaviour(final_meta={"spec_accept_length": math.nan})) as server,
        HSpecClient(server.url) as client,
    ):
        with pytest.raises(MalformedResponseError, match=f"^{server.url}/generate: body is not valid JSON"):
            client.generate(PROMPT, max_new_tokens=10, ignore_eos=True)
    meta = {"id": "a", "prompt_tokens": 1, "completion_tokens": 3, "finish_reason": {"type": "length"}}
    nan_tau = {**meta, "spec_verify_ct": 2, "spec_accept_length": math.nan}
    with pytest.raises(MalformedResponseError, match="spec_accept_length=nan is not a number >= 1"):
        parse_generate({"output_ids": [1, 2, 3], "meta_info": nan_tau}, client_latency_s=1.0)
    nan_rate = {**meta, "spec_verify_ct": 2, "spec_accept_length": 1.5, "spec_accept_rate": math.nan}
    with pytest.raises(MalformedResponseError, match="spec_accept_rate=nan is not a fraction"):
        parse_generate({"output_ids": [1, 2, 3], "meta_info": nan_rate}, client_latency_s=1.0)


@pytest.mark.parametrize(
    "body, problem",
    [
        (b"null", "expected a JSON object of server arguments, got None (NoneType)"),
        (b"[1, 2]", "expected a JSON object of server arguments, got [1, 2] (list)"),
        (b'{"speculative_num_draft_tokens": 8.5}', "speculative_num_draft_tokens should be a whole number"),
        (b'{"speculative_num_draft_tokens": 0}', "speculative_num_draft_tokens should be a whole number"),
        (b'{"speculative_num_draft_tokens": "8"}', "got '8'"),
        (b'{"speculative_num_draft_tokens": true}', "got True"),
        (b'{"speculative_algorithm": 5}', "speculative_algorithm should be a string or null, got 5"),
        (b'{"server_args": {"model_path": ["a"]}}', "model_path should be a string or null"),
    ],
)
def test_bad_server_info_names_the_url(body: bytes, problem: str) -> None:
    with FakeSGLangServer(Behaviour(server_info_body=body)) as server, HSpecClient(server.url) as client:
        with pytest.raises(MalformedResponseError) as info:
            client.server_info()
    assert str(info.value).startswith(f"{server.url}/server_info: ")
    assert problem in str(info.value) and "SGLang server" in str(info.value)


def test_server_info_keeps_whole_floats_and_nested_keys() -> None:
    body = b'{"server_args": {"speculative_num_draft_tokens": 8.0, "speculative_algorithm": "HSPEC"}}'
    with FakeSGLangServer(Behaviour(server_info_body=body)) as server, HSpecClient(server.url) as client:
        info = client.server_info()
    assert (info.speculative_num_draft_tokens, info.speculative_algorithm, info.version) == (8, "HSPEC", None)


def test_redirect_is_an_http_error_naming_the_new_address() -> None:
    with FakeSGLangServer(Behaviour(mode="redirect")) as server, HSpecClient(server.url) as client:
        with pytest.raises(ServerHTTPError) as info:
            client.generate(PROMPT, max_new_tokens=3)
    assert info.value.status_code == 307
    assert str(info.value).startswith(
        f"{server.url}/generate: HTTP 307 redirect to http://127.0.0.1:1/generate"
    )
    assert "base_url" in str(info.value)


def test_unauthorized_says_to_pass_the_api_key() -> None:
    with FakeSGLangServer(Behaviour(mode="http401")) as server, HSpecClient(server.url) as client:
        for name, call in _chat_calls(client).items():
            with pytest.raises(ServerHTTPError, match=r"HTTP 401: Unauthorized\. Pass api_key=") as info:
                call()
            assert info.value.status_code == 401, name


def test_a_stream_answered_without_sse_events_is_malformed() -> None:
    with FakeSGLangServer(Behaviour(mode="no_sse")) as server, HSpecClient(server.url) as client:
        for name, call in {**_generate_calls(client), **_chat_calls(client)}.items():
            if not name.endswith("_stream"):
                continue
            with pytest.raises(MalformedResponseError, match="no SSE `data:` events") as info:
                call()
            assert "'application/json'" in str(info.value) and server.url in str(info.value), name
