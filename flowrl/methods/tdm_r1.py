"""TDM-R1 (Luo et al., arXiv 2603.07700): reinforcement learning of a few-step TDM student from a non-differentiable
reward, through a learned surrogate reward and per-step rewards along the student's deterministic trajectory.

Each iteration, on top of :class:`flowrl.methods.distill.TDM` (the fake score's passes, then the student's steps):

- the rewards' group-relative advantages ``A_i`` (any reward: GenEval's strict 0/1 verdict on the tiny world);
- the **surrogate reward model** is a diffusion model (a :class:`flowrl.methods.distill.HeldScore`, started at the
  teacher) trained with a group preference on its denoising errors against the frozen teacher (DGPO's objective,
  :func:`flowrl.methods.dgpo.dgpo_objective`): at the trajectory step ``k`` drawn for each prompt group, the student's
  clean prediction ``x0_k`` of every sample, noised with one noise and time per group, gives
  ``l_i = mean_d (v_surr - (eps - x0_k))^2`` and the teacher's ``l_ref,i``; the loss is
  ``w_k mean_i sigmoid(S_g) A_i l_i + reference_beta mean_i (l_i - l_ref,i)^2`` with
  ``S_g = beta / G sum_{i in g} A_i (l_i - l_ref,i)`` held fixed and ``w_k = (k + 1) / K`` (later steps weigh more);
- the **per-step rewards**: at every point ``x_t`` where TDM queries the scores, the surrogate's clean prediction
  (with the teacher's CFG) minus the teacher's is the reward direction of that trajectory step, and the teacher's
  ``cfg_reward_scale / (s - 1) (x0_cfg - x0_cond)`` the guidance reward's; the student's loss is
  ``tdm + tdm_weight * R(x0, guidance) + (1 - tdm_weight) * R(x0, surrogate - real)`` with
  :func:`flowrl.methods.distill.revised_x0_loss` ``R``, normalised by the distance to the teacher and to the surrogate.

Source: the official repository (Luo-Yihong/TDM-R1 at 6b4c4556d0171be74f4821ffa7e662419da7f025) holds a README and
weights, no training code; the objective follows the paper's abstract and X-GenGroup/Flow-Factory's TDM-R1 trainer
(src/flow_factory/trainers/distillation/tdm_r1.py at 15932582d7f0eec90c77406b9dda5cd4da7fd9b5, its defaults
tdm_weight 0.3, cfg_reward_scale 3.5, preference beta 1, reference beta 1e-3, surrogate lr 3e-4, time weighting on).
Deviations from that reading: the surrogate's data is the student's clean prediction at the step (Flow-Factory noises
the stored trajectory point), one step per group per iteration (not every step), no slow-surrogate trust region and no
runaway clip.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..fields import check, config_section, setting
from .base import FinalSamples, Rewards, register_method
from .dgpo import dgpo_objective
from .distill import TDM, HeldScore, TrajectorySamples, flow_predictions, revised_x0_loss
from .forward import ForwardProcess, flow_matching_error


@config_section("train", "tdm_r1", "TDM-R1's settings (train.method tdm_r1)")
@dataclass
class TDMR1Config:
    """``train.tdm_r1.*``: TDM-R1's surrogate reward and reward terms (``train.method: tdm_r1``)."""

    tdm_weight: float = setting(
        0.3, "mixes the rewards: tdm_weight * guidance reward + (1 - tdm_weight) * surrogate reward, in (0, 1)"
    )
    cfg_reward_scale: float = setting(3.5, "scale of the teacher's guidance direction as a reward (0: none)")
    beta: float = setting(1.0, "beta of the surrogate's group preference")
    reference_beta: float = setting(1.0e-3, "weight of the surrogate's squared error gap to the teacher")
    learning_rate: float = setting(3.0e-4, "AdamW learning rate of the surrogate")
    betas: tuple[float, float] = setting((0.9, 0.999), "AdamW betas of the surrogate")
    time_weighting: bool = setting(True, "weigh the surrogate's loss at trajectory step k by (k + 1) / K")

    def __post_init__(self):
        check(0 < self.tdm_weight < 1, "train.tdm_r1.tdm_weight", "in (0, 1)", self.tdm_weight)
        check(self.cfg_reward_scale >= 0, "train.tdm_r1.cfg_reward_scale", ">= 0", self.cfg_reward_scale)
        check(self.beta > 0, "train.tdm_r1.beta", "> 0", self.beta)
        check(self.reference_beta >= 0, "train.tdm_r1.reference_beta", ">= 0", self.reference_beta)
        check(self.learning_rate > 0, "train.tdm_r1.learning_rate", "> 0", self.learning_rate)
        betas = list(self.betas)
        check(len(betas) == 2 and all(0 <= b < 1 for b in betas), "train.tdm_r1.betas", "two in [0, 1)", betas)


