"""Policy losses on trained transitions: PPO clipped surrogate and the KL to the reference policy."""

from __future__ import annotations

import torch


def ppo_loss(log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor,
             clip_range: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate (arXiv 1707.06347) per transition, as in Flow-GRPO (arXiv 2505.05470, eq. 6).

    r = exp(logp_new - logp_old); loss = mean(max(-A r, -A clip(r, 1 - eps, 1 + eps))).

    Args:
        log_prob: float32 ``(M,)`` log-probs under the current policy (with gradient).
        old_log_prob: float32 ``(M,)`` log-probs stored at rollout.
        advantages: ``(M,)`` advantage of each transition.
        clip_range: eps (1e-4 for Flow-GRPO's mean-reduced log-probs).

    Returns:
        ``(loss, stats)``: scalar loss and detached ``policy/ratio_mean``, ``policy/ratio_max_dev`` (max
        |r - 1|), ``policy/clipfrac``, ``policy/approx_kl`` (mean of (logp_new - logp_old)^2 / 2).
    """
    log_ratio = log_prob - old_log_prob
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    loss = torch.maximum(unclipped, clipped).mean()
    with torch.no_grad():
        stats = {
            "policy/ratio_mean": ratio.mean(),
            "policy/ratio_max_dev": (ratio - 1).abs().max(),
            "policy/clipfrac": ((ratio - 1).abs() > clip_range).float().mean(),
            "policy/approx_kl": (log_ratio**2).mean() / 2,
        }
    return loss, stats


def kl_to_reference(mean: torch.Tensor, ref_mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """Flow-GRPO's KL between the policy's and the reference's Gaussian steps (same std):
    KL = mean_d (mean - ref_mean)^2 / (2 std^2), reduced by mean over latent dims, then over transitions.

    Args:
        mean, ref_mean: ``(M, C, H, W)`` step means; std: ``(M,)`` step std.

    Returns:
        Scalar float32.
    """
    dims = tuple(range(1, mean.dim()))
    return ((mean.float() - ref_mean.float()) ** 2).mean(dims).div(2 * std.float() ** 2).mean()
