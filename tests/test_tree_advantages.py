"""BranchGRPO reward fusion, depth-wise advantages and pruning on a small hand-made tree."""

import math

import pytest
import torch

from flowrl.advantages import depthwise_advantages, tree_node_rewards, width_prune

# one tree, split in two at step 0 and again at step 1: transitions 0, 1 (step 0) -> 2, 3 | 4, 5 (step 1)
PARENT = torch.tensor([-1, -1, 0, 0, 1, 1])
STEP = torch.tensor([0, 0, 1, 1, 1, 1])
INCIDENCE = torch.tensor(
    [[1, 1, 0, 0], [0, 0, 1, 1], [1, 0, 0, 0], [0, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]], dtype=torch.bool
)
LEAVES = torch.tensor([1.0, 0.0, 3.0, 5.0])


def test_mean_fusion():
    assert tree_node_rewards(INCIDENCE, LEAVES).tolist() == [0.5, 4.0, 1.0, 0.0, 3.0, 5.0]


def test_probability_weighted_fusion():
    lp = torch.tensor([0.0, 0.0, math.log(3.0), 0.0, -2.0, -2.0])
    fused = tree_node_rewards(INCIDENCE, LEAVES, "prob", PARENT, lp)
    torch.testing.assert_close(fused, torch.tensor([0.75 * 1 + 0.25 * 0, 4.0, 1.0, 0.0, 3.0, 5.0]))
    with pytest.raises(ValueError, match="fusion"):
        tree_node_rewards(INCIDENCE, LEAVES, "max")


def test_depthwise_advantages_z_score_per_tree_and_step():
    adv = depthwise_advantages(tree_node_rewards(INCIDENCE, LEAVES), torch.zeros(6, dtype=torch.long), STEP)
    torch.testing.assert_close(adv[:2], torch.tensor([-1.0, 1.0]))
    std = math.sqrt(((1 - 2.25) ** 2 + 2.25**2 + 0.75**2 + 2.75**2) / 4)
    torch.testing.assert_close(adv[2:], (torch.tensor([1.0, 0.0, 3.0, 5.0]) - 2.25) / std)
    # a (tree, step) with one node, or with equal rewards, gets 0
    single = depthwise_advantages(torch.tensor([2.0, 7.0, 7.0]), torch.tensor([0, 1, 1]), torch.tensor([0, 0, 0]))
    assert single.tolist() == [0.0, 0.0, 0.0]


def test_width_pruning_keeps_the_best_and_worst_chains_after_the_last_split():
    keep = width_prune(INCIDENCE, LEAVES, torch.zeros(4, dtype=torch.long), STEP, last_split=0, keep=1)
    assert keep.tolist() == [True, True, False, True, False, True]  # leaves 1 (reward 0) and 3 (reward 5)


def test_process_advantages_per_group_step_and_granularity():
    from flowrl.advantages import process_advantages, sum_by_node

    rewards = torch.tensor([1.0, 3.0, 5.0, 5.0, 0.0, 2.0])
    group = torch.tensor([0, 0, 0, 0, 1, 1])
    step = torch.tensor([0, 0, 1, 1, 0, 0])
    adv = process_advantages(rewards, group, step, torch.ones(6, dtype=torch.long))
    torch.testing.assert_close(adv, torch.tensor([-1.0, 1.0, 0.0, 0.0, -1.0, 1.0]), atol=1e-3, rtol=0)
    # G2RPO: two granularities of the same two branches add up
    adv = process_advantages(
        torch.tensor([1.0, 3.0, 2.0, 0.0]),
        torch.zeros(4, dtype=torch.long),
        torch.zeros(4, dtype=torch.long),
        torch.tensor([1, 1, 2, 2]),
    )
    torch.testing.assert_close(
        sum_by_node(adv, torch.tensor([0, 1, 0, 1]), 3), torch.tensor([0.0, 0.0, 0.0]), atol=1e-3, rtol=0
    )


def test_turning_points():
    from flowrl.advantages import turning_point_rewards

    # R_0..R_4 = 0, -1, 1, 2, 3: trend up; d = -1, 2, 1, 1; step 2 flips to the trend and R_4 > R_2 -> R_4 - R_1 = 4
    out = turning_point_rewards(torch.tensor([[0.0, -1.0, 1.0, 2.0, 3.0]]))
    assert out.tolist() == [[-1.0, 4.0, 1.0, 1.0]]
    # step 1 agrees with what remains: R_4 - R_0
    out = turning_point_rewards(torch.tensor([[0.0, 1.0, 0.5, 2.0]]))
    assert out.tolist() == [[2.0, -0.5, 1.5]]


def test_turning_points_are_balanced_over_the_batch():
    """Two rising trajectories (D = 2, 4) and one falling (D = -2) each have a turning point at step 1: the
    balanced bonus keeps one of each sign, the rising one with the larger |D|; the other takes d_1."""
    from flowrl.advantages import turning_point_rewards

    returns = torch.tensor([[0.0, 1.0, 0.5, 2.0], [0.0, 2.0, 1.0, 4.0], [0.0, -1.0, -0.5, -2.0]])
    assert turning_point_rewards(returns).tolist() == [[1.0, -0.5, 1.5], [4.0, -1.0, 3.0], [-2.0, 0.5, -1.5]]
    assert turning_point_rewards(returns, balance=False).tolist() == [
        [2.0, -0.5, 1.5],
        [4.0, -1.0, 3.0],
        [-2.0, 0.5, -1.5],
    ]
    assert turning_point_rewards(returns[:2]).tolist() == [[2.0, -0.5, 1.5], [4.0, -1.0, 3.0]]  # one sign: all kept


def test_advantage_aggregation_and_best_of_n():
    from flowrl.advantages import aggregate_advantages, best_of_n, group_advantages

    group = torch.tensor([0, 0, 1, 1])
    per = {"big": torch.tensor([0.0, 100.0, 5.0, 5.0]), "small": torch.tensor([0.2, 0.1, 0.0, 1.0])}
    adv, zero = aggregate_advantages(per, {"big": 1.0, "small": 2.0}, group, std="group")
    za, _ = group_advantages(per["big"], group, "group")
    zb, _ = group_advantages(per["small"], group, "group")
    torch.testing.assert_close(adv, za + 2 * zb)
    assert zero.tolist() == [False] * 4  # group 1 varies in 'small'
    assert best_of_n(torch.tensor([3.0, 1.0, 2.0, 0.0, 9.0, 8.0]), torch.tensor([0, 0, 0, 0, 1, 1]), 2).tolist() == [
        True,
        False,
        False,
        True,
        True,
        True,
    ]
