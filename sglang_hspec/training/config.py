"""The training config: one strict YAML file (model / data / training) plus dotted overrides."""

from __future__ import annotations

import errno
import math
import os
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from sglang_hspec.model.config import BLOCK_SIZE_MAX, HSpecConfig, check_field_values

DRAFTER_KINDS = ("hspec", "dflash", "dspark", "dflash_target_kv", "hspec_kv_only", "hspec_last_token_only")
# HSpecConfig fields the recipe sets from model.* (and the target): model.drafter must not name them
SET_BY_RECIPE = ("target", "target_layer_ids", "kind", "kv_reuse_layer_ids", "block_size")


def _at_least(key: str, value: int, low: int, what: str) -> None:
    if value < low:
        raise ValueError(f"{key} must be >= {low} ({what}), got {value}")


def _number(key: str, value: float, *, low: float, high: float = math.inf, low_open: bool = False,
            what: str, usual: str) -> None:
    """A finite number in [low, high] ((low, high] with low_open); the message names the key and the range."""
    inside = (value > low if low_open else value >= low) and value <= high
    if not math.isfinite(value) or not inside:
        span = f"{'>' if low_open else '>='} {low:g}" if high == math.inf else \
            f"in {'(' if low_open else '['}{low:g}, {high:g}]"
        raise ValueError(f"{key} must be a finite number {span} ({what}), got {value}; the recipes use {usual}")


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class ModelSection(StrictModel):
    kind: Literal["hspec", "dflash", "dspark", "dflash_target_kv", "hspec_kv_only", "hspec_last_token_only"]
    # "embedded" (SmolLM2-135M-Instruct; "smollm2" is an alias), "tiny" (sglang_hspec.assets.tiny, with target_kwargs) or a local
    # Hugging Face model directory
    target: str = "embedded"
    target_kwargs: dict[str, Any] = {}
    target_dtype: Literal["auto", "bf16", "fp32"] = "auto"
    block_size: int = 7
    # hidden states captured at these target layers (id L = output of decoder layer L)
    target_layer_ids: list[int]
    # target layers whose post-RoPE KV the drafter's attention reads; must be among target_layer_ids
    kv_layer_ids: list[int] = []
    # passed through to build_drafter (validated there)
    drafter: dict[str, Any] = {}
    # initialise the drafter from a training checkpoint (checkpoint-<step>/) or a drafter directory
    # (config.json + model.safetensors, e.g. sglang_hspec/checkpoints/hspec-smollm2), with a fresh optimizer
    init_from: str | None = None
    # fresh drafter weights: "random", or "target_layers": each attention layer (q/k/v/o, its norms and the
    # MLP after it) copied from the target layer whose KV it reads, the last MLP from the target's last
    # layer and the final norm from the target's: the untrained drafter is a shallow layer-skip copy
    init: Literal["random", "target_layers"] = "random"

    @model_validator(mode="after")
    def _check(self) -> ModelSection:
        if not 1 <= self.block_size <= BLOCK_SIZE_MAX:
            raise ValueError(f"model.block_size must be in 1..{BLOCK_SIZE_MAX} (draft tokens per block), got "
                             f"{self.block_size}; the recipes use 7")
        if len(self.target_layer_ids) != 5:
            raise ValueError(f"model.target_layer_ids needs 5 target layer ids (the hidden states the drafter fuses), "
                             f"got {self.target_layer_ids}; e.g. [1, 8, 15, 22, 28] on a 30-layer target")
        if len(set(self.target_layer_ids)) != len(self.target_layer_ids):
            raise ValueError(f"model.target_layer_ids has duplicates: {self.target_layer_ids}")
        if self.init != "random" and self.init_from is not None:
            raise ValueError(f"model.init={self.init} and model.init_from={self.init_from} both initialise the "
                             "drafter; keep one (init_from loads every weight)")
        stray = [i for i in self.kv_layer_ids if i not in self.target_layer_ids]
        if stray:
            raise ValueError(
                f"model.kv_layer_ids {stray} are not among model.target_layer_ids {self.target_layer_ids}: "
                "the drafter reuses the KV of target layers it is conditioned on; pick kv ids from that list"
            )
        known = {f for f in HSpecConfig.__dataclass_fields__} - set(SET_BY_RECIPE)
        recipe = sorted(set(self.drafter) & set(SET_BY_RECIPE))
        if recipe:
            raise ValueError(f"model.drafter sets {recipe}; the recipe sets those itself: use model.kind / "
                             "model.target_layer_ids / model.kv_layer_ids / model.block_size (the target's geometry "
                             "is read from model.target)")
        unknown = sorted(set(self.drafter) - known)
        if unknown:
            raise ValueError(f"unknown key(s) {['model.drafter.' + k for k in unknown]}: model.drafter takes "
                             f"HSpecConfig fields {sorted(known)} (the target, layer ids, kind and block size come "
                             "from model.*)")
        check_field_values(self.drafter, prefix="model.drafter.")
        return self


