"""Model adapters, one file per family behind the contract of :mod:`flowrl.models.base`.

:func:`load_model` reads a pipeline folder's ``model_index.json`` and loads it with the adapter of that
pipeline class (:data:`ADAPTERS`): ``StableDiffusion3Pipeline`` -> :class:`SD3Model` (SD3, SD3.5, the shipped
tiny model), ``FluxPipeline`` -> :class:`FluxModel` (FLUX.1), ``StableDiffusionPipeline`` -> :class:`SD15Model`
(SD 1.x / 2.x UNets, sampled as flow models through :mod:`flowrl.samplers.ddim`), ``StableDiffusionXLPipeline`` ->
:class:`SDXLModel` (SDXL: SD 1.x's machinery plus two text encoders, pooled embeddings and added time ids).
``WanPipeline`` -> :class:`WanModel` (Wan 2.1 / 2.2 text-to-video, latents ``(C, F, H, W)``). A new family is a new
file with a :class:`FlowModel` subclass, added to :data:`ADAPTERS`. ``QwenImagePipeline`` -> :class:`QwenImageModel`
(Qwen-Image), ``FluxKontextPipeline`` -> :class:`FluxKontextModel` (FLUX.1 Kontext image editing: a source image per
prompt, read by :meth:`FlowModel.prompt_table`). ``HunyuanVideoPipeline`` -> :class:`HunyuanVideoModel` (HunyuanVideo
text-to-video: embedded guidance, latents ``(C, F, H, W)``). ``ZImagePipeline`` -> :class:`ZImageModel` (Z-Image,
Z-Image-Turbo). ``QwenImageEditPipeline`` -> :class:`QwenImageEditModel` and ``QwenImageEditPlusPipeline`` ->
:class:`QwenImageEditPlusModel` (Qwen-Image-Edit: a source image per prompt, seen by the text encoder and the
transformer).
``Flux2KleinPipeline`` -> :class:`Flux2KleinModel` (FLUX.2 klein 4B / 9B and their base models: a Qwen3 text encoder,
batch-norm-normalised 2x2-patchified latents; text-to-image, or conditioned on a prompt record's reference images,
read by :meth:`FlowModel.prompt_table`). ``Flux2Pipeline`` -> :class:`Flux2Model` (FLUX.2 [dev]: the same model with a
Mistral 3 text encoder and the guidance scale as an input).
``WanImageToVideoPipeline`` -> :class:`WanImageToVideoModel` (Wan 2.1 / 2.2 image-to-video: :class:`WanModel` plus a
source image per prompt, the video's first frame, read by :meth:`FlowModel.prompt_table`).
``LTXPipeline`` -> :class:`LTXVideoModel` (LTX-Video text-to-video: T5 prompts with a mask, VAE-normalised latents
``(C, F, H, W)`` packed one token per voxel, a shift that depends on the video's token count) and ``LTX2Pipeline`` ->
:class:`LTX2Model` (LTX-2's video and audio: Gemma 3 prompts through the text connectors, the joint video and audio
tokens as one flat state, rewards on the video).
``SanaPipeline`` -> :class:`SanaModel` (SANA, SANA 1.5: Gemma2 prompts with the complex human instruction, DC-AE
latents) and ``SanaSprintPipeline`` -> :class:`SanaSprintModel` (SANA-Sprint: TrigFlow times as flow times, embedded
guidance).
``HunyuanVideo15Pipeline`` -> :class:`HunyuanVideo15Model` (HunyuanVideo 1.5 text-to-video: Qwen2.5-VL and ByT5
glyph prompts, the guider's CFG, zero image-condition channels appended to the latents ``(C, F, H, W)``) and
``HunyuanVideo15ImageToVideoPipeline`` -> :class:`HunyuanVideo15ImageToVideoModel` (its image-to-video: a source image
per prompt, read by :meth:`FlowModel.prompt_table`, as first-frame latents and SigLIP tokens).
"""

from __future__ import annotations

from pathlib import Path

import torch

from .base import FlowModel, PromptEmbeds, _model_index, check_guidance, make_batch_invariant, resolve_device
from .flux import FluxModel
from .flux2 import Flux2KleinModel, Flux2Model
from .flux_kontext import FluxKontextModel
from .hunyuan_video import HunyuanVideoModel
from .hunyuan_video15 import HunyuanVideo15ImageToVideoModel, HunyuanVideo15Model
from .ltx import LTXVideoModel
from .ltx2 import LTX2Model
from .qwen_image import QwenImageModel
from .qwen_image_edit import QwenImageEditModel, QwenImageEditPlusModel
from .sana import SanaModel, SanaSprintModel
from .sd3 import SD3Model
from .sd15 import SD15Model
from .sdxl import SDXLModel
from .wan import WanModel
from .wan_i2v import WanImageToVideoModel
from .z_image import ZImageModel

ADAPTERS: tuple[type[FlowModel], ...] = (
    SD3Model,
    FluxModel,
    SD15Model,
    SDXLModel,
    WanModel,
    QwenImageModel,
    QwenImageEditModel,
    QwenImageEditPlusModel,
    FluxKontextModel,
    HunyuanVideoModel,
    HunyuanVideo15Model,
    HunyuanVideo15ImageToVideoModel,
    ZImageModel,
    Flux2KleinModel,
    Flux2Model,
    WanImageToVideoModel,
    LTXVideoModel,
    LTX2Model,
    SanaModel,
    SanaSprintModel,
)
"""Every adapter, looked up by its ``PIPELINE`` (the ``_class_name`` of a folder's ``model_index.json``); each names
its LoRA targets as ``LORA_TARGETS``."""

