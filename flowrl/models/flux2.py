"""The FLUX.2 family: Black Forest Labs' FLUX.2 [dev] (``Flux2Pipeline``: a Mistral Small 3.1 text encoder,
guidance-distilled) and FLUX.2 [klein] 4B / 9B (``Flux2KleinPipeline``: a Qwen3 text encoder, step-distilled) with
their base models, and small ones. Text-to-image, and conditioned on reference images (the pipelines' ``image=``) named
by a prompt record's ``image`` or ``images``.

Reference implementation (no paper): diffusers ``pipelines/flux2/pipeline_flux2.py`` (``Flux2Pipeline``,
``compute_empirical_mu``), ``pipelines/flux2/pipeline_flux2_klein.py`` (``Flux2KleinPipeline``, the same latents,
positions and schedule), ``models/transformers/transformer_flux2.py`` (``Flux2Transformer2DModel``: dual- then
single-stream blocks, 4-axis rotary positions) and ``models/autoencoders/autoencoder_kl_flux2.py``
(``AutoencoderKLFlux2``, whose batch norm normalises the 2x2-patchified latents); the adapters call them.
Notation (code -> pipeline): ``t`` (flowrl's time, 1 = noise) -> the scheduler's sigma and the transformer's
``timestep / 1000``; latents ``(C', h, w)`` -> the pipeline's ``latents`` before ``_pack_latents`` (``C'`` = 4 x the
VAE's latent channels, ``h = w`` = resolution / (2 x VAE factor)); ``w`` -> ``guidance_scale`` (the same convention:
the transformer's ``guidance`` input for [dev], the CFG scale for a klein base model); a record's reference images ->
``image=`` (``image_latents`` / ``image_latent_ids`` of ``prepare_image_latents`` -> :class:`Flux2PromptEmbeds`'
``image`` / ``image_ids``); ``reference_resolution ** 2`` -> the pipelines' ``1024 * 1024`` cap on a reference's area.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from ..fields import ConfigError
from ..files import resolve_path
from .base import (
    JOINT_ATTENTION_TARGETS,
    FlowModel,
    PromptEmbeds,
    _config_shift,
    _model_index,
    _scheduler_file,
    _vae_factor,
    register_family,
)

FLUX2_LORA_TARGETS = JOINT_ATTENTION_TARGETS + (
    "ff.linear_in",
    "ff.linear_out",
    "ff_context.linear_in",
    "ff_context.linear_out",
    "attn.to_qkv_mlp_proj",
)
"""LoRA targets for FLUX.2 transformers, Flow-Factory's defaults for FLUX.2 and FLUX.2 klein
(``src/flow_factory/models/flux/flux2.py`` and ``flux2_klein.py``, ``default_target_modules``; diffusers' ``Flux2Transformer2DModel``
names): both streams' attention and SwiGLU feed-forward layers of the dual-stream blocks, and the fused
QKV + MLP input projection of the single-stream blocks (their output projection ``attn.to_out``, a plain linear
layer, is not adapted, as in Flow-Factory)."""

DEFAULT_SAMPLE_SIZE = 128
"""Latents per image side when no resolution is given (both pipelines' ``default_sample_size``: 1024 px)."""

DEFAULT_REFERENCE_RESOLUTION = 1024
"""The side of the square whose area caps a reference image when ``reference_resolution`` is not given: the pipelines'
``1024 * 1024`` (a larger reference is shrunk to that area, a smaller one keeps its size)."""

MIN_REFERENCE_SIDE = 64
"""The shortest side in px a reference image may have (``Flux2ImageProcessor.check_image_input``'s
``min_side_length``), and so the smallest ``reference_resolution``."""

DEFAULT_STEPS = {True: 4, False: 50}
"""Steps :meth:`Flux2Model.scheduler_shift` assumes (the pipelines' shift depends on the step count): 4 for a
step-distilled klein (BFL's setting), 50 for [dev] and a klein base model (the pipelines' ``num_inference_steps``)."""


def _empirical_shift(cfg: dict, where: str | Path, image_tokens: int, num_steps: int) -> float:
    """The static shift equal to the FLUX.2 pipelines' schedule: ``exp(mu)`` with ``mu =
    compute_empirical_mu(image_tokens, num_steps)`` for a dynamically (exponentially) shifting scheduler config,
    else the config's own ``shift`` (the scheduler then ignores ``mu``).

    Raises:
        ValueError: naming ``where``, for a linear time shift (no static equivalent) or a shift that is not > 0.
    """
    if not cfg.get("use_dynamic_shifting"):
        return _config_shift(cfg, where)
    if cfg.get("time_shift_type", "exponential") != "exponential":
        raise ValueError(f"{where} has time_shift_type {cfg['time_shift_type']!r}; flowrl supports 'exponential'")
    from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu

    return math.exp(compute_empirical_mu(image_seq_len=image_tokens, num_steps=num_steps))


@dataclass
class Flux2PromptEmbeds(PromptEmbeds):
    """FLUX.2 prompt embeddings (``embeds (P, L, 3 D)``, an empty ``pooled (P, 0)``) with each row's reference images:

    - ``image (P, R, C')`` float32: the references' VAE latents, normalised and packed into tokens (the pipeline's
      ``image_latents``), one reference after the other, zero-padded to the table's most tokens ``R``;
    - ``image_ids (P, R, 4)`` long: their position ids (the pipeline's ``image_latent_ids``: ``(10 + 10 k, row, col,
      0)`` for reference ``k``), -1 on the padding; a row without references is all -1.
    """

    image: torch.Tensor = None
    image_ids: torch.Tensor = None

    SHARED = ("image", "image_ids")
    """A klein base model's CFG negative sees the row's references, as ``Flux2KleinPipeline``'s."""


def reference_paths(meta: dict) -> list[str]:
    """The reference images a prompt record names: ``[meta["image"]]``, ``meta["images"]`` (a list, several references
    in order) or ``[]`` (text-to-image).

    Raises:
        ValueError: naming the prompt, for a record with both keys, or ``images`` not a non-empty list of strings.
    """
    if "image" in meta and "images" in meta:
        raise ValueError(
            f"prompt record {meta['prompt']!r} names reference images in both 'image' and 'images'; use 'image' for "
            "one, 'images' for a list"
        )
    if "images" not in meta:
        return [meta["image"]] if "image" in meta else []
    paths = meta["images"]
    if not isinstance(paths, list) or not paths or not all(isinstance(p, str) for p in paths):
        raise ValueError(
            f"prompt record {meta['prompt']!r}: 'images' must be a non-empty list of paths, got {paths!r}"
        )
    return paths


@register_family
class Flux2Model(FlowModel):
    """A FLUX.2 [dev] flow model (``Flux2Pipeline`` folder) drawing from text, or from text and reference images, with
    :class:`FlowModel`'s interface; the samplers and the trainer see no difference. :class:`Flux2KleinModel` is the same model with klein's text encoder
    and guidance.

    What the adapter does differently, all inside it:

    - Latents are the pipeline's patchified ones, ``(C', h, w)`` with ``C'`` the transformer's ``in_channels`` (128:
      32 VAE channels x 2x2 patches), normalised by the VAE's batch-norm statistics; :meth:`_forward` flattens them
      to ``h * w`` tokens (``_pack_latents``) with the pipeline's 4-axis position ids (``_prepare_latent_ids``:
      ``(0, row, col, 0)``; the text's ``(0, 0, 0, l)``).
    - Prompts: ``Flux2Pipeline.encode_prompt``: the prompt after BFL's system message in the Mistral processor's chat
      template, padded to ``max_sequence_length`` tokens (default 512, as the pipeline), the hidden states of the
      layers :attr:`TEXT_LAYERS` (10, 20, 30) of the Mistral 3 text encoder concatenated per token: ``(P, L, 3 D)``.
      No mask: the transformer attends to the padding as in the stock pipeline. No pooled embedding (``(P, 0)``).
    - Guidance: [dev] is guidance-distilled (``guidance_embeds``): the scale is the transformer's ``guidance`` input,
      one forward per sample (:meth:`cfg_rows` 1, the empty prompt unused), as ``Flux2Pipeline(guidance_scale=w)``
      (default 4). A ``Flux2Pipeline`` transformer without a guidance embedding ignores the scale in the stock
      pipeline; flowrl refuses a scale other than 1 for it (:meth:`cfg_scale`).
    - Schedule: ``linspace(1, 1/N, N)`` shifted by ``exp(mu)``, ``mu = compute_empirical_mu(image tokens, N)``: the
      shift depends on the step count (:meth:`sigmas` with ``shift=None`` gives the stock schedule at every ``N``;
      :meth:`scheduler_shift`, which a config fills ``sampling.shift`` with, assumes :data:`DEFAULT_STEPS`).
    - Decoding: ``z * sqrt(bn.running_var + eps) + bn.running_mean``, the 2x2 patches unfolded, the VAE
      (:meth:`decode`); no scaling or shift factor. The offline and direct-reward methods, which need the inverse,
      are not built for this family.
    - Resolution: any multiple of 2 x the VAE factor (16 px; the rotary embedding has no largest size); default
      1024 px.
    - Reference images: a prompt record's ``image`` (one path) or ``images`` (a list of paths, in order), relative to
      the prompt file (:func:`flowrl.data.read_jsonl` makes them absolute; the rewards receive the same record as
      metadata), are what ``Flux2Pipeline(image=[...])`` conditions on. :meth:`prompt_table` reads each (RGB), checks
      it as the pipeline does (``check_image_input``: sides >= 64 px, aspect ratio <= 8), shrinks one of more than
      ``reference_resolution ** 2`` px to that area (the pipelines' cap is 1024 * 1024; Lanczos), crops it to
      multiples of 2 x the VAE factor about its centre and encodes it by the VAE's mode, normalised and packed
      (:meth:`encode_images`, the pipeline's ``_encode_vae_image``); a reference keeps its own size, whatever the
      output's. :meth:`_forward` appends the references' tokens after the noisy latents' with the pipeline's position
      ids (reference ``k`` at first coordinate ``10 + 10 k``) and keeps the prediction of the noisy tokens only; a
      klein base model's CFG negative sees the same references, as the pipeline's. Rows whose references differ in
      number or size run in one transformer call each (the rotary embedding takes one set of ids per call). A record
      without references is drawn text-to-image; a table without any is the plain :class:`PromptEmbeds` of the
      text-to-image adapter, which it samples exactly as before.

    Args:
        path, device, dtype, max_sequence_length, resolution: as :class:`FlowModel`.
        reference_resolution: the side in px of the square whose area caps each reference image: None for the
            pipelines' 1024 (:data:`DEFAULT_REFERENCE_RESOLUTION`); Flow-Factory's FLUX.2 edit recipes train with 384.
            ``model.options.reference_resolution`` in a config.

    Raises:
        FileNotFoundError, ValueError: as :class:`FlowModel`; ValueError also for ``max_sequence_length < 1`` and a
            ``reference_resolution`` that is not an integer >= 64.
    """

    PIPELINE = "Flux2Pipeline"
    FAMILY = "FLUX.2"
    OPTIONS = ("reference_resolution",)
    reference_resolution = DEFAULT_REFERENCE_RESOLUTION
    """The side of the square whose area caps each reference image (:meth:`check_reference_resolution`)."""
    LORA_TARGETS = FLUX2_LORA_TARGETS
    SIGMA_SPACING = "flux"
    """The pipelines' ``linspace(1, 1/N, N)`` before the shift."""
    SHIFT_TERMINAL = True
    PROMPT_LENGTH = (1, None)
    PROMPT_RULE = "its text tokens"
    TEXT_ONLY = False
    """A prompt record may name reference images."""
    TEXT_LAYERS = (10, 20, 30)
    """The text encoder's hidden states the pipeline concatenates (its ``text_encoder_out_layers`` default)."""

    @staticmethod
    def check_reference_resolution(value) -> int:
        """``reference_resolution`` as an int: None is :data:`DEFAULT_REFERENCE_RESOLUTION`.

        Raises:
            ValueError: for anything but an integer >= :data:`MIN_REFERENCE_SIDE` (64).
        """
        if value is None:
            return DEFAULT_REFERENCE_RESOLUTION
        if isinstance(value, bool) or not isinstance(value, int) or value < MIN_REFERENCE_SIDE:
            raise ValueError(
                f"reference_resolution must be an integer number of pixels >= {MIN_REFERENCE_SIDE} (the side of the "
                f"square whose area caps a reference image; 1024 in the stock pipelines), got {value!r}"
            )
        return value

    @staticmethod
    def _default_length(index: dict) -> int:
        return 512  # the FLUX.2 pipelines' max_sequence_length

    @classmethod
    def _resolution_grid(cls, path: Path) -> tuple[int, int, int | None, str]:
        """Default :data:`DEFAULT_SAMPLE_SIZE` latents a side; any multiple of the VAE factor x 2."""
        factor = _vae_factor(path)
        return DEFAULT_SAMPLE_SIZE * factor, 2 * factor, None, f"VAE factor {factor} x FLUX.2's 2x2 latent patches"

    @staticmethod
    def distilled(path: str | Path) -> bool:
        """Whether the folder's ``model_index.json`` marks the model step-distilled (``is_distilled``: klein 4B / 9B,
        no CFG; [dev] has no such key).

        Raises:
            FileNotFoundError: if ``path`` is not a pipeline folder.
        """
        return bool(_model_index(path).get("is_distilled", False))

    @classmethod
    def scheduler_shift(cls, path: str | Path, resolution: int | None = None) -> float:
        """The static shift equal to the stock schedule at ``resolution`` px (default: :meth:`check_resolution`'s) and
        :data:`DEFAULT_STEPS` steps (4 for a distilled folder, 50 for a base one), read without loading weights
        (:func:`_empirical_shift`): about 9.9 at 4 steps and 7.6 at 50 steps at 1024 px.

        Raises:
            FileNotFoundError: if ``path`` is not a pipeline folder or has no scheduler config.
            ValueError: for a resolution the model cannot take, or a scheduler :func:`_empirical_shift` refuses.
        """
        file = _scheduler_file(path)
        side = cls.check_resolution(path, resolution) // (2 * _vae_factor(Path(path)))
        steps = DEFAULT_STEPS[cls.distilled(path)]
        return _empirical_shift(json.loads(file.read_text()), file, side * side, steps)

    @property
    def shift(self) -> float:
        """:meth:`scheduler_shift` of the loaded scheduler at the model's :attr:`resolution`."""
        return self._shift(DEFAULT_STEPS[self.is_distilled])

    @property
    def is_distilled(self) -> bool:
        """Whether the loaded pipeline is step-distilled (its config's ``is_distilled``: no CFG)."""
        return bool(self.pipe.config.get("is_distilled", False))

    def _shift(self, num_steps: int) -> float:
        side = self.latent_shape[-1]
        config = dict(self.pipe.scheduler.config)
        return _empirical_shift(config, Path(self.path) / "scheduler", side * side, num_steps)

    def sigmas(self, num_steps: int, shift: float | None = None) -> torch.Tensor:
        """The sigma schedule ``(num_steps + 1,)`` float32 (CPU) from 1 to 0: ``linspace(1, 1/N, N)`` shifted by
        ``shift`` (None: the stock pipeline's ``exp(mu)`` at ``num_steps``), stretched to the scheduler's
        ``shift_terminal`` when it has one, then 0.

        Raises:
            ValueError: as :func:`samplers.flow_sigmas`.
        """
        return super().sigmas(num_steps, self._shift(num_steps) if shift is None else shift)

    @property
    def latent_shape(self) -> tuple[int, int, int]:
        """``(C', h, w)``: the transformer's ``in_channels`` (4 x the VAE's latent channels), ``h = w = resolution /
        (2 vae_scale_factor)``."""
        side = self.resolution // (2 * self.pipe.vae_scale_factor)
        return (self.transformer.config.in_channels, side, side)

    @torch.no_grad()
    def encode(self, prompts: list[str]) -> PromptEmbeds:
        """Encode prompts with the pipeline's ``encode_prompt``: ``embeds (P, max_sequence_length, 3 D)`` float32
        (the text encoder's layers :attr:`TEXT_LAYERS`, padding included) and an empty ``pooled (P, 0)``."""
        embeds, _ = self.pipe.encode_prompt(
            list(prompts),
            device=self.device,
            max_sequence_length=self.max_sequence_length,
            text_encoder_out_layers=self.TEXT_LAYERS,
        )  # (P, L, 3 D)
        return PromptEmbeds(embeds.float(), embeds.new_zeros(len(prompts), 0).float())

    def prompt_table(self, metas: list[dict]) -> PromptEmbeds:
        """:meth:`FlowModel.prompt_table` with each record's reference images (:func:`reference_paths`; row 0, the
        empty prompt, has none): :class:`Flux2PromptEmbeds` when a record names one, else the text-only table. Each
        distinct image is read and encoded once.

        Raises:
            ValueError: as :func:`reference_paths` and :meth:`read_reference`.
        """
        paths = [[]] + [reference_paths(m) for m in metas]
        distinct = list(dict.fromkeys(p for row in paths for p in row))  # read first: a bad file fails fast
        latents = dict(zip(distinct, self.encode_images(distinct))) if distinct else {}  # path -> (1, C', h, w)
        table = self.encode([""] + [m["prompt"] for m in metas])
        if not distinct:
            return table  # text-to-image: the table the adapter always built
        pipe, rows = self.pipe, []
        for row in paths:
            refs = [latents[p] for p in row]
            tokens = [pipe._pack_latents(z)[0] for z in refs]  # each (h * w, C')
            ids = pipe._prepare_image_ids(refs)[0] if refs else torch.zeros(0, 4, dtype=torch.long)  # (R_i, 4)
            rows.append((torch.cat(tokens) if refs else None, ids.to(self.device)))
        length, c = max(ids.shape[0] for _, ids in rows), self.latent_shape[0]
        image = torch.zeros(len(rows), length, c, device=self.device)  # (P, R, C')
        image_ids = torch.full((len(rows), length, 4), -1, dtype=torch.long, device=self.device)  # (P, R, 4)
        for i, (tokens, ids) in enumerate(rows):
            if tokens is not None:
                image[i, : len(ids)], image_ids[i, : len(ids)] = tokens, ids
        return Flux2PromptEmbeds(table.embeds, table.pooled, image, image_ids)

    def read_reference(self, path: str) -> torch.Tensor:
        """The reference image at ``path`` as the pipeline prepares it: pixels ``(1, 3, H, W)`` float32 in [-1, 1],
        ``H, W`` its size shrunk to at most ``reference_resolution ** 2`` px of area (its aspect ratio kept, Lanczos),
        then cropped about the centre to multiples of 2 x the VAE factor.

        Raises:
            ValueError: naming the file, for a file that cannot be read as an image, or one the pipeline refuses
                (a side under 64 px, an aspect ratio over 8).
        """
        from PIL import Image, UnidentifiedImageError

        try:
            with Image.open(path) as picture:
                image = picture.convert("RGB")
        except (OSError, UnidentifiedImageError) as e:
            raise ValueError(f"reference image {path} cannot be read as an image ({type(e).__name__})") from None
        processor = self.pipe.image_processor
        try:
            processor.check_image_input(image)
        except ValueError as e:
            raise ValueError(f"reference image {path}: {e} (as {self.PIPELINE} requires)") from None
        area = self.reference_resolution**2
        if image.width * image.height > area:
            image = processor._resize_to_target_area(image, area)
        multiple = 2 * self.pipe.vae_scale_factor
        width, height = image.width // multiple * multiple, image.height // multiple * multiple
        return processor.preprocess(image, height=height, width=width, resize_mode="crop")  # (1, 3, H, W)

    @torch.no_grad()
    def encode_images(self, paths: list[str]) -> list[torch.Tensor]:
        """Reference images as the transformer's condition: for each path, its VAE latents ``(1, C', h, w)`` float32
        on the model's device (:meth:`read_reference`, then the pipeline's ``_encode_vae_image``: the VAE's mode,
        2x2-patchified, normalised by the batch-norm statistics), ``h, w`` its size over 2 x the VAE factor. One VAE
        call per image, as the pipeline's ``prepare_image_latents``.

        Raises:
            ValueError: as :meth:`read_reference`.
        """
        vae = self.pipe.vae
        out = []
        for path in paths:
            pixels = self.read_reference(path).to(self.device, vae.dtype)
            out.append(self.pipe._encode_vae_image(pixels, generator=None).float())  # (1, C', h, w)
        return out

    @property
    def guidance_embeds(self) -> bool:
        """Whether the transformer takes the guidance scale as an input (FLUX.2 [dev]'s ``guidance_embeds``)."""
        return bool(self.transformer.config.guidance_embeds)

    def cfg_scale(self, guidance_scale: float) -> float:
        """1: the guidance scale is the transformer's input (:meth:`embedded_guidance`; ``uncond`` unused, one row per
        sample).

        Raises:
            ValueError: if ``guidance_scale`` is outside [1, 100], or not 1 for a transformer without a guidance
                embedding (the stock pipeline would ignore it).
        """
        super().cfg_scale(guidance_scale)
        if not self.guidance_embeds and guidance_scale != 1.0:
            raise ValueError(
                f"guidance_scale {guidance_scale}: the transformer of {self.path} has no guidance embedding "
                "(guidance_embeds false), so Flux2Pipeline ignores the scale; use guidance_scale 1.0"
            )
        return 1.0

    def embedded_guidance(self, guidance_scale: float) -> dict:
        """``{"guidance": w}`` for a transformer with a guidance embedding (``Flux2Pipeline(guidance_scale=w)``)."""
        return {"guidance": guidance_scale} if self.guidance_embeds else {}

    def _forward(self, x, t, cond: PromptEmbeds, dtype, guidance: float | None = None) -> torch.Tensor:
        ids = getattr(cond, "image_ids", None)
        if ids is None:
            return self._transformer_call(x, t, cond, dtype, guidance)  # a text-only table
        layouts, group = torch.unique(ids.flatten(1), dim=0, return_inverse=True)  # rows of one set of references
        if len(layouts) > 1:  # one transformer call per set (its position ids)
            out = None
            for g in range(len(layouts)):
                rows = (group == g).nonzero().squeeze(1)
                part = self._forward(x[rows], t[rows], cond[rows], dtype, guidance)  # bf16 under autocast
                out = part.new_empty(x.shape) if out is None else out
                out[rows] = part
            return out
        length = int((ids[0, :, 0] >= 0).sum())  # the rows' reference tokens (0: text-to-image rows)
        references = (cond.image[:, :length], ids[0, :length]) if length else None
        return self._transformer_call(x, t, cond, dtype, guidance, references)

    def _transformer_call(self, x, t, cond: PromptEmbeds, dtype, guidance=None, references=None) -> torch.Tensor:
        """One transformer call on latents ``x (N, C', h, w)`` at times ``t (N,)``; ``references``: the rows' common
        reference tokens ``(N, R, C')`` and their position ids ``(R, 4)``, appended after the noisy tokens as the
        pipeline does, or None. Returns the noisy tokens' prediction ``(N, C', h, w)`` in ``dtype``."""
        n, c, h, w = x.shape
        pipe = self.pipe
        tokens = pipe._pack_latents(x.to(dtype))  # (N, h * w, C')
        img_ids = pipe._prepare_latent_ids(x)[0].to(x.device)  # (h * w, 4): (0, row, col, 0)
        if references is not None:
            tokens = torch.cat([tokens, references[0].to(dtype)], dim=1)  # (N, h * w + R, C'): noisy, then references
            img_ids = torch.cat([img_ids, references[1]])  # (h * w + R, 4)
        txt_ids = pipe._prepare_text_ids(cond.embeds[:1])[0].to(x.device)  # (L, 4): (0, 0, 0, l)
        time = (t.float() * 1000) / 1000  # the pipeline's timestep / 1000 on the scheduler's 1000 sigma
        if guidance is None and self.guidance_embeds:
            guidance = 1.0  # a probe or a caller without a scale: the embedding still needs one
        g = torch.full((n,), float(guidance), device=x.device) if self.guidance_embeds else None  # float32, as stock
        out = self.network()(
            hidden_states=tokens,
            encoder_hidden_states=cond.embeds.to(dtype),
            timestep=time.to(dtype),
            img_ids=img_ids,
            txt_ids=txt_ids,
            guidance=g,
            return_dict=False,
        )[0]  # (N, h * w [+ R], C')
        out = out[:, : h * w]  # the noisy tokens' prediction
        return out.transpose(1, 2).reshape(n, c, h, w)  # (N, C', h, w): the tokens are in row-major order

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Decode latents ``(B, C', h, w)`` to images float32 ``(B, 3, 2 h f, 2 w f)`` in [0, 1] as
        ``Flux2KleinPipeline`` does (the VAE's batch-norm statistics undone, the 2x2 patches unfolded, the VAE), in
        chunks of :attr:`decode_chunk`."""
        vae = self.pipe.vae
        mean = vae.bn.running_mean.view(1, -1, 1, 1).to(latents.device, vae.dtype)
        std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(
            latents.device, vae.dtype
        )
        images = []
        for chunk in latents.split(self.decode_chunk):
            z = self.pipe._unpatchify_latents(chunk.to(vae.dtype) * std + mean)  # (b, C'/4, 2h, 2w)
            z = z.contiguous(memory_format=torch.channels_last)
            images.append(vae.decode(z, return_dict=False)[0].float())
        return (torch.cat(images) / 2 + 0.5).clamp(0, 1)


@register_family
class Flux2KleinModel(Flux2Model):
    """A FLUX.2 klein flow model (``Flux2KleinPipeline`` folder: klein 4B / 9B, their base models or a small one):
    :class:`Flux2Model` (reference images included) with klein's text encoder and guidance.

    - Prompts: ``Flux2KleinPipeline.encode_prompt``: the prompt in Qwen3's chat template (thinking disabled), padded
      to ``max_sequence_length`` tokens (default 512), the hidden states of layers 9, 18 and 27 of the Qwen3 text
      encoder concatenated per token: ``(P, L, 3 D)``.
    - Guidance: a base model (``is_distilled`` false in ``model_index.json``) takes classifier-free guidance against
      the empty prompt, ``v_u + w (v_c - v_u)`` as :meth:`FlowModel.velocity` (the pipeline's own formula), the
      negative with the row's reference images; a step-distilled one (klein 4B / 9B) samples without it:
      ``guidance_scale`` must be 1 (the stock pipeline ignores it; flowrl refuses it, :meth:`cfg_scale`,
      :meth:`check_config`).

    Args, Raises: as :class:`Flux2Model`.
    """

    PIPELINE = "Flux2KleinPipeline"
    TEXT_LAYERS = (9, 18, 27)
    """The Qwen3 hidden states the pipeline concatenates (its ``text_encoder_out_layers`` default)."""

    @classmethod
    def check_config(cls, cfg) -> None:
        """:meth:`Flux2Model.check_config`, and refuse a guidance scale other than 1 for a step-distilled folder, before
        weights load.

        Raises:
            flowrl.fields.ConfigError: naming ``model.options.reference_resolution``, ``sampling.guidance_scale`` or
                ``eval.guidance_scale``.
        """
        super().check_config(cfg)
        path = resolve_path(cfg.model.path)
        if not cls.distilled(path):
            return
        for key, value in (("sampling", cfg.sampling.guidance_scale), ("eval", cfg.eval.guidance_scale)):
            if value != 1.0:
                raise ConfigError(
                    f"config key '{key}.guidance_scale': {path} is a step-distilled FLUX.2 klein (is_distilled), "
                    f"which samples without CFG; set it to 1.0 (got {value})"
                )

    def cfg_scale(self, guidance_scale: float) -> float:
        """``guidance_scale``: a base model takes classifier-free guidance as :meth:`FlowModel.velocity` (the
        pipeline's own formula), the negative with the row's reference images (:attr:`Flux2PromptEmbeds.SHARED`).

        Raises:
            ValueError: if ``guidance_scale`` is not 1 for a step-distilled model, or outside [1, 100].
        """
        if guidance_scale != 1.0 and self.is_distilled:
            raise ValueError(
                f"guidance_scale {guidance_scale}: {self.path} is a step-distilled FLUX.2 klein (is_distilled), "
                "which samples without CFG; use guidance_scale 1.0"
            )
        return FlowModel.cfg_scale(self, guidance_scale)

    def embedded_guidance(self, guidance_scale: float) -> dict:
        """``{}``: klein's guidance is CFG."""
        return {}
