"""The Qwen-Image family (``QwenImagePipeline``): Qwen-Image (arXiv 2508.02324) and small ones.

Reference implementation: diffusers ``pipelines/qwenimage/pipeline_qwenimage.py`` (``QwenImagePipeline``) and
``models/transformers/transformer_qwenimage.py`` (``QwenImageTransformer2DModel``); the adapter calls them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from .base import JOINT_ATTENTION_TARGETS, FlowModel, PromptEmbeds, register_family
from .flux import PackedTokenShift

QWEN_IMAGE_LORA_TARGETS = JOINT_ATTENTION_TARGETS + (
    "img_mlp.net.0.proj",
    "img_mlp.net.2",
    "txt_mlp.net.0.proj",
    "txt_mlp.net.2",
)
"""Flow-GRPO's LoRA targets for Qwen-Image transformers (its ``scripts/train_qwenimage_edit_plus.py``): both streams'
attention projections and feed-forward layers of every dual-stream block."""


@dataclass
class QwenPromptEmbeds(PromptEmbeds):
    """Qwen2.5-VL prompt embeddings: ``embeds (P, T, D)`` float32, padded to the longest prompt of the batch, ``mask
    (P, T)`` long (1 for a token, 0 for padding) and ``pooled``, an empty ``(P, 0)`` (Qwen-Image has no pooled
    embedding)."""

    mask: torch.Tensor = None


def _vae_factor(path: Path) -> int:
    """The Qwen-Image VAE's spatial factor of the pipeline folder ``path``, as ``QwenImagePipeline.vae_scale_factor``
    (``2 ** len(temperal_downsample)``)."""
    return 2 ** len(json.loads((path / "vae" / "config.json").read_text())["temperal_downsample"])


@register_family
class QwenImageModel(PackedTokenShift, FlowModel):
    """A Qwen-Image text-to-image flow model (``QwenImagePipeline`` folder), with :class:`FlowModel`'s interface; the
    samplers and the trainer see no difference.

    What the adapter does differently, all inside it:

    - Prompts: ``QwenImagePipeline.encode_prompt`` (Qwen2.5-VL's last hidden states of the prompt in the pipeline's
      chat template, the template's first ``prompt_template_encode_start_idx`` tokens dropped), at most
      ``max_sequence_length`` tokens (default 512, as the stock pipeline; 1 to 1024), padded to the batch's longest
      prompt with a padding mask the transformer receives (:class:`QwenPromptEmbeds`).
    - Latents stay ``(B, C, H, W)`` (``C`` = the VAE's ``z_dim``, 16) for the samplers; :meth:`_forward` packs them into
      2x2-patch tokens with the pipeline's own ``_pack_latents`` and unpacks the prediction (``img_shapes`` gives the
      transformer the token grid for its rotary embedding).
    - Guidance: "true CFG" against the empty prompt as ``QwenImagePipeline(true_cfg_scale=w, negative_prompt="")``:
      ``v = v_u + w (v_c - v_u)``, then rescaled per token to the norm of ``v_c`` (:meth:`_guide`).
    - Schedule: the scheduler shifts dynamically, by ``exp(mu)`` with ``mu`` linear in the number of image tokens as
      the stock pipeline computes it (:func:`flowrl.models.flux._dynamic_shift`: 2.46 at 1328 px, 1.82 at 512 px with
      Qwen-Image's config), and then stretches the schedule so that its last step before 0 lands on ``shift_terminal``
      (0.02 for Qwen-Image) (:meth:`sigmas`); the steps are spaced as the pipeline spaces them (``linspace(1, 1/N,
      N)``), so the adapter's ODE sampling gives the stock pipeline's images (a test checks it).
    - Decoding: the 3-D-convolution VAE (one frame), its latents de-normalised with the VAE config's ``latents_mean``
      and ``latents_std`` (:meth:`decode`).
    - Resolution: any multiple of 2 x the VAE factor (16 px for Qwen-Image); default 128 latents (1024 px, the
      pipeline's ``default_sample_size``; Flow-GRPO trains at 512).

    Args, Raises: as :class:`FlowModel`; ``ValueError`` also for ``max_sequence_length`` outside 1..1024.
    """

    PIPELINE = "QwenImagePipeline"
    FAMILY = "Qwen-Image"
    _folder_vae_factor = staticmethod(_vae_factor)  # the shift's token count: Qwen-Image's VAE factor
    LORA_TARGETS = QWEN_IMAGE_LORA_TARGETS
    SIGMA_SPACING = "flux"
    SHIFT_TERMINAL = True
    PROMPT_LENGTH = (1, 1024)
    PROMPT_RULE = "QwenImagePipeline's limit"
    VAE_CHANNELS_LAST = False  # 3-D convolutions
    PROMPT_PADDING = "longest"  # encode pads a batch to its longest prompt (the prompt cache stores rows unpadded)
    DEFAULT_SAMPLE_SIZE = 128
    """Latents per image side when no resolution is given (``QwenImagePipeline.default_sample_size``)."""

    @staticmethod
    def _default_length(index: dict) -> int:
        return 512  # QwenImagePipeline's max_sequence_length

    @classmethod
    def _resolution_grid(cls, path: Path) -> tuple[int, int, int | None, str]:
        """Default ``DEFAULT_SAMPLE_SIZE`` latents; any multiple of the VAE factor x 2 (the rotary embedding has no
        practical largest size)."""
        factor = _vae_factor(path)
        return cls.DEFAULT_SAMPLE_SIZE * factor, factor * 2, None, f"VAE factor {factor} x the 2x2 latent packing"

    @property
    def latent_shape(self) -> tuple[int, int, int]:
        """``(C, H, W)`` of the unpacked latents: the VAE's ``z_dim``, ``H = W = resolution / vae_scale_factor``."""
        side = self.resolution // self.pipe.vae_scale_factor
        return (self.pipe.vae.config.z_dim, side, side)

    @torch.no_grad()
    def encode(self, prompts: list[str]) -> QwenPromptEmbeds:
        """Encode prompts with ``QwenImagePipeline.encode_prompt``: ``embeds (P, T, D)`` float32 with ``T`` the longest
        prompt's tokens (at most ``max_sequence_length``), its padding ``mask (P, T)``."""
        embeds, mask = self.pipe.encode_prompt(
            prompts, device=self.device, max_sequence_length=self.max_sequence_length
        )
        if mask is None:  # the pipeline drops an all-ones mask
            mask = torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device)
        return QwenPromptEmbeds(embeds.float(), embeds.new_zeros(len(prompts), 0, dtype=torch.float32), mask)

    def _guide(
        self, x: torch.Tensor, t: torch.Tensor, v_u: torch.Tensor, v_c: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """Qwen-Image's true CFG, as ``QwenImagePipeline``: ``v = v_u + w (v_c - v_u)``, rescaled per 2x2 token to
        ``|v_c|`` (the norm over the token's ``4 C`` packed channels); ``(N, C, H, W)`` float32."""
        combined = super()._guide(x, t, v_u, v_c, scale)
        return combined * (_token_norm(v_c) / _token_norm(combined))

    def _forward(self, x, t, cond: QwenPromptEmbeds, dtype) -> torch.Tensor:
        n, c, h, w = x.shape
        pipe = self.pipe
        tokens = pipe._pack_latents(x.to(dtype).contiguous(), n, c, h, w)  # (N, h/2 * w/2, 4C)
        out = self.network()(
            hidden_states=tokens,
            timestep=t.to(dtype),
            encoder_hidden_states=cond.embeds.to(dtype),
            encoder_hidden_states_mask=cond.mask,
            img_shapes=[[(1, h // 2, w // 2)]] * n,
            return_dict=False,
        )[0]  # (N, h/2 * w/2, 4C)
        factor = pipe.vae_scale_factor
        return pipe._unpack_latents(out, h * factor, w * factor, factor)[:, :, 0]  # (N, C, 1, h, w) -> (N, C, h, w)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Decode latents ``(B, C, H, W)`` to images float32 ``(B, 3, H*f, W*f)`` in [0, 1] as ``QwenImagePipeline``
        does (``z * latents_std + latents_mean``, one frame through the 3-D VAE), in chunks of :attr:`decode_chunk`."""
        vae = self.pipe.vae
        mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1).to(latents.device, vae.dtype)
        inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1).to(latents.device, vae.dtype)
        images = []
        for chunk in latents.split(self.decode_chunk):
            z = chunk.to(vae.dtype).unsqueeze(2) / inv_std + mean  # (b, C, 1, H, W), the pipeline's arithmetic
            images.append(vae.decode(z, return_dict=False)[0][:, :, 0].float())
        return (torch.cat(images) / 2 + 0.5).clamp(0, 1)


def _token_norm(v: torch.Tensor) -> torch.Tensor:
    """The L2 norm of each 2x2 latent patch of ``v (N, C, H, W)`` over its ``4 C`` values (a packed token's channels),
    broadcast back to ``(N, C, H, W)``."""
    n, c, h, w = v.shape
    patches = v.view(n, c, h // 2, 2, w // 2, 2)
    return patches.square().sum(dim=(1, 3, 5), keepdim=True).sqrt().expand_as(patches).reshape(n, c, h, w)
