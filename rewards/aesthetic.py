"""LAION aesthetic score: an MLP on CLIP ViT-L/14 image embeddings predicting a 1-10 rating.

The LAION "improved aesthetic predictor" (github.com/christophschuhmann/improved-aesthetic-predictor,
`simple_inference.py`, head `sac+logos+ava1-l14-linearMSE.pth`; used in LAION-5B, arXiv 2210.08402,
and as DDPO's aesthetic reward, arXiv 2305.13301, `ddpo_pytorch/aesthetic_scorer.py`): the image's
CLIP ViT-L/14 embedding (OpenAI weights), L2-normalised, goes through
`Linear(768, 1024) - Dropout(0.2) - Linear(1024, 128) - Dropout(0.2) - Linear(128, 64) - Dropout(0.1)
- Linear(64, 16) - Linear(16, 1)` (no activations, as published). The CLIP model is a transformers
`CLIPModel` (e.g. `openai/clip-vit-large-patch14`, as in DDPO); images are preprocessed as tensors
like its image processor (shorter side to 224 bicubic, centre crop, OpenAI mean/std).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .base import check_batch_size, check_inputs, load_pretrained, register_reward
from .clipscore import _pooled, clip_preprocess
from .frozen import FrozenNetworkReward, as_dtype, channel_stats, frozen
from .options import check_folder

__all__ = ["AestheticScore", "aesthetic", "aesthetic_mlp"]


def aesthetic_mlp(input_size: int = 768) -> nn.Sequential:
    """The LAION aesthetic head, with the published layer indices.

    Args:
        input_size (`int`, default 768): the CLIP embedding size (768 for ViT-L/14).

    Returns:
        `nn.Sequential` mapping `(B, input_size)` float embeddings to `(B, 1)` predicted ratings.
        Its state dict keys, prefixed with `layers.`, are those of the published
        `sac+logos+ava1-l14-linearMSE.pth` (`layers.0.weight` ... `layers.7.bias`): linear layers at
        indices 0, 2, 4, 6, 7, dropouts between.
    """
    return nn.Sequential(
        nn.Linear(input_size, 1024),
        nn.Dropout(0.2),
        nn.Linear(1024, 128),
        nn.Dropout(0.2),
        nn.Linear(128, 64),
        nn.Dropout(0.1),
        nn.Linear(64, 16),
        nn.Linear(16, 1),
    )


class AestheticScore(FrozenNetworkReward):
    """Predict the LAION aesthetic rating of images (prompts are ignored).

    Use the `aesthetic` factory to load one from files; build this class directly to wrap models
    already in memory.

    Args:
        clip (`transformers.CLIPModel`): the CLIP model whose image embeddings the head was trained
            on (OpenAI ViT-L/14 for the published head); moved to `device` and `dtype`, frozen.
        layers (`nn.Sequential`): the head from `aesthetic_mlp`, with its weights; kept in float32.
        image_mean (`Sequence[float]` of length 3): per-channel mean of the CLIP preprocessing.
        image_std (`Sequence[float]` of length 3): per-channel std of the CLIP preprocessing.
        device (`str` or `torch.device`): where the models run.
        dtype (`torch.dtype` or `str`): CLIP's weight dtype (e.g. `"bfloat16"` on GPU).
        batch_size (`int >= 1`, *optional*): images per forward; default the whole batch.

    Returns (when called):
        `torch.Tensor` of shape `(B,)`, float32, on CPU (`(0,)` for an empty batch): the predicted
        rating on the 1-10 scale of the human ratings it was trained on (not clamped; generated
        images typically score 4.5-7).

    Raises:
        ValueError: `image_mean` / `image_std` not of length 3, the head's input size differs from
            CLIP's embedding size, bad `dtype` or `batch_size`. When called, TypeError / ValueError on
            malformed inputs (see `rewards.base.check_inputs`).
    """

    name = "aesthetic"

    def __init__(
        self,
        clip: nn.Module,
        layers: nn.Sequential,
        image_mean: Sequence[float],
        image_std: Sequence[float],
        device: str | torch.device = "cpu",
        dtype: torch.dtype | str = torch.float32,
        batch_size: int | None = None,
    ):
        embed_dim, head_dim = int(clip.config.projection_dim), layers[0].in_features
        if embed_dim != head_dim:
            raise ValueError(
                f"aesthetic: the head takes {head_dim}-d embeddings but the CLIP model gives {embed_dim}-d"
            )
        self.place(device, dtype, batch_size)
        self.image_mean, self.image_std = channel_stats(image_mean, image_std, self.device, self.name)
        self.clip = frozen(clip, self.device, self.dtype)
        self.layers = frozen(layers, self.device, torch.float32)
        self.image_size = int(clip.config.vision_config.image_size)

    def preprocess(self, images: torch.Tensor) -> torch.Tensor:
        """`(B, 3, H, W)` in `[0, 1]` -> `(B, 3, S, S)` CLIP input, `self.dtype` on `self.device` (`clip_preprocess`)."""
        return clip_preprocess(images, self.image_size, self.image_mean, self.image_std).to(self.dtype)

    @torch.no_grad()
    def embed(self, images: torch.Tensor) -> torch.Tensor:
        """`(B, 3, H, W)` images in `[0, 1]` -> `(B, D)` float32 L2-normalised CLIP image embeddings."""
        return self._embed(images).float()

    def _embed(self, images: torch.Tensor) -> torch.Tensor:
        features = _pooled(self.clip.get_image_features(pixel_values=self.preprocess(images)))  # (B, D)
        return F.normalize(features.to(torch.promote_types(self.dtype, torch.float32)), dim=-1)

    def score_with_grad(
        self, images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]]
    ) -> torch.Tensor:
        """The scores of :meth:`__call__` with the graph back to `images` `(B, 3, H, W)` in [0, 1] (torch
        preprocessing), in one forward; `(B,)` on CPU, in the head's dtype (float32; float64 after ``layers.double()``,
        for gradient checks). The CLIP model and the head stay frozen."""
        check_inputs(images.detach(), prompts, metadata)
        head = self.layers[0].weight.dtype
        return self.layers(self._embed(images).to(head)).squeeze(-1).cpu()  # (B,)

    @torch.no_grad()
    def __call__(
        self, images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]]
    ) -> torch.Tensor:
        check_inputs(images, prompts, metadata)
        size = self.batch_size or max(1, images.shape[0])
        chunks = [
            self.layers(self.embed(images[i : i + size]).to(self.layers[0].weight.dtype)).squeeze(-1).float().cpu()
            for i in range(0, images.shape[0], size)
        ]
        return torch.cat(chunks) if chunks else torch.zeros(0)


@register_reward(
    "aesthetic",
    modality="image",
    weights="sac+logos+ava1-l14-linearMSE.pth + openai/clip-vit-large-patch14",
    differentiable=True,
)
def aesthetic(
    model_path: str | os.PathLike,
    clip_path: str | os.PathLike = "openai/clip-vit-large-patch14",
    device: str | torch.device = "cpu",
    dtype: torch.dtype | str = torch.float32,
    batch_size: int | None = None,
) -> AestheticScore:
    """Load the LAION aesthetic reward: the head's weights file and a CLIP folder (nothing is downloaded).

    Args:
        model_path (`str` or path): the head's weights, `sac+logos+ava1-l14-linearMSE.pth` from
            github.com/christophschuhmann/improved-aesthetic-predictor (read with
            `torch.load(weights_only=True)`), or its `.safetensors` conversion (`python -m
            rewards.convert`).
        clip_path (`str` or path, default `"openai/clip-vit-large-patch14"`): folder of a transformers
            `CLIPModel` with its `preprocessor_config.json`, or a hub id already in the local Hugging
            Face cache.
        device (`str` or `torch.device`, default `"cpu"`): where the models run.
        dtype (`torch.dtype` or `str`, default float32): CLIP's weight dtype, e.g. `"bfloat16"` on GPU.
        batch_size (`int >= 1`, *optional*): images per forward; default the whole batch.

    Returns:
        An `AestheticScore`, scoring `(B, 3, H, W)` images in `[0, 1]` to `(B,)` float32 CPU ratings
        (1-10 scale).

    Raises:
        FileNotFoundError: the head file or the CLIP folder is missing (the message names it).
        ValueError: the head file is not a weights-only state dict with the published keys, its input
            size differs from CLIP's embedding size, or bad `dtype` / `batch_size`.
        OSError: no image processor config in `clip_path`.
    """
    check_batch_size(batch_size, "aesthetic")
    as_dtype(dtype)
    from .convert import load_state_dict  # not at the top: `python -m rewards.convert` runs without a double import

    state = load_state_dict(model_path, "aesthetic")
    if "layers.0.weight" not in state or state["layers.0.weight"].ndim != 2:
        raise ValueError(f"aesthetic: '{model_path}' has no 2-d 'layers.0.weight'; expected the LAION aesthetic head")
    layers = aesthetic_mlp(state["layers.0.weight"].shape[1])
    try:
        nn.ModuleDict({"layers": layers}).load_state_dict(state)
    except RuntimeError as err:
        raise ValueError(
            f"aesthetic: '{model_path}' does not fit the LAION aesthetic head ({' '.join(str(err).split())})"
        ) from None

    from transformers import AutoImageProcessor, CLIPModel

    folder = check_folder(clip_path, "clip_path", need_config=True, reward="aesthetic")
    try:
        processor = AutoImageProcessor.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError) as err:
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise OSError(f"aesthetic: cannot load a CLIP image processor from '{clip_path}' ({first_line})") from err
    clip = load_pretrained(CLIPModel, folder, "aesthetic")
    return AestheticScore(clip, layers, processor.image_mean, processor.image_std, device, dtype, batch_size)
