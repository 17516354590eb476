"""`--policy auto` on the reference engine: it skips the drafter and verifies only the anchor when plain
decoding is expected to be faster, and it stays lossless.

Greedy: outputs equal plain decoding token for token, for drafters that make the switch speculate
(an oracle), decode plainly (random proposals) and everything between, with the trace checked.

Sampling (T = 1): the setup of test_sampling_lossless.py (a tiny Llama target over 4 tokens, a
random-init H-Spec drafter, block_size 3, 5 output tokens, the exact law of plain sampling by
enumeration), SAMPLES rows in one batch under the auto policy with lag 1 and probes on half the rows,
so rows verify 0 (plain), 1 (probe) or up to 3 drafts within one run. Pearson chi-square per prefix
length, Bonferroni over the 5 prefixes at family level ALPHA = 1e-3.

Power: the wrong rule is a switch that looks at this step's drafts (it skips the verify of every
row whose first drafted token is 0, i.e. "do not verify drafts that look bad"), which changes which
tokens are accepted. Measured here (seed 11, SAMPLES = 10000): the right switch gives p = 0.64 /
0.93 / 0.82 / 0.44 / 0.50 for prefixes 1..5; the wrong one X^2 = 190 on 16 cells at prefix 2 (p ~ 1e-32;
power at level ALPHA / 5 from the noncentral chi-square with noncentrality X^2 - df, a conservative
moment estimate: 1.00), and X^2 = 666 / 1132 / 1243 at prefixes 3 / 4 / 5. The test asserts the wrong
switch's smallest p-value < level and that power >= 0.99.
"""

import pytest
import torch
from scipy.stats import chi2, ncx2
from sglang_hspec.scheduler.policy import AutoPolicy
from sglang_hspec.scheduler.sps import SpsCostTable, save_sps_table
from sglang_hspec.scheduler.switch import GUARD_PRIOR

from sglang_hspec.assets.tiny import tiny_target
from sglang_hspec.core.sampling import sampling_probs
from sglang_hspec.core.types import SamplingParams, VerifyPolicy
from sglang_hspec.engine.drafters import NGramDrafter, NoDrafter, RandomDrafter
from sglang_hspec.engine.engine import SpeculativeEngine
from sglang_hspec.engine.policies import AutoVerifyPolicy, make_policy
from sglang_hspec.model import HSpecConfig, build_drafter
from sglang_hspec.target.adapter import TargetAdapter
from sglang_hspec.target.geometry import TargetGeometry

from ._drafters import OracleDrafter

GREEDY = SamplingParams(max_new_tokens=40, ignore_eos=True, seed=0)  # seeds the random drafter: runs do not depend on test order
# verify is nearly free up to 16 tokens, plain decoding costs what a 1-token verify costs, drafting 1 %
TABLE = SpsCostTable(sample_batch_tokens=[1, 2, 4, 8, 16, 32], sample_steps_per_sec=[100.0, 99, 98, 97, 96, 40],
                     max_batch_tokens=64, plain_batch_sizes=[1, 4], plain_steps_per_sec=[100.0, 99],
                     draft_seconds=[0.0001, 0.0001])


@pytest.fixture(scope="module")
def sps_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("auto") / "sps.json"
    save_sps_table(TABLE, path)
    return path


def trace(results) -> list[list[int]]:
    return [r.stats.verify_lengths for r in results]


