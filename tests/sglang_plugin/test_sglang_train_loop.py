"""The whole loop a user with their own target runs (docs/serving.md, "Serve your own target"), on the SGLang CPU
tier: a plain SGLang server regenerates conversations (`hspec data regenerate --server`), `hspec train` trains an
H-Spec drafter on them for a few steps, and an HSPEC server with that drafter gives, greedy in float32, the plain
server's tokens and the very replies the data holds.

The target is a 6-layer variant of the tiny Qwen3 (tests/sglang_cpu/builders.py): the trainer wants five distinct
captured layers, and SGLang never captures the last one."""

from __future__ import annotations

import json

import pytest

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

PLUGINS = ("sglang_cpu_testing", "hspec")
SPAWN = {"SGLANG_CPU_TESTING_FORK": "0"}  # the HSPEC server's children load both plugins, as on GPU
MAX_NEW = 24
TARGET_LAYERS = 6


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """The tiny Qwen3 geometry (hidden 128, 4 q / 2 KV heads of 32, vocabulary 1024) with 6 layers, float32."""
    import torch
    from sglang_cpu import builders
    from transformers import AutoModelForCausalLM

    def build(tmp):
        cfg = builders.tiny_qwen3_config(num_hidden_layers=TARGET_LAYERS)
        cfg.initializer_range = 0.2  # peaked next-token distributions: no greedy near-ties (builders.py)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        model.save_pretrained(tmp)
        builders.build_tokenizer(tmp)

    return builders._atomic_dir(tmp_path_factory.mktemp("loop") / "target", build)


def _conversations():
    from sglang_cpu import builders

    convs = [{"id": f"p{i}", "conversations": [{"role": "user", "content": p}, {"role": "assistant", "content": "x"}]}
             for i, p in enumerate(builders.PROMPTS)]
    convs.append({"id": "two_turns", "conversations": [
        {"role": "user", "content": "def add(a, b):"}, {"role": "assistant", "content": "x"},
        {"role": "user", "content": "now subtract"}, {"role": "assistant", "content": "x"}]})
    return convs


def _train_config(path, *, target, train_path, output_dir):
    config = {
        "model": {"kind": "hspec", "target": str(target), "target_dtype": "fp32", "block_size": 3,
                  # captured as SGLang layer ids 1..5: the inputs of layers 1..5, never the last layer's output
                  "target_layer_ids": [0, 1, 2, 3, 4], "kv_layer_ids": [2, 3, 4],
                  "drafter": {"mask_token_id": 1023, "intermediate_size": 256, "mamba_num_heads": 4,
                              "mamba_head_dim": 16, "mamba_groups": 2, "markov_rank": 16, "draft_vocab_size": 512,
                              "sliding_window": 64}},
        "data": {"train_path": str(train_path), "max_length": 128, "num_anchors": 8, "batch_size": 2,
                 "tokenized_cache": False},
        "training": {"max_steps": 4, "lr": 3.0e-3, "warmup_ratio": 0.0, "bf16": False, "seed": 0,
                     "output_dir": str(output_dir), "log_every": 1},
    }
    path.write_text(json.dumps(config))  # YAML is a superset of JSON
    return path


def test_regenerate_train_and_serve_own_target(target, sglang_server, tmp_path, capsys):
    from sglang_cpu import builders

    from sglang_hspec.cli import main as hspec_main
    from sglang_hspec.training.data import read_jsonl

    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(c) + "\n" for c in _conversations()))
    regen = tmp_path / "regen"

    plain = sglang_server(target, name="plain")
    plain_ids = [o["output_ids"] for o in plain.generate(builders.PROMPTS, MAX_NEW)]
    capsys.readouterr()
    assert hspec_main(["data", "regenerate", "--in", str(src), "--out", str(regen), "--server", plain.url,
                       "--max-turns", "2", "--max-new-tokens", str(MAX_NEW), "--heldout", "0", "--concurrency", "4",
                       "--loops", "drop"]) == 0
    stats = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    with capsys.disabled():
        print(f"\nregenerate through the plain CPU server: {stats['this_run_generated_tokens']} tokens in "
              f"{stats['this_run_seconds']:.2f} s = {stats['this_run_tokens_per_second']:.0f} tok/s")
    plain.stop()  # one server at a time on the 2-core machine
    rows = {r["id"]: r["conversations"] for r in read_jsonl(regen / "train.jsonl")}
    assert stats["input"] == 7 and stats["failed"] == 0 and stats["succeeded"] == len(rows) >= 4, stats
    run = json.loads((regen / "runs.jsonl").read_text())
    assert run["settings"]["server"] == plain.url and run["settings"]["server_model"] == str(target)

    config = _train_config(tmp_path / "train.yaml", target=target, train_path=regen / "train.jsonl",
                           output_dir=tmp_path / "run")
    assert hspec_main(["train", "--config", str(config)]) == 0
    drafter = tmp_path / "run" / "checkpoint-4" / "drafter"
    assert (drafter / "config.json").is_file() and (drafter / "model.safetensors").is_file()
    log = [json.loads(line) for line in (tmp_path / "run" / "train_log.jsonl").read_text().splitlines()]
    assert [m["step"] for m in log] == [1, 2, 3, 4] and all(m["tokens"] > 0 for m in log)

    hspec = sglang_server(target, name="hspec", plugins=PLUGINS, env_extra=SPAWN,
                          args=["--speculative-algorithm", "HSPEC", "--speculative-draft-model-path", str(drafter)])
    outs = hspec.generate(builders.PROMPTS, MAX_NEW)
    assert [o["output_ids"] for o in outs] == plain_ids
    assert all(o["meta_info"].get("spec_accept_length") is not None for o in outs)  # it did speculate
    assert "HSpecDraftModel" in hspec.log()
    # the first turns the data holds are the HSPEC server's own greedy chat replies
    for conv in rows.values():
        answer = hspec.post("/v1/chat/completions", {"model": str(target), "messages": conv[:1],
                                                     "max_tokens": MAX_NEW, "temperature": 0})
        assert answer["choices"][0]["message"]["content"].strip() == conv[1]["content"]
