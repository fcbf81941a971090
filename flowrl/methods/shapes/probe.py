"""Single-step branching with ODE completion (:func:`flowrl.samplers.sample_probes`): ``sampling.shape`` ``tempflow``
(TempFlow-GRPO, arXiv 2508.04324), ``g2rpo`` (G2RPO, arXiv 2510.01982) and ``tp_grpo`` (TP-GRPO, arXiv 2602.06422).

Each trunk is a main path; at each probe step it spawns stochastic children (or, for TP-GRPO, takes its own SDE step)
that are completed by ODE and scored: the process reward of that step. The three differ in their trunks, children,
plan and in how process rewards become advantages, each a small override of :class:`ProbeShape`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...advantages import process_advantages, sum_by_node, turning_point_rewards
from ...fields import check, config_section, setting
from ...samplers import Probes, StepPlan, sample_probes, start_latents
from ..base import ProbeSamples, Rewards
from .base import RolloutShape, register_shape


@config_section("sampling", "probe", "single-step probes (shapes tempflow, g2rpo, tp_grpo)")
@dataclass
class ProbeConfig:
    """``sampling.probe.*``: the probes of ``sampling.shape`` ``tempflow``, ``g2rpo`` and ``tp_grpo``."""

    steps: list[int] = setting(factory=list, help="probe steps; empty = every step but the last")
    children: int = setting(4, "tempflow: SDE children per trunk and probe step (g2rpo uses group_size, tp_grpo none)")
    granularities: list[int] = setting(factory=lambda: [1], help="g2rpo: the ODE-completion strides, each scored")
    adv_group: str = setting("prompt", "tempflow: normalise over the prompt's branches (prompt) or one trunk's (seed)")
    balance: bool = setting(
        True, "tp_grpo: as many positive as negative turning points (the largest |R_n - R_0| of each)"
    )

    def __post_init__(self):
        check(self.children >= 1, "sampling.probe.children", ">= 1", self.children)
        check(
            bool(self.granularities) and min(self.granularities) >= 1,
            "sampling.probe.granularities",
            "a non-empty list of strides >= 1",
            self.granularities,
        )
        check(self.adv_group in ("prompt", "seed"), "sampling.probe.adv_group", "prompt|seed", self.adv_group)


class ProbeShape(RolloutShape):
    """Probes of a main path completed by ODE; subclasses say how many trunks and children, which plan the trunks
    follow, and how the process rewards become advantages (:meth:`process_advantages`)."""

    INCLUDE_START = False
    """Whether a pure ODE run from the trunk's start is scored too (``R_0`` of TP-GRPO)."""

    @classmethod
    def check_config(cls, cfg) -> None:
        sampling = cfg.sampling
        check(
            all(0 <= k < sampling.num_steps - 1 for k in sampling.probe.steps),
            "sampling.probe.steps",
            f"steps in [0, {sampling.num_steps - 1})",
            sampling.probe.steps,
        )
        check(
            not sampling.tree.split_steps and sampling.window.size == 0,
            "sampling.shape",
            "a probe shape without sampling.tree / sampling.window",
            sampling.shape,
        )

    def trunks(self) -> int:
        """Main paths per prompt."""
        return self.cfg.sampling.group_size

    def children(self) -> int:
        """Stochastic children per trunk and probe step (0: the trunk's own SDE step is the probe)."""
        raise NotImplementedError

    def trunk_plan(self, steps: list[int]) -> StepPlan:
        """The trunks' plan (all ODE by default)."""
        return StepPlan.ode(self.cfg.sampling.num_steps)

    def process_advantages(self, probes, rewards: torch.Tensor, image_prompt: torch.Tensor) -> torch.Tensor:
        """Per-image process advantages `(B,)` of the probes' completions from their rewards `(B,)`."""
        raise NotImplementedError

    def rollout(self, metas: list[dict], generator: torch.Generator) -> ProbeSamples:
        """Main paths with probes completed by ODE (:func:`flowrl.samplers.sample_probes`); the images are the
        completions, each drawn for its trunk's prompt."""
        with torch.no_grad():
            sampling, p = self.cfg.sampling, self.cfg.sampling.probe
            table = self.model.prompt_table(metas)
            trunks = self.trunks()
            roots = torch.arange(len(metas)).repeat_interleave(trunks)  # (R,)
            shape = self.model.latent_shape
            if sampling.shared_noise or trunks == 1:
                noise = torch.randn((len(metas), *shape), generator=generator).repeat_interleave(trunks, 0)
            else:
                noise = torch.randn((len(roots), *shape), generator=generator)
            noise = start_latents(noise, self.sigmas[0])  # the state at the first time (noise itself at sigma 1)
            steps = list(p.steps) or list(range(sampling.num_steps - 1))
            velocity = self.velocity(table)
            with self.policy.autocast():
                pr = sample_probes(
                    velocity,
                    noise.to(self.device),
                    table.rows(roots).to(self.device),
                    roots.to(self.device),
                    self.sigmas.to(self.device),
                    self.trunk_plan(steps),
                    Probes(
                        steps,
                        self.children(),
                        sampling.kernel,
                        sampling.noise_level,
                        p.granularities,
                        self.INCLUDE_START,
                    ),
                    generator=generator,
                    ode_velocity_fn=self.ode_velocity(velocity),
                )
            ro = pr.rollout
            return ProbeSamples(self.method.decode(pr.final), roots[pr.root.cpu()], self.nfe(ro), ro, table, pr)

    def advantages(self, samples: ProbeSamples, rewards: Rewards):
        """Process advantages of this process's own probes (:meth:`process_advantages`), summed per transition
        over granularities (G2RPO's sum) and clipped to ``+-train.adv_clip_max``."""
        pr, clip = samples.probes, self.cfg.train.adv_clip_max
        ro = pr.rollout
        adv_p = self.process_advantages(pr, rewards.local.total, samples.image_prompt)
        adv = sum_by_node(adv_p, pr.node.cpu(), len(ro)).clamp(-clip, clip)
        keep = ro.trained.cpu() & (adv != 0)
        return (
            adv.to(self.device),
            keep.to(self.device),
            {
                "advantage/abs_mean": adv_p.abs().mean().item(),
                "advantage/zero_frac": (adv_p == 0).float().mean().item(),
            },
        )


