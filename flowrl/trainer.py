"""The training loop: sample -> score -> advantages -> policy update -> log -> evaluate -> checkpoint.

:class:`Trainer` reads top to bottom: :meth:`Trainer.train` runs the iterations, :meth:`Trainer.step` is one
of them. What differs between methods (the rollout, the advantages, the loss) is the method object
(:mod:`flowrl.methods`, chosen by ``train.method``); the trained weights, their optimizer and the gradient
handling are :class:`flowrl.policy.Policy`'s; the model family is the adapter's (:mod:`flowrl.models`).
"""

from __future__ import annotations

import dataclasses
import json
import random
import sys
import time
import warnings
from collections import defaultdict
from pathlib import Path

import torch
from tqdm import tqdm

from .checkpoint import DiskFullError, checkpoint_iteration, disk_full_error, is_disk_full, prune_checkpoints
from .config import REPO_ROOT, Config, ConfigError, RewardConfig, config_key, resolve_path, save_config
from .data import read_prompts
from .diversity import DiversityProbe, StopRules
from .evaluation import evaluate, evaluate_reward, expand_per_tag, generate
from .files import atomic_output, write_text_atomic
from .methods import Rewards, build_method
from .models import build_adapter
from .models.memory import place_frozen
from .overlap import ChunkWorker, cat_scores, chunk_images
from .pairing import resolve_model
from .plots import save_diagnostics, save_grid, save_reward_curve
from .policy import Policy, check_accelerate_engine, check_accelerate_precision, check_optimizer
from .precision import describe_device, resolve_precision
from .rewards import RewardTypeError, WeightedSum, build_reward
from .run import RunFolder
from .trackers import Trackers

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def tag_means(rewards: torch.Tensor, tags: list[str]) -> dict[str, float]:
    """Mean reward per prompt tag, ``{"reward/tag/<tag>/mean": float}`` (an iteration's mean depends on which tags it
    drew, so the per-tag means are what shows learning). rewards: float ``(B,)``; tags: ``B`` names.

    Raises:
        ValueError: if ``len(tags) != B``.
    """
    if len(tags) != rewards.shape[0]:
        raise ValueError(f"{len(tags)} tags for {rewards.shape[0]} rewards")
    rewards = rewards.float().cpu()
    return {
        f"reward/tag/{tag}/mean": rewards[torch.tensor([t == tag for t in tags])].mean().item()
        for tag in sorted(set(tags))
    }


def _given_rewards(rewards: dict | list | None) -> dict[str, tuple]:
    """The reward callables given to :class:`Trainer` as ``{name: (callable, weight)}``: a dict of callables or of
    ``(callable, weight)`` pairs, or a list of callables named by :func:`flowrl.rewards.reward_name` (weight 1).

    Raises:
        TypeError: naming the entry, for something that is not a callable or a ``(callable, weight)`` pair.
        ValueError: two rewards of one name in a list.
    """
    from .rewards import reward_name

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


def resolve_precisions(cfg: Config, device: torch.device) -> Config:
    """A copy of `cfg` whose precision settings (``run.mixed_precision``, ``sampling.decode_precision``,
    ``sampling.ode_precision``) are ``bf16`` or ``no`` on `device` (:func:`flowrl.precision.resolve_precision`:
    ``auto`` is bf16 where `device` computes it natively; an explicit bf16 where it does not is kept, with a warning).
    `cfg` itself is not changed."""
    run = dataclasses.replace(
        cfg.run, mixed_precision=resolve_precision(cfg.run.mixed_precision, device, "run.mixed_precision")
    )
    s = cfg.sampling
    sampling = dataclasses.replace(
        s,
        decode_precision=resolve_precision(s.decode_precision, device, "sampling.decode_precision"),
        ode_precision=resolve_precision(s.ode_precision, device, "sampling.ode_precision"),
    )
    return dataclasses.replace(cfg, run=run, sampling=sampling)


def precision_summary(cfg: Config, device: torch.device) -> str:
    """One line on the run's resolved precisions and why, e.g. ``"precision float32 (run.mixed_precision, decode and
    ODE steps) on this CPU (no native bf16)"``."""
    names = {
        "run.mixed_precision": cfg.run.mixed_precision,
        "sampling.decode_precision": cfg.sampling.decode_precision,
        "sampling.ode_precision": cfg.sampling.ode_precision,
    }
    label = {"bf16": "bf16 autocast", "no": "float32"}
    groups = {v: [k for k, x in names.items() if x == v] for v in dict.fromkeys(names.values())}
    parts = [f"{label[v]} ({', '.join(keys)})" for v, keys in groups.items()]
    return f"precision {'; '.join(parts)} on {describe_device(device)}, log-probs float32"