@pytest.mark.slow
def test_greedy_equals_plain_decoding_and_the_switch_follows_the_drafter(sps_path):
    model = tiny_target("llama", vocab_size=96)
    adapter = TargetAdapter(model)
    prompts = [[5, 6, 7, 8, 5, 6, 7], [9, 10, 11], [3] * 13, [40, 41]]
    plain = [r.output_ids for r in SpeculativeEngine(adapter, NoDrafter()).generate(prompts, GREEDY)]
    steps = {}
    for drafter in [OracleDrafter(model, 4, 3), RandomDrafter(96, 4), NGramDrafter(5), OracleDrafter(model, 3, 1)]:
        # guard off: the trace below is the switch's own, not timing's (the guard has its own tests)
        policy, transform = make_policy("auto", block_size=drafter.block_size, sps_table=str(sps_path), guard=False)
        res = SpeculativeEngine(adapter, drafter, policy=policy, confidence_transform=transform).generate(
            prompts, GREEDY)
        assert [r.output_ids for r in res] == plain, drafter.name
        steps[drafter.name, drafter.block_size] = policy.planner.stats()
    oracle, random_ = steps["oracle", 4], steps["random", 4]
    # the oracle keeps 3 of 4: a cold probe, one plain step (lag 2: nothing known yet), then every step speculates
    assert oracle.speculative_steps == oracle.steps - 1 and oracle.probes == 1
    # random proposals (no confidence head: the audit ratio is the acceptance rate): verifying is nearly
    # free in TABLE, so speculating looks worth it until the audit has seen enough rejections; then it
    # decodes plainly for the rest of the 40 tokens
    assert random_.probes == 1 and random_.speculative_steps < random_.steps - 10


def test_only_probes_draft_when_verifying_is_costly(tmp_path):
    """CPU-like costs (a 2-token verify costs 1.3 plain steps, a draft 0.3) and random proposals: the cold
    probe's rejected draft moves the audit's rho only to 4 / 5 (its prior is 4 predicted drafts), so the
    switch drafts three more steps (2, 3, 4) until the rejections add up, then decodes plainly; after that
    only the probe (16 steps after the last draft) verifies drafts, and every other step verifies its anchor
    alone and commits exactly one token."""
    save_sps_table(SpsCostTable(sample_batch_tokens=[1, 2, 3, 4, 5], sample_steps_per_sec=[10.0, 7.7, 6, 4.5, 3],
                                max_batch_tokens=8, plain_batch_sizes=[1], plain_steps_per_sec=[10.0],
                                draft_seconds=[0.03]), tmp_path / "cpu.json")
    model = tiny_target("llama", vocab_size=96)
    adapter = TargetAdapter(model)
    policy, transform = make_policy("auto", block_size=4, sps_table=str(tmp_path / "cpu.json"), guard=False)
    res = SpeculativeEngine(adapter, RandomDrafter(96, 4), policy=policy, confidence_transform=transform).generate(
        [[1, 2, 3]], GREEDY)[0]
    lengths = res.stats.verify_lengths
    assert [i for i, v in enumerate(lengths) if v] == [0, 2, 3, 4, 20]
    assert policy.planner.stats().probes == 2 and policy.planner.stats().speculative_steps == 5
    assert len(lengths) == GREEDY.max_new_tokens - 1  # one token per step (the first comes from the prefill)


def test_every_policy_implements_the_verify_policy_protocol(sps_path):
    target = tiny_target(vocab_size=96, seed=0)
    for name in ("fixed", "exact", "stale", "auto"):
        policy, _ = make_policy(name, block_size=4, sps_table=str(sps_path))
        assert isinstance(policy, VerifyPolicy), name
        rows = policy.decide(row_ids=torch.arange(3), generations=torch.zeros(3, dtype=torch.long))
        assert rows.tolist() == [0, 1, 2] or name == "auto", name  # auto may decode plainly
    # a bare function (the old duck-typed contract) is refused with the fix
    with pytest.raises(TypeError, match="VerifyPolicy"):
        SpeculativeEngine(TargetAdapter(target), NoDrafter(), policy=lambda **kw: kw["proposal_lengths"])


def test_make_policy_hands_the_guard_its_prior(tmp_path):
    save_sps_table(SpsCostTable(sample_batch_tokens=[1, 2], sample_steps_per_sec=[10.0, 7.7], max_batch_tokens=2,
                                plain_batch_sizes=[1], plain_steps_per_sec=[10.0], draft_seconds=[0.03]),
                   tmp_path / "cpu.json")
    policy, _ = make_policy("auto", block_size=4, sps_table=str(tmp_path / "cpu.json"), guard_prior=4.0)
    assert policy.planner.guard and policy.planner._rate_guard.prior == 4.0
    policy, _ = make_policy("auto", block_size=4, sps_table=str(tmp_path / "cpu.json"), guard_prior=32.0)
    assert policy.planner._rate_guard.prior == 32.0
    policy, _ = make_policy("auto", block_size=4, sps_table=str(tmp_path / "cpu.json"))
    assert policy.planner._rate_guard.prior == GUARD_PRIOR
    with pytest.raises(ValueError, match="need guard_prior > 0"):
        make_policy("auto", block_size=4, sps_table=str(tmp_path / "cpu.json"), guard_prior=0.0)


