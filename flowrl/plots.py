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
    """The training reward per iteration (top panel) and the evaluations of ``eval.prompts`` (bottom panel) on one
    iteration axis: each quantity on its own panel and scale, no second y axis.

    Training reward: ``reward/total/mean`` in black and each prompt tag's ``reward/tag/<tag>/mean`` in its own colour,
    labelled by the tag's name (and each reward's ``reward/<name>/mean`` when there are several), as faint
    per-iteration points under a moving average over :data:`SMOOTHING_WINDOW` iterations (:func:`moving_average`;
    none drawn where the iteration logged none). Evaluation (strict accuracy in [0, 1] for GenEval prompts, else the
    mean weighted reward): ``eval/overall`` (black diamonds) and ``eval/<tag>`` (circles in the tag's colour) on the
    iterations that logged them, with ``result``'s ``before`` at iteration 0 and ``after`` at its last iteration.

    Args:
        metrics: the rows of ``metrics.jsonl``, each with ``iteration`` and ``reward/...`` means (``eval/...``
            on evaluation iterations).
        result: the trainer's result (``before`` and ``after``, each with ``overall`` and optionally
            ``per_tag``; ``iterations``), or None for the evaluations during training only.

    Returns:
        The matplotlib ``Figure``; its axes are ``[training reward, evaluation]``, each with its legend right of it.
    """
    from matplotlib.lines import Line2D

    plt = _plt()
    fig, (ax, ev) = plt.subplots(2, 1, figsize=(9, 6.4), sharex=True, height_ratios=(3, 2))
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
    handles += [
        Line2D([], [], color="0.3", marker=".", ls="", alpha=0.4, label="per iteration"),
        Line2D([], [], color="0.3", lw=1.5, label=f"mean of last {SMOOTHING_WINDOW} iterations"),
    ]
    what = "accuracy" if accuracy else "reward"
    ev_handles = [
        Line2D([], [], color="black", marker="D", ls="--", label=f"evaluation {what}"),
        Line2D([], [], color="0.3", marker="o", ls=":", label=f"evaluation {what} per tag"),
    ]
    ax.set_ylabel("training reward\n(mean per iteration)")
    ev.set_xlabel("iteration")
    ev.set_ylabel("GenEval strict accuracy on eval.prompts" if accuracy else "mean weighted reward on eval.prompts")
    if accuracy:
        ev.set_ylim(-0.02, 1.02)
    ax.legend(handles=handles, fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1), borderaxespad=0)
    ev.legend(handles=ev_handles, fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1), borderaxespad=0)
    fig.tight_layout()
    return fig


def _plot_training_reward(ax, metrics: list[dict], colors: dict) -> list:
    """Plot each tag's reward (``colors``: tag -> colour), each reward's when there are several, and the total
    on ``ax``: faint points per iteration under their :func:`moving_average`. Sets the y range to [0, 1] when
    every value lies there. Returns the legend handles, one per curve."""
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
        smooth = moving_average(raw, SMOOTHING_WINDOW)
        smooth[[r is None for r in raw]] = np.nan  # a tag missing from an iteration is not carried forward
        ax.plot(its, smooth, style, color=color, lw=width)
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


STEP_PANELS = ("ratio_mean", "ratio_std", "clip_high", "clip_low", "grad_norm")
"""The per-step statistics (``diag/step_NN/<name>``) drawn as heatmaps, iteration x denoising step."""

DIAGNOSTICS_COLUMNS = 3
"""Panels per row of ``diagnostics.png``."""


def _values(metrics: list[dict], key: str) -> np.ndarray:
    return np.asarray([row.get(key, np.nan) for row in metrics], dtype=np.float64)  # (N,)


def diagnostics_panels(metrics: list[dict]) -> tuple[list[str], dict[str, float]]:
    """What ``diagnostics.png`` draws: the per-step statistics a run logged (:data:`STEP_PANELS`, by name), or without
    them each ``policy/*`` scalar; a metric the run never logged, or that kept one value over two or more
    iterations (a method's ``clipfrac`` at 0, DiffusionNFT's ``old_decay`` at 0.5), gets no panel.

    Returns:
        ``(panels, constant)``: the panel names in order, and ``{metric: value}`` of those left out for being
        constant (named in the figure's title instead).
    """
    steps = sorted({int(m.group(1)) for row in metrics for k in row if (m := re.match(r"diag/step_(\d+)/", k))})
    if steps:

        def filled(name: str) -> bool:
            return any(np.isfinite(_values(metrics, f"diag/step_{k:02d}/{name}")).any() for k in steps)

        return [name for name in STEP_PANELS if filled(name)] or list(STEP_PANELS[:1]), {}
    keys = sorted({k for row in metrics for k in row if k.startswith("policy/")} - {"policy/optimizer_steps"})
    panels, constant = [], {}
    for key in keys:
        v = _values(metrics, key)
        v = v[np.isfinite(v)]
        if v.size >= 2 and v.min() == v.max():
            constant[key] = float(v[0])
        elif v.size:
            panels.append(key)
    return panels or ["policy/loss"], constant


