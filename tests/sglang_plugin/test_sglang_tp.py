"""`--tp-size 2` on the SGLang CPU tier (tests/sglang_cpu): the tiny Qwen3 target's 2 KV heads, one per rank;
each rank's drafter reads its rank's KV head in place with the query heads of that group, o_proj's partial
sums all-reduced over SGLang's TP group (gloo on CPU). Greedy float32: the HSPEC tp-2 server's output equals
the plain tp-2 server's and the tp-1 HSPEC server's, and every block it drafts (SGLang's per-step record,
SGLANG_DSPARK_DEBUG_DUMP=core,reqs) is the tp-1 server's block. The drafter has random weights, so its
drafts depend on the attention over the target's KV."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

MAX_NEW = 24
PROMPTS = 4
# SGLang 0.5.23's CPU path with more ranks than NUMA nodes: each rank's cores named explicitly; and PyNccl off
# (the CUDA torch wheel ships libnccl, which SGLang then tries to open on a CPU device)
TP2 = {"SGLANG_CPU_OMP_THREADS_BIND": "0|1", "SGLANG_NCCL_SO_PATH": "/nonexistent/libnccl.so.2"}
DUMP = {"SGLANG_DSPARK_DEBUG_DUMP": "core,reqs", "SGLANG_RAGGED_VERIFY_MODE": "static"}


def _serve_one_by_one(srv, prompts):
    """Output ids of each prompt, sent alone, and the draft blocks of its steps."""
    outputs, blocks, seen = [], [], 0
    for prompt in prompts:
        out = srv.generate([prompt], MAX_NEW)[0]
        outputs.append(out["output_ids"])
        records = srv.get("/server_info")["internal_states"][0]["dspark_info_record"]["records"]
        blocks.append([r["draft_tokens"] for rec in records[seen:] for r in rec.get("reqs") or ()])
        seen = len(records)
    return outputs, blocks


def test_hspec_tp2_server_equals_plain_tp2_and_hspec_tp1(tiny_hspec_pair, sglang_server):
    from sglang_cpu import builders

    target, draft = tiny_hspec_pair
    prompts = builders.PROMPTS[:PROMPTS]
    want = builders.hf_greedy(target, prompts, MAX_NEW)
    plain = sglang_server(target, name="plain_tp2", args=["--tp-size", "2"], env_extra=TP2)
    assert [o["output_ids"] for o in plain.generate(prompts, MAX_NEW)] == want
    plain.stop()

    hspec = ["--speculative-algorithm", "HSPEC", "--speculative-draft-model-path", str(draft)]
    one = sglang_server(target, name="hspec_tp1", plugins=("sglang_cpu_testing", "hspec"), args=hspec, env_extra=DUMP)
    ids_tp1, blocks_tp1 = _serve_one_by_one(one, prompts)
    one.stop()
    two = sglang_server(target, name="hspec_tp2", plugins=("sglang_cpu_testing", "hspec"),
                        args=[*hspec, "--tp-size", "2"], env_extra={**TP2, **DUMP})
    ids_tp2, blocks_tp2 = _serve_one_by_one(two, prompts)

    log = two.log()
    for rank in (0, 1):
        assert f"TP{rank}] HSPEC: drafter attention sharded over 2 TP ranks; rank {rank} reads KV heads {rank}..{rank}" in log
    assert ids_tp2 == ids_tp1 == want
    assert all(len(b) >= MAX_NEW // 4 for b in blocks_tp2), blocks_tp2  # block 3: at most 4 tokens a step
    assert blocks_tp2 == blocks_tp1

