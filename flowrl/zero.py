"""DeepSpeed ZeRO (Rajbhandari et al., arXiv 1910.02054) as flowrl runs it through accelerate: AdamW's float32 master
weights and moments (stage 1), the gradients too (stage 2), and the trained weights themselves (stage 3) partitioned
over the processes.

flowrl drives the DeepSpeed engine itself rather than through ``accelerator.backward`` (which would step the engine
after every backward): the config is set to ``managed_gradient_accumulation: false`` (DeepSpeed >= 0.19), so a
backward only accumulates and :meth:`engine.step` is the accumulation boundary, where stage 1 reduces the gradients.
Stages 2 and 3 reduce (reduce-scatter) them in every backward, a collective call, so every process makes the same
number of backwards per optimizer step (:meth:`flowrl.policy.Policy.step` pads with zero-gradient passes under stage
2). Stage 3 also gathers each module's weights in every forward and backward, so under it every process calls the
transformer alike between optimizer steps (:func:`flowrl.sharding.lockstep`: micro-batches padded with zero-weight
rows through the method's own loss, evaluation shares padded, grids drawn on every process); the held copies of the
weights (EMA, a method's reference or sampling policy) are copies of each parameter's partition (``ds_tensor``) swapped
into it, every weight is partitioned however small (``stage3_param_persistence_threshold: 0``), and whole weights are
gathered by every process (:func:`whole_partition`, :func:`gathered`) for checkpoints and exports. The frozen text
encoders and VAE load whole (:func:`load_whole`). Under stage 3 the partitions and the optimizer may be offloaded to
the CPU (``configs/accelerate/deepspeed_zero3_offload.yaml``: DeepSpeed moves each module's partitions in for its
forward and backward and steps AdamW on the CPU); weights offload under stages 1-2 is refused (DeepSpeed has none).

Gradient clipping is DeepSpeed's (``gradient_clipping`` set to ``train.max_grad_norm``: the same rule as
``torch.nn.utils.clip_grad_norm_``, coefficient ``max_norm / (norm + 1e-6)`` when below 1). Checkpoints hold whole
tensors in torch AdamW's ``state_dict`` layout, gathered from the partitions with DeepSpeed's
``safe_get_full_optimizer_state``: the same files as under DDP, FSDP2 or one process, resumable under any of them.

Memory per process, for ``N`` trainable float32 weights over ``P`` processes: the weights ``4N`` bytes (stage 3:
``4N / P`` plus the gathered module in use), the float32 master partition ``4N / P``, AdamW's moments ``8N / P``, and
the gradients ``4N`` (stage 1) or ``4N / P`` plus a reduction bucket (stages 2 and 3), against ``16N`` (plus DDP's
``4N`` buckets) under DDP.
"""

from __future__ import annotations

import logging

import torch

STAGES = (1, 2, 3)
"""The ZeRO stages flowrl runs (stage 3 with the methods that run in lockstep: :func:`flowrl.sharding.lockstep`)."""

CPU_NOTICE = "Setting accelerator to CPU"
"""How DeepSpeed's warning on import without a GPU starts (its logger ``DeepSpeed``): :func:`quiet_cpu_notice`."""


