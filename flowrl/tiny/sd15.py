"""A seeded random-weight Stable Diffusion 1.x pipeline folder, built offline (no download).

``build_random_sd15_pipeline(folder)`` saves a ``StableDiffusionPipeline`` made from the real diffusers and
transformers classes at a tiny size: a 2-block ``UNet2DConditionModel`` (8, 16 channels, cross-attention 32), an
``AutoencoderKL`` with factor 4, a 1-layer ``CLIPTextModel`` with the tiny world's CLIP tokenizer
(``assets/tiny-sd3/tokenizer``) and Stable Diffusion 1.5's scheduler settings in a ``DDIMScheduler``. The SD 1.x
adapter's tests (``tests/test_sd15.py``) and the CPU DDPO run (``benchmarks/ddpo_tiny.py``) use it.
"""

from __future__ import annotations

from pathlib import Path

import torch

from flowrl.config import REPO_ROOT

SD15_SCHEDULER = dict(
    beta_start=0.00085,
    beta_end=0.012,
    beta_schedule="scaled_linear",
    clip_sample=False,
    set_alpha_to_one=False,
    steps_offset=1,
)
"""Stable Diffusion 1.5's scheduler settings (runwayml/stable-diffusion-v1-5 ``scheduler_config.json``), for DDIM."""

TOKENIZER = REPO_ROOT / "assets" / "tiny-sd3" / "tokenizer"
"""The real CLIP BPE tokenizer of the tiny world (``model_max_length`` 16), shipped in the repository."""


def build_random_sd15_pipeline(
    folder: str | Path, prediction_type: str = "epsilon", seed: int = 0, sample_size: int = 8
) -> Path:
    """Save a random-weight ``StableDiffusionPipeline`` to ``folder`` (created if missing) and return its path.

    Args:
        folder: the pipeline folder to write (``model_index.json`` and one subfolder per component).
        prediction_type: the UNet's target, ``"epsilon"`` or ``"v_prediction"`` (the scheduler config's).
        seed: ``torch.manual_seed`` before the weights are drawn: the same seed gives the same weights.
        sample_size: the UNet's default latent side; images are ``4 * sample_size`` px (8: 32 px), a multiple of
            2 (the UNet downsamples once).

    Returns:
        `Path`: ``folder``.

    Raises:
        ValueError: for another ``prediction_type``, or a ``sample_size`` that is not a positive even number.
    """
    from diffusers import AutoencoderKL, DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

    if prediction_type not in ("epsilon", "v_prediction"):
        raise ValueError(f"prediction_type must be 'epsilon' or 'v_prediction'; got {prediction_type!r}")
    if sample_size < 2 or sample_size % 2:
        raise ValueError(f"sample_size must be a positive even number of latent pixels; got {sample_size}")
    torch.manual_seed(seed)
    tok = CLIPTokenizer.from_pretrained(TOKENIZER)
    clip = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=len(tok),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            max_position_embeddings=tok.model_max_length,
            bos_token_id=tok.bos_token_id,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        )
    )
    unet = UNet2DConditionModel(
        sample_size=sample_size,
        in_channels=4,
        out_channels=4,
        layers_per_block=1,
        block_out_channels=(8, 16),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=32,
        attention_head_dim=4,
        norm_num_groups=8,
    )
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 3,
        up_block_types=("UpDecoderBlock2D",) * 3,
        block_out_channels=(8, 16, 16),
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=8,
        sample_size=4 * sample_size,
    )
    scheduler = DDIMScheduler(**SD15_SCHEDULER, prediction_type=prediction_type)
    pipe = StableDiffusionPipeline(
        vae=vae,
        text_encoder=clip,
        tokenizer=tok,
        unet=unet,
        scheduler=scheduler,
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    pipe.save_pretrained(folder)
    return Path(folder)
