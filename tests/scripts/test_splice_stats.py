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
