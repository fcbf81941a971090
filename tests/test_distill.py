"""Few-step distillation (flowrl/methods/distill.py): TDM's and DMD's losses against their equations written out in
float64 and against re-expressions of the official code's lines on identical inputs; the student's sampler; the held
fake score; the student's LoRA start; resume. The presets train two iterations in test_presets.py."""

import pytest
import torch
from conftest import REPO, assert_resume_is_exact, no_download, tiny_overrides

from flowrl.config import ConfigError, load_config
from flowrl.merge import lora_as_params
from flowrl.methods.distill import (
    dmd_loss,
    flow_predictions,
    importance_weights,
    min_snr_weights,
    mixed_noise,
    regression_loss,
    renoise,
    student_trajectory,
    tdm_fake_loss,
    tdm_loss,
    teacher_trajectory,
)

TDM_COMMIT = "81b019f91539948d49da86cef12ccc64030c5022"  # Luo-Yihong/TDM, train_tdm_demo.py
DMD2_COMMIT = "8d8fa55633d47cfb81bbc7a892e7248f9518763f"  # tianweiy/DMD2, main/sd_guidance.py
DMDR_COMMIT = "061dc296e570adaae2925241bd1de505376a9fce"  # vvvvvjdy/dmdr, train_cc/sit/
FLOW_FACTORY_COMMIT = "15932582d7f0eec90c77406b9dda5cd4da7fd9b5"  # X-GenGroup/Flow-Factory, TDM-R1's trainer


def _draw(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64)


# ------------------------------------------------------------------------------ the equations, written out
def test_tdm_loss_and_its_gradient_are_the_equations():
    x0, real, fake = _draw(3, 2, 4, 4, seed=1).requires_grad_(), _draw(3, 2, 4, 4, seed=2), _draw(3, 2, 4, 4, seed=3)
    loss = tdm_loss(x0, real, fake)
    n, d = x0.shape[0], x0[0].numel()
    w = torch.stack([(x0[i].detach() - real[i]).abs().sum() / d for i in range(n)])
    expected = sum(((real[i] - fake[i]) ** 2).sum() / w[i] for i in range(n)) / (n * d)
    assert loss.dtype == torch.float64
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=0)
    (grad,) = torch.autograd.grad(loss, x0)
    torch.testing.assert_close(grad, 2 * (fake - real) / (w.view(-1, 1, 1, 1) * n * d), rtol=1e-12, atol=0)


def test_dmd_loss_and_its_gradient_are_the_equations():
    x0, real, fake = _draw(3, 2, 4, 4, seed=4).requires_grad_(), _draw(3, 2, 4, 4, seed=5), _draw(3, 2, 4, 4, seed=6)
    loss = dmd_loss(x0, real, fake)
    n, d = x0.shape[0], x0[0].numel()
    grad = torch.stack([(fake[i] - real[i]) / ((x0[i].detach() - real[i]).abs().sum() / d) for i in range(n)])
    torch.testing.assert_close(loss, 0.5 * (grad**2).sum() / (n * d), rtol=1e-12, atol=0)
    (g,) = torch.autograd.grad(loss, x0)
    torch.testing.assert_close(g, grad / (n * d), rtol=1e-12, atol=0)