@register_shape("tempflow", "TempFlow-GRPO probes, sampling.probe")
class TempFlowShape(ProbeShape):
    """TempFlow-GRPO: ``group_size`` ODE trunks per prompt, each with ``probe.children`` SDE children per probe step;
    process rewards z-scored per (prompt or trunk, step)."""

    def children(self) -> int:
        return self.cfg.sampling.probe.children

    def process_advantages(self, probes, rewards, image_prompt):
        p = self.cfg.sampling.probe
        group = probes.root.cpu() if p.adv_group == "seed" else image_prompt
        return process_advantages(
            rewards, group, probes.step.cpu(), probes.granularity.cpu(), self.cfg.train.adv_clip_max
        )


@register_shape("g2rpo", "G2RPO probes, sampling.probe")
class G2RPOShape(ProbeShape):
    """G2RPO: one shared ODE anchor per prompt whose group is the ``group_size`` SDE children of each probe step,
    completed at every ODE granularity; process rewards z-scored per (prompt, step, granularity)."""

    def trunks(self) -> int:
        return 1

    def children(self) -> int:
        return self.cfg.sampling.group_size

    def process_advantages(self, probes, rewards, image_prompt):
        return process_advantages(
            rewards, image_prompt, probes.step.cpu(), probes.granularity.cpu(), self.cfg.train.adv_clip_max
        )


@register_shape("tp_grpo", "TP-GRPO probes, sampling.probe")
class TPGRPOShape(ProbeShape):
    """TP-GRPO: ``group_size`` trunks per prompt, each an SDE trajectory on the probe steps, probed after every SDE
    step (and ``R_0`` from a pure ODE run); turning-point step rewards z-scored per (prompt, step)."""

    INCLUDE_START = True

    @classmethod
    def check_config(cls, cfg) -> None:
        super().check_config(cfg)
        check(
            len(cfg.sampling.probe.granularities) == 1,
            "sampling.probe.granularities",
            "one stride for tp_grpo (one ODE completion per SDE step)",
            cfg.sampling.probe.granularities,
        )

    def children(self) -> int:
        return 0

    def trunk_plan(self, steps: list[int]) -> StepPlan:
        sampling = self.cfg.sampling
        return StepPlan.window(sampling.num_steps, steps, sampling.kernel, sampling.noise_level)

    def process_advantages(self, probes, rewards, image_prompt):
        step, root = probes.step.cpu(), probes.root.cpu()
        probe_steps = sorted(set(step.tolist()))  # [-1, steps...]
        returns = torch.zeros(int(root.max()) + 1, len(probe_steps))
        returns[root, torch.tensor([probe_steps.index(k) for k in step.tolist()])] = rewards.float()
        step_rewards = turning_point_rewards(returns, self.cfg.sampling.probe.balance)  # (R, n)
        later = step >= 0
        values = step_rewards[root[later], torch.tensor([probe_steps.index(k) - 1 for k in step[later].tolist()])]
        adv_p = torch.zeros_like(rewards, dtype=torch.float32)
        adv_p[later] = process_advantages(
            values, image_prompt[later], step[later], torch.ones_like(step[later]), self.cfg.train.adv_clip_max
        )
        return adv_p
