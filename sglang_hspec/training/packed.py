"""Packed training data: a self-distilled set as compact, committed shards that survive machines.

A packed directory holds `manifest.json` and one compressed `.npz` shard per regeneration shard (so a set that
grows adds files and never rewrites the ones already committed). A shard stores, for its conversations in
order: the ids, the split (train / held out), the target's chat-template token ids (uint16 where the
vocabulary fits, else uint32), the loss mask as bits, and each message's role and character span in the
decoded rendering, so that `unpack` gives back the SpecForge JSONL exactly. `hspec train` reads a packed
directory directly (`data.train_path=<dir>`): the examples are the ones `load_examples` tokenizes from the
JSONL, bit for bit, without the tokenizer pass.

Every shard is checked at pack time: the token ids decode to the rendering and the message spans give back
the messages; a conversation whose rendering does not round-trip keeps its messages verbatim (as JSON) in
the shard instead. At read time each shard's sha256 is checked against the manifest.
"""

from __future__ import annotations

import hashlib
import io
import json
import zipfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
from tqdm import tqdm

from sglang_hspec.core.atomic import atomic_open, atomic_write_text
from sglang_hspec.training.data import (
    ROLES,
    in_heldout,
    normalize_conversation,
    read_jsonl,
    tokenize_conversation,
    tokenizer_fingerprint,
)

PACKED_FORMAT = "hspec-packed/1"
MANIFEST = "manifest.json"
SPLITS = ("train", "heldout")
# the evaluation prompt sets that `hspec data build` / `regenerate` keep out (training/data.py)
EXCLUDED_EVAL_SETS = ("mtbench", "gsm8k", "humaneval", "mbpp", "math500")
_ARRAYS = ("ids", "split", "token_offsets", "input_ids", "loss_mask_bits", "message_offsets", "message_roles",
           "message_spans", "verbatim")


class PackedShard(msgspec.Struct, frozen=True, kw_only=True):
    file: str
    sha256: str
    conversations: int
    tokens: int
    target_tokens: int  # loss-mask tokens: what the target wrote (its end-of-turn tokens included)
    # sha256 of the regeneration shard (or JSONL) it was packed from: packing another source under the same
    # name is refused instead of keeping the old shard ("" in sets packed before it was recorded)
    source_sha256: str = ""

    def __post_init__(self) -> None:
        if "/" in self.file or not self.file.endswith(".npz"):
            raise ValueError(f"shard file {self.file!r} must be a plain .npz name inside the packed directory")


class PackedManifest(msgspec.Struct, frozen=True, kw_only=True):
    """What a packed set is and how it was made: enough to trust it, check it and make it again."""

    format: str
    target: str  # the target whose tokenizer wrote the ids ('embedded' = SmolLM2-135M-Instruct)
    tokenizer_fingerprint: str  # training/data.py tokenizer_fingerprint: the ids depend on it
    vocab_size: int
    token_dtype: str  # uint16 | uint32
    heldout_fraction: float
    heldout_ids: list[str]  # the held-out split, by id (in_heldout(id, heldout_fraction) at pack time)
    excluded_eval_sets: list[str]
    generation: list[dict[str, Any]]  # the regenerate runs that wrote the replies: command, settings, machine
    prompt_sources: dict[str, Any]  # how the prompts were built (build_stats.json, its command)
    conversations: int
    tokens: int
    target_tokens: int
    shards: list[PackedShard]

    def __post_init__(self) -> None:
        if self.format != PACKED_FORMAT:
            raise ValueError(f"format {self.format!r} is not {PACKED_FORMAT!r}")
        if self.token_dtype not in ("uint16", "uint32"):
            raise ValueError(f"token_dtype {self.token_dtype!r} must be uint16 or uint32")
        if self.token_dtype == "uint16" and self.vocab_size > 1 << 16:
            raise ValueError(f"vocab_size {self.vocab_size} does not fit uint16 token ids")
        if not 0.0 <= self.heldout_fraction < 1.0:
            raise ValueError(f"heldout_fraction {self.heldout_fraction} must be in [0, 1)")
        if len({s.file for s in self.shards}) != len(self.shards):
            raise ValueError("two shards share a file name")
        for field, total in (("conversations", self.conversations), ("tokens", self.tokens),
                             ("target_tokens", self.target_tokens)):
            if sum(getattr(s, field) for s in self.shards) != total:
                raise ValueError(f"{field} {total} is not the sum over the shards")


