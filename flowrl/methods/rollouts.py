"""GRPO's rollouts and their advantages: flat groups (Flow-GRPO, DanceGRPO; MixGRPO's sliding window and its
Flash tail), BranchGRPO trees and the single-step branching of TempFlow-GRPO / G2RPO / TP-GRPO.

:class:`GroupRollouts` builds a :class:`samplers.Rollout` from the config's step plan and turns the rewards of
its images into per-transition advantages; :class:`flowrl.methods.grpo.GRPO` adds the PPO update.
"""

from __future__ import annotations

import math

import torch

from samplers import (SlidingWindow, StepPlan, leaf_incidence, mix_plan, sample, sample_probes,
                      sample_shared_noise, sample_tree, start_latents)

from ..advantages import (depthwise_advantages, group_advantages, process_advantages, sum_by_node, tree_node_rewards,
                          turning_point_rewards, width_prune)
from ..models import PromptEmbeds
from .base import Method, Samples


class GroupRollouts(Method):
    """The rollout shapes of the GRPO family and their advantage estimators.

    From ``sampling.*``: the step plan ``self.plan`` on its grid ``self.plan_sigmas`` (all SDE, or
    BranchGRPO-Mix's SDE steps with an optional MixGRPO-Flash tail, :func:`samplers.mix_plan`); ``self.branch``,
    the children per plan step of a tree (None: flat groups); ``self.window``, MixGRPO's
    :class:`samplers.SlidingWindow` (None without ``sampling.window.size``). Args: as :class:`Method`.
    """

    def __init__(self, cfg, model, policy, rewards):
        super().__init__(cfg, model, policy, rewards)
        self._build_rollout_shape()

    # ------------------------------------------------------------------------------ the contract
    def rollout(self, metas: list[dict], generator: torch.Generator) -> Samples:
        """This iteration's rollout: probes (``sampling.probe.method``), a tree (``sampling.tree``) or flat groups of
        ``sampling.group_size`` per prompt. ``data``: ``rollout`` (:class:`samplers.Rollout`), ``table`` (prompt
        embeddings, row 0 the empty prompt), ``probes`` (the probe rollout, or None) and ``generator`` (the
        iteration's, for the advantages' random step subset)."""
        probes = None
        if self.cfg.sampling.probe.method:
            table = self.model.prompt_table(metas)
            probes, images, image_prompt = self.probe_rollout(metas, table, generator)
            ro = probes.rollout
        else:
            ro, images, table = self.flat_or_tree_rollout(metas, generator)
            image_prompt = ro.group.cpu()
        nfe = ro.cost["nfe"] * self.model.cfg_rows(self.cfg.sampling.guidance_scale)
        return Samples(images, image_prompt, nfe, {"rollout": ro, "table": table, "probes": probes, "generator": generator})

    def advantages(self, samples: Samples, scores, total: torch.Tensor, prompts: int):
        """Per-transition advantages ``(M,)`` and the transitions that enter the loss ``(M,)`` bool: process
        rewards of the probes, group z-scores of the gathered batch (this process's share), or the tree's
        depth-wise advantages; with ``train.timestep_fraction < 1``, DanceGRPO's random subset of steps."""
        ro, probes, gen = samples.data["rollout"], samples.data["probes"], samples.data["generator"]
        if probes is not None:  # process rewards of this process's own probes
            adv_t, keep, stats = self.probe_advantages(probes, scores.total, samples.image_prompt)
        elif self.branch is None:  # group z-scores over the gathered batch, then this process's share
            adv, zero, stats = self.group_advantages(scores, total, samples.image_prompt, prompts)
            mine = self.mine(len(scores.total))
            keep = ro.trained & ~zero[mine].to(ro.trained.device)[ro.leaf]
            adv_t = adv[mine].to(self.device)[ro.leaf]
        else:  # a tree is one process's group: no gather needed
            adv_t, keep, stats = self.tree_advantages(ro, scores.total)
        if self.cfg.train.timestep_fraction < 1:
            keep = keep & self.step_subset(ro, gen).to(keep.device)
        return adv_t, keep, stats

    def end_iteration(self, stats: dict) -> None:
        """Advance MixGRPO's sliding window (recording ``sampling/window_start``)."""
        if self.window is not None:
            stats["sampling/window_start"] = self.window.start
            self.window.advance()

    def state_dict(self) -> dict:
        return {"window": self.window.state_dict() if self.window else None}

    def load_state_dict(self, state: dict) -> None:
        if self.window is not None and state.get("window"):
            self.window.load_state_dict(state["window"])

    # ------------------------------------------------------------------------------ the shapes
    def _build_rollout_shape(self) -> None:
        """Set ``plan``, ``plan_sigmas``, ``branch`` and ``window`` from ``sampling.*`` (see the class docstring)."""
        s = self.cfg.sampling
        self.plan_sigmas = self.sigmas  # the schedule of self.plan (re-spaced by a tree's flash_ratio)
        self.plan = StepPlan.sde(s.num_steps, kernel=s.kernel, noise_level=s.noise_level, train_last=s.train_last_step)
        self.branch = None
        if s.tree.split_steps:
            t = s.tree
            if t.sde_steps:  # BranchGRPO-Mix, optionally with MixGRPO-Flash's DPM-Solver++ 2M tail
                self.plan_sigmas, self.plan = mix_plan(self.sigmas, sorted(set(t.sde_steps) | set(t.split_steps)),
                                                       s.kernel, s.noise_level, t.flash_ratio or None, s.shift)
            self.branch = [t.branch if k in t.split_steps else 1 for k in range(self.plan.num_steps)]
        self.plan = self.only_trainable(self.plan_sigmas, self.plan)
        w = s.window
        self.window = None if w.size == 0 else SlidingWindow(
            s.num_steps, w.size, w.schedule, w.stride, w.interval, w.min_interval, w.roll_back, seed=self.cfg.run.seed)

    def current_plan(self) -> tuple[torch.Tensor, StepPlan]:
        """This iteration's ``(sigmas (N' + 1,), plan)``: full SDE, the BranchGRPO-Mix pattern or the MixGRPO window
        (either with its Flash tail)."""
        if self.window is None:
            return self.plan_sigmas, self.plan
        s = self.cfg.sampling
        sigmas, plan = mix_plan(self.sigmas, self.window.steps, s.kernel, s.noise_level, s.window.flash_ratio or None,
                                s.shift)
        return sigmas, self.only_trainable(sigmas, plan)

    def only_trainable(self, sigmas: torch.Tensor, plan: StepPlan) -> StepPlan:
        """``plan`` on the grid ``sigmas`` (``(N + 1,)``) with its steps that run a frozen network untrained
        (:meth:`FlowModel.trainable_times`: a two-expert Wan 2.2's other expert); ``plan`` itself for every other model."""
        mask = self.model.trainable_times(sigmas[:-1])
        if mask is None:
            return plan
        return StepPlan(plan.kernels, plan.noise_levels, [t and bool(m) for t, m in zip(plan.trained, mask.tolist())])

    def ode_velocity(self, velocity):
        """`velocity` under ``sampling.ode_precision`` for the rollout's deterministic steps (ODE prefixes
        and tails, DPM-Solver++ steps, ODE completions: their velocities enter no log-prob, so no ratio),
        or None (``no``: the samplers then use `velocity` itself, float32)."""
        precision = self.cfg.sampling.ode_precision
        if precision == "no":
            return None

        def fn(x, t, cond):
            with self.policy.autocast(precision):
                return velocity(x, t, cond)

        return fn

    @torch.no_grad()
    def flat_or_tree_rollout(self, metas: list[dict], generator: torch.Generator):
        """G SDE rollouts per prompt from the current policy.

        Returns:
            ``(rollout, images (B, 3, H, W) in [0, 1], table)`` where ``table`` row 0 is the empty prompt
            and row 1 + p the p-th prompt; leaves are grouped by prompt (B = P * G).
        """
        s = self.cfg.sampling
        table = self.model.prompt_table(metas)
        velocity = self.chunked(self.model.velocity_fn(table, s.guidance_scale), s.batch_size)
        ode = self.ode_velocity(velocity)
        roots = torch.arange(len(metas), device=self.device)  # (P,) one group per prompt
        if self.branch is not None or s.shared_noise:  # one initial noise per group
            noise = torch.randn((len(metas), *self.model.latent_shape), generator=generator).to(self.device)
            noise = start_latents(noise, self.sigmas[0])  # the state at the first time (noise itself at sigma 1)
        if self.branch is not None:  # the tree makes the group
            ro = self.tree_rollout(velocity, noise, generator, ode)
            return ro, self.decode(ro.final), table  # decoded as a flat rollout's are, outside the autocast
        sigmas, plan = self.current_plan()
        sigmas = sigmas.to(self.device)
        with self.policy.autocast():
            if s.shared_noise:  # the group's deterministic prefix once per group
                ro = sample_shared_noise(velocity, noise, roots + 1, roots, sigmas, plan, s.group_size, generator=generator,
                                         ode_velocity_fn=ode)
            else:
                prompt_index = roots.repeat_interleave(s.group_size)  # (B,)
                noise = torch.randn((len(prompt_index), *self.model.latent_shape), generator=generator)
                noise = start_latents(noise, self.sigmas[0])  # the state at the first time (noise itself at sigma 1)
                ro = sample(velocity, noise.to(self.device), prompt_index + 1, prompt_index, sigmas, plan, generator=generator,
                            ode_velocity_fn=ode)
        return ro, self.decode(ro.final), table

    def tree_rollout(self, velocity, noise: torch.Tensor, generator: torch.Generator, ode_velocity=None,
                     batched: bool = True):
        """The preset's BranchGRPO tree (``self.plan`` on ``self.plan_sigmas``, split by ``self.branch``) from one
        root per prompt, under the rollout's autocast.

        Args:
            velocity: the old policy (:meth:`FlowModel.velocity_fn` of a table whose row ``1 + p`` is prompt p).
            noise (`torch.Tensor` of shape `(P, C, H, W)`): the roots' starting latents, on ``self.device``.
            generator (`torch.Generator`): source of the SDE noise.
            ode_velocity: the policy of the deterministic steps (:meth:`ode_velocity`); default `velocity`.
            batched (`bool`): every depth in one velocity call (True) or node by node (:func:`samplers.sample_tree`).

        Returns:
            :class:`samplers.Rollout` with ``P * group_size`` leaves, tree p being group p.
        """
        roots = torch.arange(len(noise), device=self.device)
        with self.policy.autocast():
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
        noise = start_latents(noise, self.sigmas[0])  # the state at the first time (noise itself at sigma 1)
        steps = list(p.steps) or list(range(s.num_steps - 1))
        plan = StepPlan.window(s.num_steps, steps, s.kernel, s.noise_level) if p.method == "tp_grpo" else StepPlan.ode(s.num_steps)
        velocity = self.chunked(self.model.velocity_fn(table, s.guidance_scale), s.batch_size)
        with self.policy.autocast():
            pr = sample_probes(velocity, noise.to(self.device), (roots + 1).to(self.device), roots.to(self.device),
                               self.sigmas.to(self.device), plan, steps, children, s.kernel, s.noise_level,
                               tuple(p.granularities), include_start=p.method == "tp_grpo", generator=generator,
                               ode_velocity_fn=self.ode_velocity(velocity))
        return pr, self.decode(pr.final), roots[pr.root.cpu()]

    def probe_advantages(self, pr, rewards: torch.Tensor, image_prompt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """Advantages of the trained transitions of a probe rollout (see :meth:`probe_rollout`).

        tempflow / g2rpo: per-step process rewards z-scored per (prompt or trunk, step, granularity), summed
        over granularities (G2RPO) and the sum clipped to ``+-train.adv_clip_max`` as in G2RPO's code. tp_grpo: turning-point step rewards from ``R_0 .. R_n``, z-scored per
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
            step_rewards = turning_point_rewards(returns, p.balance)  # (R, n)
            later = step >= 0
            values = step_rewards[root[later], torch.tensor([probe_steps.index(k) - 1 for k in step[later].tolist()])]
            adv_p = torch.zeros_like(rewards, dtype=torch.float32)
            adv_p[later] = process_advantages(values, image_prompt[later], step[later], torch.ones_like(step[later]), clip)
        adv = sum_by_node(adv_p, node, len(ro)).clamp(-clip, clip)  # G2RPO's sum over granularities, clipped again
        keep = ro.trained.cpu() & (adv != 0)
        return adv.to(self.device), keep.to(self.device), {"advantage/abs_mean": adv_p.abs().mean().item(),
                                                           "advantage/zero_frac": (adv_p == 0).float().mean().item()}

