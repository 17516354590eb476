"""Grow a trained H-Spec / DSpark drafter's capacity without changing what it drafts: a larger draft vocabulary
and / or a higher Markov rank, so that a capacity lever is measured by continuing the drafter from where it
stands, not by retraining from scratch.

    python scripts/grow_drafter.py sglang_hspec/checkpoints/hspec-smollm2 --out runs/grown \
        --draft-vocab-size 16384 --data data/smollm2_regen_fresh/train.jsonl
    hspec train --config configs/train_hspec_smollm2.yaml model.init_from=runs/grown \
        model.drafter.draft_vocab_size=16384 ...

Draft vocabulary: every old draft token stays, the most frequent tokens of the assistant turns of `--data`
(what the drafter has to draft) that it lacked are added, and d2t stays sorted by target id. An added token
gets the Markov rows it already had as an out-of-vocabulary previous token (W1's spare row) and a zero Markov
bias as a next token; its logit comes from the frozen target LM head row like every other draft token's.
Markov rank: the new W2 columns are zero (the bias is unchanged) and the new W1 columns are drawn at the
scale of the trained ones, so gradients reach both; the confidence head gets zero weights for the new
features. Every old token's logits and confidence are unchanged (tests/scripts/test_grow_drafter.py checks
this against the drafter before growing).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from sglang_hspec.model.checkpoint import read_checkpoint_config, read_checkpoint_weights, write_checkpoint


def assistant_token_counts(data: Path, tokenizer, vocab_size: int) -> torch.Tensor:
    """Token counts of the assistant turns of a SpecForge JSONL file (`conversations` of role / content)."""
    counts = torch.zeros(vocab_size, dtype=torch.float64)
    with open(data) as f:
        lines = f.readlines()
    for n, line in enumerate(tqdm(lines, desc="count tokens", unit="conv")):
        try:
            turns = json.loads(line)["conversations"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise SystemExit(f"{data}:{n + 1}: not a SpecForge conversation row ({e}); pass the JSONL that "
                             "`hspec data regenerate` or `hspec data build` wrote") from None
        for turn in turns:
            if turn.get("role") == "assistant":
                ids = tokenizer(turn["content"], add_special_tokens=False)["input_ids"]
                counts += torch.bincount(torch.tensor(ids, dtype=torch.long), minlength=vocab_size)[:vocab_size]
    return counts


def grown_draft_vocab(old_d2t: torch.Tensor, counts: torch.Tensor, size: int) -> torch.Tensor:
    """Old draft ids plus the most frequent others (ties -> lower id), sorted by target id."""
    if size < old_d2t.numel():
        raise ValueError(f"--draft-vocab-size {size} is below the drafter's {old_d2t.numel()}: growing only adds tokens")
    if size > counts.numel():
        raise ValueError(f"--draft-vocab-size {size} exceeds the target vocabulary {counts.numel()}")
    ranked = counts.clone()
    ranked[old_d2t] = float("inf")
    order = torch.sort(-ranked, stable=True).indices
    return torch.sort(order[:size]).values


def grow_state(state: dict[str, torch.Tensor], *, new_d2t: torch.Tensor | None, markov_rank: int | None,
               generator: torch.Generator) -> dict[str, torch.Tensor]:
    """The grown state dict (see the module docstring); inputs are left untouched."""
    state = dict(state)
    w1, w2 = state["markov.markov_w1.weight"], state["markov.markov_w2.weight"]  # [Vd + 1, r], [Vd, r]
    old_d2t = state["d2t"]
    vd, rank = w2.shape
    if new_d2t is not None and new_d2t.numel() != vd:
        position = torch.searchsorted(new_d2t, old_d2t)  # where each old draft id sits in the new order
        if not torch.equal(new_d2t[position], old_d2t):
            raise ValueError("the new draft vocabulary must contain every old draft id")
        new_vd = new_d2t.numel()
        g1 = w1[vd].expand(new_vd + 1, rank).clone()  # added tokens were W1's spare row until now
        g1[position] = w1[:vd]
        g2 = torch.zeros(new_vd, rank, dtype=w2.dtype)
        g2[position] = w2
        w1, w2, vd = g1, g2, new_vd
        state["d2t"] = new_d2t.to(old_d2t.dtype)
    if markov_rank is not None and markov_rank != rank:
        if markov_rank < rank:
            raise ValueError(f"--markov-rank {markov_rank} is below the drafter's {rank}: growing only adds")
        extra = markov_rank - rank
        scale = w1.float().std().item()
        w1 = torch.cat([w1, (torch.randn(vd + 1, extra, generator=generator) * scale).to(w1.dtype)], dim=1)
        w2 = torch.cat([w2, torch.zeros(vd, extra, dtype=w2.dtype)], dim=1)
        if "confidence.weight" in state:  # [1, hidden + rank]: the Markov features come last
            cw = state["confidence.weight"]
            state["confidence.weight"] = torch.cat([cw, torch.zeros(1, extra, dtype=cw.dtype)], dim=1)
    state["markov.markov_w1.weight"], state["markov.markov_w2.weight"] = w1.contiguous(), w2.contiguous()
    return state


def grow_config(config: dict, *, draft_vocab_size: int, markov_rank: int) -> dict:
    config = json.loads(json.dumps(config))
    for section in (config, config["hspec"]):
        section["draft_vocab_size"] = draft_vocab_size
        section["markov_rank"] = markov_rank
    return config


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint", type=Path, help="a drafter directory (config.json + model.safetensors)")
    ap.add_argument("--out", type=Path, required=True, help="directory to write (created if missing)")
    ap.add_argument("--draft-vocab-size", type=int, help="new draft vocabulary size (needs --data)")
    ap.add_argument("--data", type=Path, help="SpecForge JSONL whose assistant turns rank the added tokens")
    ap.add_argument("--heldout", type=Path, help="also report coverage on these conversations (e.g. heldout.jsonl)")
    ap.add_argument("--markov-rank", type=int, help="new Markov rank")
    ap.add_argument("--seed", type=int, default=0, help="seed of the new W1 columns")
    args = ap.parse_args(argv)
    for name in ("config.json", "model.safetensors"):
        if not (args.checkpoint / name).is_file():
            ap.error(f"{args.checkpoint / name} does not exist: pass a drafter directory")
    cfg = read_checkpoint_config(args.checkpoint)
    if not cfg.markov_rank:
        ap.error(f"{args.checkpoint} has no Markov head (markov_rank 0): nothing here to grow")
    if args.draft_vocab_size is not None and args.data is None:
        ap.error("--draft-vocab-size needs --data (the conversations whose tokens fill the new vocabulary)")
    for flag, path in (("--data", args.data), ("--heldout", args.heldout)):
        if path is not None and not path.is_file():
            ap.error(f"{flag} {path} does not exist")
    state = read_checkpoint_weights(args.checkpoint)
    new_d2t = None
    if args.draft_vocab_size is not None and args.draft_vocab_size != cfg.draft_vocab_size:
        from transformers import AutoTokenizer

        from sglang_hspec.assets.embedded import embedded_target_dir

        tokenizer = AutoTokenizer.from_pretrained(embedded_target_dir())
        counts = assistant_token_counts(args.data, tokenizer, cfg.target.vocab_size)
        try:
            new_d2t = grown_draft_vocab(state["d2t"], counts, args.draft_vocab_size)
        except ValueError as e:
            ap.error(str(e))
        # the share of target-written tokens the drafter can draft at all, before and after
        for path in filter(None, (args.data, args.heldout)):
            seen = counts if path == args.data else assistant_token_counts(path, tokenizer, cfg.target.vocab_size)
            share = [seen[d2t].sum().item() / seen.sum().item() for d2t in (state["d2t"], new_d2t)]
            print(f"assistant-token coverage of {path}: {share[0]:.4f} ({cfg.draft_vocab_size}) -> "
                  f"{share[1]:.4f} ({args.draft_vocab_size})")
    try:
        grown = grow_state(state, new_d2t=new_d2t, markov_rank=args.markov_rank,
                           generator=torch.Generator().manual_seed(args.seed))
    except ValueError as e:
        ap.error(str(e))
    config = grow_config(json.loads((args.checkpoint / "config.json").read_text()),
                         draft_vocab_size=grown["d2t"].numel(), markov_rank=grown["markov.markov_w2.weight"].shape[1])
    with safe_open(str(args.checkpoint / "model.safetensors"), "pt") as f:
        metadata = f.metadata() or {"format": "pt"}
    write_checkpoint(args.out, state=grown, metadata=metadata, config_text=json.dumps(config, indent=2) + "\n")
    read_checkpoint_config(args.out)  # the written config validates
    print(f"wrote {args.out}: draft vocabulary {config['draft_vocab_size']}, Markov rank {config['markov_rank']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
