"""The seesaw experiment: per-group teachers distilled into one Flow-OPD student, against one multi-tag run at equal compute.

The train prompts of ``assets/prompts/train.jsonl`` are split into tag groups (default: objects = single_object,
two_object, counting; colours = colors, color_attr; position = position), at most ``--prompts-per-tag`` prompts of
each tag (drawn once with a fixed seed, so every run sees the same prompts). Per seed:

1. one teacher per group: ``--method`` (default DGPO, the held-out leader of docs/results.md's methods table) trained
   on that group's prompts alone for ``--teacher-budget-s`` seconds of training, its LoRA exported;
2. the Flow-OPD student (``configs/flow_opd.yaml``, arXiv 2605.08063): the preset's teachers replaced by the group
   teachers, each serving its group's tags, trained on the union of the groups' prompts for ``--student-budget-s``
   seconds; with ``--cold-start merge`` (the default) it starts from the teachers' average (``flowrl merge
   --combination svd --rank model.lora_rank``, ``train.opd.init``), with ``none`` from a fresh LoRA;
3. the baseline: ``--method`` on the union prompts for the same total compute, the teachers' budgets plus the
   student's (the merge is not counted).

Every run (and the base model, once) is evaluated as the methods table evaluates: GenEval strict accuracy per tag on the
trained prompts (the union; 64 images per tag) and on the held-out ``assets/prompts/test.jsonl`` of the groups' tags (32 per tag), 10 Euler
steps, CFG 4.5; evaluation is not counted as training. Reported per run: per-tag and overall accuracy on both prompt
sets, iterations and measured training seconds; then per tag, the student against the baseline. Results are written
after every run (JSON and Markdown beside it), so an interrupted experiment keeps what it measured.

    python benchmarks/seesaw.py --teacher-budget-s 180 --student-budget-s 180 --out benchmarks/results/seesaw.json
    python benchmarks/seesaw.py --teacher-budget-s 180 --student-budget-s 180 --seeds 1 2 --append   # more seeds
    python benchmarks/seesaw.py --teacher-budget-s 5 --student-budget-s 5 --out /tmp/seesaw.json \\
        --overrides eval.images_per_tag=4 eval.held_out_images_per_tag=2   # a smoke run
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

TRAIN = REPO / "assets" / "prompts" / "train.jsonl"
"""The prompt records the groups' train prompts are drawn from."""
HELD_OUT = REPO / "assets" / "prompts" / "test.jsonl"
"""The held-out prompt records (those of the groups' tags are evaluated)."""
GROUPS = {  # group -> its tags (the default --groups)
    "objects": ["single_object", "two_object", "counting"],
    "colours": ["colors", "color_attr"],
    "position": ["position"],
}
WORLD = [  # every run's evaluation (eval.prompts and eval.held_out, files of the groups' tags, are added per seed)
    "eval.images_per_tag=64",
    "eval.num_steps=10",
    "eval.guidance_scale=4.5",
    "eval.every=0",
    "eval.held_out_images_per_tag=32",
    "run.save_every=100000",
]
SPLIT_SEED = 0
"""The seed of the draw of ``--prompts-per-tag`` prompts of a tag (the same prompts for every run and seed)."""


def parse_groups(items: list[str]) -> dict[str, list[str]]:
    """``["NAME=TAG,TAG", ...]`` (``--groups``) -> ``{NAME: [TAG, ...]}``.

    Raises:
        ValueError: an item without ``=`` or tags, a name that is not letters, digits and _ starting with a letter
            (each teacher is a peft adapter of that name), a name given twice, or a tag in two groups.
    """
    groups: dict[str, list[str]] = {}
    for item in items:
        name, _, tags = item.partition("=")
        tags = [t for t in tags.split(",") if t]
        if not tags:
            raise ValueError(f"--groups {item!r}: expected NAME=TAG[,TAG...]")
        if not re.fullmatch(r"[A-Za-z][A-Za-z0-9_]*", name):
            raise ValueError(f"--groups {item!r}: a group's name is letters, digits and _, starting with a letter")
        if name in groups:
            raise ValueError(f"--groups: group {name!r} given twice")
        groups[name] = tags
    seen = [t for tags in groups.values() for t in tags]
    twice = sorted({t for t in seen if seen.count(t) > 1})
    if twice:
        raise ValueError(f"--groups: tags {twice} are in several groups; each tag has one teacher")
    return groups


