"""The Stable Diffusion XL family (``StableDiffusionXLPipeline``): SDXL's UNet seen as a flow model, as SD 1.x.

SDXL (Podell et al., arXiv 2307.01952; diffusers' ``pipelines/stable_diffusion_xl/pipeline_stable_diffusion_xl.py``)
is a variance-preserving epsilon- (or v-) prediction UNet like SD 1.x, so :class:`SDXLModel` is an
:class:`~flowrl.models.sd15.SD15Model`: the DDIM grid from the folder's scheduler config, the change to flow
variables (:mod:`samplers.ddim`), the decode of the state at ``final_alpha_cumprod`` and the LoRA are SD 1.x's. What
SDXL adds, and this adapter follows as the stock pipeline does:

- two CLIP text encoders: the prompt is the concatenation ``(P, 77, D1 + D2)`` of both encoders' penultimate hidden
  states, and the pooled embedding ``(P, D_pooled)`` the second encoder's projection (``encode_prompt``);
- the micro-conditioning (SDXL paper, Sec. 2.2): the added time ids ``(original size, crop top-left, target size)``
  = ``(H, W, 0, 0, H, W)`` at :attr:`resolution`, which the UNet (``addition_embed_type="text_time"``) reads with
  the pooled embedding through ``added_cond_kwargs``;
- the CFG negative: zero embeddings when the pipeline sets ``force_zeros_for_empty_prompt`` (SDXL base does), else
  the empty prompt's; ``guidance_rescale`` (Lin et al., arXiv 2305.08891, Sec. 3.4) on the UNet's own output;
- the VAE's ``scaling_factor`` (0.13025 for SDXL) and ``force_upcast`` (a float16 VAE decodes in float32).

The stock pipeline samples with whatever scheduler the folder names (SDXL base ships ``EulerDiscreteScheduler``);
flowrl reads its config as DDIM's (same betas, ``timestep_spacing`` and ``steps_offset``) and equals the stock pipeline
with ``DDIMScheduler.from_config(pipe.scheduler.config)`` (tested).
"""

from __future__ import annotations

import torch

from ..samplers import flow_velocity
from .base import PromptEmbeds, check_fraction, register_family
from .sd15 import SD15_LORA_TARGETS, SD15Model

SDXL_LORA_TARGETS = SD15_LORA_TARGETS
"""The UNet's attention projections, as diffusers' SDXL LoRA training (``train_dreambooth_lora_sdxl.py``) adapts."""


