"""TargetGeometry (sglang_hspec/target/geometry.py): read from HF configs, validated, compared field by field."""

import pytest
from transformers import LlamaConfig, Qwen3Config

from sglang_hspec.assets.tiny import tiny_target
from sglang_hspec.target.geometry import TargetGeometry


def test_from_hf_config_reads_every_field_of_a_qwen3():
    cfg = Qwen3Config(vocab_size=1000, hidden_size=128, num_hidden_layers=4, num_attention_heads=8,
                      num_key_value_heads=2, head_dim=32, rope_theta=5e5, max_position_embeddings=4096,
                      rms_norm_eps=1e-5)
    g = TargetGeometry.from_hf_config(cfg)
    assert (g.model_type, g.num_hidden_layers, g.hidden_size, g.num_attention_heads, g.num_key_value_heads,
            g.head_dim, g.vocab_size, g.rope_theta, g.qk_norm, g.sliding_window, g.max_position_embeddings,
            g.rms_norm_eps) == ("qwen3", 4, 128, 8, 2, 32, 1000, 5e5, True, None, 4096, 1e-5)
    assert g.rope_scaling == {"rope_type": "default"}
    # bf16 K+V bytes/token over all layers: 2 (K,V) x 2 bytes x 4 layers x 2 heads x 32
    assert g.kv_bytes_per_token == 1024


def test_llama3_rope_scaling_and_derived_head_dim():
    cfg = LlamaConfig(vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                      rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    g = TargetGeometry.from_hf_config(cfg)
    assert g.head_dim == 16 and g.num_key_value_heads == 4 and not g.qk_norm
    assert g.rope_scaling["rope_type"] == "llama3" and g.rope_scaling["factor"] == 8.0
    assert "rope_theta" not in g.rope_scaling


def test_round_trip_and_mismatches_name_each_differing_field():
    g = TargetGeometry.from_hf_config(tiny_target("llama").config)
    assert TargetGeometry.from_dict(g.to_dict()) == g
    other = TargetGeometry.from_dict({**g.to_dict(), "num_hidden_layers": 24, "rope_theta": 1.0})
    assert g.mismatches(other) == [("num_hidden_layers", g.num_hidden_layers, 24), ("rope_theta", g.rope_theta, 1.0)]
    assert g.mismatches(g) == []


@pytest.mark.parametrize("change,match", [
    ({"model_type": "gemma"}, "model_type 'gemma' is not supported"),
    ({"num_key_value_heads": 3}, r"num_attention_heads \(4\) must be a multiple of num_key_value_heads \(3\)"),
    ({"head_dim": 0}, "head_dim must be positive"),
    ({"colour": "red"}, r"unknown target geometry fields \['colour'\]"),
])
def test_invalid_geometry_is_refused_with_the_field(change, match):
    base = TargetGeometry.from_hf_config(tiny_target("llama").config).to_dict()
    with pytest.raises(ValueError, match=match):
        TargetGeometry.from_dict({**base, **change})
