"""``ode_velocity_fn``: a second policy (e.g. bf16) for the deterministic rows of every rollout shape.

Every stored transition must still come from ``velocity_fn`` (its log-prob is exactly the one a
float32 recomputation gives, so the PPO ratio stays 1), while the deterministic rows really use the
other function.
"""

import pytest
import torch

from flowrl.samplers import (
    StepPlan,
    flow_sigmas,
    mix_plan,
    recompute_log_prob,
    sample,
    sample_probes,
    sample_shared_noise,
    sample_tree,
)


def velocity(x, t, cond):
    return torch.tanh(x) * (1 + t.view(-1, 1, 1, 1)) + 0.1 * cond.view(-1, 1, 1, 1).float()


class Other:
    """``velocity`` plus an offset (stands in for a lower-precision copy); counts its rows."""

    def __init__(self):
        self.rows = 0

    def __call__(self, x, t, cond):
        self.rows += x.shape[0]
        return velocity(x, t, cond) + 0.01


def _inputs(roots=2):
    noise = torch.randn(roots, 2, 4, 4, generator=torch.Generator().manual_seed(0))
    return noise, torch.arange(roots), torch.arange(roots)


def _assert_transitions_from_velocity_fn(rollout):
    assert len(rollout) > 0
    v = velocity(rollout.state, rollout.sigma, rollout.cond)
    log_prob, mean = recompute_log_prob(rollout, v)
    assert torch.equal(log_prob, rollout.log_prob) and torch.equal(mean, rollout.mean)


def _run(fn, **kwargs):
    gen = torch.Generator().manual_seed(3)
    return fn(generator=gen, **kwargs)


ROLLOUTS = {
    "window": lambda ode: _run(
        lambda **k: sample(velocity, *_inputs(4), *mix_plan(flow_sigmas(8, 3.0), [2, 3]), **k), ode_velocity_fn=ode
    ),
    "flash": lambda ode: _run(
        lambda **k: sample(velocity, *_inputs(4), *mix_plan(flow_sigmas(8, 3.0), [2, 3], flash_ratio=0.5), **k),
        ode_velocity_fn=ode,
    ),
    "shared_noise": lambda ode: _run(
        lambda **k: sample_shared_noise(velocity, *_inputs(2), *mix_plan(flow_sigmas(8, 3.0), [3, 4]), 3, **k),
        ode_velocity_fn=ode,
    ),
    "tree_mix": lambda ode: _run(
        lambda **k: sample_tree(
            velocity, *_inputs(2), flow_sigmas(6, 3.0), StepPlan.window(6, [0, 1, 2]), [2, 1, 2, 1, 1, 1], **k
        ),
        ode_velocity_fn=ode,
    ),
    "tree_node_by_node": lambda ode: _run(
        lambda **k: sample_tree(
            velocity,
            *_inputs(2),
            flow_sigmas(6, 3.0),
            StepPlan.window(6, [0, 1, 2]),
            [2, 1, 2, 1, 1, 1],
            batched=False,
            **k,
        ),
        ode_velocity_fn=ode,
    ),
}


@pytest.mark.parametrize("name", sorted(ROLLOUTS))
def test_deterministic_rows_use_the_ode_function_and_transitions_stay_exact(name):
    other = Other()
    with_other, plain = ROLLOUTS[name](other), ROLLOUTS[name](None)
    _assert_transitions_from_velocity_fn(with_other)
    assert other.rows > 0 and not torch.allclose(with_other.final, plain.final)  # the other function ran
    assert with_other.cost == plain.cost


@pytest.mark.parametrize(
    "plan,children,start",
    [
        (StepPlan.ode(6), 3, False),  # TempFlow-GRPO / G2RPO
        (StepPlan.window(6, [0, 1, 2]), 0, True),
    ],
)  # TP-GRPO
def test_probe_rows_split_between_the_two_functions(plan, children, start):
    noise, cond, group = _inputs()
    sigmas, other = flow_sigmas(6, 3.0), Other()
    kwargs = dict(children=children, granularities=(1, 2), include_start=start)
    out = sample_probes(
        velocity,
        noise,
        cond,
        group,
        sigmas,
        plan,
        [0, 1, 2],
        generator=torch.Generator().manual_seed(1),
        ode_velocity_fn=other,
        **kwargs,
    )
    plain = sample_probes(
        velocity, noise, cond, group, sigmas, plan, [0, 1, 2], generator=torch.Generator().manual_seed(1), **kwargs
    )
    _assert_transitions_from_velocity_fn(out.rollout)
    assert 0 < other.rows < out.cost["nfe"] and out.cost == plain.cost
    assert not torch.allclose(out.final, plain.final)
