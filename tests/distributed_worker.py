"""Worker of tests/test_distributed.py, launched by torchrun: ``python distributed_worker.py CONFIG OUT [key=value ...]``,
or ``python distributed_worker.py --runs RUNS.json`` for several runs one after another in one launch.

Trains with the given config, then writes this process's trainable parameters, the method's held copies and the
evaluation results to ``OUT/rank{r}.safetensors``, ``OUT/held{r}.safetensors`` and ``OUT/rank{r}.json``. With
``FLOWRL_TEST_FSDP2=1`` accelerate's FSDP2 path runs on the CPU (:func:`force_cpu_fsdp2`; ``full_shard``: with
``configs/accelerate/fsdp2_full_shard.yaml``), with ``FLOWRL_TEST_ZERO``
DeepSpeed ZeRO (:func:`force_cpu_deepspeed`).
"""

import json
import os
import resource
import sys

import torch
from safetensors.torch import save_file

from flowrl.sharding import fsdp_units, full


def force_cpu_fsdp2(config: str = "fsdp2.yaml") -> None:
    """Make every ``accelerate.Accelerator`` built from now on shard with FSDP2 on the CPU processes.

    accelerate 1.15 turns an FSDP launch into FSDP only on accelerator devices (``MULTI_GPU`` and kin); on CPU processes
    it stays ``MULTI_CPU`` (DDP). PyTorch's ``fully_shard`` itself runs on gloo, so after accelerate has set the
    processes up, its shared state is switched to FSDP with the plugin that ``accelerate launch --config_file
    configs/accelerate/CONFIG`` gives (the launcher's environment, :func:`fsdp2_launch_env`): from there on
    ``Accelerator.prepare``, ``no_sync`` and ``backward`` take their FSDP2 paths, as on GPUs.
    """
    import accelerate
    from accelerate import FullyShardedDataParallelPlugin
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    class CPUFSDP2Accelerator(accelerate.Accelerator):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            os.environ.update(fsdp2_launch_env(config))
            if os.environ.get("FLOWRL_TEST_FSDP_WRAP"):  # another fsdp_auto_wrap_policy than the shipped file's
                os.environ["FSDP_AUTO_WRAP_POLICY"] = os.environ["FLOWRL_TEST_FSDP_WRAP"]
            plugin = FullyShardedDataParallelPlugin()  # read from the launcher's FSDP_* variables
            for state in (PartialState(), AcceleratorState()):  # AcceleratorState() re-reads PartialState's fields
                state.distributed_type = DistributedType.FSDP
            AcceleratorState().fsdp_plugin = plugin

    accelerate.Accelerator = CPUFSDP2Accelerator


def force_cpu_deepspeed(stage: int, offload_optimizer: str = "none", offload_param: str = "none") -> None:
    """Make every ``accelerate.Accelerator`` built from now on run DeepSpeed ZeRO ``stage`` on the CPU processes.

    accelerate 1.15 counts one process per DeepSpeed launch on a machine without an accelerator (its backend stays
    unset, so ``num_processes`` is 1 while DeepSpeed's own group has every process). DeepSpeed itself runs on the CPU
    (its CPU accelerator, gloo). So the processes are set up as accelerate's ``MULTI_CPU`` (gloo), then its shared state
    is switched to DeepSpeed with the plugin that ``accelerate launch --config_file configs/accelerate/deepspeed_zero2.yaml``
    (``deepspeed_zero3.yaml`` for stage 3) gives (the launcher's environment, :func:`deepspeed_launch_env`, with the ZeRO
    stage and the optimizer's and weights' offload devices replaced): from there on ``Accelerator.prepare`` builds a DeepSpeed engine, as on GPUs.
    """
    import accelerate
    from accelerate import DeepSpeedPlugin
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    class CPUDeepSpeedAccelerator(accelerate.Accelerator):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            os.environ.update(deepspeed_launch_env("deepspeed_zero3.yaml" if stage == 3 else "deepspeed_zero2.yaml"))
            os.environ["ACCELERATE_DEEPSPEED_ZERO_STAGE"] = str(stage)
            os.environ["ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE"] = offload_optimizer
            os.environ["ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE"] = offload_param
            plugin = DeepSpeedPlugin()  # read from the launcher's ACCELERATE_DEEPSPEED_* variables
            for state in (PartialState(), AcceleratorState()):
                state.distributed_type = DistributedType.DEEPSPEED
            AcceleratorState().deepspeed_plugins = plugin
            plugin.select(_from_accelerator_state=True)
            self.deepspeed_engine_wrapped = None  # what Accelerator.__init__ sets under DeepSpeed

    accelerate.Accelerator = CPUDeepSpeedAccelerator