def test_renoise_is_the_forward_process_around_the_students_prediction():
    """x_mid = (1 - t_mid) x0 + t_mid eps diffused to t is (1 - t) x0 + t mixed, and mixed is standard normal in
    law: its variance over many draws is 1 when eps and z are."""
    x0, eps, z = _draw(4, 3, 8, 8, seed=7), _draw(4, 3, 8, 8, seed=8), _draw(4, 3, 8, 8, seed=9)
    t_mid, t = (
        torch.tensor([0.0, 0.2, 0.5, 0.7], dtype=torch.float64),
        torch.tensor([0.3, 0.4, 0.9, 0.7], dtype=torch.float64),
    )
    x_mid = (1 - t_mid.view(-1, 1, 1, 1)) * x0 + t_mid.view(-1, 1, 1, 1) * eps
    x_t, mixed = renoise(x_mid, t_mid, t, z), mixed_noise(eps, z, t_mid, t)
    torch.testing.assert_close(x_t, (1 - t.view(-1, 1, 1, 1)) * x0 + t.view(-1, 1, 1, 1) * mixed, rtol=1e-12, atol=0)
    torch.testing.assert_close(x_t[0], 0.7 * x0[0] + 0.3 * z[0], rtol=1e-12, atol=0)  # t_mid 0: plain forward
    torch.testing.assert_close(mixed[3], eps[3], rtol=1e-12, atol=0)  # t = t_mid: no fresh noise
    # variance of the mixed noise: (a_t s_mid / a_mid)^2 + beta^2 = s_t^2, over sigma_t^2 = 1
    big_eps, big_z = _draw(20000, seed=10), _draw(20000, seed=11)
    var = mixed_noise(big_eps, big_z, torch.full((20000,), 0.3).double(), torch.full((20000,), 0.6).double()).var()
    assert abs(var.item() - 1) < 0.03
    w = importance_weights(mixed, z)
    torch.testing.assert_close(w, torch.exp(-0.5 * (mixed**2).mean((1, 2, 3)) + 0.5 * (z**2).mean((1, 2, 3))))


def test_the_fake_loss_and_min_snr_are_the_equations():
    fake, x0 = _draw(3, 2, 4, 4, seed=12).requires_grad_(), _draw(3, 2, 4, 4, seed=13)
    t, w = torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64), torch.tensor([0.5, 1.0, 2.0], dtype=torch.float64)
    snr = torch.tensor([min((0.9 / 0.1) ** 2, 5.0), 1.0, (0.1 / 0.9) ** 2], dtype=torch.float64)
    torch.testing.assert_close(min_snr_weights(t, 5.0), snr, rtol=1e-12, atol=0)
    expected = sum(((fake[i] - x0[i]) ** 2).mean() * snr[i] * w[i] for i in range(3)) / 3
    torch.testing.assert_close(tdm_fake_loss(fake, x0, t, w, 5.0), expected, rtol=1e-12, atol=0)


def test_the_students_sampler_is_euler_and_ddim():
    """Euler on the velocity equals DDIM on the clean prediction and noise it implies, x' = (1 - s') x0 + s' eps."""
    a = _draw(2, 2, seed=14).float() * 0.3  # the sampler runs in float32
    velocity = lambda x, t, c: torch.einsum("ij,bjhw->bihw", a, x) * (1 + t.view(-1, 1, 1, 1))  # noqa: E731
    noise, sigmas = _draw(3, 2, 4, 4, seed=15), torch.tensor([1.0, 0.75, 0.4, 0.1, 0.0], dtype=torch.float64)
    states = student_trajectory(velocity, noise, torch.zeros(3, dtype=torch.long), sigmas)
    assert states.shape == (3, 5, 2, 4, 4)
    x = noise.float()
    for k in range(4):
        t = sigmas[k].expand(3)
        x0, eps = flow_predictions(x, t, velocity(x, t, None).float())
        x = (1 - sigmas[k + 1]) * x0 + sigmas[k + 1] * eps
        torch.testing.assert_close(states[:, k + 1], x.float(), rtol=1e-5, atol=1e-5)


