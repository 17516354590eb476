"""TargetAdapter (sglang_hspec/target/adapter.py): ragged batched extend, O(1) rollback, hidden capture,
KV views over its own cache."""

import pytest
import torch

from sglang_hspec.assets.tiny import tiny_target
from sglang_hspec.target import adapter as adapter_mod
from sglang_hspec.target.adapter import KV_CAPACITY_GRANULE, TargetAdapter, consecutive_span


def test_extend_raises_when_the_target_ignores_the_ragged_cache(monkeypatch):
    adapter = TargetAdapter(tiny_target("llama", num_layers=2))
    adapter.reset(1, capacity=8)
    # pass the cache under a name no transformers release reads: the model swallows it into **kwargs
    monkeypatch.setattr(adapter_mod, "call_with_cache",
                        lambda module, cache, **inputs: module(**inputs, ragged_cache=cache, use_cache=True))
    with pytest.raises(RuntimeError, match="wrote 0 of its 2 layers"):
        adapter.extend(torch.tensor([[5, 6, 7]]))
    assert int(adapter.lengths[0]) == 0  # nothing committed


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_ragged_extend_matches_a_full_forward(arch):
    """The inference path (ragged cache passed through call_with_cache, rows of different lengths, the
    storage grown mid-way) leaves the same K/V, logits and hidden states as one forward per sequence."""
    adapter = TargetAdapter(tiny_target(arch, dtype=torch.float64, num_layers=3))
    seqs = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14, 15]]
    adapter.reset(2, capacity=4)
    adapter.extend(torch.tensor([[5, 6, 7, 8], [12, 13, 2, 2]]), num_tokens=torch.tensor([4, 2]))
    out = adapter.extend(torch.tensor([[9, 10, 11], [14, 15, 2]]), num_tokens=torch.tensor([3, 2]),
                         hidden_layer_ids=[1])
    assert adapter.lengths.tolist() == [7, 4] and adapter.cache.capacity >= 7
    for b, (seq, m) in enumerate(zip(seqs, (3, 2))):
        n = len(seq)
        ref = adapter.full_forward(torch.tensor([seq]), hidden_layer_ids=[1], kv_layer_ids=range(3),
                                   return_logits=True)
        for L, (k, v) in ref.kv.items():
            torch.testing.assert_close(adapter.cache.layers[L].keys[b, :, :n], k[0], rtol=1e-9, atol=1e-9)
            torch.testing.assert_close(adapter.cache.layers[L].values[b, :, :n], v[0], rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(out.logits[b, :m], ref.logits[0, n - m:], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out.hidden[b, :m], ref.hidden[0, n - m:], rtol=1e-9, atol=1e-9)


def test_last_logits_only_returns_each_rows_last_real_token():
    """A prefill's logits at each row's own last token only (three rows, two of them the same length,
    so one kept position serves two rows), equal to the full logits there; K/V and lengths as usual."""
    tokens = torch.tensor([[5, 6, 7, 8], [12, 13, 2, 2], [20, 21, 2, 2]])
    num = torch.tensor([4, 2, 2])
    full = TargetAdapter(tiny_target("llama", dtype=torch.float64, num_layers=2))
    full.reset(3, capacity=8)
    ref = full.extend(tokens, num_tokens=num).logits
    last = TargetAdapter(full.model)
    last.reset(3, capacity=8)
    out = last.extend(tokens, num_tokens=num, last_logits_only=True)
    assert out.logits.shape == (3, 1, ref.shape[-1]) and last.lengths.tolist() == [4, 2, 2]
    torch.testing.assert_close(out.logits[:, 0], ref[torch.arange(3), num - 1], rtol=1e-9, atol=1e-9)
    assert not torch.equal(out.logits[1, 0], out.logits[2, 0])
    torch.testing.assert_close(last.cache.layers[1].keys, full.cache.layers[1].keys, rtol=0, atol=0)


@pytest.mark.parametrize("budget,groups", [(1024, [[0, 1, 2, 3]]), (12, [[0, 1], [2, 3]]), (8, [[0, 1], [2], [3]]),
                                           (1, [[0], [1], [2], [3]])])
def test_prefill_in_groups_matches_one_padded_forward(monkeypatch, budget, groups):
    """Prompts of 4, 2, 5 and 3 tokens: groups of consecutive rows while rows x longest <= budget (12:
    2 x 4 = 8, then 3 x 5 > 12; 2 x 5 = 10), each padded to its own longest; logits at the last
    prompt token, hidden states over each prompt, K/V and lengths equal to one padded extend."""
    prompts = [[5, 6, 7, 8], [12, 13], [20, 21, 22, 23, 24], [30, 31, 32]]
    model = tiny_target("llama", dtype=torch.float64, num_layers=2)
    one = TargetAdapter(model)
    one.reset(5, capacity=8)
    tokens = torch.tensor([p + [2] * (5 - len(p)) for p in prompts])
    rows = torch.tensor([4, 0, 1, 3])  # any cache rows, in any order
    ref = one.extend(tokens, num_tokens=torch.tensor([4, 2, 5, 3]), rows=rows, hidden_layer_ids=[0, 1],
                     last_logits_only=True)
    grouped = TargetAdapter(model)
    grouped.reset(5, capacity=8)
    seen = []
    extend = grouped.extend
    monkeypatch.setattr(grouped, "extend", lambda tokens, **kw: seen.append(kw["rows"].tolist()) or extend(tokens, **kw))
    out = grouped.prefill(prompts, rows=rows, hidden_layer_ids=[0, 1], max_forward_tokens=budget)
    assert seen == [rows[g].tolist() for g in groups]
    torch.testing.assert_close(out.logits, ref.logits, rtol=1e-9, atol=1e-9)
    assert out.hidden.shape == ref.hidden.shape
    for b, p in enumerate(prompts):
        torch.testing.assert_close(out.hidden[b, :len(p)], ref.hidden[b, :len(p)], rtol=1e-9, atol=1e-9)
    assert grouped.lengths.tolist() == one.lengths.tolist() == [2, 5, 0, 3, 4]
    for layer in range(2):
        for b, p in zip(rows.tolist(), prompts):
            torch.testing.assert_close(grouped.cache.layers[layer].keys[b, :, :len(p)],
                                       one.cache.layers[layer].keys[b, :, :len(p)], rtol=1e-9, atol=1e-9)


def test_prefill_refuses_empty_prompts_and_a_zero_budget():
    adapter = TargetAdapter(tiny_target("llama", num_layers=2))
    adapter.reset(2, capacity=8)
    with pytest.raises(ValueError, match="at least one token"):
        adapter.prefill([[5, 6], []])
    with pytest.raises(ValueError, match="max_forward_tokens must be >= 1"):
        adapter.prefill([[5, 6]], max_forward_tokens=0)
    with pytest.raises(ValueError, match="2 prompts but 1 cache rows"):
        adapter.prefill([[5], [6]], rows=torch.tensor([0]))


def test_row_subsets_consecutive_or_not_give_the_same_logits():
    """A forward over some cache rows reads them in place when they are consecutive (a view) and gathers
    them otherwise; both give the logits of a forward over the same rows alone."""
    assert consecutive_span(torch.tensor([1, 2, 3])) == (1, 4) and consecutive_span(torch.tensor([0, 2])) is None
    assert consecutive_span(torch.tensor([2, 1])) is None and consecutive_span(torch.tensor([], dtype=torch.long)) is None
    model = tiny_target("qwen3", dtype=torch.float64, num_layers=2)
    prompts = torch.tensor([[5, 6, 7], [8, 9, 10], [11, 12, 13], [14, 15, 16]])
    step = torch.tensor([[20], [21], [22], [23]])
    for rows in ([1, 2], [0, 2], [3]):
        adapter = TargetAdapter(model)
        adapter.reset(4, capacity=8)
        adapter.extend(prompts)
        out = adapter.extend(step[rows], rows=torch.tensor(rows)).logits
        for j, r in enumerate(rows):
            alone = TargetAdapter(model)
            alone.reset(1, capacity=8)
            alone.extend(prompts[r:r + 1])
            torch.testing.assert_close(out[j], alone.extend(step[r:r + 1]).logits[0], rtol=1e-9, atol=1e-9)
        assert adapter.lengths.tolist() == [3 + (r in rows) for r in range(4)]


def test_truncate_rolls_back_in_place_and_the_next_extend_overwrites():
    """Rollback only lowers lengths (O(1)); extending after it writes the same K/V and logits as a
    forward over the kept prefix plus the new tokens."""
    adapter = TargetAdapter(tiny_target("llama", dtype=torch.float64, num_layers=2))
    adapter.reset(1, capacity=16)
    adapter.extend(torch.tensor([[5, 6, 7, 8, 9]]))
    storage = adapter.cache.layers[0].keys
    adapter.truncate(torch.tensor([3]), rows=torch.tensor([0]))
    assert adapter.lengths.tolist() == [3] and adapter.cache.layers[0].keys is storage  # nothing copied
    out = adapter.extend(torch.tensor([[20, 21]]))
    ref = adapter.full_forward(torch.tensor([[5, 6, 7, 20, 21]]), kv_layer_ids=[0, 1], return_logits=True)
    torch.testing.assert_close(adapter.cache.layers[1].keys[0, :, :5], ref.kv[1][0][0], rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(out.logits[0, :2], ref.logits[0, 3:], rtol=1e-6, atol=1e-6)


def test_kv_view_reads_the_last_window_of_each_row():
    adapter = TargetAdapter(tiny_target("qwen3", dtype=torch.float64, num_layers=2))
    adapter.reset(2, capacity=8)
    adapter.extend(torch.tensor([[5, 6, 7, 8, 9], [10, 11, 2, 2, 2]]), num_tokens=torch.tensor([5, 2]))
    view = adapter.kv_view(1, window=3)
    assert view.positions.tolist() == [[2, 3, 4], [0, 0, 1]]
    assert view.valid.tolist() == [[True, True, True], [False, True, True]]
    k, _ = view.gather()
    torch.testing.assert_close(k[0], adapter.cache.layers[1].keys[0, :, 2:5])
    torch.testing.assert_close(k[1, :, 1:], adapter.cache.layers[1].keys[1, :, 0:2])


def test_layer_ids_outside_the_target_are_refused_with_the_range():
    adapter = TargetAdapter(tiny_target("llama", num_layers=3))
    with pytest.raises(ValueError, match=r"7.*0\.\.2"):
        adapter.check_layer_ids([0, 7])


def test_prefill_last_hidden_only_is_the_hidden_state_at_each_prompts_last_token():
    prompts = [[5, 6, 7, 8], [12, 13], [20, 21, 22]]
    model = tiny_target("llama", dtype=torch.float64, num_layers=2)
    full, last = TargetAdapter(model), TargetAdapter(model)
    full.reset(3, capacity=8)
    last.reset(3, capacity=8)
    ref = full.prefill(prompts, hidden_layer_ids=[1, 0], max_forward_tokens=6).hidden
    out = last.prefill(prompts, hidden_layer_ids=[1, 0], last_hidden_only=True, max_forward_tokens=6).hidden
    assert out.shape == (3, 1, 2, ref.shape[-1])
    torch.testing.assert_close(out[:, 0], ref[torch.arange(3), torch.tensor([3, 1, 2])], rtol=0, atol=0)


def test_reset_reuses_storage_that_fits_and_a_reused_cache_gives_a_fresh_caches_logits():
    """reset() keeps the previous K/V storage (views of its first rows) when it holds enough rows and
    tokens; what a previous call left past each row's length is masked, so the logits are those of a
    freshly zeroed cache, exactly. New storage is allocated in whole granules of 64 tokens."""
    assert KV_CAPACITY_GRANULE == 64
    model = tiny_target("qwen3", dtype=torch.float64, num_layers=2)
    used = TargetAdapter(model)
    used.reset(3, capacity=12)
    assert used.cache.capacity == 64
    used.extend(torch.arange(5, 35).reshape(3, 10))  # fills positions 0..9 of every row
    storage = used.cache.layers[1].keys.data_ptr()
    used.reset(2, capacity=8)
    assert used.cache.layers[1].keys.data_ptr() == storage and used.lengths.tolist() == [0, 0]
    assert used.cache.layers[0].keys.shape[0] == 2 and used.cache.capacity == 64
    used.reset(2, capacity=64)  # a few tokens more (a drafter's headroom), still inside the granule
    assert used.cache.layers[1].keys.data_ptr() == storage
    fresh = TargetAdapter(model)
    fresh.reset(2, capacity=8)
    prompt = torch.tensor([[40, 41, 42], [43, 44, 45]])
    torch.testing.assert_close(used.extend(prompt).logits, fresh.extend(prompt).logits, rtol=0, atol=0)
    step = torch.tensor([[50], [51]])
    torch.testing.assert_close(used.extend(step).logits, fresh.extend(step).logits, rtol=0, atol=0)
    used.reset(4, capacity=8)  # more rows than held: new storage
    assert used.cache.layers[1].keys.data_ptr() != storage and used.cache.layers[1].keys.shape[0] == 4
    kept = used.cache.layers[1].keys.data_ptr()
    used.reset(4, capacity=65)  # more tokens than held: new storage, two granules
    assert used.cache.layers[1].keys.data_ptr() != kept and used.cache.capacity == 128