class SyntheticData(StrictModel):
    """Patterned synthetic sequences (repeating random motifs) for tiny targets without a tokenizer."""

    num_sequences: int = 256
    seq_len: int = 64
    vocab_low: int = 3
    vocab_high: int = 64
    motif_len: int = 5
    num_motifs: int = 8
    prompt_len: int = 4
    seed: int = 0

    @model_validator(mode="after")
    def _check(self) -> SyntheticData:
        prefix = "data.synthetic."
        _at_least(prefix + "num_sequences", self.num_sequences, 1, "sequences to generate")
        _at_least(prefix + "seq_len", self.seq_len, 3, "tokens per sequence")
        _at_least(prefix + "vocab_low", self.vocab_low, 0, "the smallest token id used")
        if self.vocab_high <= self.vocab_low:
            raise ValueError(f"data.synthetic.vocab_high ({self.vocab_high}) must be above data.synthetic.vocab_low "
                             f"({self.vocab_low}): token ids are drawn from vocab_low..vocab_high-1")
        _at_least(prefix + "motif_len", self.motif_len, 1, "tokens per motif")
        _at_least(prefix + "num_motifs", self.num_motifs, 1, "distinct motifs")
        if not 1 <= self.prompt_len < self.seq_len:
            raise ValueError(f"data.synthetic.prompt_len must be in 1..seq_len-1 = 1..{self.seq_len - 1} (tokens "
                             f"outside the loss mask at the start), got {self.prompt_len}")
        _at_least(prefix + "seed", self.seed, 0, "the generator's seed")
        return self


class DataSection(StrictModel):
    # JSONL from `hspec data` ({id, conversations}) or pre-tokenized ({id, input_ids, loss_mask})
    train_path: str | None = None
    synthetic: SyntheticData | None = None
    max_length: int = 2048
    num_anchors: int = 512
    batch_size: int = 1  # sequences per process per micro-batch
    # directory of per-example target features (safetensors shards, built on first use and reused by every
    # later epoch and run on the same target and data; see sglang_hspec/training/features.py for its size)
    feature_cache: str | None = None
    feature_cache_dtype: Literal["fp32", "bf16"] = "fp32"  # bf16 halves the disk; fp32 keeps the loss exact
    # tokenized train_path kept under $HSPEC_CACHE_DIR/examples (by a hash of the file, tokenizer, max_length)
    tokenized_cache: bool = True

    @model_validator(mode="after")
    def _check(self) -> DataSection:
        if (self.train_path is None) == (self.synthetic is None):
            raise ValueError("set exactly one of data.train_path and data.synthetic")
        _at_least("data.max_length", self.max_length, 3, "tokens kept per record")
        _at_least("data.num_anchors", self.num_anchors, 1, "blocks drafted per sequence")
        _at_least("data.batch_size", self.batch_size, 1, "sequences per micro-batch")
        return self


