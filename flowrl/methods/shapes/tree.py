"""``sampling.shape: tree``: BranchGRPO (arXiv 2509.06040): one root per prompt, split into ``branch`` children at
chosen steps, every node of a depth evaluated in one batch; inner nodes take the fusion of their leaves' rewards,
advantages are z-scored per depth, and width and depth pruning drop transitions from the backward pass. With
``sde_steps`` (BranchGRPO-Mix) only those steps and the splits are SDE, and ``flash_ratio`` re-spaces the deterministic
tail after the last of them (MixGRPO-Flash's DPM-Solver++(2M), flowrl's composition).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...advantages import depthwise_advantages, group_advantages, tree_node_rewards, width_prune
from ...fields import check, config_section, setting
from ...samplers import leaf_incidence, mix_plan, sample_tree, start_latents
from ..base import Rewards, SDESamples
from .base import RolloutShape, register_shape


@config_section("sampling", "tree", "BranchGRPO's tree (shape tree)")
@dataclass
class TreeConfig:
    """``sampling.tree.*``: BranchGRPO (arXiv 2509.06040) trees, used with ``sampling.shape: tree``."""

    split_steps: list[int] = setting(factory=list, help="steps where every node splits into `branch` children")
    branch: int = setting(2, "children per split; sampling.group_size must be branch ** len(split_steps)")
    sde_steps: list[int] = setting(
        factory=list, help="BranchGRPO-Mix: SDE only here and at the splits, ODE elsewhere (empty: every step SDE)"
    )
    fusion: str = setting("mean", "leaf-reward fusion into inner nodes: mean | prob (softmax of the path log-prob)")
    width_keep: int = setting(
        0, "width pruning: train only the chains of the best and worst `width_keep` leaves (0 = off)"
    )
    depth_prune: list[int] = setting(factory=list, help="steps left out of the backward pass (depth pruning)")
    flash_ratio: float = setting(
        0.0,
        "with sde_steps: > 0 re-spaces the steps after the last SDE step into this "
        "fraction of them (DPM-Solver++(2M))",
    )

    def __post_init__(self):
        check(self.branch >= 2, "sampling.tree.branch", ">= 2", self.branch)
        check(self.fusion in ("mean", "prob"), "sampling.tree.fusion", "mean|prob", self.fusion)
        check(self.width_keep >= 0, "sampling.tree.width_keep", ">= 0", self.width_keep)
        check(0 <= self.flash_ratio <= 1, "sampling.tree.flash_ratio", "in [0, 1]", self.flash_ratio)
        check(
            len(set(self.split_steps)) == len(self.split_steps),
            "sampling.tree.split_steps",
            "distinct steps",
            self.split_steps,
        )


@register_shape("tree", "BranchGRPO trees, sampling.tree")
class TreeShape(RolloutShape):
    """BranchGRPO trees: ``self.plan`` on its grid ``self.plan_sigmas`` (all SDE, or the BranchGRPO-Mix pattern with
    an optional Flash tail, :func:`flowrl.samplers.mix_plan`), split by ``self.branch`` (children per plan step)."""

    @classmethod
    def check_config(cls, cfg) -> None:
        sampling, tree = cfg.sampling, cfg.sampling.tree
        check(
            bool(tree.split_steps),
            "sampling.tree.split_steps",
            "a non-empty list of steps with sampling.shape 'tree'",
            tree.split_steps,
        )
        check(
            sampling.group_size == tree.branch ** len(tree.split_steps),
            "sampling.group_size",
            f"branch ** len(split_steps) = {tree.branch ** len(tree.split_steps)} for a tree",
            sampling.group_size,
        )
        for key, steps in (
            ("split_steps", tree.split_steps),
            ("sde_steps", tree.sde_steps),
            ("depth_prune", tree.depth_prune),
        ):
            check(
                all(0 <= k < sampling.num_steps for k in steps),
                f"sampling.tree.{key}",
                f"steps in [0, {sampling.num_steps})",
                steps,
            )
        check(
            sampling.window.size == 0,
            "sampling.window.size",
            "0 with a tree (use sampling.tree.sde_steps)",
            sampling.window.size,
        )
        if tree.flash_ratio > 0:  # the deterministic tail after the last SDE step is what gets re-spaced
            last = max(tree.sde_steps + tree.split_steps)
            check(
                bool(tree.sde_steps) and last < sampling.num_steps - 1,
                "sampling.tree.flash_ratio",
                "0 unless sampling.tree.sde_steps leaves deterministic steps after the last SDE step "
                + (
                    f"(the last SDE step is {last}, the last step {sampling.num_steps - 1})"
                    if tree.sde_steps
                    else "(sde_steps is empty: every step is SDE)"
                ),
                tree.flash_ratio,
            )

    def __init__(self, method):
        super().__init__(method)
        sampling, tree = self.cfg.sampling, self.cfg.sampling.tree
        self.plan_sigmas, self.plan = self.sigmas, self.sde_plan()
        if tree.sde_steps:  # BranchGRPO-Mix, optionally with MixGRPO-Flash's DPM-Solver++ 2M tail
            self.plan_sigmas, self.plan = mix_plan(
                self.sigmas,
                sorted(set(tree.sde_steps) | set(tree.split_steps)),
                sampling.kernel,
                sampling.noise_level,
                tree.flash_ratio or None,
                sampling.shift,
            )
        self.branch = [tree.branch if k in tree.split_steps else 1 for k in range(self.plan.num_steps)]
        self.plan = self.only_trainable(self.plan_sigmas, self.plan)

    def rollout(self, metas: list[dict], generator: torch.Generator) -> SDESamples:
        with torch.no_grad():
            table = self.model.prompt_table(metas)
            velocity = self.velocity(table)
            noise = torch.randn((len(metas), *self.model.latent_shape), generator=generator).to(self.device)
            noise = start_latents(noise, self.sigmas[0])  # one root per prompt: the tree makes the group
            ro = self.tree(velocity, table, noise, generator, self.ode_velocity(velocity))
            return SDESamples(self.method.decode(ro.final), ro.group.cpu(), self.nfe(ro), ro, table)

    def tree(
        self, velocity, table, noise: torch.Tensor, generator: torch.Generator, ode_velocity=None, batched: bool = True
    ):
        """The tree (``self.plan`` on ``self.plan_sigmas``, split by ``self.branch``) from one root per prompt, under
        the rollout's autocast.

        Args:
            velocity: the old policy over `table` (:meth:`FlowModel.velocity_fn`).
            noise (`torch.Tensor` of shape `(P, *latent_shape)`): the roots' starting latents, on the device.
            generator (`torch.Generator`): source of the SDE noise.
            ode_velocity: the policy of the deterministic steps (:meth:`ode_velocity`); default `velocity`.
            batched (`bool`): every depth in one velocity call (True) or node by node
                (:func:`flowrl.samplers.sample_tree`).

        Returns:
            :class:`flowrl.samplers.Rollout` with ``P * group_size`` leaves, tree p being group p.
        """
        roots = torch.arange(len(noise), device=self.device)
        with self.policy.autocast():
            return sample_tree(
                velocity,
                noise,
                table.rows(roots),
                roots,
                self.plan_sigmas.to(self.device),
                self.plan,
                self.branch,
                generator=generator,
                batched=batched,
                ode_velocity_fn=ode_velocity,
            )

    def advantages(self, samples: SDESamples, rewards: Rewards):
        """Fused node rewards, depth-wise z-scores, then width and depth pruning of the backward pass. A tree is one
        process's group: this process's rewards alone."""
        ro, train, tree = samples.rollout, self.cfg.train, self.cfg.sampling.tree
        leaf_rewards = rewards.local.total
        inc = leaf_incidence(ro).cpu()
        nodes = tree_node_rewards(inc, leaf_rewards, tree.fusion, ro.parent.cpu(), ro.log_prob.cpu())
        adv = depthwise_advantages(nodes, ro.group.cpu()[ro.leaf.cpu()], ro.step.cpu(), train.adv_clip_max)
        keep = ro.trained.cpu() & (adv != 0)
        if tree.width_keep:
            keep &= width_prune(
                inc, leaf_rewards, ro.group.cpu(), ro.step.cpu(), max(tree.split_steps), tree.width_keep
            )
        if tree.depth_prune:
            keep &= ~torch.isin(ro.step.cpu(), torch.tensor(tree.depth_prune))
        _, zero = group_advantages(leaf_rewards, ro.group.cpu(), train.adv_std, train.adv_clip_max)
        return (
            adv.to(self.device),
            keep.to(self.device),
            {
                "advantage/zero_variance_frac": zero.float().mean().item(),
                "advantage/abs_mean": adv[ro.trained.cpu()].abs().mean().item(),
            },
        )
