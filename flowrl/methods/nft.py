"""DiffusionNFT (arXiv 2509.16117): online RL on the forward process.

G deterministic samples per prompt, group-relative advantages turned into optimality weights, and the
negative-aware flow-matching loss on noised copies of the samples: no log-probs and no trajectories.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..fields import check, config_section, setting
from ..losses import nft_loss, optimality_weights
from .base import FinalSamples, Rewards, register_method
from .forward import ForwardProcess


@config_section("train", "nft", "DiffusionNFT's settings (train.method nft)")
@dataclass
class NFTConfig:
    """``train.nft.*``: DiffusionNFT (arXiv 2509.16117), used when ``train.method`` is ``nft``."""

    beta: float = setting(1.0, "step of the implicit positive / negative policies (the paper's GenEval setting)")
    timesteps: int = setting(4, "noised copies of each image per iteration, at times of the sampler's grid")
    old_decay: float = setting(
        0.0, "soft update of the sampling policy, theta_old <- d theta_old + (1 - d) theta (0: it follows theta)"
    )
    min_time: float = setting(
        0.0, "noised copies only at grid times t >= min_time (1 = noise): weights training towards layout"
    )
    guidance_scale: float | None = setting(
        None,
        "CFG of the trained velocity (null: sampling.guidance_scale); 1 with "
        "guided sampling trains the conditional velocity off-policy",
    )
    keep_flat_groups: bool = setting(
        False, "also train groups without reward variance, at r = 1/2 (the published code's); false drops them"
    )
    solver: str = setting(
        "euler", "the deterministic rollout sampler: euler | dpm_solver_2m (the published code's, DPM-Solver++ 2M)"
    )
    decay_ramp: float = setting(
        0.0,
        "> 0: the soft update's decay is min(decay_ramp * optimizer steps so far, "
        "old_decay) (the published code's 0.001)",
    )

    def __post_init__(self):
        check(self.beta > 0, "train.nft.beta", "> 0", self.beta)
        check(self.timesteps >= 1, "train.nft.timesteps", ">= 1", self.timesteps)
        check(0 <= self.old_decay < 1, "train.nft.old_decay", "in [0, 1)", self.old_decay)
        check(0 <= self.min_time < 1, "train.nft.min_time", "in [0, 1)", self.min_time)
        check(
            self.guidance_scale is None or self.guidance_scale >= 1,
            "train.nft.guidance_scale",
            ">= 1 or null",
            self.guidance_scale,
        )
        check(self.decay_ramp >= 0, "train.nft.decay_ramp", ">= 0", self.decay_ramp)
        check(self.solver in ("euler", "dpm_solver_2m"), "train.nft.solver", "euler|dpm_solver_2m", self.solver)


@register_method("nft", "ODE samples, DiffusionNFT's forward-process loss")
class DiffusionNFT(ForwardProcess):
    """``train.method: nft`` (arXiv 2509.16117, Algorithm 1): sample, score, train on the forward process.

    ``sampling.group_size`` deterministic samples (``sampling.num_steps`` steps of Euler, or of DPM-Solver++ 2M
    with ``train.nft.solver``, the published code's; CFG at ``sampling.guidance_scale``) of each of
    ``sampling.prompts_per_iteration`` prompts are drawn by the old policy (the current one, or with
    ``train.nft.old_decay > 0`` its soft-updated copy) and scored; the group-relative advantages (gathered over
    processes, as in GRPO) become optimality weights ``r = clip(A / A_max) / 2 + 1/2``
    (:func:`losses.optimality_weights`). Every image of a group with reward variance (with
    ``train.nft.keep_flat_groups`` every image, a flat group's at ``r = 1/2``, as the published code) is noised
    ``train.nft.timesteps`` times, ``x_t = (1 - t) x0 + t eps`` with ``t`` drawn uniformly from the sampler's grid
    times ``>= train.nft.min_time`` (1 = noise), and the velocity at CFG ``train.nft.guidance_scale`` (by default
    the sampling guidance; 1: the conditional velocity alone, trained off-policy on guided samples) is trained on
    them with :func:`losses.nft_loss`, under ``run.mixed_precision`` (no ratio needs float32 here). Then
    ``theta_old <- d theta_old + (1 - d) theta`` (:meth:`old_decay`).

    Args: as :class:`flowrl.methods.base.Method`.
    """

    OLD_POLICY_FILE = "old_policy.safetensors"  # the soft-updated sampling policy, in each checkpoint
    lockstep = True  # the old policy's forwards padded, sample 0 standing in where a process keeps none

    def __init__(self, cfg, model, policy, rewards):
        super().__init__(cfg, model, policy, rewards)
        self.old_policy = policy.copy() if cfg.train.nft.old_decay > 0 else None

    @classmethod
    def check_config(cls, cfg) -> None:
        """DiffusionNFT samples plain ODE groups: no rollout shape but ``flat`` without a window, no shared noise, no
        KL (it trains on final samples)."""
        s = cfg.sampling
        for key, value, off in (
            ("sampling.shape", s.shape, "flat"),
            ("sampling.window.size", s.window.size, 0),
            ("sampling.shared_noise", s.shared_noise, False),
            ("train.kl_beta", cfg.train.kl_beta, 0.0),
        ):
            check(value == off, key, f"{off!r} with train.method 'nft' (it trains on final samples)", value)
        check(
            not (cfg.train.nft.keep_flat_groups and cfg.train.best_of_n),
            "train.nft.keep_flat_groups",
            "false with train.best_of_n (which drops samples)",
            cfg.train.nft.keep_flat_groups,
        )

    def sampling_weights(self) -> dict[str, torch.Tensor] | None:
        return self.old_policy

    # ------------------------------------------------------------------------------ the contract
    def solver(self) -> str:
        """Euler, or ``train.nft.solver``'s DPM-Solver++ 2M (the published code's)."""
        return "ode" if self.cfg.train.nft.solver == "euler" else self.cfg.train.nft.solver

    def advantages(self, samples: FinalSamples, rewards: Rewards, generator: torch.Generator):
        """Group z-scores over every process's images; this process's share, ``(adv (B,), keep (B,) bool, stats)``;
        with ``train.nft.keep_flat_groups`` every image is kept (a flat group's r = 1/2 pulls towards the old policy)."""
        adv, keep, stats = super().advantages(samples, rewards, generator)
        return adv, torch.ones_like(keep) if self.cfg.train.nft.keep_flat_groups else keep, stats

    def update(self, samples: FinalSamples, adv: torch.Tensor, keep: torch.Tensor, generator: torch.Generator) -> dict:
        """Noise the kept samples, compute the old policy's velocity on them and train (:meth:`optimize`).

        Returns:
            ``policy/loss``, ``policy/grad_norm``, ``policy/optimizer_steps``, ``cost/trained_transitions`` (noised
            rows x epochs) and ``cost/nfe`` (the old policy's rows of the loss, twice under CFG).
        """
        train, model = self.cfg.train, self.model
        x0, cond, table = samples.x0, samples.cond, samples.table
        kept, real = self.stand_in(keep.nonzero().squeeze(1))  # in lockstep sample 0 stands in for none kept
        rows = kept.repeat_interleave(train.nft.timesteps)  # (N,) noised copies per kept image
        count = len(rows) if real else 0
        times = self.grid_times(len(rows), generator, train.nft.min_time)  # the sampler's own times, in (0, 1]
        x_0, c = x0[rows.to(self.device)], cond[rows.to(self.device)]
        x_t, _ = self.noised(x_0, times, generator)
        r = optimality_weights(adv[rows], train.adv_clip_max).to(self.device)
        trained_scale = (
            self.cfg.sampling.guidance_scale if train.nft.guidance_scale is None else train.nft.guidance_scale
        )
        trained = model.velocity_fn(table, trained_scale)
        with torch.no_grad(), self.policy.holding(self.old_policy), self.policy.autocast():
            v_old = self.chunked(trained, pad=True)(x_t, times, c) if len(rows) else x_t
        stats = self.optimize(trained, x_t, times, c, x_0, v_old, r, generator, count)
        stats["cost/nfe"] = count * model.cfg_rows(trained_scale)
        stats["cost/trained_transitions"] = count * train.inner_epochs
        return stats

    def end_iteration(self, stats: dict) -> None:
        """The old policy's soft update (records ``policy/old_decay``)."""
        if self.old_policy is not None:
            stats["policy/old_decay"] = self.old_decay()
            self.policy.move_towards(self.old_policy, stats["policy/old_decay"])

    snapshot_origin = "with train.nft.old_decay > 0, which this run sets"

    @classmethod
    def held_copies(cls, cfg) -> int:
        """The old policy, when ``train.nft.old_decay > 0``."""
        return int(cfg.train.nft.old_decay > 0)

    def snapshots(self) -> dict:
        """The soft-updated old (sampling) policy (:data:`OLD_POLICY_FILE`), when ``train.nft.old_decay > 0``."""
        return {self.OLD_POLICY_FILE: self.old_policy} if self.old_policy is not None else {}

    # ------------------------------------------------------------------------------ the parts
    def old_decay(self) -> float:
        """The soft update's decay in [0, 1): ``train.nft.old_decay``, or with ``train.nft.decay_ramp`` ``min(ramp *
        optimizer steps so far, old_decay)`` (the published code ramps 0.001 per step up to 0.5 for GenEval)."""
        nft = self.cfg.train.nft
        if nft.decay_ramp == 0:
            return nft.old_decay
        return min(nft.decay_ramp * self.policy.steps_taken(), nft.old_decay)

    def optimize(
        self,
        velocity,
        x_t: torch.Tensor,
        times: torch.Tensor,
        cond: torch.Tensor,
        x_0: torch.Tensor,
        v_old: torch.Tensor,
        r: torch.Tensor,
        generator: torch.Generator,
        count: int | None = None,
    ) -> dict[str, float]:
        """DiffusionNFT's optimizer steps (arXiv 2509.16117, Eq. 8: :func:`losses.nft_loss`) on `N` noised rows:
        ``train.inner_epochs`` passes of minibatches (:meth:`flowrl.policy.Policy.minibatches`, micro-batched).

        Args:
            velocity: the policy at the trained guidance (:meth:`FlowModel.velocity_fn`), trained here.
            x_t, x_0, v_old (`torch.Tensor` of shape `(N, *latent_shape)`): noised rows, their clean samples, and
                the old policy's velocity at them.
            times (`torch.Tensor` of shape `(N,)`, float32 in (0, 1]): the rows' noise times; cond `(N,)` long
                their prompt rows; r `(N,)` float32 in [0, 1] their optimality weights.
            generator: the iteration's generator (minibatch order).
            count (`int`): the rows that enter the loss, the first `count` (default all `N`; 0 where the rows are
                only a stand-in for the padding micro-batches: :meth:`ForwardProcess.stand_in`).

        Returns:
            ``policy/loss`` and ``policy/grad_norm`` (means over steps) and ``policy/optimizer_steps``.
        """
        train = self.cfg.train

        def micro_loss(idx, stats, at):
            with self.policy.autocast():
                v = velocity(x_t[idx], times[idx], cond[idx])
            return nft_loss(v, v_old[idx], x_t[idx], x_0[idx], times[idx], r[idx], train.nft.beta, train.adv_clip_max)

        stats, steps = self.optimizer_steps(len(x_t) if count is None else count, generator, micro_loss)
        return self.update_metrics(stats, steps)
