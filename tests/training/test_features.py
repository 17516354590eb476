from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from sglang_hspec.target.adapter import TargetAdapter
from sglang_hspec.training.config import load_config
from sglang_hspec.training.features import FeatureCache, bytes_per_token, example_key
from sglang_hspec.training.trainer import train

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "train_tiny.yaml"
SMALL = ["data.synthetic.num_sequences=16", "data.synthetic.seq_len=24", "data.max_length=24",
         "data.batch_size=4", "data.num_anchors=4"]


@pytest.fixture
def count_target_forwards(monkeypatch):
    calls = []
    real = TargetAdapter.full_forward

    def counting(self, input_ids, **kwargs):
        calls.append(input_ids.shape[0])
        return real(self, input_ids, **kwargs)

    monkeypatch.setattr(TargetAdapter, "full_forward", counting)
    return calls


def test_feature_cache_gives_the_same_losses_and_runs_the_target_once_per_example(tmp_path, count_target_forwards,
                                                                                   capsys):
    # 16 sequences, 4 per step: 8 steps are 2 epochs
    over = SMALL + ["training.max_steps=8"]
    plain = train(load_config(TINY, over + [f"training.output_dir={tmp_path / 'plain'}"]), progress=False)
    assert len(count_target_forwards) == 8
    count_target_forwards.clear()
    cache_over = over + [f"data.feature_cache={tmp_path / 'cache'}"]
    capsys.readouterr()
    first = train(load_config(TINY, cache_over + [f"training.output_dir={tmp_path / 'a'}"]), progress=False)
    # the disk cost is said before the cache is written: 16 sequences of 24 tokens, none cached yet
    plan = [line for line in capsys.readouterr().err.splitlines() if line.startswith("target-feature cache")]
    assert len(plan) == 1 and "bytes per token x 384 tokens (16 of 16 examples not cached yet)" in plan[0], plan
    assert len(count_target_forwards) == 4  # epoch 1 only
    assert first.cache_stats["misses"] == 16 and first.cache_stats["hits"] == 16
    # epoch 1 trains on the very forward that fills the cache; epoch 2 reads features of other batches' forwards
    assert [m.loss for m in first.history[:4]] == [m.loss for m in plain.history[:4]]
    assert [m.loss for m in first.history] == pytest.approx([m.loss for m in plain.history], rel=1e-5)
    # a later run (another kind, another seed...) on the same target and data: no target forward at all
    count_target_forwards.clear()
    warm = train(load_config(TINY, cache_over + [f"training.output_dir={tmp_path / 'b'}"]), progress=False)
    assert count_target_forwards == [] and warm.cache_stats["misses"] == 0
    # the warm run's target probabilities come from the cached log-partition, `first`'s epoch 1 from the full
    # softmax: the same to float rounding, which eight optimizer steps grow (4.3e-6 relative on an AMX Xeon)
    assert [m.loss for m in warm.history] == pytest.approx([m.loss for m in first.history], rel=1e-5)
    # the warm run read each position's log-partition and ran only the LM head's draft rows; with
    # training.cached_log_partition=false it runs the full-vocabulary softmax: the same losses
    shard = load_file(str(next((tmp_path / "cache" / "shards").glob("*.safetensors"))))
    assert shard["log_partition"].dtype == torch.float32 and shard["log_partition"].shape == shard["final_hidden"].shape[:1]
    full = train(load_config(TINY, cache_over + [f"training.output_dir={tmp_path / 'c'}",
                                                 "training.cached_log_partition=false"]), progress=False)
    assert [m.loss for m in full.history] == pytest.approx([m.loss for m in warm.history], rel=1e-5)
    # disk: 16 shards of 24 tokens at the stated cost per token, plus small safetensors headers
    per_token = bytes_per_token(hidden_size=64, num_hidden_ids=5, num_kv_layers=3, num_kv_heads=2, head_dim=16,
                                dtype="fp32")
    assert per_token == (6 * 64 + 2 * 3 * 2 * 16) * 4 + 4  # + the float32 log-partition
    assert 16 * 24 * per_token <= first.cache_stats["disk_bytes"] <= 16 * 24 * per_token + 16 * 2048


