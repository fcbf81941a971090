"""HPS v2 / v2.1: Human Preference Score, a CLIP ViT-H/14 fine-tuned on HPD v2 (Wu et al., arXiv 2306.09341).

The score follows the reference `hpsv2/img_score.py` (github.com/tgxs002/HPSv2): the open_clip
`ViT-H-14` model with the HPS checkpoint loaded over it (`model.load_state_dict(checkpoint["state_dict"])`),
`outputs = model(image, text)`, whose `image_features` and `text_features` are L2-normalised, and
`score = diagonal(image_features @ text_features.T)`: the cosine similarity, with no logit scale.
Images are preprocessed as `hpsv2` does: its `create_model_and_transforms(..., light_augmentation=True)`
makes `preprocess_val` resize the longer side to 224 (bicubic) and pad to a square with black, then
normalise with OpenAI CLIP's mean and std (`hpsv2/src/open_clip/transform.py`, `ResizeMaxSize`);
on square images this equals open_clip's usual resize-shorter-side and centre crop. Here it runs on
tensors. hpsv2 bundles a fork of open_clip (`hpsv2/src/open_clip`) whose `ViT-H-14` has the same
parameter names, shapes, tokenizer and forward as open_clip's, which is used here; `open_clip` is
imported only when a model is loaded.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, Literal

import torch
import torch.nn.functional as F

from .base import register_reward
from .frozen import FrozenNetworkReward, as_dtype, channel_stats, frozen
from .options import HPS_FILES, HPS_REPO, hps_checkpoint

__all__ = ["HPS_FILES", "HPS_REPO", "HPSv2", "hps_preprocess", "hpsv2"]


def hps_preprocess(images: torch.Tensor, size: int, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """Resize the longer side to `size` (bicubic, antialiased), pad to `size x size` with black, normalise.

    The tensor counterpart of hpsv2's `preprocess_val` (`ResizeMaxSize` in
    `hpsv2/src/open_clip/transform.py`): new side lengths are `round(side * size / max(H, W))`, the
    padding is split `pad // 2` before and the rest after, and, as there, nothing is clipped after
    the resize. Unlike there, an image whose longer side is already `size` is still padded to a
    square. (hpsv2 resizes with the installed torchvision's default, antialiased since
    torchvision 0.17.)

    Args:
        images (`torch.Tensor` of shape `(B, 3, H, W)`, floating point, in `[0, 1]`, any device).
        size (`int`): the output side `S` in pixels (224 for ViT-H-14).
        mean, std (`torch.Tensor` of shape `(1, 3, 1, 1)`, float32, on the device wanted): per-channel
            normalisation (OpenAI CLIP's for HPS).

    Returns:
        `torch.Tensor` of shape `(B, 3, S, S)`, float32, on the device of `mean`.
    """
    pixels = images.to(device=mean.device, dtype=torch.float32)  # (B, 3, H, W)
    height, width = pixels.shape[-2:]
    scale = size / max(height, width)
    new_size = (round(height * scale), round(width * scale))
    if new_size != (height, width):
        pixels = F.interpolate(pixels, size=new_size, mode="bicubic", antialias=True, align_corners=False)
    pad_h, pad_w = size - new_size[0], size - new_size[1]
    pixels = F.pad(pixels, (pad_w // 2, pad_w - pad_w // 2, pad_h // 2, pad_h - pad_h // 2))  # (B, 3, S, S)
    return (pixels - mean) / std


class HPSv2(FrozenNetworkReward):
    """Score images against their prompts with an HPS v2 / v2.1 open_clip model.

    Use the `hpsv2` factory to load one from a checkpoint; build this class directly to wrap an
    open_clip model already in memory.

    Args:
        model (`open_clip.CLIP`): the dual encoder with the HPS weights; put in eval mode, frozen,
            and moved to `device` and `dtype`. Its preprocessing config (`open_clip.get_model_preprocess_cfg`)
            gives the image size, mean and std.
        tokenizer (callable): open_clip's tokenizer for the model (`list[str]` -> `(b, L)` long tensor),
            e.g. `open_clip.get_tokenizer("ViT-H-14")`; long prompts are truncated to `L` tokens (77).
        device (`str` or `torch.device`): where the model runs.
        dtype (`torch.dtype` or `str`): the model's weight dtype (e.g. `"bfloat16"` on GPU).
        batch_size (`int >= 1`, *optional*): score at most this many images per forward; default:
            the whole batch at once.

    Returns (when called):
        `torch.Tensor` of shape `(B,)`, float32, on CPU (`(0,)` for an empty batch): the cosine
        similarity of image and text embeddings, in `[-1, 1]`. Matching pairs typically score
        0.25-0.30 with HPS v2 and v2.1; only differences between images of one prompt are meaningful.

    Raises:
        ValueError: `batch_size` not an integer >= 1, or `dtype` not a floating dtype. When called,
            TypeError / ValueError on malformed inputs (see `rewards.base.check_inputs`).
    """

    name = "hpsv2"

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | str = torch.float32,
        batch_size: int | None = None,
    ):
        import open_clip

        self.place(device, dtype, batch_size)
        self.model = frozen(model, self.device, self.dtype)
        self.tokenizer = tokenizer
        cfg = open_clip.get_model_preprocess_cfg(model)
        size = cfg["size"]
        self.image_size = int(size if isinstance(size, int) else size[0])
        self.image_mean, self.image_std = channel_stats(cfg["mean"], cfg["std"], self.device, self.name)

    def preprocess(self, images: torch.Tensor) -> torch.Tensor:
        """`(B, 3, H, W)` in `[0, 1]` -> `(B, 3, S, S)` model input, `self.dtype` on `self.device` (`hps_preprocess`)."""
        return hps_preprocess(images, self.image_size, self.image_mean, self.image_std).to(self.dtype)

    def _score(self, images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        """One chunk: `(b, 3, H, W)` images and `b` prompts -> `(b,)` CPU cosines (float32; float64 for a float64
        model)."""
        tokens = self.tokenizer(list(prompts)).to(self.device)  # (b, L) long
        image = self.model.encode_image(self.preprocess(images))  # (b, D)
        text = self.model.encode_text(tokens)  # (b, D)
        dt = torch.promote_types(self.dtype, torch.float32)
        return (F.normalize(image.to(dt), dim=-1) * F.normalize(text.to(dt), dim=-1)).sum(-1).cpu()


@register_reward(
    "hpsv2",
    modality="image",
    weights="HPS_v2.1_compressed.pt (xswu/HPSv2; open_clip ViT-H-14 built from config)",
    differentiable=True,
)
def hpsv2(
    model_path: str | os.PathLike | None = None,
    version: Literal["v2", "v2.0", "v2.1"] = "v2.1",
    arch: str = "ViT-H-14",
    device: str | torch.device = "cpu",
    dtype: torch.dtype | str = torch.float32,
    batch_size: int | None = None,
) -> HPSv2:
    """Load the HPS v2 / v2.1 reward from a checkpoint file (nothing is downloaded).

    The open_clip model `arch` is built with random weights and the whole HPS state dict is loaded
    over it, so no LAION ViT-H weights are needed. The checkpoint is read with
    `torch.load(weights_only=True)`, or with safetensors for a `.safetensors` file (convert once
    with `python -m rewards.convert HPS_v2.1_compressed.pt HPS_v2.1.safetensors`).

    Args:
        model_path (`str` or path, *optional*): the checkpoint file (`HPS_v2_compressed.pt`,
            `HPS_v2.1_compressed.pt`, or a `.safetensors` conversion), or a folder holding the
            version's file. Default: the version's file of hub repo `xswu/HPSv2` in the local
            Hugging Face cache.
        version (`"v2"`, `"v2.0"` or `"v2.1"`, default `"v2.1"`): which checkpoint file name to look
            for when `model_path` is a folder or not given (the score formula is the same).
        arch (`str`, default `"ViT-H-14"`): the open_clip model config the checkpoint fits (a
            registered name, including ones added with `open_clip.add_model_config`).
        device (`str` or `torch.device`, default `"cpu"`): where the model runs.
        dtype (`torch.dtype` or `str`, default float32): weight dtype, e.g. `"bfloat16"` on GPU.
        batch_size (`int >= 1`, *optional*): images per forward (bounds ViT-H memory); default the
            whole batch.

    Returns:
        An `HPSv2`, scoring `(B, 3, H, W)` images in `[0, 1]` to `(B,)` float32 CPU cosines in `[-1, 1]`.

    Raises:
        FileNotFoundError: the checkpoint is missing (the message names the file or folder).
        ValueError: unknown `version` or `arch`; a checkpoint that is not a weights-only state dict or
            does not fit `arch` (the message counts missing and unexpected keys); bad `dtype` or
            `batch_size`.
    """
    path = hps_checkpoint(model_path, version, batch_size)  # torch-free: what `flowrl serve-reward` checks first
    as_dtype(dtype)
    import open_clip

    from .convert import load_state_dict  # not at the top: `python -m rewards.convert` runs without a double import

    if open_clip.get_model_config(arch) is None:
        raise ValueError(f"hpsv2: arch {arch!r} is not an open_clip model config (e.g. 'ViT-H-14')")
    state = load_state_dict(path, "hpsv2")
    model = open_clip.create_model(arch, pretrained=None, device=device)  # random init, overwritten below
    try:
        missing, unexpected = model.load_state_dict(state, strict=False)
    except RuntimeError as err:  # shape mismatches
        detail = str(err).splitlines()[-1].strip()
        raise ValueError(f"hpsv2: checkpoint '{path}' does not fit open_clip {arch!r} ({detail})") from None
    if missing or unexpected:
        raise ValueError(
            f"hpsv2: checkpoint '{path}' does not fit open_clip {arch!r}: {len(missing)} missing keys "
            f"(e.g. {missing[:3]}), {len(unexpected)} unexpected keys (e.g. {unexpected[:3]})"
        )
    return HPSv2(model, open_clip.get_tokenizer(arch), device, dtype, batch_size)
