"""DiffusionNFT (arXiv 2509.16117), as a mixin of :class:`flowrl.trainer.Trainer` (``train.method: nft``).

G deterministic samples per prompt, group-relative advantages turned into optimality weights, and the
negative-aware flow-matching loss on noised copies of the samples: no log-probs and no trajectories.
"""

from __future__ import annotations

import time
from collections import defaultdict

import torch

from samplers import ode_sample

from .losses import nft_loss, optimality_weights


class NFTMixin:
    """DiffusionNFT's iteration and update. Uses the trainer's sampling helpers, scoring, advantages,
    minibatches, optimizer step and ``old_policy`` (None without ``train.nft.old_decay``)."""

    def nft_step(self, it: int) -> dict[str, float]:
        """One DiffusionNFT iteration (arXiv 2509.16117, Algorithm 1): sample, score, train on the forward process.

        ``sampling.group_size`` deterministic samples (``sampling.num_steps`` steps of Euler, or of
        DPM-Solver++ 2M with ``train.nft.solver``, the published code's; CFG at
        ``sampling.guidance_scale``) of each of ``sampling.prompts_per_iteration`` prompts are drawn by the
        old policy (the current one, or with ``train.nft.old_decay > 0`` its soft-updated copy) and scored;
        the group-relative advantages (gathered over processes, as in GRPO) become optimality weights
        ``r = clip(A / A_max) / 2 + 1/2`` (:func:`losses.optimality_weights`). Every image of a group with
        reward variance (with ``train.nft.keep_flat_groups`` every image, a flat group's at ``r = 1/2``, as the
        published code) is noised ``train.nft.timesteps`` times, ``x_t = (1 - t) x0 + t eps`` with ``t`` drawn
        uniformly from the sampler's grid times ``>= train.nft.min_time`` (0: all of them; 1 = noise), and the
        velocity at CFG ``train.nft.guidance_scale`` (by default the sampling guidance; 1: the conditional
        velocity alone, trained off-policy on guided samples) is trained on them with :func:`losses.nft_loss`:
        minibatches of ``train.minibatch_size`` rows per process (the same optimizer steps on every process,
        as :meth:`flowrl.grpo.GRPOMixin.optimize`), ``train.inner_epochs`` passes, under ``run.mixed_precision`` (no ratio needs
        float32 here). Then ``theta_old <- d theta_old + (1 - d) theta`` (:meth:`_old_decay`). Needs no log-probs and no
        trajectories, only the final latents.

        Args:
            it (`int`): the 0-based iteration (with ``run.seed`` it fixes prompts and every random draw).

        Returns:
            `dict[str, float]`: the keys of :meth:`flowrl.trainer.Trainer.step` (``reward/*``, ``advantage/*``, ``cost/*``,
            ``time/*``, ``policy/loss``, ``policy/grad_norm``, ``policy/optimizer_steps``, with a soft-updated
            sampling policy ``policy/old_decay``, the decay applied); ``cost/nfe`` counts
            the sampling rows and the old-policy rows of the loss, each twice under CFG.

        Raises:
            ValueError: if a reward returns the wrong shape, NaN or inf (the reward is named).
        """
        cfg, model, t = self.cfg, self.model, self.cfg.train
        gen = self._generator(it)
        metas = self.sample_prompts(it)
        t0 = time.time()
        table = model.encode([""] + [m["prompt"] for m in metas])
        cond = torch.arange(len(metas), device=self.device).repeat_interleave(cfg.sampling.group_size) + 1  # (B,)
        noise = torch.randn((len(cond), *model.latent_shape), generator=gen).to(self.device)
        velocity = model.velocity_fn(table, cfg.sampling.guidance_scale)  # guided, against the empty prompt (row 0)
        sigmas, size = self.sigmas.to(self.device), cfg.sampling.batch_size
        kernel = "ode" if t.nft.solver == "euler" else t.nft.solver
        with torch.no_grad(), self._holding(self.old_policy), self._autocast():
            x0 = ode_sample(self._chunked(velocity, size), noise, cond, sigmas, kernel)
        images = self._decode(x0)
        t1 = time.time()
        image_prompt = (cond - 1).cpu()
        judged = self._judge_calls()
        scores = self.score(images, image_prompt, metas)
        judged = self._judge_calls() - judged
        t2 = time.time()
        total = self.accelerator.gather(scores.total.to(self.device)).cpu()
        adv, zero, adv_stats = self._group_advantages(scores, total, image_prompt, len(metas))
        mine = slice(self.accelerator.process_index * len(cond), (self.accelerator.process_index + 1) * len(cond))
        adv, keep = adv[mine], ~zero[mine]
        if t.nft.keep_flat_groups:  # a flat group's advantages are 0: r = 1/2 pulls theta towards the old policy
            keep = torch.ones_like(keep)
        rows = keep.nonzero().squeeze(1).repeat_interleave(t.nft.timesteps)  # (N,) noised copies of each kept image
        grid = self.sigmas[:-1]  # the sampler's own times, in (0, 1]; it starts at 1, so the filter keeps one
        grid = grid[grid >= t.nft.min_time]
        times = grid[torch.randint(0, len(grid), (len(rows),), generator=gen)].to(self.device)
        eps = torch.randn((len(rows), *model.latent_shape), generator=gen).to(self.device)
        x_0, c = x0[rows.to(self.device)], cond[rows.to(self.device)]
        x_t = (1 - times.view(-1, 1, 1, 1)) * x_0 + times.view(-1, 1, 1, 1) * eps
        r = optimality_weights(adv[rows], t.adv_clip_max).to(self.device)
        trained_scale = cfg.sampling.guidance_scale if t.nft.guidance_scale is None else t.nft.guidance_scale
        trained = model.velocity_fn(table, trained_scale)
        with torch.no_grad(), self._holding(self.old_policy), self._autocast():
            v_old = self._chunked(trained, size)(x_t, times, c) if len(rows) else x_t
        stats = self._nft_update(trained, x_t, times, c, x_0, v_old, r, gen)
        if self.old_policy is not None:
            stats["policy/old_decay"] = self._old_decay()
            self._move_towards_params(self.old_policy, stats["policy/old_decay"])
        t3 = time.time()
        metrics = self._reward_metrics(it, total, scores, metas, image_prompt, judged)
        nfe = len(cond) * cfg.sampling.num_steps * model.cfg_rows(cfg.sampling.guidance_scale)  # sampling
        nfe += len(rows) * model.cfg_rows(trained_scale)  # the old policy's rows of the loss
        metrics.update({**adv_stats, "cost/nfe": nfe,
                        "cost/trained_transitions": len(rows) * t.inner_epochs,
                        "time/sample_s": t1 - t0, "time/score_s": t2 - t1, "time/train_s": t3 - t2,
                        **stats})
        return metrics

    def _old_decay(self) -> float:
        """The soft update's decay in [0, 1): ``train.nft.old_decay``, or with ``train.nft.decay_ramp`` ``min(ramp *
        optimizer steps so far, old_decay)`` (the published code ramps 0.001 per step up to 0.5 for GenEval)."""
        nft = self.cfg.train.nft
        if nft.decay_ramp == 0:
            return nft.old_decay
        state = next(iter(self.optimizer.state.values()), {})  # AdamW counts its steps (restored on resume)
        return min(nft.decay_ramp * float(state.get("step", 0)), nft.old_decay)

    def _nft_update(self, velocity, x_t: torch.Tensor, times: torch.Tensor, cond: torch.Tensor, x_0: torch.Tensor,
                    v_old: torch.Tensor, r: torch.Tensor, generator: torch.Generator) -> dict[str, float]:
        """DiffusionNFT's optimizer steps (arXiv 2509.16117, Eq. 8: :func:`losses.nft_loss`) on `N` noised rows:
        ``train.inner_epochs`` passes of minibatches (:meth:`_minibatches`, micro-batched as :meth:`flowrl.grpo.GRPOMixin.optimize`).

        Args:
            velocity: the policy at the trained guidance (:meth:`FlowModel.velocity_fn`), trained here.
            x_t, x_0, v_old (`torch.Tensor` of shape `(N, C, H, W)`): noised rows, their clean samples, and the
                old policy's velocity at them.
            times (`torch.Tensor` of shape `(N,)`, float32 in (0, 1]): the rows' noise times; cond `(N,)` long
                their prompt rows; r `(N,)` float32 in [0, 1] their optimality weights.
            generator: the iteration's generator (minibatch order).

        Returns:
            ``policy/loss`` and ``policy/grad_norm`` (means over steps) and ``policy/optimizer_steps``.
        """
        t = self.cfg.train
        stats: dict[str, list[float]] = defaultdict(list)
        steps = 0
        self.model.transformer.train()
        for _, _, mb, total_rows in self._minibatches(len(x_t), generator):
            steps += 1
            if len(mb) == 0:  # this process has no rows left, the others do: a zero gradient
                self._step_optimizer(None, stats)
                continue
            share = len(mb) / total_rows  # this process's part of the global minibatch
            parts = []
            for _, idx, frac in self._micro_batches(mb):  # gradient accumulation
                with self._autocast():
                    v = velocity(x_t[idx], times[idx], cond[idx])
                loss = nft_loss(v, v_old[idx], x_t[idx], x_0[idx], times[idx], r[idx], t.nft.beta, t.adv_clip_max)
                scale = frac * share
                self.accelerator.backward(loss * scale if scale != 1.0 else loss)
                parts.append(loss.item() * frac)
            self._step_optimizer(sum(parts), stats)
        self.model.transformer.eval()
        return {**{k: sum(v) / len(v) for k, v in stats.items()}, "policy/optimizer_steps": steps}

