"""`hspec train --config configs/<name>.yaml [section.key=value ...]`: one recipe for every drafter kind.

Each micro-batch gets the frozen target's features (hidden states of the drafter's layers, their
post-RoPE KV, final-norm hidden states) from one target forward, or from the feature cache
(`data.feature_cache`, features.py) when the target already ran on those examples; samples anchors
inside the loss mask and runs the drafter over all valid anchors in one batched call. The target's
next-token distribution is computed once per position, over the draft vocabulary. Prints training
tokens/s and anchored blocks/s. Checkpoints are written atomically (temp dir + rename) with the RNG
state, so a run killed at any point (SIGKILL included) resumes with `training.resume_from=auto` to the
same per-step losses. Runs unchanged on CPU, one GPU, or many through `torchrun`
(DistributedDataParallel; gloo on CPU, nccl on GPU).
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import hashlib
import json
import math
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from tqdm import tqdm

from sglang_hspec.core.atomic import atomic_write_text
from sglang_hspec.target.dtypes import bf16_is_fast
from sglang_hspec.target.loading import resolve_device
from sglang_hspec.training.config import TrainConfig, check_against_target, check_block_size, load_config
from sglang_hspec.training.data import load_examples, load_examples_cached, patterned_examples
from sglang_hspec.training.losses import (
    block_loss,
    compile_loss_kernels,
    lm_head_log_partition,
    position_weights,
    sample_anchors,
    slot_mask,
    target_draft_probs,
)

STATE_FILE = "trainer_state.pt"


# ------------------------------------------------------------------ target and drafter
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
    if cfg.model.init == "target_layers":
        init_from_target_layers(drafter, target_model)
    return drafter


def target_layer_map(drafter: nn.Module) -> list[int]:
    """The target layer each drafter layer is initialised from: an attention layer from the target layer
    whose KV it reads (its mapped id; the last target_layer_ids for kinds that read none), a layer
    without attention from the target's last decoder layer."""
    cfg = drafter.config
    n_attn = cfg.num_attention_layers
    attn_ids = list(cfg.kv_reuse_layer_ids) or list(cfg.target_layer_ids[-n_attn:] if n_attn else [])
    last = cfg.target.num_hidden_layers - 1
    out, i = [], 0
    for layer in drafter.layers:
        if layer.attn is not None:
            out.append(int(attn_ids[i]))
            i += 1
        else:
            out.append(last)
    return out


