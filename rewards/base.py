"""The reward contract, the registry of named rewards, and their weighted combination.

A reward is a plain callable::

    scores = reward(images, prompts, metadata)   # (B, 3, H, W) in [0, 1] -> (B,) float32 on CPU

Weights live in the config and are applied by `WeightedSum`, never inside a reward.
This module imports nothing else of flowrl (the samplers, the trainer).
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import math
import numbers
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple, Protocol

import numpy as np
import torch

from .options import RewardError, RewardTypeError, check_batch_size, is_integer  # torch-free: the CLI checks first

__all__ = [
    "REWARDS",
    "CombinedScores",
    "Reward",
    "RewardError",
    "RewardTypeError",
    "WeightedSum",
    "build_reward",
    "check_batch_size",
    "check_inputs",
    "check_scores",
    "accepts_video",
    "is_integer",
    "register_reward",
    "reward_name",
    "score_in_chunks",
]


class Reward(Protocol):
    """What every reward is: a callable scoring one image per prompt.

    Args:
        images (`torch.Tensor` of shape `(B, 3, H, W)`, floating point, values in `[0, 1]`):
            RGB images, on any device.
        prompts (`Sequence[str]` of length `B`):
            The prompt each image was generated from.
        metadata (`Sequence[Mapping]` of length `B`):
            One GenEval-style dict per image (e.g. `{"tag": "counting", "include": [...]}`);
            rewards that need none accept empty dicts.

    Returns:
        `torch.Tensor` of shape `(B,)`, float32, on CPU: one finite score per image, higher is
        better. Units and range are the reward's own (documented by each reward). A reward never
        returns NaN, inf or a sentinel value; it raises instead.

    Attributes:
        name (`str`): a short identifier used in error messages. Plain functions may omit it; their
            `__name__` is used (see `reward_name`).
        accepts_video (`bool`, *optional*): True for a reward that scores videos: `images` is then a
            `(B, F, 3, H, W)` tensor in `[0, 1]` (`F` frames) and the scores are one per video. Absent
            means False (see `accepts_video`); an image reward scores videos through
            `rewards.video.frames`.
    """

    name: str

    def __call__(
        self, images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]]
    ) -> torch.Tensor: ...


RewardFactory = Callable[..., Reward]
"""A callable taking keyword options from the config (e.g. `model_path=`, `device=`) and returning
a `Reward`."""

REWARDS: dict[str, RewardFactory] = {}
"""Registered reward factories by name; filled by `register_reward` when `rewards` is imported."""


MODALITIES = ("image", "video", "image, video")
"""What a reward scores, as `register_reward(modality=...)` declares it: `(B, 3, H, W)` images, `(B, F, 3, H, W)`
videos (`accepts_video`), or either (a remote reward scores what its server's reward scores)."""


def register_reward(
    name: str, *, modality: str | None = None, weights: str | None = None, differentiable: bool = False
) -> Callable[[RewardFactory], RewardFactory]:
    """Decorator adding a reward factory to `REWARDS` under `name`.

    Args:
        name (`str`): the name configs use to ask for this reward.
        modality (`str`, *optional*): one of `MODALITIES`; set as the factory's `modality` attribute.
        weights (`str`, *optional*): the published weights the reward loads, in a few words (`"none"` for a
            model-free reward); set as the factory's `weights` attribute. `flowrl rewards` lists both; a
            user's factory (dotted path or entry point) may carry the same two attributes.
        differentiable (`bool`): the reward it builds has ``score_with_grad`` (the direct-reward methods can train
            on it); set as the factory's `differentiable` attribute and listed by `flowrl rewards`.

    Returns:
        A decorator that registers the factory (with those attributes) and returns it.

    Raises:
        ValueError: if `name` is empty, contains `:`, or is already registered to another factory, or
            `modality` is not one of `MODALITIES`.
    """
    if not name or ":" in name:
        raise ValueError(f"reward name must be non-empty and contain no ':' (got {name!r})")
    if modality is not None and modality not in MODALITIES:
        raise ValueError(
            f"reward {name!r}: modality must be one of {', '.join(map(repr, MODALITIES))}, got {modality!r}"
        )

    def decorator(factory: RewardFactory) -> RewardFactory:
        if REWARDS.get(name, factory) is not factory:
            raise ValueError(f"reward name {name!r} is already registered to {REWARDS[name]!r}")
        REWARDS[name] = factory
        if modality is not None:
            factory.modality = modality
        if weights is not None:
            factory.weights = weights
        factory.differentiable = differentiable
        return factory

    return decorator


def accepts_video(reward: Callable) -> bool:
    """Whether `reward` scores `(B, F, 3, H, W)` videos: its `accepts_video` attribute, False when absent."""
    return bool(getattr(reward, "accepts_video", False))


def score_in_chunks(
    score: Callable[[torch.Tensor, Sequence[str]], torch.Tensor],
    images: torch.Tensor,
    prompts: Sequence[str],
    batch_size: int | None,
) -> torch.Tensor:
    """``score(images, prompts)`` over consecutive chunks of `batch_size` images (None: one call), concatenated.

    Args:
        score: scores a chunk, `(b, ...)` images and `b` prompts -> `(b,)`.
        images (`torch.Tensor` of shape `(B, ...)`), prompts (`Sequence[str]` of length `B`).
        batch_size (`int` or None): images per call.

    Returns:
        `torch.Tensor` of shape `(B,)` (`(0,)` float32 for an empty batch).
    """
    chunks = [score(images[part], prompts[part]) for part in chunk_slices(len(prompts), batch_size)]
    return torch.cat(chunks) if chunks else torch.zeros(0)


def chunk_slices(count: int, size: int | None) -> list[slice]:
    """Slices covering ``range(count)`` in consecutive pieces of at most `size` (None: one piece)."""
    size = size or max(1, count)
    return [slice(i, i + size) for i in range(0, count, size)]


def reward_name(reward: Callable) -> str:
    """The reward's `name` attribute, else its `__name__`, else its class name (for error messages)."""
    return getattr(reward, "name", None) or getattr(reward, "__name__", None) or type(reward).__name__


def reward_spec(reward: Callable) -> str | None:
    """The ``'package.module:name'`` that :func:`build_reward` resolves to `reward` itself: a function or class at a
    module's top level (or a method, ``'module:Class.method'``), or an object a module holds by name; None for a
    lambda, a function defined inside another, a ``functools.partial``, or anything of ``__main__`` (importing a
    script again would run it). What :class:`flowrl.Trainer` records in ``config.yaml`` for a reward callable, so that
    ``flowrl train RUN/config.yaml run.resume=true`` rebuilds it."""
    module_name = getattr(reward, "__module__", None)
    module = sys.modules.get(module_name) if isinstance(module_name, str) else None
    if module is None or module_name == "__main__" or getattr(module, "__spec__", None) is None:
        return None
    if module.__spec__.name != module_name:  # a file imported by path, under another name: not importable so
        return None
    qualname = getattr(reward, "__qualname__", None)
    if isinstance(qualname, str) and "<" not in qualname:  # not '<lambda>' or 'f.<locals>.g'
        obj = module
        for part in qualname.split("."):
            obj = getattr(obj, part, None)
        if obj is reward or (obj is not None and obj == reward):  # a bound method compares equal, not identical
            return f"{module_name}:{qualname}"
    names = [name for name, value in vars(module).items() if value is reward]
    return f"{module_name}:{names[0]}" if names else None


def _import_file(spec: str, path: str) -> Any:
    """The module of the Python file `path` (``reward spec 'PATH.py:function'``), imported under its file name.

    Raises:
        ValueError: naming `spec`, for a missing file or a module that raises while importing.
    """
    import importlib.util

    file = os.path.abspath(os.path.expanduser(path))
    if not os.path.isfile(file):
        raise ValueError(f"reward spec {spec!r}: no Python file {file}")
    name = "flowrl_reward_file_" + os.path.splitext(os.path.basename(file))[0]
    module = importlib.util.module_from_spec(importlib.util.spec_from_file_location(name, file))
    sys.modules[name] = module  # dataclasses and pickling-free introspection look modules up by name
    try:
        module.__spec__.loader.exec_module(module)
    except Exception as err:  # the user's file raised while importing: named, in one line, chained
        del sys.modules[name]
        message = " ".join(str(err).split()) or "(no message)"
        raise ValueError(f"reward spec {spec!r}: importing {file} raised {type(err).__name__}: {message}") from err
    return module


def _import_dotted(spec: str) -> Any:
    """Resolve `'package.module:attr'` or `'path/to/file.py:attr'` (a reward module file, e.g. one a reward server
    runs in the reward's own environment); the attribute may be dotted, e.g. `'mod:Class.method'`."""
    module_name, _, attr_path = spec.rpartition(":") if ".py:" in spec else spec.partition(":")
    if not module_name or not attr_path:
        raise ValueError(f"reward spec {spec!r} must look like 'package.module:function' or 'file.py:function'")
    if module_name.endswith(".py"):
        obj = _import_file(spec, module_name)
    else:
        obj = _import_module(spec, module_name)
    for part in attr_path.split("."):
        if not hasattr(obj, part):
            raise ValueError(
                f"reward spec {spec!r}: {getattr(obj, '__name__', type(obj).__name__)!r} has no attribute {part!r}"
            )
        obj = getattr(obj, part)
    return obj


def _import_module(spec: str, module_name: str) -> Any:
    """The module `module_name` of ``reward spec 'package.module:function'``.

    Raises:
        ValueError: naming `spec`, for a standard-library module, a missing module or one that raises on import.
    """
    top = module_name.split(".")[0]
    if top in sys.stdlib_module_names or top == "builtins":  # a config is code, but a reward is never os:system
        raise ValueError(
            f"reward spec {spec!r} names a function of Python's standard library ({top}); a reward is a function of "
            "your own module or package"
        )
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name is None or not (module_name + ".").startswith(err.name + "."):  # one of the module's imports
            raise ValueError(f"reward spec {spec!r}: importing {module_name!r} failed: {err}") from err
        raise ValueError(f"reward spec {spec!r}: module {module_name!r} not found ({err})") from err
    except Exception as err:  # the user's module raised while importing: named, in one line, chained
        message = " ".join(str(err).split()) or "(no message)"
        raise ValueError(
            f"reward spec {spec!r}: importing {module_name!r} raised {type(err).__name__}: {message}"
        ) from err


ENTRY_POINT_GROUP = "flowrl.rewards"
"""The entry-point group of rewards installed by other packages: ``[project.entry-points."flowrl.rewards"]``
``my_reward = "my_pkg.rewards:my_reward"`` in their pyproject.toml makes `build_reward("my_reward")` work."""


def _entry_points() -> list:
    """The installed entry points of :data:`ENTRY_POINT_GROUP` (`importlib.metadata.EntryPoint` objects)."""
    from importlib import metadata

    return list(metadata.entry_points(group=ENTRY_POINT_GROUP))


def _entry_point(name: str) -> Any:
    """The object the ``flowrl.rewards`` entry point `name` names, loaded; None if no package declares it.

    Raises:
        ValueError: several installed packages declare `name`, or the entry point fails to load (named).
    """
    found = [ep for ep in _entry_points() if ep.name == name]
    if not found:
        return None
    if len({ep.value for ep in found}) > 1:
        raise ValueError(
            f"reward {name!r} is declared by several '{ENTRY_POINT_GROUP}' entry points: "
            f"{sorted({ep.value for ep in found})}; uninstall one or use 'package.module:function'"
        )
    try:
        target = found[0].load()
    except (ImportError, AttributeError) as err:
        raise ValueError(
            f"reward {name!r}: entry point {found[0].value!r} ({ENTRY_POINT_GROUP}) does not load: "
            f"{type(err).__name__}: {err}"
        ) from err
    if not callable(target):
        raise RewardTypeError(
            f"reward {name!r}: entry point {found[0].value!r} names a {type(target).__name__}, not a callable"
        )
    return target


def build_reward(spec: str, **kwargs: Any) -> Reward:
    """Build a reward from a registered name, an installed entry point or a user's dotted path.

    Args:
        spec (`str`): a name in `REWARDS` (e.g. `"clipscore"`), the name of an entry point of the
            ``flowrl.rewards`` group (:data:`ENTRY_POINT_GROUP`; registered names win), or
            `"package.module:attr"`. A dotted path or an entry point names the reward callable itself
            when no `kwargs` are given, and a factory called with `kwargs` otherwise.
        **kwargs: options passed to the factory (e.g. `model_path="/ckpt/PickScore_v1"`).

    Returns:
        The reward callable.

    Raises:
        ValueError: unknown name (the message lists the registered names and entry points), a dotted
            path whose module or attribute is missing, or an entry point that does not load (named).
        RewardTypeError (a TypeError): `spec` is not a string, an option the factory does not accept (the
            message lists the accepted ones), or the named or built object is not callable.
        RewardError: a user's or a plug-in's factory (a dotted path or an entry point) raised while building
            (``reward factory 'SPEC' raised TYPE: message``, the exception chained).
    """
    if not isinstance(spec, str):
        raise RewardTypeError(f"reward spec must be a registered name or 'package.module:function', got {spec!r}")
    if ":" in spec:
        target = _import_dotted(spec)
        if not callable(target):
            raise RewardTypeError(f"reward spec {spec!r} names a {type(target).__name__}, not a callable")
        if not kwargs:
            return target
    elif spec in REWARDS:
        target = REWARDS[spec]
    elif (target := _entry_point(spec)) is not None:
        if not kwargs:  # like a dotted path: the entry point names the reward itself, or a factory of options
            return target
    else:
        known = ", ".join(sorted(REWARDS)) or "(none)"
        plugins = ", ".join(sorted(ep.name for ep in _entry_points())) or "(none)"
        raise ValueError(
            f"unknown reward {spec!r}; registered rewards: {known}; installed '{ENTRY_POINT_GROUP}' entry points: "
            f"{plugins}; or give your own as 'package.module:function'"
        )

    try:
        inspect.signature(target).bind(**kwargs)
    except TypeError as err:
        params = inspect.signature(target).parameters
        accepted = ", ".join(p for p in params if params[p].kind is not inspect.Parameter.VAR_KEYWORD)
        raise RewardTypeError(f"reward {spec!r}: {err}; accepted options: {accepted or '(none)'}") from None
    except ValueError:  # some builtins have no signature; let the call itself complain
        pass
    if spec in REWARDS:
        reward = target(**kwargs)
    else:  # a user's or a plug-in's factory: its own exception (a GPU out of memory while loading) named in one line
        try:
            reward = target(**kwargs)
        except RewardTypeError:
            raise
        except Exception as err:
            message = " ".join(str(err).split()) or "(no message)"
            raise RewardError(f"reward factory {spec!r} raised {type(err).__name__}: {message}") from err
    if not callable(reward):
        raise RewardTypeError(f"reward factory {spec!r} returned a {type(reward).__name__}, not a callable")
    return reward


PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
"""Weight files that are pickles: no reward model loads them."""


def read_json(path: str | os.PathLike, reward: str) -> Any:
    """The JSON value of the file `path` (a model folder's ``config.json``, a converter's ``model_config.json``).

    Raises:
        FileNotFoundError: ``"{reward}: no file PATH"``.
        ValueError: ``"{reward}: PATH is not JSON (...)"`` naming the file, for one that is empty, not UTF-8, or not
            JSON: an HTML error page saved by a failed download is named as such.
    """
    import json
    from pathlib import Path

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{reward}: no file {path}")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{reward}: {path} is not JSON (not UTF-8 text: byte {e.start}, {e.reason})") from None
    if not text.strip():
        raise ValueError(f"{reward}: {path} is empty; expected JSON (download the file again)")
    try:
        return json.loads(text)
    except ValueError as e:
        html = text.lstrip()[:15].lower().startswith(("<!doctype html", "<html", "<?xml", "<head"))
        what = "an HTML page (a failed download?)" if html else f"not JSON ({e})"
        raise ValueError(f"{reward}: {path} is {what}; download the file again") from None


