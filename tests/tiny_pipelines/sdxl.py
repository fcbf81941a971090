"""Stable Diffusion XL: a tiny random ``StableDiffusionXLPipeline`` (two CLIP text encoders, pooled embeddings, added
time ids) and the stock pipeline's DDIM images."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .common import AUTOENCODER_KL
from .sd15 import stock_ddim
from .text import clip_text_config, tiny_clip_tokenizer

SDXL_SCHEDULER = {  # stabilityai/stable-diffusion-xl-base-1.0's scheduler/scheduler_config.json (an Euler config)
    "_class_name": "EulerDiscreteScheduler",
    "beta_end": 0.012,
    "beta_schedule": "scaled_linear",
    "beta_start": 0.00085,
    "clip_sample": False,
    "interpolation_type": "linear",
    "num_train_timesteps": 1000,
    "prediction_type": "epsilon",
    "sample_max_value": 1.0,
    "set_alpha_to_one": False,
    "skip_prk_steps": True,
    "steps_offset": 1,
    "timestep_spacing": "leading",
    "trained_betas": None,
    "use_karras_sigmas": False,
}
SDXL_STOCK = {"add_watermarker": False}
"""The stock ``from_pretrained`` keyword arguments of the tiny SDXL pipelines (no watermark)."""


def build_random_sdxl_pipeline(folder: Path, prediction_type: str = "epsilon", force_zeros: bool = True) -> Path:
    """Save a random-weight StableDiffusionXLPipeline to ``folder`` (seeded): a 2-block UNet (8, 16 channels) with
    SDXL's ``text_time`` added embedding (8 per time id + the 32-wide pooled projection), two 2-layer CLIP text
    encoders (the second with projection; 32 + 32 = the UNet's cross-attention width 64) with the tiny CLIP tokenizer,
    a VAE with factor 4 and SDXL's scaling factor, and SDXL base's scheduler config with ``prediction_type``;
    ``force_zeros``: the pipeline's ``force_zeros_for_empty_prompt``."""
    from diffusers import AutoencoderKL, EulerDiscreteScheduler, StableDiffusionXLPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    torch.manual_seed(0)
    tok = tiny_clip_tokenizer()
    config = clip_text_config(tok, 2, tok.model_max_length)
    clip, clip_2 = (
        CLIPTextModel(CLIPTextConfig(**config)),
        CLIPTextModelWithProjection(CLIPTextConfig(**config, projection_dim=32)),
    )
    unet = UNet2DConditionModel(
        sample_size=8,
        in_channels=4,
        out_channels=4,
        layers_per_block=1,
        block_out_channels=(8, 16),
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=64,
        attention_head_dim=(2, 4),
        use_linear_projection=True,
        transformer_layers_per_block=(1, 2),
        addition_embed_type="text_time",
        addition_time_embed_dim=8,
        projection_class_embeddings_input_dim=6 * 8 + 32,
        norm_num_groups=8,
    )
    vae = AutoencoderKL(**AUTOENCODER_KL, sample_size=32, scaling_factor=0.13025, force_upcast=True)
    pipe = StableDiffusionXLPipeline(
        vae=vae,
        text_encoder=clip,
        text_encoder_2=clip_2,
        tokenizer=tok,
        tokenizer_2=tok,
        unet=unet,
        scheduler=EulerDiscreteScheduler(),
        force_zeros_for_empty_prompt=force_zeros,
        **SDXL_STOCK,
    )
    pipe.save_pretrained(folder)
    scheduler = {**SDXL_SCHEDULER, "prediction_type": prediction_type}
    (folder / "scheduler" / "scheduler_config.json").write_text(json.dumps(scheduler, indent=2))
    return folder


def stock_sdxl(folder, model, metas, noise, num_steps, guidance_scale, lora=None, **kwargs) -> torch.Tensor:
    """The stock StableDiffusionXLPipeline's images (:func:`tiny_pipelines.sd15.stock_ddim`); ``kwargs``: the
    pipeline's own (``guidance_rescale``)."""
    cls = "StableDiffusionXLPipeline"
    return stock_ddim(cls, folder, model, metas, noise, num_steps, guidance_scale, lora, SDXL_STOCK, **kwargs)
