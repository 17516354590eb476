"""The transformers compatibility layer (sglang_hspec.target.hf_compat): the KV cache goes in under the
name the installed transformers reads (`cache` from 5.24 on, `past_key_values` before: SGLang 0.5.23's
environment has 5.19, where `cache=` would vanish into **kwargs), the K/V that come back are the
attention's post-RoPE keys and values, and a forward that ignored the cache raises instead of
returning features without K/V. These tests run in both environments (`make test-sglang` too)."""

import inspect
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from sglang_hspec.assets.tiny import tiny_target
from sglang_hspec.target.hf_compat import (
    cache_kwarg,
    forward_with_kv,
    layer_kv,
    new_dynamic_cache,
)


class _New(nn.Module):
    def forward(self, input_ids=None, attention_mask=None, cache=None, use_cache=None, **kwargs):
        return None


class _Old(nn.Module):
    def forward(self, input_ids=None, attention_mask=None, past_key_values=None, use_cache=None, **kwargs):
        return None


class _KwargsOnly(nn.Module):
    def forward(self, **kwargs):
        return None


def test_cache_kwarg_follows_the_forward_signature():
    assert cache_kwarg(_New()) == "cache"
    assert cache_kwarg(_Old()) == "past_key_values"


def test_cache_kwarg_of_a_kwargs_only_wrapper_comes_from_its_base_model():
    wrapper = _KwargsOnly()
    wrapper.base_model = _Old()
    assert cache_kwarg(wrapper) == "past_key_values"
    with pytest.raises(TypeError, match="takes no KV-cache argument"):
        cache_kwarg(_KwargsOnly())


def test_cache_kwarg_of_installed_transformers_is_a_real_parameter():
    model = tiny_target("llama", num_layers=1)
    for module in (model, model.model):
        assert cache_kwarg(module) in inspect.signature(module.forward).parameters


def _rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("base", [False, True], ids=["causal_lm", "base_model"])
def test_forward_with_kv_returns_post_rope_keys_and_values(arch, base):
    """K/V of every layer equal a hand-written reference: k_proj / v_proj of the layer's normed input,
    (Qwen3: per-head k_norm), then RoPE (theta 10000, rotate-half) at positions 0..T-1, in float64."""
    target = tiny_target(arch, dtype=torch.float64, num_layers=3)
    ids = torch.randint(4, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    normed = {}
    hooks = [layer.input_layernorm.register_forward_hook(lambda m, i, o, L=L: normed.__setitem__(L, o))
             for L, layer in enumerate(target.model.layers)]
    with torch.no_grad():
        out, kv = forward_with_kv(target.model if base else target, kv_layer_ids=[0, 2, 1], input_ids=ids)
    for h in hooks:
        h.remove()
    assert list(kv) == [0, 2, 1]
    head_dim, kv_heads, T = 16, 2, ids.shape[1]
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    ang = torch.arange(T, dtype=torch.float64)[:, None] * inv_freq[None]
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    for L, (k, v) in kv.items():
        attn = target.model.layers[L].self_attn
        with torch.no_grad():
            k_ref = attn.k_proj(normed[L]).view(2, T, kv_heads, head_dim)
            if arch == "qwen3":
                k_ref = attn.k_norm(k_ref)
            k_ref = k_ref.transpose(1, 2)
            k_ref = k_ref * cos + _rotate_half(k_ref) * sin
            v_ref = attn.v_proj(normed[L]).view(2, T, kv_heads, head_dim).transpose(1, 2)
        assert k.shape == v.shape == (2, kv_heads, T, head_dim)
        # HF builds cos/sin in float32, hence ~1e-7 differences; skipped or pre-RoPE keys differ by O(1)
        torch.testing.assert_close(k, k_ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(v, v_ref, rtol=1e-10, atol=1e-10)
    if not base:  # the same forward still gives the model's ordinary output
        with torch.no_grad():
            plain = target(input_ids=ids, use_cache=False).logits
        torch.testing.assert_close(out.logits, plain)


def test_a_forward_that_ignores_the_cache_raises():
    """A model that takes the cache argument by name but never writes it (what a misnamed argument
    amounts to) gives an error, not features without K/V."""
    with pytest.raises(RuntimeError, match="ran without this cache"):
        forward_with_kv(_New(), kv_layer_ids=[0], input_ids=torch.zeros(1, 3, dtype=torch.long))
    config = tiny_target("llama", num_layers=2).config
    cache = new_dynamic_cache(config)
    with pytest.raises(RuntimeError, match="ran without this cache"):
        layer_kv(cache, 1)


def test_layer_kv_reads_older_cache_layouts():
    k, v = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4)
    assert layer_kv(SimpleNamespace(key_cache=[k], value_cache=[v]), 0) == (k, v)
    assert layer_kv(((k, v),), 0) == (k, v)
    with pytest.raises(RuntimeError, match="holds 1 layers"):
        layer_kv(((k, v),), 1)