def check_json_files(folder: str | os.PathLike, reward: str) -> None:
    """Check that every ``*.json`` file of a model folder (``config.json``, the tokenizer's and processor's) is JSON,
    before transformers reads one and fails without naming it.

    Raises:
        ValueError: naming the file (:func:`read_json`).
    """
    from pathlib import Path

    for file in sorted(Path(folder).glob("*.json")):
        read_json(file, reward)


def check_weights_folder(folder: str | os.PathLike, reward: str) -> None:
    """Check a reward model's folder before it loads: not only pickled weights, and every ``*.safetensors`` file whole
    (its header and length, read by the safetensors library without loading a tensor).

    Args:
        folder (`str` or `PathLike`): the model's local folder.
        reward (`str`): the reward's name, for the error.

    Raises:
        ValueError: ``"{reward}: FOLDER holds only pickled weights (...)"`` for a folder of ``*.bin`` / ``*.pt`` files
            and no safetensors (they are never unpickled), or ``"{reward}: FILE is not a whole safetensors file"``
            for a truncated or mislabelled one, or a ``*.json`` file that is not JSON (:func:`check_json_files`).
    """
    from pathlib import Path

    from safetensors import SafetensorError, safe_open

    folder = Path(folder)
    check_json_files(folder, reward)
    safe = sorted(folder.glob("*.safetensors"))
    pickled = sorted(p.name for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES and p.is_file())
    if pickled and not safe:
        raise ValueError(
            f"{reward}: {folder} holds only pickled weights ({', '.join(pickled)}); flowrl loads safetensors only: "
            "load it once in a trusted environment and save_pretrained() it (transformers writes safetensors)"
        )
    for file in safe:
        try:
            with safe_open(file, framework="pt"):
                pass
        except (SafetensorError, OSError) as e:
            raise ValueError(f"{reward}: {file} is not a whole safetensors file ({e})") from None