# ---- distribution at temperature 1 -------------------------------------------------------------

VOCAB, BLOCK, NUM_TOKENS, PROMPT, SAMPLES = 4, 3, 5, [3, 1, 0], 10_000
ALPHA = 1e-3
LEVEL = ALPHA / NUM_TOKENS
T1 = SamplingParams(temperature=1.0, max_new_tokens=NUM_TOKENS, ignore_eos=True, seed=11)
BIG = SpsCostTable(sample_batch_tokens=[1, 10_000, 20_000], sample_steps_per_sec=[10.0, 9.9, 9.8],
                   max_batch_tokens=40_000, plain_batch_sizes=[1], plain_steps_per_sec=[10.0], draft_seconds=[0.0])


@pytest.fixture(scope="module")
def small_target():
    return tiny_target("llama", vocab_size=VOCAB, num_layers=5, hidden_size=16, num_heads=2, num_kv_heads=1,
                       head_dim=8, intermediate_size=32, seed=7)


def hspec_drafter(target):
    cfg = HSpecConfig(target=TargetGeometry.from_hf_config(target.config), target_layer_ids=(0, 1, 2, 3, 4),
                      mask_token_id=VOCAB - 1, intermediate_size=32, block_size=BLOCK, mamba_num_heads=2,
                      mamba_head_dim=8, mamba_groups=1, fusion_rank=8, markov_rank=4, draft_vocab_size=VOCAB,
                      sliding_window=16)
    torch.manual_seed(1)
    drafter = build_drafter("hspec", cfg, target.model.embed_tokens, target.lm_head).eval()
    with torch.no_grad():
        drafter.markov.markov_w2.weight.normal_(0, 1.0)
    return drafter


def plain_law(target):
    import itertools

    law = {(): 1.0}
    with torch.no_grad():
        for t in range(NUM_TOKENS):
            prefixes = list(itertools.product(range(VOCAB), repeat=t))
            logits = target(torch.tensor([PROMPT + list(x) for x in prefixes])).logits[:, -1]
            p = sampling_probs(logits, T1).double()
            law = {x + (a,): law[x] * float(p[i, a]) for i, x in enumerate(prefixes) for a in range(VOCAB)}
    return law


def prefix_pvalues(results, law):
    from scipy.stats import chisquare

    out = []
    for m in range(1, NUM_TOKENS + 1):
        marg, counts = {}, {}
        for seq, v in law.items():
            marg[seq[:m]] = marg.get(seq[:m], 0.0) + v
        for r in results:
            counts[tuple(r.output_ids[:m])] = counts.get(tuple(r.output_ids[:m]), 0) + 1
        obs, exp, po, pe = [], [], 0, 0.0
        for cell, prob in marg.items():
            if prob * SAMPLES >= 5:
                obs.append(counts.get(cell, 0))
                exp.append(prob * SAMPLES)
            else:
                po, pe = po + counts.get(cell, 0), pe + prob * SAMPLES
        if pe:
            obs.append(po)
            exp.append(pe)
        exp = [e * sum(obs) / sum(exp) for e in exp]
        res = chisquare(obs, exp)
        out.append((float(res.statistic), float(res.pvalue), len(obs)))
    return out


class SkipBadLookingDrafts(AutoVerifyPolicy):
    """The wrong switch: no verify for a row whose first drafted token is 0 (it reads this step's drafts)."""

    def __init__(self, planner, *, block_size, drafter):
        super().__init__(planner, block_size=block_size)
        self.drafter = drafter

    def plan(self, **kw):
        verify_lengths = super().plan(**kw)
        return torch.where(self.drafter.last_tokens[:, 0] == 0, torch.zeros_like(verify_lengths), verify_lengths)


