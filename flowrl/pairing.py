"""A run's model family and method, checked against the config and each other before any weight loads.

The families (:mod:`flowrl.models`) import neither the config nor the methods: a family declares what it supports as
class flags (``FORWARD_PROCESS``, ``VAE_INVERSE``, ``TEXT_ONLY``: :data:`flowrl.models.base.CAPABILITIES`), a method
names what it needs (:attr:`flowrl.methods.base.Method.requires`), and this module, above both, pairs them:
:func:`check_pairing` refuses a method a family cannot run in one line, :func:`resolve_model` finds a config's
family and fills in the model's own settings, and :func:`build_model` loads it.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .fields import ConfigError, config_key
from .files import check_model_folder, resolve_path
from .methods import METHODS
from .models import FAMILIES, FlowModel, build_adapter, model_class

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""``model.dtype`` -> the torch dtype of the frozen components."""

REFUSALS = {
    "forward_process": (
        "config key 'train.method': {method!r} ({cls}) needs a flow-matching model (it trains the flow-matching loss on "
        "clean samples); model.path {path} is a {pipeline} ({family}), whose latents do not follow the flow-matching "
        "forward process: use train.method {methods}"
    ),
    "vae_inverse": (
        "train.method {method!r} encodes its images with the VAE; the {family} family's latents are its own "
        "(built: {families})"
    ),
    "text_only": (
        "train.method {method!r}: {family} edits source images (read from each prompt record); data sets with a "
        "source image per row are not built (built: {families})"
    ),
}
"""For each capability a method may need (:data:`flowrl.models.base.CAPABILITIES`), the one-line refusal of a family
without it: ``method`` (its ``train.method``), ``cls`` (its class), ``path`` (``model.path``), ``pipeline`` and
``family`` (the family's pipeline and class), ``methods`` (what the family runs instead) and ``families`` (the families
the method runs on)."""


def check_pairing(method: type, family: type[FlowModel], path: str | Path) -> None:
    """Refuse the method class ``method`` (a registered :class:`flowrl.methods.base.Method`) on the family ``family``
    when the family lacks a capability the method ``requires``, in the order the method lists them.

    Args:
        method: ``METHODS[cfg.train.method]``. family: the family class of ``model.path``. path: ``model.path``, for the
            message.

    Raises:
        ConfigError: one line naming ``train.method``, the family and what it lacks, listing the methods the family
            runs instead (or the families the method runs on).
    """
    for need in method.requires:
        if not family.supports(need):
            runs = [name for name, m in METHODS.items() if all(family.supports(r) for r in m.requires)]
            on = [f.__name__ for f in FAMILIES.values() if all(f.supports(r) for r in method.requires)]
            raise ConfigError(
                REFUSALS[need].format(
                    method=method.name,
                    cls=method.__name__,
                    path=path,
                    pipeline=family.PIPELINE,
                    family=family.__name__,
                    methods=", ".join(runs),
                    families=", ".join(on) or "none",
                )
            )


def resolve_model(cfg) -> type[FlowModel]:
    """The family of ``model.path`` (a :class:`flowrl.config.Config`'s), with the model's shift and prompt length filled
    into `cfg` where unset (the saved config.yaml records them), every value checked before any weight loads: the folder,
    the resolution, the video settings, the family's options, the method against the family (:func:`check_pairing`),
    the family's own checks, the shift and the prompt length.

    Raises:
        ConfigError: naming ``model.path`` (with the damaged file: broken JSON, truncated or pickled weights),
            ``model.resolution``, ``train.method``, ``sampling.shift`` or ``model.max_sequence_length``.
        FileNotFoundError: a model path that is not a pipeline folder.
    """
    path = resolve_path(cfg.model.path)
    with config_key("model.path"):
        check_model_folder(path)  # readable JSON, whole safetensors weights (no pickles), before anything loads
        adapter = model_class(path)  # the family, from model_index.json
    with config_key("model.resolution"):
        adapter.check_resolution(path, cfg.model.resolution)
    _check_model_keys(cfg, adapter, path)
    check_pairing(METHODS[cfg.train.method], adapter, cfg.model.path)  # what the method needs of the family
    adapter.check_config(cfg)  # the family's own settings (the DDPM family: no Flash re-spacing, no shift)
    if cfg.sampling.shift is None:  # the model's own schedule (after the frame count's check); config.yaml records it
        with config_key("sampling.shift", (ValueError, FileNotFoundError)):
            frames = {"num_frames": cfg.model.num_frames} if adapter.VIDEO else {}  # LTX-Video: per frame count
            cfg.sampling.shift = adapter.scheduler_shift(path, cfg.model.resolution, **frames)
    if cfg.model.max_sequence_length is None:  # SD3: 256 with a T5 encoder, 0 without (the tiny model); FLUX 512
        cfg.model.max_sequence_length = adapter.default_max_sequence_length(path)
    with config_key("model.max_sequence_length"):
        adapter.check_prompt_length(path, cfg.model.max_sequence_length)
    return adapter


def build_model(cfg, family: type[FlowModel], device: torch.device) -> FlowModel:
    """The model a config names, loaded: ``family`` (from :func:`resolve_model`, which checked every setting) built on
    ``model.path`` with the config's dtype, prompt length, resolution, the video settings of a video family and the
    family's ``model.options``.

    Raises:
        ValueError: naming the folder, for a component whose ``config.json`` does not build
            (:func:`flowrl.models.build_adapter`).
    """
    m = cfg.model
    video = dict(num_frames=m.num_frames, expert=m.expert, negative_prompt=m.negative_prompt) if family.VIDEO else {}
    path, dtype = resolve_path(m.path), DTYPES[m.dtype]
    return build_adapter(family, path, device, dtype, m.max_sequence_length, m.resolution, **video, **m.options)


def _check_model_keys(cfg, adapter: type[FlowModel], path: Path) -> None:
    """Refuse the video settings (``model.num_frames``, ``expert``, ``negative_prompt``) for an image family and a
    ``model.options`` key the family's constructor does not take.

    Raises:
        ConfigError: naming the key and, for an option, the family's options.
    """
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