def test_tdm_r1_surrogate_loss_trust_region_and_runaway_clip_are_the_equations():
    """TDM-R1's surrogate loss (Flow-Factory's trainer at FLOW_FACTORY_COMMIT, tdm_r1.py lines 331-421): rows 0-1 left
    the trust region around the slow surrogate (exp(l_slow - l) > 1 + eps for A > 0, < 1 - eps for A <= 0), rows
    2-3 ran away (l past l_ref the way A asks, (l - l_ref)^2 > threshold), rows 4-6 train freely (row 4 moved the
    other way, row 6 within both). The loss is mean_i w_i (sigma_i A_i l_i + rb (l_i - l_ref,i)^2); a clipped row
    keeps its value and only the anchor's gradient."""
    import math

    from flowrl.methods.tdm_r1 import surrogate_loss

    eps, threshold, rb = 0.01, 0.05, 0.3
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5, 1.0, 0.0, 1.0], dtype=torch.float64)
    err = torch.tensor([1.0, 1.0, 0.6, 1.4, 1.4, 1.0, 0.9], dtype=torch.float64).requires_grad_()
    ref = torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0, 1.1, 1.0], dtype=torch.float64)
    slow = torch.tensor([1.02, 0.98, 0.6, 1.4, 1.4, 1.0, 0.905], dtype=torch.float64)
    sig, w = torch.rand(7, dtype=torch.float64, generator=torch.Generator().manual_seed(0)), torch.full((7,), 0.75)
    loss, trust, runaway = surrogate_loss(err, ref, slow, adv, sig, w.double(), rb, eps, threshold)

    l, r, s_, a = err.tolist(), ref.tolist(), slow.tolist(), adv.tolist()
    ratio = [math.exp(s_[i] - l[i]) for i in range(7)]
    want_trust = [ratio[i] > 1 + eps if a[i] > 0 else ratio[i] < 1 - eps for i in range(7)]
    want_run = [((l[i] < r[i]) if a[i] > 0 else (l[i] > r[i])) and (l[i] - r[i]) ** 2 > threshold for i in range(7)]
    assert want_trust == [True, True, False, False, False, False, False] == trust.tolist()
    assert want_run == [False, False, True, True, False, False, False] == runaway.tolist()
    value = sum(0.75 * (sig[i].item() * a[i] * l[i] + rb * (l[i] - r[i]) ** 2) for i in range(7)) / 7
    torch.testing.assert_close(loss, torch.tensor(value, dtype=torch.float64), rtol=1e-12, atol=0)
    free = [not (want_trust[i] or want_run[i]) for i in range(7)]
    grad = [0.75 * (sig[i].item() * a[i] * free[i] + 2 * rb * (l[i] - r[i])) / 7 for i in range(7)]
    torch.testing.assert_close(
        torch.autograd.grad(loss, err)[0], torch.tensor(grad, dtype=torch.float64), rtol=1e-12, atol=0
    )

    for off in ({"slow_err": None, "clip_range": eps}, {"slow_err": slow, "clip_range": 0.0}):  # no trust region
        _, trust, runaway = surrogate_loss(err, ref, off["slow_err"], adv, sig, w, rb, off["clip_range"], threshold)
        assert not trust.any() and runaway.tolist() == want_run


def test_the_slow_surrogate_is_an_ema_whose_decay_rises_an_iteration():
    """Flow-Factory's tdm_r1.py lines 309-324 at FLOW_FACTORY_COMMIT: d = min(max, min + 0.001 n) after n updates, and
    the snapshot's EMA slow <- d slow + (1 - d) surrogate (d the weight kept on the snapshot)."""
    from flowrl.methods.tdm_r1 import slow_decay
    from flowrl.policy import move_towards

    assert [slow_decay(n, 0.001, 0.3) for n in (0, 1, 2)] == pytest.approx([0.001, 0.002, 0.003], abs=1e-15)
    assert slow_decay(299, 0.001, 0.3) == pytest.approx(0.3, abs=1e-12) and slow_decay(5000, 0.001, 0.3) == 0.3
    assert slow_decay(7, 0.2, 0.2) == 0.2
    slow, sur = (
        {"a": _draw(3, 4, seed=40), "b": _draw(5, seed=41)},
        {"a": _draw(3, 4, seed=42), "b": _draw(5, seed=43)},
    )
    want = {n: 0.3 * slow[n] + 0.7 * sur[n] for n in slow}
    kept = {n: w for n, w in slow.items()}
    move_towards(slow, sur, 0.3)
    for n in slow:
        assert slow[n] is kept[n]  # in place: the checkpoint's tensors
        torch.testing.assert_close(slow[n], want[n], rtol=1e-15, atol=1e-15)


# ------------------------------------------------------------------------------ the official lines, re-expressed
def _tdm_official_generator_loss(model_latents, sd, sd_uncond, fake, cfg):
    """train_tdm_demo.py lines 1174-1187 (TDM_COMMIT), use_huber off: the CFG'd real prediction, the target and the
    per-sample weighting, in x0 space."""
    coop = model_latents.detach() + (sd - fake) + (cfg - 1) * (sd - sd_uncond)
    sd_cfg = sd + (cfg - 1) * (sd - sd_uncond)
    weighting = torch.abs(model_latents.double() - sd_cfg.double()).mean(dim=[1, 2, 3], keepdim=True).detach()
    return (torch.nn.functional.mse_loss(model_latents, coop.detach(), reduction="none") / weighting).mean()


