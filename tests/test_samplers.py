"""Fast tests for samplers/: kernels against closed forms, schedules against diffusers, rollouts."""

import math
import subprocess
import sys

import pytest
import torch

from flowrl import samplers
from flowrl.samplers import (
    KERNELS,
    StepPlan,
    dance_sde_step,
    flow_sde_step,
    flow_sigmas,
    gaussian_log_prob,
    group_index,
    initial_noise,
    ode_sample,
    ode_step,
    recompute_log_prob,
    sample,
)

SHAPE = (2, 4, 4)  # (C, H, W)
SDE_KERNELS = ["flow_sde", "dance_sde", "cps"]


class ToyVelocity:
    """A fixed linear map of x plus terms in t and cond; counts its calls and rows."""

    def __init__(self, channels=SHAPE[0], num_cond=3, seed=0):
        gen = torch.Generator().manual_seed(seed)
        self.mix = 0.3 * torch.randn(channels, channels, generator=gen)  # (C, C)
        self.bias = torch.randn(num_cond, channels, generator=gen)  # (num_cond, C)
        self.calls = 0
        self.rows = 0

    def __call__(self, x, t, cond):
        self.calls += 1
        self.rows += x.shape[0]
        # channel mixing as elementwise products summed in a fixed order: a matrix product (einsum) may
        # switch kernels with the batch size and change the last bits, which the exactness tests forbid
        mixed = sum(self.mix[:, c].view(1, -1, 1, 1) * x[:, c : c + 1] for c in range(x.shape[1]))  # (N, C, H, W)
        return mixed + t.view(-1, 1, 1, 1) * x + (1 - t.view(-1, 1, 1, 1)) * self.bias[cond][:, :, None, None]


def _batch(batch=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, *SHAPE, generator=gen)
    v = torch.randn(batch, *SHAPE, generator=gen)
    return x, v


def _rollout(plan, num_groups=2, group_size=3, seed=0, shared=True):
    gen = torch.Generator().manual_seed(seed)
    noise = initial_noise(num_groups, group_size, SHAPE, gen, shared_per_group=shared)
    group = group_index(num_groups, group_size)
    cond = group.clone()
    velocity_fn = ToyVelocity()
    rollout = sample(velocity_fn, noise, cond, group, flow_sigmas(plan.num_steps), plan, gen)
    return rollout, velocity_fn, noise


def _normal_log_prob(out):
    std = out.std.view(-1, 1, 1, 1)
    return torch.distributions.Normal(out.mean, std).log_prob(out.prev_sample).mean(dim=(1, 2, 3))


# --------------------------------------------------------------------------------------------- kernels


