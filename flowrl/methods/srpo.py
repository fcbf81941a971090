"""SRPO (Shen et al., "Directly Aligning the Full Diffusion Trajectory with Fine-Grained Human Preference", arXiv
2509.06942): Direct-Align with a semantic relative preference reward, ``train.method: srpo``.

Official code read: Tencent-Hunyuan/SRPO ``fastvideo/SRPO_Qwen.py`` (``SRPO_train``, ``CLIP.SRP_cfg``) and
``scripts/finetune/SRPO_training_qwen.sh`` (its defaults, quoted below as "official"). Each iteration:

1. **Rollout** (no gradient): ``sampling.group_size`` Euler ODE samples per prompt at ``sampling.guidance_scale``,
   keeping each sample's initial noise ``eps`` and its clean latents ``x0`` (the official online mode: the noise
   that drew the image is the one injected again).
2. **Direct-Align** (:func:`direct_align`), per image: a grid of ``L`` noise levels from ``sigma_max`` down to
   ``sigma_min`` (official ``L = 100`` points between the 5th and 40th of 50 unshifted levels: 0.9 to 0.2); a grid
   index ``m`` uniform in ``[2, L - 2]``, a gap ``k = min(L - m, K, m)`` with ``K = int((1 - groundtruth_ratio) L) +
   1``; the image noised with its own ``eps`` to ``s_hi = grid[L - min(m + k, L)]``, ``x = s_hi eps + (1 - s_hi)
   x0``; one velocity with gradient, one Euler step to ``s_lo = grid[L - m]``; and the clean image recovered
   analytically, ``x0_hat = (x' - s_lo eps) / (1 - s_lo)`` (exact when the velocity is the true ``eps - x0``).
3. **Semantic relative preference**: ``r = (1 + k_w) R(x0_hat, "P. prompt") - R(x0_hat, "N. prompt")`` with ``R``
   the weighted differentiable rewards, ``P`` a positive control word and ``N`` a negative one (official: the
   realism words "Natural-lighting", "Detail", "Detailed", "Real" and "Concept art", "Painting", "Anime"; ``k_w =
   0``). For a CLIP-type reward this is the official ``SRP_cfg``, the image embedding against ``(1 + k_w) t_P -
   t_N``.
4. **Loss** ``-mean(r * d(m)) * train.direct.scale`` with the time discount ``d(m) = s m / (1 + (s - 1) m)`` at ``m /
   L`` (official ``sd3_time_shift(3, .)``), optionally plus ``train.direct.kl_beta`` times the velocity KL to the
   base (``train.direct``'s, as ReFL and DRaFT).

Deviations from the official code: the control words are drawn with the iteration's generator (official: cycled by
the step count), so that a resumed run draws the same; the decoded image is flowrl's ``[0, 1]`` decode (official: the
batch min-max rescaled); the inversion branch of the paper (``discount_inv``, defined but unused by the official
script) is not built; the step with gradient takes ``train.srpo.guidance_scale`` (official ``train_cfg`` 1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..fields import check, config_section, setting
from .base import register_method
from .direct import DirectReward


@config_section("train", "srpo", "SRPO's Direct-Align settings (train.method srpo)")
@dataclass
class SRPOConfig:
    """``train.srpo.*``: SRPO's Direct-Align and semantic relative preference (``train.method: srpo``)."""

    sigma_max: float = setting(0.9, "the noisiest level of Direct-Align's grid (official 0.9)")
    sigma_min: float = setting(0.2, "the cleanest level of the grid (official 0.2)")
    grid: int = setting(100, "levels in the grid, L (official timestep_length 100)")
    groundtruth_ratio: float = setting(
        0.6, "the largest gap between the noised and the denoised level: int((1 - ratio) L) + 1 (official 0.6)"
    )
    discount_shift: float = setting(3.0, "the time discount s m / (1 + (s - 1) m) at m = index / L (official 3)")
    guidance_scale: float = setting(1.0, "the CFG scale of the step with gradient (official train_cfg 1)")
    positive_words: list = setting(
        factory=lambda: ["Natural-lighting", "Detail", "Detailed", "Real"],
        help="control words of the positive prompt 'WORD. prompt' (official realism words)",
    )
    negative_words: list = setting(
        factory=lambda: ["Concept art", "Painting", "Anime"],
        help="control words of the negative prompt 'WORD. prompt' (official CG / oily words)",
    )
    relative_weight: float = setting(0.0, "k: the reward (1 + k) R(positive) - R(negative) (official 0)")

    def __post_init__(self):
        check(
            0 < self.sigma_min < self.sigma_max <= 1,
            "train.srpo.sigma_min",
            "0 < sigma_min < sigma_max <= 1",
            (self.sigma_min, self.sigma_max),
        )
        check(self.grid >= 5, "train.srpo.grid", ">= 5 (the index is drawn from [2, L - 2])", self.grid)
        check(0 <= self.groundtruth_ratio < 1, "train.srpo.groundtruth_ratio", "in [0, 1)", self.groundtruth_ratio)
        check(self.discount_shift > 0, "train.srpo.discount_shift", "> 0", self.discount_shift)
        check(self.guidance_scale >= 1, "train.srpo.guidance_scale", ">= 1", self.guidance_scale)
        for key in ("positive_words", "negative_words"):
            words = getattr(self, key)
            ok = isinstance(words, (list, tuple)) and len(words) > 0 and all(isinstance(w, str) for w in words)
            check(ok, f"train.srpo.{key}", "a non-empty list of words", words)
            setattr(self, key, list(words))


