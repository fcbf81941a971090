"""The trained policy's weights and what updates them: AdamW, gradient clipping, the EMA, held copies of the
weights, the minibatch schedule shared by every process, and the sum of the gradients over processes.

A method (:mod:`flowrl.methods`) computes a loss per (micro-)batch, back-propagates it through
:meth:`Policy.backward` and calls :meth:`Policy.step` once per minibatch; the trainer never touches gradients.
Under several processes the transformer is wrapped by accelerate: DDP (``accelerator.prepare_model``), FSDP2
(``accelerator.prepare``, :mod:`flowrl.sharding`: weights, gradients and optimizer state sharded, the weights kept
gathered between optimizer steps, or under full shard gathered per block for each forward and backward, every process
then calling the transformer alike: :meth:`Policy.padding`), or a DeepSpeed ZeRO-1/2/3 engine (``accelerator.prepare``, :mod:`flowrl.zero`:
optimizer state, under stages 2 and 3 gradients, under stage 3 the weights too, partitioned; the engine's ``backward`` and ``step`` called here). Each
averages the gradients over processes; micro-batches accumulate under ``accelerator.no_sync`` (DDP, FSDP2) or in the
engine until its step.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch

from .checkpoint import load_checkpoint, save_checkpoint
from .precision import bf16_autocast, resolve_precision
from .sharding import (
    full,
    full_optimizer_state,
    is_fsdp2,
    keep_gathered,
    lockstep,
    regather,
    reshard_every_forward,
    shard_like,
    shard_optimizer_state,
)
from .zero import ZeroLoader, check_deepspeed_config, configure, gathered, is_deepspeed, partition_of, whole_partition
from .zero import full_optimizer_state as zero_optimizer_state


def minibatch_sizes(counts: torch.Tensor, size: int) -> torch.Tensor:
    """Transitions in each minibatch of each process, ``(processes, steps)`` int64.

    Each process splits its own kept transitions (``counts``, ``(processes,)`` int) into minibatches of
    ``size``; all take as many optimizer steps as the process with the most minibatches, because the
    gradients are summed over processes at every step, so a process that has run out contributes 0
    transitions (a zero gradient) to the remaining steps. ``steps`` is 0 when no process kept a transition.
    Example: counts ``[5, 0, 3]``, size 2 -> ``[[2, 2, 1], [0, 0, 0], [2, 1, 0]]``.
    """
    steps = max(-(-int(c) // size) for c in counts)
    return torch.stack([torch.clamp(int(c) - torch.arange(steps) * size, 0, size) for c in counts])


def move_towards(store: dict[str, torch.Tensor], target: dict[str, torch.Tensor], decay: float) -> None:
    """``store <- decay store + (1 - decay) target`` in place, tensor by tensor (an EMA step: the policy's EMA,
    DiffusionNFT's old policy, TDM-R1's slow surrogate).

    Args:
        store, target (`dict[str, torch.Tensor]`): the same names and shapes (float32; under full sharding both this
            process's shards or partitions, as :meth:`Policy.copy` makes them); `store` for each of `target`'s names.
        decay (`float`, in [0, 1]): the weight kept on `store`.
    """
    with torch.no_grad():
        for n, w in target.items():
            store[n].mul_(decay).add_(w.detach(), alpha=1 - decay)


def what_runs() -> str:
    """What the refusals of FSDP2 full shard and ZeRO-3 say runs there: the registered methods whose update calls the
    transformer alike on every process (:attr:`flowrl.methods.base.Method.lockstep`; docs/distributed.md, "Full
    sharding"), e.g. ``"full sharding runs train.method alignprop, awm, ..."``."""
    from .methods import METHODS

    return "full sharding runs train.method " + ", ".join(sorted(n for n, m in METHODS.items() if m.lockstep))


def check_accelerate_engine(
    accelerator,
    step_grad_norms: str = "none",
    optimizer: str = "adamw",
    max_grad_norm: float = 1.0,
    lockstep_blocker: str | None = None,
    engine_blockers: dict[str, str] | None = None,
) -> None:
    """Check accelerate's engine before any weights load: DDP (``configs/accelerate/ddp.yaml``), FSDP2 with the
    weights kept gathered between optimizer steps (``configs/accelerate/fsdp2.yaml``, :mod:`flowrl.sharding`), FSDP2
    resharding after each forward (``configs/accelerate/fsdp2_full_shard.yaml``) and DeepSpeed ZeRO stage 1, 2 or 3
    (``configs/accelerate/deepspeed_zero2.yaml``, ``deepspeed_zero3.yaml``, :mod:`flowrl.zero`) run; FSDP1, DeepSpeed
    parameter offload and ``zero3_init_flag``, and Megatron-LM are refused.

    FSDP2 resharding after a forward (and ZeRO-3) all-gathers the weights in every forward, a collective call every process must
    make in the same order: flowrl pads each optimizer step's micro-batches and each evaluation share to the same
    counts and draws the grids on every process (:func:`flowrl.sharding.lockstep`), for the methods whose update
    makes the same forwards once padded (:attr:`flowrl.methods.base.Method.lockstep`). accelerate 1.15 runs FSDP and
    DeepSpeed only on accelerator devices: with ``--cpu`` it falls back to DDP.

    Args:
        step_grad_norms: ``train.step_grad_norms``; ``params`` (a backward per denoising step through the sharded
            weights) is refused under FSDP2 and DeepSpeed.
        optimizer: ``train.optimizer``; ``adamw_8bit`` (bitsandbytes over ``DTensor`` shards or ZeRO partitions,
            untested) is refused under FSDP2 and DeepSpeed.
        max_grad_norm: ``train.max_grad_norm``, checked against DeepSpeed's ``gradient_clipping``.
        lockstep_blocker: the setting that keeps the method from calling the transformer alike on every process
            (:meth:`flowrl.methods.base.Method.lockstep_blocker`), refused under FSDP2 full shard and ZeRO-3; None:
            none.
        engine_blockers: the engines (``"FSDP2"``, ``"DeepSpeed"``) the method does not run under, each with why
            (:meth:`flowrl.methods.base.Method.engine_blockers`); None: none.

    Raises:
        ConfigError: naming the launch setting (or ``train.step_grad_norms``, ``train.optimizer``, the DeepSpeed
            config key) and what to use instead.
    """
    from .config import ConfigError

    kind = str(getattr(accelerator.distributed_type, "value", accelerator.distributed_type)).upper()
    if kind == "FSDP":
        plugin = accelerator.state.fsdp_plugin
        if getattr(plugin, "fsdp_version", 1) != 2:
            raise ConfigError(
                "accelerate launch uses FSDP version 1 (fsdp_config.fsdp_version): flowrl runs FSDP2; "
                "launch with configs/accelerate/fsdp2.yaml (fsdp_version: 2, "
                "fsdp_reshard_after_forward: false)"
            )
        check_not_sharded(engine_blockers, "FSDP2")
        if plugin.reshard_after_forward not in (True, False):
            raise ConfigError(
                f"accelerate's FSDP2 reshards after forward to {plugin.reshard_after_forward!r} processes "
                "(fsdp_config.fsdp_reshard_after_forward): flowrl runs true (configs/accelerate/"
                "fsdp2_full_shard.yaml) or false (configs/accelerate/fsdp2.yaml)"
            )
        if plugin.reshard_after_forward and lockstep_blocker:
            raise ConfigError(
                f"accelerate's FSDP2 reshards after each forward (fsdp_config.fsdp_reshard_after_forward: true), "
                f"which needs every process to call the transformer alike, and {lockstep_blocker} does not "
                f"({what_runs()}): set fsdp_reshard_after_forward: false (configs/accelerate/fsdp2.yaml)"
            )
        engine, shards = "FSDP2", "DTensor shards"
    elif kind == "DEEPSPEED":
        world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        if world != accelerator.num_processes:
            raise ConfigError(
                f"accelerate launch uses DEEPSPEED on {world} processes but accelerate counts "
                f"{accelerator.num_processes} (accelerate runs DeepSpeed on GPUs only): on CPUs launch "
                "with configs/accelerate/ddp.yaml or --cpu"
            )
        check_not_sharded(engine_blockers, "DeepSpeed")
        config = accelerator.state.deepspeed_plugin.deepspeed_config
        check_deepspeed_config(config, max_grad_norm)
        if getattr(accelerator.state.deepspeed_plugin, "zero3_init_flag", False):
            raise ConfigError(
                "accelerate's DeepSpeed zero3_init_flag is true (deepspeed_config.zero3_init_flag), which would "
                "partition the frozen text encoders and VAE as they load: set it false "
                "(configs/accelerate/deepspeed_zero3.yaml)"
            )
        if config.get("zero_optimization", {}).get("stage") == 3 and lockstep_blocker:
            raise ConfigError(
                f"the DeepSpeed config's zero_optimization.stage is 3, which gathers the weights in every forward "
                f"and needs every process to call the transformer alike, and {lockstep_blocker} does not "
                f"({what_runs()}): use stage 2 (configs/accelerate/deepspeed_zero2.yaml)"
            )
        engine, shards = "DeepSpeed", "ZeRO partitions"
    elif kind == "MEGATRON_LM":
        raise ConfigError(
            "accelerate launch uses MEGATRON_LM (accelerate config / --use_megatron_lm): flowrl runs DDP "
            "(configs/accelerate/ddp.yaml), FSDP2 (configs/accelerate/fsdp2.yaml) or DeepSpeed ZeRO-1/2 "
            "(configs/accelerate/deepspeed_zero2.yaml)"
        )
    else:
        return
    if step_grad_norms == "params":  # a backward per denoising step outside the engine's one per micro-batch
        raise ConfigError(
            f"config key 'train.step_grad_norms' is 'params', which back-propagates through the {engine} "
            f"weights once per denoising step: use velocity or none under {engine}"
        )
    if optimizer == "adamw_8bit":
        raise ConfigError(
            f"config key 'train.optimizer' is 'adamw_8bit', whose bitsandbytes steps over {engine}'s "
            f"{shards} are untested: use adamw under {engine} (its moments are sharded already)"
        )


def check_accelerate_precision(accelerator, run_precision: str) -> None:
    """Check accelerate's mixed precision (``accelerate launch --mixed_precision``) against flowrl's own,
    ``run.mixed_precision`` (autocast): fp16 is refused (no loss scaling here), bf16 refused under several
    processes (accelerate would autocast the wrapped model's forward, log-probs included) and warned about
    with one process when ``run.mixed_precision`` is not ``bf16``.

    Raises:
        ConfigError: for fp16, or bf16 under several processes, naming the setting to use.
    """
    from .config import ConfigError

    precision = accelerator.mixed_precision
    if precision == "fp16":  # on a GPU its loss scaling would run before our clipping
        raise ConfigError(
            "accelerate's mixed precision is fp16 (accelerate launch --mixed_precision fp16 or "
            "ACCELERATE_MIXED_PRECISION=fp16), which flowrl does not support (no loss scaling): launch "
            "with --mixed_precision no and set run.mixed_precision=bf16 or no"
        )
    if precision == "bf16" and accelerator.num_processes > 1:  # its autocast would wrap the DDP model's forward
        raise ConfigError(
            "accelerate's mixed precision is bf16 (accelerate launch --mixed_precision bf16), which "
            "would put the float32 log-probs under autocast: launch with --mixed_precision no and set "
            "run.mixed_precision=bf16 for flowrl's own bf16 autocast"
        )
    if precision == "bf16" and run_precision != "bf16":
        warnings.warn(
            f"accelerate's mixed precision bf16 (accelerate launch --mixed_precision bf16) is not used: "
            f"flowrl's precision is run.mixed_precision, here {run_precision!r}; set "
            "run.mixed_precision=bf16 for bf16 autocast",
            UserWarning,
            stacklevel=3,
        )


def check_not_sharded(engine_blockers: dict[str, str] | None, engine: str) -> None:
    """Refuse `engine` (``"FSDP2"`` or ``"DeepSpeed"``) for a method that does not run under it.

    Args:
        engine_blockers: the method's engines it does not run under, each with why
            (:meth:`flowrl.methods.base.Method.engine_blockers`), or None.

    Raises:
        ConfigError: naming ``train.method``, why, and the launch configs that run it.
    """
    from .config import ConfigError

    why = (engine_blockers or {}).get(engine)
    if why:
        runs = "DDP (configs/accelerate/ddp.yaml)"
        if "FSDP2" not in engine_blockers:
            runs += " or FSDP2 (configs/accelerate/fsdp2.yaml, fsdp2_full_shard.yaml)"
        raise ConfigError(f"config key 'train.method': {why}, so it runs in one process or under {runs}, not {engine}")


def check_launch(
    accelerator, cfg, lockstep_blocker: str | None = None, engine_blockers: dict[str, str] | None = None
) -> None:
    """Every check of the launch against the run's config, before any weights load, in this order: the engine
    (:func:`check_accelerate_engine`, with the method's `lockstep_blocker` and `engine_blockers`), accelerate's mixed precision against
    ``run.mixed_precision`` (:func:`check_accelerate_precision`; `cfg` has it resolved from ``auto``) and
    ``train.optimizer`` on the device (:func:`check_optimizer`).

    Raises:
        ConfigError: from the first check that fails, naming the setting.
    """
    t = cfg.train
    check_accelerate_engine(
        accelerator, t.step_grad_norms, t.optimizer, t.max_grad_norm, lockstep_blocker, engine_blockers
    )
    check_accelerate_precision(accelerator, cfg.run.mixed_precision)
    check_optimizer(t.optimizer, accelerator.device)


def check_optimizer(name: str, device: torch.device | str) -> None:
    """Check ``train.optimizer`` against the run's device before any weights load: ``adamw`` (torch's AdamW) runs
    anywhere; ``adamw_8bit`` is bitsandbytes' 8-bit AdamW (``bnb.optim.AdamW8bit``, Dettmers et al., arXiv 2110.02861;
    bitsandbytes ``bitsandbytes/optim/adamw.py``), whose two moments take one byte per trained weight instead of four
    (block-wise quantized, 256 weights per block; tensors under 4096 weights keep float32 moments), on a CUDA device
    only.

    Raises:
        ConfigError: naming ``train.optimizer``, for ``adamw_8bit`` on a device that is not CUDA or without the
            bitsandbytes package.
    """
    from .config import ConfigError

    if name != "adamw_8bit":
        return
    if torch.device(device).type != "cuda":
        raise ConfigError(
            f"config key 'train.optimizer' is 'adamw_8bit' (bitsandbytes' 8-bit AdamW), which flowrl "
            f"runs on a CUDA GPU only, but this run is on {torch.device(device).type}: use "
            "train.optimizer=adamw"
        )
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        raise ConfigError(
            "config key 'train.optimizer' is 'adamw_8bit' but bitsandbytes is not installed: "
            "pip install bitsandbytes, or use train.optimizer=adamw"
        ) from None


def build_optimizer(params, train) -> torch.optim.Optimizer:
    """``train.optimizer`` over ``params`` with ``train``'s learning rate, betas and weight decay (eps 1e-8 in both):
    ``torch.optim.AdamW`` for ``adamw``, ``bitsandbytes.optim.AdamW8bit`` for ``adamw_8bit`` (checked first by
    :func:`check_optimizer`)."""
    kwargs = dict(lr=train.learning_rate, betas=tuple(train.adam_betas), weight_decay=train.weight_decay)
    if train.optimizer == "adamw_8bit":
        import bitsandbytes as bnb

        return bnb.optim.AdamW8bit(params, **kwargs)
    return torch.optim.AdamW(params, **kwargs)


class Policy:
    """The trainable parameters of ``model.transformer`` (a LoRA, or every weight) with their optimizer.

    Args:
        model (:class:`flowrl.models.FlowModel`): the adapter whose transformer holds the trainable parameters
            (``requires_grad`` set by ``add_lora`` / ``full_finetune``).
        train (:class:`flowrl.config.TrainConfig`): ``optimizer``, learning rate, betas, weight decay, ``max_grad_norm``,
            ``ema_decay``, ``minibatch_size``, ``micro_batch_size``, ``inner_epochs``.
        precision (`str`): ``run.mixed_precision``, ``"no"`` or ``"bf16"`` (the default of :meth:`autocast`).
        accelerator (`accelerate.Accelerator`): processes and devices.
    """

    def __init__(self, model, train, precision: str, accelerator):
        self.model, self.cfg, self.precision, self.accelerator = model, train, precision, accelerator
        self.device = accelerator.device
        self.sharded = is_fsdp2(accelerator)
        # every process calls the transformer alike between optimizer steps (FSDP2 full shard, ZeRO-3): micro-batches
        # padded to the step's count (:meth:`padding`); under FSDP2 full shard the held copies are shards too
        self.lockstep = lockstep(accelerator)
        self.full_shard = self.sharded and self.lockstep
        self.zero3 = is_deepspeed(accelerator) and self.lockstep  # each process holds its partitions only
        params = [p for p in model.transformer.parameters() if p.requires_grad]
        self.wrapped = None  # DDP, FSDP2 or DeepSpeed over the processes; None with one process
        self.engine = None  # the DeepSpeed engine (flowrl.zero), which steps the optimizer
        self._null = None  # the empty prompt's embedding, for the zero-gradient pass of a process without rows
        self._backwards = self._needed = 0  # backwards made / to make in this optimizer step (ZeRO-2 pads to it)
        if is_deepspeed(accelerator):  # ZeRO partitions AdamW's state (and gradients) over the processes
            configure(
                accelerator.state.deepspeed_plugin.deepspeed_config, train.max_grad_norm, accelerator.num_processes
            )
            self.engine, self.optimizer = accelerator.prepare(model.transformer, build_optimizer(params, train))
            if self.engine.module is not model.transformer:
                raise RuntimeError("accelerate's DeepSpeed preparation wraps another module than the transformer")
            self.wrapped = model.wrapped = self.engine
        elif self.sharded:  # FSDP2 shards the transformer in place and points the optimizer at the shards
            transformer, self.optimizer = accelerator.prepare(model.transformer, build_optimizer(params, train))
            if transformer is not model.transformer:
                raise RuntimeError("accelerate's FSDP2 preparation returned another module than the transformer")
            self.wrapped = model.wrapped = transformer
        else:
            self.optimizer = accelerator.prepare(build_optimizer(params, train))
        # the optimizer's parameters (FSDP2: this process's shards), by name
        self.params = {n: p for n, p in model.transformer.named_parameters() if p.requires_grad}
        if self.full_shard:
            reshard_every_forward(model.transformer)
        elif self.sharded:
            keep_gathered(model.transformer)
        elif accelerator.num_processes > 1 and self.engine is None:
            self.wrapped = model.wrapped = accelerator.prepare_model(model.transformer, device_placement=False)
        self.ema = self.copy() if train.ema_decay > 0 else None

    def autocast(self, precision: str | None = None):
        """bf16 autocast for ``precision`` (default ``run.mixed_precision``; ``auto``, ``bf16`` or ``no``:
        ``auto`` resolved on the policy's device by
        :func:`flowrl.precision.resolve_precision`): ``no`` leaves the surrounding mode."""
        precision = precision or self.precision
        if precision == "auto":  # a Policy built outside the Trainer, which resolves its settings once
            precision = resolve_precision(precision, self.device, "run.mixed_precision")
        if precision == "no":
            return contextlib.nullcontext()
        return bf16_autocast(self.device.type)

    # ------------------------------------------------------------------------------ minibatches
    def minibatches(
        self, count: int, generator: torch.Generator, unit: int = 1
    ) -> Iterator[tuple[int, int, torch.Tensor, int]]:
        """The optimizer steps of ``train.inner_epochs`` passes over this process's `count` rows, each pass in a
        random order drawn from `generator`. With ``unit > 1`` the `count` items are units of `unit` rows each that
        stay together (CRD's groups): a minibatch holds ``max(1, train.minibatch_size // unit)`` of them, and the
        indices and ``total_rows`` count units.

        Yields:
            ``(epoch, j, mb, total_rows)``: the pass, the step within it, this process's row indices of the
            minibatch (`(<= train.minibatch_size,)` long; empty when only other processes have rows left) and
            the minibatch's size summed over all processes. Every process gets the same steps
            (:func:`minibatch_sizes`), so it must take each one, empty or not.
        """
        size, micro = max(1, self.cfg.minibatch_size // unit), self._micro(unit)
        counts = torch.tensor([count])
        if self.accelerator.num_processes > 1:
            counts = self.accelerator.gather(counts.to(self.device)).cpu()
        sizes = minibatch_sizes(counts, size)  # (processes, minibatches)
        for epoch in range(self.cfg.inner_epochs):
            order = torch.randperm(count, generator=generator).to(self.device)
            for j in range(sizes.shape[1]):
                # the most micro-batches any process makes in this step (at least the zero-gradient pass)
                self._needed = max(1, max(-(-int(n) // micro) for n in sizes[:, j])) if micro else 1
                self._backwards = 0
                yield epoch, j, order[j * size : (j + 1) * size], sizes[:, j].sum().item()

    def _micro(self, unit: int) -> int:
        """Items per micro-batch for items of `unit` rows (0: no micro-batches)."""
        micro = self.cfg.micro_batch_size
        return max(1, micro // unit) if micro else 0

    def micro_batches(self, mb: torch.Tensor, unit: int = 1) -> Iterator[tuple[int, torch.Tensor, float]]:
        """`mb` in chunks of ``train.micro_batch_size`` rows (one chunk when 0), for gradient accumulation: the
        consumer's forward and backward of every chunk but the last run under ``accelerator.no_sync`` (the
        gradients are summed over processes once per minibatch, in the last chunk's backward). With ``unit > 1``,
        `mb` indexes units of `unit` rows (:meth:`minibatches`): a chunk holds ``max(1, micro_batch_size // unit)``.

        Yields:
            ``(start, idx, frac)``: the chunk's offset in `mb`, its row indices and its fraction of `mb`.
        """
        micro = self._micro(unit) or len(mb)
        for start in range(0, len(mb), micro):
            idx = mb[start : start + micro]
            last = start + micro >= len(mb)
            # the engine accumulates until its step; in lockstep every backward reduce-scatters (padding follows)
            sync = self.wrapped is None or self.engine is not None or self.lockstep or last
            with contextlib.nullcontext() if sync else self.accelerator.no_sync(self.wrapped):
                yield start, idx, len(idx) / len(mb)

    def padding(self) -> Iterator[None]:
        """In lockstep (FSDP2 full shard, ZeRO-3: :func:`flowrl.sharding.lockstep`), one item per micro-batch this
        process still owes the current optimizer step: the consumer runs a micro-batch of zero-weight rows (its own
        forwards, so that every process calls the sharded module alike) and back-propagates it with
        :meth:`backward` at ``scale=0``, until this process made as many backwards as the process with the most
        micro-batches in the step (at least one). Yields nothing otherwise."""
        while self.lockstep and self._backwards < self._needed:
            before = self._backwards
            yield
            if self._backwards == before:
                raise RuntimeError("a padding micro-batch made no backward (Policy.padding needs one per item)")

    def calls_owed(self, calls: int) -> int:
        """In lockstep (:func:`flowrl.sharding.lockstep`), how many calls of the transformer this process owes beyond
        its own `calls` to make as many as the process that makes the most (a gather of the counts: every process
        calls it at the same point); 0 elsewhere. What a method's forwards without gradients over its own rows (an
        old, reference or EMA copy's velocity) pad with: :meth:`flowrl.methods.base.Method.chunked`'s ``pad``."""
        if not self.lockstep or self.accelerator.num_processes == 1:
            return 0
        counts = self.accelerator.gather(torch.tensor([calls], device=self.device))  # (processes,)
        return int(counts.max().item()) - calls

    # ----------------------------------------------------------------------------------- update
    def backward(self, loss: torch.Tensor, scale: float = 1.0) -> None:
        """Back-propagate ``loss * scale`` (``scale``: the micro-batch's share of the global minibatch). Under
        several processes DDP, FSDP2 and ZeRO average the gradients, so the loss is scaled by the process count too:
        the result is the sum of every process's share, the gradient of the mean over the global minibatch. Under
        DeepSpeed through the engine's ``backward`` (which accumulates until :meth:`step`)."""
        if self.wrapped is not None:
            scale = scale * self.accelerator.num_processes
        loss = loss * scale if scale != 1.0 else loss
        self._backwards += 1
        if self.engine is not None:
            self.engine.backward(loss)
        else:
            self.accelerator.backward(loss)

    def step(self, loss: float | None, stats: dict[str, list[float]]) -> None:
        """Clip the gradients (summed over processes by the wrapped model's backward) to ``train.max_grad_norm``,
        step AdamW, update the EMA; append ``policy/grad_norm`` (and ``policy/loss``) to `stats`. ``loss`` None: this
        process has no rows in this minibatch while others do; under several processes it then joins the
        gradient sum with a zero-gradient pass (:meth:`_zero_backward`). Under DeepSpeed the engine's ``step`` clips
        and steps; under ZeRO-2 a process first adds zero-gradient passes until it made as many backwards as the
        process with the most micro-batches in this step (each backward reduces, a collective call)."""
        params = list(self.params.values())
        if loss is None and self.wrapped is not None and not self.lockstep:  # in lockstep :meth:`padding` made it
            self._zero_backward()
        if self.engine is not None:
            if self.engine.zero_optimization_partition_gradients():  # ZeRO-2 reduces in every backward
                while self._backwards < self._needed:
                    self._zero_backward()
            self.engine.step()  # reduce (stage 1), clip at train.max_grad_norm, AdamW, zero the gradients
            grad_norm = torch.as_tensor(float(self.engine.get_global_grad_norm()))
        else:
            grad_norm = full(torch.nn.utils.clip_grad_norm_(params, self.cfg.max_grad_norm))
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        if self.sharded and not self.full_shard:  # the shards moved: gather the weights the forwards use
            regather(self.model.transformer)
        if self.ema is not None:
            self.move_towards(self.ema, self.cfg.ema_decay)
        stats["policy/grad_norm"].append(grad_norm.item())
        if loss is not None:
            stats["policy/loss"].append(loss)

    def _zero_backward(self) -> None:
        """One forward of a single empty-prompt sample through the wrapped model and the backward of 0 times it: a
        zero gradient that joins the other processes' gradient sum (DDP ties the sum to a backward)."""
        model = self.model
        if self._null is None:
            self._null = model.encode([""])
        x = torch.zeros(1, *model.latent_shape, device=self.device)
        v = model.velocity(x, torch.ones(1, device=self.device), self._null, None, 1.0)
        self.backward(v.sum() * 0.0)

    # ---------------------------------------------------------------------------- held weights
    def weights(self) -> dict[str, torch.Tensor]:
        """The trainable tensors, whole, by name, to save or read (not to write: the forwards may not see it):
        :attr:`params` itself, under FSDP2 the gathered weights (equal to the shards after every optimizer step), under
        DeepSpeed copies (its weights are views into one flat buffer, which safetensors refuses to save). No
        communication, except under FSDP2 full shard and ZeRO-3: whole tensors all-gathered from the shards or
        partitions (every process calls it)."""
        if self.full_shard or self.zero3:
            return self.whole(self._live())
        if self.engine is not None:
            return {n: p.detach().clone() for n, p in self._live().items()}
        return self._live()

    def whole(self, store: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor] | None:
        """``store`` (a held copy: :meth:`copy`) with whole tensors: under FSDP2 full shard and ZeRO-3, where held copies
        are shards or partitions, each all-gathered (:func:`flowrl.sharding.full`, :func:`flowrl.zero.whole_partition`;
        every process calls it, in the same order); else ``store`` itself. None for None."""
        if store is None or not (self.full_shard or self.zero3):
            return store
        if self.zero3:
            return {n: whole_partition(v.detach(), self.params[n]) for n, v in store.items()}
        return {n: full(v.detach()) for n, v in store.items()}

    def module_state(self) -> dict[str, torch.Tensor] | None:
        """The transformer's parameters and buffers, whole, on the CPU, for a plain copy of it
        (:meth:`flowrl.models.FlowModel.save_pipeline`'s ``state``), as the forwards now see them (a held copy
        included): under FSDP2 full shard and ZeRO-3 all-gathered (every process calls it); None otherwise (the
        pipeline export reads the module itself)."""
        module = self.model.transformer
        if self.zero3:
            with gathered(list(module.parameters())):
                return {n: t.detach().cpu().clone() for n, t in [*module.named_parameters(), *module.named_buffers()]}
        if not self.full_shard:
            return None
        return {n: full(t.detach()).cpu() for n, t in [*module.named_parameters(), *module.named_buffers()]}

    def _live(self) -> dict[str, torch.Tensor]:
        """The trainable tensors the forwards use, by name: whole, except under FSDP2 full shard, where they are the
        shards (``DTensor``) the forwards gather, and ZeRO-3, each parameter's 1-D partition ``ds_tensor`` (FSDP2
        keeping them gathered: the gathered weights, not the shards)."""
        if self.zero3:  # ZeRO-3: each parameter's partition (1-D, padded) that the forwards gather
            return {n: p.ds_tensor for n, p in self.params.items()}
        if not self.sharded or self.full_shard:
            return self.params
        return {n: p for n, p in self.model.transformer.named_parameters() if n in self.params}

    def exported(self) -> dict[str, torch.Tensor]:
        """The weights a LoRA export holds, whole: the EMA when there is one (``train.ema_decay > 0``), else
        :meth:`weights` (collective under FSDP2 full shard and ZeRO-3: every process calls it)."""
        return self.whole(self.ema) or self.weights()

    @property
    def plain_export(self) -> bool:
        """Whether a pipeline export needs a plain copy of the transformer (FSDP2's ``DTensor`` shards, DeepSpeed's
        flat-buffer views): :meth:`flowrl.models.FlowModel.save_pipeline`'s ``plain_copy``."""
        return self.sharded or self.engine is not None

    @torch.no_grad()
    def reset_optimizer(self) -> None:
        """Start AdamW afresh (moments zero, no steps taken), the learning rate and betas kept: after a cold start that
        trained the weights with this optimizer (Flow-OPD's SFT). Under DeepSpeed the partitions' state tensors are
        zeroed in place (its checkpoint helpers hold views of them); elsewhere the state is dropped, and AdamW
        creates it again, zero, at its next step."""
        if self.engine is None:
            self.optimizer.state.clear()
            return
        for state in self.engine.optimizer.optimizer.state.values():
            for value in state.values():
                if torch.is_tensor(value):
                    value.zero_()

    @torch.no_grad()
    def steps_taken(self) -> int:
        """Optimizer steps taken so far, as AdamW counts them (restored with its state on resume)."""
        state = next(iter(self.optimizer.state.values()), {})
        return int(state.get("step", 0))

    def move_towards(self, store: dict[str, torch.Tensor], decay: float) -> None:
        """``store <- decay store + (1 - decay) theta`` for every trainable tensor (the EMA, DiffusionNFT's old policy):
        :func:`move_towards` of the tensors the forwards use."""
        move_towards(store, self._live(), decay)

    def copy(self) -> dict[str, torch.Tensor]:
        """A detached copy of the trainable tensors, by name: whole, or under FSDP2 full shard and ZeRO-3 this process's
        shards or partitions (:meth:`whole` gathers them)."""
        return {n: p.detach().clone() for n, p in self._live().items()}

    def whole_shapes(self) -> dict[str, torch.Size]:
        """Each trainable tensor's whole shape, by name (under ZeRO-3 the parameters hold 1-D partitions: their
        ``ds_shape``; a ``DTensor``'s ``shape`` is the whole one already). No communication."""
        return {n: torch.Size(p.ds_shape if self.zero3 else p.shape) for n, p in self.params.items()}

    def part_of(self, name: str, value: torch.Tensor) -> torch.Tensor:
        """This process's part of `value`, the whole tensor of the trainable tensor `name`, as a held copy
        (:meth:`copy`) keeps it: under FSDP2 full shard its shard (:func:`flowrl.sharding.shard_like`), under ZeRO-3 its
        partition (:func:`flowrl.zero.partition_of`), else `value` itself. No communication: what reads a held copy
        back from a checkpoint (:meth:`flowrl.methods.base.Method.load_files`) writes it."""
        if self.zero3:
            return partition_of(value, self.params[name])
        return shard_like(value, self._live()[name])

    def assign(self, weights: dict[str, torch.Tensor]) -> None:
        """Set the trainable weights to `weights` (whole tensors by name, every process holding them; a distilled
        student or a cold start): under FSDP2 each process writes its shards, and where the weights stay gathered
        gathers them again (collective: every process calls it); under DeepSpeed the weights (ZeRO-3: this process's
        partitions) and the optimizer's float32 master partition (``deepspeed.utils.safe_set_full_fp32_param``, as a
        resume writes it: no communication); held copies and the EMA stay as they are."""
        if self.engine is not None:
            from deepspeed.utils import safe_set_full_fp32_param

            live = self._live()  # ZeRO-3: the partitions
            with torch.no_grad():
                for n, p in self.params.items():
                    if n in weights:
                        w = weights[n].detach().to(p.device)
                        live[n].copy_(self.part_of(n, w))
                        safe_set_full_fp32_param(p, w.float())
            return
        with torch.no_grad():
            for n, p in self.params.items():
                if n in weights:  # under FSDP2 this process's shards
                    p.copy_(shard_like(weights[n].to(p.dtype), p))
        if self.sharded and not self.full_shard:  # FSDP2 keeping the weights gathered: gather them again
            regather(self.model.transformer)

    @contextlib.contextmanager
    def holding(self, weights: dict[str, torch.Tensor] | None):
        """Context in which the forwards use ``weights`` (same names, as :meth:`copy` makes them; no-op for None). Under
        FSDP2 keeping the weights gathered only the gathered weights change, not the shards; under FSDP2 full shard
        and ZeRO-3 the shards or partitions change, each process its own. No communication."""
        if weights is None:
            yield
            return
        backup = self.copy()
        with torch.no_grad():
            for n, p in self._live().items():
                p.copy_(weights[n])
        try:
            yield
        finally:
            with torch.no_grad():
                for n, p in self._live().items():
                    p.copy_(backup[n])

    def ema_weights(self):
        """Context in which the trainable parameters hold their EMA (no-op without EMA)."""
        return self.holding(self.ema)

    # ----------------------------------------------------------------------------- checkpoints
    def save(self, directory: Path, iteration: int, extra: dict, write_extra_files) -> Path | None:
        """Checkpoint the trainable weights (whole), the optimizer state (whole: gathered from the shards under FSDP2,
        from the ZeRO partitions under DeepSpeed, in torch AdamW's layout either way) and the EMA with
        :func:`flowrl.checkpoint.save_checkpoint`, written by the main process. Every process calls it (the gathering
        is collective); returns the folder on the main process, None on the others."""
        main = self.accelerator.is_main_process  # the other processes drop each gathered tensor at once
        whole = self.full_shard or self.zero3
        weights, ema = (self.weights(), self.whole(self.ema)) if whole else (None, self.ema)  # collective
        if self.engine is not None:
            optimizer = zero_optimizer_state(self.engine, list(self.params.values()), keep=main)
        elif self.sharded:
            optimizer = full_optimizer_state(self.optimizer.state_dict(), keep=main)
        else:
            optimizer = self.optimizer
        if not main:
            return None
        return save_checkpoint(
            directory,
            iteration,
            self.weights() if weights is None else weights,
            optimizer,
            ema,
            extra=extra,
            write_extra_files=write_extra_files,
        )

    def load(self, path: Path) -> dict:
        """Restore a checkpoint of :meth:`save` (:func:`flowrl.checkpoint.load_checkpoint`) on every process, then the
        config's optimizer settings (:meth:`apply_optimizer_config`); under FSDP2 each process keeps its shard of the
        whole tensors it read, under DeepSpeed its partition of the master weights and moments. Returns the
        checkpoint's JSON state.

        Raises:
            CheckpointError: as :func:`flowrl.checkpoint.load_checkpoint`.
        """
        live, ema = self._live(), self.ema
        if self.full_shard or self.zero3:  # read whole tensors, then keep this process's shards
            shapes = {n: tuple(p.ds_shape if self.zero3 else p.shape) for n, p in self.params.items()}
            live = {n: torch.empty(shapes[n], dtype=p.dtype) for n, p in self.params.items()}
            ema = None if ema is None else {n: torch.empty(shapes[n], dtype=v.dtype) for n, v in ema.items()}
        if self.engine is not None:  # after the weights: the master copies them
            loader = ZeroLoader(self.engine, list(self.params.values()), list(live.values()) if self.zero3 else None)
        else:
            loader = _ShardingLoader(self) if self.sharded else self.optimizer
        state = load_checkpoint(path, live, loader, ema)
        if self.zero3:
            with torch.no_grad():
                for n, p in self.params.items():
                    p.ds_tensor.copy_(partition_of(live[n], p))
                    if ema is not None:
                        self.ema[n].copy_(partition_of(ema[n], p))
        if self.sharded:
            with torch.no_grad():
                for n, w in live.items():
                    self.params[n].copy_(shard_like(w.detach(), self.params[n]))
                if self.full_shard and ema is not None:
                    for n, w in ema.items():
                        self.ema[n].copy_(shard_like(w, self.ema[n]))
        self.apply_optimizer_config(path)
        return state

    def apply_optimizer_config(self, path: Path) -> None:
        """Set AdamW's learning rate, betas and weight decay to the config's after a resume (a restored optimizer
        state carries the checkpoint's), warning which of them the resumed config changes."""
        t = self.cfg
        wanted = {"lr": t.learning_rate, "betas": tuple(t.adam_betas), "weight_decay": t.weight_decay}
        changed = set()
        for group in self.optimizer.param_groups:
            for key, value in wanted.items():
                if (tuple(group[key]) if key == "betas" else group[key]) != value:
                    changed.add(key)
                    group[key] = value
        if changed and self.accelerator.is_main_process:
            warnings.warn(
                f"resuming from {path} with the config's {', '.join(sorted(changed))} "
                f"(learning rate {t.learning_rate}, betas {tuple(t.adam_betas)}, weight decay {t.weight_decay}), "
                "not the checkpoint's",
                UserWarning,
                stacklevel=4,
            )

    def checkpoint_mib(self, extra_copies: int = 0) -> float:
        """MiB of one checkpoint: the weights, AdamW's two moments (a byte each under ``adamw_8bit``, float32 weights),
        the EMA and `extra_copies` more copies."""
        copies = 1 + (0.5 if self.cfg.optimizer == "adamw_8bit" else 2) + (self.ema is not None) + extra_copies
        numel = {n: getattr(t, "ds_numel", t.numel()) for n, t in self.params.items()}  # ZeRO-3: whole counts
        return copies * sum(numel[n] * t.element_size() for n, t in self.params.items()) / 2**20


class _ShardingLoader:
    """Loads a whole-tensor optimizer ``state_dict`` into the FSDP2 policy's optimizer, each state tensor sharded like
    its parameter (:func:`flowrl.sharding.shard_optimizer_state`)."""

    def __init__(self, policy: Policy):
        self.policy = policy

    def load_state_dict(self, state: dict) -> None:
        params = list(self.policy.params.values())
        self.policy.optimizer.load_state_dict(shard_optimizer_state(state, params))
