import json
import logging

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from sglang_hspec.assets import tiny
from sglang_hspec.assets.prompts import chat_input_ids
from sglang_hspec.assets.tiny import TINY_SPECIAL_TOKENS, save_tiny_target, tiny_target, tiny_tokenizer

SAMPLE = 'def add(x, y):\n    """Sum."""\n    return x + y  # héllo 🙂\n\tclass Foo: pass\n'


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("tok")


@pytest.fixture(scope="module")
def tok(tok_dir):
    return tiny_tokenizer(cache_dir=tok_dir)


def test_training_files_are_deterministic():
    files = tiny._tiny_training_files()
    assert len(files) == 60
    assert files == sorted(files) and files == tiny._tiny_training_files()
    assert all(f.suffix == ".py" for f in files)


def test_tokenizer_specials_and_round_trip(tok):
    assert len(tok) == 1024
    assert tok.convert_ids_to_tokens([0, 1, 2]) == list(TINY_SPECIAL_TOKENS)
    assert (tok.unk_token_id, tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (0, 1, 2, 2)
    ids = tok(SAMPLE).input_ids
    assert ids == tok(SAMPLE).input_ids
    assert tok.decode(ids) == SAMPLE
    assert 3 <= min(ids) and max(ids) < 1024  # plain text never produces special ids
    # Python keywords seen thousands of times in training are single tokens.
    assert len(tok(" return").input_ids) == 1 and len(tok("def").input_ids) == 1


def test_tokenizer_is_deterministic_across_trainings(tok, tmp_path):
    again = tiny_tokenizer(cache_dir=tmp_path)  # fresh training in an empty cache
    assert again.get_vocab() == tok.get_vocab()
    a = json.loads(again.backend_tokenizer.to_str())["model"]["merges"]
    b = json.loads(tok.backend_tokenizer.to_str())["model"]["merges"]
    assert a == b and len(a) == 1024 - 256 - 3


def test_tokenizer_cache_is_reused_and_repaired(tok, tok_dir, caplog):
    (cached,) = [p for p in tok_dir.iterdir() if not p.name.startswith(".")]
    assert cached.name.startswith("tiny-bpe1024-")
    assert sorted(p.name for p in tok_dir.iterdir()) == [cached.name]  # no temp dirs left behind
    mtime = (cached / "tokenizer.json").stat().st_mtime_ns
    assert tiny_tokenizer(cache_dir=tok_dir)(SAMPLE).input_ids == tok(SAMPLE).input_ids
    assert (cached / "tokenizer.json").stat().st_mtime_ns == mtime  # loaded, not retrained
    (cached / "tokenizer.json").write_text('{"truncated": ')
    with caplog.at_level(logging.WARNING, logger=tiny.__name__):
        repaired = tiny_tokenizer(cache_dir=tok_dir)
    assert "unreadable" in caplog.text
    assert repaired(SAMPLE).input_ids == tok(SAMPLE).input_ids


def test_chat_template_and_chat_input_ids(tok):
    ids = chat_input_ids(tok, [{"role": "user", "content": "hi"}])
    assert ids == tok("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n").input_ids
    assert ids[0] == 1 and ids.count(1) == 2 and ids.count(2) == 1
    assert tok.decode(ids) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    tok_without = tiny._wrap_tiny_tokenizer(tok.backend_tokenizer)
    tok_without.chat_template = None
    with pytest.raises(ValueError, match="has no chat template"):
        chat_input_ids(tok_without, [{"role": "user", "content": "hi"}])


def test_saved_tiny_target_reloads_identically(tok, tmp_path):
    path = save_tiny_target(tmp_path / "target", tokenizer=tok)
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {
        p.name for p in path.iterdir()
    }
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3ForCausalLM"]
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["intermediate_size"]) == (2, 128, 256)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (4, 2, 32)
    assert (cfg["vocab_size"], cfg["bos_token_id"], cfg["eos_token_id"]) == (1024, 1, 2)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    assert model.dtype == torch.bfloat16
    reference = tiny_target(
        "qwen3",
        seed=0,
        dtype=torch.bfloat16,
        vocab_size=1024,
        num_layers=2,
        hidden_size=128,
        intermediate_size=256,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
    )
    loaded_tok = AutoTokenizer.from_pretrained(path)
    ids = torch.tensor([chat_input_ids(loaded_tok, [{"role": "user", "content": "x = 1"}])])
    assert ids.tolist()[0] == chat_input_ids(tok, [{"role": "user", "content": "x = 1"}])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)


def test_draft_variant_differs(tok, tmp_path):
    draft = save_tiny_target(tmp_path / "draft", num_layers=1, seed=1, tokenizer=tok)
    target = save_tiny_target(tmp_path / "target", tokenizer=tok)
    d = AutoModelForCausalLM.from_pretrained(draft)
    t = AutoModelForCausalLM.from_pretrained(target)
    assert d.config.num_hidden_layers == 1
    assert not torch.equal(d.model.embed_tokens.weight, t.model.embed_tokens.weight)


def test_save_tiny_target_rejects_a_vocab_smaller_than_the_tokenizer(tok, tmp_path):
    with pytest.raises(ValueError, match="smaller than the tokenizer"):
        save_tiny_target(tmp_path / "t", tokenizer=tok, vocab_size=128)
