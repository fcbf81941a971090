"""CLIP-style image-text alignment reward: CLIPScore, PickScore and any transformers `CLIPModel`.

The score is `logit_scale.exp() * cos(image_embedding, text_embedding)`, i.e. the diagonal of the
model's `logits_per_image`, which is how PickScore (Kirstain et al., arXiv 2305.01569) is used.
Images are preprocessed as tensors (resize, centre crop, normalise) on the model's device, with no
PIL round trip. `transformers` is imported only when a model is loaded, so `import rewards` stays
light.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from .base import check_json_files, load_pretrained, register_reward
from .frozen import FrozenNetworkReward, channel_stats, frozen
from .options import clip_folders

__all__ = ["ClipScore", "clip_preprocess", "clipscore"]


def _load_clip(
    model_path: str | os.PathLike, processor_path: str | os.PathLike | None, reward: str
) -> tuple[torch.nn.Module, Any, Any]:
    """Load `(CLIPModel, tokenizer, image processor)` from local folders or cached hub ids.

    Raises:
        FileNotFoundError: see `rewards.options.check_folder`. ValueError: a ``*.json`` file of either folder that is not JSON
            (named: :func:`rewards.base.check_json_files`).
        OSError: no CLIP tokenizer and image processor in `processor_path`.
    """
    from transformers import CLIPModel

    processor_path = model_path if processor_path is None else processor_path
    model_dir, processor_dir = clip_folders(model_path, processor_path, reward)  # torch-free: checked first by the CLI
    for folder in dict.fromkeys((model_dir, processor_dir)):  # each *.json file named before transformers reads it
        check_json_files(folder, reward)
    tokenizer, image_processor = load_clip_processor(processor_dir, processor_path, reward)
    model = load_pretrained(CLIPModel, model_dir, reward)  # pickled-only folders refused in one line
    return model, tokenizer, image_processor


def load_clip_processor(folder: Path, processor_path: str | os.PathLike, reward: str) -> tuple[Any, Any]:
    """The CLIP tokenizer and image processor saved in `folder` (the local copy of `processor_path`).

    Raises:
        OSError: naming `reward` and `processor_path`, when either does not load.
    """
    from transformers import AutoImageProcessor, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        image_processor = AutoImageProcessor.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError) as err:
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise OSError(
            f"{reward}: cannot load a CLIP tokenizer and image processor from '{processor_path}' ({first_line})"
        ) from err
    return tokenizer, image_processor


def clip_preprocess(images: torch.Tensor, size: int, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """Resize the shorter side to `size` (bicubic, antialiased), centre crop `size x size`, normalise.

    The tensor counterpart of transformers' `CLIPImageProcessor` (shortest edge and crop both `size`),
    with no PIL round trip.

    Args:
        images (`torch.Tensor` of shape `(B, 3, H, W)`, floating point, in `[0, 1]`, any device).
        size (`int`): the output side `S` in pixels.
        mean, std (`torch.Tensor` of shape `(1, 3, 1, 1)`, float32, on the device wanted): per-channel
            normalisation.

    Returns:
        `torch.Tensor` of shape `(B, 3, S, S)`, float32 (float64 for float64 images), on the device of `mean`.
    """
    pixels = images.to(device=mean.device, dtype=torch.promote_types(images.dtype, torch.float32))  # (B, 3, H, W)
    height, width = pixels.shape[-2:]
    if min(height, width) != size:
        scale = size / min(height, width)
        new_size = (max(size, int(height * scale)), max(size, int(width * scale)))
        pixels = F.interpolate(pixels, size=new_size, mode="bicubic", antialias=True, align_corners=False)
        pixels = pixels.clamp(0, 1)  # bicubic overshoots; PIL clips to uint8 here
    top = (pixels.shape[-2] - size) // 2
    left = (pixels.shape[-1] - size) // 2
    pixels = pixels[..., top : top + size, left : left + size]  # (B, 3, S, S)
    return (pixels - mean) / std


def _pooled(output: Any) -> torch.Tensor:
    """`get_*_features` returns a tensor in transformers 4 and a `BaseModelOutputWithPooling` in 5."""
    return output if isinstance(output, torch.Tensor) else output.pooler_output


class ClipScore(FrozenNetworkReward):
    """Score images against their prompts with a CLIP dual encoder.

    Use the `clipscore` factory to load one from folders; build this class directly to wrap a
    model already in memory.

    Args:
        model (`transformers.CLIPModel`): the dual encoder; put in eval mode, frozen, and moved to
            `device` and `dtype`.
        tokenizer (`transformers.PreTrainedTokenizerBase`): the CLIP tokenizer matching `model`.
        image_mean (`Sequence[float]` of length 3): per-channel mean of the model's preprocessing.
        image_std (`Sequence[float]` of length 3): per-channel std of the model's preprocessing.
        device (`str` or `torch.device`): where the model runs.
        dtype (`torch.dtype` or `str`): the model's weight dtype (e.g. `"bfloat16"` on GPU).
        batch_size (`int >= 1`, *optional*): score at most this many images per forward (bounds the
            memory of a large model such as PickScore's ViT-H); default: the whole batch at once.

    Returns (when called):
        `torch.Tensor` of shape `(B,)`, float32, on CPU (`(0,)` for an empty batch): `logit_scale.exp() * cos(img, text)`, in
        `[-s, s]` with `s = logit_scale.exp()` (100 for OpenAI CLIP and PickScore). Matching pairs
        typically score 20-35 with CLIP ViT-L/14 and 18-24 with PickScore; only differences between
        images of one prompt are meaningful.

    Raises (when called):
        TypeError / ValueError: malformed inputs (see `rewards.base.check_inputs`).
    """

    name = "clipscore"

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        image_mean: Sequence[float],
        image_std: Sequence[float],
        device: str | torch.device = "cpu",
        dtype: torch.dtype | str = torch.float32,
        batch_size: int | None = None,
    ):
        self.place(device, dtype, batch_size)
        self.image_mean, self.image_std = channel_stats(image_mean, image_std, self.device)
        self.model = frozen(model, self.device, self.dtype)
        self.tokenizer = tokenizer
        self.image_size = int(model.config.vision_config.image_size)
        self.max_length = min(tokenizer.model_max_length, model.config.text_config.max_position_embeddings)

    def preprocess(self, images: torch.Tensor) -> torch.Tensor:
        """Resize the shorter side to the model's image size, centre crop, normalise.

        Args:
            images (`torch.Tensor` of shape `(B, 3, H, W)`, floating point, in `[0, 1]`).

        Returns:
            `torch.Tensor` of shape `(B, 3, S, S)`, `self.dtype`, on `self.device`, where `S` is
            `model.config.vision_config.image_size`; normalised with `image_mean` / `image_std`.
        """
        return clip_preprocess(images, self.image_size, self.image_mean, self.image_std).to(self.dtype)

    @torch.no_grad()
    def image_embeddings(self, images: torch.Tensor) -> torch.Tensor:
        """Unit-norm image embeddings `(B, D)` float32 on :attr:`device` of `(B, 3, H, W)` images in [0, 1], in chunks
        of :attr:`batch_size` (the diversity signal, :mod:`flowrl.diversity`)."""
        step = self.batch_size or max(len(images), 1)
        parts = [
            _pooled(self.model.get_image_features(pixel_values=self.preprocess(images[i : i + step]))).float()
            for i in range(0, len(images), step)
        ]
        return F.normalize(torch.cat(parts), dim=-1)

    def _score(self, images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        """One chunk: `(b, 3, H, W)` images and `b` prompts -> `(b,)` float32 CPU scores."""
        tokens = self.tokenizer(
            list(prompts), padding=True, truncation=True, max_length=self.max_length, return_tensors="pt"
        ).to(self.device)
        text = _pooled(self.model.get_text_features(tokens["input_ids"], tokens["attention_mask"]))  # (b, D)
        image = _pooled(self.model.get_image_features(pixel_values=self.preprocess(images)))  # (b, D)
        dt = torch.promote_types(self.dtype, torch.float32)  # float32, or float64 for a float64 model
        cosine = (F.normalize(image.to(dt), dim=-1) * F.normalize(text.to(dt), dim=-1)).sum(-1)  # (b,)
        return (self.model.logit_scale.to(dt).exp() * cosine).cpu()


@register_reward(
    "clipscore",
    modality="image",
    weights="a transformers CLIPModel folder (assets/tiny-clip ships)",
    differentiable=True,
)
def clipscore(
    model_path: str | os.PathLike,
    processor_path: str | os.PathLike | None = None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | str = torch.float32,
    batch_size: int | None = None,
) -> ClipScore:
    """Load a `ClipScore` reward from local folders or cached hub ids (nothing is downloaded).

    For CLIPScore: the folder (or cached hub id) of e.g. `openai/clip-vit-large-patch14`. For
    PickScore prefer the `pickscore` reward (same model, its hub ids as defaults, optional scale).

    Args:
        model_path (`str` or path): folder of a transformers `CLIPModel` (`config.json` + weights),
            or a hub id already in the local Hugging Face cache.
        processor_path (`str` or path, *optional*): folder (or cached hub id) with the CLIP
            tokenizer and image processor config (`preprocessor_config.json`); defaults to
            `model_path`.
        device (`str` or `torch.device`, default `"cpu"`): where the model runs.
        dtype (`torch.dtype` or `str`, default float32): weight dtype, e.g. `"bfloat16"` on GPU.
        batch_size (`int >= 1`, *optional*): images per forward; default the whole batch.

    Returns:
        A `ClipScore`, scoring `(B, 3, H, W)` images in `[0, 1]` to `(B,)` float32 CPU tensors,
        `logit_scale.exp() * cos(image, text)` in `[-100, 100]` for CLIP and PickScore.

    Raises:
        FileNotFoundError: a path is neither a local folder nor a cached hub id, or `model_path` has
            no `config.json`.
        OSError: the tokenizer or image processor cannot be loaded from `processor_path`.
        ValueError: `dtype` is not a floating torch dtype, or `batch_size` is not an integer >= 1.
    """
    model, tokenizer, image_processor = _load_clip(model_path, processor_path, "clipscore")
    return ClipScore(
        model, tokenizer, image_processor.image_mean, image_processor.image_std, device, dtype, batch_size
    )
