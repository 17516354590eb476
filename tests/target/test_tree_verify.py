"""Tree verify in the target adapter: `extend_tree` gives every node the logits of a chain forward of its
root-to-node path, and `commit_path` leaves the cache a chain extend of the accepted path would have left.

Reference twin: a second adapter over the same model prefills prompt + path as a plain chain. fp32 tiny
targets (Llama and Qwen3, GQA), ragged prompts, trees of different shapes per row (one padded with roots),
a non-consecutive subset of cache rows."""

import pytest
import torch

from sglang_hspec.assets.tiny import tiny_target
from sglang_hspec.target.adapter import TargetAdapter

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [20, 21, 22, 23]]
# node 0 is the anchor; parents[i] < i
TREES = {
    0: ([30, 31, 32, 33, 34, 35, 36, 37], [-1, 0, 0, 1, 1, 2, 3, 5]),  # branching at several depths
    2: ([40, 41, 42, 43, 44], [-1, 0, 1, 2, 0]),  # a chain and a sibling at the root (padded to 8)
}
ROWS = [2, 0]  # a non-consecutive subset of the cache rows, out of order


def path_to(parents, i):
    path = []
    while i >= 0:
        path.append(i)
        i = parents[i]
    return path[::-1]


def chain_reference(model, prompt, tokens):
    """Logits at each of `tokens` and the K/V of every layer, from a plain chain over prompt + tokens."""
    ref = TargetAdapter(model)
    ref.reset(1, capacity=64)
    ref.prefill([prompt])
    out = ref.extend(torch.tensor([tokens]))
    n = len(prompt) + len(tokens)
    kv = [(layer.keys[0, :, :n].clone(), layer.values[0, :, :n].clone()) for layer in ref.cache.layers]
    return out.logits[0], kv


def packed_trees():
    m = max(len(t) for t, _ in TREES.values())
    tokens = torch.zeros((len(ROWS), m), dtype=torch.long)
    parents = torch.full((len(ROWS), m), -1, dtype=torch.long)
    for j, r in enumerate(ROWS):
        t, p = TREES[r]
        tokens[j, :len(t)] = torch.tensor(t)
        parents[j, :len(p)] = torch.tensor(p)
    return tokens, parents


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_tree_logits_equal_chain_of_each_path_and_commit_equals_chain_cache(arch):
    model = tiny_target(arch, vocab_size=96, seed=5)
    adapter = TargetAdapter(model)
    adapter.reset(3, capacity=64)
    adapter.prefill(PROMPTS)
    tokens, parents = packed_trees()
    before = adapter.lengths.clone()
    out = adapter.extend_tree(tokens, parents=parents, rows=torch.tensor(ROWS), hidden_layer_ids=(1, 3))
    assert torch.equal(adapter.lengths, before)  # nothing committed yet
    assert out.logits.shape == (2, 8, 96) and out.hidden.shape == (2, 8, 2, 64)
    for j, r in enumerate(ROWS):
        t, p = TREES[r]
        for i in range(len(t)):
            path = path_to(p, i)
            ref_logits, _ = chain_reference(model, PROMPTS[r], [t[n] for n in path])
            torch.testing.assert_close(out.logits[j, i], ref_logits[-1], atol=2e-5, rtol=1e-5)

    # cache row 2 keeps root -> 4, cache row 0 keeps root -> 2 -> 5 -> 7 (a node at depth t moves to s + t)
    paths = {2: [0, 4], 0: [0, 2, 5, 7]}
    width = max(len(v) for v in paths.values())
    path = torch.zeros((2, width), dtype=torch.long)
    lengths = torch.zeros(2, dtype=torch.long)
    for j, r in enumerate(ROWS):
        path[j, :len(paths[r])] = torch.tensor(paths[r])
        lengths[j] = len(paths[r])
    adapter.commit_path(path, path_lengths=lengths, rows=torch.tensor(ROWS))
    for r in ROWS:
        t, _ = TREES[r]
        accepted = [t[n] for n in paths[r]]
        n = len(PROMPTS[r]) + len(accepted)
        assert int(adapter.lengths[r]) == n
        _, ref_kv = chain_reference(model, PROMPTS[r], accepted)
        for layer, (k, v) in zip(adapter.cache.layers, ref_kv):
            torch.testing.assert_close(layer.keys[r, :, :n], k, atol=2e-5, rtol=1e-5)
            torch.testing.assert_close(layer.values[r, :, :n], v, atol=2e-5, rtol=1e-5)
        # and the next forward reads it as the chain's cache
        nxt = adapter.extend(torch.tensor([[50]]), rows=torch.tensor([r]))
        ref_logits, _ = chain_reference(model, PROMPTS[r], accepted + [50])
        torch.testing.assert_close(nxt.logits[0, 0], ref_logits[-1], atol=2e-5, rtol=1e-5)
    assert int(adapter.lengths[1]) == len(PROMPTS[1])  # a row outside the tree forward is untouched


