"""Per-step transition kernels for rectified-flow sampling.

Notation (docs/methods.md): ``x_t = (1 - t) x_0 + t eps`` with ``t = 1`` pure noise; the model predicts
the velocity ``v ~ eps - x_0``. One step goes from ``t`` (``sigma``) to ``t'`` (``sigma_next``) with
``dt = t' - t < 0``.

Every kernel is a small pure function with one signature::

    kernel(sample, velocity, sigma, sigma_next, noise_level, sigma_max, *, generator, prev_sample, noise)
        -> StepOutput

and no hidden state (no step counter): everything it needs is passed in. All maths runs in float32
whatever the input dtype (bf16 overflows in the log-density), and every output is float32. ``sigma``,
``sigma_next``, ``noise_level`` and ``sigma_max`` may each be a Python float, a 0-d tensor or a ``(B,)``
tensor (one value per sample, so samples of one batch may sit at different times).

A stochastic kernel is written as the moments of its Gaussian step, ``(mean, std)`` from float32 ``x, v`` and
``(B, 1, 1, 1)`` times, and :func:`samplers.gaussian.gaussian_kernel` makes it a kernel of that signature (the casts,
the draw of ``x'`` and its log-prob); its docstring describes the kernel's call.

Kernels are registered once, with their properties, in :data:`KERNEL_SPECS` (:func:`register_kernel`);
:data:`KERNELS`, :data:`STOCHASTIC_KERNELS`, :data:`UNIT_ETA_KERNELS` and :data:`MULTISTEP_KERNELS` are live views
of it. A new kernel is one function plus one ``register_kernel`` call.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from .ddim import flow_ddim_step, flow_ddpm_step
from .gaussian import StepOutput, _per_sample, gaussian_kernel, gaussian_log_prob

__all__ = [
    "KERNELS",
    "KERNEL_SPECS",
    "KernelSpec",
    "MULTISTEP_KERNELS",
    "STOCHASTIC_KERNELS",
    "UNIT_ETA_KERNELS",
    "StepOutput",
    "cps_step",
    "dance_sde_step",
    "dpm_solver_2m_step",
    "flow_sde_step",
    "gaussian_log_prob",
    "ode_step",
    "register_kernel",
]


def ode_step(
    sample: torch.Tensor,
    velocity: torch.Tensor,
    sigma,
    sigma_next,
    noise_level=None,
    sigma_max=None,
    *,
    generator: torch.Generator | None = None,
    prev_sample: torch.Tensor | None = None,
    noise: torch.Tensor | None = None,
) -> StepOutput:
    """Deterministic Euler step of the probability-flow ODE: ``x' = x + dt v``, ``dt = t' - t``.

    Args:
        sample (`torch.Tensor` of shape `(B, C, H, W)`): current state ``x`` at time ``t``.
        velocity (`torch.Tensor` of shape `(B, C, H, W)`): model velocity ``v`` at ``(x, t)``.
        sigma (float, 0-d or `(B,)` tensor): current time ``t`` in `(0, 1]`.
        sigma_next (float, 0-d or `(B,)` tensor): next time ``t'`` in `[0, t)`.
        noise_level, sigma_max, generator, prev_sample, noise: ignored; accepted so that every kernel in
            :data:`KERNELS` has one signature.

    Returns:
        :class:`StepOutput` with `prev_sample` `(B, C, H, W)` float32 and `mean`, `std`, `log_prob` `None`.

    Raises:
        ValueError: if a sigma has a shape other than scalar or `(B,)`.
    """
    sample = sample.float()
    dt = _per_sample(sigma_next, sample, "sigma_next") - _per_sample(sigma, sample, "sigma")  # (B, 1, 1, 1)
    return StepOutput(prev_sample=sample + dt * velocity.float())


def _sde_moments(x: torch.Tensor, v: torch.Tensor, t: torch.Tensor, dt: torch.Tensor, diffusion: torch.Tensor):
    """Euler-Maruyama step of the reverse SDE with diffusion coefficient ``diffusion`` (= sigma_t): ``(mean, std)``.

    ``mean = x + [v + sigma_t^2 / (2t) (x + (1 - t) v)] dt``, ``std = sigma_t sqrt(-dt)``, where
    ``x + (1 - t) v`` is the noise estimate ``x1_hat``. `x`, `v` `(B, C, H, W)`; `t`, `dt`, `diffusion` `(B, 1, 1, 1)`,
    all float32.
    """
    x1_hat = x + (1 - t) * v  # (B, C, H, W)
    mean = x + (v + diffusion**2 / (2 * t) * x1_hat) * dt  # (B, C, H, W)
    std = diffusion * torch.sqrt(-dt)  # (B, 1, 1, 1)
    return mean, std


@gaussian_kernel
def flow_sde_step(x, v, t, t_next, level, sigma_max):
    """Flow-GRPO SDE step (Liu et al., arXiv 2505.05470), the marginal-preserving SDE of the flow ODE.

    ``sigma_t = a sqrt(t / (1 - t))`` with ``a = noise_level``; at ``t == 1`` the denominator uses
    ``1 - sigma_max`` instead (``sigma_max`` = the schedule's second sigma ``t_1``), as Flow-GRPO's code
    does, to avoid dividing by zero. Then, with ``dt = t' - t < 0``::

        mean = x + [v + sigma_t^2 / (2t) (x + (1 - t) v)] dt
        std  = sigma_t sqrt(-dt)
        x'   = mean + std * eps,   eps ~ N(0, I)
        log_prob = mean over (C, H, W) of log N(x'; mean, std^2)

    Args:
        sample (`torch.Tensor` of shape `(B, C, H, W)`): current state ``x`` at time ``t``.
        velocity (`torch.Tensor` of shape `(B, C, H, W)`): model velocity at ``(x, t)``; gradients flow
            through it into `mean` and `log_prob`.
        sigma (float, 0-d or `(B,)` tensor): current time ``t`` in `(0, 1]`.
        sigma_next (float, 0-d or `(B,)` tensor): next time ``t'`` in `[0, t)`.
        noise_level (float, 0-d or `(B,)` tensor): ``a`` (0.7 for SD3.5, 0.9 for FLUX), `> 0`.
        sigma_max (float, 0-d or `(B,)` tensor): ``t_1``, used in place of ``t`` where ``t == 1``; `< 1`.
        generator (`torch.Generator`, optional): source of ``eps``; noise is drawn on its device in
            float32, then moved to `sample.device`.
        prev_sample (`torch.Tensor` of shape `(B, C, H, W)`, optional): if given, no sampling: score this
            ``x'`` instead (the trainer recomputes log-probs of stored transitions under the new policy).
        noise (`torch.Tensor` of shape `(B, C, H, W)`, optional): use this ``eps`` instead of drawing one.

    Returns:
        :class:`StepOutput` with `prev_sample`, `mean` `(B, C, H, W)`, `std` `(B,)`, `log_prob` `(B,)`,
        all float32.

    Raises:
        ValueError: if both `prev_sample` and `noise` are given, or a shape does not match.
    """
    if sigma_max is None:
        raise ValueError("flow_sde_step needs sigma_max (the schedule's t_1, used where t == 1)")
    t_denominator = torch.where(t == 1, _per_sample(sigma_max, x, "sigma_max"), t)  # (B, 1, 1, 1)
    return _sde_moments(x, v, t, t_next - t, level * torch.sqrt(t / (1 - t_denominator)))


@gaussian_kernel
def dance_sde_step(x, v, t, t_next, level, sigma_max):
    """DanceGRPO SDE step (Xue et al., arXiv 2505.07818): the same SDE with constant diffusion ``eta``.

    With ``eta = noise_level`` (0.3 on FLUX) and ``dt = t' - t < 0``::

        mean = x + dt (v + eta^2 (x + (1 - t) v) / (2t))
        std  = eta sqrt(-dt)
        x'   = mean + std * eps
        log_prob = mean over (C, H, W) of log N(x'; mean, std^2)

    Args:
        sample, velocity, sigma, sigma_next, generator, prev_sample, noise: as in :func:`flow_sde_step`.
        noise_level (float, 0-d or `(B,)` tensor): ``eta``, `> 0`.
        sigma_max: ignored (constant diffusion needs no guard at ``t = 1``).

    Returns:
        :class:`StepOutput` with `prev_sample`, `mean` `(B, C, H, W)`, `std` `(B,)`, `log_prob` `(B,)`,
        all float32.

    Raises:
        ValueError: if both `prev_sample` and `noise` are given, or a shape does not match.
    """
    return _sde_moments(x, v, t, t_next - t, level)


@gaussian_kernel
def cps_step(x, v, t, t_next, level, sigma_max):
    """Coefficients-preserving sampling step, CPS (Wang & Yu, arXiv 2509.05952, Eq. 8).

    With ``x0_hat = x - t v``, ``x1_hat = x + (1 - t) v``, ``eta = noise_level`` in `(0, 1]` and
    ``s = t' sin(eta pi / 2)``::

        mean = (1 - t') x0_hat + sqrt(t'^2 - s^2) x1_hat
        std  = s
        x'   = mean + s eps
        log_prob = mean over (C, H, W) of log N(x'; mean, s^2)

    so ``x'`` keeps the coefficients ``(1 - t', t')`` of data and noise exactly. The log-prob is the true
    Gaussian one (Flow-GRPO's code keeps only ``-mean((x' - mean)^2)``, a ratio ``2 s^2`` times flatter in
    log space, hence its clip range 1e-5). On a step to ``t' = 0`` the std is 0: the step returns
    ``x0_hat`` with log-prob 0 and should not be trained.

    Args:
        As :func:`flow_sde_step`; `sigma_max` is ignored.

    Returns:
        :class:`StepOutput` with `prev_sample`, `mean` `(B, C, H, W)`, `std` `(B,)`, `log_prob` `(B,)`,
        all float32.

    Raises:
        ValueError: if both `prev_sample` and `noise` are given, or a shape does not match.
    """
    s = t_next * torch.sin(level * math.pi / 2)  # (B, 1, 1, 1)
    x0_hat, x1_hat = x - t * v, x + (1 - t) * v
    mean = (1 - t_next) * x0_hat + torch.sqrt((t_next**2 - s**2).clamp(min=0)) * x1_hat
    return mean, s


def dpm_solver_2m_step(
    sample: torch.Tensor,
    velocity: torch.Tensor,
    sigma,
    sigma_next,
    prev_x0: torch.Tensor | None = None,
    prev_sigma=None,
    final: bool = False,
) -> StepOutput:
    """DPM-Solver++(2M) step (Lu et al., arXiv 2211.01095, Alg. 2, midpoint form) for a flow model.

    For ``x_t = (1 - t) x_0 + t eps``: ``alpha_t = 1 - t``, ``sigma_t = t``, ``lambda_t = log(alpha_t / t)``,
    data prediction ``x0_hat = x - t v``. With ``h = lambda_{t'} - lambda_t``::

        first order:  x' = (t' / t) x - alpha_{t'} (exp(-h) - 1) x0_hat
        second order: D = x0_hat + (x0_hat - x0_prev) / (2 r),  r = (lambda_t - lambda_prev) / h,
                      x' = (t' / t) x - alpha_{t'} (exp(-h) - 1) D

    First order when there is no previous prediction, when the previous time is 1 (``r`` infinite) or on
    the ``final`` step (diffusers' ``lower_order_final``). A first-order step from ``t = 1`` is exactly an
    Euler step; a step to ``t' = 0`` returns ``x0_hat`` (or ``D``). Deterministic: no log-prob.
    Matches diffusers' ``DPMSolverMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
    solver_order=2, algorithm_type="dpmsolver++", solver_type="midpoint")`` on the same sigmas.

    Args:
        sample (`torch.Tensor` of shape `(B, C, H, W)`): ``x`` at ``t``.
        velocity (`torch.Tensor` of shape `(B, C, H, W)`): model velocity at ``(x, t)``.
        sigma, sigma_next (float or 0-d tensor): ``t`` in `(0, 1]` and ``t'`` in `[0, t)`.
        prev_x0 (`torch.Tensor` of shape `(B, C, H, W)`, optional): ``x0_hat`` of the previous step.
        prev_sigma (float or 0-d tensor, optional): that step's time, `> t`.
        final (`bool`): force first order (the last step of a schedule).

    Returns:
        :class:`StepOutput` with `prev_sample` `(B, C, H, W)` float32; `mean`, `std`, `log_prob` `None`.

    Raises:
        ValueError: if `sigma`, `sigma_next` or `prev_sigma` is not a single number (one time for the whole
            batch), ``sigma_next >= sigma`` or ``prev_sigma <= sigma``.
    """
    sample, velocity = sample.float(), velocity.float()
    for name, value in (("sigma", sigma), ("sigma_next", sigma_next), ("prev_sigma", prev_sigma)):
        if torch.is_tensor(value) and value.numel() != 1:
            raise ValueError(
                f"dpm_solver_2m_step: {name} must be one time for the whole batch (a float or 0-d "
                f"tensor); got shape {tuple(value.shape)}"
            )
    t, t_next = float(sigma), float(sigma_next)
    if not t_next < t:
        raise ValueError(f"dpm_solver_2m_step: sigma_next={t_next} must be < sigma={t}")
    if prev_sigma is not None and not float(prev_sigma) > t:
        raise ValueError(
            f"dpm_solver_2m_step: prev_sigma={float(prev_sigma)} (the previous step's time) must be > sigma={t}"
        )
    x0 = sample - t * velocity  # (B, C, H, W)

    def lam(u: float) -> float:
        return math.log(1 - u) - math.log(u) if 0 < u < 1 else (-math.inf if u >= 1 else math.inf)

    h = lam(t_next) - lam(t)
    decay = -1.0 if math.isinf(h) else math.expm1(-h)  # exp(-h) - 1
    ratio = 0.0 if t_next == 0 else t_next / t
    d = x0
    if prev_x0 is not None and prev_sigma is not None and not final and float(prev_sigma) < 1 and not math.isinf(h):
        r = (lam(t) - lam(float(prev_sigma))) / h
        d = x0 + (x0 - prev_x0.float()) / (2 * r)
    return StepOutput(prev_sample=ratio * sample - (1 - t_next) * decay * d)


@dataclass(frozen=True)
class KernelSpec:
    """A registered transition kernel and its properties (:func:`register_kernel`).

    Attributes:
        fn: the kernel function (the signature of :func:`flow_sde_step`; a multistep kernel's adds ``prev_x0`` and
            ``prev_sigma``: :func:`dpm_solver_2m_step`).
        stochastic (`bool`): its step is a Gaussian with a log-prob: the only kernels a transition can be trained on.
        unit_eta (`bool`): its noise level is an ``eta`` in `(0, 1]`, and its step onto ``t' = 0`` has std 0.
        multistep (`bool`): deterministic, and it also reads the previous step's data prediction.
        summary (`str`): a few words on the kernel (its paper), shown beside its name in ``sampling.kernel``'s help.
    """

    fn: Callable
    stochastic: bool = False
    unit_eta: bool = False
    multistep: bool = False
    summary: str = ""


KERNEL_SPECS: dict[str, KernelSpec] = {}
"""Kernel name -> :class:`KernelSpec`: the one registry of kernels; :data:`KERNELS` and the sets below are views."""


def register_kernel(
    name: str,
    fn: Callable,
    *,
    stochastic: bool = False,
    unit_eta: bool = False,
    multistep: bool = False,
    summary: str = "",
) -> Callable:
    """Register a transition kernel under `name` with its properties (see :class:`KernelSpec`); returns `fn`.
    ``sampling.kernel`` and step plans validate names against this registry.

    Raises:
        ValueError: `name` is registered already, or ``unit_eta`` without ``stochastic``, or ``multistep`` with it.
    """
    if name in KERNEL_SPECS:
        raise ValueError(f"kernel {name!r} is registered already")
    if unit_eta and not stochastic:
        raise ValueError(f"kernel {name!r}: unit_eta describes a stochastic kernel's noise level")
    if multistep and stochastic:
        raise ValueError(f"kernel {name!r}: a multistep kernel is deterministic")
    KERNEL_SPECS[name] = KernelSpec(fn, stochastic, unit_eta, multistep, summary)
    return fn


class _KernelView(Mapping):
    """A live, read-only view of :data:`KERNEL_SPECS`: the names whose spec passes `keep`, mapped to their functions."""

    def __init__(self, keep: Callable[[KernelSpec], bool], doc: str):
        self._keep, self.__doc__ = keep, doc

    def __getitem__(self, name: str) -> Callable:
        spec = KERNEL_SPECS.get(name)
        if spec is None or not self._keep(spec):
            raise KeyError(name)
        return spec.fn

    def __iter__(self):
        return (name for name, spec in KERNEL_SPECS.items() if self._keep(spec))

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __repr__(self) -> str:
        return f"{sorted(self)}"


register_kernel("ode", ode_step, summary="Euler")
register_kernel("flow_sde", flow_sde_step, stochastic=True, summary="Flow-GRPO")  # arXiv 2505.05470
register_kernel("dance_sde", dance_sde_step, stochastic=True, summary="DanceGRPO")  # arXiv 2505.07818
register_kernel("cps", cps_step, stochastic=True, unit_eta=True, summary="coefficients-preserving")  # arXiv 2509.05952
register_kernel("ddim", flow_ddim_step, stochastic=True, unit_eta=True, summary="DDPO")  # arXiv 2305.13301
register_kernel("ddpm", flow_ddpm_step, stochastic=True, unit_eta=True, summary="ancestral")  # arXiv 2006.11239
register_kernel(
    "dpm_solver_2m", dpm_solver_2m_step, multistep=True, summary="DPM-Solver++ 2M"
)  # MixGRPO-Flash, arXiv 2507.21802

KERNELS = _KernelView(lambda k: not k.multistep, "Single-step kernel name -> function (signature of flow_sde_step).")
MULTISTEP_KERNELS = _KernelView(
    lambda k: k.multistep,
    "Deterministic kernels that also read the previous step's data prediction (the sampler passes it).",
)
STOCHASTIC_KERNELS = _KernelView(
    lambda k: k.stochastic, "Kernels whose step is a Gaussian with a log-prob (the only trainable ones)."
)
UNIT_ETA_KERNELS = _KernelView(
    lambda k: k.unit_eta,
    "Stochastic kernels whose noise level is an eta in (0, 1] and whose step onto t' = 0 has std 0.",
)
