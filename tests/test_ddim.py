"""The DDIM and DDPM kernels (samplers/ddim.py) against diffusers' DDIMScheduler.step / DDPMScheduler.step and DDPO's
Gaussian, and the flow change of variables: DDIM(eta=0) is the flow Euler step, DDIM(eta) and DDPM in flow variables are
the VP steps divided by s(a')."""

import math

import pytest
import torch

from flowrl.samplers import (
    KERNELS,
    StepPlan,
    ddim_step,
    ddpm_step,
    flow_ddim_step,
    flow_ddpm_step,
    flow_sigma,
    flow_sigmas,
    flow_velocity,
    ode_step,
    start_latents,
    vp_alpha,
    vp_predictions,
    vp_scale,
)

SD15_SCHEDULER = dict(
    beta_start=0.00085,
    beta_end=0.012,
    beta_schedule="scaled_linear",
    clip_sample=False,
    set_alpha_to_one=False,
    steps_offset=1,
)  # Stable Diffusion 1.5's scheduler config


def _scheduler(prediction_type: str, num_steps: int = 10):
    from diffusers import DDIMScheduler

    scheduler = DDIMScheduler(**SD15_SCHEDULER, prediction_type=prediction_type)
    scheduler.set_timesteps(num_steps)
    return scheduler


def _alphas(scheduler, timestep: int) -> tuple[float, float]:
    """``a`` and ``a'`` as DDIMScheduler.step reads them."""
    prev = timestep - scheduler.config.num_train_timesteps // scheduler.num_inference_steps
    a_prev = scheduler.alphas_cumprod[prev] if prev >= 0 else scheduler.final_alpha_cumprod
    return float(scheduler.alphas_cumprod[timestep]), float(a_prev)


@pytest.mark.parametrize("prediction_type", ["epsilon", "v_prediction", "sample"])
@pytest.mark.parametrize("eta", [0.0, 0.3, 1.0])
def test_ddim_step_equals_diffusers(prediction_type, eta):
    scheduler = _scheduler(prediction_type)
    g = torch.Generator().manual_seed(0)
    for timestep in scheduler.timesteps.tolist():  # every step, the last onto final_alpha_cumprod included
        x, out, z = (torch.randn(2, 4, 8, 8, generator=g) for _ in range(3))
        stock = scheduler.step(out, timestep, x, eta=eta, variance_noise=z).prev_sample
        a, a_prev = _alphas(scheduler, timestep)
        ours = ddim_step(x, out, a, a_prev, eta, prediction_type, noise=z)
        torch.testing.assert_close(ours.prev_sample, stock, rtol=0, atol=1e-5)
        if eta == 0:
            assert ours.log_prob is None
            continue
        # the mean (the step with zero noise) and the std (eta sqrt(variance)) separately
        mean = scheduler.step(out, timestep, x, eta=eta, variance_noise=torch.zeros_like(z)).prev_sample
        torch.testing.assert_close(ours.mean, mean, rtol=0, atol=1e-5)
        prev = timestep - scheduler.config.num_train_timesteps // scheduler.num_inference_steps
        std = eta * float(scheduler._get_variance(timestep, prev)) ** 0.5
        torch.testing.assert_close(ours.std, torch.full((2,), std), rtol=1e-5, atol=1e-7)
        # DDPO's log-prob: the Gaussian log-density of x' under (mean, std), mean over the latent dims
        density = torch.distributions.Normal(ours.mean.double(), ours.std.double().reshape(-1, 1, 1, 1))
        expected = density.log_prob(ours.prev_sample.double()).mean(dim=(1, 2, 3))
        torch.testing.assert_close(ours.log_prob.double(), expected, rtol=0, atol=1e-5)
        rescored = ddim_step(x, out, a, a_prev, eta, prediction_type, prev_sample=stock)
        torch.testing.assert_close(rescored.log_prob, ours.log_prob, rtol=0, atol=1e-5)


def test_flow_change_of_variables_round_trips():
    a = torch.linspace(0.004, 0.999, 50, dtype=torch.float64)
    sigma = flow_sigma(a)
    assert bool((sigma[1:] < sigma[:-1]).all())  # decreasing in a
    torch.testing.assert_close(vp_alpha(sigma), a)
    torch.testing.assert_close(vp_scale(sigma), a.sqrt() + (1 - a).sqrt())
    x0, eps = torch.randn(2, 3, 4, 4, dtype=torch.float64).unbind(0)
    for k in (0, 20, 49):  # x / s = (1 - sigma) x0 + sigma eps: the rectified-flow interpolation
        x = a[k].sqrt() * x0 + (1 - a[k]).sqrt() * eps
        torch.testing.assert_close(x / vp_scale(sigma[k]), (1 - sigma[k]) * x0 + sigma[k] * eps)
    assert torch.equal(start_latents(eps.float(), 1.0), eps.float())  # identity on flow schedules


