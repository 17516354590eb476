"""Bad training data is answered with the file, the line, the problem and the fix; data shards are
written atomically (a full disk keeps the previous shards)."""

import json

import pytest
from faults import disk_full_after

from sglang_hspec.cli import main
from sglang_hspec.core.atomic import ArtifactWriteError
from sglang_hspec.training.data import build_dataset, load_examples, read_jsonl

LAYOUTS = '{"id", "conversations": [{"role", "content"}]} or pre-tokenized {"id", "input_ids", "loss_mask"}'


def _load(path):
    return load_examples(read_jsonl(path), tokenizer=None, max_length=64)


def test_empty_jsonl_says_the_file_is_empty(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text("\n  \n")
    with pytest.raises(ValueError) as err:
        _load(path)
    assert str(err.value) == (f"{path} is empty: it holds no records ({LAYOUTS}, one per line); build training "
                              "data with `hspec data build --out DIR` and point data.train_path at DIR/train.jsonl")


@pytest.mark.parametrize("lines, line, message", [
    (['{"id": "a", "input_ids": [1, 2, 3, 4], "loss_mask": [0, 0, 1, 1]}', '{"foo": 1}'], 2,
     f"(id None): the record has neither conversations nor input_ids (its keys: ['foo']); expected {LAYOUTS}"),
    (['[1, 2, 3]'], 1, f"holds a JSON list, not a record object ({LAYOUTS}); fix or remove that line"),
    (['{"id": "a", "input_ids": [1, 2'], 1, "is not valid JSON (Expecting"),
    (['{"id": "b", "input_ids": [1, 2, 3], "loss_mask": [1, 1]}'], 1,
     "(id 'b'): input_ids and loss_mask lengths differ (3 vs 2); give one loss_mask entry per token"),
    (['{"id": "c", "input_ids": ["x", 2, 3]}'], 1, "(id 'c'): input_ids and loss_mask must be lists of integers"),
    (['{"id": "d", "input_ids": [1, 2, 3, 4], "loss_mask": [0, 0, 2, 1]}'], 1,
     "(id 'd'): loss_mask must hold 0/1 only, got values [2]"),
    (['{"id": "e", "conversations": "hello"}'], 1, "(id 'e'): conversation records need the target's tokenizer"),
], ids=["no-known-keys", "not-an-object", "bad-json", "mask-length", "non-integer-ids", "mask-values",
        "conversations-without-tokenizer"])
def test_bad_record_names_file_and_line(tmp_path, lines, line, message):
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError) as err:
        _load(path)
    assert str(err.value).startswith(f"{path}:{line} ") and message in str(err.value), str(err.value)


