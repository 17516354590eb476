"""Speculative sampling must reproduce the target's sampling distribution exactly."""

import itertools

import pytest
import torch
from scipy.stats import chisquare

from sglang_hspec.assets.tiny import tiny_target
from sglang_hspec.engine.drafters import SkewedDrafter
from sglang_hspec.engine.engine import SpeculativeEngine
from sglang_hspec.engine.sampling import sampling_probs
from sglang_hspec.engine.types import SamplingParams
from sglang_hspec.target.adapter import TargetAdapter

VOCAB = 10
PROMPT = [3, 1, 4]
SAMPLES = 20_000


def exact_first3(model, params):
    """P(t1, t2, t3) under plain sampling, by enumeration."""
    probs = {}
    with torch.no_grad():
        p1 = sampling_probs(model(torch.tensor([PROMPT])).logits[0, -1], params)
        seq2 = torch.tensor([PROMPT + [a] for a in range(VOCAB)])
        p2 = sampling_probs(model(seq2).logits[:, -1], params)
        seq3 = torch.tensor([PROMPT + [a, b] for a, b in itertools.product(range(VOCAB), repeat=2)])
        p3 = sampling_probs(model(seq3).logits[:, -1], params).view(VOCAB, VOCAB, VOCAB)
    for a, b, c in itertools.product(range(VOCAB), repeat=3):
        probs[(a, b, c)] = float(p1[a] * p2[a, b] * p3[a, b, c])
    return probs


def chi2_pvalue(counts, exact, n):
    cells = sorted(exact, key=exact.get, reverse=True)
    obs, exp, pooled_obs, pooled_exp = [], [], 0, 0.0
    for c in cells:
        e = exact[c] * n
        if e >= 5:
            obs.append(counts.get(c, 0))
            exp.append(e)
        else:
            pooled_obs += counts.get(c, 0)
            pooled_exp += e
    if pooled_exp > 0:
        obs.append(pooled_obs)
        exp.append(pooled_exp)
    exp = torch.tensor(exp, dtype=torch.float64)
    exp = exp * (sum(obs) / exp.sum())
    return chisquare(obs, exp.tolist()).pvalue, len(obs)


@pytest.mark.slow
@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, max_new_tokens=6, ignore_eos=True, seed=1234),
        SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=6, ignore_eos=True, seed=1234),
        SamplingParams(temperature=1.0, top_k=5, max_new_tokens=6, ignore_eos=True, seed=1234),
    ],
    ids=["t1.0", "t0.7-top_p0.9", "top_k5"],
)
def test_speculative_sampling_matches_target_distribution(params):
    model = tiny_target("llama", vocab_size=VOCAB, num_layers=2, hidden_size=32, head_dim=8, seed=7)
    exact = exact_first3(model, params)
    drafter = SkewedDrafter(VOCAB, block_size=3, seed=5)
    results = SpeculativeEngine(TargetAdapter(model), drafter).generate([PROMPT] * SAMPLES, params)
    counts = {}
    for r in results:
        key = tuple(r.output_ids[:3])
        counts[key] = counts.get(key, 0) + 1
    # outcomes the target can never produce (top-k / top-p cut them) must never appear
    impossible = sum(v for c, v in counts.items() if exact.get(c, 0.0) == 0.0)
    assert impossible == 0, f"{impossible} samples fell outside the target's support"
    pvalue, cells = chi2_pvalue(counts, exact, SAMPLES)
    assert cells > 20
    assert pvalue > 1e-3, f"speculative samples deviate from the target distribution (p={pvalue:.2e})"
    # the drafter is bad but not useless: both acceptances and rejections happened
    accepted = sum(sum(r.stats.slot_accepts) for r in results)
    attempted = sum(sum(r.stats.slot_attempts) for r in results)
    assert 0.05 < accepted / attempted < 0.95

    # negative control: the same test rejects samples drawn from the drafter's own q
    q = drafter.probs
    g = torch.Generator().manual_seed(0)
    draws = torch.stack([torch.multinomial(q[j], SAMPLES, replacement=True, generator=g) for j in range(3)], 1)
    q_counts = {}
    for row in draws.tolist():
        q_counts[tuple(row)] = q_counts.get(tuple(row), 0) + 1
    assert chi2_pvalue(q_counts, exact, SAMPLES)[0] < 1e-6
