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


def test_batched_rows_count_row_steps_for_tau_and_tokens_per_second_for_speed(load_script):
    bench = load_script("bench_step_cost")
    totals = {
        # batches of 2: 10 batch steps in 1.0 s (100 ms each), 20 row steps, 20 tokens (20 tok/s)
        "plain": {"seconds": 1.0, "prefill": 0.0, "steps": 10, "row_steps": 20, "accepted": 20, "tokens": 20,
                  "draft": 0.0, "target": 0.9},
        # 4 batch steps in 0.6 s (150 ms: 1.5 plain steps); one row finished after 3, so 7 row steps
        "tree 16": {"seconds": 0.6, "prefill": 0.0, "steps": 4, "row_steps": 7, "accepted": 20, "tokens": 20,
                    "draft": 0.1, "target": 0.4},
    }
    _, tree = bench.step_rows(totals)
    assert tree["step_cost"] == pytest.approx(1.5)
    assert tree["tau"] == pytest.approx(20 / 7)  # per row step, not per batch step (20 / 4 = 5)
    assert tree["speedup"] == pytest.approx((20 / 0.6) / 20)  # 1.67, not tau / step cost (1.90)
    assert (tree["draft_ms"], tree["target_ms"], tree["host_ms"]) == pytest.approx((25.0, 100.0, 25.0))
