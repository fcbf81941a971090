"""Few-step generators meet RL: a 4-step student before and after TDM-R1 and DMDR, against the 10-step base and the
best 10-step method trained for the same seconds, on the quick-start world.

The world is :data:`methods_table.WORLD` (train on the 8 prompts of ``assets/prompts/quickstart.jsonl``; evaluate
on them with 64 images per tag and on the 90 held-out test prompts with 32 per tag; 10 Euler steps, CFG 4.5). The
rows (``--rows``, in this order):

* ``base``: the base model, evaluated at 10 steps CFG 4.5, no training (the ``--best`` preset's Trainer before
  its first step; evaluated once, at the first seed: the evaluation's noise is ``eval.seed``'s, not the run's).
* ``student``: the 4-step student of ``--student`` (a ``flowrl train configs/tdm.yaml`` run's ``lora`` export, or
  its run folder), evaluated at 4 steps CFG 1, no training (``configs/tdm_r1.yaml``'s Trainer before its first step,
  the student loaded; once, at the first seed).
* ``tdm_r1``, ``dmdr``: the preset trained from the student for ``--budget-s`` seconds (evaluation not counted),
  then evaluated at 4 steps CFG 1.
* ``best``: the ``--best`` preset (default ``dgpo``, which leads held out in the methods table of docs/results.md)
  trained from the base for the same seconds, evaluated at 10 steps CFG 4.5.

The presets run as shipped (their samplers, losses, learning rates and rewards: ``tdm_r1`` trains GenEval's strict
0/1 verdict, ``dmdr`` and ``dgpo`` the dense GenEval score) except for the world's keys (``train_prompts``,
``eval.*``, ``run.save_every``), for the student rows ``eval.num_steps=4 eval.guidance_scale=1`` (the student's
sampler, as ``configs/tdm.yaml``; set after the world's) and ``train.distill.student_lora``, and for ``--overrides``
(after all of those). The student's own distillation (the tdm run) is not counted in the budget. Reported per row:
the iterations, training seconds and seconds per iteration, the dense GenEval score of the rollouts in the first and
last tenth of the iterations (and the trained reward, ``reward/total/mean``, in the JSON), GenEval strict accuracy on
the trained and the held-out prompts, and the sampler evaluated at. Results are written after every run (JSON, and
Markdown beside it), so an interrupted table keeps what it measured.

    flowrl train configs/tdm.yaml run.output_dir=runs/tdm                 # the student (its LoRA: runs/tdm/lora)
    python benchmarks/few_step_table.py --student runs/tdm/lora --budget-s 180 --seeds 0 1 2
    python benchmarks/few_step_table.py --student runs/tdm/lora --budget-s 180 --rows tdm_r1 --seeds 3 --append
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path[:0] = [str(REPO), str(HERE)]  # flowrl from the checkout; methods_table beside this file

from methods_table import METHODS, WORLD, cell  # noqa: E402  (no torch: argparse answers first)

STUDENT_SAMPLER = ["eval.num_steps=4", "eval.guidance_scale=1.0"]
"""The student rows' evaluation sampler (``configs/tdm.yaml``'s), set after :data:`methods_table.WORLD`'s."""

ROWS = {  # row -> (what it is, trains, starts from the student)
    "base": ("10-step base", False, False),
    "student": ("4-step student", False, True),
    "tdm_r1": ("4-step student + TDM-R1", True, True),
    "dmdr": ("4-step student + DMDR", True, True),
    "best": ("10-step base + {best}", True, False),
}
"""The table's rows: ``(label, trained for --budget-s, started from --student)``; ``{best}`` is the ``--best``
method's name."""


def preset_of(row: str, best: str) -> str:
    """The preset (a ``configs/NAME.yaml``) a row's Trainer is built from: ``base`` and ``best`` use `best` (its
    Trainer before a step is the base model), ``student`` uses ``tdm_r1`` (the student loaded, before a step), and
    ``tdm_r1`` and ``dmdr`` themselves."""
    return {"base": best, "best": best, "student": "tdm_r1"}.get(row, row)