class TrainingSection(StrictModel):
    max_steps: int
    grad_accum: int = 1
    lr: float = 6e-4
    warmup_ratio: float = 0.04
    weight_decay: float = 0.0
    betas: list[float] = [0.9, 0.95]
    max_grad_norm: float = 1.0
    ce_weight: float = 0.1
    tv_weight: float = 0.9
    conf_weight: float = 1.0
    gamma_decay: float = 4.0
    bf16: bool = True  # autocast the target and drafter forwards where bf16 is native (fp32 master weights)
    # throughput levers (each can be switched off to measure it: scripts/bench_train.py)
    target_probs_once: bool = True  # target softmax once per position, not once per slot reading it
    pack_anchors: bool = True  # no drafter or loss compute on padded anchors and masked slots
    # with target_probs_once and a feature cache: the cache stores each position's log-partition (4 bytes per
    # token), and a warm step runs only the draft-vocabulary rows of the target's LM head (exact up to rounding)
    cached_log_partition: bool = True
    # attention reads each sequence's target KV in place for all its blocks (false: one window copied per
    # block, the inference layout)
    sequence_attention: bool = True
    # torch.compile (inductor) the step's elementwise-heavy cores: the block attention over each sequence's KV
    # and the loss's per-row softmax / TV / CE (trainer.use_compiled_kernels). A one-off compile (~1 min on 2
    # cores, cached on disk by torch); needs a C++ compiler on a CPU. Same losses up to float rounding.
    compile: bool = False
    # AdamW as torch's fused kernel (fused=True, CPU and CUDA) rather than a loop of per-tensor ops: the same
    # update up to float rounding, ~3.5x less optimizer time (scripts/bench_train.py measures it on its own)
    fused_optimizer: bool = True
    seed: int = 0
    output_dir: str = "runs/train"
    save_every: int = 0  # 0: only the final checkpoint
    log_every: int = 10
    loss_chunk_rows: int = 2048
    device: str = "auto"  # auto | cpu | cuda | cuda:N (under torchrun: cuda:LOCAL_RANK)
    resume_from: str | None = None  # a checkpoint dir, or "auto" (latest in output_dir if any)
    # stop (with a checkpoint) after this step of the max_steps schedule; resume_from=auto continues.
    # Lets a CPU budget train in slices without changing the learning-rate schedule.
    stop_after: int | None = None

    @model_validator(mode="after")
    def _check(self) -> TrainingSection:
        _at_least("training.max_steps", self.max_steps, 1, "optimizer steps")
        _at_least("training.grad_accum", self.grad_accum, 1, "micro-batches per optimizer step")
        _number("training.lr", self.lr, low=0, high=1, low_open=True, what="the AdamW peak learning rate",
                usual="6e-4 (3e-3 on the tiny target)")
        _number("training.weight_decay", self.weight_decay, low=0, what="AdamW's decoupled weight decay", usual="0")
        if len(self.betas) != 2 or not all(math.isfinite(b) and 0 <= b < 1 for b in self.betas):
            raise ValueError(f"training.betas must be two numbers in [0, 1) (AdamW's beta1, beta2), got {self.betas}; "
                             "the recipes use [0.9, 0.95]")
        _number("training.max_grad_norm", self.max_grad_norm, low=0, low_open=True,
                what="the gradient-norm clip", usual="1.0")
        for name in ("ce_weight", "tv_weight", "conf_weight"):
            _number(f"training.{name}", getattr(self, name), low=0, what="a loss weight",
                    usual="ce 0.1, tv 0.9, conf 1.0")
        if self.ce_weight + self.tv_weight == 0:
            raise ValueError("training.ce_weight and training.tv_weight are both 0: no loss would train the draft "
                             "tokens; set either > 0 (the recipes use ce 0.1, tv 0.9)")
        _number("training.gamma_decay", self.gamma_decay, low=0, low_open=True,
                what="the per-slot loss decay", usual="4.0")
        _at_least("training.save_every", self.save_every, 0, "steps between checkpoints; 0: only the final one")
        _at_least("training.log_every", self.log_every, 0, "steps between log lines; 0: only the last")
        _at_least("training.loss_chunk_rows", self.loss_chunk_rows, 1, "loss rows computed at once")
        if self.stop_after is not None and not 1 <= self.stop_after <= self.max_steps:
            raise ValueError(f"training.stop_after must be in [1, max_steps={self.max_steps}], got {self.stop_after}")
        if not 0 <= self.warmup_ratio < 1:
            raise ValueError(f"training.warmup_ratio must be in [0, 1), got {self.warmup_ratio}")
        return self


class TrainConfig(StrictModel):
    model: ModelSection
    data: DataSection
    training: TrainingSection


# PyYAML (YAML 1.1) reads "6e-4" as a string; accept exponent floats without a dot too.
class _Loader(yaml.SafeLoader):
    pass


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:\d+\.?\d*|\.\d+)[eE][-+]?\d+$"),
    list("-+0123456789."),
)


