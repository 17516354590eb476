"""The structure docs/architecture.md promises, checked from the source text (nothing is imported):
imports run one way (assets < target < core/kernels < model < engine < training/sglang_plugin/client
< cli), scheduler/ and calibration/ import no other part of the package and never SGLang, no import
cycles between modules, and no reference to documents outside the repository."""

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


# documents that live outside this repository (the authors' reading, not the users')
_OUTSIDE = re.compile("|".join([r"shared/(?:reference|seeds)", r"\.\./" + "shared",
                                r"(?:sglang-integration|sglang-cpu-e2e|offline-assets|anchors|mamba2)\.md"]))
_SCOPES = ["sglang_hspec", "scheduler", "calibration", "docs", "scripts", "tests", "configs", "README.md",
           "Makefile", "pyproject.toml"]


def test_no_reference_to_documents_outside_the_repo():
    hits = []
    for scope in _SCOPES:
        base = ROOT / scope
        files = [base] if base.is_file() else [p for p in base.rglob("*") if p.is_file()]
        for path in files:
            if path.suffix not in (".py", ".md", ".sh", ".yaml", ".yml", ".toml", ".txt", ".json", "") or \
                    path == Path(__file__).resolve() or "__pycache__" in path.parts:
                continue
            for i, line in enumerate(path.read_text(errors="ignore").splitlines(), 1):
                if _OUTSIDE.search(line):
                    hits.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()[:100]}")
    assert not hits, "references to documents outside the repo (cite docs/architecture.md instead):\n" + "\n".join(hits)


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
