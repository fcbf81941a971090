"""Online Diffusion-DPO (Wallace et al., arXiv 2311.12908, Eq. 14; flow_grpo's online variant, ``scripts/train_sd3_dpo.py``)
for flow models.

Each iteration draws ``sampling.group_size`` deterministic samples per prompt with the reference weights, pairs the
best and the worst of each group (groups whose rewards are all equal give no pair), noises both with the same noise
at the same time, and trains the policy's velocity with the DPO loss of the two flow-matching errors against the
reference's::

    l(x) = mean_d (v(x_t, t) - (eps - x0))^2          (policy: l_theta; reference: l_ref, no gradient)
    loss = -log sigmoid(-beta / 2 [(l_theta - l_ref)(x_w) - (l_theta - l_ref)(x_l)])

equal to ``log 2`` while the policy is the reference. The reference is a copy of the policy, refreshed with the
policy's weights every ``train.dpo.ref_update_every`` iterations (flow_grpo's ``ref_update_step``; a very large value is
its offline setting, the reference then the initial policy), and it also draws the samples, as in flow_grpo.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..fields import check, config_section, setting
from .base import FinalSamples, Rewards, register_method
from .forward import ForwardProcess, flow_matching_error, logit_normal_times


@config_section("train", "dpo", "online Diffusion-DPO's settings (train.method dpo)")
@dataclass
class DPOConfig:
    """``train.dpo.*``: online Diffusion-DPO (``train.method: dpo``)."""

    beta: float = setting(100.0, "DPO's beta on the velocity errors (flow_grpo's 100; the paper's epsilon-form 5000)")
    timesteps: int = setting(
        4, "noise times drawn per pair and iteration, each with its own noise (shared by the pair)"
    )
    time_sampling: str = setting(
        "logit_normal",
        "logit_normal (u ~ sigmoid(N(0, 1)) on the time-shifted schedule, as flow_grpo) | grid (the sampler's times)",
    )
    ref_update_every: int = setting(10, "iterations between copies of the policy into the reference (and sampler)")
    guidance_scale: float = setting(1.0, "CFG of the trained velocity (1: the conditional velocity, as flow_grpo)")

    def __post_init__(self):
        check(self.beta > 0, "train.dpo.beta", "> 0", self.beta)
        check(self.timesteps >= 1, "train.dpo.timesteps", ">= 1", self.timesteps)
        check(
            self.time_sampling in ("logit_normal", "grid"),
            "train.dpo.time_sampling",
            "logit_normal|grid",
            self.time_sampling,
        )
        check(self.ref_update_every >= 1, "train.dpo.ref_update_every", ">= 1", self.ref_update_every)
        check(self.guidance_scale >= 1, "train.dpo.guidance_scale", ">= 1", self.guidance_scale)


def dpo_loss(
    err_w: torch.Tensor, ref_err_w: torch.Tensor, err_l: torch.Tensor, ref_err_l: torch.Tensor, beta: float
) -> torch.Tensor:
    """Diffusion-DPO's loss per pair (arXiv 2311.12908, Eq. 14, as flow_grpo computes it):
    ``-log sigmoid(-beta / 2 ((err_w - ref_err_w) - (err_l - ref_err_l)))``.

    Args:
        err_w, ref_err_w, err_l, ref_err_l (`torch.Tensor` of shape `(P,)`): the policy's and the reference's
            flow-matching errors (:func:`flow_matching_error`) on the preferred (w) and the other (l) sample.
        beta (`float > 0`).

    Returns:
        `torch.Tensor` of shape `(P,)`: ``log 2`` where the policy's errors equal the reference's.
    """
    inside = -0.5 * beta * ((err_w - ref_err_w) - (err_l - ref_err_l))
    return -torch.nn.functional.logsigmoid(inside)


@register_method("dpo", "online Diffusion-DPO on each group's best and worst")
class DiffusionDPO(ForwardProcess):
    """``train.method: dpo``: online Diffusion-DPO on best/worst pairs of each group (module docstring).

    Args: as :class:`flowrl.methods.base.Method`.
    """

    REFERENCE_FILE = "reference.safetensors"  # the reference (and sampling) weights, in each checkpoint
    lockstep = True  # the reference's forwards padded, sample 0 against itself standing in where a process has no pair

    @classmethod
    def check_config(cls, cfg) -> None:
        cls.check_final_samples(cfg)

    def __init__(self, cfg, model, policy, rewards):
        super().__init__(cfg, model, policy, rewards)
        self.reference = policy.copy()  # the initial policy; refreshed every train.dpo.ref_update_every iterations
        self.iterations = 0

    def sampling_weights(self) -> dict[str, torch.Tensor] | None:
        return self.reference

    # ------------------------------------------------------------------------------ the contract
    def advantages(self, samples: FinalSamples, rewards: Rewards, generator: torch.Generator):
        """``+1`` for the best and ``-1`` for the worst image of each of this process's groups with reward variance, 0
        elsewhere; keep marks the pairs."""
        _, zero, stats = self.group_advantages(rewards)
        total, zero = rewards.total[rewards.mine], zero[rewards.mine]  # (B,) this process's
        adv = torch.zeros_like(total)
        for g in samples.image_prompt.unique().tolist():
            rows = (samples.image_prompt == g).nonzero().squeeze(1)
            if bool(zero[rows].all()):
                continue
            adv[rows[total[rows].argmax()]], adv[rows[total[rows].argmin()]] = 1.0, -1.0
        stats["dpo/pairs"] = int((adv > 0).sum())
        return adv, adv != 0, stats

    def update(self, samples: FinalSamples, adv: torch.Tensor, keep: torch.Tensor, generator: torch.Generator) -> dict:
        """DPO on this iteration's pairs, ``train.dpo.timesteps`` noisings each; returns ``policy/loss`` (mean DPO
        loss), ``policy/grad_norm``, ``policy/implicit_acc`` (pairs whose policy favours the winner more than the
        reference does), ``policy/optimizer_steps`` and ``cost/*``."""
        d = self.cfg.train.dpo
        win = (adv > 0).nonzero().squeeze(1)  # (P,)
        lose = (
            torch.stack([((samples.image_prompt == samples.image_prompt[w]) & (adv < 0)).nonzero()[0, 0] for w in win])
            if len(win)
            else win
        )
        win, real = self.stand_in(win)  # in lockstep, where this process has no pair, sample 0 against itself
        lose = lose if real else win
        win, lose = win.repeat(d.timesteps), lose.repeat(d.timesteps)  # (N,) pair-times
        times = self.pair_times(len(win), generator)
        x0_w, x0_l = samples.x0[win.to(self.device)], samples.x0[lose.to(self.device)]
        x_t_w, eps = self.noised(x0_w, times, generator)
        t = times.view((-1,) + (1,) * (x0_l.ndim - 1))
        x_t_l = (1 - t) * x0_l + t * eps  # the same noise and time as its winner
        cond_w, cond_l = samples.cond[win.to(self.device)], samples.cond[lose.to(self.device)]
        velocity = self.model.velocity_fn(samples.table, d.guidance_scale)
        x_t, cond, x0 = torch.cat([x_t_w, x_t_l]), torch.cat([cond_w, cond_l]), torch.cat([x0_w, x0_l])
        eps2, times2 = torch.cat([eps, eps]), torch.cat([times, times])
        n = len(win)
        count = n if real else 0  # the pairs that enter the loss
        ref_err = torch.zeros(0, device=self.device)
        if n:
            with torch.no_grad(), self.policy.holding(self.reference), self.policy.autocast():
                ref_err = flow_matching_error(self.chunked(velocity, pad=True)(x_t, times2, cond), x0, eps2)  # (2N,)

        def micro_loss(idx, stats, at):
            both = torch.cat([idx, idx + n])  # the winners' rows, then their losers'
            with self.policy.autocast():
                v = velocity(x_t[both], times2[both], cond[both])
            err = flow_matching_error(v, x0[both], eps2[both])
            m = len(idx)
            margin = (ref_err[idx] - err[:m].detach()) - (ref_err[idx + n] - err[m:].detach())
            stats["policy/implicit_acc"].append((margin > 0).float().mean().item())
            return dpo_loss(err[:m], ref_err[idx], err[m:], ref_err[idx + n], d.beta).mean()

        stats, steps = self.optimizer_steps(count, generator, micro_loss)
        return self.update_metrics(stats, steps, 2 * count, 2 * count * self.model.cfg_rows(d.guidance_scale))

    def end_iteration(self, stats: dict) -> None:
        """Copy the policy into the reference every ``train.dpo.ref_update_every`` iterations."""
        self.iterations += 1
        if self.iterations % self.cfg.train.dpo.ref_update_every == 0:
            self.policy.move_towards(self.reference, 0.0)
            stats["policy/reference_refreshed"] = 1.0

    def state_dict(self) -> dict:
        return {"dpo_iterations": self.iterations}

    def load_state_dict(self, state: dict) -> None:
        self.iterations = int(state.get("dpo_iterations", 0))

    @classmethod
    def held_copies(cls, cfg) -> int:
        """The reference."""
        return 1

    def snapshots(self) -> dict:
        """The reference (:data:`REFERENCE_FILE`), which also draws the online samples."""
        return {self.REFERENCE_FILE: self.reference} if self.reference is not None else {}

    # ------------------------------------------------------------------------------ the parts
    def pair_times(self, count: int, generator: torch.Generator) -> torch.Tensor:
        """`count` noise times in (0, 1): ``logit_normal``, ``u = sigmoid(z)``, ``z ~ N(0, 1)``, on the model's time-shifted
        schedule ``t = s (1 - u) / (1 + (s - 1)(1 - u))`` (flow_grpo's logit-normal index into SD3's shifted grid),
        or ``grid``: the sampler's own times."""
        if self.cfg.train.dpo.time_sampling == "grid":
            return self.grid_times(count, generator)
        return logit_normal_times(count, float(self.cfg.sampling.shift or 1.0), generator).to(self.device)