def test_file_without_any_anchor_says_so(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text('{"id": "a", "input_ids": [1, 2, 3], "loss_mask": [1, 1, 0]}\n')
    with pytest.raises(ValueError, match=rf"^{path}: none of its 1 records has an assistant token after position 1"):
        _load(path)


def test_good_records_still_load(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text('{"id": "a", "input_ids": [5, 6, 7, 8], "loss_mask": [0, 0, 1, 1]}\n\n'
                    '{"id": "b", "input_ids": [5, 6, 7], "loss_mask": [1, 1, 0]}\n')  # b has no anchor: dropped
    assert _load(path) == [{"id": "a", "input_ids": [5, 6, 7, 8], "loss_mask": [0, 0, 1, 1]}]
    # records given as a list name their index instead of a line
    with pytest.raises(ValueError, match=r"^record 1 \(id None\): the record has neither"):
        load_examples([{"id": "a", "input_ids": [1, 2, 3]}, {"x": 1}], tokenizer=None, max_length=8)


@pytest.mark.parametrize("content, message", [
    ("", "is empty: it holds no records"),
    ('{"foo": 1}\n', ":1 (id None): the record has neither conversations nor input_ids"),
], ids=["empty", "foo"])
def test_hspec_train_on_bad_jsonl(tmp_path, capsys, content, message):
    """End to end through `hspec train` on the tiny recipe (it fails while reading the data, before any step)."""
    data = tmp_path / "train.jsonl"
    data.write_text(content)
    rc = main(["train", "--config", "configs/train_tiny.yaml", "--no-progress", "data.synthetic=null",
               f"data.train_path={data}", f"training.output_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith(f"error: {data}") and message in err, err


# ------------------------------------------------------------------ crash safety

def _records(n):
    for i in range(n):
        yield {"id": f"r{i}", "conversations": [{"role": "user", "content": f"question {i}"},
                                                {"role": "assistant", "content": f"answer {i} " * 20}]}


def test_build_dataset_on_a_full_disk_keeps_the_previous_shards(tmp_path, monkeypatch):
    build_dataset(records=_records(30), out_dir=tmp_path, heldout_fraction=0.2)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    assert before["train.jsonl"] and set(before) == {"train.jsonl", "heldout.jsonl", "build_stats.json"}
    with disk_full_after(3000), pytest.raises(  # room for part of the new train shard
            ArtifactWriteError, match=rf"^could not write {tmp_path}/(train|heldout)\.jsonl: No space left on "
                                      "device; the disk may be full"):
        build_dataset(records=_records(300), out_dir=tmp_path, heldout_fraction=0.2)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before  # no temp file left either
    assert json.loads(before["build_stats.json"])["read"] == 30


def _build_argv(out, *extra):
    return ["data", "build", "--out", str(out), "--sharegpt", "0", "--code", "2", *extra]


def test_hspec_data_build_out_that_cannot_exist_names_out_and_the_real_cause(tmp_path, capsys):
    """--out under a file, or a file itself: refused before a record is read, with the cause (not a full disk)."""
    blocker = tmp_path / "afile"
    blocker.write_text("x")
    assert main(_build_argv(blocker / "data")) == 2
    assert capsys.readouterr().err.strip() == (f"error: --out {blocker / 'data'} cannot be created: {blocker} is a "
                                               "file, not a directory; pick another --out")
    assert main(_build_argv(blocker)) == 2
    assert capsys.readouterr().err.strip() == (f"error: --out {blocker} cannot be created: {blocker} is a file, not a "
                                               "directory; pick another --out")
    assert sorted(tmp_path.iterdir()) == [blocker] and blocker.read_text() == "x"


@pytest.mark.parametrize("extra, message", [
    (["--heldout", "2"], "--heldout must be a fraction in [0, 1) (the held-out share, split by id hash), got 2.0"),
    (["--code", "-1"], "--code must be >= 0 (records to add; 0: none), got -1"),
    (["--code", "0"], "--sharegpt, --code and --math are all 0: nothing to build; give at least one a count"),
    (["--code-root", "MISSING"], "--code-root MISSING does not exist; pass a directory of .py files (or drop it: the "
                                 "stdlib)"),
], ids=["heldout-2", "code-negative", "nothing", "code-root-missing"])
def test_hspec_data_build_bad_flags_write_nothing(tmp_path, capsys, extra, message):
    extra = [str(tmp_path / "nope") if a == "MISSING" else a for a in extra]
    assert main(_build_argv(tmp_path / "data", *extra)) == 2
    assert capsys.readouterr().err.strip() == "error: " + message.replace("MISSING", str(tmp_path / "nope"))
    assert list(tmp_path.iterdir()) == []


def test_build_dataset_names_a_permission_error_not_a_full_disk(tmp_path, monkeypatch):
    from pathlib import Path

    def refuse(self, *a, **k):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "mkdir", refuse)
    with pytest.raises(OSError) as err:
        build_dataset(records=_records(3), out_dir=tmp_path / "data")
    assert str(err.value) == (f"out_dir {tmp_path / 'data'} cannot be created: permission denied: {tmp_path} is not "
                              "writable by this user; pick another out_dir")
    assert list(tmp_path.iterdir()) == []
