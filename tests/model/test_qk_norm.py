"""The drafter's q/k norms (HSpecConfig.qk_norm): the target's by default, either way when the config sets it.
They sit where SGLang's DFlash/DSpark draft layers put them (per head, on q and k before RoPE, the block's keys
and the context keys alike); a checkpoint keeps the choice and one written before the field existed loads as it
did (the target's)."""

import json

import pytest
import torch

from sglang_hspec.model import HSpecConfig, load_drafter, save_drafter
from sglang_hspec.target.geometry import TargetGeometry

from ._tiny import make_drafter, make_target, target_features


@pytest.fixture(scope="module")
def targets():
    return {arch: make_target(arch) for arch in ("llama", "qwen3")}


def _norm_keys(model) -> set[str]:
    return {n for n in model.state_dict() if n.endswith(("q_norm.weight", "k_norm.weight"))}


@pytest.mark.parametrize("arch, qk_norm, want", [("qwen3", None, True), ("llama", None, False),
                                                 ("llama", True, True), ("qwen3", False, False)])
@pytest.mark.parametrize("kind", ["dspark", "dflash", "hspec"])
def test_qk_norm_is_the_targets_unless_the_config_sets_it(targets, arch, qk_norm, want, kind):
    model = make_drafter(kind, targets[arch], qk_norm=qk_norm)
    assert model.config.qk_norm is want
    attn = [layer.attn for layer in model.layers if layer.attn is not None]
    assert attn and all((a.q_norm is not None, a.k_norm is not None) == (want, want) for a in attn)
    assert len(_norm_keys(model)) == (2 * len(attn) if want else 0)


@torch.no_grad()
def test_norms_act_per_head_before_rope_on_block_and_context_keys(targets):
    """RMSNorm per head before RoPE makes the attention blind to the scale of each head's q and k rows: scaling
    head 1 of q_proj and of k_proj by 7 changes nothing with the norms (the context keys go through the same
    k_proj, so they are covered) and changes the proposal logits without them. The norm weights themselves act
    per channel of a head: perturbing one channel of q_norm changes the output (float64, epsilon 1e-12)."""
    target = targets["llama"]
    ids = torch.randint(4, 128, (1, 16), generator=torch.Generator().manual_seed(0))
    feats = target_features(target, ids)
    anchors = torch.tensor([[4, 9, 13]])
    changed = {}
    for qk_norm in (True, False):
        model = make_drafter("dspark", target, qk_norm=qk_norm, rms_norm_eps=1e-12)  # eps: no scale of its own
        before = model.forward_train(feats, ids, anchors).logits
        hd = model.config.target.head_dim
        for layer in model.layers:
            layer.attn.q_proj.weight[hd:2 * hd] *= 7.0  # q head 1
            layer.attn.k_proj.weight[hd:2 * hd] *= 7.0  # kv head 1
        after = model.forward_train(feats, ids, anchors).logits
        changed[qk_norm] = (after - before).abs().max().item()
        if qk_norm:
            model.layers[2].attn.q_norm.weight[3] += 0.5
            assert not torch.allclose(model.forward_train(feats, ids, anchors).logits, after)
    assert changed[True] < 1e-9 and changed[False] > 1e-3, changed


@pytest.mark.parametrize("arch, qk_norm", [("llama", True), ("qwen3", False)])
def test_checkpoint_keeps_a_qk_norm_other_than_the_targets(tmp_path, targets, arch, qk_norm):
    target = targets[arch]
    model = make_drafter("dspark", target, qk_norm=qk_norm)
    save_drafter(model, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["hspec"]["qk_norm"] is qk_norm
    geom = TargetGeometry.from_hf_config(target.config)
    loaded = load_drafter(tmp_path, geom, target.model.embed_tokens, target.lm_head, dtype=torch.float64)
    assert loaded.config.qk_norm is qk_norm and _norm_keys(loaded) == _norm_keys(model)
    ids = torch.randint(4, 128, (1, 16), generator=torch.Generator().manual_seed(1))
    feats = target_features(target, ids)
    with torch.no_grad():
        a = model.forward_train(feats, ids, torch.tensor([[4, 9]])).logits
        b = loaded.forward_train(feats, ids, torch.tensor([[4, 9]])).logits
    assert torch.equal(a, b)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_checkpoint_without_the_field_loads_with_the_targets_norms(tmp_path, targets, arch):
    """A config.json written before qk_norm existed: the drafter has the norms exactly when its target has."""
    target = targets[arch]
    model = make_drafter("hspec", target)
    save_drafter(model, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    del cfg["hspec"]["qk_norm"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    geom = TargetGeometry.from_hf_config(target.config)
    loaded = load_drafter(tmp_path, geom, target.model.embed_tokens, target.lm_head, dtype=torch.float64)
    assert loaded.config.qk_norm is (arch == "qwen3") and _norm_keys(loaded) == _norm_keys(model)
    assert HSpecConfig.from_dict(cfg["hspec"]) == model.config


@pytest.mark.parametrize("value", ["yes", 1, 0.0])
def test_qk_norm_that_is_not_a_bool_is_refused_with_the_fix(targets, value):
    cfg = make_drafter("dspark", targets["llama"]).config.to_dict()
    with pytest.raises(ValueError) as err:
        HSpecConfig.from_dict({**cfg, "qk_norm": value})
    assert str(err.value) == (f"qk_norm must be true, false or null (q/k RMSNorm in the drafter's attention; null: "
                              f"the target's), got {value!r}; the DFlash-family recipes use true")
