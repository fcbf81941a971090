"""GRPO-Guard RatioNorm and step reweighting, TempFlow noise-aware weights, velocity KL."""

import math

import pytest
import torch

from flowrl.losses import ppo_loss, ratio_norm, step_weights, velocity_kl
from flowrl.samplers import StepPlan, flow_sde_step, flow_sigmas, sample, velocity_gain


def test_ratio_norm_has_mean_zero_and_equal_spread_at_every_step():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 8, generator=gen)
    dmu = 0.01 * torch.randn(1, 8, generator=gen)  # the policy moved the mean a little
    raw, normed = {}, {}
    for tau in (0.02, 0.2, 1.0):
        old_mean = x
        eps = torch.randn(x.shape, generator=gen)
        x_next = old_mean + tau * eps
        std = torch.full((x.shape[0],), tau)
        lp_old = torch.distributions.Normal(old_mean, tau).log_prob(x_next).mean(1)
        lp_new = torch.distributions.Normal(old_mean + dmu, tau).log_prob(x_next).mean(1)
        raw[tau] = lp_new - lp_old
        normed[tau] = ratio_norm(lp_new, lp_old, old_mean + dmu, old_mean, std)
        torch.testing.assert_close(normed[tau], (eps * dmu).mean(1), rtol=1e-3, atol=1e-6)  # the closed form
    for tau in raw:
        assert raw[tau].mean() < 0  # the analytic bias -|dmu|^2 / (2 tau^2)
        assert abs(normed[tau].mean()) < 3 * normed[tau].std() / math.sqrt(4096)
    spreads = [normed[t].std().item() for t in normed]
    assert max(spreads) / min(spreads) < 1.1
    assert raw[0.02].std() > 10 * raw[1.0].std()  # without RatioNorm the spread grows as 1 / tau


def test_velocity_gain_matches_the_flow_sde_closed_form():
    plan = StepPlan.sde(5, train_last=True)
    x = torch.randn(2, 2, 3, 3, generator=torch.Generator().manual_seed(0))
    ro = sample(
        lambda x, t, c: torch.tanh(x), x, torch.zeros(2, dtype=torch.long), torch.arange(2), flow_sigmas(5, 3.0), plan
    )
    a = 0.7
    expected = (1 + a**2 / 2) * (ro.sigma - ro.sigma_next)
    first = ro.sigma == 1  # at t = 1 the factor (1 - t) kills the SDE correction: gain = |dt|
    expected[first] = (ro.sigma - ro.sigma_next)[first]
    torch.testing.assert_close(velocity_gain(ro), expected)


def test_guard_reweighting_equalises_per_step_gradients_on_a_linear_model():
    """v = theta * x; the normalised log-ratio's gradient at step t scales with the kernel's gain."""
    theta = torch.tensor(0.5, requires_grad=True)
    sigmas = flow_sigmas(6, 3.0)
    x = torch.randn(1, 4, 4, 4, generator=torch.Generator().manual_seed(1))
    eps = torch.randn(1, 4, 4, 4, generator=torch.Generator().manual_seed(2))
    norms = []
    for k in range(1, 5):
        with torch.no_grad():
            old = flow_sde_step(x, 0.5 * x, sigmas[k], sigmas[k + 1], 0.7, sigmas[1], noise=eps)
        new = flow_sde_step(x, theta * x, sigmas[k], sigmas[k + 1], 0.7, sigmas[1], prev_sample=old.prev_sample)
        lr_hat = ratio_norm(new.log_prob, old.log_prob, new.mean, old.mean, old.std)
        gain = (1 + 0.7**2 / 2) * (sigmas[k] - sigmas[k + 1])
        (grad,) = torch.autograd.grad(lr_hat.sum() / gain, theta)
        norms.append(grad.abs().item())
    assert max(norms) / min(norms) < 1 + 1e-4
    w = step_weights("guard", torch.tensor([0.1, 0.2, 0.4]), torch.ones(3), torch.arange(3))
    torch.testing.assert_close(w, torch.tensor([4.0, 2.0, 1.0]) / (7 / 3))
    torch.testing.assert_close(
        step_weights("noise_aware", torch.ones(2), torch.tensor([1.0, 3.0]), torch.arange(2)), torch.tensor([0.5, 1.5])
    )
    assert step_weights("none", torch.ones(2), torch.ones(2), torch.arange(2)) is None


def test_step_weights_are_normalised_over_steps_not_transitions():
    """TempFlow's w_t = tau_t / mean_t(tau_t): a step holding more transitions (or a minibatch holding few
    of a step) does not move the weights; `among` picks the steps that set the mean."""
    std = torch.tensor([1.0, 1.0, 1.0, 3.0])  # step 0 three times, step 1 once
    step = torch.tensor([0, 0, 0, 1])
    torch.testing.assert_close(step_weights("noise_aware", std, std, step), torch.tensor([0.5, 0.5, 0.5, 1.5]))
    among = torch.tensor([True, True, True, False])  # only step 0 sets the mean
    torch.testing.assert_close(step_weights("noise_aware", std, std, step, among), torch.tensor([1.0, 1.0, 1.0, 3.0]))
    with pytest.raises(ValueError, match="no transition"):
        step_weights("noise_aware", std, std, step, torch.zeros(4, dtype=torch.bool))


def test_weighted_ppo_loss_and_velocity_kl():
    lp = torch.zeros(2, requires_grad=True)
    loss, stats = ppo_loss(lp, torch.zeros(2), torch.tensor([1.0, -1.0]), 1e-4, weights=torch.tensor([2.0, 0.0]))
    assert loss.item() == -1.0 and stats["policy/clipfrac_high"] == 0
    assert velocity_kl(torch.ones(2, 3), torch.zeros(2, 3)).item() == 1.0


def test_per_step_param_grad_norms_match_a_manual_backward(tmp_path, random_pipeline, prompt_files):
    """``train.step_grad_norms=params`` logs, per denoising step, the norm of the gradient of that step's mean
    loss; the whole loss is the mean of the step losses (equal counts), so by the triangle inequality its
    gradient norm is at most the mean of the per-step norms."""
    import json

    from conftest import tiny_overrides

    from flowrl.config import load_config
    from flowrl.trainer import Trainer

    train, test = prompt_files
    rows = {}
    for mode in ("params", "velocity"):
        out = tmp_path / mode
        over = tiny_overrides(
            random_pipeline,
            train,
            test,
            out,
            **{
                "run.iterations": 1,
                "run.mixed_precision": "no",
                "train.step_grad_norms": mode,
                "train.minibatch_size": 64,
                "rewards.jpeg_compressibility.weight": 1.0,
            },
        )
        Trainer(load_config(None, over)).train()
        rows[mode] = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    p, v = rows["params"], rows["velocity"]
    steps = sorted(k for k in p if k.endswith("/grad_norm"))
    assert steps == sorted(k for k in v if k.endswith("/grad_norm")) and len(steps) >= 2
    assert all(p[k] > 0 and math.isfinite(p[k]) and v[k] > 0 for k in steps)
    assert p["policy/optimizer_steps"] == 1  # one minibatch holds every transition
    assert 0 < p["policy/grad_norm"] <= sum(p[k] for k in steps) / len(steps) * (1 + 1e-4)
