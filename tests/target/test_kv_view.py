"""TargetKVView (sglang_hspec/target/kv_view.py): the same window read from dense ("bhtd") and paged
("thd") storage, hand-computed indices."""

import pytest
import torch

from sglang_hspec.target.kv_view import TargetKVView, dense_window_view, window_indices


def test_window_indices_are_right_aligned_with_left_padding_masked():
    pos, valid = window_indices(torch.tensor([1, 5]), 4)
    assert pos.tolist() == [[0, 0, 0, 1], [2, 3, 4, 5]]
    assert valid.tolist() == [[False, False, True, True], [True, True, True, True]]


def test_dense_and_paged_layouts_gather_the_same_window():
    torch.manual_seed(0)
    rows, heads, T, D = 2, 2, 6, 3
    dense_k, dense_v = torch.randn(rows, heads, T, D), torch.randn(rows, heads, T, D)
    last = torch.tensor([4, 2])
    dense = dense_window_view(dense_k, dense_v, last, window=3)
    assert dense.window == 3 and dense.batch_size == 2 and dense.num_kv_heads == 2 and dense.head_dim == 3
    # the same tokens in an SGLang-style pool: request r's position p sits at slot req_to_token[r, p]
    req_to_token = torch.tensor([[7, 1, 9, 4, 0, 11], [3, 10, 5, 2, 6, 8]])
    pool_k, pool_v = torch.zeros(12, heads, D), torch.zeros(12, heads, D)
    for r in range(rows):
        for p in range(T):
            pool_k[req_to_token[r, p]] = dense_k[r, :, p]
            pool_v[req_to_token[r, p]] = dense_v[r, :, p]
    pos, valid = window_indices(last, 3)
    slots = torch.gather(req_to_token, 1, pos)
    paged = TargetKVView(key=pool_k, value=pool_v, token_index=slots, positions=pos, valid=valid, layout="thd")
    (dk, dv), (pk, pv) = dense.gather(), paged.gather()
    assert dk.shape == (2, heads, 3, D)
    torch.testing.assert_close(dk[valid[:, None, :, None].expand_as(dk)], pk[valid[:, None, :, None].expand_as(pk)])
    torch.testing.assert_close(dv[0], dense_v[0, :, 2:5])
    torch.testing.assert_close(pv[1, :, 1:], dense_v[1, :, 1:3])
    sub = paged.select(torch.tensor([1]))
    torch.testing.assert_close(sub.gather()[0][0], pk[1])


def test_dense_view_is_only_as_wide_as_the_longest_context():
    k = torch.zeros(1, 1, 10, 2)
    assert dense_window_view(k, k, torch.tensor([3]), window=2048).window == 4


@pytest.mark.parametrize("kwargs,match", [
    (dict(layout="bhtd", key=torch.zeros(4, 1, 2)), "'bhtd' views need 4-D storage"),
    (dict(layout="thd", key=torch.zeros(4, 1, 2, 2)), "'thd' views need 3-D storage"),
    (dict(layout="nhd"), "unknown KV layout 'nhd'"),
])
def test_malformed_views_are_refused(kwargs, match):
    base = dict(key=torch.zeros(4, 1, 2), value=torch.zeros(4, 1, 2), token_index=torch.zeros(1, 2, dtype=torch.long),
                positions=torch.zeros(1, 2, dtype=torch.long), valid=torch.ones(1, 2, dtype=torch.bool), layout="thd")
    base.update(kwargs)
    with pytest.raises(ValueError, match=match):
        TargetKVView(**base)
