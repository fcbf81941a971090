"""LTX-2: a tiny random ``LTX2Pipeline`` (a one-layer Gemma3ForConditionalGeneration with the offline Gemma tokenizer,
LTX2TextConnectors with learnable registers, ``LTX2VideoTransformer3DModel``, a timestep-conditioned
``AutoencoderKLLTX2Video`` and an ``AutoencoderKLLTX2Audio`` with random latent statistics, ``LTX2Vocoder``, LTX-2's
dynamically shifting scheduler with its shift_terminal) and the stock pipeline's videos."""

from __future__ import annotations

from pathlib import Path

import torch

from .common import prompts_of, sized, stock_pipeline
from .ltx import LTX_SCHEDULER, LTX_VAE, randomize_latent_statistics
from .text import build_gemma_tokenizer, text_model_config

STOCK_OFF = dict(
    stg_scale=0.0,
    modality_scale=1.0,
    guidance_rescale=0.0,
    audio_guidance_scale=None,
    audio_stg_scale=None,
    audio_modality_scale=None,
    audio_guidance_rescale=None,
)
"""LTX2Pipeline's guidance arguments as flowrl's defaults set them: CFG only, the audio terms following the video's
(the stock defaults are LTX-2.3's: STG 1 at block 28, modality guidance 3, rescale 0.7, audio CFG 7)."""


def _text_parts():
    """The tiny LTX-2 prompt components, drawn from the global seed in this order: the Gemma tokenizer, a one-layer
    Gemma3ForConditionalGeneration (hidden size 8, a one-layer SigLIP tower the pipeline never runs) and LTX-2.0-style
    LTX2TextConnectors (one block each, 8 learnable registers)."""
    from diffusers.pipelines.ltx2 import LTX2TextConnectors
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    tokenizer = build_gemma_tokenizer()
    text = text_model_config(tokenizer, 8, 1, head_dim=4, max_position_embeddings=64)
    vision = dict(
        hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2, image_size=16, patch_size=8
    )
    encoder = Gemma3ForConditionalGeneration(
        Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=len(tokenizer))
    )
    connectors = LTX2TextConnectors(
        caption_channels=8,
        text_proj_in_factor=2,  # the encoder's hidden states: embeddings + 1 layer
        video_connector_num_attention_heads=2,
        video_connector_attention_head_dim=4,
        video_connector_num_layers=1,
        video_connector_num_learnable_registers=8,
        audio_connector_num_attention_heads=2,
        audio_connector_attention_head_dim=4,
        audio_connector_num_layers=1,
        audio_connector_num_learnable_registers=8,
        connector_rope_base_seq_len=32,
        rope_double_precision=False,
        rope_type="split",
    )
    return {"tokenizer": tokenizer, "text_encoder": encoder, "connectors": connectors}


def _audio_parts():
    """An AutoencoderKLLTX2Audio of 2 latent channels over 8 mel bins at hop 80 (50 latent frames a second) with random
    latent statistics and a small LTX2Vocoder, drawn from the global seed."""
    from diffusers import AutoencoderKLLTX2Audio
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder

    audio_vae = AutoencoderKLLTX2Audio(
        base_channels=4,
        ch_mult=(1,),
        num_res_blocks=1,
        resolution=32,
        latent_channels=2,
        mel_bins=8,
        mel_hop_length=80,
    )
    randomize_latent_statistics(audio_vae, 4)
    vocoder = LTX2Vocoder(
        in_channels=audio_vae.config.output_channels * audio_vae.config.mel_bins,
        hidden_channels=16,
        out_channels=2,
        upsample_kernel_sizes=[4, 4],
        upsample_factors=[2, 2],
        resnet_kernel_sizes=[3],
        resnet_dilations=[[1, 3, 5]],
        output_sampling_rate=16000,
    )
    return {"audio_vae": audio_vae, "vocoder": vocoder}