@pytest.mark.parametrize("prediction_type", ["epsilon", "v_prediction", "sample"])
def test_deterministic_ddim_is_the_flow_euler_step(prediction_type):
    """DDIM(eta=0) of a VP model == the flow Euler step on x / s(a) with the velocity of its prediction."""
    scheduler = _scheduler(prediction_type, num_steps=5)
    g = torch.Generator().manual_seed(1)
    worst = 0.0
    for timestep in scheduler.timesteps.tolist():
        a, a_prev = _alphas(scheduler, timestep)
        sigma, sigma_next = (float(flow_sigma(torch.tensor(v, dtype=torch.float64))) for v in (a, a_prev))
        x, out = torch.randn(2, 4, 8, 8, generator=g), torch.randn(2, 4, 8, 8, generator=g)
        vp = ddim_step(x, out, a, a_prev, 0.0, prediction_type).prev_sample
        x_flow = x / vp_scale(torch.tensor(sigma))
        v = flow_velocity(x_flow, out, sigma, prediction_type)
        euler = ode_step(x_flow, v, sigma, sigma_next).prev_sample
        worst = max(worst, float((euler * vp_scale(torch.tensor(sigma_next)) - vp).abs().max()))
        x0_hat, eps_hat = vp_predictions(x, out, a, prediction_type)
        torch.testing.assert_close(v, eps_hat - x0_hat, rtol=0, atol=1e-4)
    assert worst < 1e-5, worst


@pytest.mark.parametrize("prediction_type", ["epsilon", "v_prediction", "sample"])
@pytest.mark.parametrize("kernel,eta", [("ddim", 0.3), ("ddim", 1.0), ("ddpm", 1.0), ("ddpm", 0.5)])
def test_flow_kernels_are_the_vp_steps_divided_by_s(kernel, eta, prediction_type):
    scheduler = _scheduler(prediction_type, num_steps=4)
    g = torch.Generator().manual_seed(2)
    for timestep in scheduler.timesteps.tolist():
        a, a_prev = _alphas(scheduler, timestep)
        sigma, sigma_next = (float(flow_sigma(torch.tensor(v, dtype=torch.float64))) for v in (a, a_prev))
        x, out, z = (torch.randn(3, 4, 8, 8, generator=g) for _ in range(3))
        if kernel == "ddim":
            vp = ddim_step(x, out, a, a_prev, eta, prediction_type, noise=z)
        else:  # noise_level scales DDPM's std, nothing else
            vp = ddpm_step(x, out, a, a_prev, prediction_type)
            drawn = vp.mean + eta * vp.std.reshape(-1, 1, 1, 1) * z
            vp = ddpm_step(x, out, a, a_prev, prediction_type, prev_sample=drawn)
            vp.std = vp.std * eta
        s, s_next = (vp_scale(torch.tensor(value)) for value in (sigma, sigma_next))
        x_flow = x / s
        flow = KERNELS[kernel](
            x_flow, flow_velocity(x_flow, out, sigma, prediction_type), sigma, sigma_next, eta, None, noise=z
        )
        torch.testing.assert_close(flow.mean * s_next, vp.mean, rtol=0, atol=1e-4)
        torch.testing.assert_close(flow.std * s_next, vp.std, rtol=0, atol=1e-6)
        torch.testing.assert_close(flow.prev_sample * s_next, vp.prev_sample, rtol=0, atol=1e-4)
        # the log-prob moves by the Jacobian log s' per dimension: ratios are the same in both variables
        density = torch.distributions.Normal(vp.mean.double(), vp.std.double().reshape(-1, 1, 1, 1))
        vp_log_prob = density.log_prob(vp.prev_sample.double()).mean(dim=(1, 2, 3))
        torch.testing.assert_close(
            flow.log_prob.double() - vp_log_prob,
            torch.full((3,), math.log(float(s_next)), dtype=torch.float64),
            rtol=0,
            atol=1e-4,
        )


def _ddpm_scheduler(prediction_type: str, num_steps: int):
    from diffusers import DDPMScheduler

    scheduler = DDPMScheduler(
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        clip_sample=False,
        steps_offset=1,
        variance_type="fixed_small",
        prediction_type=prediction_type,
    )
    scheduler.set_timesteps(num_steps)
    return scheduler


