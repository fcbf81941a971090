"""GenEval-style prompts and metadata for the tiny world (templates of arXiv 2310.11513).

One JSON object per prompt: ``{"tag", "prompt", "include": [...], "exclude": [...]}``. The test split
holds shape-colour pairs, shape pairs and shape-count pairs that never appear in the training split
(``HELD_OUT_*``); single_object prompts have no combination and appear in both.
"""

from __future__ import annotations

import itertools
import random

from ..rewards.geneval.world import COLORS, COUNT_WORDS, COUNTING_RANGE, PLURALS, RELATIONS, SHAPES, TAGS

HELD_OUT_COLOR_PAIRS = {
    ("circle", "blue"),
    ("circle", "white"),
    ("square", "red"),
    ("square", "purple"),
    ("triangle", "green"),
    ("triangle", "black"),
    ("star", "orange"),
    ("star", "blue"),
    ("cross", "yellow"),
    ("cross", "purple"),
}
HELD_OUT_SHAPE_PAIRS = {frozenset(p) for p in (("circle", "star"), ("square", "triangle"), ("cross", "star"))}
HELD_OUT_COUNTS = {("circle", 3), ("square", 4), ("triangle", 2), ("star", 3), ("cross", 2)}


def _a(word: str) -> str:
    return ("an " if word[0] in "aeiou" else "a ") + word


def make_metadata(
    tag: str, shapes: tuple[str, ...], colors: tuple[str, ...] = (), count: int = 1, relation: str | None = None
) -> dict:
    """Build one prompt's metadata in GenEval's schema.

    Args:
        tag: one of ``TAGS``.
        shapes: one shape (single_object, counting, colors) or two (two_object, position, color_attr).
        colors: colours matching ``shapes`` for the colors and color_attr tags.
        count: object count for the counting tag (2..4).
        relation: for the position tag, the relation of ``shapes[0]`` to ``shapes[1]``.

    Returns:
        ``{"tag", "prompt", "include", "exclude"}``; for position the reference object is clause 0
        and the positioned object clause 1, as in GenEval's metadata.

    Raises:
        ValueError: for an unknown tag.
    """
    if tag == "single_object":
        return {
            "tag": tag,
            "prompt": f"a photo of {_a(shapes[0])}",
            "include": [{"class": shapes[0], "count": 1}],
            "exclude": [],
        }
    if tag == "two_object":
        a, b = shapes
        return {
            "tag": tag,
            "prompt": f"a photo of {_a(a)} and {_a(b)}",
            "include": [{"class": a, "count": 1}, {"class": b, "count": 1}],
            "exclude": [],
        }
    if tag == "counting":
        s = shapes[0]
        return {
            "tag": tag,
            "prompt": f"a photo of {COUNT_WORDS[count]} {PLURALS[s]}",
            "include": [{"class": s, "count": count}],
            "exclude": [{"class": s, "count": count + 1}],
        }
    if tag == "colors":
        return {
            "tag": tag,
            "prompt": f"a photo of {_a(colors[0] + ' ' + shapes[0])}",
            "include": [{"class": shapes[0], "count": 1, "color": colors[0]}],
            "exclude": [],
        }
    if tag == "position":
        a, b = shapes
        return {
            "tag": tag,
            "prompt": f"a photo of {_a(a)} {relation} {_a(b)}",
            "include": [{"class": b, "count": 1}, {"class": a, "count": 1, "position": [relation, 0]}],
            "exclude": [],
        }
    if tag == "color_attr":
        (a, b), (ca, cb) = shapes, colors
        return {
            "tag": tag,
            "prompt": f"a photo of {_a(ca + ' ' + a)} and {_a(cb + ' ' + b)}",
            "include": [{"class": a, "count": 1, "color": ca}, {"class": b, "count": 1, "color": cb}],
            "exclude": [],
        }
    raise ValueError(f"unknown tag {tag!r}; expected one of {TAGS}")


def all_metadata() -> list[dict]:
    """Every prompt of the world, each tag enumerated in a fixed order."""
    out = [make_metadata("single_object", (s,)) for s in SHAPES]
    pairs = list(itertools.permutations(SHAPES, 2))
    out += [make_metadata("two_object", p) for p in pairs]
    out += [make_metadata("counting", (s,), count=n) for s in SHAPES for n in COUNTING_RANGE]
    out += [make_metadata("colors", (s,), (c,)) for s in SHAPES for c in COLORS]
    out += [make_metadata("position", p, relation=r) for p in pairs for r in RELATIONS]
    out += [make_metadata("color_attr", p, cs) for p in pairs for cs in itertools.permutations(COLORS, 2)]
    return out


def is_held_out(meta: dict) -> bool:
    """Whether a prompt contains a combination reserved for the test split."""
    inc = meta["include"]
    if any((c["class"], c["color"]) in HELD_OUT_COLOR_PAIRS for c in inc if "color" in c):
        return True
    if len(inc) == 2 and frozenset(c["class"] for c in inc) in HELD_OUT_SHAPE_PAIRS:
        return True
    return meta["tag"] == "counting" and (inc[0]["class"], inc[0]["count"]) in HELD_OUT_COUNTS


def split(seed: int = 0, max_per_tag: int = 40) -> tuple[list[dict], list[dict]]:
    """Split the world's prompts into train and test.

    Test: single_object prompts plus every prompt with a held-out combination, at most ``max_per_tag``
    per tag (a seeded sample). Train: every prompt with no held-out combination, at most
    ``4 * max_per_tag`` per tag.

    Returns:
        ``(train, test)`` lists of metadata dicts.
    """
    rng = random.Random(seed)
    train, test = [], []
    for tag in TAGS:
        metas = [m for m in all_metadata() if m["tag"] == tag]
        held = [m for m in metas if is_held_out(m)]
        seen = [m for m in metas if not is_held_out(m)]
        if tag == "single_object":
            held = seen
        test += rng.sample(held, min(len(held), max_per_tag))
        train += rng.sample(seen, min(len(seen), 4 * max_per_tag))
    return train, test
