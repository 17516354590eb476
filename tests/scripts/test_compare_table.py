"""scripts/compare_table.py --paired: rows named by file, differences from the first run."""

from __future__ import annotations

import json


def _run(taus):
    results = [{"dataset": "gsm8k", "temperature": 0.0, "prompts": 2, "tau": sum(taus) / 2, "speedup": 1.0,
                "steps": 2, "slot_accepts": [0] * 7, "slot_attempts": [0] * 7}]
    requests = [{"dataset": "gsm8k", "id": str(i), "temperature": 0.0, "tau": t} for i, t in enumerate(taus)]
    return {"drafter": "hspec", "block_size": 7, "max_new_tokens": 8, "temperatures": [0.0],
            "results": results, "requests": requests}


def test_paired_rows_name_files_and_differ_from_the_first(load_script, tmp_path):
    compare = load_script("compare_table")
    paths = []
    for name, taus in (("old", [1.0, 2.0]), ("new", [1.5, 2.5])):
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(_run(taus)))
    table = compare.paired_table(compare.load_runs([str(p) for p in paths]))
    # both prompts +0.5: mean +0.5, SE 0 (no spread), 2 up
    assert "against hspec (old)" in table
    assert "| hspec (new) | 0 | 2 | +0.500 | 0.000 | 2 / 0 / 0 |" in table


def test_files_of_one_name_are_told_apart_by_their_folders(load_script, tmp_path):
    compare = load_script("compare_table")
    paths = []
    for folder, taus in (("V", [1.0, 2.0]), ("K", [1.0, 3.0])):
        (tmp_path / folder).mkdir()
        paths.append(tmp_path / folder / "heldout_eval.json")
        paths[-1].write_text(json.dumps(_run(taus)))
    assert compare.file_names([str(p) for p in paths]) == ["V/heldout_eval", "K/heldout_eval"]
    runs = compare.load_runs([str(p) for p in paths])
    table = compare.comparison_table(runs)
    # differences 0 and +1: mean +0.5, sample SD 0.707, SE 0.707 / sqrt(2) = 0.5
    assert "| dataset | T | tau hspec (V/heldout_eval) | tau hspec (K/heldout_eval) |" in table
    assert "| hspec (K/heldout_eval) | 0 | 2 | +0.500 | 0.500 | 1 / 0 / 1 |" in compare.paired_table(runs)
