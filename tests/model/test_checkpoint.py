"""Checkpoint round trip, validation against the target, draft vocabulary."""

import dataclasses
import json

import pytest
import torch

from sglang_hspec.model import KINDS, build_draft_vocab, load_drafter, save_drafter
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
    with pytest.raises(ValueError, match=r"target_layer_ids: checkpoint 5 vs target '< 4'"):
        load_drafter(tmp_path, dataclasses.replace(geom, num_hidden_layers=4), *args)
    with pytest.raises(ValueError, match=r"block_size: checkpoint 7 vs target 5"):
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
