"""Drafter configuration: one validated dataclass for H-Spec, its ablations and the DFlash baselines.

Stored as the `hspec` section of an HF-style `config.json` (see checkpoint.py). `configs/hspec-*.json`
hold the paper's settings for real targets (load with `HSpecConfig.from_json`). Mask tokens: Qwen3 151669
(DSpark's, an unused id inside the 151936-row embedding), Llama-3.1 128002 (<|reserved_special_token_0|>),
SmolLM2 16 (<empty_output>, a StarCoder-data special token the chat template never emits). The embedded
SmolLM2 drafter uses 8 Mamba heads (parameter-matched to dspark), a 8192-token draft vocabulary and
Markov rank 128: 21.9 M trainable parameters, 44 MB in bf16."""

from __future__ import annotations

import dataclasses
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

    def __post_init__(self) -> None:
        fix = object.__setattr__
        if isinstance(self.target, dict):
            fix(self, "target", TargetGeometry.from_dict(self.target))
        fix(self, "target_layer_ids", tuple(int(i) for i in self.target_layer_ids))
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
        fix(self, "layer_pattern", tuple(self.layer_pattern))
        for p in self.layer_pattern:
            if not p or set(p) - set("MAF") or p.count("F") != 1:
                raise ValueError(f"layer pattern entry {p!r} must use M/A/F with exactly one F, e.g. 'MAF'")
        n_attn = self.num_attention_layers
        if self.kind in ("dflash", "dspark"):
            fix(self, "kv_reuse_layer_ids", ())  # attention reads the drafter's own KV cache
            n_attn = 0
        if self.kv_reuse_layer_ids is None:
            default = self.target_layer_ids if self.kind == "dflash_target_kv" else self.target_layer_ids[-3:]
            fix(self, "kv_reuse_layer_ids", tuple(default[-n_attn:]) if n_attn else ())
        fix(self, "kv_reuse_layer_ids", tuple(int(i) for i in self.kv_reuse_layer_ids))
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
        for name in ("block_size", "mamba_head_dim", "mamba_state_dim", "mamba_groups", "mamba_conv_kernel",
                     "sliding_window", "draft_vocab_size", "intermediate_size", "mamba_chunk_size"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.fusion_rank is None:
            fix(self, "fusion_rank", t.hidden_size)
        if self.rms_norm_eps is None:
            fix(self, "rms_norm_eps", t.rms_norm_eps)
        if self.markov_rank < 0:
            raise ValueError(f"markov_rank must be >= 0 (0 disables the Markov head), got {self.markov_rank}")
        if self.draft_vocab_size > t.vocab_size:
            raise ValueError(
                f"draft_vocab_size {self.draft_vocab_size} exceeds the target vocabulary {t.vocab_size}; "
                f"set draft_vocab_size <= {t.vocab_size}"
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
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown drafter config fields {sorted(unknown)}; known: {sorted(known)}")
        data = dict(data)
        data["target"] = TargetGeometry.from_dict(data["target"])
        for k in ("target_layer_ids", "kv_reuse_layer_ids", "layer_pattern"):
            if data.get(k) is not None:
                data[k] = tuple(data[k])
        return cls(**data)
