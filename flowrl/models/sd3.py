"""The SD3 family: Stable Diffusion 3 and 3.5 (``StableDiffusion3Pipeline``) and flowrl's shipped tiny model."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .base import JOINT_ATTENTION_TARGETS, FlowModel, PromptEmbeds, _absent, _vae_factor, register_family

SD3_LORA_TARGETS = JOINT_ATTENTION_TARGETS
"""Flow-GRPO's LoRA targets for SD3 transformers: both streams of every joint attention block."""


@register_family
class SD3Model(FlowModel):
    """An SD3-family text-to-image flow model (``StableDiffusion3Pipeline`` folder: SD3, SD3.5, the tiny model).

    Prompts: CLIP-L and CLIP-G (pooled and token embeddings) and, where the folder has one, T5 tokens
    (``max_sequence_length``, default 256 with T5 and 0 without, as the tiny model was trained). Velocity: the
    transformer at ``timestep = 1000 t``. Schedule: the scheduler's static shift (3.0 for SD3.5, 1.0 for the tiny
    model). Resolution: a multiple of the VAE factor x the patch size up to the position embedding's size;
    default ``sample_size`` latents (64 px for the tiny model, 1024 px for SD3.5-Medium; Flow-GRPO trains at 512).

    Args, Raises: as :class:`FlowModel`.
    """

    PIPELINE = "StableDiffusion3Pipeline"
    """The diffusers pipeline class this adapter loads (``_class_name`` in ``model_index.json``)."""
    OPTIONAL = ("text_encoder_3", "tokenizer_3", "image_encoder", "feature_extractor")
    """Components a folder may leave out (``null`` in ``model_index.json``)."""
    LORA_TARGETS = SD3_LORA_TARGETS
    VAE_INVERSE = True
    SIGMA_SPACING = "sd3"
    """How the stock pipeline spaces its steps (:func:`samplers.flow_sigmas`' ``spacing``)."""

    @staticmethod
    def _default_length(index: dict) -> int:
        """:meth:`default_max_sequence_length` of a parsed ``model_index.json``."""
        return 0 if _absent(index, "text_encoder_3") else 256

    @classmethod
    def _resolution_grid(cls, path: Path) -> tuple[int, int, int | None, str]:
        """Default ``sample_size`` latents; a multiple of the VAE factor x the patch size, up to the position
        embedding's size (``pos_embed_max_size``)."""
        cfg = json.loads((path / "transformer" / "config.json").read_text())
        factor, patch = _vae_factor(path), cfg.get("patch_size", 2)
        unit = factor * patch
        largest = (cfg.get("pos_embed_max_size") or cfg["sample_size"]) * unit
        return cfg["sample_size"] * factor, unit, largest, f"VAE factor {factor} x patch size {patch}"

    @property
    def latent_shape(self) -> tuple[int, int, int]:
        """``(C, H, W)`` of the latents at :attr:`resolution` (``H = W = resolution / vae_scale_factor``)."""
        side = self.resolution // self.pipe.vae_scale_factor  # the check above used the same factor
        return (self.transformer.config.in_channels, side, side)

    @torch.no_grad()
    def encode(self, prompts: list[str]) -> PromptEmbeds:
        """Encode prompts with the pipeline's own ``encode_prompt`` (CLIP-L, CLIP-G and T5 where present).

        Returns:
            :class:`PromptEmbeds` with ``P = len(prompts)`` rows, float32.
        """
        embeds, _, pooled, _ = self.pipe.encode_prompt(
            prompts,
            prompts,
            prompts,
            device=self.device,
            do_classifier_free_guidance=False,
            max_sequence_length=self.max_sequence_length,
        )
        return PromptEmbeds(embeds.float(), pooled.float())

    def _forward(self, x, t, cond: PromptEmbeds, dtype) -> torch.Tensor:
        return self.network()(
            hidden_states=x.to(dtype),
            encoder_hidden_states=cond.embeds.to(dtype),
            pooled_projections=cond.pooled.to(dtype),
            timestep=t * 1000,
            return_dict=False,
        )[0]
