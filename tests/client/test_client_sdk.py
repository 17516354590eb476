"""Parsing, streaming and sync/async agreement against a local server replaying SGLang's shapes."""

from __future__ import annotations

import asyncio

import pytest
from fake_sglang import Behaviour, FakeSGLangServer, text_for, token_ids_for

from sglang_hspec.client import (
    AsyncHSpecClient,
    GenerateResult,
    HSpecClient,
    NotSpeculativeError,
    SpecStats,
)

# "Hello world", 10 tokens with ignore_eos: steps [1 prefill, 3, 1, 4, 1] -> verify_ct 4,
# correct drafts 2+0+3+0 = 5, proposed 4 * 7 = 28, tau = 10 / 4, width 8, wasted 4*8 - 5 - 4 = 23.
PROMPT = "Hello world"
EXPECTED_IDS = tuple(token_ids_for(PROMPT, 10))


def _run(coro):
    return asyncio.run(coro)


def test_generate_parses_meta_info_and_spec_stats(fake_server: FakeSGLangServer) -> None:
    with HSpecClient(fake_server.url) as client:
        r = client.generate(PROMPT, max_new_tokens=10, ignore_eos=True)
    assert r.output_ids == EXPECTED_IDS
    assert r.text == text_for(list(EXPECTED_IDS))
    assert (r.finish_reason, r.matched_stop) == ("length", None)
    assert (r.prompt_tokens, r.completion_tokens, r.cached_tokens) == (3, 10, 0)
    assert r.latency_s == pytest.approx(0.5)  # server e2e_latency wins over client wall time
    assert r.tokens_per_s == pytest.approx(20.0)
    assert r.spec == SpecStats(
        accept_length=2.5,
        verify_ct=4,
        num_correct_drafts=5,
        num_proposed_drafts=28,
        accept_rate=pytest.approx(5 / 28),
        correct_drafts_histogram=(2, 0, 1, 1, 0, 0, 0, 0),
    )
    assert (r.spec.tau, r.spec.verify_width, r.spec.verified_tokens, r.spec.wasted_verify_tokens) == (
        2.5,
        8.0,
        32,
        23,
    )
    # What was sent is SGLang's native request shape.
    path, body = fake_server.behaviour.requests[-1]
    assert path == "/generate"
    assert body == {
        "text": PROMPT,
        "stream": False,
        "sampling_params": {"max_new_tokens": 10, "temperature": 0.0, "ignore_eos": True},
    }


def test_stop_finish_reason_carries_matched_token(fake_server: FakeSGLangServer) -> None:
    # len("Hi") = 2 -> the fake model stops after 4 + 2 = 6 tokens on EOS id 2.
    with HSpecClient(fake_server.url) as client:
        r = client.generate("Hi", max_new_tokens=50)
    assert (r.finish_reason, r.matched_stop, r.completion_tokens) == ("stop", 2, 6)


@pytest.mark.parametrize("cap_length, wasted", [(None, 23), (5.0, 11)])
def test_ragged_verify_width_comes_from_cap_length(cap_length: float | None, wasted: int) -> None:
    with FakeSGLangServer(Behaviour(cap_length=cap_length)) as server, HSpecClient(server.url) as client:
        r = client.generate(PROMPT, max_new_tokens=10, ignore_eos=True)
    assert r.spec.cap_length == cap_length
    assert r.spec.wasted_verify_tokens == wasted


@pytest.mark.parametrize("incremental", [False, True])
def test_generate_stream_equals_non_streaming(incremental: bool) -> None:
    with FakeSGLangServer(Behaviour(incremental=incremental)) as server, HSpecClient(server.url) as client:
        whole = client.generate(PROMPT, max_new_tokens=10, ignore_eos=True)
        chunks = list(client.generate_stream(PROMPT, max_new_tokens=10, ignore_eos=True))
    # One event per scheduler step: 1 token from prefill, then one per verify step.
    assert [len(c.output_ids_delta) for c in chunks] == [1, 3, 1, 4, 1]
    assert [c.result is None for c in chunks] == [True] * 4 + [False]
    assert sum((c.output_ids_delta for c in chunks), ()) == EXPECTED_IDS
    assert "".join(c.text_delta for c in chunks) == whole.text
    streamed = chunks[-1].result
    assert _comparable(streamed) == _comparable(whole)
    assert streamed.spec == whole.spec


