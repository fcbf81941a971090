"""FLUX.1 Kontext (``FluxKontextPipeline``): FLUX.1 image editing, a source image per prompt (arXiv 2506.15742).

Reference implementation: diffusers ``pipelines/flux/pipeline_flux_kontext.py`` (``FluxKontextPipeline``); the adapter
calls its ``image_processor``, ``_encode_vae_image``, ``_pack_latents`` and ``_prepare_latent_image_ids``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import PromptEmbeds, register_family, source_image
from .flux import FLUX_LORA_TARGETS, FluxModel

KONTEXT_LORA_TARGETS = FLUX_LORA_TARGETS + ("proj_mlp",)
"""Flow-GRPO's LoRA targets for FLUX.1 Kontext (its ``scripts/train_flux_kontext.py``): FLUX.1's
(:data:`flowrl.models.FLUX_LORA_TARGETS`) plus the single-stream blocks' ``proj_mlp``."""


@dataclass
class KontextPromptEmbeds(PromptEmbeds):
    """FLUX prompt embeddings (``embeds (P, T, D)``, ``pooled (P, D_pooled)``) with each row's source image: ``image (P,
    L, 4C)`` float32, the VAE latents of the image packed into FLUX's 2x2-patch tokens (zeros for a row without one),
    and ``has_image (P,)`` bool."""

    image: torch.Tensor = None
    has_image: torch.Tensor = None

    SHARED = ("image", "has_image")
    """Under CFG the negative sees the row's source image, as ``FluxKontextPipeline(true_cfg_scale=w)``."""


@register_family
class FluxKontextModel(FluxModel):
    """A FLUX.1 Kontext image-editing flow model (``FluxKontextPipeline`` folder: FLUX.1-Kontext-dev or a small one):
    :class:`FluxModel` (prompts, packing, distilled guidance, dynamic shift, resolution, LoRA) plus a source image per
    prompt.

    The source image: a prompt record's ``image`` key, a path relative to the prompt file
    (:func:`flowrl.data.read_jsonl` makes it absolute; the rewards receive the same record as metadata, so an edit
    reward can compare against ``metadata[i]["image"]``). :meth:`prompt_table` loads it (RGB), resizes it to the model's
    square :attr:`resolution` with the pipeline's ``image_processor`` (Flow-GRPO resizes its reference images to the
    training resolution too) and encodes it with the VAE's mode, as ``FluxKontextPipeline(image=..., _auto_resize=False,
    height=width=max_area**0.5=resolution)`` does for a source of that size. :meth:`_forward` appends its packed tokens
    after the noisy latents' (their position ids' first coordinate 1, as the pipeline's ``image_ids``) and keeps the
    prediction of the noisy tokens only. Under classifier-free guidance (a transformer without guidance embedding) the
    negative sees the same source image, as the pipeline's ``true_cfg_scale``. A record without ``image`` is drawn as
    text-to-image (the pipeline with ``image=None``); a batch may mix both (one transformer call each).

    Args, Raises: as :class:`FluxModel`.
    """

    PIPELINE = "FluxKontextPipeline"
    LORA_TARGETS = KONTEXT_LORA_TARGETS
    TEXT_ONLY = False

    def prompt_table(self, metas: list[dict]) -> KontextPromptEmbeds:
        """:meth:`FlowModel.prompt_table` with each record's source image (row 0, the empty prompt, has none).

        Raises:
            ValueError: naming the file, for an ``image`` that cannot be read as an image.
        """
        table = self.encode([""] + [m["prompt"] for m in metas])
        image, has_image = self.encode_images([None] + [source_image(m, "FLUX.1 Kontext") for m in metas])
        return KontextPromptEmbeds(table.embeds, table.pooled, image, has_image)

    @torch.no_grad()
    def encode_images(self, paths: list[str | None]) -> tuple[torch.Tensor, torch.Tensor]:
        """Source images as packed latent tokens: ``(image (P, L, 4C) float32, has_image (P,) bool)`` on the model's
        device, ``L = (resolution / (2 f))^2`` for VAE factor ``f``; a None path gives a zero row.

        Raises:
            ValueError: naming the file, for a path that cannot be read as an image.
        """
        from PIL import Image, UnidentifiedImageError

        pipe, side = self.pipe, self.resolution
        c, h, w = self.latent_shape
        has_image = torch.tensor([p is not None for p in paths], device=self.device)
        tokens = torch.zeros(len(paths), (h // 2) * (w // 2), 4 * c, device=self.device)  # (P, L, 4C)
        rows = [i for i, p in enumerate(paths) if p is not None]
        if not rows:
            return tokens, has_image
        pictures = []
        for i in rows:
            try:
                with Image.open(paths[i]) as picture:
                    pictures.append(pipe.image_processor.resize(picture.convert("RGB"), side, side))
            except (OSError, UnidentifiedImageError) as e:
                raise ValueError(f"source image {paths[i]} cannot be read as an image ({type(e).__name__})") from None
        pixels = pipe.image_processor.preprocess(pictures, side, side)  # (k, 3, side, side) in [-1, 1]
        pixels = pixels.to(self.device, pipe.vae.dtype)
        latents = pipe._encode_vae_image(pixels, generator=None)  # (k, C, h, w): the VAE's mode, as the pipeline
        tokens[rows] = pipe._pack_latents(latents, len(rows), c, h, w).float()  # (k, L, 4C)
        return tokens, has_image

    def _forward(self, x, t, cond: PromptEmbeds, dtype, guidance: float = 1.0) -> torch.Tensor:
        has_image = getattr(cond, "has_image", None)
        if has_image is None or not has_image.any():
            return super()._forward(x, t, cond, dtype, guidance)  # text-to-image rows
        if not has_image.all():  # rows with and without a source image: one call each
            out = torch.empty_like(x, dtype=dtype)
            for rows in (has_image.nonzero().squeeze(1), (~has_image).nonzero().squeeze(1)):
                out[rows] = self._forward(x[rows], t[rows], cond[rows], dtype, guidance)
            return out
        n, c, h, w = x.shape
        pipe = self.pipe
        tokens = pipe._pack_latents(x.to(dtype).contiguous(), n, c, h, w)  # (N, L, 4C)
        hidden = torch.cat([tokens, cond.image.to(dtype)], dim=1)  # (N, 2L, 4C): noisy tokens, then the source's
        ids = pipe._prepare_latent_image_ids(n, h // 2, w // 2, x.device, dtype)  # (L, 3)
        source_ids = ids.clone()
        source_ids[:, 0] = 1  # the pipeline's image_ids: the latent ids with first coordinate 1
        txt_ids = torch.zeros(cond.embeds.shape[1], 3, device=x.device, dtype=dtype)
        g = torch.full((n,), float(guidance), device=x.device) if self.guidance_embeds else None
        out = self.network()(
            hidden_states=hidden,
            timestep=t.to(dtype),
            guidance=g,
            pooled_projections=cond.pooled.to(dtype),
            encoder_hidden_states=cond.embeds.to(dtype),
            txt_ids=txt_ids,
            img_ids=torch.cat([ids, source_ids]),
            return_dict=False,
        )[0]
        factor = pipe.vae_scale_factor
        return pipe._unpack_latents(
            out[:, : tokens.shape[1]], h * factor, w * factor, factor
        )  # the noisy tokens' part
