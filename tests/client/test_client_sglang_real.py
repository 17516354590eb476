"""The same checks against a real SGLang server, launched by the CPU tier's ``sglang_server`` fixture.

Skipped (with the reason) where that fixture is absent. Greedy decoding, so streaming and
non-streaming, and the sync and async clients, must produce identical tokens.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from sglang_hspec.client import AsyncHSpecClient, HSpecClient, ServerHTTPError, bench

pytestmark = pytest.mark.sglang

PROMPT = "The quick brown fox jumps over the lazy dog. The quick brown fox"
MESSAGES = [{"role": "user", "content": "Count from one to ten."}]
N = 16


def test_generate_stream_and_sync_async_agree(real_sglang_url: str) -> None:
    with HSpecClient(real_sglang_url, timeout=300) as client:
        info = client.server_info()
        whole = client.generate(PROMPT, max_new_tokens=N, ignore_eos=True)
        chunks = list(client.generate_stream(PROMPT, max_new_tokens=N, ignore_eos=True))

    async def run_async():
        async with AsyncHSpecClient(real_sglang_url, timeout=300) as client:
            return await client.generate(PROMPT, max_new_tokens=N, ignore_eos=True)

    via_async = asyncio.run(run_async())
    streamed = chunks[-1].result
    assert whole.completion_tokens == N and whole.finish_reason == "length"
    assert len(whole.output_ids) == N
    assert streamed.output_ids == whole.output_ids == via_async.output_ids
    assert sum((c.output_ids_delta for c in chunks), ()) == whole.output_ids
    assert "".join(c.text_delta for c in chunks) == streamed.text == whole.text
    if info.is_speculative:
        for r in (whole, streamed, via_async):
            spec = r.spec
            assert spec is not None and spec.verify_ct >= 1
            # SGLang's definition: accept length = completion tokens / verify steps.
            assert spec.tau == pytest.approx(r.completion_tokens / spec.verify_ct)
            # The first token comes from prefill, outside any verify step.
            assert 1.0 <= spec.tau <= spec.verify_width + 1 / spec.verify_ct
            if info.speculative_num_draft_tokens:
                assert spec.num_proposed_drafts == spec.verify_ct * (info.speculative_num_draft_tokens - 1)
            assert 0 <= spec.wasted_verify_tokens <= spec.verified_tokens
    else:
        assert whole.spec is None


def test_chat_stream_equals_non_streaming(real_sglang_url: str) -> None:
    with HSpecClient(real_sglang_url, timeout=300) as client:
        info = client.server_info()
        whole = client.chat(MESSAGES, max_tokens=N, extra_body={"ignore_eos": True})
        chunks = list(client.chat_stream(MESSAGES, max_tokens=N, extra_body={"ignore_eos": True}))
    streamed = chunks[-1].result
    assert streamed.text == whole.text and whole.completion_tokens == streamed.completion_tokens == N
    assert whole.finish_reason == streamed.finish_reason == "length"
    assert (whole.spec is not None) == info.is_speculative
    if info.is_speculative:
        assert (streamed.spec.verify_ct, streamed.spec.tau) == (whole.spec.verify_ct, whole.spec.tau)


def test_real_server_rejects_a_bad_request_with_an_http_error(real_sglang_url: str) -> None:
    with HSpecClient(real_sglang_url, timeout=300) as client:
        with pytest.raises(ServerHTTPError) as info:
            client.generate(PROMPT, max_new_tokens=4, sampling_params={"temperature": -1.0})
    assert 400 <= info.value.status_code < 500


def test_bench_serve_runs_against_the_real_server(real_sglang_url: str, tmp_path) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"id": i, "turns": [f"Say {i}.", "Again."]}) for i in range(2)))
    rc = bench.main(
        ["--url", real_sglang_url, "--prompts", str(prompts), "--concurrency", "1,2", "--api", "generate",
         "--max-tokens", "8", "--ignore-eos", "--out", str(tmp_path / "out")]
    )  # fmt: skip
    assert rc == 0
    rows = json.loads((tmp_path / "out" / "bench_serve.json").read_text())["results"]
    assert [(r["concurrency"], r["requests"], r["errors"], r["output_tokens"]) for r in rows] == [
        (1, 4, 0, 32),
        (2, 8, 0, 64),
    ]
