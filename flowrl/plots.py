"""Run-folder figures: the reward curve and the before/after image grid (matplotlib, Agg backend)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import torch


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_reward_curve(metrics: list[dict], result: dict | None, path: str | Path) -> None:
    """Plot ``reward/total/mean`` (and each reward's mean) per iteration, and the held-out GenEval
    accuracy before, during (``eval/overall``) and after training, side by side.

    Args:
        metrics: the rows of ``metrics.jsonl``, each with ``iteration`` and ``reward/NAME/mean`` (``eval/overall``
            on evaluation iterations).
        result: the trainer's result (``before`` and ``after`` with ``overall``, ``iterations``), or None for
            the reward curve with the evaluations during training only.
        path: the PNG to write.
    """
    plt = _plt()
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.5))
    its = [m["iteration"] for m in metrics]
    for key in sorted({k for m in metrics for k in m if k.startswith("reward/") and k.endswith("/mean")}):
        a.plot(its, [m.get(key) for m in metrics], label=key.split("/")[1])
    a.set_xlabel("iteration"), a.set_ylabel("training reward (mean)"), a.legend(fontsize=8)
    xs, ys = [], []
    if result:
        xs.append(0), ys.append(result["before"]["overall"])
    for m in metrics:
        if "eval/overall" in m:
            xs.append(m["iteration"]), ys.append(m["eval/overall"])
    if result:
        xs.append(result.get("iterations", its[-1] if its else 0)), ys.append(result["after"]["overall"])
    b.plot(xs, ys, "o-")
    b.set_xlabel("iteration"), b.set_ylabel("held-out GenEval strict accuracy"), b.set_ylim(0, 1)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def save_grid(before: torch.Tensor, after: torch.Tensor, prompts: list[str], path: str | Path) -> None:
    """Two rows (before, after) of float images ``(N, 3, H, W)`` in [0, 1] on CPU, with the N ``prompts`` as
    column titles, written as a PNG to ``path``."""
    plt = _plt()
    n = len(prompts)
    fig, axes = plt.subplots(2, n, figsize=(1.6 * n, 4.2), squeeze=False)
    for j in range(n):
        for i, (row, name) in enumerate(((before, "before"), (after, "after"))):
            ax = axes[i][j]
            ax.imshow(row[j].permute(1, 2, 0).clamp(0, 1).numpy(), interpolation="nearest")
            ax.set_xticks([]), ax.set_yticks([])
            if i == 0:
                ax.set_title("\n".join(textwrap.wrap(prompts[j].removeprefix("a photo of "), 16)), fontsize=7)
            if j == 0:
                ax.set_ylabel(name)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def save_diagnostics(metrics: list[dict], path: str | Path) -> None:
    """Per-step policy diagnostics over training (GRPO-Guard, arXiv 2510.22319, Fig. 2 style): the ratio's
    mean and std, the clip fractions above and below 1 and the gradient norm per denoising step (heatmaps:
    iteration x step; see ``train.step_grad_norms``),
    and the advantage statistics with the fraction of zero-variance groups per iteration."""
    import re

    plt = _plt()
    steps = sorted({int(m.group(1)) for row in metrics for k in row if (m := re.match(r"diag/step_(\d+)/", k))})
    fig, axes = plt.subplots(1, 6, figsize=(21, 3.2))
    its = [row["iteration"] for row in metrics]
    for ax, name in zip(axes[:5], ("ratio_mean", "ratio_std", "clip_high", "clip_low", "grad_norm")):
        grid = [[row.get(f"diag/step_{k:02d}/{name}", float("nan")) for row in metrics] for k in steps]
        if steps and its:
            im = ax.imshow(grid, aspect="auto", origin="lower", interpolation="nearest",
                           extent=(its[0] - 0.5, its[-1] + 0.5, steps[0] - 0.5, steps[-1] + 0.5))
            fig.colorbar(im, ax=ax)
        ax.set_title(name.replace("_", " ")), ax.set_xlabel("iteration"), ax.set_ylabel("denoising step")
    ax = axes[5]
    for key in ("advantage/abs_mean", "advantage/zero_variance_frac"):
        ax.plot(its, [row.get(key, float("nan")) for row in metrics], label=key.split("/")[1])
    ax.set_xlabel("iteration"), ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
