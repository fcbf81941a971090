"""Single-step branching with ODE completion (TempFlow-GRPO, G2RPO, TP-GRPO rollouts)."""

import pytest
import torch

from flowrl.samplers import StepPlan, flow_sigmas, ode_sample, sample, sample_probes


def velocity(x, t, cond):
    return torch.tanh(x) * (1 + t.view(-1, 1, 1, 1)) + 0.1 * cond.view(-1, 1, 1, 1).float()


def _inputs(roots=2):
    noise = torch.randn(roots, 2, 4, 4, generator=torch.Generator().manual_seed(0))
    return noise, torch.arange(roots), torch.arange(roots)


def test_ode_probes_of_an_ode_main_path_all_land_on_the_ode_sample():
    noise, cond, group = _inputs()
    sigmas = flow_sigmas(5, 3.0)
    out = sample_probes(velocity, noise, cond, group, sigmas, StepPlan.ode(5), [0, 2], include_start=True)
    reference = ode_sample(velocity, noise, cond, sigmas)
    assert out.final.shape[0] == 2 * 3 and len(out.rollout) == 0
    for p in range(out.final.shape[0]):
        torch.testing.assert_close(out.final[p], reference[out.root[p]], rtol=1e-6, atol=1e-6)
    assert out.step.tolist().count(-1) == 2 and bool((out.node == -1).all())


def test_children_count_nfe_and_complete_on_their_sub_schedule():
    noise, cond, group = _inputs(1)
    sigmas = flow_sigmas(4, 3.0)
    out = sample_probes(
        velocity,
        noise,
        cond,
        group,
        sigmas,
        StepPlan.ode(4),
        [0, 1],
        children=2,
        generator=torch.Generator().manual_seed(1),
    )
    assert out.cost["nfe"] == 4 + 2 * 3 + 2 * 2  # main path + children completed from steps 1 and 2
    assert len(out.rollout) == 4 and bool(out.rollout.trained.all()) and out.rollout.step.tolist() == [0, 0, 1, 1]
    for p in range(4):
        node = out.node[p]
        start = out.rollout.next_state[node][None]
        expected = sample(
            velocity, start, cond[:1], group[:1], sigmas[out.step[p] + 1 :], StepPlan.ode(4 - 1 - int(out.step[p]))
        ).final[0]
        torch.testing.assert_close(out.final[p], expected, rtol=1e-6, atol=1e-6)


def test_granularity_strides_the_completion():
    noise, cond, group = _inputs(1)
    out = sample_probes(
        velocity,
        noise,
        cond,
        group,
        flow_sigmas(5, 3.0),
        StepPlan.ode(5),
        [0],
        children=1,
        granularities=(1, 2),
        generator=torch.Generator().manual_seed(2),
    )
    # G2RPO's t[:k+2] ++ t[k+2::g] for k = 0: from grid index 1, stride 1 visits 1, 2, 3, 4; stride 2 visits
    # 1, 2 (always one grid step first), then 4, and lands on 0 at index 5
    assert out.cost["nfe"] == 5 + 4 + 3 and out.granularity.tolist() == [1, 2]
    sigmas = flow_sigmas(5, 3.0)
    start = out.rollout.next_state[out.node[1]][None]
    sub = sigmas[[1, 2, 4, 5]]
    expected = sample(velocity, start, cond[:1], group[:1], sub, StepPlan.ode(3)).final[0]
    torch.testing.assert_close(out.final[1], expected, rtol=1e-6, atol=1e-6)
    assert not torch.allclose(out.final[0], out.final[1])


def test_children_of_a_stochastic_main_step_hang_from_the_previous_main_transition():
    noise, cond, group = _inputs(1)
    out = sample_probes(
        velocity,
        noise,
        cond,
        group,
        flow_sigmas(6, 3.0),
        StepPlan.window(6, [1, 2, 3]),
        [2],
        children=2,
        generator=torch.Generator().manual_seed(4),
    )
    # rows: main step 1 (0), main step 2 (1), children of step 2 (2, 3), main step 3 (4)
    assert out.rollout.step.tolist() == [1, 2, 2, 2, 3]
    assert out.rollout.parent.tolist() == [-1, 0, 0, 0, 1]
    torch.testing.assert_close(out.rollout.state[2], out.rollout.state[1])  # the children start where step 2 does


def test_tp_grpo_probes_take_the_main_sde_state():
    noise, cond, group = _inputs(1)
    plan = StepPlan.window(5, [1, 2])
    out = sample_probes(
        velocity,
        noise,
        cond,
        group,
        flow_sigmas(5, 3.0),
        plan,
        [1, 2],
        include_start=True,
        generator=torch.Generator().manual_seed(3),
    )
    assert len(out.rollout) == 2 and out.node.tolist() == [-1, 0, 1]  # R_0, then after SDE steps 1 and 2
    assert torch.equal(out.final[-1], out.rollout.final[0])  # after the last SDE step the completion IS the main path
    assert out.cost["nfe"] == 5 + 5 + 3  # main path, R_0's completion, step 1's (step 2's is not computed again)
    again = sample_probes(
        velocity,
        noise,
        cond,
        group,
        flow_sigmas(5, 3.0),
        plan,
        [1, 2],
        include_start=True,
        granularities=(1, 2),
        generator=torch.Generator().manual_seed(3),
    )
    assert (
        again.cost["nfe"] == 5 + (5 + 3) + (3 + 2) + 2
    )  # stride 2 of step 2 is still completed: from index 3 to 4, 0


def test_bad_probe_arguments_are_named():
    noise, cond, group = _inputs(1)
    with pytest.raises(ValueError, match="probe steps"):
        sample_probes(velocity, noise, cond, group, flow_sigmas(3, 3.0), StepPlan.ode(3), [2])
    with pytest.raises(ValueError, match="dpm_solver_2m"):
        sample_probes(
            velocity,
            noise,
            cond,
            group,
            flow_sigmas(3, 3.0),
            StepPlan(["ode", "dpm_solver_2m", "dpm_solver_2m"], [0.0] * 3, [False] * 3),
            [0],
        )
    with pytest.raises(ValueError, match="child_kernel"):
        sample_probes(
            velocity, noise, cond, group, flow_sigmas(3, 3.0), StepPlan.ode(3), [0], children=2, child_kernel="ode"
        )


def test_children_with_a_zero_or_out_of_range_noise_level_or_a_negative_count_are_refused():
    """A zero noise level gave trained children with std 0 and log-prob 0 (ratio always 1, no gradient) silently."""
    noise, cond, group = _inputs(1)
    sigmas, plan = flow_sigmas(4, 3.0), StepPlan.ode(4)
    with pytest.raises(ValueError, match="child_noise_level=0.0 must be > 0"):
        sample_probes(velocity, noise, cond, group, sigmas, plan, [1], children=2, child_noise_level=0.0)
    with pytest.raises(ValueError, match="child_noise_level=1.5"):
        sample_probes(
            velocity, noise, cond, group, sigmas, plan, [1], children=2, child_kernel="cps", child_noise_level=1.5
        )
    with pytest.raises(ValueError, match="children must be an integer >= 0"):
        sample_probes(velocity, noise, cond, group, sigmas, plan, [1], children=-1)
    out = sample_probes(velocity, noise, cond, group, sigmas, plan, [1], child_noise_level=0.0)  # no children: unused
    assert out.final.shape[0] == 1
