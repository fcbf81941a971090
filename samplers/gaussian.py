"""The Gaussian step every stochastic kernel ends with: its output record, its per-sample log-density, and the
draw of ``x' = mean + std eps`` (or the scoring of a given ``x'``).

Shared by the flow kernels (:mod:`samplers.kernels`) and the DDPM-family kernels (:mod:`samplers.ddim`).
Imports torch only.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = ["StepOutput", "gaussian_kernel", "gaussian_log_prob"]

_HALF_LOG_2PI = 0.5 * math.log(2.0 * math.pi)


@dataclass
class StepOutput:
    """What one kernel step returns.

    Attributes:
        prev_sample (`torch.Tensor` of shape `(B, C, H, W)`, float32): the next state ``x'`` at ``t'``
            (diffusers' name: the sample one step closer to data). When the kernel was given
            ``prev_sample`` this is that tensor, cast to float32.
        mean (`torch.Tensor` of shape `(B, C, H, W)`, float32, or `None`): mean of the step's Gaussian;
            `None` for deterministic kernels.
        std (`torch.Tensor` of shape `(B,)`, float32, or `None`): standard deviation of the step's
            Gaussian, one per sample, `> 0`; `None` for deterministic kernels.
        log_prob (`torch.Tensor` of shape `(B,)`, float32, or `None`): ``log N(x'; mean, std^2)``
            averaged over all non-batch dims (see :func:`gaussian_log_prob`); `None` for deterministic
            kernels.
    """

    prev_sample: torch.Tensor
    mean: torch.Tensor | None = None
    std: torch.Tensor | None = None
    log_prob: torch.Tensor | None = None


def _per_sample(value, sample: torch.Tensor, name: str) -> torch.Tensor:
    """Broadcast a float, 0-d or `(B,)` value to float32 of shape `(B, 1, ..., 1)` matching `sample`."""
    batch = sample.shape[0]
    out = torch.as_tensor(value, dtype=torch.float32, device=sample.device)
    if out.ndim == 0:
        out = out.expand(batch)
    elif out.shape != (batch,):
        raise ValueError(
            f"{name} must be a float, a 0-d tensor or a tensor of shape ({batch},); got shape {tuple(out.shape)}"
        )
    return out.reshape(batch, *([1] * (sample.ndim - 1)))  # (B, 1, 1, 1)


def gaussian_log_prob(x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """Per-sample Gaussian log-density, REDUCED BY MEAN over every non-batch dim.

    ``log_prob[b] = mean_{c,h,w} [ -(x - mean)^2 / (2 std^2) - log(std) - 0.5 log(2 pi) ]``

    The mean (not the sum) over latent dims is what Flow-GRPO (arXiv 2505.05470) and DanceGRPO
    (arXiv 2505.07818) use; their PPO clip ranges (~1e-4) assume it. ``x`` is detached: gradients flow
    only through ``mean`` (and ``std``).

    Args:
        x (`torch.Tensor` of shape `(B, C, H, W)` or any `(B, ...)`): the sampled value.
        mean (`torch.Tensor`, same shape as `x`): Gaussian mean.
        std (`torch.Tensor` of shape `(B,)`, or broadcastable to `x`): standard deviation, `> 0`
            (0 gives -inf/nan).

    Returns:
        `torch.Tensor` of shape `(B,)`, float32.

    Raises:
        ValueError: if `x` and `mean` differ in shape.
    """
    if x.shape != mean.shape:
        raise ValueError(f"x and mean must have the same shape; got {tuple(x.shape)} and {tuple(mean.shape)}")
    x = x.detach().float()
    mean = mean.float()
    std = std.float()
    if std.ndim == 1:
        std = std.reshape(-1, *([1] * (x.ndim - 1)))  # (B, 1, 1, 1)
    log_density = -((x - mean) ** 2) / (2 * std**2) - torch.log(std) - _HALF_LOG_2PI  # (B, C, H, W)
    return log_density.mean(dim=tuple(range(1, x.ndim)))  # (B,)


def _draw(sample, mean, std, generator, prev_sample, noise) -> StepOutput:
    """``x' = mean + std eps`` (or the given `prev_sample`) and its log-prob; `std` is `(B, 1, 1, 1)`.
    A zero std (CPS onto ``t' = 0``) gives log-prob 0. A negative or NaN std is refused when it lives on
    the CPU; on an accelerator that check would be a host sync per step, so there the kernels rely on
    :func:`samplers.sample`'s and :class:`samplers.StepPlan`'s checks of the sigmas and noise levels."""
    if prev_sample is not None and noise is not None:
        raise ValueError("pass at most one of prev_sample (score a given sample) and noise (draw a new one)")
    if prev_sample is None:
        if noise is None:
            device = generator.device if generator is not None else sample.device
            noise = torch.randn(sample.shape, generator=generator, device=device, dtype=torch.float32)
        elif noise.shape != sample.shape:
            raise ValueError(f"noise must have shape {tuple(sample.shape)}; got {tuple(noise.shape)}")
        prev_sample = mean + std * noise.to(device=sample.device, dtype=torch.float32)
    elif prev_sample.shape != sample.shape:
        raise ValueError(f"prev_sample must have shape {tuple(sample.shape)}; got {tuple(prev_sample.shape)}")
    prev_sample = prev_sample.float()
    std = std.reshape(-1)  # (B,)
    if std.device.type == "cpu" and not bool(
        (std >= 0).all()
    ):  # also catches NaN: e.g. sigma_next > sigma, a negative noise level or eta > 1
        raise ValueError(
            f"the step's std must be finite and >= 0; got {std.detach().cpu().tolist()[:8]} "
            "(check that sigma_next < sigma and that noise_level / eta is in range)"
        )
    safe = torch.where(std > 0, std, torch.ones_like(std))
    log_prob = torch.where(std > 0, gaussian_log_prob(prev_sample, mean, safe), torch.zeros_like(std))
    return StepOutput(prev_sample, mean, std, log_prob)


def gaussian_kernel(moments: Callable) -> Callable:
    """A stochastic transition kernel with the one signature of :data:`samplers.KERNELS`, made of the function that
    gives its Gaussian's moments: ``moments(x, v, t, t_next, level, sigma_max) -> (mean, std)``.

    The kernel is ``kernel(sample, velocity, sigma, sigma_next, noise_level, sigma_max=None, *, generator=None,
    prev_sample=None, noise=None) -> StepOutput``: it casts `sample` and `velocity` to float32 (``x``, ``v``, `(B, C,
    H, W)`), broadcasts `sigma`, `sigma_next` and `noise_level` (each a float, a 0-d or a `(B,)` tensor) to float32
    ``t``, ``t_next``, ``level`` of shape `(B, 1, ..., 1)`, passes `sigma_max` as given, and draws ``x' = mean + std
    eps`` from the returned ``mean`` `(B, C, H, W)` and ``std`` `(B, 1, ..., 1)` (or scores the given `prev_sample`)
    with its log-prob. It keeps the name and docstring of `moments`, which document it as a kernel.

    Returns:
        the kernel: its :class:`StepOutput` has `prev_sample`, `mean` `(B, C, H, W)`, `std` `(B,)`, `log_prob` `(B,)`,
        all float32 (log-prob 0 where the std is 0).

    Raises:
        ValueError: (the kernel) both `prev_sample` and `noise` given, a shape that does not match, or a negative or
            NaN std on the CPU.
    """

    def kernel(
        sample: torch.Tensor,
        velocity: torch.Tensor,
        sigma,
        sigma_next,
        noise_level,
        sigma_max=None,
        *,
        generator: torch.Generator | None = None,
        prev_sample: torch.Tensor | None = None,
        noise: torch.Tensor | None = None,
    ) -> StepOutput:
        x, v = sample.float(), velocity.float()
        t, t_next = _per_sample(sigma, x, "sigma"), _per_sample(sigma_next, x, "sigma_next")  # (B, 1, 1, 1) each
        mean, std = moments(x, v, t, t_next, _per_sample(noise_level, x, "noise_level"), sigma_max)
        return _draw(x, mean, std, generator, prev_sample, noise)

    for name in ("__module__", "__name__", "__qualname__", "__doc__"):
        setattr(kernel, name, getattr(moments, name))
    kernel.moments = moments
    return kernel
