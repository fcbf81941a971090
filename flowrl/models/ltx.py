"""The LTX-Video family (``LTXPipeline``): Lightricks' LTX-Video text-to-video, sampled and trained as a flow model over
latent videos ``(C, F, H, W)``.

LTX-Video (HaCohen et al., arXiv 2501.00103; reference implementation diffusers ``pipelines/ltx/pipeline_ltx.py``,
``models/transformers/transformer_ltx.py`` and ``models/autoencoders/autoencoder_kl_ltx.py``; the adapter calls them) is
a rectified-flow video DiT: a T5 text encoder (T5-v1.1-XXL, padded to ``max_sequence_length`` tokens with a mask),
``LTXVideoTransformer3DModel`` over one token per latent voxel (patch 1 x 1 x 1) with rotary positions scaled by the
VAE's compression and the frame rate, and ``AutoencoderKLLTXVideo`` (32x spatial, 8x temporal compression into 128
channels, latents normalised by the VAE's ``latents_mean`` / ``latents_std``; from 0.9.1 on a decoder conditioned on
a timestep). The schedule shifts with the number of video tokens. The samplers see latents ``(N, C, F, H, W)`` through
:meth:`FlowModel.velocity_fn` as they see images.

Notation (code -> pipeline): ``t`` (flowrl's time, 1 = noise) -> the scheduler's sigma and the transformer's
``timestep / 1000``; latents ``(C, F, H, W)`` -> the pipeline's ``latents`` before ``_pack_latents`` (tokens ``(F H W,
C)``; ``(z - latents_mean) * scaling_factor / latents_std`` of the VAE's latents ``z``); ``w`` -> ``guidance_scale`` (the
same convention, ``v_neg + w (v_c - v_neg)``); ``guidance_rescale``, ``frame_rate``, ``decode_timestep`` and
``decode_noise_scale`` -> the pipeline's arguments of the same names.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from .base import _json, _pipeline_folder, _scheduler_file, check_fraction, register_family
from .flux import _dynamic_shift
from .hunyuan_video import HunyuanPromptEmbeds
from .video import VideoModel

LTX_LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0")
"""LoRA targets for LTX-Video transformers, finetrainers' LTX-Video LoRA recipe (a-r-r-o-w/finetrainers,
``tests/scripts/dummy_ltx_video_lora.sh``: ``--target_modules to_q to_k to_v to_out.0``): the query, key, value and
output projections of every block's self-attention (``attn1``) and cross-attention (``attn2``)."""

DEFAULT_FRAMES = 161
"""Frames per video when none is given (``LTXPipeline``'s ``num_frames``)."""
DEFAULT_SIDE = 512
"""Video side in px when no resolution is given (``LTXPipeline``'s default height; flowrl draws square videos)."""
DEFAULT_FRAME_RATE = 25.0
"""``LTXPipeline``'s ``frame_rate``: the rotary positions' time scale is ``temporal compression / frame_rate``."""
STOCK_UNIT = 32
"""``LTXPipeline.check_inputs`` wants height and width divisible by 32."""


def vae_compression(path: str | Path) -> tuple[int, int]:
    """``(spatial, temporal)`` compression of the pipeline folder ``path``'s ``AutoencoderKLLTXVideo``, read from its
    config as the class computes them (``patch_size * 2 ** n`` and ``patch_size_t * 2 ** n`` with ``n`` the blocks that
    scale space and time, unless the config names them): ``(32, 8)`` for LTX-Video."""
    cfg = _json(Path(path) / "vae" / "config.json")
    scaling = sum(cfg.get("spatio_temporal_scaling", (True, True, True, False)))
    spatial = cfg.get("spatial_compression_ratio") or cfg.get("patch_size", 4) * 2**scaling
    temporal = cfg.get("temporal_compression_ratio") or cfg.get("patch_size_t", 1) * 2**scaling
    return spatial, temporal


