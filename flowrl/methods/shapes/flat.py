"""``sampling.shape: flat``: ``sampling.group_size`` SDE rollouts per prompt (Flow-GRPO, arXiv 2505.05470; DanceGRPO,
arXiv 2505.07818), with an optional MixGRPO sliding window (arXiv 2507.21802: SDE and training on a window of steps,
ODE elsewhere, and with ``flash_ratio`` MixGRPO-Flash's re-spaced DPM-Solver++(2M) tail); advantages are group
z-scores over every process's images.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...fields import check, config_section, setting
from ...samplers import (
    WINDOW_SCHEDULES,
    SlidingWindow,
    mix_plan,
    sample,
    sample_in_chunks,
    sample_shared_noise,
    start_latents,
)
from ..base import Rewards, SDESamples
from .base import RolloutShape, register_shape


@config_section("sampling", "window", "MixGRPO's sliding window (flat groups)")
@dataclass
class WindowConfig:
    """``sampling.window.*``: MixGRPO (arXiv 2507.21802): SDE and training on a sliding window of steps, ODE
    elsewhere (flat groups only)."""

    size: int = setting(0, "steps in the window; 0 = no window (every step SDE, Flow-GRPO / DanceGRPO)")
    schedule: str = setting(
        "progressive",
        "how the window moves: progressive | decay | exp_decay | random | fixed (flowrl.samplers.windows)",
    )
    stride: int = setting(1, "steps the window moves per shift (0 keeps it where it starts)")
    interval: int = setting(25, "iterations per shift (MixGRPO's tau)")
    min_interval: int = setting(1, "the smallest tau of the 'decay' schedule")
    roll_back: bool = setting(True, "return to step 0 after the last step")
    flash_ratio: float = setting(
        0.0,
        "MixGRPO-Flash: > 0 re-spaces the steps after the window into this fraction of "
        "them, solved with DPM-Solver++(2M)",
    )

    def __post_init__(self):
        check(self.size >= 0, "sampling.window.size", ">= 0", self.size)
        check(self.schedule in WINDOW_SCHEDULES, "sampling.window.schedule", "|".join(WINDOW_SCHEDULES), self.schedule)
        check(self.interval >= 1, "sampling.window.interval", ">= 1", self.interval)
        check(self.stride >= 0, "sampling.window.stride", ">= 0 (0 keeps the window where it starts)", self.stride)
        check(self.min_interval >= 1, "sampling.window.min_interval", ">= 1", self.min_interval)
        check(0 <= self.flash_ratio <= 1, "sampling.window.flash_ratio", "in [0, 1]", self.flash_ratio)


@register_shape("flat", "flat groups, with sampling.window")
class FlatShape(RolloutShape):
    """Flat groups: every step SDE, or MixGRPO's window of SDE steps (``sampling.window``); one initial noise per
    image, or per group with ``sampling.shared_noise`` (the group's deterministic prefix then runs once)."""

    @classmethod
    def check_config(cls, cfg) -> None:
        sampling = cfg.sampling
        check(
            sampling.window.size < sampling.num_steps,
            "sampling.window.size",
            f"< sampling.num_steps ({sampling.num_steps})",
            sampling.window.size,
        )

    def __init__(self, method):
        super().__init__(method)
        sampling = self.cfg.sampling
        self.plan = self.only_trainable(self.sigmas, self.sde_plan())
        w = sampling.window
        self.window = (
            None
            if w.size == 0
            else SlidingWindow(
                sampling.num_steps,
                w.size,
                w.schedule,
                w.stride,
                w.interval,
                w.min_interval,
                w.roll_back,
                seed=self.cfg.run.seed,
            )
        )

    def current_plan(self):
        """This iteration's ``(sigmas (N' + 1,), plan)``: every step SDE, or the MixGRPO window (with its Flash
        tail)."""
        if self.window is None:
            return self.sigmas, self.plan
        sampling = self.cfg.sampling
        sigmas, plan = mix_plan(
            self.sigmas,
            self.window.steps,
            sampling.kernel,
            sampling.noise_level,
            sampling.window.flash_ratio or None,
            sampling.shift,
        )
        return sigmas, self.only_trainable(sigmas, plan)

    def rollout(self, metas: list[dict], generator: torch.Generator) -> SDESamples:
        with torch.no_grad():
            ro, table = self._sample(metas, generator)
            return SDESamples(self.method.decode(ro.final), ro.group.cpu(), self.nfe(ro), ro, table)

    @classmethod
    def chunked_rollout(cls, cfg) -> bool:
        """One initial noise per image samples in chunks; ``sampling.shared_noise`` (a group's shared prefix) not."""
        return not cfg.sampling.shared_noise

    def rollout_in_chunks(self, metas: list[dict], generator: torch.Generator, size: int, on_chunk) -> SDESamples:
        """:meth:`rollout` in chunks of `size` images (:func:`flowrl.samplers.sample_in_chunks`), ``images`` empty."""
        with torch.no_grad():
            ro, table = self._sample(metas, generator, size, on_chunk)
            return SDESamples(torch.empty(0), ro.group.cpu(), self.nfe(ro), ro, table)

    def _sample(self, metas: list[dict], generator: torch.Generator, size: int = 0, on_chunk=None):
        """The iteration's :class:`flowrl.samplers.Rollout` and prompt table; with `on_chunk`, sampled in chunks of
        `size` images, each chunk's final latents and prompt slots handed to ``on_chunk(latents, image_prompt)``."""
        sampling = self.cfg.sampling
        table = self.model.prompt_table(metas)
        velocity = self.velocity(table)
        roots = torch.arange(len(metas), device=self.device)  # (P,) one group per prompt
        if sampling.shared_noise:  # one initial noise per group
            noise = torch.randn((len(metas), *self.model.latent_shape), generator=generator).to(self.device)
            noise = start_latents(noise, self.sigmas[0])  # the state at the first time (noise itself at sigma 1)
        sigmas, plan = self.current_plan()
        sigmas = sigmas.to(self.device)
        with self.policy.autocast():
            if sampling.shared_noise:  # the group's deterministic prefix once per group
                ro = sample_shared_noise(
                    velocity,
                    noise,
                    table.rows(roots),
                    roots,
                    sigmas,
                    plan,
                    sampling.group_size,
                    generator=generator,
                    ode_velocity_fn=self.ode_velocity(velocity),
                )
            else:
                prompt_index = roots.repeat_interleave(sampling.group_size)  # (B,)
                noise = torch.randn((len(prompt_index), *self.model.latent_shape), generator=generator)
                noise = start_latents(noise, self.sigmas[0])
                args = (velocity, noise.to(self.device), table.rows(prompt_index), prompt_index, sigmas, plan)
                if on_chunk is None:
                    ro = sample(*args, generator=generator, ode_velocity_fn=self.ode_velocity(velocity))
                else:
                    ro = sample_in_chunks(
                        *args,
                        size,
                        lambda rows, final: on_chunk(final, prompt_index[rows].cpu()),
                        generator=generator,
                        ode_velocity_fn=self.ode_velocity(velocity),
                    )
        return ro, table

    def advantages(self, samples: SDESamples, rewards: Rewards):
        """Group z-scores over every process's images (:meth:`Method.group_advantages`); each transition takes its
        image's, and groups without reward variance leave the loss."""
        ro = samples.rollout
        adv, zero, stats = self.method.group_advantages(rewards)
        keep = ro.trained & ~zero[rewards.mine].to(ro.trained.device)[ro.leaf]
        return adv[rewards.mine].to(self.device)[ro.leaf], keep, stats

    def end_iteration(self, stats: dict) -> None:
        """Advance MixGRPO's sliding window (recording ``sampling/window_start``)."""
        if self.window is not None:
            stats["sampling/window_start"] = self.window.start
            self.window.advance()

    def state_dict(self) -> dict:
        return {"window": self.window.state_dict() if self.window else None}

    def load_state_dict(self, state: dict) -> None:
        if self.window is not None and state.get("window"):
            self.window.load_state_dict(state["window"])
