"""DiffusionNFT (train.method: nft): the loss, its weights, the config checks, a run, and exact resume."""

import json

import pytest
import torch
from conftest import tiny_overrides
from safetensors.torch import load_file

from flowrl.config import ConfigError, load_config
from flowrl.losses import nft_loss, optimality_weights
from flowrl.methods import DiffusionNFT
from flowrl.trainer import Trainer


def test_nft_loss_gradient_follows_the_optimality_weight():
    """At v = v_old the gradient is (2r - 1) times the weighted flow-matching gradient (towards the sample for
    r = 1, away for r = 0, none at r = 1/2), and a step with r = 1 moves v towards the sample's velocity."""
    gen = torch.Generator().manual_seed(0)
    x0, eps, v_old = (torch.randn(3, 2, 4, 4, generator=gen) for _ in range(3))
    t = torch.tensor([0.3, 0.6, 0.9])
    x_t = (1 - t.view(-1, 1, 1, 1)) * x0 + t.view(-1, 1, 1, 1) * eps

    def grad(r):
        v = v_old.clone().requires_grad_(True)
        nft_loss(v, v_old, x_t, x0, t, torch.full((3,), r)).backward()
        return v.grad

    pull = grad(1.0)
    assert torch.allclose(grad(0.0), -pull, atol=1e-6) and torch.allclose(grad(0.5), torch.zeros_like(pull), atol=1e-7)
    assert torch.allclose(grad(0.75), 0.5 * pull, atol=1e-6)
    target = eps - x0  # the flow-matching velocity of the sample
    assert (v_old - 0.1 * pull - target).norm() < (v_old - target).norm()
    with pytest.raises(ValueError, match="beta"):
        nft_loss(v_old, v_old, x_t, x0, t, torch.ones(3), beta=0.0)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        nft_loss(v_old, v_old, x_t, x0, t, torch.full((3,), 1.5))


def test_optimality_weights_map_the_clipped_advantage_to_zero_one():
    r = optimality_weights(torch.tensor([-5.0, -2.5, 0.0, 2.5, 5.0, 7.0]), adv_max=5.0)
    assert r.tolist() == [0.0, 0.25, 0.5, 0.75, 1.0, 1.0]


@pytest.mark.parametrize(
    "key,value",
    [
        ("sampling.window.size", 2),
        ("sampling.tree.split_steps", "[0]"),
        ("sampling.shape", "g2rpo"),
        ("sampling.shared_noise", "true"),
        ("train.kl_beta", 0.1),
        ("train.nft.old_decay", 1.0),
        ("train.nft.timesteps", 0),
        ("train.nft.min_time", 1.0),
        ("train.method", "ppo"),
    ],
)
def test_nft_refuses_what_it_cannot_use(key, value):
    over = ["train.method=nft", f"{key}={value}"] + (["sampling.group_size=2"] if "tree" in key else [])
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config("configs/diffusion_nft.yaml", over)


def _nft_config(tmp_path, random_pipeline, prompt_files, out, **extra):
    train, test = prompt_files
    extra = {
        "run.mixed_precision": "no",
        "rewards.geneval": "null",
        "rewards.jpeg_compressibility.weight": 1.0,
        "train.nft.timesteps": 2,
        **extra,
    }
    return load_config(
        "configs/diffusion_nft.yaml", tiny_overrides(random_pipeline, train, test, tmp_path / out, **extra)
    )


