"""The training loop: sample -> score -> advantages -> policy update -> log -> evaluate -> checkpoint.

:class:`Trainer` reads top to bottom: the constructor sets the run up, :meth:`Trainer.train` runs the iterations in
their order, :meth:`Trainer.step` is one of them. Each concern it calls is a unit of its own, tested apart: the method
(rollout, advantages, loss: :mod:`flowrl.methods`, by ``train.method``); the trained weights and optimizer
(:class:`flowrl.policy.Policy`); the model family (:mod:`flowrl.models`); the prompts drawn
(:class:`flowrl.prompt_sampler.PromptSampler`); reward scoring, overlapped with sampling or not, and its gather over
processes (:class:`flowrl.scoring.Scorer`); evaluation and the before/after grid (:class:`flowrl.evaluator.Evaluator`);
the run folder's lock, resume choice and metrics log (:class:`flowrl.run.RunFolder`), its checkpoints, evaluation
files and exports (:class:`flowrl.checkpointer.Checkpointer`); diagnostics (diversity, peak memory, per-tag rewards,
precisions: :mod:`flowrl.diagnostics`); stop rules (:mod:`flowrl.diversity`); trackers (:mod:`flowrl.trackers`).
"""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from .checkpoint import explain_disk_full
from .checkpointer import Checkpointer
from .config import Config, ConfigError, RewardConfig, save_config
from .diagnostics import diversity_metrics, diversity_probe, peak_memory, precision_summary, resolve_precisions
from .diversity import StopRules
from .evaluator import Evaluator, eval_metrics, run_summary
from .methods import METHODS, Rewards, build_method
from .models.memory import prepare_for_training
from .pairing import build_model, resolve_model
from .policy import Policy, check_launch
from .prompt_sampler import PromptSampler, iteration_seed, read_run_prompts
from .resume import check_resume, say
from .rewards import reward_spec
from .run import RunFolder
from .scoring import Scorer, build_rewards, given_rewards
from .trackers import Trackers
from .zero import load_whole, quiet_cpu_notice


