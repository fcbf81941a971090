"""GARDO, Gated and Adaptive Regularization with Diversity-aware Optimization (He et al., arXiv 2512.24138;
yifan123/flow_grpo ``scripts/train_sd3_gardo.py``, ``flow_grpo/stat_tracking.py`` (``type='gardo'``) and
``config/grpo_gardo.py``, commit 94e23ee).

Flow-GRPO (:class:`flowrl.methods.grpo.GRPO`, flat groups) with three changes against reward hacking, and the
official SD3 script's weighting of the loss:

- **Gated KL**: the KL term (weight ``train.kl_beta``) covers only the images whose reward is uncertain. With ranks
  over the iteration's gathered images (1 = best), ``u_i = rank_total(i) - mean_k rank_k(i)`` over the auxiliary
  rewards ``train.gardo.auxiliary`` (scored, usually with weight 0: the official trains on its main reward alone);
  the images with ``u`` above the ``100 (1 - f)`` percentile of the non-negative ``u`` are gated. The fraction ``f``
  adapts (the official ``RiskCompensator``): it starts at ``gate_fraction``, grows by ``gate_rate`` when the mean
  non-negative ``u`` exceeds every one of the last ``gate_history`` iterations', shrinks alike when below all, and
  stays in ``[gate_min, gate_max]``.
- **Adaptive reference**: the KL's reference is a copy of the policy (no LoRA needed), reset to the policy after an
  iteration in which a micro-batch's KL exceeded ``kl_threshold`` (on any process: every process resets alike),
  or ``reset_every`` iterations after the last reset.
- **Diversity-aware advantages**: ``A_i = clip((r_i - mean_g r) d_i, +-train.adv_clip_max)``, no std normalisation,
  with ``d_i = 1`` below the group mean and, above it, the image's distance to its nearest group mate (cosine
  distance of image features) over the group's mean such distance.

  The features (``train.gardo.features``) are the official's with ``dinov3``: the mean patch token (after the final
  norm; not the CLS or register tokens) of a DINOv3 ViT (``train.gardo.feature_model``, a local transformers folder;
  the official ViT-L/16 lvd1689m through timm) on the images resized (bicubic, antialiased) to 256 on the short side,
  centre-cropped to 256 x 256 and normalised by the ImageNet mean and std; ``pixels`` (the default, as no weights ship)
  are the images average-pooled to at most 32 x 32 pixels.
- **Std weighting** (``train.gardo.std_weighting``, the official SD3 script's): each transition's clipped surrogate is
  weighted by its SDE ``sigma_t`` (the step std per unit time) over the mean ``sigma_t`` of the micro-batch it is
  back-propagated in; the KL term is not weighted.

Deviations: the default features are pooled pixels (above); the std weighting is off by default: the official's
micro-batches each hold one denoising step, so there its std weight is exactly 1 (its FLUX script has none), while
flowrl's mix steps, where the same weight would favour the noisier ones; the reset test reads every
micro-batch's KL (the official every optimizer step's mean).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from ..fields import check, config_key, config_section, setting
from .base import Rewards, SDESamples, register_method
from .grpo import GRPO

FEATURES = ("pixels", "dinov3")  # train.gardo.features


@config_section("train", "gardo", "GARDO's settings (train.method gardo)")
@dataclass
class GARDOConfig:
    """``train.gardo.*``: GARDO (``train.method: gardo``)."""

    auxiliary: list = setting(
        factory=list,
        help="reward names (in rewards:) whose ranks against the trained total measure uncertainty (official: "
        "aesthetic and imagereward beside the main reward); empty: the KL covers every image",
    )
    gate_fraction: float = setting(0.1, "initial fraction of the non-negative uncertainties gated (official 0.1)")
    gate_min: float = setting(0.02, "smallest gated fraction (official 0.02)")
    gate_max: float = setting(0.2, "largest gated fraction (official 0.2)")
    gate_rate: float = setting(0.1, "relative step of the gated fraction (official 0.1)")
    gate_history: int = setting(20, "iterations of mean uncertainty the fraction compares with (official 20)")
    kl_threshold: float = setting(3e-4, "a micro-batch KL above this resets the reference after the iteration (3e-4)")
    reset_every: int = setting(15, "iterations after which the reference resets regardless (official 15)")
    diversity: bool = setting(True, "scale above-mean advantages by the image's diversity in its group")
    features: str = setting(
        "pixels",
        "the diversity's image features: pixels (average-pooled to at most 32 x 32) | dinov3 (the official: the "
        "mean patch token of train.gardo.feature_model)",
    )
    feature_model: Optional[str] = setting(
        None,
        "with features dinov3: a local folder of a transformers DINOv3ViTModel in safetensors (the official: "
        "ViT-L/16 lvd1689m)",
    )
    std_weighting: bool = setting(
        False,
        "weight each transition's clipped surrogate by its SDE sigma_t over its micro-batch's mean (the official "
        "SD3 script's formula; off by default: its micro-batches hold one step each, so the weight is 1 there, while "
        "flowrl's mix steps and the weight would favour the noisy ones)",
    )

    def __post_init__(self):
        check(
            isinstance(self.auxiliary, (list, tuple)) and all(isinstance(a, str) for a in self.auxiliary),
            "train.gardo.auxiliary",
            "a list of reward names",
            self.auxiliary,
        )
        self.auxiliary = list(self.auxiliary)
        check(0 < self.gate_min <= self.gate_max <= 1, "train.gardo.gate_min / gate_max", "0 < min <= max <= 1",
              (self.gate_min, self.gate_max))  # fmt: skip
        check(self.gate_min <= self.gate_fraction <= self.gate_max, "train.gardo.gate_fraction",
              "in [gate_min, gate_max]", self.gate_fraction)  # fmt: skip
        check(0 <= self.gate_rate < 1, "train.gardo.gate_rate", "in [0, 1)", self.gate_rate)
        check(self.gate_history >= 1, "train.gardo.gate_history", ">= 1", self.gate_history)
        check(self.kl_threshold > 0, "train.gardo.kl_threshold", "> 0", self.kl_threshold)
        check(self.reset_every >= 1, "train.gardo.reset_every", ">= 1", self.reset_every)
        check(self.features in FEATURES, "train.gardo.features", " | ".join(FEATURES), self.features)
        check(
            self.features != "dinov3" or (isinstance(self.feature_model, str) and self.feature_model.strip() != ""),
            "train.gardo.feature_model",
            "a local DINOv3 folder with train.gardo.features dinov3",
            self.feature_model,
        )


def descending_ranks(x: torch.Tensor) -> torch.Tensor:
    """Ranks of `x` `(N,)`, 1 for the largest (ties by position), float64."""
    ranks = torch.empty(len(x), dtype=torch.float64)
    ranks[torch.sort(x, descending=True, stable=True).indices] = torch.arange(1, len(x) + 1, dtype=torch.float64)
    return ranks


def uncertainty(total: torch.Tensor, auxiliary: list[torch.Tensor]) -> torch.Tensor:
    """GARDO's uncertainty ``rank(total) - mean_k rank(aux_k)`` per image (ranks 1 = best), float64 `(N,)`."""
    return descending_ranks(total) - torch.stack([descending_ranks(a) for a in auxiliary]).mean(0)


