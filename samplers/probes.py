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

from dataclasses import dataclass, fields

import torch

from .kernels import KERNELS, STOCHASTIC_KERNELS, UNIT_ETA_KERNELS, ode_step
from .rollout import Rollout, StepPlan, TransitionBuffer, VelocityFn, _check_sample_inputs, plan_step

__all__ = ["ProbeRollout", "Probes", "sample_probes"]


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


@dataclass(frozen=True)
class Probes:
    """Where a main path is probed and how each probe is completed (:func:`sample_probes`).

    Attributes:
        steps (`tuple[int, ...]`): steps ``i`` in ``[0, N - 1)`` that probe (checked against the plan).
        children (`int`): SDE children per probe, `>= 0` (0 = complete the main path's own ``x_{i+1}``).
        child_kernel (`str`): the children's stochastic kernel (:data:`samplers.STOCHASTIC_KERNELS`).
        child_noise_level (`float`): its noise level, `> 0` (and `<= 1` for a unit-eta kernel); unused without children.
        granularities (`tuple[int, ...]`): completion strides, each `>= 1`.
        include_start (`bool`): also complete ``x_T`` itself by ODE (step `-1`).

    Raises:
        ValueError: (in `__post_init__`) naming the field: a negative or non-integer `children`, a non-stochastic
            `child_kernel` or a `child_noise_level` out of range (with children), an empty `granularities` or one `< 1`.
    """

    steps: tuple[int, ...]
    children: int = 0
    child_kernel: str = "flow_sde"
    child_noise_level: float = 0.7
    granularities: tuple[int, ...] = (1,)
    include_start: bool = False

    def __post_init__(self):
        object.__setattr__(self, "steps", tuple(self.steps))
        object.__setattr__(self, "granularities", tuple(self.granularities))
        children, kernel, level = self.children, self.child_kernel, self.child_noise_level
        if isinstance(children, bool) or not isinstance(children, int) or children < 0:
            raise ValueError(
                f"children must be an integer >= 0 (0 = probe the main path's own state); got {children!r}"
            )
        if children and kernel not in STOCHASTIC_KERNELS:
            raise ValueError(f"child_kernel={kernel!r} must be stochastic, one of {sorted(STOCHASTIC_KERNELS)}")
        if children and not (level > 0 and (kernel not in UNIT_ETA_KERNELS or level <= 1)):
            raise ValueError(
                f"child_noise_level={level} must be > 0 (and <= 1 for {', '.join(map(repr, UNIT_ETA_KERNELS))}): the "
                "children are trained transitions and a zero noise level gives them std 0 and no log-prob"
            )
        if not self.granularities or min(self.granularities) < 1:
            raise ValueError(f"granularities must be >= 1; got {self.granularities}")

    def check_plan(self, plan: StepPlan) -> None:
        """Refuse a `plan` with a multistep kernel, or probe steps outside ``[0, N - 1)`` (ValueError)."""
        multistep = sorted({k for k in plan.kernels if k not in KERNELS})
        if multistep:
            raise ValueError(
                f"sample_probes runs single-step kernels only; the plan uses {multistep} (no Flash plan here)"
            )
        n = plan.num_steps
        if any(not 0 <= i < n - 1 for i in self.steps):
            raise ValueError(
                f"probe steps must lie in [0, {n - 1}) (a probe needs a step left to complete); got {list(self.steps)}"
            )

    def child_plan(self, num_steps: int) -> StepPlan:
        """The children's kernel and noise level at every step, trained: the plan their steps are taken from."""
        return StepPlan([self.child_kernel] * num_steps, [self.child_noise_level] * num_steps, [True] * num_steps)


