"""The structure docs/architecture.md promises, checked from the source text (nothing is imported):
imports run one way (assets < target < core/kernels < model < engine < training/sglang_plugin/client
< cli), scheduler/ and calibration/ import no other part of the package and never SGLang, no import
cycles between modules, and no text outside the product in any tracked file (documents or paths outside the
repository, the vocabulary of the lab that built it)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# installed module name prefix -> folder (pyproject's package-dir)
SOURCES = {"sglang_hspec": ROOT / "sglang_hspec", "sglang_hspec.scheduler": ROOT / "scheduler",
           "sglang_hspec.calibration": ROOT / "calibration"}
# subpackage -> level; a module may import only lower levels and its own subpackage
LEVELS = {"scheduler": 0, "calibration": 0, "assets": 1, "target": 2, "core": 3, "kernels": 3, "model": 4,
          "engine": 5, "training": 6, "sglang_plugin": 6, "client": 6, "checkpoints": 6, "cli": 7,
          "__init__": 7, "__main__": 7}
PURE = ("scheduler", "calibration")


def _module_files() -> dict[str, Path]:
    out = {}
    for prefix, folder in SOURCES.items():
        for path in folder.rglob("*.py"):
            if prefix == "sglang_hspec" and path.relative_to(folder).parts[0] in ("scheduler", "calibration"):
                continue
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__" and len(parts) > 1:
                parts = parts[:-1]
            name = ".".join([prefix, *parts]) if parts != ["__init__"] else prefix
            out[name] = path
    return out


MODULES = _module_files()


def _imports(name: str, path: Path) -> list[tuple[str, int]]:
    """Absolute names of everything `name` imports, at module level or inside functions."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.append((target, node.lineno))
            # `from pkg import submodule` depends on the submodule
            found += [(f"{target}.{alias.name}", node.lineno) for alias in node.names
                      if f"{target}.{alias.name}" in MODULES]
    return found


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def _subpackage(name: str) -> str:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _resolve(target: str) -> str | None:
    """The module of ours that `target` names (longest known prefix), or None."""
    while target:
        if target in MODULES:
            return target
        target = target.rpartition(".")[0]
    return None


def test_the_module_map_covers_every_layer():
    assert {_subpackage(m) for m in MODULES} <= set(LEVELS), "a new subpackage needs a level in LEVELS"
    assert {"sglang_hspec.model.hspec", "sglang_hspec.engine.engine", "sglang_hspec.scheduler.planner",
            "sglang_hspec.calibration.sts", "sglang_hspec.core.types"} <= set(MODULES)


def test_imports_run_one_way():
    wrong = []
    for name, path in MODULES.items():
        mine = _subpackage(name)
        for target, line in _imports(name, path):
            theirs = _resolve(target)
            if theirs is None:
                if mine in PURE and (target == "sglang" or target.startswith("sglang.")):
                    wrong.append(f"{_rel(path)}:{line} imports {target} (scheduler/calibration never import SGLang)")
                continue
            other = _subpackage(theirs)
            if other == mine:
                continue
            if mine in PURE or LEVELS[other] >= LEVELS[mine]:
                wrong.append(f"{_rel(path)}:{line} ({mine}) imports {theirs} ({other})")
    assert not wrong, "imports against docs/architecture.md's order:\n" + "\n".join(wrong)


def test_the_check_sees_a_model_to_engine_import(tmp_path, monkeypatch):
    """A test of the test: a model module importing the engine is reported."""
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from sglang_hspec.engine.engine import SpeculativeEngine\n")
    monkeypatch.setitem(MODULES, "sglang_hspec.model.bad", bad)
    with pytest.raises(AssertionError, match=r"\(model\) imports sglang_hspec.engine.engine \(engine\)"):
        test_imports_run_one_way()
    bad.write_text("import sglang.srt\n")
    monkeypatch.delitem(MODULES, "sglang_hspec.model.bad")
    monkeypatch.setitem(MODULES, "sglang_hspec.scheduler.bad", bad)
    with pytest.raises(AssertionError, match="never import SGLang"):
        test_imports_run_one_way()


def _cycles() -> list[list[str]]:
    graph = {name: sorted({t for t in (_resolve(x) for x, _ in _imports(name, path)) if t and t != name
                           and not name.startswith(t + ".")})  # a package's own __init__ is not a cycle
             for name, path in MODULES.items()}
    # Tarjan's strongly connected components
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    # package __init__ files that re-export their submodules are not cycles (Python resolves them)
    cycles = [c for c in _cycles() if not any(m == _pkg for m in c for _pkg in ("sglang_hspec",))]
    assert not cycles, f"import cycles: {cycles}"


