"""Flow-OPD (``train.method: opd``, arXiv 2605.08063) and ``flowrl merge``: the dense reward and the loss against their
equations written out in float64, the task routing by tag, prompt file and metadata and its refusals, LoRA merging
against the weighted sum of the weight deltas (and the merged LoRA and pipeline loading), the preset training two
iterations on the tiny world with an exact resume."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from conftest import REPO, assert_resume_is_exact, cli_fails, read_metrics, save_random_lora, tiny_overrides
from safetensors.torch import load_file, save_file
from tiny_pipelines.sd3 import NO_T5

from flowrl.config import ConfigError, load_config
from flowrl.losses import kl_to_reference, ppo_loss, step_kl
from flowrl.merge import LORA_FILE, lora_folder, merge_loras, read_lora
from flowrl.methods.opd import FlowOPD, OPDConfig, OPDTeacherConfig, opd_advantages, read_routing, teacher_adapter
from flowrl.samplers import KERNELS

PRESET = REPO / "configs" / "flow_opd.yaml"


# ------------------------------------------------------------------------------------------------ the equations
def _flow_sde_mean(x, v, t, t_next, a):
    """Flow-GRPO's SDE step mean and std written out (arXiv 2505.05470; the project page's SDE)."""
    sigma = a * torch.sqrt(t / (1 - t))
    dt = t_next - t
    mean = x + (v + sigma**2 / (2 * t) * (x + (1 - t) * v)) * dt
    return mean, sigma * torch.sqrt(-dt)


def test_dense_reward_is_the_project_pages_kl_in_float64():
    """The reward's KL of the student's and the teacher's steps from one state equals the project page's
    ``|dt| / 2 (sigma_t (1 - t) / (2t) + 1 / sigma_t)^2 ||v_theta - v_teacher||^2`` (here per latent dim), in float64
    through :func:`step_kl`, and in float32 through flowrl's own ``flow_sde`` kernel; the advantage is ``-c KL``
    clipped."""
    g = torch.Generator().manual_seed(0)
    x, v, v_t = (torch.randn(5, 4, 6, 6, generator=g, dtype=torch.float64) for _ in range(3))
    t = torch.tensor([0.9, 0.7, 0.5, 0.3, 0.2], dtype=torch.float64)
    t_next, a = t - 0.1, 0.7
    mean, std = _flow_sde_mean(x, v, t.view(-1, 1, 1, 1), t_next.view(-1, 1, 1, 1), a)
    mean_t, _ = _flow_sde_mean(x, v_t, t.view(-1, 1, 1, 1), t_next.view(-1, 1, 1, 1), a)
    sigma, dt = a * torch.sqrt(t / (1 - t)), (t - t_next)
    page = dt / 2 * (sigma * (1 - t) / (2 * t) + 1 / sigma) ** 2 * ((v - v_t) ** 2).mean((1, 2, 3))
    kl = step_kl(mean, mean_t, std.flatten())
    assert kl.dtype == torch.float64
    torch.testing.assert_close(kl, page, rtol=1e-12, atol=0)
    step = KERNELS["flow_sde"]
    ours = step(x.float(), v.float(), t.float(), t_next.float(), a, 0.95, prev_sample=mean.float())
    teacher = step(x.float(), v_t.float(), t.float(), t_next.float(), a, 0.95, prev_sample=mean.float())
    torch.testing.assert_close(step_kl(ours.mean, teacher.mean, ours.std), page.float(), rtol=1e-4, atol=1e-7)
    adv = opd_advantages(kl, 2.0, 0.5)
    torch.testing.assert_close(adv, (-2.0 * page).clamp(-0.5, 0.5), rtol=1e-12, atol=0)
    assert (adv <= 0).all() and (adv >= -0.5).all()


def test_opd_loss_is_ppo_on_the_dense_reward_plus_the_anchor_kl_in_float64():
    """The loss of a batch, written out in float64: ``mean max(-A rho, -A clip(rho)) + lambda mean KL(student ||
    anchor)`` with ``A = clip(-c KL(old || teacher))``, equals flowrl's composition (ppo_loss, step_kl,
    kl_to_reference), and its gradient reaches the student's log-prob and mean only (the reward is held fixed)."""
    g = torch.Generator().manual_seed(1)
    m, eps, lam, c, a_max = 6, 0.2, 0.04, 1.0, 5.0
    old_mean, teacher_mean, anchor_mean = (torch.randn(m, 3, 4, 4, generator=g, dtype=torch.float64) for _ in range(3))
    std = torch.rand(m, generator=g, dtype=torch.float64) + 0.5
    old_lp = torch.randn(m, generator=g, dtype=torch.float64)
    new_lp = (old_lp + 0.3 * torch.randn(m, generator=g, dtype=torch.float64)).requires_grad_(True)
    new_mean = (old_mean + 0.1 * torch.randn(m, 3, 4, 4, generator=g, dtype=torch.float64)).requires_grad_(True)
    kl_teacher = ((old_mean - teacher_mean) ** 2).mean((1, 2, 3)) / (2 * std**2)
    adv = torch.clamp(-c * kl_teacher, -a_max, a_max)
    rho = torch.exp(new_lp - old_lp)
    written = torch.maximum(-adv * rho, -adv * rho.clamp(1 - eps, 1 + eps)).mean()
    written = written + lam * (((new_mean - anchor_mean) ** 2).mean((1, 2, 3)) / (2 * std**2)).mean()
    adv_ours = opd_advantages(step_kl(old_mean, teacher_mean, std), c, a_max)
    policy, _ = ppo_loss(new_lp, old_lp, adv_ours, eps)
    ours = policy + lam * kl_to_reference(new_mean, anchor_mean, std)
    torch.testing.assert_close(ours.double(), written, rtol=1e-6, atol=1e-9)
    ours.backward()
    assert new_lp.grad is not None and new_mean.grad is not None and new_lp.grad.abs().sum() > 0