@register_family
class SDXLModel(SD15Model):
    """A Stable Diffusion XL text-to-image UNet (``StableDiffusionXLPipeline`` folder), sampled and trained as a flow
    model through the change of variables of :mod:`samplers.ddim` (module docstring: what SDXL adds to SD 1.x).

    Prompts: :class:`PromptEmbeds` with ``embeds (P, 77, D1 + D2)`` (both CLIP encoders, penultimate layer) and
    ``pooled (P, D_pooled)`` (the second encoder's projection). Resolution: a multiple of the VAE factor x the UNet's
    downsampling (32 px for SDXL); default ``sample_size`` latents (1024 px for SDXL base).

    Args:
        guidance_rescale (`float`): the stock pipeline's ``guidance_rescale`` in `[0, 1]`, 0 (off) by default: the
            guided prediction's per-sample std is pulled towards the conditional one's (arXiv 2305.08891, Sec. 3.4);
            config key ``model.options.guidance_rescale``, kept as the attribute of the same name.
        others: as :class:`~flowrl.models.sd15.SD15Model`.

    Raises: as :class:`~flowrl.models.sd15.SD15Model`; also ValueError for ``guidance_rescale`` outside [0, 1], and,
    naming the folder, for a UNet whose
    added-embedding width is not ``6 x addition_time_embed_dim + projection_dim`` of the second text encoder, or a VAE
    with ``latents_mean`` / ``latents_std`` (an EDM-style SDXL derivative, not SDXL).
    """

    PIPELINE = "StableDiffusionXLPipeline"
    """The diffusers pipeline class this adapter loads (``_class_name`` in ``model_index.json``)."""
    OPTIONAL = ("image_encoder", "feature_extractor")
    """Components a folder may leave out (``null`` in ``model_index.json``)."""
    LORA_TARGETS = SDXL_LORA_TARGETS
    OPTIONS = ("guidance_rescale",)

    @staticmethod
    def check_guidance_rescale(value) -> float:
        """``guidance_rescale`` as a float in [0, 1].

        Raises:
            ValueError: for anything else.
        """
        return check_fraction(value, "guidance_rescale", "0")

    def _after_load(self) -> None:
        """Refuse a VAE with ``latents_mean`` / ``latents_std``; run a float16 VAE with ``force_upcast`` in float32, as
        the stock pipeline decodes (SDXL's VAE overflows in float16).

        Raises:
            ValueError: naming the VAE folder, for an EDM-style VAE.
        """
        vae = self.pipe.vae
        if any(getattr(vae.config, key, None) is not None for key in ("latents_mean", "latents_std")):
            raise ValueError(
                f"{self.path / 'vae'} sets latents_mean/latents_std (an EDM-style model); flowrl's SDXL "
                "adapter decodes with scaling_factor only"
            )
        if vae.dtype == torch.float16 and vae.config.force_upcast:
            vae.to(torch.float32)

    def _probe(self) -> None:
        """Check the UNet's added-embedding width against the pipeline's time ids and pooled embedding, then one forward
        (for :func:`~flowrl.models.base.make_batch_invariant`; runs before the constructor returns).

        Raises:
            ValueError: naming the folder, if the widths differ.
        """
        unet, projection = self.transformer, self.pipe.text_encoder_2.config.projection_dim
        expected = unet.add_embedding.linear_1.in_features
        passed = unet.config.addition_time_embed_dim * 6 + projection
        if expected != passed:
            raise ValueError(
                f"{self.path / 'unet'}: the added embedding takes {expected} features, but 6 time ids x "
                f"addition_time_embed_dim {unet.config.addition_time_embed_dim} + text_encoder_2's "
                f"projection_dim {projection} give {passed}"
            )
        super()._probe()

    @torch.no_grad()
    def encode(self, prompts: list[str]) -> PromptEmbeds:
        """Encode prompts with the pipeline's own ``encode_prompt`` (both CLIP encoders, ``model_max_length`` tokens).

        Returns:
            :class:`PromptEmbeds` with ``P = len(prompts)`` rows: ``embeds (P, 77, D1 + D2)`` and ``pooled
            (P, D_pooled)``, float32.
        """
        embeds, _, pooled, _ = self.pipe.encode_prompt(
            prompts, device=self.device, num_images_per_prompt=1, do_classifier_free_guidance=False
        )
        return PromptEmbeds(embeds.float(), pooled.float())

    def time_ids(self, rows: int, dtype: torch.dtype) -> torch.Tensor:
        """SDXL's added time ids ``(original H, W, crop top, left, target H, W)`` = ``(R, R, 0, 0, R, R)`` at
        :attr:`resolution` ``R``, as the stock pipeline builds them by default: ``(rows, 6)`` in ``dtype``."""
        side = self.resolution
        return torch.tensor([[side, side, 0, 0, side, side]], dtype=dtype, device=self.device).expand(rows, 6)

    def _conditions(self, cond: PromptEmbeds, dtype) -> dict:
        """The UNet's prompt inputs: ``encoder_hidden_states (N, 77, D1 + D2)`` and ``added_cond_kwargs`` (the pooled
        embedding ``text_embeds (N, D_pooled)`` and :meth:`time_ids` ``(N, 6)``), all in ``dtype``."""
        rows = cond.embeds.shape[0]
        added = {"text_embeds": cond.pooled.to(dtype), "time_ids": self.time_ids(rows, dtype)}
        return {"encoder_hidden_states": cond.embeds.to(dtype), "added_cond_kwargs": added}

    def _cfg_batch(self, cond: PromptEmbeds, uncond: PromptEmbeds) -> PromptEmbeds:
        """:meth:`FlowModel._cfg_batch` with zero embeddings as the negative when the pipeline sets
        ``force_zeros_for_empty_prompt`` (``uncond``, the empty prompt's rows in flowrl, then only says that CFG is on),
        as the stock SDXL pipeline guides."""
        if self.pipe.config.force_zeros_for_empty_prompt:
            uncond = PromptEmbeds(torch.zeros_like(cond.embeds), torch.zeros_like(cond.pooled))
        return super()._cfg_batch(cond, uncond)

    def velocity(
        self, x: torch.Tensor, t: torch.Tensor, cond: PromptEmbeds, uncond: PromptEmbeds | None, guidance_scale: float
    ) -> torch.Tensor:
        """Velocity with classifier-free guidance as the stock SDXL pipeline guides (one batched forward).

        Overridden because ``guidance_rescale`` acts on the UNet's own output, not on the velocity: without
        :attr:`guidance_rescale` this is :meth:`FlowModel.velocity` (CFG on the velocity equals CFG on the UNet's output,
        an affine map of it); with it, CFG and the rescale act on the UNet's output (``diffusers``
        ``rescale_noise_cfg``), then the result becomes a velocity.

        Args:
            x: latents ``(N, C, H, W)``; t: ``(N,)`` flow times in [0, 1].
            cond: ``N`` prompt embeddings; uncond: ``N`` empty-prompt embeddings, or None when w = 1.
            guidance_scale: w >= 1.

        Returns:
            float32 ``(N, C, H, W)``.

        Raises:
            ValueError: if ``guidance_scale`` is outside [1, 100].
        """
        scale = self.cfg_scale(guidance_scale)
        if uncond is None or scale == 1.0 or not self.guidance_rescale:
            return super().velocity(x, t, cond, uncond, guidance_scale)
        from diffusers.guiders.guider_utils import rescale_noise_cfg

        t = self._clamp(t)  # (N,)
        dtype = next(self.transformer.parameters()).dtype
        both = self._cfg_batch(cond, uncond)  # (2N) rows: the negatives, then the prompts
        out_u, out_c = self._predict(torch.cat([x, x]), torch.cat([t, t]), both, dtype).float().chunk(2)
        out = rescale_noise_cfg(out_u + scale * (out_c - out_u), out_c, self.guidance_rescale)
        return flow_velocity(x, out, t, self.prediction_type)
