"""Packed training data (training/packed.py): the examples read from a packed set are exactly the ones
tokenized from the JSONL it was packed from, unpack gives the conversations back, shards are checked and
kept, and the CLI packs a regenerate directory shard by shard."""

import hashlib
import json

import numpy as np
import pytest
from transformers import AutoTokenizer

from sglang_hspec.training import packed
from sglang_hspec.training.data import in_heldout, load_examples, normalize_conversation, read_jsonl

CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4."}],
    # a leading assistant turn is dropped by the renderer, as tokenize_conversation drops it
    [{"from": "gpt", "value": "orphan reply"}, {"from": "human", "value": "  indented question\n"},
     {"from": "gpt", "value": "  an indented answer with\ttabs\n\n"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Ünïcödé — naïve café 東京?"},
     {"role": "assistant", "content": "東京 is Tokyo. 🙂"}, {"role": "user", "content": "user"},
     {"role": "assistant", "content": "user"}],
    [{"role": "user", "content": "def f(x):\n    return x"}, {"role": "assistant", "content": "```python\nprint(1)\n```"}],
    [{"role": "user", "content": "no reply"}, {"role": "assistant", "content": ""}],  # only the end-of-turn token
]


@pytest.fixture(scope="module")
def tokenizer(embedded_dir):
    return AutoTokenizer.from_pretrained(embedded_dir, local_files_only=True)


def _write_jsonl(path, convs, *, prefix="c"):
    path.write_text("".join(json.dumps({"id": f"{prefix}{i}", "conversations": c}, ensure_ascii=False) + "\n"
                            for i, c in enumerate(convs)), encoding="utf-8")
    return path


def _rendered(conv):
    msgs = normalize_conversation(conv)
    while msgs and msgs[0]["role"] == "assistant":
        msgs = msgs[1:]
    return msgs


@pytest.mark.parametrize("max_length,kept", [(512, 15), (36, 9)])
def test_packed_examples_equal_the_tokenized_jsonl(tmp_path, tokenizer, max_length, kept):
    src = _write_jsonl(tmp_path / "train.jsonl", CONVERSATIONS * 3)
    manifest = packed.pack(in_path=src, out_dir=tmp_path / "packed", tokenizer=tokenizer, target="embedded",
                           heldout_fraction=0.0, progress=False)
    assert manifest.token_dtype == "uint16" and manifest.vocab_size == 49152
    expected = load_examples(read_jsonl(src), tokenizer=tokenizer, max_length=max_length)
    got = packed.load_packed_examples(tmp_path / "packed", tokenizer=tokenizer, max_length=max_length)
    assert got == expected
    # at 36 tokens (the default system prompt takes ~30) only the short first prompts keep an anchor
    assert len(got) == kept
    assert all(len(e["input_ids"]) <= max_length for e in got)


def test_unpack_gives_the_conversations_back_split_by_id(tmp_path, tokenizer):
    convs = CONVERSATIONS * 8
    src = _write_jsonl(tmp_path / "in.jsonl", convs)
    manifest = packed.pack(in_path=src, out_dir=tmp_path / "p", tokenizer=tokenizer, target="embedded",
                           heldout_fraction=0.2, progress=False)
    heldout = sorted(f"c{i}" for i in range(len(convs)) if in_heldout(f"c{i}", 0.2))
    assert manifest.heldout_ids == heldout and 0 < len(heldout) < len(convs)
    counts = packed.unpack(path=tmp_path / "p", out_dir=tmp_path / "u", tokenizer=tokenizer)
    assert counts == {"train": len(convs) - len(heldout), "heldout": len(heldout)}
    back = {r["id"]: r["conversations"] for split in ("train", "heldout")
            for r in read_jsonl(tmp_path / "u" / f"{split}.jsonl")}
    assert back == {f"c{i}": _rendered(c) for i, c in enumerate(convs)}
    assert {r["id"] for r in read_jsonl(tmp_path / "u" / "heldout.jsonl")} == set(heldout)


class _LossyDecode:
    """The real tokenizer, except that decode loses a character: the rendering no longer round-trips."""

    def __init__(self, tok):
        self._tok = tok

    def decode(self, ids, **kw):
        return self._tok.decode(ids, **kw)[1:]

    def __getattr__(self, name):
        return getattr(self._tok, name)

    def __call__(self, *a, **kw):
        return self._tok(*a, **kw)

    def __len__(self):
        return len(self._tok)


def test_a_rendering_that_does_not_round_trip_keeps_its_messages_verbatim(tmp_path, tokenizer):
    src = _write_jsonl(tmp_path / "in.jsonl", CONVERSATIONS[:3])
    packed.pack(in_path=src, out_dir=tmp_path / "p", tokenizer=_LossyDecode(tokenizer), target="embedded",
                heldout_fraction=0.0, progress=False)
    with np.load(tmp_path / "p" / "000000.npz") as z:
        assert all(v for v in z["verbatim"]) and len(z["message_roles"]) == 0
    packed.unpack(path=tmp_path / "p", out_dir=tmp_path / "u", tokenizer=_LossyDecode(tokenizer))
    assert [r["conversations"] for r in read_jsonl(tmp_path / "u" / "train.jsonl")] == \
        [_rendered(c) for c in CONVERSATIONS[:3]]


