"""Branching-tree rollouts (BranchGRPO, arXiv 2509.06040) in the flat :class:`Rollout` layout.

A tree starts from one root per group. At step ``k`` every node of the frontier is evaluated once (one
velocity call for the whole frontier: all nodes of a depth in one batch); at a split step
(``branch[k] > 1``) each node then draws ``branch[k]`` children from the same Gaussian, each with its
own noise. Children share their parent's prefix and its velocity evaluation. Log-probs always use the
std that drew the sample (the published code scales split noise by 4 but scores with the unscaled std;
here a wider split is a larger ``noise_level`` at that step, so the two always agree).

Leaves are ordered so that the descendants of any node are contiguous; :func:`leaf_incidence` gives,
for every stored transition, the leaves below it.
"""

from __future__ import annotations

import torch

from .kernels import STOCHASTIC_KERNELS, UNIT_ETA_KERNELS
from .rollout import (
    Rollout,
    StepPlan,
    TransitionBuffer,
    VelocityFn,
    _check_sample_inputs,
    _step_policy,
    plan_step,
    sample,
)

__all__ = ["leaf_incidence", "sample_shared_noise", "sample_tree"]


def _check_branch(plan: StepPlan, branch: list[int], sigmas: torch.Tensor) -> None:
    """Refuse a `branch` of the wrong length, a factor `< 1`, or a split where the children would be equal: at a
    deterministic step, or at a ``"cps"`` step onto ``t' = 0`` (std 0)."""
    if len(branch) != plan.num_steps:
        raise ValueError(f"branch has {len(branch)} entries; expected {plan.num_steps} (one per step)")
    for k, (b, kernel) in enumerate(zip(branch, plan.kernels)):
        if b < 1:
            raise ValueError(f"branch[{k}]={b} must be >= 1")
        if b > 1 and kernel not in STOCHASTIC_KERNELS:
            raise ValueError(f"branch[{k}]={b} splits at a deterministic step ({kernel!r}); children would be equal")
        if b > 1 and kernel in UNIT_ETA_KERNELS and float(sigmas[k + 1]) == 0:
            raise ValueError(
                f"branch[{k}]={b} splits at the {kernel} step onto t'=0, whose std is 0; children would be equal"
            )


