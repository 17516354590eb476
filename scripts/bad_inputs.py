"""Run every bad input of the product we know of and regenerate docs/bad_inputs.md.

Each row is one command line run through `hspec`'s own main() in-process (what a user typing it
sees on stderr), or one library call where the input only reaches the library. Inputs are made in a
scratch directory: damaged copies of the shipped drafter, broken JSON / JSONL / YAML files, bad
flags. A row is *clear* when it exits non-zero with an `error: ...` line (no traceback) that names
the file or flag. The script exits 1 if any row is unclear, so it doubles as a check.

    .venv/bin/python scripts/bad_inputs.py            # writes docs/bad_inputs.md
    .venv/bin/python scripts/bad_inputs.py --check    # prints the table, writes nothing

Each target loads once (cached across rows; error paths never change it); the first run converts
the embedded target (~30 s), later runs take about a minute on 2 cores.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import json
import os
import shutil
import sys
import tempfile
import traceback
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # tests/faults.py: the same fault injection the tests use
from faults import disk_full_after  # noqa: E402

SHIPPED = ROOT / "sglang_hspec" / "checkpoints" / "hspec-smollm2"
DOC = ROOT / "docs" / "bad_inputs.md"


@dataclass
class Row:
    group: str
    what: str  # the bad input, in words
    command: list[str] | None = None  # hspec argv (in-process main)
    call: object = None  # or a zero-argument callable (library call)
    env: dict[str, str] | None = None  # environment variables set while the row runs


@dataclass
class Outcome:
    exit_code: int | None
    line: str  # first line of the error the user sees
    traceback: bool
    library: bool = False  # a library call: the line is the exception it raised


def run_row(row: Row) -> Outcome:
    from sglang_hspec.cli import main

    err, out = io.StringIO(), io.StringIO()
    code, tb = None, False
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out), environment(row.env or {}):
        try:
            if row.command is not None:
                code = main(row.command)
            else:
                row.call()
                code = 0
        except SystemExit as e:  # argparse errors and SystemExit("error: ...") from the CLI
            code = e.code if isinstance(e.code, int) else 2
            if isinstance(e.code, str):
                print(e.code, file=sys.stderr)
        except Exception as e:  # noqa: BLE001 - an uncaught exception is what we are looking for
            if row.command is not None:
                tb = True
                traceback.print_exc()
            code = 1
            print(f"{type(e).__name__}: {e}", file=sys.stderr)
    # progress bars share stderr: keep what follows a bar's last redraw on each line
    text = err.getvalue().replace("\x1b[A", "\r")
    lines = [ln.split("\r")[-1] for ln in text.splitlines()]
    lines = [ln for ln in lines if ln.strip()]
    if tb or row.command is None:
        line = lines[-1] if lines else "(traceback)"
    else:
        at = next((i for i, ln in enumerate(lines) if "error:" in ln), None)
        line = lines[at] if at is not None else (lines[-1] if lines else "(nothing printed)")
        if at is not None and line.endswith(":") and at + 1 < len(lines):  # a heading: its first item says what
            line = f"{line} {lines[at + 1].strip()}"
    return Outcome(code, line.strip(), tb, library=row.command is None)


@contextlib.contextmanager
def environment(env: dict[str, str]):
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def clear(outcome: Outcome) -> bool:
    """Failed, no traceback, and said so: an `error:` line (CLI) or an exception with a message (library)."""
    said = ": " in outcome.line if outcome.library else "error:" in outcome.line
    return bool(outcome.exit_code) and not outcome.traceback and said


# ------------------------------------------------------------------ inputs


def damaged_drafter(scratch: Path, name: str, damage) -> str:
    d = scratch / name
    shutil.copytree(SHIPPED, d)
    damage(d)
    return str(d)


def edit_config(edit):
    def damage(d: Path) -> None:
        cfg = json.loads((d / "config.json").read_text())
        edit(cfg)
        (d / "config.json").write_text(json.dumps(cfg, indent=2))
    return damage


def rows(scratch: Path, tiny_target_dir: str) -> list[Row]:
    w = scratch.joinpath
    w("empty.txt").write_text("\n\n")
    w("bad_prompts.jsonl").write_text('{"id": 1, "turns": ["hi"]}\n{"id": 2, "turns": [\n')
    w("notjson.json").write_text("this is not JSON\n")
    w("sps_wrong_layout.json").write_text(json.dumps({"batch_tokens": [1, 2], "steps_per_second": [3.0, 2.0]}))
    w("sps_decreasing.json").write_text(json.dumps({"sample_batch_tokens": [8, 4], "sample_steps_per_sec": [2.0, 3.0],
                                                    "max_batch_tokens": 8}))
    w("sts_3_slots.json").write_text(json.dumps({"temperatures": [1.0, 1.2, 1.5]}))
    w("sts_negative.json").write_text(json.dumps({"temperatures": [1.0, -2.0, 1.0, 1.0, 1.0, 1.0, 1.0]}))
    w("sts_unknown_field.json").write_text(json.dumps({"temperatures": [1.0] * 7, "gamma": 7}))
    w("empty.jsonl").write_text("")
    w("foo.jsonl").write_text('{"foo": 1}\n')
    w("badline.jsonl").write_text('{"id": "a", "input_ids": [5, 6, 7, 8], "loss_mask": [0, 0, 1, 1]}\n{"id": "b", \n')
    w("masklen.jsonl").write_text('{"id": "a", "input_ids": [5, 6, 7, 8], "loss_mask": [0, 1]}\n')
    w("noanchor.jsonl").write_text('{"id": "a", "input_ids": [5, 6, 7], "loss_mask": [1, 1, 0]}\n')
    w("bad.yaml").write_text("model: [unclosed\n")
    w("notarecord.pt").write_bytes(b"not a torch file")
    (scratch / "emptydir").mkdir()
    w("afile").write_text("a file where a directory is expected\n")
    w("binary.txt").write_bytes(b"\xff\xfe\x00\x81 not text")
    conv = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4."}]
    w("convs.jsonl").write_text(json.dumps({"id": "a", "conversations": conv}) + "\n")
    w("noid.jsonl").write_text(json.dumps({"conversations": conv}) + "\n")
    w("badmsg.jsonl").write_text(json.dumps({"id": "a", "conversations": ["What is 2+2?", "4."]}) + "\n")
    (scratch / "foreign").mkdir()
    w("foreign/manifest.json").write_text(json.dumps({"format": "other-packer/2", "shards": []}))
    packed_dir, damaged_pack = packed_sets(scratch)

    tiny = ["--target", tiny_target_dir, "--dtype", "fp32"]
    gen = ["generate", "--prompt", "hi"]
    emb = [*gen, "--dtype", "fp32"]
    train = ["train", "--config", str(ROOT / "configs" / "train_tiny.yaml"), "--no-progress"]
    jsonl_train = [*train, "data.synthetic=null", f"training.output_dir={scratch / 'run'}"]

    d = functools.partial(damaged_drafter, scratch)
    trunc_cfg = d("trunc_config", lambda p: (p / "config.json").write_text((p / "config.json").read_text()[:500]))
    trunc_st = d("trunc_weights", lambda p: (p / "model.safetensors").write_bytes(
        (p / "model.safetensors").read_bytes()[:1_000_000]))
    layers24 = d("layers24", edit_config(lambda c: c["hspec"]["target"].update(num_hidden_layers=24)))
    no_section = d("no_hspec", edit_config(lambda c: c.pop("hspec")))
    slot_conv = d("slot_convention", edit_config(lambda c: c["hspec"].update(slot_convention="slot_j_predicts_anchor_plus_j")))
    no_weights = d("no_weights", lambda p: (p / "model.safetensors").unlink())
    unknown_field = d("unknown_field", edit_config(lambda c: c["hspec"].update(block_len=7)))
    binary_cfg = d("binary_config", lambda p: (p / "config.json").write_bytes(b"\xff\xfe\x00garbage"))

    def other_shapes(p: Path) -> None:
        from safetensors.torch import load_file, save_file

        state = load_file(str(p / "model.safetensors"))
        state.pop(sorted(state)[0])
        save_file(state, str(p / "model.safetensors"))

    missing_tensor = d("missing_tensor", other_shapes)
    huge_block = d("block_size_100000", edit_config(lambda c: c["hspec"].update(block_size=100000)))
    huge_mlp = d("intermediate_size_1e9", edit_config(lambda c: c["hspec"].update(intermediate_size=10**9)))
    markov_rank = d("markov_rank_1e7", edit_config(lambda c: c["hspec"].update(markov_rank=10**7)))
    zero_eps = d("rms_norm_eps_0", edit_config(lambda c: c["hspec"].update(rms_norm_eps=0)))
    int_ids = d("target_layer_ids_3", edit_config(lambda c: c["hspec"].update(target_layer_ids=3)))
    conf_yes = d("confidence_head_yes", edit_config(lambda c: c["hspec"].update(confidence_head="yes")))
    no_mask = d("no_mask_token_id", edit_config(lambda c: c["hspec"].pop("mask_token_id")))
    blocker = w("afile")
    build = ["data", "build", "--sharegpt", "0", "--code", "2"]
    regen = ["data", "regenerate", "--in", str(w("convs.jsonl")), "--out", str(w("regen_flags"))]
    pack = ["data", "pack", "--in", str(w("convs.jsonl"))]
    unpack = ["data", "unpack", "--out", str(w("unpacked"))]
    sps_env = {"SGLANG_RAGGED_VERIFY_MODE": "compact", "HSPEC_CACHE_DIR": str(w("cache"))}
    auto_env = {**sps_env, "HSPEC_AUTO_PROFILE_SPS": "1"}
    fit = ["calibrate", "fit", "--data", str(w("notarecord.pt")), "--block-size", "7"]
    # profile-sps: --url reaches no server, so a flag that passed its check would fail on the connection instead
    sps_url = ["profile-sps", "--url", "http://127.0.0.1:9", "--out", str(w("sps_out.json"))]
    sps_engine = ["profile-sps", "--out", str(w("sps_out.json"))]
    simulate = ["simulate", "--out-dir", str(w("sim")), "--steps", "5"]

    return [
        # prompts and targets
        Row("prompts", "`--prompt` of blanks", [*gen[:1], "--prompt", "   "]),
        Row("prompts", "`--prompt-file` that does not exist", ["generate", "--prompt-file", str(w("missing.txt"))]),
        Row("prompts", "`--prompt-file` with blank lines only", ["generate", "--prompt-file", str(w("empty.txt"))]),
        Row("prompts", "`--prompt-file` JSONL with a broken line", ["generate", *tiny, "--prompt-file",
                                                                    str(w("bad_prompts.jsonl"))]),
        Row("prompts", "`--target` directory without config.json", [*gen, "--target", str(w("emptydir"))]),
        Row("prompts", "prompt + `--max-new-tokens` beyond the context", [*emb, "--drafter", "ngram",
                                                                           "--max-new-tokens", "100000"]),
        Row("prompts", "`--drafter` that is neither a name nor a directory", [*gen, *tiny, "--drafter", "eagle9"]),
        Row("prompts", "`--drafter` an empty directory", [*gen, *tiny, "--drafter", str(w("emptydir"))]),
        Row("prompts", "`--prompt-file` that is a directory", ["generate", "--prompt-file", str(w("emptydir"))]),
        Row("prompts", "`--prompt-file` that is not text", ["generate", "--prompt-file", str(w("binary.txt"))]),
        Row("prompts", "`--target tiny` (no tokenizer) for text generation", [*gen, "--target", "tiny"]),
        # sampling flags
        Row("sampling", "`--temperature -1`", [*gen, "--temperature", "-1"]),
        Row("sampling", "`--temperature nan`", [*gen, "--temperature", "nan"]),
        Row("sampling", "`--top-p 0`", [*gen, "--temperature", "1", "--top-p", "0"]),
        Row("sampling", "`--top-p 1.5`", [*gen, "--temperature", "1", "--top-p", "1.5"]),
        Row("sampling", "`--top-k -1`", [*gen, "--temperature", "1", "--top-k", "-1"]),
        Row("sampling", "`--top-p 0.9` with greedy decoding", [*gen, "--top-p", "0.9"]),
        Row("sampling", "`--top-k 5` with greedy decoding", [*gen, "--top-k", "5"]),
        Row("sampling", "`--max-new-tokens 0`", [*gen, "--max-new-tokens", "0"]),
        Row("sampling", "`--stop ''`", [*gen, "--stop", ""]),
        Row("sampling", "`--temperature abc`", [*gen, "--temperature", "abc"]),
        # speculation flags
        Row("speculation", "`--block-size 0` with the shipped drafter", [*gen, "--drafter", "shipped", "--block-size", "0"]),
        Row("speculation", "`--block-size 0` with the ngram drafter", [*gen, "--drafter", "ngram", "--block-size", "0"]),
        Row("speculation", "`--block-size 5` with the shipped drafter (trained for 7)", [*emb, "--drafter", "shipped",
                                                                                         "--block-size", "5"]),
        Row("speculation", "`--block-size 100000`", [*gen, "--drafter", "ngram", "--block-size", "100000"]),
        Row("speculation", "`--sps-table` that is a directory", [*gen, "--drafter", "shipped", "--policy", "stale",
                                                                  "--sps-table", str(w("emptydir"))]),
        Row("speculation", "`demo --json-out` under a file", ["demo", "--drafter", "ngram", "--json-out",
                                                               str(blocker / "rows.json")]),
        Row("speculation", "`--block-size` with `--drafter none`", [*gen, "--drafter", "none", "--block-size", "4"]),
        Row("speculation", "`--policy fixed --sps-table notjson.json`", [*gen, "--policy", "fixed", "--sps-table",
                                                                           str(w("notjson.json"))]),
        Row("speculation", "`--policy stale` without `--sps-table`", [*emb, "--drafter", "shipped", "--policy", "stale"]),
        Row("speculation", "`--policy stale` with the ngram drafter", [*gen, "--drafter", "ngram", "--policy", "stale"]),
        Row("speculation", "`--sts` with the ngram drafter", [*gen, "--drafter", "ngram", "--sts", str(w("sts_3_slots.json"))]),
        Row("speculation", "`--policy demo`", [*gen, "--policy", "demo"]),
        Row("speculation", "`demo --limit 0`", ["demo", "--limit", "0"]),
        Row("speculation", "`--tree 65` (more verify rows than a tree takes)", [*gen, "--tree", "65"]),
        Row("speculation", "`--tree -1`", [*gen, "--tree", "-1"]),
        Row("speculation", "`--tree` with `--drafter none`", [*gen, "--drafter", "none", "--tree", "4"]),
        Row("speculation", "`--tree` with `--policy auto`", [*gen, "--tree", "4", "--policy", "auto"]),
        Row("speculation", "`demo --tree 65`", ["demo", "--tree", "65"]),
        Row("speculation", "`eval --tree -1`", ["eval", "--tree", "-1"]),
        Row("sampling", "`eval --temperature nan`", ["eval", "--temperature", "0,nan"]),
        Row("speculation", "`--batch-invariant sometimes`", [*gen, "--batch-invariant", "sometimes"]),
        # SPS / STS artifacts
        Row("SPS / STS", "`--sps-table` that does not exist", [*gen, "--drafter", "shipped", "--policy", "stale",
                                                                "--sps-table", str(w("missing_sps.json"))]),
        Row("SPS / STS", "`--sps-table` that is not JSON", [*gen, "--drafter", "shipped", "--policy", "exact",
                                                             "--sps-table", str(w("notjson.json"))]),
        Row("SPS / STS", "`--sps-table` in another layout", [*gen, "--drafter", "shipped", "--policy", "stale",
                                                              "--sps-table", str(w("sps_wrong_layout.json"))]),
        Row("SPS / STS", "`--sps-table` with decreasing batch tokens", [*gen, "--drafter", "shipped", "--policy",
                                                                         "stale", "--sps-table",
                                                                         str(w("sps_decreasing.json"))]),
        Row("SPS / STS", "`--sts` that does not exist", [*gen, "--drafter", "shipped", "--sts", str(w("missing_sts.json"))]),
        Row("SPS / STS", "`--sts` that is not JSON", [*gen, "--drafter", "shipped", "--sts", str(w("notjson.json"))]),
        Row("SPS / STS", "`--sts` with a negative temperature", [*gen, "--drafter", "shipped", "--sts",
                                                                  str(w("sts_negative.json"))]),
        Row("SPS / STS", "`--sts` with an unknown field", [*gen, "--drafter", "shipped", "--sts",
                                                            str(w("sts_unknown_field.json"))]),
        Row("SPS / STS", "`--sts` fitted for 3 slots, drafter block 7", [*emb, "--drafter", "shipped", "--sts",
                                                                          str(w("sts_3_slots.json"))]),
        Row("SPS / STS", "`calibrate fit` on a glob that matches nothing", ["calibrate", "fit", "--data",
                                                                             str(w("nomatch") / "*.pt"), "--block-size",
                                                                             "7", "--out", str(w("sts.json"))]),
        Row("SPS / STS", "`calibrate fit` on a file that is not a record shard",
            ["calibrate", "fit", "--data", str(w("notarecord.pt")), "--block-size", "7", "--out", str(w("sts.json"))]),
        Row("SPS / STS", "`calibrate fit` without `--block-size`", ["calibrate", "fit", "--data",
                                                                     str(w("notarecord.pt")), "--out", str(w("sts.json"))]),
        Row("SPS / STS", "`calibrate fit --grid-min 0`", [*fit, "--out", str(w("sts.json")), "--grid-min", "0"]),
        Row("SPS / STS", "`calibrate fit --block-size 100000`", [*fit[:-1], "100000", "--out", str(w("sts.json"))]),
        Row("SPS / STS", "`calibrate fit --out` under a file", [*fit, "--out", str(blocker / "sts.json")]),
        Row("SPS / STS", "`calibrate synth --temperature -1`", ["calibrate", "synth", "--out-stem", str(w("synth")),
                                                                 "--kind", "overconfident", "--temperature", "-1"]),
        Row("SPS / STS", "`calibrate synth --seed -1`", ["calibrate", "synth", "--out-stem", str(w("synth")),
                                                          "--seed", "-1"]),
        Row("SPS / STS", "`calibrate report --sts notjson.json`", ["calibrate", "report", "--data",
                                                                    str(w("notarecord.pt")), "--sts", str(w("notjson.json"))]),
        # SPS profiling and the serving simulator
        Row("profile-sps", "`profile-sps --min-steady-steps 0`", [*sps_url, "--min-steady-steps", "0"]),
        Row("profile-sps", "`profile-sps --min-steady-seconds nan`", [*sps_url, "--min-steady-seconds", "nan"]),
        Row("profile-sps", "`profile-sps --min-steady-seconds inf`", [*sps_url, "--min-steady-seconds", "inf"]),
        Row("profile-sps", "`profile-sps --min-steady-seconds -1`", [*sps_url, "--min-steady-seconds", "-1"]),
        Row("profile-sps", "`profile-sps --round-timeout 0`", [*sps_url, "--round-timeout", "0"]),
        Row("profile-sps", "`profile-sps --round-timeout inf`", [*sps_url, "--round-timeout", "inf"]),
        Row("profile-sps", "`profile-sps --temperature nan`", [*sps_url, "--temperature", "nan"]),
        Row("profile-sps", "`profile-sps --input-len 0`", [*sps_url, "--input-len", "0"]),
        Row("profile-sps", "`profile-sps --batch-size 0`", [*sps_url, "--batch-size", "0"]),
        Row("profile-sps", "`profile-sps --out` a directory", ["profile-sps", "--url", "http://127.0.0.1:9", "--out",
                                                                str(w("emptydir"))]),
        Row("profile-sps", "`profile-sps --tokens-per-request 0`", [*sps_engine, "--tokens-per-request", "0"]),
        Row("profile-sps", "`profile-sps --max-batch-tokens -1`", [*sps_engine, "--max-batch-tokens", "-1"]),
        Row("profile-sps", "`profile-sps --warmup -1`", [*sps_engine, "--warmup", "-1"]),
        Row("profile-sps", "`profile-sps --repeats 0`", [*sps_engine, "--repeats", "0"]),
        Row("profile-sps", "`profile-sps --steps-per-repeat 0`", [*sps_engine, "--steps-per-repeat", "0"]),
        Row("profile-sps", "`profile-sps --batch-tokens ,` (no sizes)", [*sps_engine, "--batch-tokens", ","]),
        Row("profile-sps", "`profile-sps --plain-batch-sizes 0`", [*sps_engine, "--plain-batch-sizes", "0"]),
        Row("simulate", "`simulate --arrival-rate nan`", [*simulate, "--arrival-rate", "nan"]),
        Row("simulate", "`simulate --arrival-rate inf`", [*simulate, "--arrival-rate", "inf"]),
        Row("simulate", "`simulate --block-size -1`", [*simulate, "--block-size", "-1"]),
        Row("simulate", "`simulate --steps 0`", [*simulate, "--steps", "0"]),
        Row("simulate", "`simulate --threshold nan`", [*simulate, "--threshold", "nan"]),
        Row("simulate", "`simulate --concurrency 0`", [*simulate, "--concurrency", "0"]),
        Row("simulate", "`simulate --sps-table` a directory", [*simulate, "--sps-table", str(w("emptydir"))]),
        Row("simulate", "`simulate --out-dir` under a file", ["simulate", "--out-dir", str(blocker / "sim")]),
        # drafter checkpoints (damaged copies of the shipped drafter, on the embedded target)
        Row("checkpoint", "config.json truncated", [*emb, "--drafter", trunc_cfg]),
        Row("checkpoint", "config.json binary garbage", [*emb, "--drafter", binary_cfg]),
        Row("checkpoint", "model.safetensors truncated", [*emb, "--drafter", trunc_st]),
        Row("checkpoint", "model.safetensors missing", [*emb, "--drafter", no_weights]),
        Row("checkpoint", "model.safetensors without one tensor", [*emb, "--drafter", missing_tensor]),
        Row("checkpoint", "config says the target has 24 layers (it has 30)", [*emb, "--drafter", layers24]),
        Row("checkpoint", "config without its `hspec` section", [*emb, "--drafter", no_section]),
        Row("checkpoint", "config with DFlash's slot convention", [*emb, "--drafter", slot_conv]),
        Row("checkpoint", "config with an unknown field", [*emb, "--drafter", unknown_field]),
        Row("checkpoint", "the shipped drafter on another target", [*gen, *tiny, "--drafter", "shipped"]),
        Row("checkpoint", "config with `block_size: 100000`", [*emb, "--drafter", huge_block]),
        Row("checkpoint", "config with `intermediate_size: 1000000000`", [*emb, "--drafter", huge_mlp]),
        Row("checkpoint", "config with `markov_rank` above the draft vocabulary", [*emb, "--drafter", markov_rank]),
        Row("checkpoint", "config with `rms_norm_eps: 0`", [*emb, "--drafter", zero_eps]),
        Row("checkpoint", 'config with `confidence_head: "yes"`', [*emb, "--drafter", conf_yes]),
        Row("checkpoint", "config without `mask_token_id`", [*emb, "--drafter", no_mask]),
        Row("checkpoint", "config with `target_layer_ids: 3` (not a list)", [*emb, "--drafter", int_ids]),
        # training configs and records
        Row("training", "`train --config` that does not exist", ["train", "--config", str(w("missing.yaml"))]),
        Row("training", "`train --config` that is not YAML", ["train", "--config", str(w("bad.yaml"))]),
        Row("training", "an override without `=`", [*train, "training.lr"]),
        Row("training", "an override with an unknown key", [*train, "training.learning_rate=1e-3"]),
        Row("training", "`training.lr=-1`", [*train, "training.lr=-1"]),
        Row("training", "`training.betas=[0.9]`", [*train, "training.betas=[0.9]"]),
        Row("training", "`training.max_grad_norm=-1`", [*train, "training.max_grad_norm=-1"]),
        Row("training", "`training.gamma_decay=.nan`", [*train, "training.gamma_decay=.nan"]),
        Row("training", "`training.loss_chunk_rows=0`", [*train, "training.loss_chunk_rows=0"]),
        Row("training", "`model.block_size=100000`", [*train, "model.block_size=100000"]),
        Row("training", "`model.drafter.mamba_state_dim=100000`", [*train, "model.drafter.mamba_state_dim=100000"]),
        Row("training", "`data.synthetic.motif_len=0`", [*train, "data.synthetic.motif_len=0"]),
        Row("training", "`data.synthetic.vocab_high` beyond the target's vocabulary",
            [*train, "data.synthetic.vocab_high=1000", f"training.output_dir={scratch / 'run'}"]),
        Row("training", "`training.output_dir` under a file", [*train, f"training.output_dir={blocker / 'run'}"]),
        Row("training", "`data.train_path` that does not exist", [*jsonl_train, f"data.train_path={w('nope.jsonl')}"]),
        Row("training", "an empty JSONL", [*jsonl_train, f"data.train_path={w('empty.jsonl')}"]),
        Row("training", 'a JSONL line `{"foo": 1}`', [*jsonl_train, f"data.train_path={w('foo.jsonl')}"]),
        Row("training", "a JSONL line that is not JSON", [*jsonl_train, f"data.train_path={w('badline.jsonl')}"]),
        Row("training", "input_ids and loss_mask of different lengths", [*jsonl_train,
                                                                          f"data.train_path={w('masklen.jsonl')}"]),
        Row("training", "records without an assistant token", [*jsonl_train, f"data.train_path={w('noanchor.jsonl')}"]),
        Row("training", "`training.device=cuda` where no GPU is visible", [*train, "training.device=cuda",
                                                                               f"training.output_dir={scratch / 'run'}"]),
        Row("training", "`data regenerate --device cuda` where no GPU is visible",
            ["data", "regenerate", "--in", str(w("foo.jsonl")), "--out", str(w("regen")), "--device", "cuda"]),
        Row("training", "`data regenerate --eval-texts` naming no file",
            ["data", "regenerate", "--in", str(w("foo.jsonl")), "--out", str(w("regen")), "--eval-texts",
             str(w("nope.json"))]),
        Row("training", "`data regenerate --eval-texts` naming a JSONL of prompts instead",
            ["data", "regenerate", "--in", str(w("foo.jsonl")), "--out", str(w("regen")), "--eval-texts",
             str(w("foo.jsonl"))]),
        Row("training", "`data regenerate --out` under a file",
            ["data", "regenerate", "--in", str(w("convs.jsonl")), "--out", str(blocker / "regen")]),
        Row("training", "`data regenerate --server` at a port nothing listens on",
            ["data", "regenerate", "--in", str(w("convs.jsonl")), "--out", str(w("regen_dead")), "--server",
             "http://127.0.0.1:9", "--target", "embedded"]),
        Row("training", "`data regenerate --server` with an engine-only flag (`--dtype`)",
            ["data", "regenerate", "--in", str(w("convs.jsonl")), "--out", str(w("regen_dead")), "--server",
             "http://127.0.0.1:9", "--dtype", "bf16"]),
        Row("training", "`data regenerate --in` that does not exist",
            ["data", "regenerate", "--in", str(w("nope.jsonl")), "--out", str(w("regen_flags"))]),
        Row("training", "`data regenerate --batch-size 0`", [*regen, "--batch-size", "0"]),
        Row("training", "`data regenerate --max-turns 0`", [*regen, "--max-turns", "0"]),
        Row("training", "`data regenerate --max-new-tokens 0`", [*regen, "--max-new-tokens", "0"]),
        Row("training", "`data regenerate --slots 0`", [*regen, "--slots", "0"]),
        Row("training", "`data regenerate --max-prompt-tokens 0`", [*regen, "--max-prompt-tokens", "0"]),
        Row("training", "`data regenerate --heldout 2`", [*regen, "--heldout", "2"]),
        Row("training", "`data regenerate --threads 0`", [*regen, "--threads", "0"]),
        Row("training", "`data merge --out` naming a directory with no regenerate shards",
            ["data", "merge", "--out", str(w("regen"))]),
        Row("training", "`data build --out` under a file", [*build, "--out", str(blocker / "data")]),
        Row("training", "`data build --out /proc/x` (a virtual filesystem)", [*build, "--out", "/proc/x"]),
        Row("training", "`data build --heldout 2`", [*build, "--out", str(w("data_build")), "--heldout", "2"]),
        Row("training", "`data build --code-root` that does not exist",
            [*build, "--out", str(w("data_build")), "--code-root", str(w("nope"))]),
        Row("training", "`data build` with every source at 0",
            ["data", "build", "--out", str(w("data_build")), "--sharegpt", "0", "--code", "0"]),
        # packed data (hspec data pack / unpack)
        Row("packed data", "`data pack` without `--in`", ["data", "pack", "--out", str(w("packed_out"))]),
        Row("packed data", "`data pack --in` that does not exist",
            ["data", "pack", "--in", str(w("nope.jsonl")), "--out", str(w("packed_out"))]),
        Row("packed data", "`data pack --in` a file that is not JSONL",
            ["data", "pack", "--in", str(w("notjson.json")), "--out", str(w("packed_out"))]),
        Row("packed data", "`data pack --in` a binary file",
            ["data", "pack", "--in", str(w("binary.txt")), "--out", str(w("packed_out"))]),
        Row("packed data", "`data pack --in` a JSONL record without `id`",
            ["data", "pack", "--in", str(w("noid.jsonl")), "--out", str(w("packed_out"))]),
        Row("packed data", "`data pack --in` a JSONL whose messages are strings",
            ["data", "pack", "--in", str(w("badmsg.jsonl")), "--out", str(w("packed_out"))]),
        Row("packed data", "`data pack --in` an empty JSONL",
            ["data", "pack", "--in", str(w("empty.jsonl")), "--out", str(w("packed_out"))]),
        Row("packed data", "`data pack --out` under a file", [*pack, "--out", str(blocker / "packed")]),
        Row("packed data", "`data pack --out` holding a manifest of another format",
            [*pack, "--out", str(w("foreign"))]),
        Row("packed data", "`data pack --heldout 2`", [*pack, "--out", str(w("packed_out")), "--heldout", "2"]),
        Row("packed data", "`data pack --target tiny` (no tokenizer)",
            [*pack, "--out", str(w("packed_out")), "--target", "tiny"]),
        Row("packed data", "`data unpack --in` a packed set with a damaged shard", [*unpack, "--in", damaged_pack]),
        Row("packed data", "`data unpack --in` a manifest of another format", [*unpack, "--in", str(w("foreign"))]),
        Row("packed data", "`data unpack --in` a directory without a manifest", [*unpack, "--in", str(w("emptydir"))]),
        Row("packed data", "`data unpack --in` a JSONL file (not a packed directory)",
            [*unpack, "--in", str(w("convs.jsonl"))]),
        Row("packed data", "`data unpack --out` under a file",
            ["data", "unpack", "--in", packed_dir, "--out", str(blocker / "unpacked")]),
        Row("packed data", "`data unpack --target tiny` (no tokenizer)", [*unpack, "--in", packed_dir, "--target",
                                                                          "tiny"]),
        # environment variables
        Row("environment", "`HSPEC_TRAIN_THREADS=abc`", [*train, f"training.output_dir={scratch / 'run'}"],
            env={"HSPEC_TRAIN_THREADS": "abc"}),
        Row("environment", "`HSPEC_MAMBA_SCAN=bogus`", [*emb, "--drafter", "shipped", "--max-new-tokens", "2"],
            env={"HSPEC_MAMBA_SCAN": "bogus"}),
        Row("environment", "`HSPEC_CACHE_DIR` naming a file (where the embedded target is converted)",
            call=cache_dir_row, env={"HSPEC_CACHE_DIR": str(blocker)}),
        Row("environment", "`HSPEC_AUTO_PROFILE_SPS=yes1` (a typo, not read as off)", call=sps_table_row,
            env={**sps_env, "HSPEC_AUTO_PROFILE_SPS": "yes1"}),
        Row("environment", "`HSPEC_SPS_PROFILING_SERVER=yes1`", call=sps_table_row,
            env={**sps_env, "HSPEC_SPS_PROFILING_SERVER": "yes1"}),
        Row("environment", "`HSPEC_AUTO_PROFILE_SPS_STEADY_SECONDS=nan`", call=sps_table_row,
            env={**auto_env, "HSPEC_AUTO_PROFILE_SPS_STEADY_SECONDS": "nan"}),
        Row("environment", "`HSPEC_AUTO_PROFILE_SPS_STEADY_SECONDS=inf`", call=sps_table_row,
            env={**auto_env, "HSPEC_AUTO_PROFILE_SPS_STEADY_SECONDS": "inf"}),
        Row("environment", "`HSPEC_AUTO_PROFILE_SPS_STEADY_STEPS=0`", call=sps_table_row,
            env={**auto_env, "HSPEC_AUTO_PROFILE_SPS_STEADY_STEPS": "0"}),
        Row("environment", "`HSPEC_LOOKUP=yes1`", call=lookup_row, env={"HSPEC_LOOKUP": "yes1"}),
        Row("environment", "`HSPEC_SPECULATION=sometimes` (server-argument validation)", call=validate_row,
            env={"HSPEC_SPECULATION": "sometimes"}),
        Row("environment", "`HSPEC_SPECULATION_GUARD=yes` (read by the worker; checked at validation)",
            call=validate_row, env={"HSPEC_SPECULATION_GUARD": "yes"}),
        Row("environment", "`HSPEC_PLAIN_STEP_FORWARD=decode` (read by the worker; checked at validation)",
            call=validate_row, env={"HSPEC_PLAIN_STEP_FORWARD": "decode"}),
        Row("environment", "`HSPEC_AUTO_PROFILE_SPS_BATCH_SIZES=0,1` (server-argument validation)", call=validate_row,
            env={"HSPEC_AUTO_PROFILE_SPS_BATCH_SIZES": "0,1"}),
        Row("environment", "`HSPEC_AUTO_PROFILE_SPS_STEADY_SECONDS=nan` (server-argument validation)",
            call=validate_row, env={"HSPEC_AUTO_PROFILE_SPS_STEADY_SECONDS": "nan"}),
        Row("environment", "`HSPEC_STEP_PROFILE` a directory (server-argument validation)", call=validate_row,
            env={"HSPEC_STEP_PROFILE": str(w("emptydir"))}),
        Row("server arguments", "`--speculative-dspark-sps-table-path` a directory",
            call=functools.partial(sps_table_row, table=str(w("emptydir"))), env=sps_env),
        Row("environment", "`HSPEC_STEP_PROFILE` under a file (checked at startup, not on every step)",
            call=step_profile_row, env={"HSPEC_STEP_PROFILE": str(blocker / "steps.json")}),
        # artifacts on a full disk (library calls: the disk is made to fail in-process)
        Row("artifacts", "`save_drafter` on a full disk", call=functools.partial(full_disk_save_drafter, scratch)),
        Row("artifacts", "`build_dataset` (data shards) on a full disk",
            call=functools.partial(full_disk_build_dataset, scratch)),
    ]


def cache_dir_row() -> None:
    from sglang_hspec.assets.embedded import default_cache_dir

    default_cache_dir()


def sps_table_row(table: str | None = None) -> None:
    """What the launcher runs (server_args.py handle_server_args) to pick an HSPEC server's SPS table."""
    from types import SimpleNamespace

    from sglang_hspec.sglang_plugin.sps_cache import resolve_sps_table

    args = SimpleNamespace(model_path="target", speculative_draft_model_path="drafter", tp_size=1, dtype="auto",
                           device="cpu", base_gpu_id=0, speculative_dspark_sps_table_path=table)
    resolve_sps_table(args, block_size=7)