def test_packing_is_deterministic_and_a_damaged_shard_is_refused(tmp_path, tokenizer):
    src = _write_jsonl(tmp_path / "in.jsonl", CONVERSATIONS)
    a = packed.pack(in_path=src, out_dir=tmp_path / "a", tokenizer=tokenizer, target="embedded", progress=False)
    b = packed.pack(in_path=src, out_dir=tmp_path / "b", tokenizer=tokenizer, target="embedded", progress=False)
    assert a.shards == b.shards
    assert hashlib.sha256((tmp_path / "a" / "000000.npz").read_bytes()).hexdigest() == a.shards[0].sha256
    shard = tmp_path / "a" / "000000.npz"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"000000\.npz: its sha256 differs .* restore it"):
        packed.load_packed_examples(tmp_path / "a", tokenizer=tokenizer, max_length=64)
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=r"000000\.npz: listed in .*manifest\.json but missing"):
        packed.load_packed_examples(tmp_path / "a", tokenizer=tokenizer, max_length=64)


def test_another_tokenizer_is_refused_naming_the_path(tmp_path, tokenizer):
    src = _write_jsonl(tmp_path / "in.jsonl", CONVERSATIONS)
    packed.pack(in_path=src, out_dir=tmp_path / "p", tokenizer=tokenizer, target="embedded", progress=False)
    other = _LossyDecode(tokenizer)
    other.__dict__["chat_template"] = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    with pytest.raises(ValueError, match=r"data\.train_path .*p: packed with another tokenizer"):
        packed.load_packed_examples(tmp_path / "p", tokenizer=other, max_length=64)


def _regen_dir(root, shards):
    """A regenerate --out directory with committed shards (records + status files), as regenerate.py writes."""
    d = root / "shards"
    d.mkdir(parents=True, exist_ok=True)
    for n, convs in shards.items():
        ids = [f"s{n}-{i}" for i in range(len(convs))]
        (d / f"{n:06d}.status.jsonl").write_text("".join(
            json.dumps({"id": i, "status": "succeeded", "reason": None, "target_tokens": 1, "truncated": 0}) + "\n"
            for i in ids))
        (d / f"{n:06d}.jsonl").write_text("".join(
            json.dumps({"id": i, "conversations": c}, ensure_ascii=False) + "\n" for i, c in zip(ids, convs)))
    return root


def test_cli_packs_a_growing_regenerate_dir_without_rewriting_committed_shards(tmp_path, tokenizer, capsys):
    from sglang_hspec.cli import main

    regen = _regen_dir(tmp_path / "regen", {0: CONVERSATIONS[:2], 1: CONVERSATIONS[2:4]})
    (regen / "runs.jsonl").write_text(json.dumps({"command": "hspec data regenerate --in x --out regen"}) + "\n")
    out = tmp_path / "packed"
    assert main(["data", "pack", "--in", str(regen), "--out", str(out)]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["shards"] == 2 and summary["conversations"] == 4
    first = (out / "000000.npz").stat().st_mtime_ns
    _regen_dir(regen, {2: CONVERSATIONS[:1]})
    assert main(["data", "pack", "--in", str(regen), "--out", str(out)]) == 0
    manifest = packed.read_manifest(out)
    assert [s.file for s in manifest.shards] == ["000000.npz", "000001.npz", "000002.npz"]
    assert (out / "000000.npz").stat().st_mtime_ns == first  # kept, not packed again
    assert manifest.generation == [{"command": "hspec data regenerate --in x --out regen"}]
    assert manifest.conversations == 5
    assert main(["data", "unpack", "--in", str(out), "--out", str(tmp_path / "u")]) == 0
    unpacked = {split: [r["id"] for r in read_jsonl(tmp_path / "u" / f"{split}.jsonl")] for split in ("train", "heldout")}
    assert unpacked == {"train": ["s0-0", "s0-1", "s1-1", "s2-0"], "heldout": ["s1-0"]}  # in_heldout at 0.02
    assert manifest.heldout_ids == ["s1-0"]


def test_trainer_reads_a_packed_directory(tmp_path, tokenizer):
    from sglang_hspec.training.config import TrainConfig
    from sglang_hspec.training.trainer import _load_examples

    src = _write_jsonl(tmp_path / "train.jsonl", CONVERSATIONS * 2)
    packed.pack(in_path=src, out_dir=tmp_path / "p", tokenizer=tokenizer, target="embedded", heldout_fraction=0.0,
                progress=False)

    def cfg(path):
        return TrainConfig.model_validate({"model": {"kind": "hspec", "target": "embedded",
                                                     "target_layer_ids": [1, 8, 15, 22, 28]},
                                           "data": {"train_path": str(path), "max_length": 64,
                                                    "tokenized_cache": False},
                                           "training": {"max_steps": 1, "output_dir": str(tmp_path / "run")}})

    assert _load_examples(cfg(tmp_path / "p"), tokenizer) == _load_examples(cfg(src), tokenizer)


def test_bad_inputs_name_the_path(tmp_path, tokenizer):
    with pytest.raises(FileNotFoundError, match=r"--in .*nope: no such file or directory"):
        packed.pack(in_path=tmp_path / "nope", out_dir=tmp_path / "o", tokenizer=tokenizer, target="embedded")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"--in .*empty: no committed shard"):
        packed.pack(in_path=tmp_path / "empty", out_dir=tmp_path / "o", tokenizer=tokenizer, target="embedded")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "manifest.json").write_text('{"format": "other"}')
    with pytest.raises(ValueError, match=r"bad/manifest\.json is not a packed-data manifest"):
        packed.read_manifest(tmp_path / "bad")
