"""`hspec eval` end to end on a tiny saved target + tiny tokenizer and a random H-Spec drafter checkpoint."""

import json
import math
import statistics
from collections import Counter

import pytest
import torch
from sglang_hspec.calibration.records import load_records

from sglang_hspec.assets.tiny import save_tiny_target, tiny_tokenizer
from sglang_hspec.cli import main
from sglang_hspec.model import HSpecConfig, build_drafter, save_drafter
from sglang_hspec.target.geometry import TargetGeometry
from sglang_hspec.training.eval import distinct_labels, parse_temperatures, pooled_tau, pooled_tau_interval

PROMPTS = [
    {"id": "a1", "turns": ["def add(a, b):", "and now subtract"], "dataset": "code"},
    {"id": "a2", "turns": ["import os\nimport sys\n"], "dataset": "code"},
    {"id": "a3", "turns": ["class Foo:"], "dataset": "code"},  # past --limit 2
    {"id": "b1", "turns": ["Tell me about the weather in a long sentence."], "dataset": "chat"},
    {"id": "b2", "turns": ["for i in range(10): print(i)"], "dataset": "chat"},
]
K = 4


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval")
    target_dir = save_tiny_target(root / "target", "llama", dtype=torch.float32, tokenizer=tiny_tokenizer(),
                                  num_layers=6, hidden_size=64, head_dim=16, intermediate_size=128)
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    cfg = HSpecConfig(target=TargetGeometry.from_hf_config(target.config), target_layer_ids=(0, 1, 2, 3, 5),
                      mask_token_id=3, intermediate_size=96, block_size=K, mamba_num_heads=4, mamba_head_dim=8,
                      mamba_groups=2, fusion_rank=32, markov_rank=16, draft_vocab_size=512)
    torch.manual_seed(0)
    drafter = build_drafter("hspec", cfg, target.model.embed_tokens, target.lm_head)
    save_drafter(drafter, root / "drafter")
    save_drafter(build_drafter("dspark", cfg, target.model.embed_tokens, target.lm_head), root / "dspark")
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    return root, target_dir


def test_eval_writes_consistent_json_markdown_png_and_records(setup):
    root, target_dir = setup
    out, md, png, rec = root / "r.json", root / "r.md", root / "h.png", root / "conf"
    rc = main(["eval", "--target", str(target_dir), "--dtype", "fp32", "--drafter", str(root / "drafter"),
               "--prompts", str(root / "prompts.jsonl"), "--limit", "2", "--max-new-tokens", "10",
               "--temperature", "0", "--temperature", "1", "--out", str(out), "--markdown", str(md),
               "--plot", str(png), "--record-confidence", str(rec), "--no-progress"])
    assert rc == 0
    payload = json.loads(out.read_text())
    assert payload["block_size"] == K and payload["temperatures"] == [0.0, 1.0]
    cells = [(r["dataset"], r["temperature"]) for r in payload["results"]]
    assert cells == [("code", 0.0), ("chat", 0.0), ("code", 1.0), ("chat", 1.0)]
    reqs = payload["requests"]
    assert [r["id"] for r in reqs] == ["a1", "a2", "b1", "b2"] * 2
    table = md.read_text()
    for r in payload["results"]:
        mine = [q for q in reqs if (q["dataset"], q["temperature"]) == (r["dataset"], r["temperature"])]
        assert r["prompts"] == len(mine) == 2
        steps = sum(q["num_steps"] for q in mine)
        lengths = [a for q in mine for a in q["accept_lengths"]]
        assert r["steps"] == steps and r["tau"] == pytest.approx(sum(lengths) / steps)
        for j in range(K):
            attempts = sum(q["slot_attempts"][j] for q in mine)
            accepts = sum(q["slot_accepts"][j] for q in mine)
            assert r["alpha"][j] == (pytest.approx(accepts / attempts) if attempts else None)
        assert r["slot_attempts"][0] == sum(1 for q in mine for v in q["verify_lengths"] if v > 0)
        assert r["accept_length_histogram"] == {str(a): Counter(lengths)[a] for a in range(1, K + 2)}
        assert r["speedup"] > 0
        assert r["identical_to_plain"] is (True if r["temperature"] == 0 else None)
        assert f"| {r['dataset']} | {r['temperature']:g} | 2 | {r['tau']:.2f} |" in table
    for t in (0.0, 1.0):  # the pooled tau over both datasets, with its bootstrap interval
        assert f"Pooled over 4 prompts at T = {t:g}: tau {pooled_tau(payload, t):.3f}, 95 % interval " in table
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # one shard stem per (dataset, temperature); every verify with >= 1 draft is one record row
    records = load_records(data=str(rec))
    assert records.block_size == K and len(payload["confidence_shards"]) == 4
    steps = [(a, v) for q in reqs for a, v in zip(q["accept_lengths"], q["verify_lengths"]) if v > 0]
    assert records.num_samples == len(steps)
    assert int(records.prefix_mask.sum()) == sum(a - 1 for a, _ in steps)
    if records.observed_mask is None:  # shards omit the mask when every slot was verified
        assert all(v == K for _, v in steps)
    else:
        assert int(records.observed_mask.sum()) == sum(v for _, v in steps)


