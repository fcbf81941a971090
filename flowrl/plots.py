"""Run-folder figures: the reward curve and the before/after image grid (matplotlib, Agg backend)."""

from __future__ import annotations

import re
import textwrap
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


SMOOTHING_WINDOW = 10  # iterations in the reward curve's moving average


def moving_average(values: Sequence[float | None], window: int) -> np.ndarray:
    """Trailing moving average: entry ``i`` is the mean of ``values[max(0, i - window + 1) : i + 1]``, so the
    first ``window - 1`` entries average fewer values. Missing values (None, NaN) are left out of each mean;
    an entry whose window holds none is NaN.

    Args:
        values: ``N`` numbers, one per iteration (None or NaN where not logged).
        window: how many values each mean covers, at least 1.

    Returns:
        float64 array of shape ``(N,)``.
    """
    if window < 1:
        raise ValueError(f"window must be at least 1, got {window}")
    v = np.asarray(values, dtype=np.float64)  # (N,), None -> NaN
    out = np.full(len(v), np.nan)
    for i in range(len(v)):
        recent = v[max(0, i - window + 1) : i + 1]
        recent = recent[np.isfinite(recent)]
        if recent.size:
            out[i] = recent.mean()
    return out


def save_reward_curve(metrics: list[dict], result: dict | None, path: str | Path) -> None:
    """Write :func:`reward_curve_figure` of ``metrics`` and ``result`` as a PNG to ``path``."""
    plt = _plt()
    fig = reward_curve_figure(metrics, result)
    fig.savefig(path, dpi=100, bbox_inches="tight")  # keeps the legend right of the axes
    plt.close(fig)


def reward_curve_figure(metrics: list[dict], result: dict | None):
    """The training reward per iteration and the evaluations (``eval.prompts``: held-out or the trained prompts) on one
    iteration axis.

    Training reward (left axis): ``reward/total/mean`` in black and each prompt tag's ``reward/tag/<tag>/mean``
    in its own colour, labelled by the tag's name (and each reward's ``reward/<name>/mean`` when there are
    several), as faint per-iteration points under a moving average over :data:`SMOOTHING_WINDOW` iterations
    (:func:`moving_average`). Evaluation (right axis, strict accuracy in [0, 1]): ``eval/overall``
    (black diamonds) and ``eval/<tag>`` (circles in the tag's colour) on the iterations that logged them, with
    ``result``'s ``before`` at iteration 0 and ``after`` at its last iteration.

    Args:
        metrics: the rows of ``metrics.jsonl``, each with ``iteration`` and ``reward/...`` means (``eval/...``
            on evaluation iterations).
        result: the trainer's result (``before`` and ``after``, each with ``overall`` and optionally
            ``per_tag``; ``iterations``), or None for the evaluations during training only.

    Returns:
        The matplotlib ``Figure``; its axes are ``[training reward, evaluation accuracy]``, the legend on the first.
    """
    from matplotlib.lines import Line2D

    plt = _plt()
    fig, ax = plt.subplots(figsize=(9, 4.8))
    ev = ax.twinx()
    tags = sorted({k.split("/")[2] for m in metrics for k in m if re.fullmatch(r"reward/tag/[^/]+/mean", k)})
    colors = {tag: plt.cm.tab10(i % 10) for i, tag in enumerate(tags)}
    handles = _plot_training_reward(ax, metrics, colors)
    its = [m["iteration"] for m in metrics]
    last = result.get("iterations", its[-1] if its else 0) if result else None
    for tag in tags:
        xs, ys = _eval_points(metrics, result, last, f"eval/{tag}", lambda r, tag=tag: r.get("per_tag", {}).get(tag))
        ev.plot(xs, ys, "o:", color=colors[tag], ms=5, lw=0.8, mec="white", mew=0.5)
    xs, ys = _eval_points(metrics, result, last, "eval/overall", lambda r: r.get("overall"))
    ev.plot(xs, ys, "D--", color="black", ms=6, lw=1.2)
    accuracy = not any("per_reward" in (result or {}).get(k, {}) for k in ("before", "after"))  # GenEval prompts
    what = "evaluation accuracy" if accuracy else "evaluation reward"
    handles += [
        Line2D([], [], color="0.3", marker=".", ls="", alpha=0.4, label="per iteration"),
        Line2D([], [], color="0.3", lw=1.5, label=f"mean of last {SMOOTHING_WINDOW} iterations"),
        Line2D([], [], color="black", marker="D", ls="--", label=f"{what} (right axis)"),
        Line2D([], [], color="0.3", marker="o", ls=":", label=f"{what} per tag"),
    ]
    ax.set_xlabel("iteration")
    ax.set_ylabel("training reward (mean per iteration)")
    ev.set_ylabel("GenEval strict accuracy on eval.prompts" if accuracy else "mean weighted reward on eval.prompts")
    if accuracy:
        ev.set_ylim(-0.02, 1.02)
    ax.legend(handles=handles, fontsize=8, loc="upper left", bbox_to_anchor=(1.1, 1), borderaxespad=0)
    fig.tight_layout()
    return fig


