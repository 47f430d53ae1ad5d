"""Plots. Each function takes measured results and writes one PNG."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

if TYPE_CHECKING:
    from parity.mismatch import PairResult

MAX_SCATTER_POINTS = 20000


def _save(fig, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=110, bbox_inches="tight")
    plt.close(fig)
    tmp.replace(path)


def plot_mismatch_scatter(results: Sequence[PairResult], path: Path) -> None:
    """Per precision pair: μ vs π probability of each sampled token (top), and the
    log-ratio π − μ against μ's probability (bottom, where small gaps are visible)."""
    n = len(results)
    fig, axes = plt.subplots(2, n, figsize=(3.8 * n, 7.5), squeeze=False, layout="constrained")
    for col, r in enumerate(results):
        m = r.mask
        mu = r.rollout_logprobs[m].exp()[:MAX_SCATTER_POINTS].numpy()
        pi = r.trainer_logprobs[m].exp()[:MAX_SCATTER_POINTS].numpy()
        delta = (r.trainer_logprobs[m] - r.rollout_logprobs[m])[:MAX_SCATTER_POINTS].numpy()
        top, bottom = axes[0][col], axes[1][col]
        top.scatter(mu, pi, s=3, alpha=0.35)
        top.plot([0, 1], [0, 1], color="black", lw=0.7)
        top.set(
            xlim=(0, 1),
            ylim=(0, 1),
            xlabel="rollout probability μ",
            ylabel="trainer probability π" if col == 0 else None,
            title=r.label,
        )
        bottom.scatter(mu, delta, s=3, alpha=0.35, color="tab:red")
        bottom.axhline(0, color="black", lw=0.7)
        bottom.set_yscale("symlog", linthresh=1e-6)
        bottom.set(xlim=(0, 1), xlabel="rollout probability μ", ylabel="log π − log μ" if col == 0 else None)
        bottom.text(
            0.5,
            0.5,
            f"k3 = {r.metrics['k3']:.2e}\nmean |Δ| = {r.metrics['token_abs_log_ratio_mean']:.2e}",
            transform=bottom.transAxes,
            ha="center",
            va="center",
            fontsize=9,
            bbox=dict(facecolor="white", alpha=0.8, edgecolor="none"),
        )
    fig.suptitle("Token-level training–inference mismatch")
    _save(fig, path)


def plot_seq_log_ratio_vs_length(results: Sequence[PairResult], path: Path) -> None:
    """|Σ_t (π − μ)| per sequence against response length, one colour per pair."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in results:
        lengths = r.mask.sum(-1).numpy()
        seq = (r.trainer_logprobs - r.rollout_logprobs).masked_fill(~r.mask, 0).sum(-1).abs().numpy()
        ax.scatter(lengths, seq, s=8, alpha=0.5, label=f"{r.label} (mean {seq.mean():.2e})")
    ax.set_yscale("symlog", linthresh=1e-6)
    ax.set(
        xlabel="response length (tokens)",
        ylabel="|sequence log-ratio| = |Σ_t log π − log μ|",
        title="Sequence-level mismatch against response length",
    )
    ax.legend(fontsize=8)
    _save(fig, path)