def run_auto(target, *, wrong: bool):
    drafter = hspec_drafter(target)
    propose = drafter.propose

    def remembering(ctx, sampling, generator=None):
        proposal = propose(ctx, sampling, generator)
        drafter.last_tokens = proposal.tokens
        return proposal

    drafter.propose = remembering
    planner = AutoPolicy(BIG, lag=1, probe_rows=SAMPLES // 2)
    policy = (SkipBadLookingDrafts(planner, block_size=BLOCK, drafter=drafter) if wrong
              else AutoVerifyPolicy(planner, block_size=BLOCK))
    engine = SpeculativeEngine(TargetAdapter(target), drafter, policy=policy, eos_token_ids=[])
    return engine.generate([PROMPT] * SAMPLES, T1)


@pytest.mark.slow
def test_auto_policy_sampling_matches_plain_sampling_and_rejects_a_wrong_switch(small_target):
    law = plain_law(small_target)
    results = run_auto(small_target, wrong=False)
    first = torch.tensor([r.stats.verify_lengths[0] for r in results])
    # step 1 is a probe of half the rows, which verify their whole blocks (the other half decode plainly);
    # step 2 speculates for every row (capped by the tokens left to emit: the rows that decoded plainly
    # have 3 left and verify drafts)
    assert int((first == 0).sum()) == SAMPLES // 2 and int((first == BLOCK).sum()) == SAMPLES // 2
    second = torch.tensor([r.stats.verify_lengths[1] for r in results if r.stats.verify_lengths[0] == 0])
    assert second.numel() == SAMPLES // 2 and bool((second > 0).all())
    for m, (stat, pvalue, cells) in enumerate(prefix_pvalues(results, law), 1):
        assert pvalue > LEVEL, f"tokens 1..{m}: X^2={stat:.0f} on {cells} cells, p={pvalue:.1e}"

    wrong = prefix_pvalues(run_auto(small_target, wrong=True), law)
    stat, pvalue, cells = min(wrong, key=lambda t: t[1])
    assert pvalue < LEVEL, f"the wrong switch went unnoticed: X^2={stat:.0f} on {cells} cells"
    df = cells - 1
    power = ncx2.sf(chi2.isf(LEVEL, df), df, max(stat - df, 0.0))
    assert power >= 0.99


def test_drafter_with_its_own_kv_cache_sees_every_position_when_rows_skip_drafting(small_target):
    """dspark keeps a drafter-side KV cache: on steps where the switch drafts only some rows (a probe of
    1 row out of 4) or none, the engine feeds the skipped rows' committed hidden states to it
    (`extend_context`), so its next propose finds no gap, and greedy output equals plain decoding."""
    cfg = HSpecConfig(target=TargetGeometry.from_hf_config(small_target.config), target_layer_ids=(0, 1, 2, 3, 4),
                      mask_token_id=VOCAB - 1, intermediate_size=32, block_size=BLOCK, mamba_num_heads=2,
                      mamba_head_dim=8, mamba_groups=1, fusion_rank=8, markov_rank=4, draft_vocab_size=VOCAB,
                      sliding_window=16)
    torch.manual_seed(2)
    drafter = build_drafter("dspark", cfg, small_target.model.embed_tokens, small_target.lm_head).eval()
    adapter = TargetAdapter(small_target)
    prompts = [[3, 1, 0], [1, 2], [0, 0, 1, 2], [2]]
    greedy = SamplingParams(max_new_tokens=30, ignore_eos=True)
    plain = [r.output_ids for r in SpeculativeEngine(adapter, NoDrafter(), eos_token_ids=[]).generate(prompts, greedy)]
    planner = AutoPolicy(TABLE, lag=2, probe_rows=1, probe_interval=4)
    res = SpeculativeEngine(adapter, drafter, policy=AutoVerifyPolicy(planner, block_size=BLOCK),
                            eos_token_ids=[]).generate(prompts, greedy)
    assert [r.output_ids for r in res] == plain
    # the cold probe drafted row 0 only; the others' first step verified the anchor alone
    assert [r.stats.verify_lengths[0] > 0 for r in res] == [True, False, False, False]
    assert planner.stats().probes >= 1
