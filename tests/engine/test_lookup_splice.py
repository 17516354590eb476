"""Prompt lookup spliced into a learned drafter (LookupSpliceDrafter).

The lookup is hand-checked on short histories, the splice on a stub drafter's block; the engine with a
random-init H-Spec drafter + lookup keeps greedy outputs identical to plain decoding, and its sampled
outputs follow plain sampling's exact law (Pearson chi-square per output prefix, as in
test_sampling_lossless.py, on a repetitive prompt so that most first steps splice). The same test with
the spliced slots keeping the drafter's q instead of a one-hot q (the mistake a splice invites) fails:
its power is asserted, from the noncentral chi-square, at >= 0.99.
Measured on this setup (T = 1, SAMPLES = 10000): 6,475 of 24,705 proposed blocks splice; the right rule
reads p = 0.55 / 0.70 / 0.51 / 0.42 / 0.38 for m = 1..5; the wrong one X^2 = 3748 on 64 cells at m = 3
(p ~ 0, estimated power 1.0000).
"""

import itertools

import pytest
import torch
from scipy.stats import chi2, ncx2

from sglang_hspec.assets.tiny import tiny_target
from sglang_hspec.core.sampling import sampling_probs
from sglang_hspec.core.types import DraftContext, DraftProposal, SamplingParams
from sglang_hspec.engine.drafters import LookupSpliceDrafter, NoDrafter
from sglang_hspec.engine.engine import SpeculativeEngine
from sglang_hspec.target.adapter import TargetAdapter
from tests.engine.test_sampling_lossless import BLOCK, VOCAB, make_drafter, marginal, pearson

PROMPT = [0, 1, 2, 0, 1, 2, 0, 1]  # repetitive: the lookup finds a continuation for most first drafts
NUM_TOKENS = BLOCK + 2
SAMPLES = 10_000
LEVEL = 1e-3 / NUM_TOKENS  # family-wise 1e-3, Bonferroni over the prefixes


@pytest.fixture(scope="module")
def target():
    return tiny_target("llama", vocab_size=VOCAB, num_layers=5, hidden_size=16, num_heads=2, num_kv_heads=1,
                       head_dim=8, intermediate_size=32, seed=7)


class StubDrafter:
    """Proposes a fixed block with a fixed q and fixed confidence logits."""

    name = "stub"
    target_layer_ids = ()
    kv_layer_ids = ()
    sliding_window = 1

    def __init__(self, tokens, vocab):
        self.tokens = torch.tensor(tokens)
        self.block_size = self.tokens.shape[1]
        self.q = torch.full((*self.tokens.shape, vocab), 1.0 / vocab)
        self.conf = torch.full(self.tokens.shape, -1.0)

    def propose(self, ctx, sampling, generator=None):
        return DraftProposal(tokens=self.tokens.clone(), q=self.q.clone(), confidence_logits=self.conf.clone())

    def reset(self):
        pass


def test_continuation_copies_after_the_latest_longest_match():
    splice = LookupSpliceDrafter(StubDrafter([[0] * 4], vocab=10), max_ngram=3)
    # tail [8, 5, 6] has no earlier occurrence; [5, 6] occurs at 0 and 3, the latest wins: the copy from
    # position 5 reads [8, 5, 6], then runs on into what it has just copied (8 again), as the loop would
    assert splice.lookup.continuation([5, 6, 7, 5, 6, 8, 5, 6]) == [8, 5, 6, 8]
    assert splice.lookup.continuation([4, 4]) == [4, 4, 4, 4]  # a loop of period 1
    assert splice.lookup.continuation([1, 2, 3]) == []  # no token repeats
    longest_first = LookupSpliceDrafter(StubDrafter([[0] * 4], vocab=10), max_ngram=2)
    # [1, 2] at 3 is followed by 3; [2] alone at 1 by 9, but the longer n is tried first
    assert longest_first.lookup.continuation([9, 2, 9, 1, 2, 3, 1, 2]) == [3, 1, 2, 3]
    shortest = LookupSpliceDrafter(StubDrafter([[0] * 4], vocab=10), max_ngram=2, min_ngram=2)
    assert shortest.lookup.continuation([7, 2, 9, 2]) == []  # only [2] repeats, shorter than min_ngram


