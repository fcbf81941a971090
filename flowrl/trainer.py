"""The trainer: sample -> score -> advantages -> policy update -> log -> evaluate -> checkpoint.

:class:`Trainer` is the loop and what every method shares (prompts, scoring, group advantages, minibatches,
the optimizer step, EMA, evaluation, checkpoints and resume). The methods plug in as mixins:
:class:`flowrl.rollouts.RolloutMixin` (flat groups, BranchGRPO trees, single-step branching),
:class:`flowrl.grpo.GRPOMixin` (Flow-GRPO, arXiv 2505.05470: PPO clipped surrogate on the trained
transitions, optional KL to the LoRA-disabled base) and, with ``train.method: nft``,
:class:`flowrl.nft.NFTMixin` (DiffusionNFT, arXiv 2509.16117: G ODE samples per prompt and the
negative-aware flow-matching loss on noised copies of them).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import time
import warnings
from collections import defaultdict
from pathlib import Path

import torch
from tqdm import tqdm

from rewards import WeightedSum, build_reward

from .advantages import aggregate_advantages, best_of_n, group_advantages
from .checkpoint import latest_checkpoint, load_checkpoint, prune_checkpoints, save_checkpoint
from .config import Config, ConfigError, prompt_file, resolve_path, save_config
from .evaluate import evaluate, evaluate_reward, generate
from .grpo import GRPOMixin
from .models import model_class
from .nft import NFTMixin
from .plots import save_diagnostics, save_grid, save_reward_curve
from .rollouts import RolloutMixin
from .tiny.prompts import read_jsonl

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def tag_means(rewards: torch.Tensor, tags: list[str]) -> dict[str, float]:
    """Mean reward per prompt tag, ``{"reward/tag/<tag>/mean": float}``.

    An iteration's mean reward depends on which tags it drew (easy single-object prompts score higher
    than position prompts), so the per-tag means are what shows learning along a run.

    Args:
        rewards: float ``(B,)`` total rewards; tags: ``B`` tag names (GenEval metadata ``tag``).

    Raises:
        ValueError: if ``len(tags) != B``.
    """
    if len(tags) != rewards.shape[0]:
        raise ValueError(f"{len(tags)} tags for {rewards.shape[0]} rewards")
    rewards = rewards.float().cpu()
    return {f"reward/tag/{tag}/mean": rewards[torch.tensor([t == tag for t in tags])].mean().item()
            for tag in sorted(set(tags))}


def minibatch_sizes(counts: torch.Tensor, size: int) -> torch.Tensor:
    """Transitions in each minibatch of each process, ``(processes, steps)`` int64.

    Each process splits its own kept transitions (``counts``, ``(processes,)`` int) into minibatches of
    ``size``; all take as many optimizer steps as the process with the most minibatches, because the
    gradients are all-reduced at every step, so a process that has run out contributes 0 transitions
    (a zero gradient) to the remaining steps. ``steps`` is 0 when no process kept a transition.
    Example: counts ``[5, 0, 3]``, size 2 -> ``[[2, 2, 1], [0, 0, 0], [2, 1, 0]]``.
    """
    steps = max(-(-int(c) // size) for c in counts)
    return torch.stack([torch.clamp(int(c) - torch.arange(steps) * size, 0, size) for c in counts])


class Trainer(RolloutMixin, GRPOMixin, NFTMixin):
    """Runs one configured job (GRPO, or DiffusionNFT with ``train.method: nft``) end to end, writing
    everything to ``config.run.output_dir``.

    Raises (at construction, before any sampling):
        ConfigError / FileNotFoundError: bad config values, model folder or prompt files.
        ValueError: a reward that fails its smoke call (wrong shape, NaN or inf), named.
    """

    REDUCE_BUCKET = 1 << 26  # gradient elements per all-reduce under several processes (256 MB in float32)
    OLD_POLICY_FILE = "old_policy.safetensors"  # DiffusionNFT's soft-updated sampling policy, in each checkpoint

    def __init__(self, config: Config):
        from accelerate import Accelerator

        self.cfg = cfg = config
        device = cfg.run.device
        if device == "cuda" and not torch.cuda.is_available():
            raise ConfigError("config key 'run.device' is 'cuda' but no CUDA device is available; use auto or cpu")
        self.out = Path(cfg.run.output_dir)
        self._refuse_existing_run()  # before any expensive work
        # mixed precision is our own autocast (see _autocast): accelerate's state is a process-wide singleton
        self.accelerator = Accelerator(cpu=device == "cpu")
        if self.accelerator.mixed_precision == "fp16":  # refused as in the config: on a GPU its loss scaling would run before our clipping
            raise ConfigError("accelerate's mixed precision is fp16 (accelerate launch --mixed_precision fp16 or "
                              "ACCELERATE_MIXED_PRECISION=fp16), which flowrl does not support (no loss scaling): launch "
                              "with --mixed_precision no and set run.mixed_precision=bf16 or no")
        if self.accelerator.mixed_precision == "bf16" and cfg.run.mixed_precision != "bf16":
            warnings.warn(f"accelerate's mixed precision bf16 (accelerate launch --mixed_precision bf16) is not used: "
                          f"flowrl's precision is run.mixed_precision, here {cfg.run.mixed_precision!r}; set "
                          "run.mixed_precision=bf16 for bf16 autocast", UserWarning, stacklevel=2)
        self.device = self.accelerator.device
        model_path = resolve_path(cfg.model.path)
        try:  # before anything loads
            adapter = model_class(model_path)  # SD3 family or FLUX, from model_index.json
        except ValueError as e:
            raise ConfigError(f"config key 'model.path': {e}") from None
        try:
            adapter.check_resolution(model_path, cfg.model.resolution)
        except ValueError as e:
            raise ConfigError(f"config key 'model.resolution': {e}") from None
        if cfg.sampling.shift is None:  # the model's own schedule; the saved config.yaml records the value
            try:
                cfg.sampling.shift = adapter.scheduler_shift(model_path, cfg.model.resolution)
            except (ValueError, FileNotFoundError) as e:
                raise ConfigError(f"config key 'sampling.shift': {e}") from None
        if cfg.model.max_sequence_length is None:  # SD3: 256 with a T5 encoder, 0 without (the tiny model); FLUX 512
            cfg.model.max_sequence_length = adapter.default_max_sequence_length(model_path)
        try:
            adapter.check_max_sequence_length(cfg.model.max_sequence_length)
        except ValueError as e:
            raise ConfigError(f"config key 'model.max_sequence_length': {e}") from None
        self.train_metas = self._read_prompts("train_prompts", cfg.train_prompts)
        self.eval_metas = self._read_prompts("eval.prompts", cfg.eval.prompts)
        self.rewards = WeightedSum({name: (build_reward(name, **r.options), r.weight) for name, r in cfg.rewards.items()})
        self.model = adapter(model_path, self.device, DTYPES[cfg.model.dtype], cfg.model.max_sequence_length,
                             cfg.model.resolution)
        torch.manual_seed(cfg.run.seed)  # the LoRA init: runs with one seed start from the same weights
        if cfg.model.lora_rank > 0:
            self.model.add_lora(cfg.model.lora_rank, cfg.model.lora_alpha)
        else:
            self.model.full_finetune()
        if cfg.train.gradient_checkpointing:  # only forwards with gradients (training) are checkpointed
            self.model.transformer.enable_gradient_checkpointing()
        self.params = {n: p for n, p in self.model.transformer.named_parameters() if p.requires_grad}
        self.optimizer = torch.optim.AdamW(self.params.values(), lr=cfg.train.learning_rate,
                                           betas=tuple(cfg.train.adam_betas), weight_decay=cfg.train.weight_decay)
        self.optimizer = self.accelerator.prepare(self.optimizer)
        self.ema = {n: p.detach().clone() for n, p in self.params.items()} if cfg.train.ema_decay > 0 else None
        nft = cfg.train.method == "nft" and cfg.train.nft.old_decay > 0  # DiffusionNFT's soft-updated sampling policy
        self.old_policy = {n: p.detach().clone() for n, p in self.params.items()} if nft else None
        if cfg.model.lora_rank == 0 and cfg.run.keep_checkpoints is None:
            self._warn_checkpoint_size()
        self._build_rollout_shape()
        self._smoke_test_rewards()

    @staticmethod
    def _read_prompts(key: str, name: str) -> list[dict]:
        """The prompt records of config key `key` (``train``, ``test`` or a JSONL file: :func:`read_jsonl`).

        Raises:
            FileNotFoundError: a missing file. ConfigError: naming `key`, for a malformed line or no prompt.
        """
        try:
            return read_jsonl(prompt_file(name))
        except ValueError as e:
            raise ConfigError(f"config key '{key}': {e}") from None

    def _warn_checkpoint_size(self) -> None:
        """Warn how many checkpoints a run that keeps all of them writes, and their size: the trained weights,
        AdamW's two moments of each, and the EMA and old-policy copies where the run has them."""
        copies = (self.params, self.params, self.params, self.ema or {}, self.old_policy or {})  # AdamW: 2 moments
        mib = sum(t.numel() * t.element_size() for copy in copies for t in copy.values()) / 2**20
        count = -(-self.cfg.run.iterations // self.cfg.run.save_every)
        warnings.warn(f"full fine-tuning (model.lora_rank=0) with run.keep_checkpoints unset keeps all {count} "
                      f"checkpoints of about {mib:.0f} MiB each; set run.keep_checkpoints to keep only the newest",
                      UserWarning, stacklevel=3)

    # ----------------------------------------------------------------------------------------- parts
    def _smoke_test_rewards(self) -> None:
        metas = self.train_metas[:2]
        side = self.model.resolution  # the size the rollouts will have
        images = torch.full((len(metas), 3, side, side), 0.5)
        self.rewards(images, [m["prompt"] for m in metas], metas)

    def _autocast(self, precision: str | None = None):
        """bf16 autocast for ``precision`` (default ``run.mixed_precision``; the config allows ``no`` and
        ``bf16``): ``no`` leaves the surrounding mode."""
        precision = precision or self.cfg.run.mixed_precision
        if precision == "no":
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=torch.bfloat16)

    def _generator(self, iteration: int) -> torch.Generator:
        seed = self.cfg.run.seed * 1_000_003 + iteration * 1009 + self.accelerator.process_index
        return torch.Generator().manual_seed(seed)

    def sample_prompts(self, iteration: int) -> list[dict]:
        """The iteration's ``sampling.prompts_per_iteration`` prompt records (dicts with ``prompt``, ``tag``
        and GenEval metadata), deterministic in ``run.seed``, `iteration` and the process index; with
        ``tag_balanced`` a tag is drawn uniformly, then a prompt of that tag."""
        rng = random.Random(self.cfg.run.seed * 7919 + iteration * 104729 + self.accelerator.process_index)
        n = self.cfg.sampling.prompts_per_iteration
        if not self.cfg.tag_balanced:
            return [rng.choice(self.train_metas) for _ in range(n)]
        by_tag = defaultdict(list)
        for m in self.train_metas:
            by_tag[m.get("tag", "all")].append(m)
        tags = sorted(by_tag)
        return [rng.choice(by_tag[rng.choice(tags)]) for _ in range(n)]

    def _minibatches(self, count: int, generator: torch.Generator):
        """The optimizer steps of ``train.inner_epochs`` passes over this process's `count` rows, each pass in
        a random order drawn from `generator`.

        Yields:
            ``(epoch, j, mb, total_rows)``: the pass, the step within it, this process's row indices of the
            minibatch (`(<= train.minibatch_size,)` long; empty when only other processes have rows left) and
            the minibatch's size summed over all processes. Every process gets the same steps
            (:meth:`_minibatch_sizes`), so it must take each one, empty or not.
        """
        size = self.cfg.train.minibatch_size
        sizes = self._minibatch_sizes(count)  # (processes, minibatches)
        for epoch in range(self.cfg.train.inner_epochs):
            order = torch.randperm(count, generator=generator).to(self.device)
            for j in range(sizes.shape[1]):
                yield epoch, j, order[j * size:(j + 1) * size], sizes[:, j].sum().item()

    def _micro_batches(self, mb: torch.Tensor):
        """`mb` in chunks of ``train.micro_batch_size`` rows (one chunk when 0), for gradient accumulation.

        Yields:
            ``(start, idx, frac)``: the chunk's offset in `mb`, its row indices and its fraction of `mb`.
        """
        micro = self.cfg.train.micro_batch_size or len(mb)
        for start in range(0, len(mb), micro):
            idx = mb[start:start + micro]
            yield start, idx, len(idx) / len(mb)

    def _minibatch_sizes(self, count: int) -> torch.Tensor:
        """:func:`minibatch_sizes` of every process's ``count`` kept transitions (one gather of the counts)."""
        counts = torch.tensor([count])
        if self.accelerator.num_processes > 1:
            counts = self.accelerator.gather(counts.to(self.device)).cpu()
        return minibatch_sizes(counts, self.cfg.train.minibatch_size)

    def _step_optimizer(self, loss: float | None, stats: dict[str, list[float]]) -> None:
        """Sum the gradients over the processes (each process scaled its minibatch loss by its share of the
        global minibatch, so the sum is the global mean's gradient), clip, step AdamW, update the EMA.

        ``loss`` is None for a process that took part with no transitions (a zero gradient). The sum runs
        in float32 buckets of at most :attr:`REDUCE_BUCKET` elements; a parameter without a gradient on
        every process keeps none (AdamW skips it, as with one process).
        """
        params = list(self.params.values())
        if self.accelerator.num_processes > 1:
            has = self.accelerator.reduce(torch.tensor([float(p.grad is not None) for p in params], device=self.device),
                                          "sum")
            buckets, size = [[]], 0
            for p in params:
                if buckets[-1] and size + p.numel() > self.REDUCE_BUCKET:
                    buckets.append([])
                    size = 0
                buckets[-1].append(p)
                size += p.numel()
            for bucket in buckets:
                flat = torch.cat([(q.grad if q.grad is not None else torch.zeros_like(q)).reshape(-1).float()
                                  for q in bucket])
                for q in bucket:
                    q.grad = None  # free this bucket's gradients before the summed ones arrive
                flat = self.accelerator.reduce(flat, "sum")
                offset = 0
                for q in bucket:
                    q.grad = flat[offset:offset + q.numel()].view_as(q).to(q.dtype)
                    offset += q.numel()
            for p, h in zip(params, has.tolist()):
                if h == 0:
                    p.grad = None
        grad_norm = torch.nn.utils.clip_grad_norm_(params, self.cfg.train.max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._update_ema()
        stats["policy/grad_norm"].append(grad_norm.item())
        if loss is not None:
            stats["policy/loss"].append(loss)

    def _update_ema(self) -> None:
        if self.ema is not None:
            self._move_towards_params(self.ema, self.cfg.train.ema_decay)

    @torch.no_grad()
    def _move_towards_params(self, store: dict[str, torch.Tensor], decay: float) -> None:
        """``store <- decay store + (1 - decay) theta`` for every trainable tensor (the EMA, DiffusionNFT's old policy)."""
        for n, p in self.params.items():
            store[n].mul_(decay).add_(p.detach(), alpha=1 - decay)

    @contextlib.contextmanager
    def _holding(self, weights: dict[str, torch.Tensor] | None):
        """Context in which the trainable parameters hold ``weights`` (same names; no-op for None)."""
        if weights is None:
            yield
            return
        backup = {n: p.detach().clone() for n, p in self.params.items()}
        with torch.no_grad():
            for n, p in self.params.items():
                p.copy_(weights[n])
        try:
            yield
        finally:
            with torch.no_grad():
                for n, p in self.params.items():
                    p.copy_(backup[n])

    def ema_weights(self):
        """Context in which the trainable parameters hold their EMA (no-op without EMA)."""
        return self._holding(self.ema)

    def run_eval(self) -> dict:
        """Held-out evaluation with ODE sampling (EMA weights if configured): GenEval strict accuracy where
        the prompts carry GenEval metadata, else the mean of the configured rewards.

        Returns:
            `dict`: ``{"overall": float in [0, 1], "per_tag": {tag: float}, "n_images": int, ...}`` (see
            :func:`flowrl.evaluate.evaluate`; :func:`flowrl.evaluate.evaluate_reward` for reward means).
        """
        e, shift, batch = self.cfg.eval, self.cfg.sampling.shift, self.cfg.sampling.batch_size
        with self.ema_weights(), self._autocast():
            if all("include" in m for m in self.eval_metas):
                return evaluate(self.model, self.eval_metas, e.images_per_tag, e.num_steps, e.guidance_scale, shift,
                                e.seed, batch, accelerator=self.accelerator)
            return evaluate_reward(self.model, self.eval_metas, self.rewards, 1, e.num_steps, e.guidance_scale, shift,
                                   e.seed, batch, accelerator=self.accelerator)

    def grid_images(self) -> torch.Tensor:
        """Images of two fixed test prompts per tag, fixed seeds (for the before/after grid)."""
        e = self.cfg.eval
        with self.ema_weights(), self._autocast():
            return generate(self.model, [m["prompt"] for m in self._grid_metas()], [e.seed + i for i in range(12)],
                            e.num_steps, e.guidance_scale, self.cfg.sampling.shift)

    def _grid_metas(self) -> list[dict]:
        """12 entries: the first two eval prompts of each tag, cycled when there are fewer (new seeds)."""
        by_tag = defaultdict(list)
        for m in self.eval_metas:
            by_tag[m.get("tag", "all")].append(m)
        first = [m for tag in by_tag for m in by_tag[tag][:2]]
        return [first[i % len(first)] for i in range(12)]

    # ------------------------------------------------------------------------------------------ loop
    def train(self) -> dict:
        """Run (or resume) the job. Returns ``{"before": eval, "after": eval, "wall_time_s": float}``."""
        cfg, acc = self.cfg, self.accelerator
        self.out.mkdir(parents=True, exist_ok=True)
        start, elapsed = self._maybe_resume()
        if acc.is_main_process:  # a resumed run keeps its first config and records the resumed one beside it
            save_config(cfg, self.out / ("config.yaml" if start == 0 else f"config-resume-{start:06d}.yaml"))
        t_start = time.time() - elapsed
        if start == 0:
            before = self.run_eval()  # every process takes part (the images are split) and gets the result
            if acc.is_main_process:
                (self.out / "eval_before.json").write_text(json.dumps(before, indent=1))
                from safetensors.torch import save_file

                save_file({"images": self.grid_images().contiguous()}, self.out / "grid_before.safetensors")
        else:
            before = json.loads((self.out / "eval_before.json").read_text())
        bar = tqdm(range(start, cfg.run.iterations), initial=start, total=cfg.run.iterations, desc="flowrl train",
                   disable=not acc.is_main_process)
        for it in bar:
            metrics = self.step(it)
            metrics["time/elapsed_s"] = time.time() - t_start
            if cfg.eval.every and (it + 1) % cfg.eval.every == 0 and it + 1 < cfg.run.iterations:
                result = self.run_eval()
                metrics.update({"eval/overall": result["overall"], **{f"eval/{k}": v for k, v in result["per_tag"].items()}})
            self._log(metrics)
            bar.set_postfix(reward=f"{metrics['reward/total/mean']:.3f}")
            if (it + 1) % cfg.run.save_every == 0 or it + 1 == cfg.run.iterations:
                self._save(it + 1, time.time() - t_start)
        after = self.run_eval()
        wall = time.time() - t_start
        result = {"before": before, "after": after, "wall_time_s": wall, "iterations": cfg.run.iterations}
        if acc.is_main_process:
            (self.out / "eval.json").write_text(json.dumps(result, indent=1))
        self._artifacts()
        return result

    def score(self, images: torch.Tensor, image_prompt: torch.Tensor, metas: list[dict]):
        """Score ``images`` (B, 3, H, W) in [0, 1], image ``b`` drawn for ``metas[image_prompt[b]]``.

        Each image's metadata carries ``"group"`` = its prompt slot, so group-wise rewards (Pref-GRPO win
        rates) keep two draws of one prompt apart.

        Returns:
            The reward set's scores (``.total`` float32 ``(B,)``, ``.per_reward``).
        """
        leaf_metas = [{**metas[i], "group": i} for i in image_prompt.tolist()]
        return self.rewards(images, [m["prompt"] for m in leaf_metas], leaf_metas)

    def step(self, it: int) -> dict[str, float]:
        """One iteration: :meth:`flowrl.grpo.GRPOMixin.grpo_step` (prompts, rollout, rewards, advantages, PPO
        epochs, window advance), or :meth:`flowrl.nft.NFTMixin.nft_step` with ``train.method: nft``.

        Args:
            it (`int`): the 0-based iteration; with ``run.seed`` it fixes the prompts and every random draw,
                so a resumed run repeats the iterations it would have run.

        Returns:
            `dict[str, float]`: ``iteration`` (it + 1), ``reward/*`` means (per reward and per tag),
            ``advantage/*``, ``cost/nfe`` (old-policy velocity rows, CFG counted twice), ``cost/reward_calls`` (images scored),
            ``cost/judge_calls`` (with a pairwise reward: its judgements this iteration),
            ``cost/trained_transitions``, ``time/{sample,score,train}_s`` (wall seconds) and ``policy/*``.

        Raises:
            ValueError: if a reward returns the wrong shape, NaN or inf (the reward is named).
        """
        return self.nft_step(it) if self.cfg.train.method == "nft" else self.grpo_step(it)

    def _group_advantages(self, scores, total: torch.Tensor, image_prompt: torch.Tensor,
                          prompts: int) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
        """Group-relative advantages over every process's images (flat groups: GRPO and DiffusionNFT).

        Args:
            scores: this process's reward set scores (``.per_reward`` for ``train.reward_aggregation: advantage``).
            total: ``(B_all,)`` float32 total rewards gathered over the processes.
            image_prompt: ``(B,)`` long prompt slot of each of this process's images, in ``[0, prompts)``.
            prompts: prompts per process (``sampling.prompts_per_iteration``).

        Returns:
            ``(adv (B_all,) float32, zero (B_all,) bool: untrained (no reward variance, or outside best-of-n),
            {"advantage/zero_variance_frac", "advantage/abs_mean"})``.
        """
        t = self.cfg.train
        group = self.accelerator.gather((image_prompt + self.accelerator.process_index * prompts).to(self.device)).cpu()
        rank = total  # best-of-n ranks by the unclipped advantage, as DanceGRPO; within a group `total` orders alike
        if t.reward_aggregation == "advantage" and len(scores.per_reward) > 1:
            per = {k: self.accelerator.gather(v.to(self.device)).cpu() for k, v in scores.per_reward.items()}
            weights = {k: w for k, (_, w) in self.rewards.rewards.items()}
            adv, zero = aggregate_advantages(per, weights, group, t.adv_std, t.adv_clip_max)
            if t.best_of_n:  # sum_k w_k z_k may order a group unlike the total reward
                rank = aggregate_advantages(per, weights, group, t.adv_std, float("inf"))[0]
        else:
            adv, zero = group_advantages(total, group, t.adv_std, t.adv_clip_max)
        if t.best_of_n:
            zero = zero | ~best_of_n(rank, group, t.best_of_n)
        return adv, zero, {"advantage/zero_variance_frac": zero.float().mean().item(),
                           "advantage/abs_mean": adv.abs().mean().item()}

    def _reward_metrics(self, it: int, total: torch.Tensor, scores, metas: list[dict], image_prompt: torch.Tensor,
                        judged: int) -> dict[str, float]:
        """An iteration's ``iteration``, ``reward/*`` (total over every process, per reward and per tag over this
        process's images), ``cost/reward_calls`` and, with a pairwise reward, ``cost/judge_calls`` = `judged`."""
        metrics = {"iteration": it + 1, "reward/total/mean": total.mean().item(), "reward/total/std": total.std().item()}
        for name, s in scores.per_reward.items():
            metrics[f"reward/{name}/mean"] = s.mean().item()
        metrics.update(tag_means(scores.total, [metas[i].get("tag", "all") for i in image_prompt.tolist()]))
        metrics["cost/reward_calls"] = len(scores.total)
        if any(hasattr(r, "judge_calls") for r, _ in self.rewards.rewards.values()):
            metrics["cost/judge_calls"] = judged
        return metrics

    def _judge_calls(self) -> int:
        """Cumulative judgements of the pairwise rewards (:attr:`rewards.PrefWinRate.judge_calls`), 0 if none."""
        return sum(getattr(r, "judge_calls", 0) for r, _ in self.rewards.rewards.values())

    # ----------------------------------------------------------------------------------- bookkeeping
    def _log(self, metrics: dict) -> None:
        if self.accelerator.is_main_process:
            with open(self.out / "metrics.jsonl", "a") as f:
                f.write(json.dumps(metrics) + "\n")

    def _save(self, iteration: int, elapsed: float) -> None:
        if not self.accelerator.is_main_process:
            return
        def write_extra(folder: Path) -> None:  # inside the checkpoint before it is sealed
            if self.cfg.model.lora_rank > 0:
                with self.ema_weights():
                    self.model.save_lora(folder / "lora")
            if self.old_policy is not None:
                from safetensors.torch import save_file

                save_file({n: v.detach().cpu().contiguous() for n, v in self.old_policy.items()},
                          folder / self.OLD_POLICY_FILE)

        saved = save_checkpoint(self.out / "checkpoints", iteration, self.params, self.optimizer, self.ema,
                                extra={"elapsed_s": elapsed, "window": self.window.state_dict() if self.window else None},
                                write_extra_files=write_extra)
        if self.cfg.run.keep_checkpoints:
            prune_checkpoints(self.out / "checkpoints", self.cfg.run.keep_checkpoints, just_saved=saved)

    def _refuse_existing_run(self) -> None:
        """Raise FileExistsError if ``run.output_dir`` already holds a run and ``run.resume`` is off."""
        if not self.cfg.run.resume and (self.out / "metrics.jsonl").exists():
            raise FileExistsError(f"run folder {self.out} already holds a run: pass run.resume=true to continue it, "
                                  "or choose another run.output_dir")

    def _maybe_resume(self) -> tuple[int, float]:
        """Restore the newest complete checkpoint when ``run.resume``; returns ``(iteration, elapsed_s)``.

        ``metrics.jsonl`` is cut back to the checkpoint's iteration (a torn last line from a crash is
        dropped) and replaced atomically; with no checkpoint the run starts over.
        """
        metrics_file = self.out / "metrics.jsonl"
        if not self.cfg.run.resume:
            self._refuse_existing_run()  # again: the folder may have filled since __init__
            return 0, 0.0
        main = self.accelerator.is_main_process
        path = latest_checkpoint(self.out / "checkpoints")
        if path is None:
            if main:
                warnings.warn(f"run.resume=true but {self.out / 'checkpoints'} holds no complete checkpoint: "
                              "starting the run from iteration 0", UserWarning, stacklevel=3)
                if metrics_file.exists():
                    metrics_file.unlink()  # nothing checkpointed: start over
            return 0, 0.0
        state = load_checkpoint(path, self.params, self.optimizer, self.ema)
        self._apply_optimizer_config(path)
        it = state["iteration"]
        if main:
            kept = []
            for line in metrics_file.read_text().splitlines() if metrics_file.exists() else []:
                try:
                    if json.loads(line)["iteration"] <= it:
                        kept.append(line)
                except (ValueError, KeyError):  # a line torn by a crash while it was written
                    continue
            tmp = metrics_file.with_name(".metrics.jsonl.tmp")
            tmp.write_text("".join(line + "\n" for line in kept))
            os.replace(tmp, metrics_file)
        if self.window is not None and state["extra"].get("window"):
            self.window.load_state_dict(state["extra"]["window"])
        if self.old_policy is not None:
            from safetensors.torch import load_file

            file = path / self.OLD_POLICY_FILE
            if not file.is_file():
                raise ValueError(f"checkpoint {path} has no {self.OLD_POLICY_FILE}: it was not written with "
                                 "train.nft.old_decay > 0, which this run sets")
            for n, v in load_file(file).items():
                self.old_policy[n].copy_(v)
        return it, state["extra"].get("elapsed_s", 0.0)

    def _apply_optimizer_config(self, path: Path) -> None:
        """Set AdamW's learning rate, betas and weight decay to the config's after a resume (a restored optimizer
        state carries the checkpoint's), warning which of them the resumed config changes."""
        t = self.cfg.train
        wanted = {"lr": t.learning_rate, "betas": tuple(t.adam_betas), "weight_decay": t.weight_decay}
        changed = set()
        for group in self.optimizer.param_groups:
            for key, value in wanted.items():
                if (tuple(group[key]) if key == "betas" else group[key]) != value:
                    changed.add(key)
                    group[key] = value
        if changed and self.accelerator.is_main_process:
            warnings.warn(f"resuming from {path} with the config's {', '.join(sorted(changed))} "
                          f"(learning rate {t.learning_rate}, betas {tuple(t.adam_betas)}, weight decay {t.weight_decay}), "
                          "not the checkpoint's", UserWarning, stacklevel=4)

    def _artifacts(self) -> None:
        if not self.accelerator.is_main_process:
            return
        from safetensors.torch import load_file

        metrics = [json.loads(l) for l in (self.out / "metrics.jsonl").read_text().splitlines()]
        result = json.loads((self.out / "eval.json").read_text())
        save_reward_curve(metrics, result, self.out / "reward_curve.png")
        save_diagnostics(metrics, self.out / "diagnostics.png")
        before = load_file(self.out / "grid_before.safetensors")["images"]
        save_grid(before, self.grid_images(), [m["prompt"] for m in self._grid_metas()], self.out / "grid.png")
        with self.ema_weights():
            if self.cfg.model.lora_rank > 0:
                self.model.save_lora(self.out / "lora")
            else:
                self.model.save_pipeline(self.out / "pipeline")
