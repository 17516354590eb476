"""HSPEC server-argument handling (pure: runs without SGLang; SGLang hands these functions a recorder
with the same attribute interface as the SimpleNamespace used here)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from sglang_hspec.model.config import HSpecConfig
from sglang_hspec.sglang_plugin import server_args as sa
from sglang_hspec.target.geometry import TargetGeometry


def _target_config(**overrides) -> dict:
    from sglang_cpu.builders import tiny_qwen3_config

    cfg = tiny_qwen3_config(num_hidden_layers=6).to_dict()
    cfg.update(overrides)
    return cfg


def _write(path, config: dict):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    return path


def _drafter_config(target: dict, block_size: int = 7) -> dict:
    from transformers import AutoConfig

    geometry = TargetGeometry.from_hf_config(AutoConfig.for_model(**target))
    cfg = HSpecConfig(target=geometry, target_layer_ids=(0, 1, 2, 3, 4), mask_token_id=1000,
                      intermediate_size=256, block_size=block_size, mamba_num_heads=4, draft_vocab_size=512)
    return {"architectures": ["HSpecDraftModel"], "hspec": cfg.to_dict()}


def _write_drafter(path, config: dict):
    """config.json and a model.safetensors the launcher's header check reads (the weights are never loaded here)."""
    import torch
    from safetensors.torch import save_file

    _write(path, config)
    save_file({"placeholder": torch.zeros(1)}, str(path / "model.safetensors"))
    return path


@pytest.fixture
def ckpts(tmp_path):
    target = _target_config()
    return {
        "target": _write(tmp_path / "target", target),
        "draft": _write_drafter(tmp_path / "draft", _drafter_config(target)),
        "draft5": _write_drafter(tmp_path / "draft5", _drafter_config(target, block_size=5)),
    }


def test_a_truncated_drafter_is_named_before_anything_starts(ckpts):
    weights = ckpts["draft"] / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:20])
    with pytest.raises(ValueError, match=rf"^{weights} cannot be read as safetensors \(.*\): it is truncated or "
                                         "damaged; re-copy the checkpoint"):
        sa.handle_server_args(_args(ckpts))


def _args(ckpts, **kw):
    base = dict(model_path=str(ckpts["target"]), speculative_draft_model_path=str(ckpts["draft"]),
                speculative_num_draft_tokens=None, speculative_dspark_block_size=None,
                speculative_num_steps=None, speculative_eagle_topk=None, max_running_requests=None,
                enable_mixed_chunk=False, pp_size=1, enable_dp_attention=False, disaggregation_mode="null",
                enable_unified_memory=False)
    base.update(kw)
    return SimpleNamespace(**base)


@pytest.mark.parametrize("draft,num_draft_tokens", [("draft", 8), ("draft5", 6)])
def test_draft_tokens_are_block_size_plus_one_from_the_checkpoint(ckpts, draft, num_draft_tokens):
    args = _args(ckpts, speculative_draft_model_path=str(ckpts[draft]))
    sa.validate_server_args(args)
    sa.handle_server_args(args)
    assert args.speculative_num_draft_tokens == num_draft_tokens
    assert (args.speculative_num_steps, args.speculative_eagle_topk) == (1, 1)
    assert args.max_running_requests == 48
    assert args.enable_mixed_chunk is False


def test_explicit_values_that_agree_are_kept(ckpts):
    args = _args(ckpts, speculative_num_draft_tokens=8, speculative_dspark_block_size=7, max_running_requests=3,
                 enable_mixed_chunk=True, speculative_num_steps=4)
    sa.handle_server_args(args)
    assert args.speculative_num_draft_tokens == 8
    assert args.max_running_requests == 3
    assert args.speculative_num_steps == 1
    assert args.enable_mixed_chunk is False


@pytest.mark.parametrize("flag,value,match", [
    ("speculative_num_draft_tokens", 5, r"--speculative-num-draft-tokens 5 .* block size is 7.* pass 8"),
    ("speculative_dspark_block_size", 3, r"--speculative-dspark-block-size 3 .* block size 7"),
])
def test_disagreeing_draft_width_is_rejected(ckpts, flag, value, match):
    with pytest.raises(ValueError, match=match):
        sa.handle_server_args(_args(ckpts, **{flag: value}))


def test_draft_model_path_is_required(ckpts):
    with pytest.raises(ValueError, match="requires --speculative-draft-model-path"):
        sa.validate_server_args(_args(ckpts, speculative_draft_model_path=None))


