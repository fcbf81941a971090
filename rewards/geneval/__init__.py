"""GenEval reward for the tiny world (Ghosh et al., arXiv 2310.11513; Flow-GRPO's main task).

Images are read by the hand-made ``detect``; detections below GenEval's confidence thresholds are
dropped (``keep_confident``) and the rest judged by GenEval's rules (``evaluate``). Two rewards:

- ``geneval`` (dense): the fraction of the prompt's include and exclude clauses that hold, in [0, 1].
- ``geneval_strict``: GenEval's own 0/1 correctness (every clause holds).

``geneval(lenient=True)`` is a shaped training reward for weak models: rough shapes are detected with a
graded confidence (no confidence threshold) and each clause that holds counts by the mean confidence of
its objects, so a rounder circle scores higher than a blob. Evaluation always uses the default judge.

The package is standalone: it imports nothing from ``flowrl`` or ``samplers``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..base import check_inputs, register_reward
from .detector import detect, detect_batch
from .rules import Detection, check_metadata, evaluate, relative_position
from .world import COLORS, SHAPES

__all__ = [
    "COUNTING_THRESHOLD",
    "THRESHOLD",
    "Detection",
    "GenEval",
    "check_metadata",
    "detect",
    "detect_batch",
    "evaluate",
    "geneval",
    "geneval_strict",
    "keep_confident",
    "relative_position",
]

THRESHOLD = 0.3
"""GenEval's detection confidence threshold."""
COUNTING_THRESHOLD = 0.9
"""GenEval's stricter threshold for prompts tagged ``counting``."""


def keep_confident(detections: Sequence[Detection], metadata: Mapping[str, Any]) -> list[Detection]:
    """The detections GenEval would keep: score > 0.9 for the ``counting`` tag, > 0.3 otherwise (strictly
    above, as the reference evaluator's ``> confidence_threshold``).

    GenEval also applies per-class non-maximum suppression; ``detect`` returns disjoint masks, so
    there is nothing to suppress.

    Args:
        detections: one image's detections.
        metadata: the image's GenEval metadata; only ``tag`` is read (absent: not counting).

    Returns:
        The kept detections, in their input order.
    """
    threshold = COUNTING_THRESHOLD if metadata.get("tag") == "counting" else THRESHOLD
    return [d for d in detections if d.score > threshold]


@dataclass(frozen=True)
class GenEval:
    """The GenEval reward as a callable (build it with ``geneval`` or ``geneval_strict``).

    Attributes:
        strict: score GenEval's 0/1 correctness instead of the fraction of clauses met.
        name: the reward's name, for error messages and logs.
        lenient: graded detection of rough shapes and confidence-weighted clauses (see the module
            docstring); a training reward, not GenEval's metric.
    """

    strict: bool = False
    name: str = "geneval"
    lenient: bool = False

    def judge(
        self, images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Both GenEval scores of each image from one detection pass.

        Args:
            images (`torch.Tensor` of shape `(B, 3, H, W)`, floating point, values in `[0, 1]`):
                RGB images on any device, drawn like ``flowrl.tiny.render`` scenes.
            prompts (`Sequence[str]` of length `B`): used in error messages only.
            metadata (`Sequence[Mapping]` of length `B`): GenEval metadata, each with ``include``
                (and usually ``exclude`` and ``tag``), as written by ``flowrl.tiny.prompts``.

        Returns:
            ``(correct, dense)``: two `torch.Tensor` of shape `(B,)`, float32, on CPU: GenEval's 0.0 / 1.0
            correctness and the fraction of clauses met in [0, 1].

        Raises:
            ValueError: before any detection, when a metadata dict lacks ``include``, is off GenEval's
                schema (see ``rules.check_metadata``) or names a class or colour outside the tiny
                world's ``SHAPES`` and ``COLORS`` (the message names its prompt), or the inputs break
                the reward contract (see ``rewards.base.check_inputs``).
            TypeError: ``images`` is not a floating-point tensor, or a metadata entry is not a dict.
        """
        check_inputs(images, prompts, metadata)
        for prompt, meta in zip(prompts, metadata):
            if "include" not in meta:
                raise ValueError(
                    f"{self.name}: metadata of prompt {prompt!r} has no 'include'; this reward needs GenEval metadata"
                )
            check_metadata(meta)
            for clause in [*meta["include"], *meta.get("exclude", [])]:
                if clause["class"] not in SHAPES or ("color" in clause and clause["color"] not in COLORS):
                    raise ValueError(
                        f"{self.name}: metadata of prompt {prompt!r} asks for {clause}; the tiny-world detector "
                        f"knows the shapes {SHAPES} and the colours {tuple(COLORS)}"
                    )
        correct, dense = [], []
        for detections, meta in zip(detect_batch(images, self.lenient), metadata):
            kept = detections if self.lenient else keep_confident(detections, meta)
            ok, fraction, _ = evaluate(kept, meta, graded=self.lenient)
            correct.append(float(ok))
            dense.append(fraction)
        return torch.tensor(correct, dtype=torch.float32), torch.tensor(dense, dtype=torch.float32)

    def __call__(
        self, images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]]
    ) -> torch.Tensor:
        """Score one image per prompt: :meth:`judge`'s ``correct`` if ``strict``, else its ``dense``.

        Returns:
            `torch.Tensor` of shape `(B,)`, float32, on CPU, in [0, 1].

        Raises:
            As :meth:`judge`.
        """
        correct, dense = self.judge(images, prompts, metadata)
        return correct if self.strict else dense


@register_reward("geneval")
def geneval(strict: bool = False, lenient: bool = False) -> GenEval:
    """GenEval reward for tiny-world images.

    Args:
        strict: if True, GenEval's 0/1 correctness; else (default) the fraction of clauses met,
            a denser signal for RL.
        lenient: graded detection of rough shapes, clauses weighted by confidence (module docstring).

    Returns:
        A ``GenEval`` reward: ``(images (B, 3, H, W) float in [0, 1], prompts, metadata) -> (B,)``
        float32 scores on CPU in [0, 1] (``(0,)`` for an empty batch). Calling it raises as
        :meth:`GenEval.judge`.
    """
    return GenEval(strict=strict, name="geneval_strict" if strict else "geneval", lenient=lenient)


@register_reward("geneval_strict")
def geneval_strict() -> GenEval:
    """``geneval(strict=True)``: GenEval's 0/1 correctness per image."""
    return geneval(strict=True)
