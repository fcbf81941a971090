"""Policy losses on trained transitions: PPO clipped surrogate and the KL to the reference policy."""

from __future__ import annotations

import torch


def _mean_sq_diff(a: torch.Tensor, b: torch.Tensor, name_a: str, name_b: str) -> torch.Tensor:
    """``mean over every non-batch dim of (a - b)^2`` in float32: `(M,)` from two `(M, ...)` tensors of one shape.

    Raises:
        ValueError: if the shapes differ or the tensors have no batch dim (the argument names are given).
    """
    if a.shape != b.shape or a.dim() < 2:
        raise ValueError(f"{name_a} {tuple(a.shape)} and {name_b} {tuple(b.shape)} must have one shape (M, C, H, W)")
    return ((a.float() - b.float()) ** 2).mean(tuple(range(1, a.dim())))  # (M,)


def _check_per_row(rows: int, **tensors: torch.Tensor | None) -> None:
    """Refuse, naming the argument, any tensor of `tensors` (None skipped) whose shape is not ``(rows,)``."""
    for name, t in tensors.items():
        if t is not None and tuple(t.shape) != (rows,):
            raise ValueError(f"{name} must have shape ({rows},), one value per row; got {tuple(t.shape)}")


def ppo_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    clip_range: float,
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate (arXiv 1707.06347) per transition, as in Flow-GRPO's GRPO objective (arXiv 2505.05470).

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
        |r - 1|), ``policy/clipfrac`` (|r - 1| > eps), ``policy/clipfrac_high`` (r > 1 + eps),
        ``policy/clipfrac_low`` (r < 1 - eps), ``policy/approx_kl`` (mean of (logp_new - logp_old)^2 / 2, as
        Flow-GRPO logs it).

    Raises:
        ValueError: if `old_log_prob`, `advantages` or `weights` is not of `log_prob`'s shape ``(M,)`` (a
            ``(M, 1)`` advantage would otherwise broadcast to an ``(M, M)`` loss), or ``clip_range <= 0``.
    """
    if log_prob.dim() != 1:
        raise ValueError(f"log_prob must have shape (M,); got {tuple(log_prob.shape)}")
    _check_per_row(len(log_prob), old_log_prob=old_log_prob, advantages=advantages, weights=weights)
    if not clip_range > 0:
        raise ValueError(f"clip_range must be > 0, got {clip_range}")
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
    """KL between the policy's and the reference's Gaussian steps of the same std (Flow-GRPO, arXiv 2505.05470):
    KL = mean_d (mean - ref_mean)^2 / (2 std^2), reduced by mean over latent dims, then over transitions.

    With `std` the step's std ``sigma_t sqrt(|dt|)`` this is the exact KL of the two steps. Flow-GRPO's code
    divides by the SDE's ``sigma_t^2`` alone, i.e. its KL is this one times ``|dt|`` (pass
    ``std / sqrt(|dt|)``: ``train.kl_type: flow_grpo``), so its ``beta`` values are not comparable with the exact KL's.

    Args:
        mean, ref_mean: ``(M, C, H, W)`` step means (any float dtype; computed in float32); std: ``(M,)``
            step std, `> 0`.

    Returns:
        Scalar float32.

    Raises:
        ValueError: for mismatched shapes.
    """
    dmu2 = _mean_sq_diff(mean, ref_mean, "mean", "ref_mean")  # (M,)
    _check_per_row(len(dmu2), std=std)
    return dmu2.div(2 * std.float() ** 2).mean()


def step_kl(mean: torch.Tensor, ref_mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """Per transition, the KL between two Gaussian steps of one std, reduced by the mean over latent dims:
    ``KL_m = mean_d (mean_m - ref_mean_m)_d^2 / (2 std_m^2)``, :func:`kl_to_reference` before its mean over
    transitions (Flow-OPD's dense reward, arXiv 2605.08063, is ``-KL`` to the routed teacher's step).

    Args:
        mean, ref_mean (`torch.Tensor` of shape `(M, *latent_shape)`): step means (computed in float32, or float64 for
            float64 inputs). std (`torch.Tensor` of shape `(M,)`): the step std, > 0.

    Returns:
        `torch.Tensor` of shape `(M,)`, >= 0.

    Raises:
        ValueError: mismatched shapes, or a `std` that is not one value per row.
    """
    if mean.shape != ref_mean.shape or mean.dim() < 2:
        raise ValueError(
            f"mean {tuple(mean.shape)} and ref_mean {tuple(ref_mean.shape)} must have one shape (M, C, H, W)"
        )
    _check_per_row(len(mean), std=std)
    dtype = torch.promote_types(mean.dtype, torch.float32)
    dmu2 = ((mean.to(dtype) - ref_mean.to(dtype)) ** 2).mean(tuple(range(1, mean.dim())))  # (M,)
    return dmu2 / (2 * std.to(dtype) ** 2)


def ratio_norm(
    log_prob: torch.Tensor, old_log_prob: torch.Tensor, mean: torch.Tensor, old_mean: torch.Tensor, std: torch.Tensor
) -> torch.Tensor:
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

    Raises:
        ValueError: for mismatched shapes.
    """
    dmu2 = _mean_sq_diff(mean, old_mean, "mean", "old_mean")  # (M,)
    _check_per_row(len(dmu2), log_prob=log_prob, old_log_prob=old_log_prob, std=std)
    tau = std.float()
    return tau * (log_prob - old_log_prob) + dmu2 / (2 * tau)


