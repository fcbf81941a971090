"""``flowrl bench``: every sampler preset on the tiny world, same scored images per iteration, one table.

For each preset: old-policy NFEs (CFG counted twice), trained transitions, reward calls and seconds per
iteration (median of ``--iterations`` timed iterations after ``--warmup``; for a sliding-window preset
the timed iterations put the window at evenly spaced starts from the first to the last step, the
positions a run with the progressive schedule cycles through), optionally the GenEval
strict accuracy on the eval prompts (of the base model, and after half of and all of ``--budget-s`` seconds of
training that follow the timed iterations, evaluation time not counted), and the speed of a batched tree
against the same tree evaluated node by node. Writes JSON and a Markdown table.

The presets are written for the tiny world's 10 steps. A ``--preset-overrides`` YAML file rescales them,
e.g. to a paper's step count and window (``benchmarks/scale_mixgrpo.yaml``: MixGRPO's 25 steps and 4-step
window; ``benchmarks/scale_branchgrpo.yaml``: BranchGRPO's 20 steps and splits at 0, 3, 6, 9).
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from .config import REPO_ROOT, load_config
from .samplers import start_latents

PRESETS = (
    "flow_grpo",
    "flow_grpo_fast",
    "dance_grpo",
    "mix_grpo",
    "mix_grpo_flash",
    "branch_grpo",
    "branch_grpo_mix",
    "tempflow_grpo",
    "g2rpo",
    "tp_grpo",
)

SAME_IMAGES = {
    # 64 scored images per iteration for every preset (reward calls)
    "tempflow_grpo": ["sampling.prompts_per_iteration=2"],  # 2 prompts x 2 trunks x 4 steps x 4 children
    "g2rpo": ["sampling.prompts_per_iteration=2", "sampling.group_size=4"],  # 2 x 4 steps x 4 x 2 granularities
    "tp_grpo": [
        "sampling.prompts_per_iteration=2",
        "sampling.group_size=5",
    ],  # 2 x 5 trajectories x (1 + 5) probes ~ 60
}


def load_preset_overrides(path: str | Path) -> dict[str, list[str]]:
    """Read a per-preset override file: a YAML mapping of ``all`` and/or preset names to key=value lists.

    Example: ``{all: [sampling.num_steps=25], mix_grpo: [sampling.window.size=4]}``; the ``all`` list is
    applied to every preset, before the preset's own list.

    Raises:
        FileNotFoundError: if ``path`` does not exist.
        ValueError: naming the file, for one that is not UTF-8, not YAML (with the line) or not a mapping (an empty
            file included); for a key that is neither ``all`` nor a preset in ``configs/``, or a value that is not a
            list of ``key=value`` strings (the file and the key are named).
    """
    import yaml

    if not Path(path).is_file():
        raise FileNotFoundError(f"preset override file {path} does not exist")
    try:
        raw = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise ValueError(f"preset override file {path} is not UTF-8 text (byte {e.start}: {e.reason})") from None
    except yaml.YAMLError as e:  # a syntax error: the file and the line, in one line
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise ValueError(f"preset override file {path} is not valid YAML{where}: {getattr(e, 'problem', e)}") from None
    if not isinstance(raw, dict):
        got = "nothing (an empty file)" if raw is None else f"a {type(raw).__name__}"
        raise ValueError(
            f"preset override file {path}: expected a mapping of preset names to key=value lists, got {got}"
        )
    out = {}
    for key, items in raw.items():
        if key != "all" and not (REPO_ROOT / "configs" / f"{key}.yaml").is_file():
            raise ValueError(
                f"preset override file {path}: unknown key {key!r}; expected 'all' or a preset in configs/ "
                f"such as {list(PRESETS)}"
            )
        if not isinstance(items, list) or not all(isinstance(i, str) and "=" in i for i in items):
            raise ValueError(
                f"preset override file {path}: {key!r} must be a list of key=value strings, got {items!r}"
            )
        out[key] = items
    return out


def say(line: str) -> None:
    """Print ``flowrl bench: <line>`` to stderr at once: the bench's progress, a line per iteration of each preset."""
    print(f"flowrl bench: {line}", file=sys.stderr, flush=True)