def _dmd2_official_loss(latents, pred_real_image, pred_fake_image):
    """main/sd_guidance.py lines 235-241 (DMD2_COMMIT)."""
    p_real, p_fake = latents - pred_real_image, latents - pred_fake_image
    grad = torch.nan_to_num((p_real - p_fake) / torch.abs(p_real).mean(dim=[1, 2, 3], keepdim=True))
    return 0.5 * torch.nn.functional.mse_loss(latents, (latents - grad).detach(), reduction="mean")


def _tdm_official_noise(samples, model_noise, noise, t1, t2, alphas, sigmas):
    """train_tdm_demo.py lines 1036-1057 (Predictor.add_noise, obtain_mixed_noise) and 1129 (is_weight), with the
    schedules indexed by integer timesteps (extract_into_tensor)."""
    a1, s1 = alphas[t1].view(-1, 1, 1, 1), sigmas[t1].view(-1, 1, 1, 1)
    a2, s2 = alphas[t2].view(-1, 1, 1, 1), sigmas[t2].view(-1, 1, 1, 1)
    beta = (s2**2 - (a2 / a1 * s1) ** 2) ** 0.5
    x = samples / a1 * a2 + beta * noise
    mixed = (model_noise / a1 * a2 * s1 + beta * noise) / s2
    bsz = len(samples)
    is_w = torch.exp(-0.5 * (mixed**2).view(bsz, -1).mean(dim=1)) / torch.exp(-0.5 * (noise**2).view(bsz, -1).mean(1))
    return x, mixed, is_w


def _tdm_official_fake_loss(fake_latents, model_latents, timesteps, is_weight, alphas, sigmas):
    """train_tdm_demo.py lines 1130-1134 with compute_snr (lines 103-126): Min-SNR 5 times the importance weight."""
    loss = torch.nn.functional.mse_loss(fake_latents, model_latents, reduction="none")
    snr = (alphas[timesteps] / sigmas[timesteps]) ** 2
    snr = torch.stack([snr, 5 * torch.ones_like(snr)], dim=1).min(dim=1)[0]
    return (loss.mean(dim=list(range(1, loss.ndim))) * snr * is_weight).mean()


def test_tdm_generator_loss_matches_the_official_lines():
    x0 = _draw(3, 4, 8, 8, seed=20).requires_grad_()
    sd, sd_uncond, fake = _draw(3, 4, 8, 8, seed=21), _draw(3, 4, 8, 8, seed=22), _draw(3, 4, 8, 8, seed=23)
    cfg = 2.0
    official = _tdm_official_generator_loss(x0, sd, sd_uncond, fake, cfg)
    ours = tdm_loss(x0, sd_uncond + cfg * (sd - sd_uncond), fake)
    torch.testing.assert_close(ours, official, rtol=1e-12, atol=0)
    g_official, g_ours = torch.autograd.grad(official, x0)[0], torch.autograd.grad(ours, x0)[0]
    torch.testing.assert_close(g_ours, g_official, rtol=1e-12, atol=0)


def test_dmd_loss_matches_the_official_lines():
    x0 = _draw(3, 4, 8, 8, seed=24).requires_grad_()
    real, fake = _draw(3, 4, 8, 8, seed=25), _draw(3, 4, 8, 8, seed=26)
    official, ours = _dmd2_official_loss(x0, real, fake), dmd_loss(x0, real, fake)
    torch.testing.assert_close(ours, official, rtol=1e-12, atol=0)
    torch.testing.assert_close(
        torch.autograd.grad(ours, x0)[0], torch.autograd.grad(official, x0)[0], rtol=1e-12, atol=0
    )


