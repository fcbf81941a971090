"""The run's evaluator: what the trainer evaluates and with which settings, over the functions of
:mod:`flowrl.evaluation`.

An evaluation is ODE sampling (the EMA weights where there are some, the run's autocast) of ``eval.prompts``, and of
``eval.held_out`` where that is set, judged by GenEval strict accuracy where the prompts carry GenEval metadata and by
the mean of the run's rewards otherwise. The before/after grid is 12 images of the eval prompts at fixed seeds.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from .evaluation import evaluate, evaluate_reward, expand_per_tag, generate

__all__ = ["Evaluator", "before_after_line", "eval_metrics", "geneval_reader"]

GRID_IMAGES = 12
"""Images in the before/after grid."""


def geneval_reader(rewards):
    """The configured ``geneval`` / ``geneval_strict`` reward of `rewards` (a :class:`flowrl.rewards.WeightedSum`)
    when it reads real images (its real backend), so the evaluation judges with the same segmenter; None (the tiny
    world's detector) otherwise."""
    for reward, _ in rewards.rewards.values():
        if getattr(reward, "detector", None) is not None and hasattr(reward, "judge"):
            return reward
    return None


def eval_metrics(result: dict) -> dict[str, float]:
    """An evaluation's logged metrics: ``eval/overall`` and ``eval/<tag>`` per tag, from :meth:`Evaluator.evaluate`'s
    ``overall`` and ``per_tag``."""
    return {"eval/overall": result["overall"], **{f"eval/{k}": v for k, v in result["per_tag"].items()}}


COMPARED = ("n_images", "num_steps", "guidance_scale")
"""What two evaluations must share to be printed as one before -> after comparison."""


def run_summary(cfg, result: dict, whole_s: float, out) -> str:
    """The line a finished run prints: :func:`before_after_line` of ``result`` (:meth:`flowrl.trainer.Trainer.train`'s)
    with its minutes of training and ``whole_s`` seconds of the whole call (start-up and export too), and the run
    folder ``out``."""
    line = before_after_line(result["before"], result["after"], cfg.eval.prompts, cfg.eval.held_out)
    trained, whole = result["wall_time_s"] / 60, whole_s / 60
    return f"{line} in {trained:.1f} min of training ({whole:.1f} min in this call with start-up and export); run folder {out}"


def before_after_line(before: dict, after: dict, prompts: str, held_out: str | None = None) -> str:
    """The run's summary, e.g. ``"GenEval strict accuracy on test prompts: 0.250 -> 0.279"`` (other prompts: the mean
    weighted reward, and each reward's where there are several; ``held_out``: the same for ``eval.held_out``). Two
    evaluations that differ in :data:`COMPARED` are printed apart, each with its image count, not as one comparison.

    Args:
        before, after (`dict`): :meth:`Evaluator.with_held_out` results before and after training.
        prompts (`str`): ``eval.prompts``. held_out (`str`, optional): ``eval.held_out``.
    """
    rewards = before.get("per_reward", {})
    what = "mean weighted reward" if "per_reward" in before else "GenEval strict accuracy"

    def pair(b: dict, a: dict) -> str:
        if all(b.get(k) == a.get(k) for k in COMPARED):
            return f"{b['overall']:.3f} -> {a['overall']:.3f}"
        return (
            f"before {b['overall']:.3f} ({b.get('n_images')} images, {b.get('num_steps')} steps), after "
            f"{a['overall']:.3f} ({a.get('n_images')} images, {a.get('num_steps')} steps): evaluated differently, "
            "not compared"
        )

    line = f"{what} on {prompts} prompts: {pair(before, after)}"
    if len(rewards) > 1 and all(before.get(k) == after.get(k) for k in COMPARED):
        line += " (" + ", ".join(f"{k} {v:.3f} -> {after['per_reward'][k]:.3f}" for k, v in rewards.items()) + ")"
    if "held_out" in before and "held_out" in after:
        line += f"; held-out {held_out} prompts: {pair(before['held_out'], after['held_out'])}"
    return line


class Evaluator:
    """Evaluates the run's policy and draws its before/after grid.

    Args:
        cfg (:class:`flowrl.config.Config`): the run (``eval.*``, ``sampling.shift`` and ``sampling.batch_size``).
        model (:class:`flowrl.models.FlowModel`): the adapter.
        policy (:class:`flowrl.policy.Policy`): its ``ema_weights()`` and ``autocast()`` are entered to evaluate.
        accelerator (`accelerate.Accelerator`): the images of an evaluation are split over its processes.
        rewards (:class:`flowrl.rewards.WeightedSum`): the run's rewards (the judge of prompts without GenEval
            metadata; a real-backend GenEval reward judges GenEval prompts: :func:`geneval_reader`).
        metas (`list[dict]`): the prompt records of ``eval.prompts``, at least one.
        held_out (`list[dict]`): those of ``eval.held_out``; empty when it is unset.
    """

    def __init__(self, cfg, model, policy, accelerator, rewards, metas: list[dict], held_out: list[dict]):
        self.cfg, self.model, self.policy, self.accelerator = cfg, model, policy, accelerator
        self.rewards, self.metas, self.held_out = rewards, metas, held_out

    def plan(self) -> str:
        """What an evaluation draws, in words, e.g. ``"256 images of eval.prompts, 192 of eval.held_out, 10 Euler
        steps"``."""
        e = self.cfg.eval
        plan = f"{len(self.selection(self.metas, e.images_per_tag))} images of eval.prompts"
        if self.held_out:
            plan += f", {len(self.selection(self.held_out, e.held_out_images_per_tag))} of eval.held_out"
        return f"{plan}, {e.num_steps} Euler steps"

    @staticmethod
    def selection(metas: list[dict], images_per_tag: int) -> list[dict]:
        """The prompt records an evaluation of `metas` draws one image of each, for every prompt file alike (GenEval
        metadata or not): `images_per_tag` per tag, each tag's prompts taken in turn (records without a ``tag`` are
        one tag; :func:`flowrl.evaluation.expand_per_tag`); 0: every record once (in the file's order where the
        records carry no GenEval metadata)."""
        if images_per_tag == 0 and not all("include" in m for m in metas):
            return list(metas)
        return expand_per_tag(metas, images_per_tag)

    def evaluate(self, metas: list[dict] | None = None, images_per_tag: int | None = None) -> dict:
        """Evaluation with ODE sampling (EMA weights if configured) of ``eval.prompts`` (or `metas`, with
        `images_per_tag` instead of ``eval.images_per_tag``), one image per record of :meth:`selection`: GenEval
        strict accuracy where the prompts carry GenEval metadata, else the mean of the run's rewards. Every process
        calls it and gets the whole result.

        Returns:
            `dict`: ``{"overall": float, "per_tag": {tag: float}, "n_images": int, ...}`` (accuracies in [0, 1]:
            :func:`flowrl.evaluation.evaluate`; reward means in the rewards' units:
            :func:`flowrl.evaluation.evaluate_reward`).
        """
        e, shift, batch = self.cfg.eval, self.cfg.sampling.shift, self.cfg.sampling.batch_size
        metas = metas or self.metas
        images_per_tag = e.images_per_tag if images_per_tag is None else images_per_tag
        acc = self.accelerator
        with self.policy.ema_weights(), self.policy.autocast():
            if all("include" in m for m in metas):
                judge = geneval_reader(self.rewards)
                steps = (images_per_tag, e.num_steps, e.guidance_scale, shift, e.seed, batch)
                return evaluate(self.model, metas, *steps, accelerator=acc, judge=judge)
            steps = (1, e.num_steps, e.guidance_scale, shift, e.seed, batch)
            chosen = self.selection(metas, images_per_tag)
            return evaluate_reward(self.model, chosen, self.rewards, *steps, accelerator=acc)

    def with_held_out(self) -> dict:
        """:meth:`evaluate`, with ``"held_out"``: the same evaluation of ``eval.held_out``
        (``eval.held_out_images_per_tag``, its file named under ``"prompts"``) when that is set."""
        result = self.evaluate()
        if self.held_out:
            result["held_out"] = self.evaluate(self.held_out, self.cfg.eval.held_out_images_per_tag)
            result["held_out"]["prompts"] = self.cfg.eval.held_out
        return result

    def grid_metas(self) -> list[dict]:
        """12 prompt records: the first two eval prompts of each tag, cycled when there are fewer (new seeds)."""
        by_tag = defaultdict(list)
        for m in self.metas:
            by_tag[m.get("tag", "all")].append(m)
        first = [m for tag in by_tag for m in by_tag[tag][:2]]
        return [first[i % len(first)] for i in range(GRID_IMAGES)]

    def shared_grid(self) -> torch.Tensor | None:
        """:meth:`grid_images` on the processes that must draw it: the main process (which writes the grid), and in
        lockstep (:attr:`flowrl.policy.Policy.lockstep`: FSDP2 full shard, ZeRO-3) every process alike, so that all
        make the same sharded forwards; None on the others."""
        if self.accelerator.is_main_process or self.policy.lockstep:
            return self.grid_images()
        return None

    def grid_images(self) -> torch.Tensor:
        """The grid's images, float32 `(12, 3, H, W)` in [0, 1] on CPU (a video model's `(12, F, 3, H, W)`): the
        :meth:`grid_metas` at seeds ``eval.seed + i``, with the evaluation's sampling."""
        e = self.cfg.eval
        with self.policy.ema_weights(), self.policy.autocast():
            metas = self.grid_metas()
            seeds = [e.seed + i for i in range(GRID_IMAGES)]
            prompts = [m["prompt"] for m in metas]
            return generate(
                self.model, prompts, seeds, e.num_steps, e.guidance_scale, self.cfg.sampling.shift, metas=metas
            )
