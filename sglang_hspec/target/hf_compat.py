"""The one place that knows how Hugging Face causal LMs take a KV cache and where they leave it.

We support two transformers lines at once: the main environment (transformers >= 5.24) and SGLang
0.5.23's environment (it pins transformers 5.19). They differ in the name of the cache argument of
`forward`: `cache` from 5.24 on (with `past_key_values` a deprecated alias), `past_key_values`
before. A wrong name is not an error: the model swallows it into `**kwargs`, builds its own cache and
leaves ours empty. Everything here is detected from the installed objects (signatures, attributes),
never from version strings, and a forward that left the cache untouched raises instead of returning
features without K/V.

Per-layer K/V are read from the cache's layered layout (`cache.layers[L].keys`, transformers >=
4.56); older `key_cache` lists and legacy per-layer tuples are read too.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn
from transformers.cache_utils import DynamicCache

CACHE_KWARG_NAMES = ("cache", "past_key_values")


def _forward_parameters(module: nn.Module):
    return inspect.signature(module.forward).parameters


def cache_kwarg(module: nn.Module) -> str:
    """The name of `module.forward`'s KV-cache argument: `cache` (transformers >= 5.24) or
    `past_key_values` (earlier releases). A wrapper whose forward takes neither by name (`**kwargs`
    only) is answered by the HF model it wraps (`base_model`)."""
    seen = []
    for candidate in (module, getattr(module, "base_model", None)):
        if candidate is None or candidate in seen:
            continue
        seen.append(candidate)
        params = _forward_parameters(candidate)
        for name in CACHE_KWARG_NAMES:
            if name in params:
                return name
    raise TypeError(
        f"{type(module).__name__}.forward takes no KV-cache argument (neither of {CACHE_KWARG_NAMES}); "
        "pass a Hugging Face causal LM (e.g. LlamaForCausalLM) or its base model"
    )


def call_with_cache(module: nn.Module, cache, *, cache_arg: str | None = None, **inputs):
    """`module(**inputs)` with `cache` passed under the name the installed transformers reads (give
    `cache_arg = cache_kwarg(module)` from a hot loop to skip the signature lookup), and `use_cache=True`."""
    inputs.setdefault("use_cache", True)
    return module(**inputs, **{cache_arg or cache_kwarg(module): cache})


def new_dynamic_cache(config=None) -> DynamicCache:
    """An empty DynamicCache, laid out from `config` when this transformers accepts one (sliding and
    full layers then get their own layer types)."""
    if config is not None and "config" in inspect.signature(DynamicCache.__init__).parameters:
        return DynamicCache(config=config)
    return DynamicCache()


def num_cached_layers(cache) -> int:
    if hasattr(cache, "layers"):
        return len(cache.layers)
    if hasattr(cache, "key_cache"):
        return len(cache.key_cache)
    return len(cache)


def layer_kv(cache, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(keys, values) of decoder layer `layer_id` as stored by the attention: post-RoPE keys,
    [B, kv_heads, T, head_dim]. Raises if the layer holds nothing (the forward did not write it)."""
    layer_id = int(layer_id)
    n = num_cached_layers(cache)
    if not 0 <= layer_id < n:
        raise RuntimeError(
            f"the KV cache holds {n} layers, so layer {layer_id} was not written: the model ran without "
            "this cache (a KV-cache argument its forward ignores?)"
        )
    if hasattr(cache, "layers"):
        layer = cache.layers[layer_id]
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        initialized = getattr(layer, "is_initialized", keys is not None)
    elif hasattr(cache, "key_cache"):
        keys, values = cache.key_cache[layer_id], cache.value_cache[layer_id]
        initialized = keys is not None
    else:
        keys, values = cache[layer_id][:2]
        initialized = True
    if not initialized or keys is None or keys.dim() != 4:
        raise RuntimeError(
            f"layer {layer_id} of the KV cache holds no keys after the forward: the model ran without this "
            "cache (a KV-cache argument its forward ignores?)"
        )
    return keys, values


def forward_with_kv(module: nn.Module, *, kv_layer_ids=(), cache=None, **inputs):
    """Run `module` (a causal LM or its base model) with a KV cache and return `(output, kv)`, where
    kv maps each id in `kv_layer_ids` to that decoder layer's post-RoPE (K, V), [B, kv_heads, T,
    head_dim]. A fresh DynamicCache is used unless `cache` is given."""
    if cache is None:
        cache = new_dynamic_cache(getattr(module, "config", None))
    out = call_with_cache(module, cache, **inputs)
    kv = {int(i): layer_kv(cache, i) for i in kv_layer_ids}
    return out, kv
