"""Wan 2.1 / 2.2 text-to-video: a tiny random ``WanPipeline`` (UMT5 with an offline T5 tokenizer,
``WanTransformer3DModel``, ``AutoencoderKLWan``) and the stock pipeline's videos."""

from __future__ import annotations

from pathlib import Path

import torch

from .common import stock_text_to_video
from .text import t5_config, word_t5_tokenizer

WORDS = (
    "a an the photo of red blue green yellow circle circles square squares star stars moving left right up down two "
    "three then appears and".split()
)
"""The tiny T5 tokenizer's whole words (the motion prompts')."""
WAN_TRANSFORMER = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=2,
    attention_head_dim=8,
    out_channels=4,
    text_dim=32,
    freq_dim=16,
    ffn_dim=32,
    num_layers=2,
    cross_attn_norm=True,
    qk_norm="rms_norm_across_heads",
    rope_max_seq_len=32,
)
"""The tiny 2-block Wan transformer (text-to-video and image-to-video alike), bar its input channels."""


def build_random_wan_pipeline(folder: Path, two_experts: bool = False, expand_timesteps: bool = False) -> Path:
    """Save a random-weight WanPipeline to `folder` (seeded): a T5 tokenizer over a small word-piece vocabulary, a
    1-layer UMT5 encoder, a Wan VAE (4 latent channels, 4x temporal and 4x spatial compression, Wan-style latent
    mean/std), a 2-block Wan transformer and the flow-matching Euler scheduler at shift 3 (Wan 480P's flow shift);
    `two_experts`: a second transformer and boundary_ratio 0.5 (Wan 2.2 A14B's layout); ``expand_timesteps``: the
    pipeline's (Wan 2.2 TI2V 5B's per-token timesteps)."""
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    torch.manual_seed(0)
    tokenizer = word_t5_tokenizer(WORDS)
    encoder = UMT5EncoderModel(UMT5Config(**t5_config(len(tokenizer), pad_token_id=0, eos_token_id=1)))
    vae = AutoencoderKLWan(
        base_dim=4,
        z_dim=4,
        dim_mult=[1, 1, 1],
        num_res_blocks=0,
        temperal_downsample=[True, True],
        scale_factor_spatial=4,
        latents_mean=[0.1, -0.2, 0.05, 0.0],
        latents_std=[1.5, 0.8, 1.2, 1.0],
    )
    pipe = WanPipeline(
        tokenizer=tokenizer,
        text_encoder=encoder,
        vae=vae,
        transformer=WanTransformer3DModel(in_channels=4, **WAN_TRANSFORMER),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        transformer_2=WanTransformer3DModel(in_channels=4, **WAN_TRANSFORMER) if two_experts else None,
        boundary_ratio=0.5 if two_experts else None,
        expand_timesteps=expand_timesteps,
    )
    pipe.save_pretrained(folder)
    return folder


def stock_wan(
    folder: Path, model, metas: list[dict], noise: torch.Tensor, num_steps: int, guidance_scale: float, **kwargs
) -> torch.Tensor:
    """The stock WanPipeline's videos (:func:`tiny_pipelines.common.stock_text_to_video`)."""
    return stock_text_to_video("WanPipeline", folder, model, metas, noise, num_steps, guidance_scale, **kwargs)