def run_one(row: str, preset: str, seed: int, budget_s: float, tmp: Path, student: str | None, overrides=()) -> dict:
    """Build `preset`'s Trainer on the world (:data:`methods_table.WORLD`, the student's sampler and
    ``train.distill.student_lora=student`` when `student` is given, then `overrides`, ``run.seed=seed``,
    ``run.output_dir=tmp``), train it for `budget_s` seconds of :meth:`flowrl.trainer.Trainer.step` (whole
    iterations: the last one ends past the budget; 0: no step) and evaluate it with held-out prompts.

    Returns:
        `dict`: ``row``, ``preset``, ``seed``, ``iterations``, ``train_s`` and ``s_per_iteration`` (median seconds;
        None without a step), ``reward_first`` / ``reward_last`` (``reward/total/mean``, the trained reward, over the
        first and last tenth of the iterations) and ``geneval_first`` / ``geneval_last`` (the dense GenEval score's
        ``reward/geneval/mean``), None where not logged, ``trained_accuracy`` and ``held_out_accuracy`` (GenEval
        strict, in [0, 1]), ``eval_steps`` and ``eval_guidance`` (the sampler evaluated at) and ``precision``.

    Raises:
        ConfigError: as :func:`flowrl.config.load_config` and the Trainer (e.g. a `student` folder without a LoRA,
            naming ``train.distill.student_lora``).
    """
    from flowrl.config import load_config
    from flowrl.trainer import Trainer

    few = [*STUDENT_SAMPLER, f"train.distill.student_lora={student}"] if student else []
    cfg = load_config(
        REPO / "configs" / f"{preset}.yaml", [*WORLD, *few, *overrides, f"run.seed={seed}", f"run.output_dir={tmp}"]
    )
    trainer = Trainer(cfg)
    logged: dict[str, list[float]] = {"reward/total/mean": [], "reward/geneval/mean": []}
    times, it, trained = [], 0, 0.0
    while trained < budget_s:
        t0 = time.time()
        metrics = trainer.step(it)
        times.append(time.time() - t0)
        trained += times[-1]
        for key, values in logged.items():
            if key in metrics:
                values.append(metrics[key])
        it += 1
    after = trainer.evaluator.with_held_out()

    def tenth(values: list[float], last: bool) -> float | None:
        """Mean of the first (or `last`) tenth of `values` (at least one); None when empty."""
        n = max(1, len(values) // 10)
        return statistics.mean(values[-n:] if last else values[:n]) if values else None

    total, dense = logged["reward/total/mean"], logged["reward/geneval/mean"]
    return {
        "row": row,
        "preset": preset,
        "seed": seed,
        "iterations": it,
        "train_s": trained,
        "s_per_iteration": statistics.median(times) if times else None,
        "reward_first": tenth(total, False),
        "reward_last": tenth(total, True),
        "geneval_first": tenth(dense, False),
        "geneval_last": tenth(dense, True),
        "trained_accuracy": after["overall"],
        "held_out_accuracy": after["held_out"]["overall"],
        "eval_steps": trainer.cfg.eval.num_steps,
        "eval_guidance": trainer.cfg.eval.guidance_scale,
        "precision": trainer.cfg.run.mixed_precision,
    }


def markdown(result: dict) -> str:
    """The Markdown table of :func:`main`'s `result` (``{"meta": {...}, "rows": [row dicts of run_one]}``): one line
    per row of :data:`ROWS` that holds runs, in that order, several seeds as ``mean (min-max)``."""
    meta = result["meta"]
    best = METHODS.get(meta["best"], meta["best"])
    lines = [
        f"Machine: {meta['machine']}. {meta['budget_s']:g} s of training per trained row (evaluation not counted; "
        f"the student's distillation not counted); student `{meta['student']}`. Several seeds: mean (min-max).",
        "",
        "| row | preset | sampler | seeds | iterations | s/iter | rollouts' GenEval score (first -> last tenth) "
        "| trained prompts | held-out prompts |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, (label, trains, _) in ROWS.items():
        rows = [r for r in result["rows"] if r["row"] == name]
        if not rows:
            continue
        steps, guidance = rows[0]["eval_steps"], rows[0]["eval_guidance"]
        score = "-"
        if trains:
            score = f"{cell([r['geneval_first'] for r in rows])} -> {cell([r['geneval_last'] for r in rows])}"
        lines.append(
            f"| {label.format(best=best)} | `{rows[0]['preset']}` | {steps} steps, CFG {guidance:g} | {len(rows)} "
            f"| {cell([r['iterations'] for r in rows], '{:.0f}')} | {cell([r['s_per_iteration'] for r in rows], '{:.1f}')} "
            f"| {score} | {cell([r['trained_accuracy'] for r in rows])} | {cell([r['held_out_accuracy'] for r in rows])} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    """Run the table (module docstring); returns the results dict (``{"meta": ..., "rows": [...]}``, as written to
    ``--out``).

    Raises:
        SystemExit: (argparse's usage error, before torch imports) an unknown ``--rows`` or ``--best`` preset, a
            ``--student`` that is not a folder, ``--budget-s`` <= 0, or ``--append`` to a table measured with other
            settings or on another machine.
    """
    import tempfile

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--student", required=True, help="the 4-step student: a tdm run's lora/ folder (or the run)")
    parser.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS), help="rows (default: all)")
    parser.add_argument("--best", default="dgpo", help="the 10-step method of the 'best' row (default: %(default)s)")
    parser.add_argument(
        "--budget-s", type=float, default=180.0, help="training seconds per trained run (default: %(default)s)"
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="seeds (default: 0 1 2)")
    parser.add_argument("--overrides", nargs="*", default=[], help="key=value for every run (after the world's)")
    parser.add_argument("--out", default="benchmarks/results/few_step_table.json", help="JSON out (and .md beside it)")
    parser.add_argument(
        "--append",
        action="store_true",
        help="add the runs to --out's table (same budget, student, best and overrides) instead of starting a new one",
    )
    a = parser.parse_args(argv)
    if not (REPO / "configs" / f"{a.best}.yaml").is_file():
        parser.error(f"--best: no preset configs/{a.best}.yaml")
    if a.budget_s <= 0:
        parser.error(f"--budget-s must be > 0, got {a.budget_s}")
    if not any(folder.is_dir() for folder in (Path(a.student), REPO / a.student)):  # as flowrl.files.resolve_path
        parser.error(f"--student: {a.student} is not a folder (a tdm run's lora/ folder, or the run folder)")
    from flowrl.evaluation import machine  # after the arguments: --help answers at once, before torch

    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "machine": machine(),
        "budget_s": a.budget_s,
        "student": a.student,
        "best": a.best,
        "overrides": a.overrides,
    }
    result = {"meta": meta, "rows": []}
    if a.append and out.is_file():
        result = json.loads(out.read_text())
        differ = [k for k in ("budget_s", "student", "best", "overrides") if result["meta"].get(k) != meta[k]]
        if differ:
            was, got = ({k: m.get(k) for k in differ} for m in (result["meta"], meta))
            parser.error(f"--append: {out} was measured with {was}; got {got}")
        if result["meta"]["machine"] != meta["machine"]:
            parser.error(f"--append: {out} was measured on {result['meta']['machine']!r}, this is {meta['machine']!r}")

    def run(row: str, seed: int) -> None:
        """Run `row` at `seed` (:func:`run_one`), add it to the table and write the JSON and Markdown."""
        _, trains, from_student = ROWS[row]
        with tempfile.TemporaryDirectory() as tmp:
            record = run_one(
                row,
                preset_of(row, a.best),
                seed,
                a.budget_s if trains else 0.0,
                Path(tmp) / "run",
                a.student if from_student else None,
                a.overrides,
            )
        result["rows"].append(record)
        print(json.dumps(record), flush=True)
        out.write_text(json.dumps(result, indent=1))
        out.with_suffix(".md").write_text(markdown(result))

    done = {r["row"] for r in result["rows"]}
    for row in ("base", "student"):  # evaluated once: no training, the evaluation's noise is eval.seed's
        if row in a.rows and row not in done:
            run(row, a.seeds[0])
    for seed in a.seeds:
        for row in ("tdm_r1", "dmdr", "best"):
            if row in a.rows:
                run(row, seed)
    return result


if __name__ == "__main__":
    main()
