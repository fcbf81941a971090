"""The HunyuanVideo 1.5 family: text-to-video (``HunyuanVideo15Pipeline``, :class:`HunyuanVideo15Model`) and
image-to-video (``HunyuanVideo15ImageToVideoPipeline``, :class:`HunyuanVideo15ImageToVideoModel`: the first frame a
source image named in the prompt record), sampled and trained as flow models over latent videos ``(C, F, H, W)``.

HunyuanVideo 1.5 (Tencent Hunyuan, arXiv 2511.18870; reference implementation diffusers
``pipelines/hunyuan_video1_5/pipeline_hunyuan_video1_5.py``, ``models/transformers/transformer_hunyuan_video15.py`` and
``models/autoencoders/autoencoder_kl_hunyuanvideo15.py``; the adapter calls them) is a rectified-flow video DiT of 54
dual-stream blocks over 1x1x1 patches: a Qwen2.5-VL text encoder (the prompt in a chat template with a video-describing
system message, the hidden states two layers below the top, the template's first 108 tokens cropped), a ByT5 encoder
for the text in quotes of a prompt (glyph text; zeros with an empty mask when a prompt has none), 729 image tokens
(SigLIP's, for image-to-video; zeros and masked out in text-to-video), and ``AutoencoderKLHunyuanVideo15`` (16x
spatial, 4x temporal compression into 32 channels). The transformer sees the 32 latent channels followed by 32
image-condition channels and a mask channel, all zero in text-to-video. Classifier-free guidance is the pipeline's
``guider`` component (``ClassifierFreeGuidance``).

Notation (code -> pipeline): ``t`` (flowrl's time, 1 = noise) -> the scheduler's sigma and the transformer's
``timestep / 1000``; latents ``(C, F, H, W)`` -> ``latents`` (the VAE's latents times ``scaling_factor``); the zero
``(C + 1, F, H, W)`` appended in :meth:`HunyuanVideo15Model._forward` -> ``cond_latents_concat`` and ``mask_concat``;
``w`` -> ``guider.guidance_scale`` (``v_neg + w (v_c - v_neg)``, the guider's default formulation);
``max_sequence_length`` -> the pipeline's ``tokenizer_max_length`` (Qwen tokens after the crop). Image-to-video
(``pipelines/hunyuan_video1_5/pipeline_hunyuan_video1_5_image2video.py``): ``condition`` -> ``cat[cond_latents_concat,
mask_concat]`` (the source's latents in frame 0, a mask of frame 0), ``image`` -> ``image_embeds`` (SigLIP tokens).
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from pathlib import Path

import torch

from ..activations import GLYPH_TOKENS
from .base import (
    JOINT_ATTENTION_TARGETS,
    PromptEmbeds,
    _absent,
    _json,
    _model_index,
    _pipeline_folder,
    check_fraction,
    register_family,
)
from .hunyuan_video import HunyuanVideoModel
from .video import VideoModel
from .wan_i2v import WanImageToVideoModel, source_rows

HUNYUAN_VIDEO15_LORA_TARGETS = JOINT_ATTENTION_TARGETS + (
    "ff.net.0.proj",
    "ff.net.2",
    "ff_context.net.0.proj",
    "ff_context.net.2",
)
"""UniRL's LoRA targets for HunyuanVideo 1.5 (Tencent-Hunyuan/UniRL,
``examples/diffusion/hunyuan_video15/hunyuan_video15_t2v_dancegrpo_trainside.yaml``, ``lora_cfg.target_modules``): the
attention projections of both streams and both feed-forward networks of every dual-stream block; ``attn.*`` and
``ff.*`` also match the text token refiner's blocks (2 in HunyuanVideo 1.5), as in UniRL's peft config."""


GUIDER_DEFAULTS = {"enabled": True, "use_original_formulation": False, "start": 0.0, "stop": 1.0}
"""The ``ClassifierFreeGuidance`` settings flowrl samples with (the guider's defaults, which the HunyuanVideo 1.5
folders ship): guidance on at every step, ``v_neg + w (v_c - v_neg)``."""


@dataclass
class HunyuanVideo15PromptEmbeds(PromptEmbeds):
    """HunyuanVideo 1.5 prompt embeddings: Qwen2.5-VL states ``embeds (P, T, D)`` float32 (``T = max_sequence_length``,
    the template's first 108 tokens cropped, padded on the right) and their ``mask (P, T)`` long (1 for a token); ByT5
    states of the prompt's glyph text ``embeds_2 (P, G, D_2)`` float32 and their ``mask_2 (P, G)`` long (all zero
    for a prompt without text in quotes; ``G = min(256, max_sequence_length)``, :data:`GLYPH_TOKENS`); ``pooled`` is an empty ``(P, 0)``."""

    mask: torch.Tensor = None
    embeds_2: torch.Tensor = None
    mask_2: torch.Tensor = None


def per_sample(module: torch.nn.Module) -> None:
    """Make ``module`` (a convolution over ``(N, ...)``) run one sample at a time, so that a sample's output has the
    same bits at every batch size: oneDNN's ``Conv3d`` (HunyuanVideo 1.5's 1x1x1 patch embedding) gives a sample other
    last bits in a batch of 16 than in a batch of 4, which :func:`~flowrl.models.base.make_batch_invariant` (2-D linear
    layers and ``Conv2d``) does not cover; the PPO ratio before the first step would then differ from 1 by ~1e-7 in the
    tree and probe rollouts."""
    module.forward = types.MethodType(_forward_per_sample, module)  # bound to the module: a deep copy rebinds it


def _forward_per_sample(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``module``'s own forward on each sample of ``x (N, ...)``, concatenated: ``(N, ...)``."""
    return torch.cat([type(module).forward(module, x[i : i + 1]) for i in range(len(x))])


