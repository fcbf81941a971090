"""Group-relative advantages (GRPO as used by Flow-GRPO, arXiv 2505.05470, and DanceGRPO, 2505.07818)."""

from __future__ import annotations

import torch


def group_advantages(rewards: torch.Tensor, group: torch.Tensor, std: str = "global", clip: float = 5.0,
                     eps: float = 1e-4) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-prompt z-scored advantages A = (r - mean_group) / (std + eps), clipped to +-clip.

    Args:
        rewards: float ``(B,)`` scalar rewards of the B samples.
        group: long ``(B,)`` group (prompt) id of each sample.
        std: ``"group"`` (std within each group) or ``"global"`` (std over the whole batch, Flow-GRPO's
            default); both use the population std.
        clip: |A| bound (Flow-GRPO's ``adv_clip_max``, 5).
        eps: added to the std.

    Returns:
        ``(advantages, zero_variance)``: float32 ``(B,)`` and bool ``(B,)``, True for samples whose
        group has all rewards equal; their advantage is exactly 0.

    Raises:
        ValueError: for an unknown ``std`` or mismatched shapes.
    """
    if std not in ("group", "global"):
        raise ValueError(f"advantage std must be 'group' or 'global', got {std!r}")
    if rewards.shape != group.shape or rewards.dim() != 1:
        raise ValueError(f"rewards {tuple(rewards.shape)} and group {tuple(group.shape)} must both be (B,)")
    rewards = rewards.float()
    _, inverse = torch.unique(group, return_inverse=True)  # (B,) dense group index
    n = torch.bincount(inverse).float()  # (G,)
    mean = torch.bincount(inverse, rewards) / n  # (G,)
    centred = rewards - mean[inverse]  # (B,)
    var = torch.bincount(inverse, centred**2) / n  # (G,)
    zero_variance = (var < 1e-12)[inverse]  # (B,)
    scale = var.sqrt()[inverse] if std == "group" else rewards.std(unbiased=False).expand_as(rewards)
    advantages = (centred / (scale + eps)).clamp(-clip, clip)
    return torch.where(zero_variance, torch.zeros_like(advantages), advantages), zero_variance