@torch.no_grad()
def init_from_target_layers(drafter: nn.Module, target_model) -> None:
    """`model.init: target_layers` (see config.py): layer-skip self-speculation as the starting point.
    Drafter layer i takes q/k/v/o (and q/k norms), the pre-attention and pre-MLP norms and the SwiGLU MLP
    of target layer target_layer_map[i]; the final norm is the target's (it feeds the same LM head); each
    Mamba mixer's out_proj starts at zero, so the untrained drafter is exactly that shallow copy of the
    target and the Mamba branches grow in from there. The drafter's hidden size is the target's by
    construction; attention biases (Qwen2) have no slot in the drafter and are left out."""
    src_layers = target_model.model.layers
    for layer, src_id in zip(drafter.layers, target_layer_map(drafter)):
        src = src_layers[src_id]
        pairs = [(layer.mlp_norm.weight, src.post_attention_layernorm.weight)]
        pairs += [(getattr(layer.mlp, n).weight, getattr(src.mlp, n).weight) for n in ("gate_proj", "up_proj", "down_proj")]
        if layer.attn is not None:
            pairs.append((layer.attn_norm.weight, src.input_layernorm.weight))
            pairs += [(getattr(layer.attn, n).weight, getattr(src.self_attn, n).weight)
                      for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
            for n in ("q_norm", "k_norm"):
                if getattr(layer.attn, n) is not None and getattr(src.self_attn, n, None) is not None:
                    pairs.append((getattr(layer.attn, n).weight, getattr(src.self_attn, n).weight))
        for dst, w in pairs:
            if dst.shape != w.shape:
                raise ValueError(
                    f"model.init=target_layers: drafter weight {tuple(dst.shape)} cannot start from target layer "
                    f"{src_id}'s {tuple(w.shape)}; the MLP must be the target's width (drop "
                    "model.drafter.intermediate_size) or use model.init=random")
            dst.copy_(w.to(dst.dtype))
        if layer.mamba is not None:
            layer.mamba.out_proj.weight.zero_()
    drafter.norm.weight.copy_(target_model.model.norm.weight.to(drafter.norm.weight.dtype))


class DrafterLoss(nn.Module):
    """The drafter plus its loss as one module, so DistributedDataParallel wraps a plain forward."""

    def __init__(self, drafter: nn.Module, cfg: TrainConfig):
        super().__init__()
        self.drafter = drafter
        self.cfg = cfg

    def forward(self, features, input_ids, anchors, mask, anchor_valid, target_probs=None):
        """target_probs (`TargetProbs`) or, without it, full-vocabulary features.logits."""
        t = self.cfg.training
        out = self.drafter.forward_train(features, input_ids, anchors,
                                         anchor_valid=anchor_valid if t.pack_anchors else None,
                                         gather_windows=not t.sequence_attention)
        return block_loss(
            draft_logits=out.logits, confidence_logits=out.confidence_logits,
            target_logits=None if target_probs is not None else features.logits, target_probs=target_probs,
            target_vocab_size=self.drafter.config.target.vocab_size, compact=t.pack_anchors,
            input_ids=input_ids, anchors=anchors, mask=mask, d2t=self.drafter.d2t, gamma_decay=t.gamma_decay,
            ce_weight=t.ce_weight, tv_weight=t.tv_weight, conf_weight=t.conf_weight, chunk_rows=t.loss_chunk_rows,
        )


COMPILE_BACKEND = "inductor"  # tests use "aot_eager": the same captured graphs and autograd, no C++ codegen


def use_compiled_kernels(enabled: bool, device: torch.device) -> None:
    """`training.compile`: the training step's elementwise-heavy cores (the drafter's block attention over its
    sequence's KV, the loss's per-row softmax / TV / CE) under torch.compile, or back to eager. Inductor
    builds C++ kernels on a CPU, so a missing compiler is named here rather than deep inside the first step."""
    from sglang_hspec.model.hspec import compile_training_kernels

    backend = COMPILE_BACKEND if enabled else None
    if enabled and device.type == "cpu" and backend == "inductor":
        cxx = os.environ.get("CXX") or next((c for c in ("g++", "c++", "clang++") if shutil.which(c)), None)
        if cxx is None or shutil.which(cxx) is None:
            raise ValueError("training.compile=true needs a C++ compiler on a CPU (torch inductor builds its kernels "
                             "with one) and none was found (CXX, g++, c++, clang++); install one (e.g. apt install "
                             "g++) or set training.compile=false")
    compile_training_kernels(backend)
    compile_loss_kernels(backend)


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
    tokens: int = 0  # real (unpadded) tokens of the global batch
    blocks: int = 0  # anchored blocks (valid anchors) of the global batch
    seconds: float = 0.0  # wall time of the step (features, forward, backward, optimizer)


@dataclass
class TrainResult:
    history: list[StepMetrics] = field(default_factory=list)
    checkpoints: list[str] = field(default_factory=list)
    drafter: nn.Module | None = None
    cache_stats: dict[str, Any] | None = None

    def throughput(self) -> dict[str, float]:
        """Training tokens/s and anchored blocks/s over the run (the first step, which pays one-off
        allocations and warm-up, is left out when there are more)."""
        steps = self.history[1:] if len(self.history) > 1 else self.history
        secs = sum(m.seconds for m in steps) or float("nan")
        return {"tokens_per_s": sum(m.tokens for m in steps) / secs, "blocks_per_s": sum(m.blocks for m in steps) / secs}


def _lr_lambda(cfg: TrainConfig):
    total = cfg.training.max_steps
    warm = int(round(cfg.training.warmup_ratio * total))

    def f(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        progress = (step - warm) / max(1, total - warm)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return f


def drafter_bf16(device_type: str, training) -> bool:
    """Whether the drafter trains under bf16 autocast: `training.bf16` is set and bf16 is faster at
    training's row counts (target/dtypes.py, workload 'batch'; on AVX2-only CPUs bf16 is ~50x slower)."""
    return training.bf16 and bf16_is_fast(device_type, "batch")


def _device(cfg: TrainConfig) -> torch.device:
    d = cfg.training.device
    if d == "auto" and torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return resolve_device(d, flag="training.device")


def _load_examples(cfg: TrainConfig, tokenizer, *, progress: bool = False) -> list[dict[str, Any]]:
    from sglang_hspec.assets.embedded import default_cache_dir

    d = cfg.data
    if d.synthetic is not None:
        examples = load_examples(patterned_examples(**d.synthetic.model_dump()), tokenizer=tokenizer,
                                 max_length=d.max_length)
    else:
        from sglang_hspec.training.packed import is_packed, load_packed_examples

        if is_packed(d.train_path):  # a packed set (training/packed.py): already tokenized, checked by sha256
            return load_packed_examples(d.train_path, tokenizer=tokenizer, max_length=d.max_length)
        if not Path(d.train_path).is_file():
            raise FileNotFoundError(f"data.train_path {d.train_path} not found; build it with `hspec data build`, "
                                    "or point it at a packed directory (its manifest.json)")
        examples = load_examples_cached(d.train_path, tokenizer=tokenizer, max_length=d.max_length,
                                        cache_dir=default_cache_dir() / "examples" if d.tokenized_cache else None,
                                        progress=progress)
    if not examples:
        raise ValueError("no training example has an assistant token to anchor on; check the data and its loss mask")
    return examples


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    # checkpoint-<step> only: the hidden temp dir (.checkpoint-<step>-*) of a killed save is not a candidate
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
        # looked up per call, not at import: scripts/bad_inputs.py patches it to load the target once
        from sglang_hspec.target.loading import load_target

        loaded = load_target(cfg.model.target, dtype=cfg.model.target_dtype,
                             tiny_kwargs=cfg.model.target_kwargs, device=device, workload="batch")
        target, tokenizer = loaded.model, loaded.tokenizer
    target = target.to(device).eval().requires_grad_(False)
    check_against_target(cfg, num_target_layers=target.config.num_hidden_layers, vocab_size=target.config.vocab_size)
    from sglang_hspec.target.adapter import TargetAdapter

    adapter = TargetAdapter(target)
    examples = _load_examples(cfg, tokenizer, progress=progress and rank == 0)

    resume = t.resume_from
    if resume == "auto":
        resume = latest_checkpoint(t.output_dir)
    init_dir = resume or cfg.model.init_from
    weights_dir = None
    if init_dir is not None:
        weights_dir = _init_weights_dir(Path(init_dir), flag="training.resume_from" if resume else "model.init_from")
        saved = json.loads((weights_dir / "config.json").read_text())
        check_block_size(cfg, checkpoint_block_size=int(saved["block_size"]), checkpoint=str(init_dir))
    drafter = build_model(cfg, target, examples).to(device)
    if init_dir is not None:
        if (Path(init_dir) / STATE_FILE).is_file():
            drafter.load_state_dict(torch.load(Path(init_dir) / STATE_FILE, weights_only=False)["drafter"])
        else:  # a drafter directory (e.g. a shipped checkpoint): its weights and draft vocabulary
            from sglang_hspec.model.checkpoint import load_state_strict, read_checkpoint_weights

            load_state_strict(drafter, read_checkpoint_weights(weights_dir),
                              what=f"model.init_from={init_dir} (a {cfg.model.kind} drafter of this recipe's shape)")
    module = DrafterLoss(drafter, cfg)
    if distributed:
        module = nn.parallel.DistributedDataParallel(module, device_ids=[device.index] if device.type == "cuda" else None)
    use_compiled_kernels(t.compile, device)  # process-wide: set (or reset) for every run
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=t.lr, betas=tuple(t.betas), weight_decay=t.weight_decay,
                            **({"fused": True} if t.fused_optimizer else {}))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _lr_lambda(cfg))
    start = 0
    if resume is not None:
        state = torch.load(Path(resume) / STATE_FILE, weights_only=False)
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        start = int(state["step"])
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(state["rng"]["python"])
        if state["rng"].get("cuda") is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["rng"]["cuda"])
    if rank == 0:
        _clean_output_dir(Path(t.output_dir), keep_log_upto=start)

    cache = None
    if cfg.data.feature_cache is not None:
        from sglang_hspec.training.features import FeatureCache, target_fingerprint

        # a new cache stores what every kind of this recipe reads (see features.py), so they share it
        ids = list(cfg.model.target_layer_ids)
        cache = FeatureCache(cfg.data.feature_cache, target_fingerprint=target_fingerprint(target),
                             hidden_layer_ids=ids,
                             kv_layer_ids=list(dict.fromkeys([*drafter.kv_layer_ids, *ids[-3:]])),
                             dtype=cfg.data.feature_cache_dtype)
        cache.check_covers(hidden_layer_ids=drafter.target_layer_ids, kv_layer_ids=drafter.kv_layer_ids)
        if rank == 0:  # its disk cost, before any of it is written
            cache.plan(examples, target_config=target.config, log_partition=cfg.training.cached_log_partition)

    pad_id = getattr(target.config, "pad_token_id", None) or 0
    per_micro = cfg.data.batch_size * world  # sequences per micro-batch over all ranks
    amp = torch.autocast(device.type, dtype=torch.bfloat16, enabled=drafter_bf16(device.type, t))
    result = TrainResult(drafter=drafter)
    end = t.max_steps if t.stop_after is None else t.stop_after
    bar = tqdm(range(start, end), desc=f"train {cfg.model.kind}", disable=not progress or rank != 0,
               initial=start, total=end)
    for step in bar:
        t0 = time.perf_counter()
        # every micro-batch of this step (for this rank), with its anchors and masks
        micro = []
        for m in range(t.grad_accum):
            items = micro_batch_items(len(examples), seed=t.seed, position=(step * t.grad_accum + m) * per_micro,
                                      count=per_micro)
            mine = items[rank * cfg.data.batch_size: (rank + 1) * cfg.data.batch_size]
            batch = [examples[i] for _, i in mine]
            ids, lmask, lengths = collate(batch, pad_id)
            anchors, ok = sample_anchors(loss_mask=lmask, lengths=lengths, num_anchors=cfg.data.num_anchors,
                                         seeds=[example_seed(t.seed, e, i) for e, i in mine])
            smask = slot_mask(anchors=anchors, anchor_valid=ok, loss_mask=lmask, lengths=lengths,
                              block_size=cfg.model.block_size)
            micro.append((batch, ids.to(device), lengths, anchors.to(device), ok.to(device), smask.to(device)))
        # the loss is a weighted mean over every slot of the global batch: its denominator first
        w = position_weights(block_size=cfg.model.block_size, gamma_decay=t.gamma_decay, device=device)
        denom = sum((mk.float() * w).sum() for *_, mk in micro)
        if distributed:
            dist.all_reduce(denom)
        denom = denom.clamp_min(1e-8)
        totals = torch.zeros(7, device=device)  # loss, ce, tv, bce, tau, anchors, tokens
        acc = torch.zeros(2, cfg.model.block_size, device=device)
        for m, (batch, ids, lengths, anchors, ok, smask) in enumerate(micro):
            with torch.no_grad(), amp:
                feats, target_probs = _target_side(cfg, adapter, drafter, cache, batch, ids, lengths)
            sync = not distributed or m == t.grad_accum - 1
            ctx = module.no_sync() if not sync else contextlib.nullcontext()
            with ctx:
                with amp:
                    out = module(feats, ids, anchors, smask, ok, target_probs)
                # DDP averages gradients over ranks; scale so the result is the global weighted mean
                (out.loss_sum * world / denom).backward()
            totals += torch.stack([out.loss_sum.detach(), out.ce_sum, out.tv_sum, out.bce_sum, out.tau_sum,
                                   out.num_anchors.float(), lengths.sum().to(device).float()])
            acc += torch.stack([out.accept_sum, out.accept_count])
        if distributed:
            dist.all_reduce(totals)
            dist.all_reduce(acc)
        grad_norm = torch.nn.utils.clip_grad_norm_(params, t.max_grad_norm)
        lr = sched.get_last_lr()[0]
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        seconds = time.perf_counter() - t0
        metrics = StepMetrics(
            step=step + 1, loss=float(totals[0] / denom), ce=float(totals[1] / denom), tv=float(totals[2] / denom),
            bce=float(totals[3] / denom), tau_prob=float(totals[4] / totals[5].clamp_min(1)),
            accept=[round(float(x), 4) for x in acc[0] / acc[1].clamp_min(1)], lr=lr, grad_norm=float(grad_norm),
            tokens=int(totals[6]), blocks=int(totals[5]), seconds=round(seconds, 4),
        )
        result.history.append(metrics)
        bar.set_postfix(loss=f"{metrics.loss:.4f}", tau=f"{metrics.tau_prob:.3f}", lr=f"{lr:.2e}",
                        tok_s=f"{metrics.tokens / seconds:.0f}", blk_s=f"{metrics.blocks / seconds:.1f}")
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
    if cache is not None:
        result.cache_stats = {"dir": str(cache.root), "hits": cache.hits, "misses": cache.misses,
                              "written_bytes": cache.bytes_written, "disk_bytes": cache.disk_bytes()}
    return result


