"""Sampling through HSPEC's drafting steps on the real SGLang (CPU tier) keeps the target's distribution.

One HSPEC server (the tiny Qwen3 target with its LM head scaled by 8, the `hspec_bigram` drafter of block 3,
HSPEC_SPECULATION=always: every decode step drafts and verifies) answers 1,200 requests of one prompt at
temperature 1 with 12 output tokens. (The unscaled tiny random target is near-flat at temperature 1 and its
sampled paths leave the ones the bigram drafter knows, so drafts would almost never be accepted; scaled by 8,
it samples at 1 what the unscaled one samples at 0.125, and its conditionals still range from 0.5 to 1.0.)
Output token 0 comes from prefill; tokens 1-11 all come from speculative steps: accepted
draft tokens, residual draws after a rejection at slot 1, 2 or 3, and bonus tokens after full accepts.
The test checks that each kind occurred (`spec_correct_drafts_histogram`: verify steps with 0, 1, 2 and 3
accepted drafts) and that the tokens follow the target exactly:

- every output token is mapped through its exact conditional distribution P(. | prompt, earlier outputs)
  (HF transformers, float64, tokens ordered by probability) with a randomised probability integral
  transform u = F(t-) + V * P(t), V ~ U(0, 1) from a fixed seed. If the server samples from
  the target's conditionals, the u of tokens 1-11 are independent U(0, 1) (Rosenblatt); a chi-square test
  over 20 equal bins (alpha 1e-3), pooled over tokens 1-11 and for each token on its own;
- the power of the pooled test is computed exactly (noncentral chi-square from the bin probabilities that
  a wrong rule gives, on the same prefixes) for one wrong rule: decode tokens drawn at temperature 2
  instead of 1. It must exceed 0.99, and the same samples read through that rule's conditionals must
  fail the test (a test of the test).
"""

from __future__ import annotations

import json

import pytest
import torch

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

BLOCK = 3
OUTPUT_TOKENS = 12  # 1 from prefill, 11 from speculative steps
PROMPT = 3  # builders.PROMPTS[3]: the bigram drafter's greedy path, so drafts are accepted in every number
PLUGINS = ("sglang_cpu_testing", "hspec")
SAMPLES = 1200
LOGIT_SCALE = 8  # conftest's target_x8; the unscaled tiny random target is near-flat at 1, where drafts are almost never accepted
TEMPERATURE = 1.0
WRONG_TEMPERATURE = 2.0
BINS = 20
ALPHA = 1e-3
SEED = 4321


@pytest.fixture(scope="module")
def sharp_target(tiny_checkpoints):
    return tiny_checkpoints["target_x8"]


@pytest.fixture(scope="module")
def always_server(sharp_target, tmp_path_factory):
    from sglang_cpu import builders
    from sglang_cpu import server as cpu_server

    root = tmp_path_factory.mktemp("speculative_sampling")
    # the Markov bias scaled with the LM head, so it still outweighs the random drafter's base logits
    draft = builders.build_hspec_draft(root / "hspec_bigram", sharp_target, bigram=True, strength=30.0 * LOGIT_SCALE)
    profile = root / "steps.json"
    srv = cpu_server.launch(
        sharp_target, log_path=root / "hspec_always.log", plugins=PLUGINS,
        args=["--speculative-algorithm", "HSPEC", "--speculative-draft-model-path", str(draft),
              "--random-seed", str(SEED)],
        env_extra={"HSPEC_SPECULATION": "always", "HSPEC_STEP_PROFILE": str(profile)},
        timeout=900,
    )
    yield srv, profile
    srv.stop()


def _conditionals(target_dir, prompt: str, outputs: torch.Tensor, temperature: float) -> torch.Tensor:
    """[samples, OUTPUT_TOKENS, vocab] float64: P(output j | prompt, outputs < j) at `temperature`."""
    from sglang_cpu import builders

    model = builders.load_target(target_dir)
    ids = torch.tensor(builders.load_tokenizer(target_dir).encode(prompt))
    seqs = torch.cat([ids.repeat(len(outputs), 1), outputs[:, :-1]], 1)
    with torch.no_grad():
        logits = torch.cat([model(chunk).logits[:, len(ids) - 1:].double() for chunk in seqs.split(300)])
    return torch.softmax(logits / temperature, -1)


