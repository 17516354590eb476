"""The CPU tier's TARGET_VERIFY attention (tests/sglang_cpu/plugin/sglang_cpu_testing/cpu_attention.py)
against SGLang's own torch_native extend attention, which pads every request's queries to its whole
context: the same outputs (float64) for ragged verify widths (0, 1, several), GQA, causal and
non-causal layers and a sliding window, over a scattered paged KV pool."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.sglang
PLUGIN_DIR = Path(__file__).resolve().parents[1] / "sglang_cpu" / "plugin"  # imported, not loaded as a plugin


@pytest.mark.parametrize("causal,window", [(True, None), (False, None), (True, 5)])
def test_verify_attention_equals_sglang_extend_attention(causal, window):
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    if str(PLUGIN_DIR) not in sys.path:
        sys.path.insert(0, str(PLUGIN_DIR))
    from sglang_cpu_testing.cpu_attention import verify_attention

    g = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, slots = 4, 2, 8, 256
    prefix = torch.tensor([7, 1, 30, 12, 4])
    widths = torch.tensor([1, 8, 3, 0, 5])
    k_cache = torch.randn(slots, kv_heads, dim, generator=g, dtype=torch.float64)
    v_cache = torch.randn(slots, kv_heads, dim, generator=g, dtype=torch.float64)
    req_to_token = torch.zeros(8, 64, dtype=torch.int64)
    free = (torch.randperm(slots - 1, generator=g) + 1).tolist()  # scattered slots
    req_pool_indices = torch.tensor([3, 0, 6, 1, 5])
    for r, n in zip(req_pool_indices.tolist(), (prefix + widths).tolist()):
        req_to_token[r, :n] = torch.tensor([free.pop() for _ in range(n)])
    rows = int(widths.sum())
    query = torch.randn(rows + 2, heads, dim, generator=g, dtype=torch.float64)  # 2 padding rows
    ours = torch.full_like(query, 7.0)
    verify_attention(query, ours, k_cache, v_cache, req_to_token, req_pool_indices, prefix, widths,
                     scaling=dim ** -0.5, enable_gqa=True, causal=causal, sliding_window_size=window)

    reference = torch.zeros_like(query)
    backend = TorchNativeAttnBackend.__new__(TorchNativeAttnBackend)  # the method reads no backend state
    backend._run_sdpa_forward_extend(query, reference, k_cache, v_cache, req_to_token, req_pool_indices,
                                     prefix + widths, prefix, widths, None, scaling=dim ** -0.5, enable_gqa=True,
                                     causal=causal, sliding_window_size=window)
    torch.testing.assert_close(ours[:rows], reference[:rows], rtol=1e-12, atol=1e-12)
    assert torch.equal(ours[rows:], torch.full_like(ours[rows:], 7.0))  # rows past the widths untouched
    if causal:  # the mask matters: without it the later rows of a block would see the block's future
        unmasked = torch.zeros_like(query)
        verify_attention(query, unmasked, k_cache, v_cache, req_to_token, req_pool_indices, prefix, widths,
                         scaling=dim ** -0.5, enable_gqa=True, causal=False)
        assert not torch.allclose(unmasked[:rows], reference[:rows])
