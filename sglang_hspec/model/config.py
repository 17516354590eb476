"""Drafter configuration: one validated dataclass for H-Spec, its ablations and the DFlash baselines.

Stored as the `hspec` section of an HF-style `config.json` (see checkpoint.py). `configs/hspec-*.json`
hold the paper's settings for real targets (load with `HSpecConfig.from_json`). Mask tokens: Qwen3 151669
(DSpark's, an unused id inside the 151936-row embedding), Llama-3.1 128002 (<|reserved_special_token_0|>),
SmolLM2 16 (<empty_output>, a StarCoder-data special token the chat template never emits). The embedded
SmolLM2 drafter uses 8 Mamba heads (parameter-matched to dspark), a 8192-token draft vocabulary and
Markov rank 128: 21.9 M trainable parameters, 44 MB in bf16."""

from __future__ import annotations

import dataclasses
import math
import operator
from dataclasses import dataclass
from typing import Any

from sglang_hspec.target.geometry import TargetGeometry

# DSpark's block-slot convention (what SGLang's DSpark runtime assumes): the block input is the anchor
# followed by k-1 mask tokens and slot j predicts the token at anchor position + j + 1. Mixing it with
# DFlash's "slot j predicts anchor + j" drops acceptance to ~1 silently, so it is written and asserted.
SLOT_CONVENTION = "anchor_then_masks/slot_j_predicts_anchor_plus_j_plus_1"

KINDS = ("hspec", "hspec_kv_only", "hspec_last_token_only", "dflash", "dspark", "dflash_target_kv")
HSPEC_KINDS = ("hspec", "hspec_kv_only", "hspec_last_token_only")
DFLASH_KINDS = ("dflash", "dspark", "dflash_target_kv")

# Layer patterns: M = Mamba-2 mixer, A = attention, F = SwiGLU MLP (each pre-norm residual).
HSPEC_PATTERN = ("MAF", "MAF", "MAF", "MF")
DFLASH_PATTERN = ("AF",) * 5


