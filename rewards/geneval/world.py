"""The vocabulary of flowrl's tiny procedural world: shapes, colours, counts and relations.

The tiny world is a GenEval-style (arXiv 2310.11513) stand-in for real photographs: 64x64 RGB scenes
of one to four flat, axis-aligned shapes on a plain grey background. Everything that renders,
prompts or judges this world reads its vocabulary from here, so the names are fixed.
"""

from __future__ import annotations

IMAGE_SIZE = 64
"""Side of a rendered scene in pixels."""

SHAPES: tuple[str, ...] = ("circle", "square", "triangle", "star", "cross")
PLURALS: dict[str, str] = {
    "circle": "circles",
    "square": "squares",
    "triangle": "triangles",
    "star": "stars",
    "cross": "crosses",
}

COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "orange": (245, 140, 20),
    "yellow": (240, 220, 30),
    "green": (30, 170, 50),
    "blue": (30, 70, 220),
    "purple": (140, 40, 170),
    "white": (245, 245, 245),
    "black": (15, 15, 15),
}
"""Colour name -> sRGB in 0..255. Chosen far apart from each other and from the background."""

BACKGROUND: tuple[int, int, int] = (128, 128, 128)

COUNT_WORDS: dict[int, str] = {1: "one", 2: "two", 3: "three", 4: "four"}
COUNTING_RANGE: tuple[int, ...] = (2, 3, 4)
"""Counts used by the counting tag (one object is the single_object tag)."""

RELATIONS: tuple[str, ...] = ("left of", "right of", "above", "below")

TAGS: tuple[str, ...] = ("single_object", "two_object", "counting", "colors", "position", "color_attr")

MIN_SIZE, MAX_SIZE = 16, 24
"""Side of a shape's bounding box in pixels, inclusive range."""
