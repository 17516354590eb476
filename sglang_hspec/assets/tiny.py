"""Tiny random Llama / Qwen2 / Qwen3 targets for fast unit tests (built in code, no files)."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

_CONFIGS = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}


def tiny_target_config(
    arch: str = "llama",
    *,
    vocab_size: int = 128,
    hidden_size: int = 64,
    num_layers: int = 6,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    intermediate_size: int = 128,
    rope_theta: float = 10000.0,
    max_position_embeddings: int = 4096,
):
    if arch not in _CONFIGS:
        raise ValueError(f"unknown tiny target arch {arch!r}; choose one of {sorted(_CONFIGS)}")
    cfg = _CONFIGS[arch](
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    if arch == "qwen2":
        cfg.use_sliding_window = False
    return cfg


def tiny_target(arch: str = "llama", *, seed: int = 0, dtype: torch.dtype = torch.float32, **kwargs):
    """A randomly initialised causal LM in eval mode. Same (arch, seed, kwargs) -> same weights.

    The init is scaled up (std 0.2 instead of 0.02) so that next-token distributions are peaked
    enough for speculative-decoding tests to see both acceptances and rejections."""
    cfg = tiny_target_config(arch, **kwargs)
    cfg.initializer_range = 0.2
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    return model.eval()
