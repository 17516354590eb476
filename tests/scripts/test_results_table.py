"""scripts/results_table.py: the headline table of docs/results.md and README.md is what the artifacts say."""

from __future__ import annotations

import json
import shutil
import statistics
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def table(load_script):
    return load_script("results_table")


def test_pages_show_the_artifacts_numbers(table):
    assert table.stale_pages() == [], "run python scripts/results_table.py"


def test_policy_cells_are_medians_of_per_round_ratios_to_the_better_of_plain_and_always(table):
    """The bf16 auto row reads, per round, auto's tok/s over the larger of plain's and fixed's in that round,
    median over rounds, recomputed here from the raw throughputs."""
    rel = "policies/2026-12-07_epyc-zen4/auto_table_bf16.json"
    rows = json.loads((REPO / "docs/results" / rel).read_text())["rows"]

    def tok_s(b, rnd, policy):
        return next(r["throughput_tok_s"] for r in rows if (r["batch"], r["round"], r["policy"]) == (b, rnd, policy))

    by_hand = [statistics.median(tok_s(b, k, "auto") / max(tok_s(b, k, "plain"), tok_s(b, k, "fixed"))
                                 for k in range(3)) for b in (1, 4, 16, 32)]
    row = next(r for r in table.headline_rows() if r.artifact == rel)
    assert row.value.startswith(" / ".join(f"{x:.2f}" for x in by_hand) + "x")
    assert row.value.startswith("1.07 / 0.96 / 0.99 / 1.00x")


def test_every_row_names_machine_dtype_command_and_an_existing_artifact(table):
    rows = table.headline_rows()
    assert len(rows) >= 8
    for r in rows:
        assert r.machine and r.dtype and r.command, r
        assert (REPO / "docs/results" / r.artifact).is_file(), r.artifact
        manifest = next(p / "manifest.json" for p in (REPO / "docs/results" / r.artifact).parents
                        if (p / "manifest.json").is_file())
        assert json.loads(manifest.read_text())["machine"] == r.machine, (r.artifact, manifest)


def _copy(tmp_path: Path) -> Path:
    for page in ("docs/results.md", "README.md"):
        (tmp_path / page).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / page, tmp_path / page)
    shutil.copytree(REPO / "docs/results", tmp_path / "docs/results")
    return tmp_path


def test_a_number_edited_in_the_page_is_caught(table, tmp_path):
    root = _copy(tmp_path)
    page = root / "docs/results.md"
    text = page.read_text()
    assert "2.047 (95 % interval" in text
    page.write_text(text.replace("2.047 (95 % interval", "2.057 (95 % interval", 1))
    assert table.stale_pages(root) == ["docs/results.md"]


def test_an_artifact_that_changes_makes_the_page_stale(table, tmp_path):
    root = _copy(tmp_path)
    path = root / "docs/results/serving/2026-12-06_xeon-amx_bf16/bench_serve.json"
    payload = json.loads(path.read_text())
    for r in payload["results"]:
        if r["server"] == "HSPEC+lookup" and r["concurrency"] == 1:
            r["throughput_tok_s"] *= 1.1
    path.write_text(json.dumps(payload))
    assert table.stale_pages(root) == ["docs/results.md", "README.md"]


def test_missing_markers_name_the_page(table):
    with pytest.raises(SystemExit, match="README.md: wants exactly one pair of markers"):
        table.replace_table("no table here", "| t |", page="README.md")


def test_missing_artifact_names_the_file(table, tmp_path):
    root = _copy(tmp_path)
    (root / "docs/results/lookup/2026-12-06_xeon-amx/heldout80.json").unlink()
    with pytest.raises(SystemExit, match=r"lookup/2026-12-06_xeon-amx/heldout80.json: cannot read the artifact"):
        table.headline_rows(root)
