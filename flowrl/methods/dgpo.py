"""DGPO, Direct Group Preference Optimization (Luo et al., arXiv 2510.08425; Luo-Yihong/DGPO ``scripts/train_sd3_dgpo.py``,
commit 01ceb4b).

``sampling.group_size`` deterministic samples per prompt by the current policy, group-relative advantages ``A_i``, and a
group-level preference between the group's better and worse samples, learned from their denoising errors against a
frozen reference (the base: the LoRA disabled). With ``l_i = mean_d (v(x_t, t) - (eps - x0_i))^2`` at a time ``t`` of
the sampler's high-noise steps and one noise per group (shared by its samples), per group ``g`` and time::

    S_g = beta / G sum_{i in g} A_i (l_theta,i - l_ref,i)
    objective_g = -log sigmoid(-S_g)          = -log sigmoid(R(G+) - R(G-)),  R(G+-) = beta / G sum |A_i| (l_ref - l_theta)

``log 2`` while the policy is the reference. Its gradient is ``sigmoid(S_g) beta / G sum_i A_i grad l_theta,i``; as the
official code, flowrl minimises ``mean_i w_g(i) A_i l_theta,i`` with the weight ``w_g = sigmoid(S_g)`` held fixed
(computed before the iteration's first optimizer step, in a pass without gradients), the objective's gradient divided by
beta, so that the optimizer sees the official scale; plus ``train.dgpo.kl_beta`` times the velocity KL to the reference,
``mean (v_theta - v_ref)^2``. ``policy/dgpo_objective`` logs the objective.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..fields import check, config_section, setting
from .base import FinalSamples, register_method
from .forward import ForwardProcess, flow_matching_error


@config_section("train", "dgpo", "DGPO's settings (train.method dgpo)")
@dataclass
class DGPOConfig:
    """``train.dgpo.*``: DGPO (``train.method: dgpo``)."""

    beta: float = setting(100.0, "beta of the group preference (the official GenEval setting 100; PickScore 10)")
    timesteps: int = setting(4, "distinct noise times drawn per iteration (shared by every sample)")
    max_step: int = setting(
        4, "times are drawn from the sampler's grid steps 0..max_step (high noise only; official 4)"
    )
    kl_beta: float = setting(0.02, "weight of the velocity KL to the reference (official GenEval 0.02)")
    guidance_scale: float = setting(1.0, "CFG of the trained velocity (1: the conditional velocity, as the official)")

    def __post_init__(self):
        check(self.beta > 0, "train.dgpo.beta", "> 0", self.beta)
        check(self.timesteps >= 1, "train.dgpo.timesteps", ">= 1", self.timesteps)
        check(self.max_step >= 0, "train.dgpo.max_step", ">= 0", self.max_step)
        check(self.kl_beta >= 0, "train.dgpo.kl_beta", ">= 0", self.kl_beta)
        check(self.guidance_scale >= 1, "train.dgpo.guidance_scale", ">= 1", self.guidance_scale)


def dgpo_objective(
    err: torch.Tensor, ref_err: torch.Tensor, adv: torch.Tensor, group: torch.Tensor, beta: float, group_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """DGPO's per-group objective and weight (module docstring).

    Args:
        err, ref_err (`torch.Tensor` of shape `(N,)`): the policy's and the reference's flow-matching errors.
        adv (`torch.Tensor` of shape `(N,)`): the rows' advantages. group (`(N,)` long): each row's (group, time) id.
        beta (`float`), group_size (`int`): beta and G.

    Returns:
        ``(objective (n,), weight (N,))``: ``-log sigmoid(-S_g)`` per (group, time) id (in id order) and each row's
        ``sigmoid(S_g)``.
    """
    ids, inverse = torch.unique(group, return_inverse=True)
    s = torch.zeros(len(ids), dtype=err.dtype, device=err.device).index_add_(0, inverse, adv * (err - ref_err))
    s = s * beta / group_size  # (n,)
    return -torch.nn.functional.logsigmoid(-s), torch.sigmoid(s)[inverse]


@register_method("dgpo", "group preferences from denoising errors")
class DGPO(ForwardProcess):
    """``train.method: dgpo`` (module docstring). Needs a LoRA (``model.lora_rank > 0``): the reference is the base.

    Args: as :class:`flowrl.methods.base.Method`.
    """

    lockstep = True  # the policy's and base's forwards padded, sample 0 standing in where a process keeps none

    @classmethod
    def check_config(cls, cfg) -> None:
        cls.check_final_samples(cfg)
        check(
            cfg.model.lora_rank > 0,
            "model.lora_rank",
            "> 0 with train.method 'dgpo' (the reference is the base: the LoRA disabled)",
            cfg.model.lora_rank,
        )

    def update(self, samples: FinalSamples, adv: torch.Tensor, keep: torch.Tensor, generator: torch.Generator) -> dict:
        """DGPO's optimizer steps on the kept samples at ``train.dgpo.timesteps`` times; returns ``policy/loss``,
        ``policy/dgpo_objective``, ``policy/kl``, ``policy/grad_norm``, ``policy/optimizer_steps`` and ``cost/*``."""
        d, model = self.cfg.train.dgpo, self.model
        rows, real = self.stand_in(keep.nonzero().squeeze(1))  # (K,) the kept samples (in lockstep a stand-in)
        steps = torch.randperm(min(d.max_step, len(self.sigmas) - 2) + 1, generator=generator)[: d.timesteps]
        times = self.sigmas[steps].to(self.device)  # (M,) distinct high-noise times
        groups = samples.image_prompt[rows]  # (K,)
        slots = torch.unique(groups, return_inverse=True)[1]  # (K,) group 0..n-1
        m, k = len(times), len(rows)
        eps = torch.randn((m, int(slots.max()) + 1 if k else 0, *model.latent_shape), generator=generator)
        eps = eps[:, slots].reshape(m * k, *model.latent_shape).to(self.device)  # one noise per group and time
        r = rows.repeat(m).to(self.device)  # (N,) row-major by time
        t = times.repeat_interleave(k)  # (N,)
        x0, cond, a = samples.x0[r], samples.cond[r], adv.to(self.device)[r]
        expand = (-1,) + (1,) * (x0.ndim - 1)
        x_t = (1 - t.view(expand)) * x0 + t.view(expand) * eps
        gid = torch.arange(m, device=self.device).repeat_interleave(k) * max(1, len(groups)) + slots.to(
            self.device
        ).repeat(m)
        velocity = model.velocity_fn(samples.table, d.guidance_scale)
        count, chunked = len(r) if real else 0, self.chunked(velocity, pad=True)
        with torch.no_grad(), self.policy.autocast():
            v_theta = chunked(x_t, t, cond) if len(r) else x_t
            with model.reference():
                v_ref = chunked(x_t, t, cond) if len(r) else x_t
        err0, ref_err = flow_matching_error(v_theta, x0, eps), flow_matching_error(v_ref, x0, eps)
        objective, weight = dgpo_objective(err0, ref_err, a, gid, d.beta, self.cfg.sampling.group_size)

        def micro_loss(idx, stats, at):
            with self.policy.autocast():
                v = velocity(x_t[idx], t[idx], cond[idx])
            err = flow_matching_error(v, x0[idx], eps[idx])
            kl = (v.float() - v_ref[idx].float()).pow(2).flatten(1).mean(dim=1).mean()
            stats["policy/kl"].append(kl.item())
            return (weight[idx] * a[idx] * err).mean() + d.kl_beta * kl

        stats, steps = self.optimizer_steps(count, generator, micro_loss)
        objective_mean = objective.mean().item() if count else 0.0
        nfe = 2 * count * model.cfg_rows(d.guidance_scale)
        return self.update_metrics(stats, steps, count, nfe, **{"policy/dgpo_objective": objective_mean})