def test_tdm_noise_and_fake_loss_match_the_official_lines():
    """On a grid of 1000 flow times (alpha_t = 1 - t, sigma_t = t indexed by integer timesteps, as the official
    schedules are), the official lines and ours agree on x_t, the mixed noise, the importance weight and the fake
    loss."""
    grid = torch.linspace(0, 1, 1001, dtype=torch.float64)[:-1]  # t = i / 1000, i in [0, 1000)
    alphas, sigmas = 1 - grid, grid
    t1, t2 = torch.tensor([0, 200, 400, 600]), torch.tensor([150, 380, 700, 999])
    x_mid, eps, z = _draw(4, 4, 8, 8, seed=27), _draw(4, 4, 8, 8, seed=28), _draw(4, 4, 8, 8, seed=29)
    x_o, mixed_o, w_o = _tdm_official_noise(x_mid, eps, z, t1, t2, alphas, sigmas)
    torch.testing.assert_close(renoise(x_mid, grid[t1], grid[t2], z), x_o, rtol=1e-12, atol=1e-12)
    mixed = mixed_noise(eps, z, grid[t1], grid[t2])
    torch.testing.assert_close(mixed, mixed_o, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(importance_weights(mixed, z), w_o, rtol=1e-12, atol=0)
    fake, x0 = _draw(4, 4, 8, 8, seed=30), _draw(4, 4, 8, 8, seed=31)
    official = _tdm_official_fake_loss(fake, x0, t2, w_o, alphas, sigmas)
    torch.testing.assert_close(tdm_fake_loss(fake, x0, grid[t2], w_o, 5.0), official, rtol=1e-12, atol=0)


# ------------------------------------------------------------------------------ the method
def _overrides(random_pipeline, prompt_files, out, **extra):
    train, test = prompt_files
    extra = {"sampling.num_steps": 2, "sampling.guidance_scale": 1.0, "eval.num_steps": 2, **extra}
    return tiny_overrides(random_pipeline, train, test, out, **extra)


def test_tdm_trains_its_fake_score_apart_and_resumes_exactly(tmp_path, random_pipeline, prompt_files):
    """tdm trained two iterations straight and 1 + a resumed one end equal (the student, the fake score and its AdamW
    moments); the fake score took one step an iteration, moved, and differs from the student; no gradient is left on
    the policy. Its exported LoRA starts a dmdr student, whose fake score starts at the teacher (B zeroed)."""
    from safetensors.torch import load_file

    from flowrl.trainer import Trainer

    trainer = assert_resume_is_exact(
        REPO / "configs/tdm.yaml", lambda out: _overrides(random_pipeline, prompt_files, out), tmp_path
    )
    for name in ("fake_score", "fake_score_exp_avg", "fake_score_exp_avg_sq"):
        a, b = (
            load_file(tmp_path / run / f"checkpoints/checkpoint-000002/{name}.safetensors") for run in ("full", "part")
        )
        for k in a:
            torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6)
    method, policy = trainer.method, trainer.policy
    assert method.fake.steps == 2  # one fake step per iteration (one minibatch)
    assert any(w.abs().sum() > 0 for n, w in method.fake.weights.items() if "lora_B" in n)  # moved from the teacher
    assert any(not torch.equal(method.fake.weights[n], p) for n, p in policy.params.items() if "lora_B" in n)
    assert all(p.grad is None for p in policy.params.values())

    lora = tmp_path / "full/lora"
    cfg = trainer.cfg.model
    assert lora_as_params(lora, policy.params, cfg.lora_alpha, cfg.lora_rank).keys() == set(policy.params)
    over = _overrides(random_pipeline, prompt_files, tmp_path / "dmdr", **{"train.distill.student_lora": str(lora)})
    student = Trainer(load_config(REPO / "configs/dmdr.yaml", over))
    for n, p in student.policy.params.items():
        torch.testing.assert_close(p, policy.exported()[n])
    assert all(torch.equal(w, torch.zeros_like(w)) for n, w in student.method.fake.weights.items() if "lora_B" in n)
    with pytest.raises(ConfigError, match=r"train\.distill\.student_lora.*pytorch_lora_weights"):
        student.method.load_student(str(tmp_path))