def _plot_training_reward(ax, metrics: list[dict], colors: dict) -> list:
    """Plot each tag's reward (``colors``: tag -> colour), each reward's when there are several, and the total
    on ``ax``: faint points per iteration under their :func:`moving_average`. Sets the y range to [0, 1] when
    every value lies there (the right axis's range). Returns the legend handles, one per curve."""
    from matplotlib.lines import Line2D

    names = sorted({k.split("/")[1] for m in metrics for k in m if re.fullmatch(r"reward/[^/]+/mean", k)} - {"total"})
    curves = [(f"reward/tag/{tag}/mean", tag, color, "-", 1.5) for tag, color in colors.items()]
    styles = ("--", "-.", ":", (0, (5, 1, 1, 1)))  # each reward its own dash and grey, told apart in the legend
    curves += [
        (f"reward/{n}/mean", f"reward: {n}", str(0.25 + 0.4 * i / max(1, len(names) - 1)), styles[i % 4], 1.5)
        for i, n in enumerate(names)
        if len(names) > 1
    ]
    curves += [("reward/total/mean", "all prompts", "black", "-", 2.5)]
    its = [m["iteration"] for m in metrics]
    handles, seen = [], []
    for key, label, color, style, width in curves:
        raw = [m.get(key) for m in metrics]
        if all(r is None for r in raw):
            continue
        seen += [r for r in raw if r is not None]
        ax.plot(its, np.asarray(raw, dtype=np.float64), ".", color=color, alpha=0.2, ms=3)
        ax.plot(its, moving_average(raw, SMOOTHING_WINDOW), style, color=color, lw=width)
        handles.append(Line2D([], [], color=color, ls=style, lw=width, label=label))
    if seen and 0 <= min(seen) and max(seen) <= 1:
        ax.set_ylim(-0.02, 1.02)
    return handles


def _eval_points(metrics: list[dict], result: dict | None, last: int | None, key: str, pick) -> tuple[list, list]:
    """Iterations and values of ``key`` where ``metrics`` logged it, plus ``pick(result["before"])`` at iteration 0
    and ``pick(result["after"])`` at ``last`` when ``result`` is given and ``pick`` finds a value; sorted by
    iteration."""
    points = [(m["iteration"], m[key]) for m in metrics if key in m]
    for x, r in ((0, result.get("before", {})), (last, result.get("after", {}))) if result else ():
        if pick(r) is not None:
            points.append((x, pick(r)))
    points.sort(key=lambda p: p[0])
    return [x for x, _ in points], [y for _, y in points]


