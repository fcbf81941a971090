"""The tiny video world's vocabulary and its deterministic checker: one flat shape moving across a grey frame.

The video counterpart of the tiny GenEval world (``rewards.geneval.world``): 9 frames of 32x32 RGB, one shape of the
image world (``SHAPES``, 12-14 px) in one of its ``COLORS`` on its grey ``BACKGROUND``, moving left, right, up or
down at ``SPEED`` pixels per frame. Prompts read "a red circle moving left"; their metadata is
``{"prompt", "tag": direction, "shape", "color", "direction", "speed"}`` (``flowrl.tiny.video`` writes them).

The checker reuses the image world's detector on every frame (``rewards.geneval.detector``: mixing-line pixel
colours, objects opened by reconstruction, shape features under per-shape Gaussians) and reads the motion from the
trajectory of the prompted colour's largest object: the least-squares velocity ``(vx, vy)`` of its mask centroid over
the frames it is found in, in pixels per frame (image y grows downwards). Three scores per video:

- ``motion`` (0/1): the object is found in at least ``MIN_PRESENT`` of the frames (and two), its velocity along the
  prompted direction lies in ``[MIN_SPEED, MAX_SPEED] x speed`` and across it at most ``MAX_DRIFT`` times that.
- ``strict`` (0/1): ``motion``, the object found in every frame, and the prompted shape read (confidence above
  GenEval's 0.3) in at least half of the frames.
- ``dense`` (in [0, 1]): ``(presence + shape + 2 motion_grade) / 4``, with ``presence`` the fraction of frames
  where the object is found, ``shape`` the fraction where it reads as the prompted shape, and ``motion_grade`` a
  ramp of the velocity: ``clip(v_par / speed, 0, 1) * clip(3 - v_par / speed, 0, 1) * clip(1 - v_perp / speed, 0, 1)``
  (1 at the prompted velocity, 0 when static, reversed or sideways). Motion counts twice: it is what the world
  trains.

Registered rewards (all ``accepts_video = True``: videos ``(B, F, 3, H, W)`` in [0, 1] -> ``(B,)`` float32 on CPU):
``motion_world`` (dense; option ``score`` picks another), ``motion_world_strict`` and ``motion_world_direction``
(the ``motion`` score). The module imports nothing from ``flowrl`` or ``samplers``.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch

from .base import check_inputs, register_reward
from .geneval import THRESHOLD
from .geneval.detector import classify, objects, shape_features
from .geneval.world import COLORS, SHAPES

__all__ = [
    "DIRECTIONS",
    "MotionWorld",
    "NUM_FRAMES",
    "SPEED",
    "VIDEO_SIZE",
    "check_motion_metadata",
    "judge_video",
    "motion_world",
    "motion_world_direction",
    "motion_world_strict",
]

VIDEO_SIZE = 32
"""Side of a frame in pixels."""
NUM_FRAMES = 9
"""Frames per video: ``4k + 1`` as the Wan VAE takes them (4x temporal compression: 3 latent frames)."""
MIN_SIZE, MAX_SIZE = 12, 14
"""Side of the shape's bounding box in pixels, inclusive range (the image detector reads shapes of this size at
32x32 without error)."""
SPEED = 1.5
"""Pixels per frame of every prompt of the shipped world (12 px over 9 frames)."""
DIRECTIONS: dict[str, tuple[int, int]] = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}
"""Direction name -> unit step ``(dx, dy)`` in pixels, image y growing downwards."""

MIN_PRESENT = 0.5
"""Fraction of frames the prompted colour must be found in for the motion to be judged."""
MIN_SPEED, MAX_SPEED = 0.5, 2.0
"""Range of the velocity along the prompted direction, in multiples of the prompted speed."""
MAX_DRIFT = 0.5
"""Largest velocity across the prompted direction, as a fraction of the velocity along it."""

ScoreKind = Literal["dense", "strict", "motion"]
SCORES: tuple[str, ...] = ("dense", "strict", "motion")


def check_motion_metadata(metadata: Mapping[str, Any]) -> None:
    """Refuse metadata off the motion world's schema.

    Args:
        metadata: ``{"shape", "color", "direction", "speed", "prompt"?}``.

    Raises:
        ValueError: naming the prompt and the key, for a missing key, a shape, colour or direction outside
            ``SHAPES``, ``COLORS``, ``DIRECTIONS``, or a speed that is not a finite number > 0.
    """
    where = f"metadata of prompt {metadata.get('prompt', '?')!r}"
    for key, known in (("shape", SHAPES), ("color", tuple(COLORS)), ("direction", tuple(DIRECTIONS))):
        if metadata.get(key) not in known:
            raise ValueError(f"{where}: {key!r} must be one of {known}, got {metadata.get(key)!r}")
    speed = metadata.get("speed")
    if isinstance(speed, bool) or not isinstance(speed, numbers.Real) or not math.isfinite(speed) or speed <= 0:
        raise ValueError(f"{where}: 'speed' must be a number > 0 (pixels per frame), got {speed!r}")


@dataclass(frozen=True)
class Judgement:
    """The checker's reading of one video.

    Attributes:
        strict, motion: 0/1 scores; dense: in [0, 1] (see the module docstring).
        presence: fraction of frames where the prompted colour's object is found.
        shape: fraction of frames where that object reads as the prompted shape (confidence > 0.3).
        velocity: least-squares ``(vx, vy)`` of its centroid in pixels per frame; ``(0, 0)`` with fewer than two
            frames found.
    """

    strict: float
    dense: float
    motion: float
    presence: float
    shape: float
    velocity: tuple[float, float]


def _track(frame: np.ndarray, color: str, shape: str) -> tuple[tuple[float, float], bool] | None:
    """The prompted colour's largest object in one frame: its centroid ``(x, y)`` in pixels and whether it reads as
    ``shape``; None when the colour is not found."""
    masks = [m for c, m in objects(frame) if c == color]
    if not masks:
        return None
    mask = max(masks, key=lambda m: int(m.sum()))
    ys, xs = np.nonzero(mask)
    cls, score = classify(shape_features(mask)[0])
    return (float(xs.mean()), float(ys.mean())), cls == shape and score > THRESHOLD


def _velocity(frames: list[int], centroids: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares slope of the centroids against the frame index, ``(vx, vy)`` px per frame."""
    t = np.asarray(frames, dtype=np.float64)
    xy = np.asarray(centroids, dtype=np.float64)  # (n, 2)
    t = t - t.mean()
    return tuple(float(v) for v in (t[:, None] * (xy - xy.mean(0))).sum(0) / (t**2).sum())


