"""Every numeric key of a training recipe is range-checked when the config loads (before the target or any
data loads): the message names the key (training.lr, data.synthetic.motif_len, model.drafter.markov_rank...),
the range and what the recipes use. Output directories that can never be created are refused up front."""

import errno
import os
from pathlib import Path

import pytest

from sglang_hspec.training.config import load_config, make_output_dir, output_dir_problem

TINY = Path(__file__).resolve().parents[2] / "configs" / "train_tiny.yaml"

CASES = {  # override -> the message line naming the key
    "training.lr=-1": "training.lr must be a finite number in (0, 1] (the AdamW peak learning rate), got -1.0; the "
                      "recipes use 6e-4 (3e-3 on the tiny target)",
    "training.lr=.nan": "training.lr must be a finite number in (0, 1] (the AdamW peak learning rate), got nan; the "
                        "recipes use 6e-4 (3e-3 on the tiny target)",
    "training.lr=0": "training.lr must be a finite number in (0, 1] (the AdamW peak learning rate), got 0.0; the "
                     "recipes use 6e-4 (3e-3 on the tiny target)",
    "training.weight_decay=-1": "training.weight_decay must be a finite number >= 0 (AdamW's decoupled weight decay), "
                                "got -1.0; the recipes use 0",
    "training.betas=[0.9]": "training.betas must be two numbers in [0, 1) (AdamW's beta1, beta2), got [0.9]; the "
                            "recipes use [0.9, 0.95]",
    "training.max_grad_norm=-1": "training.max_grad_norm must be a finite number > 0 (the gradient-norm clip), got "
                                 "-1.0; the recipes use 1.0",
    "training.tv_weight=.inf": "training.tv_weight must be a finite number >= 0 (a loss weight), got inf; the recipes "
                               "use ce 0.1, tv 0.9, conf 1.0",
    "training.gamma_decay=.nan": "training.gamma_decay must be a finite number > 0 (the per-slot loss decay), got nan; "
                                 "the recipes use 4.0",
    "training.save_every=-1": "training.save_every must be >= 0 (steps between checkpoints; 0: only the final one), "
                              "got -1",
    "training.loss_chunk_rows=0": "training.loss_chunk_rows must be >= 1 (loss rows computed at once), got 0",
    "training.grad_accum=0": "training.grad_accum must be >= 1 (micro-batches per optimizer step), got 0",
    "model.block_size=100000": "model.block_size must be in 1..64 (draft tokens per block), got 100000; the recipes "
                               "use 7",
    "model.target_layer_ids=[0,1]": "model.target_layer_ids needs 5 target layer ids (the hidden states the drafter "
                                    "fuses), got [0, 1]; e.g. [1, 8, 15, 22, 28] on a 30-layer target",
    "model.drafter.mamba_state_dim=100000": "model.drafter.mamba_state_dim must be an integer in 1..256 (the Mamba "
                                            "state per head channel), got 100000; set it in 1..256 (H-Spec uses 4)",
    "model.drafter.block_size=3": "model.drafter sets ['block_size']; the recipe sets those itself: use model.kind / "
                                  "model.target_layer_ids / model.kv_layer_ids / model.block_size (the target's "
                                  "geometry is read from model.target)",
    "data.num_anchors=0": "data.num_anchors must be >= 1 (blocks drafted per sequence), got 0",
    "data.synthetic.motif_len=0": "data.synthetic.motif_len must be >= 1 (tokens per motif), got 0",
    "data.synthetic.vocab_low=-5": "data.synthetic.vocab_low must be >= 0 (the smallest token id used), got -5",
    "data.synthetic.prompt_len=1000": "data.synthetic.prompt_len must be in 1..seq_len-1 = 1..47 (tokens outside the "
                                      "loss mask at the start), got 1000",
}


@pytest.mark.parametrize("override", list(CASES))
def test_bad_value_names_the_key(override):
    with pytest.raises(ValueError) as err:
        load_config(TINY, [override])
    assert str(err.value) == f"invalid training config {TINY}:\n  {CASES[override]}"


def test_unknown_drafter_key_is_named_with_its_section():
    with pytest.raises(ValueError) as err:
        load_config(TINY, ["model.drafter.bogus=1"])
    assert str(err.value).startswith(f"invalid training config {TINY}:\n  unknown key(s) ['model.drafter.bogus']: "
                                     "model.drafter takes HSpecConfig fields ['confidence_head', ")


def test_every_shipped_recipe_still_loads():
    for recipe in sorted(TINY.parent.glob("train_*.yaml")):
        load_config(recipe, ["training.output_dir=/tmp"])


def test_output_dir_under_a_file_is_refused_and_nothing_is_created(tmp_path):
    blocker = tmp_path / "afile"
    blocker.write_text("x")
    for key in ("training.output_dir", "data.feature_cache"):
        with pytest.raises(ValueError) as err:
            load_config(TINY, [f"{key}={blocker / 'run'}"])
        assert str(err.value) == (f"{key} {blocker / 'run'} cannot be created: {blocker} is a file, not a directory; "
                                  f"point {key} at a writable directory")
    assert sorted(tmp_path.iterdir()) == [blocker] and blocker.read_text() == "x"


def test_make_output_dir_gives_the_real_cause(tmp_path, monkeypatch):
    blocker = tmp_path / "afile"
    blocker.write_text("x")
    assert output_dir_problem(tmp_path / "new" / "deeper") is None
    assert make_output_dir(tmp_path / "new" / "deeper", name="--out").is_dir()
    with pytest.raises(OSError) as err:
        make_output_dir(blocker / "out", name="--out")
    assert str(err.value) == f"--out {blocker / 'out'} cannot be created: {blocker} is a file, not a directory; pick another --out"
    # what a look cannot tell (a virtual filesystem, a permission the kernel refuses) comes from mkdir's errno
    for code, cause in ((errno.ENOENT, f"{tmp_path} does not accept new directories (a virtual filesystem such as "
                                       "/proc or /sys)"),
                        (errno.EACCES, f"permission denied: {tmp_path} is not writable by this user"),
                        (errno.EROFS, f"{tmp_path} is on a read-only filesystem")):
        def refuse(self, *a, code=code, **k):
            raise OSError(code, os.strerror(code), str(self))
        monkeypatch.setattr(Path, "mkdir", refuse)
        with pytest.raises(OSError) as err:
            make_output_dir(tmp_path / "x", name="--out")
        assert str(err.value) == f"--out {tmp_path / 'x'} cannot be created: {cause}; pick another --out"
        assert err.value.errno == code
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "new"]
