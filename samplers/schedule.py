"""Sampling schedules (sigmas) for rectified-flow models."""

from __future__ import annotations

import torch

__all__ = ["SPACINGS", "flow_sigmas", "respace_tail"]


def _shift(sigmas: torch.Tensor, shift: float) -> torch.Tensor:
    """SD3 time shift ``s' = shift s / (1 + (shift - 1) s)``; keeps 0 and 1 fixed."""
    return shift * sigmas / (1 + (shift - 1) * sigmas)


SPACINGS = ("sd3", "flux")
"""Step spacings of :func:`flow_sigmas`: those of diffusers' SD3 and FLUX pipelines."""


def flow_sigmas(
    num_steps: int, shift: float = 3.0, num_train_timesteps: int = 1000, spacing: str = "sd3"
) -> torch.Tensor:
    """Shifted sigma schedule ``t_0 = 1 > t_1 > ... > t_N = 0``, as diffusers builds it for SD3 or FLUX.

    The shift is SD3's timestep shift (Esser et al., arXiv 2403.03206, "resolution-dependent shifting"),
    ``shift(s) = shift s / (1 + (shift - 1) s)``; FLUX's dynamic shift ``exp(mu)`` is this one with ``shift = exp(mu)``.

    ``spacing="sd3"`` reproduces ``FlowMatchEulerDiscreteScheduler(shift=shift).set_timesteps(num_steps)`` (static
    shift, no dynamic shifting, no Karras/exponential/beta sigmas), the schedule of ``StableDiffusion3Pipeline``:

    1. ``sigma_min = shift(1 / num_train_timesteps)`` (the smallest training sigma, already shifted);
    2. ``s = linspace(1, sigma_min, num_steps)`` (diffusers spaces ``s * num_train_timesteps``);
    3. ``sigmas = shift(s)``, then append 0.

    (diffusers shifts the lower end twice; we keep that so schedules match the pipelines exactly.)

    ``spacing="flux"`` reproduces ``FluxPipeline``'s: ``shift(linspace(1, 1 / num_steps, num_steps))``, then 0 (a larger
    last sigma than SD3's spacing).

    Args:
        num_steps (`int`): number of denoising steps ``N``, `>= 1`.
        shift (`float`): time shift, `> 0`; 3.0 for SD3 / SD3.5, 1.0 for no shift.
        num_train_timesteps (`int`): the scheduler's training timesteps (1000 for every SD3-family model; unused by
            the FLUX spacing).
        spacing (`str`): one of :data:`SPACINGS`.

    Returns:
        `torch.Tensor` of shape `(num_steps + 1,)`, float32, on CPU, strictly decreasing from 1 to 0.

    Raises:
        ValueError: if `num_steps < 1`, `shift <= 0`, `num_train_timesteps < 1` or `spacing` is not in SPACINGS.
    """
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1; got {num_steps}")
    if shift <= 0:
        raise ValueError(f"shift must be > 0; got {shift}")
    if num_train_timesteps < 1:
        raise ValueError(f"num_train_timesteps must be >= 1; got {num_train_timesteps}")
    if spacing not in SPACINGS:
        raise ValueError(f"spacing must be one of {SPACINGS}; got {spacing!r}")
    if spacing == "flux":  # FluxPipeline: np.linspace(1, 1 / N, N), made float32 by the scheduler, then shifted
        unshifted = torch.linspace(1.0, 1.0 / num_steps, num_steps, dtype=torch.float64).float().double()
        return torch.cat([_shift(unshifted, shift).float(), torch.zeros(1, dtype=torch.float32)])  # (N + 1,)
    # diffusers computes its training sigmas in float32 and keeps the smallest as sigma_min.
    smallest = torch.tensor(1.0 / num_train_timesteps, dtype=torch.float32)
    sigma_min = _shift(smallest, shift).item()
    # diffusers spaces timesteps (sigma * num_train_timesteps) evenly, then divides back.
    timesteps = torch.linspace(num_train_timesteps, sigma_min * num_train_timesteps, num_steps, dtype=torch.float64)
    unshifted = timesteps / num_train_timesteps  # (N,)
    sigmas = _shift(unshifted, shift).to(torch.float32)  # (N,)
    return torch.cat([sigmas, torch.zeros(1, dtype=torch.float32)])  # (N + 1,)


def _unshift(sigmas: torch.Tensor, shift: float) -> torch.Tensor:
    """Inverse of :func:`_shift`: ``s = s' / (shift - (shift - 1) s')``."""
    return sigmas / (shift - (shift - 1) * sigmas)


def respace_tail(sigmas: torch.Tensor, keep: int, num_tail: int, shift: float = 3.0) -> torch.Tensor:
    """Keep the first `keep` steps of a schedule and re-space the rest into `num_tail` steps (MixGRPO-Flash).

    The tail goes from ``sigmas[keep]`` to 0 in `num_tail` steps evenly spaced in UNshifted time, then
    shifted, like the rest of an SD3 schedule (MixGRPO, arXiv 2507.21802, Sec. 3.3 "MixGRPO-Flash").

    Args:
        sigmas (`torch.Tensor` of shape `(N + 1,)`): a schedule from :func:`flow_sigmas` with this `shift`.
        keep (`int`): steps kept unchanged, `0 <= keep < N`.
        num_tail (`int`): steps after them, `>= 1`.
        shift (`float`): the schedule's time shift, `> 0`.

    Returns:
        `torch.Tensor` of shape `(keep + num_tail + 1,)`, float32, strictly decreasing from ``sigmas[0]`` to 0.

    Raises:
        ValueError: if `keep`, `num_tail` or `shift` is out of range, or `sigmas` is not 1-d.
    """
    if sigmas.ndim != 1:
        raise ValueError(f"sigmas must have shape (N + 1,); got {tuple(sigmas.shape)}")
    num_steps = sigmas.shape[0] - 1
    if not 0 <= keep < num_steps:
        raise ValueError(f"keep must lie in [0, {num_steps}); got {keep}")
    if num_tail < 1:
        raise ValueError(f"num_tail must be >= 1; got {num_tail}")
    if not shift > 0:
        raise ValueError(f"shift must be > 0; got {shift}")
    start = _unshift(sigmas[keep].double(), shift)
    tail = _shift(
        torch.linspace(float(start), 0.0, num_tail + 1, dtype=torch.float64), shift
    ).float()  # (num_tail + 1,)
    return torch.cat([sigmas[:keep].float(), tail])