PROGRESS_BAR_LOGGERS = ("transformers.utils.logging", "diffusers.utils.logging")
"""The libraries' logging modules whose progress bars :func:`quiet_loading` turns off (each has
``is_progress_bar_enabled``, ``disable_progress_bar`` and ``enable_progress_bar``)."""


@contextlib.contextmanager
def quiet_loading():
    """Within the block, transformers' and diffusers' progress bars are off (transformers' "Loading weights", one
    bar a model; diffusers' "Loading pipeline components"), through the libraries' own switches; after it each is as
    it was, so a caller's own loads keep their bars. Every model flowrl loads (a pipeline, a reward's network) loads
    within it: a model of a few seconds says so on flowrl's own line, not on a bar in every log. A library not
    installed is left alone."""
    turned_off = []
    for name in PROGRESS_BAR_LOGGERS:
        try:
            logging_module = importlib.import_module(name)
        except ImportError:
            continue
        if logging_module.is_progress_bar_enabled():
            logging_module.disable_progress_bar()
            turned_off.append(logging_module)
    try:
        yield
    finally:
        for logging_module in turned_off:
            logging_module.enable_progress_bar()


def load_pretrained(cls: Any, folder: str | os.PathLike, reward: str, **kwargs: Any) -> Any:
    """``cls.from_pretrained(folder)`` of a local transformers model, from safetensors only.

    Args:
        cls: a transformers model class (``CLIPModel``, ``Qwen2VLForConditionalGeneration``, ...).
        folder (`str` or `PathLike`): the model's local folder (``config.json`` and ``*.safetensors``).
        reward (`str`): the reward's name, for the error.
        **kwargs: passed to ``from_pretrained`` (``dtype``, ...).

    Raises:
        ValueError: ``"{reward}: FOLDER holds only pickled weights (...)"`` when the folder has ``*.bin`` / ``*.pt``
            files and no safetensors (they are never unpickled), or names a damaged safetensors file.
    """
    check_weights_folder(folder, reward)
    with quiet_loading():  # no "Loading weights" bar: the caller says what loads
        return cls.from_pretrained(folder, local_files_only=True, use_safetensors=True, **kwargs)


