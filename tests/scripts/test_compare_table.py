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
