"""The Z-Image family (``ZImagePipeline``): Z-Image and Z-Image-Turbo (arXiv 2511.22699) and small ones.

Reference implementation: diffusers ``pipelines/z_image/pipeline_z_image.py`` (``ZImagePipeline``) and
``models/transformers/transformer_z_image.py`` (``ZImageTransformer2DModel``, a single-stream DiT); the adapter calls
them. Notation (code -> pipeline): ``t`` (flowrl's time, 1 = noise) -> the scheduler's sigma; ``1 - t`` -> the
transformer's ``t`` (0 = noise); ``v`` -> ``-model_output`` (the pipeline negates the transformer's output before its
Euler step); ``w - 1`` -> the pipeline's ``guidance_scale``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from .base import FlowModel, PromptEmbeds, _vae_factor, check_fraction, register_family
from .flux import PackedTokenShift

Z_IMAGE_LORA_TARGETS = (
    "attention.to_q",
    "attention.to_k",
    "attention.to_v",
    "attention.to_out.0",
    "feed_forward.w1",
    "feed_forward.w2",
    "feed_forward.w3",
)
"""LoRA targets for Z-Image transformers, Flow-Factory's defaults for Z-Image
(``src/flow_factory/models/z_image/z_image.py``, ``default_target_modules``; the names are diffusers'
``ZImageTransformerBlock``'s): the attention projections and the SwiGLU feed-forward layers (``w1``, ``w2``, ``w3``) of
every block, the main layers and the noise and context refiners."""

DEFAULT_SIDE = 1024
"""Image side in px when no resolution is given (``ZImagePipeline``'s ``height or 1024``)."""

_AXES_LENS = (1024, 512, 512)
"""``ZImageTransformer2DModel``'s default ``axes_lens``: rotary positions per axis (caption/frame, height, width)."""


@dataclass
class ZImagePromptEmbeds(PromptEmbeds):
    """Qwen3 prompt embeddings: ``embeds (P, T, D)`` float32, each prompt's tokens first, zero-padded to the longest
    prompt of the batch; ``mask (P, T)`` long (1 for a token, 0 for padding) and ``pooled``, an empty ``(P, 0)``
    (Z-Image has no pooled embedding)."""

    mask: torch.Tensor = None


@register_family
class ZImageModel(PackedTokenShift, FlowModel):
    """A Z-Image text-to-image flow model (``ZImagePipeline`` folder: Z-Image, Z-Image-Turbo or a small one), with
    :class:`FlowModel`'s interface; the samplers and the trainer see no difference.

    What the adapter does differently, all inside it:

    - Prompts: ``ZImagePipeline.encode_prompt`` (the prompt in the tokenizer's chat template, thinking enabled, padded
      to ``max_sequence_length`` tokens, default 512 as the stock pipeline; the second-to-last hidden states of the
      Qwen3 text encoder), which gives one ``(L_i, D)`` tensor per prompt, its padding dropped. flowrl pads them to
      the batch's longest prompt with a mask (:class:`ZImagePromptEmbeds`), and :meth:`_forward` trims each row to its
      mask again: the transformer receives the list the stock pipeline passes.
    - Latents stay ``(B, C, H, W)``; the transformer takes a list of ``(C, 1, H, W)`` tensors (it patchifies them
      itself) and time ``1 - t`` (0 = noise), and its output is minus the velocity (the pipeline negates it).
    - Guidance: the pipeline's ``v_c + (w - 1) (v_c - v_u)`` against the empty prompt (its ``guidance_scale`` is
      ``w - 1``: flowrl's ``w = 1`` is the stock ``guidance_scale=0``, Z-Image-Turbo's setting, one row per sample);
      optionally the pipeline's ``cfg_normalization`` and ``cfg_truncation`` (:meth:`_guide`, :meth:`guided_rows`; off
      by default, as the stock pipeline).
    - Schedule: ``linspace(1, 1/N, N)`` shifted by the scheduler's shift (static, 3, in Z-Image-Turbo's config; a
      dynamically shifting config by ``exp(mu)`` with ``mu = calculate_shift(image tokens)``, as the pipeline passes
      it), stretched to ``shift_terminal`` if the config has one, then 0 (:meth:`sigmas`): ODE sampling equals the
      stock pipeline's (a test checks it).
    - Decoding: FLUX's VAE arithmetic (``z / scaling_factor + shift_factor``), :meth:`FlowModel.decode`.
    - Resolution: any multiple of 2 x the VAE factor (16 px for Z-Image) up to the rotary embedding's ``axes_lens``
      patches a side; default 1024 px (the pipeline's; a smaller largest side for a small model).

    Args:
        path, device, dtype, max_sequence_length, resolution: as :class:`FlowModel`.
        cfg_normalization (`float`): the pipeline's ``cfg_normalization``: ``c > 0`` caps each guided velocity's norm
            at ``c`` times the conditional one's (the stock ``True`` is 1.0); 0 (off, the stock default).
            Config key ``model.options.cfg_normalization``.
        cfg_truncation (`float`): the pipeline's ``cfg_truncation`` in ``[0, 1]``: steps whose ``1 - t`` exceeds it
            use the conditional velocity alone; 1.0 (never, the stock default). Config key
            ``model.options.cfg_truncation``.

    Raises:
        FileNotFoundError, ValueError: as :class:`FlowModel`; ValueError also for ``max_sequence_length < 1`` or an
            option out of range.
    """

    PIPELINE = "ZImagePipeline"
    FAMILY = "Z-Image"
    LORA_TARGETS = Z_IMAGE_LORA_TARGETS
    VAE_INVERSE = True
    SIGMA_SPACING = "flux"
    """``ZImagePipeline``'s ``linspace(1, 1/N, N)`` before the shift."""
    SHIFT_TERMINAL = True
    PROMPT_LENGTH = (1, None)
    PROMPT_RULE = "its Qwen3 prompt tokens"
    PROMPT_PADDING = "longest"  # encode pads a batch to its longest prompt (the prompt cache stores rows unpadded)
    OPTIONS = ("cfg_normalization", "cfg_truncation")
    cfg_normalization = 0.0
    """The pipeline's ``cfg_normalization`` (0: off): :meth:`check_cfg_normalization`."""
    cfg_truncation = 1.0
    """The pipeline's ``cfg_truncation`` (1: never): :meth:`check_cfg_truncation`."""

    @staticmethod
    def check_cfg_normalization(value) -> float:
        """``cfg_normalization`` as a float ``>= 0`` (0 = off; a bool as the stock pipeline reads it: True is 1.0).

        Raises:
            ValueError: for anything else.
        """
        if not isinstance(value, (bool, int, float)) or not value >= 0:
            raise ValueError(f"cfg_normalization must be a number >= 0 (0 = off, 1 = the stock True), got {value!r}")
        return float(value)

    @staticmethod
    def check_cfg_truncation(value) -> float:
        """``cfg_truncation`` as a float in ``[0, 1]`` (1 = off).

        Raises:
            ValueError: for anything else.
        """
        return check_fraction(value, "cfg_truncation", "1")

    @staticmethod
    def _default_length(index: dict) -> int:
        return 512  # ZImagePipeline's max_sequence_length

    @classmethod
    def _resolution_grid(cls, path: Path) -> tuple[int, int, int | None, str]:
        """Default 1024 px (at most the largest side); any multiple of the VAE factor x 2 up to the rotary
        embedding's ``axes_lens`` patches a side (read from ``transformer/config.json``)."""
        factor = _vae_factor(path)
        lens = json.loads((path / "transformer" / "config.json").read_text()).get("axes_lens") or _AXES_LENS
        unit = 2 * factor
        largest = unit * min(lens[1:])
        return min(DEFAULT_SIDE, largest), unit, largest, f"VAE factor {factor} x the 2x2 patches"

    @property
    def latent_shape(self) -> tuple[int, int, int]:
        """``(C, H, W)``: the transformer's ``in_channels`` (16 for Z-Image), ``H = W = resolution /
        vae_scale_factor``."""
        side = self.resolution // self.pipe.vae_scale_factor
        return (self.transformer.config.in_channels, side, side)

    @torch.no_grad()
    def encode(self, prompts: list[str]) -> ZImagePromptEmbeds:
        """Encode prompts with ``ZImagePipeline.encode_prompt``: ``embeds (P, T, D)`` float32 with ``T`` the longest
        prompt's tokens (at most ``max_sequence_length``, chat template included), its padding ``mask (P, T)``."""
        rows, _ = self.pipe.encode_prompt(
            list(prompts),  # the pipeline writes the templated prompts into the list it is given
            device=self.device,
            do_classifier_free_guidance=False,
            max_sequence_length=self.max_sequence_length,
        )  # P tensors (L_i, D)
        embeds = torch.nn.utils.rnn.pad_sequence([r.float() for r in rows], batch_first=True)  # (P, T, D)
        lengths = torch.tensor([len(r) for r in rows], device=embeds.device)
        mask = (torch.arange(embeds.shape[1], device=embeds.device) < lengths[:, None]).long()  # (P, T)
        return ZImagePromptEmbeds(embeds, embeds.new_zeros(len(prompts), 0), mask)

    def guided_rows(self, t: torch.Tensor) -> torch.Tensor:
        """The rows ``ZImagePipeline`` guides, `(N,)` bool: those whose transformer time ``1 - t`` does not exceed
        :attr:`cfg_truncation` (the others use the conditional velocity alone; none guided: one row per sample)."""
        return self._model_time(t) <= self.cfg_truncation  # the pipeline's truncation test, negated

    def _guide(
        self, x: torch.Tensor, t: torch.Tensor, v_u: torch.Tensor, v_c: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """``ZImagePipeline``'s guidance ``(N, C, H, W)`` float32 at ``scale = w``:

        - ``v = v_c + (w - 1) (v_c - v_u)`` (the pipeline's ``pos + guidance_scale (pos - neg)``);
        - with :attr:`cfg_normalization` ``c > 0``: ``v`` scaled down to norm ``c |v_c|`` (norms over each sample's
          latents) where it is larger.
        """
        v = v_c + (scale - 1.0) * (v_c - v_u)
        if self.cfg_normalization > 0:
            cap = v_c.flatten(1).norm(dim=1) * self.cfg_normalization  # (N,)
            norm = v.flatten(1).norm(dim=1)  # (N,)
            v = v * torch.where(norm > cap, cap / norm, torch.ones_like(norm)).view(-1, *[1] * (v.ndim - 1))
        return v

    @staticmethod
    def _model_time(t: torch.Tensor) -> torch.Tensor:
        """The transformer's time ``(N,)`` float32 (0 = noise) of flowrl's ``t (N,)``: ``(1000 - 1000 t) / 1000``, the
        pipeline's arithmetic on the scheduler's timesteps ``1000 sigma``."""
        return (1000 - t.float() * 1000) / 1000

    def _forward(self, x, t, cond: ZImagePromptEmbeds, dtype) -> torch.Tensor:
        latents = list(x.to(dtype).unsqueeze(2).unbind(0))  # N x (C, 1, H, W)
        captions = [e[m.bool()] for e, m in zip(cond.embeds.to(dtype), cond.mask)]  # N x (L_i, D), as encode_prompt's
        out = self.network()(latents, self._model_time(t), captions, return_dict=False)[0]  # N x (C, 1, H, W)
        return -torch.stack(out)[:, :, 0]  # (N, C, H, W): the pipeline's noise_pred = -output