@pytest.mark.slow
def test_nft_run_trains_and_resumes_exactly(tmp_path, random_pipeline, prompt_files):
    """Two iterations straight through equal one iteration, a kill, and a resume: the trained weights and
    the soft-updated sampling policy of the checkpoint are the same."""
    full = _nft_config(tmp_path, random_pipeline, prompt_files, "full", **{"train.nft.old_decay": 0.5})
    trainer = Trainer(full)
    before = {n: p.detach().clone() for n, p in trainer.policy.params.items()}
    result = trainer.train()
    assert result["after"]["n_images"] > 0
    metrics = [json.loads(line) for line in (tmp_path / "full/metrics.jsonl").read_text().splitlines()]
    for m in metrics:  # 2 noised copies of each image of a group with variance; 3 sampling steps, CFG twice
        kept = m["cost/trained_transitions"]
        assert m["policy/old_decay"] == 0.5
        assert kept > 0 and kept % 2 == 0 and m["policy/optimizer_steps"] == -(-kept // 4)
        assert m["cost/nfe"] == (4 * 3 + kept) * 2 and m["cost/reward_calls"] == 4
    assert any(not torch.equal(p.detach(), before[n]) for n, p in trainer.policy.params.items())
    old = load_file(tmp_path / "full/checkpoints/checkpoint-000002" / DiffusionNFT.OLD_POLICY_FILE)
    # theta_old = 0.5 theta_old + 0.5 theta after each iteration: it lags behind the trained weights
    assert any(not torch.equal(old[n], p.detach().cpu()) for n, p in trainer.policy.params.items())

    Trainer(
        _nft_config(
            tmp_path, random_pipeline, prompt_files, "part", **{"train.nft.old_decay": 0.5, "run.iterations": 1}
        )
    ).train()
    Trainer(
        _nft_config(
            tmp_path, random_pipeline, prompt_files, "part", **{"train.nft.old_decay": 0.5, "run.resume": "true"}
        )
    ).train()
    for name in ("trainable.safetensors", DiffusionNFT.OLD_POLICY_FILE):
        a = load_file(tmp_path / "full/checkpoints/checkpoint-000002" / name)
        b = load_file(tmp_path / "part/checkpoints/checkpoint-000002" / name)
        for k in a:
            torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6)

    Trainer(
        _nft_config(
            tmp_path, random_pipeline, prompt_files, "plain", **{"run.iterations": 1, "train.nft.old_decay": 0.0}
        )
    ).train()
    with pytest.raises(
        ValueError, match="old_policy.safetensors"
    ):  # a run without the soft update cannot resume with it
        Trainer(
            _nft_config(
                tmp_path,
                random_pipeline,
                prompt_files,
                "plain",
                **{"train.nft.old_decay": 0.5, "run.resume": "true", "run.iterations": 3},
            )
        ).train()


def test_nft_min_time_noises_only_at_high_noise(tmp_path, random_pipeline, prompt_files, monkeypatch):
    """``train.nft.min_time`` keeps the noised copies at grid times ``t >= min_time``; without it every
    grid time of the sampler can be drawn."""
    import flowrl.methods.nft as nft_module

    seen = []

    def recording(v, v_old, x_t, x0, t, *args):
        seen.append(t.detach().clone())
        return nft_loss(v, v_old, x_t, x0, t, *args)

    monkeypatch.setattr(nft_module, "nft_loss", recording)
    times = {}
    for min_time in (0.0, 0.55):
        seen.clear()
        cfg = _nft_config(
            tmp_path,
            random_pipeline,
            prompt_files,
            f"t{min_time}",
            **{"run.iterations": 2, "train.nft.timesteps": 8, "train.nft.min_time": min_time},
        )
        Trainer(cfg).train()
        times[min_time] = torch.cat(seen)
    assert len(times[0.55]) > 0 and times[0.55].min() >= 0.55
    assert times[0.0].min() < 0.55  # the filter, not chance, kept the high times


def test_nft_trains_the_conditional_velocity_off_policy(tmp_path, random_pipeline, prompt_files, monkeypatch):
    """``train.nft.guidance_scale=1`` with guided sampling: the samples are drawn under CFG, while the old
    policy's velocity and the trained one are the conditional velocity alone (one row per noised copy)."""
    from flowrl.models import FlowModel

    calls = []
    original = FlowModel.velocity_fn

    def recording(self, table, guidance_scale):
        fn = original(self, table, guidance_scale)

        def wrapped(x, t, cond):
            calls.append((guidance_scale, torch.is_grad_enabled(), len(x)))
            return fn(x, t, cond)

        return wrapped

    monkeypatch.setattr(FlowModel, "velocity_fn", recording)
    cfg = _nft_config(
        tmp_path,
        random_pipeline,
        prompt_files,
        "offp",
        **{"run.iterations": 1, "sampling.guidance_scale": 3.0, "train.nft.guidance_scale": 1.0},
    )
    Trainer(cfg).train()
    m = json.loads((tmp_path / "offp/metrics.jsonl").read_text().splitlines()[0])
    kept = m["cost/trained_transitions"]
    assert kept > 0 and m["cost/nfe"] == 4 * 3 * 2 + kept
    trained = [c for c in calls if c[1]]
    assert trained and all(scale == 1.0 for scale, _, _ in trained)
    assert sum(n for scale, grad, n in calls if scale == 1.0 and not grad) == kept  # the old policy's rows
    with pytest.raises(ConfigError, match=r"train\.nft\.guidance_scale"):
        load_config("configs/diffusion_nft.yaml", ["train.nft.guidance_scale=0.5"])


