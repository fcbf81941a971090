"""The FLUX.1 family (``FluxPipeline``): FLUX.1-dev, FLUX.1-schnell and small ones."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from .base import (
    JOINT_ATTENTION_TARGETS,
    FlowModel,
    PromptEmbeds,
    _config_shift,
    _scheduler_file,
    _vae_factor,
    register_family,
)

FLUX_LORA_TARGETS = JOINT_ATTENTION_TARGETS + (
    "ff.net.0.proj",
    "ff.net.2",
    "ff_context.net.0.proj",
    "ff_context.net.2",
)
"""LoRA targets for FLUX.1 transformers, as diffusers' FLUX LoRA training script: both streams' attention and
feed-forward layers of the dual-stream blocks; the attention suffixes also match the single-stream blocks'
``attn.to_q / to_k / to_v``."""


def _dynamic_shift(cfg: dict, where: str | Path, image_tokens: int) -> float:
    """The static shift equal to a FLUX-style scheduler config's schedule at ``image_tokens`` packed latent tokens.

    A dynamic-shifting ``FlowMatchEulerDiscreteScheduler`` maps t to ``exp(mu) / (exp(mu) + 1/t - 1)`` (its exponential
    time shift) with ``mu = calculate_shift(image_tokens, ...)`` (diffusers' FLUX pipeline, linear in the token count
    between ``base_shift`` at ``base_image_seq_len`` and ``max_shift`` at ``max_image_seq_len``); that equals SD3's static
    shift ``s t / (1 + (s - 1) t)`` with ``s = exp(mu)``. A config without dynamic shifting gives its own ``shift``.

    Raises:
        ValueError: naming ``where``, for a linear time shift (no static equivalent) or a shift that is not > 0.
    """
    if not cfg.get("use_dynamic_shifting"):
        return _config_shift(cfg, where)
    if cfg.get("time_shift_type", "exponential") != "exponential":
        raise ValueError(
            f"{where} has time_shift_type {cfg['time_shift_type']!r}; flowrl supports 'exponential' (FLUX's)"
        )
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift

    mu = calculate_shift(
        image_tokens,
        cfg.get("base_image_seq_len", 256),
        cfg.get("max_image_seq_len", 4096),
        cfg.get("base_shift", 0.5),
        cfg.get("max_shift", 1.15),
    )
    return math.exp(mu)


class PackedTokenShift:
    """``scheduler_shift`` and ``shift`` of a family whose pipeline passes the number of its 2x2-packed image tokens to
    ``calculate_shift`` (FLUX.1, Qwen-Image, Z-Image): a mixin placed before :class:`FlowModel` in the bases. A family
    whose folder gives its VAE factor another way overrides :meth:`_folder_vae_factor`."""

    @staticmethod
    def _folder_vae_factor(path: Path) -> int:
        """The VAE's spatial factor of the pipeline folder ``path`` (``2 ** (len(block_out_channels) - 1)``)."""
        return _vae_factor(path)

    @classmethod
    def scheduler_shift(cls, path: str | Path, resolution: int | None = None) -> float:
        """The static shift equal to the folder's scheduler at ``resolution`` px (default: :meth:`check_resolution`'s),
        read without loading weights (:func:`_dynamic_shift` at :func:`_image_tokens`): 3.16 for FLUX.1 at 1024 px,
        1.92 at 512 px; a scheduler without dynamic shifting gives its own ``shift``.

        Raises:
            FileNotFoundError: if ``path`` is not a pipeline folder or has no scheduler config.
            ValueError: for a resolution the model cannot take, or a scheduler as :func:`_dynamic_shift` refuses.
        """
        file = _scheduler_file(path)
        tokens = _image_tokens(cls.check_resolution(path, resolution), cls._folder_vae_factor(Path(path)))
        return _dynamic_shift(json.loads(file.read_text()), file, tokens)

    @property
    def shift(self) -> float:
        """:meth:`scheduler_shift` of the loaded scheduler at the model's :attr:`resolution`."""
        tokens = _image_tokens(self.resolution, self.pipe.vae_scale_factor)
        return _dynamic_shift(dict(self.pipe.scheduler.config), Path(self.path) / "scheduler", tokens)


