"""A registered reward's options, checked without importing the rewards: torch-free.

The reward modules import torch (about 2 s) and some a model library (open_clip, transformers: seconds more), so that
building a reward with a missing or misspelt option fails only after those imports. This module checks the options
first, from what the rewards declare, never from a copy of it:

- :func:`factory_options`: the options of the factory registered as NAME (``@register_reward("NAME")``), read from
  its signature in the rewards' source files (``ast``), without importing them;
- :data:`OPTION_CHECKS`: a reward's own cheap checks (a weights file that is not there, a choice out of range), which
  its factory runs too, before its heavy imports;
- :func:`check_options`: both, for ``flowrl score``, ``serve-reward``, ``eval --reward`` and ``train``, which run it
  before the rewards import.

Imports only the standard library (``huggingface_hub``, which imports no torch, inside the cache look-ups) and nothing
of its own package, so that :func:`flowrl.cli` can load it without executing ``flowrl.rewards``' ``__init__`` (which
imports every reward); ``rewards.base`` re-exports its errors.
"""

from __future__ import annotations

import ast
import functools
import numbers
import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

__all__ = [
    "HPS_FILES",
    "HPS_REPO",
    "OPTION_CHECKS",
    "PICKSCORE_MODEL",
    "PICKSCORE_PROCESSOR",
    "FactoryOptions",
    "RewardError",
    "RewardTypeError",
    "check_batch_size",
    "check_folder",
    "check_options",
    "factory_options",
    "hps_checkpoint",
    "is_integer",
]


class RewardError(RuntimeError):
    """A reward raised an exception of its own while scoring; the message is ``reward NAME raised TYPE: message``
    and the original exception is chained (``__cause__``)."""


class RewardTypeError(TypeError):
    """A reward spec, option or returned score of the wrong type (bad input, not a bug); the message names the
    reward and what was expected."""


class FactoryOptions(NamedTuple):
    """The keyword options of a registered reward factory, as its signature declares them.

    Attributes:
        names (`tuple[str, ...]`): every option, in the signature's order.
        required (`tuple[str, ...]`): those without a default.
        any_other (`bool`): the factory takes ``**options`` too (any other name is accepted).
    """

    names: tuple[str, ...]
    required: tuple[str, ...]
    any_other: bool


def _registers(node: ast.expr, name: str) -> bool:
    """Whether `node` is the call ``register_reward("NAME", ...)``."""
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "register_reward"
        and bool(node.args)
        and isinstance(node.args[0], ast.Constant)
        and node.args[0].value == name
    )


def _parameters(arguments: ast.arguments, skip: int = 0) -> FactoryOptions:
    """The options of a ``def``: its keyword parameters, less the first `skip` (``self`` of an ``__init__``)."""
    positional = [*arguments.posonlyargs, *arguments.args]
    first_default = len(positional) - len(arguments.defaults)
    options = [
        (a.arg, i < first_default)
        for i, a in enumerate(positional)
        if i >= max(skip, len(arguments.posonlyargs))  # positional-only parameters take no keyword
    ]
    options += [(a.arg, default is None) for a, default in zip(arguments.kwonlyargs, arguments.kw_defaults)]
    return FactoryOptions(
        tuple(n for n, _ in options), tuple(n for n, required in options if required), arguments.kwarg is not None
    )


def _init_options(cls: ast.ClassDef) -> FactoryOptions | None:
    """The options of a reward class registered as its own factory: its ``__init__``'s, less ``self``; None when it
    defines none (it inherits one: not read here)."""
    for node in cls.body:
        if isinstance(node, ast.FunctionDef) and node.name == "__init__":
            return _parameters(node.args, skip=1)
    return None


