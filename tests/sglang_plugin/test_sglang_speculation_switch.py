"""HSPEC_SPECULATION=auto served by the real SGLang on CPU: steps without drafting are lossless.

One HSPEC server (the tiny Qwen3 target with its LM head x8, the `hspec_bigram` drafter of block 3, SGLANG_RAGGED_VERIFY_MODE=compact)
with an SPS table whose plain-decode probes make plain decoding 100x faster than any speculative step, so
the switch (sglang_hspec.scheduler.switch.decide_speculation) decodes without drafting except on its probe
steps (the first decode step, then every 4, 8, 16, ... steps). The worker's step profile
(HSPEC_STEP_PROFILE) counts both kinds, so the test knows that both ran.

- greedy: six prompts in one /generate call and then one by one equal HF transformers' float32 greedy
  output (which the non-speculative server reproduces: test_sglang_cpu_e2e.py);
- sampling (temperature 1): the first decoded token (the second output token) of 1,200 requests of one
  prompt, against the target's exact distribution computed with HF transformers, by a chi-square test
  (alpha 1e-3; its power against drawing at temperature 1.2 instead is computed and must exceed 0.99). The
  LM head x8 keeps the target peaked at temperature 1 (the unscaled random target is near-flat there). These
  tokens come from steps without drafting (after the greedy test the probe interval has grown past the ~25
  decode steps this takes); a drafting step's sampling is SGLang's own DSpark path.

Steps without drafting take the stride-1 path here (`HSpecWorkerV2._forward_plain`), with the CPU default
forward (DECODE); its TARGET_VERIFY forward and its fallback to DSpark's anchor-only path:
test_sglang_plain_step.py.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

MAX_NEW = 32
BLOCK = 3
PLUGINS = ("sglang_cpu_testing", "hspec")
SAMPLES = 1200
TEMPERATURE = 1.0
WRONG_TEMPERATURE = 1.2
SEED = 1234


@pytest.fixture(scope="module")
def auto_server(tiny_checkpoints, tmp_path_factory):
    from sglang_cpu import builders
    from sglang_cpu import server as cpu_server
    from sglang_hspec.calibration import StsCalibration, save_sts
    from sglang_hspec.scheduler.sps import SpsCostTable, save_sps_table

    root = tmp_path_factory.mktemp("switch_server")
    draft = builders.build_hspec_draft(root / "hspec_bigram", tiny_checkpoints["target_x8"], bigram=True, strength=240.0)
    sps, sts, profile = root / "sps.json", root / "sts.json", root / "steps.json"
    # speculative steps at 10 steps/s whatever their size, plain ones at 1000: plain always wins
    save_sps_table(SpsCostTable(sample_batch_tokens=[1, 2], sample_steps_per_sec=[10.0, 10.0],
                                max_batch_tokens=48 * (BLOCK + 1),
                                plain_batch_sizes=[1], plain_steps_per_sec=[1000.0]), sps)
    save_sts(StsCalibration(temperatures=[1.0, 1.0, 1.0], dataset="identity, for the switch test"), sts)
    srv = cpu_server.launch(
        tiny_checkpoints["target_x8"], log_path=root / "hspec_auto.log", plugins=PLUGINS,
        args=["--speculative-algorithm", "HSPEC", "--speculative-draft-model-path", str(draft),
              "--speculative-dspark-sps-table-path", str(sps), "--speculative-dspark-confidence-sts-path", str(sts),
              "--random-seed", str(SEED)],
        env_extra={"SGLANG_RAGGED_VERIFY_MODE": "compact", "HSPEC_SPECULATION": "auto", "HSPEC_STEP_PROFILE": str(profile)},
        timeout=900,
    )
    yield srv, profile
    srv.stop()


def _kinds(profile) -> dict[str, int]:
    return json.loads(profile.read_text())["steps"]


def test_auto_greedy_equals_plain_decoding(tiny_checkpoints, auto_server):
    from sglang_cpu import builders

    srv, profile = auto_server
    golden = builders.hf_greedy(tiny_checkpoints["target_x8"], builders.PROMPTS, MAX_NEW)
    batched = srv.generate(builders.PROMPTS, MAX_NEW)
    one_by_one = [srv.generate([p], MAX_NEW)[0] for p in builders.PROMPTS]
    assert [o["output_ids"] for o in batched] == golden
    assert [o["output_ids"] for o in one_by_one] == golden
    kinds = _kinds(profile)
    print("decode steps by kind:", kinds)
    assert kinds["plain"] > kinds["draft"] > 0, kinds  # mostly without drafting, probes in between
    # ... at stride 1: no stand-in proposer ran (test_sglang_plain_step.py)
    assert "draft" not in json.loads(profile.read_text())["seconds"]["plain"]
    log = srv.log()
    assert "HSPEC: speculation policy auto (HSPEC_SPECULATION)" in log
    assert "HSPEC: steps without drafting run the anchors as a DECODE forward, read at stride 1" in log
    for o in one_by_one:  # per request: mostly anchor-only verifies (width 1), a probe now and then
        hist = o["meta_info"]["spec_cap_lens_histogram"]
        assert hist[1] > sum(hist[2:]), hist


def _exact_second_token_distribution(target_dir, prompt: str, temperature: float) -> torch.Tensor:
    """P(second output token) = sum_t1 P(t1 | prompt) P(t2 | prompt, t1), at `temperature`, float64."""
    from sglang_cpu import builders

    model = builders.load_target(target_dir)
    ids = builders.load_tokenizer(target_dir).encode(prompt)
    with torch.no_grad():
        first = torch.softmax(model(torch.tensor([ids])).logits[0, -1].double() / temperature, -1)
        vocab = first.numel()
        batch = torch.tensor(ids).repeat(vocab, 1)
        batch = torch.cat([batch, torch.arange(vocab)[:, None]], 1)
        second = torch.cat([torch.softmax(model(chunk).logits[:, -1].double() / temperature, -1)
                            for chunk in batch.split(256)])
    return first @ second


def test_auto_sampling_matches_the_target_distribution(tiny_checkpoints, auto_server):
    from scipy import stats
    from sglang_cpu import builders

    srv, profile = auto_server
    prompt = builders.PROMPTS[0]
    before = _kinds(profile)
    outs = srv.generate([prompt] * SAMPLES, 2, temperature=TEMPERATURE)
    after = _kinds(profile)
    steps = {k: after[k] - before[k] for k in after}
    print("decode steps by kind while sampling:", steps)
    assert steps["plain"] > 0, steps  # the first decoded tokens came (mostly) from steps without drafting
    second = torch.tensor([o["output_ids"][1] for o in outs])
    p = _exact_second_token_distribution(tiny_checkpoints["target_x8"], prompt, TEMPERATURE)
    # bins: every token with an expected count >= 5, the rest pooled
    expected = SAMPLES * p
    big = torch.nonzero(expected >= 5).flatten()
    observed = torch.bincount(second, minlength=p.numel()).double()
    obs = torch.cat([observed[big], (observed.sum() - observed[big].sum()).view(1)])
    exp = torch.cat([expected[big], (SAMPLES - expected[big].sum()).view(1)])
    dof = obs.numel() - 1
    chi2 = float(((obs - exp) ** 2 / exp).sum())
    p_value = float(stats.chi2.sf(chi2, dof))
    # power, stated for one wrong rule: the second token drawn at WRONG_TEMPERATURE instead
    wrong = _exact_second_token_distribution(tiny_checkpoints["target_x8"], prompt, WRONG_TEMPERATURE) * SAMPLES
    wrong_bins = torch.cat([wrong[big], (SAMPLES - wrong[big].sum()).view(1)])
    noncentrality = float(((wrong_bins - exp) ** 2 / exp).sum())
    power = float(stats.ncx2.sf(stats.chi2.isf(1e-3, dof), dof, noncentrality))
    print(f"chi2={chi2:.1f} dof={dof} p={p_value:.3g}; power at alpha=1e-3 against temperature "
          f"{WRONG_TEMPERATURE}: {power:.3f}")
    assert power > 0.99, "the test would not catch a wrong temperature: raise SAMPLES"
    assert p_value > 1e-3, (chi2, dof)
    assert math.isfinite(chi2)