def validate_row() -> None:
    """SGLang's server-argument validation of an HSPEC launch (server_args.py validate_server_args), the shipped
    drafter on the embedded target's name: the environment is checked before either is read."""
    from types import SimpleNamespace

    from sglang_hspec.sglang_plugin.server_args import validate_server_args

    validate_server_args(SimpleNamespace(model_path="embedded", speculative_draft_model_path=str(SHIPPED)))


def lookup_row() -> None:
    from sglang_hspec.sglang_plugin.lookup_splice import lookup_enabled

    lookup_enabled()


def step_profile_row() -> None:
    """The launcher's check (server_args.py validate_server_args) and the worker's StepTimer.from_env."""
    from sglang_hspec.sglang_plugin.step_timer import step_profile_path

    step_profile_path()


def packed_sets(scratch: Path) -> tuple[str, str]:
    """A packed set of two conversations, and a copy with one byte of its shard flipped."""
    from sglang_hspec.target.loading import load_tokenizer
    from sglang_hspec.training.packed import pack

    src = scratch / "pack_src.jsonl"
    src.write_text("".join(json.dumps({"id": f"c{i}", "conversations": [
        {"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": f"answer {i}"}]}) + "\n"
        for i in range(2)))
    good = scratch / "packed"
    pack(in_path=src, out_dir=good, tokenizer=load_tokenizer("embedded"), target="embedded", progress=False)
    damaged = scratch / "packed_damaged"
    shutil.copytree(good, damaged)
    shard = damaged / "000000.npz"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    return str(good), str(damaged)


