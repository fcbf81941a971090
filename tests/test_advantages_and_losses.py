"""Bad inputs to the advantage estimators, losses, model adapter and bench: one clear error naming the argument
instead of a silently broadcast loss, NaN advantages or a crash deep inside torch."""

import pytest
import torch

from flowrl.advantages import (
    aggregate_advantages,
    best_of_n,
    depthwise_advantages,
    group_advantages,
    process_advantages,
    sum_by_node,
    tree_node_rewards,
    turning_point_rewards,
    width_prune,
)
from flowrl.losses import kl_to_reference, nft_loss, optimality_weights, ppo_loss, ratio_norm, velocity_kl

LONG = torch.long


def test_ppo_loss_refuses_advantages_that_would_broadcast():
    """A `(M, 1)` advantage against `(M,)` log-probs broadcast to an `(M, M)` surrogate: every transition took
    every advantage, and the loss was the mean advantage's, whatever the pairing."""
    lp = torch.zeros(3, requires_grad=True)
    with pytest.raises(ValueError, match=r"advantages must have shape \(3,\).*\(3, 1\)"):
        ppo_loss(lp, torch.zeros(3), torch.tensor([[1.0], [-1.0], [2.0]]), 1e-4)
    with pytest.raises(ValueError, match=r"weights must have shape \(3,\)"):
        ppo_loss(lp, torch.zeros(3), torch.ones(3), 1e-4, weights=torch.ones(2))
    with pytest.raises(ValueError, match=r"old_log_prob must have shape \(3,\)"):
        ppo_loss(lp, torch.zeros(1), torch.ones(3), 1e-4)
    with pytest.raises(ValueError, match="clip_range must be > 0"):
        ppo_loss(lp, torch.zeros(3), torch.ones(3), -0.2)  # clamp(r, 1.2, 0.8) = 0.8 for every ratio


def test_optimality_weights_refuse_a_non_positive_adv_max():
    """adv_max = 0 gave r = 1 for every sample (A / 0 = inf), a negative one reversed the ranking."""
    adv = torch.tensor([-2.0, 0.0, 2.0])
    torch.testing.assert_close(optimality_weights(adv, 4.0), torch.tensor([0.25, 0.5, 0.75]))
    for bad in (0.0, -4.0):
        with pytest.raises(ValueError, match="adv_max must be > 0"):
            optimality_weights(adv, bad)


def test_group_advantages_refuse_non_finite_rewards_and_bad_shapes():
    g = torch.tensor([0, 0, 1, 1])
    with pytest.raises(ValueError, match="finite"):  # was: NaN advantages for the whole group, silently
        group_advantages(torch.tensor([1.0, float("nan"), 3.0, 3.0]), g)
    with pytest.raises(ValueError, match=r"rewards \(4,\) and group \(3,\)"):
        group_advantages(torch.ones(4), g[:3])
    with pytest.raises(ValueError, match="clip must be > 0"):
        group_advantages(torch.ones(4), g, clip=0.0)


def test_aggregate_advantages_names_the_reward_without_weight():
    g = torch.tensor([0, 0])
    with pytest.raises(ValueError, match=r"no weight for reward\(s\) \['ocr'\]"):
        aggregate_advantages({"ocr": torch.tensor([0.0, 1.0]), "clip": torch.tensor([1.0, 0.0])}, {"clip": 1.0}, g)
    with pytest.raises(ValueError, match="at least one reward"):
        aggregate_advantages({}, {}, g)


def test_selection_and_estimators_refuse_mismatched_lengths():
    """best_of_n used to select by a group vector shorter than the rewards without a word."""
    with pytest.raises(ValueError, match=r"rewards \(4,\) and group \(3,\)"):
        best_of_n(torch.ones(4), torch.zeros(3, dtype=LONG), 2)
    with pytest.raises(ValueError, match=r"node_rewards \(3,\), group \(2,\) and step \(3,\)"):
        depthwise_advantages(torch.ones(3), torch.zeros(2, dtype=LONG), torch.zeros(3, dtype=LONG))
    with pytest.raises(ValueError, match=r"granularity \(2,\)"):
        process_advantages(
            torch.ones(3), torch.zeros(3, dtype=LONG), torch.zeros(3, dtype=LONG), torch.ones(2, dtype=LONG)
        )
    with pytest.raises(ValueError, match=r"leaf_rewards \(3,\) \(B,\)"):
        tree_node_rewards(torch.ones(2, 4, dtype=torch.bool), torch.ones(3))
    with pytest.raises(ValueError, match=r"parent \(1,\) and log_prob \(2,\) must be \(2,\)"):
        tree_node_rewards(
            torch.ones(2, 1, dtype=torch.bool), torch.ones(1), "prob", torch.tensor([-1]), torch.zeros(2)
        )
    with pytest.raises(ValueError, match=r"incidence \(2, 2\) must be \(M, B\)"):
        width_prune(
            torch.ones(2, 2, dtype=torch.bool),
            torch.ones(2),
            torch.zeros(2, dtype=LONG),
            torch.zeros(3, dtype=LONG),
            0,
            1,
        )
    with pytest.raises(ValueError, match=r"node ids must lie in \[-1, 3\)"):
        sum_by_node(torch.ones(2), torch.tensor([0, 3]), 3)
    with pytest.raises(ValueError, match=r"returns must be \(B, n \+ 1\).*\(3,\)"):
        turning_point_rewards(torch.tensor([0.0, 1.0, 2.0]))