def judge_video(video: np.ndarray, metadata: Mapping[str, Any]) -> Judgement:
    """Check one video against its prompt's metadata (the module docstring's rules).

    Args:
        video: ``(F, H, W, 3)`` uint8 RGB frames (as ``flowrl.tiny.video.render_clip`` returns), ``F >= 2``.
        metadata: ``{"shape", "color", "direction", "speed"}`` (see :func:`check_motion_metadata`).

    Returns:
        The :class:`Judgement`.

    Raises:
        ValueError: for metadata off the schema, or a video that is not ``(F >= 2, H, W, 3)`` uint8.
    """
    check_motion_metadata(metadata)
    if video.ndim != 4 or video.shape[0] < 2 or video.shape[3] != 3 or video.dtype != np.uint8:
        raise ValueError(f"video must be uint8 of shape (F >= 2, H, W, 3), got {video.dtype} {video.shape}")
    found, centroids, shape_hits = [], [], 0
    for f, frame in enumerate(video):
        tracked = _track(frame, metadata["color"], metadata["shape"])
        if tracked is not None:
            found.append(f)
            centroids.append(tracked[0])
            shape_hits += tracked[1]
    n = len(video)
    presence, shape = len(found) / n, shape_hits / n
    velocity = _velocity(found, centroids) if len(found) >= 2 else (0.0, 0.0)
    dx, dy = DIRECTIONS[metadata["direction"]]
    along = (velocity[0] * dx + velocity[1] * dy) / metadata["speed"]  # in multiples of the prompted speed
    across = abs(velocity[0] * dy - velocity[1] * dx) / metadata["speed"]
    motion = len(found) >= max(2, MIN_PRESENT * n) and MIN_SPEED <= along <= MAX_SPEED and across <= MAX_DRIFT * along
    strict = motion and len(found) == n and shape >= 0.5
    grade = float(np.clip(along, 0, 1) * np.clip(3 - along, 0, 1) * np.clip(1 - across, 0, 1))
    return Judgement(float(strict), (presence + shape + 2 * grade) / 4, float(motion), presence, shape, velocity)


