"""scripts/export_drafter.py: a full-precision checkpoint written as bf16 loads with the same config, every float
weight the fp32 one rounded to bf16, integer buffers (the draft-to-target id map) unchanged."""

from __future__ import annotations

import pytest
import torch
from model._tiny import make_drafter, make_target  # tests/ is on sys.path (the rootdir conftest)
from safetensors import safe_open
from safetensors.torch import load_file

from sglang_hspec.model import load_drafter, save_drafter
from sglang_hspec.target.geometry import TargetGeometry


def test_export_rounds_floats_to_bf16_and_keeps_config_and_ids(tmp_path, load_script):
    export = load_script("export_drafter")
    target = make_target("qwen3")
    model = make_drafter("hspec", target)
    model.set_draft_vocab(torch.arange(100) + 20)
    save_drafter(model, tmp_path / "fp32")
    assert export.main([str(tmp_path / "fp32"), "--out", str(tmp_path / "bf16")]) == 0
    src, out = load_file(str(tmp_path / "fp32" / "model.safetensors")), load_file(str(tmp_path / "bf16" / "model.safetensors"))
    assert src.keys() == out.keys()
    for name, t in src.items():
        if t.is_floating_point():
            assert out[name].dtype == torch.bfloat16 != t.dtype  # the tiny target (and its drafter) is fp64
            assert torch.equal(out[name], t.to(torch.bfloat16)), name
        else:
            assert torch.equal(out[name], t), name
    assert (tmp_path / "bf16" / "config.json").read_text() == (tmp_path / "fp32" / "config.json").read_text()
    with safe_open(str(tmp_path / "bf16" / "model.safetensors"), "pt") as f:
        assert f.metadata()["kind"] == "hspec"
    geom = TargetGeometry.from_hf_config(target.config)
    loaded = load_drafter(tmp_path / "bf16", geom, target.model.embed_tokens, target.lm_head)
    assert next(loaded.parameters()).dtype == torch.bfloat16  # runs in its stored dtype unless told otherwise
    assert torch.equal(loaded.d2t, torch.arange(100) + 20)


def test_a_directory_without_a_checkpoint_is_refused_by_name(tmp_path, load_script, capsys):
    export = load_script("export_drafter")
    with pytest.raises(SystemExit):
        export.main([str(tmp_path), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert str(tmp_path / "config.json") in err and "drafter directory" in err
    assert not (tmp_path / "out").exists()