def _registered(tree: ast.Module, name: str) -> FactoryOptions | None:
    """The options of the factory a module registers as `name` (a decorated ``def`` or class, or
    ``x = register_reward("NAME", ...)(Class)``), or None when it registers none of that name."""
    classes = {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and any(_registers(d, name) for d in node.decorator_list):
            return _parameters(node.args) if isinstance(node, ast.FunctionDef) else _init_options(node)
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and _registers(node.value.func, name):
            target = node.value.args[0] if node.value.args else None
            if isinstance(target, ast.Name) and target.id in classes:
                return _init_options(classes[target.id])
    return None


@functools.cache
def _sources() -> tuple[tuple[Path, str], ...]:
    """This package's modules and their text, read once per process (:func:`factory_options` checks every reward of a
    config against them)."""
    return tuple(
        (path, path.read_text(encoding="utf-8")) for path in sorted(Path(__file__).resolve().parent.rglob("*.py"))
    )


def factory_options(name: str) -> FactoryOptions | None:
    """The options of the built-in reward `name`, read from the signature of the factory that a module of this
    package registers under that name (``@register_reward("NAME", ...)``); nothing is imported.

    Args:
        name (`str`): a reward name (``"hpsv2"``); a dotted path or an entry point's name is none of this package's.

    Returns:
        :class:`FactoryOptions`, or None when no module here registers `name` (a user's reward, a plug-in, a typo:
        :func:`rewards.build_reward` names those). A ``__signature__`` a module sets on a ``def (**options)`` after
        it is not seen: such a factory accepts any option here, and :func:`rewards.build_reward` checks them.
    """
    if not isinstance(name, str) or not re.fullmatch(r"[\w.-]+", name):
        return None
    for path, text in _sources():
        if f'"{name}"' in text and "register_reward(" in text:
            found = _registered(ast.parse(text, str(path)), name)
            if found is not None:
                return found
    return None


def is_integer(value: Any) -> bool:
    """Whether `value` is an integer option: a Python or numpy integer, and not a bool.

    Rewards use it to validate integer options (a JPEG quality, a batch size, a GenEval count), so that
    `True`, `2.0` or `"2"` from a config are refused up front rather than failing deep inside a call.

    Args:
        value: anything.

    Returns:
        `bool`: True for `int` and `numpy.integer` values other than `bool` (`numpy.bool_` is no `numbers.Integral`).
    """
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_batch_size(batch_size: Any, reward: str) -> int | None:
    """A reward's ``batch_size`` option (images per model forward): an integer >= 1, or None for all at once.

    Returns:
        `batch_size`, unchanged.

    Raises:
        ValueError: naming `reward`, for anything else.
    """
    if batch_size is not None and (not is_integer(batch_size) or batch_size < 1):
        raise ValueError(f"{reward}: batch_size must be an integer >= 1 or null, got {batch_size!r}")
    return batch_size


_HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")


def cached_snapshot(repo_id: str) -> Path | None:
    """The local Hugging Face cache's snapshot folder of hub model `repo_id`, or None (never downloads)."""
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, local_files_only=True))
    except (OSError, ValueError):  # LocalEntryNotFoundError, HFValidationError
        return None


def check_folder(path: str | os.PathLike, what: str, need_config: bool, reward: str = "clipscore") -> Path:
    """A local folder, or the cached snapshot of a hub id such as `openai/clip-vit-large-patch14`.

    Args:
        path (`str` or path): the option's value. what (`str`): the option's name, for the error.
        need_config (`bool`): the folder must hold a ``config.json`` (a transformers model).
        reward (`str`): the reward's name, for the error.

    Returns:
        `Path`: the folder.

    Raises:
        FileNotFoundError: `path` is neither (or has no `config.json` when `need_config`); the
            message starts with `reward` and names `what`.
    """
    folder = Path(path)
    if not folder.is_dir():
        cached = cached_snapshot(str(path)) if _HUB_ID.fullmatch(str(path)) and not folder.exists() else None
        if cached is None:
            raise FileNotFoundError(
                f"{reward}: {what} '{path}' is not a local folder or a hub id in the local Hugging Face cache; "
                "download it first (e.g. `hf download <repo>` or `hf download <repo> --local-dir <folder>`)"
            )
        folder = cached
    if need_config and not (folder / "config.json").is_file():
        raise FileNotFoundError(
            f"{reward}: {what} '{path}' has no config.json; save the model with CLIPModel.save_pretrained"
        )
    return folder


def clip_folders(
    model_path: str | os.PathLike, processor_path: str | os.PathLike | None, reward: str
) -> tuple[Path, Path]:
    """The folders of a CLIP reward (``clipscore``, ``pickscore``): `model_path` with its ``config.json``, and
    `processor_path` (default `model_path`), each local or a cached hub id (:func:`check_folder`)."""
    processor_path = model_path if processor_path is None else processor_path
    model_dir = check_folder(model_path, "model_path", need_config=True, reward=reward)
    return model_dir, check_folder(processor_path, "processor_path", need_config=False, reward=reward)


HPS_REPO = "xswu/HPSv2"
"""Hub repository holding the HPS checkpoints."""

HPS_FILES = {"v2": "HPS_v2_compressed.pt", "v2.0": "HPS_v2_compressed.pt", "v2.1": "HPS_v2.1_compressed.pt"}
"""Checkpoint file name in `HPS_REPO` for each version (`"v2.0"` is hpsv2's own spelling of `"v2"`)."""