def direct_align(
    x0: torch.Tensor, eps: torch.Tensor, sigma_hi: torch.Tensor, sigma_lo: torch.Tensor, velocity
) -> torch.Tensor:
    """SRPO's Direct-Align (arXiv 2509.06942, Sec. 3; official ``SRPO_train`` steps 1-3): noise the clean latents with
    their own noise to ``sigma_hi``, one Euler step of ``velocity`` to ``sigma_lo``, and the clean latents recovered
    analytically with the known noise.

    Args:
        x0 (`torch.Tensor` of shape `(N, *latent_shape)`, float32): clean latents (no gradient needed).
        eps (`torch.Tensor` of the same shape): the noise injected (official: the noise that drew `x0`).
        sigma_hi, sigma_lo (`torch.Tensor` of shape `(N,)`, float32, ``0 <= sigma_lo < sigma_hi <= 1``): the levels.
        velocity: ``velocity(x, t) -> v`` with ``t (N,)``: the flow velocity ``(N, *latent_shape)`` (with gradient).

    Returns:
        `torch.Tensor` of shape `(N, *latent_shape)`: ``x0_hat = (x' - sigma_lo eps) / (1 - sigma_lo)`` with ``x' = x +
        (sigma_lo - sigma_hi) v(x, sigma_hi)`` and ``x = sigma_hi eps + (1 - sigma_hi) x0``; equal to `x0` when ``v =
        eps - x0`` (the straight path's velocity).
    """
    shape = (-1,) + (1,) * (x0.dim() - 1)
    hi, lo = sigma_hi.view(shape), sigma_lo.view(shape)
    x = hi * eps + (1 - hi) * x0  # (N, ...): noised with the known noise
    x = x + (lo - hi) * velocity(x, sigma_hi)  # one Euler step with gradient
    return (x - lo * eps) / (1 - lo)  # the noise left at sigma_lo removed: the clean latents


def time_discount(index: torch.Tensor, grid: int, shift: float) -> torch.Tensor:
    """The official discount ``sd3_time_shift(shift, linspace(0, 1, L + 1))[index]``: ``s m / (1 + (s - 1) m)`` at ``m
    = index / L``, `(N,)` float32 in [0, 1] (small for the clean end, where the reward is easy to hack)."""
    m = index.float() / grid
    return shift * m / (1 + (shift - 1) * m)


@register_method("srpo", "direct reward: Direct-Align with a semantic relative reward")
class SRPO(DirectReward):
    """``train.method: srpo``: Direct-Align with the semantic relative preference reward (module docstring).

    Raises:
        ConfigError: as :class:`flowrl.methods.direct.DirectReward` (a reward without ``score_with_grad``, a family
            whose latents are not the VAE's).
    """

    def start_step(self, generator: torch.Generator) -> int:
        return 0  # the rollout keeps each sample's initial noise (its state at grid index 0)

    def levels(self, n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``n`` draws of the official indices: ``(m, sigma_hi, sigma_lo)``, `(n,)` long and two `(n,)` float32."""
        c = self.cfg.train.srpo
        grid = torch.linspace(c.sigma_max, c.sigma_min, c.grid)  # (L,): noisiest first
        length, most = c.grid, int((1 - c.groundtruth_ratio) * c.grid) + 1
        m = torch.randint(2, length - 1, (n,), generator=generator)  # official random.randint(2, L - 2)
        gap = torch.minimum(torch.minimum(length - m, torch.full_like(m, most)), m)
        start = torch.clamp(m + gap, max=length)
        return m, grid[length - start], grid[length - m]

    def update(self, samples, adv, keep, generator: torch.Generator) -> dict:
        """Optimizer steps over the images in minibatches: Direct-Align, the decoder, the relative reward and the
        discounted loss (module docstring); returns ``policy/loss``, ``policy/reward`` (the relative reward),
        ``policy/sigma`` (the mean noised level), ``policy/kl``, ``policy/grad_norm``, ``policy/optimizer_steps``,
        ``cost/*``."""
        c, d, model = self.cfg.train.srpo, self.cfg.train.direct, self.model
        velocity = model.velocity_fn(samples.table, c.guidance_scale)
        word = lambda words: words[int(torch.randint(len(words), (1,), generator=generator))]  # noqa: E731
        positive, negative = word(c.positive_words), word(c.negative_words)

        def micro_loss(idx, stats, at):
            kl: list = []
            m, hi, lo = (v.to(self.device) for v in self.levels(len(idx), generator))
            cond = samples.cond[idx]
            x0 = direct_align(
                samples.final[idx],
                samples.start[idx],
                hi,
                lo,
                lambda x, t: self._velocity(velocity, x, t, cond, kl),
            )
            images = model.decode_with_grad(x0, clean=True)
            rows = idx.tolist()
            prompts, metadata = [samples.prompts[i] for i in rows], [samples.metadata[i] for i in rows]
            r_pos = self.reward_with_grad(images, [f"{positive}. {p}" for p in prompts], metadata)
            r_neg = self.reward_with_grad(images, [f"{negative}. {p}" for p in prompts], metadata)
            r = (1 + c.relative_weight) * r_pos - r_neg  # (b,)
            loss = -(r * time_discount(m, c.grid, c.discount_shift)).mean() * d.scale
            if kl:
                loss = loss + d.kl_beta * torch.stack(kl).mean()
                stats["policy/kl"].append(torch.stack(kl).mean().item())
            stats["policy/reward"].append(r.mean().item())
            stats["policy/sigma"].append(hi.mean().item())
            return loss

        stats, steps = self.optimizer_steps(len(samples.cond), generator, micro_loss)
        rows = len(samples.cond) * self.cfg.train.inner_epochs
        nfe = rows * model.cfg_rows(c.guidance_scale) * (2 if d.kl_beta > 0 else 1)
        return self.update_metrics(stats, steps, len(samples.cond), nfe)
