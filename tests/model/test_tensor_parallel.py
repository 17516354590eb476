"""The drafter sharded by KV head over two gloo ranks equals the unsharded drafter on the whole cache.

Each rank gets its shard of a target's KV cache (heads sliced, as SGLang's tensor parallelism leaves it in
each rank's pool) and runs the sharded drafter; o_proj's partial sums are all-reduced over gloo. The
reference is the unsharded drafter over every KV head, on the same rank. float32 throughout."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from sglang_hspec.assets.tiny import tiny_target
from sglang_hspec.core.types import DraftContext, SamplingParams
from sglang_hspec.kernels import PagedKVWindow
from sglang_hspec.model.tensor_parallel import shard_drafter, shard_kv_heads, torch_all_reduce
from sglang_hspec.target.kv_view import dense_window_view

from ._tiny import make_drafter, target_features

WORLD = 2
# (query heads, KV heads): the SGLang CPU tier's target shape (one KV head per rank), and two KV groups per rank
GEOMETRIES = ((4, 2), (8, 4))
TOL = dict(rtol=1e-5, atol=1e-5)


def make_target(num_heads: int = 4, num_kv_heads: int = 2):
    return tiny_target("qwen3", seed=0, dtype=torch.float32, num_layers=6, num_heads=num_heads,
                       num_kv_heads=num_kv_heads)


def _setup(num_heads: int, num_kv_heads: int):
    target = make_target(num_heads, num_kv_heads)
    ids = torch.randint(4, 128, (3, 24), generator=torch.Generator().manual_seed(0))
    model = make_drafter("hspec", target, sliding_window=8)
    return target, ids, target_features(target, ids), model


def _paged_pool(K: torch.Tensor, V: torch.Tensor, seed: int):
    """Dense per-request K/V [B, kv, T, D] laid out as SGLang's pool: [slots + 1, kv, D] in shuffled
    slots (slot 0 unused), and the token-granular page table req_to_token [B, T]."""
    B, kv, T, D = K.shape
    slots = torch.randperm(B * T, generator=torch.Generator().manual_seed(seed)) + 1
    req_to_token = slots.view(B, T)
    key_buffer, value_buffer = K.new_zeros(B * T + 1, kv, D), V.new_zeros(B * T + 1, kv, D)
    key_buffer[req_to_token] = K.transpose(1, 2)
    value_buffer[req_to_token] = V.transpose(1, 2)
    return key_buffer, value_buffer, req_to_token


def _paged_contexts(model, pools, n):
    return {i: PagedKVWindow(key_buffer=pools[lid][0], value_buffer=pools[lid][1], req_to_token=pools[lid][2],
                             req_pool_indices=torch.arange(n.shape[0]), seq_lens=n + 1,
                             sliding_window=model.sliding_window)
            for i, lid in enumerate(model.kv_layer_ids)}


def _rank(rank: int, init_file: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        for num_heads, num_kv_heads in GEOMETRIES:
            _check_geometry(rank, num_heads, num_kv_heads)
    finally:
        dist.destroy_process_group()


@torch.no_grad()
def _check_geometry(rank: int, num_heads: int, num_kv_heads: int) -> None:
    target, ids, feats, full = _setup(num_heads, num_kv_heads)
    sharded = shard_drafter(copy.deepcopy(full), rank, WORLD, torch_all_reduce())
    attn = sharded.layers[0].attn
    assert (attn.nh, attn.nkv) == (num_heads // WORLD, num_kv_heads // WORLD)
    n = torch.tensor([5, 16, 21])
    rows = torch.arange(3)
    anchor, hidden_last = ids[rows, n + 1], feats.hidden[rows, n]
    shard_kv = {lid: tuple(shard_kv_heads(t, rank, WORLD) for t in feats.kv[lid]) for lid in full.kv_layer_ids}

    # the engine's path: dense windows over the cache
    full_ctx = DraftContext(anchor, n, hidden_last,
                            {lid: dense_window_view(*feats.kv[lid], n, 8) for lid in full.kv_layer_ids})
    shard_ctx = DraftContext(anchor, n, hidden_last,
                             {lid: dense_window_view(*shard_kv[lid], n, 8) for lid in full.kv_layer_ids})
    want = full.backbone(anchor, n, hidden_last, full.propose_contexts(full_ctx))
    got = sharded.backbone(anchor, n, hidden_last, sharded.propose_contexts(shard_ctx))
    assert want.abs().max() > 0.1
    torch.testing.assert_close(got, want, **TOL)
    prop_full, prop_shard = full.propose(full_ctx, SamplingParams()), sharded.propose(shard_ctx, SamplingParams())
    assert torch.equal(prop_shard.tokens, prop_full.tokens)
    torch.testing.assert_close(prop_shard.confidence_logits, prop_full.confidence_logits, **TOL)

    # the server's path: each rank's paged pool holds its KV heads, read in place
    pools_full = {lid: _paged_pool(*feats.kv[lid], seed=lid) for lid in full.kv_layer_ids}
    pools_shard = {lid: (shard_kv_heads(k, rank, WORLD), shard_kv_heads(v, rank, WORLD), r2t)
                   for lid, (k, v, r2t) in pools_full.items()}
    want_paged = full.backbone(anchor, n, hidden_last, _paged_contexts(full, pools_full, n))
    got_paged = sharded.backbone(anchor, n, hidden_last, _paged_contexts(sharded, pools_shard, n))
    torch.testing.assert_close(want_paged, want, **TOL)
    torch.testing.assert_close(got_paged, want_paged, **TOL)

    # every rank proposes the same block (the replicated heads see the same all-reduced rows)
    gathered = [torch.empty_like(prop_shard.tokens) for _ in range(WORLD)]
    dist.all_gather(gathered, prop_shard.tokens)
    assert all(torch.equal(g, gathered[0]) for g in gathered)


def test_sharded_drafter_on_two_gloo_ranks_equals_unsharded(tmp_path):
    mp.spawn(_rank, args=(str(tmp_path / "rendezvous"),), nprocs=WORLD, join=True)


@pytest.mark.parametrize("num_kv_heads,world_size", [(2, 4), (4, 3)])
def test_shard_refuses_kv_heads_that_do_not_divide(num_kv_heads, world_size):
    target = make_target(2 * num_kv_heads, num_kv_heads)
    model = make_drafter("hspec", target)
    with pytest.raises(ValueError, match=rf"{num_kv_heads} KV heads, which {world_size} does not divide"):
        shard_drafter(model, 0, world_size, lambda x: x)
    assert model.layers[0].attn.nkv == num_kv_heads  # refused before anything was sliced


def test_world_size_one_is_untouched():
    target = make_target()
    model = make_drafter("hspec", target)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert shard_drafter(model, 0, 1, lambda x: x) is model
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