def _pit_intervals(probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tokens ordered by probability (ties by id): the order, their probabilities and the start of each
    token's interval [lo, lo + p) in PIT space."""
    order = torch.argsort(probs, -1, descending=True)
    p_sorted = torch.gather(probs, -1, order)
    return order, p_sorted, torch.cumsum(p_sorted, -1) - p_sorted


def _pit_bin_probabilities(probs: torch.Tensor, true_probs: torch.Tensor) -> torch.Tensor:
    """[n, BINS]: the chance that the randomised PIT of a token lands in each bin when the token is drawn
    from `probs` [n, vocab] but transformed through `true_probs` [n, vocab] (both rows per sample)."""
    order, p_sorted, lo = _pit_intervals(true_probs)
    q_sorted = torch.gather(probs, -1, order)
    edges = torch.linspace(0, 1, BINS + 1, dtype=torch.float64)
    out = torch.zeros(probs.shape[0], BINS, dtype=torch.float64)
    for b in range(BINS):
        overlap = (torch.minimum(lo + p_sorted, edges[b + 1]) - torch.maximum(lo, edges[b])).clamp(min=0)
        out[:, b] = (q_sorted * overlap / p_sorted.clamp(min=1e-300)).sum(-1)
    return out


def _randomised_pit(probs: torch.Tensor, tokens: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """u = F(t-) + V * P(t) with tokens ordered by probability (ties by id), V ~ U(0, 1)."""
    order, _, below = _pit_intervals(probs)
    rank = torch.argsort(order, -1).gather(-1, tokens[:, None]).squeeze(-1)
    p_token = probs.gather(-1, tokens[:, None]).squeeze(-1)
    v = torch.rand(tokens.shape, generator=generator, dtype=torch.float64)
    return below.gather(-1, rank[:, None]).squeeze(-1) + v * p_token


def _chi2_uniform(u: torch.Tensor) -> tuple[float, float]:
    from scipy import stats

    observed = torch.histc(u.float(), bins=BINS, min=0.0, max=1.0).double()
    expected = u.numel() / BINS
    chi2 = float(((observed - expected) ** 2 / expected).sum())
    return chi2, float(stats.chi2.sf(chi2, BINS - 1))


def test_sharpened_target_samples_at_1_what_the_tiny_target_samples_at_one_eighth(tiny_checkpoints, sharp_target):
    from sglang_cpu import builders

    prompt = torch.tensor([builders.load_tokenizer(sharp_target).encode(builders.PROMPTS[PROMPT])])
    with torch.no_grad():
        sharp = builders.load_target(sharp_target)(prompt).logits.double()
        plain = builders.load_target(tiny_checkpoints["target"])(prompt).logits.double()
    assert torch.equal(sharp, plain * LOGIT_SCALE)  # exact: a power of two scales bf16 and fp32 exactly


def test_drafting_steps_sample_the_target_distribution_at_temperature_1(sharp_target, always_server):
    from scipy import stats
    from sglang_cpu import builders

    srv, profile = always_server
    prompt = builders.PROMPTS[PROMPT]
    outs = srv.generate([prompt] * SAMPLES, OUTPUT_TOKENS, temperature=TEMPERATURE, ignore_eos=True)
    steps = json.loads(profile.read_text())["steps"]
    print("decode steps by kind:", steps)
    assert steps["draft"] > 0 and steps.get("plain", 0) == 0, steps  # every decode step drafted

    outputs = torch.tensor([o["output_ids"] for o in outs])
    assert outputs.shape == (SAMPLES, OUTPUT_TOKENS)
    # every kind of speculative token occurred: rejections at each slot (residual draws) and full accepts
    # (bonus draws), summed over the requests' verify steps
    correct = torch.zeros(BLOCK + 1, dtype=torch.long)  # SGLang's histogram stops at the largest count seen
    for o in outs:
        hist = o["meta_info"]["spec_correct_drafts_histogram"]
        correct[:len(hist)] += torch.tensor(hist, dtype=torch.long)
    print("verify steps by number of accepted drafts 0..3:", correct.tolist())
    assert (correct >= 100).all(), correct

    probs = _conditionals(sharp_target, prompt, outputs, TEMPERATURE)
    generator = torch.Generator().manual_seed(SEED)
    u = torch.stack([_randomised_pit(probs[:, j], outputs[:, j], generator) for j in range(OUTPUT_TOKENS)], 1)
    decode_u = u[:, 1:]
    chi2, p_value = _chi2_uniform(decode_u.flatten())
    per_token = [_chi2_uniform(decode_u[:, j]) for j in range(OUTPUT_TOKENS - 1)]
    print(f"pooled tokens 1-{OUTPUT_TOKENS - 1}: chi2={chi2:.1f} dof={BINS - 1} p={p_value:.3g}; per token p:",
          [f"{p:.3g}" for _, p in per_token])

    # power against drawing decode tokens at the wrong temperature, on the same prefixes
    wrong = _conditionals(sharp_target, prompt, outputs, WRONG_TEMPERATURE)[:, 1:]
    n = decode_u.numel()
    wrong_bins = _pit_bin_probabilities(wrong.reshape(n, -1), probs[:, 1:].reshape(n, -1)).sum(0)
    expected = n / BINS
    noncentrality = float(((wrong_bins - expected) ** 2 / expected).sum())
    power = float(stats.ncx2.sf(stats.chi2.isf(ALPHA, BINS - 1), BINS - 1, noncentrality))
    print(f"power at alpha={ALPHA} against temperature {WRONG_TEMPERATURE}: {power:.4f}")
    assert power > 0.99, "the test would not catch a wrong temperature: raise SAMPLES"
    # and the test of the test on these very samples: read through the wrong rule's conditionals, they fail
    wrong_u = torch.stack([_randomised_pit(wrong[:, j], outputs[:, j + 1], generator)
                           for j in range(OUTPUT_TOKENS - 1)], 1)
    wrong_chi2, wrong_p = _chi2_uniform(wrong_u.flatten())
    print(f"the same samples against temperature {WRONG_TEMPERATURE}: chi2={wrong_chi2:.1f} p={wrong_p:.3g}")
    assert wrong_p < ALPHA, (wrong_chi2, wrong_p)

    assert p_value > ALPHA, (chi2, p_value)
    assert all(p > ALPHA for _, p in per_token), per_token
