"""SGLang-shaped paged KV pools for the kernel tests: storage [num_slots, kv_heads, head_dim] with slot 0
reserved as padding (as SGLang's allocator does), pages of `page_size` consecutive slots handed out in
random order, and a token-granular req_to_token table (one slot id per position, any page size)."""

from __future__ import annotations

import torch

from sglang_hspec.kernels import PagedKVWindow


def paged_pool(*, seq_lens: list[int], kv_heads: int, head_dim: int, page_size: int, sliding_window: int,
               dtype: torch.dtype = torch.float32, pool_rows: int = 8, seed: int = 0,
               k_scale: float = 1.0, v_scale: float = 1.0) -> PagedKVWindow:
    g = torch.Generator().manual_seed(seed)
    pages_per_req = [-(-n // page_size) for n in seq_lens]
    num_pages = sum(pages_per_req) + 3  # spare pages: stale slots the window must never read
    num_slots = (num_pages + 1) * page_size  # page 0 = the padding slot(s)
    key = torch.randn(num_slots, kv_heads, head_dim, generator=g)
    value = torch.randn(num_slots, kv_heads, head_dim, generator=g)
    max_context = max(seq_lens) + 5
    req_to_token = torch.zeros(pool_rows, max_context, dtype=torch.int32)
    rows = torch.randperm(pool_rows, generator=g)[: len(seq_lens)]
    free_pages = (torch.randperm(num_pages, generator=g) + 1).tolist()
    for row, n, pages in zip(rows.tolist(), seq_lens, pages_per_req):
        slots = torch.cat([torch.arange(p * page_size, (p + 1) * page_size) for p in
                           (free_pages.pop() for _ in range(pages))]) if pages else torch.zeros(0, dtype=torch.long)
        req_to_token[row, :n] = slots[:n].to(torch.int32)
    if dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        # SGLang's set_kv_buffer stores k / k_scale cast to FP8
        key, value = (key / k_scale).to(dtype), (value / v_scale).to(dtype)
    else:
        key, value = key.to(dtype), value.to(dtype)
    return PagedKVWindow(key_buffer=key, value_buffer=value, req_to_token=req_to_token, req_pool_indices=rows,
                         seq_lens=torch.tensor(seq_lens), sliding_window=sliding_window,
                         k_scale=k_scale, v_scale=v_scale)


def with_storage(kv: PagedKVWindow, key: torch.Tensor, value: torch.Tensor, **over) -> PagedKVWindow:
    fields = dict(key_buffer=key, value_buffer=value, req_to_token=kv.req_to_token,
                  req_pool_indices=kv.req_pool_indices, seq_lens=kv.seq_lens, sliding_window=kv.sliding_window,
                  k_scale=kv.k_scale, v_scale=kv.v_scale)
    fields.update(over)
    return PagedKVWindow(**fields)


def to_device(kv: PagedKVWindow, device) -> PagedKVWindow:
    return with_storage(kv, kv.key_buffer.to(device), kv.value_buffer.to(device),
                        req_to_token=kv.req_to_token.to(device), req_pool_indices=kv.req_pool_indices.to(device),
                        seq_lens=kv.seq_lens.to(device))


def block_inputs(*, batch: int, q_heads: int, kv_heads: int, block_size: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, seed: int = 1):
    """q [B, Hq, L, D] and block k / v [B, Hkv, L, D], as Attention.forward hands them over (transposed
    views of [B, L, H, D] projections, so the strides are not the contiguous ones)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, block_size, q_heads, head_dim, generator=g).to(dtype).transpose(1, 2)
    k = torch.randn(batch, block_size, kv_heads, head_dim, generator=g).to(dtype).transpose(1, 2)
    v = torch.randn(batch, block_size, kv_heads, head_dim, generator=g).to(dtype).transpose(1, 2)
    return q, k, v
