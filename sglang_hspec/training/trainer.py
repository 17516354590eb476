"""`hspec train --config configs/<name>.yaml [section.key=value ...]`: one recipe for every drafter kind.

Online target features, no caches: each micro-batch runs the frozen target once (hidden states of the
drafter's layers, their post-RoPE KV, next-token logits), samples anchors inside the loss mask and runs
the drafter over all anchors in one batched call. Runs unchanged on CPU, one GPU, or many through
`torchrun` (DistributedDataParallel; gloo on CPU, nccl on GPU).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from tqdm import tqdm

from sglang_hspec.target.dtypes import bf16_is_fast, resolve_dtype
from sglang_hspec.training.config import TrainConfig, check_against_target, check_block_size, load_config
from sglang_hspec.training.data import load_examples, patterned_examples, read_jsonl
from sglang_hspec.training.losses import block_loss, position_weights, sample_anchors, slot_mask

STATE_FILE = "trainer_state.pt"


# ------------------------------------------------------------------ target and drafter
def load_target(name: str, *, dtype: str = "auto", target_kwargs: dict[str, Any] | None = None, device="cpu"):
    """(frozen model, tokenizer or None) for "smollm2", "tiny" or a local HF directory."""
    torch_dtype = resolve_dtype(dtype, torch.device(device).type)
    if name == "smollm2":
        from sglang_hspec.assets.embedded import load_embedded_target

        model, tok = load_embedded_target(dtype=torch_dtype, device=device)
    elif name == "tiny":
        from sglang_hspec.assets.tiny import tiny_target

        model, tok = tiny_target(dtype=torch_dtype, **(target_kwargs or {})).to(device), None
    elif Path(name).is_dir():
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(name, dtype=torch_dtype).to(device)
        tok = AutoTokenizer.from_pretrained(name)
    else:
        raise ValueError(f"model.target {name!r} is neither 'smollm2', 'tiny' nor a local model directory")
    model.eval().requires_grad_(False)
    return model, tok


def drafter_config(cfg: TrainConfig, target_model):
    from sglang_hspec.model import HSpecConfig
    from sglang_hspec.target.geometry import TargetGeometry

    m = cfg.model
    fields = {"target": TargetGeometry.from_hf_config(target_model.config), "kind": m.kind,
              "target_layer_ids": tuple(m.target_layer_ids), "block_size": m.block_size,
              "kv_reuse_layer_ids": tuple(m.kv_layer_ids) if m.kv_layer_ids else None,
              "intermediate_size": target_model.config.intermediate_size}
    clash = sorted(set(fields) & set(m.drafter) - {"intermediate_size"})
    if clash:
        raise ValueError(f"model.drafter sets {clash}; set them through model.kind / target_layer_ids / "
                         "kv_layer_ids / block_size instead")
    try:
        return HSpecConfig(**{**fields, **m.drafter})
    except TypeError as e:
        raise ValueError(f"model.drafter: {e}; see sglang_hspec/model/config.py (HSpecConfig) for its fields") from None


def build_model(cfg: TrainConfig, target_model, examples: list[dict[str, Any]]) -> nn.Module:
    """A fresh drafter, its draft vocabulary from the training data's token counts."""
    from sglang_hspec.model import build_draft_vocab, build_drafter

    dc = drafter_config(cfg, target_model)
    drafter = build_drafter(cfg.model.kind, dc, target_model.get_input_embeddings(), target_model.get_output_embeddings())
    V = dc.target.vocab_size
    if dc.draft_vocab_size < V:
        counts = torch.zeros(V)
        for ex in examples:
            counts += torch.bincount(torch.tensor(ex["input_ids"]), minlength=V)[:V].float()
        drafter.set_draft_vocab(build_draft_vocab(counts, dc.draft_vocab_size, always_include=(dc.mask_token_id,)))
    return drafter


