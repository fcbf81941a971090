"""The run folder's checkpoints and exports: what the loop saves every ``run.save_every`` iterations (pruned to
``run.keep_checkpoints``), what a resumed run restores (with its checks), the evaluation files, and the artifacts of
a finished run (reward curve, diagnostics plot, before/after grid, the LoRA or the whole pipeline).

The files themselves are :mod:`flowrl.checkpoint`'s (verified checkpoints) and :mod:`flowrl.plots`'s; which folder a
run may write and which checkpoint it resumes is :class:`flowrl.run.RunFolder`'s.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch

from .checkpoint import checkpoint_iteration, prune_checkpoints
from .config import ConfigError
from .files import atomic_output, write_text_atomic
from .plots import save_diagnostics, save_grid, save_reward_curve

__all__ = ["Checkpointer"]


class Checkpointer:
    """Saves and restores the run's training state and writes its outputs into the run folder.

    Args:
        cfg (:class:`flowrl.config.Config`): the run (``run.iterations``, ``run.save_every``,
            ``run.keep_checkpoints``, ``model.lora_rank``).
        run (:class:`flowrl.run.RunFolder`): the run folder (its ``path`` and ``accelerator``).
        model (:class:`flowrl.models.FlowModel`): the adapter (its LoRA or pipeline is exported).
        policy (:class:`flowrl.policy.Policy`): the trained weights, optimizer and EMA.
        method (:class:`flowrl.methods.Method`): its ``state_dict`` and files are checkpointed with the policy.

    Warns:
        UserWarning: full fine-tuning (``model.lora_rank=0``) with ``run.keep_checkpoints`` unset, with the count and
            size of the checkpoints it will keep.
    """

    def __init__(self, cfg, run, model, policy, method):
        self.cfg, self.run, self.model, self.policy, self.method = cfg, run, model, policy, method
        self.out: Path = run.path
        if cfg.model.lora_rank == 0 and cfg.run.keep_checkpoints is None:
            count = -(-cfg.run.iterations // cfg.run.save_every)
            mib = policy.checkpoint_mib(method.sampling_weights() is not None)
            warnings.warn(
                f"full fine-tuning (model.lora_rank=0) with run.keep_checkpoints unset keeps all {count} "
                f"checkpoints of about {mib:.0f} MiB each; set run.keep_checkpoints to keep only the newest",
                UserWarning,
                stacklevel=3,
            )

    def save(self, iteration: int, elapsed: float) -> None:
        """Checkpoint ``iteration`` into ``checkpoints/checkpoint-<iteration>``: the policy, its optimizer and EMA, the
        method's state and files, the LoRA; then delete the oldest beyond ``run.keep_checkpoints``. Every process
        calls it (under FSDP2 the optimizer state is gathered from the shards, under FSDP2 full shard the weights and
        held copies too); the main process writes.

        Args:
            iteration (`int`): iterations completed. elapsed (`float`): the run's wall seconds so far (a resumed
                run's clock continues from it).

        Raises:
            OSError: the folder cannot be written (a full disk among them).
        """

        lora, held = None, None
        if self.policy.lockstep:  # the held shards made whole by every process, before the main process writes
            lora = self.policy.exported() if self.cfg.model.lora_rank > 0 else None
            held = {name: self.policy.whole(store) for name, store in self.method.snapshots().items()}

        def write_extra(folder: Path) -> None:  # inside the checkpoint before it is sealed
            if self.cfg.model.lora_rank > 0:
                self.model.save_lora(folder / "lora", self.policy.exported() if lora is None else lora)
            if held is None:  # a method's own save_files(folder) (an override may take the folder alone)
                self.method.save_files(folder)
            else:
                self.method.save_files(folder, held)

        saved = self.policy.save(
            self.out / "checkpoints", iteration, {"elapsed_s": elapsed, **self.method.state_dict()}, write_extra
        )
        if saved is not None and self.cfg.run.keep_checkpoints:
            prune_checkpoints(self.out / "checkpoints", self.cfg.run.keep_checkpoints, just_saved=saved)

    def resume(self) -> tuple[int, float]:
        """Restore the newest verified checkpoint when ``run.resume``
        (:meth:`flowrl.run.RunFolder.checkpoint_to_resume`) into the policy and the method; only once it is restored
        is ``metrics.jsonl`` cut back to its iteration. Every process calls it.

        Returns:
            ``(iteration, elapsed_s)`` of the restored checkpoint; ``(0, 0.0)`` to start from the beginning.

        Raises:
            ConfigError: naming ``run.iterations``, when it is below the checkpoint's iteration (nothing is loaded).
            CheckpointError: as :meth:`flowrl.run.RunFolder.checkpoint_to_resume`, or a checkpoint that does not fit
                the model.
        """
        path = self.run.checkpoint_to_resume()
        if path is None:
            return 0, 0.0
        done = checkpoint_iteration(path)
        if done > self.cfg.run.iterations:  # before anything is loaded or rewritten
            raise ConfigError(
                f"config key 'run.iterations': {self.cfg.run.iterations} is below the iteration of the checkpoint "
                f"run.resume continues ({path}: {done}); set run.iterations >= {done}"
            )
        state = self.policy.load(path)
        self.method.load_state_dict(state["extra"])
        self.method.load_files(path)
        self.run.resumed(state["iteration"])
        return state["iteration"], state["extra"].get("elapsed_s", 0.0)

    def write_eval(self, name: str, result: dict) -> None:
        """Write an evaluation's result as indented JSON to the run folder's file `name` (``eval_before.json``,
        ``eval.json``), atomically. The main process calls it."""
        write_text_atomic(self.out / name, json.dumps(result, indent=1))

    def read_eval(self, name: str) -> dict:
        """The evaluation result in the run folder's file `name` (a resumed run's ``eval_before.json``, checked
        readable by :meth:`flowrl.run.RunFolder.checkpoint_to_resume`).

        Raises:
            OSError / ValueError: a missing or unreadable file."""
        return json.loads((self.out / name).read_text())

    def write_grid_before(self, images: torch.Tensor) -> None:
        """Keep the base model's grid images `(12, 3, H, W)` (``grid_before.safetensors``) for the grid drawn at the
        end. The main process calls it."""
        from safetensors.torch import save_file

        with atomic_output(self.out / "grid_before.safetensors") as tmp:
            save_file({"images": images.contiguous()}, tmp)

    def export(self, evaluator, trackers, rewards) -> None:
        """The finished run's artifacts (main process; the others return at once, or in lockstep draw the grid and
        gather the exported weights with it first): ``reward_curve.png``,
        ``diagnostics.png`` (the `rewards` of weight 0 drawn as gold metrics), ``grid.png`` (the base
        model's grid beside `evaluator`'s :meth:`~flowrl.evaluator.Evaluator.grid_images` now, also logged to
        `trackers` as ``grid/after``), and the LoRA (``lora/``) or, fully fine-tuned, the whole pipeline
        (``pipeline/``, with the EMA weights where there are some).

        Raises:
            OSError: a file that cannot be read or written (``metrics.jsonl``, ``eval.json`` and
                ``grid_before.safetensors`` are read).
        """
        main, lockstep = self.run.accelerator.is_main_process, self.policy.lockstep
        if not (main or lockstep):
            return
        after = evaluator.shared_grid()
        lora = state = None
        if lockstep:  # whole weights gathered by every process
            if self.cfg.model.lora_rank > 0:
                lora = self.policy.exported()
            else:
                with self.policy.ema_weights():
                    state = self.policy.module_state()
        if not main:
            return
        from safetensors.torch import load_file

        metrics = [json.loads(line) for line in (self.out / "metrics.jsonl").read_text().splitlines()]
        save_reward_curve(metrics, self.read_eval("eval.json"), self.out / "reward_curve.png")
        watched = [name for name, (_, weight) in rewards.rewards.items() if weight == 0]  # gold metrics
        save_diagnostics(metrics, self.out / "diagnostics.png", watched)
        before = load_file(self.out / "grid_before.safetensors")["images"]
        trackers.log_images("grid/after", after, self.cfg.run.iterations)
        save_grid(before, after, [m["prompt"] for m in evaluator.grid_metas()], self.out / "grid.png")
        if self.cfg.model.lora_rank > 0:
            self.model.save_lora(self.out / "lora", self.policy.exported() if lora is None else lora)
        else:
            with self.policy.ema_weights():
                kwargs = {} if state is None else {"state": state}  # whole tensors gathered above
                self.model.save_pipeline(self.out / "pipeline", plain_copy=self.policy.plain_export, **kwargs)
