"""Direct reward fine-tuning (ReFL, DRaFT-K, AlignProp, SRPO): the differentiable reward's gradient against finite differences, its
scores equal to the scoring path's, the presets train and resume, and non-differentiable rewards are refused."""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import REPO, assert_resume_is_exact, tiny_overrides

from flowrl.config import ConfigError, load_config


def test_clipscore_with_grad_equals_the_scores_and_its_gradient_the_finite_differences():
    from flowrl.rewards import build_reward

    reward = build_reward("clipscore", model_path=str(REPO / "assets" / "tiny-clip"), dtype="float64")
    assert reward.differentiable
    images = torch.rand(2, 3, 8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0)) * 0.8 + 0.1
    prompts = ["a red circle", "two blue squares"]
    with_grad = reward.score_with_grad(images, prompts, [{}, {}])
    assert with_grad.dtype == torch.float64
    torch.testing.assert_close(with_grad.float(), reward(images, prompts, [{}, {}]), rtol=0, atol=1e-5)

    def f(x):
        return reward.score_with_grad(x, prompts, [{}, {}])

    assert torch.autograd.gradcheck(f, (images.clone().requires_grad_(),), eps=1e-6, atol=1e-5, rtol=1e-4)


def _overrides(random_pipeline, prompt_files, out, **extra):
    base = {
        "rewards.clipscore.options.model_path": str(REPO / "assets" / "tiny-clip"),
        "sampling.group_size": 2,
        "sampling.num_steps": 4,
        "train.minibatch_size": 4,
        **extra,
    }
    return tiny_overrides(random_pipeline, *prompt_files, out, **base)


