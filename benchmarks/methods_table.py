"""Every method of flowrl on the quick-start world, the same training wall budget each, one table.

Each preset (as shipped: its sampler, loss and learning rate) is trained on the quick-start world
(``configs/quickstart.yaml``: the 8 prompts of ``assets/prompts/quickstart.jsonl``, evaluated on them with 64 images per
tag and on the 90 held-out test prompts with 32 per tag, 10 Euler steps, CFG 4.5) for ``--budget-s`` seconds of
training (evaluation not counted), then evaluated. DiffusionNFT's row is ``quickstart`` itself. Reported per method:
the training reward of the first and last tenth of the iterations (online methods; the offline ones score nothing),
GenEval strict accuracy on the trained and the held-out prompts after training (the base model's once, first), the
iterations run and the seconds per iteration. With ``--seeds-for-best K`` the best K methods by held-out accuracy
and DiffusionNFT are run again with ``--extra-seeds``. Results are written after every run (JSON and Markdown), so
an interrupted table keeps what it measured.

    python benchmarks/methods_table.py --budget-s 180 --out benchmarks/results/methods_table.json
    python benchmarks/methods_table.py --budget-s 180 --methods awm dgpo --seeds 1 2 --append   # more seeds, same table
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

METHODS = {  # preset -> what it is (the table's first column)
    "quickstart": "DiffusionNFT (off-policy; the main job)",
    "flow_grpo": "Flow-GRPO",
    "flow_grpo_fast": "Flow-GRPO-Fast",
    "dance_grpo": "DanceGRPO",
    "mix_grpo": "MixGRPO",
    "mix_grpo_flash": "MixGRPO-Flash",
    "grpo_guard": "GRPO-Guard",
    "flow_dppo": "Flow-DPPO",
    "gardo": "GARDO",
    "awm": "AWM",
    "dgpo": "DGPO",
    "dpo_online": "Diffusion-DPO, online",
    "crd": "CRD",
    "dpo_offline": "Diffusion-DPO, offline (shipped pairs)",
    "sft": "SFT (shipped images)",
    "refl": "ReFL (tiny CLIP score)",
    "draft": "DRaFT-2 (tiny CLIP score)",
    "alignprop": "AlignProp (tiny CLIP score)",
    "srpo": "SRPO, Direct-Align (tiny CLIP score)",
}
WORLD = [  # the quick-start world for every preset
    "train_prompts=assets/prompts/quickstart.jsonl",
    "eval.prompts=assets/prompts/quickstart.jsonl",
    "eval.images_per_tag=64",
    "eval.num_steps=10",
    "eval.guidance_scale=4.5",
    "eval.every=0",
    "eval.held_out=test",
    "eval.held_out_images_per_tag=32",
    "run.save_every=100000",
]


def run_one(preset: str, seed: int, budget_s: float, tmp: Path, overrides=()) -> tuple[dict, dict]:
    """Train `preset` for `budget_s` seconds with `seed` (`overrides` after the world's); returns ``(row, base
    evaluation)``."""
    from flowrl.config import load_config
    from flowrl.trainer import Trainer

    cfg = load_config(
        REPO / "configs" / f"{preset}.yaml", [*WORLD, *overrides, f"run.seed={seed}", f"run.output_dir={tmp}"]
    )
    trainer = Trainer(cfg)
    base = trainer.evaluator.with_held_out() if preset == "quickstart" and seed == 0 else None
    rewards, times, it, trained = [], [], 0, 0.0
    while trained < budget_s:
        t0 = time.time()
        metrics = trainer.step(it)
        times.append(time.time() - t0)
        trained += times[-1]
        if "reward/total/mean" in metrics:
            rewards.append(metrics["reward/total/mean"])
        it += 1
    after = trainer.evaluator.with_held_out()
    tenth = max(1, len(rewards) // 10)
    row = {
        "preset": preset,
        "seed": seed,
        "iterations": it,
        "train_s": trained,
        "s_per_iteration": statistics.median(times),
        "reward_first": statistics.mean(rewards[:tenth]) if rewards else None,
        "reward_last": statistics.mean(rewards[-tenth:]) if rewards else None,
        "trained_accuracy": after["overall"],
        "held_out_accuracy": after["held_out"]["overall"],
        "precision": trainer.cfg.run.mixed_precision,
    }
    return row, base


def cell(values: list, fmt: str = "{:.3f}") -> str:
    """A table cell: the one value, or ``mean (min-max)`` of several; ``-`` when none (None values are skipped)."""
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    if len(values) == 1:
        return fmt.format(values[0])
    return f"{fmt.format(statistics.mean(values))} ({fmt.format(min(values))}-{fmt.format(max(values))})"


def markdown(result: dict) -> str:
    """The table of docs/results.md from :func:`main`'s results."""
    meta, base = result["meta"], result.get("base") or {}
    by_preset: dict[str, list[dict]] = {}
    for row in result["rows"]:
        by_preset.setdefault(row["preset"], []).append(row)
    lines = [
        f"Machine: {meta['machine']}. {meta['budget_s']:g} s of training per run (evaluation not counted); "
        f"base model: trained prompts {base.get('trained', float('nan')):.3f}, held-out "
        f"{base.get('held_out', float('nan')):.3f}. Several seeds: mean (min-max).",
        "",
        "| method | preset | seeds | iterations | s/iter | training reward (first -> last tenth) | trained prompts | "
        "held-out prompts |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]

    order = sorted(by_preset, key=lambda p: -statistics.mean(r["held_out_accuracy"] for r in by_preset[p]))
    for preset in order:
        rows = by_preset[preset]
        reward = (
            f"{cell([r['reward_first'] for r in rows])} -> {cell([r['reward_last'] for r in rows])}"
            if rows[0]["reward_first"] is not None
            else "- (offline)"
        )
        lines.append(
            f"| {METHODS.get(preset, preset)} | `{preset}` | {len(rows)} | {cell([r['iterations'] for r in rows], '{:.0f}')} "
            f"| {cell([r['s_per_iteration'] for r in rows], '{:.1f}')} | {reward} "
            f"| {cell([r['trained_accuracy'] for r in rows])} | {cell([r['held_out_accuracy'] for r in rows])} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    """Run the table (module docstring); returns the results dict."""
    import tempfile

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), help="presets (default: every method)")
    parser.add_argument(
        "--budget-s", type=float, default=180.0, help="training seconds per run (default: %(default)s)"
    )
    parser.add_argument("--seeds-for-best", type=int, default=3, help="best methods rerun with --extra-seeds")
    parser.add_argument("--extra-seeds", type=int, nargs="*", default=[1, 2], help="seeds of the reruns")
    parser.add_argument("--overrides", nargs="*", default=[], help="key=value for every run (after the world's)")
    parser.add_argument("--out", default="benchmarks/results/methods_table.json", help="JSON out (and .md beside it)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="seeds of the first pass (default: 0)")
    parser.add_argument(
        "--append",
        action="store_true",
        help="add the runs to --out's table (same budget) instead of starting a new one; no reruns of the best",
    )
    a = parser.parse_args(argv)
    unknown = [m for m in a.methods if not (REPO / "configs" / f"{m}.yaml").is_file()]
    if unknown or a.budget_s <= 0:
        parser.error(f"unknown presets {unknown}" if unknown else f"--budget-s must be > 0, got {a.budget_s}")
    from flowrl.evaluation import machine  # after the arguments: --help answers at once, before torch

    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {"meta": {"machine": machine(), "budget_s": a.budget_s, "overrides": a.overrides}, "rows": []}
    if a.append and out.is_file():
        result = json.loads(out.read_text())
        if result["meta"]["budget_s"] != a.budget_s or result["meta"].get("overrides", []) != a.overrides:
            parser.error(
                f"--append: {out} was measured with budget {result['meta']['budget_s']} s and overrides "
                f"{result['meta'].get('overrides', [])}; got {a.budget_s} and {a.overrides}"
            )
        if result["meta"]["machine"] != machine():
            parser.error(f"--append: {out} was measured on {result['meta']['machine']!r}, this is {machine()!r}")

    def run(preset: str, seed: int) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            row, base = run_one(preset, seed, a.budget_s, Path(tmp) / "run", a.overrides)
        if base is not None:
            result["base"] = {"trained": base["overall"], "held_out": base["held_out"]["overall"]}
        result["rows"].append(row)
        print(json.dumps(row), flush=True)
        out.write_text(json.dumps(result, indent=1))
        out.with_suffix(".md").write_text(markdown(result))

    methods = sorted(a.methods, key=lambda m: m != "quickstart")  # the base model's evaluation comes first
    for seed in a.seeds:
        for preset in methods:
            run(preset, seed)
    if a.append:
        return result
    ranked = sorted((r for r in result["rows"] if r["preset"] != "quickstart"), key=lambda r: -r["held_out_accuracy"])
    again = ["quickstart"] + [r["preset"] for r in ranked[: a.seeds_for_best]]
    for seed in a.extra_seeds:
        for preset in again:
            if preset in a.methods:
                run(preset, seed)
    return result


if __name__ == "__main__":
    main()
