"""Sampling schedules (sigmas) for rectified-flow models."""

from __future__ import annotations

import torch

__all__ = ["flow_sigmas"]


def _shift(sigmas: torch.Tensor, shift: float) -> torch.Tensor:
    """SD3 time shift ``s' = shift s / (1 + (shift - 1) s)``; keeps 0 and 1 fixed."""
    return shift * sigmas / (1 + (shift - 1) * sigmas)


def flow_sigmas(num_steps: int, shift: float = 3.0, num_train_timesteps: int = 1000) -> torch.Tensor:
    """Shifted sigma schedule ``t_0 = 1 > t_1 > ... > t_N = 0``, as diffusers builds it for SD3.

    Reproduces ``FlowMatchEulerDiscreteScheduler(shift=shift).set_timesteps(num_steps)`` (static shift,
    no dynamic shifting, no Karras/exponential/beta sigmas):

    1. ``sigma_min = shift(1 / num_train_timesteps)`` (the smallest training sigma, already shifted);
    2. ``s = linspace(1, sigma_min, num_steps)`` (diffusers spaces ``s * num_train_timesteps``);
    3. ``sigmas = shift(s)`` with ``shift(s) = shift s / (1 + (shift - 1) s)``, then append 0.

    (diffusers shifts the lower end twice; we keep that so schedules match the pipelines exactly.)

    Args:
        num_steps (`int`): number of denoising steps ``N``, `>= 1`.
        shift (`float`): time shift, `> 0`; 3.0 for SD3 / SD3.5, 1.0 for no shift.
        num_train_timesteps (`int`): the scheduler's training timesteps (1000 for every SD3-family model).

    Returns:
        `torch.Tensor` of shape `(num_steps + 1,)`, float32, on CPU, strictly decreasing from 1 to 0.

    Raises:
        ValueError: if `num_steps < 1`, `shift <= 0` or `num_train_timesteps < 1`.
    """
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1; got {num_steps}")
    if shift <= 0:
        raise ValueError(f"shift must be > 0; got {shift}")
    if num_train_timesteps < 1:
        raise ValueError(f"num_train_timesteps must be >= 1; got {num_train_timesteps}")
    # diffusers computes its training sigmas in float32 and keeps the smallest as sigma_min.
    smallest = torch.tensor(1.0 / num_train_timesteps, dtype=torch.float32)
    sigma_min = _shift(smallest, shift).item()
    # diffusers spaces timesteps (sigma * num_train_timesteps) evenly, then divides back.
    timesteps = torch.linspace(num_train_timesteps, sigma_min * num_train_timesteps, num_steps, dtype=torch.float64)
    unshifted = timesteps / num_train_timesteps  # (N,)
    sigmas = _shift(unshifted, shift).to(torch.float32)  # (N,)
    return torch.cat([sigmas, torch.zeros(1, dtype=torch.float32)])  # (N + 1,)
