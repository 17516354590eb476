"""The tree's acceptance rule is exact in distribution at T > 0, and this test has the power to see a wrong one.

Setup (synthetic, no model): a 5-token vocabulary, fixed target laws p0 (first token) and p1[t1] (second
token given the first), fixed drafter laws q0 and q1[t1]. Each sample builds a fresh two-level tree the way
`build_tree` does: the root's first child x ~ q0 (sampled, proposal q0), then two point masses (the most
likely token of q0 other than x, then the least likely one other than both); under x, a draw w ~ q1[x] and
the best token of q1[x] other than w (a point mass); under each point mass, its best continuation (a point
mass). `accept_tree_sampling` walks it; the output is the path's tokens and the drawn token, and when the
walk keeps nothing the second token comes from p1[t1] as the next step would draw it. The joint law of the
first two tokens must be p0(t1) p1(t2 | t1): a Pearson chi-square over the 25 cells at level ALPHA.

Wrong rules (`node_rule` swapped in): no residual (a rejection leaves p as it was), the chain's q for the
siblings (point masses tested with min(1, p/q) against the sampled child's q and residual (p - q)+), accept
if argmax (a candidate is kept iff it is the argmax of the current law), and an unnormalised residual (the
right residual, tested against without renormalising it). Power: the probability that the test rejects a
wrong rule at SAMPLES and ALPHA, from the noncentral chi-square whose noncentrality is that of the wrong
rule's law, lambda = SAMPLES * sum (w - e)^2 / e, with w estimated from LAW_SAMPLES draws of the rule on
another seed (less df * SAMPLES / LAW_SAMPLES, the estimate's own noise). Measured here (SAMPLES = 8000,
ALPHA = 1e-3, df = 24): lambda = 2158 / 9122 / 5653 / 358, power 1.0000 for each of no residual / chain q
/ accept if argmax / unnormalised residual; the samples that reach power 0.99 are 235 / 55 / 90 / 1412
(at 1000 samples the unnormalised residual is caught with power 0.89). The correct rule reads X^2 = 27.4,
p = 0.29. Asserted: power >= 0.99 for every wrong rule, each rejected on the test's own seed, the correct
rule not rejected.
"""

import pytest
import torch
from scipy.stats import chi2, chisquare, ncx2

from sglang_hspec.engine.tree import DraftTree, accept_tree_sampling, resolve_node

V = 5
SAMPLES = 8000
LAW_SAMPLES = 40_000
ALPHA = 1e-3
SEED = 1234


def laws():
    g = torch.Generator().manual_seed(3)
    p0 = torch.softmax(torch.randn(V, generator=g).double() * 1.2, -1)
    p1 = torch.softmax(torch.randn(V, V, generator=g).double() * 1.2, -1)
    q0 = torch.softmax(torch.randn(V, generator=g).double() * 1.2, -1)
    q1 = torch.softmax(torch.randn(V, V, generator=g).double() * 1.2, -1)
    return p0, p1, q0, q1


def best_other(q, taken, *, worst=False):
    order = torch.argsort(q, descending=not worst).tolist()
    return next(t for t in order if t not in taken)


def sample_tree(q0, q1, g) -> DraftTree:
    tree = DraftTree.root(0)
    x = int(torch.multinomial(q0, 1, generator=g))
    nx = tree.add(0, x, proposal=q0, value=1, kind="main")
    y = best_other(q0, {x})
    ny = tree.add(0, y, proposal=None, value=1, kind="sibling")
    z = best_other(q0, {x, y}, worst=True)
    nz = tree.add(0, z, proposal=None, value=1, kind="sibling")
    w = int(torch.multinomial(q1[x], 1, generator=g))
    tree.add(nx, w, proposal=q1[x], value=1, kind="main")
    tree.add(nx, best_other(q1[x], {w}), proposal=None, value=1, kind="sibling")
    tree.add(ny, best_other(q1[y], set()), proposal=None, value=1, kind="sibling")
    tree.add(nz, best_other(q1[z], set()), proposal=None, value=1, kind="sibling")
    return tree


def draw(rule, n, seed):
    p0, p1, q0, q1 = laws()
    g = torch.Generator().manual_seed(seed)
    counts = torch.zeros(V, V)
    uniform = torch.full((V,), 1.0 / V, dtype=torch.float64)
    for _ in range(n):
        tree = sample_tree(q0, q1, g)
        probs = torch.stack([p0 if d == 0 else (p1[tree.tokens[i]] if d == 1 else uniform)
                             for i, d in enumerate(tree.depths)])
        path, nxt = accept_tree_sampling(tree, probs, g, node_rule=rule)
        out = tree.path_tokens(path[1:]) + [nxt]
        if len(out) < 2:
            out.append(int(torch.multinomial(p1[out[0]], 1, generator=g)))
        counts[out[0], out[1]] += 1
    return counts


