"""OCR text-accuracy reward: does the image show the text quoted in its prompt?

The score is Flow-GRPO's (Liu et al., arXiv 2505.05470; reference `flow_grpo/ocr.py`, class
`OcrScorer`, with `ocr_score` in `flow_grpo/rewards.py`), computed per image as:

1. target: the text between the first pair of ASCII double quotes of the prompt, i.e. Python's
   `prompt.split('"')[1]` (`'a sign saying "Open 24 Hours" in neon'` -> `Open 24 Hours`). A prompt with
   one quote only gives the rest of the prompt after it, as in Flow-GRPO; typographic quotes are not
   quotes.
2. normalisation, of both the target and the recognised text: `text.replace(" ", "").lower()` (ASCII
   spaces removed, lower-cased; punctuation and digits kept). The recognised text is the engine's text
   lines joined with no separator.
3. `d = 0` when the normalised target is a substring of the normalised recognised text (extra text in
   the image costs nothing), else the Levenshtein distance between them; then
   `score = 1 - min(d, len(target)) / len(target)`, in `[0, 1]`.

The default engine is RapidOCR (PaddleOCR's PP-OCR detection and recognition models in ONNX, shipped
inside the `rapidocr` wheel, run by onnxruntime on CPU, offline); Flow-GRPO runs PaddleOCR itself
(`lang="en"`, no angle classifier), so absolute scores differ slightly between the two engines. Any
callable `(uint8 (H, W, 3) RGB numpy image) -> str` can replace it.

Where this differs from Flow-GRPO on purpose: a prompt without quotes (an IndexError there) or with
empty quoted text (a division by zero there) raises a clear error naming the prompt, or scores 0 with
`unquoted="zero"`; an engine that fails raises instead of scoring 0; and the engine gets the image in
RGB and RapidOCR is handed BGR, as it expects (Flow-GRPO hands PaddleOCR the RGB array, which it reads
as BGR: only coloured text is affected).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import numpy as np
import torch

from .base import _import_dotted, check_inputs, register_reward

__all__ = ["OcrReward", "RapidOcrEngine", "levenshtein", "normalize_text", "ocr", "ocr_accuracy", "quoted_text"]

OcrEngine = Callable[[np.ndarray], str]
"""`engine(image) -> text`: `image` a `(H, W, 3)` uint8 RGB numpy array, `text` every line read, joined."""


def quoted_text(prompt: str) -> str | None:
    """The text an OCR prompt asks to be rendered, by Flow-GRPO's rule `prompt.split('"')[1]`.

    Args:
        prompt (`str`): e.g. `'a storefront with a sign reading "Fresh Bread"'`.

    Returns:
        `str`: the text after the first `"` up to the next `"` (or to the end of the prompt when there is
        no second quote), unnormalised; `None` when the prompt has no `"`.
    """
    parts = prompt.split('"')
    return parts[1] if len(parts) > 1 else None


def normalize_text(text: str) -> str:
    """Flow-GRPO's normalisation of OCR and target text: ASCII spaces removed, then `str.lower()`.

    Args:
        text (`str`): any text.

    Returns:
        `str`: `text.replace(" ", "").lower()`; tabs, newlines and punctuation are kept.
    """
    return text.replace(" ", "").lower()


def levenshtein(a: str, b: str) -> int:
    """Edit distance: the fewest single-character insertions, deletions and substitutions turning `a` into `b`.

    Args:
        a (`str`), b (`str`): any strings (compared by Unicode code point).

    Returns:
        `int` in `[abs(len(a) - len(b)), max(len(a), len(b))]`; 0 iff `a == b`.
    """
    if len(a) < len(b):
        a, b = b, a
    previous = list(range(len(b) + 1))  # distances from a[:0] to each prefix of b
    for i, char_a in enumerate(a, start=1):
        current = [i]
        for j, char_b in enumerate(b, start=1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (char_a != char_b)))
        previous = current
    return previous[-1]


def ocr_accuracy(recognized: str, target: str, substring_match: bool = True) -> float:
    """Flow-GRPO's text accuracy of recognised text against the target text.

    Args:
        recognized (`str`): what OCR read in the image (raw; normalised here).
        target (`str`): the text the prompt asked for (raw; normalised here).
        substring_match (`bool`, default True): score 1 whenever the normalised target occurs inside the
            normalised recognised text, as Flow-GRPO's image scorer `OcrScorer` does; False scores the
            plain edit distance, as its video scorer `OcrScorer_video_or_image` does.

    Returns:
        `float` in `[0, 1]`: `1 - min(d, len(t)) / len(t)`, with `t` the normalised target and `d` its
        Levenshtein distance to the normalised recognised text (0 on a substring match).

    Raises:
        ValueError: the target is empty once normalised (nothing to read; the score would divide by 0).
    """
    reference = normalize_text(target)
    if not reference:
        raise ValueError(f"ocr: target text {target!r} is empty once spaces are removed; quote the text to render")
    read = normalize_text(recognized)
    distance = 0 if substring_match and reference in read else levenshtein(read, reference)
    return 1.0 - min(distance, len(reference)) / len(reference)


class RapidOcrEngine:
    """RapidOCR as an `OcrEngine`: detection + recognition (no angle classifier, as Flow-GRPO).

    The ONNX models ship inside the `rapidocr` wheel (PP-OCR detection and recognition, Chinese and
    English characters), so this runs offline. Settings follow the PaddleOCR 2.x defaults that Flow-GRPO
    runs with: the detector sees the image with its longer side capped at 960 px (never upscaled), and
    lines scoring under `text_score` are dropped (0.5, PaddleOCR's `drop_score`); the rest are joined in
    reading order with no separator.

    Args:
        text_score (`float` in `[0, 1]`, default 0.5): minimum recognition confidence of a kept line.
        params (`Mapping`, *optional*): further `rapidocr.RapidOCR(params=...)` settings, e.g.
            `{"EngineConfig.onnxruntime.intra_op_num_threads": 2}`.

    Raises:
        ImportError: `rapidocr` (with `onnxruntime`) is not installed; the message names the extra.
        ValueError: `text_score` outside `[0, 1]`.
    """

    def __init__(self, text_score: float = 0.5, params: Mapping[str, Any] | None = None):
        try:
            from rapidocr import RapidOCR
        except ImportError as err:
            raise ImportError("ocr: the default engine needs `pip install rapidocr onnxruntime`") from err
        if not 0 <= text_score <= 1:
            raise ValueError(f"ocr: text_score must lie in [0, 1], got {text_score!r}")
        settings = {
            "Global.log_level": "error",
            "Global.use_cls": False,
            "Global.text_score": float(text_score),
            "Det.limit_type": "max",  # PaddleOCR 2.x's detector sizing: longer side capped at 960, never upscaled
            "Det.limit_side_len": 960,
        }
        self.engine = RapidOCR(params={**settings, **dict(params or {})})

    def __call__(self, image: np.ndarray) -> str:
        """Read all text in `image`, a `(H, W, 3)` uint8 RGB array; returns the lines joined ('' if none)."""
        result = self.engine(np.ascontiguousarray(image[..., ::-1]))  # RapidOCR takes arrays as BGR
        return "".join(result.txts or ())


class OcrReward:
    """Score each image by how well OCR reads back the text quoted in its prompt (see the module doc).

    Use the `ocr` factory from configs; build this class directly to pass an engine object.

    Args:
        engine (`OcrEngine`): callable `(uint8 (H, W, 3) RGB numpy image) -> str`.
        unquoted (`"error"` or `"zero"`, default `"error"`): what a prompt without a `"` gets: an error
            naming it (the prompt set is not an OCR set), or a score of 0 (a mixed prompt set).
        substring_match (`bool`, default True): see `ocr_accuracy`.

    Returns (when called):
        `torch.Tensor` of shape `(B,)`, float32, on CPU: text accuracy in `[0, 1]`, 1 when the quoted text
        is read exactly (spaces and case ignored), 0 when nothing like it is read.

    Raises (when called):
        TypeError / ValueError: malformed inputs (see `rewards.base.check_inputs`).
        ValueError: a prompt has no quoted text (with `unquoted="error"`) or an empty one; the message
            gives its index and text. Raised before any image is read.
        TypeError: the engine returned something other than a `str`.
    """

    name = "ocr"

    def __init__(self, engine: OcrEngine, unquoted: Literal["error", "zero"] = "error", substring_match: bool = True):
        if not callable(engine):
            raise TypeError(f"ocr: engine must be a callable (image -> str), got {type(engine).__name__}")
        if unquoted not in ("error", "zero"):
            raise ValueError(f"ocr: unquoted must be 'error' or 'zero', got {unquoted!r}")
        if not isinstance(substring_match, bool):
            raise TypeError(f"ocr: substring_match must be true or false, got {substring_match!r}")
        self.engine, self.unquoted, self.substring_match = engine, unquoted, substring_match

    def targets(self, prompts: Sequence[str]) -> list[str | None]:
        """The quoted text of each prompt (`None` for an unquoted prompt with `unquoted="zero"`).

        Raises:
            ValueError: as the class says (no quoted text with `unquoted="error"`, or empty quoted text).
        """
        targets = []
        for i, prompt in enumerate(prompts):
            target = quoted_text(prompt)
            if target is None and self.unquoted == "error":
                raise ValueError(
                    f"ocr: prompts[{i}] has no text in double quotes to read back: {prompt!r}; write the text as "
                    '"..." in the prompt, or set unquoted: zero to score such prompts 0'
                )
            if target is not None and not normalize_text(target):
                raise ValueError(f"ocr: prompts[{i}] quotes empty text: {prompt!r}")
            targets.append(target)
        return targets

    @torch.no_grad()
    def __call__(
        self, images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]]
    ) -> torch.Tensor:
        check_inputs(images, prompts, metadata)
        targets = self.targets(prompts)
        pixels = (images.detach().float() * 255).round().clamp(0, 255).to(torch.uint8)  # (B, 3, H, W)
        pixels = pixels.permute(0, 2, 3, 1).cpu().numpy()  # (B, H, W, 3)
        scores = []
        for image, target in zip(pixels, targets):
            if target is None:
                scores.append(0.0)
                continue
            text = self.engine(image)
            if not isinstance(text, str):
                raise TypeError(f"ocr: the engine returned {type(text).__name__}; it must return the text read, a str")
            scores.append(ocr_accuracy(text, target, self.substring_match))
        return torch.tensor(scores, dtype=torch.float32)


@register_reward("ocr", modality="image", weights="none (RapidOCR's ONNX models ship in its wheel)")
def ocr(
    engine: str | OcrEngine | None = None,
    unquoted: Literal["error", "zero"] = "error",
    substring_match: bool = True,
    text_score: float = 0.5,
) -> OcrReward:
    """Text-rendering accuracy of Flow-GRPO's OCR task (arXiv 2505.05470, `flow_grpo/ocr.py`).

    Args:
        engine (`str`, callable or `None`, default `None`): the OCR engine. `None`: RapidOCR, offline on
            CPU (`RapidOcrEngine`). A callable `(uint8 (H, W, 3) RGB numpy image) -> str`, or its
            `"package.module:attr"` path from a config.
        unquoted (`"error"` or `"zero"`, default `"error"`): a prompt with no `"` raises (naming it), or
            scores 0.
        substring_match (`bool`, default True): a target found inside longer read text scores 1 (Flow-GRPO's
            image rule); False scores the plain edit distance.
        text_score (`float` in `[0, 1]`, default 0.5): RapidOCR's minimum line confidence (default engine
            only).

    Returns:
        An `OcrReward`, scoring `(B, 3, H, W)` images in `[0, 1]` to `(B,)` float32 CPU tensors in `[0, 1]`.

    Raises:
        ValueError: `unquoted` not `"error"`/`"zero"`, `text_score` outside `[0, 1]` or given with a custom
            engine, or an engine path that does not resolve.
        TypeError: `engine` is neither `None`, a path nor a callable.
        ImportError: the default engine without `rapidocr` installed.
    """
    if isinstance(engine, str):
        engine = _import_dotted(engine)
    elif engine is not None and not callable(engine):
        raise TypeError(
            f"ocr: engine must be null, 'package.module:function' or a callable, got {type(engine).__name__}"
        )
    if engine is None:
        engine = RapidOcrEngine(text_score=text_score)
    elif text_score != 0.5:
        raise ValueError("ocr: text_score applies to the default RapidOCR engine only; configure your engine instead")
    return OcrReward(engine, unquoted=unquoted, substring_match=substring_match)