def test_best_of_n_and_width_pruning_keep_both_ends_of_each_group():
    """The shared selection: `keep // 2` best and the rest worst per group (an odd keep takes one more worst);
    a group smaller than that keeps everyone."""
    rewards = torch.tensor([5.0, 1.0, 3.0, 4.0, 2.0, 9.0, 7.0])
    group = torch.tensor([0, 0, 0, 0, 0, 1, 1])
    assert best_of_n(rewards, group, 3).tolist() == [True, True, False, False, True, True, True]
    inc = torch.eye(7, dtype=torch.bool)  # one transition per leaf, after the split
    assert width_prune(inc, rewards, group, torch.ones(7, dtype=LONG), 0, 1).tolist() == [
        True,
        True,
        False,
        False,
        False,
        True,
        True,
    ]


def test_losses_name_mismatched_tensors():
    x = torch.zeros(2, 1, 2, 2)
    with pytest.raises(ValueError, match=r"std must have shape \(2,\)"):
        kl_to_reference(x, x, torch.ones(3))
    with pytest.raises(ValueError, match=r"mean \(2, 1, 2, 2\) and ref_mean \(3, 1, 2, 2\)"):
        kl_to_reference(x, torch.zeros(3, 1, 2, 2), torch.ones(2))
    with pytest.raises(ValueError, match=r"old_mean \(1, 1, 2, 2\)"):
        ratio_norm(torch.zeros(2), torch.zeros(2), x, x[:1], torch.ones(2))
    with pytest.raises(ValueError, match="ref_velocity"):
        velocity_kl(x, x[:1])
    with pytest.raises(ValueError, match=r"t must have shape \(2,\)"):
        nft_loss(x, x, x, x, torch.ones(3), torch.full((2,), 0.5))
    with pytest.raises(ValueError, match=r"x0 \(1, 1, 2, 2\) must have v's shape"):
        nft_loss(x, x, x, x[:1], torch.ones(2), torch.full((2,), 0.5))
    with pytest.raises(ValueError, match="adv_max must be > 0"):
        nft_loss(x, x, x, x, torch.ones(2), torch.full((2,), 0.5), adv_max=0.0)


def test_bench_refuses_zero_timed_iterations_before_running_a_preset(tmp_path):
    """`--iterations 0` ran every preset's warm-up, then failed on the median of nothing."""
    from flowrl.bench import run_bench

    with pytest.raises(ValueError, match="iterations must be >= 1, got 0"):
        run_bench(["flow_grpo"], iterations=0, out=tmp_path / "b.json")
    with pytest.raises(ValueError, match="budget_s must be >= 0"):
        run_bench(["flow_grpo"], budget_s=-1.0, out=tmp_path / "b.json")
    assert not (tmp_path / "b.json").exists()


def test_velocity_refuses_guidance_below_one():
    from conftest import ASSETS

    from flowrl.models import SD3Model

    model = SD3Model(ASSETS / "tiny-sd3", max_sequence_length=0)
    table = model.encode(["", "a photo of a star"])
    with pytest.raises(ValueError, match=r"guidance_scale must be in \[1, 100\]"):
        model.velocity_fn(table, 0.5)
    x = torch.zeros(1, *model.latent_shape)
    with pytest.raises(ValueError, match=r"guidance_scale must be in \[1, 100\]"):
        model.velocity(x, torch.ones(1), table[torch.tensor([1])], table[torch.tensor([0])], 0.0)


