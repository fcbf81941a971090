"""GenEval reward (Ghosh et al., arXiv 2310.11513; Flow-GRPO's main task), for the tiny world or real images.

Two backends read the images. Real images (``backend="real"``, or given ``segmenter_path`` and
``clip_path``) go through Mask2Former and a CLIP colour classifier as in the reference evaluator (see
``real.py``). Tiny-world images (the default) are read by the hand-made ``detect``. Either way,
detections below GenEval's confidence thresholds are dropped (``keep_confident``; for real images
``real.select_detections``, which also caps and suppresses per class as GenEval) and the rest judged by
GenEval's rules (``evaluate``). Two rewards:

- ``geneval`` (dense): the fraction of the prompt's include and exclude clauses that hold, in [0, 1].
- ``geneval_strict``: GenEval's own 0/1 correctness (every clause holds).

``geneval(lenient=True)`` is a shaped training reward for weak models: rough shapes are detected with a
graded confidence (no confidence threshold) and each clause that holds counts by the mean confidence of
its objects, so a rounder circle scores higher than a blob. Evaluation always uses the default judge.

The package is standalone: it imports nothing from ``flowrl`` or ``samplers``.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch

from ..base import check_inputs, register_reward
from .detector import detect, detect_batch
from .rules import Detection, check_metadata, evaluate, relative_position
from .world import COLORS, SHAPES

if TYPE_CHECKING:
    from .real import RealDetector

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
            docstring); a training reward, not GenEval's metric. Tiny world only.
        detector: the real-image backend (``real.RealDetector``: Mask2Former + CLIP colours), or None
            for the tiny world.
    """

    strict: bool = False
    name: str = "geneval"
    lenient: bool = False
    detector: RealDetector | None = None

    def __post_init__(self):
        if self.lenient and self.detector is not None:
            raise ValueError(f"{self.name}: lenient is for the tiny world only; drop it with the real-image backend")

    def judge(
        self, images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Both GenEval scores of each image from one detection pass.

        Args:
            images (`torch.Tensor` of shape `(B, 3, H, W)`, floating point, values in `[0, 1]`):
                RGB images on any device: ``flowrl.tiny.render``-like scenes, or photographs with ``detector``.
            prompts (`Sequence[str]` of length `B`): used in error messages only.
            metadata (`Sequence[Mapping]` of length `B`): GenEval metadata, each with ``include``
                (and usually ``exclude`` and ``tag``), as written by ``flowrl.tiny.prompts``.

        Returns:
            ``(correct, dense)``: two `torch.Tensor` of shape `(B,)`, float32, on CPU: GenEval's 0.0 / 1.0
            correctness and the fraction of clauses met in [0, 1].

        Raises:
            ValueError: before any detection, when a metadata dict lacks ``include``, is off GenEval's
                schema (see ``rules.check_metadata``) or names a class or colour outside the backend's
                vocabulary (tiny world: ``SHAPES`` and ``COLORS``; real: the segmenter's share of
                ``real.CLASSES`` and ``real.COLORS``; the message names its prompt), or the inputs break
                the reward contract (see ``rewards.base.check_inputs``).
            TypeError: ``images`` is not a floating-point tensor, or a metadata entry is not a dict.
        """
        check_inputs(images, prompts, metadata)
        if self.detector is None:
            shapes, colors = SHAPES, tuple(COLORS)
            world = "the tiny-world detector knows the shapes"
            hint = "; real images need backend 'real' (segmenter_path, clip_path)"
        else:
            from .real import COLORS as REAL_COLORS

            shapes, colors, world, hint = self.detector.classes, REAL_COLORS, "the Mask2Former segmenter knows", ""
        for prompt, meta in zip(prompts, metadata):
            if "include" not in meta:
                raise ValueError(
                    f"{self.name}: metadata of prompt {prompt!r} has no 'include'; this reward needs GenEval metadata"
                )
            check_metadata(meta)
            for clause in [*meta["include"], *meta.get("exclude", [])]:
                if clause["class"] not in shapes or ("color" in clause and clause["color"] not in colors):
                    raise ValueError(
                        f"{self.name}: metadata of prompt {prompt!r} asks for {clause}; {world} "
                        f"{shapes} and the colours {colors}{hint}"
                    )
        if self.detector is None:
            detections = detect_batch(images, self.lenient)
            batch = [d if self.lenient else keep_confident(d, m) for d, m in zip(detections, metadata)]
        else:
            batch = self.detector(images, metadata)  # kept by GenEval's thresholds, colours classified
        correct, dense = [], []
        for kept, meta in zip(batch, metadata):
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


@register_reward(
    "geneval",
    modality="image",
    weights="none (tiny world); real images: Mask2Former COCO instance + openai/clip-vit-large-patch14",
)
def geneval(
    strict: bool = False,
    lenient: bool = False,
    backend: Literal["tiny", "real"] | None = None,
    segmenter_path: str | os.PathLike | None = None,
    clip_path: str | os.PathLike | None = None,
    device: str | None = None,
    dtype: str | None = None,
    segmenter_size: int | None = None,
    max_objects: int | None = None,
    nms_threshold: float | None = None,
    batch_size: int | None = None,
) -> GenEval:
    """GenEval reward, for tiny-world images (default) or real ones (Mask2Former + CLIP, ``real.py``).

    Args:
        strict: if True, GenEval's 0/1 correctness; else (default) the fraction of clauses met,
            a denser signal for RL.
        lenient: graded detection of rough shapes, clauses weighted by confidence (module docstring);
            tiny world only.
        backend: ``"tiny"`` or ``"real"``; None: ``"real"`` when ``segmenter_path`` or ``clip_path`` is
            given, else ``"tiny"``.
        segmenter_path: real backend: local folder of a transformers Mask2Former COCO instance checkpoint
            (e.g. ``facebook/mask2former-swin-small-coco-instance``).
        clip_path: real backend: local folder of a transformers CLIP model with tokenizer and image
            processor (GenEval's: ``openai/clip-vit-large-patch14``).
        device, dtype: real backend: where and in which floating dtype the models run (None: ``"cpu"``,
            ``"float32"``).
        segmenter_size: real backend: shortest side the segmenter sees; None: its processor's.
        max_objects: real backend: most detections kept per class (None: GenEval's 16).
        nms_threshold: real backend: per-class box IoU suppression in (0, 1] (None: GenEval's default 1.0,
            no suppression).
        batch_size: real backend: images per segmenter forward and crops per CLIP forward; None: all.

    The real-backend options are refused with the tiny backend, so that none is silently ignored.

    Returns:
        A ``GenEval`` reward: ``(images (B, 3, H, W) float in [0, 1], prompts, metadata) -> (B,)``
        float32 scores on CPU in [0, 1] (``(0,)`` for an empty batch). Calling it raises as
        :meth:`GenEval.judge`.

    Raises:
        ValueError: ``backend`` is not ``"tiny"``, ``"real"`` or None; a real-backend option is given
            with the tiny backend; ``lenient`` with the real one; or as ``real.load_real_detector``
            (each message names the option).
        FileNotFoundError, OSError: as ``real.load_real_detector`` (missing or unloadable folders).
    """
    name = "geneval_strict" if strict else "geneval"
    real_options = {
        "segmenter_path": segmenter_path,
        "clip_path": clip_path,
        "device": device,
        "dtype": dtype,
        "segmenter_size": segmenter_size,
        "max_objects": max_objects,
        "nms_threshold": nms_threshold,
        "batch_size": batch_size,
    }
    if backend is None:
        backend = "real" if segmenter_path is not None or clip_path is not None else "tiny"
    if backend not in ("tiny", "real"):
        raise ValueError(f"{name}: backend must be 'tiny' or 'real', got {backend!r}")
    if backend == "tiny":
        given = [k for k, v in real_options.items() if v is not None]
        if given:
            raise ValueError(
                f"{name}: the options {', '.join(given)} are for backend 'real'; the tiny world takes none"
            )
        return GenEval(strict=strict, name=name, lenient=lenient)
    if lenient:
        raise ValueError(f"{name}: lenient is for the tiny world only; drop it with backend 'real'")
    from .real import MAX_OBJECTS, load_real_detector

    detector = load_real_detector(
        segmenter_path,
        clip_path,
        device or "cpu",
        dtype or "float32",
        segmenter_size,
        MAX_OBJECTS if max_objects is None else max_objects,
        1.0 if nms_threshold is None else nms_threshold,
        batch_size,
    )
    return GenEval(strict=strict, name=name, detector=detector)


@register_reward(
    "geneval_strict",
    modality="image",
    weights="none (tiny world); real images: Mask2Former COCO instance + openai/clip-vit-large-patch14",
)
def geneval_strict(**options: Any) -> GenEval:
    """``geneval(strict=True, **options)``: GenEval's 0/1 correctness per image (options as ``geneval``)."""
    return geneval(strict=True, **options)


geneval_strict.__signature__ = inspect.signature(geneval).replace(  # build_reward checks options against it
    parameters=[p for n, p in inspect.signature(geneval).parameters.items() if n != "strict"]
)
