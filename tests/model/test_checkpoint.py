"""Checkpoint round trip, validation against the target, draft vocabulary."""

import dataclasses
import json

import pytest
import torch
from faults import disk_full_after

from sglang_hspec.core.atomic import ArtifactWriteError
from sglang_hspec.model import KINDS, build_draft_vocab, load_drafter, save_drafter
from sglang_hspec.model.checkpoint import check_checkpoint_weights_readable, read_checkpoint_weights
from sglang_hspec.target.geometry import TargetGeometry

from ._tiny import make_drafter, make_target, target_features


@pytest.fixture(scope="module")
def target():
    return make_target("qwen3")


@pytest.mark.parametrize("kind", KINDS)
def test_round_trip_gives_identical_outputs(tmp_path, target, kind):
    model = make_drafter(kind, target)
    model.set_draft_vocab(torch.arange(100) + 20)
    save_drafter(model, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["hspec"]["kind"] == kind and cfg["block_size"] == 7 and "architectures" in cfg
    geom = TargetGeometry.from_hf_config(target.config)
    loaded = load_drafter(tmp_path, geom, target.model.embed_tokens, target.lm_head, dtype=torch.float64)
    from safetensors.torch import load_file

    names = set(load_file(str(tmp_path / "model.safetensors")))
    assert "d2t" in names and not any("embed" in n or "lm_head" in n for n in names)
    ids = torch.randint(4, 128, (1, 16), generator=torch.Generator().manual_seed(0))
    feats = target_features(target, ids)
    a = model.forward_train(feats, ids, torch.tensor([[4, 9]]))
    b = loaded.forward_train(feats, ids, torch.tensor([[4, 9]]))
    assert torch.equal(a.logits, b.logits)
    assert torch.equal(loaded.d2t, torch.arange(100) + 20)


def test_load_names_mismatched_field_and_both_values(tmp_path, target):
    save_drafter(make_drafter("hspec", target), tmp_path)
    geom = TargetGeometry.from_hf_config(target.config)
    args = (target.model.embed_tokens, target.lm_head)
    for field, value in [("num_key_value_heads", 4), ("rope_theta", 1e6), ("head_dim", 32), ("vocab_size", 256)]:
        other = dataclasses.replace(geom, **{field: value})
        with pytest.raises(ValueError, match=rf"target\.{field}: checkpoint .* vs target {value!r}"):
            load_drafter(tmp_path, other, *args)
    with pytest.raises(ValueError, match=r"target\.num_hidden_layers: checkpoint 6 vs target 4; "
                                         r"target_layer_ids: checkpoint 5 vs target '< 4'"):
        load_drafter(tmp_path, dataclasses.replace(geom, num_hidden_layers=4), *args)
    with pytest.raises(ValueError, match=r"block_size 5 was requested, but this hspec drafter proposes 7 tokens "
                                         r"per step .* \(drop --block-size\) or ask for 7"):
        load_drafter(tmp_path, geom, *args, block_size=5)


def test_load_rejects_other_slot_convention(tmp_path, target):
    save_drafter(make_drafter("hspec", target), tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["hspec"]["slot_convention"] = "slot_j_predicts_anchor_plus_j"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="slot_convention"):
        load_drafter(tmp_path, TargetGeometry.from_hf_config(target.config), target.model.embed_tokens,
                     target.lm_head)


def test_mask_token_outside_vocab_is_rejected(target):
    with pytest.raises(ValueError, match="mask_token_id 500"):
        make_drafter("hspec", target, mask_token_id=500)


def test_build_draft_vocab_takes_most_frequent_sorted_by_id():
    counts = torch.tensor([5, 0, 9, 9, 1, 7, 0, 3])
    assert build_draft_vocab(counts, 3).tolist() == [2, 3, 5]
    assert build_draft_vocab(counts, 3, always_include=(1,)).tolist() == [1, 2, 3]
    assert build_draft_vocab(torch.tensor([1, 1, 1, 1]), 2).tolist() == [0, 1]  # ties -> lower id
    with pytest.raises(ValueError, match="exceeds"):
        build_draft_vocab(counts, 9)


def test_draft_ids_map_outside_vocab_to_spare_row(target):
    model = make_drafter("hspec", target)
    model.set_draft_vocab(torch.arange(100) + 28)
    assert model.to_draft_ids(torch.tensor([28, 127, 5])).tolist() == [0, 99, 100]
    with pytest.raises(ValueError, match="repeated"):
        model.set_draft_vocab(torch.zeros(100, dtype=torch.long))


# ------------------------------------------------------------------ damaged checkpoints


def _saved(tmp_path, target):
    save_drafter(make_drafter("hspec", target), tmp_path)
    return TargetGeometry.from_hf_config(target.config), (target.model.embed_tokens, target.lm_head)


def test_truncated_config_json_names_the_file_and_the_fix(tmp_path, target):
    geom, args = _saved(tmp_path, target)
    cfg = tmp_path / "config.json"
    cfg.write_text(cfg.read_text()[:500])
    with pytest.raises(ValueError) as err:
        load_drafter(tmp_path, geom, *args)
    msg = str(err.value)
    assert msg.startswith(f"{cfg} is not valid JSON (Unterminated string") or msg.startswith(f"{cfg} is not valid JSON")
    assert "truncated or damaged; re-copy the checkpoint, or write it again with" in msg


def test_truncated_safetensors_names_the_file_and_the_fix(tmp_path, target):
    geom, args = _saved(tmp_path, target)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ValueError, match=rf"^{weights} cannot be read as safetensors \(.*\): it is truncated or "
                                         "damaged; re-copy the checkpoint"):
        load_drafter(tmp_path, geom, *args)