@pytest.mark.parametrize("kernel", SDE_KERNELS)
def test_sde_log_prob_matches_torch_normal(kernel):
    x, v = _batch()
    out = KERNELS[kernel](x, v, 0.8, 0.6, 0.7, 0.9, generator=torch.Generator().manual_seed(1))
    assert out.log_prob.shape == (4,) and out.log_prob.dtype == torch.float32
    torch.testing.assert_close(out.log_prob, _normal_log_prob(out), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kernel", SDE_KERNELS)
def test_prev_sample_reproduces_sampled_log_prob(kernel):
    x, v = _batch()
    sampled = KERNELS[kernel](x, v, 0.8, 0.6, 0.7, 0.9, generator=torch.Generator().manual_seed(1))
    scored = KERNELS[kernel](x, v, 0.8, 0.6, 0.7, 0.9, prev_sample=sampled.prev_sample)
    assert torch.equal(scored.log_prob, sampled.log_prob)
    assert torch.equal(scored.prev_sample, sampled.prev_sample)


def test_flow_sde_matches_closed_form():
    x, v = _batch()
    noise = torch.randn(x.shape, generator=torch.Generator().manual_seed(2))
    t, t_next, a = 0.8, 0.6, 0.7
    out = flow_sde_step(x, v, t, t_next, a, 0.9, noise=noise)
    dt = t_next - t
    sigma_t = a * math.sqrt(t / (1 - t))
    mean = x * (1 + sigma_t**2 * dt / (2 * t)) + v * (1 + sigma_t**2 * (1 - t) / (2 * t)) * dt
    std = sigma_t * math.sqrt(-dt)
    torch.testing.assert_close(out.mean, mean)
    torch.testing.assert_close(out.std, torch.full((4,), std))
    torch.testing.assert_close(out.prev_sample, mean + std * noise)


def test_dance_sde_matches_closed_form():
    x, v = _batch()
    noise = torch.randn(x.shape, generator=torch.Generator().manual_seed(2))
    t, t_next, eta = 0.8, 0.6, 0.3
    out = dance_sde_step(x, v, t, t_next, eta, noise=noise)
    dt = t_next - t
    mean = x + dt * (v + eta**2 * (x + (1 - t) * v) / (2 * t))
    torch.testing.assert_close(out.mean, mean)
    torch.testing.assert_close(out.std, torch.full((4,), eta * math.sqrt(-dt)))
    torch.testing.assert_close(out.prev_sample, mean + eta * math.sqrt(-dt) * noise)


def test_flow_sde_uses_sigma_max_at_t_equal_one():
    x, v = _batch()
    sigma_max, a, t_next = 0.9, 0.7, 0.9
    out = flow_sde_step(x, v, 1.0, t_next, a, sigma_max, generator=torch.Generator().manual_seed(0))
    expected_std = a * math.sqrt(1.0 / (1 - sigma_max)) * math.sqrt(1.0 - t_next)
    assert torch.isfinite(out.log_prob).all()
    torch.testing.assert_close(out.std, torch.full((4,), expected_std))


def test_per_sample_sigmas_match_scalars():
    x, v = _batch()
    noise = torch.randn(x.shape, generator=torch.Generator().manual_seed(3))
    sigma = torch.tensor([1.0, 0.8, 0.5, 0.2])
    sigma_next = torch.tensor([0.9, 0.6, 0.3, 0.0])
    batched = flow_sde_step(x, v, sigma, sigma_next, 0.7, 0.9, noise=noise)
    for b in range(4):
        rows = slice(b, b + 1)
        one = flow_sde_step(x[rows], v[rows], sigma[b], float(sigma_next[b]), 0.7, 0.9, noise=noise[rows])
        torch.testing.assert_close(batched.log_prob[rows], one.log_prob)
        torch.testing.assert_close(batched.prev_sample[rows], one.prev_sample)


def test_kernels_compute_in_float32_with_gradients():
    x, v = _batch()
    v = v.bfloat16().requires_grad_()
    out = flow_sde_step(x.bfloat16(), v, 0.8, 0.6, 0.7, 0.9, generator=torch.Generator().manual_seed(0))
    assert out.prev_sample.dtype == out.mean.dtype == out.log_prob.dtype == torch.float32
    out.log_prob.sum().backward()
    assert v.grad is not None and v.grad.abs().sum() > 0
    assert ode_step(x.bfloat16(), v, 0.8, 0.6).prev_sample.dtype == torch.float32


def test_gaussian_log_prob_reduces_by_mean():
    x, mean = _batch()
    std = torch.tensor([0.5, 1.0, 2.0, 0.1])
    normal = torch.distributions.Normal(mean, std.view(-1, 1, 1, 1)).log_prob(x)  # (B, C, H, W)
    torch.testing.assert_close(gaussian_log_prob(x, mean, std), normal.mean(dim=(1, 2, 3)))


def test_kernel_errors_name_the_argument():
    x, v = _batch()
    with pytest.raises(ValueError, match="sigma_next"):
        ode_step(x, v, 0.8, torch.zeros(3))
    with pytest.raises(ValueError, match="prev_sample"):
        flow_sde_step(x, v, 0.8, 0.6, 0.7, 0.9, prev_sample=x, noise=v)
    with pytest.raises(ValueError, match="std must be finite and >= 0"):  # sigma_next > sigma: NaN std
        flow_sde_step(x, v, 0.5, 0.6, 0.7, 0.9)
    with pytest.raises(ValueError, match="std must be finite and >= 0"):
        flow_sde_step(x, v, 0.8, 0.6, -0.7, 0.9)


# -------------------------------------------------------------------------------------------- schedule


def test_flow_sigmas_endpoints():
    sigmas = flow_sigmas(10, shift=3.0)
    assert sigmas.shape == (11,) and sigmas.dtype == torch.float32
    assert sigmas[0] == 1.0 and sigmas[-1] == 0.0 and bool((sigmas[1:] < sigmas[:-1]).all())
    with pytest.raises(ValueError, match="num_steps"):
        flow_sigmas(0)


@pytest.mark.parametrize("num_steps,shift", [(1, 3.0), (10, 3.0), (28, 3.0), (16, 1.0), (40, 5.0)])
def test_flow_sigmas_match_diffusers(num_steps, shift):
    schedulers = pytest.importorskip("diffusers.schedulers.scheduling_flow_match_euler_discrete")
    scheduler = schedulers.FlowMatchEulerDiscreteScheduler(shift=shift)
    scheduler.set_timesteps(num_steps)
    assert torch.equal(flow_sigmas(num_steps, shift), scheduler.sigmas)


@pytest.mark.parametrize("num_steps,mu", [(1, 0.5), (4, 0.65), (28, 1.15), (50, 0.9)])
def test_flux_spacing_matches_diffusers_dynamic_shift(num_steps, mu):
    """FluxPipeline's schedule: linspace(1, 1/N, N) through the scheduler's exponential shift by mu, which
    flow_sigmas(spacing="flux") gives as the static shift exp(mu)."""
    import math

    import numpy as np

    schedulers = pytest.importorskip("diffusers.schedulers.scheduling_flow_match_euler_discrete")
    scheduler = schedulers.FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True)
    scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / num_steps, num_steps), mu=mu)
    ours = flow_sigmas(num_steps, math.exp(mu), spacing="flux")
    torch.testing.assert_close(ours, scheduler.sigmas, rtol=0, atol=1e-6)
    assert not torch.allclose(ours, flow_sigmas(num_steps, math.exp(mu)), atol=1e-3) or num_steps == 1
    with pytest.raises(ValueError, match="spacing must be one of"):
        flow_sigmas(num_steps, 1.0, spacing="karras")