def test_splice_replaces_slots_after_the_first_and_makes_their_q_one_hot():
    vocab = 10
    stub = StubDrafter([[8, 1, 1, 1], [7, 1, 1, 1], [8, 2, 2, 2]], vocab=vocab)
    splice = LookupSpliceDrafter(stub, lookup_confidence=0.8)
    history = [[5, 6, 7, 5, 6, 8, 5], [5, 6, 7, 5, 6, 8, 5], [3, 3, 8, 1]]
    ctx = DraftContext(anchor_tokens=torch.tensor([6, 6, 3]), last_position=torch.tensor([6, 6, 3]),
                       target_hidden=None, token_history=history)
    out = splice.propose(ctx, SamplingParams(temperature=1.0))
    # row 0: seq [5 6 7 5 6 8 5 6] -> lookup [8, 5, 6, 8], whose 8 is the drafter's first token: spliced
    # row 1: the same lookup, the drafter's first token 7 (an older match agrees, the latest does not): kept
    # row 2: seq [3 3 8 1 3]: no earlier [8, 1, 3] or [1, 3]; [3] at 1 -> [8, 1, 3], then the copy reads
    # its own first token: [8, 1, 3, 8], first token 8 as drafted: spliced
    assert out.tokens.tolist() == [[8, 5, 6, 8], [7, 1, 1, 1], [8, 1, 3, 8]]
    assert out.lengths is None  # the drafter's blocks are whole, and so is every spliced block
    uniform = torch.full((vocab,), 1.0 / vocab)
    for row in (0, 2):
        assert torch.equal(out.q[row, 0], uniform)  # slot 1 is the drafter's own draw under its own q
        for slot in range(1, 4):
            assert out.q[row, slot].tolist() == torch.nn.functional.one_hot(out.tokens[row, slot], vocab).tolist()
    assert torch.equal(out.q[1], stub.q[1])
    logit = torch.logit(torch.tensor(0.8)).item()
    assert out.confidence_logits[0].tolist() == pytest.approx([-1.0, logit, logit, logit])
    assert out.confidence_logits[1].tolist() == [-1.0] * 4
    assert (splice.spliced_rows, splice.proposed_rows) == (2, 3)


def test_splice_refuses_a_drafter_with_its_own_kv_cache():
    class Cached(StubDrafter):
        def extend_context(self, *args, **kwargs):
            pass

    with pytest.raises(ValueError, match="drafter-side KV cache"):
        LookupSpliceDrafter(Cached([[0]], vocab=4))


def splice_engine(target, *, seed=1):
    return SpeculativeEngine(TargetAdapter(target), LookupSpliceDrafter(make_drafter("hspec", target, seed=seed)),
                             eos_token_ids=[])


def test_greedy_equals_plain_decoding_and_splices(target):
    """Three rows in one batch, spliced on some steps and not on others."""
    params = SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)
    prompts = [PROMPT, [3, 1, 0, 3, 1], [2, 2, 2, 1]]
    engine = splice_engine(target)
    spliced = engine.generate(prompts, params)
    assert 0 < engine.drafter.spliced_rows < engine.drafter.proposed_rows
    plain = SpeculativeEngine(TargetAdapter(target), NoDrafter(), eos_token_ids=[]).generate(prompts, params)
    assert [r.output_ids for r in spliced] == [r.output_ids for r in plain]


def plain_law(target, params) -> dict[tuple[int, ...], float]:
    law = {(): 1.0}
    with torch.no_grad():
        for t in range(NUM_TOKENS):
            prefixes = list(itertools.product(range(VOCAB), repeat=t))
            p = sampling_probs(target(torch.tensor([PROMPT + list(x) for x in prefixes])).logits[:, -1], params)
            law = {x + (a,): law[x] * float(p.double()[i, a]) for i, x in enumerate(prefixes) for a in range(VOCAB)}
    return law


def prefix_stats(results, law):
    out = []
    for m in range(1, NUM_TOKENS + 1):
        counts: dict = {}
        for r in results:
            counts[tuple(r.output_ids[:m])] = counts.get(tuple(r.output_ids[:m]), 0) + 1
        out.append(pearson(counts, marginal(law, m), len(results)))
    return out


PARAMS = SamplingParams(temperature=1.0, max_new_tokens=NUM_TOKENS, ignore_eos=True, seed=21)


@pytest.mark.slow
def test_sampled_outputs_follow_plain_sampling(target):
    engine = splice_engine(target)
    results = engine.generate([PROMPT] * SAMPLES, PARAMS)
    # spliced and drafter-only blocks are both common (6,475 of 24,705 blocks splice with this seed)
    assert 0.2 * engine.drafter.proposed_rows < engine.drafter.spliced_rows < 0.8 * engine.drafter.proposed_rows
    for m, (stat, pvalue, cells) in enumerate(prefix_stats(results, plain_law(target, PARAMS)), 1):
        assert pvalue > LEVEL, f"tokens 1..{m} deviate from plain sampling (X^2={stat:.0f}, {cells} cells)"


@pytest.mark.slow
def test_keeping_the_drafter_q_on_spliced_slots_is_caught(target, monkeypatch):
    """The wrong splice: the lookup's tokens verified against the drafter's q (not one-hot). Its
    statistic at the prefix that first sees slot 2 must exceed the level with power >= 0.99."""
    real_propose = LookupSpliceDrafter.propose

    def wrong(self, ctx, sampling, generator=None):
        own = {}
        inner = self.drafter.propose

        def capture(*args, **kwargs):
            own["proposal"] = inner(*args, **kwargs)
            return own["proposal"]

        self.drafter.propose = capture
        try:
            out = real_propose(self, ctx, sampling, generator)
        finally:
            del self.drafter.propose
        out.q = own["proposal"].q
        return out

    monkeypatch.setattr(LookupSpliceDrafter, "propose", wrong)
    results = splice_engine(target).generate([PROMPT] * SAMPLES, PARAMS)
    stats = prefix_stats(results, plain_law(target, PARAMS))
    stat, pvalue, cells = stats[2]  # tokens 1..3: slot 1 of the first step (the first spliced slot)
    df = cells - 1
    power = ncx2.sf(chi2.isf(LEVEL, df), df, max(stat - df, 0.0))
    assert pvalue < LEVEL and power >= 0.99, (stat, pvalue, cells, power)