def test_a_non_hspec_draft_is_rejected(ckpts, tmp_path):
    dspark = _write(tmp_path / "dspark", {"architectures": ["Qwen3DSparkModel"], "model_type": "qwen3"})
    with pytest.raises(ValueError, match="not an H-Spec drafter.*--speculative-algorithm DSPARK"):
        sa.validate_server_args(_args(ckpts, speculative_draft_model_path=str(dspark)))


def test_sample_from_anchor_false_is_rejected(ckpts, tmp_path):
    cfg = json.loads((ckpts["draft"] / "config.json").read_text())
    bad = _write(tmp_path / "bad_draft", {**cfg, "sample_from_anchor": False})
    with pytest.raises(ValueError, match="sample_from_anchor=False.*set it to true"):
        sa.validate_server_args(_args(ckpts, speculative_draft_model_path=str(bad)))


def test_a_missing_draft_dir_is_a_clear_error(ckpts, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match="neither a local checkpoint directory nor a cached hub model"):
        sa.validate_server_args(_args(ckpts, speculative_draft_model_path=str(tmp_path / "nope")))


@pytest.mark.parametrize("overrides,match", [
    ({"kv_lora_rank": 512, "q_lora_rank": 1536}, "MLA/DSA"),
    ({"index_topk": 2048}, "MLA/DSA"),
    ({"layer_types": ["sliding_attention"] * 5 + ["full_attention"]}, "hybrid sliding-window"),
    ({"sliding_window_pattern": 6}, "hybrid sliding-window"),
    ({"layer_types": ["linear_attention", "full_attention"] * 3}, "linear-attention"),
])
def test_unsupported_targets_are_rejected(ckpts, tmp_path, overrides, match):
    target = _write(tmp_path / "bad_target", _target_config(**overrides))
    with pytest.raises(ValueError, match=f"HSPEC cannot serve target .*{match}"):
        sa.validate_server_args(_args(ckpts, model_path=str(target)))


def test_multimodal_wrapper_is_checked_on_its_text_config():
    assert sa.unsupported_target_reason({"text_config": {"kv_lora_rank": 512}}).startswith("MLA")
    assert sa.unsupported_target_reason(_target_config()) is None


@pytest.mark.parametrize("kw,match", [
    ({"pp_size": 2}, "pipeline parallelism"),
    ({"enable_dp_attention": True}, "DP attention"),
    ({"disaggregation_mode": "decode"}, "disaggregation"),
    ({"enable_unified_memory": True}, "unified-memory"),
    # block-scaled KV pools: the drafter's attention dequantises per-tensor FP8 only
    ({"kv_cache_dtype": "nvfp4"}, "--kv-cache-dtype nvfp4"),
    ({"kv_cache_dtype": "mxfp8"}, "--kv-cache-dtype mxfp8"),
])
def test_unsupported_parallel_modes_are_rejected(ckpts, kw, match):
    with pytest.raises(ValueError, match=match):
        sa.validate_server_args(_args(ckpts, **kw))


@pytest.mark.parametrize("tp_size", [3, 4])
def test_tensor_parallelism_that_splits_a_kv_head_is_refused_before_any_weight_loads(ckpts, tp_size):
    """Each rank's drafter reads whole KV heads of its rank's pool (model/tensor_parallel.py): a TP size that
    does not divide the target's 2 KV heads is refused at argument validation, naming both numbers."""
    with pytest.raises(ValueError) as e:
        sa.validate_server_args(_args(ckpts, tp_size=tp_size))
    msg = str(e.value)
    assert f"--tp-size {tp_size}" in msg and "--tp" in msg  # the flag, as either spelling
    assert f"2 KV heads, which {tp_size} does not divide" in msg  # the reason, with both numbers
    assert "divides 2" in msg  # the fix


@pytest.mark.parametrize("tp_size", [1, 2])
def test_tensor_parallelism_that_divides_the_kv_heads_is_accepted(ckpts, tp_size):
    sa.validate_server_args(_args(ckpts, tp_size=tp_size))


@pytest.mark.parametrize("kw", [{"dp_size": 2}, {"dp_size": 4, "tp_size": 1}])
def test_data_parallel_replicas_are_accepted(ckpts, kw):
    """--dp-size N without DP attention: SGLang 0.5.23's DataParallelController starts N independent
    schedulers (launch_dp_schedulers), each its own TP group with the whole model, so each replica's drafter
    reads its own pool with every KV head."""
    sa.validate_server_args(_args(ckpts, **kw))