def test_shards_without_a_log_partition_read_back_as_none(tmp_path):
    """A cache written before training.cached_log_partition existed still serves: the batch then has no
    log-partition and the trainer runs the full softmax."""
    cache = FeatureCache(tmp_path, target_fingerprint="t", hidden_layer_ids=[], kv_layer_ids=[1])
    kv = {1: (torch.ones(2, 3, 4), torch.ones(2, 3, 4))}
    cache.put("old", hidden=None, kv=kv, final_hidden=torch.ones(3, 5))
    cache.put("new", hidden=None, kv=kv, final_hidden=torch.ones(3, 5), log_partition=torch.tensor([1.0, 2.0, 3.0]))
    got = cache.load_batch(["new"], length=4, dtype=torch.float32, device="cpu")
    assert got.log_partition.tolist() == [[1.0, 2.0, 3.0, 0.0]]
    assert cache.load_batch(["new", "old"], length=4, dtype=torch.float32, device="cpu").log_partition is None
    with pytest.raises(ValueError, match=r"log_partition must be \[T=3\]"):
        cache.put("bad", hidden=None, kv=kv, final_hidden=torch.ones(3, 5), log_partition=torch.ones(4))


def test_feature_cache_for_another_setup_is_refused_with_the_fix(tmp_path):
    FeatureCache(tmp_path, target_fingerprint="abc", hidden_layer_ids=[0, 1], kv_layer_ids=[1], dtype="fp32")
    FeatureCache(tmp_path, target_fingerprint="abc", hidden_layer_ids=[0, 1], kv_layer_ids=[1], dtype="fp32")  # reuse
    with pytest.raises(ValueError, match=r"built for another setup \(differs in \['target_fingerprint', 'dtype'\].*"
                                         r"use another directory"):
        FeatureCache(tmp_path, target_fingerprint="xyz", hidden_layer_ids=[0, 1], kv_layer_ids=[1], dtype="bf16")
    (tmp_path / "manifest.json").write_text("{not json")
    with pytest.raises(ValueError, match="is not a feature-cache manifest"):
        FeatureCache(tmp_path, target_fingerprint="abc", hidden_layer_ids=[0, 1], kv_layer_ids=[1], dtype="fp32")


def test_shards_round_trip_and_pad_to_the_batch_length(tmp_path):
    cache = FeatureCache(tmp_path, target_fingerprint="t", hidden_layer_ids=[0, 2], kv_layer_ids=[2], dtype="bf16")
    g = torch.Generator().manual_seed(0)
    ex = {}
    for n in (3, 5):
        ex[n] = dict(hidden=torch.randn(n, 2, 8, generator=g), kv={2: (torch.randn(2, n, 4, generator=g),
                     torch.randn(2, n, 4, generator=g))}, final_hidden=torch.randn(n, 8, generator=g))
        cache.put(example_key(list(range(n))), **ex[n])
    assert example_key([0, 1, 2]) != example_key([0, 1, 3])
    f = cache.load_batch([example_key(list(range(5))), example_key(list(range(3)))], length=6, dtype=torch.float32,
                         device="cpu")
    assert f.hidden.shape == (2, 6, 2, 8) and f.kv[2][0].shape == (2, 2, 6, 4) and f.final_hidden.shape == (2, 6, 8)
    torch.testing.assert_close(f.hidden[1, :3], ex[3]["hidden"].bfloat16().float())
    torch.testing.assert_close(f.kv[2][1][0, :, :5], ex[5]["kv"][2][1].bfloat16().float())
    assert (f.hidden[1, 3:] == 0).all() and (f.final_hidden[0, 5:] == 0).all()
    assert not list((tmp_path / "shards").glob(".*"))  # no temp file left behind


@pytest.mark.slow
def test_one_cache_serves_every_kind_of_the_recipe(tmp_path, count_target_forwards):
    """hspec fills it (hidden of all target_layer_ids, KV of the last three); dspark (hidden only) and
    hspec_kv_only (KV only) then train without a target forward; dflash_target_kv needs KV of all five."""
    over = SMALL + ["training.max_steps=4", f"data.feature_cache={tmp_path / 'cache'}"]
    train(load_config(TINY, over + [f"training.output_dir={tmp_path / 'hspec'}"]), progress=False)
    assert len(count_target_forwards) == 4
    for kind in ("dspark", "hspec_kv_only"):
        count_target_forwards.clear()
        cached = train(load_config(TINY, over + [f"model.kind={kind}", "model.kv_layer_ids=[]",
                                                 f"training.output_dir={tmp_path / kind}"]), progress=False)
        assert count_target_forwards == [], kind
        plain = train(load_config(TINY, SMALL + ["training.max_steps=4", f"model.kind={kind}", "model.kv_layer_ids=[]",
                                                 f"training.output_dir={tmp_path / (kind + '_plain')}"]),
                      progress=False)
        assert [m.loss for m in cached.history] == pytest.approx([m.loss for m in plain.history], rel=1e-5), kind
    with pytest.raises(ValueError, match=r"not \['kv 0', 'kv 1'\] that this drafter reads; use another directory"):
        train(load_config(TINY, over + ["model.kind=dflash_target_kv", "model.kv_layer_ids=[]",
                                        f"training.output_dir={tmp_path / 'dtk'}"]), progress=False)


