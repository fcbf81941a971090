"""Run-folder figures: the reward curve's smoothing, legend, evaluation points and PNG."""

import math
import random

import numpy as np
import pytest

from flowrl.plots import SMOOTHING_WINDOW, moving_average, reward_curve_figure, save_reward_curve

TAGS = ("colors", "counting", "single_object")


def fake_metrics(iterations: int = 30, eval_every: int = 10) -> list[dict]:
    """Noisy rising per-tag rewards; ``eval/overall`` and ``eval/<tag>`` every ``eval_every`` iterations."""
    rng = random.Random(0)
    rows = []
    for it in range(1, iterations + 1):
        tags = {
            tag: min(1.0, max(0.0, 0.2 + 0.4 * it / iterations + 0.1 * k + rng.gauss(0, 0.15)))
            for k, tag in enumerate(TAGS)
        }
        row = {
            "iteration": it,
            "reward/total/mean": sum(tags.values()) / len(tags),
            "reward/geneval/mean": sum(tags.values()) / len(tags),
            **{f"reward/tag/{tag}/mean": v for tag, v in tags.items()},
        }
        if it % eval_every == 0:
            row |= {"eval/overall": 0.3 + 0.01 * it, **{f"eval/{tag}": 0.2 + 0.01 * it for tag in TAGS}}
        rows.append(row)
    return rows


RESULT = {
    "before": {"overall": 0.25, "per_tag": {tag: 0.2 for tag in TAGS}},
    "after": {"overall": 0.65, "per_tag": {tag: 0.5 for tag in TAGS}},
    "iterations": 30,
}


def test_moving_average_is_the_trailing_mean_over_fewer_values_at_the_start():
    np.testing.assert_allclose(moving_average([1, 2, 3, 4, 5], 2), [1, 1.5, 2.5, 3.5, 4.5])
    values = list(range(12))
    expected = [sum(values[max(0, i - 9) : i + 1]) / len(values[max(0, i - 9) : i + 1]) for i in range(12)]
    np.testing.assert_allclose(moving_average(values, 10), expected)  # 0, 0.5, 1, ..., 4.5, 5.5, 6.5
    np.testing.assert_array_equal(moving_average([3.0, 5.0], 1), [3.0, 5.0])
    assert moving_average([], 10).shape == (0,)


def test_moving_average_leaves_out_missing_values():
    out = moving_average([1.0, None, float("nan"), 3.0, None], 2)
    np.testing.assert_allclose(out[[0, 1, 3, 4]], [1.0, 1.0, 3.0, 3.0])
    assert math.isnan(out[2])  # its window holds no value
    with pytest.raises(ValueError, match="window"):
        moving_average([1.0], 0)


def test_reward_curve_names_each_tag_and_puts_evaluations_on_the_iteration_axis():
    metrics = fake_metrics()
    fig = reward_curve_figure(metrics, RESULT)
    ax, ev = fig.axes
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert set(TAGS) <= set(labels) and "tag" not in labels and "all prompts" in labels
    assert "reward: geneval" not in labels  # a single reward is the total
    smoothed = [line.get_ydata() for line in ax.get_lines() if line.get_linestyle() == "-"]
    total = moving_average([m["reward/total/mean"] for m in metrics], SMOOTHING_WINDOW)
    assert any(np.allclose(y, total) for y in smoothed)
    overall = next(line for line in ev.get_lines() if line.get_marker() == "D")
    assert list(overall.get_xdata()) == [0, 10, 20, 30, 30]
    assert list(overall.get_ydata()) == pytest.approx([0.25, 0.4, 0.5, 0.6, 0.65])
    assert ev.get_ylabel() and ax.get_ylabel()


def test_save_reward_curve_writes_a_png_with_and_without_a_result(tmp_path):
    for name, result in (("with.png", RESULT), ("without.png", None)):
        save_reward_curve(fake_metrics(), result, tmp_path / name)
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    save_reward_curve([], None, tmp_path / "empty.png")
    assert (tmp_path / "empty.png").stat().st_size > 0


def test_reward_evaluations_are_labelled_as_rewards_and_several_rewards_are_told_apart():
    metrics = fake_metrics()
    for i, row in enumerate(metrics):
        row |= {"reward/motion/mean": 0.1 * (i % 3), "reward/clip_temporal/mean": 0.5}
    result = {
        "before": {"overall": 0.3, "per_reward": {"motion": 0.2}},
        "after": {"overall": 0.5, "per_reward": {}},
        "iterations": 30,
    }
    fig = reward_curve_figure(metrics, result)
    ax, ev = fig.axes
    assert ev.get_ylabel() == "mean weighted reward on eval.prompts"
    lines = {t.get_text(): h for t, h in zip(ax.get_legend().get_texts(), ax.get_legend().legend_handles)}
    styles = {(str(lines[k].get_color()), str(lines[k].get_linestyle())) for k in lines if k.startswith("reward: ")}
    assert len([k for k in lines if k.startswith("reward: ")]) == 3 and len(styles) == 3  # each its own look
    assert reward_curve_figure(metrics, RESULT).axes[1].get_ylabel() == "GenEval strict accuracy on eval.prompts"