# --------------------------------------------------------------------------------------------- rollout


def test_initial_noise_shared_within_group_only():
    gen = torch.Generator().manual_seed(0)
    noise = initial_noise(3, 4, SHAPE, gen, shared_per_group=True).view(3, 4, *SHAPE)
    assert torch.equal(noise[:, :1].expand_as(noise), noise)
    assert not torch.equal(noise[0, 0], noise[1, 0]) and not torch.equal(noise[1, 0], noise[2, 0])
    own = initial_noise(3, 4, SHAPE, torch.Generator().manual_seed(0), shared_per_group=False)
    assert own.shape == (12, *SHAPE) and not torch.equal(own[0], own[1])
    again = initial_noise(3, 4, SHAPE, torch.Generator().manual_seed(0), shared_per_group=True)
    assert torch.equal(again.view_as(noise), noise)


def test_ode_plan_reproduces_hand_written_euler_bit_for_bit():
    rollout, _, noise = _rollout(StepPlan.ode(5))
    velocity_fn, sigmas, cond = ToyVelocity(), flow_sigmas(5), group_index(2, 3)
    x = noise.clone()
    for k in range(5):
        x = x + (sigmas[k + 1] - sigmas[k]) * velocity_fn(x, sigmas[k].repeat(6), cond)
    assert torch.equal(rollout.final, x)
    assert torch.equal(ode_sample(ToyVelocity(), noise, cond, sigmas), x)
    assert len(rollout) == 0 and rollout.state.shape == (0, *SHAPE)


def test_same_seed_gives_identical_rollout():
    plan = StepPlan.sde(4)
    first, _, _ = _rollout(plan, seed=5)
    second, _, _ = _rollout(plan, seed=5)
    other, _, _ = _rollout(plan, seed=6)
    for name, value in vars(first).items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, getattr(second, name)), name
    assert not torch.equal(first.final, other.final)


