"""The parts the forward-process methods share (DiffusionNFT, AWM, DGPO, Diffusion-DPO, CRD): they train on clean
samples, not on the sampler's transitions, so they need no log-probs and take samples from any sampler.

- :meth:`ForwardProcess.rollout`: ``sampling.group_size`` deterministic samples per prompt (Euler, or DPM-Solver++ 2M),
  drawn with :meth:`ForwardProcess.rollout_weights` (the current policy, or an old or reference copy);
- :meth:`ForwardProcess.noised`: fresh noise and the forward process ``x_t = (1 - t) x0 + t eps`` at given times;
- :meth:`ForwardProcess.grid_times`: times drawn from the sampler's own grid;
- :func:`flow_matching_error`: the per-row velocity error ``mean_d (v - (eps - x0))^2``, the quantity DPO, DGPO, AWM and
  CRD compare between policies;
- :func:`logit_normal_times`: logit-normal noise times on the shifted schedule (Diffusion-DPO, SFT, Flow-OPD's SFT cold
  start).
"""

from __future__ import annotations

import torch

from ..fields import check
from ..samplers import ode_sample
from .base import FinalSamples, Method, Rewards


def flow_matching_error(velocity: torch.Tensor, x0: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
    """The per-row flow-matching error ``mean over (C, [F,] H, W) of (v - (eps - x0))^2`` in float32 (float64 inputs:
    float64).

    Args:
        velocity, x0, eps (`torch.Tensor` of shape `(N, *latent_shape)`): a network's velocity at ``x_t = (1 - t) x0
            + t eps``, the clean sample and the noise.

    Returns:
        `torch.Tensor` of shape `(N,)` (with the velocity's gradient).

    Raises:
        ValueError: if the shapes differ.
    """
    if not velocity.shape == x0.shape == eps.shape:
        raise ValueError(f"velocity {tuple(velocity.shape)}, x0 {tuple(x0.shape)} and eps {tuple(eps.shape)} differ")
    dtype = torch.promote_types(velocity.dtype, torch.float32)  # float32, or float64 for float64 inputs
    return (velocity.to(dtype) - (eps.to(dtype) - x0.to(dtype))).pow(2).flatten(1).mean(dim=1)


def logit_normal_times(count: int, shift: float, generator: torch.Generator) -> torch.Tensor:
    """`count` logit-normal noise times on the time-shifted schedule: ``u = sigmoid(z)``, ``z ~ N(0, 1)`` drawn from
    `generator`, ``t = s (1 - u) / (1 + (s - 1)(1 - u))`` (flow_grpo's logit-normal index into SD3's shifted grid),
    clamped to ``[1e-3, 1 - 1e-3]``.

    Args:
        count (`int`): >= 0. shift (`float`): the schedule's shift ``s`` > 0 (``sampling.shift``; 1: none).
        generator (`torch.Generator`): a CPU generator.

    Returns:
        `torch.Tensor` of shape `(count,)`, float32, on the CPU.
    """
    u = torch.sigmoid(torch.randn(count, generator=generator))
    t = shift * (1 - u) / (1 + (shift - 1) * (1 - u))
    return t.clamp(1e-3, 1 - 1e-3)


class ForwardProcess(Method):
    """Base of the methods trained on clean samples (see the module docstring). Args: as :class:`Method`."""

    requires = ("forward_process",)
    """The flow-matching loss at arbitrary times from samples taken as ``x_0``: the DDPM families refuse it."""

    @classmethod
    def check_final_samples(cls, cfg, why: str = "it trains on final samples") -> None:
        """Refuse, naming the key, the GRPO-only settings a method on final samples cannot use: a rollout shape other
        than flat groups, a sliding SDE window, and ``train.kl_beta`` (the methods weigh their own KL)."""
        s = cfg.sampling
        for key, value, off in (
            ("sampling.shape", s.shape, "flat"),
            ("sampling.window.size", s.window.size, 0),
            ("train.kl_beta", cfg.train.kl_beta, 0.0),
        ):
            check(value == off, key, f"{off!r} with train.method {cls.name!r} ({why})", value)

    @staticmethod
    def check_base_reference(cfg, key: str, value: float) -> None:
        """Refuse a KL weight `value` (config key `key`) to the base without a LoRA (the base is the LoRA disabled)."""
        check(
            value == 0 or cfg.model.lora_rank > 0,
            key,
            "0 unless model.lora_rank > 0 (the reference is the base: the LoRA disabled)",
            value,
        )

    def rollout_weights(self) -> dict[str, torch.Tensor] | None:
        """The weights the rollouts are drawn with (None: the current policy)."""
        return self.sampling_weights()

    def solver(self) -> str:
        """The deterministic sampler's kernel: ``ode`` (Euler) by default."""
        return "ode"

    def rollout(self, metas: list[dict], generator: torch.Generator) -> FinalSamples:
        """``G`` deterministic samples per prompt by :meth:`rollout_weights`: their final latents and prompt-table rows."""
        samples = self._sample(metas, generator)
        samples.images = self.decode(samples.x0)
        return samples

    @classmethod
    def chunked_rollout(cls, cfg) -> bool:
        """Where the rollout is this class's own (not a subclass's, such as the direct-reward methods')."""
        return cls.rollout is ForwardProcess.rollout

    def rollout_in_chunks(self, metas: list[dict], generator: torch.Generator, size: int, on_chunk) -> FinalSamples:
        """:meth:`rollout` in chunks of `size` images (:meth:`Method.rollout_in_chunks`), ``images`` empty."""
        return self._sample(metas, generator, size, on_chunk)

    def _sample(self, metas: list[dict], generator: torch.Generator, size: int = 0, on_chunk=None) -> FinalSamples:
        """:meth:`rollout` without decoding (``images`` empty); with `on_chunk`, the ODE runs on chunks of `size`
        images, each chunk's final latents and prompt slots handed to ``on_chunk(x0, image_prompt)`` once solved."""
        cfg, model = self.cfg, self.model
        table = model.prompt_table(metas)
        prompt_index = torch.arange(len(metas), device=self.device).repeat_interleave(cfg.sampling.group_size)  # (B,)
        cond = table.rows(prompt_index)  # (B,)
        noise = torch.randn((len(cond), *model.latent_shape), generator=generator).to(self.device)
        velocity = model.velocity_fn(table, cfg.sampling.guidance_scale)  # guided, against the empty prompt
        sigmas, size = self.sigmas.to(self.device), size or len(cond)
        with torch.no_grad(), self.policy.holding(self.rollout_weights()), self.policy.autocast():
            parts = []
            for start in range(0, len(cond), size):  # one chunk of every row without on_chunk
                rows = slice(start, start + size)
                parts.append(ode_sample(self.chunked(velocity), noise[rows], cond[rows], sigmas, self.solver()))
                if on_chunk is not None:
                    on_chunk(parts[-1], prompt_index[rows].cpu())
            x0 = parts[0] if len(parts) == 1 else torch.cat(parts)  # (B, *latent_shape)
        nfe = len(cond) * cfg.sampling.num_steps * model.cfg_rows(cfg.sampling.guidance_scale)
        return FinalSamples(torch.empty(0), prompt_index.cpu(), nfe, x0, cond, table)

    def advantages(self, samples: FinalSamples, rewards: Rewards, generator: torch.Generator):
        """Group z-scores over every process's images (:meth:`Method.group_advantages`); this process's share,
        ``(adv (B,), keep (B,) bool: groups with reward variance, stats)``."""
        adv, zero, stats = self.group_advantages(rewards)
        return adv[rewards.mine], ~zero[rewards.mine], stats

    def stand_in(self, rows: torch.Tensor, spare: torch.Tensor | None = None) -> tuple[torch.Tensor, bool]:
        """The samples an update runs its forwards on: `rows` (this process's kept samples, `(K,)` long) and True, or
        in lockstep (:attr:`flowrl.policy.Policy.lockstep`) where this process kept none, `spare` (default sample 0,
        ``[0]``) and False. The stand-in gives the zero-weight padding micro-batches (:meth:`Method.optimizer_steps`,
        ``pad_row`` 0) and the padded forwards of the held copies (:meth:`Method.chunked`'s ``pad``) a row, so that
        this process calls the transformer as the others do; the method trains and counts 0 rows of it."""
        if len(rows) or not self.policy.lockstep:
            return rows, True
        return (torch.zeros(1, dtype=rows.dtype, device=rows.device) if spare is None else spare), False

    def grid_times(self, count: int, generator: torch.Generator, min_time: float = 0.0) -> torch.Tensor:
        """`count` times drawn uniformly from the sampler's grid ``sigmas[:-1]`` (in (0, 1], starting at 1) at or
        above `min_time`, on the device."""
        grid = self.sigmas[:-1]
        grid = grid[grid >= min_time]
        return grid[torch.randint(0, len(grid), (count,), generator=generator)].to(self.device)

    def noised(self, x0: torch.Tensor, times: torch.Tensor, generator: torch.Generator):
        """Fresh noise `eps` (drawn on the CPU from `generator`) and ``x_t = (1 - t) x0 + t eps`` at `times` `(N,)`.

        Returns:
            ``(x_t, eps)``, each of `x0`'s shape `(N, *latent_shape)`.
        """
        eps = torch.randn(x0.shape, generator=generator).to(x0.device)
        t = times.view((-1,) + (1,) * (x0.ndim - 1))  # (N, 1, ...) over any latent shape
        return (1 - t) * x0 + t * eps, eps
