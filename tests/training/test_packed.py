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


# ------------------------------------------------------------------ the CLI's bad inputs
def _tree(root):
    """Every file under root with its bytes: what a failed command must leave as it was."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def cli_inputs(tmp_path, tokenizer):
    """A JSONL to pack, a packed set, a file in the way and a directory holding another format's manifest."""
    src = _write_jsonl(tmp_path / "in.jsonl", CONVERSATIONS[:2])
    packed.pack(in_path=src, out_dir=tmp_path / "p", tokenizer=tokenizer, target="embedded", progress=False)
    (tmp_path / "afile").write_text("in the way\n")
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "manifest.json").write_text('{"format": "other-packer/2", "shards": []}')
    return tmp_path


@pytest.mark.parametrize("argv, message", [
    (["pack", "--in", "{t}/nope.jsonl", "--out", "{t}/o"],
     "--in {t}/nope.jsonl: no such file or directory; pass a `hspec data regenerate --out` directory or a SpecForge "
     "JSONL file"),
    (["pack", "--in", "{t}/in.jsonl", "--out", "{t}/o", "--heldout", "2"],
     "--heldout 2.0: the held-out fraction must be in [0, 1)"),
    (["pack", "--in", "{t}/in.jsonl", "--out", "{t}/afile/o"],
     "--out {t}/afile/o cannot be created: {t}/afile is a file, not a directory; pick another --out"),
    (["pack", "--in", "{t}/in.jsonl", "--out", "{t}/foreign"],
     "--out {t}/foreign already holds a manifest.json that is not a packed-data manifest (format 'other-packer/2' is "
     "not 'hspec-packed/1'); pick another --out, or delete {t}/foreign/manifest.json to pack into {t}/foreign"),
    (["unpack", "--in", "{t}/foreign", "--out", "{t}/u"],
     "{t}/foreign/manifest.json is not a packed-data manifest (format 'other-packer/2' is not 'hspec-packed/1'); "
     "pack it again with `hspec data pack --in <regenerate dir or JSONL> --out DIR`"),
    (["unpack", "--in", "{t}/nope", "--out", "{t}/u"],
     "{t}/nope/manifest.json: no such file; a packed directory holds manifest.json (pack it again with "
     "`hspec data pack --in <regenerate dir or JSONL> --out DIR`)"),
    (["unpack", "--in", "{t}/p", "--out", "{t}/afile/u"],
     "--out {t}/afile/u cannot be created: {t}/afile is a file, not a directory; pick another --out"),
    (["unpack", "--in", "{t}/in.jsonl", "--out", "{t}/u"],
     "{t}/in.jsonl is a file, not a packed directory (one holding manifest.json); pass the --out directory of "
     "`hspec data pack`, or pack it again with `hspec data pack --in <regenerate dir or JSONL> --out DIR`"),
], ids=["pack-in-missing", "pack-heldout-2", "pack-out-under-a-file", "pack-out-foreign-manifest",
        "unpack-foreign-manifest", "unpack-no-manifest", "unpack-out-under-a-file", "unpack-in-a-file"])
def test_cli_bad_flags_are_answered_before_the_tokenizer_loads(cli_inputs, monkeypatch, capsys, argv, message):
    from sglang_hspec.cli import main
    from sglang_hspec.target import loading

    monkeypatch.setattr(loading, "load_tokenizer", lambda *a, **k: pytest.fail("the tokenizer loaded"))
    before = _tree(cli_inputs)
    assert main(["data", *[a.format(t=cli_inputs) for a in argv]]) == 2
    assert capsys.readouterr().err == f"error: {message.format(t=cli_inputs)}\n"
    assert _tree(cli_inputs) == before and not (cli_inputs / "o").exists() and not (cli_inputs / "u").exists()


def _damage_shard(root):
    shard = root / "p" / "000000.npz"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))


@pytest.mark.parametrize("case", ["no-id", "string-messages", "unknown-role", "nothing-to-pack", "damaged-shard",
                                  "other-tokenizer"])