def step_weights(
    kind: str, gain: torch.Tensor, std: torch.Tensor, step: torch.Tensor, among: torch.Tensor | None = None
) -> torch.Tensor | None:
    """Per-transition loss weights that balance denoising steps, normalised to mean 1 over the steps.

    - ``"guard"``: GRPO-Guard gradient reweighting (arXiv 2510.22319, Sec. 4.2): the gradient of the
      normalised log-ratio is ``eps . d(mean)/d(theta) = eps g_t dv/d(theta)`` with ``g_t = |d mean / d v|``
      of the step's kernel (``c_t |dt|``; ``|dt|`` for the Flow-GRPO SDE), so the weight is ``1 / g_t``.
    - ``"noise_aware"``: TempFlow-GRPO (arXiv 2508.04324, Sec. 3.3): ``w_t = tau_t / mean_t(tau_t)``.
    - ``"none"``: returns None.

    The normaliser is the mean over the distinct steps of the rows in `among` of each step's mean weight, so
    a step's weight does not depend on how many of its transitions a minibatch holds.

    Args:
        kind (`str`): ``"none" | "guard" | "noise_aware"``.
        gain (`(M,)`): ``|d mean / d v|`` per transition (:func:`samplers.velocity_gain`).
        std (`(M,)`): the step std per transition.
        step (`(M,)` long): the denoising step of each transition.
        among (`(M,)` bool, optional): the rows whose steps set the normaliser (e.g. the trained ones); default all.

    Returns:
        `(M,)` float32 weights, or None.

    Raises:
        ValueError: for an unknown `kind`, or if `among` selects no row.
    """
    if kind == "none":
        return None
    if kind == "guard":
        w = 1.0 / gain.float().clamp(min=1e-12)
    elif kind == "noise_aware":
        w = std.float()
    else:
        raise ValueError(f"step weighting must be 'none', 'guard' or 'noise_aware', got {kind!r}")
    pick = torch.ones_like(step, dtype=torch.bool) if among is None else among
    if not bool(pick.any()):
        raise ValueError("step weights: no transition to normalise over")
    steps, inverse = torch.unique(step[pick], return_inverse=True)
    per_step = torch.zeros(len(steps), dtype=torch.float32, device=w.device).index_add_(0, inverse, w[pick])
    per_step = per_step / torch.bincount(inverse, minlength=len(steps)).float()  # (S,) each step's mean weight
    return w / per_step.mean()