def test_chat_parses_sglext_spec_details(fake_server: FakeSGLangServer) -> None:
    messages = [{"role": "user", "content": PROMPT}]
    with HSpecClient(fake_server.url) as client:
        r = client.chat(messages, max_tokens=10, extra_body={"ignore_eos": True})
    # The fake chat template is "<|user|>Hello world": 2 words + 1 -> 3 prompt tokens.
    assert (r.finish_reason, r.completion_tokens, r.prompt_tokens, r.model) == ("length", 10, 3, "default")
    assert r.text == text_for(token_ids_for("<|user|>Hello world", 10))
    assert (r.spec.tau, r.spec.verify_ct, r.spec.num_correct_drafts, r.spec.cap_length) == (2.5, 4, 5, None)
    path, body = fake_server.behaviour.requests[-1]
    assert path == "/v1/chat/completions"
    assert body["return_spec_tokens_details"] is True and body["stream"] is False


def test_chat_stream_equals_non_streaming(fake_server: FakeSGLangServer) -> None:
    messages = [{"role": "user", "content": PROMPT}]
    with HSpecClient(fake_server.url) as client:
        whole = client.chat(messages, max_tokens=10, extra_body={"ignore_eos": True})
        chunks = list(client.chat_stream(messages, max_tokens=10, extra_body={"ignore_eos": True}))
    assert "".join(c.text_delta for c in chunks) == whole.text
    assert [c.result is not None for c in chunks].count(True) == 1
    streamed = chunks[-1].result
    assert _comparable(streamed) == _comparable(whole)
    assert streamed.spec == whole.spec
    body = fake_server.behaviour.requests[-1][1]
    assert body["stream_options"] == {"include_usage": True}


def test_sync_and_async_agree(fake_server: FakeSGLangServer) -> None:
    messages = [{"role": "user", "content": "Tell me a story"}]
    with HSpecClient(fake_server.url) as client:
        sync = (
            client.generate(PROMPT, max_new_tokens=10, ignore_eos=True),
            list(client.generate_stream(PROMPT, max_new_tokens=7))[-1].result,
            client.chat(messages, max_tokens=9),
            list(client.chat_stream(messages, max_tokens=9))[-1].result,
        )

    async def run_async():
        async with AsyncHSpecClient(fake_server.url) as client:
            gen = await client.generate(PROMPT, max_new_tokens=10, ignore_eos=True)
            gen_stream = [c async for c in client.generate_stream(PROMPT, max_new_tokens=7)]
            chat = await client.chat(messages, max_tokens=9)
            chat_stream = [c async for c in client.chat_stream(messages, max_tokens=9)]
            return gen, gen_stream[-1].result, chat, chat_stream[-1].result

    asyncs = _run(run_async())
    for s, a in zip(sync, asyncs, strict=True):
        assert _comparable(s) == _comparable(a)
        assert s.spec == a.spec


def test_async_client_runs_requests_concurrently(fake_server: FakeSGLangServer) -> None:
    prompts = [f"prompt number {i}" for i in range(8)]

    async def run():
        async with AsyncHSpecClient(fake_server.url) as client:
            return await asyncio.gather(
                *(client.generate(p, max_new_tokens=5, ignore_eos=True) for p in prompts)
            )

    results = _run(run())
    assert [r.output_ids for r in results] == [tuple(token_ids_for(p, 5)) for p in prompts]
    assert len({r.request_id for r in results}) == 8


