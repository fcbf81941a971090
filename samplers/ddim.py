"""The DDPM family (SD 1.x / 2.x, SDXL) in the samplers: the DDIM step with noise ``eta`` and its log-prob, and the
change of variables that makes a variance-preserving (VP) model a flow model, so that every step plan, tree and
probe of :mod:`samplers` runs on it unchanged.

**The DDIM step** (Song et al., arXiv 2010.02502, Eq. 12; its log-prob as in DDPO, Black et al., arXiv 2305.13301).
A VP model sees ``x = sqrt(a) x_0 + sqrt(1 - a) eps`` (``a`` = ``alphas_cumprod`` at the step's timestep, ``a'`` at
the next) and predicts ``eps`` (``"epsilon"``), ``x_0`` (``"sample"``) or ``v = sqrt(a) eps - sqrt(1 - a) x_0``
(``"v_prediction"``); :func:`vp_predictions` turns any of them into ``(x0_hat, eps_hat)``. Then::

    std  = eta sqrt((1 - a') / (1 - a)) sqrt(1 - a / a')                       (diffusers: eta sqrt(variance))
    mean = sqrt(a') x0_hat + sqrt(1 - a' - std^2) eps_hat
    x'   = mean + std z,  z ~ N(0, I);   log_prob = mean over (C, H, W) of log N(x'; mean, std^2)

which is ``diffusers.DDIMScheduler.step(eta=...)`` (``clip_sample=False``, no thresholding; tested equal).

**DDIM in flow variables.** With ``s(a) = sqrt(a) + sqrt(1 - a)``, the flow time and state

    sigma = sqrt(1 - a) / s(a),    x_flow = x / s(a)

give ``x_flow = (1 - sigma) x_0 + sigma eps``: the rectified-flow interpolation of :mod:`samplers.kernels`
(``1 - sigma = sqrt(a) / s``). Inversely ``a = (1 - sigma)^2 / ((1 - sigma)^2 + sigma^2)`` and
``1 / s = sqrt((1 - sigma)^2 + sigma^2)``. The flow velocity of a prediction is ``v = eps_hat - x0_hat``, with
``x0_hat = x_flow - sigma v`` and ``eps_hat = x_flow + (1 - sigma) v`` as in the flow kernels
(:func:`flow_velocity`). Divided by ``s(a')``, the DDIM step becomes

    mean_flow = (1 - sigma') x0_hat + sqrt(sigma'^2 - std_flow^2) eps_hat,    std_flow = std / s(a')

(the coefficients-preserving form of CPS, arXiv 2509.05952, with DDIM's std): :func:`flow_ddim_step`, registered as
kernel ``"ddim"``, which evaluates the square root without the difference of squares (it cancels at ``sigma = 1``). At ``eta = 0`` it is ``(1 - sigma') x0_hat + sigma' eps_hat = x_flow + (sigma' - sigma) v``:
exactly the flow Euler step (:func:`samplers.ode_step`), so deterministic DDIM is the ``"ode"`` kernel on the flow
grid ``sigma(a_k)``, and a VP model behind an adapter that returns ``v`` is sampled by the flow machinery as the
stock DDIM pipeline samples it (tests: ``tests/test_ddim.py`` checks the identities to 1e-5 on random inputs,
``tests/test_sd15.py`` the whole sampler against ``StableDiffusionPipeline`` to 1e-4). Classifier-free guidance
commutes with the change: ``v`` is affine in ``eps_hat`` (or the v-prediction) at fixed ``x``.

A log-prob in flow variables is the VP one plus ``log s(a')`` per dimension (the Jacobian of ``x' -> x' / s``),
a constant of the step: PPO ratios, and the KL ``(mean - mean_ref)^2 / (2 std^2)``, are the same in both.

**The DDPM (ancestral) step** (Ho et al., arXiv 2006.11239, Eqs. 6-7): the posterior ``q(x' | x, x0_hat)`` with
``alpha_t = a / a'``, ``beta_t = 1 - alpha_t``::

    mean = sqrt(a') beta_t / (1 - a) x0_hat + sqrt(alpha_t) (1 - a') / (1 - a) x
    std  = sqrt((1 - a') / (1 - a) beta_t)

which is ``diffusers.DDPMScheduler.step`` with ``variance_type="fixed_small"`` (:func:`ddpm_step`; tested equal). Its
std is DDIM's at ``eta = 1``, and with ``eps_hat`` derived from the same ``x0_hat`` its mean is DDIM's too (expand
``sqrt(1 - a' - std^2) = (1 - a') sqrt(alpha_t) / sqrt(1 - a)``): DDPO's "eta 1 is DDPM" holds exactly, the two
differ only in rounding and in the grid's end (``DDPMScheduler`` steps last onto ``a' = 1``). In flow variables it is
kernel ``"ddpm"`` (:func:`flow_ddpm_step`).

Two ends differ from a flow schedule and are handled by the caller: the stock pipeline starts from unit noise as
the state at its first timestep (``x_flow = noise / s(a_0)``, :func:`start_latents`; the identity at
``sigma = 1``), and it decodes the state at ``a_final`` (``final_alpha_cumprod``: ``sigma_N > 0`` unless the
scheduler sets alpha to one), i.e. ``x = s(a_N) x_flow`` (the adapter's decode).

Imports torch only (and :mod:`samplers.gaussian`).
"""