def test_flat_rollout_layout_and_cost():
    num_steps, batch = 4, 6
    rollout, velocity_fn, noise = _rollout(StepPlan.sde(num_steps))
    assert velocity_fn.calls == num_steps and rollout.cost["nfe"] == num_steps * batch == velocity_fn.rows
    assert len(rollout) == num_steps * batch and rollout.num_leaves == batch
    assert rollout.cost["trained_transitions"] == (num_steps - 1) * batch
    assert torch.equal(rollout.step, torch.arange(num_steps).repeat_interleave(batch))
    assert torch.equal(rollout.leaf, torch.arange(batch).repeat(num_steps))
    assert torch.equal(rollout.state[:batch], noise)
    assert torch.equal(rollout.next_state[-batch:], rollout.final)
    assert torch.equal(rollout.state[batch:], rollout.next_state[:-batch])  # chains link up
    assert torch.equal(rollout.parent[:batch], torch.full((batch,), -1))
    assert torch.equal(rollout.node[rollout.parent[batch:]], rollout.node[:-batch])
    assert torch.equal(rollout.sigma_max, torch.full((len(rollout),), float(flow_sigmas(num_steps)[1])))
    trained = rollout.trained_view()
    assert len(trained) == (num_steps - 1) * batch and int(trained.step.max()) == num_steps - 2


def test_window_plan_stores_only_stochastic_steps():
    plan = StepPlan(["ode", "flow_sde", "flow_sde", "ode"], [0.0, 0.7, 0.7, 0.0], [False, True, True, False])
    rollout, _, _ = _rollout(plan)
    assert rollout.cost == {"nfe": 24, "transitions": 12, "trained_transitions": 12}
    assert torch.equal(rollout.step.unique(), torch.tensor([1, 2]))
    assert int((rollout.parent == -1).sum()) == 6


@pytest.mark.parametrize("kernel", SDE_KERNELS)
def test_recompute_log_prob_with_old_velocities_is_exact(kernel):
    rollout, _, _ = _rollout(StepPlan.sde(4, kernel=kernel, noise_level=0.5))
    trained = rollout.trained_view()
    velocity = ToyVelocity()(trained.state, trained.sigma, trained.cond)
    log_prob, mean = recompute_log_prob(trained, velocity)
    assert torch.equal(log_prob, trained.log_prob) and torch.equal(mean, trained.mean)
    assert torch.equal(torch.exp(log_prob - trained.log_prob), torch.ones(len(trained)))


def test_recompute_log_prob_mixed_kernels_subset_and_gradient():
    plan = StepPlan(["flow_sde", "dance_sde", "ode", "flow_sde"], [0.7, 0.3, 0.0, 0.7], [True, True, False, True])
    rollout, _, _ = _rollout(plan)
    subset = rollout.select(torch.tensor([17, 2, 9, 6, 0]))
    velocity = ToyVelocity()(subset.state, subset.sigma, subset.cond).requires_grad_()
    log_prob, mean = recompute_log_prob(subset, velocity)
    assert torch.equal(log_prob, subset.log_prob) and torch.equal(mean, subset.mean)
    log_prob.sum().backward()
    assert velocity.grad.abs().sum(dim=(1, 2, 3)).min() > 0


def test_step_plan_validation_names_the_field():
    plan = StepPlan.sde(5)
    assert plan.trained == [True] * 4 + [False] and StepPlan.sde(5, train_last=True).trained[-1]
    with pytest.raises(ValueError, match=r"kernels\[1\]"):
        StepPlan(["ode", "euler"], [0.0, 0.0], [False, False])
    with pytest.raises(ValueError, match="noise_levels"):
        StepPlan(["ode", "ode"], [0.0], [False, False])
    with pytest.raises(ValueError, match=r"trained\[0\]"):
        StepPlan(["ode"], [0.0], [True])
    with pytest.raises(ValueError, match=r"noise_levels\[0\]"):
        StepPlan(["flow_sde"], [0.0], [True])
    with pytest.raises(ValueError, match=r"noise_levels\[1\]=2.5: the cps kernel's eta must be in \(0, 1\]"):
        StepPlan(["ode", "cps"], [0.0, 2.5], [False, True])  # sin(2.5 pi / 2) < 0 would give a negative std