def test_server_info_reports_speculation() -> None:
    for speculative in (True, False):
        with (
            FakeSGLangServer(Behaviour(speculative=speculative)) as server,
            HSpecClient(server.url) as client,
        ):
            info = client.server_info()
            assert info.is_speculative is speculative
            assert info.speculative_num_draft_tokens == (8 if speculative else None)
            assert (info.version, info.model_path) == ("0.5.23", "tiny-qwen3")
            assert client.health() is True


def test_non_speculative_server_gives_no_stats_or_a_clear_error() -> None:
    with FakeSGLangServer(Behaviour(speculative=False)) as server:
        with HSpecClient(server.url) as lenient:
            r = lenient.generate(PROMPT, max_new_tokens=10, ignore_eos=True)
            assert r.spec is None and r.completion_tokens == 10
            assert lenient.chat([{"role": "user", "content": "x"}], max_tokens=5).spec is None
        with HSpecClient(server.url, require_speculative=True) as strict:
            with pytest.raises(NotSpeculativeError, match="--speculative-algorithm"):
                strict.generate(PROMPT, max_new_tokens=10, ignore_eos=True)
            with pytest.raises(NotSpeculativeError):
                list(strict.chat_stream([{"role": "user", "content": "x"}], max_tokens=5))
            # One token comes from prefill alone: no verify step even when speculative, so no error.
            assert strict.generate(PROMPT, max_new_tokens=1, ignore_eos=True).spec is None


def test_bad_arguments_are_refused_before_any_request() -> None:
    with pytest.raises(ValueError, match="http://"):
        HSpecClient("127.0.0.1:30000")
    with pytest.raises(ValueError, match="retries"):
        HSpecClient("http://127.0.0.1:1", retries=-1)
    with HSpecClient("http://127.0.0.1:1") as client:
        with pytest.raises(ValueError, match="exactly one"):
            client.generate()
        with pytest.raises(ValueError, match="non-empty"):
            client.chat([])


def _comparable(r) -> dict:
    """Fields that must agree across transports (timings and request ids differ by nature)."""
    skip = {"request_id", "latency_s", "client_latency_s"}
    if isinstance(r, GenerateResult):
        skip.discard("latency_s")  # server-reported for /generate, so it must agree too
    return {k: getattr(r, k) for k in r.__struct_fields__ if k not in skip}


def test_docstring_examples_run() -> None:
    import doctest

    from sglang_hspec.client import types as client_types

    failures, tried = doctest.testmod(client_types)
    assert tried > 0 and failures == 0


def test_parses_chat_shapes_serialised_by_sglang_itself() -> None:
    # data/make_sglang_shapes.py built these with SGLang 0.5.23's own pydantic models and SSE helpers.
    import json
    from pathlib import Path

    from sglang_hspec.client.types import ChatStreamAssembler, decode_json, parse_chat

    shapes = json.loads((Path(__file__).parent / "data" / "sglang_0_5_23_chat_shapes.json").read_text())
    whole = parse_chat(shapes["chat"], client_latency_s=1.0)
    assembler = ChatStreamAssembler()
    deltas = []
    for line in shapes["stream"].splitlines():
        if line.startswith("data:") and line[5:].strip() != "[DONE]":
            chunk = assembler.feed(decode_json(line[5:].strip(), "stream"))
            deltas.append(chunk.text_delta if chunk else None)
    streamed = assembler.finish(client_latency_s=1.0)
    assert deltas == [None, "hello", " there", None, None, None]
    assert whole == streamed
    assert (whole.text, whole.finish_reason, whole.prompt_tokens, whole.completion_tokens) == (
        "hello there",
        "length",
        3,
        10,
    )
    assert whole.spec == SpecStats(
        accept_length=2.5,
        verify_ct=4,
        num_correct_drafts=5,
        num_proposed_drafts=28,
        accept_rate=5 / 28,
        correct_drafts_histogram=(2, 0, 1, 1, 0, 0, 0, 0),
    )