def diversity(features: torch.Tensor, group: torch.Tensor) -> torch.Tensor:
    """Each image's cosine distance to its nearest group mate, over its group's mean of those distances.

    Args:
        features (`torch.Tensor` of shape `(N, D)`): image features. group (`(N,)` long): group ids.

    Returns:
        `torch.Tensor` of shape `(N,)`, float64, >= 0 (1 for a group of one image or of identical images).
    """
    f = torch.nn.functional.normalize(features.double(), dim=1)
    out = torch.ones(len(f), dtype=torch.float64)
    for g in group.unique():
        rows = (group == g).nonzero().squeeze(1)
        if len(rows) < 2:
            continue
        dist = 1 - (f[rows] @ f[rows].T).clamp(-1, 1)
        dist.fill_diagonal_(float("inf"))
        nearest = dist.min(1).values  # (n,)
        mean = nearest.mean()
        out[rows] = nearest / mean if mean > 0 else torch.ones_like(nearest)
    return out


def gardo_advantages(
    total: torch.Tensor, group: torch.Tensor, div: torch.Tensor | None, clip: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``clip((r - mean_g r) d, +-clip)`` with ``d = 1`` below the group mean (module docstring); float32 `(N,)` and the
    groups without reward variance `(N,)` bool."""
    r = total.double()
    adv, zero = torch.zeros_like(r), torch.zeros(len(r), dtype=torch.bool)
    for g in group.unique():
        rows = (group == g).nonzero().squeeze(1)
        centred = r[rows] - r[rows].mean()
        if div is not None:
            centred = torch.where(centred < 0, centred, centred * div[rows])
        adv[rows] = centred
        zero[rows] = bool((r[rows] == r[rows][0]).all())
    return adv.clamp(-clip, clip).float().masked_fill(zero, 0.0), zero


# The official's DINOv3 input: timm's eval transform (``timm.data.create_transform(is_training=False)``) for the data
# config of ``vit_large_patch16_dinov3.lvd1689m``: input 256 x 256, crop_pct 1.0, bicubic, the ImageNet mean and std.
DINOV3_SIZE = 256
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def dinov3_pixels(images: torch.Tensor, size: int = DINOV3_SIZE) -> torch.Tensor:
    """The official's DINOv3 input: the short side resized to `size` (the long side to ``int(size * long / short)``;
    bicubic, antialiased, unclamped), the centre `size` x `size` crop and the ImageNet normalisation, as torchvision's
    ``Resize(size)``, ``CenterCrop(size)`` and ``Normalize`` (timm's eval transform) run on a batch tensor.

    Args:
        images (`torch.Tensor` of shape `(N, 3, H, W)`): floating, in [0, 1].

    Returns:
        `torch.Tensor` of shape `(N, 3, size, size)`, float32, on the images' device.
    """
    x = images.float()
    h, w = x.shape[-2:]
    long = int(size * max(h, w) / min(h, w))
    new_h, new_w = (long, size) if w <= h else (size, long)
    if (new_h, new_w) != (h, w):
        x = torch.nn.functional.interpolate(
            x, size=(new_h, new_w), mode="bicubic", align_corners=False, antialias=True
        )
    top, left = int(round((new_h - size) / 2.0)), int(round((new_w - size) / 2.0))
    x = x[..., top : top + size, left : left + size]  # (N, 3, size, size)
    mean, std = x.new_tensor(IMAGENET_MEAN).view(1, 3, 1, 1), x.new_tensor(IMAGENET_STD).view(1, 3, 1, 1)
    return (x - mean) / std


def check_feature_model(folder: str) -> None:
    """Check a DINOv3 folder before it loads: ``config.json`` of ``model_type`` ``dinov3_vit`` and whole safetensors
    weights (:func:`flowrl.files.check_weights_folder`).

    Raises:
        ValueError: naming the folder or file: no folder or ``config.json``, another model type, no safetensors, only
            pickled weights, or a damaged weight file.
    """
    from ..files import check_weights_folder

    path = Path(folder)
    if not (path / "config.json").is_file():
        raise ValueError(f"{folder} is not a transformers model folder (no config.json)")
    try:
        model_type = json.loads((path / "config.json").read_text(encoding="utf-8")).get("model_type")
    except (ValueError, AttributeError):
        raise ValueError(f"{path / 'config.json'} is not a JSON object") from None
    if model_type != "dinov3_vit":
        raise ValueError(f"{folder} holds a {model_type!r} model, not a DINOv3 ViT (model_type 'dinov3_vit')")
    check_weights_folder(path, "load it once in a trusted environment and save_pretrained() it (safetensors)")
    if not any(path.glob("*.safetensors")):
        raise ValueError(f"{folder} has no *.safetensors weights")


class DINOv3Features:
    """The official GARDO's diversity features: the mean patch token of a DINOv3 ViT's last hidden state (after its
    final norm, without the CLS and register tokens: timm's default ``avg`` pool of ``vit_large_patch16_dinov3``) on
    :func:`dinov3_pixels` of the images, in float32 without gradients.

    Args:
        folder (`str`): a local transformers ``DINOv3ViTModel`` folder (safetensors only; nothing is downloaded).
        device (`torch.device`): where the model runs.
        batch_size (`int`): images per forward.

    Raises:
        ConfigError: naming ``train.gardo.feature_model``, for a folder :func:`check_feature_model` refuses or
            transformers cannot load.
    """

    def __init__(self, folder: str, device: torch.device, batch_size: int = 16):
        from transformers import DINOv3ViTModel

        from ..files import resolve_path
        from ..rewards.base import quiet_loading

        folder = str(resolve_path(folder))  # the working folder's, else the repository's
        with config_key("train.gardo.feature_model", (ValueError, OSError)), quiet_loading():
            check_feature_model(folder)
            model = DINOv3ViTModel.from_pretrained(
                folder, local_files_only=True, use_safetensors=True, dtype=torch.float32
            )
        self.device, self.batch_size = torch.device(device), batch_size
        self.model = model.eval().requires_grad_(False).to(self.device)
        self.prefix = 1 + int(model.config.num_register_tokens)  # CLS, then the registers, then the patches

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        """Features of `(B, 3, H, W)` images, or of each frame of `(B, F, 3, H, W)` videos concatenated; floating in
        [0, 1]. Returns `(B, D)` or `(B, F * D)` float32 on the CPU."""
        with torch.no_grad():
            x = images.flatten(0, 1) if images.ndim == 5 else images  # (B', 3, H, W)
            out = []
            for c in range(0, len(x), self.batch_size):
                pixels = dinov3_pixels(x[c : c + self.batch_size].to(self.device))  # (n, 3, 256, 256)
                with torch.autocast(self.device.type, enabled=False):
                    hidden = self.model(pixel_values=pixels).last_hidden_state  # (n, 1 + R + P, D)
                out.append(hidden[:, self.prefix :].float().mean(1).cpu())  # (n, D)
            return torch.cat(out).reshape(len(images), -1)


def std_weights(std: torch.Tensor, sigma: torch.Tensor, sigma_next: torch.Tensor) -> torch.Tensor:
    """The official SD3 script's loss weight of each transition: its SDE ``sigma_t = std / sqrt(|dt|)`` (the script's
    ``std_dev_t``, ``noise_level sqrt(sigma / (1 - sigma))`` for Flow-GRPO's kernel) over the mean over the rows.

    Args:
        std, sigma, sigma_next (`torch.Tensor` of shape `(m,)`): the transitions' step std and noise levels.

    Returns:
        `torch.Tensor` of shape `(m,)`, float32, mean 1 (all 1 where every ``sigma_t`` is 0).
    """
    s = std.double() / (sigma.double() - sigma_next.double()).abs().sqrt()  # (m,) sigma_t
    mean = s.mean()
    return (s / mean).float() if mean > 0 else torch.ones_like(s, dtype=torch.float32)


@register_method("gardo", "GRPO with a gated, resetting KL")
class GARDO(GRPO):
    """``train.method: gardo`` (module docstring): GRPO on flat groups with a gated, resetting KL and diversity-aware
    advantages.

    Args: as :class:`flowrl.methods.base.Method`.
    """

    REFERENCE_FILE = "gardo_reference.safetensors"

    @classmethod
    def check_config(cls, cfg) -> None:
        super().check_config(cfg)
        check(cfg.sampling.shape == "flat", "sampling.shape", "'flat' with train.method 'gardo'", cfg.sampling.shape)
        check(
            cfg.train.reward_aggregation == "reward",
            "train.reward_aggregation",
            "'reward' with train.method 'gardo' (it centres the weighted total)",
            cfg.train.reward_aggregation,
        )
        check(cfg.train.best_of_n == 0, "train.best_of_n", "0 with train.method 'gardo'", cfg.train.best_of_n)
        for name in cfg.train.gardo.auxiliary:
            check(name in cfg.rewards, "train.gardo.auxiliary", f"names of rewards in rewards: {sorted(cfg.rewards)}",
                  name)  # fmt: skip

    def __init__(self, cfg, model, policy, rewards):
        super().__init__(cfg, model, policy, rewards)
        g = cfg.train.gardo
        self.reference = policy.copy() if cfg.train.kl_beta > 0 else None
        self.fraction, self.history = g.gate_fraction, []  # the gated fraction and the recent mean uncertainties
        self.iterations, self.last_reset, self.exceeded = 0, 0, False
        self.gate = None  # (B,) bool per local image, set by advantages
        self.v_ref = None
        dinov3 = g.diversity and g.features == "dinov3"
        self.feature_model = DINOv3Features(g.feature_model, self.device) if dinov3 else None

    # ------------------------------------------------------------------------------ advantages
    def features(self, images: torch.Tensor) -> torch.Tensor:
        """Image features for the diversity (``train.gardo.features``): :class:`DINOv3Features`, or `(B, 3, H, W)` or
        `(B, F, 3, H, W)` images average-pooled to at most 32 x 32 and flattened; `(B, D)` float32."""
        if self.feature_model is not None:
            return self.feature_model(images)
        x = images.float().flatten(0, images.ndim - 4) if images.ndim == 5 else images.float()
        size = (min(32, x.shape[-2]), min(32, x.shape[-1]))
        pooled = torch.nn.functional.adaptive_avg_pool2d(x, size)
        return pooled.reshape(len(images), -1)

    def advantages(self, samples: SDESamples, rewards: Rewards, generator: torch.Generator):
        """GARDO's advantages per transition (module docstring) and the gate of each local image; records
        ``advantage/*``, ``gardo/gated_frac``, ``gardo/gate_fraction``."""
        g = self.cfg.train.gardo
        local = self.features(samples.images) if g.diversity else None
        if local is not None and self.policy.accelerator.num_processes > 1:
            local = self.policy.accelerator.gather(local.to(self.device)).cpu()
        div = None if local is None else diversity(local.nan_to_num(), rewards.group)  # NaN -> 0 as the official
        self._adv = gardo_advantages(rewards.total, rewards.group, div, self.cfg.train.adv_clip_max)
        gate = torch.ones(len(rewards.total), dtype=torch.bool)
        if g.auxiliary:
            u = uncertainty(rewards.total, [rewards.per_reward[name] for name in g.auxiliary])
            nonneg = u[u >= 0].numpy()
            self.update_fraction(float(nonneg.mean()))
            gate = u > float(np.percentile(nonneg, 100 - self.fraction * 100))
        self.gate = gate[rewards.mine].to(self.device)
        adv, keep, stats = super().advantages(samples, rewards, generator)
        stats["gardo/gated_frac"] = gate.float().mean().item()
        stats["gardo/gate_fraction"] = self.fraction
        return adv, keep, stats

    def group_advantages(self, rewards: Rewards):
        """The advantages :meth:`advantages` computed (the flat shape asks for them through this)."""
        adv, zero = self._adv
        return adv, zero, {"advantage/zero_variance_frac": zero.float().mean().item(), "advantage/abs_mean":
                           adv.abs().mean().item()}  # fmt: skip

    def update_fraction(self, mean_u: float) -> None:
        """The official ``RiskCompensator``: the gated fraction follows the mean non-negative uncertainty."""
        g = self.cfg.train.gardo
        if self.history and mean_u > max(self.history):
            self.fraction *= 1 + g.gate_rate
        elif self.history and mean_u < min(self.history):
            self.fraction *= 1 - g.gate_rate
        self.fraction = float(min(max(self.fraction, g.gate_min), g.gate_max))
        self.history = (self.history + [mean_u])[-g.gate_history :]

    # ------------------------------------------------------------------------------ the std weighting
    def policy_loss(self, log_prob, mean, sub, adv, weights):
        """:meth:`GRPO.policy_loss` with, under ``train.gardo.std_weighting``, each transition's weight (times any
        ``train.step_weighting`` weight) its :func:`std_weights` over the micro-batch `sub`."""
        if self.cfg.train.gardo.std_weighting:
            w = std_weights(sub.std, sub.sigma, sub.sigma_next).to(log_prob.device)  # (m,)
            weights = w if weights is None else weights * w
        return super().policy_loss(log_prob, mean, sub, adv, weights)

    # ------------------------------------------------------------------------------ the gated KL
    def micro_batch_loss(self, velocity, sub, adv, weights, at, diag):
        """:meth:`GRPO.micro_batch_loss`; a zero-weight padding micro-batch's KL (``at.pad``) does not count towards
        the reference's reset."""
        exceeded = self.exceeded
        out = super().micro_batch_loss(velocity, sub, adv, weights, at, diag)
        if at.pad:
            self.exceeded = exceeded
        return out

    def policy_log_prob(self, velocity, sub):
        """The reference's velocity at the gated transitions (before the policy's forward: the reference is held in
        the same weights), then :meth:`GRPO.policy_log_prob`. In lockstep (:attr:`flowrl.policy.Policy.lockstep`)
        a micro-batch without a gated transition runs the reference on its first one, discarded, so that every
        micro-batch calls the transformer twice on every process."""
        self.v_ref = None
        if self.reference is not None:
            leaf = sub.leaf.to(self.device)
            mask = torch.ones_like(leaf, dtype=torch.bool) if self.gate is None else self.gate[leaf]  # None: all
            gated = mask.nonzero().squeeze(1).to(sub.leaf.device)
            if len(gated) or self.policy.lockstep:
                rows = sub.select(gated if len(gated) else torch.zeros(1, dtype=gated.dtype, device=gated.device))
                with torch.no_grad(), self.policy.holding(self.reference), self.policy.autocast():
                    v_ref = velocity(rows.state, rows.sigma, rows.cond)
                self.v_ref = (mask, rows, v_ref) if len(gated) else None
        return super().policy_log_prob(velocity, sub)

    def kl_to_reference(self, velocity, sub, v: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
        """Flow-GRPO's KL (``train.kl_type``) of the gated transitions to the reference copy; 0 when none is gated."""
        from ..losses import kl_to_reference, velocity_kl
        from ..samplers import recompute_log_prob

        if self.v_ref is None:
            return v.new_zeros((), dtype=torch.float32)
        mask, rows, v_ref = self.v_ref
        if self.cfg.train.kl_type == "velocity":
            kl = velocity_kl(v[mask], v_ref)
        else:
            std = (
                rows.std
                if self.cfg.train.kl_type != "flow_grpo"
                else rows.std / (rows.sigma - rows.sigma_next).abs().sqrt()
            )
            kl = kl_to_reference(mean[mask], recompute_log_prob(rows, v_ref)[1], std)
        self.exceeded = self.exceeded or kl.item() > self.cfg.train.gardo.kl_threshold
        return kl

    # ------------------------------------------------------------------------------ the reference
    def end_iteration(self, stats: dict) -> None:
        """The rollout shape's move, then the reference's reset (records ``gardo/reference_reset``)."""
        super().end_iteration(stats)
        self.iterations += 1
        if self.reference is None:
            return
        exceeded = self.exceeded
        if self.policy.accelerator.num_processes > 1:  # any process's micro-batch: every process resets alike
            flag = torch.tensor([float(exceeded)], device=self.device)
            exceeded = bool(self.policy.accelerator.gather(flag).max() > 0)
        reset = exceeded or self.iterations - self.last_reset > self.cfg.train.gardo.reset_every
        if reset:
            self.policy.move_towards(self.reference, 0.0)
            self.last_reset = self.iterations
        self.exceeded = False
        stats["gardo/reference_reset"] = float(reset)

    def state_dict(self) -> dict:
        return {
            **super().state_dict(),
            "gardo": {
                "fraction": self.fraction,
                "history": list(self.history),
                "iterations": self.iterations,
                "last_reset": self.last_reset,
            },
        }

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        s = state.get("gardo", {})
        self.fraction = float(s.get("fraction", self.cfg.train.gardo.gate_fraction))
        self.history = [float(x) for x in s.get("history", [])]
        self.iterations, self.last_reset = int(s.get("iterations", 0)), int(s.get("last_reset", 0))

    @classmethod
    def held_copies(cls, cfg) -> int:
        """The KL's reference copy, when ``train.kl_beta > 0``."""
        return int(cfg.train.kl_beta > 0)

    def snapshots(self) -> dict:
        """The KL's reference copy (:data:`REFERENCE_FILE`), when ``train.kl_beta > 0``."""
        return {self.REFERENCE_FILE: self.reference} if self.reference is not None else {}
