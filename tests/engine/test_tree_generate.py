"""generate_tree: greedy outputs token-identical to plain decoding (tiny targets with a random-init H-Spec
drafter, with and without prompt lookup, and prompt lookup alone; batch 1 and 3), the tree's shape (main
branch = the drafter's own chain, row and depth limits, min_value), EOS and max_new_tokens inside a step as
the chain engine, and at T > 0 the law of the first tokens against plain sampling's exact law (the setup of
test_sampling_lossless.py)."""


import pytest
import torch
from sglang_hspec.scheduler.sps import SpsCostTable, SpsCurve, save_sps_table

from sglang_hspec.assets.tiny import tiny_target
from sglang_hspec.core.types import DraftContext, SamplingParams
from sglang_hspec.engine.drafters import LookupSpliceDrafter, NGramDrafter, NoDrafter
from sglang_hspec.engine.engine import SpeculativeEngine, generate_tree
from sglang_hspec.engine.tree import TreeSpec, build_trees, size_trees
from sglang_hspec.target.adapter import TargetAdapter
from tests.engine._drafters import hf_greedy
from tests.model._tiny import make_drafter

GREEDY = SamplingParams(max_new_tokens=24, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 5, 6, 7], [9, 10, 11], [3] * 13]


@pytest.fixture(scope="module")
def setup():
    model = tiny_target("qwen3", seed=0, dtype=torch.float32, num_layers=6)
    drafter = make_drafter("hspec", model, block_size=5).float()
    return model, TargetAdapter(model), drafter


def test_greedy_tree_equals_plain_decoding(setup):
    model, adapter, drafter = setup
    plain = SpeculativeEngine(adapter, NoDrafter()).generate(PROMPTS, GREEDY)
    assert plain[1].output_ids == hf_greedy(model, PROMPTS[1], GREEDY.max_new_tokens)
    for d in (drafter, LookupSpliceDrafter(drafter), NGramDrafter(4)):
        for spec in (TreeSpec(), TreeSpec(max_rows=4, max_children=2)):
            tree = generate_tree(adapter, d, PROMPTS, GREEDY, spec=spec)
            assert [r.output_ids for r in tree] == [r.output_ids for r in plain], (d.name, spec)
            assert all(v <= spec.max_rows - 1 for r in tree for v in r.stats.verify_lengths)
        single = generate_tree(adapter, d, PROMPTS[2:], GREEDY)
        assert single[0].output_ids == plain[2].output_ids


def test_lookup_branch_is_a_path_of_the_tree(setup):
    """The prompt-lookup continuation of history + anchor is a root-to-node path (merged where it agrees with
    the drafter), next to the drafter's own chain; the tree thus holds the splice's chain when it splices."""
    _, adapter, drafter = setup
    d = LookupSpliceDrafter(drafter)
    ctx = context_of(adapter, drafter, PROMPTS)
    chain = drafter.propose(ctx, GREEDY).tokens.tolist()
    anchors = ctx.anchor_tokens.tolist()
    # row 0: the lookup disagrees with the drafter on slot 1 (a branch at the root); row 1: it agrees (the
    # splice fires, and the lookup leaves the drafter's chain at slot 2); row 2: no earlier occurrence
    ctx.token_history = [[anchors[0], 70, 71, 72, 73, 74] + PROMPTS[0],
                         [anchors[1], chain[1][0], 80, 81, 82, 83] + PROMPTS[1], [90, 91]]
    assert chain[0][0] != 70 and anchors[2] not in (90, 91)
    trees = build_trees(d, ctx, GREEDY, None, spec=TreeSpec(max_rows=16), max_depths=[5] * 3)
    spliced = d.propose(ctx, GREEDY).tokens.tolist()
    assert spliced[1] == [chain[1][0], 80, 81, 82, 83] and spliced[0] == chain[0]
    for b, tree in enumerate(trees):
        cont = d.lookup.continuation(ctx.token_history[b] + [anchors[b]])
        assert len(cont) == (5 if b < 2 else 0)
        assert ("lookup" in tree.kinds) == (b < 2)
        for tokens in (cont, spliced[b]):
            node = 0
            for t in tokens:
                node = tree.child_with(node, t)
                assert node is not None, (b, tokens, tree.tokens)


def context_of(adapter, drafter, prompts):
    adapter.reset(len(prompts), capacity=64)
    out = adapter.prefill(prompts, hidden_layer_ids=list(drafter.target_layer_ids), last_hidden_only=True)
    rows = torch.arange(len(prompts))
    anchors = out.logits[:, 0].argmax(-1)
    return DraftContext(anchor_tokens=anchors, last_position=adapter.lengths - 1, target_hidden=out.hidden[:, 0],
                        kv_views={lid: adapter.kv_view(lid, window=drafter.sliding_window, rows=rows)
                                  for lid in drafter.kv_layer_ids},
                        token_history=[list(p) for p in prompts], row_ids=rows)