# ------------------------------------------------------------------------------------------------ routing
def _lora_stub(folder: Path) -> Path:
    """A folder that names a LoRA file (routing reads no weights)."""
    folder.mkdir(parents=True)
    (folder / LORA_FILE).write_bytes(b"")
    return folder


METAS = [
    {"prompt": "a photo of a cat", "tag": "single_object"},
    {"prompt": "two dogs", "tag": "counting"},
    {"prompt": "a red cube", "tag": "colors", "source": "ocr"},
    {"prompt": "the word hello", "tag": "text", "source": "ocr"},
]


def test_routing_by_tag_prompt_file_and_metadata_with_a_fallback(tmp_path):
    """Each record goes to the one teacher whose tags, prompt file or metadata name it; a teacher naming none serves
    the rest; a run folder resolves to its exported lora/."""
    run = tmp_path / "run"
    _lora_stub(run / "lora")
    (tmp_path / "count.txt").write_text("two dogs\n")
    teachers = {
        "objects": OPDTeacherConfig(lora=str(_lora_stub(tmp_path / "a")), tags=["single_object"]),
        "count": OPDTeacherConfig(lora=str(run), prompts=str(tmp_path / "count.txt")),
        "ocr": OPDTeacherConfig(lora=str(_lora_stub(tmp_path / "c")), where={"source": "ocr", "tag": ["text"]}),
        "rest": OPDTeacherConfig(lora=str(_lora_stub(tmp_path / "d"))),
    }
    routing = read_routing(OPDConfig(teachers=teachers), METAS)
    assert routing.folders[1] == run / "lora"
    assert [routing.names[routing.teacher_of(m)] for m in METAS] == ["objects", "count", "rest", "ocr"]
    assert teacher_adapter("ocr") == "opd_teacher_ocr"


