import numpy as np
import pytest
import torch
from sglang_hspec.calibration import ConfidenceRecorder, ConfidenceRecords, load_records, load_shard


def test_recorder_writes_sglang_layout(tmp_path):
    stem = tmp_path / "rec" / "run"
    logits = torch.randn(4, 4)
    with ConfidenceRecorder(stem, block_size=4, flush_every=2, meta={"drafter": "tiny"}) as rec:
        rec.add(logits, torch.tensor([0, 2, 4, 1], dtype=torch.int32))
        rec.add(logits[:1], torch.tensor([3]))  # second add: flush_every reached
        assert rec.shard_paths == [tmp_path / "rec" / "run.0.pt"]
        rec.add(logits[:2], torch.tensor([1, 1]))
    assert [p.name for p in rec.shard_paths] == ["run.0.pt", "run.1.pt"]  # close flushed the rest
    shard = torch.load(rec.shard_paths[0], weights_only=True)
    assert set(shard) == {"logits", "prefix_mask", "meta"} and shard["meta"] == {"drafter": "tiny"}
    assert shard["logits"].dtype == torch.float32 and shard["prefix_mask"].dtype == torch.bool
    expected = torch.tensor(
        [[0, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 1, 0]], dtype=torch.bool
    )
    assert torch.equal(shard["prefix_mask"], expected)
    torch.testing.assert_close(shard["logits"], torch.cat([logits, logits[:1]]))
    records = load_records(data=str(stem) + ".*.pt", block_size=4)
    assert records.num_samples == 7 and records.observed_mask is None
    assert records.prefix_mask.sum(axis=1).tolist() == [0, 2, 4, 1, 3, 1, 1]


def test_recorder_verify_lengths_give_observed_mask(tmp_path):
    with ConfidenceRecorder(tmp_path / "r", block_size=3) as rec:
        rec.add(torch.zeros(2, 3), torch.tensor([1, 0]), verify_lengths=torch.tensor([2, 0]))
    records = load_shard(rec.shard_paths[0])
    assert records.observed_mask.tolist() == [[True, True, False], [False, False, False]]
    with pytest.raises(ValueError, match="verify_lengths"):  # 2 drafts accepted of 1 verified
        ConfidenceRecorder(tmp_path / "q", block_size=3).add(
            torch.zeros(1, 3), torch.tensor([2]), verify_lengths=torch.tensor([1])
        )


def test_recorder_rejects_bad_input_and_existing_stem(tmp_path):
    rec = ConfidenceRecorder(tmp_path / "r", block_size=3)
    with pytest.raises(ValueError, match=r"\[n, block_size=3\]"):
        rec.add(torch.zeros(2, 4), torch.tensor([0, 0]))
    with pytest.raises(ValueError, match="NaN or inf"):
        rec.add(torch.tensor([[0.0, float("nan"), 1.0]]), torch.tensor([0]))
    with pytest.raises(ValueError, match=r"in \[0, 3\]"):
        rec.add(torch.zeros(1, 3), torch.tensor([4]))
    rec.close()
    assert rec.shard_paths == []  # nothing valid was added, nothing written
    with ConfidenceRecorder(tmp_path / "s", block_size=3) as rec:
        rec.add(torch.zeros(1, 3), torch.tensor([1]))
    with pytest.raises(FileExistsError, match="already exist"):
        ConfidenceRecorder(tmp_path / "s", block_size=3)


def test_reads_sglang_float_masks_and_ours_through_one_schema(tmp_path):
    # SGLang's StsDataRecorder stores prefix_mask (and observed_mask) as float32
    torch.save(
        {
            "logits": torch.ones(2, 3),
            "prefix_mask": torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 0.0]]),
            "observed_mask": torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]),
        },
        tmp_path / "sglang.0.pt",
    )
    with ConfidenceRecorder(tmp_path / "ours", block_size=3) as rec:
        rec.add(torch.zeros(1, 3), torch.tensor([3]))
    records = load_records(data=[tmp_path / "sglang.*.pt", tmp_path / "ours.*.pt"])
    assert records.logits.dtype == np.float32 and records.prefix_mask.dtype == np.bool_
    assert records.prefix_mask.sum(axis=1).tolist() == [1, 2, 3]
    assert records.observed_mask.tolist() == [[1, 1, 1], [1, 1, 0], [1, 1, 1]]
    assert load_records(data=str(tmp_path)).num_samples == 3  # a directory means its *.pt


