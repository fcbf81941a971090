"""AWM, Advantage Weighted Matching (Xue et al., arXiv 2509.25050; scxue/advantage_weighted_matching
``scripts/train_sd3_awm.py`` and ``config/dgx_awm.py``, commit be51372).

Policy gradient on the forward process: the samples may come from any sampler (no log-probs are recorded); each is
noised at ``train.awm.timesteps`` stratified times ``t`` of the sampler's grid with fresh noise, and the flow-matching
error of the policy's velocity stands for the sample's log-likelihood::

    logp_theta = -(t / p) ((e + 1e-10)^p - 1e-10^p),    e = mean_d (v_theta(x_t, t) - (eps - x0))^2     ('ghuber', p)
    r = exp(logp_theta - logp_old);   loss = mean max(-A r, -A clip(r, 1 - eps_c, 1 + eps_c))
           + kl_beta mean (v_theta - v_ref)^2 + ema_beta mean (v_theta - v_ema)^2

with ``A`` the group z-score, clipped and scaled by ``train.awm.advantage_scale`` (the official 1/5), ``logp_old`` the
policy's before the iteration's first optimizer step (the ratio is exactly 1 there; the official code takes one
optimizer step per iteration, where it always is), ``v_ref`` the base (the LoRA disabled) and ``v_ema`` a soft-updated
copy of the policy, ``ema <- d ema + (1 - d) theta`` after every iteration with ``d = min(ema_decay, ema_ramp * optimizer
steps)`` (the official 0.3 and 0.001).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..fields import check, config_section, setting
from ..losses import ppo_loss
from .base import FinalSamples, Rewards, register_method
from .forward import ForwardProcess, flow_matching_error


@config_section("train", "awm", "AWM's settings (train.method awm)")
@dataclass
class AWMConfig:
    """``train.awm.*``: Advantage Weighted Matching (``train.method: awm``)."""

    timesteps: int = setting(6, "noise times per sample and iteration, one per stratum of the grid (official 6)")
    max_fraction: float = setting(0.9, "times drawn from grid steps 1 .. int(max_fraction * num_steps) (official 0.9)")
    power: float = setting(0.25, "p of the 'ghuber' weighting of the flow-matching error (official 0.25)")
    clip_range: float = setting(1.0, "PPO clip range on the ratio (official 1)")
    advantage_scale: float = setting(0.2, "advantages times this after clipping (official 1/5)")
    kl_beta: float = setting(0.001, "weight of the velocity KL to the base (official GenEval 0.001)")
    ema_beta: float = setting(1.0, "weight of the velocity KL to the soft-updated copy of the policy (official 1)")
    ema_decay: float = setting(0.3, "the copy's largest decay d (official 0.3)")
    ema_ramp: float = setting(0.001, "d grows by this per optimizer step up to ema_decay (official 0.001)")
    guidance_scale: float = setting(1.0, "CFG of the trained velocity (1: the conditional velocity, as the official)")

    def __post_init__(self):
        check(self.timesteps >= 1, "train.awm.timesteps", ">= 1", self.timesteps)
        check(0 < self.max_fraction <= 1, "train.awm.max_fraction", "in (0, 1]", self.max_fraction)
        check(self.power > 0, "train.awm.power", "> 0", self.power)
        check(self.clip_range > 0, "train.awm.clip_range", "> 0", self.clip_range)
        check(self.advantage_scale > 0, "train.awm.advantage_scale", "> 0", self.advantage_scale)
        check(
            self.kl_beta >= 0 and self.ema_beta >= 0,
            "train.awm.kl_beta / ema_beta",
            ">= 0",
            (self.kl_beta, self.ema_beta),
        )
        check(0 <= self.ema_decay < 1, "train.awm.ema_decay", "in [0, 1)", self.ema_decay)
        check(self.ema_ramp >= 0, "train.awm.ema_ramp", ">= 0", self.ema_ramp)
        check(self.guidance_scale >= 1, "train.awm.guidance_scale", ">= 1", self.guidance_scale)


def awm_log_likelihood(err: torch.Tensor, times: torch.Tensor, power: float) -> torch.Tensor:
    """AWM's log-likelihood surrogate with the 'ghuber' weighting: ``-(t / p) ((err + 1e-10)^p - 1e-10^p)`` per row,
    computed in float64 as the official code (returned float32, or float64 for a float64 `err`). err, times: `(N,)`;
    power: p > 0."""
    e, t = err.double(), times.double()
    out = -(t / power) * ((e + 1e-10) ** power - 1e-10**power)
    return out if err.dtype == torch.float64 else out.float()


@register_method("awm", "advantage-weighted flow matching")
class AWM(ForwardProcess):
    """``train.method: awm`` (module docstring). Needs a LoRA when ``train.awm.kl_beta > 0`` (the base reference).

    Args: as :class:`flowrl.methods.base.Method`.
    """

    EMA_FILE = "awm_ema.safetensors"  # the soft-updated copy of the policy, in each checkpoint
    lockstep = True  # the old, base and EMA forwards padded, sample 0 standing in where a process keeps none

    snapshot_origin = "by train.method awm with train.awm.ema_beta > 0"

    @classmethod
    def check_config(cls, cfg) -> None:
        cls.check_final_samples(cfg)
        cls.check_base_reference(cfg, "train.awm.kl_beta", cfg.train.awm.kl_beta)

    def __init__(self, cfg, model, policy, rewards):
        super().__init__(cfg, model, policy, rewards)
        self.ema = policy.copy() if cfg.train.awm.ema_beta > 0 else None

    def advantages(self, samples: FinalSamples, rewards: Rewards, generator: torch.Generator):
        adv, keep, stats = super().advantages(samples, rewards, generator)
        return adv * self.cfg.train.awm.advantage_scale, keep, stats

    def stratified_times(self, generator: torch.Generator) -> torch.Tensor:
        """``train.awm.timesteps`` times of the sampler's grid, one uniformly from each of as many strata of the steps
        ``1 .. int(max_fraction * num_steps)`` (the official ``discrete_wo_init``), shared by every sample."""
        a = self.cfg.train.awm
        last = max(2, int(len(self.sigmas[:-1]) * a.max_fraction))
        edges = torch.linspace(1, last, a.timesteps + 1).long()  # (K + 1,)
        u = torch.rand(a.timesteps, generator=generator)
        steps = edges[:-1] + (u * (edges[1:] - edges[:-1]).float()).long()
        return self.sigmas[steps.clamp(max=len(self.sigmas) - 2)].to(self.device)  # (K,)

    def update(self, samples: FinalSamples, adv: torch.Tensor, keep: torch.Tensor, generator: torch.Generator) -> dict:
        """AWM's optimizer steps on the kept samples (module docstring); returns ``policy/loss``, ``policy/kl``,
        ``policy/kl_ema``, ``policy/ratio_first_max_dev`` and the PPO statistics, ``policy/optimizer_steps``, ``cost/*``."""
        a, model = self.cfg.train.awm, self.model
        rows, real = self.stand_in(keep.nonzero().squeeze(1))  # in lockstep sample 0 stands in for none kept
        times = self.stratified_times(generator)  # (K,)
        r = rows.repeat(len(times)).to(self.device)  # (N,) every kept sample at every time
        count = len(r) if real else 0
        t = times.repeat_interleave(len(rows))
        x0, cond, adv_n = samples.x0[r], samples.cond[r], adv.to(self.device)[r]
        x_t, eps = self.noised(x0, t, generator)  # a fresh noise per (time, sample)
        velocity = model.velocity_fn(samples.table, a.guidance_scale)
        chunked = self.chunked(velocity, pad=True)
        with torch.no_grad(), self.policy.autocast():
            old = awm_log_likelihood(flow_matching_error(chunked(x_t, t, cond), x0, eps), t, a.power) if len(r) else t
            v_ref = None
            if a.kl_beta > 0 and len(r):
                with model.reference():
                    v_ref = chunked(x_t, t, cond)
            v_ema = None
            if self.ema is not None and len(r):
                with self.policy.holding(self.ema):
                    v_ema = chunked(x_t, t, cond)

        def micro_loss(idx, stats, at):
            with self.policy.autocast():
                v = velocity(x_t[idx], t[idx], cond[idx])
            logp = awm_log_likelihood(flow_matching_error(v, x0[idx], eps[idx]), t[idx], a.power)
            loss, st = ppo_loss(logp, old[idx], adv_n[idx], a.clip_range)
            if v_ref is not None:
                kl = (v.float() - v_ref[idx].float()).pow(2).flatten(1).mean(dim=1).mean()
                loss = loss + a.kl_beta * kl
                stats["policy/kl"].append(kl.item())
            if v_ema is not None:
                kl_ema = (v.float() - v_ema[idx].float()).pow(2).flatten(1).mean(dim=1).mean()
                loss = loss + a.ema_beta * kl_ema
                stats["policy/kl_ema"].append(kl_ema.item())
            if at.step == 1:
                stats["policy/ratio_first_max_dev"].append(st["policy/ratio_max_dev"].item())
            for key in ("policy/ratio_mean", "policy/clipfrac"):
                stats[key].append(st[key].item())
            return loss

        stats, steps = self.optimizer_steps(count, generator, micro_loss)
        passes = 2 + int(v_ref is not None) + int(v_ema is not None)  # the old policy's, the trained, ref and EMA rows
        return self.update_metrics(stats, steps, count, passes * count * model.cfg_rows(a.guidance_scale))

    def end_iteration(self, stats: dict) -> None:
        """The EMA copy's soft update (records ``policy/ema_decay``)."""
        if self.ema is None:
            return
        a = self.cfg.train.awm
        stats["policy/ema_decay"] = min(a.ema_decay, a.ema_ramp * self.policy.steps_taken())
        self.policy.move_towards(self.ema, stats["policy/ema_decay"])

    @classmethod
    def held_copies(cls, cfg) -> int:
        """The soft-updated copy, when ``train.awm.ema_beta > 0``."""
        return int(cfg.train.awm.ema_beta > 0)

    def snapshots(self) -> dict:
        """The soft-updated copy (:data:`EMA_FILE`), when ``train.awm.ema_beta > 0``."""
        return {self.EMA_FILE: self.ema} if self.ema is not None else {}
