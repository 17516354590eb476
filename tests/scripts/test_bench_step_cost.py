"""scripts/bench_step_cost.py: a step's parts and its cost in plain decode steps, computed by hand."""

import pytest


def test_step_rows_split_each_step_and_price_it_in_plain_steps(load_script):
    bench = load_script("bench_step_cost")
    totals = {
        # 20 plain steps in 1.0 s (50 ms each), 0.9 s of target forwards of which 0.1 s was the prefill
        "plain": {"seconds": 1.0, "prefill": 0.1, "steps": 20, "accepted": 20, "tokens": 20, "draft": 0.0,
                  "target": 0.9},
        # 10 speculative steps in 0.75 s (75 ms: 1.5 plain steps), 0.1 s drafting, 0.6 s verifying, 30 tokens
        "chain": {"seconds": 0.75, "prefill": 0.1, "steps": 10, "accepted": 30, "tokens": 30, "draft": 0.1,
                  "target": 0.7},
    }
    plain, chain = bench.step_rows(totals)
    assert plain["ms_per_step"] == pytest.approx(50.0) and plain["step_cost"] == pytest.approx(1.0)
    assert plain["target_ms"] == pytest.approx(40.0) and plain["host_ms"] == pytest.approx(10.0)
    assert chain["ms_per_step"] == pytest.approx(75.0) and chain["step_cost"] == pytest.approx(1.5)
    assert (chain["draft_ms"], chain["target_ms"], chain["host_ms"]) == pytest.approx((10.0, 60.0, 5.0))
    assert chain["tau"] == pytest.approx(3.0) and chain["speedup"] == pytest.approx(2.0)
