"""Single-step branching with ODE completion: TempFlow-GRPO, G2RPO and TP-GRPO rollouts as one mechanism.

A main path runs a :class:`StepPlan` (all ODE for TempFlow-GRPO and G2RPO, an SDE window for TP-GRPO).
At each probe step ``i`` the velocity the main path already computed at ``x_i`` is reused to

- draw ``children`` SDE children ``x'_{i,k}`` (stored, trained transitions; TempFlow-GRPO arXiv 2508.04324,
  G2RPO arXiv 2510.01982), or, with ``children = 0``,
- take the main path's own next state ``x_{i+1}`` (TP-GRPO arXiv 2602.06422: the reward after the
  first ``i + 1`` SDE steps; when only Euler steps follow, its stride-1 completion is the main path itself,
  whose final is reused instead of being computed twice, as TP-GRPO's code reuses the main image),

and every probe is completed to ``t = 0`` with deterministic Euler on the sub-schedule
``sigmas[i+1], sigmas[i+2], sigmas[i+2+g], sigmas[i+2+2g], ...`` (and 0) for each granularity ``g``: G2RPO's
multi-granularity ``t[:k+2] ++ t[k+2::g]`` (arXiv 2510.01982; 1 = the full grid). When that sub-grid ends at
0, the last Euler step onto ``t = 0`` gives the ``x0_hat`` that G2RPO decodes; when it does not (``(N - k -
2) % g != 0``), flowrl evaluates its last point too and steps from it to 0, where G2RPO's code decodes the
``x0_hat`` of the point before: one Euler step finer, one more velocity row. ``include_start`` adds the pure-ODE completion from
``x_T`` on ``sigmas[0], sigmas[g], ...`` (TP-GRPO's ``R_0``).

All rows that sit at the same grid index -- main path, completions of every probe and granularity -- are
evaluated in ONE velocity call per grid step (two when an ``ode_velocity_fn`` is given for the rows
whose velocity enters no log-prob and the main path's does).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .kernels import KERNELS, STOCHASTIC_KERNELS, UNIT_ETA_KERNELS, ode_step
from .rollout import Rollout, StepPlan, TransitionBuffer, VelocityFn, _check_sample_inputs

__all__ = ["ProbeRollout", "sample_probes"]


@dataclass
class ProbeRollout:
    """Stored transitions (main-path SDE steps and SDE children) plus the completed probes.

    Attributes:
        rollout (:class:`Rollout`): transitions; its leaves are the `R` main-path finals.
        final (`torch.Tensor` of shape `(P, C, H, W)`, float32): each probe completed to ``t = 0``.
        root (`(P,)` long): the main path (row of `noise`) the probe branched from.
        step (`(P,)` long): the probe step ``i`` (`-1` for the completion from ``x_T``).
        child (`(P,)` long): child index ``k`` (0 when probes take the main path's own state).
        granularity (`(P,)` long): the completion's grid stride ``g``.
        node (`(P,)` long): the transition the probe evaluates (the child's SDE step, or the main path's
            step ``i``); `-1` for the completion from ``x_T`` or an ODE main step.
        cost (`dict[str, int]`): ``nfe`` (velocity rows, main path and completions), ``transitions``,
            ``trained_transitions``, ``probes``.
    """

    rollout: Rollout
    final: torch.Tensor
    root: torch.Tensor
    step: torch.Tensor
    child: torch.Tensor
    granularity: torch.Tensor
    node: torch.Tensor
    cost: dict


def _check_probe_inputs(
    noise,
    cond,
    group,
    sigmas,
    plan: StepPlan,
    probe_steps: list[int],
    children: int,
    child_kernel: str,
    child_noise_level: float,
    granularities: tuple[int, ...],
) -> None:
    """Validate :func:`sample_probes`'s arguments (shapes as :func:`samplers.sample`).

    Raises:
        ValueError: for bad shapes, a multistep kernel in `plan`, a probe step outside ``[0, N - 1)``, a
            negative `children`, a non-stochastic `child_kernel` or a `child_noise_level` outside ``(0, inf)``
            (``(0, 1]`` for ``"cps"``) (when `children > 0`), or an empty `granularities` or one `< 1`.
    """
    _check_sample_inputs(noise, cond, group, sigmas, plan)
    if isinstance(children, bool) or not isinstance(children, int) or children < 0:
        raise ValueError(f"children must be an integer >= 0 (0 = probe the main path's own state); got {children!r}")
    multistep = sorted({k for k in plan.kernels if k not in KERNELS})
    if multistep:
        raise ValueError(
            f"sample_probes runs single-step kernels only; the plan uses {multistep} (no Flash plan here)"
        )
    n = plan.num_steps
    if any(not 0 <= i < n - 1 for i in probe_steps):
        raise ValueError(
            f"probe steps must lie in [0, {n - 1}) (a probe needs a step left to complete); got {probe_steps}"
        )
    if children and child_kernel not in STOCHASTIC_KERNELS:
        raise ValueError(f"child_kernel={child_kernel!r} must be stochastic, one of {sorted(STOCHASTIC_KERNELS)}")
    if children and not (child_noise_level > 0 and (child_kernel not in UNIT_ETA_KERNELS or child_noise_level <= 1)):
        raise ValueError(
            f"child_noise_level={child_noise_level} must be > 0 (and <= 1 for 'cps', 'ddim'): the children "
            "are trained transitions and a zero noise level gives them std 0 and no log-prob"
        )
    if not granularities or min(granularities) < 1:
        raise ValueError(f"granularities must be >= 1; got {granularities}")


def _new_pool(x: torch.Tensor, cond: torch.Tensor) -> dict[str, torch.Tensor]:
    """An empty completion pool: ``x`` `(0, C, H, W)` float32, and `(0,)` long ``idx`` (grid index the row
    sits at), ``g``, ``root``, ``step``, ``child``, ``node`` (as the :class:`ProbeRollout` fields)."""
    return dict(
        x=x.new_empty((0, *x.shape[1:])),
        idx=cond.new_empty(0),
        g=cond.new_empty(0),
        root=cond.new_empty(0),
        step=cond.new_empty(0),
        child=cond.new_empty(0),
        node=cond.new_empty(0),
    )


def _spawn(
    pool: dict,
    granularities: tuple[int, ...],
    states: torch.Tensor,
    root: torch.Tensor,
    step: torch.Tensor,
    child: torch.Tensor,
    node: torch.Tensor,
    start: int,
) -> None:
    """Append `K` new completions per granularity to `pool` (in place), all sitting at grid index `start`.

    `states` is `(K, C, H, W)` float32; `root`, `step`, `child`, `node` are `(K,)` long.
    """
    for g in granularities:
        k = len(states)
        new = dict(
            x=states,
            idx=torch.full((k,), start, dtype=torch.long, device=states.device),
            g=torch.full((k,), g, dtype=torch.long, device=states.device),
            root=root,
            step=step,
            child=child,
            node=node,
        )
        for name in pool:
            pool[name] = torch.cat([pool[name], new[name]])


def _velocity(
    velocity_fn: VelocityFn,
    ode_velocity_fn: VelocityFn | None,
    exact: bool,
    x: torch.Tensor,
    cond: torch.Tensor,
    batch_x: torch.Tensor,
    batch_c: torch.Tensor,
    t: torch.Tensor,
) -> torch.Tensor:
    """Velocity `(B, C, H, W)` float32 of `batch_x` `(B, C, H, W)` (the `R` main rows `x` first, then the
    completions), `batch_c` `(B,)` long, at `t` `(B,)`.

    One call, or, when `exact` (the main rows draw a log-prob) and `ode_velocity_fn` is given, `velocity_fn`
    on the main rows and `ode_velocity_fn` on the completions (if any).
    """
    if ode_velocity_fn is None:
        return velocity_fn(batch_x, t, batch_c).float()
    if not exact:
        return ode_velocity_fn(batch_x, t, batch_c).float()
    roots = x.shape[0]
    return torch.cat(
        [velocity_fn(x, t[:roots], cond).float()]
        + ([ode_velocity_fn(batch_x[roots:], t[roots:], batch_c[roots:]).float()] if batch_x.shape[0] > roots else [])
    )


def _euler_pool(pool: dict, here: torch.Tensor, v_pool: torch.Tensor, sigmas: torch.Tensor, j: int, n: int) -> None:
    """Move the pool rows selected by `here` `(Q,)` bool, all at grid index `j`, one Euler step (in place)
    with their velocity `v_pool` `(Q_j, C, H, W)`: to ``j + 1`` for a probe still at ``t_{step+1}``, else
    ``j + g``, clamped to `n` (``t = 0``)."""
    step_k, idx = pool["step"][here], pool["idx"][here]  # (Q_j,), (Q_j,)
    fresh = (step_k >= 0) & (idx == step_k + 1)  # (Q_j,) a probe of step k first takes one grid step
    stride = torch.where(fresh, torch.ones_like(pool["g"][here]), pool["g"][here])  # (Q_j,)
    target = (idx + stride).clamp(max=n)  # (Q_j,)
    pool["x"][here] = ode_step(pool["x"][here], v_pool, sigmas[j], sigmas[target]).prev_sample
    pool["idx"][here] = target


def _evaluate(
    pool: dict,
    x: torch.Tensor,
    cond: torch.Tensor,
    sigmas: torch.Tensor,
    j: int,
    n: int,
    velocity_fn: VelocityFn,
    ode_velocity_fn: VelocityFn | None,
    exact: bool,
) -> tuple[torch.Tensor, int]:
    """Evaluate the main rows `x` `(R, C, H, W)` and the completions at grid index `j` together, and advance
    those completions one Euler step (see :func:`_euler_pool`).

    Returns:
        the main rows' velocity `(R, C, H, W)` float32, and the number of velocity rows evaluated.
    """
    roots = x.shape[0]
    here = pool["idx"] == j  # (Q,) completions sitting at grid index j
    batch_x = torch.cat([x, pool["x"][here]])  # (R + Q_j, C, H, W)
    batch_c = torch.cat([cond, cond[pool["root"][here]]])  # (R + Q_j,)
    t = sigmas[j].expand(batch_x.shape[0]).contiguous()  # (R + Q_j,)
    velocity = _velocity(velocity_fn, ode_velocity_fn, exact, x, cond, batch_x, batch_c, t)
    if bool(here.any()):
        _euler_pool(pool, here, velocity[roots:], sigmas, j, n)
    return velocity[:roots], batch_x.shape[0]


def _retire(pool: dict, done: dict, n: int) -> None:
    """Move the pool rows that reached grid index `n` (``t = 0``) into `done` (lists of tensors), in place."""
    finished = pool["idx"] >= n  # (Q,)
    for name in pool:
        done.setdefault(name, []).append(pool[name][finished])
        pool[name] = pool[name][~finished]


def _repeat(z: torch.Tensor, children: int) -> torch.Tensor:
    """Each row of `z` `(R, ...)` `children` times in a row: `(R * children, ...)`."""
    return z.repeat_interleave(children, 0)


def _sorted_probes(done: dict) -> dict[str, torch.Tensor]:
    """The finished completions `done` (lists of pool tensors) concatenated to `P` rows and sorted by step,
    root, child and granularity (stable)."""
    out = {name: torch.cat(parts) for name, parts in done.items()}
    order = torch.arange(out["x"].shape[0], device=out["x"].device)  # (P,)
    for key in ("g", "child", "root", "step"):  # stable sorts, least significant key first
        order = order[torch.argsort(out[key][order], stable=True)]  # (P,)
    return {name: value[order] for name, value in out.items()}


@torch.no_grad()
def sample_probes(
    velocity_fn: VelocityFn,
    noise: torch.Tensor,
    cond: torch.Tensor,
    group: torch.Tensor,
    sigmas: torch.Tensor,
    plan: StepPlan,
    probe_steps: list[int],
    children: int = 0,
    child_kernel: str = "flow_sde",
    child_noise_level: float = 0.7,
    granularities: tuple[int, ...] = (1,),
    include_start: bool = False,
    generator: torch.Generator | None = None,
    ode_velocity_fn: VelocityFn | None = None,
) -> ProbeRollout:
    """Main path + probes completed by ODE (see the module docstring).

    Args:
        velocity_fn (:class:`VelocityFn`): the old policy.
        noise (`torch.Tensor` of shape `(R, C, H, W)`): main paths' starting latents.
        cond, group (`torch.Tensor` of shape `(R,)`, long): conditioning index and group id per main path.
        sigmas (`torch.Tensor` of shape `(N + 1,)`): the grid.
        plan (:class:`StepPlan`): the main path's `N` steps.
        probe_steps (`list[int]`): steps ``i`` in ``[0, N - 1)`` that probe.
        children (`int`): SDE children per probe (0 = complete the main path's ``x_{i+1}``).
        child_kernel (`str`), child_noise_level (`float`): the children's stochastic kernel.
        granularities (`tuple[int, ...]`): completion strides, each `>= 1`.
        include_start (`bool`): also complete ``x_T`` itself by ODE (step `-1`).
        generator (`torch.Generator`, optional): SDE noise source (main path first, then children, per step).
        ode_velocity_fn (:class:`VelocityFn`, optional): the policy for rows whose velocity enters no
            log-prob: the completions, and the main path at a deterministic step without children (e.g.
            `velocity_fn` under bf16 autocast); default `velocity_fn`. At a step whose main-path velocity
            draws a stored transition, the main rows and the completions are two calls.

    Returns:
        :class:`ProbeRollout`. Transition rows are in creation order; `parent` links main-path steps only.
        Probes are sorted by step, root, child and granularity.

    Raises:
        ValueError: for a probe step outside ``[0, N - 1)``, a negative `children`, a non-stochastic
            `child_kernel` or a `child_noise_level <= 0` (`> 1` for ``"cps"``) with children, a granularity
            `< 1`, a plan with a multistep kernel (DPM-Solver++), or bad shapes (as :func:`samplers.sample`).
    """
    _check_probe_inputs(
        noise, cond, group, sigmas, plan, probe_steps, children, child_kernel, child_noise_level, granularities
    )
    x = noise.float()
    device, roots, n = x.device, x.shape[0], plan.num_steps
    sigmas = sigmas.to(device=device, dtype=torch.float32)
    cond, group = cond.to(device), group.to(device)
    leaves, no_node = torch.arange(roots, device=device), torch.full_like(cond, -1)  # (R,), (R,)
    kernel_names = tuple(dict.fromkeys(plan.kernels + ([child_kernel] if children else [])))
    buffer = TransitionBuffer(sigmas, kernel_names)
    done: dict[str, list] = {}
    pool = _new_pool(x, cond)
    nfe, last = 0, no_node
    probes = set(probe_steps)
    follows: list[tuple[int, torch.Tensor]] = []  # probes whose completion is the main path's own ODE tail
    if include_start:
        _spawn(pool, granularities, x.clone(), leaves, torch.full_like(cond, -1), torch.zeros_like(cond), no_node, 0)
    for j in range(n):
        kernel = plan.kernels[j]
        exact = kernel in STOCHASTIC_KERNELS or (j in probes and children > 0)  # main rows draw a log-prob
        v_main, width = _evaluate(pool, x, cond, sigmas, j, n, velocity_fn, ode_velocity_fn, exact)  # (R, C, H, W)
        nfe += width
        before = last  # the main-path transition that produced x (the parent of this step's children)
        out = KERNELS[kernel](
            x, v_main, sigmas[j], sigmas[j + 1], plan.noise_levels[j], sigmas[1], generator=generator
        )
        if kernel in STOCHASTIC_KERNELS:
            last = buffer.append(
                x, out, j, kernel, plan.noise_levels[j], plan.trained[j], parent=last, leaf=leaves, cond=cond
            )  # (R,)
        if j in probes and children:
            child_out = KERNELS[child_kernel](
                _repeat(x, children),
                _repeat(v_main, children),
                sigmas[j],
                sigmas[j + 1],
                child_noise_level,
                sigmas[1],
                generator=generator,
            )
            node = buffer.append(
                _repeat(x, children),
                child_out,
                j,
                child_kernel,
                child_noise_level,
                True,
                parent=_repeat(before, children),
                leaf=_repeat(leaves, children),
                cond=_repeat(cond, children),
            )  # (R * children,)
            _spawn(
                pool,
                granularities,
                child_out.prev_sample,
                _repeat(leaves, children),
                torch.full_like(node, j),
                torch.arange(children, device=device).repeat(roots),
                node,
                j + 1,
            )
        elif j in probes:
            main_node = last if kernel in STOCHASTIC_KERNELS else no_node
            # with only Euler steps left, the main path's own continuation is the stride-1 completion: reuse its final
            same = 1 in granularities and all(k == "ode" for k in plan.kernels[j + 1 :])
            if same:
                follows.append((j, main_node))
            rest = tuple(g for g in granularities if not (same and g == 1))
            if rest:
                _spawn(
                    pool,
                    rest,
                    out.prev_sample.clone(),
                    leaves,
                    torch.full_like(cond, j),
                    torch.zeros_like(cond),
                    main_node,
                    j + 1,
                )
        x = out.prev_sample
        _retire(pool, done, n)
    for j, main_node in follows:  # the main path's final, as a probe of step j at stride 1
        tail = _new_pool(x, cond)
        _spawn(tail, (1,), x.clone(), leaves, torch.full_like(cond, j), torch.zeros_like(cond), main_node, n)
        for name in done:
            done[name].append(tail[name])
    rollout = buffer.to_rollout(x, cond, group, last, nfe)
    found = _sorted_probes(done)
    cost = dict(rollout.cost, probes=found["x"].shape[0])
    rollout.cost = dict(cost)
    return ProbeRollout(
        rollout, found["x"], found["root"], found["step"], found["child"], found["g"], found["node"], cost
    )
