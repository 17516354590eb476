"""Attention geometry a drafter must match to read a target's KV cache in place."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")


@dataclass(frozen=True)
class TargetGeometry:
    """What a drafter built for a target must agree with. Stored inside drafter checkpoints and
    compared field by field on load (see `mismatches`)."""

    model_type: str
    num_hidden_layers: int
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rope_theta: float
    # transformers' rope parameters minus rope_theta (e.g. {"rope_type": "llama3", "factor": 8.0, ...});
    # {"rope_type": "default"} when unscaled.
    rope_scaling: dict[str, Any] = field(default_factory=lambda: {"rope_type": "default"})
    qk_norm: bool = False
    sliding_window: int | None = None
    max_position_embeddings: int = 8192
    rms_norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"target model_type {self.model_type!r} is not supported; supported: {SUPPORTED_MODEL_TYPES}"
            )
        for name in ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
                     "head_dim", "vocab_size", "max_position_embeddings"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"target geometry field {name} must be positive, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )

    @property
    def kv_bytes_per_token(self) -> int:
        """bf16 K+V bytes per token over all target layers."""
        return 2 * 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim

    @classmethod
    def from_hf_config(cls, config: Any) -> TargetGeometry:
        model_type = getattr(config, "model_type", None)
        rope = dict(getattr(config, "rope_parameters", None) or {})
        legacy = getattr(config, "rope_scaling", None)
        if not rope and legacy:
            rope = dict(legacy)
        theta = rope.pop("rope_theta", None) or getattr(config, "rope_theta", None) or 10000.0
        rope.setdefault("rope_type", rope.pop("type", "default") if "type" in rope else "default")
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        use_sliding = getattr(config, "use_sliding_window", False)
        window = getattr(config, "sliding_window", None) if use_sliding or model_type == "llama" else None
        return cls(
            model_type=model_type,
            num_hidden_layers=int(config.num_hidden_layers),
            hidden_size=int(config.hidden_size),
            num_attention_heads=int(config.num_attention_heads),
            num_key_value_heads=int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads),
            head_dim=int(head_dim),
            vocab_size=int(config.vocab_size),
            rope_theta=float(theta),
            rope_scaling=rope,
            qk_norm=model_type == "qwen3",
            sliding_window=int(window) if window else None,
            max_position_embeddings=int(getattr(config, "max_position_embeddings", 8192)),
            rms_norm_eps=float(getattr(config, "rms_norm_eps", 1e-6)),
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TargetGeometry:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown target geometry fields {sorted(unknown)}; known: {sorted(known)}")
        return cls(**data)

    def mismatches(self, other: TargetGeometry) -> list[tuple[str, Any, Any]]:
        """(field, self value, other value) for every field that differs."""
        a, b = self.to_dict(), other.to_dict()
        return [(k, a[k], b[k]) for k in a if json.dumps(a[k], sort_keys=True) != json.dumps(b[k], sort_keys=True)]
