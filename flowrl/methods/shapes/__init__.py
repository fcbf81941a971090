"""The rollout shapes of the GRPO family, by ``sampling.shape`` (:data:`SHAPES`): ``flat`` (with MixGRPO's window),
``tree`` (BranchGRPO), ``tempflow``, ``g2rpo`` and ``tp_grpo`` (single-step branching). Each is a class with its
``rollout`` and ``advantages`` and its settings beside it (:mod:`.base` has the contract; docs/methods.md "Adding a
rollout shape"). Every module of this package is imported: a new shape's file registers it (register_shape)."""

import importlib
import pkgutil

from .base import SHAPES, RolloutShape, register_shape, step_subset
from .flat import FlatShape, WindowConfig
from .probe import G2RPOShape, ProbeConfig, ProbeShape, TempFlowShape, TPGRPOShape
from .tree import TreeConfig, TreeShape

__all__ = [
    "SHAPES",
    "FlatShape",
    "G2RPOShape",
    "ProbeConfig",
    "ProbeShape",
    "RolloutShape",
    "TPGRPOShape",
    "TempFlowShape",
    "TreeConfig",
    "TreeShape",
    "WindowConfig",
    "register_shape",
    "step_subset",
]

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")
