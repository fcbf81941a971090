"""GenEval's scoring rules (Ghosh et al., arXiv 2310.11513), applied to a list of detections.

The rules are those of the reference evaluator: ``include`` clauses are ANDed, ``exclude`` clauses
ORed; detections of a class are taken in order of confidence; counts, colours and relative positions
are checked on the first ``count`` detections of a class. The rules are those of the reference evaluator (Ghosh et al., arXiv 2310.11513; its ``evaluate_images.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..base import is_integer
from .world import RELATIONS

POSITION_THRESHOLD = 0.1
"""Each axis of the centre offset shrinks by this fraction of the summed box sizes (GenEval)."""


@dataclass(frozen=True)
class Detection:
    """One detected object.

    Attributes:
        cls: shape name, one of ``world.SHAPES``.
        color: colour name, one of ``world.COLORS``, or ``None`` when undecided.
        box: ``(x0, y0, x1, y1)`` in pixels, image y growing downwards, x1/y1 exclusive.
        score: confidence in [0, 1].
    """

    cls: str
    color: str | None
    box: tuple[float, float, float, float]
    score: float = 1.0


def relative_position(a: tuple[float, ...], b: tuple[float, ...]) -> set[str]:
    """Relations in which box ``a`` stands to box ``b`` ("left of", "right of", "above", "below").

    offset = centre_a - centre_b; each axis shrinks towards 0 by 0.1 * (size_a + size_b); if both are
    then ~0 the boxes stand in no relation; else (dx, dy) = shrunk offset / |offset| and dx < -0.5 is
    'left of', dx > 0.5 'right of', dy < -0.5 'above', dy > 0.5 'below'.

    Args:
        a, b: boxes ``(x0, y0, x1, y1)`` in pixels.

    Returns:
        The set of relation names (possibly empty, at most two).
    """
    offset = [(a[0] + a[2]) / 2 - (b[0] + b[2]) / 2, (a[1] + a[3]) / 2 - (b[1] + b[3]) / 2]
    dims = [(a[2] - a[0]) + (b[2] - b[0]), (a[3] - a[1]) + (b[3] - b[1])]
    shrunk = [math.copysign(max(abs(o) - POSITION_THRESHOLD * d, 0.0), o) for o, d in zip(offset, dims)]
    if all(abs(s) < 1e-3 for s in shrunk):
        return set()
    norm = math.hypot(*offset)
    dx, dy = shrunk[0] / norm, shrunk[1] / norm
    relations = set()
    if dx < -0.5:
        relations.add("left of")
    if dx > 0.5:
        relations.add("right of")
    if dy < -0.5:
        relations.add("above")
    if dy > 0.5:
        relations.add("below")
    return relations


def _check_clause(kind: str, i: int, clause: Any, metadata: dict) -> None:
    """Refuse a malformed include/exclude clause with a one-line error naming the prompt and clause."""
    where = f"{kind} clause {i} of {metadata.get('prompt', metadata)!r}"
    if not isinstance(clause, dict) or "class" not in clause or "count" not in clause:
        raise ValueError(f"{where} needs 'class' and 'count'")
    count = clause["count"]
    if not is_integer(count) or count < 1:
        raise ValueError(f"{where}: 'count' must be an integer >= 1, got {count!r}")
    if "position" in clause:
        position = clause["position"]
        if not (
            isinstance(position, (list, tuple))
            and len(position) == 2
            and position[0] in RELATIONS
            and is_integer(position[1])
            and 0 <= position[1] < i
        ):
            raise ValueError(
                f"{where}: 'position' must be [relation, index] with relation in {RELATIONS} and an "
                f"earlier clause's index in [0, {i}), got {position!r}"
            )


def check_metadata(metadata: dict) -> None:
    """Refuse GenEval metadata that does not follow the schema ``evaluate`` reads.

    Args:
        metadata: ``{"include": [{"class", "count", "color"?, "position"?: [relation, index]}],
            "exclude"?: [{"class", "count"}], "prompt"?: str}``.

    Raises:
        ValueError: naming the prompt and clause, when ``include`` is missing or empty, a clause lacks
            ``class`` or ``count``, a count is not an integer >= 1, or a position is not
            ``[relation, index]`` with a known relation and an earlier include clause's index.
    """
    include, exclude = metadata.get("include", []), metadata.get("exclude", [])
    if not include:
        raise ValueError(
            f"metadata of {metadata.get('prompt', metadata)!r} has an empty 'include'; GenEval needs one clause"
        )
    for kind, clauses in (("include", include), ("exclude", exclude)):
        for i, clause in enumerate(clauses):
            _check_clause(kind, i if kind == "include" else len(include), clause, metadata)


def evaluate(detections: list[Detection], metadata: dict, graded: bool = False) -> tuple[bool, float, list[str]]:
    """Score one image's detections against its GenEval metadata.

    Args:
        detections: the image's detections, any order (sorted here by descending score).
        metadata: ``{"include": [{"class", "count", "color"?, "position"?: [relation, index]}],
            "exclude": [{"class", "count"}]}``.
        graded: weigh each include clause that holds by the mean confidence of its matched objects
            in ``dense`` (a denser RL signal; ``correct`` is unchanged).

    Returns:
        ``(correct, dense, failures)``: ``correct`` is GenEval's strict 0/1 (every clause holds),
        ``dense`` the fraction of clauses (includes and excludes) that hold, in [0, 1], and
        ``failures`` one short reason per failed clause.

    Raises:
        ValueError: for metadata off the schema (see ``check_metadata``).
    """
    check_metadata(metadata)
    by_class: dict[str, list[Detection]] = {}
    for det in sorted(detections, key=lambda d: -d.score):
        by_class.setdefault(det.cls, []).append(det)

    include, exclude = metadata["include"], metadata.get("exclude", [])
    matched: list[list[Detection] | None] = []
    failures: list[str] = []
    shortfall = 0.0  # graded: 1 - mean confidence of each holding include clause
    for i, clause in enumerate(include):
        found = by_class.get(clause["class"], [])
        count = clause["count"]
        objects = found[:count]
        ok = len(found) >= count
        if ok and "color" in clause:  # the reference checks the colours of the first `count` only
            ok = sum(d.color == clause["color"] for d in objects) >= count
        if ok and "position" in clause:
            relation, j = clause["position"]
            ok = matched[j] is not None and all(
                relation in relative_position(a.box, b.box) for a in objects for b in matched[j]
            )
        matched.append(objects if ok else None)
        if not ok:
            failures.append(f"include {clause}")
        elif graded and objects:
            shortfall += 1.0 - sum(d.score for d in objects) / len(objects)
    for clause in exclude:
        if len(by_class.get(clause["class"], [])) >= clause["count"]:
            failures.append(f"exclude {clause}")
    total = len(include) + len(exclude)
    dense = 1.0 - (len(failures) + shortfall) / total if total else 1.0
    return not failures, dense, failures