def full_disk_save_drafter(scratch: Path) -> None:
    from sglang_hspec.assets.tiny import tiny_target
    from sglang_hspec.model import HSpecConfig, build_drafter, save_drafter
    from sglang_hspec.target.geometry import TargetGeometry

    target = tiny_target("llama", num_layers=5, hidden_size=32, num_heads=2, num_kv_heads=1, head_dim=16)
    cfg = HSpecConfig(target=TargetGeometry.from_hf_config(target.config), target_layer_ids=(0, 1, 2, 3, 4),
                      mask_token_id=3, intermediate_size=32, mamba_num_heads=2, mamba_head_dim=8, mamba_groups=1,
                      draft_vocab_size=64, markov_rank=16)  # a rank the 64-token draft vocabulary holds
    drafter = build_drafter("hspec", cfg, target.model.embed_tokens, target.lm_head)
    out = scratch / "run" / "drafter"
    save_drafter(drafter, out)
    with disk_full_after(10_000):
        save_drafter(drafter, out)


def full_disk_build_dataset(scratch: Path) -> None:
    from sglang_hspec.training.data import build_dataset

    recs = [{"id": f"r{i}", "conversations": [{"role": "user", "content": f"q {i}"},
                                              {"role": "assistant", "content": f"a {i} " * 50}]} for i in range(200)]
    with disk_full_after(5_000):
        build_dataset(records=recs, out_dir=scratch / "data")


