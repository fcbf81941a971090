"""ImageReward: a human-preference reward model for text-to-image generation.

ImageReward (Xu et al., arXiv 2304.05977; reference `ImageReward/ImageReward.py` of THUDM/ImageReward,
pip package `image-reward` 1.5) encodes the prompt with BLIP's BERT text encoder, which cross-attends to
the image tokens of BLIP's ViT-L/16 (224 px); the text [CLS] feature goes through a head of five linear
layers 768 -> 1024 -> 128 -> 64 -> 16 -> 1 (the package's ReLUs are commented out and its dropouts are
inactive at inference, so the head is affine), and the output is standardised:
`score = (head(cls) - 0.16717362830052426) / 1.0333394966054072`.

Here the two encoders are transformers' `BlipVisionModel` and `BlipTextModel` (the classes of
`BlipForImageTextRetrieval`), and `convert_imagereward_state_dict` maps the published checkpoint
`ImageReward.pt` (keys of the package's own BLIP code) onto them. Images are preprocessed as tensors
on the model's device: shorter side resized to 224 (bicubic, antialiased), centre crop, OpenAI CLIP
mean/std, as the package's torchvision pipeline does on PIL images (the package also rounds the resized
image to uint8, which moves a pixel by at most one level). Checked against the package's own code
(image-reward 1.5, random weights): the same inputs give the same scores to 3e-6. `transformers` is
imported only when a model is built, so `import rewards` stays light.

The reward is differentiable (`ImageReward.score_with_grad`): ReFL (the same paper; `ImageReward/ReFL.py`,
`ImageReward.score_gard`) back-propagates through exactly this forward, from the decoded images through the
tensor preprocessing, the ViT, the cross-attending text encoder and the head, with the weights frozen.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .base import register_reward
from .frozen import FrozenNetworkReward, channel_stats, frozen

__all__ = [
    "IMAGEREWARD_MEAN",
    "IMAGEREWARD_STD",
    "ImageReward",
    "ImageRewardModel",
    "convert_imagereward_state_dict",
    "imagereward",
    "imagereward_config",
    "load_converted",
]

IMAGEREWARD_MEAN = 0.16717362830052426
"""Mean of the head's raw output, subtracted by the package (`ImageReward.mean`)."""
IMAGEREWARD_STD = 1.0333394966054072
"""Std of the head's raw output, divided by the package (`ImageReward.std`)."""
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
MAX_LENGTH = 35
"""Prompts are padded and truncated to 35 tokens ([CLS] and [SEP] included), as the package does."""
HEAD_SIZES = (1024, 128, 64, 16, 1)


def imagereward_config(**text_overrides: Any):
    """The `transformers.BlipConfig` of ImageReward-v1.0.

    Vision: BLIP's ViT-L/16 at 224 px (1024 wide, 24 layers, 16 heads, MLP 4096, LayerNorm eps 1e-6).
    Text: BLIP's `med_config.json` (BERT-base: vocabulary 30524 = bert-base-uncased + [DEC] + [ENC],
    768 wide, 12 layers, 12 heads, MLP 3072, 512 positions, LayerNorm eps 1e-12) with cross-attention to
    the 1024-wide image tokens (`is_decoder=True` builds the cross-attention layers; the model still runs
    the text bidirectionally).

    Args:
        **text_overrides: replace text-config fields (e.g. `vocab_size=`), for variants of the checkpoint.

    Returns:
        `transformers.BlipConfig`.
    """
    from transformers import BlipConfig

    vision = dict(
        hidden_size=1024,
        intermediate_size=4096,
        num_hidden_layers=24,
        num_attention_heads=16,
        image_size=224,
        patch_size=16,
        hidden_act="gelu",
        layer_norm_eps=1e-6,
    )
    text = dict(
        vocab_size=30524,
        hidden_size=768,
        num_hidden_layers=12,
        num_attention_heads=12,
        intermediate_size=3072,
        max_position_embeddings=512,
        hidden_act="gelu",
        layer_norm_eps=1e-12,
        pad_token_id=0,
        bos_token_id=30522,
        sep_token_id=102,
        encoder_hidden_size=1024,
        is_decoder=True,
    )
    return BlipConfig(text_config={**text, **text_overrides}, vision_config=vision)


