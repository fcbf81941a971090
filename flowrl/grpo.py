"""Flow-GRPO's policy update (arXiv 2505.05470), as a mixin of :class:`flowrl.trainer.Trainer`.

One GRPO iteration (:meth:`GRPOMixin.grpo_step`): a rollout of the configured shape, rewards,
advantages, then inner PPO epochs of the clipped surrogate on the trained transitions (:meth:`GRPOMixin.optimize`),
with the log-probs recomputed in float32 at the std that drew each sample.
"""

from __future__ import annotations

import time
from collections import defaultdict

import torch

from samplers import recompute_log_prob, velocity_gain

from .losses import kl_to_reference, ppo_loss, ratio_norm, step_weights, velocity_kl
from .models import PromptEmbeds


def step_diagnostics(ratios: dict[int, list[torch.Tensor]], grad_norms: dict[int, list[torch.Tensor]],
                     clip_range: float) -> dict[str, float]:
    """GRPO-Guard's (arXiv 2510.22319) per-step diagnostics of an iteration's first PPO epoch.

    Args:
        ratios: denoising step -> the ratios `(n,)` float of its transitions (in pieces, concatenated here).
        grad_norms: denoising step -> gradient norms `(n,)` float (``train.step_grad_norms``); may be empty.
        clip_range: the PPO clip range eps.

    Returns:
        ``diag/step_KK/{ratio_mean, ratio_std, clip_high, clip_low}`` (fractions of ratios above ``1 + eps``
        and below ``1 - eps``) per step present, and ``diag/step_KK/grad_norm`` (mean) per step in `grad_norms`.
    """
    out = {}
    for k, parts in sorted(ratios.items()):
        r = torch.cat(parts)
        out[f"diag/step_{k:02d}/ratio_mean"] = r.mean().item()
        out[f"diag/step_{k:02d}/ratio_std"] = r.std(unbiased=False).item()
        out[f"diag/step_{k:02d}/clip_high"] = (r > 1 + clip_range).float().mean().item()
        out[f"diag/step_{k:02d}/clip_low"] = (r < 1 - clip_range).float().mean().item()
    for k, parts in sorted(grad_norms.items()):
        out[f"diag/step_{k:02d}/grad_norm"] = torch.cat(parts).mean().item()
    return out


