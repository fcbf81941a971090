"""Wan image-to-video: tiny random ``WanImageToVideoPipeline`` (the tiny Wan text-to-video components, an
image-to-video transformer and, for Wan 2.1, a tiny CLIP vision tower) and the stock pipeline's videos."""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from .clip import CLIP_VISION, clip_image_processor
from .common import per_record, sized, stock_pipeline
from .wan import WAN_TRANSFORMER, build_random_wan_pipeline


def build_random_wan_i2v_pipeline(folder: Path, image_encoder: bool = True, two_experts: bool = False) -> Path:
    """Save a random-weight WanImageToVideoPipeline to `folder` (seeded): the tokenizer, 1-layer UMT5, Wan VAE (4 latent
    channels, 4x temporal and spatial compression) and flow-matching scheduler (shift 3) of
    :func:`tiny_pipelines.wan.build_random_wan_pipeline`, and a 2-block image-to-video transformer taking 2 x 4 + 4
    channels (noise, mask, source latents). Its cross-attention keys are normalised with weight 8, not 1: at random
    weights the prompt's few tokens would be drowned by the 500 padding tokens of the 512 the image-to-video attention
    needs (guidance and the negative prompt would change the videos by about 3e-4; a trained model attends to the
    prompt). `image_encoder` (Wan 2.1's layout): a 2-layer CLIP vision tower (32 px, 8 px patches: 17 tokens of 32)
    with its CLIPImageProcessor, whose second-to-last hidden states the transformer attends to (``image_dim`` 32).
    Without it (Wan 2.2's layout) `two_experts` adds a second transformer and boundary_ratio 0.5 (Wan 2.2 I2V A14B's)."""
    from diffusers import WanImageToVideoPipeline, WanPipeline, WanTransformer3DModel
    from transformers import CLIPVisionConfig, CLIPVisionModel

    with tempfile.TemporaryDirectory() as tmp:
        t2v = WanPipeline.from_pretrained(build_random_wan_pipeline(Path(tmp)))  # seeds 0
    clip = processor = None
    if image_encoder:
        clip = CLIPVisionModel(CLIPVisionConfig(**CLIP_VISION))
        processor = clip_image_processor()

    def transformer():
        dit = WanTransformer3DModel(
            in_channels=12,
            image_dim=32 if image_encoder else None,
            added_kv_proj_dim=16 if image_encoder else None,  # the transformer's width, as Wan 2.1 I2V's
            **WAN_TRANSFORMER,
        )
        for block in dit.blocks:  # sharpen the text attention: see the docstring
            block.attn2.norm_k.weight.data.fill_(8.0)
        return dit

    pipe = WanImageToVideoPipeline(
        tokenizer=t2v.tokenizer,
        text_encoder=t2v.text_encoder,
        vae=t2v.vae,
        scheduler=t2v.scheduler,
        image_processor=processor,
        image_encoder=clip,
        transformer=transformer(),
        transformer_2=transformer() if two_experts else None,
        boundary_ratio=0.5 if two_experts else None,
    )
    pipe.save_pretrained(folder)
    return folder


def source_frame(meta: dict, side: int):
    """A record's source image read as RGB, or for a record without one the adapter's blank ``side`` px frame
    (``flowrl.models.wan_i2v.BLANK_SOURCE``)."""
    from PIL import Image

    from flowrl.models.wan_i2v import BLANK_SOURCE

    if meta.get("image"):
        return Image.open(meta["image"]).convert("RGB")
    return Image.new("RGB", (side, side), BLANK_SOURCE)


def stock_wan_i2v(
    folder, model, metas, noise, num_steps, guidance_scale, negative_prompt=None, lora=None
) -> torch.Tensor:
    """The stock pipeline's videos ``(B, F, 3, H, W)`` float32 in [0, 1] (``output_type="pt"``) of the records `metas`
    from the noise latents ``noise (B, *model.latent_shape)``: one call per record (the pipeline takes one image), its
    source frame (:func:`source_frame`), CFG against `negative_prompt` (None: ``""``) above 1; `lora`: a LoRA folder
    it loads first. The scheduler is the folder's flow-matching Euler one."""
    pipe = stock_pipeline(folder, "WanImageToVideoPipeline", lora)
    settings = {"guidance_scale": guidance_scale, **sized(model, num_steps, frames=True)}
    negative = [negative_prompt] if negative_prompt else None

    def one(meta, z):
        source = source_frame(meta, model.resolution)
        return pipe(image=source, prompt=[meta["prompt"]], negative_prompt=negative, latents=z, **settings).frames

    return per_record(one, metas, noise)
