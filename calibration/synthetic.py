"""Synthetic confidence records with a known truth, for tests and the docs demo (no trained drafter yet).

Acceptance is drawn sequentially: slot j is accepted with its true conditional probability only if every
earlier slot was, exactly as a verify pass truncates a block at the first rejection."""

from __future__ import annotations

import numpy as np

from .records import ConfidenceRecords


def _sequential_prefix(true_conditional: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    draws = rng.random(true_conditional.shape) < true_conditional
    return np.cumprod(draws, axis=1).astype(bool)


def overconfident_records(*, n: int, block_size: int, temperature: float, seed: int) -> ConfidenceRecords:
    """Raw logits z whose true conditional acceptance is sigmoid(z / temperature) at every slot, so the
    ideal STS temperature is `temperature` everywhere.

    Each row has an easy stretch (z ~ N(12, 2)) up to a uniformly drawn break slot, then hard tokens
    (z ~ N(2, 5)): every slot sees many rows that reached it with high survival, the regime in which its
    temperature is identifiable (with i.i.d. slots the last slots see few survivors and the fit drifts)."""
    rng = np.random.default_rng(seed)
    break_slot = rng.integers(0, block_size, size=(n, 1))
    easy = np.arange(block_size)[None, :] < break_slot
    z = np.where(
        easy, rng.normal(12.0, 2.0, size=(n, block_size)), rng.normal(2.0, 5.0, size=(n, block_size))
    )
    prefix = _sequential_prefix(1.0 / (1.0 + np.exp(-z / temperature)), rng)
    return ConfidenceRecords(
        logits=z.astype(np.float32), prefix_mask=prefix, sources=(f"overconfident(seed={seed})",)
    )


def drafter_like_records(*, n: int, block_size: int = 7, seed: int = 0) -> ConfidenceRecords:
    """Records shaped like a trained block drafter's confidence head (DSpark: AUROC 0.81-0.90, raw ECE 3-8%).

    - acceptance depends on a per-request difficulty shared by all slots of a block, and decays with depth;
    - the head sees the true acceptance logit with error (imperfect ranking) and is over-confident by a
      factor that grows with depth (later slots are trained on fewer, noisier labels)."""
    rng = np.random.default_rng(seed)
    slots = np.arange(block_size)
    difficulty = rng.normal(0.0, 1.0, size=(n, 1))
    true_logit = 2.2 - 0.2 * slots + 1.3 * difficulty + rng.normal(0.0, 0.9, size=(n, block_size))
    head_error = rng.normal(0.0, 0.6, size=(n, block_size))
    overconfidence = 1.1 + 0.05 * slots
    raw_logits = overconfidence * (true_logit + head_error) + 0.3
    prefix = _sequential_prefix(1.0 / (1.0 + np.exp(-true_logit)), rng)
    return ConfidenceRecords(
        logits=raw_logits.astype(np.float32), prefix_mask=prefix, sources=(f"drafter_like(seed={seed})",)
    )