def diagnostics_figure(metrics: list[dict], watched: Sequence[str] = ()):
    """Policy diagnostics over training, a grid of :data:`DIAGNOSTICS_COLUMNS` panels a row, each with a labelled y
    axis. With per-step statistics (the GRPO family, GRPO-Guard arXiv 2510.22319, Fig. 2 style): the ratio's mean and
    std, the clip fractions above and below 1 and the gradient norm per denoising step (heatmaps: iteration x step;
    see ``train.step_grad_norms``). Without them (DiffusionNFT and other forward-process methods): the loss, the
    gradient norm and the method's other ``policy/*`` scalars per iteration. Only the panels the run's metrics fill
    (:func:`diagnostics_panels`; constant ones named in the title). Last, the advantage statistics with the fraction of
    zero-variance groups and the within-group diversity (``diversity/*``: falling towards 0 as the groups collapse
    onto one image) and the rollouts' mean of each ``watched`` reward (rewards at weight 0, logged as
    ``reward/<name>/mean`` and not trained on: a gold metric such as ``flowrl overopt``'s).

    Returns:
        The matplotlib ``Figure``; its first axes are the panels in order, the advantages' panel after them (then the
        heatmaps' colour bars).
    """
    plt = _plt()
    panels, constant = diagnostics_panels(metrics)
    steps = sorted({int(m.group(1)) for row in metrics for k in row if (m := re.match(r"diag/step_(\d+)/", k))})
    its = [row["iteration"] for row in metrics]
    n = len(panels) + 1
    cols = min(DIAGNOSTICS_COLUMNS, n)
    rows = -(-n // cols)
    fig, grid = plt.subplots(rows, cols, figsize=(4.4 * cols, 3.3 * rows), squeeze=False)
    axes = list(grid.flat)
    for ax in axes[n:]:
        ax.remove()
    for ax, name in zip(axes, panels):
        if steps:
            values = [[row.get(f"diag/step_{k:02d}/{name}", float("nan")) for row in metrics] for k in steps]
            if its:
                extent = (its[0] - 0.5, its[-1] + 0.5, steps[0] - 0.5, steps[-1] + 0.5)
                im = ax.imshow(values, aspect="auto", origin="lower", interpolation="nearest", extent=extent)
                fig.colorbar(im, ax=ax, label=name.replace("_", " "))
            ax.set_title(name.replace("_", " ")), ax.set_ylabel("denoising step")
        else:
            ax.plot(its, _values(metrics, name), ".-", ms=3)
            ax.set_title(name.split("/", 1)[1].replace("_", " ")), ax.set_ylabel(name)
        ax.set_xlabel("iteration")
    ax = axes[len(panels)]
    for key in ("advantage/abs_mean", "advantage/zero_variance_frac", "diversity/clip", "diversity/clip_min"):
        values = _values(metrics, key)
        if key.startswith("advantage/") or np.isfinite(values).any():  # the diversity curves where measured
            ax.plot(its, values, label=key.replace("advantage/", "").replace("/", " "))
    for name in watched:
        ax.plot(its, _values(metrics, f"reward/{name}/mean"), "--", label=f"{name} (gold)")
    ax.set_title("advantages, collapse"), ax.set_xlabel("iteration"), ax.set_ylabel("value"), ax.legend(fontsize=8)
    if constant:
        said = ", ".join(f"{k.split('/', 1)[1].replace('_', ' ')} {v:g}" for k, v in constant.items())
        fig.suptitle(f"constant over the run, not drawn: {said}", fontsize=9)
    fig.tight_layout()
    return fig


def save_diagnostics(metrics: list[dict], path: str | Path, watched: Sequence[str] = ()) -> None:
    """Write :func:`diagnostics_figure` of ``metrics`` (and the ``watched`` rewards) as a PNG to ``path``."""
    plt = _plt()
    fig = diagnostics_figure(metrics, watched)
    fig.savefig(path, dpi=90)
    plt.close(fig)