def test_chain_tree_equals_extend_bitwise():
    """A tree that is a chain is the same forward as `extend` over the same tokens (same mask, positions)."""
    model = tiny_target("llama", vocab_size=96, seed=2)
    a, b = TargetAdapter(model), TargetAdapter(model)
    for ad in (a, b):
        ad.reset(2, capacity=64)
        ad.prefill(PROMPTS[:2])
    tokens = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    tree = a.extend_tree(tokens, parents=torch.tensor([[-1, 0, 1, 2]] * 2))
    chain = b.extend(tokens)
    assert torch.equal(tree.logits, chain.logits)
    a.commit_path(torch.tensor([[0, 1, 2, 3]] * 2), path_lengths=torch.tensor([4, 2]))
    b.truncate(b.lengths - torch.tensor([0, 2]))
    assert torch.equal(a.lengths, b.lengths)
    for la, lb in zip(a.cache.layers, b.cache.layers):
        for r in range(2):
            n = int(a.lengths[r])
            assert torch.equal(la.keys[r, :, :n], lb.keys[r, :, :n])


def test_bad_trees_and_paths_are_refused():
    adapter = TargetAdapter(tiny_target("llama", vocab_size=96))
    adapter.reset(1, capacity=64)
    adapter.prefill([[1, 2]])
    with pytest.raises(ValueError, match="topological"):
        adapter.extend_tree(torch.tensor([[1, 2, 3]]), parents=torch.tensor([[-1, 2, 0]]))
    with pytest.raises(ValueError, match="topological"):
        adapter.extend_tree(torch.tensor([[1, 2]]), parents=torch.tensor([[0, 0]]))
    adapter.extend_tree(torch.tensor([[1, 2, 3]]), parents=torch.tensor([[-1, 0, 0]]))
    with pytest.raises(ValueError, match="start at the root"):
        adapter.commit_path(torch.tensor([[1, 2]]), path_lengths=torch.tensor([2]))


def test_tree_key_layout_lines_up_each_nodes_keys_as_a_decode_reads_them():
    from sglang_hspec.target.adapter import tree_key_layout

    # one row, 3 prefix keys; nodes 0 (root), 1 and 2 under it, 3 under 2, written at time 3 + node
    parents = torch.tensor([[-1, 0, 0, 2]])
    depth = torch.tensor([[0, 1, 1, 2]])
    layout = tree_key_layout(parents, depth, torch.tensor([3]))
    assert layout.index.tolist() == [[[0, 1, 2, 3, 0, 0], [0, 1, 2, 3, 4, 0], [0, 1, 2, 3, 5, 0], [0, 1, 2, 3, 5, 6]]]
    assert layout.valid.sum(-1).tolist() == [[4, 5, 5, 6]]  # the prefix, then the ancestors and the node itself
    # rows with other prefixes: each node's line ends where its own row's keys do
    two = tree_key_layout(torch.tensor([[-1, 0], [-1, 0]]), torch.tensor([[0, 1], [0, 1]]), torch.tensor([1, 3]))
    assert two.index.tolist() == [[[0, 1, 0, 0, 0], [0, 1, 2, 0, 0]], [[0, 1, 2, 3, 0], [0, 1, 2, 3, 4]]]
    assert two.valid.sum(-1).tolist() == [[2, 3], [4, 5]]
    # only nodes off the root's chain (0, 1, 2, ... at depths 0, 1, 2, ...) are gathered
    assert layout.gathered.tolist() == [[False, False, True, True]]
