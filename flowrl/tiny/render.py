"""Renderer of the tiny world: 64x64 scenes of flat shapes on a grey background.

Shapes are axis-aligned and drawn without anti-aliasing, so every pixel is either the background or
exactly one palette colour; ``rewards.geneval.detect`` reads them back.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageDraw

from ..rewards.geneval.rules import relative_position
from ..rewards.geneval.world import BACKGROUND, COLORS, IMAGE_SIZE, MAX_SIZE, MIN_SIZE, SHAPES

GAP = 3
"""Minimum number of background pixels between two objects' boxes."""

POSITION_MARGIN = 1.5
"""Pixels by which a detected box may be off (polygons are drawn up to 1 px beyond ``Obj.box``): a
``position`` clause must hold for every such shift, so no rendered scene sits on the rule's edge."""


def _holds(relation: str, a: "Obj", b: "Obj") -> bool:
    m = POSITION_MARGIN
    return all(
        relation in relative_position((a.box[0] + dx, a.box[1] + dy, a.box[2] + dx, a.box[3] + dy), b.box)
        for dx in (-m, 0.0, m)
        for dy in (-m, 0.0, m)
    )


@dataclass(frozen=True)
class Obj:
    """One object of a scene: ``shape`` and ``color`` names, centre ``(cx, cy)`` and box side ``size`` in pixels."""

    shape: str
    color: str
    cx: float
    cy: float
    size: int

    @property
    def box(self) -> tuple[float, float, float, float]:
        """``(x0, y0, x1, y1)`` of the drawn shape, in pixels."""
        h = self.size / 2
        return (self.cx - h, self.cy - h, self.cx + h, self.cy + h)


def _polygon(shape: str, cx: float, cy: float, size: int) -> list[tuple[float, float]] | None:
    h = size / 2
    if shape == "triangle":
        return [(cx, cy - h), (cx + h, cy + h), (cx - h, cy + h)]
    if shape == "star":
        pts = []
        for k in range(10):
            r = h if k % 2 == 0 else 0.42 * h
            a = -math.pi / 2 + k * math.pi / 5
            pts.append((cx + r * math.cos(a), cy + h * 0.1 + r * math.sin(a)))
        return pts
    if shape == "cross":
        t = size / 6
        return [
            (cx - t, cy - h),
            (cx + t, cy - h),
            (cx + t, cy - t),
            (cx + h, cy - t),
            (cx + h, cy + t),
            (cx + t, cy + t),
            (cx + t, cy + h),
            (cx - t, cy + h),
            (cx - t, cy + t),
            (cx - h, cy + t),
            (cx - h, cy - t),
            (cx - t, cy - t),
        ]
    return None


def render(scene: list[Obj], size: int = IMAGE_SIZE) -> np.ndarray:
    """Draw a scene.

    Args:
        scene: objects to draw (drawn in order; the scene samplers never let them overlap).
        size: image side in pixels.

    Returns:
        ``uint8`` array of shape ``(size, size, 3)``, RGB.

    Raises:
        KeyError: for a shape or colour outside the world's vocabulary.
    """
    image = Image.new("RGB", (size, size), BACKGROUND)
    draw = ImageDraw.Draw(image)
    for obj in scene:
        fill = COLORS[obj.color]
        x0, y0, x1, y1 = obj.box
        if obj.shape == "circle":
            draw.ellipse([x0, y0, x1 - 1, y1 - 1], fill=fill)
        elif obj.shape == "square":
            draw.rectangle([x0, y0, x1 - 1, y1 - 1], fill=fill)
        elif obj.shape in SHAPES:
            draw.polygon(_polygon(obj.shape, obj.cx, obj.cy, obj.size), fill=fill)
        else:
            raise KeyError(f"unknown shape {obj.shape!r}; expected one of {SHAPES}")
    return np.array(image)  # a writable copy (torch.from_numpy warns on a read-only one)


def _free(box: tuple[float, ...], others: list[Obj]) -> bool:
    return all(
        box[2] + GAP <= o.box[0] or o.box[2] + GAP <= box[0] or box[3] + GAP <= o.box[1] or o.box[3] + GAP <= box[1]
        for o in others
    )


def _place(shape: str, color: str, placed: list[Obj], rng: random.Random, tries: int = 200, accept=None) -> Obj:
    for _ in range(tries):
        size = rng.randint(MIN_SIZE, MAX_SIZE)
        lo, hi = size / 2 + 1, IMAGE_SIZE - size / 2 - 1
        obj = Obj(shape, color, round(rng.uniform(lo, hi)), round(rng.uniform(lo, hi)), size)
        if _free(obj.box, placed) and (accept is None or accept(obj)):
            return obj
    raise RuntimeError("could not place object")


def sample_scene(metadata: dict, rng: random.Random) -> list[Obj]:
    """Sample a scene that satisfies GenEval-style ``metadata`` exactly (see ``flowrl.tiny.prompts``).

    Colours not named by the metadata are uniform over the palette; sizes are uniform in
    [MIN_SIZE, MAX_SIZE]; objects keep ``GAP`` pixels apart; a ``position`` clause is met under
    GenEval's relative-position rule with ``POSITION_MARGIN`` pixels to spare.

    Args:
        metadata: ``{"include": [...], ...}`` as written by ``flowrl.tiny.prompts``.
        rng: the random source; the same seed gives the same scene.

    Returns:
        The list of objects, in clause order.
    """
    for _ in range(50):
        try:
            placed: list[Obj] = []
            groups: list[list[Obj]] = []
            for clause in metadata["include"]:
                group = []
                for _ in range(clause["count"]):
                    color = clause.get("color") or rng.choice(list(COLORS))
                    accept = None
                    if "position" in clause:
                        relation, j = clause["position"]

                        def accept(o, r=relation, t=groups[j]):
                            return all(_holds(r, o, b) for b in t)

                    obj = _place(clause["class"], color, placed, rng, accept=accept)
                    placed.append(obj)
                    group.append(obj)
                groups.append(group)
            return placed
        except RuntimeError:
            continue
    raise RuntimeError(f"no scene found for {metadata.get('prompt')!r}")
