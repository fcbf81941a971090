"""Deferred imports for the ``flowrl`` command: ``import torch`` binds a placeholder module that executes torch on the
first attribute read, so that a command refused for a bad argument, config key, prompt file or output path answers
before torch (about 2 s) has loaded.

The placeholder is the module object torch then loads into (as :class:`importlib.util.LazyLoader`'s): every name
bound by ``import torch`` before the load sees the loaded torch after it. Unlike ``LazyLoader`` (Python 3.11), the
import statement's own read of ``__spec__`` does not load the module, so that ``import torch`` at the top of a module
costs nothing until torch is used. Only :func:`flowrl.cli.main` defers, and only modules not imported yet: a script
that imports flowrl gets the usual eager imports. Imports nothing heavy.
"""

from __future__ import annotations

import importlib.util
import sys
import threading
import types

_AS_IS = frozenset({"__spec__", "__name__", "__class__"})
"""Attributes read without loading: the import statement reads ``__spec__`` (is the module still initialising?)."""

_LOCK = threading.RLock()
_LOADING: set[str] = set()


class DeferredModule(types.ModuleType):
    """A module not executed yet: the first read of an attribute (other than ``__spec__``, ``__name__``) executes it
    in place, after which the object is a plain module. One thread executes it; the others wait for it."""

    def __getattribute__(self, attr: str):
        if attr in _AS_IS:
            return types.ModuleType.__getattribute__(self, attr)
        spec = types.ModuleType.__getattribute__(self, "__spec__")
        with _LOCK:
            if type(self) is DeferredModule and spec.name not in _LOADING:
                _LOADING.add(spec.name)
                try:
                    spec.loader.exec_module(self)
                except BaseException:  # as a failed import: a later `import` starts afresh
                    sys.modules.pop(spec.name, None)
                    raise
                finally:
                    _LOADING.discard(spec.name)
                self.__class__ = types.ModuleType
        # the loaded module, or the names set so far while its own code reads it (torch importing torch)
        return types.ModuleType.__getattribute__(self, attr)


def defer(*names: str) -> list[str]:
    """Put a :class:`DeferredModule` in ``sys.modules`` for each top-level module of `names` that is installed and
    not imported yet; returns those deferred (a module already imported, or not installed, is left alone)."""
    deferred = []
    for name in names:
        if "." in name:
            raise ValueError(f"defer({name!r}): expected a top-level module name")
        if name in sys.modules:
            continue
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            continue
        module = importlib.util.module_from_spec(spec)  # sets __spec__, __file__, __path__: executes nothing
        module.__class__ = DeferredModule
        sys.modules[name] = module
        deferred.append(name)
    return deferred


def is_deferred(name: str) -> bool:
    """Whether module `name` is in ``sys.modules`` and not executed yet."""
    return type(sys.modules.get(name)) is DeferredModule
