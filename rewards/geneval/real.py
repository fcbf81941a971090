"""GenEval on real images: Mask2Former instance segmentation and a CLIP colour classifier.

The second GenEval backend (Ghosh et al., arXiv 2310.11513), for photographs rather than the tiny world.
It mirrors the reference evaluator, ``evaluation/evaluate_images.py`` of github.com/djghosh13/geneval:

1. Objects. Mask2Former (Cheng et al., arXiv 2112.01527) instance segmentation with COCO's 80 thing
   classes, here transformers' ``Mask2FormerForUniversalSegmentation`` read from a local folder (e.g.
   ``facebook/mask2former-swin-small-coco-instance``; GenEval runs mmdetection's
   ``mask2former_swin-s-p4-w7-224_lsj_8x2_50e_coco``, the same architecture with other weights). The
   image processor's ``post_process_instance_segmentation`` scores every (query, class) pair by class
   probability times mean mask probability, as mmdetection's ``MaskFormerFusionHead`` does; each mask
   (binary, overlaps allowed) gives its box as the mask's extent, exclusive ends (mmdetection's
   ``mask2bbox``). COCO names become GenEval's (``COCO_TO_GENEVAL``: ``mouse`` -> ``computer mouse``, ...).
2. Selection, per class (``select_detections``): scores strictly above 0.3, or 0.9 for the
   ``counting`` tag; the ``MAX_OBJECTS`` most confident; then greedy non-maximum suppression at box IoU
   ``nms_threshold``, where 1.0, the reference's default ``max_overlap``, keeps all.
3. Colours (``ColorClassifier``), only for the objects a colour clause reads (the first ``count`` of its
   class): the image outside the object's mask is painted grey ``#999``, the object's box is cut out,
   and CLIP (GenEval: OpenAI ViT-L/14, i.e. ``openai/clip-vit-large-patch14``) picks one of GenEval's
   ten ``COLORS`` zero-shot, each colour's text embedding the normalised mean of three normalised
   prompts: "a photo of a {color} {object}", "a photo of a {color}-colored {object}" and "a photo of a
   {color} object" (the reference builds it with clip_benchmark's ``zero_shot_classifier``).

The kept, coloured detections are then judged by ``rules.evaluate``, as for the tiny world. Images are
quantised to 8 bits first, as the reference reads saved PNGs. Known differences from the reference:
transformers' Mask2Former port and image processor (its resize, and masks thresholded at 384 x 384 then
resized to the image by nearest neighbour) instead of mmdetection's, and the CLIP image processor's
tensor resize instead of PIL's; scores can differ on borderline objects.

``transformers`` is imported only when a model is loaded.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ..base import check_batch_size, chunk_slices, is_integer, quiet_loading
from ..clipscore import _pooled
from ..frozen import as_dtype, frozen
from . import COUNTING_THRESHOLD, THRESHOLD
from .rules import Detection

__all__ = [
    "CLASSES",
    "COCO_TO_GENEVAL",
    "COLORS",
    "COLOR_TEMPLATES",
    "ColorClassifier",
    "MAX_OBJECTS",
    "Mask2FormerSegmenter",
    "RealDetector",
    "Segment",
    "box_iou",
    "crop_object",
    "geneval_name",
    "load_real_detector",
    "mask_boxes",
    "select_detections",
]

CLASSES: tuple[str, ...] = (
    "person",
    "bicycle",
    "car",
    "motorcycle",
    "airplane",
    "bus",
    "train",
    "truck",
    "boat",
    "traffic light",
    "fire hydrant",
    "stop sign",
    "parking meter",
    "bench",
    "bird",
    "cat",
    "dog",
    "horse",
    "sheep",
    "cow",
    "elephant",
    "bear",
    "zebra",
    "giraffe",
    "backpack",
    "umbrella",
    "handbag",
    "tie",
    "suitcase",
    "frisbee",
    "skis",
    "snowboard",
    "sports ball",
    "kite",
    "baseball bat",
    "baseball glove",
    "skateboard",
    "surfboard",
    "tennis racket",
    "bottle",
    "wine glass",
    "cup",
    "fork",
    "knife",
    "spoon",
    "bowl",
    "banana",
    "apple",
    "sandwich",
    "orange",
    "broccoli",
    "carrot",
    "hot dog",
    "pizza",
    "donut",
    "cake",
    "chair",
    "couch",
    "potted plant",
    "bed",
    "dining table",
    "toilet",
    "tv",
    "laptop",
    "computer mouse",
    "tv remote",
    "computer keyboard",
    "cell phone",
    "microwave",
    "oven",
    "toaster",
    "sink",
    "refrigerator",
    "book",
    "clock",
    "vase",
    "scissors",
    "teddy bear",
    "hair drier",
    "toothbrush",
)
"""GenEval's 80 object names (its ``object_names.txt``): COCO's thing classes in COCO order, three renamed."""

COLORS: tuple[str, ...] = ("red", "orange", "yellow", "green", "blue", "purple", "pink", "brown", "black", "white")
"""GenEval's colour names, in the reference's order (the classifier's output order)."""

COLOR_TEMPLATES: tuple[str, ...] = (
    "a photo of a {color} {object}",
    "a photo of a {color}-colored {object}",
    "a photo of a {color} object",
)
"""GenEval's zero-shot prompts for an object's colour; ``{object}`` is its GenEval name."""

COCO_TO_GENEVAL: dict[str, str] = {
    "mouse": "computer mouse",
    "remote": "tv remote",
    "keyboard": "computer keyboard",
    # other spellings of COCO's names found in checkpoints' id2label (Pascal VOC style, detectron2's panoptic)
    "motorbike": "motorcycle",
    "aeroplane": "airplane",
    "sofa": "couch",
    "pottedplant": "potted plant",
    "diningtable": "dining table",
    "tvmonitor": "tv",
    "tv monitor": "tv",
    "hair dryer": "hair drier",
    "cellphone": "cell phone",
}
"""Segmenter label -> GenEval name, where they differ (after lower-casing, ``-``/``_`` read as spaces)."""

CROP_BACKGROUND = 0x99 / 255
"""Grey painted outside an object's mask before its colour is classified (the reference's ``#999``)."""
MAX_OBJECTS = 16
"""Most detections kept per class (the reference's ``max_objects``)."""


def geneval_name(label: str) -> str | None:
    """GenEval's name for a segmenter's class label, or None for a label GenEval does not use.

    Args:
        label: a class name from a checkpoint's ``config.id2label``, e.g. ``"mouse"`` or ``"dining-table"``.

    Returns:
        One of ``CLASSES`` (``"computer mouse"``, ``"dining table"``), or None (e.g. ``"sky-other"``).
    """
    name = " ".join(label.lower().replace("-", " ").replace("_", " ").split())
    name = COCO_TO_GENEVAL.get(name, name)
    return name if name in CLASSES else None


@dataclass(frozen=True)
class Segment(Detection):
    """A detection from the segmenter: a ``rules.Detection`` with its mask.

    Attributes:
        cls: GenEval object name, one of ``CLASSES``.
        color: one of ``COLORS`` once classified, else None.
        box: ``(x0, y0, x1, y1)`` in pixels of the input image, exclusive ends (the mask's extent).
        score: class probability times mean mask probability, in [0, 1].
        mask (`torch.Tensor` of shape `(H, W)`, bool, on CPU): the object's pixels; not compared or hashed.
    """

    mask: torch.Tensor | None = field(default=None, compare=False, repr=False)


def mask_boxes(masks: torch.Tensor) -> torch.Tensor:
    """Boxes of binary masks: each mask's pixel extent, exclusive ends (mmdetection's ``mask2bbox``).

    Args:
        masks (`torch.Tensor` of shape `(N, H, W)`, bool): non-empty masks.

    Returns:
        `torch.Tensor` of shape `(N, 4)`, float32, on the masks' device: ``(x0, y0, x1, y1)`` in pixels.
    """
    masks = masks.bool()
    cols, rows = masks.any(1), masks.any(2)  # (N, W), (N, H)
    x = torch.arange(masks.shape[2], device=masks.device)
    y = torch.arange(masks.shape[1], device=masks.device)
    big = max(masks.shape[1:]) + 1
    x0 = torch.where(cols, x, big).amin(1)
    x1 = torch.where(cols, x, -1).amax(1) + 1
    y0 = torch.where(rows, y, big).amin(1)
    y1 = torch.where(rows, y, -1).amax(1) + 1
    return torch.stack([x0, y0, x1, y1], 1).float()  # (N, 4)


def box_iou(a: Sequence[float], b: Sequence[float]) -> float:
    """Box IoU as the reference's ``compute_iou`` (sides counted as ``x1 - x0 + 1``), for its NMS.

    Args:
        a, b: boxes ``(x0, y0, x1, y1)`` in pixels.

    Returns:
        Intersection over union in [0, 1] (0 when the union is empty).
    """

    def area(box: Sequence[float]) -> float:
        return max(box[2] - box[0] + 1, 0) * max(box[3] - box[1] + 1, 0)

    inter = area([max(a[0], b[0]), max(a[1], b[1]), min(a[2], b[2]), min(a[3], b[3])])
    union = area(a) + area(b) - inter
    return inter / union if union else 0.0


def select_detections(
    detections: Sequence[Detection],
    metadata: Mapping[str, Any],
    threshold: float = THRESHOLD,
    counting_threshold: float = COUNTING_THRESHOLD,
    max_objects: int = MAX_OBJECTS,
    nms_threshold: float = 1.0,
) -> list[Detection]:
    """The detections GenEval keeps, per class (``evaluate_image`` of the reference).

    Per class, by descending score: scores strictly above ``counting_threshold`` for the ``counting``
    tag, else above ``threshold``; the first ``max_objects``; then greedily, each kept box drops the later
    ones whose ``box_iou`` with it is ``>= nms_threshold`` (none when ``nms_threshold == 1``).

    Args:
        detections: one image's detections, any order.
        metadata: its GenEval metadata; only ``tag`` is read.
        threshold, counting_threshold: GenEval's confidence thresholds, in [0, 1].
        max_objects: most detections kept per class, >= 1.
        nms_threshold: box IoU at which a less confident box of the same class is dropped, in (0, 1].

    Returns:
        The kept detections, grouped by class in order of first appearance, each class by descending score.
    """
    cutoff = counting_threshold if metadata.get("tag") == "counting" else threshold
    by_class: dict[str, list[Detection]] = {}
    for det in sorted(detections, key=lambda d: -d.score):
        if det.score > cutoff:
            by_class.setdefault(det.cls, []).append(det)
    kept = []
    for candidates in by_class.values():
        candidates = candidates[:max_objects]
        while candidates:
            best = candidates.pop(0)
            kept.append(best)
            if nms_threshold < 1:
                candidates = [d for d in candidates if box_iou(best.box, d.box) < nms_threshold]
    return kept


def crop_object(image: torch.Tensor, segment: Detection) -> torch.Tensor:
    """An object as GenEval shows it to CLIP: grey ``CROP_BACKGROUND`` outside its mask, cut to its box.

    Args:
        image (`torch.Tensor` of shape `(3, H, W)`, float, values in `[0, 1]`).
        segment: the object; its ``mask`` (a ``Segment``'s) is `(H, W)` bool (absent or None: no masking),
            its ``box`` lies in the image.

    Returns:
        `torch.Tensor` of shape `(3, y1 - y0, x1 - x0)` (at least 1 x 1), float, on the image's device.
    """
    mask = getattr(segment, "mask", None)
    if mask is not None:
        image = torch.where(mask.to(image.device), image, image.new_tensor(CROP_BACKGROUND))
    x0, y0, x1, y1 = (int(round(v)) for v in segment.box)
    x1, y1 = max(x1, x0 + 1), max(y1, y0 + 1)
    return image[:, y0:y1, x0:x1]


class Mask2FormerSegmenter:
    """Mask2Former instance segmentation -> ``Segment`` records (step 1 of the module docstring).

    Mask2Former: Cheng et al., arXiv 2112.01527; transformers' ``modeling_mask2former.py`` and
    ``image_processing_mask2former.py``. Build it with ``load_real_detector``, or directly around a model
    and image processor in memory.

    Args:
        model (`transformers.Mask2FormerForUniversalSegmentation`): put in eval mode, frozen, moved to
            ``device`` and ``dtype``.
        processor (`transformers.Mask2FormerImageProcessor`): its resize and normalisation are used.
        device, dtype: where and in which floating dtype the model runs.
        size (`int`, *optional*): shortest image side the model sees (longest at most ``size * 1333 / 800``);
            None: the processor's own size (GenEval's mmdetection pipeline uses 800).
        threshold (`float`): lowest score kept by post-processing (GenEval's 0.3 keeps what it may use).
        batch_size (`int`, *optional*): images per forward; None: the whole batch.

    Raises:
        ValueError: ``model.config.id2label`` names none of GenEval's ``CLASSES``.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        processor: Any,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | str = torch.float32,
        size: int | None = None,
        threshold: float = THRESHOLD,
        batch_size: int | None = None,
    ):
        self.device, self.dtype = torch.device(device), as_dtype(dtype, "geneval")
        self.model = frozen(model, self.device, self.dtype)
        self.processor = processor
        self.labels = {int(i): geneval_name(str(label)) for i, label in model.config.id2label.items()}
        if not any(self.labels.values()):
            raise ValueError(
                f"geneval: the segmenter's classes {sorted(model.config.id2label.values())[:5]}... include none "
                "of GenEval's COCO classes; use a COCO instance checkpoint such as "
                "facebook/mask2former-swin-small-coco-instance"
            )
        self.size = None if size is None else {"shortest_edge": int(size), "longest_edge": round(size * 1333 / 800)}
        self.threshold, self.batch_size = threshold, batch_size

    @property
    def classes(self) -> tuple[str, ...]:
        """The GenEval object names this segmenter can detect."""
        return tuple(sorted({name for name in self.labels.values() if name}))

    @torch.no_grad()
    def forward(self, images: torch.Tensor) -> Any:
        """Run the model on a batch.

        Args:
            images (`torch.Tensor` of shape `(B, 3, H, W)`, float, values in `[0, 1]`, any device).

        Returns:
            A ``Mask2FormerForUniversalSegmentationOutput`` with ``class_queries_logits`` `(B, Q, C + 1)` and
            ``masks_queries_logits`` `(B, Q, h, w)`, float32, on CPU (``h, w``: the model input's over 4).
        """
        kwargs = {} if self.size is None else {"size": self.size}
        inputs = self.processor(
            images=images.to(self.device),
            do_rescale=False,
            return_tensors="pt",
            input_data_format="channels_first",
            **kwargs,
        )
        out = self.model(
            pixel_values=inputs["pixel_values"].to(self.device, self.dtype),
            pixel_mask=inputs["pixel_mask"].to(self.device),
        )
        # post-processing indexes CPU tensors with these, so it runs on CPU
        out.class_queries_logits = out.class_queries_logits.float().cpu()
        out.masks_queries_logits = out.masks_queries_logits.float().cpu()
        return out

    def records(self, outputs: Any, image_size: tuple[int, int]) -> list[list[Segment]]:
        """Post-process model outputs into ``Segment`` records (``color`` None).

        Args:
            outputs: as :meth:`forward` returns (or any object with those two logits fields).
            image_size: ``(H, W)`` of the input images, in pixels.

        Returns:
            One list per image of ``Segment(cls, None, box, score, mask)`` with score >= ``threshold``,
            a non-empty mask and a class in ``CLASSES``; masks `(H, W)` bool on CPU.
        """
        results = self.processor.post_process_instance_segmentation(
            outputs, threshold=self.threshold, return_binary_maps=True
        )
        batch = []
        for result in results:
            infos = result["segments_info"]
            if not infos:
                batch.append([])
                continue
            binary = result["segmentation"].float()[None]  # (1, N, 384, 384)
            masks = F.interpolate(binary, size=tuple(image_size), mode="nearest")[0].bool()  # (N, H, W)
            boxes = mask_boxes(masks).tolist()  # (N, 4)
            segments = []
            for info, mask, box in zip(infos, masks, boxes):
                name = self.labels.get(int(info["label_id"]))
                if name is not None and mask.any():
                    segments.append(Segment(name, None, tuple(box), float(info["score"]), mask.cpu()))
            batch.append(segments)
        return batch

    def __call__(self, images: torch.Tensor) -> list[list[Segment]]:
        """``records(forward(images))``, in chunks of ``batch_size``: one list of segments per image."""
        out: list[list[Segment]] = []
        for chunk in chunk_slices(len(images), self.batch_size):
            out += self.records(self.forward(images[chunk]), tuple(images.shape[-2:]))
        return out


class ColorClassifier:
    """GenEval's zero-shot CLIP colour classifier (step 3 of the module docstring).

    CLIP: Radford et al., arXiv 2103.00020, transformers' ``modeling_clip.py``; the classifier follows
    clip_benchmark's ``zero_shot_classifier`` and ``run_classification`` as GenEval calls them.

    Args:
        model (`transformers.CLIPModel`): put in eval mode, frozen, moved to ``device`` and ``dtype``.
        tokenizer: the CLIP tokenizer of ``model``.
        image_processor (`transformers.CLIPImageProcessor`): resizes, centre-crops and normalises crops.
        device, dtype: where and in which floating dtype the model runs.
        batch_size (`int`, *optional*): crops per forward; None: all at once.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        image_processor: Any,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | str = torch.float32,
        batch_size: int | None = None,
    ):
        self.device, self.dtype = torch.device(device), as_dtype(dtype, "geneval")
        self.model = frozen(model, self.device, self.dtype)
        self.tokenizer, self.image_processor, self.batch_size = tokenizer, image_processor, batch_size
        self.max_length = min(tokenizer.model_max_length, model.config.text_config.max_position_embeddings)
        self._weights: dict[str, torch.Tensor] = {}

    @torch.no_grad()
    def text_weights(self, object_name: str) -> torch.Tensor:
        """Zero-shot weights for one object name (cached): per colour, the normalised mean of the
        normalised text embeddings of ``COLOR_TEMPLATES``.

        Returns:
            `torch.Tensor` of shape `(len(COLORS), D)`, float32, unit rows, on ``device``.
        """
        if object_name not in self._weights:
            texts = [t.format(color=c, object=object_name) for c in COLORS for t in COLOR_TEMPLATES]
            tokens = self.tokenizer(
                texts, padding=True, truncation=True, max_length=self.max_length, return_tensors="pt"
            ).to(self.device)
            emb = _pooled(self.model.get_text_features(tokens["input_ids"], tokens["attention_mask"])).float()
            emb = F.normalize(emb, dim=-1).view(len(COLORS), len(COLOR_TEMPLATES), -1).mean(1)  # (K, D)
            self._weights[object_name] = F.normalize(emb, dim=-1)
        return self._weights[object_name]

    @torch.no_grad()
    def logits(self, crops: Sequence[torch.Tensor], object_names: Sequence[str]) -> torch.Tensor:
        """Colour logits of object crops: ``100 * normalised image embedding @ text_weights(name).T``.

        Args:
            crops: `N` tensors `(3, h, w)`, float in `[0, 1]` (as ``crop_object`` returns).
            object_names: `N` GenEval object names, one per crop.

        Returns:
            `torch.Tensor` of shape `(N, len(COLORS))`, float32, on CPU, in [-100, 100].
        """
        rows = []
        for chunk in chunk_slices(len(crops), self.batch_size):
            pixels = self.image_processor(
                images=[c.float().cpu() for c in crops[chunk]],
                do_rescale=False,
                return_tensors="pt",
                input_data_format="channels_first",
            )["pixel_values"]
            image = _pooled(self.model.get_image_features(pixel_values=pixels.to(self.device, self.dtype)))
            image = F.normalize(image.float(), dim=-1)  # (n, D)
            weights = torch.stack([self.text_weights(n) for n in object_names[chunk]])  # (n, K, D)
            rows.append(100.0 * torch.einsum("nd,nkd->nk", image, weights).cpu())
        return torch.cat(rows) if rows else torch.zeros(0, len(COLORS))

    def classify(self, crops: Sequence[torch.Tensor], object_names: Sequence[str]) -> list[str]:
        """The most likely colour of each crop: ``COLORS[argmax logits]``."""
        if not crops:
            return []
        return [COLORS[i] for i in self.logits(crops, object_names).argmax(1).tolist()]


def _color_needs(metadata: Mapping[str, Any]) -> dict[str, int]:
    """Object name -> how many of its most confident detections colour clauses read."""
    needs: dict[str, int] = {}
    for clause in metadata.get("include", []):
        if "color" in clause:
            needs[clause["class"]] = max(needs.get(clause["class"], 0), int(clause["count"]))
    return needs


@dataclass
class RealDetector:
    """The real-image GenEval detector: segment, select as GenEval, classify the colours clauses read.

    Attributes:
        segmenter: a ``Mask2FormerSegmenter``.
        colors: a ``ColorClassifier``.
        max_objects: most detections kept per class (``select_detections``).
        nms_threshold: box IoU for per-class suppression, in (0, 1]; 1.0 (GenEval's default) keeps all.
    """

    segmenter: Mask2FormerSegmenter
    colors: ColorClassifier
    max_objects: int = MAX_OBJECTS
    nms_threshold: float = 1.0

    def __post_init__(self):
        if not is_integer(self.max_objects) or self.max_objects < 1:
            raise ValueError(f"geneval: max_objects must be an integer >= 1, got {self.max_objects!r}")
        if isinstance(self.nms_threshold, bool) or not 0 < float(self.nms_threshold) <= 1:
            raise ValueError(
                f"geneval: nms_threshold must be a box IoU in (0, 1] (1 = no suppression), got {self.nms_threshold!r}"
            )

    @property
    def classes(self) -> tuple[str, ...]:
        """The GenEval object names the segmenter can detect."""
        return self.segmenter.classes

    def finish(
        self, images: torch.Tensor, segments: Sequence[Sequence[Segment]], metadata: Sequence[Mapping[str, Any]]
    ) -> list[list[Detection]]:
        """Select each image's segments as GenEval and set the colours its colour clauses read.

        Args:
            images (`torch.Tensor` of shape `(B, 3, H, W)`, float in `[0, 1]`): the segmented images.
            segments: `B` lists of ``Segment`` (as ``Mask2FormerSegmenter`` returns).
            metadata: `B` GenEval metadata dicts.

        Returns:
            `B` lists of kept detections, ``color`` set on the first ``count`` of each colour clause's class.
        """
        kept = [
            select_detections(s, m, max_objects=self.max_objects, nms_threshold=self.nms_threshold)
            for s, m in zip(segments, metadata)
        ]
        jobs = []  # (image index, index in kept, crop, object name)
        for b, (dets, meta) in enumerate(zip(kept, metadata)):
            for name, count in _color_needs(meta).items():
                positions = [i for i, d in enumerate(dets) if d.cls == name][:count]
                if len(positions) < count:  # the clause fails on the count; GenEval classifies nothing
                    continue
                jobs += [(b, i, crop_object(images[b], dets[i]), name) for i in positions]
        colors = self.colors.classify([j[2] for j in jobs], [j[3] for j in jobs])
        for (b, i, _, _), color in zip(jobs, colors):
            kept[b][i] = replace(kept[b][i], color=color)
        return kept

    def __call__(self, images: torch.Tensor, metadata: Sequence[Mapping[str, Any]]) -> list[list[Detection]]:
        """Detections GenEval's rules read, per image.

        Args:
            images (`torch.Tensor` of shape `(B, 3, H, W)`, float, values in `[0, 1]`, any device).
            metadata: `B` GenEval metadata dicts.

        Returns:
            `B` lists of ``Segment`` (see :meth:`finish`).
        """
        images = (images.detach().float().clamp(0, 1) * 255).round() / 255  # 8-bit, as saved PNGs
        return self.finish(images, self.segmenter(images), metadata)


def _config(path: str | os.PathLike | None, option: str, model_type: str, example: str) -> Path:
    """Check that ``path`` is a local folder holding a ``model_type`` checkpoint; one-line errors."""
    if path is None:
        raise ValueError(
            f"geneval: the real-image backend needs {option}, a local {model_type} folder such as {example}"
        )
    folder = Path(path)
    if not folder.is_dir():
        raise FileNotFoundError(
            f"geneval: {option} '{path}' is not a local folder; download it first "
            f"(`hf download {example} --local-dir <folder>`) and pass the folder"
        )
    config = folder / "config.json"
    try:
        found = json.loads(config.read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        raise FileNotFoundError(
            f"geneval: {option} '{path}' has no readable config.json; expected a {model_type} "
            f"checkpoint such as {example}"
        ) from None
    if found != model_type:
        raise ValueError(
            f"geneval: {option} '{path}' holds a {found!r} model, expected a {model_type!r} checkpoint "
            f"such as {example}"
        )
    return folder


def _load_error(option: str, path: Any, what: str, err: Exception) -> OSError:
    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return OSError(f"geneval: cannot load the {what} from {option} '{path}' ({first})")


def load_real_detector(
    segmenter_path: str | os.PathLike | None,
    clip_path: str | os.PathLike | None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | str = torch.float32,
    segmenter_size: int | None = None,
    max_objects: int = MAX_OBJECTS,
    nms_threshold: float = 1.0,
    batch_size: int | None = None,
) -> RealDetector:
    """Load GenEval's real-image detector from local folders (nothing is downloaded).

    Args:
        segmenter_path: folder of a transformers Mask2Former COCO instance checkpoint (``config.json``
            with ``model_type: mask2former``, weights, ``preprocessor_config.json``), e.g.
            ``facebook/mask2former-swin-small-coco-instance``.
        clip_path: folder of a transformers ``CLIPModel`` with its tokenizer and image processor;
            GenEval's is ``openai/clip-vit-large-patch14``.
        device, dtype: where and in which floating dtype both models run (e.g. ``"cuda"``, ``"bfloat16"``).
        segmenter_size: shortest image side the segmenter sees; None: its processor's (GenEval: 800).
        max_objects: most detections kept per class (GenEval: 16).
        nms_threshold: per-class box IoU suppression threshold in (0, 1]; 1.0 (GenEval's default) keeps all.
        batch_size: images per segmenter forward and crops per CLIP forward; None: all at once.

    Returns:
        A ``RealDetector``: ``(images (B, 3, H, W) float in [0, 1], metadata) -> B lists of detections``.

    Raises:
        ValueError: a path is None, or its ``config.json`` is not of a Mask2Former (``segmenter_path``) or
            CLIP (``clip_path``) model, or the segmenter knows none of GenEval's classes, or an option
            is out of range (each message names the option).
        FileNotFoundError: a path is not a local folder or has no readable ``config.json``.
        OSError: the weights, tokenizer or image processor cannot be loaded (the option is named).
    """
    from transformers import AutoImageProcessor, AutoTokenizer, CLIPModel, Mask2FormerForUniversalSegmentation

    if segmenter_size is not None and (not is_integer(segmenter_size) or segmenter_size < 32):
        raise ValueError(f"geneval: segmenter_size must be an integer >= 32 or null, got {segmenter_size!r}")
    check_batch_size(batch_size, "geneval")
    seg_dir = _config(segmenter_path, "segmenter_path", "mask2former", "facebook/mask2former-swin-small-coco-instance")
    clip_dir = _config(clip_path, "clip_path", "clip", "openai/clip-vit-large-patch14")
    try:
        with quiet_loading():
            seg_model = Mask2FormerForUniversalSegmentation.from_pretrained(seg_dir, local_files_only=True)
        seg_processor = AutoImageProcessor.from_pretrained(seg_dir, local_files_only=True)
    except (OSError, ValueError) as err:
        raise _load_error("segmenter_path", segmenter_path, "Mask2Former model and image processor", err) from err
    try:
        with quiet_loading():
            clip_model = CLIPModel.from_pretrained(clip_dir, local_files_only=True)
        tokenizer = AutoTokenizer.from_pretrained(clip_dir, local_files_only=True)
        clip_processor = AutoImageProcessor.from_pretrained(clip_dir, local_files_only=True)
    except (OSError, ValueError) as err:
        raise _load_error("clip_path", clip_path, "CLIP model, tokenizer and image processor", err) from err
    segmenter = Mask2FormerSegmenter(seg_model, seg_processor, device, dtype, segmenter_size, batch_size=batch_size)
    colors = ColorClassifier(clip_model, tokenizer, clip_processor, device, dtype, batch_size)
    return RealDetector(segmenter, colors, max_objects, nms_threshold)