@pytest.mark.parametrize(
    "teachers, match",
    [
        ({"a": {"tags": ["single_object"]}, "b": {"tags": ["nope"]}}, r"teachers\.b\.tags': 'nope' is no tag"),
        (
            {"a": {"tags": ["single_object", "counting", "colors"]}, "b": {"where": {"source": "ocr"}}},
            "served by teachers a and b",
        ),
        ({"a": {"tags": ["single_object"]}}, "served by no teacher"),
        ({"a": {}, "b": {}}, "teachers a and b both name no prompts"),
        (
            {"a": {}, "b": {"tags": ["single_object"], "where": {"source": "nowhere"}}, "c": {"where": {"x": 1}}},
            r"teachers\.c': it serves no record",
        ),
    ],
)
def test_routing_refuses_in_one_line(tmp_path, teachers, match):
    specs = {n: OPDTeacherConfig(lora=str(_lora_stub(tmp_path / n)), **t) for n, t in teachers.items()}
    with pytest.raises(ConfigError, match=match) as error:
        read_routing(OPDConfig(teachers=specs), METAS)
    assert "\n" not in str(error.value)


def test_bad_teacher_folders_and_names_are_refused_in_one_line(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"teachers\.a\.lora'.*holds no pytorch_lora_weights"):
        read_routing(OPDConfig(teachers={"a": OPDTeacherConfig(lora=str(tmp_path))}), METAS)
    with pytest.raises(FileNotFoundError, match=r"teachers\.a\.lora'.*is not a folder"):
        read_routing(OPDConfig(teachers={"a": OPDTeacherConfig(lora=str(tmp_path / "missing"))}), METAS)
    with pytest.raises(ConfigError, match=r"teachers\.a\.lora' must be a LoRA folder"):
        read_routing(OPDConfig(teachers={"a": OPDTeacherConfig()}), METAS)
    with pytest.raises(ConfigError, match="train.opd.teachers' must be teachers named by letters"):
        OPDConfig(teachers={"a.b": OPDTeacherConfig()})
    with pytest.raises(ConfigError, match="train.opd.teachers' must be at least one teacher"):
        load_config(PRESET, ["train.opd.teachers.geneval=null", "train.opd.teachers.clipscore=null"])
    with pytest.raises(ConfigError, match=r"train\.kl_type' must be mean\|flow_grpo with train\.method opd"):
        load_config(PRESET, ["train.kl_type=velocity"])


# ------------------------------------------------------------------------------------------------ LoRA files
@pytest.fixture(scope="module")
def teachers(random_pipeline, tmp_path_factory) -> dict[str, Path]:
    """Two LoRAs of the tiny random SD3 pipeline with random (nonzero) factors: ``objects`` a LoRA folder of rank 2,
    alpha 4; ``attributes`` a run folder (its LoRA in lora/, as a finished run exports it) of rank 3, alpha 3."""
    from flowrl.models import load_model

    root = tmp_path_factory.mktemp("teachers")
    out, model = {}, load_model(random_pipeline)
    for name, rank, alpha, seed in (("objects", 2, 4.0, 1), ("attributes", 3, 3.0, 2)):
        if name == "attributes":
            model.transformer.delete_adapters("default")
        out[name] = root / name
        save_random_lora(model, out[name] if name == "objects" else out[name] / "lora", rank, alpha, seed)
    return out


def _deltas(folder: Path) -> dict[str, torch.Tensor]:
    """Each module's weight delta ``s B A`` (float64) of a LoRA folder."""
    lora = read_lora(lora_folder(folder, "LoRA"))
    return {n: lora.scale[n.split(".", 1)[0]] * b.double() @ a.double() for n, (a, b) in lora.modules.items()}


def test_merge_cat_and_svd_are_the_weighted_sum_of_the_weight_deltas(teachers, tmp_path):
    """``cat`` (the default) is exactly ``sum_i w_i s_i B_i A_i``; ``svd`` at the summed rank too; ``linear`` (one rank
    and alpha) is the weighted sum of the factors, and is refused across ranks in one line."""
    d1, d2 = _deltas(teachers["objects"]), _deltas(teachers["attributes"])
    for combination, rank in (("cat", None), ("svd", 5)):
        out = merge_loras(list(teachers.values()), tmp_path / combination, [0.3, -1.2], combination, rank)
        merged = _deltas(out)
        assert merged.keys() == d1.keys()
        for n in d1:
            torch.testing.assert_close(merged[n], 0.3 * d1[n] - 1.2 * d2[n], rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="combination linear sums the LoRAs' factors, which needs one rank"):
        merge_loras(list(teachers.values()), tmp_path / "linear", None, "linear")
    out = merge_loras([teachers["objects"]] * 2, tmp_path / "linear", [0.25, 0.25], "linear")
    lora, one = read_lora(out), read_lora(teachers["objects"])
    for n, (a, b) in lora.modules.items():
        torch.testing.assert_close(a, 0.5 * one.modules[n][0])
        torch.testing.assert_close(b, 0.5 * one.modules[n][1])
    assert lora.scale == one.scale