def _median_iteration(trainer, start: int, count: int, progress=say, name: str = "") -> dict[str, float]:
    """Medians over `count` iterations ``start, start + 1, ...`` of `trainer` of the cost and time metrics
    (``cost/nfe``, ``cost/trained_transitions``, ``cost/reward_calls``, ``time/*_s``) and of their sum
    ``time/iteration_s``; a progressive or decaying window is put at evenly spaced starts (restored after).
    ``progress(line)`` is called after each iteration with `name`, its number and seconds."""
    window = getattr(
        trainer.method, "window", None
    )  # a sliding window is timed at evenly spaced starts, the positions a run cycles through
    spread = window is not None and window.schedule not in ("fixed", "random")
    state = window.state_dict() if spread else None
    rows = []
    for i in range(count):
        if spread:
            window.load_state_dict({"start": round(i * window.last / max(count - 1, 1)), "count": 0, "iteration": 0})
        rows.append(trainer.step(start + i))
        seconds = rows[-1]["time/sample_s"] + rows[-1]["time/score_s"] + rows[-1]["time/train_s"]
        progress(f"{name} timed iteration {i + 1}/{count}: {seconds:.1f} s")
    if spread:
        window.load_state_dict(state)
    out = {
        k: statistics.median(r[k] for r in rows)
        for k in (
            "cost/nfe",
            "cost/trained_transitions",
            "cost/reward_calls",
            "time/sample_s",
            "time/score_s",
            "time/train_s",
        )
    }
    out["time/iteration_s"] = statistics.median(
        r["time/sample_s"] + r["time/score_s"] + r["time/train_s"] for r in rows
    )
    return out


def bench_tree(trainer, repeats: int = 3) -> dict[str, float]:
    """Seconds of one BranchGRPO tree rollout (the preset's tree, all prompts) batched vs node by node.

    Returns:
        ``{"batched_s", "node_by_node_s"}`` (medians of `repeats` rollouts each) and their ratio ``"speedup"``.

    Raises:
        ValueError: if ``repeats < 1``.
    """
    if repeats < 1:
        raise ValueError(f"bench_tree repeats must be >= 1, got {repeats}")
    s = trainer.cfg.sampling
    metas = trainer.sample_prompts(0)
    table = trainer.model.prompt_table(metas)
    velocity = trainer.model.velocity_fn(table, s.guidance_scale)
    shape = trainer.method.shape  # a TreeShape
    ode = shape.ode_velocity(velocity)  # built once, outside the timed calls
    noise = torch.randn((len(metas), *trainer.model.latent_shape), generator=torch.Generator().manual_seed(0)).to(
        trainer.device
    )  # drawn on CPU, as the trainer's
    noise = start_latents(noise, trainer.method.sigmas[0])  # the state at the first time (noise itself at sigma 1)
    times = {}
    for batched in (True, False):
        runs = []
        for _ in range(repeats):
            t0 = time.time()
            shape.tree(velocity, table, noise, torch.Generator().manual_seed(1), ode, batched=batched)
            runs.append(time.time() - t0)
        times["batched_s" if batched else "node_by_node_s"] = statistics.median(runs)
    times["speedup"] = times["node_by_node_s"] / times["batched_s"]
    return times


def run_bench(
    presets=PRESETS,
    iterations: int = 3,
    warmup: int = 1,
    budget_s: float = 0.0,
    overrides=(),
    out: str | Path = "runs/bench.json",
    preset_overrides: str | Path | None = None,
    progress=say,
) -> dict:
    """Benchmark `presets` (names in configs/); see the module docstring. Returns the results dict.
    ``progress(line)`` hears what it is doing: each preset as it starts, each iteration and evaluation as it ends
    (default: a ``flowrl bench:`` line on stderr; an iteration of the tiny world takes seconds).

    Overrides apply in this order: the same-images settings, `preset_overrides` (a file read by
    :func:`load_preset_overrides`: its ``all`` list, then the preset's list), then `overrides` (every preset).

    Raises:
        ValueError: for ``iterations < 1``, ``warmup < 0`` or ``budget_s < 0``, before any preset runs.
        ConfigError: for an override that does not fit a preset (the key is named), before any preset runs.
        FileNotFoundError, ValueError: for a missing or malformed `preset_overrides` file.
    """
    from .trainer import Trainer

    for name, value, low in (("iterations", iterations, 1), ("warmup", warmup, 0), ("budget_s", budget_s, 0)):
        if not value >= low:
            raise ValueError(f"bench {name} must be >= {low}, got {value}")

    per_preset = load_preset_overrides(preset_overrides) if preset_overrides else {}

    def config(name: str, output_dir: str):
        return load_config(
            REPO_ROOT / "configs" / f"{name}.yaml",
            [
                f"run.output_dir={output_dir}",
                "eval.every=0",
                *SAME_IMAGES.get(name, []),
                *per_preset.get("all", []),
                *per_preset.get(name, []),
                *overrides,
            ],
        )

    for name in presets:  # a bad override stops the bench before any preset has run
        config(name, "unused")
    results, base_accuracy = {}, None
    for k, name in enumerate(presets):
        progress(f"{name} ({k + 1}/{len(presets)}): building the trainer")
        with tempfile.TemporaryDirectory() as tmp:
            trainer = Trainer(config(name, f"{tmp}/run"))
            if budget_s > 0 and base_accuracy is None:  # every preset starts from the same base model
                progress(f"evaluating the base model ({trainer.evaluator.plan()})")
                base_accuracy = trainer.evaluator.evaluate()["overall"]
            for i in range(warmup):
                t0 = time.time()
                trainer.step(i)
                progress(f"{name} warm-up iteration {i + 1}/{warmup}: {time.time() - t0:.1f} s")
            row = _median_iteration(trainer, warmup, iterations, progress, name)
            if trainer.cfg.train.method == "grpo" and trainer.cfg.sampling.shape == "tree":
                progress(f"{name}: timing the tree batched and node by node")
                row["tree"] = bench_tree(trainer)
            if budget_s > 0:  # training time only: the half-way evaluation is not counted
                it, trained = warmup + iterations, 0.0
                while trained < budget_s:
                    t0 = time.time()
                    trainer.step(it)
                    trained += time.time() - t0
                    it += 1
                    progress(f"{name} budget: {trained:.0f} of {budget_s:.0f} s trained")
                    if "budget_half_accuracy" not in row and trained >= budget_s / 2:
                        progress(f"{name}: evaluating at half the budget")
                        row["budget_half_accuracy"] = trainer.evaluator.evaluate()["overall"]
                row["budget_iterations"] = it
                progress(f"{name}: evaluating after the budget")
                row["budget_accuracy"] = trainer.evaluator.evaluate()["overall"]
            results[name] = row
            print(name, json.dumps(row))
    base = results.get("dance_grpo", {}).get("time/iteration_s")
    for row in results.values():
        row["vs_dance_grpo"] = row["time/iteration_s"] / base if base else None
    meta = {
        "iterations": iterations,
        "warmup": warmup,
        "budget_s": budget_s,
        "base_accuracy": base_accuracy,
        "overrides": list(overrides),
        "preset_overrides": {"file": str(preset_overrides), **per_preset} if preset_overrides else None,
    }
    save_results(out, meta, results, markdown_table)
    return results