@register_method("tdm_r1", "few-step TDM student, RL through a learned surrogate and per-step rewards")
class TDMR1(TDM):
    """``train.method: tdm_r1`` (module docstring). Needs a LoRA: the surrogate starts at the teacher, the LoRA's B
    zeroed. Args: as :class:`flowrl.methods.base.Method`."""

    def __init__(self, cfg, model, policy, rewards):
        super().__init__(cfg, model, policy, rewards)
        r = cfg.train.tdm_r1
        start = {n: torch.zeros_like(w) if "lora_B" in n else w.clone() for n, w in policy.copy().items()}
        self.surrogate = HeldScore(policy, start, r.learning_rate, r.betas, cfg.train.max_grad_norm)

    @classmethod
    def check_config(cls, cfg) -> None:
        super().check_config(cfg)
        check(cfg.model.lora_rank > 0, "model.lora_rank", "> 0 with train.method 'tdm_r1'", cfg.model.lora_rank)

    def advantages(self, samples: FinalSamples, rewards: Rewards, generator: torch.Generator):
        """Group z-scores over every process's images; every row kept (a flat group's advantage is 0: it trains the
        TDM term alone)."""
        adv, keep, stats = ForwardProcess.advantages(self, samples, rewards, generator)
        return adv, torch.ones_like(keep), stats

    def boundaries(self, samples: TrajectorySamples, rows: torch.Tensor, generator) -> torch.Tensor:
        """One trajectory step per prompt group, shared by its samples (the preference compares them there)."""
        per_prompt = torch.randint(
            0, self.cfg.sampling.num_steps, (int(samples.image_prompt.max()) + 1,), generator=generator
        )
        return per_prompt[samples.image_prompt[rows.cpu()]].to(self.device)

    def between_phases(self, samples, rows, k, adv, generator) -> dict:
        """The surrogate's optimizer steps (module docstring): ``surrogate/loss``, ``surrogate/grad_norm``."""
        policy, model, r = self.policy, self.model, self.cfg.train.tdm_r1
        groups = samples.image_prompt[rows.cpu()]  # (N,)
        slots = torch.unique(groups, return_inverse=True)[1]  # (N,) group 0..n-1
        n = int(slots.max()) + 1 if len(rows) else 0
        sigmas = self.sigmas.to(self.device)
        velocity = model.velocity_fn(samples.table, 1.0)
        x, s, c = self.student_point(samples, rows, k)
        with torch.no_grad(), policy.autocast():
            x0 = flow_predictions(x, s, self.chunked(velocity)(x, s, c))[0] if len(rows) else x
        d = self.cfg.train.distill
        low = sigmas[k + 1].clamp(min=d.min_time)
        u = torch.rand(n, generator=generator)[slots].to(self.device)  # one time per group
        t = low + u * (d.max_time - low)
        eps = torch.randn((n, *model.latent_shape), generator=generator)[slots].to(self.device)  # one noise per group
        x_t = (1 - t.view(-1, *[1] * (x0.ndim - 1))) * x0 + t.view(-1, *[1] * (x0.ndim - 1)) * eps
        with torch.no_grad(), policy.autocast():
            with self.teacher_context():
                v_ref = self.chunked(velocity)(x_t, t, c) if len(rows) else x_t
            with self.surrogate.holding():
                v_sur = self.chunked(velocity)(x_t, t, c) if len(rows) else x_t
        ref_err = flow_matching_error(v_ref, x0, eps)
        a = adv.to(self.device)[rows]
        _, weight = dgpo_objective(flow_matching_error(v_sur, x0, eps), ref_err, a, slots.to(self.device), r.beta,
                                   self.cfg.sampling.group_size)  # fmt: skip
        time_w = (k + 1).float() / self.cfg.sampling.num_steps if r.time_weighting else torch.ones_like(t)
        losses, norms = [], []
        for _, _, mb, total in policy.minibatches(len(rows), generator):
            share, parts = len(mb) / max(total, 1), []
            for _, idx, frac in policy.micro_batches(mb):
                with self.surrogate.holding():
                    with policy.autocast():
                        err = flow_matching_error(velocity(x_t[idx], t[idx], c[idx]), x0[idx], eps[idx])
                    loss = (time_w[idx] * weight[idx] * a[idx] * err).mean()
                    loss = loss + r.reference_beta * (err - ref_err[idx]).pow(2).mean()
                    policy.backward(loss, frac * share)
                parts.append(loss.item() * frac)
            norms.append(self.surrogate.step())
            losses.append(sum(parts))
        return {
            "surrogate/loss": sum(losses) / max(len(losses), 1),
            "surrogate/grad_norm": sum(norms) / max(len(norms), 1),
        }

    def extra_scores(self, x_t, t, c, table):
        """The surrogate's clean prediction at the teacher's CFG and the teacher's conditional one (no gradient)."""
        scale = self.cfg.train.distill.teacher_guidance
        with torch.no_grad(), self.policy.autocast():
            with self.surrogate.holding():
                sur = flow_predictions(x_t, t, self.model.velocity_fn(table, scale)(x_t, t, c))[0]
            cond = None
            if scale > 1 and self.cfg.train.tdm_r1.cfg_reward_scale > 0:
                with self.teacher_context():
                    cond = flow_predictions(x_t, t, self.model.velocity_fn(table, 1.0)(x_t, t, c))[0]
        return sur, cond

    def step_loss(self, x0, real, fake, idx, extra):
        """``tdm + tdm_weight * guidance reward + (1 - tdm_weight) * surrogate reward`` (module docstring)."""
        r, scale = self.cfg.train.tdm_r1, self.cfg.train.distill.teacher_guidance
        sur, cond = extra
        tdm = self.matching_loss(x0, real, fake)
        surrogate = revised_x0_loss(x0, sur - real, sur)
        guidance = torch.zeros((), device=x0.device)
        if cond is not None:
            guidance = revised_x0_loss(x0, r.cfg_reward_scale / (scale - 1) * (real - cond), real)
        loss = tdm + r.tdm_weight * guidance + (1 - r.tdm_weight) * surrogate
        stats = {"policy/matching_loss": tdm.item(), "policy/guidance_reward_loss": guidance.item()}
        return loss, {**stats, "policy/surrogate_reward_loss": surrogate.item()}

    # ------------------------------------------------------------------------------ checkpoints
    @classmethod
    def held_copies(cls, cfg) -> int:
        """TDM's, and the surrogate with its two AdamW moments."""
        return super().held_copies(cfg) + 3

    def snapshots(self) -> dict:
        """The fake score's and the surrogate's weights and AdamW moments."""
        return {**super().snapshots(), **self.surrogate.files("surrogate")}

    def state_dict(self) -> dict:
        return {**super().state_dict(), "surrogate_steps": self.surrogate.steps}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.surrogate.steps = state.get("surrogate_steps", 0)