def build_random_ltx2_pipeline(folder: Path) -> Path:
    """Save a random-weight LTX2Pipeline to ``folder`` (seeded; seconds): the prompt components of :func:`_text_parts`
    (prompt lengths must be multiples of 8), a 2-block LTX2VideoTransformer3DModel (8 video channels, 4 audio
    features, both streams 32 wide), an AutoencoderKLLTX2Video (:data:`tiny_pipelines.ltx.LTX_VAE`, spatiotemporal
    down- and upsampling, a timestep-conditioned decoder) with random latent statistics, the audio VAE and vocoder of
    :func:`_audio_parts`, and LTX-2's scheduler config (:data:`tiny_pipelines.ltx.LTX_SCHEDULER`, as diffusers'
    scripts/convert_ltx2_to_diffusers.py).

    The widths and the audio rate keep the transformer batch invariant on the CPU (the ratio is exactly 1): with a
    16-wide stream the per-sample SiLU of the timestep embedding, and with 9 audio tokens a sample (hop 160) the audio
    stream's projections, round differently for one sample than for several (measured on AMD EPYC, PyTorch's CPU
    kernels); LTX-2's own streams are 4096 and 2048 wide over 126 audio tokens."""
    from diffusers import (
        AutoencoderKLLTX2Video,
        FlowMatchEulerDiscreteScheduler,
        LTX2Pipeline,
        LTX2VideoTransformer3DModel,
    )

    torch.manual_seed(0)
    text = _text_parts()
    dit = LTX2VideoTransformer3DModel(
        in_channels=8,
        out_channels=8,
        num_attention_heads=2,
        attention_head_dim=16,
        cross_attention_dim=32,
        audio_in_channels=4,
        audio_out_channels=4,
        audio_num_attention_heads=2,
        audio_attention_head_dim=16,
        audio_cross_attention_dim=32,
        audio_hop_length=80,
        num_layers=2,
        caption_channels=8,
        rope_double_precision=False,
        rope_type="split",
    )
    vae = AutoencoderKLLTX2Video(
        down_block_types=("LTX2VideoDownBlock3D",) * 2,
        downsample_type=("spatiotemporal", "spatiotemporal"),
        upsample_type=("spatiotemporal", "spatiotemporal"),
        timestep_conditioning=True,
        **LTX_VAE,
    )
    randomize_latent_statistics(vae, 8)
    LTX2Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**LTX_SCHEDULER),
        vae=vae,
        transformer=dit,
        **text,
        **_audio_parts(),
    ).save_pretrained(folder)
    return folder


def stock_ltx2(folder, model, metas, noise, num_steps, guidance_scale, output_type="pt", **kwargs):
    """The stock LTX2Pipeline's videos ``(B, F, 3, H, W)`` float32 in [0, 1] for the prompt records ``metas`` from
    flowrl's latents ``noise (B, *model.latent_shape)``: its video tokens as the pipeline's packed ``latents=``, its
    audio tokens de-normalised with the audio VAE's statistics as ``audio_latents=`` (the pipeline normalises what it is
    given), at the model's frames, frame rate, side and prompt length, with flowrl's default guidance terms
    (:data:`STOCK_OFF`); ``kwargs``: the pipeline's own arguments (``negative_prompt``, the guidance terms,
    ``decode_timestep``, ...). With ``output_type="latent"``: ``(video latents (B, C, F, h, w), audio latents (B, C_a,
    L, M))``, both de-normalised, as the pipeline returns them."""
    pipe = stock_pipeline(folder, "LTX2Pipeline")
    video, audio = model.split_latents(noise)  # (B, S_v, C), (B, S_a, C_a), normalised
    audio = audio * pipe.audio_vae.latents_std + pipe.audio_vae.latents_mean
    negative = kwargs.pop("negative_prompt", None)
    settings = {**sized(model, num_steps, frames=True), "output_type": output_type, **STOCK_OFF, **kwargs}
    with torch.no_grad():
        frames, sound = pipe(
            prompts_of(metas),
            negative_prompt=[negative] * len(metas) if negative else None,
            latents=video,
            audio_latents=audio,
            frame_rate=model.frame_rate,
            guidance_scale=guidance_scale,
            return_dict=False,
            **settings,
        )
    return (frames, sound) if output_type == "latent" else frames
