import json
import math

import pytest
from sglang_hspec.scheduler.simulator import DOMAINS, SimConfig, main, make_policy, simulate
from sglang_hspec.scheduler.sps import SpsCostTable, synthetic_sps_table

FLAT = SpsCostTable(sample_batch_tokens=[1, 2], sample_steps_per_sec=[50.0, 50.0], max_batch_tokens=4096)


def run(policy, *, threshold=0.3, **kw):
    cfg = SimConfig(**kw)
    return simulate(config=cfg, sps_table=FLAT,
                    policy=make_policy(policy, block_size=cfg.block_size, sps_table=FLAT, threshold=threshold))


def test_fixed_policy_matches_analytic_acceptance():
    # no noise, only code requests that never finish: tau = 1 + sum_j prod_{i<=j} p_i per request-step
    r = run("fixed", concurrency=64, steps=300, code_fraction=1.0, request_logit_sd=0.0, step_logit_sd=0.0,
            output_tokens=10**6)
    expected = 1 + sum(math.prod(DOMAINS["code"][: j + 1]) for j in range(7))
    assert r.tokens_per_step == pytest.approx(expected, abs=0.06)
    assert r.drafts_per_request == 7.0
    assert r.wasted_fraction == pytest.approx((7 - (expected - 1)) / 7, abs=0.01)
    # flat 50 steps/s: throughput is tokens per step x requests x 50
    assert r.throughput == pytest.approx(50 * 64 * r.tokens_per_step, rel=1e-9)


def test_threshold_one_verifies_nothing():
    r = run("threshold", threshold=1.0, concurrency=8, steps=50, output_tokens=10**6)
    assert (r.tokens_per_step, r.drafts_per_request, r.wasted_fraction) == (1.0, 0.0, 0.0)


def test_same_seed_same_result_and_chat_accepts_less():
    a = run("fixed", concurrency=16, steps=100, code_fraction=0.0)
    assert a == run("fixed", concurrency=16, steps=100, code_fraction=0.0)
    assert a.tokens_per_step < run("fixed", concurrency=16, steps=100, code_fraction=1.0).tokens_per_step


def test_stale_beats_verify_all_at_high_load_on_jagged_curve():
    table = synthetic_sps_table()
    res = {p: simulate(config=SimConfig(concurrency=256, steps=120), sps_table=table,
                       policy=make_policy(p, block_size=7, sps_table=table)) for p in ("fixed", "stale")}
    assert res["stale"].throughput > 1.05 * res["fixed"].throughput
    assert res["stale"].wasted_fraction < res["fixed"].wasted_fraction


def test_poisson_open_loop_serves_the_offered_load():
    # 2 req/s x 128 tokens mean = 256 tok/s offered, far below capacity: served throughput follows it
    r = simulate(config=SimConfig(arrival_rate=2.0, steps=3000, seed=3), sps_table=FLAT,
                 policy=make_policy("stale", block_size=7, sps_table=FLAT))
    assert r.finished > 20
    assert 200 < r.throughput < 320  # measured 256.5 with this seed


def test_bad_config_is_rejected():
    with pytest.raises(ValueError, match="block_size must be"):
        SimConfig(block_size=9)
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("greedy", block_size=7, sps_table=FLAT)


def test_cli_writes_table_json_png(tmp_path):
    assert main(["--concurrency", "1,4", "--steps", "20", "--policies", "fixed,stale",
                 "--out-dir", str(tmp_path)]) == 0
    assert "| stale | 4 |" in (tmp_path / "simulate.md").read_text()
    assert len(json.loads((tmp_path / "simulate.json").read_text())) == 4
    assert (tmp_path / "simulate.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("flag, value", [("--arrival-rate", "nan"), ("--arrival-rate", "inf"), ("--block-size", "-1"),
                                         ("--steps", "0"), ("--threshold", "nan"), ("--concurrency", "0")])
def test_cli_numbers_out_of_range_name_the_flag(tmp_path, capsys, flag, value):
    with pytest.raises(SystemExit) as exit_:
        main(["--out-dir", str(tmp_path / "sim"), flag, value])
    assert exit_.value.code == 2 and f"argument {flag}: expected" in capsys.readouterr().err
    assert not (tmp_path / "sim").exists()


def test_cli_paths_are_checked_before_any_run(tmp_path):
    (tmp_path / "afile").write_text("in the way\n")
    with pytest.raises(ValueError, match="--sps-table .* is a directory"):
        main(["--out-dir", str(tmp_path / "sim"), "--sps-table", str(tmp_path)])
    with pytest.raises(ValueError, match="--out-dir .* cannot be created: .*afile is a file"):
        main(["--out-dir", str(tmp_path / "afile" / "sim")])
