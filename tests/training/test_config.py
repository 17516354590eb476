from pathlib import Path

import pytest
import yaml

from sglang_hspec.training.config import check_against_target, load_config

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "train_tiny.yaml"


def _write(tmp_path, mutate):
    data = yaml.safe_load(TINY.read_text())
    mutate(data)
    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump(data))
    return p


def test_tiny_config_loads_with_dotted_overrides():
    cfg = load_config(TINY, ["training.lr=1e-3", "data.batch_size=2", "model.kind=dspark"])
    assert cfg.training.lr == 1e-3 and cfg.data.batch_size == 2 and cfg.model.kind == "dspark"
    assert cfg.training.ce_weight == 0.1 and cfg.training.tv_weight == 0.9 and cfg.training.conf_weight == 1.0
    assert cfg.training.gamma_decay == 4.0


def test_unknown_key_is_an_error(tmp_path):
    p = _write(tmp_path, lambda d: d["training"].update(learning_rate=1e-3))
    with pytest.raises(ValueError, match=r"unknown key 'training.learning_rate'"):
        load_config(p)
    with pytest.raises(ValueError, match=r"unknown key 'model.kindd'"):
        load_config(TINY, ["model.kindd=hspec"])


def test_wrong_type_is_an_error():
    with pytest.raises(ValueError, match=r"training.max_steps"):
        load_config(TINY, ["training.max_steps=many"])


def test_kv_ids_must_be_among_target_layer_ids():
    with pytest.raises(ValueError, match=r"kv_layer_ids \[7\] are not among model.target_layer_ids"):
        load_config(TINY, ["model.kv_layer_ids=[2, 3, 7]"])


def test_layer_id_out_of_range():
    cfg = load_config(TINY, ["model.target_layer_ids=[0, 1, 2, 3, 9]", "model.kv_layer_ids=[2, 3, 9]"])
    with pytest.raises(ValueError, match=r"model.target_layer_ids \[9\] out of range for a 5-layer target"):
        check_against_target(cfg, num_target_layers=5)
    check_against_target(cfg, num_target_layers=10)


def test_data_source_must_be_exactly_one():
    with pytest.raises(ValueError, match="exactly one of data.train_path and data.synthetic"):
        load_config(TINY, ["data.train_path=x.jsonl"])


@pytest.mark.parametrize("name", ["hspec", "dspark", "dflash", "hspec_kv_only", "hspec_last_token_only"])
def test_smollm2_configs_share_one_recipe(name):
    base = yaml.safe_load((ROOT / "configs" / "train_hspec_smollm2.yaml").read_text())
    cfg = load_config(ROOT / "configs" / f"train_{name}_smollm2.yaml")
    assert cfg.model.kind == name
    # identical data, training recipe and token budget; only the kind differs
    assert cfg.data.model_dump() == load_config(ROOT / "configs" / "train_hspec_smollm2.yaml").data.model_dump()
    assert cfg.training.model_dump() | {"output_dir": ""} == \
        load_config(ROOT / "configs" / "train_hspec_smollm2.yaml").training.model_dump() | {"output_dir": ""}
    assert cfg.training.lr == 6e-4 and cfg.training.warmup_ratio == 0.04 and base["model"]["block_size"] == 7


def test_init_from_target_layers_and_from_a_checkpoint_together_is_a_clear_error():
    with pytest.raises(ValueError, match="model.init=target_layers and model.init_from=.* both initialise"):
        load_config(TINY, ["model.init=target_layers", "model.init_from=runs/x/checkpoint-10"])
    assert load_config(TINY, ["model.init=target_layers"]).model.init == "target_layers"
    with pytest.raises(ValueError, match="model.init"):
        load_config(TINY, ["model.init=zeros"])