def _target_side(cfg: TrainConfig, adapter, drafter, cache, batch, ids, lengths):
    """(features, TargetProbs or None) of one micro-batch: from the cache when every example is in it,
    else from one target forward (whose per-example features then go into the cache). With
    training.target_probs_once=false features.logits holds the full logits instead (reference path)."""
    keys = None
    if cache is not None:
        from sglang_hspec.training.features import example_key

        keys = [example_key(e["input_ids"]) for e in batch]
    need_hidden, need_kv = list(drafter.target_layer_ids), list(drafter.kv_layer_ids)
    if keys is not None and all(cache.has(k) for k in keys):
        return _with_target_probs(cfg, adapter, drafter, cache.load_batch(
            keys, length=ids.shape[1], dtype=adapter.dtype, device=ids.device, hidden_layer_ids=need_hidden,
            kv_layer_ids=need_kv))
    if keys is None:
        feats = adapter.full_forward(ids, hidden_layer_ids=need_hidden, kv_layer_ids=need_kv, return_logits=False)
        return _with_target_probs(cfg, adapter, drafter, feats)
    store_hidden, store_kv = cache.manifest.hidden_layer_ids, cache.manifest.kv_layer_ids
    feats = adapter.full_forward(ids, hidden_layer_ids=store_hidden, kv_layer_ids=store_kv, return_logits=False)
    lm = adapter.lm_head
    for b, (key, n) in enumerate(zip(keys, lengths.tolist())):
        if not cache.has(key):
            cache.misses += 1
            log_partition = None
            if cfg.training.cached_log_partition:  # of the hidden states as stored, so a warm read is exact
                log_partition = lm_head_log_partition(
                    hidden=cache.stored(feats.final_hidden[b, :n]).to(feats.final_hidden.dtype),
                    lm_head_weight=lm.weight, lm_head_bias=lm.bias, chunk_rows=cfg.training.loss_chunk_rows)
            cache.put(key, hidden=None if feats.hidden is None else feats.hidden[b, :n],
                      kv={i: (k[b, :, :n], v[b, :, :n]) for i, (k, v) in feats.kv.items()},
                      final_hidden=feats.final_hidden[b, :n], log_partition=log_partition)
    if need_hidden != store_hidden:
        pick = [store_hidden.index(i) for i in need_hidden]
        feats.hidden = feats.hidden[:, :, pick] if pick else None
    feats.kv = {i: feats.kv[i] for i in need_kv}
    return _with_target_probs(cfg, adapter, drafter, feats)


