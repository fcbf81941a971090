"""GRPO for flow models: Flow-GRPO's policy update (arXiv 2505.05470) on any of the GRPO rollout shapes.

The rollouts and advantages are the rollout shape's (``sampling.shape``, :mod:`flowrl.methods.shapes`); :class:`GRPO`
adds DanceGRPO's random step subset and the inner PPO epochs of the clipped surrogate on the trained transitions, with
the log-probs recomputed in float32 at the std that drew each sample, and the optional KL to the LoRA-disabled base.
"""

from __future__ import annotations

import torch

from ..losses import kl_to_reference, ppo_loss, ratio_norm, step_weights, velocity_kl
from ..samplers import recompute_log_prob, velocity_gain
from .base import Method, Rewards, SDESamples, register_method
from .diagnostics import StepDiagnostics
from .shapes import SHAPES, step_subset


@register_method("grpo", "SDE rollouts of sampling.shape, PPO on log-prob ratios")
class GRPO(Method):
    """``train.method: grpo``: Flow-GRPO, DanceGRPO, MixGRPO, BranchGRPO, TempFlow-GRPO, G2RPO, TP-GRPO, GRPO-Guard
    and Pref-GRPO are this method with other rollout shapes (``sampling.shape``), rewards and loss options
    (``configs/``).

    Attributes:
        shape (:class:`flowrl.methods.shapes.RolloutShape`): the rollout shape ``sampling.shape`` names.

    Args: as :class:`flowrl.methods.base.Method`.
    """

    lockstep = True

    @classmethod
    def check_config(cls, cfg) -> None:
        """The rollout shape's cross-key checks (:meth:`RolloutShape.check_config`)."""
        SHAPES[cfg.sampling.shape].check_config(cfg)

    def __init__(self, cfg, model, policy, rewards):
        super().__init__(cfg, model, policy, rewards)
        self.shape = SHAPES[cfg.sampling.shape](self)

    # ------------------------------------------------------------------------------ the contract
    def rollout(self, metas: list[dict], generator: torch.Generator) -> SDESamples:
        """The rollout shape's groups of stochastic transitions (:meth:`RolloutShape.rollout`)."""
        return self.shape.rollout(metas, generator)

    @classmethod
    def chunked_rollout(cls, cfg) -> bool:
        """Where the rollout is GRPO's and the shape samples in chunks (:meth:`RolloutShape.chunked_rollout`)."""
        return cls.rollout is GRPO.rollout and SHAPES[cfg.sampling.shape].chunked_rollout(cfg)

    def rollout_in_chunks(self, metas: list[dict], generator: torch.Generator, size: int, on_chunk) -> SDESamples:
        """The rollout shape's :meth:`RolloutShape.rollout_in_chunks` (:meth:`Method.rollout_in_chunks`)."""
        return self.shape.rollout_in_chunks(metas, generator, size, on_chunk)

    def advantages(self, samples: SDESamples, rewards: Rewards, generator: torch.Generator):
        """The rollout shape's per-transition advantages ``(M,)`` and the transitions that enter the loss ``(M,)``
        bool; with ``train.timestep_fraction < 1``, DanceGRPO's random subset of each image's trained steps, drawn
        from `generator`."""
        adv, keep, stats = self.shape.advantages(samples, rewards)
        if self.cfg.train.timestep_fraction < 1:
            keep = keep & step_subset(samples.rollout, self.cfg.train.timestep_fraction, generator).to(keep.device)
        return adv, keep, stats

    def update(self, samples: SDESamples, adv: torch.Tensor, keep: torch.Tensor, generator: torch.Generator) -> dict:
        """Inner PPO epochs over the kept transitions of ``samples.rollout`` (:meth:`optimize`)."""
        return self.optimize(samples.rollout, adv, keep, samples.table, generator)

    def end_iteration(self, stats: dict) -> None:
        """The rollout shape's move (MixGRPO's window)."""
        self.shape.end_iteration(stats)

    def state_dict(self) -> dict:
        return self.shape.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.shape.load_state_dict(state)

    # ------------------------------------------------------------------------------ the update
    def optimize(
        self, ro, adv_all: torch.Tensor, keep: torch.Tensor, table, generator: torch.Generator
    ) -> dict[str, float]:
        """Inner PPO epochs over the kept transitions, each with its advantage ``adv_all[m]``.

        Flow-GRPO's clipped surrogate (arXiv 2505.05470, its GRPO objective without the KL term, which is added here
        with weight ``train.kl_beta``): ``max(-A r, -A clip(r, 1 - eps, 1 + eps))`` averaged over a minibatch
        of ``train.minibatch_size`` transitions, one optimizer step (AdamW, gradient clipping at
        ``train.max_grad_norm``, EMA update) per minibatch, ``train.inner_epochs`` passes in a random order
        drawn from `generator`. The log-probs are recomputed in float32 with the std that drew each sample.
        With ``train.micro_batch_size`` each minibatch is forwarded and back-propagated in micro-batches of
        that many transitions, each loss weighted by its share of the minibatch (gradient accumulation: the
        same step, less activation memory). Under several processes the step follows the mean over every
        process's minibatch; the returned statistics are this process's, except ``policy/grad_norm``, which
        is the summed gradient's.

        Args:
            ro (:class:`flowrl.samplers.Rollout`): the iteration's stored transitions, `M` rows.
            adv_all (`torch.Tensor` of shape `(M,)`, float32): advantage per transition (clipped, unitless).
            keep (`torch.Tensor` of shape `(M,)`, bool): transitions that enter the loss.
            table (:class:`flowrl.models.PromptEmbeds`): the iteration's prompt table, indexed by ``ro.cond``.
            generator (`torch.Generator`): the iteration's generator (minibatch order).

        Returns:
            `dict[str, float]`: means over optimizer steps of ``policy/*`` (loss, grad_norm, ratio, clip
            fractions, approx_kl, kl), ``policy/ratio_first_max_dev`` (the ratio's largest deviation from 1
            before the first optimizer step: 0 when the recomputation is exact), per-step ``diag/step_KK/*``
            and ``cost/trained_transitions``.
        """
        train = self.cfg.train
        rows = keep.nonzero().squeeze(1)
        count = len(rows)
        if count == 0 and self.policy.lockstep:  # row 0 stands in for the zero-weight padding micro-batches
            rows = torch.zeros(1, dtype=rows.dtype, device=rows.device)
        tv, adv = ro.select(rows), adv_all[rows]  # M' transitions, (M',)
        diagnostics = StepDiagnostics(train.step_grad_norms, train.clip_range)  # filled in the first epoch
        # step weights normalised over the plan's trained steps (the same on every process), then kept rows
        gain = velocity_gain(ro) if train.step_weighting == "guard" else ro.std
        step_w = step_weights(train.step_weighting, gain, ro.std, ro.step, ro.trained) if count else None  # (M,)
        step_w = None if step_w is None else step_w[rows]  # (M',)
        velocity = self.model.velocity_fn(table, self.cfg.sampling.guidance_scale)  # CFG against table row 0

        def micro_loss(idx, stats, at):
            diag = diagnostics if at.epoch == 0 and not at.pad else None
            w = None if step_w is None else step_w[idx]
            loss, micro = self.micro_batch_loss(velocity, tv.select(idx), adv[idx], w, at, diag)
            if at.step == 1:  # before any update (absent where this process's first step had no transitions)
                stats["policy/ratio_first_max_dev"].append(micro["policy/ratio_max_dev"])
            return loss, micro

        stats, steps = self.optimizer_steps(count, generator, micro_loss)
        return self.update_metrics(stats, steps, count, **diagnostics.metrics())

    def micro_batch_loss(
        self, velocity, sub, adv: torch.Tensor, weights: torch.Tensor | None, at, diag: StepDiagnostics | None
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """The loss of one micro-batch of :meth:`optimize`: the clipped surrogate (plus the KL term) of the `m`
        transitions `sub`, and its statistics; :meth:`Method.optimizer_steps` back-propagates it with weight
        ``at.scale`` (its share of the global minibatch).

        Args:
            velocity: the policy (:meth:`FlowModel.velocity_fn`); sub (:class:`samplers.Rollout`): `m` transitions.
            adv (`torch.Tensor` of shape `(m,)`, float32): their advantages; weights `(m,)` or None: step weights.
            at (:class:`flowrl.methods.base.MicroBatch`): the micro-batch's step and weights (``step_grad_norms:
                params`` is measured on the iteration's first one).
            diag: the first epoch's :class:`StepDiagnostics` hook, None in later epochs.

        Returns:
            ``(loss, stats)``: the scalar loss with its graph, and this micro-batch's ``policy/kl`` (with
            ``train.kl_beta``) and :func:`losses.ppo_loss`'s statistics.
        """
        train = self.cfg.train
        v, log_prob, mean = self.policy_log_prob(velocity, sub)
        if diag is not None:
            diag.track_velocity(v, sub, at.scale)
        loss, st = self.policy_loss(log_prob, mean, sub, adv, weights)
        out = {}
        if diag is not None:
            first = at.step == 1 and at.first
            diag.record(sub, log_prob, first, lambda: self.param_grad_norms(sub, log_prob, adv, weights))
        if train.kl_beta > 0:
            kl = self.kl_to_reference(velocity, sub, v, mean)
            loss = loss + train.kl_beta * kl
            out["policy/kl"] = kl.item()
        out.update({k: x.item() for k, x in st.items()})
        return loss, out

    def policy_loss(
        self, log_prob: torch.Tensor, mean: torch.Tensor, sub, adv: torch.Tensor, weights: torch.Tensor | None
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The policy-gradient loss of transitions `sub` from their recomputed log-probs `(m,)` and step means: Flow-GRPO's
        clipped surrogate (:func:`losses.ppo_loss` at ``train.clip_range``); a variant (Flow-DPPO) overrides this."""
        return ppo_loss(log_prob, sub.log_prob, adv, self.cfg.train.clip_range, weights)

    def policy_log_prob(self, velocity, sub) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The current policy's velocity `(M, C, H, W)` (under ``run.mixed_precision``) at transitions `sub`,
        and the float32 log-prob `(M,)` and mean `(M, C, H, W)` of their recorded next states at the std that
        drew them (:func:`samplers.recompute_log_prob`); with ``train.ratio_norm`` the log-prob is GRPO-Guard's
        (arXiv 2510.22319) std-scaled, unbiased one, ``old + ratio_norm(...)``, so that ``exp(new - old)`` is its ratio."""
        with self.policy.autocast():
            v = velocity(sub.state, sub.sigma, sub.cond)
        log_prob, mean = recompute_log_prob(sub, v)
        if self.cfg.train.ratio_norm:
            log_prob = sub.log_prob + ratio_norm(log_prob, sub.log_prob, mean, sub.mean, sub.std)
        return v, log_prob, mean

    def kl_to_reference(self, velocity, sub, v: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
        """The KL penalty (scalar, before ``train.kl_beta``) of the policy's velocity `v` / step mean `mean` at
        transitions `sub` to the reference's (:meth:`reference`: the LoRA-disabled base; ``train.kl_type``: ``velocity`` -> :func:`losses.velocity_kl`,
        else the Gaussian steps' :func:`losses.kl_to_reference` at the recorded std; ``flow_grpo``: at the std per
        unit time, Flow-GRPO's code's KL)."""
        with torch.no_grad(), self.reference(), self.policy.autocast():
            v_ref = velocity(sub.state, sub.sigma, sub.cond)
        if self.cfg.train.kl_type == "velocity":
            return velocity_kl(v, v_ref)
        std = sub.std  # flow_grpo: the SDE's sigma_t, as Flow-GRPO's code (its KL is the exact one times |dt|)
        if self.cfg.train.kl_type == "flow_grpo":
            std = std / (sub.sigma - sub.sigma_next).abs().sqrt()
        return kl_to_reference(mean, recompute_log_prob(sub, v_ref)[1], std)

    def reference(self):
        """The context in which the transformer is the KL's reference: the LoRA-disabled base
        (:meth:`FlowModel.reference`); Flow-OPD's anchor teacher overrides it."""
        return self.model.reference()

    def param_grad_norms(
        self, sub, log_prob: torch.Tensor, adv: torch.Tensor, weights: torch.Tensor | None
    ) -> dict[int, list[torch.Tensor]]:
        """Norm of the gradient of each denoising step's mean PPO loss w.r.t. the trained parameters, on the
        first (micro-)batch of an iteration (``train.step_grad_norms: params``; one extra backward per step present)."""
        train = self.cfg.train
        params = [p for p in self.policy.params.values() if p.requires_grad]
        out = {}
        for k in sub.step.unique().tolist():
            m = sub.step == k
            loss_k, _ = ppo_loss(
                log_prob[m], sub.log_prob[m], adv[m], train.clip_range, None if weights is None else weights[m]
            )
            grads = torch.autograd.grad(loss_k, params, retain_graph=True, allow_unused=True)
            sq = sum(g.float().pow(2).sum() for g in grads if g is not None)
            out[k] = [torch.as_tensor(sq).sqrt().reshape(1).cpu()]
        return out