def test_cli_bad_data_names_the_file_and_writes_nothing(cli_inputs, tokenizer, monkeypatch, capsys, case):
    from sglang_hspec.cli import main
    from sglang_hspec.target import loading

    t = cli_inputs
    other = _LossyDecode(tokenizer)  # another class: another tokenizer fingerprint
    monkeypatch.setattr(loading, "load_tokenizer", lambda spec: other if spec == "other" else tokenizer)
    pack = ["data", "pack", "--in", str(t / "bad.jsonl"), "--out", str(t / "o")]
    unpack = ["data", "unpack", "--in", str(t / "p"), "--out", str(t / "u")]
    fingerprint = packed.read_manifest(t / "p").tokenizer_fingerprint
    argv, message = {
        "no-id": (pack, f"{t}/bad.jsonl:2: a record needs an 'id' (SpecForge layout) to pack"),
        "string-messages": (pack, f"{t}/bad.jsonl:2: 'conversations' must be a list of {{role, content}} messages "
                                  "(SpecForge layout) to pack; fix or remove that line"),
        "unknown-role": (pack, f"{t}/bad.jsonl:2: message {{'role': 'robot', 'content': 'beep'}} needs role in "
                               "('system', 'user', 'assistant') (or ShareGPT from/value) and string content; fix or "
                               "remove that line"),
        "nothing-to-pack": (pack, f"--in {t}/bad.jsonl: no conversation to pack (no record whose conversation "
                                  "renders to tokens); pass a SpecForge JSONL of {id, conversations} records"),
        "damaged-shard": (unpack, f"{t}/p/000000.npz: its sha256 differs from {t}/p/manifest.json's (a damaged or "
                                  "hand-edited shard); restore it (git checkout) or pack the set again"),
        "other-tokenizer": ([*unpack, "--target", "other"],
                            f"--target other: its tokenizer is not the one {t}/p was packed with (fingerprint "
                            f"{fingerprint}, target 'embedded'), so its ids would decode to other text; pass "
                            "--target embedded"),
    }[case]
    good = {"id": "a", "conversations": CONVERSATIONS[0]}
    bad = {"no-id": {"conversations": CONVERSATIONS[0]},
           "string-messages": {"id": "b", "conversations": ["What is 2+2?", "4."]},
           "unknown-role": {"id": "b", "conversations": [{"role": "robot", "content": "beep"}]}}.get(case, good)
    (t / "bad.jsonl").write_text("\n" if case == "nothing-to-pack" else json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    if case == "damaged-shard":
        _damage_shard(t)
    before = _tree(t)
    assert main(argv) == 2
    err = capsys.readouterr().err  # after pack's progress bar, if it started
    assert err.endswith(f"\nerror: {message}\n") or err == f"error: {message}\n"
    assert _tree(t) == before and not (t / "o").exists() and not (t / "u").exists()


def test_unpack_shards_restores_the_regenerate_dir_byte_for_byte_and_another_source_is_refused(tmp_path, tokenizer):
    # regenerate writes {role, content} conversations that open with a user turn, as these
    regen = _regen_dir(tmp_path / "regen", {0: [CONVERSATIONS[0], CONVERSATIONS[2]], 1: CONVERSATIONS[3:5]})
    out = tmp_path / "packed"
    packed.pack(in_path=regen, out_dir=out, tokenizer=tokenizer, target="embedded", progress=False,
                generation=[{"command": "hspec data regenerate ..."}])
    restored = tmp_path / "restored"
    packed.unpack(path=out, out_dir=restored, tokenizer=tokenizer, shards=True)
    for n in ("000000", "000001"):
        assert (restored / "shards" / f"{n}.jsonl").read_bytes() == (regen / "shards" / f"{n}.jsonl").read_bytes()
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    # the restored directory packs to the same set, and keeps the runs that wrote it
    manifest = packed.pack(in_path=restored, out_dir=out, tokenizer=tokenizer, target="embedded", progress=False)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert manifest.generation == [{"command": "hspec data regenerate ..."}]
    # a fresh regeneration elsewhere (shard 0 of other conversations) is refused, not silently kept
    other = _regen_dir(tmp_path / "other", {0: CONVERSATIONS[2:3]})
    with pytest.raises(ValueError, match=r"--in .*other/shards/000000\.jsonl is not the shard packed as .*000000\.npz"):
        packed.pack(in_path=other, out_dir=out, tokenizer=tokenizer, target="embedded", progress=False)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    # a regenerate directory holding only a later shard adds it and keeps the committed ones
    later = _regen_dir(tmp_path / "later", {2: CONVERSATIONS[:1]})
    manifest = packed.pack(in_path=later, out_dir=out, tokenizer=tokenizer, target="embedded", progress=False)
    assert [s.file for s in manifest.shards] == ["000000.npz", "000001.npz", "000002.npz"]
    assert (out / "000000.npz").read_bytes() == before["000000.npz"]
