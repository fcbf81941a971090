"""flowrl: online reinforcement learning for text-to-image and text-to-video flow and diffusion models.

The public face, imported lazily (``import flowrl.samplers`` or ``import flowrl.rewards`` loads neither the trainer nor
diffusers)::

    from flowrl import Trainer, load_config

    trainer = Trainer(load_config("configs/quickstart.yaml", ["run.seed=1"]), rewards={"mine": my_reward})
    result = trainer.train()

- :class:`Trainer`, :class:`Config`, :func:`load_config`, :class:`ConfigError`: a run from a config object
  (``flowrl config`` lists every key), with reward callables passed directly;
- :func:`load_model`: a pipeline folder as a model adapter (the family from ``model_index.json``);
- :func:`evaluate`, :func:`evaluate_reward`, :func:`generate`: GenEval-style accuracy, reward means, images;
- :func:`register_reward`, :data:`REWARDS`, :func:`build_reward`: the reward registry;
- :data:`METHODS`: ``train.method`` -> method class; :data:`KERNELS`: the transition kernels by name;
- :func:`autocast`: the precision a device computes natively (bf16 or float32).

Subpackages: :mod:`flowrl.samplers` (kernels, schedules, rollouts; torch only) and :mod:`flowrl.rewards` (reward
callables; never imports the trainer).
"""

from __future__ import annotations

import importlib

from .cpu import strict_mkl_on_intel_avx2

__version__ = "0.1.0"

strict_mkl_on_intel_avx2()  # before MKL's first call: batch-invariant matrix products on Intel CPUs running AVX2 code

_EXPORTS = {
    "Trainer": "flowrl.trainer",
    "Config": "flowrl.config",
    "ConfigError": "flowrl.config",
    "load_config": "flowrl.config",
    "load_model": "flowrl.models",
    "evaluate": "flowrl.evaluation",
    "evaluate_reward": "flowrl.evaluation",
    "generate": "flowrl.evaluation",
    "register_reward": "flowrl.rewards",
    "build_reward": "flowrl.rewards",
    "REWARDS": "flowrl.rewards",
    "METHODS": "flowrl.methods",
    "KERNELS": "flowrl.samplers",
    "autocast": "flowrl.precision",
}
"""Public name -> the module that defines it (imported on first access)."""

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    """Import a public name's module on first access (PEP 562)."""
    if name not in _EXPORTS:
        raise AttributeError(f"module 'flowrl' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