def _launch_args(name: str):
    """``accelerate launch --config_file configs/accelerate/NAME`` parsed and validated as accelerate's launcher does
    it: ``(args, the config file's defaults)``."""
    from pathlib import Path

    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    config = Path(__file__).parent.parent / "configs/accelerate" / name
    args, defaults, _ = _validate_launch_command(
        launch_command_parser().parse_args(["--config_file", str(config), "train.py"])
    )
    return args, defaults


def deepspeed_launch_env(config: str = "deepspeed_zero2.yaml") -> dict[str, str]:
    """The ``ACCELERATE_*`` DeepSpeed environment ``accelerate launch --config_file configs/accelerate/CONFIG`` gives
    its processes."""
    from accelerate.utils.launch import prepare_deepspeed_cmd_env

    args, defaults = _launch_args(config)
    args.deepspeed_fields_from_accelerate_config = ",".join(defaults.deepspeed_config)  # as launch_command sets it
    _, env = prepare_deepspeed_cmd_env(args)
    return {k: v for k, v in env.items() if "DEEPSPEED" in k or k == "ACCELERATE_GRADIENT_ACCUMULATION_STEPS"}


def fsdp2_launch_env(config: str = "fsdp2.yaml") -> dict[str, str]:
    """The ``FSDP_*`` environment ``accelerate launch --config_file configs/accelerate/CONFIG`` gives its processes."""
    from accelerate.utils.launch import prepare_multi_gpu_env

    args, _ = _launch_args(config)
    return {k: v for k, v in prepare_multi_gpu_env(args).items() if "FSDP" in k}


def rank_reward(images, prompts, metadata):
    """Brightness on process 0, a constant on the others: their groups have no reward variance, so they
    keep no transitions and must still take every optimizer step."""
    if int(os.environ.get("RANK", "0")) == 0:
        return images.float().mean(dim=(1, 2, 3))
    return torch.zeros(len(prompts))


