"""Speculative sampling reproduces plain sampling's distribution exactly, at every output position.

Setup: a random tiny Llama target over a 4-token vocabulary and a random-init H-Spec drafter (Mamba
state from the target's hidden states, attention over the target's KV, Markov-conditioned q) or a
dspark drafter (its own growing KV cache, Markov + confidence heads), block_size 3,
max_new_tokens 5: token 1 comes from the prefill, tokens 2..4 from draft slots 0..2 of the first
step (each one kept, or a residual draw at the first rejected slot) and token 5 is the bonus token
after a full accept (or a later step's token). The exact law of plain sampling over all 4**5
sequences is enumerated with the target; the engine draws SAMPLES sequences in one batch.

Statistic: for m = 1..5 the joint of the first m tokens (a Pearson chi-square, cells with expected
count < 5 pooled), Bonferroni over the 5 tests at family level ALPHA. Prefix m = j + 2 is the first
one that sees slot j's residual draw; m = 5 the bonus.

Power (tests of the test below): each wrong rule is accept_block with one mistake, monkeypatched
into the engine, on the same setup and seed. Power at level ALPHA / 5 of the prefix test that
first sees the mistake, from the noncentral chi-square with the noncentrality estimated from the
wrong rule's own statistic (lambda = X^2 - df, a conservative moment estimate): asserted >= 0.99.
Measured on this setup (hspec, T = 1, SAMPLES = 10000; the same numbers the tests compute):
residual drawn from p instead of normalise((p - q)+) at slot 0 / 1 / 2: X^2 = 1333 / 547 / 511 on
16 / 64 / 231 cells; bonus drawn from the last slot's q instead of p: X^2 = 3391 on 479 cells; the
estimated power is 1.0000 for each (the correct rule: p = 0.64 / 0.76 / 0.90 / 0.16 / 0.59 for m = 1..5).
"""

import itertools

import pytest
import torch
from scipy.stats import chi2, chisquare, ncx2

import sglang_hspec.engine.engine as engine_module
from sglang_hspec.assets.tiny import tiny_target
from sglang_hspec.core.sampling import sampling_probs
from sglang_hspec.core.types import SamplingParams
from sglang_hspec.engine.engine import SpeculativeEngine
from sglang_hspec.model import HSpecConfig, build_drafter
from sglang_hspec.target.adapter import TargetAdapter
from sglang_hspec.target.geometry import TargetGeometry

VOCAB = 4
BLOCK = 3
NUM_TOKENS = BLOCK + 2  # prefill token + BLOCK draft slots + bonus
PROMPT = [3, 1, 0]
SAMPLES = 10_000
ALPHA = 1e-3  # family-wise false-alarm rate of one distribution test (Bonferroni over NUM_TOKENS prefixes)
LEVEL = ALPHA / NUM_TOKENS

SAMPLING = {
    "t1.0": SamplingParams(temperature=1.0, max_new_tokens=NUM_TOKENS, ignore_eos=True, seed=11),
    "t0.7-top_p0.9-top_k3": SamplingParams(temperature=0.7, top_p=0.9, top_k=3, max_new_tokens=NUM_TOKENS,
                                           ignore_eos=True, seed=12),
}


@pytest.fixture(scope="module")
def target():
    return tiny_target("llama", vocab_size=VOCAB, num_layers=5, hidden_size=16, num_heads=2, num_kv_heads=1,
                       head_dim=8, intermediate_size=32, seed=7)


def make_drafter(kind, target, seed=1):
    cfg = HSpecConfig(target=TargetGeometry.from_hf_config(target.config), target_layer_ids=(0, 1, 2, 3, 4),
                      mask_token_id=VOCAB - 1, intermediate_size=32, block_size=BLOCK, mamba_num_heads=2,
                      mamba_head_dim=8, mamba_groups=1, fusion_rank=8, markov_rank=4, draft_vocab_size=VOCAB,
                      sliding_window=16)
    torch.manual_seed(seed)
    drafter = build_drafter(kind, cfg, target.model.embed_tokens, target.lm_head).eval()
    with torch.no_grad():  # the Markov head starts at zero: give q a real dependence on the previous draft
        drafter.markov.markov_w2.weight.normal_(0, 1.0)
    return drafter


