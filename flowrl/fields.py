"""The parts every config section is built from: :class:`ConfigError`, the checks that raise it naming the key,
:func:`config_key` (turn a ValueError into one), :func:`setting` (a dataclass field with its help text, which
``flowrl config`` prints), and :func:`config_section` (a method's or a rollout shape's settings, registered as a
section of ``train.*`` or ``sampling.*`` from its own file).

Imports nothing of flowrl and nothing heavy, so that the sections can live next to the code they configure (a rollout
shape's settings in its module, a method's in its file) without import cycles.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any


class ConfigError(ValueError):
    """A configuration value or key is wrong; the message names the key and what was expected."""


def check(cond: bool, key: str, expected: str, value: Any) -> None:
    """Raise :class:`ConfigError` ``config key 'KEY' must be EXPECTED, got VALUE`` unless `cond`."""
    if not cond:
        raise ConfigError(f"config key '{key}' must be {expected}, got {value!r}")


@contextlib.contextmanager
def config_key(key: str, errors: tuple[type[BaseException], ...] = (ValueError,)):
    """Re-raise an error of `errors` (``ValueError``) raised inside the block as :class:`ConfigError`
    ``config key 'KEY': message``; a ConfigError passes unchanged (it names its key already).

    Example::

        with config_key("model.resolution"):
            adapter.check_resolution(path, cfg.model.resolution)
    """
    try:
        yield
    except ConfigError:
        raise
    except errors as e:
        raise ConfigError(f"config key '{key}': {e}") from None


def setting(default: Any = dataclasses.MISSING, help: str = "", *, factory: Any = dataclasses.MISSING):
    """A config field with its help text (``metadata["help"]``, what ``flowrl config`` prints): ``setting(0.7, "...")``,
    or ``setting(factory=list, help="...")`` for a mutable default."""
    if factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=factory, metadata={"help": help})
    return dataclasses.field(default=default, metadata={"help": help})


def field_help(cls: type, name: str) -> str:
    """The help text of field `name` of the dataclass `cls` (empty when it has none)."""
    for f in dataclasses.fields(cls):
        if f.name == name:
            return f.metadata.get("help", "")
    raise KeyError(f"{cls.__name__} has no field {name!r}")


def precision_value(value: Any) -> Any:
    """A precision key's value with YAML's reading of a bare ``no`` (false) turned back into ``"no"``."""
    return "no" if value in ("False", "false", "none", False) else value


SECTIONS: dict[str, dict[str, tuple[type, str]]] = {"train": {}, "sampling": {}}
"""The settings sections the methods and rollout shapes bring, by parent: ``SECTIONS["train"]["nft"] = (NFTConfig,
help)`` is the config's ``train.nft``. :mod:`flowrl.config` makes each a field of ``TrainConfig`` / ``SamplingConfig``
(:func:`config_section` registers them)."""


def config_section(parent: str, name: str, help: str):
    """Class decorator: register a settings dataclass as the config section ``PARENT.NAME`` (``train.nft``,
    ``sampling.window``), so that a method or a rollout shape keeps its settings in its own file and the config needs
    no edit to take them.

    Args:
        parent (`str`): ``"train"`` (a method's settings) or ``"sampling"`` (a rollout shape's).
        name (`str`): the section's key. help (`str`): its help text (``flowrl config``).

    Raises:
        ValueError: (when it decorates) an unknown `parent`, or a section of that name registered already.
    """

    def register(cls: type) -> type:
        if parent not in SECTIONS:
            raise ValueError(f"config section parent {parent!r}: expected one of {sorted(SECTIONS)}")
        if name in SECTIONS[parent]:
            raise ValueError(f"config section '{parent}.{name}' is registered already ({SECTIONS[parent][name][0]})")
        SECTIONS[parent][name] = (cls, help)
        return cls

    return register