@pytest.mark.parametrize("keep", [1000, 0.9], ids=["header cut", "tensors cut"])
def test_the_header_check_names_a_damaged_file_as_the_full_read_does(tmp_path, target, keep):
    _saved(tmp_path, target)
    check_checkpoint_weights_readable(tmp_path)  # intact: nothing to say
    weights = tmp_path / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: keep if isinstance(keep, int) else int(len(data) * keep)])
    with pytest.raises(ValueError) as quick:
        check_checkpoint_weights_readable(tmp_path)
    with pytest.raises(ValueError) as full:
        read_checkpoint_weights(tmp_path)
    assert str(quick.value) == str(full.value)  # the header check says what the full read would
    assert str(quick.value).startswith(f"{weights} cannot be read as safetensors (")
    assert str(quick.value).endswith("it is truncated or damaged; re-copy the checkpoint, or write it again with "
                                     "sglang_hspec.model.checkpoint.save_drafter")
    weights.unlink()
    with pytest.raises(ValueError, match=rf"^{weights} does not exist: a drafter checkpoint is a directory with "
                                         "config.json and model.safetensors"):
        check_checkpoint_weights_readable(tmp_path)


def test_config_written_for_a_shallower_target_names_the_layer_counts(tmp_path, target):
    """The config says its target had 4 layers (ids 0..3 valid) while this target has 6: the layer counts
    are the cause, the out-of-range id 5 only the symptom, and both are named."""
    geom, args = _saved(tmp_path, target)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["hspec"]["target"]["num_hidden_layers"] = 4
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError) as err:
        load_drafter(tmp_path, geom, *args)
    assert str(err.value) == (f"drafter checkpoint {tmp_path} does not match the target: "
                              "target.num_hidden_layers: checkpoint 4 vs target 6. "
                              "Load the drafter trained for this target (or retrain it).")


@pytest.mark.parametrize("damage, message", [
    (lambda c: c.pop("hspec"), "has no 'hspec' section; was it written by save_drafter?"),
    (lambda c: c["hspec"]["target"].pop("vocab_size"), "hspec.target section is not a valid target geometry"),
    (lambda c: c["hspec"].update(block_size=0), "invalid drafter config: block_size must be an integer in 1..64 (draft tokens per block), got 0"),
    (lambda c: c["hspec"].update(colour="red"), "invalid drafter config: unknown drafter config fields ['colour']"),
], ids=["no-hspec-section", "geometry-field-missing", "block-size-0", "unknown-field"])
def test_invalid_config_fields_name_the_file(tmp_path, target, damage, message):
    geom, args = _saved(tmp_path, target)
    cfg = json.loads((tmp_path / "config.json").read_text())
    damage(cfg)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError) as err:
        load_drafter(tmp_path, geom, *args)
    assert str(err.value).startswith(f"{tmp_path / 'config.json'}") and message in str(err.value)


@pytest.mark.parametrize("field, value, example", [("target_layer_ids", 3, "[1, 8, 15, 22, 28]"),
                                                    ("kv_reuse_layer_ids", "15,22", "[15, 22, 28]")])
def test_layer_ids_that_are_not_a_list_name_the_file_and_field(tmp_path, target, field, value, example):
    """An integer (or a string) where a list of layer ids belongs is answered before the geometry comparison
    iterates it (it raised `TypeError: Value after * must be an iterable`); the checkpoint is left as it was."""
    geom, args = _saved(tmp_path, target)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["hspec"][field] = value
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    with pytest.raises(ValueError) as err:
        load_drafter(tmp_path, geom, *args)
    assert str(err.value) == (
        f"{tmp_path / 'config.json'}: invalid drafter config: {field} must be a list of target layer ids (integers, "
        f"e.g. {example}), got {value!r}; re-copy the checkpoint, or write it again with "
        "sglang_hspec.model.checkpoint.save_drafter")
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


# ------------------------------------------------------------------ crash safety


@pytest.mark.parametrize("where", ["first-byte", "mid-weights", "config"])
def test_save_drafter_on_a_full_disk_keeps_the_previous_checkpoint(tmp_path, target, monkeypatch, where):
    """ENOSPC mid-write (in the weights, or in the config after the weights were written): a clear error
    naming the file, the previous checkpoint byte-identical and loadable, no temp file left behind."""
    old_model = make_drafter("hspec", target, seed=1)
    save_drafter(old_model, tmp_path)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    weights = len(before["model.safetensors"])  # the new weights have the same size: same architecture
    free = {"first-byte": 0, "mid-weights": weights // 2, "config": weights + 100}[where]
    failing = "config.json" if where == "config" else "model.safetensors"
    with disk_full_after(free), pytest.raises(ArtifactWriteError, match=rf"could not write {tmp_path / failing}: "
                                              "No space left on device; the disk may be full. The previous"):
        save_drafter(make_drafter("hspec", target, seed=2), tmp_path)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
    loaded = load_drafter(tmp_path, TargetGeometry.from_hf_config(target.config), target.model.embed_tokens,
                          target.lm_head, dtype=torch.float64)
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), old_model.state_dict().values()))
