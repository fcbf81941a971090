"""Where the quick-start job's time goes: the rollout by component (transformer, the guidance combination, the VAE
decode, the rest of the sampler: Python and small tensor ops), the update (forwards, backwards, optimizer), scoring,
and one before/after evaluation.

    python benchmarks/quickstart_profile.py [--config configs/quickstart.yaml] [--iterations 3] [key=value ...]

Builds the job's :class:`flowrl.trainer.Trainer` in a temporary run folder, runs one warm-up iteration, then times
``--iterations`` iterations with wall-clock hooks on the transformer (split by whether a forward records gradients),
the VAE decode, the guidance combination, the rewards and the optimizer step, and one evaluation of the base model
(both prompt sets). Prints a table (seconds per iteration, medians) and writes it as JSON with ``--out``.
Timings are wall seconds on the CPU (synchronous), so the parts add up to the whole.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections import defaultdict
from contextlib import contextmanager


class Clock:
    """Wall seconds per named part, summed over an iteration (``totals``) and kept per iteration (``rows``)."""

    def __init__(self):
        self.totals: dict[str, float] = defaultdict(float)
        self.rows: list[dict[str, float]] = []
        self.depth = 0

    @contextmanager
    def part(self, name: str):
        """Time the block as ``name`` (nested parts are timed apart from their parent's own remainder)."""
        t = time.perf_counter()
        try:
            yield
        finally:
            self.totals[name] += time.perf_counter() - t

    def wrap(self, obj, attr: str, name) -> None:
        """Replace ``obj.attr`` (a callable) by a timed one; ``name`` a string or ``fn() -> str``."""
        inner = getattr(obj, attr)

        def timed(*args, **kwargs):
            with self.part(name() if callable(name) else name):
                return inner(*args, **kwargs)

        setattr(obj, attr, timed)

    def close_row(self, **extra: float) -> None:
        """End an iteration's row."""
        self.rows.append({**self.totals, **extra})
        self.totals = defaultdict(float)


def main(argv: list[str] | None = None) -> dict:
    """Run the profile; returns ``{"rows": [...], "median": {...}, "eval_s": float}``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/quickstart.yaml")
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--skip-eval", action="store_true", help="do not time the evaluation")
    parser.add_argument("--out", default=None, help="write the table as JSON here")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    import torch  # after the arguments: --help answers at once

    from flowrl.config import load_config
    from flowrl.trainer import Trainer

    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(args.config, [*args.overrides, f"run.output_dir={tmp}/run"])
        t = time.perf_counter()
        trainer = Trainer(cfg)
        setup_s = time.perf_counter() - t
        clock, model = Clock(), trainer.model
        phase = {"now": "other"}

        def in_phase(obj, attr: str, name: str) -> None:
            """Time ``obj.attr`` as ``name`` and mark the transformer calls inside it as of phase ``name``."""
            inner = getattr(obj, attr)

            def marked(*args, **kwargs):
                phase["now"] = name
                try:
                    return inner(*args, **kwargs)
                finally:
                    phase["now"] = "other"

            setattr(obj, attr, marked)
            clock.wrap(obj, attr, name)

        def transformer_part() -> str:
            return f"transformer in {phase['now']}" + (", with gradients" if torch.is_grad_enabled() else "")

        clock.wrap(model.transformer, "forward", transformer_part)
        clock.wrap(model, "decode", "VAE decode")
        clock.wrap(model, "_guide", "guidance combination")
        in_phase(trainer.scorer, "rollout", "rollout and scoring")
        in_phase(trainer.method, "update", "update")
        clock.wrap(trainer.policy.optimizer, "step", "optimizer step")
        trainer.step(0)  # warm-up
        clock.totals = defaultdict(float)
        for it in range(1, args.iterations + 1):
            t = time.perf_counter()
            metrics = trainer.step(it)
            clock.close_row(
                iteration=time.perf_counter() - t,
                sample_s=metrics["time/sample_s"],
                score_s=metrics["time/score_s"],
                train_s=metrics["time/train_s"],
            )
        eval_s = None
        if not args.skip_eval:
            t = time.perf_counter()
            phase["now"] = "evaluation"
            with clock.part("evaluation"):
                trainer.evaluator.with_held_out()
            eval_s = time.perf_counter() - t
            eval_parts = dict(clock.totals)
    keys = sorted({k for row in clock.rows for k in row})
    median = {k: statistics.median(row.get(k, 0.0) for row in clock.rows) for k in keys}
    get = median.get
    median["rollout, the rest (sampler steps, Python)"] = (
        get("sample_s", 0.0) - get("transformer in rollout and scoring", 0.0) - get("VAE decode", 0.0)
    )
    median["update, the rest (backward, loss, optimizer)"] = (
        get("update", 0.0) - get("transformer in update", 0.0) - get("transformer in update, with gradients", 0.0)
    )
    keys = sorted(median)
    result = {
        "config": args.config,
        "overrides": args.overrides,
        "threads": torch.get_num_threads(),
        "setup_s": setup_s,
        "median": median,
        "rows": clock.rows,
        "eval_s": eval_s,
        "eval_parts": eval_parts if eval_s is not None else None,
    }
    width = max(map(len, keys))
    print(f"set-up (model, LoRA, rewards): {setup_s:.2f} s; torch threads {torch.get_num_threads()}")
    for k in keys:
        print(f"{k:<{width}}  {median[k]:7.3f} s / iteration")
    if eval_s is not None:
        print(
            f"one evaluation (both prompt sets): {eval_s:.2f} s; "
            + ", ".join(f"{k} {v:.2f} s" for k, v in eval_parts.items() if k != "evaluation")
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