# ------------------------------------------------------------------ table


def markdown(results: list[tuple[Row, Outcome]], scratch: Path) -> str:
    def show(text: str) -> str:
        text = text.replace(str(scratch), "$SCRATCH").replace(str(ROOT) + "/", "")
        text = text.replace(str(Path.home()), "~").replace("|", "\\|")
        return text

    lines = [
        "# Bad inputs and what the user sees",
        "",
        "Generated by `scripts/bad_inputs.py` (do not edit by hand): every bad input we know of, run through",
        "`hspec`'s own entry point (or the library call it reaches), with the first line of the error. `$SCRATCH`",
        "is the script's scratch directory (damaged copies of the shipped drafter, broken files). A row is",
        "clear when the command fails with an `error:` line, no traceback.",
        "",
        "| # | area | input | what the user sees | exit | clear |",
        "|---|---|---|---|---|---|",
    ]
    for i, (row, out) in enumerate(results, 1):
        env = "".join(f"{k}={v} " for k, v in (row.env or {}).items())
        cmd = (f"<br>`{show(env)}(library call)`" if env else "") if row.command is None else \
            f"<br>`{show(env)}hspec {show(' '.join(a if a.strip() else repr(a) for a in row.command))}`"
        lines.append(f"| {i} | {row.group} | {show(row.what)}{cmd} | {show(out.line)} | {out.exit_code} | "
                     f"{'yes' if clear(out) else '**no**'} |")
    n_clear = sum(clear(o) for _, o in results)
    lines += ["", f"{n_clear} of {len(results)} rows clear.", ""]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="print the table; do not write docs/bad_inputs.md")
    args = parser.parse_args()
    torch.set_num_threads(1)

    import sglang_hspec.target.loading as target_loading
    from sglang_hspec.assets.tiny import save_tiny_target

    real_load, cached = target_loading.load_target, {}

    def load_once(spec="embedded", **kw):  # the trainer passes unhashable kwargs: those load afresh
        try:
            key = (spec, tuple(sorted(kw.items())))
            hash(key)
        except TypeError:
            return real_load(spec, **kw)
        if key not in cached:
            cached[key] = real_load(spec, **kw)
        return cached[key]

    target_loading.load_target = load_once
    with tempfile.TemporaryDirectory(prefix="hspec-bad-inputs-") as tmp:
        scratch = Path(tmp)
        tiny_dir = str(save_tiny_target(scratch / "tiny_target", dtype=torch.float32))
        results = [(row, run_row(row)) for row in tqdm(rows(scratch, tiny_dir), desc="bad inputs", unit="input")]
        table = markdown(results, scratch)
    if args.check:
        print(table)
    else:
        from sglang_hspec.core.atomic import atomic_write_text

        atomic_write_text(DOC, table)
        print(f"wrote {DOC.relative_to(ROOT)}: {len(results)} rows")
    unclear = [(r, o) for r, o in results if not clear(o)]
    for r, o in unclear:
        print(f"UNCLEAR: {r.what}: {o.line}", file=sys.stderr)
    return 1 if unclear else 0


if __name__ == "__main__":
    raise SystemExit(main())
