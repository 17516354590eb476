"""SGLang's DSpark planner under HSPEC: with an SPS table and an STS file (both written by our code, in
SGLang's own JSON layouts) and SGLANG_RAGGED_VERIFY_MODE=compact, verify widths vary per request inside one
concurrent batch, and greedy output is still the target's.

Tiny Qwen3 target, the `hspec_bigram` drafter (block 3: verify widths 1..4, anchor included), six prompts
in one /generate call. The SPS table is crafted with a cliff: 100 steps/s up to 9 verify tokens per step,
1 step/s from 10 on. The planner maximises (N + admitted survivals) x SPS(N + budget), so with N requests
in a step the budget is min(9 - N, 3N) draft tokens: N = 6 leaves 3 extra tokens for 6 requests, which
the top-k over the current survivals hands to some requests and not to others.

Per-request widths are read from outside in two ways: `meta_info.spec_cap_lens_histogram` (SGLang counts,
per request, the steps verified at each width: `layout.verify_lens` of the compact layout), and the
planner's own per-step decision log (`SGLANG_DSPARK_DEBUG_CONFIDENCE_PREFIX_SCHEDULER=1`: one
`[DSPARK-CPS] num_reqs=N budget=B ...` line per step, then one `req=... verify_len=L ...` line per request).

The two decisions are our planner's (sglang_plugin/planner_hooks.py): under the same flag it logs each
budget (`[HSPEC-PLANNER] budget_choice num_reqs=N budget=B ...`) and each step's lengths
(`[HSPEC-PLANNER] topk_lengths num_reqs=N budget=B verify_lens=[...]`) right before SGLang's lines.
"""

from __future__ import annotations

import re

import pytest

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

MAX_NEW = 32
BLOCK = 3  # the tiny H-Spec drafter's block: widths 1..BLOCK + 1
CLIFF_TOKENS = 10  # SPS falls 100x at this many verify tokens per step
STS_TEMPERATURES = [1.0, 0.8, 1.25]

_STEP = re.compile(r"\[DSPARK-CPS\] num_reqs=(\d+) budget=(\d+) gamma=(\d+)")
_ROW = re.compile(r"\[DSPARK-CPS\]\s+req=(\d+) prefix=(\d+) verify_len=(\d+)")
_OUR_BUDGET = re.compile(r"\[HSPEC-PLANNER\] budget_choice num_reqs=(\d+) budget=(\d+)")
_OUR_LENS = re.compile(r"\[HSPEC-PLANNER\] topk_lengths num_reqs=(\d+) budget=(\d+) verify_lens=\[([\d, ]*)\]")


def planner_steps(log: str) -> list[dict]:
    """The planner's per-step decisions from the server log: [{num_reqs, budget, verify_lens}]."""
    steps: list[dict] = []
    ours = None  # our planner's last lengths decision (logged just before SGLang's step line)
    for line in log.splitlines():
        if m := _OUR_LENS.search(line):
            ours = {"num_reqs": int(m[1]), "budget": int(m[2]), "verify_lens": [int(x) for x in m[3].split(",")]}
        elif m := _STEP.search(line):
            steps.append({"num_reqs": int(m[1]), "budget": int(m[2]), "verify_lens": [], "ours": ours})
            ours = None
        elif (m := _ROW.search(line)) and steps:
            steps[-1]["verify_lens"].append(int(m[3]))
    return [s for s in steps if len(s["verify_lens"]) == s["num_reqs"]]  # drop a step cut off by stop()


@pytest.fixture(scope="module")
def planner_files(tmp_path_factory):
    """The SPS table and the STS file, written by sglang_hspec.scheduler and sglang_hspec.calibration."""
    from sglang_hspec.calibration import StsCalibration, save_sts
    from sglang_hspec.scheduler.sps import SpsCostTable, save_sps_table

    root = tmp_path_factory.mktemp("planner_files")
    sps, sts = root / "sps.json", root / "sts.json"
    save_sps_table(SpsCostTable(sample_batch_tokens=[1, CLIFF_TOKENS], sample_steps_per_sec=[100.0, 1.0],
                                max_batch_tokens=48 * (BLOCK + 1)), sps)
    save_sts(StsCalibration(temperatures=STS_TEMPERATURES, dataset="crafted for the planner test"), sts)
    return sps, sts


