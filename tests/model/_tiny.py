"""Tiny float64 targets + drafters and the features the target adapter will provide."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang_hspec.assets.tiny import tiny_target
from sglang_hspec.model import HSpecConfig, build_drafter
from sglang_hspec.target.geometry import TargetGeometry
from sglang_hspec.target.hf_compat import forward_with_kv

LAYER_IDS = (0, 1, 2, 3, 5)


@dataclass
class Features:
    hidden: torch.Tensor  # [B, T, 5, d] for LAYER_IDS
    kv: dict  # layer id -> (K, V) [B, kv, T, D], post-RoPE
    all_hidden: torch.Tensor  # [B, T, layers, d]


def make_target(arch="qwen3", dtype=torch.float64, seed=0):
    return tiny_target(arch, seed=seed, dtype=dtype, num_layers=6)


def target_features(target, ids) -> Features:
    n_layers = target.config.num_hidden_layers
    with torch.no_grad():  # the cache argument's name differs across transformers releases
        out, kv = forward_with_kv(target, kv_layer_ids=range(n_layers), input_ids=ids, output_hidden_states=True)
    all_hidden = torch.stack(out.hidden_states[1:], dim=2)
    return Features(all_hidden[:, :, list(LAYER_IDS)], kv, all_hidden)


def make_config(target, **over) -> HSpecConfig:
    kw = dict(target=TargetGeometry.from_hf_config(target.config), target_layer_ids=LAYER_IDS, mask_token_id=3,
              intermediate_size=96, mamba_num_heads=4, mamba_head_dim=8, mamba_groups=2, mamba_state_dim=4,
              fusion_rank=32, markov_rank=16, draft_vocab_size=100)
    kw.update(over)
    return HSpecConfig(**kw)


def make_drafter(kind, target, seed=1, **over):
    torch.manual_seed(seed)
    model = build_drafter(kind, make_config(target, **over), target.model.embed_tokens, target.lm_head)
    model = model.to(target.dtype)
    with torch.no_grad():  # a trained-looking Markov head (it starts at zero) and varied Mamba decays
        if model.markov is not None:
            model.markov.markov_w2.weight.normal_(0, 0.5)
        for layer in model.layers:
            if layer.mamba is not None:
                layer.mamba.dt_bias.normal_(0, 0.5)
                layer.mamba.D.normal_()
    return model.eval()