def test_merge_refuses_loras_of_different_models_in_one_line(teachers, tmp_path):
    state = load_file(teachers["objects"] / LORA_FILE)
    cut = tmp_path / "cut"
    cut.mkdir()
    save_file({k: v for i, (k, v) in enumerate(sorted(state.items())) if i >= 2}, str(cut / LORA_FILE))
    with pytest.raises(ValueError, match="target different modules"):
        merge_loras([teachers["objects"], cut], tmp_path / "x")
    wide = tmp_path / "wide"
    wide.mkdir()
    save_file({k: torch.cat([v, v], dim=1) if "lora_A" in k else v for k, v in state.items()}, str(wide / LORA_FILE))
    with pytest.raises(ValueError, match="are not of one base model"):
        merge_loras([teachers["objects"], wide], tmp_path / "y")


def test_flowrl_merge_writes_a_lora_the_pipeline_loads_and_a_fused_pipeline(
    teachers, random_pipeline, tmp_path, capsys
):
    """``flowrl merge`` writes the merged LoRA, which the stock pipeline's ``load_lora_weights`` loads with the merged
    deltas; with ``--base`` the pipeline with them fused into its transformer; bad arguments are one line."""
    from diffusers import StableDiffusion3Pipeline

    from flowrl import cli

    loras = [str(teachers["objects"]), str(teachers["attributes"])]
    cli.main(["merge", *loras, "--out", str(tmp_path / "m"), "--weights", "0.5", "0.25"])
    expected = {n: 0.5 * d for n, d in _deltas(teachers["objects"]).items()}
    for n, d in _deltas(teachers["attributes"]).items():
        expected[n] = expected[n] + 0.25 * d
    name = next(n for n in expected if n.endswith("attn.to_q"))
    pipe = StableDiffusion3Pipeline.from_pretrained(random_pipeline, **NO_T5)
    base = pipe.transformer.get_submodule(name.split(".", 1)[1]).weight.detach().double().clone()
    pipe.load_lora_weights(str(tmp_path / "m"), adapter_name="m")
    layer = pipe.transformer.get_submodule(name.split(".", 1)[1])
    torch.testing.assert_close(layer.get_delta_weight("m").double(), expected[name], rtol=1e-5, atol=1e-7)
    cli.main(["merge", *loras, "--out", str(tmp_path / "pipe"), "--base", str(random_pipeline)])
    fused = StableDiffusion3Pipeline.from_pretrained(tmp_path / "pipe", **NO_T5).transformer.get_submodule(
        name.split(".", 1)[1]
    )
    half = {n: 0.5 * d for n, d in _deltas(teachers["objects"]).items()}
    want = base + half[name] + 0.5 * _deltas(teachers["attributes"])[name]
    torch.testing.assert_close(fused.weight.detach().double(), want, rtol=1e-5, atol=1e-6)
    capsys.readouterr()
    assert "2 given for 1 LoRA folders" in cli_fails(
        capsys, "merge", loras[0], "--out", tmp_path / "z", "--weights", 1, 2
    )
    assert "holds no pytorch_lora_weights" in cli_fails(capsys, "merge", tmp_path, "--out", tmp_path / "z")
    assert "holds a LoRA already" in cli_fails(capsys, "merge", loras[0], "--out", tmp_path / "m")


# ------------------------------------------------------------------------------------------------ the preset
def _overrides(random_pipeline, prompt_files, teachers, **extra):
    """The preset's overrides for a run folder, on the tiny random pipeline, its two teachers the module's (a LoRA
    folder and a run folder), JPEG compressibility logged in place of the GenEval reward."""
    settings = {
        "train.opd.teachers.geneval.lora": teachers["objects"],
        "train.opd.teachers.clipscore.lora": teachers["attributes"],
        "rewards.geneval": "null",
        "rewards.jpeg_compressibility.weight": 1.0,
        **extra,
    }
    return lambda run: tiny_overrides(random_pipeline, *prompt_files, run, **settings)