class GRPOMixin:
    """GRPO's iteration and PPO epochs. Uses the trainer's rollouts (:class:`flowrl.rollouts.RolloutMixin`),
    scoring, minibatches and optimizer step."""

    def grpo_step(self, it: int) -> dict[str, float]:
        """One GRPO iteration: prompts, rollout (flat, tree or probes), rewards, advantages, :meth:`optimize`,
        then the MixGRPO window's advance.

        Args:
            it (`int`): the 0-based iteration; with ``run.seed`` it fixes the prompts and every random draw.

        Returns:
            `dict[str, float]`: the metrics of :meth:`flowrl.trainer.Trainer.step`.

        Raises:
            ValueError: if a reward returns the wrong shape, NaN or inf (the reward is named).
        """
        gen = self._generator(it)
        metas = self.sample_prompts(it)
        t0 = time.time()
        if self.cfg.sampling.probe.method:
            table = self.model.encode([""] + [m["prompt"] for m in metas])
            probes, images, image_prompt = self.probe_rollout(metas, table, gen)
            ro = probes.rollout
        else:
            probes = None
            ro, images, table = self.rollout(metas, gen)
            image_prompt = ro.group.cpu()
        t1 = time.time()
        judged = self._judge_calls()
        scores = self.score(images, image_prompt, metas)
        judged = self._judge_calls() - judged
        t2 = time.time()
        total = self.accelerator.gather(scores.total.to(self.device)).cpu()
        mine = slice(self.accelerator.process_index * len(scores.total), (self.accelerator.process_index + 1) * len(scores.total))
        if probes is not None:  # process rewards of this process's own probes
            adv_t, keep, adv_stats = self.probe_advantages(probes, scores.total, image_prompt)
        elif self.branch is None:  # group z-scores over the gathered batch, then this process's share
            adv, zero, adv_stats = self._group_advantages(scores, total, image_prompt, len(metas))
            keep = ro.trained & ~zero[mine].to(ro.trained.device)[ro.leaf]
            adv_t = adv[mine].to(self.device)[ro.leaf]
        else:  # a tree is one process's group: no gather needed
            adv_t, keep, adv_stats = self.tree_advantages(ro, scores.total)
        if self.cfg.train.timestep_fraction < 1:
            keep = keep & self.step_subset(ro, gen).to(keep.device)
        stats = self.optimize(ro, adv_t, keep, table, gen)
        t3 = time.time()
        if self.window is not None:
            stats["sampling/window_start"] = self.window.start
            self.window.advance()
        metrics = self._reward_metrics(it, total, scores, metas, image_prompt, judged)
        metrics.update({**adv_stats, "cost/nfe": ro.cost["nfe"] * self.model.cfg_rows(self.cfg.sampling.guidance_scale),
                        "time/sample_s": t1 - t0, "time/score_s": t2 - t1, "time/train_s": t3 - t2, **stats})
        return metrics

    def optimize(self, ro, adv_all: torch.Tensor, keep: torch.Tensor, table: PromptEmbeds,
                 generator: torch.Generator) -> dict[str, float]:
        """Inner PPO epochs over the kept transitions, each with its advantage ``adv_all[m]``.

        Flow-GRPO's clipped surrogate (arXiv 2505.05470, its GRPO objective without the KL term, which is added here
        with weight ``train.kl_beta``): ``max(-A r, -A clip(r, 1 - eps, 1 + eps))`` averaged over a minibatch
        of ``train.minibatch_size`` transitions, one optimizer step (AdamW, gradient clipping at
        ``train.max_grad_norm``, EMA update) per minibatch, ``train.inner_epochs`` passes in a random order
        drawn from `generator`. The log-probs are recomputed in float32 with the std that drew each sample.
        With ``train.micro_batch_size`` each minibatch is forwarded and back-propagated in micro-batches of
        that many transitions, each loss weighted by its share of the minibatch (gradient accumulation: the
        same step, less activation memory). Under several processes the step follows the mean over every
        process's minibatch; the returned statistics are this
        process's, except ``policy/grad_norm``, which is the summed gradient's.

        Args:
            ro (:class:`samplers.Rollout`): the iteration's stored transitions, `M` rows.
            adv_all (`torch.Tensor` of shape `(M,)`, float32): advantage per transition (clipped, unitless).
            keep (`torch.Tensor` of shape `(M,)`, bool): transitions that enter the loss.
            table (:class:`PromptEmbeds`): prompt embeddings, row 0 the empty prompt (CFG), rows 1.. indexed
                by ``ro.cond``.
            generator (`torch.Generator`): the iteration's generator (minibatch order).

        Returns:
            `dict[str, float]`: means over optimizer steps of ``policy/*`` (loss, grad_norm, ratio, clip
            fractions, approx_kl, kl), ``policy/ratio_first_max_dev`` (the ratio's largest deviation from 1
            before the first optimizer step: 0 when the recomputation is exact), per-step ``diag/step_KK/*``
            and ``cost/trained_transitions``.
        """
        t = self.cfg.train
        rows = keep.nonzero().squeeze(1)
        tv = ro.select(rows)
        adv = adv_all[rows]  # (M',)
        stats: dict[str, list[float]] = defaultdict(list)
        per_step: dict[int, list[torch.Tensor]] = defaultdict(list)  # first epoch: the ratios per step
        grad_step: dict[int, list[torch.Tensor]] = defaultdict(list)  # first epoch: gradient norms per step
        # step weights normalised over the plan's trained steps (the same on every process), then kept rows
        gain = velocity_gain(ro) if t.step_weighting == "guard" else ro.std
        step_w = step_weights(t.step_weighting, gain, ro.std, ro.step, ro.trained) if len(rows) else None  # (M,)
        step_w = None if step_w is None else step_w[rows]  # (M',)
        velocity = self.model.velocity_fn(table, self.cfg.sampling.guidance_scale)  # CFG against table row 0
        optimizer_steps = 0
        self.model.transformer.train()
        for epoch, j, mb, total_rows in self._minibatches(len(tv), generator):
            weights = None if step_w is None else step_w[mb]
            if len(mb) == 0:  # this process has no transitions left, the others do: a zero gradient
                self._step_optimizer(None, stats)
                optimizer_steps += 1
                continue
            share = len(mb) / total_rows  # this process's part of the global mean (1 with one process)
            parts: dict[str, list[tuple[float, float]]] = defaultdict(list)  # (value, fraction of the minibatch)
            diag = (per_step, grad_step) if epoch == 0 else None
            for c, idx, frac in self._micro_batches(mb):  # gradient accumulation over micro-batches
                w = None if weights is None else weights[c:c + len(idx)]
                micro = self._ppo_micro_batch(velocity, tv.select(idx), adv[idx], w, frac * share, diag, j == 0 and c == 0)
                for k, x in micro.items():
                    parts[k].append((x, frac))
            merged = {k: max(x for x, _ in vals) if k == "policy/ratio_max_dev" else sum(x * f for x, f in vals)
                      for k, vals in parts.items()}  # the minibatch's statistics
            if optimizer_steps == 0:  # before any update (absent where this process's first step had no transitions)
                stats["policy/ratio_first_max_dev"].append(merged["policy/ratio_max_dev"])
            self._step_optimizer(merged["policy/loss"], stats)
            optimizer_steps += 1
            for k, x in merged.items():
                if k != "policy/loss":
                    stats[k].append(x)
        self.model.transformer.eval()
        out = {k: sum(v) / len(v) for k, v in stats.items()}
        out["policy/optimizer_steps"] = optimizer_steps
        out.update(step_diagnostics(per_step, grad_step, t.clip_range))
        out["cost/trained_transitions"] = len(tv) * t.inner_epochs
        return out

    def _ppo_micro_batch(self, velocity, sub, adv: torch.Tensor, weights: torch.Tensor | None, scale: float,
                         diag: tuple[dict, dict] | None, first: bool) -> dict[str, float]:
        """Forward and backward of one micro-batch of :meth:`optimize`: the clipped surrogate (plus the KL term)
        of the `m` transitions `sub`, back-propagated with weight `scale` (their share of the global minibatch).

        Args:
            velocity: the policy (:meth:`FlowModel.velocity_fn`); sub (:class:`samplers.Rollout`): `m` transitions.
            adv (`torch.Tensor` of shape `(m,)`, float32): their advantages; weights `(m,)` or None: step weights.
            diag: in the first epoch, ``(ratios, grad_norms)``, denoising step -> list of `(n,)` tensors, to
                which this micro-batch's per-step ratios (and gradient norms, ``train.step_grad_norms``) are
                appended; None in later epochs.
            first (`bool`): the iteration's first micro-batch (where ``step_grad_norms: params`` is measured).

        Returns:
            This micro-batch's ``policy/kl`` (with ``train.kl_beta``), ``policy/loss`` and :func:`losses.ppo_loss`'s statistics.
        """
        t = self.cfg.train
        present = sub.step.unique().tolist()  # denoising steps in this micro-batch
        v, log_prob, mean = self._policy_log_prob(velocity, sub)
        track_v = diag is not None and t.step_grad_norms == "velocity" and v.requires_grad
        if track_v:
            v.retain_grad()
        loss, st = ppo_loss(log_prob, sub.log_prob, adv, t.clip_range, weights)
        out = {}
        if diag is not None:
            ratio = torch.exp(log_prob.detach() - sub.log_prob)
            for k in present:
                diag[0][k].append(ratio[sub.step == k].cpu())
            if t.step_grad_norms == "params" and first:
                diag[1].update(self._param_grad_norms(sub, present, log_prob, adv, weights))
        if t.kl_beta > 0:
            kl = self._kl_to_reference(velocity, sub, v, mean)
            loss = loss + t.kl_beta * kl
            out["policy/kl"] = kl.item()
        self.accelerator.backward(loss * scale if scale != 1.0 else loss)
        if track_v and v.grad is not None:  # d loss / d v per transition, undoing the 1/m of the mean
            norms = v.grad.float().flatten(1).norm(dim=1).cpu() * len(sub) / scale
            for k in present:
                diag[1][k].append(norms[(sub.step == k).cpu()])
        out["policy/loss"] = loss.item()
        out.update({k: x.item() for k, x in st.items()})
        return out

    def _policy_log_prob(self, velocity, sub) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The current policy's velocity `(M, C, H, W)` (under ``run.mixed_precision``) at transitions `sub`,
        and the float32 log-prob `(M,)` and mean `(M, C, H, W)` of their recorded next states at the std that
        drew them (:func:`samplers.recompute_log_prob`); with ``train.ratio_norm`` the log-prob is GRPO-Guard's
        (arXiv 2510.22319) std-scaled, unbiased one, ``old + ratio_norm(...)``, so that ``exp(new - old)`` is its ratio."""
        with self._autocast():
            v = velocity(sub.state, sub.sigma, sub.cond)
        log_prob, mean = recompute_log_prob(sub, v)
        if self.cfg.train.ratio_norm:
            log_prob = sub.log_prob + ratio_norm(log_prob, sub.log_prob, mean, sub.mean, sub.std)
        return v, log_prob, mean

    def _kl_to_reference(self, velocity, sub, v: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
        """The KL penalty (scalar, before ``train.kl_beta``) of the policy's velocity `v` / step mean `mean` at
        transitions `sub` to the LoRA-disabled base's (``train.kl_type``: ``velocity`` -> :func:`losses.velocity_kl`,
        else the Gaussian steps' :func:`losses.kl_to_reference` at the recorded std; ``flow_grpo``: at the std per
        unit time, Flow-GRPO's code's KL)."""
        with torch.no_grad(), self.model.reference(), self._autocast():
            v_ref = velocity(sub.state, sub.sigma, sub.cond)
        if self.cfg.train.kl_type == "velocity":
            return velocity_kl(v, v_ref)
        std = sub.std  # flow_grpo: the SDE's sigma_t, as Flow-GRPO's code (its KL is the exact one times |dt|)
        if self.cfg.train.kl_type == "flow_grpo":
            std = std / (sub.sigma - sub.sigma_next).abs().sqrt()
        return kl_to_reference(mean, recompute_log_prob(sub, v_ref)[1], std)

    def _param_grad_norms(self, sub, steps: list[int], log_prob: torch.Tensor, adv: torch.Tensor,
                          weights: torch.Tensor | None) -> dict[int, list[torch.Tensor]]:
        """Norm of the gradient of each denoising step's mean PPO loss w.r.t. the trained parameters, on the
        first (micro-)batch of an iteration (``train.step_grad_norms: params``; one extra backward per step present)."""
        t = self.cfg.train
        params = [p for p in self.params.values() if p.requires_grad]
        out = {}
        for k in steps:
            m = sub.step == k
            loss_k, _ = ppo_loss(log_prob[m], sub.log_prob[m], adv[m], t.clip_range,
                                 None if weights is None else weights[m])
            grads = torch.autograd.grad(loss_k, params, retain_graph=True, allow_unused=True)
            sq = sum(g.float().pow(2).sum() for g in grads if g is not None)
            out[k] = [torch.as_tensor(sq).sqrt().reshape(1).cpu()]
        return out

