"""The Qwen-Image-Edit family (``QwenImageEditPipeline``, ``QwenImageEditPlusPipeline``): Qwen-Image's image editing, a
source image per prompt (Qwen-Image, arXiv 2508.02324).

Reference implementation: diffusers ``pipelines/qwenimage/pipeline_qwenimage_edit.py`` (``QwenImageEditPipeline``) and
``pipeline_qwenimage_edit_plus.py`` (``QwenImageEditPlusPipeline``); the adapter calls their ``encode_prompt``,
``image_processor``, ``_encode_vae_image``, ``_pack_latents`` and ``_unpack_latents`` and the module's
``calculate_dimensions``.

Notation (code -> the pipelines): ``source_resolution ** 2`` -> ``VAE_IMAGE_SIZE`` (the source's area in the VAE,
1024 * 1024 in both pipelines), ``grid`` -> the source's entry of ``img_shapes`` (its packed token rows and columns).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import (
    CONDITION_IMAGE_SIZE,
    VAE_IMAGE_SIZE,
    calculate_dimensions,
)

from ..fields import ConfigError
from .base import register_family, source_image
from .qwen_image import QwenImageModel, QwenPromptEmbeds

DEFAULT_SOURCE_RESOLUTION = round(VAE_IMAGE_SIZE**0.5)
"""The side of the square whose area a source image gets in the VAE when ``source_resolution`` is not given: 1024, the
edit pipelines' ``VAE_IMAGE_SIZE = 1024 * 1024``."""

ENCODE_CHUNK = 8
"""Prompts (each with its source image's vision tokens) per Qwen2.5-VL call of :meth:`QwenImageEditModel.prompt_table`."""


@dataclass
class EditPromptEmbeds(QwenPromptEmbeds):
    """Qwen2.5-VL embeddings of prompts that each may carry a source image (the text encoder sees the image):

    - ``embeds (P, T, D)`` float32 and ``mask (P, T)`` long: the prompt with its source image in the pipeline's
      template, padded (:class:`QwenPromptEmbeds`); ``pooled`` an empty ``(P, 0)``;
    - ``negative (P, Tn, D)`` float32 and ``negative_mask (P, Tn)``: each row's own CFG negative, the empty prompt
      with the same source image (as the pipeline encodes ``negative_prompt`` with ``image``);
    - ``image (P, L, 4C)`` float32: the source's VAE latents packed into 2x2 tokens, zero-padded to the longest source
      of the table (``L`` tokens);
    - ``grid (P, 2)`` long: each source's packed token rows and columns (its ``img_shapes`` entry), ``(0, 0)`` for a
      row without a source image.
    """

    negative: torch.Tensor = None
    negative_mask: torch.Tensor = None
    image: torch.Tensor = None
    grid: torch.Tensor = None

    SHARED = ("negative", "negative_mask", "image", "grid")
    """A row carries its own CFG negative and source (:meth:`QwenImageEditModel._cfg_batch`)."""