def test_attention_data_parallelism_is_refused(ckpts):
    """SGLang folds --enable-dp-attention --dp-size N into attn_dp_size N (handle_deprecated_dp_attention runs
    before the HSPEC checks), so the check reads attn_dp_size."""
    with pytest.raises(ValueError, match="DP attention.*--attn-dp-size 2"):
        sa.validate_server_args(_args(ckpts, attn_dp_size=2))


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "bf16", "fp8_e4m3", "fp8_e5m2"])
def test_kv_cache_dtypes_the_drafter_reads_are_accepted(ckpts, kv_cache_dtype):
    sa.validate_server_args(_args(ckpts, kv_cache_dtype=kv_cache_dtype))


def test_drafter_for_another_target_is_rejected(ckpts, tmp_path):
    other = _write(tmp_path / "other", _target_config(num_key_value_heads=4))
    with pytest.raises(ValueError, match="num_key_value_heads"):
        sa.validate_server_args(_args(ckpts, model_path=str(other)))


def test_a_drafter_for_a_shallower_target_names_the_layer_count(ckpts, tmp_path):
    """The cause (the layer count), not its symptom (a layer id out of range for the drafter's own target)."""
    cfg = json.loads((ckpts["draft"] / "config.json").read_text())
    layers = cfg["hspec"]["target"]["num_hidden_layers"]
    ids = cfg["hspec"]["target_layer_ids"]
    cfg["hspec"]["target"]["num_hidden_layers"] = max(ids)  # the drafter's largest id no longer exists there
    shallow = _write(tmp_path / "shallow_draft", cfg)
    with pytest.raises(ValueError, match=rf"num_hidden_layers: checkpoint {max(ids)} vs target {layers}"):
        sa.validate_server_args(_args(ckpts, speculative_draft_model_path=str(shallow)))


def test_old_hspec_model_type_is_rejected_with_the_fix(ckpts, tmp_path):
    cfg = json.loads((ckpts["draft"] / "config.json").read_text())
    old = _write(tmp_path / "old_draft", {**cfg, "model_type": "hspec"})
    with pytest.raises(ValueError, match="model_type 'hspec'.*config_json"):
        sa.validate_server_args(_args(ckpts, speculative_draft_model_path=str(old)))


def test_a_drafter_reading_the_last_layers_output_is_rejected(ckpts, tmp_path):
    target = json.loads((ckpts["target"] / "config.json").read_text())
    raw = _drafter_config(target)
    raw["hspec"]["target_layer_ids"] = [0, 1, 2, 3, 5]  # 6-layer target: layer 5's output is never captured
    bad = _write(tmp_path / "last_layer", raw)
    with pytest.raises(ValueError, match="layer 5's output.*never captures.*ids below 5"):
        sa.validate_server_args(_args(ckpts, speculative_draft_model_path=str(bad)))


def test_save_drafter_config_is_served_as_written(ckpts, tmp_path):
    """The trainer's checkpoint (save_drafter) passes HSPEC's checks as written, and transformers parses
    its config.json as the target family's config (what SGLang's loader does first)."""
    import torch
    from transformers import AutoConfig

    from sglang_hspec.model.checkpoint import build_drafter, save_drafter

    target = json.loads((ckpts["target"] / "config.json").read_text())
    cfg = HSpecConfig.from_dict(_drafter_config(target)["hspec"])
    t = cfg.target
    model = build_drafter("hspec", cfg, torch.nn.Embedding(t.vocab_size, t.hidden_size),
                          torch.nn.Linear(t.hidden_size, t.vocab_size, bias=False))
    out = save_drafter(model, tmp_path / "saved")
    raw = json.loads((out / "config.json").read_text())
    assert raw["model_type"] == "qwen3" and raw["sample_from_anchor"] is True
    assert raw["architectures"] == ["HSpecDraftModel"] and raw["num_hidden_layers"] == 4
    assert type(AutoConfig.from_pretrained(out)).__name__ == "Qwen3Config"
    args = _args(ckpts, speculative_draft_model_path=str(out))
    sa.validate_server_args(args)
    sa.handle_server_args(args)
    assert args.speculative_num_draft_tokens == 8