def test_diagnostics_of_a_method_without_per_step_statistics_plot_its_policy_scalars(tmp_path):
    from flowrl.plots import diagnostics_figure, save_diagnostics

    rows = [
        {
            "iteration": i,
            "policy/loss": 0.1 * i,
            "policy/grad_norm": 1.0 + 0.1 * i,
            "policy/old_decay": 0.5,  # DiffusionNFT's constant: no panel
            "policy/clipfrac": 0.0,
            "policy/optimizer_steps": 2,
            "advantage/abs_mean": 0.8,
        }
        for i in range(1, 6)
    ]
    save_diagnostics(rows, tmp_path / "nft.png")
    assert (tmp_path / "nft.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for row in rows:
        row["reward/geneval_strict/mean"] = 0.25
    fig = diagnostics_figure(rows, watched=["geneval_strict"])
    assert [x.get_title() for x in fig.axes] == ["grad norm", "loss", "advantages, collapse"]
    assert all(x.get_ylabel() for x in fig.axes)
    assert fig._suptitle.get_text() == "constant over the run, not drawn: clipfrac 0, old decay 0.5"
    gold = [line for line in fig.axes[-1].get_lines() if line.get_label() == "geneval_strict (gold)"]
    assert len(gold) == 1 and list(gold[0].get_ydata()) == [0.25] * 5  # the watched reward drawn with collapse


def test_diagnostics_is_a_grid_of_the_panels_a_method_fills():
    """AWM-like: eight varying policy scalars and two constant ones make 8 + 1 panels in 3 rows of 3, readable at
    normal size; GRPO-like per-step heatmaps without gradient norms leave that heatmap out."""
    from flowrl.plots import diagnostics_figure

    names = [f"policy/m{k}" for k in range(8)]
    rows = [
        {"iteration": i, **{n: i * (k + 1) for k, n in enumerate(names)}, "policy/clipfrac": 0.0, "policy/kl": 0.0}
        for i in range(1, 4)
    ]
    fig = diagnostics_figure(rows)
    panels = list(fig.axes)
    assert len(panels) == 9 and {x.get_subplotspec().get_geometry()[:2] for x in panels} == {(3, 3)}
    width, height = fig.get_size_inches() * 90
    assert width <= 1400 and height >= 0.5 * width  # about square, not a strip of 2835 x 288 px
    assert [x.get_title() for x in panels[:8]] == [n.split("/")[1] for n in names]
    steps = [
        {
            "iteration": i,
            **{f"diag/step_{k:02d}/{s}": 0.1 * i * k for k in range(3) for s in ("ratio_mean", "clip_high")},
        }
        for i in range(1, 4)
    ]
    fig = diagnostics_figure(steps)
    titles = [x.get_title() for x in fig.axes if x.get_title()]
    assert titles == ["ratio mean", "clip high", "advantages, collapse"]
    assert fig.axes[0].get_subplotspec().get_topmost_subplotspec().get_geometry()[:2] == (1, 3)
    assert fig.axes[0].get_ylabel() == "denoising step"


def test_the_reward_curve_keeps_one_scale_per_quantity_and_carries_no_missing_tag_forward():
    metrics = fake_metrics(iterations=20)
    for row in metrics[10:]:
        del row["reward/tag/colors/mean"]  # the tag is no longer drawn
    fig = reward_curve_figure(metrics, RESULT)
    ax, ev = fig.axes  # two panels, no twin axis: each its own quantity and y label
    assert ax.get_position().y0 > ev.get_position().y1 - 1e-6  # training above, evaluation below
    assert ev.get_ylim() == (-0.02, 1.02) and ev.get_legend() is not None
    colors = next(line for line in ax.get_lines() if line.get_linestyle() == "-" and len(line.get_ydata()) == 20)
    smoothed = [
        line.get_ydata()
        for line in ax.get_lines()
        if line.get_linestyle() == "-" and np.isnan(line.get_ydata()[10:]).all()
    ]
    assert colors is not None and len(smoothed) == 1  # the missing tag's curve stops where it stopped
