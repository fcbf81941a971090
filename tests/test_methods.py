"""The methods of 2026: AWM, DGPO, Diffusion-DPO (online and offline), SFT, CRD, Flow-DPPO, GARDO and GDPO's
aggregation. Each loss is checked against an independent derivation of the paper's and official code's equations
written here (float64, 1e-6), each property the method promises is asserted, and each preset trains on the tiny
random pipeline and resumes exactly."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import REPO, assert_resume_is_exact, tiny_overrides

from flowrl.config import ConfigError, load_config

G64 = torch.float64


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=G64)


# ------------------------------------------------------------------------------------------------ the losses
def test_dpo_loss_is_the_papers_on_velocity_errors_with_its_gradient():
    """Diffusion-DPO (arXiv 2311.12908, Eq. 14) in flow_grpo's velocity form, written out: errors are means over the
    latent dimensions of (v - (eps - x0))^2; loss = -log sigmoid(-beta/2 [(e_w - e_ref_w) - (e_l - e_ref_l)])."""
    from flowrl.methods.dpo import dpo_loss
    from flowrl.methods.forward import flow_matching_error

    v_w, v_l = _randn(3, 4, 5, 5, seed=1).requires_grad_(), _randn(3, 4, 5, 5, seed=2).requires_grad_()
    r_w, r_l, x_w, x_l, eps = (_randn(3, 4, 5, 5, seed=s) for s in range(3, 8))
    beta = 7.0
    ours = dpo_loss(
        flow_matching_error(v_w, x_w, eps),
        flow_matching_error(r_w, x_w, eps),
        flow_matching_error(v_l, x_l, eps),
        flow_matching_error(r_l, x_l, eps),
        beta,
    )
    grads = torch.autograd.grad(ours.sum(), [v_w, v_l])
    v_w2, v_l2 = v_w.detach().clone().requires_grad_(), v_l.detach().clone().requires_grad_()

    def err(v, x0):
        return ((v - (eps - x0)) ** 2).reshape(3, -1).sum(1) / (4 * 5 * 5)

    inside = -beta / 2 * ((err(v_w2, x_w) - err(r_w, x_w)) - (err(v_l2, x_l) - err(r_l, x_l)))
    theirs = torch.log1p(torch.exp(-inside))  # -log sigmoid(inside)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)
    for g, h in zip(grads, torch.autograd.grad(theirs.sum(), [v_w2, v_l2])):
        torch.testing.assert_close(g, h, rtol=0, atol=1e-6)
    same = flow_matching_error(r_w, x_w, eps)
    assert dpo_loss(same, same, same, same, beta).tolist() == pytest.approx([math.log(2)] * 3, abs=1e-12)


def test_dgpo_objective_and_its_weighted_surrogate_have_the_papers_gradient():
    """DGPO (arXiv 2510.08425): per group -log sigmoid(R(G+) - R(G-)) with R = beta/G sum |A| (l_ref - l_theta);
    flowrl trains mean(w A l_theta) with w = sigmoid(S_g) held fixed, whose gradient is the objective's times
    G / (beta N) (the official code's scale)."""
    from flowrl.methods.dgpo import dgpo_objective

    n, g_size, beta = 8, 4, 3.0
    err = torch.rand(n, dtype=G64, generator=torch.Generator().manual_seed(0)).requires_grad_()
    ref = torch.rand(n, dtype=G64, generator=torch.Generator().manual_seed(1))
    adv = _randn(n, seed=2)
    group = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    objective, weight = dgpo_objective(err, ref, adv, group, beta, g_size)
    # the paper's form, written out: positive and negative halves of each group
    expected = []
    for g in (0, 1):
        m = group == g
        pos, neg = m & (adv > 0), m & (adv < 0)
        r_pos = beta / g_size * (adv[pos].abs() * (ref[pos] - err[pos])).sum()
        r_neg = beta / g_size * (adv[neg].abs() * (ref[neg] - err[neg])).sum()
        expected.append(-F.logsigmoid(r_pos - r_neg))
    expected = torch.stack(expected)
    torch.testing.assert_close(objective, expected, rtol=0, atol=1e-12)
    grad_obj = torch.autograd.grad(objective.sum(), err)[0]
    surrogate = (weight.detach() * adv * err).mean()
    grad_sur = torch.autograd.grad(surrogate, err)[0]
    torch.testing.assert_close(grad_sur * beta * n / g_size, grad_obj, rtol=0, atol=1e-12)
    same, w = dgpo_objective(ref, ref, adv, group, beta, g_size)
    assert same.tolist() == pytest.approx([math.log(2)] * 2, abs=1e-12) and torch.all(w == 0.5)


def test_awm_surrogate_is_the_ghuber_weighted_flow_matching_error():
    """AWM (arXiv 2509.25050, official 'ghuber'): log p = -(t / p) ((mse + 1e-10)^p - (1e-10)^p)."""
    from flowrl.methods.awm import awm_log_likelihood

    mse, t, p = torch.rand(6, dtype=G64) * 2, torch.rand(6, dtype=G64), 0.25
    expected = -(t / p) * ((mse + 1e-10) ** p - (1e-10) ** p)
    torch.testing.assert_close(awm_log_likelihood(mse, t, p), expected, rtol=0, atol=1e-12)
    assert awm_log_likelihood(torch.zeros(2, dtype=G64), torch.ones(2, dtype=G64), p).abs().max() < 1e-12


def test_dppo_loss_masks_steps_that_moved_too_far_in_the_advantages_direction():
    """Flow-DPPO (arXiv 2606.11025; UniRL flowdppo.py): kl = mean_d (mu - mu_old)^2 / (2 sigma^2); a transition is
    dropped when kl >= tau and (r > 1 and A > 0 or r < 1 and A < 0); loss = mean over all of -A r (0 if dropped)."""
    from flowrl.losses import dppo_loss

    m = 6
    mean = _randn(m, 2, 3, 3, seed=1).requires_grad_()
    old_mean = mean.detach() + 0.05 * _randn(m, 2, 3, 3, seed=2) * torch.tensor([0, 1, 1, 1, 0, 1.0], dtype=G64).view(
        -1, 1, 1, 1
    )
    std = torch.full((m,), 0.1, dtype=G64)
    old_lp = _randn(m, seed=3)
    log_prob = (old_lp + torch.tensor([0.1, 0.1, -0.1, 0.1, -0.1, -0.1], dtype=G64)).requires_grad_()
    adv = torch.tensor([1.0, 1.0, 1.0, -1.0, -1.0, -1.0], dtype=G64)
    tau = 1e-3
    loss, stats = dppo_loss(log_prob, old_lp, adv, mean, old_mean, std, tau)
    kl = ((mean.detach() - old_mean) ** 2 / (2 * 0.01)).reshape(m, -1).mean(1)
    r = torch.exp(log_prob.detach() - old_lp)
    drop = (kl >= tau) & (((r > 1) & (adv > 0)) | ((r < 1) & (adv < 0)))
    assert drop.tolist() == [False, True, False, False, False, True]  # row 2 moves back; rows 0, 4 did not move
    expected = torch.where(drop, torch.zeros(m, dtype=G64), -adv * r).mean()
    torch.testing.assert_close(loss, expected, rtol=0, atol=1e-12)
    grad = torch.autograd.grad(loss, log_prob)[0]
    torch.testing.assert_close(grad, torch.where(drop, 0.0, -adv * r) / m, rtol=0, atol=1e-12)
    assert stats["policy/maskfrac"].item() == pytest.approx(2 / 6)


def test_gdpo_normalises_each_reward_in_its_group_then_the_sum_over_the_batch():
    """Flow-Factory's GDPO: n_k = (r_k - mean_g) / max(std_g, 1e-6); c = sum_k w_k n_k; A = (c - mean c) / max(std c, 1e-6)."""
    from flowrl.advantages import gdpo_advantages

    group = torch.tensor([0, 0, 0, 1, 1, 1])
    a = torch.tensor([1.0, 2.0, 3.0, 5.0, 5.0, 5.0])  # constant in group 1
    b = torch.tensor([10.0, 0.0, 20.0, 1.0, 3.0, 2.0])
    adv, zero = gdpo_advantages({"a": a, "b": b}, {"a": 1.0, "b": 0.5}, group, clip=100.0)

    def z(x):
        out = torch.zeros(6, dtype=G64)
        for g in (0, 1):
            m = group == g
            v = x[m].double()
            out[m] = (v - v.mean()) / max(v.std(unbiased=False).item(), 1e-6)
        return out

    c = 1.0 * z(a) + 0.5 * z(b)
    expected = (c - c.mean()) / c.std(unbiased=False)
    torch.testing.assert_close(adv.double(), expected, rtol=0, atol=1e-6)
    assert not zero.any()  # reward b varies in both groups
    cfg = load_config(None, ["train.reward_aggregation=gdpo"])
    assert cfg.train.reward_aggregation == "gdpo"


# ------------------------------------------------------------------------------------------------ the presets
PRESETS = {"awm": "awm", "crd": "crd", "dgpo": "dgpo", "dpo_online": "dpo", "flow_dppo": "flow_dppo", "gardo": "gardo"}


def _overrides(random_pipeline, prompt_files, out, **extra):
    train, test = prompt_files
    base = {
        "rewards.geneval": "null",
        "rewards.jpeg_compressibility.weight": 1.0,
        "sampling.group_size": 4,
        "sampling.num_steps": 4,
        "train.minibatch_size": 8,
        **extra,
    }
    return tiny_overrides(random_pipeline, train, test, out, **base)


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_each_preset_trains_two_iterations_and_its_first_step_is_exact(
    preset, tmp_path, random_pipeline, prompt_files
):
    import json

    from flowrl.trainer import Trainer

    over = _overrides(random_pipeline, prompt_files, tmp_path / "run")
    trainer = Trainer(load_config(REPO / "configs" / f"{preset}.yaml", over))
    assert trainer.method.name == PRESETS[preset]
    before = {n: p.detach().clone() for n, p in trainer.policy.params.items()}
    trainer.train()
    after = trainer.policy.params
    assert any(not torch.equal(before[n], after[n]) for n in after), "the policy did not move"
    rows = [json.loads(line) for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(math.isfinite(r["policy/loss"]) for r in rows if "policy/loss" in r)
    first = rows[0]
    if preset in ("awm", "flow_dppo"):  # their ratio is exactly 1 before the iteration's first optimizer step
        assert first["policy/ratio_first_max_dev"] == 0.0
    if preset == "dgpo":
        assert first["policy/dgpo_objective"] == pytest.approx(math.log(2), abs=1e-6)  # policy = reference at start
    if preset == "dpo_online":
        assert first["dpo/pairs"] >= 1
    if preset == "crd":  # the policy is the old copy until the first optimizer step
        assert first["policy/implicit_reward_first_max"] == 0.0
        assert first["policy/old_decay"] == pytest.approx(0.25 + 0.005 * first["policy/optimizer_steps"])
        assert first["sampling/decay"] == 0.0  # on-policy sampling for the first 75 optimizer steps
    if preset == "gardo":
        assert 0 < first["gardo/gated_frac"] < 1 and "policy/kl" in first


@pytest.mark.parametrize("preset", ["awm", "crd", "dpo_online", "gardo"])
def test_methods_with_extra_state_resume_exactly(preset, tmp_path, random_pipeline, prompt_files):
    """AWM's soft-updated copy, CRD's old and sampler copies, DPO's reference (and its refresh count) and GARDO's
    reference and gate state are in the checkpoint."""
    assert_resume_is_exact(
        REPO / "configs" / f"{preset}.yaml",
        lambda out: _overrides(random_pipeline, prompt_files, out, **{"train.dpo.ref_update_every": 1}),
        tmp_path,
    )


@pytest.mark.parametrize(
    "key,value,preset",
    [
        ("sampling.shape", "tree", "dgpo"),
        ("train.kl_beta", 0.1, "dpo_online"),
        ("model.lora_rank", 0, "dgpo"),
        ("train.dpo.beta", 0, "dpo_online"),
        ("train.awm.power", 0, "awm"),
        ("train.flow_dppo.kl_threshold", 0, "flow_dppo"),
        ("sampling.shape", "tree", "crd"),
        ("train.crd.old_decay", "[0,2,0,1]", "crd"),
        ("train.gardo.auxiliary", "[hpsv2]", "gardo"),
        ("train.reward_aggregation", "gdpo", "gardo"),
    ],
)
def test_settings_a_method_cannot_run_are_refused_naming_the_key(key, value, preset):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(REPO / "configs" / f"{preset}.yaml", [f"{key}={value}"])


# ------------------------------------------------------------------------------------------------ CRD and GARDO
def test_crd_implicit_reward_and_centred_loss_are_the_official_equations():
    """CRD (arXiv 2603.14128; Flow-Factory crd.py): r = -mean_d[(v - u)^2 / w - (v_old - u)^2 / w_old] with
    w = max(mean_d |v - u|, 1e-5) held fixed; a = clamp(clamp(A, -c, c) / c / 2 + 1/2, 0, 1);
    loss = (c / beta) mean((beta (r - mean r) - (a - mean a))^2) per centring set, mean r held fixed."""
    from flowrl.methods.crd import crd_loss, implicit_reward

    n, beta, c = 8, 2.0, 5.0
    v = _randn(n, 3, 4, 4, seed=1).requires_grad_()
    v_old, u = _randn(n, 3, 4, 4, seed=2), _randn(n, 3, 4, 4, seed=3)
    adv = _randn(n, seed=4) * 4
    unit = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    r = implicit_reward(v, v_old, u)
    loss, a = crd_loss(r, adv, unit, beta, c)
    grad = torch.autograd.grad(loss, v)[0]

    v2 = v.detach().clone().requires_grad_()
    w = (v2.detach() - u).abs().mean(dim=(1, 2, 3)).clamp(min=1e-5)
    w_old = (v_old - u).abs().mean(dim=(1, 2, 3)).clamp(min=1e-5)
    r2 = -(((v2 - u) ** 2).mean(dim=(1, 2, 3)) / w - ((v_old - u) ** 2).mean(dim=(1, 2, 3)) / w_old)
    a2 = torch.clamp(torch.clamp(adv, -c, c) / c / 2.0 + 0.5, 0, 1)
    terms = []
    for g in (0, 1):
        m = unit == g
        terms.append(beta * (r2[m] - r2[m].detach().mean()) - (a2[m] - a2[m].mean()))
    expected = (torch.cat(terms) ** 2).mean() * c / beta
    torch.testing.assert_close(r, r2, rtol=0, atol=1e-10)
    torch.testing.assert_close(a, a2, rtol=0, atol=1e-12)
    torch.testing.assert_close(loss, expected, rtol=0, atol=1e-10)
    torch.testing.assert_close(grad, torch.autograd.grad(expected, v2)[0], rtol=0, atol=1e-10)
    assert implicit_reward(v_old, v_old, u).abs().max() == 0  # policy = old copy: no implicit reward


def test_crd_decay_schedules_follow_the_official_presets():
    from flowrl.methods.crd import decay_at

    assert [decay_at([75, 0.0, 0.0075, 0.999], s) for s in (0, 74, 75, 175, 10_000)] == pytest.approx(
        [0.0, 0.0, 0.0, 0.75, 0.999]
    )
    assert [decay_at([0, 0.25, 0.005, 0.999], s) for s in (0, 10, 1000)] == pytest.approx([0.25, 0.3, 0.999])


def test_gardo_advantages_gate_and_compensator_match_the_official_code():
    """flow_grpo stat_tracking type='gardo': A = (r - mean_g) * d with d = 1 below the mean, else the cosine distance
    to the nearest group mate over the group's mean of those; uncertainty = rank(main) - mean(rank(aux)) (1 = best),
    gated above the (100 - 100 f) percentile of the non-negative values; RiskCompensator moves f."""
    import numpy as np

    from flowrl.methods.gardo import diversity, gardo_advantages, uncertainty

    rng = np.random.default_rng(0)
    n, groups = 12, np.repeat([0, 1, 2], 4)
    rewards, feats = rng.random(n), rng.standard_normal((n, 5))
    aux = [rng.random(n), rng.random(n)]
    # the official computation, written out with numpy
    f = feats / np.linalg.norm(feats, axis=1, keepdims=True)
    expected = np.zeros(n)
    for g in range(3):
        m = groups == g
        r, pf = rewards[m], f[m]
        d = 1 - np.clip(pf @ pf.T, -1, 1)
        nearest = np.array([np.min(np.delete(d[i], i)) for i in range(len(d))])
        mult = np.where(r - r.mean() < 0, 1.0, nearest / nearest.mean())
        expected[m] = (r - r.mean()) * mult
    div = diversity(torch.tensor(feats), torch.tensor(groups))
    adv, zero = gardo_advantages(torch.tensor(rewards), torch.tensor(groups), div, clip=5.0)
    np.testing.assert_allclose(adv.numpy(), expected, atol=1e-6)
    assert not zero.any()

    def ranks(x):
        out = np.empty(n)
        out[np.argsort(-x, kind="stable")] = np.arange(1, n + 1)
        return out

    u_expected = ranks(rewards) - (ranks(aux[0]) + ranks(aux[1])) / 2
    u = uncertainty(torch.tensor(rewards), [torch.tensor(a) for a in aux])
    np.testing.assert_allclose(u.numpy(), u_expected, atol=1e-12)


def test_gardo_gated_fraction_follows_the_risk_compensator():
    from types import SimpleNamespace

    from flowrl.methods.gardo import GARDO, GARDOConfig

    m = GARDO.__new__(GARDO)
    m.cfg = SimpleNamespace(train=SimpleNamespace(gardo=GARDOConfig()))
    m.fraction, m.history = 0.1, []
    seen = []
    for mean_u in (1.0, 2.0, 3.0, 0.5, 0.4, 1.0):
        m.update_fraction(mean_u)
        seen.append(m.fraction)
    # official: first call keeps base; above every past mean: *1.1; below every one: *0.9; else unchanged
    assert seen == pytest.approx([0.1, 0.11, 0.121, 0.1089, 0.09801, 0.09801])


# ------------------------------------------------------------------------------------------------ offline
@pytest.mark.parametrize("preset,method", [("dpo_offline", "dpo_offline"), ("sft", "sft")])
def test_offline_presets_train_on_the_shipped_data_and_resume_exactly(
    preset, method, tmp_path, random_pipeline, prompt_files
):
    import json

    from flowrl.trainer import Trainer

    over = _overrides(random_pipeline, prompt_files, tmp_path / "run", **{"train.offline.batch_size": 4})
    trainer = Trainer(load_config(REPO / "configs" / f"{preset}.yaml", over))
    assert trainer.method.name == method and not trainer.method.online
    assert len(trainer.method.data) == (229 if preset == "dpo_offline" else 66)
    trainer.train()
    rows = [json.loads(line) for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(r["policy/optimizer_steps"] > 0 and math.isfinite(r["policy/loss"]) for r in rows)
    assert "reward/total/mean" not in rows[0]  # nothing scored while training
    if preset == "dpo_offline":  # the policy is the reference before the first step: log 2
        assert rows[0]["policy/loss"] == pytest.approx(math.log(2), abs=0.05)
    assert_resume_is_exact(
        REPO / "configs" / f"{preset}.yaml",
        lambda out: _overrides(random_pipeline, prompt_files, out, **{"train.offline.batch_size": 4}),
        tmp_path / "resume",
    )


def test_offline_data_reads_pick_a_pic_rows_and_names_bad_rows(tmp_path):
    import io

    from PIL import Image

    from flowrl.methods.offline import load_image, read_preference_rows

    def png(color):
        buf = io.BytesIO()
        Image.new("RGB", (40, 20), color).save(buf, format="PNG")
        return buf.getvalue()

    Image.new("RGB", (8, 8), "red").save(tmp_path / "a.png")
    rows = [
        {"caption": "x", "jpg_0": "a.png", "jpg_1": "b.png", "label_0": 0},  # jpg_1 preferred
        {"caption": "y", "jpg_0": "a.png", "jpg_1": "b.png", "label_0": 0.5},  # a tie: skipped
    ]
    (tmp_path / "p.jsonl").write_text("".join(__import__("json").dumps(r) + "\n" for r in rows))
    assert read_preference_rows(tmp_path / "p.jsonl", pairs=True) == [
        ("x", str(tmp_path / "b.png"), str(tmp_path / "a.png"))
    ]
    import pyarrow as pa
    import pyarrow.parquet as pq

    pick = {"caption": ["g", "t"], "jpg_0": [png((0, 255, 0)), png((0, 0, 255))], "jpg_1": [png((0, 0, 255))] * 2,
            "label_0": [1.0, 0.5]}  # fmt: skip
    pq.write_table(pa.table(pick), tmp_path / "pick.parquet")  # Pick-a-Pic's parquet: images as bytes
    (row,) = read_preference_rows(tmp_path / "pick.parquet", pairs=True)
    assert row[0] == "g" and load_image(row[1], 8)[1].min() == 1.0 and load_image(row[2], 8)[2].min() == 1.0
    image = load_image(png((0, 255, 0)), 16)  # bytes, as Pick-a-Pic's parquet holds them: resized and centre-cropped
    assert image.shape == (3, 16, 16) and image[1].min() == 1.0 and image[0].max() == 0.0
    (tmp_path / "bad.jsonl").write_text('{"prompt": "x", "image": "a.png"}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl row 1: expected fields prompt, image_w, image_l"):
        read_preference_rows(tmp_path / "bad.jsonl", pairs=True)
    with pytest.raises(ValueError, match="cannot be read as an image"):
        load_image(str(tmp_path / "p.jsonl"), 8)


def test_offline_methods_refuse_a_missing_data_key_and_families_without_vae_latents(random_pipeline):
    from flowrl.methods import METHODS
    from flowrl.models import FluxKontextModel, SD15Model, WanModel
    from flowrl.pairing import check_pairing

    with pytest.raises(ConfigError, match=r"train\.offline\.data"):
        load_config(REPO / "configs" / "sft.yaml", ["train.offline.data="])
    with pytest.raises(ConfigError, match=r"'sft' \(SFT\) needs a flow-matching model"):
        check_pairing(METHODS["sft"], SD15Model, "sd15")  # the forward process first: a DDPM family lacks both
    with pytest.raises(ConfigError, match="the WanModel family's latents are its own"):
        check_pairing(METHODS["sft"], WanModel, "wan")
    with pytest.raises(ConfigError, match="FluxKontextModel edits source images"):
        check_pairing(METHODS["dpo_offline"], FluxKontextModel, "kontext")