def sample_tree(
    velocity_fn: VelocityFn,
    noise: torch.Tensor,
    cond: torch.Tensor,
    group: torch.Tensor,
    sigmas: torch.Tensor,
    plan: StepPlan,
    branch: list[int],
    generator: torch.Generator | None = None,
    batched: bool = True,
    ode_velocity_fn: VelocityFn | None = None,
) -> Rollout:
    """Run `plan` as a tree from `R` roots, splitting node ``i`` into ``branch[k]`` children at step ``k``.

    The frontier after step ``k`` has ``R * prod(branch[:k + 1])`` nodes. Velocity calls per step: one per
    frontier node BEFORE the split (children share it). The SDE noise of a step is drawn for the whole
    post-split frontier in one call, so ``batched=False`` (one velocity call per node, the published
    code's way) draws identical noise; its samples differ from the batched ones only by the rounding of
    batched matrix products (about 1e-6), and it is slower.

    With ``branch = [G, 1, ..., 1]`` and one root per group this is the flat group with shared initial
    noise; with all ones it is :func:`samplers.sample` on the roots (but for ``depth``: 0 here, no split;
    :func:`samplers.sample` records 1, its group's split at step 0).

    Args:
        velocity_fn (:class:`VelocityFn`): the old policy.
        noise (`torch.Tensor` of shape `(R, C, H, W)`): the roots' starting latents.
        cond (`torch.Tensor` of shape `(R,)`, long): conditioning index per root.
        group (`torch.Tensor` of shape `(R,)`, long): group id per root (one tree = one group).
        sigmas (`torch.Tensor` of shape `(N + 1,)`): strictly decreasing times in `[0, 1]`.
        plan (:class:`StepPlan`): `N` steps; split steps must be stochastic.
        branch (`list[int]`): children per node at each step, `>= 1`.
        generator (`torch.Generator`, optional): source of the SDE noise.
        batched (`bool`): evaluate the whole frontier in one velocity call (True) or node by node.
        ode_velocity_fn (:class:`VelocityFn`, optional): the policy for the deterministic steps, which
            record no log-prob (as :func:`samplers.sample`); default `velocity_fn`.

    Returns:
        :class:`Rollout` with `B = R * prod(branch)` leaves. `depth` counts the splits on a transition's
        path up to and including its step; `leaf` is the first leaf below it; `cost["nfe"]` counts
        velocity evaluations (rows).

    Raises:
        ValueError: bad shapes (as :func:`samplers.sample`), a `branch` of the wrong length, a factor
            `< 1`, or a split at a deterministic step or at a ``"cps"`` step onto ``t' = 0``.
    """
    with torch.no_grad():
        _check_sample_inputs(noise, cond, group, sigmas, plan)
        _check_branch(plan, branch, sigmas)
        x = noise.float()
        device = x.device
        sigmas = sigmas.to(device=device, dtype=torch.float32)
        cond, group = cond.to(device), group.to(device)
        last = torch.full_like(cond, -1)  # (F,) node id of the last stored transition on each frontier path
        depth = torch.zeros_like(cond)  # (F,)
        buffer = TransitionBuffer(sigmas, tuple(dict.fromkeys(plan.kernels)))
        below = _leaves_below(branch)
        nfe, prev_x0, prev_sigma = 0, None, None
        for k in range(plan.num_steps):
            kernel = plan.kernels[k]
            velocity = _frontier_velocity(
                _step_policy(kernel, velocity_fn, ode_velocity_fn), x, sigmas[k], cond, batched
            )
            nfe += x.shape[0]
            b = branch[k]
            if b > 1:
                x, velocity, cond, group, last = (z.repeat_interleave(b, 0) for z in (x, velocity, cond, group, last))
                depth = depth.repeat_interleave(b, 0) + 1
                if prev_x0 is not None:
                    prev_x0 = prev_x0.repeat_interleave(b, 0)
            out = plan_step(plan, k, x, velocity, sigmas, prev_x0, prev_sigma, generator)
            prev_x0, prev_sigma = x - sigmas[k] * velocity, sigmas[k]
            if kernel in STOCHASTIC_KERNELS:
                leaf = torch.arange(x.shape[0], device=device) * below[k]  # (F,) the first leaf below each node
                last = buffer.append(
                    x,
                    out,
                    k,
                    kernel,
                    plan.noise_levels[k],
                    plan.trained[k],
                    parent=last,
                    leaf=leaf,
                    cond=cond,
                    depth=depth,
                )  # (F,) the new nodes' ids
            x = out.prev_sample
        return buffer.to_rollout(x, cond, group, last, nfe)


def _frontier_velocity(
    fn: VelocityFn, x: torch.Tensor, sigma: torch.Tensor, cond: torch.Tensor, batched: bool
) -> torch.Tensor:
    """Velocity `(F, C, H, W)` float32 of the frontier `x` `(F, C, H, W)` at time `sigma` (a scalar tensor),
    in one call (`batched`) or one call per node.

    Raises:
        ValueError: if `fn` returns another shape.
    """
    t = sigma.expand(x.shape[0]).contiguous()  # (F,)
    if batched:
        velocity = fn(x, t, cond).float()
    else:
        velocity = torch.cat([fn(x[i : i + 1], t[i : i + 1], cond[i : i + 1]).float() for i in range(x.shape[0])])
    if velocity.shape != x.shape:
        raise ValueError(f"velocity_fn returned shape {tuple(velocity.shape)}; expected {tuple(x.shape)}")
    return velocity


def _leaves_below(branch: list[int]) -> list[int]:
    """Leaves below one node of step `k`'s post-split frontier, per step: ``prod(branch[k + 1:])``."""
    below = [1] * len(branch)
    for k in range(len(branch) - 2, -1, -1):
        below[k] = below[k + 1] * branch[k + 1]
    return below


