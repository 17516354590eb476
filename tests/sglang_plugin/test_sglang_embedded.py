"""HSPEC on the embedded target (SmolLM2-135M-Instruct) with the shipped drafter, through the CPU tier:
greedy float32 output equals the non-speculative server on 10 MT-Bench prompts x 64 tokens, and
SGLang's accept length is close to the reference engine's tau on the same prompts."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.sglang, pytest.mark.slow, pytest.mark.integration]

N_PROMPTS, MAX_NEW = 10, 64


@pytest.fixture(scope="module")
def embedded_prompts():
    from transformers import AutoTokenizer

    from sglang_hspec.assets.embedded import embedded_target_dir
    from sglang_hspec.assets.prompts import chat_input_ids, load_prompts

    target = embedded_target_dir()
    tok = AutoTokenizer.from_pretrained(target)
    ids = [chat_input_ids(tok, it.messages(0)) for it in load_prompts("mtbench", limit=N_PROMPTS)]
    return target, ids


def test_hspec_on_embedded_target_equals_nonspec(embedded_prompts, sglang_server):
    from sglang_hspec.engine.loading import SHIPPED_DRAFTER_DIR

    target, prompts = embedded_prompts
    base = sglang_server(target, name="embedded_nonspec")
    golden = [o["output_ids"] for o in base.generate(prompts, MAX_NEW)]
    base.stop()
    srv = sglang_server(target, name="embedded_hspec", plugins=("sglang_cpu_testing", "hspec"),
                        args=["--speculative-algorithm", "HSPEC",
                              "--speculative-draft-model-path", str(SHIPPED_DRAFTER_DIR)])
    outs = srv.generate(prompts, MAX_NEW)
    assert [o["output_ids"] for o in outs] == golden
    accept = [o["meta_info"]["spec_accept_length"] for o in outs]
    assert all(1.0 <= a <= 8.0 for a in accept), accept
    # the shipped drafter accepts some drafts (the reference engine measures tau 1.26 on MT-Bench)
    assert sum(accept) / len(accept) > 1.1, accept
    assert "no drafter KV cache allocated" in srv.log()
