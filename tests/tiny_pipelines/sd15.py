"""Stable Diffusion 1.x: the library's seeded random ``StableDiffusionPipeline``
(:func:`flowrl.tiny.sd15.build_random_sd15_pipeline`, which ``benchmarks/ddpo_tiny.py`` uses too) and the stock
pipeline's DDIM images, shared with SDXL."""

from __future__ import annotations

import torch

from flowrl.tiny.sd15 import build_random_sd15_pipeline

from .common import prompts_of, sized, stock_pipeline

SD15_STOCK = {"safety_checker": None, "feature_extractor": None}
"""The stock ``from_pretrained`` keyword arguments of the tiny SD 1.x pipelines (no safety checker)."""


def stock_ddim(
    cls_name: str, folder, model, metas, noise, num_steps, guidance_scale, lora=None, load=None, **kwargs
) -> torch.Tensor:
    """The DDPM pipeline ``cls_name``'s images ``(B, 3, H, W)`` in [0, 1] for the records ``metas`` from the noise
    ``noise (B, *model.latent_shape)``, with DDIM at eta 0 on its scheduler config (what flowrl samples); ``lora``: a
    LoRA folder it loads first; ``load``: keyword arguments of ``from_pretrained``; ``kwargs``: the pipeline's own
    (``guidance_rescale``)."""
    from diffusers import DDIMScheduler

    pipe = stock_pipeline(folder, cls_name, lora, **(load or {}))
    pipe.scheduler = DDIMScheduler.from_config(pipe.scheduler.config)
    with torch.no_grad():
        return pipe(
            prompts_of(metas),
            latents=noise,
            guidance_scale=guidance_scale,
            eta=0.0,
            **sized(model, num_steps, length=False),
            **kwargs,
        ).images


def stock_sd15(folder, model, metas, noise, num_steps, guidance_scale, lora=None) -> torch.Tensor:
    """The stock StableDiffusionPipeline's images (:func:`stock_ddim`)."""
    return stock_ddim(
        "StableDiffusionPipeline", folder, model, metas, noise, num_steps, guidance_scale, lora, SD15_STOCK
    )


__all__ = ["SD15_STOCK", "build_random_sd15_pipeline", "stock_ddim", "stock_sd15"]