def token_dtype_for(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


# ------------------------------------------------------------------ one conversation
def _message_spans(text: str, messages: list[dict[str, str]]) -> list[tuple[int, int]] | None:
    """Each message's content as a (start, end) character span of the rendering, in order; None where a
    content is not found verbatim after the previous one (a template that rewrites contents)."""
    spans, cursor = [], 0
    for m in messages:
        start = text.find(m["content"], cursor)
        if start < 0:
            return None
        spans.append((start, start + len(m["content"])))
        cursor = start + len(m["content"])
    return spans


def _rendered_messages(messages: list[dict[str, str]]) -> list[dict[str, str]]:
    # what tokenize_conversation renders: an assistant turn with no prompt before it is dropped
    while messages and messages[0]["role"] == "assistant":
        messages = messages[1:]
    return messages


class _ShardBuilder:
    def __init__(self, tokenizer, *, heldout_fraction: float, token_dtype: str):
        self.tokenizer, self.heldout_fraction, self.token_dtype = tokenizer, heldout_fraction, token_dtype
        self.ids: list[str] = []
        self.split: list[int] = []
        self.lengths: list[int] = []
        self.tokens: list[np.ndarray] = []
        self.masks: list[np.ndarray] = []
        self.message_counts: list[int] = []
        self.roles: list[int] = []
        self.spans: list[tuple[int, int]] = []
        self.verbatim: list[str] = []

    def add(self, record_id: str, conversation: list[dict[str, Any]]) -> None:
        messages = _rendered_messages(normalize_conversation(conversation))
        ids, mask = tokenize_conversation(self.tokenizer, messages, max_length=1 << 62)
        if not ids:
            return
        text = self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        spans = _message_spans(text, messages)
        exact = spans is not None and text == self.tokenizer.apply_chat_template(messages, tokenize=False)
        self.ids.append(record_id)
        self.split.append(int(in_heldout(record_id, self.heldout_fraction)))
        self.lengths.append(len(ids))
        self.tokens.append(np.asarray(ids, dtype=self.token_dtype))
        self.masks.append(np.asarray(mask, dtype=np.uint8))
        self.message_counts.append(len(messages) if exact else 0)
        if exact:
            self.roles += [ROLES.index(m["role"]) for m in messages]
            self.spans += spans
        self.verbatim.append("" if exact else json.dumps(messages, ensure_ascii=False))

    def arrays(self) -> dict[str, np.ndarray]:
        masks = np.concatenate(self.masks) if self.masks else np.zeros(0, np.uint8)
        return {
            "ids": np.asarray(self.ids, dtype=np.str_),
            "split": np.asarray(self.split, dtype=np.uint8),
            "token_offsets": np.concatenate([[0], np.cumsum(self.lengths, dtype=np.int64)]).astype(np.int64),
            "input_ids": np.concatenate(self.tokens) if self.tokens else np.zeros(0, self.token_dtype),
            "loss_mask_bits": np.packbits(masks),
            "message_offsets": np.concatenate([[0], np.cumsum(self.message_counts, dtype=np.int64)]).astype(np.int64),
            "message_roles": np.asarray(self.roles, dtype=np.uint8),
            "message_spans": np.asarray(self.spans, dtype=np.int64).reshape(-1, 2),
            "verbatim": np.asarray(self.verbatim, dtype=np.str_),
        }


def _npz_bytes(arrays: dict[str, np.ndarray]) -> bytes:
    """A compressed .npz whose bytes depend only on the arrays (fixed member timestamps), so that packing
    the same data twice writes the same file and the same sha256."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=9) as zf:
        for name in _ARRAYS:
            member = io.BytesIO()
            np.lib.format.write_array(member, np.ascontiguousarray(arrays[name]), allow_pickle=False)
            info = zipfile.ZipInfo(f"{name}.npy", date_time=(1980, 1, 1, 0, 0, 0))
            info.compress_type = zipfile.ZIP_DEFLATED
            zf.writestr(info, member.getvalue(), compresslevel=9)
    return buf.getvalue()


# ------------------------------------------------------------------ pack
def _regenerate_shards(in_dir: Path) -> list[tuple[str, Path]]:
    from sglang_hspec.training.regenerate import SHARD_DIR, _committed_shards

    shard_dir = in_dir / SHARD_DIR
    shards = _committed_shards(shard_dir) if shard_dir.is_dir() else []
    return [(f"{number:06d}.npz", records) for number, records, _ in shards]


def _read_json(path: Path) -> Any:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


def pack(*, in_path: str | Path, out_dir: str | Path, tokenizer, target: str, heldout_fraction: float = 0.02,
         prompt_sources: dict[str, Any] | None = None, generation: list[dict[str, Any]] | None = None,
         progress: bool = True) -> PackedManifest:
    """Pack a `hspec data regenerate --out` directory (one packed shard per committed regeneration shard) or a
    SpecForge JSONL file (one shard) into `out_dir`. Shards already packed with the same name and the same
    source are kept as they are (their sha256 must still match), so packing a growing set only adds files.
    The manifest is written last, atomically."""
    in_path, out_dir = Path(in_path), Path(out_dir)
    sources = check_pack_input(in_path=in_path, out_dir=out_dir, heldout_fraction=heldout_fraction)
    if in_path.is_dir() and generation is None:
        from sglang_hspec.training.regenerate import RUNS_FILE

        generation = [dict(r) for r in read_jsonl(in_path / RUNS_FILE)] if (in_path / RUNS_FILE).is_file() else []
    vocab_size = len(tokenizer)
    token_dtype = token_dtype_for(vocab_size)
    fingerprint = tokenizer_fingerprint(tokenizer)
    previous = _previous_manifest(out_dir, fingerprint=fingerprint, heldout_fraction=heldout_fraction)
    kept = {s.file: s for s in previous.shards} if previous else {}
    shards: list[PackedShard] = []
    heldout_ids: list[str] = []
    for name, source in tqdm(sources, desc=f"pack {in_path.name}", unit="shard", disable=not progress):
        source_sha = _sha256(source)
        if name in kept and kept[name].source_sha256 not in ("", source_sha):
            raise ValueError(f"--in {source} is not the shard packed as {out_dir / name} (another regeneration, its "
                             f"sha256 differs): pack into a new --out, or, to grow this set, restore its regenerate "
                             f"directory first with `hspec data unpack --in {out_dir} --out <regenerate dir> --shards` "
                             "and rerun the regenerate command there")
        if name in kept and (out_dir / name).is_file() and _sha256(out_dir / name) == kept[name].sha256:
            shard = kept[name]
            arrays = _load_arrays(out_dir / name)
        else:
            builder = _ShardBuilder(tokenizer, heldout_fraction=heldout_fraction, token_dtype=token_dtype)
            records = read_jsonl(source)
            for rec in records:
                if not isinstance(rec.get("conversations"), list):
                    raise ValueError(f"{records.where()}: a record needs 'conversations' (SpecForge layout) to pack")
                if "id" not in rec:
                    raise ValueError(f"{records.where()}: a record needs an 'id' (SpecForge layout) to pack")
                if not all(isinstance(m, dict) for m in rec["conversations"]):
                    raise ValueError(f"{records.where()}: 'conversations' must be a list of {{role, content}} "
                                     "messages (SpecForge layout) to pack; fix or remove that line")
                try:
                    builder.add(str(rec["id"]), rec["conversations"])
                except ValueError as e:  # a message without a known role or string content
                    raise ValueError(f"{records.where()}: {e}; fix or remove that line") from None
            if not builder.ids and in_path.is_file():  # a set of nothing: refused before anything is written
                raise ValueError(f"--in {in_path}: no conversation to pack (no record whose conversation renders to "
                                 "tokens); pass a SpecForge JSONL of {id, conversations} records")
            arrays = builder.arrays()
            data = _npz_bytes(arrays)
            with atomic_open(out_dir / name, "wb") as f:
                f.write(data)
            mask = np.unpackbits(arrays["loss_mask_bits"])[: len(arrays["input_ids"])]
            shard = PackedShard(file=name, sha256=hashlib.sha256(data).hexdigest(), conversations=len(arrays["ids"]),
                                tokens=len(arrays["input_ids"]), target_tokens=int(mask.sum()),
                                source_sha256=source_sha)
        shards.append(shard)
        heldout_ids += [str(i) for i, s in zip(arrays["ids"], arrays["split"]) if s]
    # shards packed before whose source is not here (a regenerate directory on another machine) stay as they are
    for name in sorted(set(kept) - {s.file for s in shards}):
        shards.append(kept[name])
        heldout_ids += [str(i) for i, s in zip(*(_load_arrays(out_dir / name)[k] for k in ("ids", "split"))) if s]
    shards.sort(key=lambda s: s.file)
    manifest = PackedManifest(
        format=PACKED_FORMAT, target=target, tokenizer_fingerprint=fingerprint, vocab_size=vocab_size,
        token_dtype=token_dtype, heldout_fraction=heldout_fraction, heldout_ids=sorted(heldout_ids),
        excluded_eval_sets=list(EXCLUDED_EVAL_SETS),
        # a set grown on several machines keeps every run that wrote it, and its prompt build
        generation=[*(previous.generation if previous else []),
                    *(r for r in generation or [] if not previous or r not in previous.generation)],
        prompt_sources=prompt_sources or (previous.prompt_sources if previous else {}), conversations=sum(s.conversations for s in shards),
        tokens=sum(s.tokens for s in shards), target_tokens=sum(s.target_tokens for s in shards), shards=shards)
    atomic_write_text(out_dir / MANIFEST, msgspec.json.format(msgspec.json.encode(manifest), indent=1).decode() + "\n")
    return manifest


def check_pack_input(*, in_path: str | Path, out_dir: str | Path, heldout_fraction: float) -> list[tuple[str, Path]]:
    """What `pack` reads and where it writes, checked before any tokenizer work (the CLI runs it before the
    tokenizer loads): the (packed shard name, source JSONL) pairs of `in_path`. Each problem names its flag."""
    in_path, out_dir = Path(in_path), Path(out_dir)
    if in_path.is_dir():
        sources = _regenerate_shards(in_path)
        if not sources:
            raise FileNotFoundError(f"--in {in_path}: no committed shard under {in_path}/shards; pass the --out "
                                    "directory of a `hspec data regenerate` run, or a SpecForge JSONL file")
    elif in_path.is_file():
        sources = [("000000.npz", in_path)]
    else:
        raise FileNotFoundError(f"--in {in_path}: no such file or directory; pass a `hspec data regenerate --out` "
                                "directory or a SpecForge JSONL file")
    if not 0.0 <= heldout_fraction < 1.0:
        raise ValueError(f"--heldout {heldout_fraction}: the held-out fraction must be in [0, 1)")
    if (out_dir / MANIFEST).is_file():
        _out_manifest(out_dir)
    return sources


def _out_manifest(out_dir: Path) -> PackedManifest:
    """The manifest already in the --out directory; one that is not a packed-data manifest names --out."""
    try:
        return _decode_manifest(out_dir / MANIFEST)
    except ValueError as e:
        raise ValueError(f"--out {out_dir} already holds a {MANIFEST} that is not a packed-data manifest ({e}); "
                         f"pick another --out, or delete {out_dir / MANIFEST} to pack into {out_dir}") from None


def _previous_manifest(out_dir: Path, *, fingerprint: str, heldout_fraction: float) -> PackedManifest | None:
    """The manifest already in out_dir, when its shards can be kept (same tokenizer and split)."""
    if not (out_dir / MANIFEST).is_file():
        return None
    manifest = _out_manifest(out_dir)
    if manifest.tokenizer_fingerprint != fingerprint or manifest.heldout_fraction != heldout_fraction:
        return None  # another tokenizer or split: every shard is packed again
    return manifest


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ------------------------------------------------------------------ read
def is_packed(path: str | Path) -> bool:
    path = Path(path)
    return (path / MANIFEST).is_file() if path.is_dir() else path.name == MANIFEST


def read_manifest(path: str | Path) -> PackedManifest:
    path = Path(path)
    file = path if path.name == MANIFEST else path / MANIFEST
    fix = "pack it again with `hspec data pack --in <regenerate dir or JSONL> --out DIR`"
    try:
        return _decode_manifest(file)
    except NotADirectoryError:
        raise FileNotFoundError(f"{path} is a file, not a packed directory (one holding {MANIFEST}); pass the --out "
                                f"directory of `hspec data pack`, or {fix}") from None
    except FileNotFoundError:
        raise FileNotFoundError(f"{file}: no such file; a packed directory holds {MANIFEST} ({fix})") from None
    except ValueError as e:
        raise ValueError(f"{file} is not a packed-data manifest ({e}); {fix}") from None


def _decode_manifest(file: Path) -> PackedManifest:
    """The manifest in `file`, or a ValueError with the cause: the format first (another tool's manifest lacks
    our fields because it is another format), then the first field that is wrong."""
    raw = file.read_bytes()
    try:
        head = msgspec.json.decode(raw)
    except msgspec.DecodeError as e:
        raise ValueError(f"not JSON: {e}") from None
    if not isinstance(head, dict):
        raise ValueError(f"a JSON {type(head).__name__}, not an object")
    if head.get("format") != PACKED_FORMAT:
        raise ValueError(f"format {head.get('format')!r} is not {PACKED_FORMAT!r}")
    try:
        return msgspec.json.decode(raw, type=PackedManifest)
    except (msgspec.ValidationError, msgspec.DecodeError) as e:
        raise ValueError(str(e)) from None


def _load_arrays(path: Path) -> dict[str, np.ndarray]:
    with np.load(path, allow_pickle=False) as z:
        missing = set(_ARRAYS) - set(z.files)
        if missing:
            raise ValueError(f"{path} lacks {sorted(missing)}: not a packed shard")
        return {name: z[name] for name in _ARRAYS}


def iter_packed(path: str | Path, *, splits: Sequence[str] = SPLITS, tokenizer=None) -> Iterator[dict[str, Any]]:
    """{id, split, input_ids, loss_mask} of every packed conversation in shard order (only the given splits),
    after checking each shard's sha256 against the manifest; with `tokenizer`, also its `conversations`
    (the messages, decoded from the ids)."""
    for s in splits:
        if s not in SPLITS:
            raise ValueError(f"split {s!r}: choose from {SPLITS}")
    root = Path(path)
    root = root.parent if root.name == MANIFEST else root
    manifest = read_manifest(root)
    wanted = {SPLITS.index(s) for s in splits}
    for shard in manifest.shards:
        file = root / shard.file
        if not file.is_file():
            raise FileNotFoundError(f"{file}: listed in {root / MANIFEST} but missing; restore it (git checkout) "
                                    "or pack the set again")
        if _sha256(file) != shard.sha256:
            raise ValueError(f"{file}: its sha256 differs from {root / MANIFEST}'s (a damaged or hand-edited "
                             "shard); restore it (git checkout) or pack the set again")
        a = _load_arrays(file)
        mask = np.unpackbits(a["loss_mask_bits"])[: len(a["input_ids"])]
        tok = a["token_offsets"]
        for i, rid in enumerate(a["ids"]):
            if int(a["split"][i]) not in wanted:
                continue
            ids = a["input_ids"][tok[i]:tok[i + 1]]
            ex = {"id": str(rid), "split": SPLITS[int(a["split"][i])], "input_ids": ids.astype(np.int64),
                  "loss_mask": mask[tok[i]:tok[i + 1]], "shard": shard.file}
            if tokenizer is not None:
                ex["conversations"] = _messages(a, i, ids, tokenizer)
            yield ex


def _messages(a: dict[str, np.ndarray], i: int, ids: np.ndarray, tokenizer) -> list[dict[str, str]]:
    if a["verbatim"][i]:
        return json.loads(str(a["verbatim"][i]))
    text = tokenizer.decode(ids.tolist(), skip_special_tokens=False, clean_up_tokenization_spaces=False)
    lo, hi = a["message_offsets"][i], a["message_offsets"][i + 1]
    return [{"role": ROLES[int(r)], "content": text[s:e]}
            for r, (s, e) in zip(a["message_roles"][lo:hi], a["message_spans"][lo:hi])]


def load_packed_examples(path: str | Path, *, tokenizer, max_length: int) -> list[dict[str, Any]]:
    """The training examples of the packed train split: exactly `load_examples` over the JSONL it was packed
    from ({id, input_ids, loss_mask}, truncated to max_length; records without an assistant token after
    position 1 dropped). The tokenizer must be the one the set was packed with (its fingerprint)."""
    manifest = read_manifest(path)
    if tokenizer is not None and tokenizer_fingerprint(tokenizer) != manifest.tokenizer_fingerprint:
        raise ValueError(f"data.train_path {path}: packed with another tokenizer (fingerprint "
                         f"{manifest.tokenizer_fingerprint}, target {manifest.target!r}) than this target's "
                         f"({tokenizer_fingerprint(tokenizer)}); train the target it was packed for, or unpack it "
                         "(`hspec data unpack`) and train on the JSONL, which is tokenized again")
    out = []
    for ex in iter_packed(path, splits=("train",)):
        ids, mask = ex["input_ids"][:max_length].tolist(), ex["loss_mask"][:max_length].tolist()
        if sum(mask[2:]) == 0:
            continue
        out.append({"id": ex["id"], "input_ids": ids, "loss_mask": mask})
    if not out:
        raise ValueError(f"data.train_path {path}: the packed train split has no example with an assistant token "
                         "after position 1")
    return out


def unpack(*, path: str | Path, out_dir: str | Path, tokenizer, shards: bool = False) -> dict[str, int]:
    """SpecForge JSONL (train.jsonl / heldout.jsonl of {id, conversations}) from a packed directory, exactly
    the conversations that were packed. Returns the records per split. `shards`: also the regenerate directory
    layout (shards/NNNNNN.jsonl with its status file, one per packed shard: byte for byte the shards regenerate
    wrote, whose conversations open with a user turn), so that rerunning the set's regenerate command with this --out resumes after them and
    packing again keeps the committed shards."""
    lines: dict[str, list[str]] = {s: [] for s in SPLITS}
    by_shard: dict[str, list[dict[str, Any]]] = {}
    for ex in iter_packed(path, tokenizer=tokenizer):
        line = json.dumps({"id": ex["id"], "conversations": ex["conversations"]}, ensure_ascii=False) + "\n"
        lines[ex["split"]].append(line)
        by_shard.setdefault(ex["shard"], []).append({"line": line, "id": ex["id"],
                                                     "target_tokens": int(ex["loss_mask"].sum())})
    out_dir = Path(out_dir)
    for split, split_lines in lines.items():
        with atomic_open(out_dir / f"{split}.jsonl", "w") as f:
            f.writelines(split_lines)
    if shards:
        from sglang_hspec.training.regenerate import SHARD_DIR

        for name, rows in by_shard.items():
            stem = out_dir / SHARD_DIR / Path(name).stem
            # the status file first: a records file without one is refused by regenerate (its commit order)
            with atomic_open(stem.with_suffix(".status.jsonl"), "w") as f:
                f.writelines(json.dumps({"id": r["id"], "status": "succeeded", "reason": None,
                                         "target_tokens": r["target_tokens"], "truncated": 0}) + "\n" for r in rows)
            with atomic_open(stem.with_suffix(".jsonl"), "w") as f:
                f.writelines(r["line"] for r in rows)
    return {s: len(v) for s, v in lines.items()}


def prompt_sources_of(prompts_dir: str | Path | None, command: str | None) -> dict[str, Any]:
    """The prompt build behind a set: `hspec data build`'s build_stats.json and the command that made it."""
    out: dict[str, Any] = {}
    if command:
        out["command"] = command
    if prompts_dir is not None:
        stats = _read_json(Path(prompts_dir) / "build_stats.json")
        if stats is not None:
            out["build_stats"] = stats
    return out