def save_grid(before: torch.Tensor, after: torch.Tensor, prompts: list[str], path: str | Path) -> None:
    """Two rows (before, after) of float images ``(N, 3, H, W)`` (or videos ``(N, F, 3, H, W)``, each shown as 4 evenly
    spaced frames side by side) in [0, 1] on CPU, with the N ``prompts`` as column titles, written as a PNG to
    ``path``."""
    from .video import frame_strip

    plt = _plt()
    n = len(prompts)
    fig, axes = plt.subplots(2, n, figsize=(1.6 * n, 4.2), squeeze=False)
    for j in range(n):
        for i, (row, name) in enumerate(((before, "before"), (after, "after"))):
            ax = axes[i][j]
            cell = row[j] if row[j].ndim == 3 else frame_strip(row[j], 4)  # a video (F, 3, H, W): 4 of its frames
            ax.imshow(cell.permute(1, 2, 0).clamp(0, 1).numpy(), interpolation="nearest")
            ax.set_xticks([]), ax.set_yticks([])
            if i == 0:
                ax.set_title("\n".join(textwrap.wrap(prompts[j].removeprefix("a photo of "), 16)), fontsize=7)
            if j == 0:
                ax.set_ylabel(name)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def save_diagnostics(metrics: list[dict], path: str | Path, watched: Sequence[str] = ()) -> None:
    """Policy diagnostics over training. With per-step statistics (the GRPO family, GRPO-Guard arXiv 2510.22319, Fig. 2
    style): the ratio's mean and std, the clip fractions above and below 1 and the gradient norm per denoising step
    (heatmaps: iteration x step; see ``train.step_grad_norms``). Without them (DiffusionNFT and other forward-process
    methods): the loss, the gradient norm and the method's other ``policy/*`` scalars per iteration. Then the
    advantage statistics with the fraction of zero-variance groups and the within-group diversity (``diversity/*``:
    falling towards 0 as the groups collapse onto one image) and the rollouts' mean of each ``watched`` reward (rewards
    at weight 0, logged as ``reward/<name>/mean`` and not trained on: a gold metric such as ``flowrl overopt``'s)."""
    plt = _plt()
    steps = sorted({int(m.group(1)) for row in metrics for k in row if (m := re.match(r"diag/step_(\d+)/", k))})
    its = [row["iteration"] for row in metrics]
    if steps:
        panels = ("ratio_mean", "ratio_std", "clip_high", "clip_low", "grad_norm")
    else:  # no per-step statistics: the run-level policy scalars, each in its own panel
        keys = sorted({k for row in metrics for k in row if k.startswith("policy/")} - {"policy/optimizer_steps"})
        panels = tuple(keys) or ("policy/loss",)
    fig, axes = plt.subplots(1, len(panels) + 1, figsize=(3.5 * (len(panels) + 1), 3.2))
    for ax, name in zip(axes[:-1], panels):
        if steps:
            grid = [[row.get(f"diag/step_{k:02d}/{name}", float("nan")) for row in metrics] for k in steps]
            if its:
                im = ax.imshow(
                    grid,
                    aspect="auto",
                    origin="lower",
                    interpolation="nearest",
                    extent=(its[0] - 0.5, its[-1] + 0.5, steps[0] - 0.5, steps[-1] + 0.5),
                )
                fig.colorbar(im, ax=ax)
            ax.set_title(name.replace("_", " ")), ax.set_xlabel("iteration"), ax.set_ylabel("denoising step")
        else:
            ax.plot(its, [row.get(name, float("nan")) for row in metrics], ".-", ms=3)
            ax.set_title(name.split("/", 1)[1].replace("_", " ")), ax.set_xlabel("iteration")
    ax = axes[-1]
    for key in ("advantage/abs_mean", "advantage/zero_variance_frac", "diversity/clip", "diversity/clip_min"):
        values = [row.get(key, float("nan")) for row in metrics]
        if key.startswith("advantage/") or any(v == v for v in values):  # the diversity curves where measured
            ax.plot(its, values, label=key.replace("advantage/", "").replace("/", " "))
    for name in watched:
        ax.plot(its, [row.get(f"reward/{name}/mean", float("nan")) for row in metrics], "--", label=f"{name} (gold)")
    ax.set_title("advantages, collapse"), ax.set_xlabel("iteration"), ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