class DrafterLoss(nn.Module):
    """The drafter plus its loss as one module, so DistributedDataParallel wraps a plain forward."""

    def __init__(self, drafter: nn.Module, cfg: TrainConfig):
        super().__init__()
        self.drafter = drafter
        self.cfg = cfg

    def forward(self, features, input_ids, anchors, mask):
        t = self.cfg.training
        out = self.drafter.forward_train(features, input_ids, anchors)
        return block_loss(
            draft_logits=out.logits, confidence_logits=out.confidence_logits, target_logits=features.logits,
            input_ids=input_ids, anchors=anchors, mask=mask, d2t=self.drafter.d2t, gamma_decay=t.gamma_decay,
            ce_weight=t.ce_weight, tv_weight=t.tv_weight, conf_weight=t.conf_weight, chunk_rows=t.loss_chunk_rows,
        )


# ------------------------------------------------------------------ data order
def example_seed(seed: int, epoch: int, index: int) -> int:
    """Anchor seed of one example occurrence: independent of rank and micro-batch layout."""
    return int.from_bytes(hashlib.sha1(f"{seed}:{epoch}:{index}".encode()).digest()[:8], "big") >> 1


def micro_batch_items(n: int, *, seed: int, position: int, count: int) -> list[tuple[int, int]]:
    """Items `position .. position+count-1` of the endless stream of seeded epoch permutations."""
    items, perms = [], {}
    for p in range(position, position + count):
        epoch, i = divmod(p, n)
        if epoch not in perms:
            perms[epoch] = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1000003 + epoch)).tolist()
        items.append((epoch, perms[epoch][i]))
    return items


