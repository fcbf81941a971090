"""The parts every config section is built from: :class:`ConfigError`, the checks that raise it naming the key,
:func:`config_key` (turn a ValueError into one), and :func:`setting` (a dataclass field with its help text, which
``flowrl config`` prints).

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