class Trainer:
    """Runs one configured job end to end, writing everything to ``config.run.output_dir``.

    Args:
        config (:class:`flowrl.config.Config`): the run (:func:`flowrl.load_config`; ``flowrl config`` lists its keys).
        rewards (optional): reward callables ``reward(images, prompts, metadata) -> scores`` to train on instead of
            the config's ``rewards`` section, as trl's trainers take ``reward_funcs``: a dict ``name -> callable`` or
            ``name -> (callable, weight)``, or a list of callables (named by their ``name`` or ``__name__``,
            weight 1). ``config.yaml`` records their names, weights and, where a callable has one, its import path
            (``rewards.NAME.spec``, :func:`flowrl.rewards.reward_spec`): ``flowrl train RUN/config.yaml
            run.resume=true`` then rebuilds it; a Python resume passes them again.

    Attributes: ``cfg`` (resolved), ``out`` (the run folder), ``accelerator``, ``model`` (the adapter), ``policy``,
    ``method``, ``rewards`` (:class:`flowrl.rewards.WeightedSum`), ``train_metas`` / ``eval_metas`` /
    ``held_out_metas`` (prompt records); the units the loop calls: ``prompts``, ``scorer``, ``evaluator``, ``run``,
    ``checkpointer``, ``trackers``, ``diversity`` (the CLIP probe or None). :meth:`train` holds the run folder's lock
    (main process) from before anything is written until it returns.

    Raises (at construction, before any sampling):
        TypeError: `config` is not a Config, or a given reward is not callable.
        ConfigError / FileNotFoundError: bad config values, model folder or prompt files.
        FileExistsError: ``run.output_dir`` holds a run and ``run.resume`` is off.
        RunFolderInUse: another process is training in ``run.output_dir``.
        OutputError: ``run.output_dir`` cannot be written.
        ValueError: a reward that fails its smoke call (wrong shape, NaN or inf), named; RewardError: one that
            raises.
    """

    def __init__(self, config: Config, rewards: dict | list | None = None):
        from accelerate import Accelerator, DistributedDataParallelKwargs
        from accelerate.utils import ProjectConfiguration

        self._built_at = time.time()  # the summary's minutes count start-up and export too
        if not isinstance(config, Config):
            raise TypeError(f"Trainer takes a flowrl.Config (flowrl.load_config(...)), got {type(config).__name__}")
        given = given_rewards(rewards)  # name -> (callable, weight); checked before any work
        if given:  # they replace the config's rewards section (recorded with each import path in config.yaml)
            recorded = {n: RewardConfig(weight=w, spec=reward_spec(fn)) for n, (fn, w) in given.items()}
            config = dataclasses.replace(config, rewards=recorded)
        self.cfg = cfg = config
        if cfg.run.device == "cuda" and not torch.cuda.is_available():
            raise ConfigError("config key 'run.device' is 'cuda' but no CUDA device is available; use auto or cpu")
        self.out = Path(cfg.run.output_dir)
        # precision is run.mixed_precision (our autocast); DDP: a family may leave parameters unused in a forward,
        # and every forward without gradients (rollouts, evaluation) bypasses the wrapper, so buffers are not synced
        ddp = DistributedDataParallelKwargs(find_unused_parameters=True, broadcast_buffers=False)
        quiet_cpu_notice()  # a ZeRO launch imports DeepSpeed here
        self.accelerator = acc = Accelerator(
            cpu=cfg.run.device == "cpu",
            kwargs_handlers=[ddp],
            log_with=list(cfg.run.log_with) or None,
            project_config=ProjectConfiguration(str(self.out), str(self.out / "tensorboard")),
        )
        self.trackers = Trackers(acc, cfg.run.log_with)
        self.run = RunFolder(self.out, acc, cfg.run.resume)  # not in use, no other run, writable: before any work
        self.device = acc.device
        self.cfg = cfg = resolve_precisions(cfg, self.device)  # auto -> bf16 or no; config.yaml records the choice
        method = METHODS[cfg.train.method]
        check_launch(acc, cfg, method.lockstep_blocker(cfg), method.engine_blockers(cfg))
        load_whole(acc)  # ZeRO-3 partitions the trained transformer only
        adapter = resolve_model(cfg)  # fills sampling.shift and model.max_sequence_length, as config.yaml has them
        if cfg.run.resume:  # the run's evaluations stay comparable; other changes are named (flowrl.resume)
            lines = self.run.on_main(lambda: check_resume(cfg, self.out))  # every process: one verdict
            say(lines if acc.is_main_process else [])
        # image-to-video: every record names its first frame
        self.train_metas, self.eval_metas, self.held_out_metas = read_run_prompts(cfg, adapter.SOURCE_REQUIRED)
        self.prompts = PromptSampler(self.train_metas, cfg, acc.process_index)
        data = METHODS[cfg.train.method].read_data(cfg)  # an offline data set: a bad file refused before the model
        self.rewards = build_rewards(cfg.rewards, given)
        self._say(f"loading {cfg.model.path} onto {self.device} ({adapter.PIPELINE})")  # the start-up's long part
        self.model = build_model(cfg, adapter, self.device)
        prompts = [x["prompt"] for x in self.train_metas + self.eval_metas + self.held_out_metas]
        prepare_for_training(self.model, cfg.model, cfg.run.seed, cfg.train.gradient_checkpointing, prompts, acc)
        self.policy = Policy(self.model, cfg.train, cfg.run.mixed_precision, acc)
        self.method = build_method(cfg, self.model, self.policy, self.rewards, data)
        self.diversity = diversity_probe(cfg.run.diversity_model, self.device) if self.method.online else None
        self.stop_rules = StopRules(cfg.run.stop_if)
        self.scorer = Scorer(self.rewards, cfg.sampling, acc)
        self.evaluator = Evaluator(
            cfg, self.model, self.policy, acc, self.rewards, self.eval_metas, self.held_out_metas
        )
        self.checkpointer = Checkpointer(cfg, self.run, self.model, self.policy, self.method)
        self._say(f"checking the rewards ({', '.join(self.rewards.rewards)}) on one batch")
        self.scorer.smoke(self.model, self.train_metas)  # a broken reward fails here, named

    def train(self) -> dict:
        """Run (or resume) the job, holding the run folder's lock throughout; the main process prints the before ->
        after line with the minutes taken (:func:`flowrl.evaluator.run_summary`).

        Returns:
            `dict`: ``{"before": eval, "after": eval, "wall_time_s": float, "iterations": int}``, plus ``"stopped"``
            (the rule that held) when a ``run.stop_if`` rule stopped the run early.

        Raises:
            RunFolderInUse: another process holds the run folder. FileExistsError: it holds a run and
            ``run.resume`` is off. CheckpointError: ``run.resume`` finds run files but no verified checkpoint.
            DiskFullError: the disk filled up; the message names the newest verified checkpoint.
        """
        with self.run.hold(), explain_disk_full(self.out / "checkpoints"):  # names the checkpoint to resume from
            return self._train()

    def _train(self) -> dict:
        """:meth:`train`'s body, under the lock: resume or evaluate the base model, iterate, evaluate, export."""
        cfg, main = self.cfg, self.accelerator.is_main_process
        start, elapsed = self.checkpointer.resume()
        if main:  # a resumed run keeps its first config and records the resumed one beside it
            save_config(cfg, self.out / ("config.yaml" if start == 0 else f"config-resume-{start:06d}.yaml"))
        self.trackers.start(cfg.run.project, self.out.resolve().name, dataclasses.asdict(cfg), self.out)
        t_start = time.time() - elapsed
        self._say(f"{precision_summary(cfg, self.device)}; run folder {self.out}")
        if start == 0:  # a fresh run's cold start that trains (a resumed run's checkpoint holds its result)
            self.method.begin(self.train_metas)
        before = self._evaluate_base() if start == 0 else self.checkpointer.read_eval("eval_before.json")
        last, stopped = self._iterate(start, t_start, eval_metrics(before).keys())
        self._say(f"evaluating the trained model ({self.evaluator.plan()})")
        after = self.evaluator.with_held_out()
        result = {"before": before, "after": after, "wall_time_s": time.time() - t_start, "iterations": last}
        result.update({"stopped": stopped} if stopped else {})
        if main:
            self.checkpointer.write_eval("eval.json", result)
        self.trackers.log(eval_metrics(after), cfg.run.iterations)
        self._say(f"trained model: {after['overall']:.3f}; drawing the grid's after half, plots and exports")
        self.checkpointer.export(self.evaluator, self.trackers, self.rewards)
        self.trackers.finish()
        if main:
            print(run_summary(cfg, result, time.time() - self._built_at, self.out), flush=True)
        return result

    def _evaluate_base(self) -> dict:
        """The base model's evaluation (every process takes part: the images are split) and, on the main process,
        ``eval_before.json`` and the grid's before half (drawn by every process alike in lockstep)."""
        self._say(f"evaluating the base model ({self.evaluator.plan()})")
        before = self.evaluator.with_held_out()
        if self.accelerator.is_main_process:
            self.checkpointer.write_eval("eval_before.json", before)
            self._say(f"base model: {before['overall']:.3f}; drawing the before/after grid's before half")
        grid = self.evaluator.shared_grid()
        if self.accelerator.is_main_process:
            self.checkpointer.write_grid_before(grid)
            self.trackers.log_images("grid/before", grid, 0)
        return before

    def _iterate(self, start: int, t_start: float, eval_names) -> tuple[int, str | None]:
        """Iterations ``start ..``: each :meth:`step`, the evaluation every ``eval.every``, the metrics row, the stop
        rules (a warning for a rule whose metric is neither in the first row nor in `eval_names`, the evaluation's) and the
        checkpoints. Returns ``(iterations done, the stop rule that held or None)``."""
        cfg, main = self.cfg, self.accelerator.is_main_process
        todo, n = range(start, cfg.run.iterations), cfg.run.iterations
        bar = tqdm(todo, initial=start, total=n, desc="flowrl train", disable=not main)
        last, stopped = cfg.run.iterations, None
        for it in bar:
            metrics = self.step(it)
            metrics["time/elapsed_s"] = time.time() - t_start
            if cfg.eval.every and (it + 1) % cfg.eval.every == 0 and it + 1 < cfg.run.iterations:
                metrics.update(eval_metrics(self.evaluator.evaluate()))
            if it == start:  # a misspelt metric would never hold
                for line in self.stop_rules.unlogged([*metrics, *eval_names]):
                    self._say(f"warning: {line}")
            self.run.log(metrics)
            self.trackers.log(metrics, it + 1)
            if "reward/total/mean" in metrics:  # offline methods score no rollouts
                bar.set_postfix(reward=f"{metrics['reward/total/mean']:.3g}")  # 0.00023, not 0.000
            stopped = self.run.on_main(lambda m=metrics: self.stop_rules.update(m))  # one verdict for every process
            if (it + 1) % cfg.run.save_every == 0 or it + 1 == cfg.run.iterations or stopped:
                self.checkpointer.save(it + 1, time.time() - t_start)
            if stopped:
                last = it + 1
                self._say(f"stopping after iteration {last}: {stopped}")
                break
        bar.close()
        return last, stopped

    def step(self, it: int) -> dict[str, float]:
        """One iteration: prompts, the method's rollout, rewards, the method's advantages and update.

        Args:
            it (`int`): the 0-based iteration; with ``run.seed`` it fixes the prompts and every random draw,
                so a resumed run repeats the iterations it would have run.

        Returns:
            `dict[str, float]`: ``iteration`` (it + 1), the rewards' ``reward/*`` and ``cost/*_calls``
            (:meth:`flowrl.scoring.Scorer.metrics`), ``advantage/*``, ``cost/nfe`` (transformer rows, CFG counted
            twice), ``cost/trained_transitions``, ``time/{sample,score,train}_s`` (wall seconds; with
            ``sampling.overlap_rewards``, ``score_s`` is the wait for the worker after sampling and
            ``time/score_worker_s`` its decoding and scoring), ``diversity/*`` and ``memory/*_peak_gib``
            (:mod:`flowrl.diagnostics`) and the method's ``policy/*``.

        Raises:
            ValueError: if a reward returns the wrong shape, NaN or inf (the reward is named).
        """
        method, acc = self.method, self.accelerator
        gen = self._generator(it)
        if not method.online:
            return self.offline_step(it, gen)
        metas = self.sample_prompts(it)
        t0 = time.time()
        scored = self.scorer.rollout(method, metas, gen)
        samples, t1, t2 = scored.samples, scored.sampled_at, time.time()
        every = self.cfg.run.log_images_every
        if every and (it + 1) % every == 0:
            self.trackers.log_images("rollout", samples.images[:8], it + 1)
        rewards = self.scorer.gather(scored.scores, samples.image_prompt, len(metas))
        diversity = diversity_metrics(self.diversity, samples.images, samples.image_prompt, acc)
        adv, keep, adv_stats = method.advantages(samples, rewards, gen)
        stats = method.update(samples, adv, keep, gen)
        method.end_iteration(stats)
        t3 = time.time()
        metrics = {"iteration": it + 1, **self.scorer.metrics(rewards, scored, metas)}
        metrics.update(
            {**adv_stats, "time/sample_s": t1 - t0, "time/score_s": t2 - t1, "time/train_s": t3 - t2, **stats}
        )
        metrics["cost/nfe"] = samples.nfe + stats.get("cost/nfe", 0)
        if scored.worker_s is not None:
            metrics["time/score_worker_s"] = scored.worker_s
        metrics.update(diversity)
        metrics.update(peak_memory(acc))
        return metrics

    def offline_step(self, it: int, gen: torch.Generator) -> dict[str, float]:
        """One iteration of an offline method (``dpo_offline``, ``sft``): its rows of the data set and its update, no
        rollouts or rewards. Returns ``iteration``, ``time/train_s``, ``cost/nfe``, ``memory/*`` and ``policy/*``."""
        t0 = time.time()
        samples = self.method.rollout([], gen)
        stats = self.method.update(samples, None, None, gen)
        self.method.end_iteration(stats)
        metrics = {"iteration": it + 1, "time/train_s": time.time() - t0, **stats}
        metrics["cost/nfe"] = samples.nfe + stats.get("cost/nfe", 0)
        metrics.update(peak_memory(self.accelerator))
        return metrics

    def sample_prompts(self, iteration: int) -> list[dict]:
        """The iteration's prompt records (:class:`flowrl.prompt_sampler.PromptSampler`)."""
        return self.prompts(iteration)

    def _generator(self, iteration: int) -> torch.Generator:
        """The iteration's CPU generator (every noise draw and minibatch order), per ``run.seed`` and process."""
        return torch.Generator().manual_seed(
            iteration_seed(self.cfg.run.seed, iteration, self.accelerator.process_index)
        )

    def score(self, images: torch.Tensor, image_prompt: torch.Tensor, metas: list[dict]):
        """:meth:`flowrl.scoring.Scorer.score`: the scores of ``images`` `(B, 3, H, W)` drawn for ``metas``."""
        return self.scorer.score(images, image_prompt, metas)

    def gather_rewards(self, scores, image_prompt: torch.Tensor, prompts: int) -> Rewards:
        """:meth:`flowrl.scoring.Scorer.gather`: the iteration's rewards gathered over every process."""
        return self.scorer.gather(scores, image_prompt, prompts)

    def _say(self, line: str) -> None:
        """Print ``flowrl train: <line>`` to stderr on the main process."""
        if self.accelerator.is_main_process:
            print(f"flowrl train: {line}", file=sys.stderr, flush=True)