# Text that does not belong in the product, in any tracked text file: documents, machines and folders outside
# this repository, and the vocabulary of the lab that built it (work periods, lab notes, issue numbers). Each
# rule: (name, pattern, what to write instead). Written with string joins so this file does not match itself.
_FORBIDDEN = [
    ("a document outside the repo", re.compile("|".join([r"shared/(?:reference|seeds)", r"\.\./" + "shared",
     r"(?:sglang-integration|sglang-cpu-e2e|offline-assets|anchors|mamba2)\.md"])),
     "cite a file of this repository (docs/architecture.md)"),
    ("a work period", re.compile(r"\b" + "sess" + r"ions?\s+\d+|\b(?:same|next|later|earlier|previous|between|"
                                 r"last)\s+" + "sess" + r"ions?\b|\bthis\s+" + "sess" + r"ion's", re.I),
     "say what was measured, on which machine and date"),
    ("a work-period name as a path part", re.compile(r"(?<=[/_])s\d{2}\b|(?<![\w.-])s\d{2}/"),
     "name results by topic, date and machine (docs/results/<topic>/<date>_<machine>/)"),
    ("lab notes", re.compile(r"\bruns/" + "notes" + r"\b|(?<![\w.-])" + "notes" + r"/"),
     "put what users need in docs/"),
    ("an issue of the tracker", re.compile(r"\b" + "iss" + r"ues?\s+#?\d+|\bthe\s+" + "iss" + r"ue(?:'s)?\b", re.I),
     "state the requirement itself"),
    ("an absolute path of a build machine", re.compile(r"(?<![\w.~-])/(?:work|root|home|mnt|Users)/"),
     "a path relative to the repository root, or $HSPEC_CACHE_DIR"),
    ("a scratch path that is not an example", re.compile(r"(?<!--out )(?<![\"'=\w.~-])/tmp/"),
     "tmp_path in tests, --out in examples"),
]
# Artifacts under docs/results/ record the machine that wrote them (a server's model path, a temp folder): data,
# not text of the product, so only the vocabulary rules apply there.
_RECORDED = ("a work period", "a work-period name as a path part", "lab notes", "an issue of the tracker",
             "a document outside the repo")
_BINARY_SUFFIXES = (".png", ".safetensors", ".gguf", ".pt", ".bin", ".whl", ".gz", ".zip")


def _tracked_text_files() -> list[Path]:
    import subprocess

    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: no tracked files to scan")
    files = []
    for name in out.decode().split("\0"):
        path = ROOT / name
        if not name or name.endswith(_BINARY_SUFFIXES) or not path.is_file():
            continue
        files.append(path)
    return files


def forbidden_lines(path: Path, text: str) -> list[str]:
    """Every line of `text` (the file `path`, relative to the repo) that breaks a rule of _FORBIDDEN."""
    rel = path.relative_to(ROOT).as_posix() if path.is_absolute() else path.as_posix()
    recorded = rel.startswith("docs/results/") and not rel.endswith(".md")
    hits = []
    for i, line in enumerate(text.splitlines(), 1):
        for name, pattern, fix in _FORBIDDEN:
            if recorded and name not in _RECORDED:
                continue
            if pattern.search(line):
                hits.append(f"{rel}:{i}: {name} ({fix}): {line.strip()[:100]}")
    return hits


def test_tracked_text_speaks_of_the_product_only():
    hits = []
    for path in _tracked_text_files():
        if path == Path(__file__).resolve():
            continue
        data = path.read_bytes()
        if b"\0" in data[:8192]:
            continue
        hits += forbidden_lines(path, data.decode("utf-8", errors="ignore"))
    assert not hits, "text that does not belong in the product:\n" + "\n".join(hits)


@pytest.mark.parametrize("line, rule", [
    ("measured in " + "sess" + "ion 33 on the Xeon", "a work period"),
    ("the same run, next " + "sess" + "ion", "a work period"),
    ("nothing else ran but this " + "sess" + "ion's tests", "a work period"),
    ("see docs/results/amx_s" + "32/demo.txt", "a work-period name as a path part"),
    ("rerun runs/s" + "21/bench.sh", "a work-period name as a path part"),
    ("Reading: `../" + "shared/seeds/`", "a document outside the repo"),
    ("runs/" + "notes/i12.md", "lab notes"),
    ("as " + "iss" + "ue 12 asks", "an issue of the tracker"),
    ("cd /" + "work/main && make", "an absolute path of a build machine"),
    ("cat /" + "tmp/w/rules.md", "a scratch path that is not an example"),
])
def test_scan_catches_each_rule(line, rule):
    hits = forbidden_lines(Path("docs/example.md"), line)
    assert len(hits) == 1 and f": {rule} (" in hits[0], hits


@pytest.mark.parametrize("line", [
    '@pytest.fixture(scope="' + "sess" + 'ion")',
    "targets patched earlier in this " + "sess" + "ion are skipped",  # pytest's session, not a work period
    "docs/results/drafter/2026-12-06_xeon-amx_whole-set/heldout80.json",
    "python scripts/profile_sglang_step.py --out /" + "tmp/prof",
    'default=os.environ.get("OUT", "/' + 'tmp/gpu_check_out")',
    "hspec eval ... --record-confidence runs/conf",
    "an SSM with 16 heads, s16 blocks",  # not a path part
])
def test_scan_leaves_product_text_alone(line):
    assert forbidden_lines(Path("docs/example.md"), line) == []