def hps_checkpoint(
    model_path: str | os.PathLike | None = None, version: str = "v2.1", batch_size: Any = None, **_: Any
) -> Path:
    """The ``hpsv2`` reward's checkpoint file, its `version` and `batch_size` checked: `model_path` itself, the
    version's file inside it, or the local Hugging Face cache's copy of it (never downloads). Other options are
    ignored (the factory checks them).

    Raises:
        FileNotFoundError: the checkpoint is missing (the message names the file or folder, and how to download it).
        ValueError: an unknown `version`, or a `batch_size` that is not an integer >= 1 or None.
    """
    if version not in HPS_FILES:
        raise ValueError(f"hpsv2: version must be one of {sorted(HPS_FILES)}, got {version!r}")
    check_batch_size(batch_size, "hpsv2")
    filename = HPS_FILES[version]
    if model_path is None:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(HPS_REPO, filename)
        if not isinstance(cached, str):
            raise FileNotFoundError(
                f"hpsv2: no model_path given and {filename} of {HPS_REPO} is not in the local Hugging Face cache; "
                f"download it (`hf download {HPS_REPO} {filename}`) or pass model_path"
            )
        return Path(cached)
    path = Path(model_path)
    if path.is_dir():
        candidates = [path / filename, path / Path(filename).with_suffix(".safetensors").name]
        found = [c for c in candidates if c.is_file()]
        if not found:
            names = f"{candidates[0].name} or {candidates[1].name}"
            raise FileNotFoundError(f"hpsv2: model_path folder '{path}' has no {names}")
        return found[0]
    if not path.is_file():
        raise FileNotFoundError(
            f"hpsv2: model_path '{path}' not found; download {filename} (`hf download {HPS_REPO} {filename}`)"
        )
    return path


PICKSCORE_MODEL = "yuvalkirstain/PickScore_v1"
"""Hub id of the PickScore_v1 weights (a transformers `CLIPModel`)."""

PICKSCORE_PROCESSOR = "laion/CLIP-ViT-H-14-laion2B-s32B-b79K"
"""Hub id of the tokenizer and image processor PickScore was trained with."""


def clipscore_folders(
    model_path: str | os.PathLike, processor_path: Any = None, batch_size: Any = None, **_: Any
) -> tuple[Path, Path]:
    """The cheap checks of the ``clipscore`` reward's options, with its factory's defaults: `batch_size`
    (:func:`check_batch_size`) and the folders (:func:`clip_folders`). Other options are ignored."""
    check_batch_size(batch_size, "clipscore")
    return clip_folders(model_path, processor_path, "clipscore")


def pickscore_folders(
    model_path: str | os.PathLike = PICKSCORE_MODEL,
    processor_path: str | os.PathLike = PICKSCORE_PROCESSOR,
    batch_size: Any = None,
    **_: Any,
) -> tuple[Path, Path]:
    """The cheap checks of the ``pickscore`` reward's options, with its factory's defaults (the hub ids of
    PickScore_v1 and its processor, looked up in the local Hugging Face cache): as :func:`clipscore_folders`."""
    check_batch_size(batch_size, "pickscore")
    return clip_folders(model_path, processor_path, "pickscore")


OPTION_CHECKS: dict[str, Callable[..., Any]] = {
    "hpsv2": hps_checkpoint,
    "clipscore": clipscore_folders,
    "pickscore": pickscore_folders,
}
"""A reward's own cheap checks of its options (files that are not there, values out of range), by reward name: each
takes the reward's options as keywords, with its factory's defaults, and raises what its factory raises for them (the
factory runs the same checks). Run by :func:`check_options` before the rewards import."""


def check_options(name: str, options: Mapping[str, Any]) -> None:
    """Check the options of the built-in reward `name` before any reward imports: its factory's required options are
    given and every option is one it takes (:func:`factory_options`), then the reward's own cheap checks
    (:data:`OPTION_CHECKS`). A name that is no built-in reward (a dotted path, a plug-in, a typo) passes:
    :func:`rewards.build_reward` checks it when it builds it.

    Args:
        name (`str`): the reward's name. options (`Mapping[str, Any]`): its keyword options, paths resolved.

    Raises:
        RewardTypeError (a TypeError): a required option missing or an option the factory does not take (the
            message is :func:`rewards.build_reward`'s: the reward, the option, the accepted ones).
        FileNotFoundError, ValueError: from the reward's own check (a weights file that is not there, ...).
    """
    declared = factory_options(name)
    if declared is None:
        return
    missing = [key for key in declared.required if key not in options]
    unknown = [] if declared.any_other else [key for key in options if key not in declared.names]
    if missing or unknown:
        problem = (
            f"missing a required argument: {missing[0]!r}"
            if missing
            else f"got an unexpected keyword argument {unknown[0]!r}"
        )
        accepted = ", ".join(declared.names) or "(none)"
        raise RewardTypeError(f"reward {name!r}: {problem}; accepted options: {accepted}")
    check = OPTION_CHECKS.get(name)
    if check is not None:
        check(**options)
