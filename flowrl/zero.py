"""DeepSpeed ZeRO stage 1 and 2 (Rajbhandari et al., arXiv 1910.02054) as flowrl runs it through accelerate: every
process holds the whole trained weights, and AdamW's float32 master weights and moments (stage 1), and the gradients
too (stage 2), are partitioned over the processes.

flowrl drives the DeepSpeed engine itself rather than through ``accelerator.backward`` (which would step the engine
after every backward): the config is set to ``managed_gradient_accumulation: false`` (DeepSpeed >= 0.19), so a
backward only accumulates and :meth:`engine.step` is the accumulation boundary, where stage 1 reduces the gradients.
Stage 2 reduces (reduce-scatters) them in every backward, a collective call, so under stage 2 every process makes the
same number of backwards per optimizer step (:meth:`flowrl.policy.Policy.step` pads with zero-gradient passes).
Stage 3 partitions the weights themselves and gathers them in every forward, a collective call every process must make
in the same order, which flowrl's processes do not (their own transitions, evaluation shares, the main process's
grids): it is refused, as FSDP2's resharding after forward is.

Gradient clipping is DeepSpeed's (``gradient_clipping`` set to ``train.max_grad_norm``: the same rule as
``torch.nn.utils.clip_grad_norm_``, coefficient ``max_norm / (norm + 1e-6)`` when below 1). Checkpoints hold whole
tensors in torch AdamW's ``state_dict`` layout, gathered from the partitions with DeepSpeed's
``safe_get_full_optimizer_state``: the same files as under DDP, FSDP2 or one process, resumable under any of them.

Memory per process, for ``N`` trainable float32 weights over ``P`` processes: the weights ``4N`` bytes, the float32
master partition ``4N / P``, AdamW's moments ``8N / P``, and the gradients ``4N`` (stage 1) or ``4N / P`` plus a
reduction bucket (stage 2), against ``16N`` (plus DDP's ``4N`` buckets) under DDP.
"""

from __future__ import annotations

import logging

import torch

STAGES = (1, 2)
"""The ZeRO stages flowrl runs."""

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
            DeepSpeed key and what to set, for a ZeRO stage other than 1 or 2, parameter offload, DeepSpeed's own
            bf16/fp16 (flowrl's precision is ``run.mixed_precision``), an ``optimizer`` or ``scheduler`` block (flowrl
            builds AdamW from ``train``), or a ``gradient_clipping`` other than ``train.max_grad_norm``.
    """
    from .config import ConfigError

    try:
        import deepspeed
        from deepspeed.runtime.engine import DeepSpeedEngine
    except ImportError:
        raise ConfigError(
            "accelerate launch uses DeepSpeed, which is not installed: pip install 'flowrl[deepspeed]'"
        ) from None
    if not hasattr(DeepSpeedEngine, "managed_gradient_accumulation"):
        raise ConfigError(
            f"DeepSpeed {deepspeed.__version__} has no managed_gradient_accumulation (flowrl calls the "
            "engine's step once per minibatch): pip install 'deepspeed>=0.19.8'"
        )
    stage = _get(config, "zero_optimization.stage", 0)
    if stage not in STAGES:
        raise ConfigError(
            f"the DeepSpeed config's zero_optimization.stage is {stage!r}: flowrl runs ZeRO stage 1 or 2 "
            "(configs/accelerate/deepspeed_zero2.yaml); stage 3 gathers the weights in every forward, "
            "which needs every process to make the same forwards (use FSDP2 or stage 2), and stage 0 is "
            "DDP (configs/accelerate/ddp.yaml)"
        )
    if _get(config, "zero_optimization.offload_param.device", "none") not in ("none", None):
        raise ConfigError(
            "the DeepSpeed config offloads parameters (zero_optimization.offload_param.device), a "
            "ZeRO stage 3 feature: set it to none (optimizer offload, offload_optimizer.device: cpu, runs)"
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


class ZeroLoader:
    """Loads a whole-tensor AdamW ``state_dict`` (:func:`full_optimizer_state`'s layout) into a DeepSpeed engine's
    ZeRO partitions: the moments with ``safe_set_full_optimizer_state``, the step count into every partition, and
    the float32 master weights from the trained parameters (which ``load_checkpoint`` has set first).

    Args:
        engine: the DeepSpeed engine; params (`list[torch.Tensor]`): the trained parameters in optimizer order.
    """

    def __init__(self, engine, params: list[torch.Tensor]):
        self.engine, self.params = engine, params

    def load_state_dict(self, state: dict) -> None:
        """Restore ``state`` (whole tensors). No communication: every process holds the whole state and writes its
        own partition."""
        from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

        zero = self.engine.optimizer
        inner = zero.optimizer
        saved = {k: v for k, v in state["param_groups"][0].items() if k != "params"}
        for group in inner.param_groups:
            group.update(saved)
        for p in self.params:
            safe_set_full_fp32_param(p, p.detach().float())
        per = {int(k): v for k, v in state["state"].items()}  # parameter index -> its state
        if not per:
            return
        step = next(iter(per.values()))["step"]
        for flat in zero.single_partition_of_fp32_groups:
            if not inner.state[flat]:  # torch AdamW creates its state in its first step: create it now
                inner.state[flat] = {
                    "step": torch.zeros((), dtype=torch.float32),
                    "exp_avg": torch.zeros_like(flat),
                    "exp_avg_sq": torch.zeros_like(flat),
                }
            inner.state[flat]["step"] = torch.as_tensor(step, dtype=torch.float32).clone()
        zero._lazy_init_hp_params_optimizer_state()  # point each parameter's fragment at the state tensors
        for i, p in enumerate(self.params):
            for key in ("exp_avg", "exp_avg_sq"):
                safe_set_full_optimizer_state(p, per[i][key].to(p.device), key)
