"""Online RL methods, each an object the training loop calls (:mod:`flowrl.methods.base` has the contract).

:data:`METHODS` maps ``train.method`` to its class: ``grpo`` (:class:`GRPO`: SDE rollouts of any shape in
:mod:`flowrl.methods.rollouts`, PPO on log-prob ratios) and ``nft`` (:class:`DiffusionNFT`: ODE samples and the
negative-aware flow-matching loss). A new method is a new file with a :class:`Method` subclass, added here.
"""

from __future__ import annotations

from .base import Method, Samples
from .grpo import GRPO
from .nft import DiffusionNFT
from .rollouts import GroupRollouts

METHODS: dict[str, type[Method]] = {"grpo": GRPO, "nft": DiffusionNFT}
"""``train.method`` -> the method class."""

__all__ = ["METHODS", "DiffusionNFT", "GRPO", "GroupRollouts", "Method", "Samples", "build_method"]


def build_method(cfg, model, policy, rewards) -> Method:
    """The method ``cfg.train.method`` names, built on the model adapter, policy and rewards.

    Raises:
        ValueError: naming ``train.method`` and the known names, for an unknown method.
    """
    if cfg.train.method not in METHODS:
        raise ValueError(f"config key 'train.method': unknown method {cfg.train.method!r}; expected one of {sorted(METHODS)}")
    return METHODS[cfg.train.method](cfg, model, policy, rewards)