def test_nft_keep_flat_groups_trains_them_at_one_half(tmp_path, random_pipeline, prompt_files, monkeypatch):
    """Every group flat: by default nothing is trained; with ``train.nft.keep_flat_groups`` (the published code's
    way) every image is, at r = 1/2, which pulls the policy towards the old one."""
    rows = {}
    for keep in (False, True):
        trainer = Trainer(
            _nft_config(
                tmp_path,
                random_pipeline,
                prompt_files,
                f"flat{keep}",
                **{"train.nft.keep_flat_groups": str(keep).lower(), "train.nft.old_decay": 0.5},
            )
        )
        monkeypatch.setattr(
            trainer.method,
            "group_advantages",
            lambda rewards: (torch.zeros_like(rewards.total), torch.ones_like(rewards.total, dtype=torch.bool), {}),
        )
        rows[keep] = trainer.step(0)["cost/trained_transitions"]
    assert rows == {False: 0, True: 4 * 2}  # 4 images x 2 noised copies
    with pytest.raises(ConfigError, match="train.nft.keep_flat_groups"):
        load_config("configs/diffusion_nft.yaml", ["train.nft.keep_flat_groups=true", "train.best_of_n=2"])


def test_nft_decay_ramp_grows_with_the_optimizer_steps():
    """``train.nft.decay_ramp``: decay = min(ramp * optimizer steps, old_decay), as the published code's 0.001 per step."""
    from types import SimpleNamespace

    def decay(steps, ramp=0.001, old=0.5):
        from flowrl.policy import Policy

        state = {} if steps is None else {"p": {"step": torch.tensor(float(steps))}}
        policy = SimpleNamespace(optimizer=SimpleNamespace(state=state))  # AdamW's step count, read by the Policy
        policy.steps_taken = lambda: Policy.steps_taken(policy)
        fake = SimpleNamespace(
            cfg=SimpleNamespace(train=SimpleNamespace(nft=SimpleNamespace(decay_ramp=ramp, old_decay=old))),
            policy=policy,
        )
        return DiffusionNFT.old_decay(fake)

    assert decay(None) == 0 and decay(100) == pytest.approx(0.1) and decay(2000) == 0.5 and decay(100, ramp=0) == 0.5


def test_nft_solver_dpm_solver_2m_draws_other_samples(tmp_path, random_pipeline, prompt_files, monkeypatch):
    """``train.nft.solver=dpm_solver_2m`` (the published code's sampler) replaces the Euler rollouts; the default is
    Euler, the samples of ``samplers.ode_sample``."""
    seen = {}
    for solver in ("euler", "dpm_solver_2m"):
        trainer = Trainer(_nft_config(tmp_path, random_pipeline, prompt_files, solver, **{"train.nft.solver": solver}))

        def recording(images, *args, _score=trainer.scorer.score, _solver=solver):
            seen[_solver] = images
            return _score(images, *args)

        monkeypatch.setattr(trainer.scorer, "score", recording)
        trainer.step(0)
    assert seen["euler"].shape == seen["dpm_solver_2m"].shape and bool(torch.isfinite(seen["dpm_solver_2m"]).all())
    assert not torch.allclose(seen["euler"], seen["dpm_solver_2m"])
    with pytest.raises(ConfigError, match="train.nft.solver"):
        load_config("configs/diffusion_nft.yaml", ["train.nft.solver=heun"])
