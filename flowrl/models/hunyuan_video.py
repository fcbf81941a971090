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

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from .base import FlowModel, PromptEmbeds, _pipeline_folder, check_guidance

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

    def __getitem__(self, index: torch.Tensor) -> HunyuanPromptEmbeds:
        """The rows `index` (`(N,)` long) of the three tensors."""
        return HunyuanPromptEmbeds(self.embeds[index], self.pooled[index], self.mask[index])


def _json(path: Path) -> dict:
    """A parsed JSON config file."""
    return json.loads(path.read_text())


class HunyuanVideoModel(FlowModel):
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
    LORA_TARGETS = HUNYUAN_VIDEO_LORA_TARGETS
    SIGMA_SPACING = "flux"
    """``linspace(1, 1/N, N)`` before the shift: ``HunyuanVideoPipeline``'s ``np.linspace(1, 0, N + 1)[:-1]``."""
    VIDEO = True
    VAE_CHANNELS_LAST = False
    """The HunyuanVideo VAE's convolutions are 3-D (channels-last is a 4-D format)."""
    DEFAULT_FRAMES = 129
    """Frames per video when none is given (``HunyuanVideoPipeline``'s default)."""
    DEFAULT_SIDE = 720
    """Video side in px when no resolution is given (``HunyuanVideoPipeline``'s default height)."""
    STOCK_UNIT = 16
    """``HunyuanVideoPipeline.check_inputs`` wants height and width divisible by 16."""

    OPTIONS = ("true_cfg_scale",)

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

    def __init__(
        self,
        path,
        device="cpu",
        dtype=torch.float32,
        max_sequence_length=None,
        resolution=None,
        num_frames: int | None = None,
        expert: str | None = None,
        negative_prompt: str = "",
        true_cfg_scale: float = 1.0,
    ):
        if expert is not None:
            raise ValueError(
                f"{Path(path)} is a HunyuanVideo model (one transformer): leave the expert unset, got {expert!r}"
            )
        self.true_cfg_scale = self.check_true_cfg_scale(true_cfg_scale)
        self.num_frames = self.check_num_frames(path, num_frames)
        self.expert, self.negative_prompt = None, negative_prompt
        self._negative: tuple[str, HunyuanPromptEmbeds] | None = None  # (prompt, its encoding), made on first use
        super().__init__(path, device, dtype, max_sequence_length, resolution)
        if self.pipe.tokenizer.padding_side != "right":
            raise ValueError(
                f"{Path(path) / 'tokenizer'} pads on the {self.pipe.tokenizer.padding_side}; "
                "HunyuanVideo's transformer needs the prompt tokens first: set padding_side 'right'"
            )
        self.decode_chunk = 4  # videos per VAE decode call

    # ------------------------------------------------------------------------------ folder checks
    @staticmethod
    def _default_length(index: dict) -> int:
        """256 Llama tokens after the template's crop, ``HunyuanVideoPipeline``'s default."""
        return 256

    @staticmethod
    def check_max_sequence_length(length: int) -> None:
        """Raise ValueError for a Llama prompt length below 1."""
        if length < 1:
            raise ValueError(
                f"max_sequence_length must be >= 1 for HunyuanVideo (its Llama tokens condition every "
                f"block), got {length}"
            )

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
        """Refuse ``model.num_frames``, ``model.expert`` and ``model.negative_prompt`` the folder cannot take, before
        weights load (the trainer samples with the embedded guidance alone: a negative prompt would be unused).

        Raises:
            flowrl.config.ConfigError: naming the key.
        """
        from ..config import ConfigError, config_key, resolve_path

        path = resolve_path(cfg.model.path)
        with config_key("model.num_frames"):
            cls.check_num_frames(path, cfg.model.num_frames)
        if cfg.model.expert is not None:
            raise ConfigError(
                f"config key 'model.expert': {path} is a HunyuanVideo model (one transformer); leave it "
                f"unset (got {cfg.model.expert!r})"
            )
        with config_key("model.options.true_cfg_scale"):
            true_cfg = cls.check_true_cfg_scale(cfg.model.options.get("true_cfg_scale", 1.0))
        if cfg.model.negative_prompt and true_cfg == 1:
            raise ConfigError(
                f"config key 'model.negative_prompt': HunyuanVideo ({path}) samples with embedded "
                f"guidance (sampling.guidance_scale), which uses no negative prompt; leave it empty, or "
                f"turn true CFG on with model.options.true_cfg_scale > 1"
            )

    # ------------------------------------------------------------------------------ the model
    @property
    def latent_shape(self) -> tuple[int, int, int, int]:
        """``(C, F_lat, H, W)`` of one video's latents: ``F_lat = (num_frames - 1) / 4 + 1``, ``H = W = resolution / 8``
        (the VAE's compressions)."""
        pipe = self.pipe
        side = self.resolution // pipe.vae_scale_factor_spatial
        frames = (self.num_frames - 1) // pipe.vae_scale_factor_temporal + 1
        return (self.transformer.config.in_channels, frames, side, side)

    @property
    def decoded_shape(self) -> tuple[int, int, int, int]:
        """``(F, 3, H, W)`` of one decoded video (what the rewards get per sample)."""
        return (self.num_frames, 3, self.resolution, self.resolution)

    @torch.no_grad()
    def encode(self, prompts: list[str]) -> HunyuanPromptEmbeds:
        """Encode prompts with ``HunyuanVideoPipeline.encode_prompt``: Llama states ``(P, max_sequence_length, D)``
        float32 (the template's ``crop_start`` tokens dropped), their padding mask ``(P, max_sequence_length)`` long and
        CLIP's pooled output ``(P, D_clip)`` float32."""
        embeds, pooled, mask = self.pipe.encode_prompt(
            prompts, device=self.device, max_sequence_length=self.max_sequence_length
        )
        return HunyuanPromptEmbeds(embeds.float(), pooled.float(), mask.long())

    def cfg_rows(self, guidance_scale: float) -> int:
        """Transformer rows per sample and velocity: 1 (embedded guidance), 2 with true CFG (``true_cfg_scale > 1``)."""
        return 2 if self.true_cfg_scale > 1 else 1

    def velocity_fn(self, table: HunyuanPromptEmbeds, guidance_scale: float):
        """A :class:`samplers.VelocityFn` ``fn(x (N, C, F, H, W), t (N,), cond (N,) long) -> (N, C, F, H, W)`` float32
        over a table of prompts (``cond`` indexes ``table``; its row 0, the empty prompt, is unused: the guidance is
        embedded, and true CFG's negative is :attr:`negative_prompt`).

        Raises:
            ValueError: if ``guidance_scale < 1``.
        """
        check_guidance(guidance_scale)

        def fn(x: torch.Tensor, t: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
            return self.velocity(x, t, table[cond], None, guidance_scale)

        return fn

    def velocity(
        self,
        x: torch.Tensor,
        t: torch.Tensor,
        cond: HunyuanPromptEmbeds,
        uncond: HunyuanPromptEmbeds | None,
        guidance_scale: float,
    ) -> torch.Tensor:
        """Velocity ``(N, C, F, H, W)`` float32 of latents ``x (N, C, F, H, W)`` at times ``t (N,)`` in [0, 1] with the
        guidance scale ``guidance_scale`` embedded, and with true CFG against ``uncond`` (None: the encoded
        :attr:`negative_prompt`) when :attr:`true_cfg_scale` ``> 1`` (one batched forward of both rows).

        Raises:
            ValueError: if ``guidance_scale < 1``.
        """
        check_guidance(guidance_scale)
        dtype = next(self.transformer.parameters()).dtype
        if self.true_cfg_scale == 1.0:
            return self._forward(x, t, cond, dtype, guidance_scale).float()
        if uncond is None:
            negative = self.negative_encoding()
            uncond = negative[torch.zeros(len(x), dtype=torch.long, device=negative.embeds.device)]  # N rows
        both = PromptEmbeds.cat([uncond, cond])
        v_n, v_c = self._forward(torch.cat([x, x]), torch.cat([t, t]), both, dtype, guidance_scale).float().chunk(2)
        return v_n + self.true_cfg_scale * (v_c - v_n)

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