def main_branch(tree):
    node, tokens = 0, []
    while tree.children[node]:
        node = tree.children[node][0]
        assert tree.kinds[node] == "main"
        tokens.append(tree.tokens[node])
    return tokens


def test_tree_shape(setup):
    _, adapter, drafter = setup
    ctx = context_of(adapter, drafter, PROMPTS)
    chain = drafter.propose(ctx, GREEDY).tokens.tolist()
    trees = build_trees(drafter, ctx, GREEDY, None, spec=TreeSpec(max_rows=16), max_depths=[5, 5, 2])
    for b, tree in enumerate(trees):
        assert len(tree) == 16
        assert main_branch(tree) == chain[b][:[5, 5, 2][b]]
        assert max(tree.depths) <= [5, 5, 2][b]
        assert all(p < i for i, p in enumerate(tree.parents) if i)
        for kids in tree.children:  # distinct tokens among siblings, at most max_children of them
            assert len({tree.tokens[c] for c in kids}) == len(kids) <= 4
        assert all(q is None for q in tree.proposals)  # greedy: every node deterministic
    only_chain = build_trees(drafter, ctx, GREEDY, None, spec=TreeSpec(min_value=1.0), max_depths=[5] * 3)
    assert [len(t) for t in only_chain] == [6, 6, 6]
    plain = build_trees(drafter, ctx, GREEDY, None, spec=TreeSpec(max_rows=1), max_depths=[5] * 3)
    assert [len(t) for t in plain] == [1, 1, 1]
    # at T > 0 only the main branch is sampled (it carries its q); every other node is a point mass
    hot = SamplingParams(temperature=1.0, max_new_tokens=24, ignore_eos=True)
    trees = build_trees(drafter, ctx, hot, torch.Generator().manual_seed(0), spec=TreeSpec(), max_depths=[5] * 3)
    for tree in trees:
        for kind, q in zip(tree.kinds, tree.proposals):
            assert (q is not None) == (kind == "main")
            if q is not None:
                torch.testing.assert_close(q.sum(), torch.tensor(1.0))


def test_eos_and_max_new_tokens_as_the_chain_engine(setup):
    _, adapter, drafter = setup
    plain = SpeculativeEngine(adapter, NoDrafter()).generate(PROMPTS, GREEDY)
    eos = plain[0].output_ids[9]  # a token the greedy output reaches mid-way
    for params in (SamplingParams(max_new_tokens=24), SamplingParams(max_new_tokens=11, ignore_eos=True)):
        chain = SpeculativeEngine(adapter, NoDrafter(), eos_token_ids=[eos]).generate(PROMPTS, params)
        tree = generate_tree(adapter, drafter, PROMPTS, params, eos_token_ids=[eos])
        assert [(r.output_ids, r.finish_reason) for r in tree] == [(r.output_ids, r.finish_reason) for r in chain]
    assert chain[0].finish_reason == "length" and len(tree[0].output_ids) == 11


def curve(steps_per_sec: list[float]) -> SpsCurve:
    """Probes at 1, 2, 3, ... verify rows."""
    n = len(steps_per_sec)
    return SpsCurve(SpsCostTable(sample_batch_tokens=list(range(1, n + 1)), sample_steps_per_sec=steps_per_sec,
                                 max_batch_tokens=n))


def test_sized_trees_keep_the_main_branch_and_the_best_nodes(setup):
    _, adapter, drafter = setup
    ctx = context_of(adapter, drafter, PROMPTS)
    trees = build_trees(drafter, ctx, GREEDY, None, spec=TreeSpec(max_rows=16), max_depths=[5, 5, 2])
    forced = [t.forced for t in trees]
    assert forced == [6, 6, 3]  # the root and the main branch (5, 5 and 2 deep)
    rows = sum(len(t) for t in trees)
    # every row costs the same up to all of them: nothing cut; a cliff after the forced rows: only they stay
    assert [len(t) for t in size_trees(trees, curve([100.0] * rows))] == [16, 16, 16]
    cliff = size_trees(trees, curve([100.0] * sum(forced) + [1.0] * (rows - sum(forced))))
    assert [len(t) for t in cliff] == forced
    assert [t.tokens for t in cliff] == [t.tokens[:f] for t, f in zip(trees, forced)]
    # a slope: tau x SPS peaks at some number of extra nodes, which are the best by value across the rows
    extras = sorted((-t.values[i], i, j) for j, t in enumerate(trees) for i in range(t.forced, len(t)))
    slope = [100.0] * sum(forced) + [100.0 / (1 + 0.01 * n) for n in range(1, rows - sum(forced) + 1)]
    tau = sum(sum(t.values[:t.forced]) for t in trees)
    theta = [tau * 100.0] + [(tau - sum(v for v, _, _ in extras[:n])) * slope[sum(forced) + n - 1]
                             for n in range(1, len(extras) + 1)]
    n = max(range(len(theta)), key=lambda i: (theta[i], -i))
    assert 0 < n < len(extras)
    sized = size_trees(trees, curve(slope))
    assert sum(len(t) for t in sized) == sum(forced) + n
    for j, (tree, full) in enumerate(zip(sized, trees)):
        want = sorted(i for _, i, jj in extras[:n] if jj == j)
        assert [path_tokens(tree, i) for i in range(tree.forced, len(tree))] == [path_tokens(full, i) for i in want]
        assert all(p < i for i, p in enumerate(tree.parents) if i)