def _split_steps(trainer, rows: int, train) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The all-reduced gradient of one optimizer step over the same `rows` rows of one rollout, split two ways. Split:
    process 0 trains every third row, process 1 the rest. Whole: process 0 trains all of them, process 1 none. Both
    must give the gradient of the mean over all rows. ``train(keep)`` runs the method's update on this process's rows
    ``keep`` (bool ``(rows,)``); the optimizer step is replaced by a recorder, so the weights do not move."""
    rank = trainer.accelerator.process_index
    every_third = torch.arange(rows) % 3 == 0
    grads = []
    step = trainer.policy.optimizer.step
    trainer.policy.optimizer.step = lambda *a, **k: grads.append(
        [full(p.grad).clone() for p in trainer.policy.params.values()]
    )
    size = trainer.cfg.train.minibatch_size
    trainer.cfg.train.minibatch_size = rows  # one optimizer step
    try:
        for keep in (every_third if rank == 0 else ~every_third, torch.full((rows,), rank == 0)):
            train(keep)
    finally:
        trainer.policy.optimizer.step = step
        trainer.cfg.train.minibatch_size = size
    assert len(grads) == 2, len(grads)
    return grads[0], grads[1]


def split_gradient(trainer) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """:func:`_split_steps` for the GRPO update: both processes draw the same rollout (same prompts, same generator,
    same weights) and train its stored transitions with fixed advantages."""
    samples = trainer.method.rollout(trainer.train_metas[:2], torch.Generator().manual_seed(7))
    ro, table = samples.rollout, samples.table
    adv = torch.linspace(-1.0, 1.0, len(ro))
    return _split_steps(
        trainer,
        len(ro),
        lambda keep: trainer.method.optimize(
            ro, adv, keep & ro.trained.cpu(), table, torch.Generator().manual_seed(0)
        ),
    )


def split_direct_gradient(trainer) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """:func:`_split_steps` for a direct-reward method (ReFL, DRaFT, AlignProp): both processes draw the same rollout
    and train the reward gradient of its images."""
    import dataclasses

    samples = trainer.method.rollout(trainer.train_metas[:2], torch.Generator().manual_seed(7))

    def train(keep: torch.Tensor) -> None:
        rows = keep.nonzero().squeeze(1)
        part = dataclasses.replace(
            samples,
            start=samples.start[rows],
            cond=samples.cond[rows],
            prompts=[samples.prompts[i] for i in rows.tolist()],
            metadata=[samples.metadata[i] for i in rows.tolist()],
            final=samples.final[rows],
        )
        trainer.method.update(part, None, None, torch.Generator().manual_seed(0))

    return _split_steps(trainer, len(samples.cond), train)


def train_one(config: str, out: str, overrides: list[str]):
    """Train ``config`` with ``overrides`` and write this process's results into ``out``: the trainable parameters
    (``rank{r}.safetensors``), the method's held copies (``held{r}.safetensors``, keys ``FILE/NAME``), the split
    gradients (``grads{r}.safetensors``) and the evaluation and engine facts (``rank{r}.json``). Returns the
    trainer's accelerator."""
    from flowrl.config import load_config
    from flowrl.evaluation import sharded
    from flowrl.methods import GRPO
    from flowrl.methods.direct import DRaFT, ReFL
    from flowrl.trainer import Trainer

    trainer = Trainer(load_config(config, overrides))
    rank = trainer.accelerator.process_index
    split_grads, whole_grads = [], []
    if not trainer.policy.engine and not os.environ.get("FLOWRL_TEST_NO_SPLIT"):  # at the initial weights
        if isinstance(trainer.method, GRPO):  # the GRPO update on stored transitions
            split_grads, whole_grads = split_gradient(trainer)
        elif isinstance(trainer.method, (ReFL, DRaFT)) and not trainer.policy.sharded:
            # under DDP, the direct update on one rollout's images (uneven micro-batch counts across processes are a
            # collective mismatch under FSDP2; its training runs even ones)
            split_grads, whole_grads = split_direct_gradient(trainer)
    optimize, peaks = getattr(trainer.method, "optimize", None), []  # GRPO's and DiffusionNFT's update

    def measured(*args, **kwargs):  # the peak resident memory up to the end of each policy update
        out = optimize(*args, **kwargs)
        peaks.append(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
        return out

    if optimize is not None:
        trainer.method.optimize = measured
    result = trainer.train()
    save_file(
        {n: p.detach().contiguous() for n, p in trainer.policy.weights().items()}, f"{out}/rank{rank}.safetensors"
    )
    held = {f"{file}/{n}": v.detach().cpu().contiguous()
            for file, store in trainer.method.snapshots().items()
            for n, v in trainer.policy.whole(store).items()}  # fmt: skip  # sharded copies: gathered by every process
    save_file(held, f"{out}/held{rank}.safetensors")
    save_file(
        {
            **{f"split.{i}": g for i, g in enumerate(split_grads)},
            **{f"whole.{i}": g for i, g in enumerate(whole_grads)},
        },
        f"{out}/grads{rank}.safetensors",
    )
    engine = trainer.policy.engine  # a DeepSpeed engine, or None
    calls = []  # items 0..6 over 2 processes: 4 and 3 items, gathered back in item order
    order = sharded(
        lambda idx: calls.append(idx) or torch.tensor(idx, dtype=torch.float32)[:, None] * 10, 7, trainer.accelerator
    )
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump(
            {
                "before": result["before"],
                "after": result["after"],
                "sharded": order.squeeze(1).tolist(),
                "sharded_calls": calls,
                "num_processes": trainer.accelerator.num_processes,
                "wrapped": type(trainer.policy.wrapped).__name__,
                "optimizer_offload": bool(engine is not None and engine.zero_cpu_offload()),
                "weights_offload": bool(
                    engine is not None and getattr(engine.zero_offload_param(), "device", "none") == "cpu"
                ),
                "fsdp_units": len(fsdp_units(trainer.model.transformer)) if trainer.policy.sharded else 0,
                "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                "peak_rss_after_update_mib": peaks,
            },
            f,
        )
    trainer.accelerator.wait_for_everyone()
    return trainer.accelerator


def main() -> None:
    """``CONFIG OUT [key=value ...]``: one run; ``--runs RUNS.json``: the runs of a JSON list of ``{"config", "out",
    "overrides"}`` one after another in the same processes (one launch for several presets)."""
    if os.environ.get("FLOWRL_TEST_FSDP2") == "1":
        force_cpu_fsdp2()
    elif os.environ.get("FLOWRL_TEST_FSDP2") == "full_shard":
        force_cpu_fsdp2("fsdp2_full_shard.yaml")
    if os.environ.get("FLOWRL_TEST_ZERO"):  # "stage", "stage:optimizer offload device[:weights offload device]"
        stage, *offload = os.environ["FLOWRL_TEST_ZERO"].split(":")
        force_cpu_deepspeed(int(stage), *offload)
    if sys.argv[1] == "--runs":
        with open(sys.argv[2]) as f:
            runs = json.load(f)
    else:
        config, out, *overrides = sys.argv[1:]
        runs = [{"config": config, "out": out, "overrides": overrides}]
    for run in runs:
        accelerator = train_one(**run)
    accelerator.end_training()  # tear the process group down together, as flowrl train does


if __name__ == "__main__":
    main()
