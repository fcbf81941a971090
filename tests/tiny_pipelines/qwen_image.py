"""Qwen-Image: a tiny random ``QwenImagePipeline`` (a tiny Qwen2.5-VL text encoder with an offline byte-level BPE
tokenizer trained on the pipeline's prompt template) and the stock pipeline's images."""

from __future__ import annotations

from pathlib import Path

import torch

from .common import prompts_of, sized, stock_pipeline
from .text import QWEN_ROPE, build_qwen_tokenizer, text_model_config


def qwen_text_encoder(tok, vision: dict, **token_ids):
    """A 1-layer Qwen2_5_VLForConditionalGeneration (hidden 32) over ``tok`` with a 1-block vision tower (16 wide,
    ``vision``: its patch and window settings) and the vision token ids ``token_ids``."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    tower = dict(
        depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32, fullatt_block_indexes=[0]
    )
    return Qwen2_5_VLForConditionalGeneration(
        Qwen2_5_VLConfig(
            text_config=text_model_config(tok, 32, 1, rope_parameters=QWEN_ROPE),
            vision_config={**tower, **vision},
            **token_ids,
        )
    )


def qwen_image_parts() -> dict:
    """The image components of the tiny Qwen-Image pipelines (drawn in this order from the global seed): a Qwen-Image
    VAE of factor 4 with 4 latent channels and random-looking latent statistics, a 1-block Qwen-Image transformer and
    Qwen-Image's scheduler config (dynamic shift 0.5..0.9 over 256..8192 tokens, shift_terminal 0.02)."""
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel

    vae = AutoencoderKLQwenImage(
        base_dim=8,
        z_dim=4,
        dim_mult=[1, 2, 2],
        num_res_blocks=1,
        temperal_downsample=[False, True],
        latents_mean=[0.1, -0.2, 0.3, 0.0],
        latents_std=[1.5, 0.8, 1.2, 2.0],
    )
    dit = QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=16,
        out_channels=4,
        num_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        axes_dims_rope=(4, 6, 6),
    )
    scheduler = FlowMatchEulerDiscreteScheduler(
        base_image_seq_len=256,
        base_shift=0.5,
        max_image_seq_len=8192,
        max_shift=0.9,
        shift=1.0,
        shift_terminal=0.02,
        time_shift_type="exponential",
        use_dynamic_shifting=True,
    )
    return {"vae": vae, "transformer": dit, "scheduler": scheduler}


def build_random_qwen_image_pipeline(folder: Path) -> Path:
    """Save a random-weight QwenImagePipeline to ``folder`` (seeded): :func:`tiny_pipelines.text.build_qwen_tokenizer`
    with a 1-layer Qwen2.5-VL text encoder (hidden 32, a 1-block vision tower it never uses) and
    :func:`qwen_image_parts`."""
    from diffusers import QwenImagePipeline

    torch.manual_seed(0)
    tok = build_qwen_tokenizer()
    n = len(tok)
    te = qwen_text_encoder(
        tok,
        dict(patch_size=2, window_size=8),
        image_token_id=n + 1,
        video_token_id=n + 2,
        vision_start_token_id=n + 3,
        vision_end_token_id=n + 4,
    )
    QwenImagePipeline(text_encoder=te, tokenizer=tok, **qwen_image_parts()).save_pretrained(folder)
    return folder


def stock_qwen_image(folder, model, metas, noise, num_steps, guidance_scale, lora=None) -> torch.Tensor:
    """The stock QwenImagePipeline's images ``(B, 3, H, W)`` in [0, 1] for the records ``metas`` from the noise
    ``noise (B, *model.latent_shape)`` (packed as the pipeline packs latents): its schedule, true CFG against ``""``
    above 1; ``lora``: a LoRA folder it loads first."""
    pipe = stock_pipeline(folder, "QwenImagePipeline", lora)
    latents = pipe._pack_latents(noise, len(metas), *model.latent_shape)
    negative = "" if guidance_scale > 1 else None
    with torch.no_grad():
        return pipe(
            prompts_of(metas),
            negative_prompt=negative,
            true_cfg_scale=guidance_scale,
            latents=latents,
            **sized(model, num_steps),
        ).images