def check_inputs(
    images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[Mapping], video: bool = False
) -> None:
    """Check the reward inputs agree with the contract of `Reward`.

    Args:
        images (`torch.Tensor` of shape `(B, 3, H, W)`, or `(B, F, 3, H, W)` with `video=True`, floating
            point, values in `[0, 1]`, any device).
        prompts (`Sequence[str]` of length `B`).
        metadata (`Sequence[Mapping]` of length `B`).
        video (`bool`, default False): expect videos of `F >= 1` frames instead of images.

    Raises:
        TypeError: `images` is not a floating-point tensor, a prompt is not a `str`, or a metadata
            entry is not a mapping (the message gives its index).
        ValueError: `images` is not `(B, 3, H, W)` (or `(B, F, 3, H, W)` with `video=True`), has values
            outside `[0, 1]` or non-finite values, or `prompts` or `metadata` does not have length `B`.
    """
    if not isinstance(images, torch.Tensor) or not images.is_floating_point():
        got = f"{images.dtype} tensor" if isinstance(images, torch.Tensor) else type(images).__name__
        raise TypeError(f"images must be a floating-point torch.Tensor, got {got}")
    if video and (images.ndim != 5 or images.shape[2] != 3 or images.shape[1] < 1):
        raise ValueError(f"videos must have shape (B, F, 3, H, W) with F >= 1, got {tuple(images.shape)}")
    if not video and (images.ndim != 4 or images.shape[1] != 3):
        hint = (
            "; videos go to rewards that accept them, or wrap an image reward in 'frames'" if images.ndim == 5 else ""
        )
        raise ValueError(f"images must have shape (B, 3, H, W), got {tuple(images.shape)}{hint}")
    batch = images.shape[0]
    if len(prompts) != batch or len(metadata) != batch:
        raise ValueError(
            f"need one prompt and one metadata dict per image: {batch} images, "
            f"{len(prompts)} prompts, {len(metadata)} metadata"
        )
    for i, (prompt, meta) in enumerate(zip(prompts, metadata)):
        if not isinstance(prompt, str):
            raise TypeError(f"prompts[{i}] must be a str, got {type(prompt).__name__}")
        if not isinstance(meta, Mapping):
            raise TypeError(f"metadata[{i}] must be a dict (use {{}} when there is none), got {type(meta).__name__}")
    if batch and images.numel():
        if not bool(torch.isfinite(images).all()):
            raise ValueError(
                "images contain NaN or inf (a diverged policy or decoder?); rewards need values in [0, 1]"
            )
        low, high = images.aminmax()
        if low < 0 or high > 1:
            raise ValueError(
                f"images must lie in [0, 1], got [{low.item():.3g}, {high.item():.3g}]; "
                "map decoder output with (x / 2 + 0.5).clamp(0, 1)"
            )