def velocity_kl(velocity: torch.Tensor, ref_velocity: torch.Tensor) -> torch.Tensor:
    """KL surrogate on the velocity: ``mean over dims and transitions of (v_theta - v_ref)^2``.

    Args:
        velocity, ref_velocity (`(M, C, H, W)`): policy (with gradient) and reference velocities.

    Returns:
        Scalar float32.

    Raises:
        ValueError: for mismatched shapes.
    """
    if velocity.shape != ref_velocity.shape:
        raise ValueError(
            f"velocity {tuple(velocity.shape)} and ref_velocity {tuple(ref_velocity.shape)} must have one shape"
        )
    return ((velocity.float() - ref_velocity.float()) ** 2).mean()


def optimality_weights(advantages: torch.Tensor, adv_max: float) -> torch.Tensor:
    """DiffusionNFT's optimality probability of each sample, ``r = clip(A / A_max, -1, 1) / 2 + 1/2``
    (arXiv 2509.16117, Sec. 4.2): 1 for the best, 0 for the worst, 1/2 at the group mean.

    Args:
        advantages: ``(B,)`` float group-relative advantages (unitless, already clipped to ``[-A_max, A_max]``).
        adv_max: ``A_max`` > 0 (``train.adv_clip_max``).

    Returns:
        ``(B,)`` float32 weights in [0, 1].

    Raises:
        ValueError: if ``adv_max <= 0``.
    """
    if not adv_max > 0:
        raise ValueError(f"adv_max must be > 0, got {adv_max}")
    return (advantages.float() / adv_max / 2 + 0.5).clamp(0, 1)


def nft_loss(
    v: torch.Tensor,
    v_old: torch.Tensor,
    x_t: torch.Tensor,
    x0: torch.Tensor,
    t: torch.Tensor,
    r: torch.Tensor,
    beta: float = 1.0,
    adv_max: float = 5.0,
) -> torch.Tensor:
    """DiffusionNFT's negative-aware flow-matching loss (arXiv 2509.16117, Eq. 8 with its adaptive weight).

    ``v+ = beta v + (1 - beta) v_old`` and ``v- = (1 + beta) v_old - beta v`` are the implicit positive and
    negative policies; with ``x0(u) = x_t - t u`` and ``w(u) = mean |x0(u) - x0|`` (no gradient) the loss is
    ``A_max / beta * mean_b[r |x0(v+) - x0|^2 / w(v+) + (1 - r) |x0(v-) - x0|^2 / w(v-)]`` (squares
    averaged over C, H, W). At ``v = v_old`` its gradient is that of the flow-matching loss scaled by
    ``(2 r - 1)``: towards the sample for ``r > 1/2``, away for ``r < 1/2``, none at 1/2.

    Args:
        v: ``(B, C, H, W)`` velocity of the policy being trained (with gradient; any float dtype, the loss
            is computed in float32).
        v_old: ``(B, C, H, W)`` velocity of the old (sampling) policy at the same inputs, no gradient.
        x_t: ``(B, C, H, W)`` noised samples ``(1 - t) x0 + t eps``; x0: ``(B, C, H, W)`` clean samples.
        t: ``(B,)`` times in (0, 1] (1 = noise).
        r: ``(B,)`` optimality weights in [0, 1] (:func:`optimality_weights`).
        beta: the implicit policies' step, > 0 (DiffusionNFT's GenEval setting is 1).
        adv_max: the advantage clip ``A_max`` that scaled ``r`` (restores the loss scale).

    Returns:
        Scalar float32 loss.

    Raises:
        ValueError: for ``beta <= 0``, ``adv_max <= 0``, mismatched shapes or ``r`` outside [0, 1].
    """
    if beta <= 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    if not adv_max > 0:
        raise ValueError(f"adv_max must be > 0, got {adv_max}")
    for name, u in (("v_old", v_old), ("x_t", x_t), ("x0", x0)):
        if u.shape != v.shape:
            raise ValueError(f"{name} {tuple(u.shape)} must have v's shape {tuple(v.shape)}")
    _check_per_row(v.shape[0], t=t, r=r)
    if r.min() < 0 or r.max() > 1:
        raise ValueError(f"optimality weights r must lie in [0, 1], got [{r.min().item()}, {r.max().item()}]")
    t = t.float().view(-1, *([1] * (x0.dim() - 1)))
    v, v_old, x_t, x0 = v.float(), v_old.float(), x_t.float(), x0.float()

    def weighted(u: torch.Tensor) -> torch.Tensor:  # (B,)
        err = x_t - t * u - x0
        scale = err.detach().abs().mean(dim=tuple(range(1, err.dim())), keepdim=True).clamp(min=1e-5)
        return (err**2 / scale).mean(dim=tuple(range(1, err.dim())))

    positive = weighted(beta * v + (1 - beta) * v_old)
    negative = weighted((1 + beta) * v_old - beta * v)
    return (adv_max / beta * (r * positive + (1 - r) * negative)).mean()


