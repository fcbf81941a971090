"""Reward scoring for the loop: the run's rewards built from the config (or given to the trainer) and smoke-called at
set-up, each rollout's images scored (after the sampling, or overlapped with it: ``sampling.overlap_rewards``,
:mod:`flowrl.overlap`), the scores gathered over the processes into :class:`flowrl.methods.Rewards`, and the
iteration's ``reward/*`` and ``cost/*`` metrics.

:class:`Scorer` is what :meth:`flowrl.trainer.Trainer.step` calls; :func:`build_rewards` and :func:`given_rewards` are
its set-up.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass

import torch

from .config import ConfigError, RewardConfig
from .diagnostics import tag_means
from .files import resolve_option_paths
from .methods import Rewards
from .overlap import ChunkWorker, cat_scores, chunk_images
from .rewards import CombinedScores, RewardTypeError, WeightedSum, build_reward, reward_name

__all__ = ["ScoredRollout", "Scorer", "build_rewards", "given_rewards"]


def given_rewards(rewards: dict | list | None) -> dict[str, tuple]:
    """The reward callables given to :class:`flowrl.trainer.Trainer` as ``{name: (callable, weight)}``: a dict of
    callables or of ``(callable, weight)`` pairs, or a list of callables named by :func:`flowrl.rewards.reward_name`
    (weight 1); ``{}`` for none.

    Raises:
        TypeError: naming the entry, for something that is not a callable or a ``(callable, weight)`` pair.
        ValueError: two rewards of one name in a list.
    """
    if not rewards:
        return {}
    if isinstance(rewards, (list, tuple)):
        names = [reward_name(r) for r in rewards]
        if len(set(names)) < len(names):
            raise ValueError(f"Trainer(rewards=[...]) names two rewards alike ({names}); pass a dict name -> reward")
        rewards = dict(zip(names, rewards))
    given = {}
    for name, entry in dict(rewards).items():
        fn, weight = entry if isinstance(entry, tuple) and len(entry) == 2 else (entry, 1.0)
        if not callable(fn):
            raise TypeError(
                f"Trainer(rewards=...): reward {name!r} is a {type(fn).__name__}, not a callable "
                "reward(images, prompts, metadata) -> scores or a (callable, weight) pair"
            )
        given[str(name)] = (fn, weight)
    return given


def build_rewards(configured: dict[str, RewardConfig], given: dict[str, tuple] | None = None) -> WeightedSum:
    """The run's rewards: `given` (``{name: (callable, weight)}``, :func:`given_rewards`) when there are any, else each
    config key ``rewards.NAME`` built (:func:`flowrl.rewards.build_reward` of its ``spec``, default ``NAME``, with its
    ``options``) at its ``weight``.

    Raises:
        ConfigError: naming ``rewards.NAME``, for an unknown reward, a missing module or a bad option.
        ValueError: no reward at all, or a weight that is not a finite number.
    """
    if given:
        return WeightedSum(given)
    built = {}
    for name, r in configured.items():
        try:
            built[name] = (build_reward(r.spec or name, **resolve_option_paths(r.options)), r.weight)
        except (ValueError, TypeError) as e:
            if isinstance(e, TypeError) and not isinstance(e, RewardTypeError):
                raise  # a bug inside the reward's factory: not disguised as bad input
            hint = (
                f" (a reward passed to Trainer(rewards=...) from a script: set rewards.{name}.spec=module:function)"
                if r.spec is None and str(e).startswith("unknown reward")
                else ""
            )
            raise ConfigError(f"config key 'rewards.{name}': {e}{hint}") from None
    return WeightedSum(built)


@dataclass
class ScoredRollout:
    """One rollout and its scores (:meth:`Scorer.rollout`).

    Attributes:
        samples: the method's samples (:class:`flowrl.methods.Samples`), ``images`` `(B, 3, H, W)` in [0, 1] (videos
            `(B, F, 3, H, W)`) and ``image_prompt`` `(B,)` long among them.
        scores (:class:`flowrl.rewards.CombinedScores`): this process's scores, ``.total`` `(B,)` float32.
        sampled_at (`float`): the ``time.time()`` the sampling ended.
        worker_s (`float` or None): with ``sampling.overlap_rewards``, the worker's busy seconds; else None.
        judge_calls (`int`): judgements the pairwise rewards made for this rollout (0 without one).
    """

    samples: object
    scores: CombinedScores
    sampled_at: float
    worker_s: float | None
    judge_calls: int


class Scorer:
    """Scores the loop's rollouts with the run's rewards and gathers the scores over the processes.

    Args:
        rewards (:class:`flowrl.rewards.WeightedSum`): the run's rewards (:func:`build_rewards`).
        sampling (:class:`flowrl.config.SamplingConfig`): ``overlap_rewards``, ``batch_size``, ``group_size`` and
            ``prompts_per_iteration``.
        accelerator (`accelerate.Accelerator`): the run's processes (``device``, ``process_index``, ``gather``).

    Warns:
        UserWarning: ``sampling.overlap_rewards`` where a rollout is one chunk (nothing overlaps).
    """

    def __init__(self, rewards: WeightedSum, sampling, accelerator):
        self.rewards, self.sampling, self.accelerator = rewards, sampling, accelerator
        s, chunk = sampling, chunk_images(sampling.batch_size, sampling.group_size)
        if s.overlap_rewards and chunk >= s.prompts_per_iteration * s.group_size:
            warnings.warn(
                f"sampling.overlap_rewards: a rollout of {s.prompts_per_iteration * s.group_size} images is one chunk "
                f"of lcm(sampling.batch_size, sampling.group_size) = {chunk}, so nothing overlaps; lower "
                "sampling.batch_size",
                UserWarning,
                stacklevel=3,
            )

    def smoke(self, model, metas: list[dict]) -> None:
        """Call the rewards once on mid-grey images of the rollouts' size (``(2, 3, H, W)``, a video model's
        ``(2, F, 3, H, W)``) for the first two of `metas`, both in one group (a pairwise judge judges them): a broken
        reward fails at set-up, named, not after the first rollout.

        Raises:
            ValueError: a reward returning the wrong shape, NaN or inf, named. RewardError: one that raises.
        """
        metas, side = [{**m, "group": 0} for m in metas[:2]], model.resolution
        shape = model.decoded_shape if model.VIDEO else (3, side, side)  # a video: (F, 3, H, W)
        self.rewards(torch.full((len(metas), *shape), 0.5), [m["prompt"] for m in metas], metas)

    def score(self, images: torch.Tensor, image_prompt: torch.Tensor, metas: list[dict]) -> CombinedScores:
        """Score ``images`` `(B, 3, H, W)` in [0, 1], image ``b`` drawn for ``metas[image_prompt[b]]``; each image's
        metadata carries ``"group"`` = its prompt slot (group-wise rewards such as Pref-GRPO's win rates).

        Returns:
            The reward set's scores (``.total`` float32 ``(B,)``, ``.per_reward``).

        Raises:
            ValueError: a reward returning the wrong shape, NaN or inf, named. RewardError: one that raises.
        """
        leaf_metas = [{**metas[i], "group": i} for i in image_prompt.tolist()]
        return self.rewards(images, [m["prompt"] for m in leaf_metas], leaf_metas)

    def rollout(self, method, metas: list[dict], generator: torch.Generator) -> ScoredRollout:
        """The method's rollout of `metas` and its scores: sampled then scored, or, with ``sampling.overlap_rewards``,
        scored chunk by chunk while the next chunk samples (:meth:`overlapped_rollout`); the pairwise rewards'
        judgements counted.

        Raises:
            As :meth:`score`.
        """
        judged, worker_s = self.judge_calls(), None
        if self.sampling.overlap_rewards:  # each chunk decoded and scored in a worker while the next one samples
            samples, scores, sampled_at, worker_s = self.overlapped_rollout(method, metas, generator)
        else:
            samples = method.rollout(metas, generator)
            sampled_at = time.time()
            scores = self.score(samples.images, samples.image_prompt, metas)
        return ScoredRollout(samples, scores, sampled_at, worker_s, self.judge_calls() - judged)

    def overlapped_rollout(self, method, metas: list[dict], generator: torch.Generator):
        """The method's rollout in chunks of ``lcm(sampling.batch_size, sampling.group_size)`` images
        (:meth:`flowrl.methods.Method.rollout_in_chunks`), each chunk decoded and scored (:meth:`score`) in a worker
        thread (:class:`flowrl.overlap.ChunkWorker`) while the next one samples: the samples and scores of
        :meth:`Method.rollout` then :meth:`score`, where a reward scores an image alike in any batch of whole groups.

        Returns:
            ``(samples, scores, t_sampled, worker_s)``: the samples with their ``images`` `(B, 3, H, W)`, the scores
            (``.total`` `(B,)`), the ``time.time()`` the sampling ended, the worker's busy seconds.

        Raises:
            As :meth:`score` (a reward's error, named), re-raised from the worker once the chunk that hit it is done.
        """
        s = self.sampling

        def decode_and_score(latents: torch.Tensor, image_prompt: torch.Tensor):
            images = method.decode(latents)  # (n, 3, H, W) on the CPU
            return images, self.score(images, image_prompt, metas)

        with ChunkWorker(decode_and_score, self.accelerator.device) as worker:
            samples = method.rollout_in_chunks(
                metas, generator, chunk_images(s.batch_size, s.group_size), worker.submit
            )
            t_sampled = time.time()
            done = worker.results()
        samples.images = torch.cat([images for images, _ in done])  # (B, 3, H, W)
        return samples, cat_scores([scores for _, scores in done]), t_sampled, worker.busy_s

    def gather(self, scores: CombinedScores, image_prompt: torch.Tensor, prompts: int) -> Rewards:
        """The iteration's rewards gathered over every process, once (:class:`flowrl.methods.Rewards`): the totals,
        each reward's scores and the images' groups (prompt slots made unique over processes).

        Args:
            scores: this process's :class:`flowrl.rewards.CombinedScores` (``.total`` `(B,)`, ``.per_reward``).
            image_prompt (`torch.Tensor` of shape `(B,)`, long): each image's prompt slot in ``[0, prompts)``.
            prompts (`int`): prompts per process.
        """
        acc, device = self.accelerator, self.accelerator.device
        total = acc.gather(scores.total.to(device)).cpu()  # (B_all,) every process's totals
        per_reward = {k: acc.gather(v.to(device)).cpu() for k, v in scores.per_reward.items()}
        group = acc.gather((image_prompt + acc.process_index * prompts).to(device)).cpu()  # (B_all,)
        rows = len(scores.total)
        mine = slice(acc.process_index * rows, (acc.process_index + 1) * rows)
        return Rewards(scores, total, per_reward, group, mine)

    def judge_calls(self) -> int:
        """Cumulative judgements of the pairwise rewards (:attr:`rewards.PrefWinRate.judge_calls`), 0 if none."""
        return sum(getattr(r, "judge_calls", 0) for r, _ in self.rewards.rewards.values())

    def metrics(self, rewards: Rewards, scored: ScoredRollout, metas: list[dict]) -> dict[str, float]:
        """The iteration's reward metrics: ``reward/total/{mean,std}`` over every process, ``reward/<name>/mean`` and
        ``reward/tag/<tag>/mean`` of this process's images (:func:`flowrl.diagnostics.tag_means`),
        ``cost/reward_calls`` (images scored) and, with a pairwise reward, ``cost/judge_calls``.

        Args:
            rewards: :meth:`gather`'s result; scored: :meth:`rollout`'s; metas: the rollout's prompt records.
        """
        scores, image_prompt = scored.scores, scored.samples.image_prompt
        metrics = {"reward/total/mean": rewards.total.mean().item(), "reward/total/std": rewards.total.std().item()}
        metrics.update({f"reward/{name}/mean": s.mean().item() for name, s in scores.per_reward.items()})
        metrics.update(tag_means(scores.total, [metas[i].get("tag", "all") for i in image_prompt.tolist()]))
        metrics["cost/reward_calls"] = len(scores.total)
        if any(hasattr(r, "judge_calls") for r, _ in self.rewards.rewards.values()):
            metrics["cost/judge_calls"] = scored.judge_calls
        return metrics
