"""The contract of a rollout shape of the GRPO family, the registry ``sampling.shape`` names, and the parts the shapes
share (the step plan, the deterministic steps' precision, DanceGRPO's step subset).

A rollout shape is how a group's stochastic transitions are drawn and how their rewards become per-transition
advantages: flat groups with an optional MixGRPO window (``flat``), BranchGRPO trees (``tree``), the single-step
branching of TempFlow-GRPO, G2RPO and TP-GRPO (``tempflow``, ``g2rpo``, ``tp_grpo``). Most papers of the field are
one of these: a new one is a new :class:`RolloutShape` subclass registered with :func:`register_shape`, with its
settings (a dataclass) beside it; the GRPO update (:class:`flowrl.methods.grpo.GRPO`) is shared.
"""

from __future__ import annotations

import math

import torch

from ...samplers import StepPlan
from ..base import Rewards, SDESamples, register_in

SHAPES: dict[str, type[RolloutShape]] = {}
"""``sampling.shape`` -> the rollout shape class (:func:`register_shape`)."""


def register_shape(name: str, summary: str = ""):
    """Class decorator: register a :class:`RolloutShape` subclass as ``sampling.shape: NAME`` (sets its ``name``, and
    its ``summary``: the few words ``sampling.shape``'s help shows beside the name).

    Raises:
        ValueError: `name` is registered already.
    """
    return register_in(SHAPES, "rollout shape", name, summary)


class RolloutShape:
    """One rollout shape: :meth:`rollout` draws an iteration's groups of stochastic transitions, :meth:`advantages`
    turns their rewards into per-transition advantages.

    Args:
        method (:class:`flowrl.methods.grpo.GRPO`): the method using the shape; its config, model, policy, schedule
            (``method.sigmas``), chunked velocity and decoding are the shape's.
    """

    name = ""

    @classmethod
    def check_config(cls, cfg) -> None:
        """Refuse ``sampling.*`` values this shape cannot run, naming the key (:class:`flowrl.config.ConfigError`);
        called when the config is built. Default: the other shapes' settings must be left unset."""

    def __init__(self, method):
        self.method, self.cfg, self.model, self.policy = method, method.cfg, method.model, method.policy
        self.device, self.sigmas = method.device, method.sigmas

    def rollout(self, metas: list[dict], generator: torch.Generator) -> SDESamples:
        """This iteration's groups for the prompt records `metas` from the current policy."""
        raise NotImplementedError

    @classmethod
    def chunked_rollout(cls, cfg) -> bool:
        """Whether the shape, under `cfg`, has :meth:`rollout_in_chunks`. Default: no."""
        return False

    def rollout_in_chunks(self, metas: list[dict], generator: torch.Generator, size: int, on_chunk) -> SDESamples:
        """:meth:`rollout` a chunk of `size` images at a time, as :meth:`flowrl.methods.base.Method.rollout_in_chunks`
        describes."""
        raise NotImplementedError

    def advantages(self, samples: SDESamples, rewards: Rewards) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """``(advantages (M,) float32, keep (M,) bool, stats)`` of the `M` stored transitions of `samples`."""
        raise NotImplementedError

    def end_iteration(self, stats: dict) -> None:
        """Called once per iteration after the update (a sliding window moves here)."""

    def state_dict(self) -> dict:
        """The shape's state for a checkpoint (JSON)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s output."""

    # ------------------------------------------------------------------------------ shared parts
    def sde_plan(self) -> StepPlan:
        """Every step ``sampling.kernel`` at ``sampling.noise_level`` (all but the last trained, unless
        ``sampling.train_last_step``)."""
        sampling = self.cfg.sampling
        return StepPlan.sde(
            sampling.num_steps,
            kernel=sampling.kernel,
            noise_level=sampling.noise_level,
            train_last=sampling.train_last_step,
        )

    def only_trainable(self, sigmas: torch.Tensor, plan: StepPlan) -> StepPlan:
        """``plan`` on the grid ``sigmas`` (``(N + 1,)``) with its steps that run a frozen network untrained
        (:meth:`FlowModel.trainable_times`: a two-expert Wan 2.2's other expert); ``plan`` itself for every other
        model."""
        mask = self.model.trainable_times(sigmas[:-1])
        if mask is None:
            return plan
        return StepPlan(plan.kernels, plan.noise_levels, [t and bool(m) for t, m in zip(plan.trained, mask.tolist())])

    def velocity(self, table):
        """The old policy over `table`, guided at ``sampling.guidance_scale``, in chunks of ``sampling.batch_size``."""
        sampling = self.cfg.sampling
        return self.method.chunked(self.model.velocity_fn(table, sampling.guidance_scale), sampling.batch_size)

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

    def nfe(self, rollout) -> int:
        """Transformer rows of `rollout` (CFG counted twice)."""
        return rollout.cost["nfe"] * self.model.cfg_rows(self.cfg.sampling.guidance_scale)


def step_subset(rollout, fraction: float, generator: torch.Generator) -> torch.Tensor:
    """DanceGRPO's ``timestep_fraction`` (arXiv 2505.07818): for each leaf of `rollout`, a random ``ceil(fraction *
    S)`` of its ``S`` trained steps, drawn from `generator`. Returns a `(M,)` bool mask (CPU)."""
    trained = rollout.trained.cpu()
    score = torch.rand(len(rollout), generator=generator)  # random order of the steps within each leaf
    score = torch.where(trained, score, torch.full_like(score, 2.0))
    keep = torch.zeros(len(rollout), dtype=torch.bool)
    leaf = rollout.leaf.cpu()
    for b in leaf.unique().tolist():
        rows = (leaf == b).nonzero().squeeze(1)
        take = math.ceil(fraction * int(trained[rows].sum()))
        keep[rows[torch.argsort(score[rows])[:take]]] = True
    return keep & trained
