"""JPEG (in)compressibility rewards of DDPO (Black et al., arXiv 2305.13301).

The score is the size of the image saved as JPEG: small files mean flat, simple images, large
files mean detailed, high-frequency images. No model, no prompt: a cheap reward for tests and
ablations.
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from PIL import Image

from .base import check_inputs, is_integer, register_reward

__all__ = ["jpeg_compressibility", "jpeg_incompressibility", "jpeg_size_kb"]


def jpeg_size_kb(images: torch.Tensor, quality: int = 95) -> torch.Tensor:
    """Size of each image encoded as JPEG with PIL.

    Args:
        images (`torch.Tensor` of shape `(B, 3, H, W)`, floating point, values in `[0, 1]`):
            RGB images, on any device; quantised to uint8 by rounding before encoding.
        quality (`int`, 1 to 100): the JPEG quality setting.

    Returns:
        `torch.Tensor` of shape `(B,)`, float32, on CPU: sizes in kB (1 kB = 1000 bytes), > 0.
    """
    pixels = (images.detach().float().clamp(0, 1) * 255).round().to(torch.uint8)  # (B, 3, H, W)
    pixels = pixels.permute(0, 2, 3, 1).cpu().numpy()  # (B, H, W, 3)
    sizes = []
    for array in pixels:
        buffer = io.BytesIO()
        Image.fromarray(array).save(buffer, format="JPEG", quality=int(quality))
        sizes.append(buffer.tell() / 1000)
    return torch.tensor(sizes, dtype=torch.float32)


@dataclass(frozen=True)
class _JpegSize:
    """`sign * jpeg_size_kb(images, quality)`, as a `Reward`."""

    name: str
    sign: float
    quality: int

    def __post_init__(self):
        if not is_integer(self.quality) or not 1 <= self.quality <= 100:
            raise ValueError(f"{self.name}: quality must be an integer in [1, 100], got {self.quality!r}")

    def __call__(
        self, images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]]
    ) -> torch.Tensor:
        check_inputs(images, prompts, metadata)
        return self.sign * jpeg_size_kb(images, self.quality)


@register_reward("jpeg_compressibility", modality="image", weights="none")
def jpeg_compressibility(quality: int = 95) -> _JpegSize:
    """Reward favouring images that compress well: `-(JPEG size in kB)`.

    Args:
        quality (`int`, 1 to 100, default 95): JPEG quality, as in DDPO.

    Returns:
        A `Reward` whose scores are `(B,)` float32 on CPU, in kB, always < 0 (a 512x512 image
        scores about -5 when flat grey and -300 when uniform noise). Prompts and metadata are ignored.

    Raises:
        ValueError: `quality` not an integer in `[1, 100]`.
    """
    return _JpegSize("jpeg_compressibility", sign=-1.0, quality=quality)


@register_reward("jpeg_incompressibility", modality="image", weights="none")
def jpeg_incompressibility(quality: int = 95) -> _JpegSize:
    """Reward favouring detailed images that compress badly: `+(JPEG size in kB)`.

    Args:
        quality (`int`, 1 to 100, default 95): JPEG quality, as in DDPO.

    Returns:
        A `Reward` whose scores are `(B,)` float32 on CPU, in kB, always > 0. Prompts and metadata
        are ignored.

    Raises:
        ValueError: `quality` not an integer in `[1, 100]`.
    """
    return _JpegSize("jpeg_incompressibility", sign=1.0, quality=quality)
