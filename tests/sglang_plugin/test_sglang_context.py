"""H-Spec's context inside SGLang: target-KV views over a paged pool and the per-request state rows
(pure torch; runs without SGLang)."""

from __future__ import annotations

import torch

from sglang_hspec.sglang_plugin.context import (
    ContextState,
    drafter_kv_bytes_saved,
    pool_kv_view,
    prefill_last_rows,
    verify_commit_rows,
)


def _paged_pool(seq_lens, *, num_slots=64, heads=2, dim=4, seed=0):
    """A pool whose slots are scattered (as SGLang's allocator leaves them) plus the dense per-request
    keys/values they hold, position by position."""
    g = torch.Generator().manual_seed(seed)
    k_buf = torch.randn(num_slots, heads, dim, generator=g)
    v_buf = torch.randn(num_slots, heads, dim, generator=g)
    perm = torch.randperm(num_slots - 1, generator=g) + 1  # slot 0 is SGLang's padding slot
    req_to_token = torch.zeros(4, 32, dtype=torch.int32)
    req_rows = torch.tensor([3, 1])  # requests live in arbitrary pool rows
    used = 0
    for r, n in zip(req_rows.tolist(), seq_lens):
        req_to_token[r, :n] = perm[used:used + n].to(torch.int32)
        used += n
    return k_buf, v_buf, req_to_token, req_rows


def test_pool_view_reads_each_requests_last_window_in_place():
    seq_lens = [9, 3]
    k_buf, v_buf, req_to_token, rows = _paged_pool(seq_lens)
    view = pool_kv_view(key_buffer=k_buf, value_buffer=v_buf, req_to_token=req_to_token, req_pool_indices=rows,
                        prefix_lens=torch.tensor(seq_lens), window=5)
    assert view.layout == "thd" and view.key is k_buf  # no copy of the pool
    k, v = view.gather()  # [B, heads, W, dim]
    # request 0: positions 4..8, all valid; request 1: positions 0..2 right-aligned, 2 padding entries
    assert view.positions.tolist() == [[4, 5, 6, 7, 8], [0, 0, 0, 1, 2]]
    assert view.valid.tolist() == [[True] * 5, [False, False, True, True, True]]
    for b, r in enumerate(rows.tolist()):
        for w in range(5):
            if view.valid[b, w]:
                slot = int(req_to_token[r, int(view.positions[b, w])])
                assert torch.equal(k[b, :, w], k_buf[slot]) and torch.equal(v[b, :, w], v_buf[slot])


def test_pool_view_attention_matches_dense_reference():
    seq_lens = [9, 3]
    k_buf, v_buf, req_to_token, rows = _paged_pool(seq_lens, seed=1)
    view = pool_kv_view(key_buffer=k_buf, value_buffer=v_buf, req_to_token=req_to_token, req_pool_indices=rows,
                        prefix_lens=torch.tensor(seq_lens), window=16)
    q = torch.randn(2, 2, 1, 4, generator=torch.Generator().manual_seed(2))
    k, v = view.gather()
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=view.valid[:, None, None, :])
    for b, (r, n) in enumerate(zip(rows.tolist(), seq_lens)):
        slots = req_to_token[r, :n].long()
        ref = torch.nn.functional.scaled_dot_product_attention(
            q[b:b + 1], k_buf[slots].transpose(0, 1)[None], v_buf[slots].transpose(0, 1)[None])
        torch.testing.assert_close(out[b:b + 1], ref)


def test_prefill_rows_are_each_requests_last_prompt_token():
    assert prefill_last_rows([3, 1, 4], torch.device("cpu")).tolist() == [2, 3, 7]


def test_verify_rows_are_the_last_committed_token():
    bs, stride, width = 3, 4, 2
    hidden = torch.arange(bs * stride * width, dtype=torch.float32).view(bs * stride, width)
    commit_lens = torch.tensor([1, 4, 2, 99])  # padded beyond bs
    rows = verify_commit_rows(hidden, commit_lens, bs)
    # request b row commit_lens[b] - 1 of its stride-4 block
    assert rows.tolist() == [hidden[0].tolist(), hidden[7].tolist(), hidden[9].tolist()]


def test_context_state_writes_projected_rows_per_request_slot():
    proj = torch.nn.Linear(6, 3, bias=False)
    with torch.no_grad():
        proj.weight.copy_(torch.arange(18, dtype=torch.float32).view(3, 6) / 10)
    state = ContextState(req_pool_size=5, rank=3, project=proj, device="cpu", dtype=torch.float32)
    h = torch.randn(2, 6)
    with torch.no_grad():
        state.write(torch.tensor([4, 1]), h)
        torch.testing.assert_close(state.read(torch.tensor([1, 4])), proj(h)[[1, 0]])
        assert state.read(torch.tensor([0, 2, 3])).abs().sum() == 0
        state.write(torch.tensor([4]), h[1:])  # slot reuse overwrites
        torch.testing.assert_close(state.read(torch.tensor([4]))[0], proj(h[1]))
    assert state.nbytes == 5 * 3 * 4


def test_kv_bytes_saved_hand_computed():
    # 3 attention layers reading Qwen3-8B's KV (8 kv heads x 128) for 100k bf16 tokens
    assert drafter_kv_bytes_saved(max_total_tokens=100_000, num_attention_layers=3, num_kv_heads=8,
                                  head_dim=128, dtype_bytes=2) == 2 * 100_000 * 3 * 8 * 128 * 2