def test_best_of_n_ranks_by_the_aggregated_advantage_as_dancegrpo():
    """With advantage aggregation DanceGRPO keeps the extremes of sum_k w_k z_k; the total reward can order a group
    otherwise (here reward `b` has the larger scale, so the total follows `b` while the z-scores weigh both alike)."""
    from types import SimpleNamespace

    from flowrl.methods import Method

    a = torch.tensor([0.0, 1.0, 0.4, 0.0])
    b = torch.tensor([0.0, 0.0, 10.0, 10.5])
    train = SimpleNamespace(reward_aggregation="advantage", adv_std="group", adv_clip_max=5.0, best_of_n=2)
    from flowrl.methods import Rewards

    fake = SimpleNamespace(
        cfg=SimpleNamespace(train=train),
        device="cpu",
        rewards=SimpleNamespace(rewards={"a": (None, 1.0), "b": (None, 1.0)}),
    )
    rewards = Rewards(None, a + b, {"a": a, "b": b}, torch.zeros(4, dtype=LONG), slice(0, 4))
    adv, zero, _ = Method.group_advantages(fake, rewards)
    assert int(adv.argmax()) == 2 and int(adv.argmin()) == 0  # z-sum order: image 2 best, image 0 worst
    assert (~zero).tolist() == [True, False, True, False]  # the total reward would keep images 3 and 0


def test_g2rpo_sum_over_granularities_is_clipped():
    """G2RPO sums a z-score per granularity; with 12 children and one outlier each z is 3.32 and the sum 6.63, which
    the published code clips to adv_clip_max (flowrl used to leave it at 6.63)."""
    from types import SimpleNamespace

    from flowrl.methods import ProbeSamples, Rewards
    from flowrl.methods.shapes import G2RPOShape

    class _Rollout:
        trained = torch.ones(12, dtype=torch.bool)

        def __len__(self):
            return 12

    children = torch.arange(12)
    pr = SimpleNamespace(
        rollout=_Rollout(),
        step=torch.zeros(24, dtype=LONG),
        root=torch.zeros(24, dtype=LONG),
        node=children.repeat(2),
        granularity=torch.tensor([1] * 12 + [2] * 12),
    )
    shape = G2RPOShape.__new__(G2RPOShape)  # its advantages need only the config and the device
    shape.cfg = SimpleNamespace(train=SimpleNamespace(adv_clip_max=5.0))
    shape.device = "cpu"
    rewards = torch.tensor(([1.0] + [0.0] * 11) * 2)
    samples = ProbeSamples(None, torch.zeros(24, dtype=LONG), 0, pr.rollout, None, pr)
    adv, keep, _ = shape.advantages(samples, Rewards(SimpleNamespace(total=rewards), rewards, {}, None, slice(0, 24)))
    assert adv[0].item() == pytest.approx(5.0) and adv[1].item() == pytest.approx(
        -2 * (1 / 12) / (11**0.5 / 12), abs=1e-3
    )
    assert keep.all()


def test_kl_type_flow_grpo_is_the_exact_kl_times_dt():
    """`train.kl_type: flow_grpo` divides by the SDE's sigma_t^2 as Flow-GRPO's code (the recipe's beta is for that
    KL); `mean` is the exact KL of the two Gaussian steps, 1 / |dt| times it per transition."""
    import contextlib
    from types import SimpleNamespace

    from flowrl.methods import GRPO
    from flowrl.samplers import StepPlan, flow_sigmas, recompute_log_prob, sample

    gen = torch.Generator().manual_seed(0)
    noise, cond = torch.randn(3, 2, 4, 4, generator=gen), torch.zeros(3, dtype=LONG)
    ro = sample(lambda x, t, c: 0.5 * x, noise, cond, cond, flow_sigmas(4), StepPlan.sde(4), gen)
    v = 0.7 * ro.state  # the policy's velocity at the transitions; the reference's is 0.5 x
    mean = recompute_log_prob(ro, v)[1]
    ref_mean = recompute_log_prob(ro, 0.5 * ro.state)[1]
    dt = (ro.sigma - ro.sigma_next).abs()
    per_row = (mean - ref_mean).pow(2).mean(dim=(1, 2, 3)) / (2 * ro.std**2)  # (M,) exact KL per transition
    for kl_type, expected in (("mean", per_row.mean()), ("flow_grpo", (per_row * dt).mean())):
        fake = SimpleNamespace(
            cfg=SimpleNamespace(train=SimpleNamespace(kl_type=kl_type)),
            reference=contextlib.nullcontext,  # GRPO.reference: the reference's context (the base, Flow-OPD's anchor)
            policy=SimpleNamespace(autocast=contextlib.nullcontext),
        )
        kl = GRPO.kl_to_reference(fake, lambda x, t, c: 0.5 * x, ro, v, mean)
        assert kl.item() == pytest.approx(expected.item(), rel=1e-5), kl_type
    assert not torch.allclose(dt, dt[:1].expand_as(dt))  # the two differ by more than one constant