def leaf_incidence(rollout: Rollout) -> torch.Tensor:
    """Which leaves lie below each stored transition (the transition is on their path).

    Works on a full rollout (node ids are row numbers); walks each leaf's ``leaf_node`` up ``parent``.

    Args:
        rollout (:class:`samplers.Rollout`): a whole rollout of `M` transitions and `B` leaves, e.g. from
            :func:`sample_tree`.

    Returns:
        `torch.Tensor` of shape `(M, B)`, bool: ``[m, b]`` is True iff transition `m` is on leaf `b`'s path.

    Raises:
        ValueError: for a subset of a rollout (:meth:`Rollout.select`), whose node ids are not its row numbers.
    """
    m, b = len(rollout), rollout.num_leaves
    if not torch.equal(rollout.node.cpu(), torch.arange(m)):
        raise ValueError("leaf_incidence needs a whole rollout (node ids = row numbers), not a selected subset")
    out = torch.zeros(m, b, dtype=torch.bool, device=rollout.final.device)
    current = rollout.leaf_node.clone()  # (B,)
    leaves = torch.arange(b, device=out.device)
    while bool((current >= 0).any()):
        alive = current >= 0
        out[current[alive], leaves[alive]] = True
        current = torch.where(alive, rollout.parent[current.clamp(min=0)], current)
    return out


def sample_shared_noise(
    velocity_fn: VelocityFn,
    noise: torch.Tensor,
    cond: torch.Tensor,
    group: torch.Tensor,
    sigmas: torch.Tensor,
    plan: StepPlan,
    group_size: int,
    generator: torch.Generator | None = None,
    ode_velocity_fn: VelocityFn | None = None,
) -> Rollout:
    """Groups of `group_size` samples from one initial noise each, the shared deterministic prefix run once.

    With one initial noise per group (DanceGRPO, MixGRPO), the deterministic steps before the plan's
    first stochastic step ``f`` give the same state to every member of a group, so they, and the
    velocity of step ``f`` itself, are evaluated once per group and the group splits at ``f`` (a
    :func:`sample_tree` with ``branch[f] = group_size``). Velocity rows: ``R * (f + 1) + R * G * (N - f - 1)``
    instead of ``R * G * N``; for a MixGRPO window starting at step ``l`` that saves
    ``(l + 1) * (G - 1) / (G * N)`` of the sampling. The result has the layout of
    :func:`samplers.sample` on ``noise.repeat_interleave(G, 0)`` (leaves grouped by root, the same SDE
    noise drawn from `generator`) and equals it up to the rounding of batched matrix products.

    Args:
        velocity_fn (:class:`VelocityFn`): the old policy.
        noise (`torch.Tensor` of shape `(R, C, H, W)`): one starting latent per group.
        cond (`torch.Tensor` of shape `(R,)`, long): conditioning index per group.
        group (`torch.Tensor` of shape `(R,)`, long): group id per group.
        sigmas (`torch.Tensor` of shape `(N + 1,)`): strictly decreasing times in `[0, 1]`.
        plan (:class:`StepPlan`): `N` steps.
        group_size (`int`): samples per group `G`, `>= 1`.
        generator (`torch.Generator`, optional): source of the SDE noise.
        ode_velocity_fn (:class:`VelocityFn`, optional): the policy for the deterministic steps (as
            :func:`samplers.sample`); default `velocity_fn`.

    Returns:
        :class:`Rollout` with `B = R * G` leaves; ``cost["nfe"]`` counts the rows actually evaluated.

    Raises:
        ValueError: bad shapes (as :func:`samplers.sample`) or `group_size < 1`.
    """
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1; got {group_size}")
    if not plan.stochastic_steps:  # nothing to split at: every member is the same ODE sample
        rep = (z.repeat_interleave(group_size, 0) for z in (noise, cond, group))
        return sample(velocity_fn, *rep, sigmas, plan, generator=generator, ode_velocity_fn=ode_velocity_fn)
    branch = [1] * plan.num_steps
    branch[plan.stochastic_steps[0]] = group_size
    return sample_tree(
        velocity_fn, noise, cond, group, sigmas, plan, branch, generator=generator, ode_velocity_fn=ode_velocity_fn
    )
