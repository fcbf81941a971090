"""Online RL methods, each an object the training loop calls (:mod:`flowrl.methods.base` has the contract).

:data:`METHODS` maps ``train.method`` to its class, each registered in its own file with :func:`register_method`:
``grpo`` (:class:`GRPO`: SDE rollouts of any shape in :mod:`flowrl.methods.shapes`, PPO on log-prob ratios) and
``flow_dppo`` (:class:`FlowDPPO`: GRPO with a trust-region mask for the clip), and the forward-process methods
(:mod:`flowrl.methods.forward`) ``nft`` (:class:`DiffusionNFT`), ``awm`` (:class:`AWM`), ``dgpo`` (:class:`DGPO`) and
``dpo`` (:class:`DiffusionDPO`, online), ``crd`` (:class:`CRD`); ``gardo`` (:class:`GARDO`: GRPO with a gated,
resetting KL); the offline ``dpo_offline`` (:class:`OfflineDPO`) and ``sft`` (:class:`SFT`) on a data set; the direct-reward
``refl`` (:class:`ReFL`), ``draft`` (:class:`DRaFT`), ``alignprop`` (:class:`AlignProp`) and ``srpo`` (:class:`SRPO`:
Direct-Align with a semantic relative reward). A new method is a new file with a :class:`Method` subclass and its
settings (:func:`flowrl.fields.config_section`): every module of this package is imported, so nothing here changes
(docs/methods.md "Extending flowrl").
"""

from __future__ import annotations

import importlib
import pkgutil

from .awm import AWM, AWMConfig
from .base import METHODS, FinalSamples, Method, ProbeSamples, Rewards, Samples, SDESamples, register_method
from .crd import CRD, CRDConfig
from .dgpo import DGPO, DGPOConfig
from .direct import AlignProp, DirectConfig, DirectReward, DRaFT, ReFL
from .dpo import DiffusionDPO, DPOConfig
from .flow_dppo import FlowDPPO, FlowDPPOConfig
from .gardo import GARDO, GARDOConfig
from .grpo import GRPO
from .nft import DiffusionNFT, NFTConfig
from .offline import SFT, OfflineConfig, OfflineDPO
from .shapes import SHAPES, RolloutShape, register_shape
from .srpo import SRPO, SRPOConfig

__all__ = [
    "METHODS",
    "AWM",
    "AWMConfig",
    "AlignProp",
    "CRD",
    "CRDConfig",
    "DGPO",
    "DGPOConfig",
    "DRaFT",
    "DirectConfig",
    "DirectReward",
    "DPOConfig",
    "DiffusionDPO",
    "FlowDPPO",
    "FlowDPPOConfig",
    "GARDO",
    "GARDOConfig",
    "OfflineConfig",
    "OfflineDPO",
    "SFT",
    "SRPO",
    "SRPOConfig",
    "SHAPES",
    "DiffusionNFT",
    "FinalSamples",
    "GRPO",
    "Method",
    "NFTConfig",
    "ProbeSamples",
    "ReFL",
    "Rewards",
    "RolloutShape",
    "SDESamples",
    "Samples",
    "build_method",
    "register_method",
    "register_shape",
]

for _module in pkgutil.iter_modules(__path__):  # each method's file registers it (register_method)
    importlib.import_module(f"{__name__}.{_module.name}")


def build_method(cfg, model, policy, rewards, data=None) -> Method:
    """The method ``cfg.train.method`` names, built on the model adapter, policy and rewards, and the `data` its
    :meth:`Method.read_data` read before the model loaded (None: none, or read now).

    Raises:
        ValueError: naming ``train.method`` and the known names, for an unknown method.
    """
    if cfg.train.method not in METHODS:
        raise ValueError(
            f"config key 'train.method': unknown method {cfg.train.method!r}; expected one of {sorted(METHODS)}"
        )
    method = METHODS[cfg.train.method]
    return method(cfg, model, policy, rewards) if data is None else method(cfg, model, policy, rewards, data=data)