@dataclass
class _Pool:
    """Completions on their way to ``t = 0``, `Q` rows: ``x`` `(Q, C, H, W)` float32 and, `(Q,)` long, ``idx`` (the
    grid index the row sits at), ``g`` (its stride), ``root``, ``step``, ``child``, ``node`` (as the
    :class:`ProbeRollout` fields)."""

    x: torch.Tensor
    idx: torch.Tensor
    g: torch.Tensor
    root: torch.Tensor
    step: torch.Tensor
    child: torch.Tensor
    node: torch.Tensor

    @classmethod
    def empty(cls, x: torch.Tensor, cond: torch.Tensor) -> _Pool:
        """No rows, with the dtype and device of the states `x` `(R, C, H, W)` and of `cond` `(R,)` long."""
        z = cond.new_empty(0)
        return cls(x.new_empty((0, *x.shape[1:])), z, z, z, z, z, z)

    @classmethod
    def spawn(cls, granularities, states, root, step, child, node, start: int) -> _Pool:
        """`K` new completions per granularity (granularity-major), all at grid index `start`: `states` `(K, C, H, W)`
        float32, `root`, `step`, `child`, `node` `(K,)` long."""

        def full(value):  # (K,)
            return torch.full((len(states),), value, dtype=torch.long, device=states.device)

        return cls.cat([cls(states, full(start), full(g), root, step, child, node) for g in granularities])

    @classmethod
    def cat(cls, pools: list[_Pool]) -> _Pool:
        """The rows of `pools` one after the other."""
        return cls(*(torch.cat([getattr(p, f.name) for p in pools]) for f in fields(cls)))

    def select(self, mask: torch.Tensor) -> _Pool:
        """The rows where `mask` `(Q,)` bool is set."""
        return _Pool(*(getattr(self, f.name)[mask] for f in fields(self)))

    def sorted(self) -> _Pool:
        """The rows sorted by step, root, child and granularity (stable)."""
        order = torch.arange(self.x.shape[0], device=self.x.device)  # (P,)
        for key in (self.g, self.child, self.root, self.step):  # stable sorts, least significant key first
            order = order[torch.argsort(key[order], stable=True)]  # (P,)
        return self.select(order)


def _repeat(z: torch.Tensor, children: int) -> torch.Tensor:
    """Each row of `z` `(R, ...)` `children` times in a row: `(R * children, ...)`."""
    return z.repeat_interleave(children, 0)


