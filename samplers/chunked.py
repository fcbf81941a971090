"""A flat rollout sampled a chunk of rows at a time, equal to the one-batch rollout of :func:`samplers.sample`.

:func:`sample` steps the whole batch together: no image is finished before the last step. :func:`sample_in_chunks`
runs the rows ``[0, size)``, then ``[size, 2 size)``, ... to the end, handing each chunk's final latents to a
callback as soon as they exist (a caller decodes and scores them while the next chunk samples), and returns the
rollout :func:`sample` would have returned. For that, every step's noise is drawn up front for the whole batch in
:func:`sample`'s order (the initial noise is the caller's, then one ``randn`` of the batch's shape per stochastic
step, as every kernel of :data:`samplers.KERNELS` draws it), and the chunks' transitions are laid out as one batch's.
Imports torch only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields

import torch

from .kernels import STOCHASTIC_KERNELS
from .rollout import Rollout, StepPlan, VelocityFn, sample

__all__ = ["cat_flat_rollouts", "sample_in_chunks"]


def sample_in_chunks(
    velocity_fn: VelocityFn,
    noise: torch.Tensor,
    cond: torch.Tensor,
    group: torch.Tensor,
    sigmas: torch.Tensor,
    plan: StepPlan,
    size: int,
    on_chunk: Callable[[slice, torch.Tensor], None],
    generator: torch.Generator | None = None,
    ode_velocity_fn: VelocityFn | None = None,
) -> Rollout:
    """:func:`sample` over the rows of `noise` in consecutive chunks of `size` rows, each run through every step
    before the next starts; ``on_chunk(rows, final)`` is called with each chunk's rows (a `slice` of the batch) and
    final latents ``(len(rows), C, H, W)`` float32 as soon as they are sampled.

    The result equals ``sample(velocity_fn, noise, cond, group, sigmas, plan, generator, ode_velocity_fn)`` (every
    field, and the state of `generator` afterwards) wherever `velocity_fn` gives a row the same velocity whatever the
    other rows of its call: a velocity evaluated in chunks of ``sampling.batch_size`` rows (:meth:`Method.chunked`)
    needs `size` to be a multiple of that chunk.

    Args:
        velocity_fn, noise `(B, C, H, W)`, cond `(B,)` long, group `(B,)` long, sigmas `(N + 1,)`, plan, generator,
            ode_velocity_fn: as in :func:`sample`.
        size (`int`): rows per chunk, `>= 1` (the last chunk may be shorter).
        on_chunk: ``on_chunk(rows: slice, final: torch.Tensor) -> None``; an exception it raises stops the sampling
            and propagates.

    Returns:
        :class:`Rollout` of `B` leaves and ``B * len(plan.stochastic_steps)`` transitions, step-major as
        :func:`sample`'s.

    Raises:
        ValueError: `size < 1`, or as :func:`sample`.
    """
    with torch.no_grad():
        if size < 1:
            raise ValueError(f"size must be >= 1 rows per chunk; got {size}")
        batch = noise.shape[0]
        device = generator.device if generator is not None else noise.device
        step_noise = [  # sample()'s draws, in its order: one (B, C, H, W) eps per stochastic step
            torch.randn(noise.shape, generator=generator, device=device, dtype=torch.float32)
            if kernel in STOCHASTIC_KERNELS
            else None
            for kernel in plan.kernels
        ]
        parts = []
        for start in range(0, batch, size):
            rows = slice(start, min(start + size, batch))
            eps = [None if n is None else n[rows] for n in step_noise]
            part = sample(
                velocity_fn, noise[rows], cond[rows], group[rows], sigmas, plan, generator, ode_velocity_fn, eps
            )
            on_chunk(rows, part.final)
            parts.append(part)
        return cat_flat_rollouts(parts)


def cat_flat_rollouts(parts: list[Rollout]) -> Rollout:
    """The rollouts of :func:`sample` on consecutive row chunks of one batch, as one rollout of the whole batch: leaves
    in order, transitions step-major (row ``j * B + b`` is leaf `b`'s `j`-th stored step), node ids the rows, each
    transition's parent the same leaf's previous step, ``cost`` summed.

    Args:
        parts (`list[Rollout]`): flat rollouts of one plan (every leaf `S` stored steps, the same `kernel_names`).

    Returns:
        :class:`Rollout` of ``B = sum of the parts' leaves`` leaves and ``S * B`` transitions.

    Raises:
        ValueError: no parts, or parts of different plans (stored steps or kernel names).
    """
    if not parts:
        raise ValueError("cat_flat_rollouts needs at least one rollout")
    first = parts[0]
    steps = len(first) // max(first.num_leaves, 1)
    for p in parts:
        if len(p) != steps * p.num_leaves or p.kernel_names != first.kernel_names:
            raise ValueError(
                f"rollouts of different plans: {len(p)} transitions for {p.num_leaves} leaves and kernels "
                f"{p.kernel_names}, against {steps} steps per leaf and kernels {first.kernel_names}"
            )
    batch = sum(p.num_leaves for p in parts)
    cat = {}
    for f in fields(Rollout):
        per = f.metadata.get("per")
        if per == "leaf":
            cat[f.name] = torch.cat([getattr(p, f.name) for p in parts])  # (B, ...)
        elif per == "transition":  # each part (S * B_c, ...) -> (S, B_c, ...); joined along the leaves
            values = [getattr(p, f.name) for p in parts]
            joined = torch.cat([v.reshape(steps, p.num_leaves, *v.shape[1:]) for v, p in zip(values, parts)], dim=1)
            cat[f.name] = joined.reshape(steps * batch, *values[0].shape[1:])  # (S * B, ...)
    node = torch.arange(steps * batch, device=first.final.device)  # (M,) ids are rows, as sample() numbers them
    cat["node"], cat["leaf"] = node, node % batch
    cat["parent"] = torch.where(node >= batch, node - batch, torch.full_like(node, -1))  # (M,)
    leaves = torch.arange(batch, device=node.device)
    cat["leaf_node"] = leaves + (steps - 1) * batch if steps else torch.full_like(leaves, -1)  # (B,)
    cost = {k: sum(p.cost.get(k, 0) for p in parts) for k in first.cost}
    return Rollout(**cat, kernel_names=first.kernel_names, cost=cost)
