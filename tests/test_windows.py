"""MixGRPO windows, Flash schedules and the DPM-Solver++(2M) kernel."""

import math

import pytest
import torch

from flowrl.samplers import (
    SlidingWindow,
    StepPlan,
    dpm_solver_2m_step,
    flow_sigmas,
    mix_plan,
    ode_step,
    respace_tail,
    sample,
)


def _starts(window: SlidingWindow, iterations: int) -> list[int]:
    out = []
    for _ in range(iterations):
        out.append(window.start)
        window.advance()
    return out


def test_progressive_moves_by_stride_every_interval_and_rolls_back():
    w = SlidingWindow(num_steps=25, size=4, schedule="progressive", stride=1, interval=3)
    starts = _starts(w, 3 * 25)
    assert starts[:7] == [0, 0, 0, 1, 1, 1, 2]
    assert starts[3 * 23] == 23 and starts[3 * 24] == 0  # last = N - 2 = 23, then back to 0
    w = SlidingWindow(num_steps=25, size=4, stride=2, interval=1, roll_back=False)
    assert _starts(w, 14)[-3:] == [22, 23, 23]  # clipped at the last trainable step


def test_window_steps_shrink_at_the_end_but_never_empty():
    w = SlidingWindow(num_steps=25, size=4, start=0)
    assert w.steps == [0, 1, 2, 3]
    w.start = 21
    assert w.steps == [21, 22, 23]
    w.start = 23
    assert w.steps == [23]


def test_decay_and_exp_decay_intervals_follow_the_published_rules():
    w = SlidingWindow(num_steps=25, schedule="decay", interval=10, min_interval=1)
    values = {}
    for start in (0, 11, 23):
        w.start = start
        values[start] = w.current_interval()
    assert values == {0: 10, 11: int(10 * 12 / 23 + 11 / 23), 23: 1}
    w = SlidingWindow(num_steps=25, schedule="exp_decay", interval=25)
    for start, expected in ((0, 25), (13, 25), (20, math.ceil(25 * math.exp(-0.7)))):
        w.start = start
        assert w.current_interval() == expected
    w = SlidingWindow(num_steps=25, schedule="decay", interval=4, min_interval=1)
    starts = _starts(w, 8)
    assert starts == [0, 0, 0, 0, 1, 1, 1, 2]  # tau(0) = 4, tau(1) = int(4 * 22/23 + 1/23) = 3


def test_random_is_seeded_within_range_and_fixed_never_moves():
    a = _starts(SlidingWindow(num_steps=10, size=3, schedule="random", seed=3), 50)
    b = _starts(SlidingWindow(num_steps=10, size=3, schedule="random", seed=3), 50)
    assert a == b and min(a) >= 0 and max(a) <= 8 - 3 + 1 and len(set(a)) > 1
    assert set(_starts(SlidingWindow(num_steps=10, schedule="fixed", start=2), 30)) == {2}


@pytest.mark.parametrize("schedule", ["progressive", "decay", "exp_decay", "random"])
def test_state_round_trip_continues_the_same_sequence(schedule):
    a = SlidingWindow(num_steps=12, size=3, schedule=schedule, interval=2, seed=1)
    _starts(a, 7)
    b = SlidingWindow(num_steps=12, size=3, schedule=schedule, interval=2, seed=1)
    b.load_state_dict(a.state_dict())
    assert _starts(a, 20) == _starts(b, 20)


def test_bad_window_values_are_named():
    with pytest.raises(ValueError, match="schedule"):
        SlidingWindow(num_steps=10, schedule="sideways")
    with pytest.raises(ValueError, match="size"):
        SlidingWindow(num_steps=10, size=0)
    with pytest.raises(ValueError, match="start"):
        SlidingWindow(num_steps=10).load_state_dict({"start": 9, "count": 0, "iteration": 0})
    with pytest.raises(ValueError, match="size=10"):
        SlidingWindow(num_steps=10, size=10)
    with pytest.raises(ValueError, match="exp_k"):
        SlidingWindow(num_steps=10, schedule="exp_decay", exp_k=-0.1)
    with pytest.raises(ValueError, match="interval"):
        SlidingWindow(num_steps=10, interval=2.5)
    with pytest.raises(ValueError, match="reaches the last step"):
        mix_plan(flow_sigmas(10, 3.0), [8, 9], flash_ratio=0.4)
    with pytest.raises(ValueError, match=r"SlidingWindow.start=1.5 must be an integer"):  # was a TypeError in .steps
        SlidingWindow(num_steps=10, start=1.5)
    with pytest.raises(ValueError, match=r"sigmas must have shape \(N \+ 1,\)"):  # was an IndexError
        respace_tail(torch.tensor(1.0), 0, 1)


