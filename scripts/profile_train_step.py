"""Where a drafter training step's time goes, with the target's features already in memory.

    python scripts/profile_train_step.py [--config configs/train_hspec_smollm2.yaml]
        [--data data/smollm2_prompts/train.jsonl] [--repeats 5] [--top 25] [section.key=value ...]

Runs the frozen target once on the first micro-batch of the config (the feature-cache case), then times the
drafter's forward + loss + backward with the two attention context paths interleaved in one process: the
per-block window copy (`gather_windows=True`, the inference layout) and each sequence's KV read in place
(`training.sequence_attention`, the default). It ends with a `torch.profiler` table of the default path
(self CPU time per op, and per op and input shape). The drafter runs under the trainer's bf16 autocast where
`training.bf16` is set and bf16 pays at training's row counts. Prints the CPU model, flags, dtype and threads
(HSPEC_TRAIN_THREADS, default all).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from sglang_hspec.target.dtypes import describe_machine
from sglang_hspec.training import trainer
from sglang_hspec.training.config import load_config
from sglang_hspec.training.losses import block_loss, sample_anchors, slot_mask


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/train_hspec_smollm2.yaml")
    ap.add_argument("--data", default="data/smollm2_prompts/train.jsonl")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if "HSPEC_TRAIN_THREADS" in os.environ:
        torch.set_num_threads(int(os.environ["HSPEC_TRAIN_THREADS"]))
    cfg = load_config(args.config, [f"data.train_path={args.data}", "data.feature_cache=null", *args.overrides])
    from sglang_hspec.target.adapter import TargetAdapter
    from sglang_hspec.target.loading import load_target

    loaded = load_target(cfg.model.target, dtype=cfg.model.target_dtype, tiny_kwargs=cfg.model.target_kwargs,
                         workload="batch")
    target = loaded.model.eval().requires_grad_(False)
    adapter = TargetAdapter(target)
    examples = trainer._load_examples(cfg, loaded.tokenizer)
    torch.manual_seed(cfg.training.seed)
    drafter = trainer.build_model(cfg, target, examples).train()
    batch = examples[: cfg.data.batch_size]
    ids, lmask, lengths = trainer.collate(batch, 0)
    anchors, valid = sample_anchors(loss_mask=lmask, lengths=lengths, num_anchors=cfg.data.num_anchors,
                                    seeds=[trainer.example_seed(cfg.training.seed, 0, i) for i in range(len(batch))])
    smask = slot_mask(anchors=anchors, anchor_valid=valid, loss_mask=lmask, lengths=lengths,
                      block_size=cfg.model.block_size)
    with torch.no_grad():
        feats, probs = trainer._target_side(cfg, adapter, drafter, None, batch, ids, lengths)
    t = cfg.training
    bf16 = trainer.drafter_bf16("cpu", t)  # the trainer's autocast over the drafter's forward and loss
    amp = torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16)
    print(f"{describe_machine()} | target dtype {adapter.dtype}, drafter autocast {'bf16' if bf16 else 'off'} | "
          f"{cfg.model.kind}: {int(valid.sum())} valid blocks of {cfg.model.block_size} tokens, "
          f"sequences {tuple(ids.shape)}")

    def step(gather: bool) -> None:
        with amp:
            out = drafter.forward_train(feats, ids, anchors, anchor_valid=valid, gather_windows=gather)
            loss = block_loss(draft_logits=out.logits, confidence_logits=out.confidence_logits, target_probs=probs,
                              target_vocab_size=drafter.config.target.vocab_size, compact=True, input_ids=ids,
                              anchors=anchors, mask=smask, d2t=drafter.d2t, gamma_decay=t.gamma_decay,
                              ce_weight=t.ce_weight, tv_weight=t.tv_weight, conf_weight=t.conf_weight)
        loss.loss_sum.backward()
        drafter.zero_grad(set_to_none=True)

    times = {True: [], False: []}
    for gather in (True, False):
        step(gather)  # warm-up: one-off allocations
    for _ in range(args.repeats):
        for gather in (True, False):
            t0 = time.perf_counter()
            step(gather)
            times[gather].append(time.perf_counter() - t0)
    med = {g: statistics.median(v) for g, v in times.items()}
    blocks = int(valid.sum())
    for gather, label in ((True, "window copied per block"), (False, "sequence KV in place   ")):
        print(f"{label}: median {med[gather]:.3f} s per step, {blocks / med[gather]:.1f} blocks/s "
              f"(steps {[round(x, 3) for x in times[gather]]})")
    print(f"in place / copied: {med[True] / med[False]:.2f}x faster")
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        step(False)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top))
    print(prof.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total", row_limit=args.top))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