from __future__ import annotations

import torch

from .gaussian import StepOutput, _draw, _per_sample, gaussian_kernel

__all__ = [
    "PREDICTION_TYPES",
    "ddim_std",
    "ddim_step",
    "ddpm_step",
    "flow_ddim_step",
    "flow_ddpm_step",
    "flow_sigma",
    "flow_velocity",
    "start_latents",
    "vp_alpha",
    "vp_predictions",
    "vp_scale",
]

PREDICTION_TYPES = ("epsilon", "v_prediction", "sample")
"""What a VP model's network predicts (diffusers' ``prediction_type``)."""


def flow_sigma(alpha_prod: torch.Tensor) -> torch.Tensor:
    """Flow time of a VP noise level: ``sigma = sqrt(1 - a) / (sqrt(a) + sqrt(1 - a))``.

    Args:
        alpha_prod (`torch.Tensor` of any shape, float): ``a`` (``alphas_cumprod``) in `[0, 1]`.

    Returns:
        `torch.Tensor`, same shape, float64 if the input is, else float32: ``sigma`` in `[0, 1]` (1 at ``a = 0``,
        0 at ``a = 1``), decreasing in ``a``.
    """
    a = alpha_prod if alpha_prod.dtype == torch.float64 else alpha_prod.float()
    return (1 - a).sqrt() / (a.sqrt() + (1 - a).sqrt())


