"""Z-Image: a tiny random ``ZImagePipeline`` (a tiny Qwen3 text encoder with the offline Qwen tokenizer and a
Qwen3-style chat template) and the stock pipeline's images."""

from __future__ import annotations

from pathlib import Path

import torch

from .common import FLUX_VAE, prompts_of, sized, stock_pipeline
from .text import QWEN3_CHAT_TEMPLATE, build_qwen_tokenizer, text_model_config


def build_random_z_image_pipeline(folder: Path) -> Path:
    """Save a random-weight ZImagePipeline to ``folder`` (seeded): a 2-layer Qwen3 text encoder (hidden 32; the
    pipeline reads its second-to-last hidden states) with an offline Qwen2 tokenizer and a Qwen3-style chat template,
    a VAE of factor 4 with 4 latent channels and FLUX's scaling and shift factors (Z-Image's VAE is FLUX's), a Z-Image
    transformer of one main layer and one noise and one context refiner, and Z-Image-Turbo's scheduler config (static
    shift 3)."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel
    from transformers import Qwen3Config, Qwen3Model

    torch.manual_seed(0)
    tok = build_qwen_tokenizer()
    tok.chat_template = QWEN3_CHAT_TEMPLATE
    te = Qwen3Model(Qwen3Config(**text_model_config(tok, 32, 2, head_dim=16)))
    vae = AutoencoderKL(**FLUX_VAE)
    dit = ZImageTransformer2DModel(
        in_channels=4,
        dim=32,
        n_layers=1,
        n_refiner_layers=1,
        n_heads=2,
        n_kv_heads=2,
        cap_feat_dim=32,
        axes_dims=[4, 6, 6],
        axes_lens=[256, 32, 32],
    )
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False)
    pipe = ZImagePipeline(scheduler=scheduler, vae=vae, text_encoder=te, tokenizer=tok, transformer=dit)
    pipe.save_pretrained(folder)
    return folder


def stock_z_image(folder, model, metas, noise, num_steps, guidance_scale, **options) -> torch.Tensor:
    """The stock ZImagePipeline's images ``(B, 3, H, W)`` float32 in [0, 1] for the prompt records ``metas`` from the
    latents ``noise (B, *model.latent_shape)``, with flowrl's guidance scale ``w`` (the pipeline's ``guidance_scale``
    is ``w - 1``, its negative the empty prompt: the default ``negative_prompt=None``); ``options``: the pipeline's
    ``cfg_normalization`` / ``cfg_truncation``."""
    pipe = stock_pipeline(folder, "ZImagePipeline")
    guidance = guidance_scale - 1.0
    with torch.no_grad():
        return pipe(
            prompts_of(metas), guidance_scale=guidance, latents=noise, **sized(model, num_steps), **options
        ).images