def _parse_value(text: str) -> Any:
    return yaml.load(text, Loader=_Loader)


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply "section.key=value" overrides (values parsed as YAML) to a raw config dict."""
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"override {item!r} must look like section.key=value (e.g. training.lr=3e-4)")
        key, value = item.split("=", 1)
        parts = key.strip().split(".")
        node = data
        for p in parts[:-1]:
            child = node.get(p) if isinstance(node, dict) else None
            if child is None:
                child = {}
                node[p] = child
            if not isinstance(child, dict):
                raise ValueError(f"override {key!r}: {p!r} is not a section")
            node = child
        node[parts[-1]] = _parse_value(value)
    return data


def _format_errors(err: ValidationError, source: str) -> str:
    lines = [f"invalid training config {source}:"]
    for e in err.errors():
        loc = ".".join(str(x) for x in e["loc"])
        if e["type"] == "extra_forbidden":
            lines.append(f"  unknown key {loc!r}: remove it or fix its spelling")
        elif e["type"] == "value_error" and "error" in e.get("ctx", {}):  # our checks name their own keys
            lines.append(f"  {e['ctx']['error']}")
        else:
            lines.append(f"  {loc or '(top level)'}: {e['msg']}")
    return "\n".join(lines)


def config_from_dict(data: dict[str, Any], *, source: str = "<dict>") -> TrainConfig:
    try:
        return TrainConfig.model_validate(data)
    except ValidationError as err:
        raise ValueError(_format_errors(err, source)) from None


def load_config(path: str | Path, overrides: list[str] | None = None) -> TrainConfig:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"training config {path} not found; see configs/train_*.yaml")
    try:
        data = yaml.load(path.read_text(), Loader=_Loader) or {}
    except yaml.YAMLError as e:
        where = getattr(e, "problem_mark", None)
        at = f" at line {where.line + 1}, column {where.column + 1}" if where is not None else ""
        raise ValueError(f"training config {path} is not valid YAML{at} ({getattr(e, 'problem', None) or e}); "
                         "fix it, or start from configs/train_*.yaml") from None
    if not isinstance(data, dict):
        raise ValueError(f"training config {path} must be a mapping with model / data / training sections")
    cfg = config_from_dict(apply_overrides(data, list(overrides or [])), source=str(path))
    for key, out in (("training.output_dir", cfg.training.output_dir), ("data.feature_cache", cfg.data.feature_cache)):
        problem = None if out is None else output_dir_problem(out)
        if problem:
            raise ValueError(f"{key} {out} cannot be created: {problem}; point {key} at a writable directory")
    return cfg


# ------------------------------------------------------------------ output directories


def _nearest_existing(path: Path) -> Path:
    probe = path
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    return probe


def output_dir_problem(path: str | os.PathLike) -> str | None:
    """Why `path` cannot be (or become) a writable directory, without creating anything; None when it can
    as far as a look tells (a virtual filesystem such as /proc only refuses when written: make_output_dir)."""
    path = Path(path).expanduser()
    probe = _nearest_existing(path)
    if not probe.is_dir():
        return f"{probe} is a file, not a directory"
    if hasattr(os, "statvfs") and os.statvfs(probe).f_flag & os.ST_RDONLY:
        return f"{probe} is on a read-only filesystem"
    if not os.access(probe, os.W_OK | os.X_OK):
        return f"permission denied: {probe} is not writable by this user"
    return None


def make_output_dir(path: str | os.PathLike, *, name: str) -> Path:
    """Create the output directory `path` (and its parents) up front, before any work, or raise an OSError
    naming `name` (a flag or config key) and the real cause: a file in the way, a permission, a read-only
    or virtual filesystem, a full disk."""
    path = Path(path).expanduser()
    problem = output_dir_problem(path)
    if problem is None:
        try:
            path.mkdir(parents=True, exist_ok=True)
            return path
        except OSError as exc:
            probe = _nearest_existing(path)
            problem = {
                errno.ENOTDIR: f"{probe} is a file, not a directory",
                errno.EEXIST: f"{probe} is a file, not a directory",
                errno.EACCES: f"permission denied: {probe} is not writable by this user",
                errno.EPERM: f"permission denied: {probe} is not writable by this user",
                errno.EROFS: f"{probe} is on a read-only filesystem",
                errno.ENOENT: f"{probe} does not accept new directories (a virtual filesystem such as /proc "
                              "or /sys)",
                errno.ENOSPC: "no space left on the device",
            }.get(exc.errno, exc.strerror or str(exc))
            err = OSError(f"{name} {path} cannot be created: {problem}; pick another {name}")
            err.errno = exc.errno
            raise err from None
    raise OSError(f"{name} {path} cannot be created: {problem}; pick another {name}")


def check_against_target(cfg: TrainConfig, *, num_target_layers: int, vocab_size: int | None = None) -> None:
    """Layer ids must name real decoder layers of the target; synthetic token ids must be in its vocabulary."""
    synthetic = cfg.data.synthetic
    if vocab_size is not None and synthetic is not None and synthetic.vocab_high > vocab_size:
        raise ValueError(f"data.synthetic.vocab_high {synthetic.vocab_high} exceeds the target's vocabulary of "
                         f"{vocab_size} tokens; set data.synthetic.vocab_high <= {vocab_size}")
    for name in ("target_layer_ids", "kv_layer_ids"):
        bad = [i for i in getattr(cfg.model, name) if not 0 <= i < num_target_layers]
        if bad:
            raise ValueError(
                f"model.{name} {bad} out of range for a {num_target_layers}-layer target "
                f"(valid ids 0..{num_target_layers - 1}); pick ids of existing decoder layers"
            )


def check_block_size(cfg: TrainConfig, *, checkpoint_block_size: int, checkpoint: str) -> None:
    if checkpoint_block_size != cfg.model.block_size:
        raise ValueError(
            f"model.block_size={cfg.model.block_size} does not match the checkpoint {checkpoint} "
            f"(block_size={checkpoint_block_size}); set model.block_size={checkpoint_block_size} or start fresh"
        )
