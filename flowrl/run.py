"""A training run's folder: one writer at a time, what counts as an existing run, which checkpoint a resumed run
takes, and the metrics log. The trainer asks; this decides and says why (``docs/reliability.md``).
"""

from __future__ import annotations

import json
import sys
import warnings
from contextlib import contextmanager
from pathlib import Path

from .checkpoint import CheckpointError, choose_checkpoint, truncate_metrics
from .files import RunLock, check_folder_writable, check_not_in_use

RUN_FILES = (
    "config.yaml",
    "eval_before.json",
    "grid_before.safetensors",
    "metrics.jsonl",
    "checkpoints",
    "eval.json",
    "lora",
    "pipeline",
    "grid.png",
    "reward_curve.png",
    "diagnostics.png",
)
"""What a run writes into its folder (its outputs too: a finished run's LoRA, exported pipeline and plots); any of
them present means the folder holds a run."""


class RunFolder:
    """The folder ``run.output_dir`` of one training run, used from every process of it (the main process
    decides; the others get its verdict).

    Args:
        path (`Path`): the folder (created when :meth:`hold` takes it).
        accelerator (`accelerate.Accelerator`): the run's processes.
        resume (`bool`): ``run.resume``: continue the run the folder holds.

    Raises (at construction, before any expensive work):
        RunFolderInUse: another process holds the folder's lock.
        FileExistsError: the folder holds a run and `resume` is off.
        OutputError: the folder cannot be written.
    """

    def __init__(self, path: Path, accelerator, resume: bool):
        self.path, self.accelerator, self.resume = Path(path), accelerator, resume
        self.lock = RunLock(self.path)
        # probed by the main process alone: two processes probing the lock at once would each find it taken
        self.on_main(lambda: check_not_in_use(self.path))  # nothing is created yet: hold() takes the lock
        self.refuse_existing()
        for folder in ("checkpoints", "lora", "pipeline"):  # before any work, not at the first save
            if (self.path / folder).exists() and not (self.path / folder).is_dir():
                raise NotADirectoryError(
                    f"run folder {self.path}: '{folder}' is a file where flowrl writes a folder; move it away or "
                    "choose another run.output_dir"
                )
        check_folder_writable(self.path, "config key 'run.output_dir'")

    def files(self) -> list[str]:
        """The :data:`RUN_FILES` present in the folder (an empty ``checkpoints/``, ``lora/`` or ``pipeline/`` does not
        count)."""
        present = [name for name in RUN_FILES if (self.path / name).exists()]
        for folder in ("checkpoints", "lora", "pipeline"):
            if folder in present and (self.path / folder).is_dir() and not any((self.path / folder).iterdir()):
                present.remove(folder)
        return present

    def refuse_existing(self) -> None:
        """Raise FileExistsError if the folder already holds a run (any of :data:`RUN_FILES`) and resume is off."""
        if not self.resume and (found := self.files()):
            raise FileExistsError(
                f"run folder {self.path} already holds a run ({found[0]}): pass run.resume=true to "
                "continue it, or choose another run.output_dir"
            )

    @contextmanager
    def hold(self):
        """Hold the folder's lock (main process) from before anything is written until the block ends; the
        existing-run check is repeated under it. Every process gets the main process's verdict.

        Raises:
            RunFolderInUse, FileExistsError: as the constructor, if the folder changed since.
        """

        def take() -> None:
            self.lock.acquire()
            self.refuse_existing()  # again, under the lock: the folder may have filled since the constructor

        try:
            self.on_main(take)
            self.path.mkdir(parents=True, exist_ok=True)
            yield
        finally:
            self.lock.release()

    def on_main(self, fn):
        """``fn()`` on the main process only; every process returns its result or raises its exception (sent
        from the main process under several processes)."""
        acc, result, error = self.accelerator, None, None
        if acc.is_main_process:
            try:
                result = fn()
            except Exception as e:  # re-raised below, on every process
                error = e
        if acc.num_processes > 1:
            from accelerate.utils import broadcast_object_list

            result, error = broadcast_object_list([result, error], from_process=0)
        if error is not None:
            raise error
        return result

    def checkpoint_to_resume(self) -> Path | None:
        """With ``run.resume``, the newest verified checkpoint (:func:`flowrl.checkpoint.choose_checkpoint`), said in one
        line with the reason for each newer one skipped; None to start over (resume off, or a folder that holds
        nothing a restart would lose, with a warning). Decided on the main process, returned on every one.

        Raises:
            CheckpointError: naming the folder, when it holds checkpoints or metrics rows but no verified
                checkpoint, or a checkpoint but no readable ``eval_before.json``; nothing is deleted.
        """
        return self.on_main(self._choose) if self.resume else None

    def _choose(self) -> Path | None:
        path, skipped = choose_checkpoint(self.path / "checkpoints")
        why = "; ".join(reason for _, reason in skipped)
        metrics_file = self.path / "metrics.jsonl"
        if path is None:
            if skipped or (metrics_file.exists() and metrics_file.read_text().strip()):
                raise CheckpointError(
                    f"run.resume=true but run folder {self.path} holds no verified checkpoint "
                    f"({why or 'metrics.jsonl has rows, checkpoints/ has none'}); nothing was "
                    "deleted: move the folder aside to start over, or choose another run.output_dir"
                )
            warnings.warn(
                f"run.resume=true but {self.path / 'checkpoints'} holds no complete checkpoint: "
                "starting the run from iteration 0",
                UserWarning,
                stacklevel=6,
            )
            metrics_file.unlink(missing_ok=True)  # empty: nothing is lost
            return None
        try:
            json.loads((self.path / "eval_before.json").read_text())
        except (OSError, ValueError):
            raise CheckpointError(
                f"run folder {self.path} has no readable eval_before.json, which resuming from "
                f"{path.name} needs; nothing was deleted"
            ) from None
        note = f"flowrl train: resuming {self.path} from {path.name}"
        print(note + (f"; skipped newer: {why}" if skipped else ""), file=sys.stderr, flush=True)
        return path

    def resumed(self, iteration: int) -> None:
        """Cut ``metrics.jsonl`` back to the restored checkpoint's `iteration` (main process; call once the
        checkpoint has loaded: the rows after it are repeated by the resumed run)."""
        if self.accelerator.is_main_process:
            truncate_metrics(self.path / "metrics.jsonl", iteration)

    def log(self, metrics: dict) -> None:
        """Append one iteration's metrics as a JSON line to ``metrics.jsonl`` (main process)."""
        if self.accelerator.is_main_process:
            with open(self.path / "metrics.jsonl", "a") as f:
                f.write(json.dumps(metrics) + "\n")
