"""Prompts and ground-truth renders of the tiny video world (vocabulary and checker: ``rewards.motion_world``).

One prompt per (shape, colour, direction): "a red circle moving left", 5 x 8 x 4 = 160 in all. Its metadata (one JSON
object per line of a prompt file, as ``flowrl.data`` reads) is ``{"prompt", "tag": direction, "shape", "color",
"direction", "speed"}``: the tag is the direction, so ``tag_balanced`` training draws the four directions equally.
The test split holds every prompt with a (colour, direction) pair of ``HELD_OUT_PAIRS`` (two directions per colour,
each direction held out for four colours): 80 test prompts whose colour-direction pairing the RL never trains on,
and 80 training prompts. Pre-training clips (``flowrl.tiny.build_video``) cover all 160, as a web-scale set would.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np

from flowrl.tiny.render import Obj, render

from ..rewards.geneval.world import COLORS, SHAPES
from ..rewards.motion_world import DIRECTIONS, MAX_SIZE, MIN_SIZE, NUM_FRAMES, SPEED, VIDEO_SIZE, check_motion_metadata

HELD_OUT_PAIRS: frozenset[tuple[str, str]] = frozenset(
    {
        ("red", "left"),
        ("red", "up"),
        ("orange", "right"),
        ("orange", "down"),
        ("yellow", "left"),
        ("yellow", "down"),
        ("green", "right"),
        ("green", "up"),
        ("blue", "left"),
        ("blue", "up"),
        ("purple", "right"),
        ("purple", "down"),
        ("white", "left"),
        ("white", "down"),
        ("black", "right"),
        ("black", "up"),
    }
)
"""(colour, direction) pairs of the test split."""


def _a(word: str) -> str:
    return ("an " if word[0] in "aeiou" else "a ") + word


def make_metadata(shape: str, color: str, direction: str, speed: float = SPEED) -> dict:
    """One prompt's record: ``{"prompt", "tag", "shape", "color", "direction", "speed"}``.

    Raises:
        ValueError: for a shape, colour, direction or speed outside the world (``check_motion_metadata``).
    """
    meta = {
        "prompt": f"{_a(color)} {shape} moving {direction}",
        "tag": direction,
        "shape": shape,
        "color": color,
        "direction": direction,
        "speed": speed,
    }
    check_motion_metadata(meta)
    return meta


def all_metadata() -> list[dict]:
    """Every prompt of the world, shapes then colours then directions in the vocabulary's order."""
    return [make_metadata(s, c, d) for s in SHAPES for c in COLORS for d in DIRECTIONS]


def is_held_out(meta: dict) -> bool:
    """Whether a prompt's (colour, direction) pair is reserved for the test split."""
    return (meta["color"], meta["direction"]) in HELD_OUT_PAIRS


def split() -> tuple[list[dict], list[dict]]:
    """``(train, test)``: the prompts without and with a held-out (colour, direction) pair, 80 each."""
    metas = all_metadata()
    return [m for m in metas if not is_held_out(m)], [m for m in metas if is_held_out(m)]


@dataclass(frozen=True)
class Clip:
    """One ground-truth clip: a ``shape`` of ``color`` and side ``size`` px whose centre starts at ``(x, y)`` px and
    moves ``(vx, vy)`` px per frame."""

    shape: str
    color: str
    size: int
    x: float
    y: float
    vx: float
    vy: float

    def at(self, frame: int) -> Obj:
        """The object drawn in frame ``frame`` (0-based)."""
        return Obj(self.shape, self.color, self.x + frame * self.vx, self.y + frame * self.vy, self.size)


def sample_clip(meta: dict, rng: random.Random, frames: int = NUM_FRAMES, side: int = VIDEO_SIZE) -> Clip:
    """A clip that satisfies ``meta``: size uniform in ``[MIN_SIZE, MAX_SIZE]``, a whole-pixel start drawn uniformly
    among those that keep the shape 1 px inside the frame for all ``frames`` frames.

    Args:
        meta: ``{"shape", "color", "direction", "speed"}`` (see ``rewards.motion_world.check_motion_metadata``).
        rng: the random source; the same seed gives the same clip.

    Raises:
        ValueError: for metadata off the schema, or a motion too long for the frame (``speed * (frames - 1)``
            more than the room left by the largest shape).
    """
    check_motion_metadata(meta)
    size = rng.randint(MIN_SIZE, MAX_SIZE)
    dx, dy = DIRECTIONS[meta["direction"]]
    vx, vy = dx * meta["speed"], dy * meta["speed"]
    lo, hi = size / 2 + 1, side - size / 2 - 1
    travel = meta["speed"] * (frames - 1)
    if travel > hi - lo:
        raise ValueError(
            f"speed {meta['speed']} over {frames} frames moves {travel} px: more than the {hi - lo} px a "
            f"{size} px shape has in a {side} px frame"
        )

    def start(v: float) -> float:  # whole pixels keeping every frame inside
        first, last = (lo, hi - travel) if v > 0 else (lo + travel, hi) if v < 0 else (lo, hi)
        return float(rng.randint(int(np.ceil(first)), int(np.floor(last))))

    return Clip(meta["shape"], meta["color"], size, start(vx), start(vy), vx, vy)


def render_clip(clip: Clip, frames: int = NUM_FRAMES, side: int = VIDEO_SIZE) -> np.ndarray:
    """Draw a clip with the image world's renderer (``flowrl.tiny.render.render``).

    Returns:
        ``uint8`` array of shape ``(frames, side, side, 3)``, RGB.
    """
    return np.stack([render([clip.at(f)], side) for f in range(frames)])


def render_dataset(
    metas: list[dict], n: int, seed: int, frames: int = NUM_FRAMES, side: int = VIDEO_SIZE
) -> tuple[np.ndarray, list[dict]]:
    """Render ``n`` clips of prompts drawn uniformly from ``metas``.

    Returns:
        ``(videos, drawn)``: uint8 ``(n, frames, side, side, 3)`` and the ``n`` records drawn.
    """
    rng = random.Random(seed)
    videos = np.empty((n, frames, side, side, 3), np.uint8)
    drawn = []
    for i in range(n):
        meta = rng.choice(metas)
        videos[i] = render_clip(sample_clip(meta, rng, frames, side), frames, side)
        drawn.append(meta)
    return videos, drawn