def video_tokens(path: str | Path, resolution: int, num_frames: int) -> int:
    """The transformer's tokens for one square video of ``resolution`` px and ``num_frames`` frames: latent frames x
    latent rows x latent columns (one token per latent voxel), what ``LTXPipeline`` passes ``calculate_shift``."""
    spatial, temporal = vae_compression(path)
    return ((num_frames - 1) // temporal + 1) * (resolution // spatial) ** 2


def _number(name: str, value, low: float, high: float | None = None, unset: bool = False) -> float | None:
    """``value`` as a float in ``[low, high]`` (None allowed when ``unset``), or ValueError naming ``name``."""
    if unset and value is None:
        return None
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and value >= low
    if not ok or (high is not None and value > high):
        span = f"in [{low:g}, {high:g}]" if high is not None else f">= {low:g}"
        raise ValueError(
            f"{name} must be a number {span}{' or null (the video value)' if unset else ''}, got {value!r}"
        )
    return float(value)


@register_family
class LTXVideoModel(VideoModel):
    """An LTX-Video text-to-video flow model (``LTXPipeline`` folder), with :class:`FlowModel`'s interface.

    - Latents: ``(C, F_lat, H/32, W/32)`` per video (:attr:`latent_shape`; ``C`` = 128), ``F_lat = (num_frames - 1) / 8
      + 1``, in the pipeline's normalised space; :meth:`_forward` packs them into ``F_lat H W`` tokens with the
      pipeline's ``_pack_latents`` (patch 1; a transformer with another patch size is refused: the stock pipeline
      cannot sample it either) and unpacks the prediction.
    - Frames: ``num_frames`` (``model.num_frames``; default 161, ``LTXPipeline``'s) must be ``8k + 1`` (the stock
      pipeline would round it silently; flowrl refuses it). Resolution: square, a multiple of 32 (the stock pipeline's
      rule and the VAE's compression); default 512 px.
    - Prompts: the pipeline's own ``encode_prompt``: T5 states ``(P, max_sequence_length, D)`` (default 128 tokens, as
      ``LTXPipeline``) and their padding mask, which the transformer's cross-attention receives
      (:class:`~flowrl.models.hunyuan_video.HunyuanPromptEmbeds`; ``pooled`` is ``(P, 0)``).
    - CFG: ``v_neg + w (v_c - v_neg)`` with the embedding of ``negative_prompt`` (default ``""``, the stock default) as
      the negative, then the stock ``guidance_rescale`` (Lin et al., arXiv 2305.08891, Sec. 3.4; 0 = off, the default).
    - Schedule: ``linspace(1, 1/N, N)`` shifted by ``exp(mu)``, ``mu = calculate_shift(video tokens)`` with the
      scheduler config's ``base_shift`` / ``max_shift`` / ``base_image_seq_len`` / ``max_image_seq_len`` (LTX-Video:
      0.95 / 2.05 / 1024 / 4096), then stretched to end at its ``shift_terminal`` (0.1), then 0 (:meth:`sigmas`): the
      ODE equals ``LTXPipeline``'s (a test checks it within 1e-4). The shift depends on the frame count as well as the
      resolution: :meth:`scheduler_shift` assumes 161 frames unless told otherwise.
    - Rotary positions: ``rope_interpolation_scale = (temporal compression / frame_rate, spatial compression, spatial
      compression)`` as the stock pipeline passes it (``frame_rate`` default 25).
    - Decode: ``z * latents_std / scaling_factor + latents_mean``, then for a timestep-conditioned decoder (LTX-Video
      0.9.1 on) ``(1 - s) z + s noise`` with ``s = decode_noise_scale`` (None: ``decode_timestep``) and the decoder's
      timestep ``decode_timestep``, as ``LTXPipeline`` decodes (defaults 0 and None: no noise, timestep 0); the noise is
      drawn from the global RNG, as the stock pipeline draws it without a generator. Videos ``(B, F, 3, H, W)``
      float32 in [0, 1], :attr:`decode_chunk` videos per VAE call. A decoder that injects noise of its own
      (``decoder_inject_noise``, LTX-Video 0.9.1's VAE) draws it from the global RNG too, in flowrl as in the stock
      pipeline.
    - LoRA: :data:`LTX_LORA_TARGETS`, saved in diffusers' format (``LTXPipeline.load_lora_weights`` loads it).

    Args:
        path, device, dtype, max_sequence_length, resolution: as :class:`FlowModel`.
        num_frames: frames per video (None: 161).
        expert: must be None (one transformer; the trainer passes every video family's settings).
        negative_prompt: the CFG negative prompt.
        frame_rate: frames per second the rotary positions assume (``model.options.frame_rate``), > 0.
        guidance_rescale: the stock ``guidance_rescale`` in [0, 1] (``model.options.guidance_rescale``).
        decode_timestep, decode_noise_scale: the stock decode settings in [0, 1] (``model.options``); only for a VAE with
            ``timestep_conditioning``.

    Raises:
        FileNotFoundError, ValueError: as :class:`FlowModel`; ValueError also for a frame count the VAE cannot take
            (:meth:`check_num_frames`), a transformer patch size other than 1 (:meth:`check_patches`), an expert, or an
            option out of range or set for a VAE that does not take it (:meth:`check_options`).
    """

    PIPELINE = "LTXPipeline"
    """The diffusers pipeline class this adapter loads (``_class_name`` in ``model_index.json``)."""
    FAMILY = "LTX-Video"
    """The family's name in error messages."""
    DEFAULT_FRAMES = DEFAULT_FRAMES
    """Frames per video when none is given (the stock pipeline's; :class:`~flowrl.models.LTX2Model` has its own)."""
    DEFAULT_SIDE = DEFAULT_SIDE
    """Video side in px when none is given (the stock pipeline's height)."""
    DEFAULT_FRAME_RATE = DEFAULT_FRAME_RATE
    """The stock pipeline's ``frame_rate``."""
    LORA_TARGETS = LTX_LORA_TARGETS
    SIGMA_SPACING = "flux"
    """``linspace(1, 1/N, N)`` before the shift, as ``LTXPipeline`` passes its sigmas."""
    SHIFT_TERMINAL = True
    PROMPT_LENGTH = (1, None)
    PROMPT_RULE = "its T5 tokens condition every block"
    OPTIONS = ("frame_rate", "guidance_rescale", "decode_timestep", "decode_noise_scale")
    frame_rate = DEFAULT_FRAME_RATE
    """Frames per second the rotary positions assume (:meth:`check_options`)."""
    decode_timestep = 0.0
    """The stock decode timestep (a VAE with ``timestep_conditioning`` only)."""
    decode_noise_scale = None
    """The stock decode noise scale (None: :attr:`decode_timestep`)."""

    # ------------------------------------------------------------------------------ folder checks
    @staticmethod
    def _default_length(index: dict) -> int:
        """128 T5 tokens, ``LTXPipeline``'s default."""
        return 128

    @classmethod
    def _resolution_grid(cls, path: Path) -> tuple[int, int, int | None, str]:
        """Default 512 px; a multiple of 32 and of the VAE's spatial compression (no largest side: the rotary
        embedding is computed for any size)."""
        spatial, _ = vae_compression(path)
        unit = math.lcm(STOCK_UNIT, spatial)
        return (
            cls.DEFAULT_SIDE // unit * unit,
            unit,
            None,
            f"32, {cls.PIPELINE}'s rule, and VAE spatial compression {spatial}",
        )

    @classmethod
    def check_folder(cls, path: Path) -> None:
        """:meth:`check_patches`.

        Raises:
            ValueError: as :meth:`check_patches`.
        """
        cls.check_patches(path)

    @classmethod
    def check_patches(cls, path: str | Path) -> None:
        """Refuse a transformer whose ``patch_size`` or ``patch_size_t`` is not 1 (no weights loaded): ``LTXPipeline``
        draws ``in_channels`` latent channels and packs them with those patches, which only fits at 1.

        Raises:
            FileNotFoundError: if ``path`` is not a pipeline folder.
            ValueError: naming the folder and the sizes.
        """
        dit = _json(_pipeline_folder(path) / "transformer" / "config.json")
        patches = (dit.get("patch_size", 1), dit.get("patch_size_t", 1))
        if patches != (1, 1):
            raise ValueError(
                f"{Path(path) / 'transformer'} has patch_size {patches[0]}, patch_size_t {patches[1]}; "
                f"{cls.PIPELINE} (and flowrl) sample one token per latent voxel: both must be 1"
            )

    @classmethod
    def check_num_frames(cls, path: str | Path, num_frames: int | None) -> int:
        """The frames per video the folder ``path`` draws: ``num_frames`` checked, or 161 (no weights loaded).

        Raises:
            FileNotFoundError: if ``path`` is not a pipeline folder.
            ValueError: naming the folder, unless ``num_frames = t k + 1 >= 1`` (``t`` the VAE's temporal compression,
                8 for LTX-Video).
        """
        path = _pipeline_folder(path)
        _, t = vae_compression(path)
        frames = cls.DEFAULT_FRAMES if num_frames is None else num_frames
        if frames < 1 or (frames - 1) % t:
            raise ValueError(
                f"num_frames {frames} does not fit the model at {path}: expected {t}k+1 frames (the VAE compresses "
                f"time {t}x), e.g. {(max(frames, 1) - 1) // t * t + 1}"
            )
        return frames

    @classmethod
    def check_options(cls, path: str | Path, options: dict) -> dict:
        """The family's options (``frame_rate``, ``guidance_rescale``, ``decode_timestep``, ``decode_noise_scale``;
        those absent take the stock defaults) checked against the folder ``path`` (no weights loaded).

        Returns:
            the four options: ``frame_rate`` a float > 0, ``guidance_rescale`` and ``decode_timestep`` floats in [0, 1],
            ``decode_noise_scale`` a float in [0, 1] or None (the stock rule: ``decode_timestep``).

        Raises:
            ValueError: naming the option, for a value out of range; naming the folder, for a decode setting other than
                the defaults with a VAE whose decoder takes no timestep (the stock pipeline would ignore it).
        """
        rate = options.get("frame_rate", cls.DEFAULT_FRAME_RATE)
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not rate > 0:
            raise ValueError(
                f"frame_rate must be a number > 0 (frames per second; {cls.PIPELINE}'s is {cls.DEFAULT_FRAME_RATE:g}), "
                f"got {rate!r}"
            )
        decode_timestep = _number("decode_timestep", options.get("decode_timestep", 0.0), 0.0, 1.0)
        noise_scale = options.get("decode_noise_scale")
        noise_scale = None if noise_scale is None else _number("decode_noise_scale", noise_scale, 0.0, 1.0)
        conditioned = _json(_pipeline_folder(path) / "vae" / "config.json").get("timestep_conditioning", False)
        if not conditioned and (decode_timestep or noise_scale):
            raise ValueError(
                f"{Path(path) / 'vae'} decodes without a timestep (timestep_conditioning false): leave decode_timestep "
                f"and decode_noise_scale at 0 / unset (got {decode_timestep}, {noise_scale})"
            )
        return dict(
            frame_rate=float(rate),
            guidance_rescale=check_fraction(options.get("guidance_rescale", 0.0), "guidance_rescale", "0"),
            decode_timestep=decode_timestep,
            decode_noise_scale=noise_scale,
        )

    @classmethod
    def check_option(cls, path: Path, name: str, value):
        """The option ``name`` checked against the folder ``path`` (:meth:`check_options`, one option at a time so
        that the error names its key).

        Raises:
            ValueError: as :meth:`check_options`.
        """
        return cls.check_options(path, {name: value})[name]

    @classmethod
    def scheduler_shift(cls, path: str | Path, resolution: int | None = None, num_frames: int | None = None) -> float:
        """The static shift equal to the folder's scheduler for videos of ``resolution`` px (default: 512) and
        ``num_frames`` frames (default: 161), read without loading weights: ``exp(mu)`` with ``mu =
        calculate_shift(video tokens)`` (:func:`~flowrl.models.flux._dynamic_shift` at :func:`video_tokens`); a
        scheduler without dynamic shifting gives its own ``shift``. The ``shift_terminal`` stretch is applied by
        :meth:`sigmas`.

        Raises:
            FileNotFoundError: if ``path`` has no scheduler config.
            ValueError: for a resolution or frame count the model cannot take, or a scheduler
                :func:`~flowrl.models.flux._dynamic_shift` refuses.
        """
        file = _scheduler_file(path)
        tokens = video_tokens(path, cls.check_resolution(path, resolution), cls.check_num_frames(path, num_frames))
        return _dynamic_shift(_json(file), file, tokens)

    @property
    def shift(self) -> float:
        """:meth:`scheduler_shift` of the loaded scheduler at the model's :attr:`resolution` and :attr:`num_frames`."""
        tokens = math.prod(self.latent_shape[1:])  # F_lat * H * W, one token per latent voxel
        return _dynamic_shift(dict(self.pipe.scheduler.config), Path(self.path) / "scheduler", tokens)

    def sigmas(self, num_steps: int, shift: float | None = None) -> torch.Tensor:
        """The stock pipeline's sigma schedule ``(num_steps + 1,)`` float32 (CPU) from 1 to 0: ``linspace(1, 1/N, N)``
        shifted by ``shift`` (None: :attr:`shift`), stretched to end at the scheduler's ``shift_terminal`` when it has
        one (:meth:`FlowModel.sigmas`), then 0.

        Raises:
            ValueError: as :func:`samplers.flow_sigmas`, and for one step with a ``shift_terminal`` (the stretch is then
                0 / 0 in the stock scheduler too).
        """
        terminal = self.pipe.scheduler.config.get("shift_terminal")
        if terminal and num_steps == 1:
            raise ValueError(
                f"{Path(self.path) / 'scheduler'} stretches the schedule to shift_terminal {terminal}, which needs at "
                "least 2 steps; got num_steps 1"
            )
        return super().sigmas(num_steps, shift)

    # ------------------------------------------------------------------------------ the model
    def vae_factors(self) -> tuple[int, int]:
        """``(spatial, temporal)`` compression of the loaded VAE (the pipeline's ``vae_spatial_compression_ratio`` and
        ``vae_temporal_compression_ratio``)."""
        return self.pipe.vae_spatial_compression_ratio, self.pipe.vae_temporal_compression_ratio

    @property
    def rope_interpolation_scale(self) -> tuple[float, int, int]:
        """The transformer's ``rope_interpolation_scale`` as ``LTXPipeline`` builds it: ``(temporal compression /
        frame_rate, spatial compression, spatial compression)``."""
        pipe = self.pipe
        spatial = pipe.vae_spatial_compression_ratio
        return (pipe.vae_temporal_compression_ratio / self.frame_rate, spatial, spatial)

    @torch.no_grad()
    def encode(self, prompts: list[str]) -> HunyuanPromptEmbeds:
        """Encode prompts with ``LTXPipeline.encode_prompt``: T5 states ``(P, max_sequence_length, D)`` float32, their
        padding ``mask (P, max_sequence_length)`` long (1 for a token) and an empty pooled ``(P, 0)``."""
        embeds, mask, _, _ = self.pipe.encode_prompt(
            prompts,
            do_classifier_free_guidance=False,
            max_sequence_length=self.max_sequence_length,
            device=self.device,
        )
        return HunyuanPromptEmbeds(embeds.float(), embeds.new_zeros(len(prompts), 0).float(), mask.long())

    def _forward(self, x, t, cond: HunyuanPromptEmbeds, dtype) -> torch.Tensor:
        """One transformer call on ``x (N, C, F, H, W)`` at times ``t (N,)``: the latents packed into ``F H W`` tokens,
        timestep ``1000 t`` (float32, as the scheduler's), the prompt mask and the rotary scale as ``LTXPipeline``
        passes them; the prediction unpacked to ``(N, C, F, H, W)``."""
        _, _, frames, height, width = x.shape
        pipe = self.pipe
        tokens = pipe._pack_latents(x.to(dtype))  # (N, F * H * W, C)
        out = self.network()(
            hidden_states=tokens,
            encoder_hidden_states=cond.embeds.to(dtype),
            timestep=t.float() * 1000,
            encoder_attention_mask=cond.mask.to(dtype),
            num_frames=frames,
            height=height,
            width=width,
            rope_interpolation_scale=self.rope_interpolation_scale,
            return_dict=False,
        )[0]  # (N, F * H * W, C)
        return pipe._unpack_latents(out, frames, height, width)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Decode latents ``(B, C, F_lat, h, w)`` to videos float32 ``(B, F, 3, H, W)`` in [0, 1], as ``LTXPipeline``:
        ``z * latents_std / scaling_factor + latents_mean`` in float32, cast to the model's dtype; for a
        timestep-conditioned decoder ``(1 - s) z + s noise`` (``s`` = :attr:`decode_noise_scale`, or
        :attr:`decode_timestep` when None; the noise from the global RNG, drawn only when ``s > 0``) and the timestep
        :attr:`decode_timestep`; the VAE; ``x / 2 + 0.5`` clamped. :attr:`decode_chunk` videos per call."""
        pipe, vae = self.pipe, self.pipe.vae
        scale = self.decode_timestep if self.decode_noise_scale is None else self.decode_noise_scale
        videos = []
        for chunk in latents.split(self.decode_chunk):
            z = pipe._denormalize_latents(chunk.float(), vae.latents_mean, vae.latents_std, vae.config.scaling_factor)
            z = z.to(self.dtype)  # (b, C, F_lat, h, w), as the stock casts to its prompt embeddings' dtype
            timestep = None
            if vae.config.timestep_conditioning:
                if scale:
                    z = (1 - scale) * z + scale * torch.randn(z.shape, device=z.device, dtype=z.dtype)
                timestep = torch.full((len(z),), self.decode_timestep, device=z.device, dtype=z.dtype)  # (b,)
            video = vae.decode(z.to(vae.dtype), timestep, return_dict=False)[0]  # (b, 3, F, H, W)
            videos.append(video.float().permute(0, 2, 1, 3, 4))  # (b, F, 3, H, W)
        return (torch.cat(videos) / 2 + 0.5).clamp(0, 1)