def _with_target_probs(cfg: TrainConfig, adapter, drafter, feats):
    lm = adapter.lm_head
    if not cfg.training.target_probs_once:
        feats.logits = lm(feats.final_hidden).float()
        return feats, None
    log_partition = feats.log_partition if cfg.training.cached_log_partition else None
    probs = target_draft_probs(d2t=drafter.d2t, hidden=feats.final_hidden, lm_head_weight=lm.weight,
                               lm_head_bias=lm.bias, chunk_rows=cfg.training.loss_chunk_rows,
                               log_partition=log_partition)
    return feats, probs


def _clean_output_dir(out: Path, *, keep_log_upto: int) -> None:
    """Before (re)starting: drop the temp dirs of saves a killed run left behind, and the log records past
    the step training restarts from (they are trained again; a torn last line is dropped too)."""
    if not out.is_dir():
        return
    for tmp in [*out.glob(".checkpoint-*"), *out.glob("checkpoint-*.tmp")]:
        shutil.rmtree(tmp, ignore_errors=True)
    log = out / "train_log.jsonl"
    if not log.is_file():
        return
    kept = []
    for line in log.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict) and int(rec.get("step", 0)) <= keep_log_upto:
            kept.append(line + "\n")
    atomic_write_text(log, "".join(kept))


