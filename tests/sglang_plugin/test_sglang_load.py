"""HSPEC under load on the real SGLang (CPU tier, tiny Qwen3, float32, greedy, bigram H-Spec drafter):
three times more concurrent requests than the KV pool holds queue and finish with the outputs of one-by-one
decoding, and a short soak of random requests with 10 % aborted leaves no failure, no leaked KV and the
target's greedy outputs. The long soak is `scripts/soak_sglang.py`."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

PLUGINS = ("sglang_cpu_testing", "hspec")
POOL_TOKENS = 320  # KV tokens: each request below needs ~70-90 (prompt + output + the verify window)


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    from sglang_cpu import builders
    from sglang_cpu import server as cpu_server

    root = tmp_path_factory.mktemp("sglang_load")
    target = builders.build_tiny_target(root / "target")
    drafter = builders.build_hspec_draft(root / "hspec_bigram", target, bigram=True)
    prompts = list(builders.PROMPTS)
    golden = builders.hf_greedy(target, prompts, 64)  # = the non-speculative server's (float32)
    srv = cpu_server.launch(target, log_path=root / "hspec_small_pool.log", plugins=PLUGINS,
                            max_total_tokens=POOL_TOKENS,
                            args=["--speculative-algorithm", "HSPEC", "--speculative-draft-model-path", str(drafter)])
    yield {"server": srv, "prompts": prompts, "golden": golden}
    srv.stop()


def test_three_times_the_kv_pool_queues_and_matches_one_by_one(loaded):
    from sglang_cpu import load

    srv, prompts, golden = loaded["server"], loaded["prompts"], loaded["golden"]
    n = 18  # ~18 x 75 tokens = 4.2x the pool
    idx = [i % len(prompts) for i in range(n)]
    lengths = [48 + (7 * i) % 17 for i in range(n)]
    result = load.overload(srv.url, [prompts[i] for i in idx], lengths, workers=n)
    assert not result["failures"], result["failures"]
    assert result["peak_waiting"] > 0  # the pool could not hold them all: requests queued
    assert result["outputs"] == [golden[i][:m] for i, m in zip(idx, lengths)]
    drained = load.wait_drained(srv.url)
    assert drained == {"num_running_reqs": 0, "num_waiting_reqs": 0, "num_used_tokens": 0}, drained
    assert "Traceback" not in srv.serving_log()


def test_short_soak_with_aborts_leaks_nothing(loaded):
    from sglang_cpu import load

    srv = loaded["server"]
    stats = load.soak(srv.url, prompts=loaded["prompts"], reference=loaded["golden"], duration_s=40, concurrency=6,
                      max_new_tokens=(4, 64), abort_fraction=0.1, seed=0, server_pid=srv.proc.pid, rss_every_s=8)
    print(stats)
    assert stats["failed"] == 0 and stats["mismatched"] == 0, stats["errors"]
    assert stats["completed"] >= 10 and stats["aborted"] + stats["completed"] <= stats["requests"]
    assert stats["kv_tokens_leaked"] == 0 and stats["left_running"] == 0, stats
    assert "Traceback" not in srv.serving_log()
    # RSS sampled every 8 s over the 40 s, plus the end: its second half's growth is reported
    assert len(stats["rss_mib_series"]) >= 5 and stats["rss_mib_series"][-1][1] == stats["rss_end_mib"]
    assert stats["rss_second_half_pct"] == load.second_half_growth_pct(stats["rss_mib_series"])
    assert abs(stats["rss_second_half_pct"]) < 10, stats["rss_mib_series"]


def test_second_half_growth_is_read_after_the_warm_up():
    from sglang_cpu import load

    # a 240 s run: the warm-up jump (100 -> 110 MiB) falls in the first half; 110 -> 115.5 is +5 %
    assert load.second_half_growth_pct([[60, 100.0], [120, 110.0], [180, 112.0], [240, 115.5]]) == 5.0
    assert load.second_half_growth_pct([[60, 100.0], [240, 130.0]]) is None  # one sample in the second half
    assert load.second_half_growth_pct([]) is None
