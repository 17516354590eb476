"""FP8 target KV pools (`--kv-cache-dtype fp8_e4m3 / fp8_e5m2`): `HSpecDraftModel.bind_target_kv` finds
the per-layer k/v scales on the target's RadixAttention layers and reads them by SGLang's rule; pools it
cannot read are refused with the flag to change. The stand-in has only what bind_target_kv reads."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytestmark = pytest.mark.sglang

KV_LAYERS = (1, 3)


def _stand_in():
    t = SimpleNamespace(num_key_value_heads=2, head_dim=16)
    return SimpleNamespace(hspec_config=SimpleNamespace(target=t), drafter=SimpleNamespace(kv_layer_ids=KV_LAYERS))


def _pool(dtype, **attrs):
    buffers = {i: torch.zeros(32, 2, 16).to(dtype) for i in range(4)}
    return SimpleNamespace(get_key_buffer=buffers.__getitem__, get_value_buffer=buffers.__getitem__, **attrs)


def _target(scales: dict[int, tuple[float, float]]):
    """Attention layers as SGLang leaves them after loading: KV-cache quant method -> k_scale parameter and
    k_scale_float; layers without scales keep k_scale None."""
    from sglang.srt.layers.radix_attention import RadixAttention

    layers = torch.nn.ModuleList()
    for i in range(4):
        attn = RadixAttention(4, 16, 0.25, 2, layer_id=i)
        if i in scales:
            attn.k_scale = torch.nn.Parameter(torch.tensor(scales[i][0]), requires_grad=False)
            attn.v_scale = torch.nn.Parameter(torch.tensor(scales[i][1]), requires_grad=False)
            attn.k_scale_float, attn.v_scale_float = scales[i]
        layers.append(torch.nn.ModuleDict({"attn": attn}))
    return layers


def test_fp8_pool_reads_each_layers_scales():
    from sglang_hspec.sglang_plugin.draft_model import HSpecDraftModel

    model = _stand_in()
    HSpecDraftModel.bind_target_kv(model, _pool(torch.float8_e4m3fn), torch.zeros(2, 8, dtype=torch.int32),
                                   target_model=_target({1: (0.5, 2.0)}))
    assert HSpecDraftModel._kv_scales(model, 1) == (0.5, 2.0)
    assert HSpecDraftModel._kv_scales(model, 3) == (1.0, 1.0)  # FP8 without checkpoint scales: SGLang uses 1
    bf16 = _stand_in()
    HSpecDraftModel.bind_target_kv(bf16, _pool(torch.bfloat16), torch.zeros(2, 8, dtype=torch.int32))
    assert HSpecDraftModel._kv_scales(bf16, 1) == (1.0, 1.0)


def test_unreadable_pools_are_refused_with_the_flag():
    from sglang_hspec.sglang_plugin.draft_model import HSpecDraftModel

    r2t = torch.zeros(2, 8, dtype=torch.int32)
    with pytest.raises(ValueError, match="pass target_model"):
        HSpecDraftModel.bind_target_kv(_stand_in(), _pool(torch.float8_e5m2), r2t)
    with pytest.raises(ValueError, match=r"no RadixAttention with layer_id \[3\]"):
        HSpecDraftModel.bind_target_kv(_stand_in(), _pool(torch.float8_e4m3fn), r2t,
                                       target_model=_target({})[:3])
    with pytest.raises(ValueError, match="--kv-cache-dtype auto, bf16, fp8_e4m3 and fp8_e5m2"):
        HSpecDraftModel.bind_target_kv(_stand_in(), _pool(torch.float8_e4m3fn, is_quantized_kv_cache=True), r2t)
    with pytest.raises(ValueError, match="stored as torch.uint8"):
        HSpecDraftModel.bind_target_kv(_stand_in(), _pool(torch.uint8), r2t)
