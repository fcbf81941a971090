"""FLUX.1 Kontext: a tiny random ``FluxKontextPipeline`` (the tiny FLUX pipeline's components) and the stock
pipeline's edits of each record's source image."""

from __future__ import annotations

from pathlib import Path

import torch

from .common import prompts_of, sized, stock_pipeline
from .flux import build_random_flux_pipeline, flux_guidance


def build_random_kontext_pipeline(folder: Path, guidance_embeds: bool = True) -> Path:
    """Save a random-weight FluxKontextPipeline to ``folder``: the components of :func:`build_random_flux_pipeline`
    (saved first beside ``folder``, as ``<folder>-flux``)."""
    from diffusers import FluxKontextPipeline, FluxPipeline

    flux = build_random_flux_pipeline(folder.parent / f"{folder.name}-flux", guidance_embeds=guidance_embeds)
    FluxKontextPipeline(**FluxPipeline.from_pretrained(flux).components).save_pretrained(folder)
    return folder


def stock_flux_kontext(folder, model, metas, noise, num_steps, guidance_scale, lora=None) -> torch.Tensor:
    """The stock FluxKontextPipeline's edits ``(B, 3, H, W)`` in [0, 1] of the records' source images (``image``,
    read as RGB) from the noise ``noise (B, *model.latent_shape)``, at the model's side (no resize of the sources),
    with the FLUX pipelines' guidance (:func:`tiny_pipelines.flux.flux_guidance`); ``lora``: a LoRA folder it loads
    first."""
    from PIL import Image

    pipe = stock_pipeline(folder, "FluxKontextPipeline", lora)
    sources = [Image.open(m["image"]).convert("RGB") for m in metas]
    latents = pipe._pack_latents(noise, len(metas), *model.latent_shape)
    guidance = flux_guidance(model, guidance_scale)
    with torch.no_grad():
        return pipe(
            prompt=prompts_of(metas),
            image=sources,
            latents=latents,
            max_area=model.resolution**2,
            _auto_resize=False,
            **guidance,
            **sized(model, num_steps),
        ).images
