"""Policy losses on trained transitions: PPO clipped surrogate and the KL to the reference policy."""

from __future__ import annotations

import torch


def ppo_loss(log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor,
             clip_range: float, weights: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate (arXiv 1707.06347) per transition, as in Flow-GRPO (arXiv 2505.05470, eq. 6).

    r = exp(logp_new - logp_old); loss = mean(w max(-A r, -A clip(r, 1 - eps, 1 + eps))).

    Args:
        log_prob: float32 ``(M,)`` log-probs under the current policy (with gradient), or
            ``old_log_prob +`` a normalised log-ratio (:func:`ratio_norm`).
        old_log_prob: float32 ``(M,)`` log-probs stored at rollout.
        advantages: ``(M,)`` advantage of each transition.
        clip_range: eps (1e-4 for Flow-GRPO's mean-reduced log-probs).
        weights: optional ``(M,)`` per-transition loss weights (:func:`step_weights`); default 1.

    Returns:
        ``(loss, stats)``: scalar loss and detached ``policy/ratio_mean``, ``policy/ratio_max_dev`` (max
        |r - 1|), ``policy/clipfrac``, ``policy/approx_kl`` (mean of (logp_new - logp_old)^2 / 2).
    """
    log_ratio = log_prob - old_log_prob
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    per = torch.maximum(unclipped, clipped)  # (M,)
    loss = (per if weights is None else per * weights).mean()
    with torch.no_grad():
        stats = {
            "policy/ratio_mean": ratio.mean(),
            "policy/ratio_max_dev": (ratio - 1).abs().max(),
            "policy/clipfrac": ((ratio - 1).abs() > clip_range).float().mean(),
            "policy/clipfrac_high": (ratio > 1 + clip_range).float().mean(),
            "policy/clipfrac_low": (ratio < 1 - clip_range).float().mean(),
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


def ratio_norm(log_prob: torch.Tensor, old_log_prob: torch.Tensor, mean: torch.Tensor, old_mean: torch.Tensor,
               std: torch.Tensor) -> torch.Tensor:
    """GRPO-Guard RatioNorm (arXiv 2510.22319, Sec. 4.1): the log-ratio with its analytic bias removed and
    rescaled by the step's std.

    For a Gaussian step with std ``tau`` and ``x' = mu_old + tau eps``, the mean-reduced log-ratio is
    ``log r = mean(eps dmu) / tau - mean(dmu^2) / (2 tau^2)`` (``dmu = mu_theta - mu_old``): biased below 0,
    with a spread that grows as ``tau`` shrinks. RatioNorm returns
    ``log r_hat = tau (log r + mean(dmu^2) / (2 tau^2)) = mean(eps dmu)``: mean 0 and the same spread at
    every step. Use it in place of ``log_prob - old_log_prob`` (then clip as usual).

    Args:
        log_prob, old_log_prob (`(M,)` float32): new (with gradient) and stored log-probs.
        mean (`(M, C, H, W)`): the new step mean (with gradient); old_mean: the stored rollout mean.
        std (`(M,)`): the step std ``tau``, `> 0`.

    Returns:
        `torch.Tensor` of shape `(M,)`, float32: the normalised log-ratio.
    """
    dims = tuple(range(1, mean.dim()))
    dmu2 = ((mean.float() - old_mean.float()) ** 2).mean(dims)  # (M,)
    tau = std.float()
    return tau * (log_prob - old_log_prob) + dmu2 / (2 * tau)


def step_weights(kind: str, gain: torch.Tensor, std: torch.Tensor, mean: float | None = None) -> torch.Tensor | None:
    """Per-transition loss weights that balance denoising steps, normalised to mean 1.

    - ``"guard"``: GRPO-Guard gradient reweighting (arXiv 2510.22319, Sec. 4.2): the gradient of the
      normalised log-ratio is ``eps . d(mean)/d(theta) = eps g_t dv/d(theta)`` with ``g_t = |d mean / d v|``
      of the step's kernel (``c_t |dt|``; ``|dt|`` for the Flow-GRPO SDE), so the weight is ``1 / g_t``.
    - ``"noise_aware"``: TempFlow-GRPO (arXiv 2508.04324, Sec. 3.3): ``w_t = tau_t / mean(tau)``.
    - ``"none"``: returns None.

    Args:
        kind (`str`): ``"none" | "guard" | "noise_aware"``.
        gain (`(M,)`): ``|d mean / d v|`` per transition (:func:`samplers.velocity_gain`).
        std (`(M,)`): the step std per transition.
        mean (`float`, optional): divide by this instead of the weights' own mean (several processes: the
            mean over every process's minibatch; ``1.0`` returns the unnormalised weights).

    Returns:
        `(M,)` float32 weights with mean 1 (over the batch, or as given by `mean`), or None.

    Raises:
        ValueError: for an unknown `kind`.
    """
    if kind == "none":
        return None
    if kind == "guard":
        w = 1.0 / gain.float().clamp(min=1e-12)
    elif kind == "noise_aware":
        w = std.float()
    else:
        raise ValueError(f"step weighting must be 'none', 'guard' or 'noise_aware', got {kind!r}")
    return w / (w.mean() if mean is None else mean)


def velocity_kl(velocity: torch.Tensor, ref_velocity: torch.Tensor) -> torch.Tensor:
    """KL surrogate on the velocity: ``mean over dims and transitions of (v_theta - v_ref)^2``.

    Args:
        velocity, ref_velocity (`(M, C, H, W)`): policy (with gradient) and reference velocities.

    Returns:
        Scalar float32.
    """
    return ((velocity.float() - ref_velocity.float()) ** 2).mean()