def check_scores(name: str, scores: Any, batch_size: int) -> torch.Tensor:
    """Convert a reward's output to a `(B,)` float32 CPU tensor, refusing anything malformed.

    Args:
        name (`str`): the reward's name, used in error messages.
        scores (`torch.Tensor`, `numpy.ndarray` or sequence of numbers): what the reward returned.
        batch_size (`int`): `B`, the number of images scored.

    Returns:
        `torch.Tensor` of shape `(B,)`, float32, on CPU, detached.

    Raises:
        RewardTypeError (a TypeError): `scores` cannot be read as numbers.
        ValueError: the shape is not `(B,)`, or some value is NaN or infinite (the message counts
            them and gives their indices).
    """
    try:
        if isinstance(scores, torch.Tensor):
            out = scores.detach().to(device="cpu", dtype=torch.float32)
        else:
            out = torch.as_tensor(np.asarray(scores, dtype=np.float32))
    except (TypeError, ValueError, RuntimeError) as err:
        kind = type(scores).__name__
        raise RewardTypeError(f"reward {name!r} returned {kind} that is not numeric: {err}") from None
    if out.shape != (batch_size,):
        raise ValueError(
            f"reward {name!r} returned scores of shape {tuple(out.shape)}; expected ({batch_size},), "
            "one float per image"
        )
    problems = []
    for label, mask in (("NaN", out.isnan()), ("inf", out.isinf())):
        if mask.any():
            idx = mask.nonzero().flatten().tolist()
            shown = idx[:8] + (["..."] if len(idx) > 8 else [])
            problems.append(f"{len(idx)} {label} scores (at {shown})")
    if problems:
        raise ValueError(
            f"reward {name!r} returned {' and '.join(problems)} of {batch_size}; "
            "rewards must be finite (raise instead of returning sentinels)"
        )
    return out


