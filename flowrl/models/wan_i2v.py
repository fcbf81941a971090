"""The Wan image-to-video family (``WanImageToVideoPipeline``): Wan 2.1 I2V (CLIP image tokens beside the text) and Wan
2.2 I2V A14B (two experts, no image encoder), sampled and trained as flow models over latent videos ``(C, F, H, W)``
whose first frame is a source image named in the prompt record.

Wan (arXiv 2503.20314), image-to-video: the transformer sees, concatenated to the noisy latents along the channels, a
condition video: a mask of the given frames (``t`` channels, one per frame a latent frame compresses: 1 for the source
frame, 0 for the frames to draw) and the VAE latents of the source image followed by blank (zero) frames. Wan 2.1 I2V
also attends to the CLIP image tokens of the source (the second-to-last layer of ``image_encoder``). Reference
implementation: diffusers ``pipelines/wan/pipeline_wan_i2v.py`` (``WanImageToVideoPipeline``); the adapter calls its
``video_processor``, ``prepare_latents`` and ``encode_image``, and :class:`flowrl.models.WanModel` does the rest
(prompts, negative prompt, schedule, both experts, decoding, LoRA).

Notation (code -> pipeline): ``condition`` -> the ``condition`` of ``prepare_latents`` (``cat[mask_lat_size,
latent_condition]``), ``image`` -> ``image_embeds`` (``encoder_hidden_states_image``), ``cat[x, condition]`` ->
``latent_model_input``, ``t`` (flowrl's time, 1 = noise) -> ``timestep / 1000``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from .base import PromptEmbeds, _absent, _json, _model_index, _pipeline_folder, register_family, source_image
from .wan import WAN_LORA_TARGETS, WanModel

WAN_I2V_LORA_TARGETS = WAN_LORA_TARGETS + ("ffn.net.0.proj", "ffn.net.2")
"""Flow-Factory's LoRA targets for Wan image-to-video (github.com/X-GenGroup/Flow-Factory,
``src/flow_factory/models/wan/wan2_i2v.py``, ``default_target_modules``): the query, key, value and output projections
of every block's self-attention (``attn1``) and cross-attention (``attn2``), and both linear layers of its feed-forward
(``ffn.net.0.proj``, ``ffn.net.2``); not the image cross-attention's ``add_k_proj`` / ``add_v_proj``."""

TEXT_TOKENS = 512
"""The UMT5 tokens a Wan 2.1 I2V transformer must get: its attention splits the CLIP image tokens from the text as all
but the last 512 tokens of the context (diffusers ``WanAttnProcessor``: "512 is the context length of the text
encoder, hardcoded for now")."""

BLANK_SOURCE = (128, 128, 128)
"""RGB of the source frame of a record without ``image``: a uniform mid-gray frame, about the zero of the pipeline's
[-1, 1] pixels, with which it fills the frames it draws."""


def source_rows(model, metas: list[dict]) -> tuple[torch.Tensor, ...]:
    """The source image of each prompt record (its ``image`` path; None: the blank frame), read by
    ``model.read_source`` and encoded by ``model.encode_images`` (each distinct source once), after a zero row 0 for
    the CFG negative, which takes the source of the row it guides: each tensor ``encode_images`` returns, as ``(P + 1,
    ...)`` rows of a prompt table (:class:`WanImageToVideoModel`, :class:`flowrl.models.HunyuanVideo15ImageToVideoModel`).

    Raises:
        ValueError: naming the file, for a source that cannot be read as an image.
    """
    keys = [source_image(m, "image-to-video") for m in metas]
    sources = list(dict.fromkeys(keys))  # each distinct source once (None: the blank frame)
    encoded = model.encode_images([model.read_source(k) for k in sources])  # tensors (S, ...)
    rows = torch.tensor([sources.index(k) for k in keys], device=model.device)  # (P,) source of each record
    return tuple(torch.cat([torch.zeros_like(e[:1]), e[rows]]) for e in encoded)  # (P + 1, ...) each