def _fsync_tree(root: Path) -> None:
    for p in sorted(root.rglob("*"), key=lambda q: len(q.parts), reverse=True):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (the previous one is left as it was)."""


def _init_weights_dir(path: Path, *, flag: str) -> Path:
    """Where the drafter's config.json / model.safetensors are: <checkpoint>/drafter for a training
    checkpoint, the directory itself for a drafter directory (only model.init_from takes one)."""
    if (path / "drafter" / "config.json").is_file():
        return path / "drafter"
    if flag == "model.init_from" and (path / "config.json").is_file() and (path / "model.safetensors").is_file():
        return path
    wanted = (f"{STATE_FILE} and drafter/config.json" if flag != "model.init_from" else
              f"{STATE_FILE} and drafter/ (a training checkpoint) or config.json and model.safetensors (a drafter)")
    raise FileNotFoundError(f"{flag}={path}: no checkpoint there (it needs {wanted}); point it at a "
                            "checkpoint-<step> directory of a training run or at a drafter directory")


def save_checkpoint(cfg: TrainConfig, drafter: nn.Module, opt, sched, step: int) -> Path:
    """checkpoint-<step>/: drafter/ (config.json + model.safetensors, what serving loads) and
    trainer_state.pt (optimizer, scheduler, step, RNG, config: what exact resume needs).

    Atomic: everything is written and fsynced into a hidden temp dir next to it, which is then renamed
    into place, so a kill at any moment leaves either the whole new checkpoint or none (resume then takes
    the previous one). A full disk raises `CheckpointWriteError` naming the fix; earlier checkpoints
    are never touched."""
    from sglang_hspec.model import save_drafter

    root = Path(cfg.training.output_dir)
    root.mkdir(parents=True, exist_ok=True)
    out = root / f"checkpoint-{step}"
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".{out.name}-"))
    try:
        save_drafter(drafter, tmp / "drafter")
        torch.save({"drafter": drafter.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
                    "step": step, "rng": _rng_state(), "config": cfg.model_dump()}, tmp / STATE_FILE)
        _fsync_tree(tmp)
        if out.exists():  # the same step saved again (a re-run slice): swap it out, then drop the old copy
            old = Path(tempfile.mkdtemp(dir=root, prefix=f".{out.name}-old-"))
            os.rename(out, old / out.name)
            os.rename(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, out)
        fd = os.open(root, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            prev = latest_checkpoint(root)
            kept = f"the previous checkpoint {prev} is intact" if prev else "no earlier checkpoint exists"
            raise CheckpointWriteError(
                errno.ENOSPC, f"no space left on device writing {out} ({shutil.disk_usage(root).free / 2**20:.0f} MiB "
                f"free); {kept}. Free space or set training.output_dir to a larger disk, then continue with "
                "training.resume_from=auto") from None
        raise
    return out


# ------------------------------------------------------------------ data parallel on one machine
def rank_overrides(*, batch_size: int, ranks: int) -> list[str]:
    """The per-rank batch of a data-parallel run: the recipe's data.batch_size split over `ranks` processes, so
    the global batch (and with it every loss) stays the recipe's."""
    if ranks < 2:
        raise ValueError(f"--ranks {ranks}: data parallelism needs at least 2 ranks")
    if batch_size % ranks:
        raise ValueError(f"--ranks {ranks} does not divide the recipe's data.batch_size={batch_size}: give a --ranks that "
                         f"divides it, or data.batch_size=<a multiple of {ranks}> as an override")
    return [f"data.batch_size={batch_size // ranks}"]