def test_the_regression_term_trains_on_the_teachers_trajectory_from_the_students_noise(
    tmp_path, random_pipeline, prompt_files
):
    """With train.distill.regression_weight the rollout holds the teacher's trajectory from the student's own noise
    (same start, other path), the student's loss logs its regression term and the teacher's forwards are counted."""
    from flowrl.trainer import Trainer

    runs = {}
    for weight in (0, 1):
        over = _overrides(
            random_pipeline, prompt_files, tmp_path / f"w{weight}", **{"train.distill.regression_weight": weight}
        )
        trainer = Trainer(load_config(REPO / "configs/dmd.yaml", over))
        samples = trainer.method.rollout(trainer.train_metas[:2], torch.Generator().manual_seed(0))
        runs[weight] = (trainer.step(0), samples)
    (plain, no_pairs), (with_reg, samples) = runs[0], runs[1]
    assert no_pairs.teacher_states is None and "policy/regression_loss" not in plain
    assert samples.teacher_states.shape == samples.states.shape
    assert torch.equal(samples.teacher_states[:, 0], samples.states[:, 0])
    assert not torch.allclose(samples.teacher_states[:, -1], samples.states[:, -1])
    assert 0 < with_reg["policy/regression_loss"] < float("inf")
    assert with_reg["cost/nfe"] > plain["cost/nfe"]


def test_the_regression_pairs_are_the_teachers_finer_euler_path_and_the_loss_its_step_error():
    """teacher_trajectory is Euler over each student step split in `substeps` equal steps, kept at the student's
    times; regression_loss is the squared error of the student's velocity against the teacher's step, written out."""
    a = _draw(2, 2, seed=16).float() * 0.3
    velocity = lambda x, t, c: torch.einsum("ij,bjhw->bihw", a, x) * (1 + t.view(-1, 1, 1, 1))  # noqa: E731
    noise, cond = _draw(3, 2, 4, 4, seed=17), torch.zeros(3, dtype=torch.long)
    sigmas = torch.tensor([1.0, 0.75, 0.4, 0.0])
    states = teacher_trajectory(velocity, noise, cond, sigmas, substeps=2)
    assert states.shape == (3, 4, 2, 4, 4)
    x, kept = noise.float(), [noise.float()]
    for s, s_next in zip(sigmas[:-1].tolist(), sigmas[1:].tolist()):
        mid = (s + s_next) / 2
        x = x + (mid - s) * velocity(x, torch.full((3,), s), None)
        x = x + (s_next - mid) * velocity(x, torch.full((3,), mid), None)
        kept.append(x)
    torch.testing.assert_close(states, torch.stack(kept, 1), rtol=1e-5, atol=1e-5)
    assert torch.equal(
        teacher_trajectory(velocity, noise, cond, sigmas, 1), student_trajectory(velocity, noise, cond, sigmas)
    )
    v = _draw(3, 2, 4, 4, seed=18).requires_grad_()
    xs, xn = _draw(3, 2, 4, 4, seed=19), _draw(3, 2, 4, 4, seed=20)
    s, s_next = (
        torch.tensor([1.0, 0.75, 0.4], dtype=torch.float64),
        torch.tensor([0.75, 0.4, 0.0], dtype=torch.float64),
    )
    loss = regression_loss(v, xs, xn, s, s_next)
    expected = sum(((v[i] - (xn[i] - xs[i]) / (s_next[i] - s[i])) ** 2).sum() for i in range(3)) / v.numel()
    assert loss.dtype == torch.float64
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=0)
    loss.backward()
    torch.testing.assert_close(v.grad, 2 * (v - (xn - xs) / (s_next - s).view(-1, 1, 1, 1)).detach() / v.numel())


def test_bad_distill_settings_are_refused_naming_the_key():
    with pytest.raises(ConfigError, match=r"train\.distill\.fake_init"):
        load_config(REPO / "configs/tdm.yaml", ["train.distill.fake_init=copy"])
    with pytest.raises(ConfigError, match=r"train\.distill\.min_time"):
        load_config(REPO / "configs/tdm.yaml", ["train.distill.min_time=0.99"])
    with pytest.raises(ConfigError, match=r"sampling\.shape"):
        load_config(REPO / "configs/dmd.yaml", ["sampling.shape=tree"])
    for preset, bad in (("dmdr", "[0.0,1.5]"), ("dmd", "[4.0,-1.0]"), ("tdm", "[4.0,1.5]")):  # tdm queries no Beta
        with pytest.raises(ConfigError, match=r"^config key 'train\.distill\.renoise_beta' must be [^\n]+$"):
            load_config(REPO / f"configs/{preset}.yaml", [f"train.distill.renoise_beta={bad}"])
    with pytest.raises(ConfigError, match=r"train\.distill\.dynamic_steps"):
        load_config(REPO / "configs/dmdr.yaml", ["train.distill.dynamic_steps=-1"])
    with pytest.raises(ConfigError, match=r"^config key 'train\.distill\.regression_substeps' must be [^\n]+$"):
        load_config(REPO / "configs/tdm.yaml", ["train.distill.regression_substeps=0"])
    with pytest.raises(ConfigError, match=r"^config key 'train\.distill\.regression_weight' must be [^\n]+$"):
        load_config(REPO / "configs/dmd.yaml", ["train.distill.regression_weight=-1"])