def test_recorded_artifacts_keep_their_machine_paths():
    line = '"model_path": "/' + 'root/.cache/sglang-hspec/smollm2-135m-instruct"'
    assert forbidden_lines(Path("docs/results/serving/x/bench_serve.json"), line) == []
    assert forbidden_lines(Path("docs/serving.md"), line)
    assert forbidden_lines(Path("docs/results/x/run.json"), '"drafter_spec": "runs/s' + '30/export"')


def test_cited_results_exist():
    """Every docs/results/ path that the product's text cites exists, and every `docs/results.md, "Section"`
    names a heading of that page (results move by topic and date; their citations must move with them)."""
    headings = [line[3:] for line in (ROOT / "docs/results.md").read_text().splitlines() if line.startswith("## ")]
    path_re = re.compile(r"docs/results/[\w./-]+")
    section_re = re.compile(r"results\.md[`,:\s]*\(?\s*[\"'](\w[^\"']{2,80})[\"']")
    missing = []
    for path in _tracked_text_files():
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith("docs/results/") or path == Path(__file__).resolve() or path.suffix not in (
                ".md", ".py", ".sh", ".yaml", ".toml", ".txt", ""):
            continue
        text = path.read_text(errors="ignore")
        for m in path_re.finditer(text):
            cited = m.group(0).rstrip(".")
            if not (ROOT / cited).exists() and not (ROOT / cited).parent.is_dir() and "<" not in cited:
                missing.append(f"{rel}: {cited}")
        for m in section_re.finditer(text):
            section = " ".join(m.group(1).split())
            if not any(h.startswith(section) for h in headings):
                missing.append(f"{rel}: docs/results.md has no section {section!r}")
    assert not missing, "citations of results that do not exist:\n" + "\n".join(missing)


# A drafter checkpoint is committed only as a release, at most one per month of work (CONTRIBUTING.md): every
# version stays in the history for good, since main is never rewritten. Versions before the policy (nine of them, the current one included;
# docs/history.md) are grandfathered; the first one after it must still come a month after the last one before.
_RELEASE_POLICY_START = 1796601600  # 2026-12-07 00:00 UTC
_MIN_RELEASE_GAP_S = 28 * 24 * 3600


def release_gaps_too_short(times: list[int], *, start: int = _RELEASE_POLICY_START,
                           min_gap: int = _MIN_RELEASE_GAP_S) -> list[tuple[int, int]]:
    """Pairs of consecutive checkpoint commits (commit times) under the policy that are less than min_gap apart."""
    times = sorted(times)
    before = [t for t in times if t < start]
    after = [t for t in times if t >= start]
    chain = before[-1:] + after
    return [(a, b) for a, b in zip(chain, chain[1:]) if b - a < min_gap]


def test_release_gap_rule_by_hand():
    day = 24 * 3600
    start = 100 * day
    assert release_gaps_too_short([10 * day, 20 * day], start=start) == []  # grandfathered
    assert release_gaps_too_short([90 * day, 130 * day], start=start) == []
    assert release_gaps_too_short([90 * day, 110 * day], start=start) == [(90 * day, 110 * day)]
    assert release_gaps_too_short([50 * day, 130 * day, 140 * day], start=start) == [(130 * day, 140 * day)]


def test_drafter_checkpoints_are_released_at_most_monthly():
    import subprocess

    try:
        out = subprocess.run(["git", "log", "--format=%ct", "--", "sglang_hspec/checkpoints/*/model.safetensors"],
                             cwd=ROOT, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    times = [int(t) for t in out.split()]
    assert not release_gaps_too_short(times), (
        "drafter checkpoints committed less than 28 days apart: commit a new drafter only as a release, at most "
        "one per month (CONTRIBUTING.md, 'Release a drafter'); keep experiments in runs/ (git-ignored)")


def test_no_test_package_shadows_an_installed_distribution():
    """tests/ is on sys.path (pytest's rootdir import mode, and the conftests that import tests/sglang_cpu),
    so a test folder with an __init__.py is importable under its bare name. tests/kernels was one, and
    once transformers 5.25 depended on Hugging Face's `kernels`, its `from kernels import ...` at import
    time found ours and every test that loads a model failed to collect."""
    import importlib.metadata

    installed = importlib.metadata.packages_distributions()
    tests_dir = Path(__file__).parent
    shadows = {init.parent.name: installed[init.parent.name] for init in tests_dir.glob("*/__init__.py")
               if init.parent.name in installed}
    assert not shadows, (f"test packages named like installed distributions: {shadows}; drop their __init__.py "
                         "(import their helpers by bare name) or rename them")


def test_the_front_pages_stay_short():
    """A newcomer reads the README and the results page whole: under 120 and 400 lines."""
    assert len((ROOT / "README.md").read_text().splitlines()) < 120
    assert len((ROOT / "docs" / "results.md").read_text().splitlines()) < 400