def test_flow_opd_trains_two_iterations_and_resumes_exactly(random_pipeline, prompt_files, teachers, tmp_path):
    """The preset trains two iterations on the tiny world: the ratio is 1 before each first step, the advantages are
    the teachers' negative KLs (each teacher labelling its own transitions), the student moves, the teachers stay
    frozen and inactive; 1 iteration + a resume equals 2 straight."""
    over = _overrides(random_pipeline, prompt_files, teachers, **{"sampling.num_steps": 2})  # one trained step
    trainer = assert_resume_is_exact(PRESET, over, tmp_path)
    rows = read_metrics(tmp_path / "full")
    for r in rows:
        assert r["policy/ratio_first_max_dev"] == 0.0 and r["policy/optimizer_steps"] > 0
        assert r["opd/kl"] > 0 and r["advantage/abs_mean"] > 0 and math.isfinite(r["policy/kl"])
        assert r["opd/geneval/transitions"] + r["opd/clipscore/transitions"] == r["cost/trained_transitions"]
        assert r["cost/teacher_nfe"] > 0
    transformer = trainer.model.transformer
    assert transformer.active_adapters() == ["default"]
    trainable = {n for n, p in transformer.named_parameters() if p.requires_grad}
    assert trainable == set(trainer.policy.params) and not any("opd_teacher" in n for n in trainable)


def test_a_teacher_of_another_model_is_refused_in_one_line(random_pipeline, prompt_files, teachers, tmp_path):
    from flowrl.trainer import Trainer

    state = load_file(teachers["objects"] / LORA_FILE)
    bad = tmp_path / "bad"
    bad.mkdir()
    save_file({k: torch.cat([v, v], dim=1) if "lora_A" in k else v for k, v in state.items()}, str(bad / LORA_FILE))
    over = _overrides(random_pipeline, prompt_files, {**teachers, "objects": bad})(tmp_path / "run")
    with pytest.raises(ValueError, match=r"^config key 'train\.opd\.teachers\.geneval\.lora': .* is not a LoRA") as e:
        Trainer(load_config(PRESET, over))
    assert "\n" not in str(e.value)


def test_cold_start_sets_the_student_to_the_merged_teachers(random_pipeline, prompt_files, teachers, tmp_path):
    """``train.opd.init``: the student starts from the teachers' merge (svd at the student's rank 2, alpha 4): its
    weight deltas equal the merged LoRA's; a LoRA of another rank is refused in one line. ``train.opd.anchor``: a
    LoRA, run alone inside :meth:`FlowOPD.reference` (the velocity of the teacher of that LoRA, not the student's)."""
    from flowrl.trainer import Trainer

    merged = merge_loras(list(teachers.values()), tmp_path / "merged", [0.5, 0.5], "svd", 2)
    settings = {"train.opd.init": merged, "model.lora_alpha": 4, "train.opd.anchor": teachers["objects"]}
    trainer = Trainer(
        load_config(PRESET, _overrides(random_pipeline, prompt_files, teachers, **settings)(tmp_path / "run"))
    )
    model, x = trainer.model, torch.randn(1, *trainer.model.latent_shape, generator=torch.Generator().manual_seed(0))
    velocity, t, row = (
        model.velocity_fn(model.prompt_table([{"prompt": "a cat"}]), 1.0),
        torch.tensor([0.5]),
        torch.ones(1, dtype=torch.long),
    )
    with torch.no_grad():
        with trainer.method.reference():
            anchor = velocity(x, t, row)
        with model.adapter(teacher_adapter("geneval")):
            teacher = velocity(x, t, row)
        student = velocity(x, t, row)
    assert torch.equal(anchor, teacher) and (anchor - student).abs().max() > 1e-4
    params, want = trainer.policy.params, _deltas(merged)
    for key, delta in want.items():
        module = key.split(".", 1)[1]
        a, b = params[f"{module}.lora_A.default.weight"], params[f"{module}.lora_B.default.weight"]
        torch.testing.assert_close((4 / 2) * b.double() @ a.double(), delta, rtol=1e-5, atol=1e-7)
    over = _overrides(random_pipeline, prompt_files, teachers, **{"train.opd.init": teachers["attributes"]})
    with pytest.raises(ConfigError, match=r"^config key 'train\.opd\.init': .* of rank 3, .*--rank 2$"):
        FlowOPD.read_data(load_config(PRESET, over(tmp_path / "run2")))  # before the model loads


