"""Model adapters, one file per family behind the contract of :mod:`flowrl.models.base`.

Each family file registers its adapter class(es) with :func:`register_family` under the diffusers pipeline class it
loads; :func:`load_model` reads a pipeline folder's ``model_index.json`` and loads it with the family registered for
its ``_class_name`` (:data:`FAMILIES`). Importing this package imports every module beside this one, so a new family
is a new file here and nothing else in the package; each family's classes are importable from it by name
(``from flowrl.models import SD3Model``). The families, their settings and their recipes: ``docs/models.md``.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from pathlib import Path

import torch

from .base import (
    FAMILIES,
    FlowModel,
    PromptEmbeds,
    _model_index,
    check_guidance,
    make_batch_invariant,
    register_family,
    resolve_device,
)

for _module in pkgutil.iter_modules(__path__):  # each family file registers its classes (register_family)
    importlib.import_module(f"{__name__}.{_module.name}")

globals().update({cls.__name__: cls for cls in FAMILIES.values()})  # flowrl.models.SD3Model, ...

ADAPTERS: tuple[type[FlowModel], ...] = tuple(FAMILIES.values())
"""Every registered family (a read-only view of :data:`FAMILIES`, kept for compatibility); each names its LoRA
targets as ``LORA_TARGETS``."""

__all__ = [
    "ADAPTERS",
    "FAMILIES",
    "FlowModel",
    "PromptEmbeds",
    "build_adapter",
    "check_guidance",
    "load_model",
    "make_batch_invariant",
    "model_class",
    "register_family",
    "resolve_device",
    *sorted(cls.__name__ for cls in FAMILIES.values()),
]


def model_class(path: str | Path) -> type[FlowModel]:
    """The family registered for the pipeline folder ``path``, from the ``_class_name`` of its ``model_index.json`` (no
    weights loaded). Its class methods (``check_resolution``, ``scheduler_shift``, ``default_max_sequence_length``,
    ``check_max_sequence_length``) check a folder and settings before anything loads.

    Raises:
        FileNotFoundError: if ``path`` is not a folder with ``model_index.json``.
        ValueError: naming the file, for a pipeline class no family is registered for.
    """
    name = _model_index(path).get("_class_name")
    if name in FAMILIES:
        return FAMILIES[name]
    known = ", ".join(f"{pipeline} ({cls.__name__})" for pipeline, cls in FAMILIES.items())
    raise ValueError(f"{Path(path) / 'model_index.json'} names pipeline {name!r}; flowrl adapts {known}")


def load_model(
    path: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    max_sequence_length: int | None = None,
    resolution: int | None = None,
    **options,
) -> FlowModel:
    """Load the pipeline folder ``path`` with the family its ``model_index.json`` names (:func:`model_class`); the
    arguments are :class:`FlowModel`'s; ``options`` go to the family's constructor (a video family's ``num_frames``,
    ``expert``, ``negative_prompt``: :class:`WanModel`).

    Raises:
        FileNotFoundError, ValueError: as :func:`model_class` and the family's constructor.
        TypeError: naming the family's options, for one it does not take.
    """
    adapter = model_class(path)
    named = inspect.signature(adapter).parameters  # a video family's num_frames, expert, negative_prompt
    adapter.check_option_names([name for name in options if name not in named])  # TypeError, before building
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
