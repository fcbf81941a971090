"""CRD, Centered Reward Distillation (arXiv 2603.14128; X-GenGroup/Flow-Factory ``src/flow_factory/trainers/crd.py`` and
``hparams`` ``CRDTrainingArguments``, commit 396dd6e).

``sampling.group_size`` deterministic samples per prompt drawn by a *sampler* copy of the policy, group-relative
advantages ``A``, and a regression of the policy's implicit reward onto them. Each clean sample ``x0`` is noised at
``train.crd.timesteps`` times of the sampler's grid with fresh noise; with the target ``u = eps - x0`` and per-row
adaptive weights ``w = max(mean_d |v - u|, 1e-5)`` (held fixed), the implicit reward of the policy against an *old*
copy is::

    r_i = -mean_d [ (v_theta - u)^2 / w_theta - (v_old - u)^2 / w_old ]          (0 while the policy is the old copy)
    a_i = clamp(clamp(A_i, -c, c) / c / 2 + 1/2, 0, 1)                          (c = train.adv_clip_max)
    loss = (c / beta) mean_i ( beta (r_i - mean_g r) - (a_i - mean_g a) )^2       (mean_g r held fixed)
           + kl_beta mean_i (m + a_i (1 - m)) mean_d (v_theta - v_ref)^2,         m = 1e-4 / kl_beta

with ``mean_g`` the mean over the sample's group at the same draw of times, ``v_ref`` the base (the LoRA disabled) with
CFG ``train.crd.kl_guidance_scale`` against the empty prompt: the reward-adaptive KL holds high-reward samples closer
to the guided base. The old and sampler copies move towards the policy after every iteration,
``copy <- d copy + (1 - d) theta``, with ``d = min(d0 + slope (n - n0), d_max)`` after ``n0`` optimizer steps (``d0``
before), from ``train.crd.old_decay`` and ``sampler_decay`` (``[n0, d0, slope, d_max]``; ``d = 0`` copies).

Deviations from the official code: the centring is over each group (the official centres over the gathered
micro-batch, which is a group where a micro-batch holds one group); the times are distinct steps of flowrl's grid per
sample; the official's ``bce`` loss and softmax-temperature centring (off by default there) are not built.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..fields import check, config_section, setting
from .base import FinalSamples, register_method
from .forward import ForwardProcess


def decay_at(schedule: list[float], step: int) -> float:
    """The decay of a ``[start_step, start_value, slope, end_value]`` schedule after `step` optimizer steps:
    ``start_value`` before ``start_step``, then ``min(start_value + (step - start_step) slope, end_value)``."""
    start, value, slope, end = schedule
    return value if step < start else min(value + (step - start) * slope, end)


def _schedule_check(key: str, value) -> None:
    ok = isinstance(value, (list, tuple)) and len(value) == 4
    ok = ok and value[0] >= 0 and 0 <= value[1] <= 1 and value[2] >= 0 and 0 <= value[3] <= 1
    check(ok, key, "[start_step >= 0, start_value in [0, 1], slope >= 0, end_value in [0, 1]]", value)


@config_section("train", "crd", "CRD's settings (train.method crd)")
@dataclass
class CRDConfig:
    """``train.crd.*``: Centered Reward Distillation (``train.method: crd``)."""

    beta: float = setting(1.0, "beta of the implicit reward (official crd_beta 1)")
    timesteps: int = setting(0, "noise times per sample and iteration (0: int(0.99 * sampling.num_steps), official)")
    kl_beta: float = setting(0.1, "weight of the reward-adaptive velocity KL to the guided base (official 0.1)")
    kl_guidance_scale: float = setting(4.5, "CFG of the base in the KL (official kl_cfg 4.5; 1: no CFG)")
    old_decay: list[float] = setting(
        factory=lambda: [0, 0.25, 0.005, 0.999],
        help="the old copy's decay schedule [start_step, start_value, slope, end_value] (official 0-0.25-0.005-0.999)",
    )
    sampler_decay: list[float] = setting(
        factory=lambda: [75, 0.0, 0.0075, 0.999],
        help="the sampler copy's decay schedule (official 75-0.0-0.0075-0.999: on-policy for 75 optimizer steps)",
    )
    guidance_scale: float = setting(1.0, "CFG of the trained velocity (1: the conditional velocity, as the official)")

    def __post_init__(self):
        check(self.beta > 0, "train.crd.beta", "> 0", self.beta)
        check(self.timesteps >= 0, "train.crd.timesteps", ">= 0", self.timesteps)
        check(self.kl_beta >= 0, "train.crd.kl_beta", ">= 0", self.kl_beta)
        check(self.kl_guidance_scale >= 1, "train.crd.kl_guidance_scale", ">= 1", self.kl_guidance_scale)
        check(self.guidance_scale >= 1, "train.crd.guidance_scale", ">= 1", self.guidance_scale)
        _schedule_check("train.crd.old_decay", self.old_decay)
        _schedule_check("train.crd.sampler_decay", self.sampler_decay)
        self.old_decay, self.sampler_decay = [float(x) for x in self.old_decay], [float(x) for x in self.sampler_decay]


def implicit_reward(v: torch.Tensor, v_old: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """CRD's implicit reward per row, ``-mean_d [(v - u)^2 / w - (v_old - u)^2 / w_old]`` with the adaptive weights
    ``w = max(mean_d |v - u|, 1e-5)`` computed in float64 and held fixed (module docstring).

    Args:
        v, v_old, target (`torch.Tensor` of shape `(N, *latent_shape)`): the policy's and the old copy's velocities
            and the flow-matching target ``eps - x0``.

    Returns:
        `torch.Tensor` of shape `(N,)`, float32 (float64 for float64 inputs), with `v`'s gradient.
    """
    dtype = torch.promote_types(v.dtype, torch.float32)
    v, v_old, target = v.to(dtype), v_old.to(dtype), target.to(dtype)
    with torch.no_grad():
        w = (v.double() - target.double()).abs().flatten(1).mean(1).clamp(min=1e-5).to(dtype)
        w_old = (v_old.double() - target.double()).abs().flatten(1).mean(1).clamp(min=1e-5).to(dtype)
    err = (v - target).pow(2).flatten(1).mean(1)
    err_old = (v_old - target).pow(2).flatten(1).mean(1)
    return -(err / w - err_old / w_old)


def crd_loss(
    r: torch.Tensor, adv: torch.Tensor, unit: torch.Tensor, beta: float, clip: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """CRD's centred regression (module docstring) over rows grouped in `unit` ids.

    Args:
        r (`torch.Tensor` of shape `(N,)`): implicit rewards (with gradient).
        adv (`torch.Tensor` of shape `(N,)`): group-relative advantages (unitless).
        unit (`torch.Tensor` of shape `(N,)`, long): the (group, draw of times) each row belongs to: the centring sets.
        beta (`float`): beta > 0. clip (`float`): the advantage clip ``c`` > 0.

    Returns:
        ``(loss, a)``: the scalar loss ``(c / beta) mean_i (beta (r_i - mean r) - (a_i - mean a))^2`` and the
        normalised advantages ``a`` `(N,)` in [0, 1].
    """
    a = ((adv.clamp(-clip, clip) / clip) / 2 + 0.5).clamp(0, 1)
    ids, inverse = torch.unique(unit, return_inverse=True)
    count = torch.zeros(len(ids), dtype=r.dtype, device=r.device).index_add_(0, inverse, torch.ones_like(r))
    r_mean = torch.zeros_like(count).index_add_(0, inverse, r.detach()) / count
    a_mean = torch.zeros_like(count).index_add_(0, inverse, a.to(r.dtype)) / count
    diff = beta * (r - r_mean[inverse]) - (a.to(r.dtype) - a_mean[inverse])
    return diff.pow(2).mean() * clip / beta, a


@register_method("crd", "centered reward distillation")
class CRD(ForwardProcess):
    """``train.method: crd`` (module docstring). Needs a LoRA when ``train.crd.kl_beta > 0`` (the base reference).

    Args: as :class:`flowrl.methods.base.Method`.
    """

    OLD_FILE = "crd_old.safetensors"
    SAMPLER_FILE = "crd_sampler.safetensors"
    lockstep = True  # the old and base forwards padded, group 0 standing in where a process keeps none

    @classmethod
    def check_config(cls, cfg) -> None:
        cls.check_final_samples(cfg, "it trains whole groups of final samples")
        check(
            cfg.train.best_of_n == 0,
            "train.best_of_n",
            "0 with train.method 'crd' (it trains whole groups of final samples)",
            cfg.train.best_of_n,
        )
        cls.check_base_reference(cfg, "train.crd.kl_beta", cfg.train.crd.kl_beta)

    def __init__(self, cfg, model, policy, rewards):
        super().__init__(cfg, model, policy, rewards)
        self.old = policy.copy()
        self.sampler = policy.copy()

    def sampling_weights(self) -> dict[str, torch.Tensor] | None:
        return self.sampler

    def num_times(self) -> int:
        """Times per sample: ``train.crd.timesteps``, or ``int(0.99 * sampling.num_steps)`` (at least 1)."""
        c = self.cfg.train.crd
        return c.timesteps or max(1, int(0.99 * self.cfg.sampling.num_steps))

    def update(self, samples: FinalSamples, adv: torch.Tensor, keep: torch.Tensor, generator: torch.Generator) -> dict:
        """CRD's optimizer steps over (group, time) units of the kept samples; returns ``policy/loss``,
        ``policy/crd_loss``, ``policy/implicit_reward`` (mean ``r``), ``policy/implicit_reward_first_max`` (the largest
        ``|r|`` in the first optimizer step: 0 while the policy is the old copy), ``policy/kl``, ``policy/grad_norm``,
        ``policy/optimizer_steps`` and ``cost/*``."""
        c, model, g = self.cfg.train.crd, self.model, self.cfg.sampling.group_size
        rows = keep.nonzero().squeeze(1)  # (K,) whole groups
        rows = rows[torch.argsort(samples.image_prompt[rows], stable=True)]  # group by group
        first = (samples.image_prompt == samples.image_prompt[0]).nonzero().squeeze(1)  # (G,) sample 0's group
        rows, real = self.stand_in(rows, first.to(rows.device))  # in lockstep group 0 stands in for none kept
        if len(rows) % g:
            raise RuntimeError(f"CRD trains whole groups of {g} samples; {len(rows)} kept rows are not")
        k, steps = len(rows), min(self.num_times(), len(self.sigmas) - 1)
        # per sample, `steps` distinct grid steps in a random order; draw j of every sample forms the units of draw j
        order = [torch.randperm(len(self.sigmas) - 1, generator=generator)[:steps] for _ in range(k)]
        t = self.sigmas[torch.stack(order).T.reshape(-1)].to(self.device) if k else torch.zeros(0, device=self.device)
        r_idx = rows.repeat(steps).to(self.device)  # (N,) draw-major, groups contiguous within a draw
        x0, cond, a_n = samples.x0[r_idx], samples.cond[r_idx], adv.to(self.device)[r_idx]
        x_t, eps = self.noised(x0, t, generator)
        target = eps - x0
        units = len(r_idx) // g if k else 0
        count = units if real else 0  # the units that enter the loss
        velocity = model.velocity_fn(samples.table, c.guidance_scale)
        with torch.no_grad(), self.policy.autocast():
            v_old = v_ref = None
            if units:
                with self.policy.holding(self.old):
                    v_old = self.chunked(velocity, pad=True)(x_t, t, cond)
                if c.kl_beta > 0:
                    guided = model.velocity_fn(samples.table, c.kl_guidance_scale)
                    with model.reference():
                        v_ref = self.chunked(guided, pad=True)(x_t, t, cond)

        def micro_loss(u, stats, at):
            idx = (u.view(-1, 1) * g + torch.arange(g, device=u.device)).reshape(-1)  # the units' rows
            with self.policy.autocast():
                v = velocity(x_t[idx], t[idx], cond[idx])
            r = implicit_reward(v, v_old[idx], target[idx])
            loss, a = crd_loss(r, a_n[idx], idx // g, c.beta, self.cfg.train.adv_clip_max)
            stats["policy/crd_loss"].append(loss.item())
            stats["policy/implicit_reward"].append(r.mean().item())
            if at.step == 1:  # the policy is still the old copy on the first iteration's first step
                stats["policy/implicit_reward_first_max"].append(r.abs().max().item())
            if v_ref is not None:
                kl = (v.float() - v_ref[idx].float()).pow(2).flatten(1).mean(1)  # (n,)
                m = 1e-4 / c.kl_beta
                loss = loss + c.kl_beta * ((m + a.float() * (1 - m)) * kl).mean()
                stats["policy/kl"].append(kl.mean().item())
            return loss

        stats, steps = self.optimizer_steps(count, generator, micro_loss, unit=g)
        passes = 2 + (model.cfg_rows(c.kl_guidance_scale) if v_ref is not None else 0)
        return self.update_metrics(stats, steps, count * g, passes * count * g * model.cfg_rows(c.guidance_scale))

    def end_iteration(self, stats: dict) -> None:
        """Move the old and sampler copies towards the policy (records ``policy/old_decay``, ``sampling/decay``)."""
        c = self.cfg.train.crd
        n = self.policy.steps_taken()
        stats["policy/old_decay"] = decay_at(c.old_decay, n)
        stats["sampling/decay"] = decay_at(c.sampler_decay, n)
        self.policy.move_towards(self.old, stats["policy/old_decay"])
        self.policy.move_towards(self.sampler, stats["sampling/decay"])

    @classmethod
    def held_copies(cls, cfg) -> int:
        """The old and sampler copies."""
        return 2

    def snapshots(self) -> dict:
        """The old (:data:`OLD_FILE`) and sampler (:data:`SAMPLER_FILE`) copies."""
        return {self.OLD_FILE: self.old, self.SAMPLER_FILE: self.sampler}