class _ProbeRun:
    """One :func:`sample_probes` call: the main rows, the completions in flight and finished, the stored transitions.

    Args:
        policy (`tuple`): ``(velocity_fn, ode_velocity_fn)``; noise `(R, C, H, W)`, cond `(R,)` long, sigmas `(N + 1,)`,
            plan, probes (:class:`Probes`), generator: as :func:`sample_probes`'s.
    """

    def __init__(self, policy, noise, cond, sigmas, plan: StepPlan, probes: Probes, generator):
        self.velocity_fn, self.ode_velocity_fn = policy
        self.plan, self.probes, self.generator = plan, probes, generator
        self.x = noise.float()  # (R, C, H, W) the main rows
        device = self.x.device
        self.sigmas, self.cond = sigmas.to(device=device, dtype=torch.float32), cond.to(device)
        self.leaves, self.no_node = torch.arange(len(self.x), device=device), torch.full_like(self.cond, -1)  # (R,)
        self.last = self.no_node  # (R,) the main path's last stored transition
        children = [probes.child_kernel] if probes.children else []
        self.buffer = TransitionBuffer(self.sigmas, tuple(dict.fromkeys(plan.kernels + children)))
        self.child_plan = probes.child_plan(plan.num_steps) if probes.children else None
        self.pool, self.done, self.nfe = _Pool.empty(self.x, self.cond), [], 0
        self.follows: list[tuple[int, torch.Tensor]] = []  # probes whose completion is the main path's own ODE tail
        if probes.include_start:
            self._spawn(
                probes.granularities, self.x.clone(), self.leaves, -1, torch.zeros_like(self.cond), self.no_node, 0
            )

    def _spawn(self, granularities, states, root, step: int, child, node, start: int) -> None:
        step_ids = torch.full_like(root, step)  # (K,)
        self.pool = _Pool.cat([self.pool, _Pool.spawn(granularities, states, root, step_ids, child, node, start)])

    def step(self, j: int) -> None:
        """Grid step `j`: one evaluation of the main rows and the completions sitting at `j`, the main path's kernel
        step, the probe of step `j` if it is one, and the completions that reached ``t = 0`` retired."""
        plan, probes = self.plan, self.probes
        kernel, probe = plan.kernels[j], j in probes.steps
        exact = kernel in STOCHASTIC_KERNELS or (probe and probes.children > 0)  # main rows draw a log-prob
        v_main = self._evaluate(j, exact)  # (R, C, H, W)
        before = self.last  # the main-path transition that produced x (the parent of this step's children)
        out = plan_step(plan, j, self.x, v_main, self.sigmas, None, None, self.generator)
        if kernel in STOCHASTIC_KERNELS:
            self.last = self.buffer.append(
                self.x,
                out,
                j,
                kernel,
                plan.noise_levels[j],
                plan.trained[j],
                parent=self.last,
                leaf=self.leaves,
                cond=self.cond,
            )  # (R,)
        if probe and probes.children:
            self._children(j, v_main, before)
        elif probe:
            self._probe_main_path(j, out.prev_sample, self.last if kernel in STOCHASTIC_KERNELS else self.no_node)
        self.x = out.prev_sample
        finished = self.pool.idx >= plan.num_steps  # (Q,)
        self.done.append(self.pool.select(finished))
        self.pool = self.pool.select(~finished)

    def _children(self, j: int, v_main: torch.Tensor, before: torch.Tensor) -> None:
        """Draw the probe's SDE children from the main rows with their velocity `v_main` `(R, C, H, W)`, store them
        (their parent: `before`, `(R,)`) and start their completions at grid index ``j + 1``."""
        c, probes = self.probes.children, self.probes
        x = _repeat(self.x, c)  # (R * c, C, H, W)
        out = plan_step(self.child_plan, j, x, _repeat(v_main, c), self.sigmas, None, None, self.generator)
        leaves = _repeat(self.leaves, c)  # (R * c,)
        node = self.buffer.append(
            x,
            out,
            j,
            probes.child_kernel,
            probes.child_noise_level,
            True,
            parent=_repeat(before, c),
            leaf=leaves,
            cond=_repeat(self.cond, c),
        )  # (R * c,)
        child = torch.arange(c, device=x.device).repeat(len(self.x))  # (R * c,)
        self._spawn(probes.granularities, out.prev_sample, leaves, j, child, node, j + 1)

    def _probe_main_path(self, j: int, next_x: torch.Tensor, main_node: torch.Tensor) -> None:
        """Probe the main path's own next state `next_x` `(R, C, H, W)` (TP-GRPO), stored as `main_node` `(R,)`."""
        granularities = self.probes.granularities
        # with only Euler steps left, the main path's own continuation is the stride-1 completion: reuse its final
        same = 1 in granularities and all(k == "ode" for k in self.plan.kernels[j + 1 :])
        if same:
            self.follows.append((j, main_node))
        rest = tuple(g for g in granularities if not (same and g == 1))
        if rest:
            self._spawn(rest, next_x.clone(), self.leaves, j, torch.zeros_like(self.cond), main_node, j + 1)

    def _evaluate(self, j: int, exact: bool) -> torch.Tensor:
        """Evaluate the main rows and the completions at grid index `j` together, advance those completions one Euler
        step (:meth:`_advance`) and return the main rows' velocity `(R, C, H, W)` float32."""
        roots, pool = self.x.shape[0], self.pool
        here = pool.idx == j  # (Q,) completions sitting at grid index j
        batch_x = torch.cat([self.x, pool.x[here]])  # (R + Q_j, C, H, W)
        batch_c = torch.cat([self.cond, self.cond[pool.root[here]]])  # (R + Q_j,)
        t = self.sigmas[j].expand(batch_x.shape[0]).contiguous()  # (R + Q_j,)
        velocity = self._velocity(batch_x, batch_c, t, exact)
        if bool(here.any()):
            self._advance(here, velocity[roots:], j)
        self.nfe += batch_x.shape[0]
        return velocity[:roots]

    def _velocity(self, batch_x: torch.Tensor, batch_c: torch.Tensor, t: torch.Tensor, exact: bool) -> torch.Tensor:
        """Velocity `(B, C, H, W)` float32 of `batch_x` `(B, C, H, W)` (the `R` main rows first, then the completions),
        `batch_c` `(B,)` long, at `t` `(B,)`: one call, or, when `exact` (the main rows draw a log-prob) and an
        ``ode_velocity_fn`` is given, ``velocity_fn`` on the main rows and ``ode_velocity_fn`` on the completions."""
        fn, ode_fn = self.velocity_fn, self.ode_velocity_fn
        if ode_fn is None:
            return fn(batch_x, t, batch_c).float()
        if not exact:
            return ode_fn(batch_x, t, batch_c).float()
        roots = self.x.shape[0]
        rest = [ode_fn(batch_x[roots:], t[roots:], batch_c[roots:]).float()] if batch_x.shape[0] > roots else []
        return torch.cat([fn(self.x, t[:roots], self.cond).float()] + rest)

    def _advance(self, here: torch.Tensor, v_pool: torch.Tensor, j: int) -> None:
        """Move the pool rows selected by `here` `(Q,)` bool, all at grid index `j`, one Euler step (in place) with
        their velocity `v_pool` `(Q_j, C, H, W)`: to ``j + 1`` for a probe still at ``t_{step+1}``, else ``j + g``,
        clamped to `N` (``t = 0``)."""
        pool, n = self.pool, self.plan.num_steps
        step_k, idx = pool.step[here], pool.idx[here]  # (Q_j,), (Q_j,)
        fresh = (step_k >= 0) & (idx == step_k + 1)  # (Q_j,) a probe of step k first takes one grid step
        stride = torch.where(fresh, torch.ones_like(pool.g[here]), pool.g[here])  # (Q_j,)
        target = (idx + stride).clamp(max=n)  # (Q_j,)
        pool.x[here] = ode_step(pool.x[here], v_pool, self.sigmas[j], self.sigmas[target]).prev_sample
        pool.idx[here] = target

    def result(self, group: torch.Tensor) -> ProbeRollout:
        """The :class:`ProbeRollout` once every grid step has run; `group` `(R,)` long is each main path's group."""
        n, cond = self.plan.num_steps, self.cond
        for j, main_node in self.follows:  # the main path's final, as a probe of step j at stride 1
            step = torch.full_like(cond, j)
            self.done.append(
                _Pool.spawn((1,), self.x.clone(), self.leaves, step, torch.zeros_like(cond), main_node, n)
            )
        rollout = self.buffer.to_rollout(self.x, cond, group.to(cond.device), self.last, self.nfe)
        found = _Pool.cat(self.done).sorted()
        cost = dict(rollout.cost, probes=found.x.shape[0])
        rollout.cost = dict(cost)
        return ProbeRollout(rollout, found.x, found.root, found.step, found.child, found.g, found.node, cost)