def plain_sampling_law(target, params) -> dict[tuple[int, ...], float]:
    """P(t1..t_NUM_TOKENS) under plain sampling, by enumerating every prefix through the target."""
    law = {(): 1.0}
    with torch.no_grad():
        for t in range(NUM_TOKENS):
            prefixes = list(itertools.product(range(VOCAB), repeat=t))
            logits = target(torch.tensor([PROMPT + list(x) for x in prefixes])).logits[:, -1]
            p = sampling_probs(logits, params).double()
            law = {x + (a,): law[x] * float(p[i, a]) for i, x in enumerate(prefixes) for a in range(VOCAB)}
    return law


def marginal(law: dict, m: int) -> dict:
    out: dict = {}
    for seq, v in law.items():
        out[seq[:m]] = out.get(seq[:m], 0) + v
    return out


def pearson(counts: dict, law: dict, n: int) -> tuple[float, float, int]:
    """(X^2, p-value, cells) of counts against law; cells expecting < 5 are pooled, impossible ones kept
    apart so a single impossible sequence fails the test."""
    obs, exp, pooled_obs, pooled_exp = [], [], 0, 0.0
    for cell, prob in law.items():
        e = prob * n
        if e >= 5:
            obs.append(counts.get(cell, 0))
            exp.append(e)
        elif e > 0:
            pooled_obs += counts.get(cell, 0)
            pooled_exp += e
    if pooled_exp > 0:
        obs.append(pooled_obs)
        exp.append(pooled_exp)
    impossible = sum(c for cell, c in counts.items() if law.get(cell, 0.0) == 0.0)
    if impossible:
        return float("inf"), 0.0, len(obs)
    exp = [e * sum(obs) / sum(exp) for e in exp]
    res = chisquare(obs, exp)
    return float(res.statistic), float(res.pvalue), len(obs)


def run_engine(target, kind, params, samples=SAMPLES):
    engine = SpeculativeEngine(TargetAdapter(target), make_drafter(kind, target), eos_token_ids=[])
    return engine.generate([PROMPT] * samples, params)


def prefix_tests(results, law) -> list[tuple[float, float, int]]:
    """One Pearson test per prefix length m = 1..NUM_TOKENS."""
    out = []
    for m in range(1, NUM_TOKENS + 1):
        counts: dict = {}
        for r in results:
            key = tuple(r.output_ids[:m])
            counts[key] = counts.get(key, 0) + 1
        out.append(pearson(counts, marginal(law, m), SAMPLES))
    return out


@pytest.mark.parametrize("sampling", list(SAMPLING), ids=list(SAMPLING))
@pytest.mark.parametrize("kind", ["hspec", "dspark"])
def test_speculative_sampling_matches_plain_sampling_at_every_position(target, kind, sampling):
    params = SAMPLING[sampling]
    law = plain_sampling_law(target, params)
    results = run_engine(target, kind, params)
    assert all(len(r.output_ids) == NUM_TOKENS for r in results)
    # every path the statistic must cover actually happened often: a residual draw at each slot of
    # the first step (rejected there after keeping the earlier slots) and the bonus after a full accept
    first_step = torch.tensor([r.stats.accept_lengths[0] - 1 for r in results])  # drafts kept in step 1
    for slot in range(BLOCK):
        assert int((first_step == slot).sum()) > 200, f"slot {slot} residual drawn too rarely to test"
    assert int((first_step == BLOCK).sum()) > 200, "full accepts too rare to test the bonus token"
    tests = prefix_tests(results, law)
    assert tests[-1][2] > 50, "too few cells for the joint test to mean anything"
    for m, (stat, pvalue, cells) in enumerate(tests, 1):
        assert pvalue > LEVEL, f"tokens 1..{m} deviate from plain sampling (X^2={stat:.0f}, {cells} cells, p={pvalue:.1e})"


# ------------------------------------------------------------------ tests of the test

