"""Steps without drafting at stride 1 (`HSpecWorkerV2._forward_plain`, sglang_plugin/plain_step.py), served by
the real SGLang on CPU, and their fallback to DSpark's anchor-only path.

One HSPEC server that never drafts (HSPEC_SPECULATION=never; the default static verify mode, which the SPS
profiler's plain probes use; overlap scheduling off, so the worker gets no `on_publish`), whose steps run the
target forward a GPU runs (HSPEC_PLAIN_STEP_FORWARD=verify: TARGET_VERIFY over the compact anchors; on CPU the
default is a DECODE forward, which test_sglang_speculation_switch.py's server runs), with the worker's step
profile (HSPEC_STEP_PROFILE):

- greedy: six prompts in one /generate call and then one by one equal HF transformers' float32 greedy output,
  every decode step is a step without drafting that verifies one token and commits one, and the steps ran
  the stride-1 path: no proposer segment (`draft`) in the plain steps' profile, which the anchor-only path
  always has (its stand-in proposer is timed as `draft`);
- a request with logprobs (which the stride-1 path does not compute) falls back to the anchor-only path, says
  so in the log once, and returns the same tokens with one logprob each.

Sampling at temperature 1 through the stride-1 path is checked against the target's exact distribution by
test_sglang_speculation_switch.py (its steps without drafting take this path; overlap on); the bonus draw
itself by test_plain_step.py.
"""

from __future__ import annotations

import json
import math

import pytest

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

MAX_NEW = 24
PLUGINS = ("sglang_cpu_testing", "hspec")
STRIDE_1_LOG = "HSPEC: steps without drafting verify the anchors (TARGET_VERIFY, compact layout), read at stride 1"
LOGPROB_FALLBACK_LOG = "HSPEC: a step without drafting takes DSpark's anchor-only path: logprobs requested"


@pytest.fixture(scope="module")
def never_server(tiny_checkpoints, tmp_path_factory):
    from sglang_cpu import builders
    from sglang_cpu import server as cpu_server

    root = tmp_path_factory.mktemp("plain_step_server")
    draft = builders.build_hspec_draft(root / "hspec", tiny_checkpoints["target"])
    profile = root / "steps.json"
    srv = cpu_server.launch(
        tiny_checkpoints["target"], log_path=root / "hspec_never.log", plugins=PLUGINS,
        args=["--speculative-algorithm", "HSPEC", "--speculative-draft-model-path", str(draft),
              "--disable-overlap-schedule"],
        env_extra={"HSPEC_SPECULATION": "never", "HSPEC_PLAIN_STEP_FORWARD": "verify",
                   "HSPEC_STEP_PROFILE": str(profile)},
        timeout=900,
    )
    yield srv, profile
    srv.stop()


@pytest.fixture(scope="module")
def golden(tiny_checkpoints):
    from sglang_cpu import builders

    return builders.hf_greedy(tiny_checkpoints["target"], builders.PROMPTS, MAX_NEW)


def _profile(path) -> dict:
    return json.loads(path.read_text())


def test_never_greedy_equals_hf_through_the_stride_1_path(never_server, golden):
    from sglang_cpu import builders

    srv, profile = never_server
    batched = srv.generate(builders.PROMPTS, MAX_NEW)
    one_by_one = [srv.generate([p], MAX_NEW)[0] for p in builders.PROMPTS]
    assert [o["output_ids"] for o in batched] == golden
    assert [o["output_ids"] for o in one_by_one] == golden
    for o in batched + one_by_one:  # the first token comes from the prefill, then one per decode step
        meta = o["meta_info"]
        assert meta["spec_verify_ct"] == MAX_NEW - 1, meta
        assert meta["spec_cap_lens_histogram"] == [0, MAX_NEW - 1], meta  # every step verified the anchor alone
    steps = _profile(profile)
    print("decode steps by kind:", steps["steps"], "plain-step segments:", sorted(steps["seconds"]["plain"]))
    assert steps["steps"]["draft"] == 0 and steps["steps"]["plain"] >= 7 * (MAX_NEW - 1), steps["steps"]
    plain = steps["seconds"]["plain"]
    assert "draft" not in plain, plain  # no proposer ran: not the anchor-only path
    assert plain["verify"] > 0 and plain["accept"] > 0 and plain["commit"] > 0, plain
    log = srv.log()
    assert log.count(STRIDE_1_LOG) == 1
    assert "as a DECODE forward" not in log and "takes DSpark's anchor-only path" not in log


def test_logprob_request_falls_back_to_the_anchor_only_path(never_server, golden):
    from sglang_cpu import builders

    srv, profile = never_server
    before = _profile(profile)
    params = {"temperature": 0.0, "max_new_tokens": MAX_NEW, "ignore_eos": True}
    out = srv.post("/generate", {"text": builders.PROMPTS[0], "sampling_params": params, "return_logprob": True})
    after = _profile(profile)
    assert out["output_ids"] == golden[0]
    logprobs = out["meta_info"]["output_token_logprobs"]  # (logprob, token id, text) per output token
    assert [entry[1] for entry in logprobs] == golden[0]
    assert all(math.isfinite(entry[0]) and entry[0] <= 0.0 for entry in logprobs), logprobs
    assert after["steps"]["plain"] - before["steps"]["plain"] == MAX_NEW - 1
    # the anchor-only path ran its stand-in proposer (timed as `draft`) on each of these steps
    assert after["seconds"]["plain"].get("draft", 0.0) > 0.0, after["seconds"]["plain"]
    assert srv.log().count(LOGPROB_FALLBACK_LOG) == 1