def expected(n):
    p0, p1, _, _ = laws()
    return (p0[:, None] * p1 * n).flatten()


def pearson(counts):
    e = expected(counts.sum())
    assert float(e.min()) >= 5  # no pooling needed on this setup
    return chisquare(counts.flatten().double().numpy(), e.numpy())


# ---------------------------------------------------------------- wrong rules


def no_residual(p, candidates, g):
    for i, (x, q) in enumerate(candidates):
        u = float(torch.rand((), generator=g))
        if (u < float(p[x])) if q is None else (u * float(q[x]) < float(p[x])):
            return i, None
    return None, int(torch.multinomial(p, 1, generator=g))


def chain_q_for_siblings(p, candidates, g):
    sampled = next((q for _, q in candidates if q is not None), None)
    fixed = [(x, q if q is not None else sampled) for x, q in candidates]
    return resolve_node(p, fixed, g)


def accept_if_argmax(p, candidates, g):
    for i, (x, _) in enumerate(candidates):
        if int(p.argmax()) == x:
            return i, None
        p = p.clone()
        p[x] = 0
        p = p / p.sum()
    return None, int(torch.multinomial(p, 1, generator=g))


def unnormalised_residual(p, candidates, g):
    """The residual (p - q)+ tested against without renormalising it (a subtle slip: acceptance too rare)."""
    for i, (x, q) in enumerate(candidates):
        u = float(torch.rand((), generator=g))
        q = torch.nn.functional.one_hot(torch.tensor(x), V).double() if q is None else q
        if u * float(q[x]) < float(p[x]):
            return i, None
        p = (p - q).clamp_min(0)
    return None, int(torch.multinomial(p, 1, generator=g))


WRONG = {"no_residual": no_residual, "chain_q_for_siblings": chain_q_for_siblings,
         "accept_if_argmax": accept_if_argmax, "unnormalised_residual": unnormalised_residual}


def test_tree_acceptance_follows_the_target_law():
    res = pearson(draw(resolve_node, SAMPLES, SEED))
    print(f"correct rule: X^2 = {res.statistic:.1f}, p = {res.pvalue:.2f}")
    assert res.pvalue > ALPHA, res


@pytest.mark.parametrize("name", sorted(WRONG))
def test_wrong_rules_are_rejected_with_power(name):
    rule = WRONG[name]
    res = pearson(draw(rule, SAMPLES, SEED))
    assert res.pvalue < ALPHA, (name, res)
    # power at SAMPLES from the wrong rule's own law, estimated on LAW_SAMPLES draws of another seed
    law = draw(rule, LAW_SAMPLES, SEED + 1).flatten().double() / LAW_SAMPLES
    e = expected(1.0)
    df = V * V - 1
    lam = max(0.0, float(SAMPLES * ((law - e) ** 2 / e).sum()) - df * SAMPLES / LAW_SAMPLES)
    power = float(ncx2.sf(chi2.isf(ALPHA, df), df, lam))
    print(f"{name}: X^2 = {res.statistic:.1f}, lambda = {lam:.1f}, power = {power:.4f}")
    assert power >= 0.99, (name, lam, power)


def test_point_mass_and_sampled_candidates_by_hand():
    """resolve_node's arithmetic on a 3-token law: a point mass on 0 is kept with probability p(0) = 0.5;
    after its rejection the law is (0, 0.6, 0.4); a sampled candidate 1 with q = (0, 0.8, 0.2) is then
    kept with probability 0.6 / 0.8 = 0.75, and its rejection leaves normalise((0, 0, 0.2)) = token 2."""
    p = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    q = torch.tensor([0.0, 0.8, 0.2], dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    outcomes = {"first": 0, "second": 0, "residual2": 0}
    n = 20_000
    for _ in range(n):
        kept, drawn = resolve_node(p, [(0, None), (1, q)], g)
        if kept == 0:
            outcomes["first"] += 1
        elif kept == 1:
            outcomes["second"] += 1
        else:
            assert drawn == 2
            outcomes["residual2"] += 1
    probs = [0.5, 0.5 * 0.75, 0.5 * 0.25]
    res = chisquare([outcomes["first"], outcomes["second"], outcomes["residual2"]], [n * x for x in probs])
    assert res.pvalue > ALPHA, (outcomes, res)