def _padded(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack token rows ``(T_i, D)`` into ``(P, T, D)``, zero-padded to the longest, with their mask ``(P, T)`` long."""
    length = max(r.shape[0] for r in rows)
    embeds = torch.stack([torch.nn.functional.pad(r, (0, 0, 0, length - r.shape[0])) for r in rows])  # (P, T, D)
    mask = torch.stack([(torch.arange(length, device=r.device) < r.shape[0]).long() for r in rows])  # (P, T)
    return embeds, mask


def _pad_tokens(x: torch.Tensor, length: int) -> torch.Tensor:
    """``x (P, T)`` or ``(P, T, D)`` zero-padded along dim 1 to ``length`` tokens."""
    return torch.nn.functional.pad(x, (0, 0) * (x.ndim - 2) + (0, length - x.shape[1]))


@register_family
class QwenImageEditModel(QwenImageModel):
    """A Qwen-Image-Edit image-editing flow model (``QwenImageEditPipeline`` folder: Qwen/Qwen-Image-Edit, or a small
    one): :class:`QwenImageModel` (packing, true CFG with its norm rescale, dynamic shift with the terminal stretch,
    3-D VAE decoding, LoRA) plus a source image per prompt, which both the text encoder and the transformer see.

    The source image: a prompt record's ``image`` key, a path relative to the prompt file (:func:`flowrl.data.read_jsonl`
    makes it absolute; the rewards receive the same record as metadata, so an edit reward can compare against
    ``metadata[i]["image"]``), as for :class:`flowrl.models.FluxKontextModel`. :meth:`prompt_table` reads it (RGB) and,
    as the pipeline does,

    - sizes it by ``calculate_dimensions(source_resolution ** 2, width / height)``: the source's aspect ratio at that
      area, each side rounded to 32 px (the pipeline's area is 1024 * 1024, this adapter's default);
    - resizes it with the pipeline's ``image_processor`` and encodes it with the VAE's mode, normalised by
      ``latents_mean`` / ``latents_std`` (``_encode_vae_image``), packed into 2x2 tokens (:meth:`encode_images`);
    - encodes the prompt together with the image by Qwen2.5-VL, through the pipeline's own ``encode_prompt(prompt,
      image)`` (the processor puts the image's vision tokens in the chat template; the vision tower embeds them), and
      the row's CFG negative, the empty prompt, with the same image.

    :meth:`_forward` appends the source's tokens after the noisy latents' (``img_shapes`` ``[(1, h/2, w/2), (1, grid)]``:
    the transformer's rotary embedding gives the source frame index 1) and keeps the prediction of the noisy tokens
    only. Rows whose sources differ in shape run in one transformer call per shape (the rotary embedding takes one
    ``img_shapes`` per call). True CFG (``guidance_scale > 1``) guides each row against its own negative, ``v = v_u +
    w (v_c - v_u)`` rescaled per token to ``|v_c|``, as ``QwenImageEditPipeline(true_cfg_scale=w, negative_prompt="")``.
    A record without ``image`` is drawn as text-to-image: its prompt in the template without an image placeholder, as
    ``QwenImageEditPlusPipeline.encode_prompt(image=None)`` encodes it, no source tokens, the empty prompt as its
    negative; a batch may mix both (the stock pipelines themselves need an image).

    Encoded edit prompts depend on the image, so :meth:`prompt_table` runs the text encoder at every rollout; the
    prompt cache (``model.prompt_cache``) holds the text-only rows, and ``model.text_encoders=drop_after_cache`` is
    refused (:meth:`check_config`). ``max_sequence_length`` is checked (1..1024) but, as in the edit pipelines, cuts
    nothing.

    Args:
        path, device, dtype, max_sequence_length, resolution: as :class:`FlowModel`.
        source_resolution: the side in px of the square whose area each source image gets in the VAE (its aspect ratio
            kept): None for the pipelines' 1024 (:data:`DEFAULT_SOURCE_RESOLUTION`); Flow-GRPO's Qwen-Image-Edit-Plus
            script uses 512. ``model.options.source_resolution`` in a config.

    Raises:
        FileNotFoundError, ValueError: as :class:`FlowModel`; ValueError also for a ``source_resolution`` that is not
            an integer >= 32.
    """

    PIPELINE = "QwenImageEditPipeline"
    OPTIONS = ("source_resolution",)
    source_resolution = DEFAULT_SOURCE_RESOLUTION
    """The side of the square whose area each source image gets in the VAE (:meth:`check_source_resolution`)."""
    _text_only = None  # the pipeline that encodes prompts without an image (:meth:`_text_pipeline`)
    TEXT_ONLY = False

    @staticmethod
    def check_source_resolution(value) -> int:
        """``source_resolution`` as an int: None is :data:`DEFAULT_SOURCE_RESOLUTION`.

        Raises:
            ValueError: for anything but an integer >= 32 (``calculate_dimensions`` rounds sides to 32 px).
        """
        if value is None:
            return DEFAULT_SOURCE_RESOLUTION
        if isinstance(value, bool) or not isinstance(value, int) or value < 32:
            raise ValueError(
                f"source_resolution must be an integer number of pixels >= 32 (the side of the square whose area a "
                f"source image gets; 1024 in the stock pipelines), got {value!r}"
            )
        return value

    @classmethod
    def check_config(cls, cfg) -> None:
        """Check ``model.options.source_resolution`` and refuse ``model.text_encoders=drop_after_cache`` (edit prompts
        are encoded with their source image at every rollout) before weights load.

        Raises:
            flowrl.fields.ConfigError: naming the key.
        """
        super().check_config(cfg)
        if cfg.model.text_encoders == "drop_after_cache":
            raise ConfigError(
                f"config key 'model.text_encoders': {cls.__name__} encodes every prompt together with its source image "
                "(Qwen2.5-VL sees the image) at each rollout, so its text encoder cannot be freed; use keep or cpu"
            )

    # ------------------------------------------------------------------------------------------------ prompts
    def _text_pipeline(self):
        """The pipeline whose ``encode_prompt(image=None)`` encodes a prompt without an image: a
        ``QwenImageEditPlusPipeline`` over this pipeline's components (its template is the edit template without the
        image placeholder, which ``QwenImageEditPipeline.encode_prompt`` cannot leave out)."""
        if self._text_only is None:
            from diffusers import QwenImageEditPlusPipeline

            self._text_only = QwenImageEditPlusPipeline(**self.pipe.components)
        return self._text_only

    @torch.no_grad()
    def encode(self, prompts: list[str]) -> QwenPromptEmbeds:
        """Encode prompts without an image (row 0, the empty prompt, and records without ``image``): ``embeds (P, T,
        D)`` float32 padded to the longest prompt, its ``mask (P, T)`` long, an empty ``pooled (P, 0)``."""
        with self._encoder_on_device():
            embeds, mask = self._text_pipeline().encode_prompt(prompts, image=None, device=self.device)
        if mask is None:  # the pipeline drops an all-ones mask
            mask = torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device)
        return QwenPromptEmbeds(embeds.float(), embeds.new_zeros(len(prompts), 0, dtype=torch.float32), mask)

    def _encoder_on_device(self):
        """Context with the text encoder on the model's device (``model.text_encoders=cpu`` keeps it on the CPU)."""
        from .memory import on_device

        encoder = self.pipe.text_encoder
        if next(encoder.parameters()).device.type == self.device.type:  # "cuda:0" is where "cuda" puts it
            return contextlib.nullcontext()
        return on_device([encoder], self.device)  # moved back to the CPU afterwards

    @torch.no_grad()
    def encode_with_images(self, prompts: list[str], images: list) -> list[torch.Tensor]:
        """Qwen2.5-VL embeddings of prompts, each with its image (``PIL.Image``, already at the size the text encoder
        is given): ``QwenImageEditPipeline.encode_prompt(prompts, image=images)`` in chunks of :data:`ENCODE_CHUNK`;
        each row ``(T_i, D)`` float32 without padding (its image's vision tokens among them)."""
        rows = []
        with self._encoder_on_device():
            for start in range(0, len(prompts), ENCODE_CHUNK):
                chunk = slice(start, start + ENCODE_CHUNK)
                embeds, mask = self.pipe.encode_prompt(prompts[chunk], image=images[chunk], device=self.device)
                lengths = [embeds.shape[1]] * len(embeds) if mask is None else mask.sum(1).tolist()
                rows.extend(e[:n].float() for e, n in zip(embeds, lengths))
        return rows

    def source_size(self, image) -> tuple[int, int]:
        """``(width, height)`` in px of the source ``image`` (``PIL.Image``) in the VAE: ``calculate_dimensions``' sides
        for its aspect ratio at the area ``source_resolution ** 2`` (multiples of 32; a side may round to 0 for an
        extreme aspect ratio: :meth:`read_source` refuses those)."""
        width, height = image.size
        return calculate_dimensions(self.source_resolution**2, width / height)

    def condition_image(self, image):
        """The source ``image`` as the text encoder sees it: resized to :meth:`source_size` (``QwenImageEditPipeline``
        gives Qwen2.5-VL the image it gives the VAE)."""
        width, height = self.source_size(image)
        return self.pipe.image_processor.resize(image, height, width)

    def read_source(self, path: str):
        """The source image at ``path``, as an RGB ``PIL.Image``.

        Raises:
            ValueError: naming the file, for a file that cannot be read as an image, or an aspect ratio so extreme that
                a side rounds to 0 px at ``source_resolution``.
        """
        from PIL import Image, UnidentifiedImageError

        try:
            with Image.open(path) as picture:
                image = picture.convert("RGB")
        except (OSError, UnidentifiedImageError) as e:
            raise ValueError(f"source image {path} cannot be read as an image ({type(e).__name__})") from None
        if min(self.source_size(image)) == 0:
            raise ValueError(
                f"source image {path} ({image.width} x {image.height} px) has a side that rounds to 0 px at "
                f"source_resolution {self.source_resolution}; crop it or raise model.options.source_resolution"
            )
        return image

    @torch.no_grad()
    def encode_images(self, images: list) -> tuple[torch.Tensor, torch.Tensor]:
        """Source images (``PIL.Image``) as the transformer's source tokens: ``(tokens (S, L, 4C) float32, grid (S, 2)
        long)`` on the model's device; image ``s`` resized to :meth:`source_size` with the pipeline's
        ``image_processor``, encoded by the VAE's mode (``_encode_vae_image``: normalised by ``latents_mean`` and
        ``latents_std``) and packed into 2x2 tokens, ``grid[s]`` its token rows and columns, zero-padded to the longest
        ``L``. Images of one size share a VAE call."""
        pipe = self.pipe
        sizes = [self.source_size(image) for image in images]
        packed = [None] * len(images)
        for width, height in dict.fromkeys(sizes):
            rows = [i for i, s in enumerate(sizes) if s == (width, height)]
            resized = [pipe.image_processor.resize(images[i], height, width) for i in rows]
            pixels = pipe.image_processor.preprocess(resized, height, width)  # (k, 3, H, W) in [-1, 1]
            pixels = pixels.unsqueeze(2).to(self.device, pipe.vae.dtype)  # (k, 3, 1, H, W): one frame
            latents = pipe._encode_vae_image(pixels, generator=None)  # (k, C, 1, h, w): the mode, normalised
            k, c, _, h, w = latents.shape
            tokens = pipe._pack_latents(latents, k, c, h, w).float()  # (k, h/2 * w/2, 4C)
            for j, i in enumerate(rows):
                packed[i] = (tokens[j], (h // 2, w // 2))
        length = max(t.shape[0] for t, _ in packed)
        tokens = torch.stack([_pad_tokens(t[None], length)[0] for t, _ in packed])  # (S, L, 4C)
        grid = torch.tensor([g for _, g in packed], dtype=torch.long, device=self.device)  # (S, 2)
        return tokens, grid

    def prompt_table(self, metas: list[dict]) -> EditPromptEmbeds:
        """:meth:`FlowModel.prompt_table` with each record's source image (row 0, the empty prompt, has none): ``P + 1``
        rows of :class:`EditPromptEmbeds`. Each distinct source is read, encoded by the VAE and encoded with the empty
        prompt (its rows' negative) once.

        Raises:
            ValueError: naming the file, as :meth:`read_source`.
            KeyError: for a record without ``prompt`` (the prompt files are checked when read, :mod:`flowrl.data`).
        """
        prompts = [""] + [m["prompt"] for m in metas]
        paths = [None] + [source_image(m, "Qwen-Image-Edit") for m in metas]
        sources = list(dict.fromkeys(p for p in paths if p is not None))  # each distinct source once
        slot = {p: s for s, p in enumerate(sources)}
        plain = [i for i, p in enumerate(paths) if p is None]  # row 0 and the text-to-image records
        text = self.encode([prompts[i] for i in plain])
        empty = text.embeds[0, : int(text.mask[0].sum())]  # (T0, D): the empty prompt, row 0 (plain[0] == 0)
        cond = [None] * len(prompts)
        negative = [empty] * len(prompts)
        for j, i in enumerate(plain):
            cond[i] = text.embeds[j, : int(text.mask[j].sum())]
        c = self.latent_shape[0]
        image = torch.zeros(len(prompts), 1, 4 * c, device=self.device)  # (P, L, 4C); L grows with the sources
        grid = torch.zeros(len(prompts), 2, dtype=torch.long, device=self.device)
        if sources:
            pictures = [self.read_source(p) for p in sources]
            seen = [self.condition_image(p) for p in pictures]  # what Qwen2.5-VL sees of each source
            blank = self.encode_with_images([""] * len(sources), seen)  # each source's negative
            edits = [i for i, p in enumerate(paths) if p is not None]
            rows = self.encode_with_images([prompts[i] for i in edits], [seen[slot[paths[i]]] for i in edits])
            tokens, shapes = self.encode_images(pictures)  # (S, L, 4C), (S, 2)
            image = torch.zeros(len(prompts), tokens.shape[1], 4 * c, device=self.device)
            for j, i in enumerate(edits):
                s = slot[paths[i]]
                cond[i], negative[i], image[i], grid[i] = rows[j], blank[s], tokens[s], shapes[s]
        embeds, mask = _padded(cond)
        negatives, negative_mask = _padded(negative)
        pooled = embeds.new_zeros(len(prompts), 0)
        return EditPromptEmbeds(embeds, pooled, mask, negatives, negative_mask, image, grid)

    # ------------------------------------------------------------------------------------------- prediction
    def _cfg_batch(self, cond: QwenPromptEmbeds, uncond: QwenPromptEmbeds) -> QwenPromptEmbeds:
        """The ``2N`` rows of a true-CFG forward: for :class:`EditPromptEmbeds` each row's own negative (the empty prompt
        with its source image, as ``QwenImageEditPipeline(true_cfg_scale=w, negative_prompt="")``; ``uncond``, the
        table's row 0, is not used), then the prompts, both padded to the longer text; text-only embeddings
        (:class:`QwenPromptEmbeds`) as :meth:`FlowModel._cfg_batch`. The guidance is Qwen-Image's (:meth:`_guide`)."""
        if not isinstance(cond, EditPromptEmbeds):
            return super()._cfg_batch(cond, uncond)
        length = max(cond.embeds.shape[1], cond.negative.shape[1])
        embeds = torch.cat([_pad_tokens(cond.negative, length), _pad_tokens(cond.embeds, length)])  # (2N, T, D)
        mask = torch.cat([_pad_tokens(cond.negative_mask, length), _pad_tokens(cond.mask, length)])  # (2N, T)
        return EditPromptEmbeds(
            embeds,
            torch.cat([cond.pooled, cond.pooled]),
            mask,
            embeds,
            mask,
            torch.cat([cond.image, cond.image]),
            torch.cat([cond.grid, cond.grid]),
        )  # the negatives, then the prompts

    def _forward(self, x, t, cond: QwenPromptEmbeds, dtype) -> torch.Tensor:
        grid = getattr(cond, "grid", None)
        if grid is None or not grid.any():
            return super()._forward(x, t, cond, dtype)  # text-to-image rows
        shapes, group = torch.unique(grid, dim=0, return_inverse=True)  # one transformer call per source shape
        if len(shapes) == 1:
            return self._forward_shape(x, t, cond, dtype, *shapes[0].tolist())
        out = torch.empty_like(x, dtype=dtype)
        for g, (rows_h, cols_w) in enumerate(shapes.tolist()):
            rows = (group == g).nonzero().squeeze(1)
            out[rows] = self._forward_shape(x[rows], t[rows], cond[rows], dtype, rows_h, cols_w)
        return out

    def _forward_shape(self, x, t, cond: EditPromptEmbeds, dtype, source_h: int, source_w: int) -> torch.Tensor:
        """One transformer call for rows whose sources are ``source_h x source_w`` tokens (0 x 0: no source)."""
        if source_h == 0:
            return super()._forward(x, t, cond, dtype)
        n, c, h, w = x.shape
        pipe = self.pipe
        tokens = pipe._pack_latents(x.to(dtype).contiguous(), n, c, h, w)  # (N, L, 4C)
        source = cond.image[:, : source_h * source_w].to(dtype)  # (N, Ls, 4C)
        out = self.network()(
            hidden_states=torch.cat([tokens, source], dim=1),  # (N, L + Ls, 4C): noisy tokens, then the source's
            timestep=t.to(dtype),
            encoder_hidden_states=cond.embeds.to(dtype),
            encoder_hidden_states_mask=cond.mask,
            img_shapes=[[(1, h // 2, w // 2), (1, source_h, source_w)]] * n,
            return_dict=False,
        )[0]  # (N, L + Ls, 4C)
        factor = pipe.vae_scale_factor
        noisy = out[:, : tokens.shape[1]]  # (N, L, 4C): the noisy tokens' prediction
        return pipe._unpack_latents(noisy, h * factor, w * factor, factor)[:, :, 0]  # (N, C, h, w)


@register_family
class QwenImageEditPlusModel(QwenImageEditModel):
    """A Qwen-Image-Edit-Plus flow model (``QwenImageEditPlusPipeline`` folder: Qwen/Qwen-Image-Edit-2509 and later):
    :class:`QwenImageEditModel` with the Plus pipeline's conventions for the one source image of a record:

    - the text encoder sees the image resized to ``calculate_dimensions(CONDITION_IMAGE_SIZE, ratio)`` (384 * 384 px
      of area), not to the VAE's size, and the prompt reads ``"Picture 1: <image> prompt"`` (the pipeline's
      ``encode_prompt(prompt, image=[image])``, one prompt per call, as the pipeline takes one prompt per call);
    - a record without ``image`` is the pipeline's ``encode_prompt(image=None)``.

    The Plus pipeline takes several images per prompt; flowrl's prompt records carry one (``image``).

    Args, Raises: as :class:`QwenImageEditModel`.
    """

    PIPELINE = "QwenImageEditPlusPipeline"

    def _text_pipeline(self):
        """The pipeline itself: its ``encode_prompt(image=None)`` leaves the image out of the template."""
        return self.pipe

    def condition_image(self, image):
        """The source ``image`` as the text encoder sees it: resized to ``calculate_dimensions(CONDITION_IMAGE_SIZE,
        width / height)``, as ``QwenImageEditPlusPipeline`` does."""
        width, height = calculate_dimensions(CONDITION_IMAGE_SIZE, image.width / image.height)
        return self.pipe.image_processor.resize(image, height, width)

    @torch.no_grad()
    def encode_with_images(self, prompts: list[str], images: list) -> list[torch.Tensor]:
        """As :meth:`QwenImageEditModel.encode_with_images`, one prompt per ``encode_prompt(prompt, image=[image])``
        call (the Plus template names every image of its list for every prompt of the call)."""
        rows = []
        with self._encoder_on_device():
            for prompt, image in zip(prompts, images):
                embeds, _ = self.pipe.encode_prompt([prompt], image=[image], device=self.device)  # (1, T, D)
                rows.append(embeds[0].float())
        return rows