class MotionWorld:
    """The motion world's checker as a reward (build it with ``motion_world``, ``motion_world_strict`` or
    ``motion_world_direction``).

    Args:
        score: ``"dense"`` (default), ``"strict"`` or ``"motion"`` (module docstring).

    Raises:
        ValueError: for another ``score``.
    """

    accepts_video = True

    def __init__(self, score: ScoreKind = "dense"):
        if score not in SCORES:
            raise ValueError(f"motion_world: score must be one of {SCORES}, got {score!r}")
        self.score = score
        self.name = (
            "motion_world"
            if score == "dense"
            else {"strict": "motion_world_strict", "motion": "motion_world_direction"}[score]
        )

    def judge(
        self, videos: torch.Tensor, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]]
    ) -> list[Judgement]:
        """Read every video.

        Args:
            videos (`torch.Tensor` of shape `(B, F, 3, H, W)`, floating point in `[0, 1]`, any device, `F >= 2`).
            prompts (`Sequence[str]` of length `B`), metadata (`Sequence[Mapping]` of length `B`): the motion world's
                metadata per video (:func:`check_motion_metadata`).

        Returns:
            One :class:`Judgement` per video.

        Raises:
            ValueError / TypeError: inputs off the reward contract (``rewards.base.check_inputs``), fewer than two
                frames, or metadata off the schema (checked for every video before any is read; named by prompt).
        """
        check_inputs(videos, prompts, metadata, video=True)
        if videos.shape[1] < 2:
            raise ValueError(f"{self.name}: videos need at least 2 frames to show motion, got {videos.shape[1]}")
        for meta in metadata:
            check_motion_metadata(meta)
        frames = (videos.detach().float().cpu() * 255).round().to(torch.uint8).permute(0, 1, 3, 4, 2).numpy()
        return [judge_video(v, m) for v, m in zip(frames, metadata)]  # (F, H, W, 3) each

    def __call__(
        self, videos: torch.Tensor, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]]
    ) -> torch.Tensor:
        """Score each video: :meth:`judge`'s ``score`` field.

        Returns:
            `torch.Tensor` of shape `(B,)`, float32, on CPU, in [0, 1].

        Raises:
            As :meth:`judge`.
        """
        return torch.tensor(
            [getattr(j, self.score) for j in self.judge(videos, prompts, metadata)], dtype=torch.float32
        )


@register_reward("motion_world", modality="video", weights="none (the tiny video world's checker)")
def motion_world(score: ScoreKind = "dense") -> MotionWorld:
    """The tiny video world's checker: ``score`` ``"dense"`` (default, in [0, 1]), ``"strict"`` or ``"motion"`` (0/1).

    Raises:
        ValueError: for another ``score``.
    """
    return MotionWorld(score)


@register_reward("motion_world_strict", modality="video", weights="none (the tiny video world's checker)")
def motion_world_strict() -> MotionWorld:
    """The tiny video world's strict 0/1 score: colour in every frame, shape in half of them, motion as prompted."""
    return MotionWorld("strict")


@register_reward("motion_world_direction", modality="video", weights="none (the tiny video world's checker)")
def motion_world_direction() -> MotionWorld:
    """The tiny video world's 0/1 motion score: the prompted colour moves in the prompted direction at about the
    prompted speed."""
    return MotionWorld("motion")
