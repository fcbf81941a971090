"""TDM-R1 (Luo et al., arXiv 2603.07700): reinforcement learning of a few-step TDM student from a non-differentiable
reward, through a learned surrogate reward and per-step rewards along the student's deterministic trajectory.

Each iteration, on top of :class:`flowrl.methods.distill.TDM` (the fake score's passes, then the student's steps):

- the rewards' group-relative advantages ``A_i`` (any reward: GenEval's strict 0/1 verdict on the tiny world);
- the **surrogate reward model** is a diffusion model (a :class:`flowrl.methods.distill.HeldScore`, started at the
  teacher) trained with a group preference on its denoising errors against the frozen teacher (DGPO's objective,
  :func:`flowrl.methods.dgpo.dgpo_objective`): at the trajectory step ``k`` drawn for each prompt group, the student's
  clean prediction ``x0_k`` of every sample, noised with one noise and time per group, gives
  ``l_i = mean_d (v_surr - (eps - x0_k))^2`` and the teacher's ``l_ref,i``; the loss is
  ``mean_i w_k (sigmoid(S_g) A_i sg?(l_i) + reference_beta (l_i - l_ref,i)^2)`` with
  ``S_g = beta / G sum_{i in g} A_i (l_i - l_ref,i)`` held fixed and ``w_k = (k + 1) / K`` (later steps weigh more);
  ``sg?`` stops the preference's gradient of a row outside the **trust region** around the **slow surrogate** (a
  second copy of the surrogate moved towards it by an EMA once an iteration, ``l_slow,i`` its error: the ratio
  ``exp(l_slow,i - l_i)`` above ``1 + clip_range`` for ``A_i > 0``, below ``1 - clip_range`` otherwise) or past the
  **runaway clip** (``l_i`` already moved from ``l_ref,i`` the way ``A_i`` asks, by ``(l_i - l_ref,i)^2 >
  reference_threshold``) (:func:`surrogate_loss`, :func:`slow_decay`);
- the **per-step rewards**: at every point ``x_t`` where TDM queries the scores, the surrogate's clean prediction
  (with the teacher's CFG) minus the teacher's is the reward direction of that trajectory step, and the teacher's
  ``cfg_reward_scale / (s - 1) (x0_cfg - x0_cond)`` the guidance reward's; the student's loss is
  ``tdm + tdm_weight * R(x0, guidance) + (1 - tdm_weight) * R(x0, surrogate - real)`` with
  :func:`flowrl.methods.distill.revised_x0_loss` ``R``, normalised by the distance to the teacher and to the surrogate.

Source: the official repository (Luo-Yihong/TDM-R1 at 6b4c4556d0171be74f4821ffa7e662419da7f025) holds a README and
weights, no training code; the objective follows the paper's abstract and X-GenGroup/Flow-Factory's TDM-R1 trainer
(src/flow_factory/trainers/distillation/tdm_r1.py at 15932582d7f0eec90c77406b9dda5cd4da7fd9b5, its defaults
tdm_weight 0.3, cfg_reward_scale 3.5, preference beta 1, reference beta 1e-3, surrogate lr 3e-4, time weighting on,
trust-region clip range 1e-3, slow decay 0.001 rising by 0.001 an iteration to 0.3, runaway threshold 0.05).
Deviations from that reading: the surrogate's data is the student's clean prediction at the step (Flow-Factory noises
the stored trajectory point), one step per group per iteration (not every step).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..fields import check, config_section, setting
from .base import FinalSamples, Rewards, register_method
from .dgpo import dgpo_objective
from .distill import TDM, HeldScore, TrajectorySamples, flow_predictions, revised_x0_loss
from .forward import ForwardProcess, flow_matching_error

SLOW_DECAY_RAMP = 1.0e-3
"""How much the slow surrogate's EMA decay rises an iteration (Flow-Factory's TDM-R1 trainer, ``_surrogate_phase``)."""


def slow_decay(updates: int, low: float, high: float) -> float:
    """The slow surrogate's EMA decay after `updates` earlier updates: ``min(high, low + 0.001 updates)``, so that it
    lags the surrogate more as training goes on (Flow-Factory's TDM-R1 trainer at 1593258, ``_surrogate_phase``, with
    its ``self.step`` the iteration).

    Args:
        updates (`int`, >= 0): the slow copy's updates so far. low, high (`float`, ``0 <= low <= high <= 1``):
            ``train.tdm_r1.slow_decay_min``, ``slow_decay_max``.

    Returns:
        The decay, in ``[low, high]``: the weight the update keeps on the slow copy.
    """
    return min(high, low + SLOW_DECAY_RAMP * updates)


def surrogate_loss(
    err: torch.Tensor,
    ref_err: torch.Tensor,
    slow_err: torch.Tensor | None,
    adv: torch.Tensor,
    weight: torch.Tensor,
    time_w: torch.Tensor,
    reference_beta: float,
    clip_range: float,
    threshold: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """TDM-R1's surrogate loss with its trust region and runaway clip (Flow-Factory's TDM-R1 trainer at 1593258,
    ``_surrogate_boundary_loss``, ``_clip_outside_trust_region``, ``_clip_runaway_surrogate``; group preference as
    DGPO's, arXiv 2510.08425)::

        trust_i   = exp(l_slow,i - l_i) > 1 + clip_range   if A_i > 0,   < 1 - clip_range   otherwise
        runaway_i = (l_i < l_ref,i if A_i > 0 else l_i > l_ref,i)  and  (l_i - l_ref,i)^2 > threshold
        loss      = mean_i w_i (sigmoid(S_g(i)) A_i sg?(l_i) + reference_beta (l_i - l_ref,i)^2)

    ``sg?(l_i)`` is ``l_i`` without its gradient where ``trust_i or runaway_i`` (the row keeps its value and its
    place in ``S_g``, which the caller holds fixed); the anchor to the teacher keeps every row's gradient.

    Args:
        err (`torch.Tensor` of shape `(N,)`): the surrogate's flow-matching errors ``l_i`` (with the gradient).
        ref_err, slow_err (`(N,)`): the teacher's and the slow surrogate's at the same ``x_t`` (no gradient);
            `slow_err` None (or ``clip_range`` 0): no trust region.
        adv (`(N,)`): the advantages ``A_i``. weight (`(N,)`, in (0, 1)): ``sigmoid(S_g)`` of each row's group.
        time_w (`(N,)`, in (0, 1]): the trajectory step's weight ``w_i``.
        reference_beta (`float`, >= 0), clip_range (`float`, >= 0), threshold (`float`, > 0): as ``train.tdm_r1``.

    Returns:
        ``(loss, trust, runaway)``: the scalar loss (float32, or float64 for float64 inputs) and the `(N,)` bool
        masks of the rows whose preference gradient each clip stopped.
    """
    e = err.detach()
    up = adv > 0  # (N,)
    trust = torch.zeros_like(up)
    if slow_err is not None and clip_range > 0:
        ratio = torch.exp(slow_err.to(e.dtype) - e)  # > 1: the surrogate denoises the row better than its slow copy
        trust = torch.where(up, ratio > 1 + clip_range, ratio < 1 - clip_range)
    gap = e - ref_err.to(e.dtype)
    runaway = torch.where(up, gap < 0, gap > 0) & (gap.pow(2) > threshold)
    preferred = torch.where(trust | runaway, e, err)
    anchor = (err - ref_err.to(err.dtype)).pow(2)
    loss = time_w.to(err.dtype) * (weight.to(err.dtype) * adv.to(err.dtype) * preferred + reference_beta * anchor)
    return loss.mean(), trust, runaway


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
    clip_range: float = setting(
        1.0e-3,
        "trust region of the surrogate's preference: a row whose ratio exp(l_slow - l) to the slow surrogate passed "
        "1 + clip_range (advantage > 0; below 1 - clip_range otherwise) stops its gradient (0: off)",
    )
    slow_decay_min: float = setting(
        1.0e-3,
        "EMA decay of the slow surrogate at the first iteration, rising by 0.001 an iteration to slow_decay_max",
    )
    slow_decay_max: float = setting(0.3, "highest EMA decay of the slow surrogate (the weight kept on it)")
    reference_threshold: float = setting(
        0.05,
        "runaway clip: a row whose error moved from the teacher's the way its advantage asks by a squared gap above "
        "this stops its preference gradient",
    )

    def __post_init__(self):
        check(0 < self.tdm_weight < 1, "train.tdm_r1.tdm_weight", "in (0, 1)", self.tdm_weight)
        check(self.cfg_reward_scale >= 0, "train.tdm_r1.cfg_reward_scale", ">= 0", self.cfg_reward_scale)
        check(self.beta > 0, "train.tdm_r1.beta", "> 0", self.beta)
        check(self.reference_beta >= 0, "train.tdm_r1.reference_beta", ">= 0", self.reference_beta)
        check(self.learning_rate > 0, "train.tdm_r1.learning_rate", "> 0", self.learning_rate)
        betas = list(self.betas)
        check(len(betas) == 2 and all(0 <= b < 1 for b in betas), "train.tdm_r1.betas", "two in [0, 1)", betas)
        check(self.clip_range >= 0, "train.tdm_r1.clip_range", ">= 0", self.clip_range)
        check(self.reference_threshold > 0, "train.tdm_r1.reference_threshold", "> 0", self.reference_threshold)
        decays = (self.slow_decay_min, self.slow_decay_max)
        check(0 <= decays[0] <= decays[1] <= 1, "train.tdm_r1.slow_decay_min",
              "0 <= slow_decay_min <= slow_decay_max <= 1", decays)  # fmt: skip


@register_method("tdm_r1", "few-step TDM student, RL through a learned surrogate and per-step rewards")
class TDMR1(TDM):
    """``train.method: tdm_r1`` (module docstring). Needs a LoRA: the surrogate starts at the teacher, the LoRA's B
    zeroed. Args: as :class:`flowrl.methods.base.Method`."""

    def __init__(self, cfg, model, policy, rewards):
        super().__init__(cfg, model, policy, rewards)
        r = cfg.train.tdm_r1
        start = {n: torch.zeros_like(w) if "lora_B" in n else w.clone() for n, w in policy.copy().items()}
        self.surrogate = HeldScore(policy, start, r.learning_rate, r.betas, cfg.train.max_grad_norm)
        self.slow = {n: w.clone() for n, w in self.surrogate.weights.items()}  # the slow surrogate, a held copy
        self.slow_updates = 0

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
        """The surrogate's optimizer steps (module docstring, :func:`surrogate_loss`), then the slow surrogate's EMA
        update (:func:`slow_decay`, :func:`flowrl.policy.move_towards`): ``surrogate/loss``, ``surrogate/grad_norm``,
        ``surrogate/trust_clip_frac``, ``surrogate/runaway_clip_frac`` (rows whose preference gradient each clip
        stopped) and ``surrogate/slow_decay``."""
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
            slow_err = None
            if r.clip_range > 0:
                with policy.holding(self.slow):
                    slow_err = flow_matching_error(self.chunked(velocity)(x_t, t, c) if len(rows) else x_t, x0, eps)
        ref_err = flow_matching_error(v_ref, x0, eps)
        a = adv.to(self.device)[rows]
        _, weight = dgpo_objective(flow_matching_error(v_sur, x0, eps), ref_err, a, slots.to(self.device), r.beta,
                                   self.cfg.sampling.group_size)  # fmt: skip
        time_w = (k + 1).float() / self.cfg.sampling.num_steps if r.time_weighting else torch.ones_like(t)
        losses, norms, clipped = [], [], torch.zeros(3)  # rows clipped by the trust region, by the runaway clip; rows
        for _, _, mb, total in policy.minibatches(len(rows), generator):
            share, parts = len(mb) / max(total, 1), []
            for _, idx, frac in policy.micro_batches(mb):
                with self.surrogate.holding():
                    with policy.autocast():
                        err = flow_matching_error(velocity(x_t[idx], t[idx], c[idx]), x0[idx], eps[idx])
                    slow = None if slow_err is None else slow_err[idx]
                    loss, trust, runaway = surrogate_loss(
                        err,
                        ref_err[idx],
                        slow,
                        a[idx],
                        weight[idx],
                        time_w[idx],
                        r.reference_beta,
                        r.clip_range,
                        r.reference_threshold,
                    )
                    policy.backward(loss, frac * share)
                parts.append(loss.item() * frac)
                clipped += torch.tensor([trust.sum().item(), runaway.sum().item(), len(idx)])
            norms.append(self.surrogate.step())
            losses.append(sum(parts))
        decay = self.advance_slow_copy()
        return {
            "surrogate/loss": sum(losses) / max(len(losses), 1),
            "surrogate/grad_norm": sum(norms) / max(len(norms), 1),
            "surrogate/trust_clip_frac": (clipped[0] / clipped[2].clamp(min=1)).item(),
            "surrogate/runaway_clip_frac": (clipped[1] / clipped[2].clamp(min=1)).item(),
            "surrogate/slow_decay": decay,
        }

    def advance_slow_copy(self) -> float:
        """The slow surrogate's EMA update after the iteration's surrogate steps (:func:`slow_decay`,
        :func:`flowrl.policy.move_towards`); returns the decay it used."""
        from ..policy import move_towards  # here: importing flowrl.policy executes torch, which the CLI defers

        r = self.cfg.train.tdm_r1
        decay = slow_decay(self.slow_updates, r.slow_decay_min, r.slow_decay_max)
        move_towards(self.slow, self.surrogate.weights, decay)
        self.slow_updates += 1
        return decay

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
        """TDM's, the surrogate with its two AdamW moments, and the slow surrogate."""
        return super().held_copies(cfg) + 4

    def snapshots(self) -> dict:
        """The fake score's and the surrogate's weights and AdamW moments, and the slow surrogate
        (``surrogate_slow.safetensors``)."""
        return {**super().snapshots(), **self.surrogate.files("surrogate"), "surrogate_slow.safetensors": self.slow}

    def state_dict(self) -> dict:
        return {**super().state_dict(), "surrogate_steps": self.surrogate.steps, "slow_updates": self.slow_updates}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.surrogate.steps = state.get("surrogate_steps", 0)
        self.slow_updates = state.get("slow_updates", 0)
