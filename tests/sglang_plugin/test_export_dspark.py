"""Exporter from our `dspark` baseline to SGLang's DSpark layout (pure torch: runs without SGLang). The
end-to-end case (SGLang's DSPARK serving an exported checkpoint) is in test_sglang_cpu_e2e.py."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from sglang_hspec.model.checkpoint import build_drafter, save_drafter
from sglang_hspec.model.config import HSpecConfig
from sglang_hspec.sglang_plugin.export_dspark import OUTSIDE_VOCAB_BIAS, export_dspark
from sglang_hspec.target.geometry import TargetGeometry


def _drafter(ids=(1, 0, 1, 2, 0), model_type="qwen3", kind="dspark"):
    geometry = TargetGeometry(model_type=model_type, num_hidden_layers=4, hidden_size=32, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=8, vocab_size=64, rope_theta=10000.0,
                              qk_norm=model_type == "qwen3")
    cfg = HSpecConfig(target=geometry, target_layer_ids=ids, mask_token_id=63, intermediate_size=48, block_size=3,
                      mamba_num_heads=4, mamba_head_dim=8, draft_vocab_size=50, markov_rank=8)
    g = torch.Generator().manual_seed(0)
    model = build_drafter(kind, cfg, torch.nn.Embedding(64, 32), torch.nn.Linear(32, 64, bias=False))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    model.set_draft_vocab(torch.arange(0, 64, dtype=torch.long)[torch.randperm(64, generator=g)[:50]].sort().values)
    return model


@torch.no_grad()
def test_export_folds_capture_order_and_draft_vocabulary_exactly(tmp_path):
    model = _drafter()
    out = export_dspark(save_drafter(model, tmp_path / "ours"), tmp_path / "sglang")
    cfg, w = json.loads((out / "config.json").read_text()), load_file(str(out / "model.safetensors"))
    assert cfg["architectures"] == ["Qwen3DSparkModel"] and cfg["model_type"] == "qwen3"
    assert cfg["dflash_config"]["target_layer_ids"] == [0, 1, 2] and cfg["sample_from_anchor"] is True
    assert cfg["markov_rank"] == 9  # 8 + the outside-vocabulary column
    H = 32
    g = torch.Generator().manual_seed(1)
    per_layer = torch.randn(5, 3, H, generator=g)  # captured rows of target layers 0, 1, 2
    ours = torch.cat([per_layer[:, i] for i in (1, 0, 1, 2, 0)], dim=-1) @ model.fc.weight.T
    theirs = per_layer.flatten(1) @ w["model.fc.weight"].T
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)

    prev = torch.arange(64)  # every previous token, inside and outside the draft vocabulary
    h = torch.randn(64, H, generator=g)
    ref = model.head_outputs(h, prev)
    emb = w["markov_head.markov_w1.weight"][prev]
    full = h @ model._target[1].weight.T + emb @ w["markov_head.markov_w2.weight"].T
    torch.testing.assert_close(full[:, model.d2t], ref.logits, rtol=1e-5, atol=1e-5)
    outside = torch.ones(64, dtype=torch.bool)
    outside[model.d2t] = False
    assert (full[:, outside] < OUTSIDE_VOCAB_BIAS / 2).all()
    conf = torch.cat([h, emb], -1) @ w["confidence_head.proj.weight"].T + w["confidence_head.proj.bias"]
    torch.testing.assert_close(conf.squeeze(-1), ref.confidence_logits, rtol=1e-5, atol=1e-5)
    assert w["model.layers.4.self_attn.k_norm.weight"].equal(model.layers[4].attn.k_norm.weight)
    assert w["model.layers.2.input_layernorm.weight"].equal(model.layers[2].attn_norm.weight)


@pytest.mark.parametrize("kwargs,match", [
    ({"kind": "hspec"}, "only 'dspark'"),
    ({"model_type": "llama"}, "without q/k norms"),
    ({"ids": (0, 1, 2, 3, 3)}, "never captures"),
])
def test_export_refuses_what_sglang_dspark_cannot_reproduce(tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        export_dspark(save_drafter(_drafter(**kwargs), tmp_path / "ours"), tmp_path / "sglang")