def path_tokens(tree, node):
    """The tokens from the root to `node`: a node's identity across a tree and its cut."""
    out = []
    while node:
        out.append(tree.tokens[node])
        node = tree.parents[node]
    return tuple(reversed(out))


def test_sized_tree_greedy_equals_plain_decoding(setup, tmp_path):
    model, adapter, drafter = setup
    plain = SpeculativeEngine(adapter, NoDrafter()).generate(PROMPTS, GREEDY)
    table = tmp_path / "sps.json"
    save_sps_table(SpsCostTable(sample_batch_tokens=[1, 8, 16, 48], sample_steps_per_sec=[100.0, 90.0, 60.0, 20.0],
                                max_batch_tokens=48), table)
    for d in (drafter, LookupSpliceDrafter(drafter)):
        sized = generate_tree(adapter, d, PROMPTS, GREEDY, spec=TreeSpec(max_rows=16, sps_table=str(table)))
        full = generate_tree(adapter, d, PROMPTS, GREEDY, spec=TreeSpec(max_rows=16))
        assert [r.output_ids for r in sized] == [r.output_ids for r in plain], d.name
        # the table made some steps verify fewer rows than the full trees
        assert sum(map(sum, (r.stats.verify_lengths for r in sized))) < sum(map(sum, (r.stats.verify_lengths
                                                                                      for r in full)))


# ---------------------------------------------------------------- T > 0: the law of plain sampling

SAMPLES = 4000


@pytest.mark.parametrize("sized", [False, True], ids=["full", "sized"])
def test_sampled_tree_follows_plain_sampling_law(sized, tmp_path):
    """Prefix laws m = 1..NUM_TOKENS of the tree engine's outputs against plain sampling's exact law (tiny
    4-token target, random H-Spec drafter with a real Markov head, block 3; 4000 samples, family-wise 1e-3).
    Tokens 2..4 come from the first step's tree, where a point-mass sibling or a residual draw decides.
    sized: an SPS table cuts each step's point-mass nodes by their values (`size_trees`), which depend on the
    sampled main branch; the law must not move."""
    from tests.engine.test_sampling_lossless import (
        LEVEL,
        NUM_TOKENS,
        PROMPT,
        VOCAB,
        marginal,  # noqa
        pearson,
        plain_sampling_law,
    )
    from tests.engine.test_sampling_lossless import make_drafter as lossless_drafter
    target = tiny_target("llama", vocab_size=VOCAB, num_layers=5, hidden_size=16, num_heads=2, num_kv_heads=1,
                         head_dim=8, intermediate_size=32, seed=7)
    params = SamplingParams(temperature=1.0, max_new_tokens=NUM_TOKENS, ignore_eos=True, seed=21)
    law = plain_sampling_law(target, params)
    table = None
    if sized:  # the 4000 samples run as one batch: beyond ~4 verify rows a request, rows get dear fast
        table = tmp_path / "sps.json"
        save_sps_table(SpsCostTable(sample_batch_tokens=[1, 4 * SAMPLES, 6 * SAMPLES, 8 * SAMPLES],
                                    sample_steps_per_sec=[100.0, 100.0, 70.0, 40.0], max_batch_tokens=8 * SAMPLES),
                       table)
    res = generate_tree(TargetAdapter(target), lossless_drafter("hspec", target), [PROMPT] * SAMPLES, params,
                        spec=TreeSpec(max_rows=8, max_children=3, sps_table=None if table is None else str(table)),
                        eos_token_ids=[])
    seqs = [tuple(r.output_ids) for r in res]
    assert all(len(s) == NUM_TOKENS for s in seqs)
    assert sum(1 for r in res if r.stats.accept_lengths[0] > 1) > SAMPLES // 4  # the tree keeps drafts
    if sized:  # the table did cut, and not down to the main branch alone
        first_rows = [r.stats.verify_lengths[0] for r in res]
        assert 3 < sum(first_rows) / SAMPLES < 7, sum(first_rows) / SAMPLES
    for m in range(1, NUM_TOKENS + 1):
        counts: dict = {}
        for s in seqs:
            counts[s[:m]] = counts.get(s[:m], 0) + 1
        stat, p, cells = pearson(counts, marginal(law, m), SAMPLES)
        assert p > LEVEL, (m, stat, p, cells)