def test_eval_compare_shares_prompts_and_reports_the_ratio_to_dspark(setup):
    root, target_dir = setup
    base = ["eval", "--target", str(target_dir), "--dtype", "fp32", "--prompts", str(root / "prompts.jsonl"),
            "--limit", "2", "--max-new-tokens", "10", "--temperature", "0,1", "--no-progress"]
    both, alpha_png, md = root / "both.json", root / "alpha.png", root / "both.md"
    assert main([*base, "--drafter", str(root / "drafter"), "--compare", str(root / "dspark"), "--out", str(both),
                 "--markdown", str(md), "--alpha-plot", str(alpha_png)]) == 0
    runs = json.loads(both.read_text())["runs"]
    assert [r["drafter"] for r in runs] == ["hspec", "dspark"]
    # each drafter's numbers are what it gets evaluated alone (per-request seeds, deterministic target)
    for name, run in zip(["drafter", "dspark"], runs):
        alone = root / f"{name}_alone.json"
        assert main([*base, "--drafter", str(root / name), "--out", str(alone)]) == 0
        solo = json.loads(alone.read_text())
        strip = ("plain_seconds", "spec_seconds", "prefill_seconds", "wall_seconds")
        assert [{k: v for k, v in q.items() if k not in strip} for q in run["requests"]] == \
               [{k: v for k, v in q.items() if k not in strip} for q in solo["requests"]]
    table = md.read_text()
    for t in (0.0, 1.0):
        h, d = pooled_tau(runs[0], t), pooled_tau(runs[1], t)
        steps = [q for q in runs[0]["requests"] if q["temperature"] == t]
        assert h == pytest.approx(sum(sum(q["accept_lengths"]) for q in steps) / sum(q["num_steps"] for q in steps))
        assert f"| all (pooled) | {t:g} | {h:.2f} | {d:.2f} | - | - | {h / d:.3f} |" in table
        # the paired row: dspark's per-prompt tau minus hspec's on the same prompts, by statistics' formulas
        per_prompt = [{(q["dataset"], q["id"]): q["tau"] for q in run["requests"] if q["temperature"] == t}
                      for run in runs]
        diffs = [per_prompt[1][key] - per_prompt[0][key] for key in sorted(per_prompt[0])]
        se = statistics.stdev(diffs) / math.sqrt(len(diffs))
        counts = f"{sum(x > 0 for x in diffs)} / {sum(x < 0 for x in diffs)} / {sum(x == 0 for x in diffs)}"
        assert f"| dspark | {t:g} | {len(diffs)} | {statistics.mean(diffs):+.3f} | {se:.3f} | {counts} |" in table
    assert "Paired per prompt against hspec" in table
    assert alpha_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_eval_bad_inputs(setup, capsys):
    root, target_dir = setup
    base = ["eval", "--target", str(target_dir), "--dtype", "fp32", "--prompts", str(root / "prompts.jsonl"),
            "--no-progress", "--max-new-tokens", "4"]
    assert main([*base, "--drafter", "ngram", "--record-confidence", str(root / "x")]) == 2
    assert "confidence head" in capsys.readouterr().err
    assert main([*base, "--drafter", "ngram", "--temperature", "0,hot"]) == 2
    assert "--temperature 'hot'" in capsys.readouterr().err
    assert main(["eval", "--prompts", str(root / "missing.jsonl")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main([*base, "--drafter", "ngram", "--alpha-plot", str(root / "a.png")]) == 2
    assert "--compare" in capsys.readouterr().err
    assert main([*base, "--drafter", "ngram", "--compare", "ngram"]) == 2
    assert "the same drafter is given twice" in capsys.readouterr().err
    drafter = str(root / "drafter")
    assert main([*base, "--drafter", drafter + "+lookup", "--record-confidence", str(root / "x")]) == 2
    assert f"record with --drafter {drafter} (the drafter alone)" in capsys.readouterr().err
    assert not (root / "x").exists()
    assert main([*base, "--drafter", "ngram+lookup"]) == 2
    assert "splices lookup into a learned drafter" in capsys.readouterr().err


def test_eval_splices_lookup_into_a_drafter_losslessly(setup):
    """`<drafter>+lookup` on the tiny target: every greedy output identical to plain decoding, labelled
    hspec+lookup."""
    root, target_dir = setup
    out = root / "lookup.json"
    assert main(["eval", "--target", str(target_dir), "--dtype", "fp32", "--prompts", str(root / "prompts.jsonl"),
                 "--no-progress", "--max-new-tokens", "12", "--temperature", "0", "--drafter",
                 str(root / "drafter") + "+lookup", "--out", str(out)]) == 0
    run = json.loads(out.read_text())
    assert run["drafter"] == "hspec+lookup"
    assert all(r["identical_to_plain"] for r in run["results"])


def test_distinct_labels_number_repeated_kinds():
    assert distinct_labels(["hspec", "dspark"]) == ["hspec", "dspark"]
    assert distinct_labels(["hspec", "dspark", "hspec"]) == ["hspec-1", "dspark", "hspec-2"]


def test_parse_temperatures():
    assert parse_temperatures(None) == [0.0, 1.0]
    assert parse_temperatures(["0", "0.7,1", "1"]) == [0.0, 0.7, 1.0]
    for bad in ("-1", "nan", "inf"):
        with pytest.raises(ValueError, match=rf"^--temperature {bad} is not a finite number >= 0; use 0 for greedy"):
            parse_temperatures(["0", bad])


def _payload(name, taus, temperature=0.0):
    return {"drafter": name, "requests": [{"dataset": d, "id": i, "temperature": temperature, "tau": t}
                                          for (d, i), t in taus.items()]}


def test_paired_tau_difference_by_hand():
    from sglang_hspec.training.eval import paired_tau_difference

    base = _payload("old", {("gsm8k", "a"): 2.0, ("gsm8k", "b"): 1.5, ("mbpp", "a"): 1.0, ("mbpp", "b"): 3.0})
    new = _payload("new", {("gsm8k", "a"): 2.5, ("gsm8k", "b"): 1.5, ("mbpp", "a"): 1.5, ("mbpp", "b"): 2.0})
    # differences +0.5, 0, +0.5, -1.0 (same id in two datasets stays two prompts): mean 0, sample variance
    # (0.25 + 0 + 0.25 + 1) / 3 = 0.5, SE sqrt(0.5 / 4)
    d = paired_tau_difference(base, new, 0.0)
    assert d["n"] == 4 and d["mean"] == pytest.approx(0.0) and d["se"] == pytest.approx((0.5 / 4) ** 0.5)
    assert (d["up"], d["down"], d["same"]) == (2, 1, 1)
    # other temperatures are not mixed in; a prompt missing on one side is an error, not a silent drop
    assert paired_tau_difference(base, new, 1.0)["n"] == 0
    with pytest.raises(ValueError, match="different prompts"):
        paired_tau_difference(base, _payload("short", {("gsm8k", "a"): 2.0}), 0.0)


def _requests(rows):
    """(dataset, [accept lengths]) -> eval request records at T = 0."""
    return {"requests": [{"dataset": d, "temperature": 0.0, "accept_lengths": a, "num_steps": len(a)} for d, a in rows]}


def test_pooled_tau_interval_by_hand():
    # one dataset, two prompts of tau 1 and 3 (one step each): a draw of two prompts pools to 1, 2 or 3 with
    # probabilities 1/4, 1/2, 1/4, so the 2.5 % and 97.5 % points of 2,000 draws are 1 and 3
    assert pooled_tau_interval(_requests([("a", [1]), ("a", [3])]), 0.0) == (1.0, 3.0)
    # identical prompts: no spread to resample
    assert pooled_tau_interval(_requests([("a", [2, 2]), ("a", [2, 2]), ("a", [2, 2])]), 0.0) == (2.0, 2.0)
    # within-dataset resampling: two sets that differ from each other but not inside keep the pooled 2.0 exactly
    # (resampling prompts across sets would draw 1.0 to 3.0)
    rows = [("a", [1])] * 5 + [("b", [3])] * 5
    assert pooled_tau_interval(_requests(rows), 0.0) == (2.0, 2.0)
    assert pooled_tau_interval(_requests([("a", [2])]), 0.0) is None  # one prompt: no interval
    assert pooled_tau_interval(_requests(rows), 1.0) is None  # no prompt at that temperature


def test_pooled_tau_interval_covers_a_known_mean():
    """Coverage with a fixed seed: prompts whose per-step accept lengths are iid uniform on 1..3 (mean 2). Over 40
    seeded sets of 30 prompts the 95 % interval should cover 2.0 in about 38; fewer than 33 has probability
    < 0.2 % for a correct 95 % interval (binomial), so the test catches an interval that is far too narrow."""
    rng = torch.Generator().manual_seed(0)
    covered = 0
    for trial in range(40):
        rows = [("a" if i % 2 else "b", (torch.randint(1, 4, (8,), generator=rng)).tolist()) for i in range(30)]
        lo, hi = pooled_tau_interval(_requests(rows), 0.0, resamples=500, seed=trial)
        covered += lo <= 2.0 <= hi
    assert covered >= 33