def test_bad_tdm_r1_settings_are_refused_in_one_line_naming_the_key():
    for override, key in (
        (["train.tdm_r1.clip_range=-0.1"], "clip_range"),
        (["train.tdm_r1.reference_threshold=0"], "reference_threshold"),
        (["train.tdm_r1.slow_decay_min=0.5", "train.tdm_r1.slow_decay_max=0.3"], "slow_decay_min"),
        (["train.tdm_r1.slow_decay_max=1.5"], "slow_decay_min"),
    ):
        with pytest.raises(ConfigError, match=rf"train\.tdm_r1\.{key}") as error:
            load_config(REPO / "configs/tdm_r1.yaml", override)
        assert "\n" not in str(error.value)


def test_dynamic_distribution_guidance_decays_by_a_half_cosine():
    """DMDR's lambda = lambda_0 (1 + cos(pi min(n / N, 1))) / 2 after n student steps (train_sitxl_refl_deepspeed.py
    lines 517-521 at vvvvvjdy/dmdr 061dc296)."""
    import math
    from types import SimpleNamespace

    from flowrl.methods.distill import DMDR

    for n, expected in ((0, 0.8), (5, 0.4), (10, 0.0), (30, 0.0)):
        d = SimpleNamespace(dynamic_guidance=0.8, dynamic_steps=10)
        host = SimpleNamespace(cfg=SimpleNamespace(train=SimpleNamespace(distill=d)))
        host.policy = SimpleNamespace(steps_taken=lambda n=n: n)
        assert DMDR.guidance_scale_now(host) == pytest.approx(expected, abs=1e-12)
        assert 0.8 * 0.5 * (1 + math.cos(math.pi * min(n / 10, 1))) == pytest.approx(expected, abs=1e-12)


def test_dynamic_renoise_sampling_draws_a_beta_that_decays_to_uniform():
    """DMDR's dynamic renoise sampling (utils.py lines 68-80 at DMDR_COMMIT, the times of the fake score's
    and the DMD loss's queries): after n of N student steps the query time is min_time + (max_time - min_time) u, u ~
    Beta(1 + (a0 - 1) c, 1 + (b0 - 1) c), c = (1 + cos(pi min(n / N, 1))) / 2: at n = 0 Beta(4, 1.5) and halfway
    Beta(2.5, 1.25) (Kolmogorov-Smirnov distance and mean over 20000 draws), from n = N on the very uniform draw of
    DMD2 from the same generator; x_t = (1 - t) x0 + t z at the drawn t."""
    import math
    from types import SimpleNamespace

    from scipy import stats

    from flowrl.methods.distill import DMD, Distillation, renoise_shape

    for n, steps, expected in ((0, 10, (4.0, 1.5)), (5, 10, (2.5, 1.25)), (10, 10, (1.0, 1.0)), (7, 0, (4.0, 1.5))):
        c = 1.0 if steps == 0 else (1 + math.cos(math.pi * min(n / steps, 1))) / 2
        assert renoise_shape((4.0, 1.5), n, steps) == pytest.approx((1 + 3 * c, 1 + 0.5 * c), abs=1e-12)
        assert renoise_shape((4.0, 1.5), n, steps) == pytest.approx(expected, abs=1e-12)
    d = SimpleNamespace(renoise_beta=(4.0, 1.5), dynamic_steps=10, min_time=0.02, max_time=0.98)
    host = SimpleNamespace(cfg=SimpleNamespace(train=SimpleNamespace(distill=d)), device=torch.device("cpu"))
    host.renoise_shape_now = lambda: Distillation.renoise_shape_now(host)
    count, x0 = 20000, _draw(20000, 1, seed=14).float()  # (N, 1)

    def query(n):
        host.policy = SimpleNamespace(steps_taken=lambda: n)
        return DMD.query(host, x0, x0, torch.zeros(count, dtype=torch.long), torch.Generator().manual_seed(0))

    for n, (a, b) in ((0, (4.0, 1.5)), (5, (2.5, 1.25))):
        x_t, t, w, z = query(n)
        u = ((t.double() - 0.02) / 0.96).numpy()
        assert stats.kstest(u, stats.beta(a, b).cdf).statistic < 0.012  # 1% critical value at 20000 draws: 0.0115
        assert stats.kstest(u, "uniform").statistic > 0.1
        assert abs(u.mean() - a / (a + b)) < 0.005
        torch.testing.assert_close(x_t, (1 - t[:, None]) * x0 + t[:, None] * z)
        assert torch.equal(w, torch.ones(count))
    uniform = 0.02 + torch.rand(count, generator=torch.Generator().manual_seed(0)) * 0.96
    for n in (10, 30):
        assert torch.equal(query(n)[1], uniform)


