"""Stable Diffusion 3: a tiny random ``StableDiffusion3Pipeline`` with the tiny model's architecture (the golden runs'
and most trainer tests' pipeline) and the stock pipeline's images."""

from __future__ import annotations

from pathlib import Path

import torch

from .common import AUTOENCODER_KL, prompts_of, sized, stock_pipeline
from .text import clip_text_config

NO_T5 = {"text_encoder_3": None, "tokenizer_3": None}
"""The tiny SD3 pipelines have no T5 encoder (``null`` is not saved in ``model_index.json``): the keyword arguments
of the stock ``from_pretrained``."""


def build_random_sd3_pipeline(folder: Path) -> Path:
    """Save a random-weight StableDiffusion3Pipeline with the tiny model's architecture to ``folder`` (seeded): one
    2-layer CLIP text model with projection as both text encoders (the real CLIP BPE tokenizer of
    ``flowrl.tiny.build``), no T5, a VAE of factor 4, a 2-block SD3 transformer and the Euler scheduler at shift 1."""
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    from flowrl.tiny.build import MAX_TOKENS, build_tokenizer

    torch.manual_seed(0)
    tok = build_tokenizer()
    te = CLIPTextModelWithProjection(CLIPTextConfig(**clip_text_config(tok, 2, MAX_TOKENS, projection_dim=32)))
    vae = AutoencoderKL(**AUTOENCODER_KL, sample_size=64)
    dit = SD3Transformer2DModel(
        sample_size=16,
        patch_size=2,
        in_channels=4,
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=64,
        caption_projection_dim=32,
        pooled_projection_dim=64,
        out_channels=4,
        pos_embed_max_size=16,
        qk_norm="rms_norm",
    )
    pipe = StableDiffusion3Pipeline(
        transformer=dit,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=1.0),
        vae=vae,
        text_encoder=te,
        tokenizer=tok,
        text_encoder_2=te,
        tokenizer_2=tok,
        **NO_T5,
    )
    pipe.save_pretrained(folder)
    return folder


def stock_sd3(folder, model, metas, noise, num_steps, guidance_scale) -> torch.Tensor:
    """The stock StableDiffusion3Pipeline's images ``(B, 3, H, W)`` in [0, 1] for the records ``metas`` from the
    noise ``noise (B, *model.latent_shape)``, at the model's side and prompt length (the random VAE has no shift
    factor; the stock decode adds it: 0, as flowrl's)."""
    pipe = stock_pipeline(folder, "StableDiffusion3Pipeline", **NO_T5)
    if pipe.vae.config.shift_factor is None:
        pipe.vae.register_to_config(shift_factor=0.0)
    with torch.no_grad():
        return pipe(prompts_of(metas), latents=noise, guidance_scale=guidance_scale, **sized(model, num_steps)).images
