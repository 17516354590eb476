"""Training data: SpecForge-layout JSONL ({id, conversations: [{role, content}]}) from the offline corpora,
optional regeneration of assistant turns by the target, and tokenization with the loss mask.

Sources are ShareGPT (chat) and Python standard-library source (code); evaluation prompt sets are never
read here. `hspec data build` deduplicates and splits a held-out set by id (a hash of the id, so the
split is stable as the corpus grows); `hspec data regenerate` rewrites assistant turns with the target in
its own chat template (the train/serve gap fix), batched and resumable.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
import sysconfig
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

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


def evaluation_prompt_texts() -> set[str]:
    """Normalised turns of every evaluation prompt set, to keep them out of the training data."""
    from sglang_hspec.assets.prompts import PROMPT_SETS, load_prompts

    return {_norm_text(t) for name in PROMPT_SETS for item in load_prompts(name) for t in item.turns}


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


@dataclass
class BuildStats:
    read: int = 0
    duplicates: int = 0
    unusable: int = 0
    contaminated: int = 0
    train: int = 0
    heldout: int = 0


def build_dataset(
    *, records: Iterable[dict[str, Any]], out_dir: str | Path, heldout_fraction: float = 0.02,
    exclude_texts: set[str] = frozenset(),
) -> BuildStats:
    """Deduplicate (by id and by content), drop conversations with a user turn in `exclude_texts`
    (normalised evaluation prompts) and write train.jsonl / heldout.jsonl."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stats, seen_ids, seen_keys = BuildStats(), set(), set()
    with open(out / "train.jsonl", "w") as ftrain, open(out / "heldout.jsonl", "w") as fheld:
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
    (out / "build_stats.json").write_text(json.dumps(stats.__dict__, indent=1))
    return stats


def read_jsonl(path: str | Path) -> Iterator[dict[str, Any]]:
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                try:
                    yield json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{lineno} is not valid JSON ({e}); fix or remove that line") from None


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


def load_examples(records: Iterable[dict[str, Any]], *, tokenizer, max_length: int) -> list[dict[str, Any]]:
    """Training examples {id, input_ids, loss_mask}: records with `conversations` are tokenized with the
    target's chat template; pre-tokenized records (`input_ids`, optional `loss_mask`) pass through."""
    out = []
    for rec in records:
        if "input_ids" in rec:
            ids = list(rec["input_ids"])[:max_length]
            mask = list(rec.get("loss_mask", [1] * len(ids)))[:max_length]
        elif "conversations" in rec:
            if tokenizer is None:
                raise ValueError("conversation records need the target's tokenizer (the tiny target has none): "
                                 "use pre-tokenized {input_ids, loss_mask} records or data.synthetic")
            ids, mask = tokenize_conversation(tokenizer, normalize_conversation(rec["conversations"]),
                                              max_length=max_length)
        else:
            raise ValueError(f"record {rec.get('id')!r} has neither conversations nor input_ids")
        if len(ids) != len(mask):
            raise ValueError(f"record {rec.get('id')!r}: input_ids and loss_mask lengths differ")
        if sum(mask[2:]) == 0:
            continue  # no assistant token after position 1: no anchor possible
        out.append({"id": str(rec.get("id", len(out))), "input_ids": ids, "loss_mask": mask})
    return out


# ------------------------------------------------------------------ regeneration
@dataclass
class RegenStats:
    input: int = 0
    success: int = 0
    error: int = 0
    skipped: int = 0


def regenerate(
    *, model, tokenizer, in_path: str | Path, out_path: str | Path, batch_size: int = 8,
    max_new_tokens: int = 512, temperature: float = 0.7, top_p: float = 0.8, top_k: int = 20,
    seed: int = 0, limit: int | None = None,
) -> RegenStats:
    """Rewrite every assistant turn with the target (turn by turn, each conditioned on the regenerated
    history). Resumable: ids already in out_path (or its .errors.jsonl) are skipped. Records without a
    user turn are copied unchanged and counted as skipped. success + error + skipped == input."""
    out_path = Path(out_path)
    err_path = out_path.with_suffix(".errors.jsonl")
    done = set()
    for p in (out_path, err_path):
        if p.exists():
            done.update(r["id"] for r in read_jsonl(p))
    records = list(read_jsonl(in_path))[:limit]
    stats = RegenStats(input=len(records))
    todo = []
    with open(out_path, "a") as fout:
        for rec in records:
            conv = normalize_conversation(rec["conversations"])
            if rec["id"] in done:
                stats.skipped += 1
            elif not any(m["role"] == "user" for m in conv):
                stats.skipped += 1
                fout.write(json.dumps({"id": rec["id"], "conversations": conv}, ensure_ascii=False) + "\n")
            else:
                todo.append({"id": rec["id"], "conversations": conv})
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    torch.manual_seed(seed)
    bar = tqdm(total=len(todo), desc="regenerate", unit="conv")
    with open(out_path, "a") as fout, open(err_path, "a") as ferr:
        for s in range(0, len(todo), batch_size):
            batch = todo[s: s + batch_size]
            try:
                results = _regenerate_batch(model, tokenizer, batch, max_new_tokens=max_new_tokens,
                                            temperature=temperature, top_p=top_p, top_k=top_k)
            except Exception as e:  # noqa: BLE001 - one bad batch must not lose the run; retried per record
                results = []
                for rec in batch:
                    try:
                        results += _regenerate_batch(model, tokenizer, [rec], max_new_tokens=max_new_tokens,
                                                     temperature=temperature, top_p=top_p, top_k=top_k)
                    except Exception as e1:  # noqa: BLE001
                        results.append(e1 if str(e1) else e)
            for rec, res in zip(batch, results):
                if isinstance(res, Exception):
                    stats.error += 1
                    ferr.write(json.dumps({"id": rec["id"], "error": f"{type(res).__name__}: {res}"}) + "\n")
                else:
                    stats.success += 1
                    fout.write(json.dumps({"id": rec["id"], "conversations": res}, ensure_ascii=False) + "\n")
            fout.flush()
            ferr.flush()
            bar.update(len(batch))
    bar.close()
    assert stats.success + stats.error + stats.skipped == stats.input
    return stats


