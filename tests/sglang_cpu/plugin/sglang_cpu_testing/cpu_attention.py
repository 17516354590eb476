"""Fix 3: TARGET_VERIFY for SGLang's torch_native attention backend (CPU tests only).

The DFlash-family verify window (and DSpark's draft block) is allocated in `req_to_token` before the
forward, so a verify row of request r attends to `req_to_token[r, :prefix + width]`: the committed
prefix plus its own block, causally for decoder layers (target verify) and fully for ENCODER_ONLY
layers (DSpark's non-causal draft block). A per-request Python loop, fine at CI sizes.

Each request's SDPA takes only its verify rows as queries, with the causal (and sliding-window) mask
aligned to their positions prefix + i. SGLang's `_run_sdpa_forward_extend` instead pads the queries to
the whole context and keeps the last rows, which made a verify of w tokens over a context of n cost
like n query rows: a step verifying only the anchor cost 1.3 plain decode steps on the embedded target
(docs/serving.md, "Where an HSPEC step's time goes").
"""

from __future__ import annotations

import torch
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
from sglang.srt.layers.radix_attention import AttentionType
from sglang.srt.mem_cache.memory_pool import KVWriteLoc
from sglang.srt.speculative.ragged_verify import resolve_ragged_verify_layout


class TorchNativeAttnBackendWithVerify(TorchNativeAttnBackend):
    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        if not forward_batch.forward_mode.is_target_verify():
            return super().forward_extend(q, k, v, layer, forward_batch, save_kv_cache)
        if save_kv_cache and k is not None and v is not None:
            self.token_to_kv_pool.set_kv_buffer(
                layer, KVWriteLoc(forward_batch.out_cache_loc, self.swa_out_cache_loc), k, v
            )
        prefix = forward_batch.seq_lens
        bs = prefix.shape[0]
        q_ = q.reshape(-1, layer.tp_q_head_num, layer.qk_head_dim)
        rows = q_.shape[0]
        layout = resolve_ragged_verify_layout(forward_batch)
        if layout is not None:
            # compact mode: uneven widths; padding rows beyond their sum stay zero
            widths = layout.verify_lens.to(device=prefix.device, dtype=prefix.dtype)
        else:
            widths = torch.full_like(prefix, rows // bs)
        o = q.new_zeros((rows, layer.tp_q_head_num * layer.v_head_dim))
        o_ = o.view(-1, layer.tp_q_head_num, layer.v_head_dim)
        causal = layer.attn_type != AttentionType.ENCODER_ONLY
        window = layer.sliding_window_size
        verify_attention(
            q_, o_,
            self.token_to_kv_pool.get_key_buffer(layer.layer_id),
            self.token_to_kv_pool.get_value_buffer(layer.layer_id),
            self.req_to_token_pool.req_to_token,
            forward_batch.req_pool_indices,
            prefix,
            widths,
            scaling=layer.scaling,
            enable_gqa=layer.tp_q_head_num != layer.tp_k_head_num,
            causal=causal,
            sliding_window_size=window if causal and window is not None and window > -1 else None,
        )
        return o


def verify_attention(query, output, k_cache, v_cache, req_to_token, req_pool_indices, prefix_lens, widths, *,
                     scaling, enable_gqa, causal, sliding_window_size=None) -> None:
    """Per request r: its widths[r] query rows (packed in `query` [rows, heads, dim]) attend to the keys
    of req_to_token[r, :prefix + width]; row i sits at position prefix + i. Causal: key j is visible iff
    j <= prefix + i (and j >= prefix + i - sliding_window_size with a window, SGLang's rule); otherwise
    every key is. Writes `output` [rows, heads, dim]; rows past sum(widths) are left as they are."""
    start = 0
    for r, (prefix, width) in enumerate(zip(prefix_lens.tolist(), widths.tolist())):
        if width <= 0:
            continue
        n = prefix + width
        tokens = req_to_token[req_pool_indices[r], :n]
        q = query[start:start + width].movedim(0, 1)  # [heads, width, dim]
        k = k_cache[tokens].movedim(0, 1)
        v = v_cache[tokens].movedim(0, 1)
        if k.dtype != q.dtype:
            k, v = k.to(q.dtype), v.to(q.dtype)
        mask = None
        if causal and (width > 1 or sliding_window_size is not None):
            q_pos = torch.arange(prefix, n, device=q.device)[:, None]
            k_pos = torch.arange(n, device=q.device)[None, :]
            mask = k_pos <= q_pos
            if sliding_window_size is not None:
                mask &= k_pos >= q_pos - sliding_window_size
        out = torch.nn.functional.scaled_dot_product_attention(
            q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), attn_mask=mask, scale=scaling, enable_gqa=enable_gqa)
        output[start:start + width] = out[0].movedim(0, 1)
        start += width
