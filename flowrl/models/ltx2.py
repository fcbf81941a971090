"""The LTX-2 family (``LTX2Pipeline``): Lightricks' joint audio-video LTX-2, sampled and trained as a flow model whose
rewards see the video.

LTX-2 (HaCohen et al., arXiv 2601.03233; reference implementation diffusers ``pipelines/ltx2/pipeline_ltx2.py``,
``pipelines/ltx2/connectors.py`` and ``models/transformers/transformer_ltx2.py``; the adapter calls them) generates a
video and its soundtrack in one transformer: Gemma 3's hidden states of every layer go through ``LTX2TextConnectors``,
which give one text embedding for the video stream and one for the audio stream (and a mask); the
``LTX2VideoTransformer3DModel`` has a video stream over one token per latent voxel of ``AutoencoderKLLTX2Video`` (32x
spatial, 8x temporal compression into 128 channels, latents normalised by the VAE's statistics, as LTX-Video's) and an
audio stream over one token per latent frame of ``AutoencoderKLLTX2Audio`` (mel spectrogram latents, ``latent_channels
x mel_bins / 4`` features a token), coupled by audio-to-video and video-to-audio cross-attention; both streams are
denoised together on one sigma schedule.

Audio: the joint latents are the flow's state. The video's velocity depends on the audio latents at every step (the
audio-to-video cross-attention), so the audio is sampled alongside the video exactly as the stock pipeline samples it:
flowrl's state is the video tokens followed by the audio tokens, flattened (:attr:`LTX2Model.latent_shape`), every
kernel steps both (the ODE equals ``LTX2Pipeline``'s), the log-prob of a stochastic step is over both, and the
trained velocity is the joint one: the audio branch is trained with the video (the policy's action is the pair), with
LTX-2's real sizes about 2% of the dimensions (126 audio tokens against 6144 video tokens of 128 features for 121
frames at 512 x 768). The rewards see the decoded video only; the audio latents are not decoded (the vocoder never
runs), and :meth:`LTX2Model.stock_latents` gives them as the stock pipeline's ``output_type="latent"`` does.

Notation (code -> pipeline): ``t`` (flowrl's time, 1 = noise) -> the scheduler's sigma, the transformer's ``timestep``
and ``sigma`` ``1000 t``; the state ``(D,)`` -> ``latents`` (packed, normalised video tokens ``(F H W, C)``) then
``audio_latents`` (packed, normalised audio tokens ``(L, C_a M)``); ``w`` -> ``guidance_scale``; the options -> the
pipeline's arguments of the same names.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ..fields import config_key
from ..files import resolve_path
from .base import (
    MAX_GUIDANCE,
    PromptEmbeds,
    _json,
    _pipeline_folder,
    check_guidance,
    make_batch_invariant,
    register_family,
)
from .ltx import LTXVideoModel, _number

LTX2_LORA_TARGETS = tuple(
    f"{prefix}.{proj}"
    for prefix in ("attn1", "attn2", "audio_attn1", "audio_attn2", "audio_to_video_attn", "video_to_audio_attn")
    for proj in ("to_q", "to_k", "to_v", "to_out.0")
) + ("ff.net.0.proj", "ff.net.2", "audio_ff.net.0.proj", "audio_ff.net.2")
"""LoRA targets for LTX-2 transformers, Flow-Factory's LTX-2 default (X-GenGroup/Flow-Factory,
``src/flow_factory/models/ltx2/ltx2_t2av.py``, ``default_target_modules``): the query, key, value and output projections
of both streams' self- and text cross-attention and of the two cross-modal attentions, and both streams' feed-forward
layers (28 linear layers a block)."""

DEFAULT_LENGTH = 1024
"""Gemma tokens per prompt when none is given (``LTX2Pipeline``'s ``max_sequence_length``)."""
AUDIO_MEL_COMPRESSION = 4
"""``AutoencoderKLLTX2Audio``'s mel-bin (and time) compression (diffusers' ``LATENT_DOWNSAMPLE_FACTOR``)."""


@dataclass
class LTX2PromptEmbeds(PromptEmbeds):
    """LTX-2 prompt embeddings, the connectors' outputs: the video stream's ``embeds (P, T, D)`` float32 (``T =
    max_sequence_length``), the audio stream's ``audio (P, T, D_a)`` float32, their ``mask (P, T)`` long (1 for a token
    the transformer attends to; all ones when the connectors replace the padding by learnable registers), and an empty
    ``pooled (P, 0)``."""

    audio: torch.Tensor = None
    mask: torch.Tensor = None


GUIDANCE_DEFAULTS = dict(
    stg_scale=0.0,
    spatio_temporal_guidance_blocks=(28,),
    modality_scale=1.0,
    audio_guidance_scale=None,
    audio_stg_scale=None,
    audio_modality_scale=None,
    audio_guidance_rescale=None,
)
"""flowrl's defaults of ``LTX2Pipeline``'s guidance arguments beyond ``guidance_scale`` and ``guidance_rescale``: STG
and modality guidance off, each audio term following the video's. The stock defaults (STG 1 at block 28, modality
guidance 3, rescale 0.7, audio CFG 7: LTX-2.3's recommendation) cost two more transformer calls a step; set them with
``model.options``."""


@register_family
class LTX2Model(LTXVideoModel):
    """An LTX-2 text-to-audio-video flow model (``LTX2Pipeline`` folder), with :class:`FlowModel`'s interface; the
    rewards see its videos. LTX-Video's adapter (:class:`LTXVideoModel`) supplies the frame, resolution, patch and
    decode checks and the schedule.

    - Latents: ``(D,)`` per sample (:attr:`latent_shape`), ``D = F_lat H W C + L C_a``: the pipeline's packed,
      normalised video tokens ``(F_lat H W, C)`` (``C`` = 128, ``F_lat = (num_frames - 1) / 8 + 1``, ``H = W =
      resolution / 32``) followed by its packed, normalised audio tokens ``(L, C_a)`` (``L = round(num_frames /
      frame_rate x sample_rate / hop_length / 4)`` latent audio frames, ``C_a = latent_channels x mel_bins / 4`` = 128),
      flattened (:meth:`split_latents`). Both are sampled and trained together (the module docstring says why); the
      stock pipeline's de-normalised video and audio latents are :meth:`stock_latents`.
    - Frames: ``num_frames`` (``model.num_frames``; default 121, ``LTX2Pipeline``'s) must be ``8k + 1``. Resolution:
      square, a multiple of 32 (the stock rule); default 512 px (the stock height).
    - Prompts: the pipeline's own ``encode_prompt`` (Gemma 3, left-padded to ``max_sequence_length`` tokens, default
      1024 as ``LTX2Pipeline``; every layer's hidden states), then its ``connectors``: the video and audio text
      embeddings and their mask (:class:`LTX2PromptEmbeds`). With learnable registers (LTX-2) the length must be a
      multiple of their count (128), as the connectors require (:meth:`check_prompt_length`).
    - Guidance, as ``LTX2Pipeline`` combines it in the data prediction ``x0 = x - t v``: ``x0_c + (w - 1)(x0_c - x0_neg)
      + s (x0_c - x0_stg) + (m - 1)(x0_c - x0_iso)``, then ``guidance_rescale`` toward ``x0_c``'s standard deviation
      (Lin et al., arXiv 2305.08891), separately for the video tokens (``w``, ``stg_scale``, ``modality_scale``,
      ``guidance_rescale``) and the audio tokens (the ``audio_*`` options; None, or 0 as the stock pipeline reads it,
      takes the video's value). ``x0_neg`` is the negative prompt's (``model.negative_prompt``, default ""), ``x0_stg``
      the transformer's with spatio-temporal guidance at ``spatio_temporal_guidance_blocks`` (STG, Hyung et al., arXiv
      2411.18664: those blocks' self-attention skipped), ``x0_iso`` the transformer's with the cross-modal attention off
      (modality guidance, LTX-2's paper). Each active term is one more transformer call per sample (:meth:`cfg_rows`).
      flowrl's defaults are CFG only (:data:`GUIDANCE_DEFAULTS`, ``guidance_rescale`` 0).
    - Schedule: LTX-Video's (:meth:`LTXVideoModel.sigmas`): ``linspace(1, 1/N, N)`` shifted by ``exp(mu)``, ``mu =
      calculate_shift(F_lat H W video tokens)``, stretched to the scheduler's ``shift_terminal`` (0.1); the audio tokens
      use the same sigmas, as the pipeline's copy of the scheduler.
    - Transformer calls: timestep and sigma ``1000 t``, rotary positions at ``frame_rate`` (default 24, the stock's)
      for the video and at the audio's own rate, the connectors' mask for both text cross-attentions, as the pipeline.
    - Decode: as ``LTX2Pipeline``: for a timestep-conditioned decoder ``(1 - s) z + s noise`` on the normalised latents
      (``s = decode_noise_scale``, None: ``decode_timestep``; the noise from the global RNG, drawn only when ``s > 0``),
      then ``z * latents_std / scaling_factor + latents_mean``, the VAE at ``decode_timestep``; videos ``(B, F, 3, H,
      W)`` float32 in [0, 1].
    - LoRA: :data:`LTX2_LORA_TARGETS`, saved in diffusers' format (``LTX2Pipeline.load_lora_weights`` loads it).

    Args:
        path, device, dtype, max_sequence_length, resolution, num_frames, expert, negative_prompt, frame_rate,
            decode_timestep, decode_noise_scale: as :class:`LTXVideoModel` (``frame_rate`` also sets the audio length).
        guidance_rescale: the stock ``guidance_rescale`` in [0, 1] (0: off, flowrl's default; the stock's is 0.7).
        stg_scale: STG's scale ``s >= 0`` (0: off). spatio_temporal_guidance_blocks: the blocks STG perturbs (the
            stock default ``(28,)``; checked against the transformer when STG is on).
        modality_scale: modality guidance's ``m >= 1`` (1: off).
        audio_guidance_scale, audio_stg_scale, audio_modality_scale, audio_guidance_rescale: the audio tokens' terms
            (None: the video's).

    Raises:
        FileNotFoundError, ValueError: as :class:`LTXVideoModel`; ValueError also for an option out of range
            (:meth:`check_options`), STG blocks the transformer does not have (:meth:`check_stg_blocks`), a prompt
            length the connectors cannot take (:meth:`check_prompt_length`) or an audio VAE whose tokens do not fit the
            transformer (:meth:`check_audio`).
    """

    PIPELINE = "LTX2Pipeline"
    """The diffusers pipeline class this adapter loads (``_class_name`` in ``model_index.json``)."""
    FAMILY = "LTX-2"
    OPTIONAL = ("processor", "prompt_enhancer", "duration_head")
    """Components a folder may leave out (the prompt enhancer and LTX-2.5's duration head; flowrl uses neither)."""
    LORA_TARGETS = LTX2_LORA_TARGETS
    PROMPT_RULE = "its Gemma tokens condition every block"
    OPTIONS = ("frame_rate", "guidance_rescale", "decode_timestep", "decode_noise_scale", *GUIDANCE_DEFAULTS)
    DEFAULT_FRAMES = 121
    """Frames per video when none is given (``LTX2Pipeline``'s ``num_frames`` without a duration head)."""
    DEFAULT_SIDE = 512
    """Video side in px when none is given (``LTX2Pipeline``'s default height; flowrl draws square videos)."""
    DEFAULT_FRAME_RATE = 24.0
    """``LTX2Pipeline``'s ``frame_rate``."""

    frame_rate = DEFAULT_FRAME_RATE
    stg_scale = GUIDANCE_DEFAULTS["stg_scale"]
    spatio_temporal_guidance_blocks = GUIDANCE_DEFAULTS["spatio_temporal_guidance_blocks"]
    modality_scale = GUIDANCE_DEFAULTS["modality_scale"]
    audio_guidance_scale = audio_stg_scale = audio_modality_scale = audio_guidance_rescale = None
    """The audio terms (None: the video's)."""

    def _set_options(self, path: Path, options: dict) -> None:
        """:meth:`FlowModel._set_options`, then the STG blocks against the transformer (:meth:`check_stg_blocks`).

        Raises:
            TypeError, ValueError: as those.
        """
        super()._set_options(path, options)
        self.check_stg_blocks(path, {name: getattr(self, name) for name in GUIDANCE_DEFAULTS})

    def _after_load(self) -> None:
        """The text connectors, the audio VAE and the vocoder frozen; the connectors, which run in every ``encode``,
        made batch-invariant (a prompt's row whatever its batch: the prompt cache)."""
        for name in ("connectors", "audio_vae", "vocoder"):
            self.pipe.components[name].requires_grad_(False).eval()
        make_batch_invariant(self.pipe.connectors, None)

    # ------------------------------------------------------------------------------ folder checks
    @staticmethod
    def _default_length(index: dict) -> int:
        """1024 Gemma tokens, ``LTX2Pipeline``'s default."""
        return DEFAULT_LENGTH

    @classmethod
    def check_prompt_length(cls, path: str | Path, length: int) -> None:
        """Refuse a prompt length the folder's connectors cannot take (no weights loaded): with learnable registers
        (LTX-2: 128) the padded prompt must be a whole number of register blocks.

        Raises:
            FileNotFoundError: if ``path`` is not a pipeline folder.
            ValueError: naming the folder, the length and the register count.
        """
        cls.check_max_sequence_length(length)
        cfg = _json(_pipeline_folder(path) / "connectors" / "config.json")
        for stream in ("video", "audio"):
            registers = cfg.get(f"{stream}_connector_num_learnable_registers", 128)
            if registers and length % registers:
                raise ValueError(
                    f"max_sequence_length {length} does not fit {Path(path) / 'connectors'}: its {stream} connector "
                    f"replaces padding by {registers} learnable registers, so the length must be a multiple of "
                    f"{registers}, e.g. {max(length // registers, 1) * registers}"
                )

    @classmethod
    def check_folder(cls, path: Path) -> None:
        """:meth:`LTXVideoModel.check_folder` and :meth:`check_audio`.

        Raises:
            ValueError: as those.
        """
        super().check_folder(path)
        cls.check_audio(path)

    @classmethod
    def check_audio(cls, path: str | Path) -> None:
        """Refuse an audio VAE whose packed tokens do not have the transformer's ``audio_in_channels`` features
        (``latent_channels x mel_bins / 4``; the stock pipeline cannot sample it either), no weights loaded.

        Raises:
            FileNotFoundError: if ``path`` is not a pipeline folder. ValueError: naming the folder and the sizes.
        """
        path = _pipeline_folder(path)
        audio, dit = _json(path / "audio_vae" / "config.json"), _json(path / "transformer" / "config.json")
        features = audio.get("latent_channels", 8) * (audio.get("mel_bins", 64) // AUDIO_MEL_COMPRESSION)
        if features != dit.get("audio_in_channels", 128):
            raise ValueError(
                f"{path / 'audio_vae'} packs {features} features an audio token (latent_channels x mel_bins / "
                f"{AUDIO_MEL_COMPRESSION}) but {path / 'transformer'} takes audio_in_channels "
                f"{dit.get('audio_in_channels', 128)}: they must be equal"
            )

    @classmethod
    def check_options(cls, path: str | Path, options: dict) -> dict:
        """:meth:`LTXVideoModel.check_options` for ``frame_rate``, ``guidance_rescale``, ``decode_timestep`` and
        ``decode_noise_scale``, and the guidance options (:data:`GUIDANCE_DEFAULTS`; those absent take their defaults),
        no weights loaded.

        Returns:
            every option: as :meth:`LTXVideoModel.check_options`, and ``stg_scale`` a float >= 0,
            ``spatio_temporal_guidance_blocks`` a tuple of ints >= 0, ``modality_scale`` a float >= 1,
            ``audio_guidance_scale`` None or a float in [1, 100], ``audio_stg_scale`` None or >= 0,
            ``audio_modality_scale`` None or >= 1, ``audio_guidance_rescale`` None or in [0, 1].

        Raises:
            ValueError: naming the option, for a value out of range; as :meth:`LTXVideoModel.check_options`.
        """
        out = super().check_options(path, options)
        get = {**GUIDANCE_DEFAULTS, **options}.get
        blocks = get("spatio_temporal_guidance_blocks")
        if (
            not isinstance(blocks, (list, tuple))
            or not blocks
            or not all(isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in blocks)
        ):
            raise ValueError(
                f"spatio_temporal_guidance_blocks must be a non-empty list of transformer block indices >= 0 "
                f"(LTX2Pipeline's default [28]), got {blocks!r}"
            )
        return {
            **out,
            "stg_scale": _number("stg_scale", get("stg_scale"), 0.0),
            "spatio_temporal_guidance_blocks": tuple(blocks),
            "modality_scale": _number("modality_scale", get("modality_scale"), 1.0),
            "audio_guidance_scale": _number(
                "audio_guidance_scale", get("audio_guidance_scale"), 1.0, MAX_GUIDANCE, True
            ),
            "audio_stg_scale": _number("audio_stg_scale", get("audio_stg_scale"), 0.0, unset=True),
            "audio_modality_scale": _number("audio_modality_scale", get("audio_modality_scale"), 1.0, unset=True),
            "audio_guidance_rescale": _number("audio_guidance_rescale", get("audio_guidance_rescale"), 0.0, 1.0, True),
        }

    @classmethod
    def check_stg_blocks(cls, path: str | Path, options: dict) -> None:
        """Refuse STG (``stg_scale`` or ``audio_stg_scale`` > 0 in ``options``, checked ones) at blocks the folder's
        transformer does not have (the stock pipeline would skip them silently, a transformer call for nothing).

        Raises:
            ValueError: naming ``spatio_temporal_guidance_blocks``, the folder and its block count.
        """
        if not (options["stg_scale"] or options["audio_stg_scale"]):
            return
        layers = _json(_pipeline_folder(path) / "transformer" / "config.json").get("num_layers", 48)
        wrong = [b for b in options["spatio_temporal_guidance_blocks"] if b >= layers]
        if wrong:
            raise ValueError(
                f"spatio_temporal_guidance_blocks {list(options['spatio_temporal_guidance_blocks'])} name blocks "
                f"{wrong} that {Path(path) / 'transformer'} does not have (blocks 0 to {layers - 1}); LTX-2.0 uses "
                "[29], LTX-2.3 [28]"
            )

    @classmethod
    def check_config(cls, cfg) -> None:
        """:meth:`LTXVideoModel.check_config` (the folder's patches and audio VAE, the options, frames and expert), and
        the STG blocks against the transformer, before weights load.

        Raises:
            flowrl.fields.ConfigError: naming the key.
        """
        super().check_config(cfg)
        path = resolve_path(cfg.model.path)
        with config_key("model.options.spatio_temporal_guidance_blocks"):
            cls.check_stg_blocks(path, cls.check_options(path, dict(cfg.model.options)))

    @property
    def shift(self) -> float:
        """:meth:`scheduler_shift` of the loaded scheduler at the model's video tokens (``F_lat H W``)."""
        from .flux import _dynamic_shift

        frames, height, width = self.video_grid
        return _dynamic_shift(dict(self.pipe.scheduler.config), Path(self.path) / "scheduler", frames * height * width)

    # ------------------------------------------------------------------------------ latents
    @property
    def audio_frames(self) -> int:
        """Latent audio frames ``L`` of one video, as ``LTX2Pipeline`` counts them: ``round(num_frames / frame_rate x
        sample_rate / hop_length / 4)``."""
        pipe = self.pipe
        per_second = (
            pipe.audio_sampling_rate / pipe.audio_hop_length / float(pipe.audio_vae_temporal_compression_ratio)
        )
        return round(self.num_frames / self.frame_rate * per_second)

    @property
    def latent_shape(self) -> tuple[int]:
        """``(D,)``: the video tokens' ``F_lat H W C`` then the audio tokens' ``L C_a`` (:meth:`split_latents`)."""
        config = self.transformer.config
        frames, height, width = self.video_grid
        return (frames * height * width * config.in_channels + self.audio_frames * config.audio_in_channels,)

    def split_latents(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The pipeline's two packed latents of flowrl's state ``x (N, D)``: video tokens ``(N, F_lat H W, C)`` and
        audio tokens ``(N, L, C_a)`` (views, normalised)."""
        config = self.transformer.config
        frames, height, width = self.video_grid
        size = frames * height * width * config.in_channels
        video = x[:, :size].reshape(len(x), frames * height * width, config.in_channels)  # (N, S_v, C)
        audio = x[:, size:].reshape(len(x), self.audio_frames, config.audio_in_channels)  # (N, L, C_a)
        return video, audio

    @torch.no_grad()
    def stock_latents(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """What ``LTX2Pipeline(output_type="latent")`` returns for the final state ``x (N, D)``: the video latents ``(N,
        C, F_lat, H, W)`` and the audio latents ``(N, C_a', L, M)`` (``C_a'`` the audio VAE's latent channels, ``M`` the
        latent mel bins), both de-normalised with their VAE's statistics, float32: the audio VAE and the vocoder decode
        the second to sound."""
        pipe, config = self.pipe, self.transformer.config
        video, audio = self.split_latents(x.float())
        video = pipe._unpack_latents(video, *self.video_grid, config.patch_size, config.patch_size_t)
        video = pipe._denormalize_latents(
            video, pipe.vae.latents_mean, pipe.vae.latents_std, pipe.vae.config.scaling_factor
        )
        audio = pipe._denormalize_audio_latents(audio, pipe.audio_vae.latents_mean, pipe.audio_vae.latents_std)
        mel = pipe.audio_vae.config.mel_bins // pipe.audio_vae_mel_compression_ratio
        return video.float(), pipe._unpack_audio_latents(audio, self.audio_frames, num_mel_bins=mel).float()

    # ------------------------------------------------------------------------------ the model
    @torch.no_grad()
    def encode(self, prompts: list[str]) -> LTX2PromptEmbeds:
        """Encode prompts with ``LTX2Pipeline.encode_prompt`` (Gemma 3's hidden states of every layer, left-padded to
        ``max_sequence_length`` ``T``) and its ``connectors``: the video and audio text embeddings ``(P, T, D)`` and
        ``(P, T, D_a)`` float32, their mask ``(P, T)`` long and an empty pooled ``(P, 0)``."""
        pipe = self.pipe
        states, mask, _, _ = pipe.encode_prompt(
            prompts,
            do_classifier_free_guidance=False,
            max_sequence_length=self.max_sequence_length,
            device=self.device,
        )
        side = getattr(pipe.tokenizer, "padding_side", "left")  # encode_prompt pads on the left, as the pipeline
        video, audio, mask = pipe.connectors(states, mask, padding_side=side)
        return LTX2PromptEmbeds(video.float(), video.new_zeros(len(prompts), 0).float(), audio.float(), mask.long())

    def _scales(
        self, guidance_scale: float
    ) -> tuple[tuple[float, float, float, float], tuple[float, float, float, float]]:
        """The video's and the audio's ``(cfg, stg, modality, rescale)`` at CFG ``guidance_scale``, the audio's unset
        ones (None or 0) taking the video's as the stock pipeline's ``or``."""
        video = (guidance_scale, self.stg_scale, self.modality_scale, self.guidance_rescale)
        audio = (
            self.audio_guidance_scale or guidance_scale,
            self.audio_stg_scale or self.stg_scale,
            self.audio_modality_scale or self.modality_scale,
            self.audio_guidance_rescale or self.guidance_rescale,
        )
        return video, audio

    def _terms(self, guidance_scale: float) -> tuple[bool, bool, bool]:
        """Which guidance calls a velocity at ``guidance_scale`` makes besides the conditional one: ``(cfg, stg,
        modality)``, as ``LTX2Pipeline``'s ``do_*`` properties."""
        video, audio = self._scales(guidance_scale)
        return video[0] > 1 or audio[0] > 1, video[1] > 0 or audio[1] > 0, video[2] > 1 or audio[2] > 1

    def cfg_rows(self, guidance_scale: float) -> int:
        """Transformer rows per sample and velocity: the conditional one, plus one each for CFG's negative, STG and
        modality guidance when they are on (:meth:`_terms`)."""
        return 1 + sum(self._terms(guidance_scale))

    def uses_negative(self, guidance_scale: float) -> bool:
        """Whether either stream is guided by CFG (:meth:`_terms`: the audio's CFG may be on at ``guidance_scale`` 1):
        :meth:`FlowModel.velocity_fn` then passes the negative row (row 0, re-encoded as :attr:`negative_prompt` when
        that is not empty).

        Raises:
            ValueError: if ``guidance_scale`` is not in [1, 100].
        """
        check_guidance(guidance_scale)
        return self._terms(guidance_scale)[0]

    def velocity(
        self,
        x: torch.Tensor,
        t: torch.Tensor,
        cond: LTX2PromptEmbeds,
        uncond: LTX2PromptEmbeds | None,
        guidance_scale: float,
    ) -> torch.Tensor:
        """Velocity ``(N, D)`` float32 of the joint latents ``x (N, D)`` at times ``t (N,)`` in (0, 1], guided as
        ``LTX2Pipeline`` (the class docstring): the conditional call, the negative one batched with it when CFG is on
        and ``uncond`` is given, one STG call and one modality-isolated call when those are on; the terms combined in
        the data prediction per stream and converted back to a velocity. Overridden because LTX-2 guides in the data
        prediction, per stream (video and audio scales apart), with terms beyond CFG (STG, modality guidance).

        Raises:
            ValueError: if ``guidance_scale`` is not in [1, 100].
        """
        check_guidance(guidance_scale)
        dtype = next(self.transformer.parameters()).dtype
        cfg, stg, modality = self._terms(guidance_scale)
        cfg = cfg and uncond is not None
        if cfg:
            both = self._cfg_batch(cond, uncond)  # (2N) rows: negatives first, as the stock pipeline batches them
            v_neg, v_c = self._forward(torch.cat([x, x]), torch.cat([t, t]), both, dtype).float().chunk(2)
        else:
            v_c = self._forward(x, t, cond, dtype).float()
        video, audio = self._scales(guidance_scale)
        terms = []  # (video scale, audio scale, the other call's velocity), in the pipeline's order
        if cfg:
            terms.append((video[0] - 1, audio[0] - 1, v_neg))
        if stg:
            perturbed = self._forward(x, t, cond, dtype, stg_blocks=self.spatio_temporal_guidance_blocks).float()
            terms.append((video[1], audio[1], perturbed))
        if modality:
            terms.append((video[2] - 1, audio[2] - 1, self._forward(x, t, cond, dtype, isolate=True).float()))
        if not terms:
            return v_c
        size = self.split_latents(x)[0][0].numel()  # video numbers per sample
        parts = [
            self._guide(x[:, span], t, v_c[:, span], [(s[k], v[:, span]) for *s, v in terms], rescale)
            for k, (span, rescale) in enumerate(((slice(0, size), video[3]), (slice(size, None), audio[3])))
        ]
        return torch.cat(parts, dim=1)

    @staticmethod
    def _guide(x, t, v_c, terms, rescale: float) -> torch.Tensor:
        """One stream's guided velocity ``(N, d)`` from its state ``x (N, d)``, times ``t (N,)``, conditional velocity
        ``v_c`` and ``terms`` ``[(scale, velocity)]``, in ``LTX2Pipeline``'s data-prediction form (``x0 = x - t v``;
        ``x0_c + sum scale (x0_c - x0_k)``, rescaled toward ``x0_c`` when ``rescale > 0``, then ``(x - x0) / t``)."""
        from diffusers.pipelines.ltx2.pipeline_ltx2 import rescale_noise_cfg

        t = t.float().view(-1, 1)  # (N, 1)
        x = x.float()
        x0_c = x - t * v_c  # (N, d)
        guided = x0_c
        for scale, v in terms:
            guided = guided + scale * (x0_c - (x - t * v))
        if rescale > 0:
            guided = rescale_noise_cfg(guided, x0_c, guidance_rescale=rescale)
        return (x - guided) / t

    def _forward(
        self, x, t, cond: LTX2PromptEmbeds, dtype, stg_blocks: tuple[int, ...] = (), isolate: bool = False
    ) -> torch.Tensor:
        """One transformer call on the joint latents ``x (N, D)`` at times ``t (N,)``: the video and audio tokens
        (:meth:`split_latents`), both text embeddings with the connectors' mask, timestep and sigma ``1000 t`` (float32,
        as the scheduler's), the video's grid and frame rate and the audio's length as ``LTX2Pipeline`` passes them;
        ``stg_blocks`` perturbs those blocks (STG), ``isolate`` turns the cross-modal attention off. Returns the joint
        prediction ``(N, D)``."""
        frames, height, width = self.video_grid
        video, audio = self.split_latents(x)
        timestep = t.float() * 1000  # (N,)
        out_video, out_audio = self.network()(
            hidden_states=video.to(dtype),
            audio_hidden_states=audio.to(dtype),
            encoder_hidden_states=cond.embeds.to(dtype),
            audio_encoder_hidden_states=cond.audio.to(dtype),
            timestep=timestep,
            sigma=timestep,
            encoder_attention_mask=cond.mask,
            audio_encoder_attention_mask=cond.mask,
            num_frames=frames,
            height=height,
            width=width,
            fps=self.frame_rate,
            audio_num_frames=self.audio_frames,
            isolate_modalities=isolate,
            spatio_temporal_guidance_blocks=list(stg_blocks) or None,
            use_cross_timestep=True,
            return_dict=False,
        )  # (N, S_v, C), (N, L, C_a)
        return torch.cat([out_video.flatten(1), out_audio.flatten(1)], dim=1)  # (N, D)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Decode the video part of the joint latents ``(B, D)`` to videos float32 ``(B, F, 3, H, W)`` in [0, 1], as
        ``LTX2Pipeline``: the tokens unpacked to ``(b, C, F_lat, h, w)`` in the model's dtype; for a
        timestep-conditioned decoder ``(1 - s) z + s noise`` (``s`` = :attr:`decode_noise_scale`, or
        :attr:`decode_timestep` when None; the noise from the global RNG, drawn only when ``s > 0``) and the timestep
        :attr:`decode_timestep`; then ``z * latents_std / scaling_factor + latents_mean``; the VAE; ``x / 2 + 0.5``
        clamped. :attr:`decode_chunk` videos per call. The audio tokens are not decoded (:meth:`stock_latents`)."""
        pipe, vae, config = self.pipe, self.pipe.vae, self.transformer.config
        scale = self.decode_timestep if self.decode_noise_scale is None else self.decode_noise_scale
        videos = []
        for chunk in latents.split(self.decode_chunk):
            tokens, _ = self.split_latents(chunk.float())
            z = pipe._unpack_latents(tokens, *self.video_grid, config.patch_size, config.patch_size_t).to(self.dtype)
            timestep = None
            if vae.config.timestep_conditioning:
                if scale:
                    z = (1 - scale) * z + scale * torch.randn(z.shape, device=z.device, dtype=z.dtype)
                timestep = torch.full((len(z),), self.decode_timestep, device=z.device, dtype=z.dtype)  # (b,)
            z = pipe._denormalize_latents(z, vae.latents_mean, vae.latents_std, vae.config.scaling_factor)
            video = vae.decode(z.to(vae.dtype), timestep, return_dict=False)[0]  # (b, 3, F, H, W)
            videos.append(video.float().permute(0, 2, 1, 3, 4))  # (b, F, 3, H, W)
        return (torch.cat(videos) / 2 + 0.5).clamp(0, 1)
