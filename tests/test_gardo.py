"""GARDO's official parts beyond tests/test_methods.py: the DINOv3 diversity features (yifan123/flow_grpo
scripts/train_sd3_gardo.py: timm ``vit_large_patch16_dinov3.lvd1689m`` on its eval transform) on a tiny random
transformers DINOv3 ViT, and the SD3 script's std weighting of the clipped surrogate, written out here in float64."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch
from conftest import REPO, tiny_overrides

from flowrl.config import ConfigError, load_config

G64 = torch.float64


@pytest.fixture(scope="module")
def dinov3_folder(tmp_path_factory):
    """A tiny random ``DINOv3ViTModel`` (2 register tokens) saved with save_pretrained (safetensors)."""
    from transformers import DINOv3ViTConfig, DINOv3ViTModel

    torch.manual_seed(0)
    config = DINOv3ViTConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_register_tokens=2
    )
    folder = tmp_path_factory.mktemp("dinov3")
    DINOv3ViTModel(config).save_pretrained(folder)
    return folder


def _official_transform():
    """timm's eval transform of the official's DINOv3 (its data config written out with torchvision)."""
    from torchvision import transforms as T

    return T.Compose(
        [
            T.Resize(256, interpolation=T.InterpolationMode.BICUBIC, antialias=True),
            T.CenterCrop(256),
            T.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),
        ]
    )


# ------------------------------------------------------------------------------------------------ DINOv3 features
@pytest.mark.parametrize("h,w", [(64, 64), (300, 200), (96, 160), (512, 512)])
def test_dinov3_pixels_are_timms_eval_transform_of_the_official_model(h, w):
    from flowrl.methods.gardo import dinov3_pixels

    images = torch.rand(2, 3, h, w, generator=torch.Generator().manual_seed(h + w))
    ours = dinov3_pixels(images)
    assert ours.shape == (2, 3, 256, 256)
    torch.testing.assert_close(ours, _official_transform()(images), rtol=0, atol=1e-5)
    data = pytest.importorskip("timm.data")  # the official's own transform, where timm is installed
    from timm.models import get_pretrained_cfg

    cfg = data.resolve_data_config(pretrained_cfg=get_pretrained_cfg("vit_large_patch16_dinov3.lvd1689m").to_dict())
    torch.testing.assert_close(ours, data.create_transform(**cfg, is_training=False)(images), rtol=0, atol=1e-5)


def test_dinov3_features_are_the_mean_patch_token_of_the_models_own_forward(dinov3_folder):
    """Official: ``dinov3(transforms(images))``, timm's Eva with global_pool 'avg' and no head: the mean over the patch
    tokens (CLS and registers left out) of the final-normed last hidden state."""
    from transformers import DINOv3ViTModel

    from flowrl.methods.gardo import DINOv3Features

    images = torch.rand(3, 3, 80, 48, generator=torch.Generator().manual_seed(1))
    ours = DINOv3Features(str(dinov3_folder), torch.device("cpu"), batch_size=2)(images)

    model = DINOv3ViTModel.from_pretrained(dinov3_folder).eval()
    with torch.no_grad():
        out = model(pixel_values=_official_transform()(images))
    expected = out.last_hidden_state[:, 1 + 2 :].mean(1)  # (3, 32): after the CLS token and the 2 registers
    assert ours.shape == (3, 32) and ours.dtype == torch.float32
    torch.testing.assert_close(ours, expected, rtol=0, atol=1e-5)
    assert not torch.allclose(ours, out.pooler_output, atol=1e-3)  # not the CLS token

    video = torch.stack([images, images.flip(0)], 1)  # (3, 2, 3, 80, 48): each frame's features, concatenated
    feats = DINOv3Features(str(dinov3_folder), torch.device("cpu"))(video)
    torch.testing.assert_close(feats, torch.cat([expected, expected.flip(0)], 1), rtol=0, atol=1e-5)


def test_dinov3_settings_are_refused_naming_the_key_before_training(tmp_path, dinov3_folder):
    from flowrl.methods.gardo import DINOv3Features

    key = r"train\.gardo\.feature_model"
    with pytest.raises(ConfigError, match=key):
        load_config(REPO / "configs" / "gardo.yaml", ["train.gardo.features=dinov3"])
    with pytest.raises(ConfigError, match=r"train\.gardo\.features"):
        load_config(REPO / "configs" / "gardo.yaml", ["train.gardo.features=clip"])
    with pytest.raises(ConfigError, match=key + ".*no config.json"):
        DINOv3Features(str(tmp_path / "missing"), torch.device("cpu"))
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text((dinov3_folder / "config.json").read_text())
    (pickled / "pytorch_model.bin").write_bytes(b"not unpickled")
    with pytest.raises(ConfigError, match=key + ".*only pickled weights") as e:
        DINOv3Features(str(pickled), torch.device("cpu"))
    assert "\n" not in str(e.value)
    other = tmp_path / "clip"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "clip"}))
    with pytest.raises(ConfigError, match=key + ".*not a DINOv3 ViT"):
        DINOv3Features(str(other), torch.device("cpu"))


def test_gardo_trains_one_iteration_on_dinov3_features(tmp_path, random_pipeline, prompt_files, dinov3_folder):
    """One iteration of the shipped preset (Trainer.step: rollout, rewards, advantages, update) on a tiny random
    pipeline with features dinov3 and the std weighting on (off by default)."""
    from flowrl.trainer import Trainer

    train, test = prompt_files
    extra = {
        "rewards.geneval": "null",
        "rewards.jpeg_compressibility.weight": 1.0,
        "sampling.group_size": 4,
        "train.minibatch_size": 8,
        "train.gardo.features": "dinov3",
        "train.gardo.feature_model": str(dinov3_folder),
        "train.gardo.std_weighting": True,
    }
    trainer = Trainer(load_config(REPO / "configs" / "gardo.yaml", tiny_overrides(random_pipeline, train, test, tmp_path, **extra)))  # fmt: skip
    assert trainer.cfg.train.gardo.std_weighting
    seen = []
    features = trainer.method.feature_model

    def spy(images):
        seen.append(features(images))
        return seen[-1]

    trainer.method.feature_model = spy
    before = {n: p.detach().clone() for n, p in trainer.policy.params.items()}
    metrics = trainer.step(0)
    assert len(seen) == 1 and seen[0].shape == (8, 32)  # the iteration's 2 prompts x 4 images, DINOv3's width
    assert any(not torch.equal(before[n], p) for n, p in trainer.policy.params.items()), "the policy did not move"
    assert math.isfinite(metrics["policy/loss"]) and math.isfinite(metrics["advantage/abs_mean"])
    assert "gardo/gated_frac" in metrics and metrics["policy/ratio_first_max_dev"] == 0.0


# ------------------------------------------------------------------------------------------------ std weighting
def _gardo(std_weighting: bool, clip_range: float):
    from flowrl.methods.gardo import GARDO, GARDOConfig

    m = GARDO.__new__(GARDO)
    gardo = GARDOConfig(std_weighting=std_weighting)
    m.cfg = SimpleNamespace(train=SimpleNamespace(gardo=gardo, clip_range=clip_range, ratio_norm=False))
    return m


def _transitions(steps: list[int], noise_level: float = 0.7):
    """Flow-GRPO SDE transitions at `steps` of a shifted 6-step schedule: std = sigma_t sqrt(dt)."""
    sigmas = torch.tensor([1.0, 0.93, 0.82, 0.66, 0.45, 0.2, 0.0], dtype=G64)
    k = torch.tensor(steps)
    sigma, sigma_next = sigmas[k], sigmas[k + 1]
    # Flow-GRPO's kernel at sigma = 1 takes sigma_max = sigmas[1] in the denominator (sde_step_with_logprob)
    sigma_t = noise_level * torch.sqrt(sigma / (1 - torch.where(sigma == 1, sigmas[1], sigma)))
    std = (sigma_t * (sigma - sigma_next).sqrt()).float()
    return SimpleNamespace(std=std, sigma=sigma.float(), sigma_next=sigma_next.float()), sigma_t


def test_std_weighting_is_the_official_sd3_scripts_weighted_surrogate():
    """scripts/train_sd3_gardo.py: ``policy_loss = (std_dev_t / mean(std_dev_t)) * max(-A r, -A clip(r, 1 +- eps))``,
    ``loss = mean(policy_loss)`` over the back-propagated batch, with ``std_dev_t = noise_level sqrt(sigma / (1 -
    sigma))``; written out in float64, against GARDO.policy_loss (value and gradient)."""
    from flowrl.losses import ppo_loss

    gen = torch.Generator().manual_seed(0)
    steps = [0, 0, 1, 2, 3, 3, 4, 5, 5, 1]
    sub, sigma_t = _transitions(steps)
    old = torch.randn(len(steps), generator=gen, dtype=G64)
    sub.log_prob = old
    log_prob = (old + 0.3 * torch.randn(len(steps), generator=gen, dtype=G64)).requires_grad_()
    adv = torch.randn(len(steps), generator=gen, dtype=G64)
    eps = 0.2
    ours, _ = _gardo(True, eps).policy_loss(log_prob, None, sub, adv, None)
    (grad,) = torch.autograd.grad(ours, log_prob)

    lp = log_prob.detach().clone().requires_grad_()
    ratio = torch.exp(lp - old)
    surrogate = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1 - eps, 1 + eps))
    expected = ((sigma_t / sigma_t.mean()) * surrogate).mean()
    torch.testing.assert_close(ours, expected, rtol=0, atol=1e-6)
    torch.testing.assert_close(grad, torch.autograd.grad(expected, lp)[0], rtol=0, atol=1e-6)
    assert not torch.allclose(ours, surrogate.mean(), atol=1e-4)  # the weight matters where steps mix

    step_w = torch.rand(len(steps), generator=gen, dtype=G64)  # a train.step_weighting weight multiplies in
    both, _ = _gardo(True, eps).policy_loss(log_prob, None, sub, adv, step_w)
    torch.testing.assert_close(both, (step_w * (sigma_t / sigma_t.mean()) * surrogate).mean(), rtol=0, atol=1e-6)

    plain, _ = _gardo(False, eps).policy_loss(log_prob, None, sub, adv, None)
    torch.testing.assert_close(plain, ppo_loss(log_prob, old, adv, eps)[0], rtol=0, atol=0)
    one_step, _ = _transitions([3] * len(steps))  # the official's batches: one step each, so every weight is 1
    one_step.log_prob = old
    same, _ = _gardo(True, eps).policy_loss(log_prob, None, one_step, adv, None)
    torch.testing.assert_close(same, surrogate.mean(), rtol=0, atol=1e-6)
