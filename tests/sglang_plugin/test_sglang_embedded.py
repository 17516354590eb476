"""HSPEC on the embedded target (SmolLM2-135M-Instruct) with the shipped drafter, through the CPU tier:
greedy float32 output equals the non-speculative server on 10 MT-Bench prompts x 64 tokens, and
SGLang's accept length matches the reference engine's tau on the same prompts (fixed full-block verify).

With prompt lookup spliced in (HSPEC_LOOKUP=1, overlap scheduling off): the same outputs, and the same
verify steps as the reference engine's shipped+lookup request by request; under the prefix scheduler
(compact mode), the same outputs.

Each server is started, sent all prompts in one /generate call and stopped before anything else runs, so
no two servers share the two cores."""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = [pytest.mark.sglang, pytest.mark.slow, pytest.mark.integration]

N_PROMPTS, MAX_NEW = 10, 64
SHIPPED_STS = Path(__file__).resolve().parents[2] / "docs" / "results" / "calibration" / "sts_hspec_smollm2.json"


@pytest.fixture(scope="module")
def embedded_prompts():
    from transformers import AutoTokenizer

    from sglang_hspec.assets.embedded import embedded_target_dir
    from sglang_hspec.assets.prompts import chat_input_ids, load_prompts

    target = embedded_target_dir()
    tok = AutoTokenizer.from_pretrained(target)
    ids = [chat_input_ids(tok, it.messages(0)) for it in load_prompts("mtbench", limit=N_PROMPTS)]
    return target, ids


def serve_hspec(embedded_prompts, log_path, *, args=(), env_extra=None) -> dict:
    """Start an HSPEC server with the shipped drafter, send all prompts in one /generate call, stop it:
    its outputs and log."""
    from sglang_cpu import server as cpu_server

    from sglang_hspec.engine.loading import SHIPPED_DRAFTER_DIR

    target, prompts = embedded_prompts
    srv = cpu_server.launch(target, log_path=log_path, plugins=("sglang_cpu_testing", "hspec"), env_extra=env_extra,
                            args=["--speculative-algorithm", "HSPEC", "--speculative-draft-model-path",
                                  str(SHIPPED_DRAFTER_DIR), *args])
    try:
        outs = srv.generate(prompts, MAX_NEW)
    finally:
        srv.stop()
    return {"outs": outs, "log": srv.log()}


@pytest.fixture(scope="module")
def hspec_run(embedded_prompts, tmp_path_factory):
    """The module's drafter-only HSPEC server (static full-block verify, the default): outputs and log."""
    return serve_hspec(embedded_prompts, tmp_path_factory.mktemp("embedded_hspec") / "server.log")


def test_hspec_on_embedded_target_equals_nonspec(embedded_prompts, hspec_run, sglang_server):
    target, prompts = embedded_prompts
    base = sglang_server(target, name="embedded_nonspec")
    golden = [o["output_ids"] for o in base.generate(prompts, MAX_NEW)]
    base.stop()
    outs = hspec_run["outs"]
    assert [o["output_ids"] for o in outs] == golden
    accept = [o["meta_info"]["spec_accept_length"] for o in outs]
    assert all(1.0 <= a <= 8.0 for a in accept), accept
    # the shipped drafter accepts some drafts (the reference engine measures tau 1.26 on MT-Bench)
    assert sum(accept) / len(accept) > 1.1, accept
    assert "no drafter KV cache allocated" in hspec_run["log"]