# ------------------------------------------------------------------------------------------------ the SFT cold start
def _trainer(random_pipeline, prompt_files, teachers, folder, **extra):
    """A Trainer of the preset on the tiny random pipeline (its teachers the module's), built, not trained."""
    from flowrl.trainer import Trainer

    return Trainer(load_config(PRESET, _overrides(random_pipeline, prompt_files, teachers, **extra)(folder)))


def test_sft_loss_is_the_flow_matching_error_written_out_in_float64(random_pipeline, prompt_files, teachers, tmp_path):
    """:meth:`FlowOPD.sft_loss` of a velocity (a fixed linear map, float64) equals ``mean_n mean_d (v(x_t, t) - (eps -
    x0))^2`` at ``x_t = (1 - t) x0 + t eps``, written out in float64; the teachers' samples are Euler ODE samples of
    the routed teacher alone at ``sampling.guidance_scale``, written out step by step."""
    trainer = _trainer(random_pipeline, prompt_files, teachers, tmp_path / "run")
    method, model = trainer.method, trainer.model
    g = torch.Generator().manual_seed(3)
    x0, eps = (torch.randn(5, 4, 6, 6, generator=g, dtype=torch.float64) for _ in range(2))
    times = torch.rand(5, generator=g, dtype=torch.float64) * 0.9 + 0.05
    weight = torch.randn(4, 4, generator=g, dtype=torch.float64)

    def velocity(x, t, cond):  # a linear velocity field standing in for the student
        return torch.einsum("oc,nchw->nohw", weight, x) * t.view(-1, 1, 1, 1) + cond.view(-1, 1, 1, 1)

    cond = torch.arange(5)
    t = times.view(-1, 1, 1, 1)
    x_t = (1 - t) * x0 + t * eps
    written = ((velocity(x_t, times, cond) - (eps - x0)) ** 2).mean((1, 2, 3)).mean()
    ours = method.sft_loss(velocity, x0, cond, times, eps)
    assert ours.dtype == torch.float64
    torch.testing.assert_close(ours, written, rtol=1e-12, atol=0)

    metas = [next(m for m in trainer.train_metas if m.get("tag") == tag) for tag in ("colors", "counting")]
    names = [method.routing.names[method.routing.teacher_of(m)] for m in metas]
    x_teacher, rows, table = method.teacher_samples(metas, torch.Generator().manual_seed(4))
    noise = torch.randn(x_teacher.shape, generator=torch.Generator().manual_seed(4))
    guided, sigmas = model.velocity_fn(table, trainer.cfg.sampling.guidance_scale), method.sigmas
    for n, name in enumerate(names):
        x = noise[n : n + 1]
        with torch.no_grad(), model.adapter(teacher_adapter(name)):
            for s, s_next in zip(sigmas[:-1], sigmas[1:]):
                x = x + (s_next - s) * guided(x, s.view(1), rows[n : n + 1])
        torch.testing.assert_close(x_teacher[n : n + 1], x, rtol=1e-5, atol=1e-6)
    assert names == ["clipscore", "geneval"]