@dataclass(frozen=True)
class HSpecConfig:
    target: TargetGeometry
    target_layer_ids: tuple[int, ...]  # 5 target layers; id L = output of decoder layer L
    mask_token_id: int
    intermediate_size: int  # SwiGLU width (the DFlash/DSpark baselines use the target's)
    kind: str = "hspec"
    kv_reuse_layer_ids: tuple[int, ...] | None = None  # None -> last 3 of target_layer_ids (all 5 for dflash_target_kv)
    layer_pattern: tuple[str, ...] | None = None  # None -> HSPEC_PATTERN / DFLASH_PATTERN by kind
    block_size: int = 7
    slot_convention: str = SLOT_CONVENTION
    mamba_num_heads: int = 0  # required by the hspec kinds; inner width = heads x head_dim (paper's head counts)
    mamba_head_dim: int = 64
    mamba_state_dim: int = 4
    mamba_groups: int = 4
    mamba_conv_kernel: int = 4
    mamba_expand: int = 1  # recorded for reference; the inner width follows mamba_num_heads
    mamba_chunk_size: int = 256  # GPU kernel chunk; any block <= chunk is one chunk
    mamba_dt_min: float = 1e-3
    mamba_dt_max: float = 0.1
    fusion_rank: int | None = None  # None -> target hidden size
    markov_rank: int = 256  # 0 disables the Markov head
    confidence_head: bool = True
    sliding_window: int = 2048
    draft_vocab_size: int = 32000
    rms_norm_eps: float | None = None  # None -> the target's
    # per-head RMSNorm on q and k before RoPE (Qwen3's, and SGLang's DFlash/DSpark draft layers, which always
    # apply it); None -> the target's. The DFlash-family recipes set true so they export to SGLang exactly.
    qk_norm: bool | None = None

    def __post_init__(self) -> None:
        fix = object.__setattr__
        if isinstance(self.target, dict):
            fix(self, "target", TargetGeometry.from_dict(self.target))
        if not isinstance(self.target, TargetGeometry):
            raise ValueError(f"target must be the target's geometry (a mapping of {TargetGeometry.__name__} fields), "
                             f"got {type(self.target).__name__}; copy it from the checkpoint the drafter was trained "
                             "with, or build it with TargetGeometry.from_hf_config")
        fix(self, "target_layer_ids", _int_ids("target_layer_ids", self.target_layer_ids))
        check_field_values({f.name: getattr(self, f.name) for f in dataclasses.fields(self)})
        if self.kind not in KINDS:
            raise ValueError(f"unknown drafter kind {self.kind!r}; choose one of {KINDS}")
        if self.slot_convention != SLOT_CONVENTION:
            raise ValueError(
                f"slot_convention {self.slot_convention!r} is not supported; this drafter implements "
                f"{SLOT_CONVENTION!r} (DSpark's). Retrain or convert the checkpoint to that convention."
            )
        t = self.target
        if len(self.target_layer_ids) != 5:
            raise ValueError(f"target_layer_ids needs 5 layer ids, got {list(self.target_layer_ids)}")
        for i in self.target_layer_ids:
            if not 0 <= i < t.num_hidden_layers:
                raise ValueError(
                    f"target layer id {i} is outside the target's layers 0..{t.num_hidden_layers - 1}"
                )
        if self.layer_pattern is None:
            fix(self, "layer_pattern", HSPEC_PATTERN if self.kind in HSPEC_KINDS else DFLASH_PATTERN)
        if isinstance(self.layer_pattern, str) or not isinstance(self.layer_pattern, (list, tuple)):
            raise ValueError(f"layer_pattern must be a list of layer strings such as {list(HSPEC_PATTERN)}, "
                             f"got {self.layer_pattern!r}")
        fix(self, "layer_pattern", tuple(self.layer_pattern))
        if not 1 <= len(self.layer_pattern) <= MAX_DRAFTER_LAYERS:
            raise ValueError(f"layer_pattern must hold 1..{MAX_DRAFTER_LAYERS} layers, got {len(self.layer_pattern)}; "
                             f"H-Spec uses {list(HSPEC_PATTERN)}")
        for p in self.layer_pattern:
            if not isinstance(p, str) or not p or set(p) - set("MAF") or p.count("F") != 1:
                raise ValueError(f"layer pattern entry {p!r} must use M/A/F with exactly one F, e.g. 'MAF'")
        n_attn = self.num_attention_layers
        if self.kind in ("dflash", "dspark"):
            fix(self, "kv_reuse_layer_ids", ())  # attention reads the drafter's own KV cache
            n_attn = 0
        if self.kv_reuse_layer_ids is None:
            default = self.target_layer_ids if self.kind == "dflash_target_kv" else self.target_layer_ids[-3:]
            fix(self, "kv_reuse_layer_ids", tuple(default[-n_attn:]) if n_attn else ())
        fix(self, "kv_reuse_layer_ids", _int_ids("kv_reuse_layer_ids", self.kv_reuse_layer_ids))
        if len(self.kv_reuse_layer_ids) != n_attn:
            raise ValueError(
                f"kv_reuse_layer_ids {list(self.kv_reuse_layer_ids)} must name one target layer per attention "
                f"layer ({n_attn} in pattern {list(self.layer_pattern)})"
            )
        for i in self.kv_reuse_layer_ids:
            if not 0 <= i < t.num_hidden_layers:
                raise ValueError(f"kv_reuse layer id {i} is outside the target's layers 0..{t.num_hidden_layers - 1}")
        if self.uses_mamba and self.mamba_num_heads <= 0:
            raise ValueError("mamba_num_heads must be set (> 0) for a pattern with Mamba layers, e.g. 48")
        if self.mamba_num_heads and self.mamba_num_heads % self.mamba_groups:
            raise ValueError(
                f"mamba_num_heads ({self.mamba_num_heads}) must be a multiple of mamba_groups ({self.mamba_groups})"
            )
        if self.fusion_rank is None:
            fix(self, "fusion_rank", t.hidden_size)
        if self.rms_norm_eps is None:
            fix(self, "rms_norm_eps", t.rms_norm_eps)
        if self.qk_norm is None:
            fix(self, "qk_norm", t.qk_norm)
        if self.mamba_dt_min > self.mamba_dt_max:
            raise ValueError(f"mamba_dt_min ({self.mamba_dt_min}) must be <= mamba_dt_max ({self.mamba_dt_max}): they "
                             "bound the initial Mamba step sizes (H-Spec uses 0.001 and 0.1)")
        d = t.hidden_size
        # widths against the target's hidden size d: past these the drafter outgrows the target it drafts for
        # (and a mistyped width would allocate terabytes before any weight is read)
        n_fused = len(self.target_layer_ids)
        for name, value, limit, why, fix_it in (
            ("intermediate_size", self.intermediate_size, 16 * d, f"16 x the target's hidden size {d}",
             "set intermediate_size to at most that (3-4 x the hidden size is usual)"),
            ("mamba_num_heads x mamba_head_dim", self.mamba_inner, 8 * d, f"8 x the target's hidden size {d}",
             "lower mamba_num_heads or mamba_head_dim (H-Spec's inner width is 0.5-1.1 x the hidden size)"),
            ("fusion_rank", self.fusion_rank, n_fused * d, f"the {n_fused} fused target hidden states, {n_fused} x {d}",
             "set fusion_rank to at most that (H-Spec uses the hidden size)"),
        ):
            if value > limit:
                raise ValueError(f"{name} is {value}, above {limit} ({why}); {fix_it}")
        if self.draft_vocab_size > t.vocab_size:
            raise ValueError(
                f"draft_vocab_size {self.draft_vocab_size} exceeds the target vocabulary {t.vocab_size}; "
                f"set draft_vocab_size <= {t.vocab_size}"
            )
        if self.markov_rank > self.draft_vocab_size + 1:
            raise ValueError(
                f"markov_rank {self.markov_rank} exceeds draft_vocab_size + 1 = {self.draft_vocab_size + 1} (the rank "
                f"of a full bigram table over the draft vocabulary); set markov_rank in 0..{self.draft_vocab_size + 1}"
            )
        if not 0 <= self.mask_token_id < t.vocab_size:
            raise ValueError(f"mask_token_id {self.mask_token_id} is outside the target vocabulary 0..{t.vocab_size - 1}")

    # ---- derived ----
    @property
    def hidden_size(self) -> int:
        return self.target.hidden_size

    @property
    def num_layers(self) -> int:
        return len(self.layer_pattern)

    @property
    def num_attention_layers(self) -> int:
        return sum("A" in p for p in self.layer_pattern)

    @property
    def uses_mamba(self) -> bool:
        return any("M" in p for p in self.layer_pattern)

    @property
    def mamba_inner(self) -> int:
        return self.mamba_num_heads * self.mamba_head_dim

    @property
    def injects_state(self) -> bool:
        """Mamba starts from a state projected from the target hidden states (not zero)."""
        return self.uses_mamba and self.kind != "hspec_kv_only"

    @property
    def reads_target_kv(self) -> bool:
        return self.kind in ("hspec", "hspec_kv_only", "dflash_target_kv")

    @property
    def block_causal(self) -> bool:
        # H-Spec's block attends causally (the Mamba scan is causal too); DFlash's block is bidirectional.
        return self.kind in HSPEC_KINDS

    @property
    def hidden_layer_ids(self) -> tuple[int, ...]:
        """Target layers whose hidden states the drafter consumes."""
        if self.kind in ("hspec_kv_only", "dflash_target_kv"):
            return ()
        return self.target_layer_ids

    def for_kind(self, kind: str) -> HSpecConfig:
        """The same target, ids and heads for another drafter kind. `dflash` drops the Markov and
        confidence heads (DFlash has none); the others keep them so ablations differ in one thing."""
        changes: dict[str, Any] = {}
        if kind != self.kind:
            changes.update(kind=kind, layer_pattern=None, kv_reuse_layer_ids=None)
        # also when the config already says dflash: a recipe shared by every kind (the trainer's
        # model.drafter section) sets a Markov rank that DFlash must not get
        if kind == "dflash" and (self.markov_rank or self.confidence_head):
            changes.update(markov_rank=0, confidence_head=False)
        return dataclasses.replace(self, **changes) if changes else self

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["target"] = self.target.to_dict()
        for k in ("target_layer_ids", "kv_reuse_layer_ids", "layer_pattern"):
            d[k] = list(d[k])
        return d

    @classmethod
    def from_json(cls, path) -> HSpecConfig:
        """A bare config (configs/*.json) or a checkpoint's config.json (its `hspec` section)."""
        import json
        from pathlib import Path

        data = json.loads(Path(path).read_text())
        return cls.from_dict(data.get("hspec", data))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> HSpecConfig:
        if not isinstance(data, dict):
            raise ValueError(f"a drafter config is a JSON object of HSpecConfig fields, got {type(data).__name__}")
        fields = dataclasses.fields(cls)
        known = {f.name for f in fields}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown drafter config fields {sorted(unknown)}; known: {sorted(known)}")
        missing = [f.name for f in fields if f.default is dataclasses.MISSING and f.name not in data]
        if missing:
            raise ValueError(f"drafter config lacks the required fields {missing}; required: "
                             f"{[f.name for f in fields if f.default is dataclasses.MISSING]}")
        data = dict(data)
        if not isinstance(data["target"], dict):
            raise ValueError(f"target must be a mapping of {TargetGeometry.__name__} fields, got "
                             f"{type(data['target']).__name__}")
        data["target"] = TargetGeometry.from_dict(data["target"])
        for k in ("target_layer_ids", "kv_reuse_layer_ids", "layer_pattern"):
            if isinstance(data.get(k), list):
                data[k] = tuple(data[k])
        return cls(**data)


