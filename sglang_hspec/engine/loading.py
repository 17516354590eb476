"""Resolve user-facing drafter names ("none", "ngram", "shipped", a checkpoint path) into drafters.
Targets are resolved by sglang_hspec.target.loading.load_target."""

from __future__ import annotations

from pathlib import Path

from sglang_hspec.engine.drafters import BUILTIN_DRAFTERS, LookupSpliceDrafter, NGramDrafter, NoDrafter
from sglang_hspec.target.adapter import TargetAdapter

LOOKUP_SUFFIX = "+lookup"
SHIPPED_DRAFTER_DIR = Path(__file__).resolve().parent.parent / "checkpoints" / "hspec-smollm2"


def default_drafter_spec() -> str:
    """The shipped H-Spec drafter with prompt lookup spliced in when the package carries one (lossless, held-out
    tau 1.90 -> 2.10 at the same step cost: docs/results.md), else prompt lookup alone."""
    return str(SHIPPED_DRAFTER_DIR) + LOOKUP_SUFFIX if (SHIPPED_DRAFTER_DIR / "config.json").is_file() else "ngram"


def load_drafter_spec(spec: str, adapter: TargetAdapter, *, block_size: int | None = None):
    """A builtin drafter name (none, ngram), `shipped`, or a drafter checkpoint directory; a `+lookup`
    suffix splices prompt lookup into that drafter's blocks (LookupSpliceDrafter)."""
    if spec.endswith(LOOKUP_SUFFIX):
        inner = spec[: -len(LOOKUP_SUFFIX)]
        if inner in BUILTIN_DRAFTERS:
            raise ValueError(f"drafter {spec!r}: {LOOKUP_SUFFIX} splices lookup into a learned drafter; use "
                             "'shipped+lookup' or '<checkpoint dir>+lookup'")
        return LookupSpliceDrafter(load_drafter_spec(inner, adapter, block_size=block_size))
    if spec == "none":
        return NoDrafter()
    if spec == "ngram":
        return NGramDrafter(block_size or 7)
    if spec == "shipped":
        spec = str(SHIPPED_DRAFTER_DIR)
    path = Path(spec)
    if not path.exists():
        raise ValueError(
            f"unknown drafter {spec!r}: use one of {list(BUILTIN_DRAFTERS)}, 'shipped', or a drafter checkpoint "
            "directory (config.json + model.safetensors)"
        )
    from sglang_hspec.model.checkpoint import load_drafter

    # run the drafter in the target's compute dtype (a bf16 checkpoint on an fp32 AVX2 target is upcast)
    return load_drafter(path, adapter.geometry, adapter.embed_tokens, adapter.lm_head, block_size=block_size,
                        device=adapter.device, dtype=adapter.dtype)
