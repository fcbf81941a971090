"""Flow-DPPO (arXiv 2606.11025): Flow-GRPO's objective with the ratio clip replaced by a trust-region mask.

Every rollout shape and the rest of the GRPO update (log-probs recomputed in float32 at the drawing std, KL to the
base, minibatches) are :class:`flowrl.methods.grpo.GRPO`'s; only the per-transition loss differs
(:func:`flowrl.losses.dppo_loss`): a transition whose step mean moved, in Gaussian KL, past ``train.flow_dppo.
kl_threshold`` in the direction its advantage pushes it leaves the loss, and the ratio is not clipped.

Source read: Tencent-Hunyuan/UniRL ``unirl/algorithms/flowdppo.py`` (commit a1f8596), ``FlowDPPO/config.yaml``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..fields import check, config_section, setting
from ..losses import dppo_loss
from .base import register_method
from .grpo import GRPO


@config_section("train", "flow_dppo", "Flow-DPPO's settings (train.method flow_dppo)")
@dataclass
class FlowDPPOConfig:
    """``train.flow_dppo.*``: Flow-DPPO's trust-region mask (``train.method: flow_dppo``)."""

    kl_threshold: float = setting(
        1e-5,
        "a transition leaves the loss when its step's KL (mean over dims) to the rollout's step reaches this "
        "and its ratio moved in its advantage's direction (the official recipe's 1e-5)",
    )

    def __post_init__(self):
        check(self.kl_threshold > 0, "train.flow_dppo.kl_threshold", "> 0", self.kl_threshold)


@register_method("flow_dppo", "GRPO with a trust-region mask instead of the clip")
class FlowDPPO(GRPO):
    """``train.method: flow_dppo``: GRPO with :func:`flowrl.losses.dppo_loss` in place of the clipped surrogate.

    Args: as :class:`flowrl.methods.base.Method`.
    """

    def policy_loss(
        self, log_prob: torch.Tensor, mean: torch.Tensor, sub, adv: torch.Tensor, weights: torch.Tensor | None
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """:func:`flowrl.losses.dppo_loss` of transitions `sub` (the rollout's step means ``sub.mean`` and stds)."""
        kl_threshold = self.cfg.train.flow_dppo.kl_threshold
        return dppo_loss(log_prob, sub.log_prob, adv, mean, sub.mean, sub.std, kl_threshold, weights)