# ---- field ranges ----
# Fixed ranges of the fields that do not depend on the target (those that do are checked in
# HSpecConfig.__post_init__). Also run on the trainer's model.drafter section before any model loads.

BLOCK_SIZE_MAX = 64  # draft tokens per block: H-Spec uses 7; past 64 acceptance has long run out
MAX_DRAFTER_LAYERS = 64
# field -> (low, high, what it is, the value the H-Spec recipes use); high None: bounded against the target
_INT_RANGES: dict[str, tuple[int, int | None, str, str]] = {
    "block_size": (1, BLOCK_SIZE_MAX, "draft tokens per block", "7"),
    "mask_token_id": (0, None, "the token id of a block's mask slots", "an unused id, e.g. 16 on SmolLM2"),
    "intermediate_size": (1, None, "the SwiGLU width", "3-4 x the target's hidden size"),
    "mamba_num_heads": (0, 4096, "Mamba heads (0: no Mamba layers)", "8-56"),
    "mamba_head_dim": (1, 512, "the width of one Mamba head", "64"),
    "mamba_state_dim": (1, 256, "the Mamba state per head channel", "4"),
    "mamba_groups": (1, 4096, "Mamba B/C groups", "4"),
    "mamba_conv_kernel": (1, 16, "the Mamba causal-conv width", "4"),
    "mamba_expand": (1, 8, "the Mamba expansion factor (recorded for reference)", "1"),
    "mamba_chunk_size": (1, 4096, "the GPU scan's chunk length", "256"),
    "fusion_rank": (1, None, "the width of the fused target hidden states", "the target's hidden size"),
    "markov_rank": (0, None, "the Markov head's rank (0: no Markov head)", "128-256"),
    "sliding_window": (1, 1 << 20, "target tokens the drafter's attention reads", "2048"),
    "draft_vocab_size": (1, None, "the draft vocabulary size", "8192-32000"),
}
# field -> (exclusive low, inclusive high, what it is, the recipes' value)
_FLOAT_RANGES: dict[str, tuple[float, float, str, str]] = {
    "mamba_dt_min": (0.0, 1.0, "the smallest initial Mamba step size", "0.001"),
    "mamba_dt_max": (0.0, 1.0, "the largest initial Mamba step size", "0.1"),
    "rms_norm_eps": (0.0, 0.1, "the RMSNorm epsilon", "the target's, 1e-5 or 1e-6"),
}
_OPTIONAL = ("fusion_rank", "rms_norm_eps", "kv_reuse_layer_ids", "layer_pattern", "qk_norm")  # None: derived