@pytest.mark.parametrize("preset", ["refl", "draft", "alignprop"])
def test_direct_presets_train_on_the_rewards_gradient(preset, tmp_path, random_pipeline, prompt_files):
    from flowrl.trainer import Trainer

    trainer = Trainer(
        load_config(REPO / "configs" / f"{preset}.yaml", _overrides(random_pipeline, prompt_files, tmp_path / "r"))
    )
    assert trainer.method.name == preset
    before = {n: p.detach().clone() for n, p in trainer.policy.params.items()}
    trainer.train()
    rows = [json.loads(line) for line in (tmp_path / "r/metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(math.isfinite(r["policy/loss"]) and r["policy/optimizer_steps"] >= 1 for r in rows)
    assert all(r["policy/loss"] == pytest.approx(-r["policy/reward"], rel=1e-5) for r in rows)  # loss -r, scale 1
    assert any(not torch.equal(before[n], p) for n, p in trainer.policy.params.items())
    steps = {r["policy/start_step"] for r in rows}
    assert steps <= {"refl": {3}, "draft": {2}, "alignprop": {0, 1, 2, 3}}[preset]  # ReFL: [int(0.75 N), N - 1]


def test_refl_resumes_exactly(tmp_path, random_pipeline, prompt_files):
    assert_resume_is_exact(
        REPO / "configs" / "refl.yaml", lambda out: _overrides(random_pipeline, prompt_files, out), tmp_path
    )


def test_a_reward_without_a_gradient_is_refused_naming_its_key(tmp_path, random_pipeline, prompt_files):
    from flowrl.trainer import Trainer

    over = _overrides(random_pipeline, prompt_files, tmp_path / "r", **{"rewards.jpeg_compressibility.weight": 1.0})
    with pytest.raises(ConfigError, match=r"'rewards\.jpeg_compressibility': train\.method 'draft' back-propagates"):
        Trainer(load_config(REPO / "configs" / "draft.yaml", over))
    with pytest.raises(ConfigError, match=r"train\.direct\.grad_steps"):
        load_config(REPO / "configs" / "draft.yaml", ["train.direct.grad_steps=0"])


@pytest.mark.parametrize("preset,step,calls", [("refl", 3, 1), ("draft", 2, 2), ("alignprop", 1, 3)])
def test_only_the_steps_after_the_truncation_take_gradient(
    preset, step, calls, tmp_path, random_pipeline, prompt_files
):
    """The velocity is called with gradient exactly at the steps from the truncation on (ReFL: one), and the loss's
    gradient reaches the policy's weights."""
    from flowrl.trainer import Trainer

    trainer = Trainer(
        load_config(REPO / "configs" / f"{preset}.yaml", _overrides(random_pipeline, prompt_files, tmp_path / "r"))
    )
    method, model = trainer.method, trainer.model
    metas = trainer.train_metas[:1]
    table = model.prompt_table(metas)
    cond = table.rows(torch.zeros(2, dtype=torch.long))
    seen = []
    inner = model.velocity_fn(table, 1.0)

    def counting(x, t, c):
        seen.append((round(float(t[0]), 6), torch.is_grad_enabled()))
        return inner(x, t, c)

    x = torch.randn(2, *model.latent_shape)
    x0 = method.predict(counting, x, cond, step, [])
    assert len(seen) == calls and all(grad for _, grad in seen)
    assert [s for s, _ in seen] == [round(float(t), 6) for t in method.sigmas[step : step + calls]]
    x0.float().pow(2).mean().backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in trainer.policy.params.values())


def test_direct_align_recovers_the_clean_latents_from_the_true_velocity():
    """SRPO's Direct-Align (arXiv 2509.06942): with the straight path's velocity eps - x0 the recovered latents are
    x0 exactly, at any pair of levels; the step's gradient reaches the velocity."""
    from flowrl.methods.srpo import direct_align

    gen = torch.Generator().manual_seed(0)
    x0, eps = (
        torch.randn(3, 4, 8, 8, generator=gen, dtype=torch.float64),
        torch.randn(3, 4, 8, 8, generator=gen).double(),
    )
    hi, lo = torch.tensor([0.9, 0.5, 0.3], dtype=torch.float64), torch.tensor([0.2, 0.45, 0.0], dtype=torch.float64)
    scale = torch.ones((), dtype=torch.float64, requires_grad=True)
    out = direct_align(x0, eps, hi, lo, lambda x, t: scale * (eps - x0))
    torch.testing.assert_close(out, x0, rtol=0, atol=1e-12)
    out.sum().backward()
    assert scale.grad is not None and scale.grad.abs() > 0
    wrong = direct_align(x0, eps, hi, lo, lambda x, t: torch.zeros_like(x))  # no denoising: the noise left is wrong
    assert (wrong - x0).abs().max() > 0.1


def test_srpo_levels_follow_the_official_draws(tmp_path, random_pipeline, prompt_files):
    from flowrl.trainer import Trainer

    over = _overrides(random_pipeline, prompt_files, tmp_path / "r")
    method = Trainer(load_config(REPO / "configs" / "srpo.yaml", over)).method
    m, hi, lo = method.levels(4000, torch.Generator().manual_seed(0))
    grid = torch.linspace(0.9, 0.2, 100)
    assert int(m.min()) == 2 and int(m.max()) == 98  # random.randint(2, L - 2)
    assert torch.all(hi > lo) and torch.all((hi <= 0.9) & (lo >= grid[-1] - 1e-7))
    gap = (grid[:, None] - hi[None]).abs().argmin(0) - (grid[:, None] - lo[None]).abs().argmin(0)  # index distance
    assert int(gap.abs().max()) == int(0.4 * 100) + 1  # K = int((1 - groundtruth_ratio) L) + 1
    torch.testing.assert_close(lo, grid[100 - m])


def test_srpo_scores_the_control_word_prompts_and_trains(tmp_path, random_pipeline, prompt_files):
    """The relative reward R("P. prompt") - R("N. prompt") with the configured words, the time discount smallest at
    the clean end, and two iterations of the preset that move the LoRA."""
    from flowrl.methods.srpo import time_discount
    from flowrl.trainer import Trainer

    over = _overrides(random_pipeline, prompt_files, tmp_path / "r")
    over += ["train.srpo.positive_words=[Real]", "train.srpo.negative_words=[Painting]", "train.minibatch_size=8"]
    trainer = Trainer(load_config(REPO / "configs" / "srpo.yaml", over))
    method, seen = trainer.method, []

    def reward_with_grad(images, prompts, metadata):  # a differentiable reward that tells the two prompts apart
        seen.append(list(prompts))
        sign = torch.tensor([1.0 if p.startswith("Real. ") else -1.0 for p in prompts])
        return sign * images.flatten(1).mean(1)

    method.reward_with_grad = reward_with_grad
    metas = trainer.train_metas[:2]
    samples = method.rollout(metas, torch.Generator().manual_seed(1))
    assert samples.final.shape == samples.start.shape == (4, *trainer.model.latent_shape)
    stats = method.update(samples, None, None, torch.Generator().manual_seed(2))
    prompts = [m["prompt"] for m in metas for _ in range(2)]
    assert seen[0] == [f"Real. {p}" for p in prompts] and seen[1] == [f"Painting. {p}" for p in prompts]
    assert stats["policy/reward"] > 0  # R(P) - R(N) = 2 x mean pixel
    discount = time_discount(torch.tensor([0, 2, 50, 98, 100]), 100, 3.0)
    torch.testing.assert_close(discount, torch.tensor([0.0, 0.06 / 1.04, 0.75, 2.94 / 2.96, 1.0]))
    before = {n: p.detach().clone() for n, p in trainer.policy.params.items()}
    del method.reward_with_grad  # the tiny CLIP score from here on
    trainer.train()
    rows = [json.loads(line) for line in (tmp_path / "r/metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(math.isfinite(r["policy/loss"]) and r["policy/optimizer_steps"] >= 1 for r in rows)
    assert all(0.2 <= r["policy/sigma"] <= 0.9 for r in rows)
    assert any(not torch.equal(before[n], p) for n, p in trainer.policy.params.items())


def test_draft_lv_trains_on_the_final_samples_renoised_to_the_last_step(tmp_path, random_pipeline, prompt_files):
    """DRaFT-LV (arXiv 2309.17400): each final sample noised n times with its own noise to the last step's time, the
    one step with gradient taken from each copy; the setting is refused where it would be ignored."""
    from flowrl.trainer import Trainer

    over = _overrides(random_pipeline, prompt_files, tmp_path / "r")
    lv = ["train.direct.grad_steps=1", "train.direct.lv_samples=3"]
    trainer = Trainer(load_config(REPO / "configs" / "draft.yaml", over + lv))
    method = trainer.method
    samples = method.rollout(trainer.train_metas[:2], torch.Generator().manual_seed(0))
    assert samples.step == len(method.sigmas) - 2 and len(samples.images) == 4  # 2 prompts x group 2: scored once
    assert len(samples.cond) == len(samples.start) == len(samples.prompts) == 12  # 3 copies of each
    t = float(method.sigmas[samples.step])
    eps = (samples.start - (1 - t) * samples.final) / t  # (12, ...): the noise of each copy
    assert torch.equal(samples.final[0], samples.final[2]) and not torch.equal(eps[0], eps[1])
    assert 0.8 < float(eps.std()) < 1.2 and samples.prompts[:3] == [samples.prompts[0]] * 3
    stats = method.update(samples, None, None, torch.Generator().manual_seed(1))
    assert stats["cost/trained_transitions"] == 12 and math.isfinite(stats["policy/loss"])
    with pytest.raises(ConfigError, match=r"train\.direct\.lv_samples.*grad_steps is 1"):
        load_config(REPO / "configs" / "draft.yaml", over + ["train.direct.lv_samples=2"])  # the preset's K = 2
    with pytest.raises(ConfigError, match=r"^config key 'train\.direct\.lv_samples': DRaFT-LV .* 'refl' does not"):
        Trainer(load_config(REPO / "configs" / "refl.yaml", over + ["train.direct.lv_samples=2"]))