def test_sft_cold_start_moves_the_student_to_its_teachers_samples(random_pipeline, prompt_files, teachers, tmp_path):
    """``train.opd.sft_steps``: the first step's logged loss is the student's flow-matching error on the routed
    teachers' samples written out from the same draws; after the steps the student's error on those samples (fixed
    times and noise, all deterministic) dropped, the AdamW state is cleared; with 0 steps :meth:`FlowOPD.begin` changes
    nothing."""
    from flowrl.prompt_sampler import iteration_seed

    off = _trainer(random_pipeline, prompt_files, teachers, tmp_path / "off")
    before = {n: p.detach().clone() for n, p in off.policy.params.items()}
    off.method.begin(off.train_metas)
    assert all(torch.equal(p, before[n]) for n, p in off.policy.params.items()) and not off.method._sft_stats
    settings = {"train.opd.sft_steps": 8, "train.opd.sft_prompts": 3, "train.learning_rate": 1e-3}
    trainer = _trainer(random_pipeline, prompt_files, teachers, tmp_path / "on", **settings)
    method, model, cfg = trainer.method, trainer.model, trainer.cfg
    # the cold start's draws, replayed: the prompts, the teachers' samples, the first step's images, times and noise
    g = torch.Generator().manual_seed(iteration_seed(cfg.run.seed, -1, 0))
    metas = [trainer.train_metas[i] for i in torch.randperm(len(trainer.train_metas), generator=g)[:3].tolist()]
    x0, cond, table = method.teacher_samples(metas, g)
    size = cfg.train.minibatch_size
    pick = torch.randint(0, len(x0), (size,), generator=g)
    shift = float(cfg.sampling.shift or 1.0)
    u = torch.sigmoid(torch.randn(size, generator=g))
    times = (shift * (1 - u) / (1 + (shift - 1) * (1 - u))).clamp(1e-3, 1 - 1e-3)
    eps = torch.randn((size, *x0.shape[1:]), generator=g)
    student = model.velocity_fn(table, 1.0)

    def error(x, c, t, e):  # the student's flow-matching error, in float64 from its float32 velocity
        tt = t.view(-1, 1, 1, 1)
        with torch.no_grad():
            v = student((1 - tt) * x + tt * e, t, c).double()
        return ((v - (e.double() - x.double())) ** 2).mean((1, 2, 3)).mean().item()

    first = error(x0[pick], cond[pick], times, eps)
    held_t = torch.full((len(x0),), 0.5)
    held_eps = torch.randn(x0.shape, generator=torch.Generator().manual_seed(9))
    start = error(x0, cond, held_t, held_eps)
    method.begin(trainer.train_metas)
    stats = method._sft_stats
    assert stats["opd/sft_images"] == 3 and stats["cost/sft_nfe"] > 0
    assert stats["opd/sft_loss_first"] == pytest.approx(first, rel=1e-5)
    assert error(x0, cond, held_t, held_eps) < start - 0.01  # 1.987 -> 1.964 (8 steps of a fresh rank-2 LoRA)
    assert trainer.policy.steps_taken() == 0 and not trainer.policy.optimizer.state


def test_sft_cold_start_trains_once_and_resumes_exactly(random_pipeline, prompt_files, teachers, tmp_path):
    """The preset with ``train.opd.sft_steps``: the first iteration's row logs the cold start, the second does not;
    1 iteration + a resume (which skips the cold start: the checkpoint holds the student) equals 2 straight."""
    settings = {"sampling.num_steps": 2, "train.opd.sft_steps": 2, "train.opd.sft_prompts": 2}
    assert_resume_is_exact(PRESET, _overrides(random_pipeline, prompt_files, teachers, **settings), tmp_path)
    full, part = read_metrics(tmp_path / "full"), read_metrics(tmp_path / "part")
    assert full[0]["opd/sft_loss"] > 0 and full[0]["cost/nfe"] > full[0]["cost/sft_nfe"] > 0
    assert "opd/sft_loss" not in full[1] and "opd/sft_loss" not in part[1]
    assert part[0]["opd/sft_loss"] == full[0]["opd/sft_loss"]


def test_sft_cold_start_and_init_are_refused_together_in_one_line(tmp_path):
    with pytest.raises(ConfigError, match=r"^config key 'train\.opd\.sft_steps' must be 0 with train\.opd\.init") as e:
        load_config(PRESET, ["train.opd.sft_steps=2", f"train.opd.init={tmp_path}"])
    assert "\n" not in str(e.value)
    for key, value in (("sft_steps", -1), ("sft_prompts", -1), ("sft_samples_per_prompt", 0)):
        with pytest.raises(ConfigError, match=rf"^config key 'train\.opd\.{key}' must be >= "):
            load_config(PRESET, [f"train.opd.{key}={value}"])
