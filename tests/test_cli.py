"""`hspec` end to end through main() on a tiny saved target (fast) and the embedded one (integration)."""

import json

import pytest
import torch

from sglang_hspec.assets.tiny import save_tiny_target
from sglang_hspec.cli import main


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return str(save_tiny_target(tmp_path_factory.mktemp("tiny") / "target", dtype=torch.float32))


def test_generate_json_is_lossless_across_drafters(tiny_dir, capsys):
    outs = {}
    for drafter in ("none", "ngram"):
        rc = main(["generate", "--target", tiny_dir, "--dtype", "fp32", "--drafter", drafter, "--prompt",
                   "def add(a, b):", "--max-new-tokens", "24", "--json"])
        assert rc == 0
        outs[drafter] = json.loads(capsys.readouterr().out)
    assert outs["none"]["output_ids"] == outs["ngram"]["output_ids"]
    assert outs["none"]["tau"] == 1.0 and outs["none"]["num_output_tokens"] <= 24
    assert outs["ngram"]["drafter"] == "ngram" and outs["ngram"]["tau"] >= 1.0
    assert set(outs["ngram"]) >= {"text", "accept_lengths", "conditional_acceptance", "tokens_per_second"}


def test_generate_errors_name_the_problem(tiny_dir, capsys, tmp_path):
    rc = main(["generate", "--target", tiny_dir, "--drafter", "eagle9", "--prompt", "hi"])
    assert rc == 2 and "unknown drafter 'eagle9'" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="--prompt is empty"):
        main(["generate", "--target", tiny_dir, "--prompt", "   "])
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    with pytest.raises(SystemExit, match="holds no prompts"):
        main(["generate", "--target", tiny_dir, "--prompt-file", str(empty)])
    rc = main(["generate", "--target", str(tmp_path), "--prompt", "hi"])
    assert rc == 2 and "neither 'embedded', 'tiny' nor a local Hugging Face model directory" in capsys.readouterr().err
    rc = main(["generate", "--target", tiny_dir, "--prompt", "hi", "--policy", "stale"])  # ngram: no confidences
    assert rc == 2 and "plans verify lengths from a confidence head, which the ngram drafter has none of" in \
        capsys.readouterr().err
    # the shipped drafter was built for SmolLM2: on another target the error names the fields and values
    rc = main(["generate", "--target", tiny_dir, "--drafter", "shipped", "--prompt", "hi"])
    err = capsys.readouterr().err
    assert rc == 2 and "does not match the target" in err and "num_hidden_layers: checkpoint 30 vs target 2" in err


@pytest.mark.integration
@pytest.mark.slow
def test_demo_prints_side_by_side_table(embedded_dir, capsys, tmp_path):
    out = tmp_path / "demo.json"
    rc = main(["demo", "--drafter", "ngram", "--limit", "2", "--max-new-tokens", "16", "--dtype", "fp32",
               "--json-out", str(out)])
    assert rc == 0
    table = capsys.readouterr().out
    assert "speedup" in table and "ngram" in table
    rows = json.loads(out.read_text())
    assert [r["drafter"] for r in rows] == ["none", "ngram"]
    assert rows[0]["speedup"] == 1.0 and all(r["identical_to_plain"] for r in rows)
    assert rows[0]["tokens"] == rows[1]["tokens"] == 32


@pytest.mark.integration
@pytest.mark.slow
def test_demo_with_tree_runs_each_drafter_as_chain_and_tree(embedded_dir, capsys, tmp_path):
    out = tmp_path / "demo.json"
    rc = main(["demo", "--drafter", "shipped+lookup", "--tree", "16", "--limit", "2", "--max-new-tokens", "24",
               "--dtype", "fp32", "--json-out", str(out)])
    assert rc == 0
    rows = {r["drafter"]: r for r in json.loads(out.read_text())}
    assert list(rows) == ["none", "shipped+lookup", "shipped+lookup tree 16"]
    assert all(r["identical_to_plain"] for r in rows.values())  # fp32 greedy: both token-identical to plain
    assert rows["shipped+lookup tree 16"]["tau"] >= rows["shipped+lookup"]["tau"]  # the tree holds the chain


def test_bad_hspec_environment_variables_are_named(tmp_path, monkeypatch, capsys):
    """HSPEC_TRAIN_THREADS that is not a count, HSPEC_CACHE_DIR that names a file: the variable, the value and
    the fix, before a target loads or a run directory is made."""
    from sglang_hspec.assets.embedded import default_cache_dir

    monkeypatch.setenv("HSPEC_TRAIN_THREADS", "abc")
    run = tmp_path / "run"
    assert main(["train", "--config", "configs/train_tiny.yaml", "--no-progress", f"training.output_dir={run}"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "error: HSPEC_TRAIN_THREADS='abc' must be a whole number >= 1 (torch threads per process), or unset (all cores)")
    assert not run.exists()
    blocker = tmp_path / "afile"
    blocker.write_text("x")
    monkeypatch.setenv("HSPEC_CACHE_DIR", str(blocker))
    with pytest.raises(ValueError) as err:
        default_cache_dir()
    assert str(err.value) == (f"HSPEC_CACHE_DIR={blocker} is a file, not a directory: point it at a directory (or "
                              "unset it for ~/.cache/sglang-hspec)")
    assert blocker.read_text() == "x"