def save_results(out, meta: dict, results: dict, table, **extra) -> None:
    """Write a benchmark's JSON to `out` (``{"meta": {"machine": ..., **meta}, "results": results, **extra}``) and
    ``table(results, meta)`` (its Markdown table) beside it as ``.md``, creating the folder."""
    from .evaluation import machine  # the models and diffusers: not loaded by the CLI's parser

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"machine": machine(), **meta}
    out.write_text(json.dumps({"meta": meta, "results": results, **extra}, indent=1))
    out.with_suffix(".md").write_text(table(results, meta))


def markdown_table(results: dict, meta: dict) -> str:
    """The README table of :func:`run_bench`'s results."""
    budget = meta["budget_s"]
    head = (
        f"Machine: {meta['machine']}; median of {meta['iterations']} iterations after {meta['warmup']} warm-up"
        " (sliding windows timed at evenly spaced starts)."
    )
    if budget:
        head += (
            f" Accuracy: GenEval strict on the eval prompts after {budget / 2:g} s and {budget:g} s of training"
            f" (base model {float('nan') if meta.get('base_accuracy') is None else meta['base_accuracy']:.3f})."
        )
    if meta.get("overrides"):
        head += f" Overrides: `{' '.join(meta['overrides'])}`."
    if meta.get("preset_overrides"):
        po = meta["preset_overrides"]
        head += (
            f" Per-preset overrides from `{po['file']}`: "
            + "; ".join(f"{k}: `{' '.join(v)}`" for k, v in po.items() if k != "file")
            + "."
        )
    lines = [
        head,
        "",
        "| preset | old-policy NFEs | trained transitions | reward calls | s / iteration | vs dance_grpo |"
        + (" accuracy, half budget | accuracy, budget |" if budget else ""),
        "|---|---|---|---|---|---|" + ("---|---|" if budget else ""),
    ]
    for name, r in results.items():
        ratio = f"{r['vs_dance_grpo']:.2f}x" if r.get("vs_dance_grpo") else "-"
        line = (
            f"| {name} | {r['cost/nfe']:.0f} | {r['cost/trained_transitions']:.0f} | {r['cost/reward_calls']:.0f} | "
            f"{r['time/iteration_s']:.2f} | {ratio} |"
        )
        if budget:
            line += (
                f" {r.get('budget_half_accuracy', float('nan')):.3f} | {r.get('budget_accuracy', float('nan')):.3f} |"
            )
        lines.append(line)
    for name, r in results.items():
        if "tree" in r:
            t = r["tree"]
            lines.append(
                f"\n{name} tree rollout: batched {t['batched_s']:.2f} s, node by node {t['node_by_node_s']:.2f} s "
                f"({t['speedup']:.1f}x)."
            )
    return "\n".join(lines) + "\n"
