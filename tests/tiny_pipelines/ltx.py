"""LTX-Video: a tiny random ``LTXPipeline`` (a 1-layer T5 encoder with an offline T5 tokenizer,
``LTXVideoTransformer3DModel``, a timestep-conditioned ``AutoencoderKLLTXVideo`` with random latent statistics,
LTX-Video's dynamically shifting scheduler with its shift_terminal) and the stock pipeline's videos."""

from __future__ import annotations

from pathlib import Path

import torch

from .common import prompts_of, sized, stock_pipeline
from .text import t5_config, word_t5_tokenizer

WORDS = (
    "a an the photo of red blue green yellow circle circles square squares star stars moving left right up down two "
    "three then appears and blurry static video".split()
)
"""The tiny T5 tokenizer's whole words (the motion prompts' and the negative prompt's)."""
LTX_SCHEDULER = dict(
    use_dynamic_shifting=True,
    base_shift=0.95,
    max_shift=2.05,
    base_image_seq_len=1024,
    max_image_seq_len=4096,
    shift_terminal=0.1,
)
"""LTX-Video's scheduler config (diffusers' scripts/convert_ltx_to_diffusers.py, the Lightricks/LTX-Video folders)."""
LTX_VAE = dict(
    latent_channels=8,
    block_out_channels=(8, 8),
    decoder_block_out_channels=(8, 16),
    layers_per_block=(1, 1, 1),
    decoder_layers_per_block=(1, 1, 1),
    spatio_temporal_scaling=(True, True),
    decoder_spatio_temporal_scaling=(True, True),
    decoder_inject_noise=(False, False, False),
    upsample_residual=(True, True),
    upsample_factor=(2, 2),
    patch_size=2,
    patch_size_t=1,
    scaling_factor=0.9,
)
"""The tiny LTX video VAE (LTX-Video's and LTX-2's): 8x in space (patch 2 x two scaling blocks) and 4x in time into 8
channels, with residual upsamplers and scaling factor 0.9."""


def randomize_latent_statistics(vae, channels: int) -> None:
    """Draw the VAE's ``latents_mean`` (``N(0, 0.3^2)``) and ``latents_std`` (``U(0.5, 1.5)``) of ``channels`` each from
    the global seed, so that decoding checks the de-normalisation."""
    vae.latents_mean.copy_(torch.randn(channels) * 0.3)
    vae.latents_std.copy_(torch.rand(channels) + 0.5)


def build_random_ltx_pipeline(folder: Path, timestep_conditioning: bool = True) -> Path:
    """Save a random-weight LTXPipeline to ``folder`` (seeded; seconds): a T5 tokenizer over a small word-piece
    vocabulary with a 1-layer T5 encoder (d_model 32), an AutoencoderKLLTXVideo (:data:`LTX_VAE`, LTX-Video 0.9.1's
    residual upsamplers, a timestep-conditioned decoder: ``timestep_conditioning``) with random latent statistics, a
    2-block LTXVideoTransformer3DModel (patch 1), and LTX-Video's scheduler config (:data:`LTX_SCHEDULER`)."""
    from diffusers import (
        AutoencoderKLLTXVideo,
        FlowMatchEulerDiscreteScheduler,
        LTXPipeline,
        LTXVideoTransformer3DModel,
    )
    from transformers import T5Config, T5EncoderModel

    torch.manual_seed(0)
    tokenizer = word_t5_tokenizer(WORDS)
    encoder = T5EncoderModel(T5Config(**t5_config(len(tokenizer), pad_token_id=0, eos_token_id=1)))
    vae = AutoencoderKLLTXVideo(
        down_block_types=("LTXVideoDownBlock3D",) * 2,
        downsample_type=("conv", "conv"),
        timestep_conditioning=timestep_conditioning,
        **LTX_VAE,
    )
    randomize_latent_statistics(vae, 8)
    dit = LTXVideoTransformer3DModel(
        in_channels=8,
        out_channels=8,
        patch_size=1,
        patch_size_t=1,
        num_attention_heads=2,
        attention_head_dim=16,
        cross_attention_dim=32,
        num_layers=2,
        caption_channels=32,
    )
    pipe = LTXPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**LTX_SCHEDULER),
        vae=vae,
        text_encoder=encoder,
        tokenizer=tokenizer,
        transformer=dit,
    )
    pipe.save_pretrained(folder)
    return folder


def stock_ltx(folder, model, metas, noise, num_steps, guidance_scale, **kwargs) -> torch.Tensor:
    """The stock LTXPipeline's videos ``(B, F, 3, H, W)`` float32 in [0, 1] for the prompt records ``metas`` from the
    latents ``noise (B, *model.latent_shape)`` (packed with the pipeline's ``_pack_latents``: the pipeline takes
    ``latents=`` as tokens), at the model's frames, side and prompt length; ``kwargs``: the pipeline's own
    (``negative_prompt``, ``guidance_rescale``, ``frame_rate``, ``decode_timestep``, ``decode_noise_scale``)."""
    pipe = stock_pipeline(folder, "LTXPipeline")
    settings = {"guidance_scale": guidance_scale, **sized(model, num_steps, frames=True), **kwargs}
    with torch.no_grad():
        return pipe(prompts_of(metas), latents=pipe._pack_latents(noise), **settings).frames
