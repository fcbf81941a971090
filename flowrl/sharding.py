"""FSDP2 (``torch.distributed.fsdp.fully_shard``; FSDP: arXiv 2304.11277, ZeRO: arXiv 1910.02054) as flowrl runs it
through accelerate: the trained parameters, their gradients and the optimizer state are sharded over the processes,
in one of two modes.

Weights kept gathered (``configs/accelerate/fsdp2.yaml``, ``fsdp_reshard_after_forward: false``, FSDP2's ZeRO-2
mode): the parameters are gathered once after every optimizer step and kept gathered until the next one
(:func:`keep_gathered`, :func:`regather`), so the processes may make different numbers of forwards between two
optimizer steps (their own kept transitions, their share of the evaluation, the main process's grids). The only
collective calls are the gradients' reduce-scatter in the one synchronised backward of each optimizer step (every
process makes it, as under DDP), the clipping norm's reduction, and :func:`regather` after each step.

Full shard (``configs/accelerate/fsdp2_full_shard.yaml``, ``fsdp_reshard_after_forward: true``): each FSDP unit
all-gathers its parameters for its forward and again for its backward and frees them after (the root unit too:
:func:`reshard_every_forward`), so between calls every process holds only its shards. Each all-gather is a
collective call every process must make in the same order, so in this mode (:func:`lockstep`) every process calls
the transformer alike between optimizer steps: each optimizer step's micro-batches are padded to the count of the
process with the most, with zero-weight rows through the method's own loss
(:meth:`flowrl.policy.Policy.padding`, :meth:`flowrl.methods.base.Method.optimizer_steps`); each process's share of an
evaluation is padded to the same number of images (:func:`flowrl.evaluation.sharded`); the before/after grid is
drawn on every process and written by one; held copies of the weights (EMA, a method's reference or sampling
policy) are shards swapped into the shards; checkpoints and exports are made whole by every process
(:func:`full`) and written by the main process.

Memory per process, for ``N`` trainable float32 weights over ``P`` processes: kept gathered, the gathered weights
``4N`` bytes plus their shard ``4N / P``, the gradient shard ``4N / P`` (a whole gradient only during a backward) and
AdamW's moments ``8N / P``, against ``4N + 4N + 8N`` (plus DDP's ``4N`` buckets) under DDP; full shard, ``16N / P``
plus one unit's gathered weights and gradient during its forward and backward.
"""

from __future__ import annotations

import torch


def is_fsdp2(accelerator) -> bool:
    """Whether ``accelerator`` (an ``accelerate.Accelerator``) shards the model with FSDP2."""
    return bool(getattr(accelerator, "is_fsdp2", False))


def lockstep(accelerator) -> bool:
    """Whether ``accelerator`` (an ``accelerate.Accelerator``) gathers the trained module's weights in every forward
    (FSDP2 with ``fsdp_reshard_after_forward: true``, DeepSpeed ZeRO stage 3), so that every process must call the
    module the same number of times, in the same order, between two optimizer steps: flowrl then pads each
    optimizer step's micro-batches and each process's share of an evaluation to the same counts, and draws the
    grids on every process."""
    if is_fsdp2(accelerator):
        return accelerator.state.fsdp_plugin.reshard_after_forward is not False
    kind = getattr(accelerator, "distributed_type", None)
    if str(getattr(kind, "value", kind)).upper() == "DEEPSPEED":
        config = accelerator.state.deepspeed_plugin.deepspeed_config
        return config.get("zero_optimization", {}).get("stage") == 3
    return False


def reshard_every_forward(module: torch.nn.Module) -> None:
    """Make every FSDP unit of ``module`` reshard after each forward, the root too (FSDP2 keeps the root gathered
    after a forward by default, which would leave it gathered on a process whose next call is a forward without
    gradients): between calls every parameter of ``module`` is then its shard (a ``DTensor``), on every process."""
    for unit in fsdp_units(module):
        unit.set_reshard_after_forward(True, recurse=False)


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
