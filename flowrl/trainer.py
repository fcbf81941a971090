"""The trainer: sample -> score -> advantages -> policy update -> log -> evaluate -> checkpoint.

Flow-GRPO (arXiv 2505.05470) is the first method: G SDE rollouts per prompt, group-relative
advantages, PPO clipped surrogate on every trained transition, optional KL to the LoRA-disabled base.
``train.method: nft`` swaps in DiffusionNFT (arXiv 2509.16117): G ODE samples per prompt and the
negative-aware flow-matching loss on noised copies of them (:meth:`Trainer.nft_step`).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import time
import warnings
from collections import defaultdict
from pathlib import Path

import torch
from tqdm import tqdm

from rewards import WeightedSum, build_reward
from samplers import (SlidingWindow, StepPlan, flow_sigmas, leaf_incidence, mix_plan, ode_sample, recompute_log_prob,
                      sample, sample_probes, sample_shared_noise, sample_tree, velocity_gain)

from .advantages import (aggregate_advantages, best_of_n, depthwise_advantages, group_advantages, process_advantages, sum_by_node, tree_node_rewards,
                         turning_point_rewards, width_prune)
from .checkpoint import latest_checkpoint, load_checkpoint, prune_checkpoints, save_checkpoint
from .config import Config, ConfigError, prompt_file, resolve_path, save_config
from .evaluate import evaluate, evaluate_reward, generate
from .losses import kl_to_reference, nft_loss, optimality_weights, ppo_loss, ratio_norm, step_weights, velocity_kl
from .models import FlowModel, PromptEmbeds
from .plots import save_diagnostics, save_grid, save_reward_curve
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


def step_diagnostics(ratios: dict[int, list[torch.Tensor]], grad_norms: dict[int, list[torch.Tensor]],
                     clip_range: float) -> dict[str, float]:
    """GRPO-Guard's (arXiv 2510.22319) per-step diagnostics of an iteration's first PPO epoch.

    Args:
        ratios: denoising step -> the ratios `(n,)` float of its transitions (in pieces, concatenated here).
        grad_norms: denoising step -> gradient norms `(n,)` float (``train.step_grad_norms``); may be empty.
        clip_range: the PPO clip range eps.

    Returns:
        ``diag/step_KK/{ratio_mean, ratio_std, clip_high, clip_low}`` (fractions of ratios above ``1 + eps``
        and below ``1 - eps``) per step present, and ``diag/step_KK/grad_norm`` (mean) per step in `grad_norms`.
    """
    out = {}
    for k, parts in sorted(ratios.items()):
        r = torch.cat(parts)
        out[f"diag/step_{k:02d}/ratio_mean"] = r.mean().item()
        out[f"diag/step_{k:02d}/ratio_std"] = r.std(unbiased=False).item()
        out[f"diag/step_{k:02d}/clip_high"] = (r > 1 + clip_range).float().mean().item()
        out[f"diag/step_{k:02d}/clip_low"] = (r < 1 - clip_range).float().mean().item()
    for k, parts in sorted(grad_norms.items()):
        out[f"diag/step_{k:02d}/grad_norm"] = torch.cat(parts).mean().item()
    return out


class Trainer:
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
        try:  # before anything loads
            FlowModel.check_resolution(resolve_path(cfg.model.path), cfg.model.resolution)
        except ValueError as e:
            raise ConfigError(f"config key 'model.resolution': {e}") from None
        self.train_metas = read_jsonl(prompt_file(cfg.train_prompts))
        self.eval_metas = read_jsonl(prompt_file(cfg.eval.prompts))
        self.rewards = WeightedSum({name: (build_reward(name, **r.options), r.weight) for name, r in cfg.rewards.items()})
        self.model = FlowModel(resolve_path(cfg.model.path), self.device, DTYPES[cfg.model.dtype],
                               cfg.model.max_sequence_length, cfg.model.resolution)
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
        self._build_rollout_shape()
        self._smoke_test_rewards()

    def _build_rollout_shape(self) -> None:
        """From ``sampling.*``: the grid ``self.sigmas`` `(N + 1,)`; the step plan ``self.plan`` on its grid
        ``self.plan_sigmas`` (all SDE, or BranchGRPO-Mix's SDE steps with an optional MixGRPO-Flash tail,
        :func:`samplers.mix_plan`); ``self.branch``, the children per plan step of a tree (None: flat groups);
        and ``self.window``, MixGRPO's :class:`samplers.SlidingWindow` (None without ``sampling.window.size``)."""
        s = self.cfg.sampling
        self.sigmas = flow_sigmas(s.num_steps, s.shift)
        self.plan_sigmas = self.sigmas  # the schedule of self.plan (re-spaced by a tree's flash_ratio)
        self.plan = StepPlan.sde(s.num_steps, kernel=s.kernel, noise_level=s.noise_level, train_last=s.train_last_step)
        self.branch = None
        if s.tree.split_steps:
            t = s.tree
            if t.sde_steps:  # BranchGRPO-Mix, optionally with MixGRPO-Flash's DPM-Solver++ 2M tail
                self.plan_sigmas, self.plan = mix_plan(self.sigmas, sorted(set(t.sde_steps) | set(t.split_steps)),
                                                       s.kernel, s.noise_level, t.flash_ratio or None, s.shift)
            self.branch = [t.branch if k in t.split_steps else 1 for k in range(self.plan.num_steps)]
        w = s.window
        self.window = None if w.size == 0 else SlidingWindow(
            s.num_steps, w.size, w.schedule, w.stride, w.interval, w.min_interval, w.roll_back, seed=self.cfg.run.seed)

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

    def current_plan(self) -> tuple[torch.Tensor, StepPlan]:
        """This iteration's ``(sigmas (N' + 1,), plan)``: full SDE, the BranchGRPO-Mix pattern or the MixGRPO window
        (either with its Flash tail)."""
        if self.window is None:
            return self.plan_sigmas, self.plan
        s = self.cfg.sampling
        return mix_plan(self.sigmas, self.window.steps, s.kernel, s.noise_level, s.window.flash_ratio or None, s.shift)

    def _chunked(self, fn, size: int):
        def chunked(x, t, cond):
            return torch.cat([fn(x[i:i + size], t[i:i + size], cond[i:i + size]) for i in range(0, len(x), size)])
        return chunked

    def _ode_velocity(self, velocity):
        """`velocity` under ``sampling.ode_precision`` for the rollout's deterministic steps (ODE prefixes
        and tails, DPM-Solver++ steps, ODE completions: their velocities enter no log-prob, so no ratio),
        or None (``no``: the samplers then use `velocity` itself, float32)."""
        precision = self.cfg.sampling.ode_precision
        if precision == "no":
            return None

        def fn(x, t, cond):
            with self._autocast(precision):
                return velocity(x, t, cond)

        return fn

    def _decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Rollout latents to float32 images in [0, 1] for the rewards (bf16 autocast if
        ``sampling.decode_precision`` says so: the images only feed the rewards, never a log-prob)."""
        size = self.cfg.sampling.batch_size
        with self._autocast(self.cfg.sampling.decode_precision):
            return torch.cat([self.model.decode(latents[i:i + size]) for i in range(0, latents.shape[0], size)]).cpu()

    @torch.no_grad()
    def probe_rollout(self, metas: list[dict], table: PromptEmbeds, generator: torch.Generator):
        """TempFlow-GRPO / G2RPO / TP-GRPO rollout: main paths with probes completed by ODE.

        Trunks per prompt: 1 shared anchor for g2rpo (its group is the ``group_size`` SDE children of
        each probe step), ``group_size`` for tempflow (each with ``probe.children`` children per step)
        and for tp_grpo (each an SDE trajectory on the probe steps, probed after every SDE step).

        Returns:
            ``(probe_rollout, images (P, 3, H, W), prompt index of each image (P,))``.
        """
        s, p = self.cfg.sampling, self.cfg.sampling.probe
        trunks = 1 if p.method == "g2rpo" else s.group_size
        children = {"g2rpo": s.group_size, "tempflow": p.children, "tp_grpo": 0}[p.method]
        roots = torch.arange(len(metas)).repeat_interleave(trunks)  # (R,)
        shape = self.model.latent_shape
        if s.shared_noise or trunks == 1:
            noise = torch.randn((len(metas), *shape), generator=generator).repeat_interleave(trunks, 0)
        else:
            noise = torch.randn((len(roots), *shape), generator=generator)
        steps = list(p.steps) or list(range(s.num_steps - 1))
        plan = StepPlan.window(s.num_steps, steps, s.kernel, s.noise_level) if p.method == "tp_grpo" else StepPlan.ode(s.num_steps)
        velocity = self._chunked(self.model.velocity_fn(table, s.guidance_scale), s.batch_size)
        with self._autocast():
            pr = sample_probes(velocity, noise.to(self.device), (roots + 1).to(self.device), roots.to(self.device),
                               self.sigmas.to(self.device), plan, steps, children, s.kernel, s.noise_level,
                               tuple(p.granularities), include_start=p.method == "tp_grpo", generator=generator,
                               ode_velocity_fn=self._ode_velocity(velocity))
        return pr, self._decode(pr.final), roots[pr.root.cpu()]

    def probe_advantages(self, pr, rewards: torch.Tensor, image_prompt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """Advantages of the trained transitions of a probe rollout (see :meth:`probe_rollout`).

        tempflow / g2rpo: per-step process rewards z-scored per (prompt or trunk, step, granularity), summed
        over granularities (G2RPO). tp_grpo: turning-point step rewards from ``R_0 .. R_n``, z-scored per
        (prompt, step).

        Returns:
            ``(advantages (M,), keep (M,) bool, stats)``.
        """
        p, clip, ro = self.cfg.sampling.probe, self.cfg.train.adv_clip_max, pr.rollout
        step, root, node = pr.step.cpu(), pr.root.cpu(), pr.node.cpu()
        if p.method in ("tempflow", "g2rpo"):
            group = root if p.adv_group == "seed" and p.method == "tempflow" else image_prompt
            adv_p = process_advantages(rewards, group, step, pr.granularity.cpu(), clip)
        else:
            probe_steps = sorted(set(step.tolist()))  # [-1, steps...]
            returns = torch.zeros(int(root.max()) + 1, len(probe_steps))
            returns[root, torch.tensor([probe_steps.index(k) for k in step.tolist()])] = rewards.float()
            step_rewards = turning_point_rewards(returns)  # (R, n)
            later = step >= 0
            values = step_rewards[root[later], torch.tensor([probe_steps.index(k) - 1 for k in step[later].tolist()])]
            adv_p = torch.zeros_like(rewards, dtype=torch.float32)
            adv_p[later] = process_advantages(values, image_prompt[later], step[later], torch.ones_like(step[later]), clip)
        adv = sum_by_node(adv_p, node, len(ro))
        keep = ro.trained.cpu() & (adv != 0)
        return adv.to(self.device), keep.to(self.device), {"advantage/abs_mean": adv_p.abs().mean().item(),
                                                           "advantage/zero_frac": (adv_p == 0).float().mean().item()}

    @torch.no_grad()
    def rollout(self, metas: list[dict], generator: torch.Generator):
        """G SDE rollouts per prompt from the current policy.

        Returns:
            ``(rollout, images (B, 3, H, W) in [0, 1], table)`` where ``table`` row 0 is the empty prompt
            and row 1 + p the p-th prompt; leaves are grouped by prompt (B = P * G).
        """
        s = self.cfg.sampling
        table = self.model.encode([""] + [m["prompt"] for m in metas])
        velocity = self._chunked(self.model.velocity_fn(table, s.guidance_scale), s.batch_size)
        ode = self._ode_velocity(velocity)
        roots = torch.arange(len(metas), device=self.device)  # (P,) one group per prompt
        if self.branch is not None or s.shared_noise:  # one initial noise per group
            noise = torch.randn((len(metas), *self.model.latent_shape), generator=generator).to(self.device)
        if self.branch is not None:  # the tree makes the group
            ro = self.tree_rollout(velocity, noise, generator, ode)
            return ro, self._decode(ro.final), table  # decoded as a flat rollout's are, outside the autocast
        sigmas, plan = self.current_plan()
        sigmas = sigmas.to(self.device)
        with self._autocast():
            if s.shared_noise:  # the group's deterministic prefix once per group
                ro = sample_shared_noise(velocity, noise, roots + 1, roots, sigmas, plan, s.group_size, generator=generator,
                                         ode_velocity_fn=ode)
            else:
                prompt_index = roots.repeat_interleave(s.group_size)  # (B,)
                noise = torch.randn((len(prompt_index), *self.model.latent_shape), generator=generator)
                ro = sample(velocity, noise.to(self.device), prompt_index + 1, prompt_index, sigmas, plan, generator=generator,
                            ode_velocity_fn=ode)
        return ro, self._decode(ro.final), table

    def tree_rollout(self, velocity, noise: torch.Tensor, generator: torch.Generator, ode_velocity=None,
                     batched: bool = True):
        """The preset's BranchGRPO tree (``self.plan`` on ``self.plan_sigmas``, split by ``self.branch``) from one
        root per prompt, under the rollout's autocast.

        Args:
            velocity: the old policy (:meth:`FlowModel.velocity_fn` of a table whose row ``1 + p`` is prompt p).
            noise (`torch.Tensor` of shape `(P, C, H, W)`): the roots' starting latents, on ``self.device``.
            generator (`torch.Generator`): source of the SDE noise.
            ode_velocity: the policy of the deterministic steps (:meth:`_ode_velocity`); default `velocity`.
            batched (`bool`): every depth in one velocity call (True) or node by node (:func:`samplers.sample_tree`).

        Returns:
            :class:`samplers.Rollout` with ``P * group_size`` leaves, tree p being group p.
        """
        roots = torch.arange(len(noise), device=self.device)
        with self._autocast():
            return sample_tree(velocity, noise, roots + 1, roots, self.plan_sigmas.to(self.device), self.plan, self.branch,
                               generator=generator, batched=batched, ode_velocity_fn=ode_velocity)

    def tree_advantages(self, ro, rewards: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """BranchGRPO advantages of every stored transition of a tree rollout and whether it enters the loss:
        fused node rewards, depth-wise z-scores, then width and depth pruning of the backward pass.

        Args:
            ro: a :func:`samplers.sample_tree` rollout; rewards: `(B,)` leaf rewards.

        Returns:
            ``(advantages (M,), keep (M,) bool, stats)``.
        """
        t, tree = self.cfg.train, self.cfg.sampling.tree
        inc = leaf_incidence(ro).cpu()
        nodes = tree_node_rewards(inc, rewards, tree.fusion, ro.parent.cpu(), ro.log_prob.cpu())
        adv = depthwise_advantages(nodes, ro.group.cpu()[ro.leaf.cpu()], ro.step.cpu(), t.adv_clip_max)
        keep = ro.trained.cpu() & (adv != 0)
        if tree.width_keep:
            keep &= width_prune(inc, rewards, ro.group.cpu(), ro.step.cpu(), max(tree.split_steps), tree.width_keep)
        if tree.depth_prune:
            keep &= ~torch.isin(ro.step.cpu(), torch.tensor(tree.depth_prune))
        _, zero = group_advantages(rewards, ro.group.cpu(), t.adv_std, t.adv_clip_max)
        return adv.to(self.device), keep.to(self.device), {"advantage/zero_variance_frac": zero.float().mean().item(),
                                                           "advantage/abs_mean": adv[ro.trained.cpu()].abs().mean().item()}

    def step_subset(self, ro, generator: torch.Generator) -> torch.Tensor:
        """DanceGRPO's ``timestep_fraction`` (arXiv 2505.07818): for each leaf, a random
        ``ceil(fraction * S)`` of its ``S`` trained steps. Returns a `(M,)` bool mask."""
        trained = ro.trained.cpu()
        score = torch.rand(len(ro), generator=generator)  # random order of the steps within each leaf
        score = torch.where(trained, score, torch.full_like(score, 2.0))
        keep = torch.zeros(len(ro), dtype=torch.bool)
        leaf = ro.leaf.cpu()
        for b in leaf.unique().tolist():
            rows = (leaf == b).nonzero().squeeze(1)
            count = int(trained[rows].sum())
            take = math.ceil(self.cfg.train.timestep_fraction * count)
            keep[rows[torch.argsort(score[rows])[:take]]] = True
        return keep & trained

    def optimize(self, ro, adv_all: torch.Tensor, keep: torch.Tensor, table: PromptEmbeds,
                 generator: torch.Generator) -> dict[str, float]:
        """Inner PPO epochs over the kept transitions, each with its advantage ``adv_all[m]``.

        Flow-GRPO's clipped surrogate (arXiv 2505.05470, Eq. 8 without its KL term, which is added here
        with weight ``train.kl_beta``): ``max(-A r, -A clip(r, 1 - eps, 1 + eps))`` averaged over a minibatch
        of ``train.minibatch_size`` transitions, one optimizer step (AdamW, gradient clipping at
        ``train.max_grad_norm``, EMA update) per minibatch, ``train.inner_epochs`` passes in a random order
        drawn from `generator`. The log-probs are recomputed in float32 with the std that drew each sample.
        With ``train.micro_batch_size`` each minibatch is forwarded and back-propagated in micro-batches of
        that many transitions, each loss weighted by its share of the minibatch (gradient accumulation: the
        same step, less activation memory). Under several processes the step follows the mean over every
        process's minibatch (step weights normalised over it too); the returned statistics are this
        process's, except ``policy/grad_norm``, which is the summed gradient's.

        Args:
            ro (:class:`samplers.Rollout`): the iteration's stored transitions, `M` rows.
            adv_all (`torch.Tensor` of shape `(M,)`, float32): advantage per transition (clipped, unitless).
            keep (`torch.Tensor` of shape `(M,)`, bool): transitions that enter the loss.
            table (:class:`PromptEmbeds`): prompt embeddings, row 0 the empty prompt (CFG), rows 1.. indexed
                by ``ro.cond``.
            generator (`torch.Generator`): the iteration's generator (minibatch order).

        Returns:
            `dict[str, float]`: means over optimizer steps of ``policy/*`` (loss, grad_norm, ratio, clip
            fractions, approx_kl, kl), ``policy/ratio_first_max_dev`` (the ratio's largest deviation from 1
            before the first optimizer step: 0 when the recomputation is exact), per-step ``diag/step_KK/*``
            and ``cost/trained_transitions``.
        """
        t = self.cfg.train
        rows = keep.nonzero().squeeze(1)
        tv = ro.select(rows)
        adv = adv_all[rows]  # (M',)
        stats: dict[str, list[float]] = defaultdict(list)
        per_step: dict[int, list[torch.Tensor]] = defaultdict(list)  # first epoch: the ratios per step
        grad_step: dict[int, list[torch.Tensor]] = defaultdict(list)  # first epoch: gradient norms per step
        gain = velocity_gain(tv) if t.step_weighting == "guard" else None
        velocity = self.model.velocity_fn(table, self.cfg.sampling.guidance_scale)  # CFG against table row 0
        many = self.accelerator.num_processes > 1
        optimizer_steps = 0
        self.model.transformer.train()
        for epoch, j, mb, total_rows in self._minibatches(len(tv), generator):
            weights = step_weights(t.step_weighting, gain[mb] if gain is not None else tv.std[mb], tv.std[mb],
                                   mean=1.0 if many else None)  # several processes: unnormalised here
            if many and weights is not None:  # mean 1 over the minibatch of all processes
                weights = weights / (self.accelerator.reduce(weights.sum().reshape(1), "sum") / total_rows)
            if len(mb) == 0:  # this process has no transitions left, the others do: a zero gradient
                self._step_optimizer(None, stats)
                optimizer_steps += 1
                continue
            share = len(mb) / total_rows  # this process's part of the global mean (1 with one process)
            parts: dict[str, list[tuple[float, float]]] = defaultdict(list)  # (value, fraction of the minibatch)
            for c, idx, frac in self._micro_batches(mb):  # gradient accumulation over micro-batches
                sub = tv.select(idx)
                present = sub.step.unique().tolist()  # denoising steps in this micro-batch
                w = None if weights is None else weights[c:c + len(idx)]
                v, log_prob, mean = self._policy_log_prob(velocity, sub)
                track_v = epoch == 0 and t.step_grad_norms == "velocity" and v.requires_grad
                if track_v:
                    v.retain_grad()
                loss, st = ppo_loss(log_prob, sub.log_prob, adv[idx], t.clip_range, w)
                if epoch == 0:
                    ratio = torch.exp(log_prob.detach() - sub.log_prob)
                    for k in present:
                        per_step[k].append(ratio[sub.step == k].cpu())
                    if t.step_grad_norms == "params" and j == 0 and c == 0:
                        grad_step.update(self._param_grad_norms(sub, present, log_prob, adv[idx], w))
                if t.kl_beta > 0:
                    kl = self._kl_to_reference(velocity, sub, v, mean)
                    loss = loss + t.kl_beta * kl
                    parts["policy/kl"].append((kl.item(), frac))
                scale = frac * share  # the micro-batch's part of the (global) minibatch mean
                self.accelerator.backward(loss * scale if scale != 1.0 else loss)
                if track_v and v.grad is not None:  # d loss / d v per transition, undoing the 1/M of the mean
                    norms = v.grad.float().flatten(1).norm(dim=1).cpu() * len(idx) / scale
                    for k in present:
                        grad_step[k].append(norms[(sub.step == k).cpu()])
                parts["policy/loss"].append((loss.item(), frac))
                for k, v_ in st.items():
                    parts[k].append((v_.item(), frac))
            merged = {k: max(x for x, _ in vals) if k == "policy/ratio_max_dev" else sum(x * f for x, f in vals)
                      for k, vals in parts.items()}  # the minibatch's statistics
            if optimizer_steps == 0:  # before any update (absent where this process's first step had no transitions)
                stats["policy/ratio_first_max_dev"].append(merged["policy/ratio_max_dev"])
            self._step_optimizer(merged["policy/loss"], stats)
            optimizer_steps += 1
            for k, x in merged.items():
                if k != "policy/loss":
                    stats[k].append(x)
        self.model.transformer.eval()
        out = {k: sum(v) / len(v) for k, v in stats.items()}
        out["policy/optimizer_steps"] = optimizer_steps
        out.update(step_diagnostics(per_step, grad_step, t.clip_range))
        out["cost/trained_transitions"] = len(tv) * t.inner_epochs
        return out

    def _policy_log_prob(self, velocity, sub) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The current policy's velocity `(M, C, H, W)` (under ``run.mixed_precision``) at transitions `sub`,
        and the float32 log-prob `(M,)` and mean `(M, C, H, W)` of their recorded next states at the std that
        drew them (:func:`samplers.recompute_log_prob`); with ``train.ratio_norm`` the log-prob is GRPO-Guard's
        (arXiv 2510.22319) std-scaled, unbiased one, ``old + ratio_norm(...)``, so that ``exp(new - old)`` is its ratio."""
        with self._autocast():
            v = velocity(sub.state, sub.sigma, sub.cond)
        log_prob, mean = recompute_log_prob(sub, v)
        if self.cfg.train.ratio_norm:
            log_prob = sub.log_prob + ratio_norm(log_prob, sub.log_prob, mean, sub.mean, sub.std)
        return v, log_prob, mean

    def _kl_to_reference(self, velocity, sub, v: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
        """The KL penalty (scalar, before ``train.kl_beta``) of the policy's velocity `v` / step mean `mean` at
        transitions `sub` to the LoRA-disabled base's (``train.kl_type``: ``velocity`` -> :func:`losses.velocity_kl`,
        else the Gaussian steps' :func:`losses.kl_to_reference` at the recorded std)."""
        with torch.no_grad(), self.model.reference(), self._autocast():
            v_ref = velocity(sub.state, sub.sigma, sub.cond)
        if self.cfg.train.kl_type == "velocity":
            return velocity_kl(v, v_ref)
        return kl_to_reference(mean, recompute_log_prob(sub, v_ref)[1], sub.std)

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

    def _param_grad_norms(self, sub, steps: list[int], log_prob: torch.Tensor, adv: torch.Tensor,
                          weights: torch.Tensor | None) -> dict[int, list[torch.Tensor]]:
        """Norm of the gradient of each denoising step's mean PPO loss w.r.t. the trained parameters, on the
        first (micro-)batch of an iteration (``train.step_grad_norms: params``; one extra backward per step present)."""
        t = self.cfg.train
        params = [p for p in self.params.values() if p.requires_grad]
        out = {}
        for k in steps:
            m = sub.step == k
            loss_k, _ = ppo_loss(log_prob[m], sub.log_prob[m], adv[m], t.clip_range,
                                 None if weights is None else weights[m])
            grads = torch.autograd.grad(loss_k, params, retain_graph=True, allow_unused=True)
            sq = sum(g.float().pow(2).sum() for g in grads if g is not None)
            out[k] = [torch.as_tensor(sq).sqrt().reshape(1).cpu()]
        return out

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
        """One iteration: prompts, rollout, rewards, advantages, :meth:`optimize`, window advance (GRPO), or
        :meth:`nft_step` with ``train.method: nft``.

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
        if self.cfg.train.method == "nft":
            return self.nft_step(it)
        gen = self._generator(it)
        metas = self.sample_prompts(it)
        t0 = time.time()
        if self.cfg.sampling.probe.method:
            table = self.model.encode([""] + [m["prompt"] for m in metas])
            probes, images, image_prompt = self.probe_rollout(metas, table, gen)
            ro = probes.rollout
        else:
            probes = None
            ro, images, table = self.rollout(metas, gen)
            image_prompt = ro.group.cpu()
        t1 = time.time()
        judged = self._judge_calls()
        scores = self.score(images, image_prompt, metas)
        judged = self._judge_calls() - judged
        t2 = time.time()
        total = self.accelerator.gather(scores.total.to(self.device)).cpu()
        mine = slice(self.accelerator.process_index * len(scores.total), (self.accelerator.process_index + 1) * len(scores.total))
        if probes is not None:  # process rewards of this process's own probes
            adv_t, keep, adv_stats = self.probe_advantages(probes, scores.total, image_prompt)
        elif self.branch is None:  # group z-scores over the gathered batch, then this process's share
            adv, zero, adv_stats = self._group_advantages(scores, total, image_prompt, len(metas))
            keep = ro.trained & ~zero[mine].to(ro.trained.device)[ro.leaf]
            adv_t = adv[mine].to(self.device)[ro.leaf]
        else:  # a tree is one process's group: no gather needed
            adv_t, keep, adv_stats = self.tree_advantages(ro, scores.total)
        if self.cfg.train.timestep_fraction < 1:
            keep = keep & self.step_subset(ro, gen).to(keep.device)
        stats = self.optimize(ro, adv_t, keep, table, gen)
        t3 = time.time()
        if self.window is not None:
            stats["sampling/window_start"] = self.window.start
            self.window.advance()
        metrics = self._reward_metrics(it, total, scores, metas, image_prompt, judged)
        metrics.update({**adv_stats, "cost/nfe": ro.cost["nfe"] * (2 if self.cfg.sampling.guidance_scale != 1 else 1),
                        "time/sample_s": t1 - t0, "time/score_s": t2 - t1, "time/train_s": t3 - t2, **stats})
        return metrics

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
        if t.reward_aggregation == "advantage" and len(scores.per_reward) > 1:
            per = {k: self.accelerator.gather(v.to(self.device)).cpu() for k, v in scores.per_reward.items()}
            weights = {k: w for k, (_, w) in self.rewards.rewards.items()}
            adv, zero = aggregate_advantages(per, weights, group, t.adv_std, t.adv_clip_max)
        else:
            adv, zero = group_advantages(total, group, t.adv_std, t.adv_clip_max)
        if t.best_of_n:
            zero = zero | ~best_of_n(total, group, t.best_of_n)
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

    def nft_step(self, it: int) -> dict[str, float]:
        """One DiffusionNFT iteration (arXiv 2509.16117, Algorithm 1): sample, score, train on the forward process.

        ``sampling.group_size`` deterministic Euler samples (``sampling.num_steps`` steps, CFG at
        ``sampling.guidance_scale``) of each of ``sampling.prompts_per_iteration`` prompts are drawn by the
        old policy (the current one, or with ``train.nft.old_decay > 0`` its soft-updated copy) and scored;
        the group-relative advantages (gathered over processes, as in GRPO) become optimality weights
        ``r = clip(A / A_max) / 2 + 1/2`` (:func:`losses.optimality_weights`). Every image of a group with
        reward variance is noised ``train.nft.timesteps`` times, ``x_t = (1 - t) x0 + t eps`` with ``t`` drawn
        uniformly from the sampler's grid times ``>= train.nft.min_time`` (0: all of them; 1 = noise), and the
        guided velocity is trained on them with :func:`losses.nft_loss`:
        minibatches of ``train.minibatch_size`` rows per process (the same optimizer steps on every process,
        as :meth:`optimize`), ``train.inner_epochs`` passes, under ``run.mixed_precision`` (no ratio needs
        float32 here). Then ``theta_old <- d theta_old + (1 - d) theta``. Needs no log-probs and no
        trajectories, only the final latents.

        Args:
            it (`int`): the 0-based iteration (with ``run.seed`` it fixes prompts and every random draw).

        Returns:
            `dict[str, float]`: the keys of :meth:`step` (``reward/*``, ``advantage/*``, ``cost/*``,
            ``time/*``, ``policy/loss``, ``policy/grad_norm``, ``policy/optimizer_steps``); ``cost/nfe`` counts
            the sampling rows and the old-policy rows of the loss, CFG twice.

        Raises:
            ValueError: if a reward returns the wrong shape, NaN or inf (the reward is named).
        """
        cfg, model, t = self.cfg, self.model, self.cfg.train
        gen = self._generator(it)
        metas = self.sample_prompts(it)
        t0 = time.time()
        table = model.encode([""] + [m["prompt"] for m in metas])
        cond = torch.arange(len(metas), device=self.device).repeat_interleave(cfg.sampling.group_size) + 1  # (B,)
        noise = torch.randn((len(cond), *model.latent_shape), generator=gen).to(self.device)
        velocity = model.velocity_fn(table, cfg.sampling.guidance_scale)  # guided, against the empty prompt (row 0)
        sigmas, size = self.sigmas.to(self.device), cfg.sampling.batch_size
        with torch.no_grad(), self._holding(self.old_policy), self._autocast():
            x0 = ode_sample(self._chunked(velocity, size), noise, cond, sigmas)
        images = self._decode(x0)
        t1 = time.time()
        image_prompt = (cond - 1).cpu()
        judged = self._judge_calls()
        scores = self.score(images, image_prompt, metas)
        judged = self._judge_calls() - judged
        t2 = time.time()
        total = self.accelerator.gather(scores.total.to(self.device)).cpu()
        adv, zero, adv_stats = self._group_advantages(scores, total, image_prompt, len(metas))
        mine = slice(self.accelerator.process_index * len(cond), (self.accelerator.process_index + 1) * len(cond))
        adv, keep = adv[mine], ~zero[mine]
        rows = keep.nonzero().squeeze(1).repeat_interleave(t.nft.timesteps)  # (N,) noised copies of each kept image
        grid = self.sigmas[:-1]  # the sampler's own times, in (0, 1]; it starts at 1, so the filter keeps one
        grid = grid[grid >= t.nft.min_time]
        times = grid[torch.randint(0, len(grid), (len(rows),), generator=gen)].to(self.device)
        eps = torch.randn((len(rows), *model.latent_shape), generator=gen).to(self.device)
        x_0, c = x0[rows.to(self.device)], cond[rows.to(self.device)]
        x_t = (1 - times.view(-1, 1, 1, 1)) * x_0 + times.view(-1, 1, 1, 1) * eps
        r = optimality_weights(adv[rows], t.adv_clip_max).to(self.device)
        with torch.no_grad(), self._holding(self.old_policy), self._autocast():
            v_old = self._chunked(velocity, size)(x_t, times, c) if len(rows) else x_t
        stats = self._nft_update(velocity, x_t, times, c, x_0, v_old, r, gen)
        if self.old_policy is not None:
            self._move_towards_params(self.old_policy, t.nft.old_decay)
        t3 = time.time()
        cfg_rows = 2 if cfg.sampling.guidance_scale != 1 else 1
        metrics = self._reward_metrics(it, total, scores, metas, image_prompt, judged)
        metrics.update({**adv_stats, "cost/nfe": (len(cond) * cfg.sampling.num_steps + len(rows)) * cfg_rows,
                        "cost/trained_transitions": len(rows) * t.inner_epochs,
                        "time/sample_s": t1 - t0, "time/score_s": t2 - t1, "time/train_s": t3 - t2,
                        **stats})
        return metrics

    def _nft_update(self, velocity, x_t: torch.Tensor, times: torch.Tensor, cond: torch.Tensor, x_0: torch.Tensor,
                    v_old: torch.Tensor, r: torch.Tensor, generator: torch.Generator) -> dict[str, float]:
        """DiffusionNFT's optimizer steps (arXiv 2509.16117, Eq. 8: :func:`losses.nft_loss`) on `N` noised rows:
        ``train.inner_epochs`` passes of minibatches (:meth:`_minibatches`, micro-batched as :meth:`optimize`).

        Args:
            velocity: the guided policy (:meth:`FlowModel.velocity_fn`), trained here.
            x_t, x_0, v_old (`torch.Tensor` of shape `(N, C, H, W)`): noised rows, their clean samples, and the
                old policy's velocity at them.
            times (`torch.Tensor` of shape `(N,)`, float32 in (0, 1]): the rows' noise times; cond `(N,)` long
                their prompt rows; r `(N,)` float32 in [0, 1] their optimality weights.
            generator: the iteration's generator (minibatch order).

        Returns:
            ``policy/loss`` and ``policy/grad_norm`` (means over steps) and ``policy/optimizer_steps``.
        """
        t = self.cfg.train
        stats: dict[str, list[float]] = defaultdict(list)
        steps = 0
        self.model.transformer.train()
        for _, _, mb, total_rows in self._minibatches(len(x_t), generator):
            steps += 1
            if len(mb) == 0:  # this process has no rows left, the others do: a zero gradient
                self._step_optimizer(None, stats)
                continue
            share = len(mb) / total_rows  # this process's part of the global minibatch
            parts = []
            for _, idx, frac in self._micro_batches(mb):  # gradient accumulation
                with self._autocast():
                    v = velocity(x_t[idx], times[idx], cond[idx])
                loss = nft_loss(v, v_old[idx], x_t[idx], x_0[idx], times[idx], r[idx], t.nft.beta, t.adv_clip_max)
                scale = frac * share
                self.accelerator.backward(loss * scale if scale != 1.0 else loss)
                parts.append(loss.item() * frac)
            self._step_optimizer(sum(parts), stats)
        self.model.transformer.eval()
        return {**{k: sum(v) / len(v) for k, v in stats.items()}, "policy/optimizer_steps": steps}

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
            if main and metrics_file.exists():
                metrics_file.unlink()  # nothing checkpointed: start over
            return 0, 0.0
        state = load_checkpoint(path, self.params, self.optimizer, self.ema)
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
        if self.cfg.model.lora_rank > 0:
            with self.ema_weights():
                self.model.save_lora(self.out / "lora")