def read_records(path: Path) -> list[dict]:
    """The prompt records of a ``.jsonl`` file (one JSON object a line, blank lines skipped)."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def split_prompts(records: list[dict], groups: dict[str, list[str]], per_tag: int) -> dict[str, list[dict]]:
    """Each group's train prompt records: at most `per_tag` records of each of its tags (all when a tag has fewer),
    drawn with :data:`SPLIT_SEED` and kept in the file's order.

    Args:
        records: prompt records with a ``tag`` (``assets/prompts/train.jsonl``'s). groups: name -> tags.
        per_tag: the cap per tag, >= 1.

    Returns:
        ``{group: [record, ...]}``, the groups in the order given; no record is in two groups.

    Raises:
        ValueError: a group's tag that no record has (the known tags are named).
    """
    known = sorted({r.get("tag") for r in records if r.get("tag")})
    missing = sorted({t for tags in groups.values() for t in tags} - set(known))
    if missing:
        raise ValueError(f"--groups: tags {missing} are not tags of {TRAIN.name} (its tags: {', '.join(known)})")
    rng = random.Random(SPLIT_SEED)
    chosen: dict[str, set[int]] = {}
    for tag in known:
        idx = [i for i, r in enumerate(records) if r.get("tag") == tag]
        chosen[tag] = set(idx if len(idx) <= per_tag else rng.sample(idx, per_tag))
    return {
        name: [r for i, r in enumerate(records) if r.get("tag") in tags and i in chosen[r["tag"]]]
        for name, tags in groups.items()
    }


def write_jsonl(records: list[dict], path: Path) -> Path:
    """Write `records` as a ``.jsonl`` prompt file at `path`; returns `path`."""
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def accuracies(result: dict) -> dict:
    """The per-tag strict accuracies of an evaluation with a held-out set
    (:meth:`flowrl.evaluator.Evaluator.with_held_out`): ``{"trained": {"overall", "per_tag"}, "held_out": {...}}``,
    accuracies in [0, 1]."""
    held = result["held_out"]
    return {
        "trained": {"overall": result["overall"], "per_tag": dict(result["per_tag"])},
        "held_out": {"overall": held["overall"], "per_tag": dict(held["per_tag"])},
    }


def train_for(trainer, budget_s: float) -> tuple[int, float]:
    """Run ``trainer.step`` until `budget_s` seconds of steps have passed (at least one step); returns
    ``(iterations, measured training seconds)``."""
    it, trained = 0, 0.0
    while trained < budget_s:
        t0 = time.time()
        trainer.step(it)
        trained += time.time() - t0
        it += 1
    return it, trained


def run_one(
    run: str, preset: str, settings: list[str], seed: int, budget_s: float, out: Path, base: bool = False
) -> tuple[dict, object]:
    """Train `preset` with the override list `settings` (the world's, the user's, the run's) and `seed` for `budget_s`
    seconds in the run folder `out`, then evaluate it.

    Args:
        run: the row's name (``teacher:objects``, ``opd student``, ``baseline``). base: also evaluate the model
            before training (the ``base`` row).

    Returns:
        ``(row, trainer)``: the row (``run``, ``preset``, ``seed``, ``iterations``, ``train_s``, ``trained`` and
        ``held_out`` accuracies as :func:`accuracies`, plus ``"base"``: the base model's, when asked) and the trainer
        (its model holds the trained LoRA: :func:`export_lora`).
    """
    from flowrl.config import load_config
    from flowrl.trainer import Trainer

    cfg = load_config(REPO / "configs" / f"{preset}.yaml", [*settings, f"run.seed={seed}", f"run.output_dir={out}"])
    trainer = Trainer(cfg)
    before = accuracies(trainer.evaluator.with_held_out()) if base else None
    iterations, trained = train_for(trainer, budget_s)
    row = {"run": run, "preset": preset, "seed": seed, "iterations": iterations, "train_s": trained}
    row.update(accuracies(trainer.evaluator.with_held_out()))
    if before is not None:
        row["base"] = before
    return row, trainer


def export_lora(trainer, folder: Path) -> Path:
    """Write `trainer`'s LoRA (the EMA where the run keeps one, as a finished run's ``lora/``) to `folder`; returns
    `folder`."""
    trainer.model.save_lora(folder, trainer.policy.exported())
    return folder


def teacher_overrides(preset_teachers: list[str], teachers: dict[str, tuple[Path, list[str]]]) -> list[str]:
    """The overrides that replace Flow-OPD's preset teachers (`preset_teachers`, dropped with ``null`` unless a group
    has the name) by the group teachers ``{name: (LoRA folder, tags)}``."""
    over = [f"train.opd.teachers.{n}=null" for n in preset_teachers if n not in teachers]
    for name, (lora, tags) in teachers.items():
        over += [f"train.opd.teachers.{name}.lora={lora}", f"train.opd.teachers.{name}.tags=[{','.join(tags)}]"]
    return over


def cell(values: list[float], fmt: str = "{:.3f}") -> str:
    """One table cell: the value (one seed, or several that agree), else ``mean (min-max)``; ``-`` for none."""
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    if len(set(values)) == 1:
        return fmt.format(values[0])
    return f"{fmt.format(statistics.mean(values))} ({fmt.format(min(values))}-{fmt.format(max(values))})"


def markdown(result: dict) -> str:
    """The experiment's tables from :func:`main`'s results: per run (teachers, student, baseline, base) the per-tag
    accuracy on the trained and on the held-out prompts, and per tag the student against the baseline."""
    meta, rows = result["meta"], result["rows"]
    groups = meta["groups"]
    tags = [t for g in groups.values() for t in g]
    by_run: dict[str, list[dict]] = {}
    for row in rows:
        by_run.setdefault(row["run"], []).append(row)
    order = ["base"] * bool(result.get("base")) + [f"teacher:{g}" for g in groups] + ["opd student", "baseline"]
    runs = {"base": [result["base"]]} if result.get("base") else {}
    runs.update({r: by_run[r] for r in order if r in by_run})
    seeds = sorted({r["seed"] for r in rows})
    budget = meta["teacher_budget_s"] * len(groups) + meta["student_budget_s"]
    lines = [
        f"Machine: {meta['machine']}. Teachers: `{meta['method']}`, {meta['teacher_budget_s']:g} s of training each on "
        f"their group's prompts; Flow-OPD student (`flow_opd`, cold start: {meta['cold_start']}): "
        f"{meta['student_budget_s']:g} s on all of them; baseline: `{meta['method']}`, {budget:g} s on all of them "
        f"(evaluation not counted). At most {meta['prompts_per_tag']} train prompts per tag; groups: "
        + "; ".join(f"{g} = {', '.join(t)}" for g, t in groups.items())
        + f". Seeds {', '.join(map(str, seeds))}: mean (min-max). GenEval strict accuracy.",
    ]
    for which, title in (("trained", "Trained prompts"), ("held_out", "Held-out prompts (assets/prompts/test.jsonl)")):
        lines += [
            "",
            f"{title}:",
            "",
            "| run | seeds | iterations | train s | " + " | ".join(tags) + " | overall |",
            "| --- " * (len(tags) + 5) + "|",
        ]
        for run, rs in runs.items():
            its = cell([r.get("iterations") for r in rs], "{:.0f}")
            secs = cell([r.get("train_s") for r in rs], "{:.0f}")
            per = [cell([r[which]["per_tag"].get(t) for r in rs]) for t in tags]
            seen = "-" if run == "base" else str(len(rs))
            overall = cell([r[which]["overall"] for r in rs])
            lines.append(f"| {run} | {seen} | {its} | {secs} | " + " | ".join(per) + f" | {overall} |")
    student, baseline = by_run.get("opd student", []), by_run.get("baseline", [])
    if student and baseline:
        lines += [
            "",
            "Student against baseline, per tag (difference of the means):",
            "",
            "| tag | group | student trained | baseline trained | difference | student held-out | baseline held-out "
            "| difference |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for group, group_tags in [*groups.items(), ("all", ["overall"])]:
            for tag in group_tags:
                cells = []
                for which in ("trained", "held_out"):

                    def values(rs, which=which, tag=tag):
                        """The tag's (or the overall) accuracy of each row of `rs`."""
                        return [r[which]["overall"] if tag == "overall" else r[which]["per_tag"].get(tag) for r in rs]

                    s, b = values(student), values(baseline)
                    diff = statistics.mean(s) - statistics.mean(b) if None not in s + b else None
                    cells += [cell(s), cell(b), "-" if diff is None else f"{diff:+.3f}"]
                lines.append(f"| {tag} | {group} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, dict[str, list[dict]]]:
    """The command line, checked before torch imports; returns ``(arguments, each group's train prompt records)``.

    Raises:
        SystemExit: usage errors (argparse's one line): an unknown preset, a budget <= 0, ``--prompts-per-tag`` < 1,
            bad ``--groups`` (:func:`parse_groups`, :func:`split_prompts`).
    """
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--method", default="dgpo", help="the teachers' and the baseline's preset (default: dgpo)")
    parser.add_argument(
        "--groups",
        nargs="+",
        default=[f"{g}={','.join(t)}" for g, t in GROUPS.items()],
        help="NAME=TAG[,TAG...] per teacher (default: %(default)s)",
    )
    parser.add_argument("--prompts-per-tag", type=int, default=8, help="train prompts per tag, at most (default: 8)")
    parser.add_argument("--teacher-budget-s", type=float, default=180.0, help="training seconds per teacher")
    parser.add_argument("--student-budget-s", type=float, default=180.0, help="training seconds of the student")
    parser.add_argument(
        "--cold-start", choices=("merge", "none"), default="merge", help="the student's start (default: merge)"
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="seeds (default: 0)")
    parser.add_argument("--overrides", nargs="*", default=[], help="key=value for every run (after the world's)")
    parser.add_argument("--out", default="benchmarks/results/seesaw.json", help="JSON out (and .md beside it)")
    parser.add_argument("--append", action="store_true", help="add the runs to --out's results (same settings)")
    a = parser.parse_args(argv)
    missing = [p for p in (a.method, "flow_opd") if not (REPO / "configs" / f"{p}.yaml").is_file()]
    if missing:
        parser.error(f"--method: unknown preset {missing[0]!r} (no configs/{missing[0]}.yaml)")
    for key in ("teacher_budget_s", "student_budget_s"):
        if not getattr(a, key) > 0:
            parser.error(f"--{key.replace('_', '-')} must be > 0, got {getattr(a, key)}")
    if a.prompts_per_tag < 1:
        parser.error(f"--prompts-per-tag must be >= 1, got {a.prompts_per_tag}")
    bad = [o for o in a.overrides if "=" not in o]
    if bad:
        parser.error(f"--overrides {bad[0]!r}: expected key=value")
    try:
        a.groups = parse_groups(a.groups)
        split = split_prompts(read_records(TRAIN), a.groups, a.prompts_per_tag)
    except ValueError as e:
        parser.error(str(e))
    return a, split


def main(argv: list[str] | None = None) -> dict:
    """Run the experiment (module docstring); returns the results dict."""
    import tempfile

    a, split = parse_args(argv)
    from flowrl.config import load_config  # after the arguments: --help answers at once, before torch
    from flowrl.evaluation import machine
    from flowrl.merge import merge_loras

    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "machine": machine(),
        "method": a.method,
        "groups": a.groups,
        "prompts_per_tag": a.prompts_per_tag,
        "prompts": {g: [r["prompt"] for r in rs] for g, rs in split.items()},
        "teacher_budget_s": a.teacher_budget_s,
        "student_budget_s": a.student_budget_s,
        "cold_start": a.cold_start,
        "overrides": a.overrides,
    }
    result = {"meta": meta, "rows": []}
    if a.append and out.is_file():
        result = json.loads(out.read_text())
        old = {k: v for k, v in result["meta"].items() if k != "machine"}
        new = {k: v for k, v in meta.items() if k != "machine"}
        if old != new:
            changed = sorted(k for k in new if old.get(k) != new[k])
            print(f"error: --append: {out} was measured with other {', '.join(changed)}", file=sys.stderr)
            raise SystemExit(2)
        if result["meta"]["machine"] != meta["machine"]:
            print(f"error: --append: {out} was measured on {result['meta']['machine']!r}", file=sys.stderr)
            raise SystemExit(2)

    def record(row: dict) -> None:
        """Add `row` (its base evaluation to the results' ``base``) and rewrite the JSON and the Markdown."""
        if "base" in row:
            result["base"] = {"run": "base", **row.pop("base")}
        result["rows"].append(row)
        print(json.dumps(row), flush=True)
        out.write_text(json.dumps(result, indent=1))
        out.with_suffix(".md").write_text(markdown(result))

    preset_teachers = list(load_config(REPO / "configs" / "flow_opd.yaml").train.opd.teachers)
    union_records = [r for rs in split.values() for r in rs]
    tags = {t for ts in a.groups.values() for t in ts}
    for seed in a.seeds:
        with tempfile.TemporaryDirectory() as tmp:
            tmp = Path(tmp)
            union = write_jsonl(union_records, tmp / "union.jsonl")
            held = write_jsonl([r for r in read_records(HELD_OUT) if r.get("tag") in tags], tmp / "held_out.jsonl")
            world = [*WORLD, f"eval.prompts={union}", f"eval.held_out={held}", *a.overrides]
            teachers: dict[str, tuple[Path, list[str]]] = {}
            for group, records in split.items():
                prompts = write_jsonl(records, tmp / f"{group}.jsonl")
                settings = [*world, f"train_prompts={prompts}"]
                base = "base" not in result
                row, trainer = run_one(
                    f"teacher:{group}", a.method, settings, seed, a.teacher_budget_s, tmp / group, base
                )
                teachers[group] = (export_lora(trainer, tmp / f"{group}_lora"), a.groups[group])
                del trainer
                record(row)
            settings = [*world, f"train_prompts={union}", *teacher_overrides(preset_teachers, teachers)]
            merge_s = None
            if a.cold_start == "merge":
                rank = load_config(REPO / "configs" / "flow_opd.yaml", settings).model.lora_rank
                t0 = time.time()
                merged = merge_loras([f for f, _ in teachers.values()], tmp / "cold_start", None, "svd", rank)
                merge_s = time.time() - t0
                settings.append(f"train.opd.init={merged}")
            row, trainer = run_one("opd student", "flow_opd", settings, seed, a.student_budget_s, tmp / "student")
            del trainer
            record({**row, "merge_s": merge_s})
            total = a.teacher_budget_s * len(teachers) + a.student_budget_s
            settings = [*world, f"train_prompts={union}"]
            row, trainer = run_one("baseline", a.method, settings, seed, total, tmp / "baseline")
            del trainer
            record(row)
    return result


if __name__ == "__main__":
    main()
