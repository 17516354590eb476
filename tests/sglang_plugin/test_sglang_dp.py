"""`--dp-size 2` (without DP attention) on the SGLang CPU tier: SGLang's DataParallelController starts two
schedulers, each holding the whole tiny Qwen3 target and its own KV pool with every KV head."""

from __future__ import annotations

import pytest

from tests.sglang_plugin.test_sglang_tp import DUMP, MAX_NEW, PROMPTS, TP2

pytestmark = [pytest.mark.sglang, pytest.mark.slow]


def test_hspec_dp2_replicas_each_draft_from_their_own_pool(tiny_hspec_pair, sglang_server):
    """`--dp-size 2` without DP attention: SGLang's DataParallelController starts two schedulers, each holding
    the whole model and its own KV pool; both replicas bind their drafter to their pool, both draft blocks
    (each replica's record), and the greedy outputs of prompts spread over them equal HF's."""
    from sglang_cpu import builders

    target, draft = tiny_hspec_pair
    prompts = builders.PROMPTS[:PROMPTS]
    want = builders.hf_greedy(target, prompts, MAX_NEW)
    srv = sglang_server(target, name="hspec_dp2", plugins=("sglang_cpu_testing", "hspec"),
                        args=["--speculative-algorithm", "HSPEC", "--speculative-draft-model-path", str(draft),
                              "--dp-size", "2"], env_extra={**TP2, **DUMP})
    assert [o["output_ids"] for o in srv.generate(prompts, MAX_NEW)] == want
    assert [srv.generate([p], MAX_NEW)[0]["output_ids"] for p in prompts] == want
    log = srv.log()
    for rank in (0, 1):
        assert any(f"DP{rank}" in line and "HSPEC: drafter reads the target KV pool in place" in line
                   for line in log.splitlines()), f"replica {rank} did not bind its drafter"
    states = srv.get("/server_info")["internal_states"]
    assert len(states) == 2
    drafted = [sum(len(rec.get("reqs") or ()) for rec in s["dspark_info_record"]["records"]) for s in states]
    assert all(n > 0 for n in drafted), drafted