def test_mix_plan_and_flash_schedule():
    sigmas = flow_sigmas(10, shift=3.0)
    same, plan = mix_plan(sigmas, [2, 3, 4, 5])
    assert same is sigmas
    assert plan.kernels == ["ode"] * 2 + ["flow_sde"] * 4 + ["ode"] * 4 and plan.trained[2:6] == [True] * 4
    flash, plan = mix_plan(sigmas, [2, 3, 4, 5], flash_ratio=0.5, shift=3.0)
    assert plan.num_steps == 6 + 2 and flash.shape == (9,)  # R = 4 steps after the window -> 2
    torch.testing.assert_close(flash[:7], sigmas[:7])  # up to the window's end the schedule is unchanged
    assert flash[-1] == 0 and bool((flash[1:] < flash[:-1]).all())
    assert plan.kernels[6:] == ["dpm_solver_2m"] * 2 and not any(plan.trained[6:])
    linear = respace_tail(flow_sigmas(10, shift=1.0), 3, 2, shift=1.0)  # unshifted: an even tail to 0
    torch.testing.assert_close(linear[3:], torch.linspace(float(linear[3]), 0, 3))


def test_dpm_solver_refuses_per_sample_or_increasing_times():
    x = torch.randn(2, 1, 2, 2)
    with pytest.raises(ValueError, match="sigma must be one time"):
        dpm_solver_2m_step(x, x, torch.tensor([0.5, 0.6]), 0.3)
    with pytest.raises(ValueError, match="sigma_next=0.6 must be < sigma=0.5"):
        dpm_solver_2m_step(x, x, 0.5, 0.6)
    with pytest.raises(ValueError, match="prev_sigma=0.4 .* must be > sigma=0.5"):  # was a silent wrong correction
        dpm_solver_2m_step(x, x, 0.5, 0.3, prev_x0=x, prev_sigma=0.4)


def test_dpm_first_order_from_one_is_euler():
    x, v = torch.randn(2, 3, 4, 4), torch.randn(2, 3, 4, 4)
    torch.testing.assert_close(dpm_solver_2m_step(x, v, 1.0, 0.7).prev_sample, ode_step(x, v, 1.0, 0.7).prev_sample)
    x0 = x - 0.5 * v
    torch.testing.assert_close(dpm_solver_2m_step(x, v, 0.5, 0.0).prev_sample, x0)  # a step to t' = 0 lands on x0_hat


def test_dpm_solver_matches_diffusers():
    from diffusers import DPMSolverMultistepScheduler

    sched = DPMSolverMultistepScheduler(
        prediction_type="flow_prediction",
        use_flow_sigmas=True,
        flow_shift=3.0,
        solver_order=2,
        algorithm_type="dpmsolver++",
        solver_type="midpoint",
    )
    sched.set_timesteps(6)
    sigmas = sched.sigmas.float()  # (7,), ends at 0

    def velocity(x, t, cond):  # a smooth made-up field, the same for both samplers
        return torch.tanh(x) * (1 + t.view(-1, 1, 1, 1)) - 0.3

    x = torch.randn(2, 3, 4, 4, generator=torch.Generator().manual_seed(0))
    ours = sample(
        velocity,
        x,
        torch.zeros(2, dtype=torch.long),
        torch.zeros(2, dtype=torch.long),
        sigmas,
        StepPlan(["dpm_solver_2m"] * 6, [0.0] * 6, [False] * 6),
    ).final
    ref = x.clone()
    for k, timestep in enumerate(sched.timesteps):
        ref = sched.step(velocity(ref, sigmas[k].expand(2), None), timestep, ref).prev_sample
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-5)