class CombinedScores(NamedTuple):
    """Output of `WeightedSum`.

    Attributes:
        total (`torch.Tensor` of shape `(B,)`, float32, CPU): `sum_k weight_k * scores_k`.
        per_reward (`dict[str, torch.Tensor]`, each `(B,)` float32 CPU): the unweighted scores of
            each reward, keyed by its name in the config (log them as `reward/<name>/mean`).
    """

    total: torch.Tensor
    per_reward: dict[str, torch.Tensor]


class WeightedSum:
    """Call several rewards on the same batch and sum their scores with fixed weights.

    Args:
        rewards (`Mapping[str, tuple[Reward, float]]`): name -> (reward callable, weight). Names
            are free-form (typically the config keys) and become the keys of `per_reward`.

    Raises:
        ValueError: `rewards` is empty, or a weight is not a finite number.
        TypeError: a reward is not callable.
    """

    def __init__(self, rewards: Mapping[str, tuple[Callable, float]]):
        if not rewards:
            raise ValueError("WeightedSum needs at least one reward")
        self.rewards: dict[str, tuple[Callable, float]] = {}
        for key, (reward, weight) in rewards.items():
            if not callable(reward):
                raise RewardTypeError(f"reward {key!r} is a {type(reward).__name__}, not a callable")
            if (
                isinstance(weight, (bool, np.bool_))
                or not isinstance(weight, numbers.Real)
                or not math.isfinite(weight)
            ):
                raise ValueError(f"reward {key!r} has weight {weight!r}; weights must be finite numbers")
            self.rewards[key] = (reward, float(weight))

    def __call__(
        self, images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]]
    ) -> CombinedScores:
        """Score a batch with every reward.

        Args:
            images, prompts, metadata: as in `Reward` (`(B, 3, H, W)` images or `(B, F, 3, H, W)`
                videos in `[0, 1]`, `B` prompts, `B` dicts).

        Returns:
            `CombinedScores(total, per_reward)`, all `(B,)` float32 on CPU.

        Raises:
            TypeError / ValueError: malformed inputs (see `check_inputs`), videos given to a reward
                without `accepts_video` (the message names it), or a reward returning a malformed
                score (see `check_scores`; the message names the reward).
        """
        video = isinstance(images, torch.Tensor) and images.ndim == 5
        check_inputs(images, prompts, metadata, video=video)
        for key, (reward, _) in self.rewards.items() if video else ():
            if not accepts_video(reward):
                raise ValueError(
                    f"reward {key!r} scores images, not (B, F, 3, H, W) videos; score its frames with "
                    f"rewards.frames (config: reward 'frames' with option reward: {key})"
                )
        batch = images.shape[0]
        total = torch.zeros(batch, dtype=torch.float32)
        per_reward = {}
        for key, (reward, weight) in self.rewards.items():
            try:
                raw = reward(images, prompts, metadata)
            except Exception as err:  # the reward's own failure (a bug in it, a server down): named, chained
                message = " ".join(str(err).split()) or "(no message)"
                raise RewardError(f"reward {key} raised {type(err).__name__}: {message}") from err
            scores = check_scores(key, raw, batch)
            per_reward[key] = scores
            total += weight * scores
        return CombinedScores(total, per_reward)

    def __repr__(self) -> str:
        parts = ", ".join(f"{k}={reward_name(r)}*{w:g}" for k, (r, w) in self.rewards.items())
        return f"WeightedSum({parts})"
