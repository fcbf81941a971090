"""The HunyuanVideo family (``HunyuanVideoPipeline``): HunyuanVideo text-to-video, sampled and trained as a flow model
over latent videos ``(C, F, H, W)``.

HunyuanVideo (Kong et al., arXiv 2412.03603; reference implementation ``diffusers/pipelines/hunyuan_video/
pipeline_hunyuan_video.py`` and ``diffusers/models/transformers/transformer_hunyuan_video.py``) is a rectified-flow
video DiT with guidance distillation: a Llama text encoder (LLaVA-Llama-3-8B; the prompt wrapped in the pipeline's
chat template, the hidden states two layers below the top, the template's system part cropped), CLIP-L's pooled
output, ``HunyuanVideoTransformer3DModel`` (dual- then single-stream blocks over 1x2x2 patches) and
``AutoencoderKLHunyuanVideo`` (a causal 3-D VAE compressing 4x in time, 8x in space). The guidance scale is an input
of the transformer (the distilled CFG): one forward per sample. The samplers see latents ``(N, C, F, H, W)`` through
:meth:`FlowModel.velocity_fn` as they see images.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from ..fields import ConfigError
from ..files import resolve_path
from .base import PromptEmbeds, _json, _pipeline_folder, register_family
from .video import VideoModel

HUNYUAN_VIDEO_LORA_TARGETS = (
    "to_q",
    "to_k",
    "to_v",
    "to_out.0",
    "add_q_proj",
    "add_k_proj",
    "add_v_proj",
    "to_add_out",
)
"""LoRA targets for HunyuanVideo transformers: the attention projections of both streams of every dual-stream block
and of every single-stream block, as finetrainers' HunyuanVideo LoRA recipe
(``examples/training/sft/hunyuan_video/modal_labs_dissolve/train.sh``); the suffixes also match the attention of the
text token refiner's blocks (2 in HunyuanVideo)."""


@dataclass
class HunyuanPromptEmbeds(PromptEmbeds):
    """HunyuanVideo prompt embeddings: Llama states ``embeds (P, T, D)`` float32 (``T = max_sequence_length``, padded
    on the right), their padding ``mask (P, T)`` long (1 for a token, 0 for padding), and CLIP's pooled output
    ``pooled (P, D_clip)`` float32."""

    mask: torch.Tensor = None


