"""Fix 3: TARGET_VERIFY for SGLang's torch_native attention backend (CPU tests only).

The DFlash-family verify window (and DSpark's draft block) is allocated in `req_to_token` before the
forward, so a verify row of request r attends to `req_to_token[r, :prefix + width]`: the committed
prefix plus its own block, causally for decoder layers (target verify) and fully for ENCODER_ONLY
layers (DSpark's non-causal draft block). A per-request Python loop, fine at CI sizes.
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
        self._run_sdpa_forward_extend(
            q_, o_,
            self.token_to_kv_pool.get_key_buffer(layer.layer_id),
            self.token_to_kv_pool.get_value_buffer(layer.layer_id),
            self.req_to_token_pool.req_to_token,
            forward_batch.req_pool_indices,
            prefix + widths,
            prefix,
            widths,
            None,
            scaling=layer.scaling,
            enable_gqa=layer.tp_q_head_num != layer.tp_k_head_num,
            causal=causal,
            sliding_window_size=window if causal and window is not None and window > -1 else None,
        )
        return o