def test_accept_length_matches_reference_engine_tau(embedded_prompts, hspec_run, record_property):
    """SGLang 0.5.23 reports, per request, spec_accept_length = completion_tokens / spec_verify_ct
    (tokenizer_manager._calculate_spec_decoding_metrics): the numerator counts every output token, so the
    first token (sampled by the prefill) and each step's bonus token are in; the verify count is one per
    decode step that found the request unfinished (batch_result_processor). Our engine's own `tau` is
    accepted + bonus per verify step without the prefill token; the same definition as SGLang's on the
    engine is len(output_ids) / verify steps. Both sides: mean over the prompts of the per-request value."""
    from sglang_hspec.core.types import SamplingParams
    from sglang_hspec.engine.engine import SpeculativeEngine
    from sglang_hspec.engine.loading import SHIPPED_DRAFTER_DIR, load_drafter_spec
    from sglang_hspec.target.loading import load_target

    _, prompts = embedded_prompts
    adapter = load_target("embedded", dtype="float32")
    drafter = load_drafter_spec(str(SHIPPED_DRAFTER_DIR), adapter)
    assert drafter.block_size == 7
    engine = SpeculativeEngine(adapter, drafter)  # full_block_policy: verify all k = 7 drafts every step
    ref = engine.generate(prompts, SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True))

    outs = hspec_run["outs"]
    assert [r.output_ids for r in ref] == [o["output_ids"] for o in outs]  # same tokens from the same ids
    metas = [o["meta_info"] for o in outs]
    for m in metas:
        assert m["completion_tokens"] == MAX_NEW
        assert m["spec_accept_length"] == pytest.approx(m["completion_tokens"] / m["spec_verify_ct"])
    steps_sglang = [m["spec_verify_ct"] for m in metas]
    steps_ref = [r.stats.num_steps for r in ref]
    tau_sglang = sum(m["spec_accept_length"] for m in metas) / len(metas)
    tau_ref = sum(len(r.output_ids) / r.stats.num_steps for r in ref) / len(ref)
    engine_tau = sum(r.stats.tau for r in ref) / len(ref)  # the engine's own definition, for the record
    record_property("tau_sglang", tau_sglang)
    record_property("tau_ref", tau_ref)
    print(f"tau_sglang={tau_sglang:.4f} tau_ref={tau_ref:.4f} (engine tau {engine_tau:.4f}); "
          f"verify steps sglang={steps_sglang} ref={steps_ref}")
    assert abs(tau_sglang - tau_ref) / tau_ref <= 0.05, (tau_sglang, tau_ref)
    # identical drafts and greedy verify: the step counts agree request by request (a one-step slack for a
    # draft near-tie between SGLang's and the engine's float32 drafter forward)
    assert all(abs(a - b) <= 1 for a, b in zip(steps_sglang, steps_ref)), (steps_sglang, steps_ref)


@pytest.fixture(scope="module")
def hspec_lookup_run(embedded_prompts, tmp_path_factory):
    """An HSPEC server with prompt lookup spliced in (HSPEC_LOOKUP=1, overlap off as it requires)."""
    return serve_hspec(embedded_prompts, tmp_path_factory.mktemp("embedded_hspec_lookup") / "server.log",
                       args=["--disable-overlap-schedule"], env_extra={"HSPEC_LOOKUP": "1"})


def test_lookup_splice_serves_what_the_reference_engine_splices(embedded_prompts, hspec_lookup_run, hspec_run):
    """HSPEC_LOOKUP=1 against the reference engine's `shipped+lookup` on the same prompts: the same outputs
    (plain greedy's, as the drafter-only server's), the same verify steps per request (a one-step slack for a
    float32 draft near-tie, as above), so the same splices; and more tokens per step than the drafter alone."""
    from sglang_hspec.core.types import SamplingParams
    from sglang_hspec.engine.engine import SpeculativeEngine
    from sglang_hspec.engine.loading import SHIPPED_DRAFTER_DIR, load_drafter_spec
    from sglang_hspec.target.loading import load_target

    _, prompts = embedded_prompts
    adapter = load_target("embedded", dtype="float32")
    drafter = load_drafter_spec(str(SHIPPED_DRAFTER_DIR) + "+lookup", adapter)
    ref = SpeculativeEngine(adapter, drafter).generate(prompts, SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True))
    assert drafter.spliced_rows > 0
    outs = hspec_lookup_run["outs"]
    assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in hspec_run["outs"]]
    assert [r.output_ids for r in ref] == [o["output_ids"] for o in outs]
    steps_sglang = [o["meta_info"]["spec_verify_ct"] for o in outs]
    steps_ref = [r.stats.num_steps for r in ref]
    print(f"verify steps with lookup: sglang={steps_sglang} ref={steps_ref}; without: "
          f"{[o['meta_info']['spec_verify_ct'] for o in hspec_run['outs']]}")
    assert all(abs(a - b) <= 1 for a, b in zip(steps_sglang, steps_ref)), (steps_sglang, steps_ref)
    assert sum(steps_sglang) < sum(o["meta_info"]["spec_verify_ct"] for o in hspec_run["outs"])
    assert "prompt lookup spliced into argmax-drafted blocks" in hspec_lookup_run["log"]


def test_lookup_splice_under_the_prefix_scheduler(embedded_prompts, hspec_run, tmp_path):
    """Compact mode: SGLang's prefix scheduler picks verify lengths from the confidences, which the splice
    rewrites for spliced slots; outputs stay plain decoding's."""
    run = serve_hspec(embedded_prompts, tmp_path / "server.log",
                      args=["--disable-overlap-schedule", "--speculative-dspark-confidence-sts-path", str(SHIPPED_STS)],
                      env_extra={"HSPEC_LOOKUP": "1", "SGLANG_RAGGED_VERIFY_MODE": "compact"})
    assert [o["output_ids"] for o in run["outs"]] == [o["output_ids"] for o in hspec_run["outs"]]
    assert "prompt lookup spliced into argmax-drafted blocks" in run["log"]
