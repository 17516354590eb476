"""scripts/splice_stats.py: per-slot acceptance of spliced and drafter-only blocks, hand-computed."""

from __future__ import annotations

import pytest


def test_block_stats_split_spliced_from_drafter_blocks(load_script):
    stats = load_script("splice_stats").block_stats([(True, 3), (True, 0), (False, 1)], block_size=3)
    # spliced: kept 3 and 0 drafts -> slot 1 tried twice, kept once; slots 2, 3 tried and kept once
    assert stats["spliced"]["steps"] == 2
    assert stats["spliced"]["tau"] == pytest.approx((3 + 0 + 2) / 2)
    assert stats["spliced"]["slot_attempts"] == [2, 1, 1] and stats["spliced"]["slot_accepts"] == [1, 1, 1]
    assert stats["spliced"]["alpha"] == [0.5, 1.0, 1.0]
    # the drafter's own block: slot 1 kept, slot 2 rejected, slot 3 never verified
    assert stats["drafter"]["tau"] == 2.0
    assert stats["drafter"]["alpha"] == [1.0, 0.0, None]


def test_block_stats_without_spliced_steps(load_script):
    stats = load_script("splice_stats").block_stats([(False, 0)], block_size=2)
    assert stats["spliced"] == {"steps": 0, "tau": None, "alpha": [None, None], "slot_attempts": [0, 0],
                                "slot_accepts": [0, 0]}


def test_main_on_the_embedded_target_accounts_for_every_step(load_script, embedded_dir, tmp_path):
    """The shipped drafter + lookup on two GSM8K prompts: every verify step lands in one of the two kinds, and
    their accepted tokens add up to the replies' lengths."""
    import json

    out = tmp_path / "stats.json"
    assert load_script("splice_stats").main(["--datasets", "gsm8k", "--limit", "2", "--max-new-tokens", "24",
                                             "--out", str(out)]) == 0
    stats = json.loads(out.read_text())
    steps = stats["spliced"]["steps"] + stats["drafter"]["steps"]
    tokens = sum(stats[k]["tau"] * stats[k]["steps"] for k in ("spliced", "drafter") if stats[k]["steps"])
    # each reply: token 1 from the prefill, then verify steps up to 24 tokens (the last step may overshoot
    # max_new_tokens by at most its 7 drafts and is cut)
    assert steps > 0 and 2 * 23 <= round(tokens) <= 2 * (23 + 7)
    for kind in ("spliced", "drafter"):
        assert stats[kind]["slot_attempts"][0] == stats[kind]["steps"]
        assert all(a is None or 0.0 <= a <= 1.0 for a in stats[kind]["alpha"])
    assert stats["drafter_spec"] == "shipped" and stats["lookup_confidence"] == 0.8
