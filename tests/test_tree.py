"""Branching-tree rollouts: equivalences with flat sampling, batching, NFE counts, leaf paths."""

import pytest
import torch

from flowrl.samplers import StepPlan, flow_sigmas, leaf_incidence, mix_plan, sample, sample_shared_noise, sample_tree


def velocity(x, t, cond):
    """A deterministic made-up field that depends on the state, the time and the conditioning."""
    return torch.tanh(x) * (1 + t.view(-1, 1, 1, 1)) + 0.1 * cond.view(-1, 1, 1, 1).float()


def _inputs(roots: int, seed: int = 0):
    noise = torch.randn(roots, 2, 4, 4, generator=torch.Generator().manual_seed(seed))
    return noise, torch.arange(roots), torch.arange(roots)


def test_tree_without_splits_is_flat_sampling():
    noise, cond, group = _inputs(3)
    plan, sigmas = StepPlan.sde(5), flow_sigmas(5, 3.0)
    tree = sample_tree(velocity, noise, cond, group, sigmas, plan, [1] * 5, generator=torch.Generator().manual_seed(1))
    flat = sample(velocity, noise, cond, group, sigmas, plan, generator=torch.Generator().manual_seed(1))
    for name in ("final", "state", "next_state", "log_prob", "std", "parent", "leaf", "leaf_node", "step", "trained"):
        assert torch.equal(getattr(tree, name), getattr(flat, name)), name
    assert tree.cost == flat.cost


def test_root_split_is_the_flat_group_with_shared_noise():
    noise, cond, group = _inputs(2)
    plan, sigmas = StepPlan.sde(4), flow_sigmas(4, 3.0)
    tree = sample_tree(
        velocity, noise, cond, group, sigmas, plan, [3, 1, 1, 1], generator=torch.Generator().manual_seed(2)
    )
    flat = sample(
        velocity,
        noise.repeat_interleave(3, 0),
        cond.repeat_interleave(3),
        group.repeat_interleave(3),
        sigmas,
        plan,
        generator=torch.Generator().manual_seed(2),
    )
    torch.testing.assert_close(tree.final, flat.final, rtol=0, atol=0)
    torch.testing.assert_close(tree.log_prob, flat.log_prob, rtol=0, atol=0)
    assert torch.equal(tree.group, flat.group)
    assert tree.cost["nfe"] == 2 + 3 * 6 and flat.cost["nfe"] == 4 * 6  # the root's step-0 call is shared


@pytest.mark.parametrize("window,flash", [([3, 4], None), ([2, 3], 0.5), ([0, 1], None)])
def test_shared_noise_runs_the_ode_prefix_once_per_group(window, flash):
    noise, cond, group = _inputs(2)
    sigmas, plan = mix_plan(flow_sigmas(8, 3.0), window, flash_ratio=flash)
    shared = sample_shared_noise(
        velocity, noise, cond, group, sigmas, plan, 3, generator=torch.Generator().manual_seed(4)
    )
    flat = sample(
        velocity,
        noise.repeat_interleave(3, 0),
        cond.repeat_interleave(3),
        group.repeat_interleave(3),
        sigmas,
        plan,
        generator=torch.Generator().manual_seed(4),
    )
    for name in ("final", "state", "next_state", "mean", "log_prob", "std"):
        torch.testing.assert_close(getattr(shared, name), getattr(flat, name), rtol=0, atol=1e-6, msg=name)
    for name in ("leaf", "node", "parent", "depth", "step", "trained", "cond", "group", "leaf_node", "leaf_cond"):
        assert torch.equal(getattr(shared, name), getattr(flat, name)), name
    n = plan.num_steps
    f = window[0] + 1  # the prefix and the split step's velocity once per group
    assert shared.cost["nfe"] == 2 * f + 6 * (n - f)
    assert flat.cost["nfe"] == 6 * n


def test_shared_noise_without_stochastic_steps_is_the_repeated_ode_sample():
    noise, cond, group = _inputs(2)
    out = sample_shared_noise(velocity, noise, cond, group, flow_sigmas(4, 3.0), StepPlan.ode(4), 3)
    assert out.num_leaves == 6 and len(out) == 0
    assert torch.equal(out.final[0], out.final[2]) and not torch.equal(out.final[0], out.final[3])
    with pytest.raises(ValueError, match="group_size"):
        sample_shared_noise(velocity, noise, cond, group, flow_sigmas(4, 3.0), StepPlan.ode(4), 0)


def test_ode_tree_and_probes_store_no_transition_and_match_flat_sampling():
    from flowrl.samplers import sample_probes

    noise, cond, group = _inputs(3)
    plan, sigmas = StepPlan.ode(4), flow_sigmas(4, 3.0)
    flat = sample(velocity, noise, cond, group, sigmas, plan)
    tree = sample_tree(velocity, noise, cond, group, sigmas, plan, [1] * 4)
    probes = sample_probes(velocity, noise, cond, group, sigmas, plan, [1]).rollout
    for out in (flat, tree, probes):
        assert len(out) == 0 and out.state.shape == (0, 2, 4, 4) and out.trained.dtype == torch.bool
        assert torch.equal(out.leaf_node, torch.full((3,), -1)) and torch.equal(out.group, group)
        torch.testing.assert_close(out.final, flat.final, rtol=0, atol=0)
    assert tree.cost == flat.cost == {"nfe": 12, "transitions": 0, "trained_transitions": 0}