@register_family
class HunyuanVideo15Model(VideoModel):
    """A HunyuanVideo 1.5 text-to-video flow model (``HunyuanVideo15Pipeline`` folder), with :class:`FlowModel`'s
    interface.

    - Latents: ``(C, F_lat, H/s, W/s)`` per video (:attr:`latent_shape`; ``C`` the VAE's ``latent_channels``, 32),
      ``F_lat = (num_frames - 1) / 4 + 1``, ``s`` the VAE's spatial compression (16). :meth:`_forward` appends the
      text-to-video condition the stock pipeline appends: ``C`` zero image-condition channels and a zero mask channel
      (the transformer's ``in_channels`` must be ``2 C + 1``), and 729 zero image tokens.
    - Frames: ``num_frames`` (``model.num_frames``; default 121, the pipeline's) must be ``4k + 1`` (the stock pipeline
      would round it silently; flowrl refuses it). Resolution: square, a multiple of the VAE's spatial compression x
      the patch size (16 px); default the transformer's ``target_size`` (640 for 480p, 960 for 720p: the square bucket
      of the stock ``calculate_default_height_width``).
    - Prompts: the pipeline's own ``encode_prompt`` (:class:`HunyuanVideo15PromptEmbeds`): Qwen2.5-VL states of the
      chat-templated prompt padded to ``108 + max_sequence_length`` tokens (default 1000, the pipeline's
      ``tokenizer_max_length``), 108 cropped; ByT5 states of its glyph text (``"..."`` or curly quotes) padded to
      256 tokens (the pipeline's ``tokenizer_2_max_length``; :data:`GLYPH_TOKENS`), or ``max_sequence_length`` if that is
      shorter. The transformer masks both paddings out: a shorter ``max_sequence_length`` changes no video, only the
      cost (and truncates longer prompts and glyph texts).
      The empty prompt is templated as ``" "``, as the stock pipeline does.
    - CFG: the guider's ``v_neg + w (v_c - v_neg)`` (``w`` = ``sampling.guidance_scale``, standing in for the folder's
      ``guider.guidance_scale``: 6 for 480p / 720p, 1 for the CFG-distilled folders) against ``negative_prompt``
      (default ``""``: the stock ``negative_prompt=None`` encodes ``""``), then the guider's ``guidance_rescale`` if
      its config sets one (arXiv 2305.08891, Sec. 3.4; 0 in the published folders). A guider that is disabled, uses the
      original formulation or guides only part of the steps is refused (:meth:`check_guider`).
    - Schedule: the folder's ``FlowMatchEulerDiscreteScheduler`` shift (5 for 480p, 9 for 720p text-to-video), its
      steps spaced as the pipeline spaces them (``linspace(1, 0, N + 1)[:-1]`` shifted, then 0:
      :func:`samplers.flow_sigmas`' ``"flux"`` spacing): the ODE equals ``HunyuanVideo15Pipeline``'s (the
      conformance suite checks it within 1e-4).
    - Decode: as :class:`~flowrl.models.HunyuanVideoModel` (``z / scaling_factor``, the VAE, ``x / 2 + 0.5`` clamped)
      to videos ``(B, F, 3, H, W)`` float32 in [0, 1], one video per VAE call: the VAE's mid-block attention mask does
      not broadcast over a batch in diffusers 0.42 (the stock pipeline fails to decode two videos at once; diffusers PR
      #13133).
    - Batch invariance: the patch embedding (a ``Conv3d``) runs one sample at a time (:func:`per_sample`), so that a
      sample's velocity has the same bits in every batch (the PPO ratio is exactly 1 before the first step).
    - LoRA: :data:`HUNYUAN_VIDEO15_LORA_TARGETS`, saved in diffusers' format (``transformer.*`` keys with peft's
      metadata). ``HunyuanVideo15Pipeline`` has no ``load_lora_weights`` in diffusers 0.42 (diffusers issue #14420):
      load it into the stock pipeline with ``pipe.transformer.load_lora_adapter(folder, prefix="transformer",
      use_safetensors=True)``.

    Args:
        path, device, dtype, max_sequence_length, resolution: as :class:`FlowModel`.
        num_frames: frames per video (None: 121).
        expert: must be None (one transformer; the trainer passes every video family's settings).
        negative_prompt: the CFG negative prompt.

    Raises:
        FileNotFoundError, ValueError: as :class:`FlowModel`; ValueError also for a frame count the VAE cannot take
            (:meth:`check_num_frames`), an expert, a guider flowrl does not sample as the stock pipeline
            (:meth:`check_guider`) or a transformer whose channels are not the latents' plus the condition's
            (:meth:`check_channels`).
    """

    PIPELINE = "HunyuanVideo15Pipeline"
    """The diffusers pipeline class this adapter loads (``_class_name`` in ``model_index.json``)."""
    FAMILY = "HunyuanVideo 1.5"
    LORA_TARGETS = HUNYUAN_VIDEO15_LORA_TARGETS
    PROMPT_LENGTH = (1, None)
    PROMPT_RULE = "its Qwen2.5-VL tokens condition every block"
    SIGMA_SPACING = "flux"
    """``linspace(1, 1/N, N)`` before the shift: ``HunyuanVideo15Pipeline``'s ``np.linspace(1, 0, N + 1)[:-1]``."""
    DEFAULT_FRAMES = 121
    """Frames per video when none is given (``HunyuanVideo15Pipeline``'s ``num_frames``)."""
    DECODE_CHUNK = 1
    """Videos per VAE decode call: its attention does not take a batch (see the class doc)."""

    def _after_load(self) -> None:
        """The guider's ``guidance_rescale`` (:meth:`check_guider`), and the patch embedding (a ``Conv3d``) one sample at
        a time (:func:`per_sample`)."""
        self.guidance_rescale = self.check_guider(self.path)
        per_sample(self.transformer.x_embedder.proj)

    # ------------------------------------------------------------------------------ folder checks
    @staticmethod
    def _default_length(index: dict) -> int:
        """1000 Qwen tokens after the template's crop, ``HunyuanVideo15Pipeline``'s ``tokenizer_max_length``."""
        return 1000

    @classmethod
    def _resolution_grid(cls, path: Path) -> tuple[int, int, int | None, str]:
        """Default the transformer's ``target_size`` (640 px for 480p); a multiple of the VAE's spatial compression x
        the patch size (no largest side: the rotary embedding is computed for any size)."""
        vae, dit = _json(path / "vae" / "config.json"), _json(path / "transformer" / "config.json")
        factor, patch = vae.get("spatial_compression_ratio", 16), dit.get("patch_size", 1)
        unit = factor * patch
        default = max(dit.get("target_size", 640) // unit, 1) * unit
        return default, unit, None, f"VAE spatial compression {factor} x patch size {patch}"

    @classmethod
    def check_num_frames(cls, path: str | Path, num_frames: int | None) -> int:
        """The frames per video the folder ``path`` draws: ``num_frames`` checked, or 121 (no weights loaded), by
        HunyuanVideo's rule (:meth:`HunyuanVideoModel.check_num_frames`: the VAE's ``temporal_compression_ratio`` and
        the transformer's ``patch_size_t``, both in HunyuanVideo 1.5's configs).

        Raises:
            FileNotFoundError: if ``path`` is not a pipeline folder.
            ValueError: naming the folder, unless ``num_frames = 4k + 1 >= 1``.
        """
        return HunyuanVideoModel.check_num_frames.__func__(cls, path, num_frames)

    @classmethod
    def check_folder(cls, path: Path) -> None:
        """The folder's guider and transformer channels (:meth:`check_guider`, :meth:`check_channels`).

        Raises:
            FileNotFoundError, ValueError: as those.
        """
        cls.check_guider(path)
        cls.check_channels(path)

    @classmethod
    def check_guider(cls, path: str | Path) -> float:
        """The ``guidance_rescale`` of the folder's guider (``guider/guider_config.json``), after checking that flowrl
        samples as it does: a ``ClassifierFreeGuidance`` enabled at every step with the diffusers formulation
        (:data:`GUIDER_DEFAULTS`). No weights load.

        Raises:
            FileNotFoundError: if ``path`` is not a pipeline folder or has no guider config.
            ValueError: naming the file and the setting, for another guider or settings.
        """
        file = _pipeline_folder(path) / "guider" / "guider_config.json"
        if not file.is_file():
            raise FileNotFoundError(
                f"{file} not found: {cls.PIPELINE} guides with its guider component (ClassifierFreeGuidance)"
            )
        cfg = _json(file)
        if cfg.get("_class_name") != "ClassifierFreeGuidance":
            raise ValueError(f"{file} is a {cfg.get('_class_name')!r}; flowrl samples with ClassifierFreeGuidance")
        for key, value in GUIDER_DEFAULTS.items():
            if cfg.get(key, value) != value:
                raise ValueError(
                    f"{file} sets {key} {cfg[key]!r}; flowrl guides as ClassifierFreeGuidance's default {key} "
                    f"{value!r} (w = sampling.guidance_scale at every step, 1 = off)"
                )
        return check_fraction(cfg.get("guidance_rescale", 0.0), f"{file}: guidance_rescale", "0")

    @classmethod
    def check_channels(cls, path: str | Path) -> None:
        """Refuse a transformer whose ``in_channels`` is not ``2 C + 1`` or ``out_channels`` not ``C`` (``C`` the VAE's
        ``latent_channels``): the latents, the image-condition latents and their mask, as the stock pipeline stacks
        them (no weights loaded).

        Raises:
            FileNotFoundError: if ``path`` is not a pipeline folder.
            ValueError: naming the folder and the channel counts.
        """
        path = _pipeline_folder(path)
        latent = _json(path / "vae" / "config.json").get("latent_channels", 32)
        dit = _json(path / "transformer" / "config.json")
        if (dit.get("in_channels"), dit.get("out_channels")) != (2 * latent + 1, latent):
            raise ValueError(
                f"{path / 'transformer'} takes {dit.get('in_channels')} channels and predicts "
                f"{dit.get('out_channels')}; {cls.PIPELINE} stacks the VAE's {latent} latent channels, "
                f"{latent} image-condition channels and a mask: expected {2 * latent + 1} in, {latent} out"
            )

    # ------------------------------------------------------------------------------ the model
    @property
    def latent_shape(self) -> tuple[int, int, int, int]:
        """``(C, F_lat, H, W)`` of one video's latents: ``C`` the VAE's latent channels and :attr:`video_grid`."""
        return (self.pipe.num_channels_latents, *self.video_grid)

    decode = HunyuanVideoModel.decode  # z / scaling_factor, the VAE, x / 2 + 0.5: the same arithmetic

    @torch.no_grad()
    def encode(self, prompts: list[str]) -> HunyuanVideo15PromptEmbeds:
        """Encode prompts with ``HunyuanVideo15Pipeline.encode_prompt`` at ``max_sequence_length`` Qwen tokens (the
        pipeline's ``tokenizer_max_length``, set here) and at most as many ByT5 glyph tokens (its
        ``tokenizer_2_max_length``, :data:`GLYPH_TOKENS`): :class:`HunyuanVideo15PromptEmbeds`."""
        pipe = self.pipe
        pipe.tokenizer_max_length = self.max_sequence_length  # an attribute of the pipeline, not an argument
        pipe.tokenizer_2_max_length = min(GLYPH_TOKENS, self.max_sequence_length)  # likewise
        embeds, mask, embeds_2, mask_2 = pipe.encode_prompt(list(prompts), device=self.device, batch_size=len(prompts))
        empty = embeds.new_zeros(len(prompts), 0).float()  # (P, 0): no pooled embedding
        return HunyuanVideo15PromptEmbeds(embeds.float(), empty, mask.long(), embeds_2.float(), mask_2.long())

    def _forward(self, x, t, cond: HunyuanVideo15PromptEmbeds, dtype) -> torch.Tensor:
        """One transformer call on ``x (N, C, F, H, W)`` at times ``t (N,)``, as ``HunyuanVideo15Pipeline`` makes it
        for text-to-video: the latents followed by ``C + 1`` zero channels (image-condition latents and mask), 729 zero
        image tokens (:meth:`_call`); returns ``(N, C, F, H, W)``."""
        n, c, f, h, w = x.shape
        pipe = self.pipe
        condition = x.new_zeros(n, c + 1, f, h, w)  # (N, C + 1, F, H, W): cond_latents_concat, mask_concat
        image = x.new_zeros(n, pipe.vision_num_semantic_tokens, pipe.vision_states_dim)  # (N, 729, D_img)
        return self._call(x, t, cond, condition, image, dtype)

    def _call(self, x, t, cond: HunyuanVideo15PromptEmbeds, condition, image, dtype) -> torch.Tensor:
        """The transformer on ``hidden_states = cat[x, condition]`` (``x (N, C, F, H, W)``, ``condition (N, C + 1, F,
        H, W)``: image-condition latents and mask), the image tokens ``image (N, T_img, D_img)``, timestep ``1000 t``
        (``t (N,)``) and both prompt embeddings of ``cond`` with their masks, inputs cast to ``dtype``; returns ``(N,
        C, F, H, W)``."""
        return self.network()(
            hidden_states=torch.cat([x, condition.to(x.dtype)], dim=1).to(dtype),  # (N, 2C + 1, F, H, W)
            image_embeds=image.to(dtype),
            timestep=(t.float() * 1000).to(dtype),
            encoder_hidden_states=cond.embeds.to(dtype),
            encoder_attention_mask=cond.mask.to(dtype),
            encoder_hidden_states_2=cond.embeds_2.to(dtype),
            encoder_attention_mask_2=cond.mask_2.to(dtype),
            return_dict=False,
        )[0]

    # ------------------------------------------------------------------------------ LoRA files
    def save_lora(self, directory: str | Path, weights: dict[str, torch.Tensor] | None = None) -> None:
        """Write the transformer LoRA in diffusers' format (``pytorch_lora_weights.safetensors``, keys
        ``transformer.*`` with peft's metadata, by the transformer-only writer of ``HunyuanVideoLoraLoaderMixin``);
        ``weights``: as :meth:`FlowModel.lora_state`. The stock pipeline loads it with
        ``pipe.transformer.load_lora_adapter(directory, prefix="transformer", use_safetensors=True)``."""
        from diffusers.loaders import HunyuanVideoLoraLoaderMixin

        state = self.lora_state(weights)
        metadata = self.transformer.peft_config["default"].to_dict()  # carries lora_alpha: without it alpha = rank
        HunyuanVideoLoraLoaderMixin.save_lora_weights(
            directory, transformer_lora_layers=state, transformer_lora_adapter_metadata=metadata
        )

    def load_lora(self, directory: str | Path, adapter_name: str | None = None) -> None:
        """:meth:`FlowModel.load_lora` through the transformer's ``load_lora_adapter(directory, prefix="transformer",
        use_safetensors=True)`` (``HunyuanVideo15Pipeline`` has no ``load_lora_weights``)."""
        self.pipe.load_lora_weights = lambda folder, **kwargs: self.transformer.load_lora_adapter(
            folder, prefix="transformer", **kwargs
        )
        try:
            super().load_lora(directory, adapter_name)
        finally:
            del self.pipe.load_lora_weights


@dataclass
class HunyuanVideo15I2VPromptEmbeds(HunyuanVideo15PromptEmbeds):
    """:class:`HunyuanVideo15PromptEmbeds` with each row's source image:

    - ``condition (P, C + 1, F_lat, h, w)`` float32: the source's VAE latents (the mode, times ``scaling_factor``) in
      latent frame 0 and zeros after, then a mask channel (1 over frame 0, 0 elsewhere), as
      ``HunyuanVideo15ImageToVideoPipeline.prepare_cond_latents_and_mask`` returns them (``cond_latents_concat``,
      ``mask_concat``);
    - ``image (P, T_img, D_img)`` float32: the source's SigLIP tokens (the image encoder's last hidden states, 729 x
      1152 for the published folders), the pipeline's ``image_embeds``.

    Row 0 (the CFG negative's text) holds zeros: the negative takes the source of the row it guides.
    """

    condition: torch.Tensor = None
    image: torch.Tensor = None

    SHARED = ("condition", "image")
    """Under CFG the negative sees the row's source, as the stock pipeline gives both predictions the same image."""


@register_family
class HunyuanVideo15ImageToVideoModel(HunyuanVideo15Model):
    """A HunyuanVideo 1.5 image-to-video flow model (``HunyuanVideo15ImageToVideoPipeline`` folder: 480p_i2v, 720p_i2v
    or a small one): :class:`HunyuanVideo15Model` (latents, frames, prompts, the guider's CFG, negative prompt,
    schedule, decoding, LoRA) plus a source image per prompt, the video's first frame.

    - Source: a prompt record's ``image`` key, a path relative to the prompt file (:func:`flowrl.data.read_jsonl` makes
      it absolute; the rewards receive the record as metadata), as :class:`~flowrl.models.WanImageToVideoModel` reads
      it; a record without one starts from a blank mid-gray frame (:data:`flowrl.models.wan_i2v.BLANK_SOURCE`; the
      stock pipeline needs an image and reproduces this given that frame): what ``flowrl sample --prompt`` draws.
    - :meth:`encode_images` resizes the source to the square :attr:`resolution` with the pipeline's
      ``video_processor.resize(..., resize_mode="crop")`` (scaled to cover, centre-cropped), builds the condition with
      the pipeline's own ``prepare_cond_latents_and_mask`` and the SigLIP tokens with its ``encode_image``. The stock
      pipeline sizes its video by the source's aspect ratio (the ``target_size`` bucket nearest it); for a square
      source and ``target_size = resolution`` that is :attr:`resolution` square, flowrl's only shape: a source of
      another aspect ratio is centre-cropped to a square where the stock pipeline would draw an oblong video.
    - :meth:`_forward` gives the transformer ``cat[x, condition]`` (``2 C + 1`` channels) and the image tokens; under
      CFG the negative sees the same source (:attr:`HunyuanVideo15I2VPromptEmbeds.SHARED`), as the stock pipeline. A row
      without a source (the probe of :func:`~flowrl.models.base.make_batch_invariant`) is drawn as text-to-video
      (zero condition, 729 zero image tokens). The transformer masks the image tokens out only when every row's are
      zero, so rows with and without a source run one transformer call each (a row's velocity does not depend on
      its batch).
    - The MeanFlow step-distilled transformers (``use_meanflow``: the stock image-to-video pipeline also passes the
      next step's time) are refused (:meth:`check_layout`).

    Args:
        path, device, dtype, max_sequence_length, resolution, num_frames, expert, negative_prompt: as
            :class:`HunyuanVideo15Model`.

    Raises:
        FileNotFoundError, ValueError: as :class:`HunyuanVideo15Model`; ValueError also for a folder this adapter
            cannot run (:meth:`check_layout`) and, from :meth:`prompt_table`, a source that is not an image.
    """

    PIPELINE = "HunyuanVideo15ImageToVideoPipeline"
    """The diffusers pipeline class this adapter loads (``_class_name`` in ``model_index.json``)."""
    TEXT_ONLY = False
    SOURCE_REQUIRED = True

    # ------------------------------------------------------------------------------ folder checks
    @classmethod
    def check_folder(cls, path: Path) -> None:
        """:meth:`HunyuanVideo15Model.check_folder` and :meth:`check_layout`.

        Raises:
            FileNotFoundError, ValueError: as those.
        """
        super().check_folder(path)
        cls.check_layout(path)

    @classmethod
    def check_layout(cls, path: str | Path) -> None:
        """Check that the folder ``path`` has the SigLIP image encoder and its processor and a transformer sampled
        without the next step's time (no weights loaded).

        Raises:
            FileNotFoundError: if ``path`` is not a pipeline folder.
            ValueError: naming the folder, for a missing ``image_encoder`` / ``feature_extractor`` or a transformer
                with ``use_meanflow`` (the step-distilled folders).
        """
        path = _pipeline_folder(path)
        index = _model_index(path)
        missing = [name for name in ("image_encoder", "feature_extractor") if _absent(index, name)]
        if missing:
            raise ValueError(
                f"{path} has no {' or '.join(missing)}: {cls.PIPELINE} encodes the source image with SigLIP "
                "(image_encoder and its feature_extractor)"
            )
        if _json(path / "transformer" / "config.json").get("use_meanflow"):
            raise ValueError(
                f"{path / 'transformer'} sets use_meanflow (a step-distilled transformer that also takes the next "
                "step's time): not built in flowrl; load a 480p_i2v / 720p_i2v or CFG-distilled folder"
            )

    # ------------------------------------------------------------------------------ the sources
    read_source = WanImageToVideoModel.read_source  # the RGB image at a path, or the blank frame

    @torch.no_grad()
    def encode_images(self, images: list) -> tuple[torch.Tensor, torch.Tensor]:
        """Source images (``PIL.Image``) as the transformer's condition, one pipeline call each (as the stock pipeline
        encodes its one image): ``(condition (S, C + 1, F_lat, h, w), image (S, T_img, D_img))`` float32 on the model's
        device (:class:`HunyuanVideo15I2VPromptEmbeds`)."""
        pipe, side = self.pipe, self.resolution
        conditions, tokens = [], []
        for source in images:
            source = pipe.video_processor.resize(source, height=side, width=side, resize_mode="crop")  # side x side
            zeros = torch.zeros(1, *self.latent_shape, device=self.device)  # the latents' shape, not their values
            latents, mask = pipe.prepare_cond_latents_and_mask(
                zeros, source, 1, side, side, torch.float32, self.device
            )  # (1, C, F_lat, h, w), (1, 1, F_lat, h, w)
            conditions.append(torch.cat([latents, mask], dim=1).float())  # (1, C + 1, F_lat, h, w)
            tokens.append(pipe.encode_image(source, 1, self.device, torch.float32).float())  # (1, T_img, D_img)
        return torch.cat(conditions), torch.cat(tokens)

    def prompt_table(self, metas: list[dict]) -> HunyuanVideo15I2VPromptEmbeds:
        """:meth:`FlowModel.prompt_table` with each record's source (:func:`~flowrl.models.wan_i2v.source_rows`: row 0,
        the negative's text, gets zeros); ``P + 1`` rows of :class:`HunyuanVideo15I2VPromptEmbeds`.

        Raises:
            ValueError: naming the file, for a source that cannot be read as an image.
            KeyError: for a record without ``prompt`` (the prompt files are checked when read, :mod:`flowrl.data`).
        """
        table = self.encode([""] + [m["prompt"] for m in metas])
        condition, image = source_rows(self, metas)  # (P + 1, C + 1, F_lat, h, w), (P + 1, T_img, D_img)
        text = {f: getattr(table, f) for f in table.text_fields()}
        return HunyuanVideo15I2VPromptEmbeds(**text, condition=condition, image=image)

    def _forward(self, x, t, cond: HunyuanVideo15PromptEmbeds, dtype) -> torch.Tensor:
        """One transformer call on ``x (N, C, F, H, W)`` at times ``t (N,)``, as ``HunyuanVideo15ImageToVideoPipeline``
        makes it: ``cat[x, condition]`` and the SigLIP tokens of ``cond`` (:class:`HunyuanVideo15I2VPromptEmbeds`);
        returns ``(N, C, F, H, W)``. Rows without a source (a plain :class:`HunyuanVideo15PromptEmbeds`, or zero image
        tokens) run as text-to-video, in a call of their own when the batch mixes both."""
        if getattr(cond, "condition", None) is None:
            return super()._forward(x, t, cond, dtype)  # text-to-video: zero condition and image tokens
        blank = (cond.image == 0).flatten(1).all(dim=1)  # (N,) rows whose image tokens the transformer masks out
        if blank.any() and not blank.all():  # it masks them only when every row's are zero: one call per kind
            groups = [blank.nonzero()[:, 0], (~blank).nonzero()[:, 0]]  # (N_0,), (N_1,) row indices
            out = torch.cat([self._forward(x[i], t[i], cond[i], dtype) for i in groups])  # (N, C, F, H, W) grouped
            return out[torch.cat(groups).argsort()]  # (N, C, F, H, W) in row order
        return self._call(x, t, cond, cond.condition, cond.image, dtype)
