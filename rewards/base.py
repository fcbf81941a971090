"""The reward contract, the registry of named rewards, and their weighted combination.

A reward is a plain callable::

    scores = reward(images, prompts, metadata)   # (B, 3, H, W) in [0, 1] -> (B,) float32 on CPU

Weights live in the config and are applied by `WeightedSum`, never inside a reward.
This module imports nothing from `flowrl` or `samplers`.
"""

from __future__ import annotations

import importlib
import inspect
import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple, Protocol

import numpy as np
import torch

__all__ = [
    "REWARDS",
    "CombinedScores",
    "Reward",
    "RewardError",
    "RewardTypeError",
    "WeightedSum",
    "build_reward",
    "check_inputs",
    "check_scores",
    "is_integer",
    "register_reward",
    "reward_name",
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
    """

    name: str

    def __call__(
        self, images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]]
    ) -> torch.Tensor: ...


class RewardError(RuntimeError):
    """A reward raised an exception of its own while scoring; the message is ``reward NAME raised TYPE: message``
    and the original exception is chained (``__cause__``)."""


class RewardTypeError(TypeError):
    """A reward spec, option or returned score of the wrong type (bad input, not a bug); the message names the
    reward and what was expected."""


RewardFactory = Callable[..., Reward]
"""A callable taking keyword options from the config (e.g. `model_path=`, `device=`) and returning
a `Reward`."""

REWARDS: dict[str, RewardFactory] = {}
"""Registered reward factories by name; filled by `register_reward` when `rewards` is imported."""


def register_reward(name: str) -> Callable[[RewardFactory], RewardFactory]:
    """Decorator adding a reward factory to `REWARDS` under `name`.

    Args:
        name (`str`): the name configs use to ask for this reward.

    Returns:
        A decorator that registers the factory and returns it unchanged.

    Raises:
        ValueError: if `name` is empty, contains `:`, or is already registered to another factory.
    """
    if not name or ":" in name:
        raise ValueError(f"reward name must be non-empty and contain no ':' (got {name!r})")

    def decorator(factory: RewardFactory) -> RewardFactory:
        if REWARDS.get(name, factory) is not factory:
            raise ValueError(f"reward name {name!r} is already registered to {REWARDS[name]!r}")
        REWARDS[name] = factory
        return factory

    return decorator


def reward_name(reward: Callable) -> str:
    """The reward's `name` attribute, else its `__name__`, else its class name (for error messages)."""
    return getattr(reward, "name", None) or getattr(reward, "__name__", None) or type(reward).__name__


def _import_dotted(spec: str) -> Any:
    """Resolve `'package.module:attr'` (the attribute may be dotted, e.g. `'mod:Class.method'`)."""
    module_name, _, attr_path = spec.partition(":")
    if not module_name or not attr_path:
        raise ValueError(f"reward spec {spec!r} must look like 'package.module:function'")
    try:
        obj = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        # Only translate the error when the module itself is missing, not one of its imports.
        if err.name is None or not (module_name + ".").startswith(err.name + "."):
            raise
        raise ValueError(f"reward spec {spec!r}: module {module_name!r} not found ({err})") from err
    for part in attr_path.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"reward spec {spec!r}: {getattr(obj, '__name__', type(obj).__name__)!r} has no attribute {part!r}")
        obj = getattr(obj, part)
    return obj


def build_reward(spec: str, **kwargs: Any) -> Reward:
    """Build a reward from a registered name or a user's dotted path.

    Args:
        spec (`str`): a name in `REWARDS` (e.g. `"clipscore"`), or `"package.module:attr"`. A dotted
            path names the reward callable itself when no `kwargs` are given, and a factory called
            with `kwargs` otherwise.
        **kwargs: options passed to the factory (e.g. `model_path="/ckpt/PickScore_v1"`).

    Returns:
        The reward callable.

    Raises:
        ValueError: unknown name (the message lists the registered names), or a dotted path whose
            module or attribute is missing (the message names it).
        RewardTypeError (a TypeError): `spec` is not a string, an option the factory does not accept (the
            message lists the accepted ones), or the named or built object is not callable.
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
    else:
        known = ", ".join(sorted(REWARDS)) or "(none)"
        raise ValueError(
            f"unknown reward {spec!r}; registered rewards: {known}; "
            "or give your own as 'package.module:function'"
        )

    try:
        inspect.signature(target).bind(**kwargs)
    except TypeError as err:
        params = inspect.signature(target).parameters
        accepted = ", ".join(p for p in params if params[p].kind is not inspect.Parameter.VAR_KEYWORD)
        raise RewardTypeError(f"reward {spec!r}: {err}; accepted options: {accepted or '(none)'}") from None
    except ValueError:  # some builtins have no signature; let the call itself complain
        pass
    reward = target(**kwargs)
    if not callable(reward):
        raise RewardTypeError(f"reward factory {spec!r} returned a {type(reward).__name__}, not a callable")
    return reward


def is_integer(value: Any) -> bool:
    """Whether `value` is an integer option: a Python or numpy integer, and not a bool.

    Rewards use it to validate integer options (a JPEG quality, a batch size, a GenEval count), so that
    `True`, `2.0` or `"2"` from a config are refused up front rather than failing deep inside a call.

    Args:
        value: anything.

    Returns:
        `bool`: True for `int` and `numpy.integer` values other than `bool`/`numpy.bool_`.
    """
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def check_inputs(images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[Mapping]) -> None:
    """Check the reward inputs agree with the contract of `Reward`.

    Args:
        images (`torch.Tensor` of shape `(B, 3, H, W)`, floating point, values in `[0, 1]`, any device).
        prompts (`Sequence[str]` of length `B`).
        metadata (`Sequence[Mapping]` of length `B`).

    Raises:
        TypeError: `images` is not a floating-point tensor, a prompt is not a `str`, or a metadata
            entry is not a mapping (the message gives its index).
        ValueError: `images` is not `(B, 3, H, W)`, has values outside `[0, 1]` or non-finite values,
            or `prompts` or `metadata` does not have length `B`.
    """
    if not isinstance(images, torch.Tensor) or not images.is_floating_point():
        got = f"{images.dtype} tensor" if isinstance(images, torch.Tensor) else type(images).__name__
        raise TypeError(f"images must be a floating-point torch.Tensor, got {got}")
    if images.ndim != 4 or images.shape[1] != 3:
        raise ValueError(f"images must have shape (B, 3, H, W), got {tuple(images.shape)}")
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
            raise ValueError("images contain NaN or inf (a diverged policy or decoder?); rewards need values in [0, 1]")
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
            if isinstance(weight, (bool, np.bool_)) or not isinstance(weight, numbers.Real) or not math.isfinite(weight):
                raise ValueError(f"reward {key!r} has weight {weight!r}; weights must be finite numbers")
            self.rewards[key] = (reward, float(weight))

    def __call__(
        self, images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]]
    ) -> CombinedScores:
        """Score a batch with every reward.

        Args:
            images, prompts, metadata: as in `Reward` (`(B, 3, H, W)` in `[0, 1]`, `B` prompts,
                `B` dicts).

        Returns:
            `CombinedScores(total, per_reward)`, all `(B,)` float32 on CPU.

        Raises:
            TypeError / ValueError: malformed inputs (see `check_inputs`) or a reward returning a
                malformed score (see `check_scores`; the message names the reward).
        """
        check_inputs(images, prompts, metadata)
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