def _regenerate_batch(model, tokenizer, batch, *, max_new_tokens, temperature, top_p, top_k):
    """Regenerate turn t of every conversation in the batch together, t = 0, 1, ..."""
    convs = [[m for m in r["conversations"] if m["role"] != "assistant"] for r in batch]
    new: list[list[dict[str, str]]] = [[] for _ in batch]
    # position of each non-assistant message; an assistant reply follows every user message
    max_turns = max(len(c) for c in convs)
    cursor = [0] * len(batch)
    for _ in range(max_turns):
        active = []
        for b, c in enumerate(convs):
            while cursor[b] < len(c) and c[cursor[b]]["role"] != "user":
                new[b].append(c[cursor[b]])
                cursor[b] += 1
            if cursor[b] < len(c):
                new[b].append(c[cursor[b]])
                cursor[b] += 1
                active.append(b)
        if not active:
            break
        prompts = [tokenizer.apply_chat_template(new[b], tokenize=False, add_generation_prompt=True) for b in active]
        enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
        gen = model.generate(
            **enc, max_new_tokens=max_new_tokens, do_sample=temperature > 0,
            temperature=temperature if temperature > 0 else None, top_p=top_p if temperature > 0 else None,
            top_k=top_k if temperature > 0 else None, pad_token_id=tokenizer.pad_token_id,
        )
        texts = tokenizer.batch_decode(gen[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
        for b, t in zip(active, texts):
            new[b].append({"role": "assistant", "content": t.strip()})
    return new


# ------------------------------------------------------------------ CLI
def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("data", help="build / regenerate drafter training data (SpecForge JSONL layout)")
    sub = p.add_subparsers(dest="data_command", required=True)
    b = sub.add_parser("build", help="ShareGPT + Python source -> train.jsonl / heldout.jsonl")
    b.add_argument("--out", required=True, help="output directory")
    b.add_argument("--sharegpt", type=int, default=10000, help="ShareGPT conversations to read (0: none)")
    b.add_argument("--code", type=int, default=2000, help="Python source chunks to add (0: none)")
    b.add_argument("--code-root", default=None, help="directory of .py files (default: the stdlib)")
    b.add_argument("--heldout", type=float, default=0.02, help="held-out fraction (split by id hash)")
    b.set_defaults(func=run_cli)
    r = sub.add_parser("regenerate", help="rewrite assistant turns with the target (resumable)")
    r.add_argument("--in", dest="in_path", required=True)
    r.add_argument("--out", required=True)
    r.add_argument("--target", default="smollm2", help="'smollm2' (embedded) or a local HF model directory")
    r.add_argument("--batch-size", type=int, default=8)
    r.add_argument("--max-new-tokens", type=int, default=512)
    r.add_argument("--temperature", type=float, default=0.7)
    r.add_argument("--top-p", type=float, default=0.8)
    r.add_argument("--top-k", type=int, default=20)
    r.add_argument("--limit", type=int, default=None)
    r.add_argument("--seed", type=int, default=0)
    r.set_defaults(func=run_cli)
    return p


def run_cli(args) -> int:
    if args.data_command == "build":
        def records():
            if args.sharegpt:
                yield from sharegpt_records(limit=args.sharegpt)
            if args.code:
                yield from code_records(limit=args.code, root=args.code_root)

        stats = build_dataset(records=records(), out_dir=args.out, heldout_fraction=args.heldout,
                              exclude_texts=evaluation_prompt_texts())
        print(json.dumps(stats.__dict__))
        return 0
    from sglang_hspec.training.trainer import load_target

    model, tokenizer = load_target(args.target, dtype="bf16")
    if tokenizer is None:
        raise SystemExit(f"target {args.target!r} has no tokenizer; regeneration needs a chat model")
    stats = regenerate(model=model, tokenizer=tokenizer, in_path=args.in_path, out_path=args.out,
                       batch_size=args.batch_size, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                       top_p=args.top_p, top_k=args.top_k, seed=args.seed, limit=args.limit)
    print(json.dumps(stats.__dict__))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sglang_hspec.training.data")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["data", *(argv if argv is not None else sys.argv[1:])])
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