class ImageRewardModel(nn.Module):
    """BLIP ViT + BERT with cross-attention + ImageReward's affine head.

    Args:
        config (`transformers.BlipConfig`): e.g. `imagereward_config()`; its text config must have
            `is_decoder=True` (cross-attention layers) and `encoder_hidden_size` equal to the vision width.

    Attributes:
        vision_model (`transformers.BlipVisionModel`), text_encoder (`transformers.BlipTextModel`, no pooler),
        head (`nn.Sequential` of 5 `nn.Linear`: text width -> 1024 -> 128 -> 64 -> 16 -> 1).

    Raises:
        ValueError: the text config has no cross-attention or a width that does not match the vision width.
    """

    def __init__(self, config):
        super().__init__()
        from transformers import BlipTextModel, BlipVisionModel

        text, vision = config.text_config, config.vision_config
        if not text.is_decoder or text.encoder_hidden_size != vision.hidden_size:
            raise ValueError(
                "imagereward: the text config needs is_decoder=True (cross-attention) and encoder_hidden_size "
                f"= vision hidden_size {vision.hidden_size}, got is_decoder={text.is_decoder}, "
                f"encoder_hidden_size={text.encoder_hidden_size}"
            )
        self.config = config
        self.vision_model = BlipVisionModel(vision)
        self.text_encoder = BlipTextModel(text, add_pooling_layer=False)
        sizes = (text.hidden_size, *HEAD_SIZES)
        self.head = nn.Sequential(*(nn.Linear(n_in, n_out) for n_in, n_out in zip(sizes[:-1], sizes[1:])))

    def forward(
        self, pixel_values: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor
    ) -> torch.Tensor:
        """Standardised ImageReward scores.

        Args:
            pixel_values (`torch.Tensor` of shape `(B, 3, S, S)`): preprocessed images (CLIP-normalised).
            input_ids (`torch.LongTensor` of shape `(B, L)`): BERT token ids starting with [CLS].
            attention_mask (`torch.LongTensor` of shape `(B, L)`): 1 for tokens, 0 for padding.

        Returns:
            `torch.Tensor` of shape `(B,)`, float32 (float64 for a float64 model, for gradient checks):
            `(head(text [CLS] feature) - IMAGEREWARD_MEAN) / IMAGEREWARD_STD`.
        """
        image_embeds = self.vision_model(pixel_values=pixel_values).last_hidden_state  # (B, 1 + patches, Dv)
        image_mask = torch.ones(
            image_embeds.shape[:-1], dtype=torch.long, device=image_embeds.device
        )  # (B, 1 + patches)
        text = self.text_encoder(
            input_ids=input_ids,
            attention_mask=attention_mask,
            encoder_hidden_states=image_embeds,
            encoder_attention_mask=image_mask,
            is_decoder=False,
        ).last_hidden_state  # (B, L, Dt)
        raw = self.head(text[:, 0]).squeeze(-1)  # (B,)
        raw = raw.to(torch.promote_types(raw.dtype, torch.float32))  # float32, or float64 for a float64 model
        return (raw - IMAGEREWARD_MEAN) / IMAGEREWARD_STD


_BLOCK_KEY = re.compile(
    r"blip\.visual_encoder\.blocks\.(\d+)\.(norm1|norm2|attn\.qkv|attn\.proj|mlp\.fc1|mlp\.fc2)\.(weight|bias)"
)
_BLOCK_NAMES = {
    "norm1": "layer_norm1",
    "norm2": "layer_norm2",
    "attn.qkv": "self_attn.qkv",
    "attn.proj": "self_attn.projection",
    "mlp.fc1": "mlp.fc1",
    "mlp.fc2": "mlp.fc2",
}
_VISION_NAMES = {
    "blip.visual_encoder.cls_token": "vision_model.embeddings.class_embedding",
    "blip.visual_encoder.pos_embed": "vision_model.embeddings.position_embedding",
    "blip.visual_encoder.patch_embed.proj.weight": "vision_model.embeddings.patch_embedding.weight",
    "blip.visual_encoder.patch_embed.proj.bias": "vision_model.embeddings.patch_embedding.bias",
    "blip.visual_encoder.norm.weight": "vision_model.post_layernorm.weight",
    "blip.visual_encoder.norm.bias": "vision_model.post_layernorm.bias",
}
_HEAD_KEY = re.compile(r"mlp\.layers\.(\d+)\.(weight|bias)")
_HEAD_INDEX = {0: 0, 2: 1, 4: 2, 6: 3, 7: 4}  # the package's Sequential interleaves Dropouts at 1, 3, 5
_SCORING_PREFIXES = ("blip.visual_encoder.", "blip.text_encoder.", "mlp.")
_DROPPED = ("blip.text_encoder.embeddings.position_ids", "blip.text_encoder.pooler.")  # a buffer; unused
_OURS = ("vision_model.", "text_encoder.", "head.")


