"""FSDP2 (``torch.distributed.fsdp.fully_shard``; FSDP: arXiv 2304.11277, ZeRO: arXiv 1910.02054) as flowrl runs it
through accelerate: the trained parameters, their gradients and the optimizer state are sharded over the processes,
and the parameters are gathered once after every optimizer step and kept gathered until the next one.

Why kept gathered: FSDP2 all-gathers a sharded module's parameters in its forward, a collective call every process
must make in the same order. flowrl's processes make different numbers of forwards between two optimizer steps (each
keeps its own transitions, evaluates its own share of the prompts, the main process draws the before/after grid), so
the parameters must not be resharded after a forward or a backward: ``fsdp_reshard_after_forward: false`` (FSDP2's
ZeRO-2 mode) and :func:`keep_gathered`. The only collective calls left are the gradients' reduce-scatter in the one
synchronised backward of each optimizer step (every process makes it, as under DDP), the clipping norm's reduction,
and :func:`regather` after each step, which every process makes too.

Memory per process, for ``N`` trainable float32 weights over ``P`` processes: the gathered weights ``4N`` bytes plus
their shard ``4N / P``, the gradient shard ``4N / P`` (a whole gradient only during a backward) and AdamW's moments
``8N / P``, against ``4N + 4N + 8N`` (plus DDP's ``4N`` buckets) under DDP.
"""

from __future__ import annotations

import torch


def is_fsdp2(accelerator) -> bool:
    """Whether ``accelerator`` (an ``accelerate.Accelerator``) shards the model with FSDP2."""
    return bool(getattr(accelerator, "is_fsdp2", False))


def fsdp_units(module: torch.nn.Module) -> list:
    """The modules of ``module`` that ``fully_shard`` wrapped (``FSDPModule``), in ``modules()`` order (the same on
    every process)."""
    from torch.distributed.fsdp import FSDPModule

    return [m for m in module.modules() if isinstance(m, FSDPModule)]


def keep_gathered(module: torch.nn.Module) -> None:
    """Gather the parameters of every FSDP unit of ``module`` and keep them gathered after a backward (collective:
    every process calls it)."""
    units = fsdp_units(module)
    for unit in units:
        unit.set_reshard_after_backward(False)
    for unit in units:
        unit.unshard()


def regather(module: torch.nn.Module) -> None:
    """Refresh the gathered parameters of ``module`` from their shards after the optimizer updated the shards
    (collective: every process calls it, after every optimizer step)."""
    units = fsdp_units(module)
    for unit in units:
        unit.reshard()
    for unit in units:
        unit.unshard()


def full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a sharded ``DTensor`` (an all-gather: every process calls it for the same tensor), or
    ``tensor`` itself when it is a plain tensor."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def shard_like(value: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """This process's shard of the whole tensor ``value``, placed as ``like`` (a ``DTensor``) is; ``value`` as it is
    when ``like`` is a plain tensor. No communication: every process holds ``value`` whole.

    Raises:
        ValueError: when ``value``'s shape differs from ``like``'s (global) shape.
    """
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not isinstance(like, DTensor):
        return value
    if tuple(value.shape) != tuple(like.shape):
        raise ValueError(
            f"cannot shard a tensor of shape {tuple(value.shape)} like a parameter of shape {tuple(like.shape)}"
        )
    return distribute_tensor(
        value.to(device=like.device, dtype=like.dtype), like.device_mesh, like.placements, src_data_rank=None
    )


def full_optimizer_state(state: dict, keep: bool = True) -> dict | None:
    """An optimizer ``state_dict`` with every sharded tensor of its per-parameter state made whole (:func:`full`;
    collective under FSDP2), on the CPU. ``keep`` False (the processes that do not write the checkpoint): take part in
    each all-gather, drop the whole tensor at once and return None, so that only one process holds the whole state."""

    def whole(value):
        if isinstance(value, dict):
            return {k: whole(v) for k, v in value.items()}
        if not torch.is_tensor(value):
            return value
        value = full(value)
        return value.detach().cpu() if keep else None

    out = {"state": {pid: whole(s) for pid, s in state["state"].items()}, "param_groups": state["param_groups"]}
    return out if keep else None


def shard_optimizer_state(state: dict, params: list[torch.Tensor]) -> dict:
    """The inverse of :func:`full_optimizer_state` for an optimizer over ``params`` (in ``param_groups`` order): each
    state tensor shaped like its parameter becomes that parameter's shard (:func:`shard_like`); scalars such as
    AdamW's ``step`` stay as they are."""

    def part(value, like):
        if isinstance(value, dict):
            return {k: part(v, like) for k, v in value.items()}
        if torch.is_tensor(value) and tuple(value.shape) == tuple(like.shape) and value.ndim > 0:
            return shard_like(value, like)
        return value

    return {
        "state": {pid: part(s, params[int(pid)]) for pid, s in state["state"].items()},
        "param_groups": state["param_groups"],
    }