class Trainer:
    """Runs one configured job end to end, writing everything to ``config.run.output_dir``.

    Args:
        config (:class:`flowrl.config.Config`): the run (:func:`flowrl.load_config`; ``flowrl config`` lists its keys).
        rewards (optional): reward callables ``reward(images, prompts, metadata) -> scores`` to train on instead of
            the config's ``rewards`` section, as trl's trainers take ``reward_funcs``: a dict ``name -> callable`` or
            ``name -> (callable, weight)``, or a list of callables (named by their ``name`` or ``__name__``,
            weight 1). ``config.yaml`` records their names and weights; a resume passes them again.

    Attributes: ``model`` (the adapter), ``policy`` (:class:`flowrl.policy.Policy`), ``method`` (the
    :mod:`flowrl.methods` object), ``rewards``, ``train_metas`` / ``eval_metas`` (prompt records).

    The run folder (:class:`flowrl.run.RunFolder`) has one writer: :meth:`train` holds its lock (main process)
    from before anything is written until it returns.

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

        if not isinstance(config, Config):
            raise TypeError(f"Trainer takes a flowrl.Config (flowrl.load_config(...)), got {type(config).__name__}")
        given = _given_rewards(rewards)  # name -> (callable, weight); checked before any work
        if given:  # they replace the config's rewards section (recorded by name in config.yaml)
            config = dataclasses.replace(config, rewards={n: RewardConfig(weight=w) for n, (_, w) in given.items()})
        self.cfg = cfg = config
        if cfg.run.device == "cuda" and not torch.cuda.is_available():
            raise ConfigError("config key 'run.device' is 'cuda' but no CUDA device is available; use auto or cpu")
        self.out = Path(cfg.run.output_dir)
        # precision is run.mixed_precision (our autocast); DDP: a family may leave parameters unused in a forward,
        # and every forward without gradients (rollouts, evaluation) bypasses the wrapper, so buffers are not synced
        ddp = DistributedDataParallelKwargs(find_unused_parameters=True, broadcast_buffers=False)
        self.accelerator = acc = Accelerator(
            cpu=cfg.run.device == "cpu",
            kwargs_handlers=[ddp],
            log_with=list(cfg.run.log_with) or None,
            project_config=ProjectConfiguration(str(self.out), str(self.out / "tensorboard")),
        )
        self.trackers = Trackers(acc, cfg.run.log_with)
        self.run = RunFolder(self.out, acc, cfg.run.resume)  # not in use, no other run, writable: before any work
        check_accelerate_engine(acc, cfg.train.step_grad_norms, cfg.train.optimizer, cfg.train.max_grad_norm)
        self.device = acc.device
        self.cfg = cfg = resolve_precisions(cfg, self.device)  # auto -> bf16 or no; config.yaml records the choice
        check_accelerate_precision(acc, cfg.run.mixed_precision)
        check_optimizer(cfg.train.optimizer, acc.device)
        adapter = resolve_model(cfg)
        self.train_metas = self._read_prompts("train_prompts", cfg.train_prompts)
        self.eval_metas = self._read_prompts("eval.prompts", cfg.eval.prompts)
        self.held_out_metas = self._read_prompts("eval.held_out", cfg.eval.held_out) if cfg.eval.held_out else []
        self.rewards = WeightedSum(
            given or {name: (self._build_reward(name), r.weight) for name, r in cfg.rewards.items()}
        )
        video = (
            dict(num_frames=cfg.model.num_frames, expert=cfg.model.expert, negative_prompt=cfg.model.negative_prompt)
            if adapter.VIDEO
            else {}
        )  # checked by resolve_model
        self.model = build_adapter(
            adapter,
            resolve_path(cfg.model.path),
            self.device,
            DTYPES[cfg.model.dtype],
            cfg.model.max_sequence_length,
            cfg.model.resolution,
            **video,
            **cfg.model.options,
        )
        torch.manual_seed(cfg.run.seed)  # the LoRA init: runs with one seed start from the same weights
        if cfg.model.lora_rank > 0:
            self.model.add_lora(cfg.model.lora_rank, cfg.model.lora_alpha)
        else:
            self.model.full_finetune()
        if cfg.train.gradient_checkpointing:  # only forwards with gradients (training) are checkpointed
            self.model.transformer.enable_gradient_checkpointing()
        m = cfg.model  # the frozen parts: prompt cache, text encoders and VAE placement
        if m.prompt_cache or m.text_encoders != "keep" or m.vae_placement != "keep":
            prompts = [x["prompt"] for x in self.train_metas + self.eval_metas + self.held_out_metas]
            prompts.append(m.negative_prompt)
            with acc.main_process_first():  # the main process encodes into the shared cache, the others read it
                place_frozen(self.model, m.prompt_cache, m.text_encoders, m.vae_placement, prompts)
        self.policy = Policy(self.model, cfg.train, cfg.run.mixed_precision, acc)
        self.method = build_method(cfg, self.model, self.policy, self.rewards)
        self.diversity = self._diversity_probe() if self.method.online else None  # offline: no rollout images
        self.stop_rules = StopRules(cfg.run.stop_if)
        s = cfg.sampling
        if s.overlap_rewards and chunk_images(s.batch_size, s.group_size) >= s.prompts_per_iteration * s.group_size:
            warnings.warn(
                f"sampling.overlap_rewards: a rollout of {s.prompts_per_iteration * s.group_size} images is one chunk of "
                f"lcm(sampling.batch_size, sampling.group_size) = {chunk_images(s.batch_size, s.group_size)}, so "
                "nothing overlaps; lower sampling.batch_size",
                UserWarning,
                stacklevel=2,
            )
        if cfg.model.lora_rank == 0 and cfg.run.keep_checkpoints is None:
            count = -(-cfg.run.iterations // cfg.run.save_every)
            mib = self.policy.checkpoint_mib(self.method.sampling_weights() is not None)
            warnings.warn(
                f"full fine-tuning (model.lora_rank=0) with run.keep_checkpoints unset keeps all {count} "
                f"checkpoints of about {mib:.0f} MiB each; set run.keep_checkpoints to keep only the newest",
                UserWarning,
                stacklevel=2,
            )
        # a smoke call of the rewards at the rollouts' size, both images in one group so a pairwise judge judges them
        metas, side = [{**m, "group": 0} for m in self.train_metas[:2]], self.model.resolution
        shape = self.model.decoded_shape if self.model.VIDEO else (3, side, side)  # a video: (F, 3, H, W)
        self.rewards(torch.full((len(metas), *shape), 0.5), [m["prompt"] for m in metas], metas)

    # ------------------------------------------------------------------------------------------ loop
    def train(self) -> dict:
        """Run (or resume) the job, holding the run folder's lock throughout.

        Returns:
            `dict`: ``{"before": eval, "after": eval, "wall_time_s": float, "iterations": int}``.

        Raises:
            RunFolderInUse: another process holds the run folder. FileExistsError: it holds a run and
            ``run.resume`` is off. CheckpointError: ``run.resume`` finds run files but no verified checkpoint.
            DiskFullError: the disk filled up; the message names the newest verified checkpoint.
        """
        with self.run.hold():
            try:
                return self._train()
            except OSError as e:  # a full disk: say which checkpoint a resume continues from
                if isinstance(e, DiskFullError) or not is_disk_full(e):
                    raise
                raise disk_full_error(e, self.out / "checkpoints") from e

    def _train(self) -> dict:
        """:meth:`train`'s body, run under the lock."""
        cfg, acc = self.cfg, self.accelerator
        start, elapsed = self._maybe_resume()
        if acc.is_main_process:  # a resumed run keeps its first config and records the resumed one beside it
            save_config(cfg, self.out / ("config.yaml" if start == 0 else f"config-resume-{start:06d}.yaml"))
        self.trackers.start(cfg.run.project, self.out.resolve().name, dataclasses.asdict(cfg), self.out)
        t_start = time.time() - elapsed
        if acc.is_main_process:
            print(f"flowrl train: {precision_summary(cfg, self.device)}; run folder {self.out}", file=sys.stderr)
        if start == 0:
            if acc.is_main_process:
                print(f"flowrl train: evaluating the base model ({self._eval_plan()})", file=sys.stderr)
            before = self._eval_with_held_out()  # every process takes part (the images are split) and gets the result
            if acc.is_main_process:
                from safetensors.torch import save_file

                write_text_atomic(self.out / "eval_before.json", json.dumps(before, indent=1))
                grid = self.grid_images()
                with atomic_output(self.out / "grid_before.safetensors") as tmp:
                    save_file({"images": grid.contiguous()}, tmp)
                self.trackers.log_images("grid/before", grid, 0)
        else:
            before = json.loads(
                (self.out / "eval_before.json").read_text()
            )  # checked readable by RunFolder.checkpoint_to_resume
        bar = tqdm(
            range(start, cfg.run.iterations),
            initial=start,
            total=cfg.run.iterations,
            desc="flowrl train",
            disable=not acc.is_main_process,
        )
        last, stopped = cfg.run.iterations, None
        for it in bar:
            metrics = self.step(it)
            metrics["time/elapsed_s"] = time.time() - t_start
            if cfg.eval.every and (it + 1) % cfg.eval.every == 0 and it + 1 < cfg.run.iterations:
                result = self.run_eval()
                metrics.update(
                    {"eval/overall": result["overall"], **{f"eval/{k}": v for k, v in result["per_tag"].items()}}
                )
            self.run.log(metrics)
            self.trackers.log(metrics, it + 1)
            if "reward/total/mean" in metrics:  # offline methods score no rollouts
                bar.set_postfix(reward=f"{metrics['reward/total/mean']:.3f}")
            stopped = self.run.on_main(lambda m=metrics: self.stop_rules.update(m))  # one verdict for every process
            if (it + 1) % cfg.run.save_every == 0 or it + 1 == cfg.run.iterations or stopped:
                self._save(it + 1, time.time() - t_start)
            if stopped:
                last = it + 1
                if acc.is_main_process:
                    print(f"flowrl train: stopping after iteration {last}: {stopped}", file=sys.stderr)
                break
        bar.close()
        if acc.is_main_process:
            print(f"flowrl train: evaluating the trained model ({self._eval_plan()})", file=sys.stderr)
        after = self._eval_with_held_out()
        result = {
            "before": before,
            "after": after,
            "wall_time_s": time.time() - t_start,
            "iterations": last,
            **({"stopped": stopped} if stopped else {}),
        }
        if acc.is_main_process:
            write_text_atomic(self.out / "eval.json", json.dumps(result, indent=1))
        self.trackers.log(
            {"eval/overall": after["overall"], **{f"eval/{k}": v for k, v in after["per_tag"].items()}},
            cfg.run.iterations,
        )
        self._artifacts()
        self.trackers.finish()
        return result

    def step(self, it: int) -> dict[str, float]:
        """One iteration: prompts, the method's rollout, rewards, the method's advantages and update.

        Args:
            it (`int`): the 0-based iteration; with ``run.seed`` it fixes the prompts and every random draw,
                so a resumed run repeats the iterations it would have run.

        Returns:
            `dict[str, float]`: ``iteration`` (it + 1), ``reward/*`` means (per reward and per tag),
            ``advantage/*``, ``cost/nfe`` (transformer rows, CFG counted twice), ``cost/reward_calls`` (images
            scored), ``cost/judge_calls`` (with a pairwise reward), ``cost/trained_transitions``,
            ``time/{sample,score,train}_s`` (wall seconds; with ``sampling.overlap_rewards``, ``score_s`` is the wait
            for the worker after sampling and ``time/score_worker_s`` the worker's decoding and scoring),
            ``memory/*_peak_gib`` (:meth:`_peak_memory`) and the method's ``policy/*``.

        Raises:
            ValueError: if a reward returns the wrong shape, NaN or inf (the reward is named).
        """
        method = self.method
        gen = self._generator(it)
        if not method.online:
            return self.offline_step(it, gen)
        metas = self.sample_prompts(it)
        t0 = time.time()
        judged, worker_s = self._judge_calls(), None
        if self.cfg.sampling.overlap_rewards:  # each chunk decoded and scored in a worker while the next one samples
            samples, scores, t1, worker_s = self.overlapped_rollout(metas, gen)
        else:
            samples = method.rollout(metas, gen)
            t1 = time.time()
            scores = self.score(samples.images, samples.image_prompt, metas)
        judged = self._judge_calls() - judged
        t2 = time.time()
        every = self.cfg.run.log_images_every
        if every and (it + 1) % every == 0:
            self.trackers.log_images("rollout", samples.images[:8], it + 1)
        rewards = self.gather_rewards(scores, samples.image_prompt, len(metas))
        diversity = self.diversity_metrics(samples)
        adv, keep, adv_stats = method.advantages(samples, rewards, gen)
        stats = method.update(samples, adv, keep, gen)
        method.end_iteration(stats)
        t3 = time.time()
        total = rewards.total
        metrics = {
            "iteration": it + 1,
            "reward/total/mean": total.mean().item(),
            "reward/total/std": total.std().item(),
        }
        metrics.update({f"reward/{name}/mean": s.mean().item() for name, s in scores.per_reward.items()})
        metrics.update(tag_means(scores.total, [metas[i].get("tag", "all") for i in samples.image_prompt.tolist()]))
        metrics["cost/reward_calls"] = len(scores.total)
        if any(hasattr(r, "judge_calls") for r, _ in self.rewards.rewards.values()):
            metrics["cost/judge_calls"] = judged
        metrics.update(
            {**adv_stats, "time/sample_s": t1 - t0, "time/score_s": t2 - t1, "time/train_s": t3 - t2, **stats}
        )
        metrics["cost/nfe"] = samples.nfe + stats.get("cost/nfe", 0)
        if worker_s is not None:
            metrics["time/score_worker_s"] = worker_s
        metrics.update(diversity)
        metrics.update(self._peak_memory())
        return metrics

    def overlapped_rollout(self, metas: list[dict], gen: torch.Generator):
        """The method's rollout in chunks of ``lcm(sampling.batch_size, sampling.group_size)`` images
        (:meth:`flowrl.methods.Method.rollout_in_chunks`), each chunk decoded and scored (:meth:`score`) in a worker
        thread (:class:`flowrl.overlap.ChunkWorker`) while the next one samples (``sampling.overlap_rewards``): the
        samples and scores of :meth:`Method.rollout` then :meth:`score`, where a reward scores an image alike in any
        batch of whole groups.

        Returns:
            ``(samples, scores, t_sampled, worker_s)``: the samples with their ``images`` `(B, 3, H, W)`, the scores
            (``.total`` `(B,)`), the ``time.time()`` the sampling ended, the worker's busy seconds.

        Raises:
            As :meth:`score` (a reward's error, named), re-raised from the worker once the chunk that hit it is done.
        """
        method, s = self.method, self.cfg.sampling

        def decode_and_score(latents: torch.Tensor, image_prompt: torch.Tensor):
            images = method.decode(latents)  # (n, 3, H, W) on the CPU
            return images, self.score(images, image_prompt, metas)

        with ChunkWorker(decode_and_score, self.device) as worker:
            samples = method.rollout_in_chunks(metas, gen, chunk_images(s.batch_size, s.group_size), worker.submit)
            t_sampled = time.time()
            done = worker.results()
        samples.images = torch.cat([images for images, _ in done])
        return samples, cat_scores([scores for _, scores in done]), t_sampled, worker.busy_s

    def _diversity_probe(self):
        """The CLIP of ``run.diversity_model`` (:class:`flowrl.diversity.DiversityProbe`), or None: ``''``, or ``auto``
        where the shipped ``assets/tiny-clip`` is absent (an installed package).

        Raises:
            ConfigError: naming ``run.diversity_model``, for a folder that is not a CLIP model.
        """
        name = self.cfg.run.diversity_model or ""
        if name == "auto":
            shipped = REPO_ROOT / "assets" / "tiny-clip"
            name = str(shipped) if (shipped / "config.json").is_file() else ""
        if not name:
            return None
        with config_key("run.diversity_model", (ValueError, FileNotFoundError, OSError)):
            return DiversityProbe(str(resolve_path(name)), self.device)

    def diversity_metrics(self, samples) -> dict[str, float]:
        """``diversity/clip`` (mean over every process's groups of their mean pairwise CLIP cosine distance),
        ``diversity/clip_min`` (the least diverse group) and ``time/diversity_s``; empty without a probe."""
        if self.diversity is None or len(samples.images) == 0:
            return {}
        t0 = time.time()
        per_group = self.diversity(samples.images, samples.image_prompt).float()  # (n,) this process's groups
        local = torch.tensor(
            [per_group.sum().item(), float(len(per_group)), per_group.min().item() if len(per_group) else 2.0]
        )
        if self.accelerator.num_processes > 1:
            local = self.accelerator.gather(local.to(self.device)).cpu().view(-1, 3)
        else:
            local = local.view(1, 3)
        count = local[:, 1].sum().item()
        if not count:
            return {}
        return {
            "diversity/clip": local[:, 0].sum().item() / count,
            "diversity/clip_min": local[:, 2].min().item(),
            "time/diversity_s": time.time() - t0,
        }

    def offline_step(self, it: int, gen: torch.Generator) -> dict[str, float]:
        """One iteration of an offline method (``dpo_offline``, ``sft``): its rows of the data set and its update, no
        rollouts and no rewards. Returns ``iteration``, ``time/train_s``, ``cost/nfe``, ``memory/*`` and ``policy/*``."""
        t0 = time.time()
        samples = self.method.rollout([], gen)
        stats = self.method.update(samples, None, None, gen)
        self.method.end_iteration(stats)
        metrics = {"iteration": it + 1, "time/train_s": time.time() - t0, **stats}
        metrics["cost/nfe"] = samples.nfe + stats.get("cost/nfe", 0)
        metrics.update(self._peak_memory())
        return metrics

    def _peak_memory(self) -> dict[str, float]:
        """``memory/gpu_peak_gib``: the most GPU memory tensors took during the iteration (CUDA only, from
        ``torch.cuda.max_memory_allocated``, reset here), and ``memory/host_peak_gib``: the most resident host memory
        of the process since it started (``ru_maxrss``; absent where the ``resource`` module is missing). Each is the
        maximum over the processes (a gather: every process calls it)."""
        names, values = [], []
        try:
            import resource

            rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
            names.append("memory/host_peak_gib")
            values.append(rss / 2**30 if sys.platform == "darwin" else rss / 2**20)
        except ImportError:  # Windows
            pass
        if self.device.type == "cuda":
            names.append("memory/gpu_peak_gib")
            values.append(torch.cuda.max_memory_allocated(self.device) / 2**30)
            torch.cuda.reset_peak_memory_stats(self.device)
        if not names:
            return {}
        peak = torch.tensor(values, dtype=torch.float64, device=self.device)
        if self.accelerator.num_processes > 1:
            peak = self.accelerator.gather(peak[None]).amax(0)
        return dict(zip(names, peak.tolist()))

    # ----------------------------------------------------------------------------------------- parts
    def sample_prompts(self, iteration: int) -> list[dict]:
        """The iteration's ``sampling.prompts_per_iteration`` prompt records, deterministic in ``run.seed``,
        `iteration` and the process index; with ``tag_balanced`` a tag is drawn uniformly, then a prompt of it."""
        rng = random.Random(self.cfg.run.seed * 7919 + iteration * 104729 + self.accelerator.process_index)
        n = self.cfg.sampling.prompts_per_iteration
        if not self.cfg.tag_balanced:
            return [rng.choice(self.train_metas) for _ in range(n)]
        by_tag = defaultdict(list)
        for m in self.train_metas:
            by_tag[m.get("tag", "all")].append(m)
        tags = sorted(by_tag)
        return [rng.choice(by_tag[rng.choice(tags)]) for _ in range(n)]

    def _generator(self, iteration: int) -> torch.Generator:
        """The iteration's CPU generator (every noise draw and minibatch order), per ``run.seed`` and process."""
        return torch.Generator().manual_seed(
            self.cfg.run.seed * 1_000_003 + iteration * 1009 + self.accelerator.process_index
        )

    def score(self, images: torch.Tensor, image_prompt: torch.Tensor, metas: list[dict]):
        """Score ``images`` (B, 3, H, W) in [0, 1], image ``b`` drawn for ``metas[image_prompt[b]]``; each image's
        metadata carries ``"group"`` = its prompt slot (group-wise rewards such as Pref-GRPO's win rates).

        Returns:
            The reward set's scores (``.total`` float32 ``(B,)``, ``.per_reward``).
        """
        leaf_metas = [{**metas[i], "group": i} for i in image_prompt.tolist()]
        return self.rewards(images, [m["prompt"] for m in leaf_metas], leaf_metas)

    def gather_rewards(self, scores, image_prompt: torch.Tensor, prompts: int) -> Rewards:
        """The iteration's rewards gathered over every process, once (:class:`flowrl.methods.Rewards`): the totals,
        each reward's scores and the images' groups (prompt slots made unique over processes).

        Args:
            scores: this process's :class:`flowrl.rewards.CombinedScores` (``.total`` `(B,)`, ``.per_reward``).
            image_prompt (`torch.Tensor` of shape `(B,)`, long): each image's prompt slot in ``[0, prompts)``.
            prompts (`int`): prompts per process.
        """
        acc = self.accelerator
        total = acc.gather(scores.total.to(self.device)).cpu()  # (B_all,) every process's totals
        per_reward = {k: acc.gather(v.to(self.device)).cpu() for k, v in scores.per_reward.items()}
        group = acc.gather((image_prompt + acc.process_index * prompts).to(self.device)).cpu()
        rows = len(scores.total)
        mine = slice(acc.process_index * rows, (acc.process_index + 1) * rows)
        return Rewards(scores, total, per_reward, group, mine)

    def _judge_calls(self) -> int:
        """Cumulative judgements of the pairwise rewards (:attr:`rewards.PrefWinRate.judge_calls`), 0 if none."""
        return sum(getattr(r, "judge_calls", 0) for r, _ in self.rewards.rewards.values())

    def run_eval(self, metas: list[dict] | None = None, images_per_tag: int | None = None) -> dict:
        """Evaluation with ODE sampling (EMA weights if configured) of ``eval.prompts`` (or `metas`, with
        `images_per_tag` instead of ``eval.images_per_tag``): GenEval strict accuracy where the prompts carry GenEval
        metadata, else the mean of the configured rewards.

        Returns:
            `dict`: ``{"overall": float in [0, 1], "per_tag": {tag: float}, "n_images": int, ...}`` (see
            :func:`flowrl.evaluation.evaluate`; :func:`flowrl.evaluation.evaluate_reward` for reward means).
        """
        e, shift, batch = self.cfg.eval, self.cfg.sampling.shift, self.cfg.sampling.batch_size
        metas, images_per_tag = metas or self.eval_metas, images_per_tag or e.images_per_tag
        with self.policy.ema_weights(), self.policy.autocast():
            if all("include" in m for m in metas):
                return evaluate(
                    self.model,
                    metas,
                    images_per_tag,
                    e.num_steps,
                    e.guidance_scale,
                    shift,
                    e.seed,
                    batch,
                    accelerator=self.accelerator,
                    judge=self._geneval_reader(),
                )
            return evaluate_reward(
                self.model,
                metas,
                self.rewards,
                1,
                e.num_steps,
                e.guidance_scale,
                shift,
                e.seed,
                batch,
                accelerator=self.accelerator,
            )

    def _eval_plan(self) -> str:
        """What an evaluation draws, in words: ``"256 images of eval.prompts, 192 of eval.held_out, 10 steps"``."""
        e = self.cfg.eval

        def images(metas: list[dict], per_tag: int) -> int:
            return len(expand_per_tag(metas, per_tag)) if all("include" in m for m in metas) else len(metas)

        plan = f"{images(self.eval_metas, e.images_per_tag)} images of eval.prompts"
        if self.held_out_metas:
            plan += f", {images(self.held_out_metas, e.held_out_images_per_tag)} of eval.held_out"
        return f"{plan}, {e.num_steps} Euler steps"

    def _eval_with_held_out(self) -> dict:
        """:meth:`run_eval`, with ``"held_out"``: the same evaluation of ``eval.held_out`` (``eval.held_out_images_per_tag``)
        when that is set."""
        result = self.run_eval()
        if self.held_out_metas:
            result["held_out"] = self.run_eval(self.held_out_metas, self.cfg.eval.held_out_images_per_tag)
            result["held_out"]["prompts"] = self.cfg.eval.held_out
        return result

    def _geneval_reader(self):
        """The configured ``geneval`` / ``geneval_strict`` reward when it reads real images (its real backend), so
        the evaluation judges with the same segmenter; None (the tiny world's detector) otherwise."""
        for reward, _ in self.rewards.rewards.values():
            if getattr(reward, "detector", None) is not None and hasattr(reward, "judge"):
                return reward
        return None

    def grid_images(self) -> torch.Tensor:
        """Images `(12, 3, H, W)` of two fixed test prompts per tag, fixed seeds (the before/after grid)."""
        e = self.cfg.eval
        with self.policy.ema_weights(), self.policy.autocast():
            metas = self._grid_metas()
            return generate(
                self.model,
                [m["prompt"] for m in metas],
                [e.seed + i for i in range(12)],
                e.num_steps,
                e.guidance_scale,
                self.cfg.sampling.shift,
                metas=metas,
            )

    def _grid_metas(self) -> list[dict]:
        """12 entries: the first two eval prompts of each tag, cycled when there are fewer (new seeds)."""
        by_tag = defaultdict(list)
        for m in self.eval_metas:
            by_tag[m.get("tag", "all")].append(m)
        first = [m for tag in by_tag for m in by_tag[tag][:2]]
        return [first[i % len(first)] for i in range(12)]

    # ----------------------------------------------------------------------------------- set-up
    def _build_reward(self, name: str):
        """The reward of config key ``rewards.NAME`` (:func:`rewards.build_reward` with its options).

        Raises:
            ConfigError: naming ``rewards.NAME``, for an unknown reward, a missing module or a bad option.
        """
        try:
            return build_reward(name, **self.cfg.rewards[name].options)
        except (ValueError, TypeError) as e:
            if isinstance(e, TypeError) and not isinstance(e, RewardTypeError):
                raise  # a bug inside the reward's factory: not disguised as bad input
            raise ConfigError(f"config key 'rewards.{name}': {e}") from None

    @staticmethod
    def _read_prompts(key: str, name: str) -> list[dict]:
        """The prompt records of config key `key` (a shipped set's name or a JSONL file: :func:`flowrl.data.read_prompts`).

        Raises:
            FileNotFoundError: a missing file. ConfigError: naming `key`, for a malformed line or no prompt.
        """
        with config_key(key):
            return read_prompts(name)

    # ----------------------------------------------------------------------------------- bookkeeping
    def _save(self, iteration: int, elapsed: float) -> None:
        """Checkpoint ``iteration``: the policy, its optimizer and EMA, the method's state and files, the LoRA."""

        def write_extra(folder: Path) -> None:  # inside the checkpoint before it is sealed
            if self.cfg.model.lora_rank > 0:
                self.model.save_lora(folder / "lora", self.policy.exported())
            self.method.save_files(folder)

        # every process: under FSDP2 the optimizer state is gathered from the shards; the main process writes
        saved = self.policy.save(
            self.out / "checkpoints", iteration, {"elapsed_s": elapsed, **self.method.state_dict()}, write_extra
        )
        if saved is not None and self.cfg.run.keep_checkpoints:
            prune_checkpoints(self.out / "checkpoints", self.cfg.run.keep_checkpoints, just_saved=saved)

    def _maybe_resume(self) -> tuple[int, float]:
        """Restore the newest verified checkpoint when ``run.resume`` (:meth:`flowrl.run.RunFolder.checkpoint_to_resume`); returns
        ``(iteration, elapsed_s)``. Only once it is restored is ``metrics.jsonl`` cut back to its iteration."""
        path = self.run.checkpoint_to_resume()
        if path is None:
            return 0, 0.0
        done = checkpoint_iteration(path)
        if done > self.cfg.run.iterations:  # before anything is loaded or rewritten
            raise ConfigError(
                f"config key 'run.iterations': {self.cfg.run.iterations} is below the iteration of the checkpoint "
                f"run.resume continues ({path}: {done}); set run.iterations >= {done}"
            )
        state = self.policy.load(path)
        self.method.load_state_dict(state["extra"])
        self.method.load_files(path)
        self.run.resumed(state["iteration"])
        return state["iteration"], state["extra"].get("elapsed_s", 0.0)

    def _artifacts(self) -> None:
        """The run's reward curve, diagnostics plot, before/after grid, and the LoRA (or the whole pipeline)."""
        if not self.accelerator.is_main_process:
            return
        from safetensors.torch import load_file

        metrics = [json.loads(line) for line in (self.out / "metrics.jsonl").read_text().splitlines()]
        result = json.loads((self.out / "eval.json").read_text())
        save_reward_curve(metrics, result, self.out / "reward_curve.png")
        watched = [name for name, (_, weight) in self.rewards.rewards.items() if weight == 0]  # gold metrics
        save_diagnostics(metrics, self.out / "diagnostics.png", watched)
        before, after = load_file(self.out / "grid_before.safetensors")["images"], self.grid_images()
        self.trackers.log_images("grid/after", after, self.cfg.run.iterations)
        save_grid(before, after, [m["prompt"] for m in self._grid_metas()], self.out / "grid.png")
        if self.cfg.model.lora_rank > 0:
            self.model.save_lora(self.out / "lora", self.policy.exported())
        else:
            with self.policy.ema_weights():
                self.model.save_pipeline(self.out / "pipeline", plain_copy=self.policy.plain_export)