def vp_alpha(sigma: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`flow_sigma`: ``a = (1 - sigma)^2 / ((1 - sigma)^2 + sigma^2)``.

    Args:
        sigma (`torch.Tensor` of any shape, float32): flow time in `[0, 1]`.

    Returns:
        `torch.Tensor`, same shape and dtype: ``a`` in `[0, 1]`.
    """
    return (1 - sigma) ** 2 / ((1 - sigma) ** 2 + sigma**2)


def vp_scale(sigma: torch.Tensor) -> torch.Tensor:
    """``s = sqrt(a) + sqrt(1 - a) = 1 / sqrt((1 - sigma)^2 + sigma^2)``: the VP state is ``x = s x_flow``.

    Args:
        sigma (`torch.Tensor` of any shape, float32): flow time in `[0, 1]`.

    Returns:
        `torch.Tensor`, same shape and dtype, in `[1, sqrt(2)]`; exactly 1 at ``sigma`` 0 and 1.
    """
    return torch.rsqrt((1 - sigma) ** 2 + sigma**2)


def start_latents(noise: torch.Tensor, sigma) -> torch.Tensor:
    """The flow state a VP pipeline starts from: unit noise taken as the state at the first timestep,
    ``x_flow = noise / s(a_0) = noise sqrt((1 - sigma_0)^2 + sigma_0^2)``.

    At ``sigma_0 = 1`` (every flow schedule) the factor is exactly 1 and `noise` is returned as it is.

    Args:
        noise (`torch.Tensor` of shape `(B, C, H, W)` or any `(B, ...)`, float32): unit Gaussian noise.
        sigma (float or 0-d tensor): the schedule's first time ``sigma_0`` in `(0, 1]`.

    Returns:
        `torch.Tensor`, same shape, float32.

    Raises:
        ValueError: if `sigma` is not a single value in `(0, 1]`.
    """
    value = float(sigma)
    if not 0 < value <= 1:
        raise ValueError(f"start_latents: sigma must be one time in (0, 1]; got {value}")
    if value == 1.0:
        return noise
    return noise * float(vp_scale(torch.tensor(value, dtype=torch.float64)).reciprocal())


def vp_predictions(
    sample: torch.Tensor, model_output: torch.Tensor, alpha_prod, prediction_type: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x0_hat, eps_hat)`` of a VP model's output, as ``DDIMScheduler.step`` derives them.

    ``"epsilon"``: ``x0 = (x - sqrt(1 - a) eps) / sqrt(a)``; ``"sample"``: ``eps = (x - sqrt(a) x0) / sqrt(1 - a)``;
    ``"v_prediction"``: ``x0 = sqrt(a) x - sqrt(1 - a) v``, ``eps = sqrt(a) v + sqrt(1 - a) x``
    (Salimans & Ho, arXiv 2202.00512, Eq. 10).

    Args:
        sample (`torch.Tensor` of shape `(B, C, H, W)`): the VP state ``x`` at ``a``.
        model_output (`torch.Tensor` of shape `(B, C, H, W)`): the network's prediction.
        alpha_prod (float, 0-d or `(B,)` tensor): ``a`` in `(0, 1)`.
        prediction_type (`str`): one of :data:`PREDICTION_TYPES`.

    Returns:
        `(x0_hat, eps_hat)`, each `(B, C, H, W)` float32.

    Raises:
        ValueError: for an unknown `prediction_type`.
    """
    x, out = sample.float(), model_output.float()
    a = _per_sample(alpha_prod, x, "alpha_prod")  # (B, 1, 1, 1)
    if prediction_type == "epsilon":
        return (x - (1 - a).sqrt() * out) / a.sqrt(), out
    if prediction_type == "sample":
        return out, (x - a.sqrt() * out) / (1 - a).sqrt()
    if prediction_type == "v_prediction":
        return a.sqrt() * x - (1 - a).sqrt() * out, a.sqrt() * out + (1 - a).sqrt() * x
    raise ValueError(f"prediction_type must be one of {PREDICTION_TYPES}; got {prediction_type!r}")


def flow_velocity(sample: torch.Tensor, model_output: torch.Tensor, sigma, prediction_type: str) -> torch.Tensor:
    """The flow velocity ``v = eps_hat - x0_hat`` of a VP model's output, in flow variables.

    With ``x = s x_flow`` (the network's input) and ``1 - sigma = sqrt(a) / s``, ``sigma = sqrt(1 - a) / s``:
    ``"epsilon"``: ``v = (eps - x_flow) / (1 - sigma)``; ``"sample"``: ``v = (x_flow - x0) / sigma``;
    ``"v_prediction"``: ``eps_hat - x0_hat`` of :func:`vp_predictions` on the VP state (``x0_hat`` and ``eps_hat``
    are the same in both variables).

    Args:
        sample (`torch.Tensor` of shape `(B, C, H, W)`): the flow state ``x_flow`` at ``sigma``.
        model_output (`torch.Tensor` of shape `(B, C, H, W)`): the network's prediction on ``s x_flow``.
        sigma (float, 0-d or `(B,)` tensor): flow time in `(0, 1)` (``"epsilon"`` needs ``sigma < 1``,
            ``"sample"`` ``sigma > 0``).
        prediction_type (`str`): one of :data:`PREDICTION_TYPES`.

    Returns:
        `torch.Tensor` of shape `(B, C, H, W)`, float32.

    Raises:
        ValueError: for an unknown `prediction_type`.
    """
    x, out = sample.float(), model_output.float()
    t = _per_sample(sigma, x, "sigma")  # (B, 1, 1, 1)
    if prediction_type == "epsilon":
        return (out - x) / (1 - t)
    if prediction_type == "sample":
        return (x - out) / t
    if prediction_type == "v_prediction":  # vp_predictions' formulas with sqrt(a) = (1 - t) s, sqrt(1 - a) = t s
        s = vp_scale(t)  # (B, 1, 1, 1); sqrt(1 - a) from t itself, not from 1 - vp_alpha(t) (cancels near t = 0)
        vp_x, root_a, root_1ma = x * s, (1 - t) * s, t * s
        x0_hat, eps_hat = root_a * vp_x - root_1ma * out, root_a * out + root_1ma * vp_x
        return eps_hat - x0_hat
    raise ValueError(f"prediction_type must be one of {PREDICTION_TYPES}; got {prediction_type!r}")


def ddim_std(alpha_prod: torch.Tensor, alpha_prod_prev: torch.Tensor, eta: torch.Tensor) -> torch.Tensor:
    """DDIM's standard deviation ``eta sqrt((1 - a') / (1 - a)) sqrt(1 - a / a')`` (arXiv 2010.02502, Eq. 16).

    Args:
        alpha_prod, alpha_prod_prev, eta (`torch.Tensor`, broadcastable, float32): ``a``, ``a' > a`` and ``eta >= 0``.

    Returns:
        `torch.Tensor`, the broadcast shape, float32, `>= 0` (0 at ``eta = 0``).
    """
    variance = (1 - alpha_prod_prev) / (1 - alpha_prod) * (1 - alpha_prod / alpha_prod_prev)
    return eta * variance.clamp(min=0).sqrt()


def _ddim_mean(x0_hat, eps_hat, alpha_prod_prev, std):
    """``sqrt(a') x0_hat + sqrt(1 - a' - std^2) eps_hat`` (all broadcastable float32)."""
    return alpha_prod_prev.sqrt() * x0_hat + (1 - alpha_prod_prev - std**2).clamp(min=0).sqrt() * eps_hat


def ddim_step(
    sample: torch.Tensor,
    model_output: torch.Tensor,
    alpha_prod,
    alpha_prod_prev,
    eta,
    prediction_type: str = "epsilon",
    *,
    generator: torch.Generator | None = None,
    prev_sample: torch.Tensor | None = None,
    noise: torch.Tensor | None = None,
) -> StepOutput:
    """One DDIM step of a VP model with noise ``eta`` and its Gaussian log-prob (DDPO, arXiv 2305.13301, Eq. 4;
    DDIM arXiv 2010.02502, Eq. 12), in the model's own variables::

        (x0_hat, eps_hat) = vp_predictions(x, model_output, a, prediction_type)
        std  = eta sqrt((1 - a') / (1 - a)) sqrt(1 - a / a')
        mean = sqrt(a') x0_hat + sqrt(1 - a' - std^2) eps_hat
        x'   = mean + std z;   log_prob = mean over (C, H, W) of log N(x'; mean, std^2)

    Equal to ``DDIMScheduler.step(model_output, t, x, eta=eta, variance_noise=z)`` with ``clip_sample=False``
    (``a`` = ``alphas_cumprod[t]``, ``a'`` that of ``t - T // N`` or ``final_alpha_cumprod``). No hidden state.

    Args:
        sample (`torch.Tensor` of shape `(B, C, H, W)`): the VP state ``x`` at ``a``.
        model_output (`torch.Tensor` of shape `(B, C, H, W)`): the network's prediction; gradients flow through
            it into `mean` and `log_prob`.
        alpha_prod, alpha_prod_prev (float, 0-d or `(B,)` tensor): ``a`` in `(0, 1)` and ``a'`` in `(a, 1]`.
        eta (float, 0-d or `(B,)` tensor): `>= 0`; 0 is deterministic DDIM (then `mean`, `std`, `log_prob` are
            `None`), 1 DDPM's posterior variance.
        prediction_type (`str`): one of :data:`PREDICTION_TYPES`.
        generator, prev_sample, noise: as in :func:`samplers.flow_sde_step` (draw ``z``, score a given ``x'``, or
            use this ``z``: diffusers' ``variance_noise``).

    Returns:
        :class:`samplers.StepOutput`: `prev_sample`, `mean` `(B, C, H, W)`, `std` `(B,)`, `log_prob` `(B,)`, float32.

    Raises:
        ValueError: for an unknown `prediction_type`, both `prev_sample` and `noise`, or a negative std (``a' <= a``).
    """
    x = sample.float()
    a, a_prev = _per_sample(alpha_prod, x, "alpha_prod"), _per_sample(alpha_prod_prev, x, "alpha_prod_prev")
    x0_hat, eps_hat = vp_predictions(x, model_output, alpha_prod, prediction_type)  # (B, C, H, W) each
    eta_t = _per_sample(eta, x, "eta")  # (B, 1, 1, 1)
    std = ddim_std(a, a_prev, eta_t)  # (B, 1, 1, 1)
    mean = _ddim_mean(x0_hat, eps_hat, a_prev, std)  # (B, C, H, W)
    if not torch.is_tensor(eta) and eta == 0:
        return StepOutput(prev_sample=mean)
    return _draw(x, mean, std, generator, prev_sample, noise)


@gaussian_kernel
def flow_ddim_step(x, v, t, t_next, eta, sigma_max):
    """DDIM with noise ``eta`` (DDPO, arXiv 2305.13301) in flow variables: kernel ``"ddim"`` of :data:`samplers.KERNELS`.

    With ``x0_hat = x - t v``, ``eps_hat = x + (1 - t) v``, ``a = vp_alpha(t)``, ``a' = vp_alpha(t')`` and
    ``s' = vp_scale(t')`` (module docstring)::

        std  = eta sqrt((1 - a') / (1 - a)) sqrt(1 - a / a') / s'
             = eta (t' / t) sqrt((t - t')(t + t' - 2 t t')) / (1 - t')
        mean = (1 - t') x0_hat + sqrt(t'^2 - std^2) eps_hat        (= DDIM's mean / s')
             = (1 - t') x0_hat + t' sqrt(1 - eta^2 + eta^2 r^2) eps_hat,    r = t' (1 - t) / (t (1 - t'))
        x'   = mean + std z;   log_prob = mean over (C, H, W) of log N(x'; mean, std^2)

    i.e. :func:`ddim_step` on ``x = s x_flow`` with every output divided by ``s'``, computed from the flow times
    directly (float32 ``1 - vp_alpha(t')`` would lose most digits near ``t' = 0``), and the noise coefficient as a
    sum of non-negative terms (``t'^2 - std^2`` is a difference of two equal squares at ``t = 1``, ``eta = 1``:
    float32 left 1e-3 of rounding in ``x'`` there). At ``t = 1`` (``a = 0``, a flow
    model's first step) everything stays finite (``std = eta sqrt(1 - a') / s' = eta t'``): no guard is needed, and
    the kernel applies to flow and VP models alike. ``eta = 1`` with ``t' > 0`` keeps ``std <= t'``.

    Args:
        sample, velocity, sigma, sigma_next, generator, prev_sample, noise: as in :func:`samplers.flow_sde_step`
            (a step onto ``t' = 0`` has std 0 and log-prob 0: do not train it).
        noise_level (float, 0-d or `(B,)` tensor): ``eta`` in `(0, 1]`.
        sigma_max: ignored.

    Returns:
        :class:`samplers.StepOutput` with `prev_sample`, `mean` `(B, C, H, W)`, `std` `(B,)`, `log_prob` `(B,)`,
        all float32.

    Raises:
        ValueError: if both `prev_sample` and `noise` are given, a shape does not match, or the std is negative.
    """
    x0_hat, eps_hat = x - t * v, x + (1 - t) * v  # (B, C, H, W) each
    std = eta * _flow_posterior_std(t, t_next)  # (B, 1, 1, 1) flow units
    # sqrt(t'^2 - std^2) = t' sqrt(1 - eta^2 + eta^2 r^2), r = t' (1 - t) / (t (1 - t')): a sum of non-negative terms
    # (t'^2 - std^2 cancels to nothing at t = 1, eta = 1, where the difference of float32 squares is pure rounding)
    r = t_next * (1 - t) / (t * (1 - t_next))  # (B, 1, 1, 1), in [0, 1)
    noise_coeff = t_next * ((1 - eta) * (1 + eta) + (eta * r) ** 2).clamp(min=0).sqrt()  # (B, 1, 1, 1)
    mean = (1 - t_next) * x0_hat + noise_coeff * eps_hat  # (B, C, H, W)
    return mean, std


def _flow_posterior_std(t: torch.Tensor, t_next: torch.Tensor) -> torch.Tensor:
    """DDPM's posterior std ``sqrt((1 - a') / (1 - a) (1 - a / a'))`` divided by ``s' = vp_scale(t')``, in flow times
    and without forming ``a``: with ``D = (1 - t)^2 + t^2``, ``1 - a = t^2 / D`` and ``1 - a / a' = (t - t')(t + t' -
    2 t t') / ((1 - t')^2 D)``, so the std is ``(t' / t) sqrt((t - t')(t + t' - 2 t t')) / (1 - t')``. Computing
    ``1 - a'`` from ``a' = vp_alpha(t')`` in float32 instead loses most digits near ``t' = 0`` (0.56% of the std at
    ``t' = 0.001``). ``t``, ``t_next`` broadcastable float32 with ``1 >= t > t' >= 0``; 0 at ``t' = 0``, ``t'`` at
    ``t = 1``."""
    return t_next / t * ((t - t_next) * _spread(t, t_next)).clamp(min=0).sqrt() / (1 - t_next)


def _spread(t: torch.Tensor, t_next: torch.Tensor) -> torch.Tensor:
    """``t + t' - 2 t t'`` as the sum of non-negative terms ``t (1 - t') + t' (1 - t)`` (the difference loses digits
    near ``t = 1``, where it is ``1 - t'``); broadcastable float32 times in `[0, 1]`."""
    return t * (1 - t_next) + t_next * (1 - t)


def _ddpm_posterior(x0_hat, sample, alpha_prod, alpha_prod_prev):
    """DDPM's posterior ``(mean, std)`` of ``x'`` given the VP state ``sample`` and ``x0_hat`` (arXiv 2006.11239,
    Eqs. 6-7; diffusers' ``DDPMScheduler.step``, ``variance_type="fixed_small"``); ``a``, ``a'`` broadcastable
    float32."""
    alpha_t = alpha_prod / alpha_prod_prev  # (B, 1, 1, 1) one step's alpha
    beta_t = 1 - alpha_t
    mean = (alpha_prod_prev.sqrt() * beta_t / (1 - alpha_prod)) * x0_hat + (
        alpha_t.sqrt() * (1 - alpha_prod_prev) / (1 - alpha_prod)
    ) * sample  # (B, C, H, W)
    std = ((1 - alpha_prod_prev) / (1 - alpha_prod) * beta_t).clamp(min=0).sqrt()  # (B, 1, 1, 1)
    return mean, std


def ddpm_step(
    sample: torch.Tensor,
    model_output: torch.Tensor,
    alpha_prod,
    alpha_prod_prev,
    prediction_type: str = "epsilon",
    *,
    generator: torch.Generator | None = None,
    prev_sample: torch.Tensor | None = None,
    noise: torch.Tensor | None = None,
) -> StepOutput:
    """One DDPM (ancestral) step of a VP model and its Gaussian log-prob (Ho et al., arXiv 2006.11239, Eqs. 6-7), in
    the model's own variables::

        x0_hat = vp_predictions(x, model_output, a, prediction_type)[0];   alpha_t = a / a',  beta_t = 1 - alpha_t
        mean   = sqrt(a') beta_t / (1 - a) x0_hat + sqrt(alpha_t) (1 - a') / (1 - a) x
        std    = sqrt((1 - a') / (1 - a) beta_t)
        x'     = mean + std z;   log_prob = mean over (C, H, W) of log N(x'; mean, std^2)

    Equal to ``DDPMScheduler.step(model_output, t, x, generator=g)`` with ``variance_type="fixed_small"`` and
    ``clip_sample=False`` (``a = alphas_cumprod[t]``, ``a'`` that of ``t - T // N``, or 1 after the last timestep,
    where ``std = 0`` and no noise is drawn, as diffusers adds none at ``t = 0``); diffusers' source:
    ``diffusers/schedulers/scheduling_ddpm.py``. No hidden state.

    Args:
        sample (`torch.Tensor` of shape `(B, C, H, W)`): the VP state ``x`` at ``a``.
        model_output (`torch.Tensor` of shape `(B, C, H, W)`): the network's prediction; gradients flow through it.
        alpha_prod, alpha_prod_prev (float, 0-d or `(B,)` tensor): ``a`` in `(0, 1)` and ``a'`` in `(a, 1]`.
        prediction_type (`str`): one of :data:`PREDICTION_TYPES`.
        generator, prev_sample, noise: as in :func:`ddim_step`.

    Returns:
        :class:`samplers.StepOutput`: `prev_sample`, `mean` `(B, C, H, W)`, `std` `(B,)` (0 onto ``a' = 1``),
        `log_prob` `(B,)` (0 where the std is 0), float32.

    Raises:
        ValueError: for an unknown `prediction_type`, or both `prev_sample` and `noise`.
    """
    x = sample.float()
    a, a_prev = _per_sample(alpha_prod, x, "alpha_prod"), _per_sample(alpha_prod_prev, x, "alpha_prod_prev")
    x0_hat, _ = vp_predictions(x, model_output, alpha_prod, prediction_type)  # (B, C, H, W)
    mean, std = _ddpm_posterior(x0_hat, x, a, a_prev)
    return _draw(x, mean, std, generator, prev_sample, noise)


@gaussian_kernel
def flow_ddpm_step(x, v, t, t_next, level, sigma_max):
    """The DDPM ancestral step (:func:`ddpm_step`) in flow variables: kernel ``"ddpm"`` of :data:`samplers.KERNELS`.

    With ``x0_hat = x - t v``, ``a = vp_alpha(t)``, ``a' = vp_alpha(t')``, ``s = vp_scale(t)``, ``s' = vp_scale(t')``
    (module docstring), DDPM's posterior of the VP state ``s x``, divided by ``s'``::

        mean = [sqrt(a') beta_t / (1 - a) x0_hat + sqrt(alpha_t) (1 - a') / (1 - a) s x] / s'
        std  = noise_level sqrt((1 - a') / (1 - a) beta_t) / s'
        x'   = mean + std z;   log_prob = mean over (C, H, W) of log N(x'; mean, std^2)

    ``noise_level = 1`` is ``DDPMScheduler.step`` (fixed_small) and, up to rounding, the ``"ddim"`` kernel at
    ``eta = 1``; below 1 it scales the std only (a colder ancestral step whose marginals are no longer the model's:
    for less noise with consistent marginals use ``"ddim"`` with ``eta < 1``). At ``t = 1`` (``a = 0``) the step is
    finite (``mean = sqrt(a') x0_hat / s'``), so it also runs on flow schedules; onto ``t' = 0`` it is ``x0_hat`` with
    std 0 and log-prob 0 (do not train that step).

    Args:
        sample, velocity, sigma, sigma_next, generator, prev_sample, noise: as in :func:`samplers.flow_sde_step`.
        noise_level (float, 0-d or `(B,)` tensor): the std's factor in `(0, 1]`; 1 is DDPM's posterior.
        sigma_max: ignored.

    Returns:
        :class:`samplers.StepOutput` with `prev_sample`, `mean` `(B, C, H, W)`, `std` `(B,)`, `log_prob` `(B,)`,
        all float32.

    Raises:
        ValueError: if both `prev_sample` and `noise` are given, a shape does not match, or the std is negative (a
            negative `noise_level`).
    """
    # DDPM's posterior mean of the VP state s x, over s', in flow times (:func:`_flow_posterior_std`'s identities):
    # sqrt(a') beta_t / (1 - a) / s' = (t - t')(t + t' - 2 t t') / ((1 - t') t^2),  sqrt(alpha_t) (1 - a') / (1 - a)
    # s / s' = (1 - t) t'^2 / ((1 - t') t^2)
    scale = 1 / ((1 - t_next) * t**2)  # (B, 1, 1, 1)
    mean = ((t - t_next) * _spread(t, t_next) * scale) * (x - t * v) + ((1 - t) * t_next**2 * scale) * x
    return mean, level * _flow_posterior_std(t, t_next)  # (B, C, H, W), (B, 1, 1, 1)
