"""KV memory at one budget: HSPEC's target reserves no drafter KV (sglang_plugin/hooks.py), so at the same
KV byte budget it holds as many tokens as the non-speculative server, and (L_t + L_d) / L_t times as many
as SGLang's DSPARK, whose pool shares the budget with L_d drafter layers of the target's KV geometry.

The budget is fixed through the CPU plugin (SGLANG_CPU_TESTING_KV_BUDGET_MB) instead of SGLang's CPU
default (free host RAM x --mem-fraction-static), which other processes move between launches; no
--max-total-tokens, so SGLang's own pool sizing picks the token counts."""

from __future__ import annotations

import json

import pytest

from sglang_hspec.sglang_plugin.hooks import tokens_with_reservation

BUDGET_MB = 64
PLUGINS = ("sglang_cpu_testing", "hspec")  # the HSPEC hooks are loaded for every server, DSPARK too


def test_tokens_with_reservation_hand_computed():
    # 2 target layers, 4 drafter layers: the budget of 65536 target-only tokens holds 65536 * 2 / 6
    assert tokens_with_reservation(tokens=65536, target_layers=2, draft_layers=4) == 21845
    # SmolLM2 (30 layers) with a 5-layer drafter, page 16: 6000 * 30 / 35 = 5142.9 -> 5136
    assert tokens_with_reservation(tokens=6000, target_layers=30, draft_layers=5, page_size=16) == 5136
    assert tokens_with_reservation(tokens=4096, target_layers=2, draft_layers=0) == 4096


def _config(path) -> dict:
    return json.loads((path / "config.json").read_text())


@pytest.mark.sglang
@pytest.mark.slow
def test_hspec_holds_more_kv_tokens_than_dspark_at_one_budget(tiny_checkpoints, sglang_server, tmp_path):
    from sglang_cpu import builders

    target = tiny_checkpoints["target"]
    dspark = tiny_checkpoints["dspark_exported"]
    hspec = builders.build_hspec_draft(tmp_path / "hspec", target)
    t, d, h = _config(target), _config(dspark), _config(hspec)
    # Both drafts carry the target's KV geometry, so SGLang prices a drafter layer as a target layer.
    for cfg in (d, h):
        assert (cfg["num_key_value_heads"], cfg["head_dim"]) == (t["num_key_value_heads"], t["head_dim"])
    L_t, L_d = t["num_hidden_layers"], d["num_hidden_layers"]
    assert (L_t, L_d, h["num_hidden_layers"]) == (2, 5, 4)

    budget = BUDGET_MB * 2**20
    layer_bytes = 2 * t["num_key_value_heads"] * t["head_dim"] * 4  # K + V per token per layer, float32
    expect_target_only = budget // (L_t * layer_bytes)  # 67108864 // 1024 = 65536
    expect_dspark = budget // ((L_t + L_d) * layer_bytes)  # 67108864 // 3584 = 18724

    def tokens(name, args=()):
        srv = sglang_server(target, name=name, args=list(args), plugins=PLUGINS, max_total_tokens=None,
                            env_extra={"SGLANG_CPU_TESTING_KV_BUDGET_MB": str(BUDGET_MB)})
        n = srv.get("/server_info")["max_total_num_tokens"]
        assert f"max_total_num_tokens={n}," in srv.log()  # the scheduler's own startup line agrees
        srv.stop()  # one server at a time
        return n, srv.log()

    n_none, _ = tokens("kv_nonspec")
    n_hspec, hspec_log = tokens("kv_hspec", ["--speculative-algorithm", "HSPEC",
                                             "--speculative-draft-model-path", str(hspec)])
    n_dspark, dspark_log = tokens("kv_dspark", ["--speculative-algorithm", "DSPARK",
                                                "--speculative-draft-model-path", str(dspark)])

    assert (n_none, n_hspec, n_dspark) == (expect_target_only, expect_target_only, expect_dspark)
    assert n_hspec / n_dspark == pytest.approx((L_t + L_d) / L_t, abs=(L_t + L_d) / L_t / n_dspark)
    # Without the hook HSPEC would reserve its 4 drafter layers: 65536 * 2 / 6 tokens; the startup log says so.
    reserved = tokens_with_reservation(tokens=n_hspec, target_layers=L_t, draft_layers=h["num_hidden_layers"])
    assert reserved == budget // ((L_t + h["num_hidden_layers"]) * layer_bytes)
    assert (f"HSPEC: the KV pool reserves no drafter KV: {n_hspec} KV tokens instead of ~{reserved} with "
            f"SGLang's reservation of 4 drafter layers") in hspec_log
    assert "HSPEC: the KV pool" not in dspark_log  # the hook leaves other algorithms alone