def test_full_disk_while_caching_is_a_clear_error_and_leaves_no_partial_shard(tmp_path, monkeypatch):
    from faults import disk_full_after

    cache = FeatureCache(tmp_path, target_fingerprint="t", hidden_layer_ids=[0], kv_layer_ids=[], dtype="fp32")
    with disk_full_after(7), pytest.raises(  # 7 bytes of the shard fit, then ENOSPC
            OSError, match=r"no space left on device writing the target-feature cache .*feature_cache_dtype=bf16"):
        cache.put("k", hidden=torch.zeros(2, 1, 4), kv={}, final_hidden=torch.zeros(2, 4))
    assert not cache.has("k") and list((tmp_path / "shards").iterdir()) == []


def test_plan_prints_bytes_per_token_times_tokens_and_refuses_a_disk_too_small(tmp_path, monkeypatch):
    from collections import namedtuple
    from types import SimpleNamespace

    from sglang_hspec.training import features

    # SmolLM2-135M's geometry: (5 + 1) x 576 + 2 x 3 layers x 3 KV heads x 64 = 4608 values, fp32 + 4 bytes
    smollm2 = SimpleNamespace(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, head_dim=64)
    cache = FeatureCache(tmp_path, target_fingerprint="t", hidden_layer_ids=[1, 8, 15, 22, 28],
                         kv_layer_ids=[15, 22, 28], dtype="fp32")
    examples = [{"input_ids": list(range(n))} for n in (100, 250, 7)]
    cache.put(example_key(list(range(7))), hidden=torch.zeros(7, 5, 4), kv={i: (torch.zeros(1, 7, 2), torch.zeros(1, 7, 2))
              for i in (15, 22, 28)}, final_hidden=torch.zeros(7, 4))  # cached already: not counted
    Usage = namedtuple("Usage", "total used free")
    monkeypatch.setattr(features.shutil, "disk_usage", lambda path: Usage(0, 0, 3 * 2**30))
    lines = []
    assert cache.plan(examples, target_config=smollm2, report=lines.append) == 18436 * 350 == 6452600
    assert lines == [f"target-feature cache {tmp_path}: 18,436 bytes per token x 350 tokens (2 of 3 examples not "
                     "cached yet) = 6.2 MiB; 3.00 GiB free"]
    # the trainer's per-token cost without the log-partition, and with head_dim from hidden / heads
    no_head_dim = SimpleNamespace(hidden_size=576, num_attention_heads=9, num_key_value_heads=3)
    assert features.target_bytes_per_token(no_head_dim, num_hidden_ids=5, num_kv_layers=3, dtype="bf16",
                                           log_partition=False) == 4608 * 2
    monkeypatch.setattr(features.shutil, "disk_usage", lambda path: Usage(0, 0, 6452599))
    with pytest.raises(OSError) as err:
        cache.plan(examples, target_config=smollm2, report=lines.append)
    assert str(err.value) == (f"[Errno 28] data.feature_cache {tmp_path} would need 6.2 MiB (18,436 bytes per token "
                              "x 350 tokens) but only 6.2 MiB is free there; free space, set "
                              "data.feature_cache_dtype=bf16 (half the size), point data.feature_cache at a larger "
                              "disk, or unset it to run the target every step")
    assert len(list((tmp_path / "shards").iterdir())) == 1  # nothing written by the plan


def test_plan_of_the_8b_recipes_is_61_kb_per_token_in_bf16():
    """Qwen3-8B and Llama-3.1-8B share the geometry the cache stores (hidden 4096, 8 KV heads of 128):
    (5 + 1) x 4096 + 2 x 3 x 8 x 128 = 30,720 values a token, the numbers docs/serving.md quotes."""
    import json

    from sglang_hspec.training.features import target_bytes_per_token

    for name in ("hspec-qwen3-8b.json", "hspec-llama-3.1-8b-instruct.json"):
        cfg = json.loads((ROOT / "configs" / name).read_text())
        target = type("Config", (), cfg["target"])
        assert len(cfg["target_layer_ids"]) == 5 and len(set(cfg["kv_reuse_layer_ids"])) == 3, name
        kw = dict(num_hidden_ids=5, num_kv_layers=3)
        assert target_bytes_per_token(target, dtype="bf16", **kw) == 61_444, name
        assert target_bytes_per_token(target, dtype="fp32", **kw) == 122_884, name