@pytest.mark.slow  # CI: tdm's resume (above) runs in the default command
@pytest.mark.parametrize("preset", ["dmdr", "tdm_r1"])
def test_dmdr_and_tdm_r1_resume_exactly(preset, tmp_path, random_pipeline, prompt_files):
    """dmdr (DiffusionNFT's loss with the DMD regulariser) and tdm_r1 (its surrogate reward beside the fake score)
    trained two iterations straight and 1 + a resumed one end on the same student, and their held networks' checkpoint
    files (the fake score, tdm_r1's surrogate, their AdamW moments, its slow surrogate) are equal. tdm_r1 scores JPEG
    compressibility (the random pipeline's GenEval verdicts are all 0: the surrogate would not train), and its slow
    surrogate (a visible lag: decay 0.5 rising 0.001 an iteration) resumed with its update count and took the EMA step
    d = 0.501 of the second iteration towards the trained surrogate."""
    import json

    from safetensors.torch import load_file

    lag = {"train.tdm_r1.slow_decay_min": 0.5, "train.tdm_r1.slow_decay_max": 0.9, **no_download("geneval_strict")}
    lag = lag if preset == "tdm_r1" else {}
    assert_resume_is_exact(
        REPO / "configs" / f"{preset}.yaml",
        lambda out: _overrides(random_pipeline, prompt_files, out, **lag),
        tmp_path,
    )
    held = sorted(
        p.name
        for p in (tmp_path / "full/checkpoints/checkpoint-000002").glob("*.safetensors")
        if p.name not in ("trainable.safetensors", "optimizer.safetensors")
    )
    assert "fake_score.safetensors" in held and ("surrogate.safetensors" in held) == (preset == "tdm_r1")
    for name in held:
        a, b = (load_file(tmp_path / run / "checkpoints/checkpoint-000002" / name) for run in ("full", "part"))
        assert a.keys() == b.keys()
        for k in a:
            torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6)
    if preset != "tdm_r1":
        return
    assert "surrogate_slow.safetensors" in held
    part = tmp_path / "part/checkpoints"
    assert json.loads((part / "checkpoint-000002/state.json").read_text())["extra"]["slow_updates"] == 2
    slow_1, slow_2, sur_2 = (
        load_file(part / f"checkpoint-00000{i}/{name}.safetensors")
        for i, name in ((1, "surrogate_slow"), (2, "surrogate_slow"), (2, "surrogate"))
    )
    for k in slow_2:
        want = 0.501 * slow_1[k].double() + 0.499 * sur_2[k].double()
        torch.testing.assert_close(slow_2[k].double(), want, rtol=0, atol=1e-7)
    assert any(sur_2[k].abs().max() > 0 for k in sur_2 if "lora_B" in k)  # the surrogate trained (from B = 0)
    assert any((slow_2[k] - sur_2[k]).abs().max() > 1e-6 for k in slow_2)  # the slow copy lags it
    last = json.loads((tmp_path / "full/metrics.jsonl").read_text().splitlines()[-1])
    assert last["surrogate/slow_decay"] == pytest.approx(0.501) and 0 <= last["surrogate/trust_clip_frac"] <= 1