def test_batched_tree_equals_node_by_node_and_counts_nfe():
    noise, cond, group = _inputs(2)
    plan, sigmas = StepPlan.sde(4, train_last=True), flow_sigmas(4, 3.0)
    branch = [2, 1, 2, 1]
    a = sample_tree(velocity, noise, cond, group, sigmas, plan, branch, generator=torch.Generator().manual_seed(3))
    b = sample_tree(
        velocity, noise, cond, group, sigmas, plan, branch, generator=torch.Generator().manual_seed(3), batched=False
    )
    assert torch.equal(a.final, b.final) and torch.equal(a.log_prob, b.log_prob)
    assert a.num_leaves == 8 and len(a) == 4 + 4 + 8 + 8
    assert a.cost["nfe"] == 2 + 4 + 4 + 8  # per step: the frontier before the split
    assert a.depth.tolist() == [1] * 4 + [1] * 4 + [2] * 8 + [2] * 8
    assert torch.equal(a.group, torch.tensor([0] * 4 + [1] * 4))


def test_tree_with_a_flash_tail_batches_and_counts_the_compressed_steps():
    """BranchGRPO-Mix with MixGRPO-Flash's tail: splits at 0 and 2, SDE on 0-2, the 5 steps after re-spaced to 2."""
    noise, cond, group = _inputs(2)
    sigmas, plan = mix_plan(flow_sigmas(8, 3.0), [0, 1, 2], flash_ratio=0.4)
    assert plan.kernels == ["flow_sde"] * 3 + ["dpm_solver_2m"] * 2 and sigmas.shape == (6,)
    branch = [2, 1, 2, 1, 1]
    a = sample_tree(velocity, noise, cond, group, sigmas, plan, branch, generator=torch.Generator().manual_seed(5))
    b = sample_tree(
        velocity, noise, cond, group, sigmas, plan, branch, generator=torch.Generator().manual_seed(5), batched=False
    )
    torch.testing.assert_close(a.final, b.final, rtol=0, atol=1e-6)
    assert torch.equal(a.log_prob, b.log_prob)
    assert a.num_leaves == 8 and a.cost["nfe"] == 2 + 4 + 4 + 8 + 8  # the tail: 2 steps of the 8 leaves
    full_sigmas, full_plan = mix_plan(flow_sigmas(8, 3.0), [0, 1, 2])
    full = sample_tree(
        velocity,
        noise,
        cond,
        group,
        full_sigmas,
        full_plan,
        branch + [1] * 3,
        generator=torch.Generator().manual_seed(5),
    )
    assert full.cost["nfe"] == 2 + 4 + 4 + 8 * 5
    assert torch.equal(a.log_prob, full.log_prob)  # the same SDE prefix and noise; only the ODE tail differs


def test_leaf_incidence_follows_the_tree():
    noise, cond, group = _inputs(1)
    plan = StepPlan(["flow_sde", "ode", "flow_sde", "flow_sde"], [0.7, 0.0, 0.7, 0.7], [True, False, True, False])
    ro = sample_tree(velocity, noise, cond, group, flow_sigmas(4, 3.0), plan, [2, 1, 2, 1])
    inc = leaf_incidence(ro)  # (M, B) = (2 + 4 + 4, 4)
    assert inc.shape == (10, 4)
    assert inc[:2].sum(1).tolist() == [2, 2] and inc[2:].sum(1).tolist() == [1] * 8  # leaves below each transition
    assert inc[0].tolist() == [True, True, False, False]
    assert inc.sum(0).tolist() == [3, 3, 3, 3]  # every leaf path holds one transition per stored step
    assert ro.leaf.tolist() == [0, 2, 0, 1, 2, 3, 0, 1, 2, 3]
    # the ODE step between the stored ones is skipped by the parent pointers
    assert ro.parent[2:6].tolist() == [0, 0, 1, 1]
    with pytest.raises(ValueError, match="whole rollout"):
        leaf_incidence(ro.select(torch.arange(2, 10)))


def test_split_at_a_deterministic_step_is_refused():
    noise, cond, group = _inputs(1)
    with pytest.raises(ValueError, match=r"branch\[1\]=2 splits at a deterministic step"):
        sample_tree(velocity, noise, cond, group, flow_sigmas(3, 3.0), StepPlan.window(3, [0]), [1, 2, 1])
    with pytest.raises(ValueError, match="one per step"):
        sample_tree(velocity, noise, cond, group, flow_sigmas(3, 3.0), StepPlan.sde(3), [1, 1])


def test_split_at_the_cps_step_onto_zero_is_refused():
    noise, cond, group = _inputs(1)
    plan = StepPlan.sde(3, kernel="cps", noise_level=0.5)  # the last step lands on t' = 0 with std 0
    with pytest.raises(ValueError, match=r"branch\[2\]=2 splits at the cps step onto t'=0"):
        sample_tree(velocity, noise, cond, group, flow_sigmas(3, 3.0), plan, [1, 1, 2])
    ro = sample_tree(velocity, noise, cond, group, flow_sigmas(3, 3.0), plan, [1, 2, 1])
    assert ro.num_leaves == 2 and not torch.equal(ro.final[0], ro.final[1])