def convert_imagereward_state_dict(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename the keys of the package's `ImageReward.pt` to those of `ImageRewardModel`.

    `blip.visual_encoder.*` (timm-style ViT) -> `vision_model.*` (`cls_token` -> `embeddings.class_embedding`,
    `pos_embed` -> `embeddings.position_embedding`, `patch_embed.proj` -> `embeddings.patch_embedding`,
    `blocks.i.{norm1, attn.qkv, attn.proj, norm2, mlp.fc1, mlp.fc2}` -> `encoder.layers.i.{layer_norm1,
    self_attn.qkv, self_attn.projection, layer_norm2, mlp.fc1, mlp.fc2}`, `norm` -> `post_layernorm`);
    `blip.text_encoder.*` -> `text_encoder.*` (BLIP's `med.py` BERT and transformers' `BlipTextModel` share
    their names; the `embeddings.position_ids` buffer is dropped); `mlp.layers.{0,2,4,6,7}` -> `head.{0..4}`.
    Keys outside the scoring path (`blip.vision_proj`, `blip.text_proj`, any other) are dropped. A state
    dict already in `ImageRewardModel`'s names is returned unchanged.

    Args:
        state_dict (`Mapping[str, torch.Tensor]`): the checkpoint, e.g.
            `torch.load("ImageReward.pt", map_location="cpu", weights_only=True)`.

    Returns:
        `dict[str, torch.Tensor]`: the same tensors (not copied) under `ImageRewardModel`'s names.

    Raises:
        ValueError: a key under `blip.visual_encoder.` or `mlp.` that has no counterpart (the message names
            up to 5), or a state dict with no `blip.visual_encoder.`, `blip.text_encoder.` or `mlp.` keys.
            Text-encoder keys are renamed as they are; `load_converted` refuses any that do not fit.
    """
    if state_dict and all(key.startswith(_OURS) for key in state_dict):
        return dict(state_dict)
    converted, unknown = {}, []
    for key, tensor in state_dict.items():
        if not key.startswith(_SCORING_PREFIXES) or key.startswith(_DROPPED):
            continue
        if key in _VISION_NAMES:
            converted[_VISION_NAMES[key]] = tensor
        elif block := _BLOCK_KEY.fullmatch(key):
            layer, name, kind = block.groups()
            converted[f"vision_model.encoder.layers.{layer}.{_BLOCK_NAMES[name]}.{kind}"] = tensor
        elif key.startswith("blip.text_encoder."):
            converted["text_encoder." + key.removeprefix("blip.text_encoder.")] = tensor
        elif (head := _HEAD_KEY.fullmatch(key)) and int(head.group(1)) in _HEAD_INDEX:
            converted[f"head.{_HEAD_INDEX[int(head.group(1))]}.{head.group(2)}"] = tensor
        else:
            unknown.append(key)
    if unknown:
        raise ValueError(f"imagereward: checkpoint keys with no counterpart in ImageRewardModel: {unknown[:5]}")
    if not converted:
        raise ValueError(
            "imagereward: the checkpoint has no 'blip.visual_encoder.', 'blip.text_encoder.' or 'mlp.' keys; "
            f"is it ImageReward.pt? (first keys: {list(state_dict)[:3]})"
        )
    return converted


def load_converted(
    model: ImageRewardModel, state_dict: Mapping[str, torch.Tensor], source: str = "checkpoint"
) -> None:
    """Convert `state_dict` and load it into `model` strictly (every weight present, none left over).

    Raises:
        ValueError: a key without counterpart (see `convert_imagereward_state_dict`), or missing/unexpected
            keys or mismatched shapes after conversion (the message names `source` and up to 5 keys).
    """
    converted = convert_imagereward_state_dict(state_dict)
    expected = model.state_dict()
    missing = [k for k in expected if k not in converted]
    unexpected = [k for k in converted if k not in expected]
    shapes = [
        f"{k}: {tuple(converted[k].shape)} vs {tuple(expected[k].shape)}"
        for k in expected
        if k in converted and converted[k].shape != expected[k].shape
    ]
    if missing or unexpected or shapes:
        raise ValueError(
            f"imagereward: {source} does not fit the ImageReward-v1.0 architecture: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}, shape mismatches {shapes[:5]}"
        )
    model.load_state_dict(converted, strict=True)


class ImageReward(FrozenNetworkReward):
    """Score images against their prompts with ImageReward.

    Use the `imagereward` factory to load the published checkpoint; build this class directly to wrap a
    model already in memory.

    Args:
        model (`ImageRewardModel`): put in eval mode, frozen, and moved to `device` and `dtype`.
        tokenizer (`transformers.PreTrainedTokenizerBase`): BERT uncased WordPiece (bert-base-uncased; the
            package adds [DEC] and [ENC], which prompts never contain).
        device (`str` or `torch.device`, default `"cpu"`): where the model runs.
        dtype (`torch.dtype` or `str`, default float32): weight dtype (e.g. `"bfloat16"` on GPU).
        batch_size (`int >= 1`, *optional*): images per forward; default the whole batch.

    Returns (when called):
        `torch.Tensor` of shape `(B,)`, float32, on CPU (`(0,)` for an empty batch): the standardised reward,
        unbounded; about N(0, 1) over the package's generated images (higher: preferred by people); only
        differences between images of one prompt are meaningful.

    Raises:
        ValueError: `batch_size` not an integer >= 1, `dtype` not floating, or a tokenizer whose vocabulary
            exceeds the model's.
        TypeError / ValueError (when called): malformed inputs (see `rewards.base.check_inputs`).
    """

    name = "imagereward"

    def __init__(
        self,
        model: ImageRewardModel,
        tokenizer: Any,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | str = torch.float32,
        batch_size: int | None = None,
    ):
        self.place(device, dtype, batch_size)
        vocab = model.config.text_config.vocab_size
        if len(tokenizer) > vocab:
            raise ValueError(
                f"imagereward: the tokenizer has {len(tokenizer)} tokens, the model only {vocab}; "
                "use bert-base-uncased's tokenizer"
            )
        self.model = frozen(model, self.device, self.dtype)
        self.tokenizer = tokenizer
        self.image_size = int(model.config.vision_config.image_size)
        self.image_mean, self.image_std = channel_stats(CLIP_MEAN, CLIP_STD, self.device, self.name)

    def preprocess(self, images: torch.Tensor) -> torch.Tensor:
        """torchvision's `Resize(S, BICUBIC)`, `CenterCrop(S)`, `Normalize(CLIP mean, std)` on tensors.

        Args:
            images (`torch.Tensor` of shape `(B, 3, H, W)`, floating point, in `[0, 1]`; may carry a graph).

        Returns:
            `torch.Tensor` of shape `(B, 3, S, S)`, `self.dtype`, on `self.device`, `S` the model's image
            size (224); the shorter side is resized to `S` and the longer to `int(S * long / short)`. Every step
            is a differentiable torch op (gradients are zero where the resized pixels are clipped to [0, 1]).
        """
        size = self.image_size
        pixels = images.to(device=self.device, dtype=torch.promote_types(images.dtype, torch.float32))  # (B, 3, H, W)
        height, width = pixels.shape[-2:]
        if min(height, width) != size:
            short, long = min(height, width), max(height, width)
            new_long = int(size * long / short)
            new_size = (size, new_long) if height <= width else (new_long, size)
            pixels = F.interpolate(pixels, size=new_size, mode="bicubic", antialias=True, align_corners=False)
            pixels = pixels.clamp(0, 1)  # bicubic overshoots; PIL clips to uint8 here
        top = int(round((pixels.shape[-2] - size) / 2.0))  # torchvision's center_crop offsets
        left = int(round((pixels.shape[-1] - size) / 2.0))
        pixels = pixels[..., top : top + size, left : left + size]  # (B, 3, S, S)
        return ((pixels - self.image_mean) / self.image_std).to(self.dtype)

    def _score(self, images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        """One chunk: `(b, 3, H, W)` images and `b` prompts -> `(b,)` CPU scores (float32; float64 for a float64
        model)."""
        tokens = self.tokenizer(
            list(prompts), padding="max_length", truncation=True, max_length=MAX_LENGTH, return_tensors="pt"
        ).to(self.device)
        return self.model(self.preprocess(images), tokens["input_ids"], tokens["attention_mask"]).cpu()


@register_reward(
    "imagereward",
    modality="image",
    weights="ImageReward.pt (THUDM/ImageReward) + bert-base-uncased tokenizer",
    differentiable=True,
)
def imagereward(
    checkpoint: str | os.PathLike,
    tokenizer_path: str | os.PathLike,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | str = torch.float32,
    batch_size: int | None = None,
) -> ImageReward:
    """Load ImageReward-v1.0 (arXiv 2304.05977) from local files (nothing is downloaded).

    Download beforehand `ImageReward.pt` from the hub repository `THUDM/ImageReward`, and the tokenizer of
    `google-bert/bert-base-uncased` (e.g. `hf download google-bert/bert-base-uncased tokenizer.json
    tokenizer_config.json vocab.txt --local-dir /ckpt/bert-base-uncased`).

    Args:
        checkpoint (`str` or path): `ImageReward.pt`, a folder holding it, or a `.safetensors` file with
            the same tensors (in the package's key names or already converted).
        tokenizer_path (`str` or path): folder of the bert-base-uncased tokenizer.
        device (`str` or `torch.device`, default `"cpu"`): where the model runs.
        dtype (`torch.dtype` or `str`, default float32): weight dtype, e.g. `"bfloat16"` on GPU.
        batch_size (`int >= 1`, *optional*): images per forward; default the whole batch.

    Returns:
        An `ImageReward`, scoring `(B, 3, H, W)` images in `[0, 1]` to `(B,)` float32 CPU tensors
        (standardised, unbounded, higher is better); differentiable through `score_with_grad`.

    Raises:
        FileNotFoundError: `checkpoint` or `tokenizer_path` does not exist.
        OSError: the tokenizer cannot be loaded from `tokenizer_path`.
        ValueError: the checkpoint holds Python objects beyond tensors (refused, never unpickled) or does
            not fit the architecture (the message names the keys), or a bad `dtype` / `batch_size`.
    """
    from transformers import AutoTokenizer

    path = Path(checkpoint)
    if path.is_dir():
        path = path / "ImageReward.pt"
    if not path.is_file():
        raise FileNotFoundError(
            f"imagereward: checkpoint '{checkpoint}' is not a file (nor a folder with ImageReward.pt); "
            "download it first with `hf download THUDM/ImageReward ImageReward.pt --local-dir <folder>`"
        )
    if not Path(tokenizer_path).is_dir():
        raise FileNotFoundError(
            f"imagereward: tokenizer_path '{tokenizer_path}' is not a local folder; download the tokenizer of "
            "google-bert/bert-base-uncased and pass its folder"
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_path, local_files_only=True)
    except (OSError, ValueError) as err:
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise OSError(f"imagereward: cannot load a BERT tokenizer from '{tokenizer_path}' ({first_line})") from err
    tokenizer.add_tokens(["[DEC]", "[ENC]"], special_tokens=True)  # as BLIP's init_tokenizer (ids 30522, 30523)
    from .convert import load_state_dict  # not at the top: `python -m rewards.convert` runs without a double import

    weights = convert_imagereward_state_dict(load_state_dict(path, reward="imagereward"))  # fails before building
    model = ImageRewardModel(imagereward_config())
    load_converted(model, weights, source=f"checkpoint '{checkpoint}'")
    return ImageReward(model, tokenizer, device=device, dtype=dtype, batch_size=batch_size)