def _is_int(value: Any) -> bool:
    """An integer (numpy's too), not a bool, float or string."""
    if isinstance(value, bool):
        return False
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


def _int_ids(name: str, ids: Any) -> tuple[int, ...]:
    if isinstance(ids, (str, bytes)) or not isinstance(ids, (list, tuple)) or not all(_is_int(i) for i in ids):
        raise ValueError(f"{name} must be a list of target layer ids (integers), got {ids!r}")
    return tuple(operator.index(i) for i in ids)


def check_field_values(values: dict[str, Any], *, prefix: str = "") -> None:
    """Types and fixed ranges of the drafter config fields present in `values` (a field absent is not checked).
    The message names the field (`prefix` + its name, e.g. model.drafter.markov_rank), the range and the fix."""
    for name, value in values.items():
        key = prefix + name
        if value is None and name in _OPTIONAL:
            continue
        if name in _INT_RANGES:
            low, high, what, typical = _INT_RANGES[name]
            if not _is_int(value):
                raise ValueError(f"{key} must be an integer ({what}), got {value!r}; H-Spec uses {typical}")
            span = f"in {low}..{high}" if high is not None else f">= {low}"
            if value < low or (high is not None and value > high):
                raise ValueError(f"{key} must be an integer {span} ({what}), got {value}; set it {span} "
                                 f"(H-Spec uses {typical})")
        elif name in _FLOAT_RANGES:
            low, high, what, typical = _FLOAT_RANGES[name]
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
            if not ok or not math.isfinite(value) or not low < value <= high:
                raise ValueError(f"{key} must be a finite number in ({low:g}, {high:g}] ({what}), got {value!r}; "
                                 f"H-Spec uses {typical}")
        elif name == "confidence_head" and not isinstance(value, bool):
            raise ValueError(f"{key} must be true or false (whether the drafter has a confidence head), "
                             f"got {value!r}")
        elif name == "qk_norm" and not isinstance(value, bool):
            raise ValueError(f"{key} must be true, false or null (q/k RMSNorm in the drafter's attention; null: "
                             f"the target's), got {value!r}; the DFlash-family recipes use true")
        elif name in ("kind", "slot_convention") and not isinstance(value, str):
            raise ValueError(f"{key} must be a string, got {value!r}")