__all__ = [
    "ADAPTERS",
    "build_adapter",
    "FlowModel",
    "Flux2KleinModel",
    "Flux2Model",
    "FluxKontextModel",
    "FluxModel",
    "HunyuanVideoModel",
    "HunyuanVideo15Model",
    "HunyuanVideo15ImageToVideoModel",
    "LTXVideoModel",
    "LTX2Model",
    "PromptEmbeds",
    "QwenImageModel",
    "QwenImageEditModel",
    "QwenImageEditPlusModel",
    "SanaModel",
    "SanaSprintModel",
    "SD15Model",
    "SD3Model",
    "SDXLModel",
    "WanImageToVideoModel",
    "WanModel",
    "ZImageModel",
    "check_guidance",
    "load_model",
    "make_batch_invariant",
    "model_class",
    "resolve_device",
    "resolve_model",
]


def model_class(path: str | Path) -> type[FlowModel]:
    """The adapter class for the pipeline folder ``path``, from the ``_class_name`` of its ``model_index.json`` (no
    weights loaded). Its class methods (``check_resolution``, ``scheduler_shift``, ``default_max_sequence_length``,
    ``check_max_sequence_length``) check a folder and settings before anything loads.

    Raises:
        FileNotFoundError: if ``path`` is not a folder with ``model_index.json``.
        ValueError: naming the file, for a pipeline class no adapter loads.
    """
    name = _model_index(path).get("_class_name")
    for cls in ADAPTERS:
        if cls.PIPELINE == name:
            return cls
    known = ", ".join(f"{cls.PIPELINE} ({cls.__name__})" for cls in ADAPTERS)
    raise ValueError(f"{Path(path) / 'model_index.json'} names pipeline {name!r}; flowrl adapts {known}")


def load_model(
    path: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    max_sequence_length: int | None = None,
    resolution: int | None = None,
    **options,
) -> FlowModel:
    """Load the pipeline folder ``path`` with the adapter its ``model_index.json`` names (:func:`model_class`); the
    arguments are :class:`FlowModel`'s; ``options`` go to the family's constructor (a video family's ``num_frames``,
    ``expert``, ``negative_prompt``: :class:`WanModel`).

    Raises:
        FileNotFoundError, ValueError: as :func:`model_class` and the adapter's constructor; TypeError for an option
            the family does not take.
    """
    import inspect

    adapter = model_class(path)
    inspect.signature(adapter).bind(path, device, dtype, max_sequence_length, resolution, **options)  # TypeError
    return build_adapter(adapter, path, device, dtype, max_sequence_length, resolution, **options)


def build_adapter(adapter: type[FlowModel], path, *args, **kwargs) -> FlowModel:
    """``adapter(path, *args, **kwargs)``, with a component whose ``config.json`` does not fit its class (a missing key,
    a string where a size belongs: diffusers' ``KeyError`` / ``TypeError`` while building it) reported as one
    ValueError naming the folder.

    Raises:
        ValueError: naming `path` and the error, for a component config that does not build.
    """
    try:
        return adapter(path, *args, **kwargs)
    except (KeyError, TypeError) as e:
        message = " ".join(str(e).split()) or "(no message)"
        raise ValueError(
            f"model folder {path}: a component's config.json does not build its {adapter.PIPELINE} component "
            f"({type(e).__name__}: {message}); compare it with the model's published config"
        ) from e


def resolve_model(cfg):
    """The adapter class of ``model.path`` (a :class:`flowrl.config.Config`'s), with the model's shift and prompt length filled
    into `cfg` where unset (the saved config.yaml records them), every value checked before any weight loads.

    Raises:
        ConfigError: naming ``model.path`` (with the damaged file: broken JSON, truncated or pickled weights),
            ``model.resolution``, ``sampling.shift`` or ``model.max_sequence_length``.
        FileNotFoundError: a model path that is not a pipeline folder.
    """
    from ..config import ConfigError, config_key, resolve_path
    from ..files import check_model_folder

    path = resolve_path(cfg.model.path)
    with config_key("model.path"):
        check_model_folder(path)  # readable JSON, whole safetensors weights (no pickles), before anything loads
        adapter = model_class(path)  # the family, from model_index.json
    with config_key("model.resolution"):
        adapter.check_resolution(path, cfg.model.resolution)
    for key in ("num_frames", "expert", "negative_prompt"):  # video settings: refused by the image families
        if not adapter.VIDEO and getattr(cfg.model, key) not in (None, ""):
            raise ConfigError(
                f"config key 'model.{key}': {path} holds a {adapter.PIPELINE}, which draws images; "
                f"leave it unset (got {getattr(cfg.model, key)!r})"
            )
    for key in cfg.model.options:  # the family's own constructor settings
        if key not in adapter.OPTIONS:
            takes = ", ".join(adapter.OPTIONS) or "none"
            raise ConfigError(
                f"config key 'model.options.{key}': {adapter.__name__} ({path}) takes no option {key!r}; "
                f"its options: {takes}"
            )
    adapter.check_config(cfg)  # what the family cannot run (the DDPM family: DiffusionNFT, Flash re-spacing)
    if (
        cfg.sampling.shift is None
    ):  # the model's own schedule (after the frame count's check); the saved config.yaml records the value
        with config_key("sampling.shift", (ValueError, FileNotFoundError)):
            frames = {"num_frames": cfg.model.num_frames} if adapter.VIDEO else {}  # LTX-Video: per frame count
            cfg.sampling.shift = adapter.scheduler_shift(path, cfg.model.resolution, **frames)
    if cfg.model.max_sequence_length is None:  # SD3: 256 with a T5 encoder, 0 without (the tiny model); FLUX 512
        cfg.model.max_sequence_length = adapter.default_max_sequence_length(path)
    with config_key("model.max_sequence_length"):
        adapter.check_max_sequence_length(cfg.model.max_sequence_length)
    return adapter