def test_sample_rejects_bad_inputs():
    noise = torch.zeros(2, *SHAPE)
    cond = torch.zeros(2, dtype=torch.long)
    with pytest.raises(ValueError, match="sigmas"):
        sample(ToyVelocity(), noise, cond, cond, flow_sigmas(3), StepPlan.ode(4))
    with pytest.raises(ValueError, match="cond"):
        sample(ToyVelocity(), noise, cond.float(), cond, flow_sigmas(4), StepPlan.ode(4))
    with pytest.raises(ValueError, match=r"trained\[3\].*cps"):  # CPS onto t' = 0 has std 0: nothing to train
        sample(
            ToyVelocity(),
            noise,
            cond,
            cond,
            flow_sigmas(4),
            StepPlan.sde(4, kernel="cps", noise_level=0.5, train_last=True),
        )
    with pytest.raises(ValueError, match="num_steps >= 1"):
        StepPlan.sde(0)


def test_rollout_to_keeps_everything():
    rollout, _, _ = _rollout(StepPlan.sde(2))
    moved = rollout.to("cpu")
    assert torch.equal(moved.final, rollout.final) and moved.cost == rollout.cost
    assert moved.kernel_names == ("flow_sde",)


def test_package_imports_only_torch():
    """``import flowrl.samplers`` loads no other flowrl module but the package's stdlib-only :mod:`flowrl.cpu` (run at
    import: MKL's reproducible mode), and neither transformers nor diffusers."""
    code = (
        "import sys, flowrl.samplers; "
        "bad = [m for m in sys.modules if m.split('.')[0] in ('diffusers', 'transformers') "
        "or (m.startswith('flowrl.') and not m.startswith('flowrl.samplers') and m != 'flowrl.cpu')]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    assert set(samplers.__all__) <= set(dir(samplers))


def test_cps_matches_closed_form_and_preserves_coefficients():
    from flowrl.samplers import cps_step

    x, v = _batch()
    noise = torch.randn(x.shape, generator=torch.Generator().manual_seed(2))
    t, t_next, eta = 0.8, 0.6, 0.5
    out = cps_step(x, v, t, t_next, eta, noise=noise)
    s = t_next * math.sin(eta * math.pi / 2)
    x0, x1 = x - t * v, x + (1 - t) * v
    mean = (1 - t_next) * x0 + math.sqrt(t_next**2 - s**2) * x1
    torch.testing.assert_close(out.mean, mean)
    torch.testing.assert_close(out.prev_sample, mean + s * noise)
    # noise coefficient: sqrt(t'^2 - s^2)^2 + s^2 = t'^2 (variance of the noise part preserved)
    assert math.isclose((t_next**2 - s**2) + s**2, t_next**2)
    last = cps_step(x, v, 0.2, 0.0, eta, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(last.prev_sample, x - 0.2 * v)  # to t' = 0: x0_hat, std 0, log-prob 0
    assert bool((last.log_prob == 0).all())


def test_transition_buffer_numbers_rows_and_reads_sigmas_by_step():
    sigmas, (x, v) = flow_sigmas(4, 3.0), _batch(3)
    cond, group = torch.tensor([0, 1, 1]), torch.tensor([0, 0, 1])
    buffer = samplers.TransitionBuffer(sigmas, ("ode", "flow_sde", "cps"))
    first = flow_sde_step(x, v, sigmas[1], sigmas[2], 0.7, sigmas[1], generator=torch.Generator().manual_seed(0))
    node = buffer.append(
        x, first, 1, "flow_sde", 0.7, False, parent=torch.full_like(cond, -1), leaf=torch.arange(3), cond=cond
    )
    second = KERNELS["cps"](first.prev_sample, v, sigmas[2], sigmas[3], 0.5, sigmas[1])
    last = buffer.append(
        first.prev_sample,
        second,
        2,
        "cps",
        0.5,
        True,
        parent=node,
        leaf=torch.arange(3),
        cond=cond,
        depth=torch.tensor([1, 2, 2]),
    )
    ro = buffer.to_rollout(second.prev_sample, cond, group, last, nfe=12)
    assert node.tolist() == [0, 1, 2] and last.tolist() == [3, 4, 5] and len(ro) == buffer.rows == 6
    assert ro.parent.tolist() == [-1, -1, -1, 0, 1, 2] and ro.node.tolist() == list(range(6))
    assert torch.equal(ro.sigma, sigmas[ro.step]) and torch.equal(ro.sigma_next, sigmas[ro.step + 1])
    assert torch.equal(ro.sigma_max, sigmas[1].expand(6)) and ro.kernel_id.tolist() == [1] * 3 + [2] * 3
    assert ro.depth.tolist() == [1, 1, 1, 1, 2, 2] and ro.trained.tolist() == [False] * 3 + [True] * 3
    assert ro.noise_level.dtype == torch.float32 and torch.equal(ro.next_state[3:], second.prev_sample)
    assert ro.cost == dict(nfe=12, transitions=6, trained_transitions=3)
    torch.testing.assert_close(
        recompute_log_prob(ro, torch.cat([v, v])),
        (torch.cat([first.log_prob, second.log_prob]), torch.cat([first.mean, second.mean])),
        rtol=0,
        atol=0,
    )


def test_empty_transition_buffer_gives_a_rollout_without_transitions():
    x, _ = _batch(2)
    cond = torch.tensor([0, 1])
    ro = samplers.TransitionBuffer(flow_sigmas(3, 3.0), ("ode",)).to_rollout(
        x, cond, cond, torch.full_like(cond, -1), 6
    )
    assert len(ro) == 0 and ro.leaf_node.tolist() == [-1, -1] and torch.equal(ro.final, x)
    assert ro.cost == dict(nfe=6, transitions=0, trained_transitions=0)


def test_ode_plan_takes_a_deterministic_kernel_only():
    """StepPlan.ode / ode_sample run one deterministic kernel at every step (Euler, or DPM-Solver++ 2M for
    DiffusionNFT's rollouts); a stochastic kernel is refused by name."""
    assert StepPlan.ode(3, "dpm_solver_2m").kernels == ["dpm_solver_2m"] * 3
    with pytest.raises(ValueError, match="stochastic 'flow_sde'"):
        StepPlan.ode(3, "flow_sde")


def test_a_kernel_registered_once_appears_in_every_view_and_the_config(monkeypatch):
    from flowrl.config import ConfigError, load_config
    from flowrl.samplers import (
        KERNEL_SPECS,
        KERNELS,
        STOCHASTIC_KERNELS,
        UNIT_ETA_KERNELS,
        flow_sde_step,
        register_kernel,
    )

    monkeypatch.setattr("flowrl.samplers.kernels.KERNEL_SPECS", dict(KERNEL_SPECS))  # undone after the test
    import flowrl.samplers.kernels as kernels

    with pytest.raises(ConfigError, match="sampling.kernel"):
        load_config(None, ["sampling.kernel=my_sde"])
    register_kernel("my_sde", flow_sde_step, stochastic=True, unit_eta=True)
    assert "my_sde" in kernels.KERNELS and "my_sde" in kernels.STOCHASTIC_KERNELS and "my_sde" in UNIT_ETA_KERNELS
    assert KERNELS is kernels.KERNELS and "my_sde" in STOCHASTIC_KERNELS  # the exported names are the live views
    assert load_config(None, ["sampling.kernel=my_sde", "sampling.noise_level=0.5"]).sampling.kernel == "my_sde"
    with pytest.raises(ConfigError, match="sampling.noise_level"):  # a unit-eta kernel's noise level is checked
        load_config(None, ["sampling.kernel=my_sde", "sampling.noise_level=2"])
    with pytest.raises(ValueError, match="registered already"):
        register_kernel("my_sde", flow_sde_step)
    with pytest.raises(ValueError, match="deterministic"):
        register_kernel("other", flow_sde_step, stochastic=True, multistep=True)
    assert "ode" in KERNELS and "ode" not in STOCHASTIC_KERNELS and "dpm_solver_2m" not in KERNELS