def collate(examples: list[dict[str, Any]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    T = max(len(e["input_ids"]) for e in examples)
    ids = torch.full((len(examples), T), pad_id, dtype=torch.long)
    mask = torch.zeros(len(examples), T, dtype=torch.long)
    for b, e in enumerate(examples):
        ids[b, : len(e["input_ids"])] = torch.tensor(e["input_ids"])
        mask[b, : len(e["loss_mask"])] = torch.tensor(e["loss_mask"])
    lengths = torch.tensor([len(e["input_ids"]) for e in examples])
    return ids, mask, lengths


# ------------------------------------------------------------------ the loop
@dataclass
class StepMetrics:
    step: int
    loss: float
    ce: float
    tv: float
    bce: float
    tau_prob: float
    accept: list[float]
    lr: float
    grad_norm: float


@dataclass
class TrainResult:
    history: list[StepMetrics] = field(default_factory=list)
    checkpoints: list[str] = field(default_factory=list)
    drafter: nn.Module | None = None


def _lr_lambda(cfg: TrainConfig):
    total = cfg.training.max_steps
    warm = int(round(cfg.training.warmup_ratio * total))

    def f(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        progress = (step - warm) / max(1, total - warm)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return f


def _device(cfg: TrainConfig) -> torch.device:
    d = cfg.training.device
    if d == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        return torch.device("cpu")
    return torch.device(d)


def _load_examples(cfg: TrainConfig, tokenizer) -> list[dict[str, Any]]:
    d = cfg.data
    if d.synthetic is not None:
        recs = patterned_examples(**d.synthetic.model_dump())
    else:
        if not Path(d.train_path).is_file():
            raise FileNotFoundError(f"data.train_path {d.train_path} not found; build it with `hspec data build`")
        recs = read_jsonl(d.train_path)
    examples = load_examples(recs, tokenizer=tokenizer, max_length=d.max_length)
    if not examples:
        raise ValueError("no training example has an assistant token to anchor on; check the data and its loss mask")
    return examples


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    # checkpoint-<step> only: a half-written checkpoint-<step>.tmp from a killed run is not a candidate
    ckpts = [c for c in Path(output_dir).glob("checkpoint-*") if c.name.split("-", 1)[1].isdigit()]
    ckpts = sorted((c for c in ckpts if (c / STATE_FILE).is_file()), key=lambda c: int(c.name.split("-", 1)[1]))
    return ckpts[-1] if ckpts else None


def _rng_state() -> dict[str, Any]:
    return {"torch": torch.get_rng_state(), "python": random.getstate(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def train(cfg: TrainConfig, *, target=None, tokenizer=None, progress: bool = True) -> TrainResult:
    """Train the configured drafter. `target` / `tokenizer` override model.target (tests pass a
    pre-trained tiny target)."""
    t = cfg.training
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    device = _device(cfg)
    if distributed and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    torch.manual_seed(t.seed)
    random.seed(t.seed)

    if target is None:
        target, tokenizer = load_target(cfg.model.target, dtype=cfg.model.target_dtype,
                                        target_kwargs=cfg.model.target_kwargs, device=device)
    target = target.to(device).eval().requires_grad_(False)
    check_against_target(cfg, num_target_layers=target.config.num_hidden_layers)
    from sglang_hspec.target.adapter import TargetAdapter

    adapter = TargetAdapter(target)
    examples = _load_examples(cfg, tokenizer)

    resume = t.resume_from
    if resume == "auto":
        resume = latest_checkpoint(t.output_dir)
    init_dir = resume or cfg.model.init_from
    if init_dir is not None:
        saved = json.loads((Path(init_dir) / "drafter" / "config.json").read_text())
        check_block_size(cfg, checkpoint_block_size=int(saved["block_size"]), checkpoint=str(init_dir))
    drafter = build_model(cfg, target, examples).to(device)
    if init_dir is not None:
        drafter.load_state_dict(torch.load(Path(init_dir) / STATE_FILE, weights_only=False)["drafter"])
    module = DrafterLoss(drafter, cfg)
    if distributed:
        module = nn.parallel.DistributedDataParallel(module, device_ids=[device.index] if device.type == "cuda" else None)
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=t.lr, betas=tuple(t.betas), weight_decay=t.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _lr_lambda(cfg))
    start = 0
    if resume is not None:
        state = torch.load(Path(resume) / STATE_FILE, weights_only=False)
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        start = int(state["step"])
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(state["rng"]["python"])

    pad_id = getattr(target.config, "pad_token_id", None) or 0
    per_micro = cfg.data.batch_size * world  # sequences per micro-batch over all ranks
    # bf16 autocast only where bf16 is native: on AVX2-only CPUs it is ~50x slower than fp32
    amp = torch.autocast(device.type, dtype=torch.bfloat16, enabled=t.bf16 and bf16_is_fast(device.type))
    result = TrainResult(drafter=drafter)
    end = t.max_steps if t.stop_after is None else t.stop_after
    bar = tqdm(range(start, end), desc=f"train {cfg.model.kind}", disable=not progress or rank != 0,
               initial=start, total=end)
    for step in bar:
        # every micro-batch of this step (for this rank), with its anchors and masks
        micro = []
        for m in range(t.grad_accum):
            items = micro_batch_items(len(examples), seed=t.seed, position=(step * t.grad_accum + m) * per_micro,
                                      count=per_micro)
            mine = items[rank * cfg.data.batch_size: (rank + 1) * cfg.data.batch_size]
            ids, lmask, lengths = collate([examples[i] for _, i in mine], pad_id)
            anchors, ok = sample_anchors(loss_mask=lmask, lengths=lengths, num_anchors=cfg.data.num_anchors,
                                         seeds=[example_seed(t.seed, e, i) for e, i in mine])
            smask = slot_mask(anchors=anchors, anchor_valid=ok, loss_mask=lmask, lengths=lengths,
                              block_size=cfg.model.block_size)
            micro.append((ids.to(device), anchors.to(device), smask.to(device)))
        # the loss is a weighted mean over every slot of the global batch: its denominator first
        w = position_weights(block_size=cfg.model.block_size, gamma_decay=t.gamma_decay, device=device)
        denom = sum((mk.float() * w).sum() for _, _, mk in micro)
        if distributed:
            dist.all_reduce(denom)
        denom = denom.clamp_min(1e-8)
        totals = torch.zeros(6, device=device)  # loss, ce, tv, bce, tau, anchors
        acc = torch.zeros(2, cfg.model.block_size, device=device)
        for m, (ids, anchors, smask) in enumerate(micro):
            with torch.no_grad(), amp:
                feats = adapter.full_forward(ids, hidden_layer_ids=drafter.target_layer_ids,
                                             kv_layer_ids=drafter.kv_layer_ids, return_logits=True)
            sync = not distributed or m == t.grad_accum - 1
            ctx = module.no_sync() if not sync else contextlib.nullcontext()
            with ctx:
                with amp:
                    out = module(feats, ids, anchors, smask)
                # DDP averages gradients over ranks; scale so the result is the global weighted mean
                (out.loss_sum * world / denom).backward()
            totals += torch.stack([out.loss_sum.detach(), out.ce_sum, out.tv_sum, out.bce_sum, out.tau_sum,
                                   out.num_anchors.float()])
            acc += torch.stack([out.accept_sum, out.accept_count])
        if distributed:
            dist.all_reduce(totals)
            dist.all_reduce(acc)
        grad_norm = torch.nn.utils.clip_grad_norm_(params, t.max_grad_norm)
        lr = sched.get_last_lr()[0]
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        metrics = StepMetrics(
            step=step + 1, loss=float(totals[0] / denom), ce=float(totals[1] / denom), tv=float(totals[2] / denom),
            bce=float(totals[3] / denom), tau_prob=float(totals[4] / totals[5].clamp_min(1)),
            accept=[round(float(x), 4) for x in acc[0] / acc[1].clamp_min(1)], lr=lr, grad_norm=float(grad_norm),
        )
        result.history.append(metrics)
        bar.set_postfix(loss=f"{metrics.loss:.4f}", tau=f"{metrics.tau_prob:.3f}", lr=f"{lr:.2e}")
        if rank == 0 and (t.log_every and (step + 1) % t.log_every == 0 or step + 1 == end):
            Path(t.output_dir).mkdir(parents=True, exist_ok=True)
            with open(Path(t.output_dir) / "train_log.jsonl", "a") as f:
                f.write(json.dumps(metrics.__dict__) + "\n")
        if (t.save_every and (step + 1) % t.save_every == 0) or step + 1 == end:
            if rank == 0:
                result.checkpoints.append(str(save_checkpoint(cfg, drafter, opt, sched, step + 1)))
            if distributed:
                dist.barrier()
    bar.close()
    return result


def save_checkpoint(cfg: TrainConfig, drafter: nn.Module, opt, sched, step: int) -> Path:
    """checkpoint-<step>/: drafter/ (config.json + model.safetensors, what serving loads) and
    trainer_state.pt (optimizer, scheduler, step, RNG, config: what exact resume needs)."""
    from sglang_hspec.model import save_drafter

    out = Path(cfg.training.output_dir) / f"checkpoint-{step}"
    tmp = out.with_name(out.name + ".tmp")
    save_drafter(drafter, tmp / "drafter")
    torch.save({"drafter": drafter.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
                "step": step, "rng": _rng_state(), "config": cfg.model_dump()}, tmp / STATE_FILE)
    if out.exists():
        import shutil

        shutil.rmtree(out)
    tmp.rename(out)
    return out


# ------------------------------------------------------------------ CLI
def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("train", help="train a drafter (any kind) against a frozen target")
    p.add_argument("--config", required=True, help="configs/train_<kind>_<target>.yaml")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. training.lr=3e-4 data.batch_size=2")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=run_cli)
    return p


def run_cli(args) -> int:
    torch.set_num_threads(max(1, int(os.environ.get("HSPEC_TRAIN_THREADS", torch.get_num_threads()))))
    cfg = load_config(args.config, args.overrides)
    result = train(cfg, progress=not args.no_progress)
    if result.history:
        last = result.history[-1]
        print(json.dumps({"step": last.step, "loss": last.loss, "tau_prob": last.tau_prob,
                          "accept": last.accept, "checkpoints": result.checkpoints}))
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sglang_hspec.training.trainer")
    sub = parser.add_subparsers(dest="command", required=True)
    add_parser(sub)
    args = parser.parse_args(["train", *(argv if argv is not None else __import__("sys").argv[1:])])
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
