"""The training config: one strict YAML file (model / data / training) plus dotted overrides."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

DRAFTER_KINDS = ("hspec", "dflash", "dspark", "dflash_target_kv", "hspec_kv_only", "hspec_last_token_only")


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
        if self.block_size < 1:
            raise ValueError(f"model.block_size must be >= 1, got {self.block_size}")
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
        if self.max_length < 3 or self.num_anchors < 1 or self.batch_size < 1:
            raise ValueError("data.max_length must be >= 3, data.num_anchors and data.batch_size >= 1")
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
        if self.max_steps < 1 or self.grad_accum < 1:
            raise ValueError("training.max_steps and training.grad_accum must be >= 1")
        if self.stop_after is not None and not 1 <= self.stop_after <= self.max_steps:
            raise ValueError(f"training.stop_after must be in [1, max_steps={self.max_steps}], got {self.stop_after}")
        if not 0 <= self.warmup_ratio < 1:
            raise ValueError(f"training.warmup_ratio must be in [0, 1), got {self.warmup_ratio}")
        if self.gamma_decay <= 0:
            raise ValueError(f"training.gamma_decay must be > 0, got {self.gamma_decay}")
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
    return config_from_dict(apply_overrides(data, list(overrides or [])), source=str(path))


def check_against_target(cfg: TrainConfig, *, num_target_layers: int) -> None:
    """Layer ids must name real decoder layers of the target."""
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
