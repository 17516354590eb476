"""One name per quantity (docs/architecture.md, "Glossary"): the aliases the code used to give the
glossary's quantities are banned from the product's source as identifiers (names bound or read,
parameters, keyword arguments, attributes). SGLang's names live at the boundary,
sglang_hspec/sglang_plugin/sglang_names.py; anywhere else an alias needs an entry in ALLOWED, with
its reason."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCE = [ROOT / "scheduler", ROOT / "calibration", ROOT / "sglang_hspec"]
BOUNDARY = ROOT / "sglang_hspec" / "sglang_plugin" / "sglang_names.py"

# alias -> the glossary's name
BANNED = {
    "k": "block_size (drafts per step) or verify_length (drafts a request verifies)",
    "temperatures": "STS per-slot temperatures only: sampling_temperatures, or candidates of one slot's fit",
    "verify_len": "verify_length",
    "verify_lens": "verify_length (SGLang's verify_lens count the anchor: verify_length + 1)",
    "l_r": "verify_length",
    "full_block": "block_size (drafts per request; verify rows are block_size + 1)",
    "gamma": "block_size (DSpark's gamma), or gamma_decay (DFlash's loss decay)",
    "num_draft_tokens": "block_size + 1 (SGLang's verify rows per request)",
    "survival_probs": "survival",
    "sliding_window_size": "sliding_window",
}

# where an alias is banned (prefixes of the path relative to the repo; the others: everywhere). `k` names
# attention keys in model/, kernels/ and target/; `temperatures` are STS's own in calibration/.
SCOPE = {
    "k": ("scheduler/", "calibration/", "sglang_hspec/engine/", "sglang_hspec/training/", "sglang_hspec/core/"),
    "temperatures": ("scheduler/", "sglang_hspec/engine/", "sglang_hspec/training/", "sglang_hspec/core/"),
}

# (path relative to the repo, alias) -> why it stays there.
ALLOWED = {
    ("sglang_hspec/engine/policies.py", "temperatures"): "the STS temperatures (StsCalibration's), to calibration",
}


def uses(tree: ast.AST):
    """(alias, construct, line) of every banned identifier in a module. `k` as a loop or comprehension
    target (a dict's keys) is not the block size and passes; keyword `k` passes only as torch.topk's."""
    loop_targets = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.For | ast.comprehension):
            for target in ast.walk(node.target):
                loop_targets.add(id(target))
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id in BANNED:
            if node.id == "k" and isinstance(node.ctx, ast.Load):
                continue  # a read of k needs a binding, checked at the binding
            if id(node) not in loop_targets or node.id != "k":
                yield node.id, "name", node.lineno
        elif isinstance(node, ast.arg) and node.arg in BANNED:
            yield node.arg, "arg", node.lineno
        elif isinstance(node, ast.keyword) and node.arg in BANNED:
            yield node.arg, "keyword", node.lineno
        elif isinstance(node, ast.Attribute) and node.attr in BANNED:
            yield node.attr, "attribute", node.lineno


def is_topk_keyword(tree: ast.AST, line: int) -> bool:
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.lineno == line:
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name == "topk" and any(kw.arg == "k" for kw in node.keywords):
                return True
    return False


def scan() -> dict[tuple[str, str, str], list[int]]:
    found: dict[tuple[str, str, str], list[int]] = {}
    for folder in SOURCE:
        for path in sorted(folder.rglob("*.py")):
            if path == BOUNDARY:
                continue
            tree = ast.parse(path.read_text(), filename=str(path))
            rel = path.relative_to(ROOT).as_posix()
            for alias, construct, line in uses(tree):
                if alias in SCOPE and not rel.startswith(SCOPE[alias]):
                    continue
                if alias == "k" and construct == "keyword" and is_topk_keyword(tree, line):
                    continue
                found.setdefault((rel, alias, construct), []).append(line)
    return found


def test_no_glossary_alias_in_the_source():
    found = scan()
    offending = []
    for (rel, alias, construct), lines in sorted(found.items()):
        if (rel, alias) in ALLOWED:
            continue
        offending.append(f"{rel}:{lines[0]}: {alias} ({construct}, {len(lines)}x) -> {BANNED[alias]}")
    assert not offending, "glossary aliases (docs/architecture.md, Glossary):\n" + "\n".join(offending)


def test_every_allowed_alias_is_still_used():
    found = scan()
    stale = [key for key in ALLOWED if not any(key == (rel, alias) for rel, alias, _ in found)]
    assert not stale, f"remove these ALLOWED entries, the code no longer holds them: {stale}"


def test_the_scan_catches_each_construct():
    code = "def f(k, verify_len):\n    b, k = x.shape\n    g(full_block=1)\n    return cfg.gamma\n" \
           "for k, v in d.items():\n    pass\ntorch.topk(x, k=3)\n"
    got = sorted((alias, construct) for alias, construct, _ in uses(ast.parse(code)))
    assert got == [("full_block", "keyword"), ("gamma", "attribute"), ("k", "arg"), ("k", "keyword"),
                   ("k", "name"), ("verify_len", "arg")]
    assert is_topk_keyword(ast.parse(code), 7) and not is_topk_keyword(ast.parse(code), 3)
