"""Direct reward fine-tuning (ReFL, DRaFT-K): the differentiable reward's gradient against finite differences, its
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