def single_thread_env(environ: dict[str, str]) -> dict[str, str]:
    """One thread per rank: HSPEC_TRAIN_THREADS alone leaves OpenMP's and MKL's pools at every core, and two
    ranks then oversubscribe the machine (measured: 2.5x fewer blocks together)."""
    return {**environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HSPEC_TRAIN_THREADS": "1"}


def data_parallel_command(*, config: str, overrides: list[str], ranks: int, batch_size: int,
                          progress: bool = True) -> list[str]:
    """torchrun over `ranks` local processes running this trainer with the recipe's global batch."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
            "-m", "sglang_hspec.training.trainer", "--config", str(config), *([] if progress else ["--no-progress"]),
            *overrides, *rank_overrides(batch_size=batch_size, ranks=ranks)]


def resolve_ranks(value: str, cfg: TrainConfig) -> int:
    """--ranks: a count, or `auto` = one rank per usable core on a CPU (the GPUs on CUDA)."""
    if value == "auto":
        if _device(cfg).type == "cuda":
            return torch.cuda.device_count()
        return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        ranks = int(value)
    except ValueError:
        ranks = 0
    if ranks < 1:
        raise ValueError(f"--ranks {value!r}: give a whole number >= 1 or auto")
    if _device(cfg).type == "cuda" and ranks > torch.cuda.device_count():
        raise ValueError(f"--ranks {ranks}: one rank per GPU, and this machine has {torch.cuda.device_count()}; give "
                         "--ranks auto or at most that many")
    return ranks


# ------------------------------------------------------------------ CLI
def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("train", help="train a drafter (any kind) against a frozen target")
    p.add_argument("--config", required=True, help="configs/train_<kind>_<target>.yaml")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. training.lr=3e-4 data.batch_size=2")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--ranks", default="1",
                   help="data-parallel processes on this machine, one thread each (torchrun, gloo on a CPU), sharing the "
                        "recipe's data.batch_size; auto = one per usable core (CPU) or GPU. The same losses; on 2 CPU cores "
                        "2 ranks trained 1.1-1.3x the blocks/s of one 2-thread process in bf16 and in fp32 with "
                        "AVX2 only, nothing in fp32 with AVX-512 (scripts/bench_train.py measures it)")
    p.set_defaults(func=run_cli)
    return p


def run_cli(args) -> int:
    ranks_flag = getattr(args, "ranks", "1")
    if ranks_flag != "1" and "WORLD_SIZE" not in os.environ:
        cfg = load_config(args.config, args.overrides)
        try:
            ranks = resolve_ranks(ranks_flag, cfg)
            cmd = (data_parallel_command(config=args.config, overrides=args.overrides, ranks=ranks,
                                         batch_size=cfg.data.batch_size, progress=not args.no_progress)
                   if ranks > 1 else None)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        if cmd is not None:
            return subprocess.run(cmd, env=single_thread_env(dict(os.environ))).returncode
    threads = os.environ.get("HSPEC_TRAIN_THREADS", "").strip()
    if threads and not (threads.isdigit() and int(threads) >= 1):
        print(f"error: HSPEC_TRAIN_THREADS={threads!r} must be a whole number >= 1 (torch threads per process), "
              "or unset (all cores)", file=sys.stderr)
        return 2
    torch.set_num_threads(int(threads) if threads else torch.get_num_threads())
    cfg = load_config(args.config, args.overrides)
    try:
        result = train(cfg, progress=not args.no_progress)
    except CheckpointWriteError as e:
        print(f"error: {e.strerror}", file=sys.stderr)
        return 3
    if result.history:
        last = result.history[-1]
        print(json.dumps({"step": last.step, "loss": last.loss, "tau_prob": last.tau_prob,
                          "accept": last.accept, **{k: round(v, 2) for k, v in result.throughput().items()},
                          "checkpoints": result.checkpoints,
                          **({"feature_cache": result.cache_stats} if result.cache_stats else {})}))
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sglang_hspec.training.trainer")
    sub = parser.add_subparsers(dest="command", required=True)
    add_parser(sub)
    args = parser.parse_args(["train", *(argv if argv is not None else sys.argv[1:])])
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