class _DropCpuNotice(logging.Filter):
    """Drops the ``DeepSpeed`` logger's :data:`CPU_NOTICE` record and keeps every other."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(CPU_NOTICE)


def quiet_cpu_notice() -> None:
    """Filter DeepSpeed's ``Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect
    it.`` out of the logs, through its logger (``logging.getLogger("DeepSpeed")``, whose filters DeepSpeed keeps when it
    sets the logger up on import): accelerate imports DeepSpeed on every process of a ZeRO launch, and on a machine
    without a GPU (the tests' two-process ZeRO runs) the warning says nothing the run's own lines do not. Its other
    records pass. Called before flowrl builds an ``Accelerator``; calling it again adds nothing."""
    logger = logging.getLogger("DeepSpeed")
    if not any(isinstance(f, _DropCpuNotice) for f in logger.filters):
        logger.addFilter(_DropCpuNotice())


def is_deepspeed(accelerator) -> bool:
    """Whether ``accelerator`` (an ``accelerate.Accelerator``) runs DeepSpeed."""
    kind = getattr(accelerator, "distributed_type", None)
    return str(getattr(kind, "value", kind)).upper() == "DEEPSPEED"


def _get(config: dict, dotted: str, default=None):
    """``config["a"]["b"]`` for ``"a.b"``, ``default`` where a key is missing."""
    for key in dotted.split("."):
        if not isinstance(config, dict) or key not in config:
            return default
        config = config[key]
    return config


def check_deepspeed_config(config: dict, max_grad_norm: float) -> None:
    """Check a DeepSpeed config (``accelerator.state.deepspeed_plugin.deepspeed_config``, after accelerate read the
    launch's ``deepspeed_config`` or ``deepspeed_config_file``) before any weights load.

    Args:
        config (`dict`): the DeepSpeed config.
        max_grad_norm (`float`): ``train.max_grad_norm``, which ``gradient_clipping`` must leave as ``auto`` or equal.

    Raises:
        ConfigError: for DeepSpeed missing or without ``managed_gradient_accumulation`` (0.19.8 has it); naming the
            DeepSpeed key and what to set, for a ZeRO stage other than 1, 2 or 3, weights offload under stage 1 or 2,
            DeepSpeed's own bf16/fp16 (flowrl's precision is ``run.mixed_precision``), an ``optimizer`` or ``scheduler`` block (flowrl
            builds AdamW from ``train``), or a ``gradient_clipping`` other than ``train.max_grad_norm``.
    """
    from .config import ConfigError

    try:
        import deepspeed
        from deepspeed.runtime.engine import DeepSpeedEngine
    except ImportError:
        raise ConfigError(
            "accelerate launch uses DeepSpeed, which is not installed: pip install 'deepspeed>=0.19.8'"
        ) from None
    if not hasattr(DeepSpeedEngine, "managed_gradient_accumulation"):
        raise ConfigError(
            f"DeepSpeed {deepspeed.__version__} has no managed_gradient_accumulation (flowrl calls the "
            "engine's step once per minibatch): pip install 'deepspeed>=0.19.8'"
        )
    stage = _get(config, "zero_optimization.stage", 0)
    if stage not in STAGES:
        raise ConfigError(
            f"the DeepSpeed config's zero_optimization.stage is {stage!r}: flowrl runs ZeRO stage 1, 2 or 3 "
            "(configs/accelerate/deepspeed_zero2.yaml, deepspeed_zero3.yaml); stage 0 is DDP "
            "(configs/accelerate/ddp.yaml)"
        )
    if stage != 3 and _get(config, "zero_optimization.offload_param.device", "none") not in ("none", None):
        raise ConfigError(
            f"the DeepSpeed config offloads the weights (zero_optimization.offload_param.device) under ZeRO stage "
            f"{stage}: DeepSpeed offloads weights under stage 3 only (configs/accelerate/deepspeed_zero3_offload.yaml); "
            "set it to none (optimizer offload, offload_optimizer.device: cpu, runs under stages 1-3)"
        )
    for key in ("bf16", "fp16"):
        if _get(config, f"{key}.enabled", False) is True:
            raise ConfigError(
                f"the DeepSpeed config enables {key} ({key}.enabled), which would run the float32 "
                "log-probs in half precision: set it false (accelerate launch --mixed_precision no) and "
                "use run.mixed_precision=bf16 for flowrl's own autocast"
            )
    for key in ("optimizer", "scheduler"):
        if key in config:
            raise ConfigError(
                f"the DeepSpeed config has an {key!r} block: remove it; flowrl builds AdamW from "
                "train.learning_rate, train.adam_betas and train.weight_decay"
            )
    clip = config.get("gradient_clipping", "auto")
    if clip not in ("auto", None) and float(clip) != float(max_grad_norm):
        raise ConfigError(
            f"the DeepSpeed config's gradient_clipping is {clip!r} but config key 'train.max_grad_norm' "
            f"is {max_grad_norm!r}: set gradient_clipping to auto (flowrl fills it) or to the same value"
        )


def load_whole(accelerator) -> None:
    """Let the frozen components (text encoders, VAE) load whole under a ZeRO-3 launch: accelerate (1.16) points
    transformers at its DeepSpeed config whatever ``zero3_init_flag`` says (``set_deepspeed_weakref``), and transformers
    then partitions every model it loads (``deepspeed.zero.Init``), the text encoders too, whose forwards flowrl calls
    outside the engine. Only the trained transformer is partitioned, by the engine. No-op unless ``accelerator`` runs
    DeepSpeed."""
    if not is_deepspeed(accelerator):
        return
    from transformers.integrations import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()


def configure(config: dict, max_grad_norm: float, num_processes: int) -> None:
    """Fill the keys flowrl owns in a checked DeepSpeed config (:func:`check_deepspeed_config`), in place, before
    ``accelerator.prepare``: clipping at ``train.max_grad_norm``; no managed gradient accumulation (flowrl calls
    ``engine.step`` once per minibatch and scales each micro-batch's loss by its share itself); a micro-batch of 1
    sample for DeepSpeed's sample counters; torch's AdamW accepted (also with optimizer offload, on the CPU)."""
    config["gradient_clipping"] = float(max_grad_norm)
    config["gradient_accumulation_steps"] = 1
    config["managed_gradient_accumulation"] = False
    config["train_micro_batch_size_per_gpu"] = 1
    config["train_batch_size"] = num_processes
    config["zero_allow_untested_optimizer"] = True
    config["zero_force_ds_cpu_optimizer"] = False
    if config.get("zero_optimization", {}).get("stage") == 3:  # every weight partitioned, however small: the held
        config["zero_optimization"]["stage3_param_persistence_threshold"] = 0  # copies are partitions
        config["zero_optimization"]["stage3_model_persistence_threshold"] = 0


def full_optimizer_state(engine, params: list[torch.Tensor], keep: bool = True) -> dict | None:
    """AdamW's state as torch's ``AdamW.state_dict()`` of one process over ``params`` would hold it, with whole tensors
    on the CPU, gathered from the ZeRO partitions (collective: every process calls it for the same ``params``).

    Args:
        engine: the DeepSpeed engine; params (`list[torch.Tensor]`): the trained parameters in optimizer order.
        keep (`bool`): False on the processes that do not write the checkpoint: each whole tensor is dropped once
            gathered, so that only one process holds the whole state.

    Returns:
        `dict`: ``{"state": {i: {"step", "exp_avg", "exp_avg_sq"}}, "param_groups": [...]}`` (empty ``state``
        before the first optimizer step); None when not ``keep``.
    """
    from deepspeed.utils import safe_get_full_optimizer_state

    zero = engine.optimizer  # DeepSpeedZeroOptimizer
    inner = zero.optimizer  # torch AdamW over this process's float32 partitions
    group = {k: v for k, v in inner.param_groups[0].items() if k != "params"}
    groups = [{**group, "params": list(range(len(params)))}]
    flat = [s for s in inner.state.values() if s]
    if not flat:
        return {"state": {}, "param_groups": groups} if keep else None
    step = flat[0]["step"]
    state = {}
    for i, p in enumerate(params):
        state[i] = {"step": step.detach().clone().cpu() if torch.is_tensor(step) else torch.tensor(float(step))}
        for key in ("exp_avg", "exp_avg_sq"):
            value = safe_get_full_optimizer_state(p, key)  # an all-reduce of the partitions
            state[i][key] = value.detach().cpu() if keep else None
    return {"state": state, "param_groups": groups} if keep else None


def partition_of(value: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """This process's ZeRO-3 partition of the whole tensor ``value`` (shaped like ``param.ds_shape``): the flattened
    tensor, zero-padded to ``processes x`` the partition size, cut into equal parts in process order, as DeepSpeed
    partitions ``param`` into ``param.ds_tensor``. No communication."""
    import torch.distributed as dist

    size = param.ds_tensor.numel()
    flat = value.detach().reshape(-1).to(device=param.ds_tensor.device, dtype=param.ds_tensor.dtype)
    flat = torch.nn.functional.pad(flat, (0, size * dist.get_world_size() - flat.numel()))
    return flat[size * dist.get_rank() : size * (dist.get_rank() + 1)]


def whole_partition(part: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """The whole tensor, shaped ``param.ds_shape``, of which every process holds the ZeRO-3 partition ``part`` (laid
    out as ``param.ds_tensor``; an all-gather: every process calls it for the same parameter)."""
    import torch.distributed as dist

    parts = [torch.empty_like(part) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, part.contiguous())
    return torch.cat(parts)[: param.ds_numel].view(tuple(param.ds_shape))


def gathered(params: list[torch.Tensor]):
    """Context in which the ZeRO-3 ``params`` hold their whole tensors, to read (DeepSpeed's ``GatheredParameters``;
    collective: every process enters it with the same parameters)."""
    from deepspeed.runtime.zero.partition_parameters import GatheredParameters

    return GatheredParameters(params, modifier_rank=None)


class ZeroLoader:
    """Loads a whole-tensor AdamW ``state_dict`` (:func:`full_optimizer_state`'s layout) into a DeepSpeed engine's
    ZeRO partitions: the moments with ``safe_set_full_optimizer_state``, the step count into every partition, and
    the float32 master weights from the trained parameters (which ``load_checkpoint`` has set first).

    Args:
        engine: the DeepSpeed engine; params (`list[torch.Tensor]`): the trained parameters in optimizer order.
        weights (`list[torch.Tensor]`, optional): their whole tensors, where the parameters hold only partitions
            (ZeRO-3); None: the parameters themselves.
    """

    def __init__(self, engine, params: list[torch.Tensor], weights: list[torch.Tensor] | None = None):
        self.engine, self.params, self.weights = engine, params, weights

    def load_state_dict(self, state: dict) -> None:
        """Restore ``state`` (whole tensors). No communication: every process holds the whole state and writes its
        own partition."""
        from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

        zero = self.engine.optimizer
        inner = zero.optimizer
        saved = {k: v for k, v in state["param_groups"][0].items() if k != "params"}
        for group in inner.param_groups:
            group.update(saved)
        for p, w in zip(self.params, self.weights or self.params):
            safe_set_full_fp32_param(p, w.detach().float().to(p.device))
        per = {int(k): v for k, v in state["state"].items()}  # parameter index -> its state
        if not per:
            return
        step = next(iter(per.values()))["step"]
        flats = getattr(zero, "single_partition_of_fp32_groups", None) or zero.fp32_partitioned_groups_flat  # stage 3
        for flat in flats:
            if not inner.state[flat]:  # torch AdamW creates its state in its first step: create it now
                inner.state[flat] = {
                    "step": torch.zeros((), dtype=torch.float32),
                    "exp_avg": torch.zeros_like(flat),
                    "exp_avg_sq": torch.zeros_like(flat),
                }
            inner.state[flat]["step"] = torch.as_tensor(step, dtype=torch.float32).clone()
        if hasattr(zero, "_lazy_init_hp_params_optimizer_state"):  # stages 1 and 2: point the fragments at the state
            zero._lazy_init_hp_params_optimizer_state()
        for i, p in enumerate(self.params):
            for key in ("exp_avg", "exp_avg_sq"):
                safe_set_full_optimizer_state(p, per[i][key].to(p.device), key)