@dataclass
class I2VPromptEmbeds(PromptEmbeds):
    """Wan prompt embeddings (``embeds (P, T, D)`` float32, an empty ``pooled (P, 0)``) with each row's source:

    - ``condition (P, t + C, F_lat, h, w)`` float32: the mask of the given frames (``t`` channels: 1 over the source
      frame, 0 elsewhere) and the normalised VAE latents of the source followed by blank frames, as
      ``WanImageToVideoPipeline.prepare_latents`` returns them;
    - ``image (P, T_img, D_img)`` float32: the source's CLIP tokens (the image encoder's second-to-last hidden states),
      ``(P, 0, 0)`` for a model without image encoder (Wan 2.2).
    """

    condition: torch.Tensor = None
    image: torch.Tensor = None

    SHARED = ("condition", "image")
    """Under CFG the negative sees the row's source (condition and CLIP tokens), as ``WanImageToVideoPipeline``."""


@register_family
class WanImageToVideoModel(WanModel):
    """A Wan image-to-video flow model (``WanImageToVideoPipeline`` folder: Wan2.1-I2V-14B-480P / 720P, Wan2.2-I2V-A14B
    or a small one): :class:`WanModel` (video latents, frames, prompts, negative prompt, schedule, two experts,
    decoding, LoRA) plus a source image per prompt, the video's first frame.

    - Source: a prompt record's ``image`` key, a path relative to the prompt file (:func:`flowrl.data.read_jsonl` makes
      it absolute; the rewards receive the record as metadata), as FLUX.1 Kontext and Qwen-Image-Edit read theirs.
      :meth:`prompt_table` reads it (RGB), resizes it to the square :attr:`resolution` with the pipeline's
      ``video_processor`` and builds the condition video with the pipeline's own ``prepare_latents`` (the VAE's mode,
      normalised by ``latents_mean`` / ``latents_std``, after the mask of the given frames), and for Wan 2.1 its CLIP
      tokens with the pipeline's ``encode_image``: what ``WanImageToVideoPipeline(image=source, height=width=
      resolution)`` computes. Each distinct source is encoded once per table.
    - A record without ``image`` starts from a blank mid-gray frame (:data:`BLANK_SOURCE`; the stock pipeline needs an
      image, and reproduces this given that frame): what ``flowrl sample --prompt`` draws.
    - :meth:`_forward` gives the transformer ``cat[x, condition]`` (``2 C + t`` channels) and, for Wan 2.1, the CLIP
      tokens; it predicts the velocity of the ``C`` latent channels. Under classifier-free guidance the negative sees
      the same source (condition and CLIP tokens), as the stock pipeline. A row without a source (the probe that makes
      the transformer batch-invariant, a process's zero-gradient pass) gets zeros.
    - Resolution: a multiple of 16 px (the pipeline's ``check_inputs``) and of the VAE factor x the patch size.
    - ``max_sequence_length`` must be 512 with CLIP image tokens (:data:`TEXT_TOKENS`); without them (Wan 2.2) any.
    - LoRA: :data:`WAN_I2V_LORA_TARGETS`; ``WanImageToVideoPipeline.load_lora_weights`` loads it.

    Not built: Wan 2.2 TI2V-5B's image-to-video (``expand_timesteps``: the source's latents replace the first latent
    frame at every step instead of conditioning the transformer), refused when the folder loads; a last frame
    (``last_image``).

    Args:
        path, device, dtype, max_sequence_length, resolution, num_frames, expert, negative_prompt: as :class:`WanModel`.

    Raises:
        FileNotFoundError, ValueError: as :class:`WanModel`; ValueError also for a folder this family cannot run
            (:meth:`check_layout`) or a ``max_sequence_length`` other than 512 with CLIP image tokens
            (:meth:`check_prompt_length`).
    """

    PIPELINE = "WanImageToVideoPipeline"
    """The diffusers pipeline class this adapter loads (``_class_name`` in ``model_index.json``)."""
    OPTIONAL = ("transformer_2", "image_encoder", "image_processor")
    """Components a folder may leave out: the second expert (Wan 2.1 has none), the CLIP image encoder and its
    processor (Wan 2.2 has none)."""
    LORA_TARGETS = WAN_I2V_LORA_TARGETS
    TEXT_ONLY = False
    SOURCE_REQUIRED = True

    # ------------------------------------------------------------------------------ folder checks
    @classmethod
    def check_folder(cls, path: Path) -> None:
        """:meth:`check_layout` (before loading and for ``model.path``).

        Raises:
            ValueError: as :meth:`check_layout`.
        """
        cls.check_layout(path)

    @classmethod
    def check_layout(cls, path: str | Path) -> None:
        """Check that the folder ``path`` is an image-to-video layout this adapter runs (no weights loaded).

        Raises:
            FileNotFoundError: if ``path`` is not a pipeline folder.
            ValueError: naming the folder, for ``expand_timesteps`` (Wan 2.2 TI2V-5B's image-to-video), a transformer
                whose ``in_channels`` is not ``2 C + t`` (noise, mask and source latents), or CLIP image tokens
                (``image_dim``) without ``image_encoder`` and ``image_processor``.
        """
        path = _pipeline_folder(path)
        index, vae, dit = _model_index(path), _json(path / "vae" / "config.json"), cls._transformer_config(path)
        if index.get("expand_timesteps"):
            raise ValueError(
                f"{path} sets expand_timesteps (Wan 2.2 TI2V-5B's image-to-video, which overwrites the first latent "
                "frame with the source at every step): not built in flowrl; load its text-to-video WanPipeline folder"
            )
        channels, t = vae.get("z_dim", 16), vae.get("scale_factor_temporal", 4)
        if dit["in_channels"] != 2 * channels + t:
            raise ValueError(
                f"{path}: the transformer takes {dit['in_channels']} channels, not the {2 * channels + t} of "
                f"image-to-video ({channels} noisy latent + {t} mask + {channels} source channels)"
            )
        if dit.get("image_dim") is not None and (_absent(index, "image_encoder") or _absent(index, "image_processor")):
            raise ValueError(
                f"{path}: the transformer takes CLIP image tokens (image_dim {dit['image_dim']}) but the folder has no "
                "image_encoder and image_processor"
            )

    @classmethod
    def check_prompt_length(cls, path: Path, length: int) -> None:
        """:meth:`WanModel.check_max_sequence_length`, and 512 when the folder's transformer takes CLIP image tokens
        (:data:`TEXT_TOKENS`).

        Raises:
            ValueError: naming the folder ``path``, for another length with CLIP image tokens.
        """
        super().check_prompt_length(path, length)
        image_dim = cls._transformer_config(_pipeline_folder(path)).get("image_dim")
        if image_dim is not None and length != TEXT_TOKENS:
            raise ValueError(
                f"max_sequence_length must be {TEXT_TOKENS} for {path}: its transformer tells the CLIP image tokens "
                f"from the text by a context of {TEXT_TOKENS} text tokens (got {length})"
            )

    @classmethod
    def _resolution_grid(cls, path: Path) -> tuple[int, int, int | None, str]:
        """:meth:`WanModel._resolution_grid` on multiples of 16 px as well (``WanImageToVideoPipeline.check_inputs``)."""
        default, unit, largest, why = super()._resolution_grid(path)
        if unit % 16:
            unit = math.lcm(unit, 16)
            largest = largest // unit * unit
            default = min(default // unit * unit, largest)
            why += " and the pipeline's 16"
        return default, unit, largest, why

    # ------------------------------------------------------------------------------ the model
    @property
    def latent_shape(self) -> tuple[int, int, int, int]:
        """``(C, F_lat, H, W)`` of one video's latents: :meth:`WanModel.latent_shape` with the VAE's ``C = z_dim``
        channels (the transformer takes ``2 C + t``: the condition's too)."""
        _, frames, h, w = super().latent_shape
        return (self.pipe.vae.config.z_dim, frames, h, w)

    def read_source(self, path: str | None):
        """The source image at ``path`` as an RGB ``PIL.Image`` (None: the blank frame, :data:`BLANK_SOURCE`).

        Raises:
            ValueError: naming the file, for a path that cannot be read as an image.
        """
        from PIL import Image, UnidentifiedImageError

        if path is None:
            return Image.new("RGB", (self.resolution, self.resolution), BLANK_SOURCE)
        try:
            with Image.open(path) as picture:
                return picture.convert("RGB")
        except (OSError, UnidentifiedImageError) as e:
            raise ValueError(f"source image {path} cannot be read as an image ({type(e).__name__})") from None

    @torch.no_grad()
    def encode_images(self, images: list) -> tuple[torch.Tensor, torch.Tensor]:
        """Source images (``PIL.Image``) as the transformer's condition, one pipeline call each (as the stock pipeline
        encodes its one image): ``(condition (S, t + C, F_lat, h, w), image (S, T_img, D_img))`` float32 on the model's
        device (``image`` is ``(S, 0, 0)`` without image encoder)."""
        pipe, side = self.pipe, self.resolution
        conditions, tokens = [], []
        for source in images:
            pixels = pipe.video_processor.preprocess(source, height=side, width=side)  # (1, 3, side, side) in [-1, 1]
            zeros = torch.zeros(1, *self.latent_shape, device=self.device)  # the noise, not used: no draw
            _, condition = pipe.prepare_latents(
                pixels.to(self.device, torch.float32),
                1,
                self.latent_shape[0],
                side,
                side,
                self.num_frames,
                torch.float32,
                self.device,
                None,
                zeros,
            )  # (1, t + C, F_lat, h, w)
            conditions.append(condition.float())
            if self.transformer.config.image_dim is not None:
                tokens.append(pipe.encode_image(source, self.device).float())  # (1, T_img, D_img)
            else:
                tokens.append(torch.zeros(1, 0, 0, device=self.device))
        return torch.cat(conditions), torch.cat(tokens)

    def prompt_table(self, metas: list[dict]) -> I2VPromptEmbeds:
        """:meth:`FlowModel.prompt_table` with each record's source (row 0, the negative's text, gets zeros: under CFG
        each row's negative takes that row's source, :attr:`I2VPromptEmbeds.SHARED`); ``P + 1`` rows of
        :class:`I2VPromptEmbeds`.

        Raises:
            ValueError: naming the file, as :meth:`read_source`.
            KeyError: for a record without ``prompt`` (the prompt files are checked when read, :mod:`flowrl.data`).
        """
        table = self.encode([""] + [m["prompt"] for m in metas])
        condition, image = source_rows(self, metas)  # (P + 1, t + C, F_lat, h, w), (P + 1, T_img, D_img)
        return I2VPromptEmbeds(table.embeds, table.pooled, condition, image)

    def _call(
        self, net: torch.nn.Module, x: torch.Tensor, t: torch.Tensor, cond: PromptEmbeds, dtype: torch.dtype
    ) -> torch.Tensor:
        """One expert on rows ``x (N, C, F, H, W)`` at times ``t (N,)``: ``hidden_states = cat[x, condition]`` ``(N,
        2 C + t, F, H, W)``, timestep ``1000 t``, the text and (Wan 2.1) the CLIP tokens, as
        ``WanImageToVideoPipeline``; returns the velocity ``(N, C, F, H, W)``. Rows without a source (a plain
        :class:`PromptEmbeds`) get a zero condition and one zero image token."""
        condition = getattr(cond, "condition", None)
        if condition is None:
            condition = x.new_zeros(len(x), net.config.in_channels - x.shape[1], *x.shape[2:])  # (N, t + C, F, H, W)
        image = None
        if net.config.image_dim is not None:
            image = getattr(cond, "image", None)
            if image is None or image.shape[1] == 0:
                image = x.new_zeros(len(x), 1, net.config.image_dim)  # (N, 1, D_img)
            image = image.to(dtype)
        return net(
            hidden_states=torch.cat([x, condition.to(x.dtype)], dim=1).to(dtype),  # (N, 2 C + t, F, H, W)
            timestep=t.to(dtype) * 1000,
            encoder_hidden_states=cond.embeds.to(dtype),
            encoder_hidden_states_image=image,
            return_dict=False,
        )[0]
