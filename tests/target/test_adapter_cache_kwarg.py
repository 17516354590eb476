"""The adapter passes its KV cache under the name the installed transformers expects: `cache` from 5.24
on, `past_key_values` before (SGLang 0.5.23's environment has 5.19, where `cache=` would vanish into
**kwargs and every extend would run without the cache)."""

import inspect

from torch import nn

from sglang_hspec.target.adapter import cache_kwarg


class _New(nn.Module):
    def forward(self, input_ids=None, attention_mask=None, cache=None, use_cache=None, **kwargs):
        return None


class _Old(nn.Module):
    def forward(self, input_ids=None, attention_mask=None, past_key_values=None, use_cache=None, **kwargs):
        return None


def test_cache_kwarg_follows_the_forward_signature():
    assert cache_kwarg(_New()) == "cache"
    assert cache_kwarg(_Old()) == "past_key_values"


def test_cache_kwarg_of_installed_transformers_is_a_real_parameter():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1)
    model = LlamaForCausalLM(cfg)
    for module in (model, model.model):
        assert cache_kwarg(module) in inspect.signature(module.forward).parameters