@pytest.fixture(scope="module")
def planner_run(tiny_checkpoints, planner_files, tmp_path_factory):
    """One HSPEC server per module (compact verify, SPS table, STS file, planner decision log): started,
    sent the six prompts in one /generate call, stopped."""
    from sglang_cpu import builders
    from sglang_cpu import server as cpu_server

    root = tmp_path_factory.mktemp("planner_server")
    draft = builders.build_hspec_draft(root / "hspec_bigram", tiny_checkpoints["target"], bigram=True)
    sps, sts = planner_files
    srv = cpu_server.launch(
        tiny_checkpoints["target"], log_path=root / "hspec_planner.log",
        plugins=("sglang_cpu_testing", "hspec"),
        args=["--speculative-algorithm", "HSPEC", "--speculative-draft-model-path", str(draft),
              "--speculative-dspark-sps-table-path", str(sps),
              "--speculative-dspark-confidence-sts-path", str(sts)],
        env_extra={"SGLANG_RAGGED_VERIFY_MODE": "compact", "SGLANG_DSPARK_DEBUG_CONFIDENCE_PREFIX_SCHEDULER": "1"},
    )
    try:
        outs = srv.generate(builders.PROMPTS, MAX_NEW)
    finally:
        srv.stop()
    return {"outs": outs, "log": srv.log()}


def test_planner_loaded_our_files(planner_run, planner_files):
    log = planner_run["log"]
    sps, sts = planner_files
    assert f"DSpark STS calibration loaded from {sts}" in log
    assert "DSpark ragged-verify scheduler enabled (mode=compact" in log and f"sps_table={sps}" in log
    assert "SPS table is uninitialized" not in log


def test_verify_widths_vary_within_a_batch(planner_run):
    steps = planner_steps(planner_run["log"])
    assert steps, "no [DSPARK-CPS] planner decisions in the server log"
    for s in steps:
        n, lens = s["num_reqs"], s["verify_lens"]
        # the SPS cliff fixes the budget by hand: every draft token that keeps the step under 10 tokens
        assert s["budget"] == min(CLIFF_TOKENS - 1 - n, BLOCK * n), s
        assert sum(lens) == n + s["budget"], s
        assert all(1 <= w <= BLOCK + 1 for w in lens), s
    mixed = [s for s in steps if len(set(s["verify_lens"])) > 1]
    print("planner steps (num_reqs, budget, verify_lens):",
          [(s["num_reqs"], s["budget"], s["verify_lens"]) for s in steps])
    # six concurrent requests get 3 extra tokens: some verify 2 tokens, the rest the anchor only
    assert any(s["num_reqs"] == 6 and sorted(s["verify_lens"]) == [1, 1, 1, 2, 2, 2] for s in mixed), steps[:5]
    # and which requests get them changes from step to step (the top-k follows the confidences)
    assert len({tuple(s["verify_lens"]) for s in mixed}) > 1, mixed[:5]


def test_our_planner_made_the_decisions(planner_run):
    log = planner_run["log"]
    assert "HSPEC: verify budget and per-request verify lengths from sglang_hspec.scheduler.planner" in log
    steps = planner_steps(log)
    assert steps
    for s in steps:  # every step's lengths: our topk_lengths, read back by SGLang's own log
        assert s["ours"] == {k: s[k] for k in ("num_reqs", "budget", "verify_lens")}, s
    # every step's budget: one of our budget_choice decisions, in order
    budgets = iter((int(m[1]), int(m[2])) for m in _OUR_BUDGET.finditer(log))
    assert all((s["num_reqs"], s["budget"]) in budgets for s in steps), "a budget not from budget_choice"
    print(f"{len(steps)} steps planned by sglang_hspec.scheduler.planner")


def test_per_request_widths_in_meta_info(planner_run):
    hists = [o["meta_info"].get("spec_cap_lens_histogram") for o in planner_run["outs"]]
    assert all(h for h in hists), hists
    print("spec_cap_lens_histogram per request:", hists)
    print("spec_cap_length per request:", [o["meta_info"].get("spec_cap_length") for o in planner_run["outs"]])
    for o, h in zip(planner_run["outs"], hists):
        m = o["meta_info"]
        assert len(h) <= BLOCK + 2 and h[0] == 0, h  # index = verify width, anchor included (1..BLOCK + 1)
        assert sum(h) == m["spec_verify_ct"], (h, m)
        assert m["spec_cap_length"] == pytest.approx(sum(w * c for w, c in enumerate(h)) / sum(h)), (h, m)
    # each request verified at more than one width over its life
    assert all(sum(1 for c in h if c) > 1 for h in hists), hists
    # and the requests did not all see the same mix of widths
    assert len({tuple(h) for h in hists}) > 1, hists


def test_planner_greedy_equals_nonspec(tiny_checkpoints, planner_run):
    from sglang_cpu import builders

    golden = builders.hf_greedy(tiny_checkpoints["target"], builders.PROMPTS, MAX_NEW)
    outs = planner_run["outs"]
    assert [o["output_ids"] for o in outs] == golden
    accept = [o["meta_info"]["spec_accept_length"] for o in outs]
    assert all(1.0 <= a <= BLOCK + 1 for a in accept), accept
    print("spec_accept_length per request:", accept)
