"""Experiment trackers (``run.log_with``): TensorBoard, Weights & Biases and Trackio through accelerate's trackers.

``metrics.jsonl`` in the run folder is always written (:meth:`flowrl.run.RunFolder.log`); the trackers receive the
same scalars at the same iteration, the before/after evaluation grids and, every ``run.log_images_every``
iterations, a few of the rollout's images. Everything here runs on the main process only (accelerate's trackers
are main-process objects).

Offline use is each tracker's own: TensorBoard writes event files under ``<run.output_dir>/tensorboard``;
``WANDB_MODE=offline`` keeps a wandb run in ``<run.output_dir>/wandb`` for a later ``wandb sync``; Trackio logs to a
local database by default.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import torch

TRACKERS = {"tensorboard": "tensorboard", "wandb": "wandb", "trackio": "trackio"}
"""Tracker name in ``run.log_with`` -> the Python package it needs (all three: ``pip install -e ".[trackers]"``)."""


def check_trackers(names: list[str]) -> None:
    """Check ``run.log_with`` before anything loads.

    Args:
        names (`list[str]`): tracker names, each one of :data:`TRACKERS`.

    Raises:
        ValueError: naming ``run.log_with``, for an unknown name, a repeated one, or a tracker whose package is
            not installed (with the pip command that installs it).
    """
    for name in names:
        if name not in TRACKERS:
            raise ValueError(f"config key 'run.log_with' must list trackers among {'|'.join(TRACKERS)}, got {name!r}")
        if importlib.util.find_spec(TRACKERS[name]) is None:
            raise ValueError(
                f"config key 'run.log_with' names {name!r}, but its package is not installed: "
                f"pip install {TRACKERS[name]}"
            )
    if len(set(names)) != len(names):
        raise ValueError(f"config key 'run.log_with' lists a tracker twice: {names}")


def flat_config(config: dict, prefix: str = "") -> dict[str, bool | int | float | str]:
    """A nested config dict flattened to ``{"sampling.window.size": 4, ...}`` with scalar values only (lists and
    None become strings), the form TensorBoard's hyper-parameters and wandb's config accept."""
    out: dict[str, bool | int | float | str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flat_config(value, name + "."))
        else:
            out[name] = value if isinstance(value, (bool, int, float, str)) else str(value)
    return out


class Trackers:
    """The run's trackers, through an accelerate ``Accelerator`` made with ``log_with`` and a ``logging_dir``.

    Args:
        accelerator (`accelerate.Accelerator`): built with ``log_with=names`` (TensorBoard writes under its
            ``logging_dir``).
        names (`list[str]`): ``run.log_with`` (checked by :func:`check_trackers`); empty = no tracker, every
            method a no-op.
    """

    def __init__(self, accelerator, names: list[str]):
        self.accelerator, self.names, self.started = accelerator, list(names), False

    def start(self, project: str, run_name: str, config: dict, out: Path) -> None:
        """Start the trackers (once; every other method is a no-op before).

        Args:
            project (`str`): the project name (``run.project``): TensorBoard's sub-folder, the wandb / Trackio
                project.
            run_name (`str`): the run's display name (the run folder's name).
            config (`dict`): the resolved config, logged as the run's hyper-parameters (flattened).
            out (`Path`): the run folder (wandb's files go to ``out/wandb``).
        """
        if not self.names or self.started:
            return
        init_kwargs = {"wandb": {"name": run_name, "dir": str(out)}, "trackio": {"name": run_name}, "tensorboard": {}}
        self.accelerator.init_trackers(
            project, config=flat_config(config), init_kwargs={k: v for k, v in init_kwargs.items() if k in self.names}
        )
        self.started = True

    def log(self, metrics: dict[str, float], iteration: int) -> None:
        """Log one iteration's scalars (the row of ``metrics.jsonl``) at step ``iteration`` (1-based)."""
        if self.started:
            self.accelerator.log({k: v for k, v in metrics.items() if isinstance(v, (int, float))}, step=iteration)

    def log_images(self, name: str, images: torch.Tensor, iteration: int) -> None:
        """Log images under `name` at step `iteration` to the trackers that take images (TensorBoard, wandb; Trackio
        gets scalars only).

        Args:
            name (`str`): the panel's name, e.g. ``"rollout"`` or ``"grid/after"``.
            images (`torch.Tensor` of shape `(N, 3, H, W)`, or `(N, F, 3, H, W)` for videos, of which the first
                frame is logged): values in [0, 1], any float dtype and device.
            iteration (`int`): the step they belong to.
        """
        if not self.started or not self.accelerator.is_main_process:
            return
        if images.dim() == 5:
            images = images[:, 0]
        array = (images.detach().float().clamp(0, 1).cpu() * 255).round().to(torch.uint8).numpy()  # (N, 3, H, W)
        for tracker_name in self.names:
            if tracker_name == "tensorboard":
                self.accelerator.get_tracker("tensorboard").log_images(
                    {name: array}, step=iteration, dataformats="NCHW"
                )
            elif tracker_name == "wandb":
                self.accelerator.get_tracker("wandb").log_images(
                    {name: [np.ascontiguousarray(a.transpose(1, 2, 0)) for a in array]}, step=iteration
                )

    def finish(self) -> None:
        """Close every tracker (flushes TensorBoard's event files, ends the wandb run)."""
        if self.started:
            self.accelerator.end_training()
            self.started = False
