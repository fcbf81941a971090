"""Qwen-Image-Edit: tiny random ``QwenImageEditPipeline`` / ``QwenImageEditPlusPipeline`` (a tiny Qwen2.5-VL with a
vision tower, a Qwen2VLProcessor and a byte-level BPE tokenizer trained on the edit template) and the stock
pipelines' edits."""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path
from unittest import mock

import torch

from .common import per_record, sized, stock_pipeline
from .qwen_image import qwen_image_parts, qwen_text_encoder
from .text import QWEN_SPECIALS, qwen2_tokenizer, tiny_world_prompts

SIDE = 32  # px: the image processor's largest source area is SIDE x SIDE
EDIT_SYSTEM = (
    "<|im_start|>system\nDescribe the key features of the input image (color, shape, size, texture, objects, "
    "background), then explain how the user's text instruction should alter or modify the image. Generate a new image "
    "that meets the user's requirements while maintaining consistency with the original input where appropriate."
    "<|im_end|>\n<|im_start|>user\n"
)
"""The edit pipelines' system prefix, 64 tokens with Qwen's tokenizer (``prompt_template_encode_start_idx``)."""
SPECIALS = [*QWEN_SPECIALS, "<|vision_start|>", "<|vision_end|>", "<|image_pad|>"]


def build_qwen_edit_tokenizer():
    """A Qwen2Tokenizer of 500 tokens (:func:`tiny_pipelines.text.qwen2_tokenizer`) with Qwen2.5-VL's vision tokens,
    trained on the edit template and the tiny world's prompts, so that the template's system prefix is 64 tokens, as
    with Qwen's own tokenizer: the edit pipelines drop exactly that many (``prompt_template_encode_start_idx``)."""
    text = EDIT_SYSTEM + "<|vision_start|><|image_pad|><|vision_end|>{}<|im_end|>\n<|im_start|>assistant\n"
    return qwen2_tokenizer([text.format(p) for p in tiny_world_prompts()], 500, [*SPECIALS, "<|video_pad|>"])


def build_random_qwen_image_edit_pipeline(folder: Path, plus: bool = False) -> Path:
    """Save a random-weight QwenImageEditPipeline (``plus``: QwenImageEditPlusPipeline) to ``folder`` (seeded; about a
    second): a 1-layer Qwen2.5-VL (hidden 32) with a 1-block vision tower (4 px patches, 2 x 2 merge), a
    Qwen2VLProcessor whose image processor keeps at most 32 x 32 px, and the VAE, transformer and scheduler of
    :func:`tiny_pipelines.qwen_image.qwen_image_parts`."""
    from diffusers import QwenImageEditPipeline, QwenImageEditPlusPipeline
    from transformers import Qwen2VLImageProcessor, Qwen2VLProcessor, Qwen2VLVideoProcessor

    torch.manual_seed(0)
    tok = build_qwen_edit_tokenizer()
    ids = tok.convert_tokens_to_ids
    vision = dict(patch_size=4, temporal_patch_size=2, merge_size=2, min_pixels=8 * 8, max_pixels=SIDE * SIDE)
    te = qwen_text_encoder(
        tok,
        dict(patch_size=4, temporal_patch_size=2, spatial_merge_size=2, window_size=16),
        image_token_id=ids("<|image_pad|>"),
        video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"),
        vision_end_token_id=ids("<|vision_end|>"),
    )
    processor = Qwen2VLProcessor(
        image_processor=Qwen2VLImageProcessor(**vision),
        tokenizer=tok,
        video_processor=Qwen2VLVideoProcessor(**vision),
    )
    cls = QwenImageEditPlusPipeline if plus else QwenImageEditPipeline
    cls(text_encoder=te, tokenizer=tok, processor=processor, **qwen_image_parts()).save_pretrained(folder)
    return folder


def stock_qwen_image_edit(folder, model, metas, noise, num_steps, guidance_scale, lora=None) -> torch.Tensor:
    """The stock pipeline's edits ``(B, 3, H, W)`` float32 in [0, 1] (``output_type="pt"``) of the records ``metas``
    (dicts with ``prompt`` and ``image``) from the noise latents ``noise (B, *model.latent_shape)``, one record per
    call (QwenImageEditPipeline sizes every source of a call by the first one's; the Plus pipeline takes one prompt),
    with its own schedule and true CFG against ``""`` above 1; ``lora``: a LoRA folder it loads first.

    The one constant changed is the area the pipeline gives a source image in the VAE, 1024 * 1024 in both
    (``calculate_dimensions(1024 * 1024, ratio)``; ``VAE_IMAGE_SIZE``): it is set to ``model.source_resolution ** 2``,
    as flowrl's ``model.options.source_resolution`` (and Flow-GRPO's Qwen-Image-Edit-Plus script) set it."""
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit as edit
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus as plus
    from PIL import Image

    from flowrl.models import QwenImageEditPlusModel

    pipe = stock_pipeline(folder, model.PIPELINE, lora)
    area = model.source_resolution**2
    settings = dict(true_cfg_scale=guidance_scale, **sized(model, num_steps, length=False))
    negative = [""] if guidance_scale > 1 else None

    def one(meta, z):
        source = Image.open(meta["image"]).convert("RGB")
        image = [source] if isinstance(model, QwenImageEditPlusModel) else source
        latents = pipe._pack_latents(z, 1, *model.latent_shape)
        return pipe(image=image, prompt=[meta["prompt"]], negative_prompt=negative, latents=latents, **settings).images

    with ExitStack() as patches:
        original = edit.calculate_dimensions
        patches.enter_context(mock.patch.object(edit, "calculate_dimensions", lambda _, r: original(area, r)))
        patches.enter_context(mock.patch.object(plus, "VAE_IMAGE_SIZE", area))
        return per_record(one, metas, noise)
