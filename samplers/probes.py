"""Single-step branching with ODE completion: TempFlow-GRPO, G2RPO and TP-GRPO rollouts as one mechanism.

A main path runs a :class:`StepPlan` (all ODE for TempFlow-GRPO and G2RPO, an SDE window for TP-GRPO).
At each probe step ``i`` the velocity the main path already computed at ``x_i`` is reused to

- draw ``children`` SDE children ``x'_{i,k}`` (stored, trained transitions; TempFlow-GRPO arXiv 2508.04324,
  G2RPO arXiv 2510.01982), or, with ``children = 0``,
- take the main path's own next state ``x_{i+1}`` (TP-GRPO arXiv 2602.06422: the reward after the
  first ``i + 1`` SDE steps),

and every probe is completed to ``t = 0`` with deterministic Euler on the sub-schedule
``sigmas[i+1], sigmas[i+2], sigmas[i+2+g], sigmas[i+2+2g], ...`` (and 0) for each granularity ``g``: G2RPO's
multi-granularity ``t[:k+2] ++ t[k+2::g]`` (arXiv 2510.01982; 1 = the full grid; the last Euler step onto
``t = 0`` gives the ``x0_hat`` that G2RPO decodes). ``include_start`` adds the pure-ODE completion from
``x_T`` on ``sigmas[0], sigmas[g], ...`` (TP-GRPO's ``R_0``).

All rows that sit at the same grid index -- main path, completions of every probe and granularity -- are
evaluated in ONE velocity call per grid step (two when an ``ode_velocity_fn`` is given for the rows
whose velocity enters no log-prob and the main path's does).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .kernels import KERNELS, STOCHASTIC_KERNELS, ode_step
from .rollout import Rollout, StepPlan, VelocityFn, _check_sample_inputs

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


def _append(store: dict, **values) -> None:
    for name, value in values.items():
        store.setdefault(name, []).append(value)


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
        ValueError: for a probe step outside ``[0, N - 1)``, a non-stochastic `child_kernel`, a
            granularity `< 1`, a plan with a multistep kernel (DPM-Solver++), or bad shapes (as
            :func:`samplers.sample`).
    """
    _check_sample_inputs(noise, cond, group, sigmas, plan)
    multistep = sorted({k for k in plan.kernels if k not in KERNELS})
    if multistep:
        raise ValueError(f"sample_probes runs single-step kernels only; the plan uses {multistep} (no Flash plan here)")
    n = plan.num_steps
    if any(not 0 <= i < n - 1 for i in probe_steps):
        raise ValueError(f"probe steps must lie in [0, {n - 1}) (a probe needs a step left to complete); got {probe_steps}")
    if children and child_kernel not in STOCHASTIC_KERNELS:
        raise ValueError(f"child_kernel={child_kernel!r} must be stochastic, one of {sorted(STOCHASTIC_KERNELS)}")
    if not granularities or min(granularities) < 1:
        raise ValueError(f"granularities must be >= 1; got {granularities}")
    x = noise.float()
    device, roots = x.device, x.shape[0]
    sigmas = sigmas.to(device=device, dtype=torch.float32)
    cond, group = cond.to(device), group.to(device)
    kernel_names = tuple(dict.fromkeys(plan.kernels + ([child_kernel] if children else [])))
    trans: dict[str, list] = {}
    pool = dict(x=x.new_empty((0, *x.shape[1:])), idx=cond.new_empty(0), g=cond.new_empty(0), root=cond.new_empty(0),
                step=cond.new_empty(0), child=cond.new_empty(0), node=cond.new_empty(0))
    done: dict[str, list] = {}
    rows, nfe, last = 0, 0, torch.full_like(cond, -1)
    probes = set(probe_steps)

    def spawn(states, root, step, child, node, start):
        for g in granularities:
            k = len(states)
            new = dict(x=states, idx=torch.full((k,), start, dtype=torch.long, device=device),
                       g=torch.full((k,), g, dtype=torch.long, device=device), root=root, step=step, child=child, node=node)
            for name in pool:
                pool[name] = torch.cat([pool[name], new[name]])

    if include_start:
        spawn(x.clone(), torch.arange(roots, device=device), torch.full_like(cond, -1), torch.zeros_like(cond),
              torch.full_like(cond, -1), 0)
    for j in range(n):
        here = pool["idx"] == j  # completions sitting at grid index j
        batch_x = torch.cat([x, pool["x"][here]])
        batch_c = torch.cat([cond, cond[pool["root"][here]]])
        t = sigmas[j].expand(batch_x.shape[0]).contiguous()
        exact = plan.kernels[j] in STOCHASTIC_KERNELS or (j in probes and children > 0)  # main rows draw a log-prob
        if ode_velocity_fn is None:
            velocity = velocity_fn(batch_x, t, batch_c).float()
        elif exact:
            velocity = torch.cat([velocity_fn(x, t[:roots], cond).float()]
                                 + ([ode_velocity_fn(batch_x[roots:], t[roots:], batch_c[roots:]).float()]
                                    if batch_x.shape[0] > roots else []))
        else:
            velocity = ode_velocity_fn(batch_x, t, batch_c).float()
        nfe += batch_x.shape[0]
        v_main, v_pool = velocity[:roots], velocity[roots:]
        # completions: one Euler step to their own next grid point
        if bool(here.any()):
            # a probe of step k still at t_{k+1} first takes one grid step (to t_{k+2}), then strides of g
            step_k, idx = pool["step"][here], pool["idx"][here]
            fresh = (step_k >= 0) & (idx == step_k + 1)
            stride = torch.where(fresh, torch.ones_like(pool["g"][here]), pool["g"][here])
            target = (pool["idx"][here] + stride).clamp(max=n)
            stepped = ode_step(pool["x"][here], v_pool, sigmas[j], sigmas[target]).prev_sample
            pool["x"][here] = stepped
            pool["idx"][here] = target
        # the main path
        kernel = plan.kernels[j]
        before = last  # the main-path transition that produced x (the parent of this step's children)
        out = KERNELS[kernel](x, v_main, sigmas[j], sigmas[j + 1], plan.noise_levels[j], sigmas[1], generator=generator)
        if kernel in STOCHASTIC_KERNELS:
            node = torch.arange(rows, rows + roots, device=device)
            _append(trans, state=x, next_state=out.prev_sample, mean=out.mean, std=out.std, log_prob=out.log_prob,
                    parent=last, cond=cond, leaf=torch.arange(roots, device=device), group=group,
                    step=torch.full_like(cond, j), kernel=torch.full_like(cond, kernel_names.index(kernel)),
                    noise_level=torch.full((roots,), plan.noise_levels[j], device=device),
                    trained=torch.full((roots,), plan.trained[j], dtype=torch.bool, device=device))
            last, rows = node, rows + roots
        if j in probes:
            if children:
                rep = lambda z: z.repeat_interleave(children, 0)  # noqa: E731
                child_out = KERNELS[child_kernel](rep(x), rep(v_main), sigmas[j], sigmas[j + 1], child_noise_level,
                                                  sigmas[1], generator=generator)
                m = roots * children
                node = torch.arange(rows, rows + m, device=device)
                _append(trans, state=rep(x), next_state=child_out.prev_sample, mean=child_out.mean, std=child_out.std,
                        log_prob=child_out.log_prob, parent=rep(before),
                        cond=rep(cond), leaf=rep(torch.arange(roots, device=device)), group=rep(group),
                        step=torch.full((m,), j, device=device, dtype=torch.long),
                        kernel=torch.full((m,), kernel_names.index(child_kernel), device=device, dtype=torch.long),
                        noise_level=torch.full((m,), child_noise_level, device=device),
                        trained=torch.ones(m, dtype=torch.bool, device=device))
                rows += m
                spawn(child_out.prev_sample, rep(torch.arange(roots, device=device)), torch.full((m,), j, device=device),
                      torch.arange(children, device=device).repeat(roots), node, j + 1)
            else:
                main_node = last if kernel in STOCHASTIC_KERNELS else torch.full_like(cond, -1)
                spawn(out.prev_sample.clone(), torch.arange(roots, device=device), torch.full_like(cond, j),
                      torch.zeros_like(cond), main_node, j + 1)
        x = out.prev_sample
        finished = pool["idx"] >= n
        for name in pool:
            done.setdefault(name, []).append(pool[name][finished])
            pool[name] = pool[name][~finished]
    cat = {name: torch.cat(parts) for name, parts in trans.items()} if trans else {}
    if cat:
        m = cat["state"].shape[0]
        rollout = Rollout(state=cat["state"], next_state=cat["next_state"], mean=cat["mean"], std=cat["std"],
                          log_prob=cat["log_prob"], sigma=sigmas[cat["step"]], sigma_next=sigmas[cat["step"] + 1],
                          sigma_max=sigmas[1].expand(m).clone(), noise_level=cat["noise_level"], kernel_id=cat["kernel"],
                          step=cat["step"], leaf=cat["leaf"], node=torch.arange(m, device=device), parent=cat["parent"],
                          depth=torch.ones(m, dtype=torch.long, device=device), cond=cat["cond"], trained=cat["trained"],
                          final=x, leaf_cond=cond, group=group, leaf_node=last, kernel_names=kernel_names, cost={})
    else:
        empty = x.new_empty((0, *x.shape[1:]))
        z = cond.new_empty(0)
        rollout = Rollout(state=empty, next_state=empty, mean=empty, std=x.new_empty(0), log_prob=x.new_empty(0),
                          sigma=x.new_empty(0), sigma_next=x.new_empty(0), sigma_max=x.new_empty(0),
                          noise_level=x.new_empty(0), kernel_id=z, step=z, leaf=z, node=z, parent=z, depth=z, cond=z,
                          trained=torch.zeros(0, dtype=torch.bool, device=device), final=x, leaf_cond=cond, group=group,
                          leaf_node=last, kernel_names=kernel_names, cost={})
    out = {name: torch.cat(parts) for name, parts in done.items()}
    order = torch.arange(out["x"].shape[0], device=device)
    for key in ("g", "child", "root", "step"):  # stable sorts, least significant key first
        order = order[torch.argsort(out[key][order], stable=True)]
    out = {name: value[order] for name, value in out.items()}
    cost = dict(nfe=nfe, transitions=len(rollout), trained_transitions=int(rollout.trained.sum()), probes=out["x"].shape[0])
    rollout.cost = dict(cost)
    return ProbeRollout(rollout, out["x"], out["root"], out["step"], out["child"], out["g"], out["node"], cost)
