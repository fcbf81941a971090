"""PickScore: a CLIP ViT-H/14 fine-tuned on Pick-a-Pic human preferences (Kirstain et al., arXiv 2305.01569).

The score is the `ClipScore` one, `logit_scale.exp() * cos(image, text)`, as in the inference
snippet of the reference README (github.com/yuvalkirstain/PickScore) and flow_grpo's
`flow_grpo/pickscore_scorer.py`; this module only adds PickScore's hub ids as defaults and an
optional divisor. The model is `yuvalkirstain/PickScore_v1`, its tokenizer and image processor
come from `laion/CLIP-ViT-H-14-laion2B-s32B-b79K`.
"""

from __future__ import annotations

import math
import numbers
import os
from collections.abc import Sequence
from typing import Any

import torch

from .base import register_reward
from .clipscore import ClipScore, _load_clip
from .options import PICKSCORE_MODEL, PICKSCORE_PROCESSOR

__all__ = ["PICKSCORE_MODEL", "PICKSCORE_PROCESSOR", "PickScore", "pickscore"]


def _check_scale(scale: Any) -> float:
    """`scale` as a float, refusing anything but a finite number > 0 (bools included)."""
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"pickscore: scale must be a finite number > 0, got {scale!r}")
    return float(scale)


class PickScore(ClipScore):
    """A `ClipScore` whose scores are divided by `scale`.

    Args:
        *args, **kwargs: as `ClipScore` (model, tokenizer, image_mean, image_std, device, dtype,
            batch_size).
        scale (`float > 0`, default 1): scores are `logit_scale.exp() * cos(image, text) / scale`.

    Returns (when called):
        `torch.Tensor` of shape `(B,)`, float32, on CPU. With `scale=1`, raw PickScore in
        `[-100, 100]`; matching pairs typically score 18-24. Only differences between images of one
        prompt are meaningful.

    Raises:
        ValueError: `scale` is not a finite number > 0 (and see `ClipScore`).
    """

    name = "pickscore"

    def __init__(self, *args: Any, scale: float = 1.0, **kwargs: Any):
        self.scale = _check_scale(scale)
        super().__init__(*args, **kwargs)

    def _score(self, images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        """One chunk: `(b, 3, H, W)` images and `b` prompts -> `(b,)` float32 CPU scores / `scale`."""
        return super()._score(images, prompts) / self.scale


@register_reward(
    "pickscore",
    modality="image",
    weights="yuvalkirstain/PickScore_v1 + laion/CLIP-ViT-H-14-laion2B-s32B-b79K processor (hub ids)",
    differentiable=True,
)
def pickscore(
    model_path: str | os.PathLike = PICKSCORE_MODEL,
    processor_path: str | os.PathLike = PICKSCORE_PROCESSOR,
    scale: float = 1.0,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | str = torch.float32,
    batch_size: int | None = None,
) -> PickScore:
    """Load the PickScore reward from local folders or hub ids already in the local HF cache.

    Nothing is downloaded: fetch the two repositories first, e.g.
    `hf download yuvalkirstain/PickScore_v1` and `hf download laion/CLIP-ViT-H-14-laion2B-s32B-b79K`
    (into the cache, then the defaults work), or with `--local-dir` and pass the folders.

    Args:
        model_path (`str` or path, default `"yuvalkirstain/PickScore_v1"`): folder of the PickScore
            `CLIPModel` (`config.json` + weights), or a cached hub id.
        processor_path (`str` or path, default `"laion/CLIP-ViT-H-14-laion2B-s32B-b79K"`): folder or
            cached hub id with the CLIP tokenizer and `preprocessor_config.json` (resize the shorter
            side to 224 bicubic, centre crop 224, OpenAI mean/std).
        scale (`float > 0`, default 1): divide scores by this. Default: raw PickScore (about 18-24
            for matching pairs). flow_grpo reports PickScore / 26 (roughly 0.8-0.9); pass `scale: 26`
            to compare curves with its numbers. Reward weights belong in the config, not here.
        device (`str` or `torch.device`, default `"cpu"`): where the model runs.
        dtype (`torch.dtype` or `str`, default float32): weight dtype, e.g. `"bfloat16"` on GPU.
        batch_size (`int >= 1`, *optional*): images per forward (bounds ViT-H memory); default the
            whole batch.

    Returns:
        A `PickScore`, scoring `(B, 3, H, W)` images in `[0, 1]` to `(B,)` float32 CPU tensors.

    Raises:
        FileNotFoundError: a path is neither a local folder nor a cached hub id, or `model_path` has
            no `config.json` (the message starts with `pickscore:` and names the path).
        OSError: no CLIP tokenizer and image processor in `processor_path`.
        ValueError: bad `scale`, `dtype` or `batch_size`.
    """
    _check_scale(scale)  # before loading a ViT-H
    model, tokenizer, image_processor = _load_clip(model_path, processor_path, "pickscore")
    return PickScore(
        model,
        tokenizer,
        image_processor.image_mean,
        image_processor.image_std,
        device,
        dtype,
        batch_size,
        scale=scale,
    )
