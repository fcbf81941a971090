"""Rollouts: run a step plan over a batch of samples and record its stochastic transitions.

The sampler only calls a :class:`VelocityFn`; the model adapter behind it (prompt encoding,
classifier-free guidance, dtype casts) lives elsewhere. One velocity call per step covers the whole batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Protocol

import torch

from .kernels import KERNELS, MULTISTEP_KERNELS, STOCHASTIC_KERNELS, UNIT_ETA_KERNELS

__all__ = [
    "Rollout",
    "StepPlan",
    "TransitionBuffer",
    "VelocityFn",
    "group_index",
    "initial_noise",
    "ode_sample",
    "recompute_log_prob",
    "sample",
    "velocity_gain",
]


class VelocityFn(Protocol):
    """The policy as the sampler sees it: ``velocity_fn(x, t, cond) -> v``.

    Args:
        x (`torch.Tensor` of shape `(N, C, H, W)`, float32): states at time `t`.
        t (`torch.Tensor` of shape `(N,)`, float32): times in `[0, 1]` (1 = pure noise), one per row.
        cond (`torch.Tensor` of shape `(N,)`, long): index of each row's prompt / conditioning.

    Returns:
        `torch.Tensor` of shape `(N, C, H, W)`: velocity ``v ~ eps - x_0`` (guidance already applied);
        any float dtype, the sampler casts it to float32.
    """

    def __call__(self, x: torch.Tensor, t: torch.Tensor, cond: torch.Tensor) -> torch.Tensor: ...


def group_index(num_groups: int, group_size: int, device=None) -> torch.Tensor:
    """Group id of each sample in group-major order: ``[0]*group_size + [1]*group_size + ...``.

    Args:
        num_groups (`int`): groups (prompts), `>= 1`.
        group_size (`int`): samples per group, `>= 1`.
        device (`torch.device`, optional): where to build the tensor.

    Returns:
        `torch.Tensor` of shape `(num_groups * group_size,)`, long, values in `[0, num_groups)`.

    Raises:
        ValueError: if `num_groups` or `group_size` is `< 1`.
    """
    if num_groups < 1 or group_size < 1:
        raise ValueError(f"num_groups and group_size must be >= 1; got {num_groups} and {group_size}")
    return torch.arange(num_groups, device=device).repeat_interleave(group_size)  # (G * S,)


def initial_noise(
    num_groups: int,
    group_size: int,
    shape: tuple[int, ...],
    generator: torch.Generator | None = None,
    shared_per_group: bool = True,
    device=None,
) -> torch.Tensor:
    """Starting latents ``x_1 ~ N(0, I)`` for `num_groups` groups of `group_size` samples, group-major.

    Drawn on the generator's device in float32 (so a seed gives the same noise on any target device),
    then moved to `device`.

    Args:
        num_groups (`int`): number of groups (prompts), `>= 1`.
        group_size (`int`): samples per group, `>= 1`.
        shape (`tuple` of `int`): one latent's shape, e.g. `(C, H, W)`.
        generator (`torch.Generator`, optional): random source; `None` uses the global one.
        shared_per_group (`bool`): if True every member of a group starts from the same noise (DanceGRPO and
            MixGRPO share ``x_1`` within a group); else every sample draws its own (Flow-GRPO's default).
        device (optional): where to put the result; default the generator's device (or CPU).

    Returns:
        `torch.Tensor` of shape `(num_groups * group_size, *shape)`, float32.

    Raises:
        ValueError: if `num_groups` or `group_size` is `< 1`.
    """
    if num_groups < 1 or group_size < 1:
        raise ValueError(f"num_groups and group_size must be >= 1; got {num_groups} and {group_size}")
    draw_device = generator.device if generator is not None else torch.device("cpu")
    num_draws = num_groups if shared_per_group else num_groups * group_size
    noise = torch.randn((num_draws, *shape), generator=generator, device=draw_device, dtype=torch.float32)
    if shared_per_group:
        noise = noise.repeat_interleave(group_size, dim=0)  # (G * S, C, H, W)
    return noise.to(device if device is not None else draw_device)


@dataclass
class StepPlan:
    """What happens at every denoising step: the kernel, its noise level, and whether it is trained.

    Attributes:
        kernels (`list[str]`): one name from :data:`samplers.KERNELS` per step.
        noise_levels (`list[float]`): per step, the kernel's noise level (Flow-GRPO's ``a`` or Dance's
            ``eta``); must be `> 0` for stochastic kernels (and `<= 1` for ``"cps"`` and ``"ddim"``), ignored for ``"ode"``.
        trained (`list[bool]`): per step, whether its transitions enter the policy loss. Only stochastic
            kernels can be trained (a deterministic step has no log-prob).

    Raises:
        ValueError: (in `__post_init__`) naming the field, if lengths differ, the plan is empty, a kernel
            name is unknown, a stochastic step has noise level `<= 0`, or a deterministic step is trained.
    """

    kernels: list[str]
    noise_levels: list[float]
    trained: list[bool]

    def __post_init__(self):
        self.kernels = list(self.kernels)
        self.noise_levels = [float(level) for level in self.noise_levels]
        self.trained = [bool(flag) for flag in self.trained]
        if not self.kernels:
            raise ValueError("StepPlan.kernels is empty; a plan needs at least one step")
        for name in ("noise_levels", "trained"):
            if len(getattr(self, name)) != len(self.kernels):
                raise ValueError(
                    f"StepPlan.{name} has {len(getattr(self, name))} entries; expected {len(self.kernels)} "
                    "(one per step, like kernels)"
                )
        for k, (kernel, level, trained) in enumerate(zip(self.kernels, self.noise_levels, self.trained)):
            if kernel not in KERNELS and kernel not in MULTISTEP_KERNELS:
                raise ValueError(
                    f"StepPlan.kernels[{k}]={kernel!r} is not a kernel; "
                    f"choose from {sorted(KERNELS) + sorted(MULTISTEP_KERNELS)}"
                )
            stochastic = kernel in STOCHASTIC_KERNELS
            if stochastic and not level > 0:
                raise ValueError(f"StepPlan.noise_levels[{k}]={level} must be > 0 for stochastic kernel {kernel!r}")
            if kernel in UNIT_ETA_KERNELS and level > 1:
                raise ValueError(f"StepPlan.noise_levels[{k}]={level}: the {kernel} kernel's eta must be in (0, 1]")
            if trained and not stochastic:
                raise ValueError(f"StepPlan.trained[{k}] is True but kernel {kernel!r} is deterministic; set it False")

    @property
    def num_steps(self) -> int:
        """Number of denoising steps ``N``."""
        return len(self.kernels)

    @property
    def stochastic_steps(self) -> list[int]:
        """Indices of the steps whose kernel is stochastic (the steps a :class:`Rollout` records)."""
        return [k for k, kernel in enumerate(self.kernels) if kernel in STOCHASTIC_KERNELS]

    @classmethod
    def ode(cls, num_steps: int, kernel: str = "ode") -> StepPlan:
        """A deterministic `kernel` at every step, nothing trained (evaluation sampling): Euler (``"ode"``) or
        DPM-Solver++ 2M (``"dpm_solver_2m"``).

        Raises:
            ValueError: if `kernel` is stochastic (and as :class:`StepPlan` for an unknown kernel).
        """
        if kernel in STOCHASTIC_KERNELS:
            raise ValueError(f"StepPlan.ode needs a deterministic kernel; got stochastic {kernel!r}")
        return cls([kernel] * num_steps, [0.0] * num_steps, [False] * num_steps)

    @classmethod
    def sde(
        cls, num_steps: int, kernel: str = "flow_sde", noise_level: float = 0.7, train_last: bool = False
    ) -> StepPlan:
        """Full SDE sampling (Flow-GRPO arXiv 2505.05470, DanceGRPO arXiv 2505.07818).

        Every step uses `kernel` with `noise_level`; every step is trained except the last one unless
        `train_last` (Flow-GRPO's default leaves the final step out of the loss).

        Raises:
            ValueError: if `num_steps < 1` (and as :class:`StepPlan` for the kernel or noise level).
        """
        if num_steps < 1:
            raise ValueError(f"StepPlan.sde needs num_steps >= 1; got {num_steps}")
        trained = [True] * num_steps
        if not train_last:
            trained[-1] = False
        return cls([kernel] * num_steps, [noise_level] * num_steps, trained)

    @classmethod
    def window(cls, num_steps: int, steps, kernel: str = "flow_sde", noise_level: float = 0.7) -> StepPlan:
        """MixGRPO (arXiv 2507.21802): `kernel` with `noise_level` on the window `steps`, all of them
        trained, deterministic Euler everywhere else (see :class:`samplers.SlidingWindow`).

        Raises:
            ValueError: if a window step is outside ``[0, num_steps)``.
        """
        window = set(steps)
        if not window or min(window) < 0 or max(window) >= num_steps:
            raise ValueError(f"window steps {sorted(window)} must be a non-empty subset of [0, {num_steps})")
        inside = [k in window for k in range(num_steps)]
        return cls([kernel if w else "ode" for w in inside], [noise_level if w else 0.0 for w in inside], inside)


def _per(kind: str):
    """A Rollout field indexed per `"transition"` (leading dim M) or per `"leaf"` (leading dim B)."""
    return field(metadata={"per": kind})


@dataclass
class Rollout:
    """A batch of sampled trajectories stored as FLAT transitions (leading dim `M`) plus per-leaf results.

    Storage choice: only transitions of stochastic kernels are stored. Deterministic (ODE) steps have no
    log-prob and :class:`StepPlan` forbids training them, so they are skipped to save memory; their
    velocity evaluations still count in ``cost["nfe"]``. Untrained stochastic steps are stored (their
    states are needed by tree methods and the data are cheap next to the model).

    Rows are step-major: the `j`-th stored step of leaf `b` is row ``j * B + b``. A flat batch is a tree
    whose root splits into `B` leaves at step 0; ``node``/``parent`` describe that tree so branching
    samplers can use the same layout.

    Per transition, shape `(M, ...)`:
        state, next_state, mean (`(M, C, H, W)` float32): ``x`` at `sigma`, the sampled ``x'`` at
            `sigma_next`, and the kernel's Gaussian mean.
        std, log_prob (`(M,)` float32): the kernel's std and the old-policy log-prob of ``x'``
            (mean-reduced over latent dims).
        sigma, sigma_next, sigma_max, noise_level (`(M,)` float32): the kernel's inputs, kept so the
            log-prob can be recomputed under a new policy (:func:`recompute_log_prob`).
        kernel_id (`(M,)` long): index into `kernel_names`.
        step (`(M,)` long): denoising step index `k` in `[0, N)`.
        leaf (`(M,)` long): the final sample (row of `final`) this transition leads to.
        node (`(M,)` long): unique transition id, equal to the row in the full rollout (subsets keep ids).
        parent (`(M,)` long): node id of the previous stored transition on the same path, `-1` for the first.
        depth (`(M,)` long): number of branchings on the path up to this transition; 1 everywhere in a
            flat batch (the root's split at step 0).
        cond (`(M,)` long): conditioning index of the transition's sample.
        trained (`(M,)` bool): whether the transition enters the policy loss.
    Per leaf, shape `(B, ...)`:
        final (`(B, C, H, W)` float32): the sampled latents at ``t = 0``.
        leaf_cond (`(B,)` long): conditioning index; group (`(B,)` long): group id.
        leaf_node (`(B,)` long): node id of the last stored transition on the leaf's path (`-1` if none);
            with `parent` it gives every leaf's path (:func:`samplers.tree.leaf_incidence`).
    Other:
        kernel_names (`tuple[str, ...]`): names indexed by `kernel_id`.
        cost (`dict[str, int]`): ``nfe`` (old-policy velocity evaluations, a batched call of `N` rows
            counting `N`; an adapter doing CFG with two forwards per row should double it),
            ``transitions`` (stored), ``trained_transitions``. Describes the sampling run; subsets copy it.
    """

    state: torch.Tensor = _per("transition")
    next_state: torch.Tensor = _per("transition")
    mean: torch.Tensor = _per("transition")
    std: torch.Tensor = _per("transition")
    log_prob: torch.Tensor = _per("transition")
    sigma: torch.Tensor = _per("transition")
    sigma_next: torch.Tensor = _per("transition")
    sigma_max: torch.Tensor = _per("transition")
    noise_level: torch.Tensor = _per("transition")
    kernel_id: torch.Tensor = _per("transition")
    step: torch.Tensor = _per("transition")
    leaf: torch.Tensor = _per("transition")
    node: torch.Tensor = _per("transition")
    parent: torch.Tensor = _per("transition")
    depth: torch.Tensor = _per("transition")
    cond: torch.Tensor = _per("transition")
    trained: torch.Tensor = _per("transition")
    final: torch.Tensor = _per("leaf")
    leaf_cond: torch.Tensor = _per("leaf")
    group: torch.Tensor = _per("leaf")
    leaf_node: torch.Tensor = _per("leaf")
    kernel_names: tuple[str, ...] = ()
    cost: dict[str, int] = field(default_factory=dict)

    @classmethod
    def without_transitions(
        cls,
        final: torch.Tensor,
        leaf_cond: torch.Tensor,
        group: torch.Tensor,
        kernel_names: tuple[str, ...] = (),
        cost: dict[str, int] | None = None,
    ) -> Rollout:
        """A rollout of `B` leaves that stored no transition (an all-deterministic plan): every per-transition
        field has `M = 0` rows and ``leaf_node`` is `-1`; ``cost`` as given (default empty).

        Args:
            final (`torch.Tensor` of shape `(B, C, H, W)`, float32): the sampled latents.
            leaf_cond, group (`torch.Tensor` of shape `(B,)`, long): conditioning index and group id per leaf.
        """
        empty, none, z = final.new_empty((0, *final.shape[1:])), final.new_empty(0), leaf_cond.new_empty(0)
        return cls(
            state=empty,
            next_state=empty,
            mean=empty,
            std=none,
            log_prob=none,
            sigma=none,
            sigma_next=none,
            sigma_max=none,
            noise_level=none,
            kernel_id=z,
            step=z,
            leaf=z,
            node=z,
            parent=z,
            depth=z,
            cond=z,
            trained=torch.zeros(0, dtype=torch.bool, device=final.device),
            final=final,
            leaf_cond=leaf_cond,
            group=group,
            leaf_node=torch.full_like(leaf_cond, -1),
            kernel_names=kernel_names,
            cost=dict(cost or {}),
        )

    def __len__(self) -> int:
        """Number of stored transitions `M`."""
        return self.state.shape[0]

    @property
    def num_leaves(self) -> int:
        """Number of final samples `B`."""
        return self.final.shape[0]

    def _map(self, kinds: tuple[str, ...], fn) -> Rollout:
        changed = {f.name: fn(getattr(self, f.name)) for f in fields(self) if f.metadata.get("per") in kinds}
        return replace(self, **changed, cost=dict(self.cost))

    def select(self, index: torch.Tensor) -> Rollout:
        """Subset of the transitions (per-leaf data unchanged).

        Args:
            index (`torch.Tensor`): `(K,)` long row indices or `(M,)` bool mask.

        Returns:
            :class:`Rollout` with `K` transitions; `node`/`parent` keep their original ids.
        """
        return self._map(("transition",), lambda tensor: tensor[index])

    def trained_view(self) -> Rollout:
        """Only the transitions with ``trained`` set (what the policy loss sees)."""
        return self.select(self.trained.nonzero().squeeze(1))

    def to(self, device) -> Rollout:
        """Copy of the rollout with every tensor moved to `device`."""
        return self._map(("transition", "leaf"), lambda tensor: tensor.to(device))


def plan_step(
    plan: StepPlan,
    k: int,
    x: torch.Tensor,
    velocity: torch.Tensor,
    sigmas: torch.Tensor,
    prev_x0: torch.Tensor | None,
    prev_sigma,
    generator: torch.Generator | None,
    noise: torch.Tensor | None = None,
):
    """Step ``k`` of `plan` from ``sigmas[k]`` to ``sigmas[k + 1]`` with the step's kernel.

    Multistep kernels also get the previous step's data prediction `prev_x0` and time `prev_sigma`
    (`None` on the first step) and run first order on the plan's last step; the others get the step's
    noise level, ``sigma_max = sigmas[1]`` and `generator`.

    Args:
        plan (:class:`StepPlan`): `N` steps; k (`int`): the step, in ``[0, N)``.
        x, velocity (`torch.Tensor` of shape `(F, C, H, W)`): states at ``sigmas[k]`` and their velocities.
        sigmas (`torch.Tensor` of shape `(N + 1,)`, float32): the schedule.
        prev_x0 (`torch.Tensor` of shape `(F, C, H, W)`, optional): ``x0_hat`` of step ``k - 1``;
            prev_sigma (0-d tensor, optional): ``sigmas[k - 1]``.
        generator (`torch.Generator`, optional): source of the SDE noise.
        noise (`torch.Tensor` of shape `(F, C, H, W)`, optional): the stochastic kernel's ``eps``, instead of a draw
            from `generator`.

    Returns:
        The kernel's :class:`samplers.StepOutput` (float32; `mean`, `std`, `log_prob` `None` if deterministic).
    """
    kernel = plan.kernels[k]
    if kernel in MULTISTEP_KERNELS:
        return MULTISTEP_KERNELS[kernel](
            x, velocity, sigmas[k], sigmas[k + 1], prev_x0, prev_sigma, final=k == plan.num_steps - 1
        )
    given = {} if noise is None else {"noise": noise}
    return KERNELS[kernel](
        x, velocity, sigmas[k], sigmas[k + 1], plan.noise_levels[k], sigmas[1], generator=generator, **given
    )


def _step_policy(kernel: str, velocity_fn: VelocityFn, ode_velocity_fn: VelocityFn | None) -> VelocityFn:
    """The policy a step of `kernel` calls: `velocity_fn` where it draws a stored log-prob (a stochastic
    kernel), else `ode_velocity_fn` if given."""
    return velocity_fn if kernel in STOCHASTIC_KERNELS or ode_velocity_fn is None else ode_velocity_fn


def _check_sample_inputs(noise, cond, group, sigmas, plan: StepPlan) -> None:
    if noise.ndim < 2:
        raise ValueError(f"noise must have shape (B, C, H, W); got {tuple(noise.shape)}")
    batch = noise.shape[0]
    for name, tensor in (("cond", cond), ("group", group)):
        if tensor.shape != (batch,) or tensor.dtype != torch.long:
            raise ValueError(
                f"{name} must be a long tensor of shape ({batch},); got {tensor.dtype} {tuple(tensor.shape)}"
            )
    if sigmas.shape != (plan.num_steps + 1,):
        raise ValueError(
            f"sigmas must have shape ({plan.num_steps + 1},) for a {plan.num_steps}-step plan; "
            f"got {tuple(sigmas.shape)}"
        )
    values = sigmas.detach().cpu()
    if not (bool((values[1:] < values[:-1]).all()) and values[0] <= 1 and values[-1] >= 0):
        raise ValueError(f"sigmas must decrease strictly within [0, 1]; got {values.tolist()}")
    for k, (kernel, trained) in enumerate(zip(plan.kernels, plan.trained)):
        if kernel in UNIT_ETA_KERNELS and trained and float(values[k + 1]) == 0:
            raise ValueError(
                f"StepPlan.trained[{k}] is True but the {kernel} step onto t'=0 has std 0 and no log-prob "
                f"(train_last / sampling.train_last_step must be False with kernel '{kernel}')"
            )


class TransitionBuffer:
    """A sampler's stochastic transitions, appended one kernel call at a time, then built into a :class:`Rollout`.

    Rows are numbered in the order they are appended (a transition's node id is its row). Per-step
    constants (step, kernel, noise level, trained) are Python scalars; ``sigma``, ``sigma_next`` and
    ``sigma_max = sigmas[1]`` are read from the schedule by step when the rollout is built.

    Args:
        sigmas (`torch.Tensor` of shape `(N + 1,)`, float32): the schedule the kernels stepped on.
        kernel_names (`tuple[str, ...]`): the rollout's kernel names; ``kernel_id`` indexes them.

    Attributes:
        rows (`int`): transitions appended so far.
    """

    def __init__(self, sigmas: torch.Tensor, kernel_names: tuple[str, ...]):
        self.sigmas, self.kernel_names, self.rows = sigmas, tuple(kernel_names), 0
        self._parts: dict[str, list[torch.Tensor]] = {}

    def append(
        self,
        x: torch.Tensor,
        out,
        step: int,
        kernel: str,
        noise_level: float,
        trained: bool,
        *,
        parent: torch.Tensor,
        leaf: torch.Tensor,
        cond: torch.Tensor,
        depth: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Record the `F` transitions of one stochastic kernel call from the states `x`.

        Args:
            x (`torch.Tensor` of shape `(F, C, H, W)`, float32): the states the kernel stepped from.
            out (:class:`samplers.StepOutput`): the kernel's output on `x`: ``prev_sample``, ``mean``
                `(F, C, H, W)` and ``std``, ``log_prob`` `(F,)`, float32.
            step (`int`): the denoising step `k`; kernel (`str`): its name, one of `kernel_names`.
            noise_level (`float`), trained (`bool`): the kernel's noise level; whether the rows are trained.
            parent, leaf, cond (`torch.Tensor` of shape `(F,)`, long): per row, the node id of the previous
                stored transition on its path (`-1` for none), the first leaf below it, its conditioning index.
            depth (`torch.Tensor` of shape `(F,)`, long, optional): branchings on each path; default 1.

        Returns:
            `torch.Tensor` of shape `(F,)`, long: the new rows' node ids (the next step's `parent`).
        """
        n, device = x.shape[0], x.device

        def full(value, dtype):  # a per-step constant -> (F,)
            return torch.full((n,), value, dtype=dtype, device=device)

        columns = dict(
            state=x,
            next_state=out.prev_sample,
            mean=out.mean,
            std=out.std,
            log_prob=out.log_prob,
            noise_level=full(noise_level, torch.float32),
            kernel_id=full(self.kernel_names.index(kernel), torch.long),
            step=full(step, torch.long),
            leaf=leaf,
            parent=parent,
            depth=full(1, torch.long) if depth is None else depth,
            cond=cond,
            trained=full(trained, torch.bool),
        )
        for name, value in columns.items():
            self._parts.setdefault(name, []).append(value)
        self.rows += n
        return torch.arange(self.rows - n, self.rows, device=device)  # (F,)

    def to_rollout(
        self, final: torch.Tensor, leaf_cond: torch.Tensor, group: torch.Tensor, leaf_node: torch.Tensor, nfe: int
    ) -> Rollout:
        """The :class:`Rollout` of the appended rows (`M` of them, possibly none) and `B` leaves.

        Args:
            final (`torch.Tensor` of shape `(B, C, H, W)`, float32): the sampled latents.
            leaf_cond, group, leaf_node (`torch.Tensor` of shape `(B,)`, long): per leaf, its conditioning
                index, group id and the node id of the last stored transition on its path (`-1` if none).
            nfe (`int`): velocity rows evaluated, for ``cost``.

        Returns:
            :class:`Rollout`; ``cost`` holds ``nfe``, ``transitions`` and ``trained_transitions``.
        """
        cost = dict(nfe=nfe, transitions=self.rows, trained_transitions=0)
        if not self.rows:
            return Rollout.without_transitions(final, leaf_cond, group, self.kernel_names, cost)
        cat = {name: torch.cat(parts) for name, parts in self._parts.items()}  # (M, ...) each
        cost["trained_transitions"] = int(cat["trained"].sum())
        m, step = self.rows, cat["step"]
        return Rollout(
            **cat,
            sigma=self.sigmas[step],
            sigma_next=self.sigmas[step + 1],  # (M,), (M,)
            sigma_max=self.sigmas[1].expand(m).clone(),
            node=torch.arange(m, device=final.device),  # (M,)
            final=final,
            leaf_cond=leaf_cond,
            group=group,
            leaf_node=leaf_node,
            kernel_names=self.kernel_names,
            cost=cost,
        )


def sample(
    velocity_fn: VelocityFn,
    noise: torch.Tensor,
    cond: torch.Tensor,
    group: torch.Tensor,
    sigmas: torch.Tensor,
    plan: StepPlan,
    generator: torch.Generator | None = None,
    ode_velocity_fn: VelocityFn | None = None,
    step_noise: list[torch.Tensor | None] | None = None,
) -> Rollout:
    """Run `plan` on a batch from `noise` down the schedule `sigmas`, recording stochastic transitions.

    Step `k` calls ``velocity_fn(x, sigmas[k], cond)`` once for the whole batch, then the kernel
    ``KERNELS[plan.kernels[k]]`` from ``sigmas[k]`` to ``sigmas[k + 1]`` (``sigma_max = sigmas[1]`` for
    Flow-GRPO's guard at ``t = 1``). Runs without gradients; deterministic given `generator`.

    Args:
        velocity_fn (:class:`VelocityFn`): the old policy.
        noise (`torch.Tensor` of shape `(B, C, H, W)`): starting latents at ``t = sigmas[0]``.
        cond (`torch.Tensor` of shape `(B,)`, long): conditioning index per sample.
        group (`torch.Tensor` of shape `(B,)`, long): group id per sample (for group-relative advantages).
        sigmas (`torch.Tensor` of shape `(N + 1,)`): strictly decreasing times in `[0, 1]`, e.g.
            :func:`samplers.flow_sigmas`.
        plan (:class:`StepPlan`): `N` steps.
        generator (`torch.Generator`, optional): source of the SDE noise; `None` uses the global RNG.
        ode_velocity_fn (:class:`VelocityFn`, optional): the policy for the deterministic steps (ODE,
            DPM-Solver++), which record no log-prob, e.g. `velocity_fn` under bf16 autocast; default
            `velocity_fn`. Stochastic steps always call `velocity_fn`.
        step_noise (`list`, optional): per step, the stochastic kernel's ``eps`` (`(B, C, H, W)`, float32) instead of
            a draw from `generator` (None for a step that draws; :func:`samplers.sample_in_chunks` draws them up front).

    Returns:
        :class:`Rollout` with `M = B * len(plan.stochastic_steps)` transitions and `B` leaves.

    Raises:
        ValueError: if a shape or dtype is wrong, `sigmas` is not decreasing in `[0, 1]`, `step_noise` is not one
            entry per step, or `velocity_fn` returns a tensor of the wrong shape.
    """
    with torch.no_grad():
        _check_sample_inputs(noise, cond, group, sigmas, plan)
        if step_noise is not None and len(step_noise) != plan.num_steps:
            raise ValueError(f"step_noise has {len(step_noise)} entries for a {plan.num_steps}-step plan")
        batch = noise.shape[0]
        x = noise.float()
        sigmas = sigmas.to(device=x.device, dtype=torch.float32)
        cond, group = cond.to(x.device), group.to(x.device)
        buffer = TransitionBuffer(sigmas, tuple(dict.fromkeys(plan.kernels)))
        leaves, last = torch.arange(batch, device=x.device), torch.full_like(cond, -1)  # (B,), (B,)
        prev_x0, prev_sigma = None, None
        for k in range(plan.num_steps):
            kernel = plan.kernels[k]
            velocity = _step_policy(kernel, velocity_fn, ode_velocity_fn)(
                x, sigmas[k].expand(batch).contiguous(), cond
            )
            if velocity.shape != x.shape:
                raise ValueError(f"velocity_fn returned shape {tuple(velocity.shape)}; expected {tuple(x.shape)}")
            noise_k = None if step_noise is None else step_noise[k]
            out = plan_step(plan, k, x, velocity, sigmas, prev_x0, prev_sigma, generator, noise_k)
            # history of the multistep kernels; after an SDE window it is the window's last x0_hat, so the first
            # DPM-Solver++ step is second order, as in MixGRPO's code (its x0 history is updated on SDE steps too)
            prev_x0, prev_sigma = x - sigmas[k] * velocity.float(), sigmas[k]
            if kernel in STOCHASTIC_KERNELS:
                last = buffer.append(
                    x, out, k, kernel, plan.noise_levels[k], plan.trained[k], parent=last, leaf=leaves, cond=cond
                )  # (B,)
            x = out.prev_sample
        return buffer.to_rollout(x, cond, group, last, nfe=plan.num_steps * batch)


def ode_sample(
    velocity_fn: VelocityFn, noise: torch.Tensor, cond: torch.Tensor, sigmas: torch.Tensor, kernel: str = "ode"
) -> torch.Tensor:
    """Deterministic sampling, for evaluation: Euler (``x' = x + dt v`` at every step) or another deterministic
    `kernel` (``"dpm_solver_2m"``, DPM-Solver++ 2M) at every step.

    Args:
        velocity_fn (:class:`VelocityFn`): the policy.
        noise (`torch.Tensor` of shape `(B, C, H, W)`): starting latents.
        cond (`torch.Tensor` of shape `(B,)`, long): conditioning index per sample.
        sigmas (`torch.Tensor` of shape `(N + 1,)`): strictly decreasing times in `[0, 1]`.
        kernel (`str`): the deterministic kernel of every step (:meth:`StepPlan.ode`).

    Returns:
        `torch.Tensor` of shape `(B, C, H, W)`, float32: latents at ``t = sigmas[-1]``.

    Raises:
        ValueError: as :func:`sample`, or for a stochastic `kernel`.
    """
    group = torch.zeros_like(cond)
    return sample(velocity_fn, noise, cond, group, sigmas, StepPlan.ode(sigmas.shape[0] - 1, kernel)).final


def recompute_log_prob(transitions: Rollout, velocity: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of the stored ``x'`` of each transition under new velocities (the PPO ratio's numerator).

    Re-runs each transition's stored kernel with its stored ``sigma, sigma_next, noise_level, sigma_max``
    and ``prev_sample = next_state``; with the old policy's velocities it returns exactly the stored
    ``log_prob``. Gradients flow from the outputs into `velocity`.

    Args:
        transitions (:class:`Rollout`): any subset of a rollout (e.g. `rollout.trained_view().select(idx)`).
        velocity (`torch.Tensor` of shape `(M, C, H, W)`): new-policy velocity at ``(state, sigma, cond)``.

    Returns:
        `(log_prob, mean)`: `(M,)` float32 and `(M, C, H, W)` float32.

    Raises:
        ValueError: if `velocity` does not match `transitions.state` in shape.
    """
    if velocity.shape != transitions.state.shape:
        raise ValueError(f"velocity must have shape {tuple(transitions.state.shape)}; got {tuple(velocity.shape)}")
    log_prob = velocity.new_zeros(len(transitions), dtype=torch.float32)
    mean = velocity.new_zeros(transitions.state.shape, dtype=torch.float32)
    for kernel_id in transitions.kernel_id.unique().tolist():
        rows = (transitions.kernel_id == kernel_id).nonzero().squeeze(1)  # (K,)
        part = transitions.select(rows)
        out = KERNELS[transitions.kernel_names[kernel_id]](
            part.state,
            velocity[rows],
            part.sigma,
            part.sigma_next,
            part.noise_level,
            part.sigma_max,
            prev_sample=part.next_state,
        )
        if rows.shape[0] == len(transitions):
            return out.log_prob, out.mean
        log_prob = log_prob.index_put((rows,), out.log_prob)  # (M,)
        mean = mean.index_put((rows,), out.mean)  # (M, C, H, W)
    return log_prob, mean


def velocity_gain(transitions: Rollout) -> torch.Tensor:
    """``|d mean / d v|`` of each stored transition's kernel (a kernel's mean is affine in ``x`` and ``v``).

    Evaluated by running the kernel at ``x = 0`` with ``v = 1``: for the Flow-GRPO SDE it is
    ``(1 + a^2 / 2) |dt|`` for ``t < 1`` and ``|dt|`` at ``t = 1`` (where ``(1 - t) = 0``), for DanceGRPO
    ``(1 + eta^2 (1 - t) / (2t)) |dt|``. GRPO-Guard's gradient reweighting (arXiv 2510.22319) divides each
    step's loss by it.

    Args:
        transitions (:class:`Rollout`): stored transitions (any subset, e.g. :meth:`Rollout.trained_view`).

    Returns:
        `torch.Tensor` of shape `(M,)`, float32, `> 0`.
    """
    gain = transitions.sigma.new_zeros(len(transitions), dtype=torch.float32)
    for kernel_id in transitions.kernel_id.unique().tolist():
        rows = (transitions.kernel_id == kernel_id).nonzero().squeeze(1)
        part = transitions.select(rows)
        zeros = part.sigma.new_zeros((rows.shape[0], 1), dtype=torch.float32)
        out = KERNELS[transitions.kernel_names[kernel_id]](
            zeros, zeros + 1, part.sigma, part.sigma_next, part.noise_level, part.sigma_max, prev_sample=zeros
        )
        gain[rows] = out.mean.reshape(-1).abs()
    return gain
