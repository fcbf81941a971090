"""FLUX.1: a tiny random ``FluxPipeline`` (guidance-distilled as FLUX.1-dev, or not as FLUX.1-schnell) and the stock
pipeline's images."""

from __future__ import annotations

from pathlib import Path

import torch

from .common import FLUX_VAE, prompts_of, sized, stock_pipeline
from .text import clip_text_config, t5_config


def build_random_flux_pipeline(folder: Path, guidance_embeds: bool = True) -> Path:
    """Save a random-weight FluxPipeline to ``folder`` (seeded): CLIP and a 1-layer T5 (both with the tiny CLIP
    tokenizer), a VAE with factor 4 and FLUX's scaling and shift factors, a FLUX transformer of one dual- and one
    single-stream block (``guidance_embeds``: guidance-distilled), and FLUX.1's dynamically shifting scheduler."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    from flowrl.tiny.build import MAX_TOKENS, build_tokenizer

    torch.manual_seed(0)
    tok = build_tokenizer()
    clip = CLIPTextModel(CLIPTextConfig(**clip_text_config(tok, 1, MAX_TOKENS)))
    t5 = T5EncoderModel(T5Config(**t5_config(len(tok), pad_token_id=tok.pad_token_id)))
    vae = AutoencoderKL(**FLUX_VAE)
    dit = FluxTransformer2DModel(
        patch_size=1,
        in_channels=16,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        pooled_projection_dim=32,
        guidance_embeds=guidance_embeds,
        axes_dims_rope=(4, 6, 6),
    )
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=3.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=1.15,
        base_image_seq_len=256,
        max_image_seq_len=4096,
    )
    pipe = FluxPipeline(
        scheduler=scheduler,
        vae=vae,
        text_encoder=clip,
        tokenizer=tok,
        text_encoder_2=t5,
        tokenizer_2=tok,
        transformer=dit,
    )
    pipe.save_pretrained(folder)
    return folder


def flux_guidance(model, guidance_scale: float) -> dict:
    """The FLUX pipelines' guidance arguments for flowrl's ``guidance_scale``: the embedded guidance of a distilled
    transformer, or true CFG against the empty prompt for one without a guidance embedding."""
    cfg = {} if model.guidance_embeds else {"true_cfg_scale": guidance_scale, "negative_prompt": ""}
    return {"guidance_scale": guidance_scale, **cfg}


def stock_flux(folder, model, metas, noise, num_steps, guidance_scale) -> torch.Tensor:
    """The stock FluxPipeline's images ``(B, 3, H, W)`` in [0, 1] for the records ``metas`` from the noise ``noise
    (B, *model.latent_shape)`` (packed as the pipeline packs latents), with :func:`flux_guidance`."""
    pipe = stock_pipeline(folder, "FluxPipeline")
    latents = pipe._pack_latents(noise, len(metas), *model.latent_shape)
    with torch.no_grad():
        return pipe(
            prompts_of(metas), latents=latents, **flux_guidance(model, guidance_scale), **sized(model, num_steps)
        ).images