def _image_tokens(resolution: int, vae_factor: int) -> int:
    """Packed image tokens of a square ``resolution`` px image: one per 2x2 latent patch."""
    return (resolution // (2 * vae_factor)) ** 2


@register_family
class FluxModel(PackedTokenShift, FlowModel):
    """A FLUX.1 text-to-image flow model (``FluxPipeline`` folder: FLUX.1-dev, FLUX.1-schnell or a small one), with
    :class:`FlowModel`'s interface; the samplers and the trainer see no difference.

    What the adapter does differently, all inside it:

    - Latents stay ``(B, C, H, W)`` (``C`` the VAE's latent channels, 16 for FLUX.1) for the samplers; :meth:`_forward`
      packs them into FLUX's tokens of 2x2 latent patches, with the pipeline's own ``_pack_latents``,
      ``_prepare_latent_image_ids`` and ``_unpack_latents``, and unpacks the prediction.
    - Guidance: a guidance-distilled transformer (``guidance_embeds``, FLUX.1-dev) takes the guidance scale as an
      input (one forward per sample, :meth:`cfg_rows` 1, the empty prompt unused), as ``FluxPipeline(guidance_scale=)``;
      one without it (FLUX.1-schnell) gets classifier-free guidance with the empty prompt, as SD3.
    - Prompts: CLIP-L's pooled output and ``max_sequence_length`` T5 tokens (default 512, as ``FluxPipeline``; at least 1).
    - Schedule: FLUX's scheduler shifts dynamically, by ``exp(mu)`` with ``mu`` linear in the number of image tokens,
      which equals SD3's static shift ``exp(mu)`` (:func:`_dynamic_shift`): 3.16 at 1024 px, 1.92 at 512 px; the
      steps are spaced as ``FluxPipeline`` spaces them (:meth:`sigmas`: ``linspace(1, 1/N, N)`` shifted, then 0), so
      the adapter's ODE sampling gives the stock pipeline's images (a test checks it).
    - Resolution: any multiple of 16 px (VAE factor 8 x the 2x2 packing; FLUX's rotary position embedding has no
      largest size); the default is ``FluxPipeline``'s 128 latents (1024 px).

    Args, Raises: as :class:`FlowModel`; ``ValueError`` also for ``max_sequence_length < 1``.
    """

    PIPELINE = "FluxPipeline"
    FAMILY = "FLUX"
    OPTIONAL = ("image_encoder", "feature_extractor")
    LORA_TARGETS = FLUX_LORA_TARGETS
    VAE_INVERSE = True
    SIGMA_SPACING = "flux"
    PROMPT_LENGTH = (1, None)
    PROMPT_RULE = "its T5 tokens condition every block"
    DEFAULT_SAMPLE_SIZE = 128
    """Latents per image side when no resolution is given (``FluxPipeline.default_sample_size``)."""

    @staticmethod
    def _default_length(index: dict) -> int:
        return 512  # FluxPipeline's default; FLUX.1-schnell was trained with 256

    @classmethod
    def _resolution_grid(cls, path: Path) -> tuple[int, int, int | None, str]:
        """Default ``DEFAULT_SAMPLE_SIZE`` latents; any multiple of the VAE factor x 2 (FLUX's rotary position
        embedding has no largest size)."""
        factor = _vae_factor(path)
        return cls.DEFAULT_SAMPLE_SIZE * factor, factor * 2, None, f"VAE factor {factor} x FLUX's 2x2 latent packing"

    @property
    def latent_shape(self) -> tuple[int, int, int]:
        """``(C, H, W)`` of the unpacked latents: the VAE's latent channels, ``H = W = resolution / vae_scale_factor``."""
        side = self.resolution // self.pipe.vae_scale_factor
        return (self.pipe.vae.config.latent_channels, side, side)

    @property
    def guidance_embeds(self) -> bool:
        """Whether the transformer is guidance-distilled (takes the guidance scale as an input, FLUX.1-dev)."""
        return bool(self.transformer.config.guidance_embeds)

    @torch.no_grad()
    def encode(self, prompts: list[str]) -> PromptEmbeds:
        """Encode prompts with ``FluxPipeline.encode_prompt``: T5 tokens ``(P, max_sequence_length, D_t5)`` and CLIP-L's
        pooled output ``(P, D_clip)``, float32."""
        embeds, pooled, _ = self.pipe.encode_prompt(
            prompts, prompts, device=self.device, max_sequence_length=self.max_sequence_length
        )
        return PromptEmbeds(embeds.float(), pooled.float())

    def cfg_scale(self, guidance_scale: float) -> float:
        """1 for a guidance-distilled transformer (the scale is its input, :meth:`embedded_guidance`; ``uncond`` unused,
        one row per sample), else ``guidance_scale`` (classifier-free guidance with the empty prompt, as SD3).

        Raises:
            ValueError: for a ``guidance_scale`` outside [1, 100].
        """
        scale = super().cfg_scale(guidance_scale)
        return 1.0 if self.guidance_embeds else scale

    def embedded_guidance(self, guidance_scale: float) -> dict:
        """``{"guidance": w}`` for a guidance-distilled transformer (``FluxPipeline(guidance_scale=w)``), else ``{}``."""
        return {"guidance": guidance_scale} if self.guidance_embeds else {}

    def _forward(self, x, t, cond: PromptEmbeds, dtype, guidance: float = 1.0) -> torch.Tensor:
        n, c, h, w = x.shape
        pipe = self.pipe
        tokens = pipe._pack_latents(x.to(dtype).contiguous(), n, c, h, w)  # (N, h/2 * w/2, 4C); it views its input
        img_ids = pipe._prepare_latent_image_ids(n, h // 2, w // 2, x.device, dtype)
        txt_ids = torch.zeros(cond.embeds.shape[1], 3, device=x.device, dtype=dtype)
        g = torch.full((n,), float(guidance), device=x.device) if self.guidance_embeds else None
        out = self.network()(
            hidden_states=tokens,
            timestep=t.to(dtype),
            guidance=g,
            pooled_projections=cond.pooled.to(dtype),
            encoder_hidden_states=cond.embeds.to(dtype),
            txt_ids=txt_ids,
            img_ids=img_ids,
            return_dict=False,
        )[0]
        factor = pipe.vae_scale_factor
        return pipe._unpack_latents(out, h * factor, w * factor, factor)
