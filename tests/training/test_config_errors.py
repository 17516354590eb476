"""A training config that is not YAML names the file, the place and the fix (not a yaml traceback)."""

import pytest

from sglang_hspec.training.config import load_config


def test_config_that_is_not_yaml(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("model: [unclosed\n")
    with pytest.raises(ValueError) as err:
        load_config(path)
    assert str(err.value) == (f"training config {path} is not valid YAML at line 2, column 1 (expected ',' or ']', "
                              "but got '<stream end>'); fix it, or start from configs/train_*.yaml")
