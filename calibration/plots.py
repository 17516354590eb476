"""Reliability diagram (before / after STS) as PNG."""

from __future__ import annotations

import io
import os
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from .metrics import ConfidenceMetrics, ReliabilityBins  # noqa: E402
from .sts import write_bytes_atomic  # noqa: E402


def check_png_path(path: str | os.PathLike) -> Path:
    path = Path(path)
    if path.suffix.lower() != ".png":
        raise ValueError(f"plot path {str(path)!r} must end in .png (the diagram is written as PNG)")
    return path


def _panel(ax, bins: ReliabilityBins, metrics: ConfidenceMetrics, title: str) -> None:
    edges = np.asarray(bins.edges)
    count = np.asarray(bins.count)
    observed = np.asarray(bins.observed, dtype=float)
    predicted = np.asarray(bins.mean_predicted, dtype=float)
    centers = 0.5 * (edges[1:] + edges[:-1])
    width = edges[1] - edges[0]
    filled = count > 0
    ax.bar(
        centers[filled],
        observed[filled],
        width=width * 0.9,
        color="#4C72B0",
        alpha=0.75,
        label="observed survival",
    )
    ax.plot(
        predicted[filled],
        observed[filled],
        "o",
        color="#C44E52",
        ms=4,
        label="bin mean (predicted, observed)",
    )
    ax.plot([0, 1], [0, 1], "k--", lw=1, label="perfect calibration")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.set_xlabel("predicted cumulative survival")
    ax.set_title(
        f"{title}\nECE {metrics.overall_ece:.2%} (mean per slot {metrics.mean_slot_ece:.2%}), "
        f"Brier {metrics.overall_brier:.3f}",
        fontsize=9,
    )
    share = ax.twinx()
    share.bar(centers, count / max(count.sum(), 1), width=width * 0.9, color="grey", alpha=0.2)
    share.set_ylim(0, 1)
    share.set_yticks([])


def render_reliability_png(
    *,
    before: tuple[ReliabilityBins, ConfidenceMetrics],
    after: tuple[ReliabilityBins, ConfidenceMetrics],
    title: str = "",
) -> bytes:
    """Two panels (raw head, after STS), bins pooled over every observed (request step, slot) pair;
    grey bars show each bin's share of samples."""
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.6), sharey=True)
    _panel(axes[0], *before, "raw confidence (T = 1)")
    _panel(axes[1], *after, "after STS")
    axes[0].set_ylabel("observed survival (accepted prefix)")
    axes[0].legend(loc="upper left", fontsize=7)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110)
    plt.close(fig)
    return buffer.getvalue()


def save_reliability_png(path: str | os.PathLike, png: bytes) -> Path:
    path = check_png_path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_bytes_atomic(path, png)
    return path
