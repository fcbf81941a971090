"""HunyuanVideo 1.5 image-to-video: a tiny random ``HunyuanVideo15ImageToVideoPipeline`` (the text-to-video pipeline's
prompt components, a cheaper VAE, an image-to-video transformer, a 1-layer SigLIP vision tower) and the stock
pipeline's videos."""

from __future__ import annotations

from pathlib import Path

import torch

from .common import per_record, stock_pipeline
from .hunyuan_video15 import HV15_TRANSFORMER, random_hunyuan_video15_text_components
from .wan_i2v import source_frame

SIDE = 16  # px: the transformer's target size


def build_random_hunyuan_video15_i2v_pipeline(folder: Path) -> Path:
    """Save a random-weight HunyuanVideo15ImageToVideoPipeline to ``folder`` (seeded; seconds): the Qwen2.5-VL and ByT5
    prompt components, scheduler (shift 5) and guider (scale 6) of
    :func:`tiny_pipelines.hunyuan_video15.random_hunyuan_video15_text_components`; an AutoencoderKLHunyuanVideo15 of
    8-channel blocks compressing 4x in space and 4x in time into 4 channels with scaling factor 0.9 (a quarter of the
    text-to-video test VAE's decoding cost: the stock comparison decodes 12 videos); a 1-block image-to-video
    HunyuanVideo15Transformer3DModel (in_channels 2 x 4 + 1, 16-wide image tokens, target_size 16); a 1-layer SigLIP
    vision tower (16 px, 8 px patches: 4 tokens of width 16) with its SiglipImageProcessor, whose last hidden states
    are the transformer's image tokens."""
    from diffusers import (
        AutoencoderKLHunyuanVideo15,
        HunyuanVideo15ImageToVideoPipeline,
        HunyuanVideo15Transformer3DModel,
    )
    from transformers import SiglipImageProcessor, SiglipVisionConfig, SiglipVisionModel

    text = random_hunyuan_video15_text_components()  # seeds 0
    vae = AutoencoderKLHunyuanVideo15(
        latent_channels=4,
        block_out_channels=(8, 8, 8),
        layers_per_block=1,
        spatial_compression_ratio=4,
        temporal_compression_ratio=4,
        scaling_factor=0.9,
    )
    dit = HunyuanVideo15Transformer3DModel(target_size=SIDE, task_type="i2v", **HV15_TRANSFORMER)
    siglip = SiglipVisionModel(
        SiglipVisionConfig(
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=16,
            patch_size=8,
        )
    )
    pipe = HunyuanVideo15ImageToVideoPipeline(
        transformer=dit,
        vae=vae,
        image_encoder=siglip,
        feature_extractor=SiglipImageProcessor(size={"height": 16, "width": 16}),
        **text,
    )
    pipe.save_pretrained(folder)
    return folder


def stock_hunyuan_video15_i2v(
    folder, model, metas, noise, num_steps, guidance_scale, negative_prompt=None
) -> torch.Tensor:
    """The stock HunyuanVideo15ImageToVideoPipeline's videos ``(B, F, 3, H, W)`` float32 in [0, 1] for the prompt
    records ``metas`` from the initial latents ``noise (B, *model.latent_shape)``: one call per record (the pipeline
    takes one image), its source frame (:func:`tiny_pipelines.wan_i2v.source_frame`), at the model's frames and prompt
    length (``tokenizer_max_length``), its size the ``target_size`` bucket of the source's aspect ratio with
    ``target_size = model.resolution`` (the square for a square source), guided by its guider at ``guidance_scale``
    against ``negative_prompt`` (None: ``""``)."""
    pipe = stock_pipeline(folder, "HunyuanVideo15ImageToVideoPipeline")
    pipe.tokenizer_max_length, pipe.target_size = model.max_sequence_length, model.resolution
    pipe.guider = pipe.guider.new(guidance_scale=guidance_scale)

    def one(meta, z):
        source = source_frame(meta, model.resolution)
        call = dict(prompt=meta["prompt"], negative_prompt=negative_prompt, latents=z, num_frames=model.num_frames)
        return pipe(image=source, num_inference_steps=num_steps, output_type="pt", **call).frames

    return per_record(one, metas, noise)