def _save(path, **tensors):
    torch.save(tensors, path)
    return path


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda p: p.write_bytes(b"not a torch file"), "not a readable confidence record shard"),
        (lambda p: _save(p, logits=torch.zeros(2, 3)), "expected a dict with 'logits' and 'prefix_mask'"),
        (lambda p: _save(p, logits=torch.zeros(2, 3), prefix_mask=torch.zeros(2, 4)), "shape"),
        (
            lambda p: _save(p, logits=torch.tensor([[0.0, float("nan")]]), prefix_mask=torch.zeros(1, 2)),
            "NaN or infinite",
        ),
        (
            lambda p: _save(p, logits=torch.tensor([[0.0, float("inf")]]), prefix_mask=torch.zeros(1, 2)),
            "NaN or infinite",
        ),
        (
            lambda p: _save(p, logits=torch.zeros(1, 2), prefix_mask=torch.tensor([[0.0, 1.0]])),
            "not an accepted prefix",
        ),
        (lambda p: _save(p, logits=torch.zeros(1, 2), prefix_mask=torch.tensor([[0.5, 0.0]])), "only 0/1"),
    ],
)
def test_bad_shards_raise_clear_errors(tmp_path, make, message):
    path = tmp_path / "bad.0.pt"
    make(path)
    with pytest.raises(ValueError, match=message) as info:
        load_records(data=str(tmp_path / "*.pt"))
    assert "bad.0.pt" in str(info.value)


def test_glob_block_size_and_empty_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no confidence record shards matched"):
        load_records(data=str(tmp_path / "*.pt"))
    _save(tmp_path / "a.0.pt", logits=torch.zeros(2, 3), prefix_mask=torch.zeros(2, 3))
    with pytest.raises(ValueError, match="block_size=3 slots but --block-size 7"):
        load_records(data=str(tmp_path / "a.*.pt"), block_size=7)
    _save(tmp_path / "b.0.pt", logits=torch.zeros(2, 4), prefix_mask=torch.zeros(2, 4))
    with pytest.raises(ValueError, match="disagree on the block size"):
        load_records(data=str(tmp_path / "*.pt"))
    _save(tmp_path / "e.0.pt", logits=torch.zeros(0, 3), prefix_mask=torch.zeros(0, 3))
    with pytest.raises(ValueError, match="hold no records"):
        load_records(data=str(tmp_path / "e.*.pt"))


def test_split_is_a_partition():
    rng = np.random.default_rng(0)
    records = ConfidenceRecords(rng.normal(size=(100, 3)).astype(np.float32), np.zeros((100, 3), bool))
    fit, held = records.split(holdout_fraction=0.25, seed=1)
    assert fit.num_samples == 75 and held.num_samples == 25
    rows = np.concatenate([fit.logits, held.logits])
    assert sorted(map(tuple, rows.tolist())) == sorted(map(tuple, records.logits.tolist()))


def test_old_shards_storing_the_block_size_still_load(tmp_path):
    # recordings may carry the block size under SGLang's name ("gamma") or ours; both are read and checked
    _save(tmp_path / "old.0.pt", logits=torch.zeros(2, 3), prefix_mask=torch.zeros(2, 3), gamma=3)
    _save(
        tmp_path / "new.0.pt",
        logits=torch.zeros(1, 3),
        prefix_mask=torch.ones(1, 3),
        block_size=torch.tensor(3),
    )
    records = load_records(data=str(tmp_path / "*.pt"), block_size=3)
    assert records.num_samples == 3 and records.block_size == 3
    _save(tmp_path / "bad.0.pt", logits=torch.zeros(2, 3), prefix_mask=torch.zeros(2, 3), gamma=7)
    with pytest.raises(ValueError, match="bad.0.pt: the shard stores gamma=7 but its logits have 3 slots"):
        load_records(data=str(tmp_path / "bad.*.pt"))
