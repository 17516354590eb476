"""load_target (sglang_hspec/target/loading.py): the one target loader behind every command."""

import pytest
import torch

from sglang_hspec.assets.tiny import tiny_target
from sglang_hspec.target.adapter import TargetAdapter
from sglang_hspec.target.loading import load_target


def test_tiny_target_is_frozen_and_shaped_by_its_kwargs():
    adapter = load_target("tiny", dtype="fp32", tiny_kwargs={"num_layers": 3, "vocab_size": 64})
    assert isinstance(adapter, TargetAdapter) and adapter.tokenizer is None
    assert adapter.num_layers == 3 and adapter.geometry.vocab_size == 64 and adapter.dtype == torch.float32
    assert not adapter.model.training and not any(p.requires_grad for p in adapter.model.parameters())


def test_auto_dtype_follows_the_workload(monkeypatch):
    """A CPU where bf16 pays only at many rows (the AMX Xeon's shape of probe): the engine's default
    workload loads fp32, training and regeneration (`workload="batch"`) load bf16."""
    from sglang_hspec.target import dtypes

    monkeypatch.setattr(dtypes, "cpu_flags", lambda: frozenset({"avx2", "avx512f", "amx_bf16"}))
    monkeypatch.setattr(dtypes, "cpu_bf16_speedup", lambda workload="decode": {"decode": 0.9, "batch": 3.2}[workload])
    monkeypatch.delenv("HSPEC_CPU_BF16", raising=False)
    dtypes.bf16_is_fast.cache_clear()
    try:
        assert load_target("tiny", dtype="auto").dtype == torch.float32
        assert load_target("tiny", dtype="auto", workload="batch").dtype == torch.bfloat16
        assert load_target("tiny", dtype="fp32", workload="batch").dtype == torch.float32  # explicit wins
    finally:
        dtypes.bf16_is_fast.cache_clear()


def test_a_local_hf_directory_loads_the_same_weights(tmp_path):
    model = tiny_target("qwen3", num_layers=2)
    model.save_pretrained(tmp_path)
    adapter = load_target(str(tmp_path), dtype="fp32")
    assert adapter.geometry.model_type == "qwen3" and adapter.num_layers == 2
    torch.testing.assert_close(adapter.embed_tokens.weight, model.get_input_embeddings().weight)


def test_a_missing_directory_names_the_spec_and_the_fix(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"neither 'embedded', 'tiny' nor a local Hugging Face.*config\.json"):
        load_target(str(tmp_path / "nope"))


def test_tiny_kwargs_on_another_target_are_refused(tmp_path):
    with pytest.raises(ValueError, match="only shape the 'tiny' target"):
        load_target(str(tmp_path), tiny_kwargs={"num_layers": 2})


@pytest.mark.integration
def test_embedded_and_its_alias_load_smollm2(embedded_dir):
    adapter = load_target("smollm2", dtype="fp32")
    assert adapter.geometry.num_hidden_layers == 30 and adapter.tokenizer is not None


def test_resolve_device_auto_picks_the_gpu_only_where_there_is_one(monkeypatch):
    from sglang_hspec.target.loading import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu") and resolve_device("cpu") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("auto") == torch.device("cuda") and resolve_device("cuda:1") == torch.device("cuda", 1)


def test_resolve_device_names_the_flag_and_the_fix(monkeypatch):
    from sglang_hspec.target.loading import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"--device 'cuda': no CUDA device is visible.*use --device cpu or --device auto"):
        resolve_device("cuda")
    with pytest.raises(ValueError, match=r"training.device 'cuda'.*use training.device=cpu or training.device=auto"):
        resolve_device("cuda", flag="training.device")
    with pytest.raises(ValueError, match=r"training.device 'gpu' is not a device: use auto, cpu, cuda or cuda:N"):
        resolve_device("gpu", flag="training.device")
    with pytest.raises(ValueError, match=r"--device 'meta': only cpu and cuda"):
        resolve_device("meta")
