"""Exporter from our `dspark` baseline to SGLang's DSpark layout (pure torch: runs without SGLang). The
end-to-end cases (SGLang's DSPARK serving an exported checkpoint) are in test_sglang_cpu_e2e.py (tiny Qwen3)
and test_sglang_export_dspark.py (tiny Llama, q/k norms from qk_norm, SGLang's blocks against ours)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from sglang_hspec.model.checkpoint import build_drafter, save_drafter
from sglang_hspec.model.config import HSpecConfig
from sglang_hspec.sglang_plugin.export_dspark import OUTSIDE_VOCAB_BIAS, export_dspark
from sglang_hspec.target.geometry import TargetGeometry


def _drafter(ids=(1, 0, 1, 2, 0), model_type="qwen3", kind="dspark", qk_norm=None, layer_pattern=None):
    geometry = TargetGeometry(model_type=model_type, num_hidden_layers=4, hidden_size=32, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=8, vocab_size=64, rope_theta=10000.0,
                              qk_norm=model_type == "qwen3")
    cfg = HSpecConfig(target=geometry, target_layer_ids=ids, mask_token_id=63, intermediate_size=48, block_size=3,
                      mamba_num_heads=4, mamba_head_dim=8, draft_vocab_size=50, markov_rank=8, qk_norm=qk_norm,
                      kind=kind, layer_pattern=layer_pattern)
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


def test_llama_target_exports_when_the_drafter_has_its_own_qk_norms(tmp_path):
    """SmolLM2's family has no q/k norms; a dspark drafter with qk_norm set has them, so it maps onto SGLang's
    DSpark layers weight for weight (the numerics: test_sglang_export_dspark.py, through SGLang's DSPARK)."""
    model = _drafter(model_type="llama", qk_norm=True)
    out = export_dspark(save_drafter(model, tmp_path / "ours"), tmp_path / "sglang")
    cfg, w = json.loads((out / "config.json").read_text()), load_file(str(out / "model.safetensors"))
    assert cfg["architectures"] == ["Qwen3DSparkModel"] and cfg["model_type"] == "llama"
    for i, layer in enumerate(model.layers):
        for name in ("q_norm", "k_norm"):
            assert w[f"model.layers.{i}.self_attn.{name}.weight"].equal(getattr(layer.attn, name).weight)
    assert sum(".q_norm." in k or ".k_norm." in k for k in w) == 10


def test_export_refusal_without_qk_norms_names_the_fix(tmp_path):
    src = save_drafter(_drafter(model_type="qwen3", qk_norm=False), tmp_path / "ours")
    with pytest.raises(ValueError) as err:
        export_dspark(src, tmp_path / "sglang")
    assert str(err.value) == (f"{src} holds a dspark drafter without q/k norms (qk_norm false; trained for a qwen3 "
                              "target); SGLang's DSpark layers always apply them, so it cannot export exactly: "
                              "retrain it with model.drafter.qk_norm: true (configs/train_dspark_smollm2.yaml does)")
    assert not (tmp_path / "sglang").exists()


@pytest.mark.parametrize("kwargs,match", [
    ({"kind": "hspec"}, "only 'dspark'"),
    ({"model_type": "llama"}, "without q/k norms"),  # qk_norm unset: the target's, none
    ({"ids": (0, 1, 2, 3, 3)}, "never captures"),
    ({"layer_pattern": ("AF", "MAF", "AF")}, r"layer_pattern \['AF', 'MAF', 'AF'\]; every SGLang DSpark layer"),
])
def test_export_refuses_what_sglang_dspark_cannot_reproduce(tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        export_dspark(save_drafter(_drafter(**kwargs), tmp_path / "ours"), tmp_path / "sglang")
