"""Model adapters, one file per family behind the contract of :mod:`flowrl.models.base`.

:func:`load_model` reads a pipeline folder's ``model_index.json`` and loads it with the adapter of that
pipeline class (:data:`ADAPTERS`): ``StableDiffusion3Pipeline`` -> :class:`SD3Model` (SD3, SD3.5, the shipped
tiny model), ``FluxPipeline`` -> :class:`FluxModel` (FLUX.1), ``StableDiffusionPipeline`` -> :class:`SD15Model`
(SD 1.x / 2.x UNets, sampled as flow models through :mod:`samplers.ddim`). A new family is a new file with a
:class:`FlowModel` subclass, added to :data:`ADAPTERS`.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .base import FlowModel, PromptEmbeds, _model_index, check_guidance, make_batch_invariant, resolve_device
from .flux import FLUX_LORA_TARGETS, FluxModel
from .sd3 import SD3_LORA_TARGETS, SD3Model
from .sd15 import SD15_LORA_TARGETS, SD15Model

ADAPTERS: tuple[type[FlowModel], ...] = (SD3Model, FluxModel, SD15Model)
"""Every adapter, looked up by its ``PIPELINE`` (the ``_class_name`` of a folder's ``model_index.json``)."""

__all__ = ["ADAPTERS", "FLUX_LORA_TARGETS", "FlowModel", "FluxModel", "PromptEmbeds", "SD15Model", "SD15_LORA_TARGETS",
           "SD3Model", "SD3_LORA_TARGETS", "check_guidance", "load_model", "make_batch_invariant", "model_class",
           "resolve_device"]


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


def load_model(path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
               max_sequence_length: int | None = None, resolution: int | None = None) -> FlowModel:
    """Load the pipeline folder ``path`` with the adapter its ``model_index.json`` names (:func:`model_class`); the
    arguments are :class:`FlowModel`'s.

    Raises:
        FileNotFoundError, ValueError: as :func:`model_class` and the adapter's constructor.
    """
    return model_class(path)(path, device, dtype, max_sequence_length, resolution)