@pytest.mark.parametrize("prediction_type", ["epsilon", "v_prediction", "sample"])
def test_ddpm_step_equals_diffusers(prediction_type):
    """Mean, std and the drawn sample of DDPMScheduler.step (fixed_small), DDPO's Gaussian log-prob, and DDPM = DDIM
    at eta 1 (same a, a')."""
    scheduler = _ddpm_scheduler(prediction_type, num_steps=10)
    g = torch.Generator().manual_seed(3)
    for timestep in scheduler.timesteps.tolist():  # the last one steps onto a' = 1
        x, out = torch.randn(2, 4, 8, 8, generator=g), torch.randn(2, 4, 8, 8, generator=g)
        prev = scheduler.previous_timestep(timestep)
        a = float(scheduler.alphas_cumprod[timestep])
        a_prev = float(scheduler.alphas_cumprod[prev]) if prev >= 0 else 1.0
        stock = scheduler.step(out, timestep, x, generator=torch.Generator().manual_seed(timestep)).prev_sample
        z = torch.randn(x.shape, generator=torch.Generator().manual_seed(timestep))  # what step drew (randn_tensor)
        ours = ddpm_step(x, out, a, a_prev, prediction_type, noise=z)
        torch.testing.assert_close(ours.prev_sample, stock, rtol=0, atol=1e-5)
        std = float(scheduler._get_variance(timestep)) ** 0.5 if prev >= 0 else 0.0  # diffusers: 1e-10 at a' = 1
        torch.testing.assert_close(ours.std, torch.full((2,), std), rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(ours.mean, stock - std * z, rtol=0, atol=1e-5)
        ddim = ddim_step(x, out, a, a_prev, 1.0, prediction_type, noise=z)
        torch.testing.assert_close(ddim.mean, ours.mean, rtol=0, atol=1e-4)
        torch.testing.assert_close(ddim.std, ours.std, rtol=1e-5, atol=1e-7)
        if prev < 0:
            assert torch.equal(ours.log_prob, torch.zeros(2))  # onto a' = 1: no noise, no log-prob
            continue
        density = torch.distributions.Normal(ours.mean.double(), ours.std.double().reshape(-1, 1, 1, 1))
        expected = density.log_prob(ours.prev_sample.double()).mean(dim=(1, 2, 3))
        torch.testing.assert_close(ours.log_prob.double(), expected, rtol=0, atol=1e-5)
        rescored = ddpm_step(x, out, a, a_prev, prediction_type, prev_sample=stock)
        torch.testing.assert_close(rescored.log_prob, ours.log_prob, rtol=0, atol=1e-5)


def test_flow_ddpm_kernel_on_a_flow_schedule_is_finite():
    x, v = torch.randn(2, 4, 4, 4), torch.randn(2, 4, 4, 4)
    first = flow_ddpm_step(x, v, 1.0, 0.8, 1.0, None, generator=torch.Generator().manual_seed(0))
    a_next = float(vp_alpha(torch.tensor(0.8)))
    torch.testing.assert_close(first.mean, (a_next**0.5 * (x - v)) * float(vp_scale(torch.tensor(0.8))) ** -1)
    assert torch.isfinite(first.log_prob).all() and torch.allclose(first.std, torch.full((2,), 0.8))
    last = flow_ddpm_step(x, v, 0.2, 0.0, 1.0, None, generator=torch.Generator().manual_seed(0))
    assert torch.equal(last.std, torch.zeros(2)) and torch.equal(last.log_prob, torch.zeros(2))
    torch.testing.assert_close(last.prev_sample, x - 0.2 * v)  # onto t' = 0: x0_hat
    with pytest.raises(ValueError, match="ddpm kernel's eta must be in"):
        StepPlan(["ddpm"], [1.5], [True])


def test_flow_ddim_kernel_on_a_flow_schedule_is_finite_and_plans_check_eta():
    x, v = torch.randn(2, 4, 4, 4), torch.randn(2, 4, 4, 4)
    out = flow_ddim_step(x, v, 1.0, 0.8, 1.0, None, generator=torch.Generator().manual_seed(0))
    assert torch.isfinite(out.log_prob).all() and torch.allclose(out.std, torch.full((2,), 0.8))
    last = flow_ddim_step(x, v, 0.2, 0.0, 1.0, None, generator=torch.Generator().manual_seed(0))
    assert torch.equal(last.std, torch.zeros(2)) and torch.equal(last.log_prob, torch.zeros(2))
    torch.testing.assert_close(last.prev_sample, x - 0.2 * v)  # onto t' = 0: x0_hat
    with pytest.raises(ValueError, match="ddim kernel's eta must be in"):
        StepPlan(["ddim"], [1.5], [True])


def _vp_reference(kernel: str, x, v, t: float, t_next: float, eta: float):
    """The flow kernel's mean and std evaluated in float64 from the VP formulas (``a = vp_alpha(t)`` ...): the
    definitions, without the float32 cancellation of ``1 - a'`` near ``t' = 0``."""
    x, v = x.double(), v.double()
    t64, n64 = torch.tensor(t, dtype=torch.float64), torch.tensor(t_next, dtype=torch.float64)
    a, a_next, s, s_next = vp_alpha(t64), vp_alpha(n64), vp_scale(t64), vp_scale(n64)
    x0, eps = x - t64 * v, x + (1 - t64) * v
    posterior = ((1 - a_next) / (1 - a) * (1 - a / a_next)).sqrt()  # DDPM's std in VP units
    if kernel == "ddim":
        std = eta * posterior
        mean = a_next.sqrt() * x0 + (1 - a_next - std**2).clamp(min=0).sqrt() * eps  # exactly 0 - rounding at t = 1
    else:
        alpha_t = a / a_next
        mean = a_next.sqrt() * (1 - alpha_t) / (1 - a) * x0 + alpha_t.sqrt() * (1 - a_next) / (1 - a) * (s * x)
        std = eta * posterior
    return mean / s_next, std / s_next


@pytest.mark.parametrize("kernel,eta", [("ddim", 0.5), ("ddim", 1.0), ("ddpm", 1.0), ("ddpm", 0.5)])
@pytest.mark.parametrize("t,t_next", [(0.101, 0.001), (0.5, 0.25), (1.0, 0.9), (0.02, 0.0001)])
def test_flow_kernels_near_zero_noise_match_a_float64_evaluation(kernel, eta, t, t_next):
    """The step onto the last non-zero sigma of a shift-1 schedule (``t' = 0.001``): std, mean and log-prob within
    float32 rounding of the float64 values (``1 - vp_alpha(t')`` in float32 was 0.56% off in the std)."""
    g = torch.Generator().manual_seed(0)
    x, v, z = (torch.randn(2, 4, 8, 8, generator=g) for _ in range(3))
    out = KERNELS[kernel](x, v, t, t_next, eta, None, noise=z)
    mean, std = _vp_reference(kernel, x, v, t, t_next, eta)
    assert abs(float(out.std[0]) / float(std) - 1) < 1e-6, (float(out.std[0]), float(std))
    torch.testing.assert_close(out.mean.double(), mean, rtol=0, atol=2e-6)
    density = torch.distributions.Normal(mean, std)
    log_prob = density.log_prob(out.prev_sample.double()).mean(dim=(1, 2, 3))
    torch.testing.assert_close(out.log_prob.double(), log_prob, rtol=0, atol=1e-4 * max(1.0, log_prob.abs().max()))


@pytest.mark.parametrize("kernel", ["ddim", "ddpm"])
@pytest.mark.parametrize("eta", [1.0, 0.5])
def test_flow_kernels_first_step_of_a_flow_schedule_match_a_float64_evaluation(kernel, eta):
    """At ``t = 1`` (VP alpha 0) onto ``t' = 0.001`` and down a shift-3 10-step grid, ``x'`` is within float32 precision
    of the float64 formula: DDIM's ``sqrt(t'^2 - std^2)`` cancelled at ``t = 1``, ``eta = 1`` (1.4e-3 off in ``x'``)."""
    g = torch.Generator().manual_seed(0)
    x, v, z = (torch.randn(2, 4, 8, 8, generator=g) for _ in range(3))
    grid = flow_sigmas(10, 3.0).tolist()
    for t, t_next in [(1.0, 0.001), *zip(grid[:-1], grid[1:])]:
        out = KERNELS[kernel](x, v, t, t_next, eta, None, noise=z)
        mean, std = _vp_reference(kernel, x, v, t, t_next, eta)
        expected = mean + std * z.double()
        error = float((out.prev_sample.double() - expected).abs().max() / expected.abs().max())
        assert error < 1e-6, (t, t_next, error)


@pytest.mark.parametrize("t,t_next", [(0.101, 0.001), (0.5, 0.25), (1.0, 0.9)])
def test_flow_ddim_at_eta_zero_is_the_euler_step(t, t_next):
    g = torch.Generator().manual_seed(1)
    x, v = torch.randn(2, 4, 8, 8, generator=g), torch.randn(2, 4, 8, 8, generator=g)
    out = flow_ddim_step(x, v, t, t_next, 0.0, noise=torch.zeros_like(x))
    torch.testing.assert_close(out.prev_sample, ode_step(x, v, t, t_next).prev_sample, rtol=0, atol=1e-6)