def dppo_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    mean: torch.Tensor,
    old_mean: torch.Tensor,
    std: torch.Tensor,
    kl_threshold: float,
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Flow-DPPO's masked policy-gradient loss (arXiv 2606.11025; Tencent-Hunyuan/UniRL ``unirl/algorithms/flowdppo.py``):
    Flow-GRPO's objective with the ratio clip replaced by a trust-region mask on each transition::

        kl = mean_d (mean - old_mean)^2 / (2 std^2)                     (the Gaussian steps' KL, mean over dims)
        drop = kl >= kl_threshold and ((r > 1 and A > 0) or (r < 1 and A < 0))
        loss = mean over all M transitions of (0 where drop, else -A r)

    A transition that moved far (in KL) in the direction its advantage pushes it stops contributing (value and
    gradient); one moving back (A > 0 with r < 1) or within the threshold always contributes. The ratio itself is not
    clipped, and dropped transitions still count in the mean's denominator, as the official code.

    Args:
        log_prob, old_log_prob, advantages: ``(M,)`` float32, as :func:`ppo_loss` (log-probs mean over dims).
        mean (`torch.Tensor` of shape `(M, ...)`): the current policy's step means (with gradient); old_mean the
            rollout's, std `(M,)` the step stds.
        kl_threshold (`float > 0`): the mask's KL bound (1e-5 in the official recipe).
        weights: optional ``(M,)`` per-transition weights.

    Returns:
        ``(loss, stats)``: ``policy/ratio_mean``, ``policy/ratio_max_dev``, ``policy/maskfrac`` (the dropped
        fraction), ``policy/kl_step_mean`` and ``policy/approx_kl``.

    Raises:
        ValueError: for shapes that do not match ``(M,)`` (a mean's first dimension included) or a threshold <= 0.
    """
    if log_prob.dim() != 1:
        raise ValueError(f"log_prob must have shape (M,); got {tuple(log_prob.shape)}")
    _check_per_row(len(log_prob), old_log_prob=old_log_prob, advantages=advantages, weights=weights, std=std)
    if mean.shape != old_mean.shape or mean.shape[0] != len(log_prob):
        raise ValueError(
            f"mean {tuple(mean.shape)} and old_mean {tuple(old_mean.shape)} must be (M, ...), M = {len(log_prob)}"
        )
    if not kl_threshold > 0:
        raise ValueError(f"kl_threshold must be > 0, got {kl_threshold}")
    log_ratio = log_prob - old_log_prob
    ratio = torch.exp(log_ratio)
    var = std.float().reshape(-1, *([1] * (mean.dim() - 1))) ** 2  # (M, 1, ...)
    kl = ((mean.float() - old_mean.float()) ** 2 / (2 * var)).flatten(1).mean(dim=1)  # (M,)
    with torch.no_grad():
        drop = (kl >= kl_threshold) & (((ratio > 1) & (advantages > 0)) | ((ratio < 1) & (advantages < 0)))
    per = torch.where(drop, torch.zeros_like(ratio), -advantages * ratio)  # (M,)
    loss = (per if weights is None else per * weights).mean()
    stats = {
        "policy/ratio_mean": ratio.detach().mean(),
        "policy/ratio_max_dev": (ratio.detach() - 1).abs().max(),
        "policy/maskfrac": drop.float().mean(),
        "policy/kl_step_mean": kl.detach().mean(),
        "policy/approx_kl": (log_ratio.detach() ** 2).mean() / 2,
    }
    return loss, stats