def wrong_accept_block(mistake: str, slot: int | None = None):
    """accept_block (sampling path) with one mistake: `residual_from_p` draws the token after a rejection
    at `slot` from p instead of normalise((p - q)+); `bonus_from_q` draws the bonus token after a full
    accept from the last verified slot's q instead of the target's p."""

    def accept(*, draft_tokens, verify_lengths, target_probs, draft_probs, greedy, generator=None):
        b, length = draft_tokens.shape
        rows = torch.arange(b)
        if draft_probs is None:  # the engine passes no q for a step that verifies no draft
            assert length == 0
            draft_probs = torch.zeros((b, 0, target_probs.shape[-1]))
        p_draft = target_probs[:, :length].gather(-1, draft_tokens[..., None]).squeeze(-1)
        q_draft = draft_probs.gather(-1, draft_tokens[..., None]).squeeze(-1)
        u = torch.rand(p_draft.shape, generator=generator)
        keep = (u * q_draft < p_draft) & (torch.arange(length)[None] < verify_lengths[:, None])
        num_accepted = keep.long().cumprod(1).sum(1)
        p_next = target_probs[rows, num_accepted]
        rejected = num_accepted < verify_lengths
        if length:
            q_at = draft_probs[rows, num_accepted.clamp_max(length - 1)]
            residual = (p_next - q_at).clamp_min(0.0)
            mass = residual.sum(-1, keepdim=True)
            residual = torch.where(mass > 0, residual / mass.clamp_min(1e-30), p_next)
            use_residual = rejected & (num_accepted != slot) if mistake == "residual_from_p" else rejected
            p_next = torch.where(use_residual[:, None], residual, p_next)
            if mistake == "bonus_from_q":
                bonus = ~rejected & (verify_lengths > 0)
                last_q = draft_probs[rows, (verify_lengths - 1).clamp_min(0)]
                p_next = torch.where(bonus[:, None], last_q, p_next)
        return num_accepted, torch.multinomial(p_next, 1, generator=generator).squeeze(-1)

    return accept


WRONG_RULES = {  # name -> (mistake, slot, the first prefix length m that sees it)
    "residual_from_p-slot0": ("residual_from_p", 0, 2),
    "residual_from_p-slot1": ("residual_from_p", 1, 3),
    "residual_from_p-slot2": ("residual_from_p", 2, 4),
    "bonus_from_q": ("bonus_from_q", None, 5),
}


def test_wrong_rule_reproduces_the_real_one_when_it_makes_no_mistake(target, monkeypatch):
    """The monkeypatched variant is the real rule plus one mistake: with the mistake aimed at a slot that
    never exists it gives the engine's exact outputs (same seed), so a failure below is the mistake's."""
    params = SAMPLING["t1.0"]
    real = run_engine(target, "hspec", params, samples=2000)
    monkeypatch.setattr(engine_module, "accept_block", wrong_accept_block("residual_from_p", slot=99))
    patched = run_engine(target, "hspec", params, samples=2000)
    assert [r.output_ids for r in patched] == [r.output_ids for r in real]


@pytest.mark.parametrize("rule", list(WRONG_RULES))
def test_distribution_test_rejects_a_wrong_rule(target, monkeypatch, rule):
    mistake, slot, first_m = WRONG_RULES[rule]
    params = SAMPLING["t1.0"]
    law = plain_sampling_law(target, params)
    monkeypatch.setattr(engine_module, "accept_block", wrong_accept_block(mistake, slot))
    tests = prefix_tests(run_engine(target, "hspec", params), law)
    # prefixes shorter than the mistaken position are untouched: the mistake is exactly where it says
    for m in range(1, first_m):
        assert tests[m - 1][1] > LEVEL, (rule, m)
    stat, pvalue, cells = tests[first_m - 1]
    assert pvalue < LEVEL, f"{rule}: tokens 1..{first_m} pass (X^2={stat:.0f}, p={pvalue:.1e}): the test has no power"
    df = cells - 1
    power = float(ncx2.sf(chi2.isf(LEVEL, df), df, max(stat - df, 0.0)))
    assert power >= 0.99, f"{rule}: estimated power {power:.3f} at level {LEVEL:.0e}"