@register_family
class HunyuanVideoModel(VideoModel):
    """A HunyuanVideo text-to-video flow model (``HunyuanVideoPipeline`` folder), with :class:`FlowModel`'s interface.

    - Latents: ``(C, F_lat, H/8, W/8)`` per video (:attr:`latent_shape`), ``F_lat = (num_frames - 1) / 4 + 1`` with the
      VAE's temporal compression 4 (``temporal_compression_ratio``) and spatial compression 8.
    - Frames: ``num_frames`` (``model.num_frames``; default 129, ``HunyuanVideoPipeline``'s) must be ``4k + 1`` (the
      stock pipeline would round it down silently; flowrl refuses it). Resolution: square, a multiple of 16 (the stock
      pipeline's rule; the VAE's 8 x the 2x2 patches); default 720 px (the stock height).
    - Prompts: the pipeline's own ``encode_prompt``: the prompt in its ``DEFAULT_PROMPT_TEMPLATE``, tokenized to
      ``crop_start + max_sequence_length`` Llama tokens (default 256 after the crop, as the stock pipeline), the hidden
      states of the third-last layer, the template's first ``crop_start`` (95) tokens dropped; plus CLIP's pooled
      output (:class:`HunyuanPromptEmbeds`, with the padding mask the transformer receives). The tokenizer must pad on
      the right (the transformer treats the first ``mask.sum()`` tokens as the prompt).
    - Guidance: embedded, as ``HunyuanVideoPipeline(guidance_scale=w)``: ``1000 w`` is the transformer's ``guidance``
      input, one forward per sample (:meth:`cfg_rows` 1), the empty prompt of the prompt table unused. Optionally also
      true CFG, as ``HunyuanVideoPipeline(true_cfg_scale=s, negative_prompt=negative_prompt)``: ``v = v_neg + s (v_c
      - v_neg)`` (two rows per sample), for ``true_cfg_scale > 1``.
    - Schedule: the folder's ``FlowMatchEulerDiscreteScheduler`` shift (7.0 for HunyuanVideo), its steps spaced as the
      pipeline spaces them (``linspace(1, 0, N + 1)[:-1]`` shifted, then 0: :func:`samplers.flow_sigmas`' ``"flux"``
      spacing): the ODE equals ``HunyuanVideoPipeline``'s (a test checks it within 1e-4).
    - Decode: to videos ``(B, F, 3, H, W)`` float32 in [0, 1], :attr:`decode_chunk` videos per VAE call; the VAE decodes
      frames in chunks itself (diffusers' framewise decoding, 16 frames at a time). Call
      ``model.pipe.vae.enable_tiling()`` for spatial tiles too (DanceGRPO does; it changes the pixels slightly).
    - LoRA: :data:`HUNYUAN_VIDEO_LORA_TARGETS`, saved in diffusers' format (``HunyuanVideoPipeline.load_lora_weights``
      loads it).

    Args:
        path, device, dtype, max_sequence_length, resolution: as :class:`FlowModel`.
        num_frames: frames per video (None: 129).
        expert: must be None (HunyuanVideo has one transformer; the trainer passes every video family's settings).
        negative_prompt: the true-CFG negative prompt (used only when ``true_cfg_scale > 1``).
        true_cfg_scale: true CFG scale ``s >= 1`` on top of the embedded guidance (1 = off, the stock default).

    Raises:
        FileNotFoundError, ValueError: as :class:`FlowModel`; ValueError also for a frame count the VAE cannot take
            (:meth:`check_num_frames`), an expert, ``true_cfg_scale < 1``, or a tokenizer that pads on the left.
    """

    PIPELINE = "HunyuanVideoPipeline"
    """The diffusers pipeline class this adapter loads (``_class_name`` in ``model_index.json``)."""
    FAMILY = "HunyuanVideo"
    LORA_TARGETS = HUNYUAN_VIDEO_LORA_TARGETS
    PROMPT_LENGTH = (1, None)
    PROMPT_RULE = "its Llama tokens condition every block"
    SIGMA_SPACING = "flux"
    """``linspace(1, 1/N, N)`` before the shift: ``HunyuanVideoPipeline``'s ``np.linspace(1, 0, N + 1)[:-1]``."""
    DEFAULT_FRAMES = 129
    """Frames per video when none is given (``HunyuanVideoPipeline``'s default)."""
    DEFAULT_SIDE = 720
    """Video side in px when no resolution is given (``HunyuanVideoPipeline``'s default height)."""
    STOCK_UNIT = 16
    """``HunyuanVideoPipeline.check_inputs`` wants height and width divisible by 16."""

    OPTIONS = ("true_cfg_scale",)
    true_cfg_scale = 1.0
    """True CFG's scale on top of the embedded guidance (1: off, the stock default): :meth:`check_true_cfg_scale`."""

    @staticmethod
    def check_true_cfg_scale(value) -> float:
        """``true_cfg_scale`` as a float ``>= 1`` (1 = off).

        Raises:
            ValueError: for anything else.
        """
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 1:
            raise ValueError(
                f"true_cfg_scale must be a number >= 1 (1 = off, the embedded guidance alone), got {value!r}"
            )
        return float(value)

    def _after_load(self) -> None:
        """Refuse a tokenizer that pads on the left (the transformer treats the first ``mask.sum()`` tokens as the
        prompt).

        Raises:
            ValueError: naming the tokenizer folder.
        """
        if self.pipe.tokenizer.padding_side != "right":
            raise ValueError(
                f"{Path(self.path) / 'tokenizer'} pads on the {self.pipe.tokenizer.padding_side}; "
                "HunyuanVideo's transformer needs the prompt tokens first: set padding_side 'right'"
            )

    # ------------------------------------------------------------------------------ folder checks
    @staticmethod
    def _default_length(index: dict) -> int:
        """256 Llama tokens after the template's crop, ``HunyuanVideoPipeline``'s default."""
        return 256

    @classmethod
    def _resolution_grid(cls, path: Path) -> tuple[int, int, int | None, str]:
        """Default 720 px; a multiple of 16 and of the VAE's spatial compression x the patch size (no largest side:
        the rotary embedding is computed for any size)."""
        vae, dit = _json(path / "vae" / "config.json"), _json(path / "transformer" / "config.json")
        factor, patch = vae.get("spatial_compression_ratio", 8), dit.get("patch_size", 2)
        unit = math.lcm(cls.STOCK_UNIT, factor * patch)
        why = f"16, HunyuanVideoPipeline's rule, and VAE spatial compression {factor} x patch size {patch}"
        return cls.DEFAULT_SIDE // unit * unit, unit, None, why

    @classmethod
    def check_num_frames(cls, path: str | Path, num_frames: int | None) -> int:
        """The frames per video the folder ``path`` draws: ``num_frames`` checked, or 129 (no weights loaded).

        Raises:
            FileNotFoundError: if ``path`` is not a pipeline folder.
            ValueError: naming the folder, unless ``num_frames = t k + 1 >= 1`` (``t`` the VAE's temporal compression,
                4) with a latent frame count divisible by the transformer's temporal patch size.
        """
        path = _pipeline_folder(path)
        t = _json(path / "vae" / "config.json").get("temporal_compression_ratio", 4)
        p_t = _json(path / "transformer" / "config.json").get("patch_size_t", 1)
        frames = cls.DEFAULT_FRAMES if num_frames is None else num_frames
        if frames < 1 or (frames - 1) % t or ((frames - 1) // t + 1) % p_t:
            latent = max(((max(frames, 1) - 1) // t + 1) // p_t, 1) * p_t  # the nearest fitting latent frame count
            raise ValueError(
                f"num_frames {frames} does not fit the model at {path}: expected {t}k+1 frames (the VAE "
                f"compresses time {t}x) with latent frames divisible by the temporal patch {p_t}, e.g. "
                f"{t * (latent - 1) + 1}"
            )
        return frames

    @classmethod
    def check_config(cls, cfg) -> None:
        """:meth:`VideoModel.check_config` (frames, expert, ``true_cfg_scale``), and refuse ``model.negative_prompt``
        without true CFG, before weights load (the embedded guidance alone uses no negative prompt).

        Raises:
            flowrl.fields.ConfigError: naming the key.
        """
        super().check_config(cfg)
        if cfg.model.negative_prompt and cls.check_true_cfg_scale(cfg.model.options.get("true_cfg_scale", 1.0)) == 1:
            raise ConfigError(
                f"config key 'model.negative_prompt': HunyuanVideo ({resolve_path(cfg.model.path)}) samples with embedded "
                f"guidance (sampling.guidance_scale), which uses no negative prompt; leave it empty, or "
                f"turn true CFG on with model.options.true_cfg_scale > 1"
            )

    # ------------------------------------------------------------------------------ the model
    @torch.no_grad()
    def encode(self, prompts: list[str]) -> HunyuanPromptEmbeds:
        """Encode prompts with ``HunyuanVideoPipeline.encode_prompt``: Llama states ``(P, max_sequence_length, D)``
        float32 (the template's ``crop_start`` tokens dropped), their padding mask ``(P, max_sequence_length)`` long and
        CLIP's pooled output ``(P, D_clip)`` float32."""
        embeds, pooled, mask = self.pipe.encode_prompt(
            prompts, device=self.device, max_sequence_length=self.max_sequence_length
        )
        return HunyuanPromptEmbeds(embeds.float(), pooled.float(), mask.long())

    def cfg_scale(self, guidance_scale: float) -> float:
        """:attr:`true_cfg_scale`: the guidance scale itself is embedded (:meth:`embedded_guidance`), and true CFG against
        the negative prompt (``v = v_neg + s (v_c - v_neg)``, two rows per sample) is on when ``s > 1``.

        Raises:
            ValueError: if ``guidance_scale`` is outside [1, 100].
        """
        super().cfg_scale(guidance_scale)
        return self.true_cfg_scale

    def embedded_guidance(self, guidance_scale: float) -> dict:
        """``{"guidance": w}``: ``1000 w`` is the transformer's ``guidance`` input, as ``HunyuanVideoPipeline``."""
        return {"guidance": guidance_scale}

    def _forward(self, x, t, cond: HunyuanPromptEmbeds, dtype, guidance: float = 1.0) -> torch.Tensor:
        """One transformer call on ``x (N, C, F, H, W)`` at times ``t (N,)``: timestep ``1000 t``, embedded guidance
        ``1000 guidance`` per row, as ``HunyuanVideoPipeline`` gives them."""
        g = torch.full((len(x),), float(guidance), device=x.device, dtype=dtype) * 1000.0  # (N,)
        return self.network()(
            hidden_states=x.to(dtype),
            timestep=t.to(dtype) * 1000,
            encoder_hidden_states=cond.embeds.to(dtype),
            encoder_attention_mask=cond.mask.to(dtype),
            pooled_projections=cond.pooled.to(dtype),
            guidance=g,
            return_dict=False,
        )[0]

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Decode latents ``(B, C, F_lat, h, w)`` to videos float32 ``(B, F, 3, H, W)`` in [0, 1], as
        ``HunyuanVideoPipeline`` (``z / scaling_factor``, the VAE, ``x / 2 + 0.5`` clamped), :attr:`decode_chunk` videos
        per call."""
        vae = self.pipe.vae
        videos = []
        for chunk in latents.split(self.decode_chunk):
            z = chunk.to(vae.dtype) / vae.config.scaling_factor
            videos.append(vae.decode(z, return_dict=False)[0].float().permute(0, 2, 1, 3, 4))  # (b, F, 3, H, W)
        return (torch.cat(videos) / 2 + 0.5).clamp(0, 1)