def sample_probes(
    velocity_fn: VelocityFn,
    noise: torch.Tensor,
    cond: torch.Tensor,
    group: torch.Tensor,
    sigmas: torch.Tensor,
    plan: StepPlan,
    probes: Probes | list[int],
    generator: torch.Generator | None = None,
    ode_velocity_fn: VelocityFn | None = None,
    **options,
) -> ProbeRollout:
    """Main path + probes completed by ODE (see the module docstring).

    Args:
        velocity_fn (:class:`VelocityFn`): the old policy.
        noise (`torch.Tensor` of shape `(R, C, H, W)`): main paths' starting latents.
        cond, group (`torch.Tensor` of shape `(R,)`, long): conditioning index and group id per main path.
        sigmas (`torch.Tensor` of shape `(N + 1,)`): the grid.
        plan (:class:`StepPlan`): the main path's `N` steps, single-step kernels only.
        probes (:class:`Probes`, or the probe steps ``i`` in ``[0, N - 1)`` as a list): where and how to probe.
        generator (`torch.Generator`, optional): SDE noise source (main path first, then children, per step).
        ode_velocity_fn (:class:`VelocityFn`, optional): the policy for rows whose velocity enters no
            log-prob: the completions, and the main path at a deterministic step without children (e.g.
            `velocity_fn` under bf16 autocast); default `velocity_fn`. At a step whose main-path velocity
            draws a stored transition, the main rows and the completions are two calls.
        **options: with a list of steps, the other :class:`Probes` fields (``children``, ``child_kernel``,
            ``child_noise_level``, ``granularities``, ``include_start``).

    Returns:
        :class:`ProbeRollout`. Transition rows are in creation order; `parent` links main-path steps only.
        Probes are sorted by step, root, child and granularity.

    Raises:
        ValueError: as :class:`Probes` and :meth:`Probes.check_plan` (a probe step outside ``[0, N - 1)``, a plan with a
            multistep kernel such as DPM-Solver++), or bad shapes (as :func:`samplers.sample`).
        TypeError: `options` beside a :class:`Probes`, or an option :class:`Probes` has no field for.
    """
    with torch.no_grad():
        if isinstance(probes, Probes) and options:
            raise TypeError(
                f"sample_probes: give the probe settings in probes or as keywords, not both; got {sorted(options)}"
            )
        spec = probes if isinstance(probes, Probes) else Probes(tuple(probes), **options)
        _check_sample_inputs(noise, cond, group, sigmas, plan)
        spec.check_plan(plan)
        run = _ProbeRun((velocity_fn, ode_velocity_fn), noise, cond, sigmas, plan, spec, generator)
        for j in range(plan.num_steps):
            run.step(j)
        return run.result(group)
