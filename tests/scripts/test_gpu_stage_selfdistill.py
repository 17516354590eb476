"""scripts/gpu_stage_selfdistill.py: which prompts it stages for the GPU, in what form."""

from __future__ import annotations

import gzip
import json

import pytest

from sglang_hspec.training import regenerate as regen_module


@pytest.fixture(scope="module")
def stage(load_script):
    return load_script("gpu_stage_selfdistill")


def _conv(*users):
    out = []
    for u in users:
        out += [{"role": "user", "content": u}, {"role": "assistant", "content": "old " + u}]
    return out


def test_order_key_is_regenerates_order(stage):
    """The script takes its prompts from the far end of the order regenerate works through, so a CPU run
    resuming from the near end never meets them: the two orders must be the same."""
    pending = [regen_module._Pending(id=f"r{i}", conversation=[], prompt_tokens=0) for i in range(40)]
    assert [p.id for p in regen_module._order(pending, window=1)] == sorted(
        (p.id for p in pending), key=stage.regeneration_order_key)


def test_stages_the_last_records_not_done_with_their_first_turns(stage, tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    recs = [{"id": f"r{i}", "conversations": _conv(f"q{i}", f"second {i}", f"third {i}")} for i in range(12)]
    a.write_text("".join(json.dumps(r) + "\n" for r in recs[:8]))
    b.write_text("".join(json.dumps(r) + "\n" for r in recs[8:] + recs[:1]))  # r0 twice: staged once
    done_dir = tmp_path / "done"
    (done_dir / "shards").mkdir(parents=True)
    (done_dir / "shards" / "000000.jsonl").write_text("")  # a committed shard: records + statuses
    (done_dir / "shards" / "000000.status.jsonl").write_text(
        "".join(json.dumps({"id": i, "status": "succeeded"}) + "\n" for i in ("r3", "r7")))
    assert stage.done_ids([done_dir]) == {"r3", "r7"}
    out = tmp_path / "prompts.jsonl.gz"
    assert stage.stage_prompts([a, b], {"r3", "r7"}, take=4, max_turns=2, out=out) == 4
    staged = [json.loads(line) for line in gzip.open(out, "rt")]
    left = sorted((f"r{i}" for i in range(12) if i not in (3, 7)), key=stage.regeneration_order_key)
    assert [r["id"] for r in staged] == left[-4:]
    first = next(r for r in recs if r["id"] == staged[0]["id"])
    assert staged[0]["conversations"] == first["conversations"][:4]  # two user turns and their replies


def test_cut_turns(stage):
    conv = [{"role": "system", "content": "s"}, *_conv("a", "b")]
    assert stage.cut_turns(conv, 1) == conv[:3]
    assert stage.cut_turns(conv, 2) == conv == stage.cut_turns(conv, 5)
