"""What every model family must do, checked on a tiny random pipeline of its real classes (tests/families.py): ODE
sampling equal to the stock pipeline (at each guidance scale, and with a negative prompt where the family takes
one), a PPO ratio of exactly 1 before the first step for every rollout shape, DiffusionNFT training that resumes
exactly, a LoRA that the stock ``load_lora_weights`` loads and that reproduces the trained model, a full fine-tune
the stock class loads, ``flowrl memory``'s counts equal to the loaded model's, and ``flowrl sample`` writing images
or mp4s and ``flowrl generate`` a benchmark folder (edit records' source images and FLUX.2's reference images kept),
and ``flowrl eval --reward`` handing rewards those source images; every method of 2026 and every direct-reward method
trained two iterations, or refused in one line (CI). One parametrization id per family, its adapter's
class name (a second entry of one adapter, with other prompt records, adds a suffix: ``Flux2Model-references``):
``pytest tests/test_conformance.py -q -k WanModel``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import REPO, assert_resume_is_exact, shape_overrides, tiny_overrides
from families import FAMILIES, TinyFamily, prompt_files

from flowrl.config import ConfigError, load_config
from flowrl.data import read_jsonl
from flowrl.methods import METHODS
from flowrl.models import PromptEmbeds, load_model, model_class
from flowrl.trainer import Trainer

IDS = list(FAMILIES)
CORE = ("SD3Model", "SD15Model", "FluxKontextModel", "WanModel")
"""The families whose training and command checks (ratio, resume, LoRA, memory counts, full fine-tune, ``flowrl
generate``, ``flowrl eval``) run in the default test command: the shipped model's, the DDPM one, an edit one and a
video one (``flowrl sample`` too); ODE sampling against the stock pipeline runs for every family. Every family runs
every check with CI=true (as .ci/run does): ``CI=true pytest tests/test_conformance.py -q -k <AdapterName>``."""


@pytest.fixture(scope="module")
def family(request, tmp_path_factory) -> tuple[TinyFamily, Path, tuple[Path, Path]]:
    """The family ``request.param``: its spec, a tiny random pipeline folder and its train / test prompt files."""
    spec = FAMILIES[request.param]
    root = tmp_path_factory.mktemp(spec.id)
    return spec, spec.build(root / "pipeline"), prompt_files(spec.prompts, root / "prompts")


def _params(video_slow: bool = False, core_only: bool = False):
    """Every family's id; marked slow (run with CI=true) where the check is a video family's longer one (`video_slow`)
    or, for a family outside :data:`CORE`, one the default command runs on the core families only (`core_only`)."""
    slow = lambda i: (video_slow and FAMILIES[i].video) or (core_only and i not in CORE)  # noqa: E731
    return [pytest.param(i, marks=pytest.mark.slow, id=i) if slow(i) else pytest.param(i, id=i) for i in IDS]


def config_path(preset: str) -> Path:
    """The preset's file in configs/."""
    return REPO / "configs" / f"{preset}.yaml"


def _config(spec: TinyFamily, folder: Path, prompts, preset: str, out: Path, **extra) -> tuple[Path, list[str]]:
    """The preset's config file and the overrides that shrink it onto the family's tiny pipeline."""
    cfg = load_config(REPO / "configs" / f"{preset}.yaml")
    train, test = prompts
    settings = {**spec.run_settings, **shape_overrides(cfg), **extra}
    return REPO / "configs" / f"{preset}.yaml", tiny_overrides(folder, train, test, out, **settings)


@pytest.mark.parametrize("family", _params(), indirect=True)
def test_ode_sampling_equals_the_stock_pipeline(family):
    from flowrl.evaluation import generate

    spec, folder, (train, _) = family
    assert model_class(folder).__name__ == spec.adapter
    metas = read_jsonl(train)[:2]
    model = load_model(folder, **spec.load)
    images = []
    for guidance in spec.guidance:
        ours = generate(model, [m["prompt"] for m in metas], [0, 1], 3, guidance, metas=metas)
        stock = spec.stock_images(folder, model, metas, 3, guidance)
        assert ours.shape == stock.shape and ours.shape[0] == 2
        torch.testing.assert_close(ours, stock, rtol=0, atol=1e-4)
        images.append(ours)
    if len(images) > 1:
        assert (images[0] - images[1]).abs().max() > 1e-3  # the guidance scale matters
    if spec.negative_prompt:  # as the stock pipeline's negative_prompt
        model.negative_prompt = "blurry static"
        ours = generate(model, [m["prompt"] for m in metas], [0, 1], 3, spec.guidance[0], metas=metas)
        stock = spec.stock_images(folder, model, metas, 3, spec.guidance[0], negative_prompt=model.negative_prompt)
        torch.testing.assert_close(ours, stock, rtol=0, atol=1e-4)
        assert (ours - images[0]).abs().max() > 1e-3  # the negative prompt matters


SHAPES = ["flow_grpo", "mix_grpo_flash", "branch_grpo_mix", "tempflow_grpo"]
"""Presets of every rollout shape: SDE steps, a window with an ODE tail, a tree, single-step probes."""


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("family", _params(video_slow=True, core_only=True), indirect=True)
def test_the_ratio_is_exactly_one_before_the_first_step(family, shape, tmp_path):
    spec, folder, prompts = family
    config, over = _config(spec, folder, prompts, shape, tmp_path / "run")
    if shape in spec.refuses:
        with pytest.raises(ConfigError, match=r"^config key '[a-z_.]+': .*\(DDPM\)"):
            Trainer(load_config(config, over))
        return
    trainer = Trainer(load_config(config, over))
    method, gen = trainer.method, lambda i: torch.Generator().manual_seed(i)
    metas = trainer.sample_prompts(0)
    samples = method.rollout(metas, gen(1))
    scores = trainer.score(samples.images, samples.image_prompt, metas)
    adv, keep, _ = method.advantages(samples, trainer.gather_rewards(scores, samples.image_prompt, len(metas)), gen(2))
    before = {n: p.detach().clone() for n, p in trainer.policy.params.items()}
    stats = method.update(samples, adv, keep, gen(3))
    assert stats["cost/trained_transitions"] > 0 and stats["policy/optimizer_steps"] > 0
    assert stats["policy/ratio_first_max_dev"] == 0.0
    assert any(not torch.equal(p.detach(), before[n]) for n, p in trainer.policy.params.items())


def _method_presets() -> dict[str, str]:
    """Every registered method (:data:`flowrl.methods.METHODS`) but those of the families' own runs (GRPO, DiffusionNFT:
    :attr:`TinyFamily.trains`) -> its preset in configs/: the one of its name, else the only one naming it."""
    named: dict[str, list[str]] = {}
    for path in sorted((REPO / "configs").glob("*.yaml")):
        named.setdefault(load_config(path).train.method, []).append(path.stem)
    own = {load_config(REPO / "configs" / f"{spec.trains}.yaml").train.method for spec in FAMILIES.values()}
    presets = {}
    for method in sorted(set(METHODS) - own):
        choices = named.get(method, [])
        assert method in choices or len(choices) == 1, f"method {method!r}: presets {choices}; name one after it"
        presets[method] = method if method in choices else choices[0]
    return presets


METHOD_PRESETS = _method_presets()
"""Each method the suite trains on every family, by its preset (derived from the registry: a new method with its
preset joins the suite)."""
FORWARD = {name for name, method in METHODS.items() if "forward_process" in method.requires}
"""The methods that train the flow-matching loss on clean samples (:attr:`Method.requires`): the DDPM families refuse
them."""
OFFLINE = {name for name, method in METHODS.items() if not method.online}
"""The methods trained on a data set (no rollouts): the families whose latents are the VAE's and whose prompts are text
alone (:attr:`TinyFamily.offline`) train them, the others refuse them."""
DIRECT = {name for name, method in METHODS.items() if method.differentiable_reward}
"""The direct-reward methods: trained on the tiny CLIP score's gradient through the decoder (``frames`` of it for
videos)."""


def _refusal(spec: TinyFamily, method: str) -> str | None:
    """The one-line refusal the family gives the method (a regular expression), or None where it trains."""
    if spec.trains == "flow_grpo" and method in FORWARD:  # the DDPM families
        return r"^config key 'train\.method': .* needs a flow-matching model"
    if method in OFFLINE and not spec.offline:
        return rf"^train\.method '{method}'.*({spec.adapter} edits source images|{spec.adapter} family's latents are its own)"
    return None


@pytest.mark.slow
@pytest.mark.parametrize("preset", sorted(METHOD_PRESETS.values()))
@pytest.mark.parametrize("family", _params(), indirect=True)
def test_each_method_trains_two_iterations_or_refuses_in_one_line(family, preset, tmp_path, request):
    """Every method of 2026 and every direct-reward method through its preset shrunk onto the family (two iterations
    of rollout, rewards and update; the offline ones on the shipped preference data set; the direct ones on the tiny
    CLIP score, ``frames`` of it for a video family): the optimizer steps, the policy moves, the loss is finite, and
    what each method promises before its first step holds (the ratio 1, DGPO's objective log 2, CRD's implicit reward
    0); Flow-OPD distils the family's own trained run (:func:`nft_run`, its teacher for every prompt); or the family
    refuses the method in one line (the DDPM families the forward-process methods, the families
    without VAE-scaled latents or with source images the offline data sets)."""
    import math

    spec, folder, prompts = family
    method = load_config(REPO / "configs" / f"{preset}.yaml").train.method
    clip = str(REPO / "assets" / "tiny-clip")
    extra = {"train.offline.batch_size": 4, "train.gardo.auxiliary": "[]", "rewards.clipscore": "null"}
    extra["rewards.geneval_strict"] = "null"  # tdm_r1's verdict: the family's training reward instead
    if spec.video:  # the image rewards of GARDO's preset
        extra["rewards.jpeg_compressibility"] = "null"
    if method in DIRECT:  # a differentiable reward alone
        extra = {"rewards.jpeg_compressibility": "null", "rewards.clipscore.options.model_path": clip}
        if spec.video:
            extra = {"rewards.clipscore": "null", "rewards.families:brightness": "null", "rewards.frames.weight": 1.0}
            extra.update({"rewards.frames.options.reward": "clipscore", "rewards.frames.options.num_frames": 2})
            extra["rewards.frames.options.reward_options.model_path"] = clip
    if method == "opd":  # the preset's teachers are LoRAs of the shipped model: the family's own run instead
        _, run = request.getfixturevalue("nft_run")
        extra.update(
            {f"train.opd.teachers.{name}": "null" for name in load_config(config_path(preset)).train.opd.teachers}
        )
        extra["train.opd.teachers.run.lora"] = str(run)
    config, over = _config(spec, folder, prompts, preset, tmp_path / "run", **extra)
    refusal = _refusal(spec, method)
    if refusal:
        with pytest.raises((ConfigError, ValueError), match=refusal) as error:
            Trainer(load_config(config, over))
        assert "\n" not in str(error.value)
        return
    trainer = Trainer(load_config(config, over))
    before = {n: p.detach().clone() for n, p in trainer.policy.params.items()}
    rows = [trainer.step(it) for it in range(2)]
    assert all(r["policy/optimizer_steps"] > 0 and math.isfinite(r["policy/loss"]) for r in rows)
    assert any(not torch.equal(p.detach(), before[n]) for n, p in trainer.policy.params.items())
    first = rows[0]
    if method in ("awm", "flow_dppo", "gardo"):
        assert first["policy/ratio_first_max_dev"] == 0.0
    if method == "dgpo":
        assert first["policy/dgpo_objective"] == pytest.approx(math.log(2), abs=1e-6)
    if method == "crd":
        assert first["policy/implicit_reward_first_max"] == 0.0
    if method == "dpo":
        assert first["dpo/pairs"] >= 1


@pytest.fixture(scope="module")
def nft_run(family, tmp_path_factory) -> tuple[Trainer, Path]:
    """The family's training preset (:attr:`TinyFamily.trains`: DiffusionNFT where the family takes it) trained 2
    iterations straight and 1 + a resumed one (equal: checked); the straight run's trainer and folder."""
    spec, folder, prompts = family
    out = tmp_path_factory.mktemp(f"{spec.id}-{spec.trains}")
    config = REPO / "configs" / f"{spec.trains}.yaml"
    trainer = assert_resume_is_exact(config, lambda run: _config(spec, folder, prompts, spec.trains, run)[1], out)
    return trainer, out / "full"


@pytest.mark.parametrize("family", _params(core_only=True), indirect=True)
def test_training_resumes_exactly_and_its_lora_loads_in_stock_diffusers(family, nft_run):
    spec, folder, (train, _) = family
    trainer, run = nft_run
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["iteration"] for m in metrics] == [1, 2] and all(m["policy/optimizer_steps"] > 0 for m in metrics)
    model = trainer.model
    metas = read_jsonl(train)[:2]
    table = model.prompt_table(metas)
    cond, uncond = table[PromptEmbeds.rows(torch.arange(2))], table[torch.zeros(2, dtype=torch.long)]
    x = torch.randn(2, *model.latent_shape, generator=torch.Generator().manual_seed(0))
    t, guidance = torch.tensor([0.7, 0.4]), spec.guidance[0]
    stock = load_model(folder, **spec.load)
    import diffusers

    pipe = getattr(diffusers, stock.PIPELINE).from_pretrained(folder, **spec.stock_kwargs)
    stock.pipe, stock.transformer = pipe, getattr(pipe, stock.network_name())  # the stock network under the adapter
    with torch.no_grad():
        base = stock.velocity(x, t, cond, uncond, guidance)
        if hasattr(pipe, "load_lora_weights"):
            pipe.load_lora_weights(str(run / "lora"))
        else:  # a pipeline without a LoRA loader mixin (HunyuanVideo 1.5 in diffusers 0.42): its network's own loader
            stock.transformer.load_lora_adapter(str(run / "lora"), prefix="transformer", use_safetensors=True)
        loaded = stock.velocity(x, t, cond, uncond, guidance)
        ours = model.velocity(x, t, cond, uncond, guidance)
    assert (base - ours).abs().max() > 1e-5  # the LoRA trained
    torch.testing.assert_close(loaded, ours, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", _params(core_only=True), indirect=True)
def test_memory_counts_equal_the_loaded_model(family, nft_run):
    from flowrl.plan import component_elements, trained_counts

    spec, folder, _ = family
    trainer, _ = nft_run
    model, cfg = trainer.model, trainer.cfg
    adapter = type(model)
    network = adapter.network_name(cfg.model.expert)
    total, trained, _ = trained_counts(
        folder, network, cfg.model.lora_rank, cfg.model.lora_alpha, adapter.LORA_TARGETS
    )
    params = dict(getattr(model.pipe, network).named_parameters())
    assert trained == sum(p.numel() for p in trainer.policy.params.values()) > 0
    assert total == sum(p.numel() for n, p in params.items() if "lora_" not in n)
    for name, count in component_elements(folder).items():
        component = getattr(model.pipe, name)
        stored = {v.data_ptr(): v.numel() for n, v in component.state_dict().items() if "lora_" not in n}
        own = sum(stored.values())  # weights and persistent buffers, tied weights once (as safetensors saves them)
        assert count == own, name


@pytest.mark.parametrize("family", _params(video_slow=True, core_only=True), indirect=True)
def test_full_finetuning_writes_a_pipeline_the_stock_class_loads(family, tmp_path):
    import diffusers

    spec, folder, prompts = family
    config, over = _config(
        spec,
        folder,
        prompts,
        "flow_grpo",
        tmp_path / "run",
        **{"model.lora_rank": 0, "run.iterations": 1, "run.keep_checkpoints": 1},
    )
    trainer = Trainer(load_config(config, over))
    trainer.train()
    pipe = getattr(diffusers, trainer.model.PIPELINE).from_pretrained(
        tmp_path / "run" / "pipeline", **spec.stock_kwargs
    )
    saved = getattr(pipe, trainer.model.network_name(trainer.cfg.model.expert)).state_dict()
    for n, p in trainer.policy.params.items():
        torch.testing.assert_close(saved[n].float(), p.detach().float(), rtol=0, atol=0)


@pytest.mark.parametrize("family", _params(core_only=True), indirect=True)
def test_flowrl_sample_writes_images_or_an_mp4(family, tmp_path, capsys):
    from flowrl.cli import main

    spec, folder, _ = family
    args = ["sample", "--model", str(folder), "--prompt", "a photo of a star", "-n", "2", "--num-steps", "2"]
    args += ["--resolution", str(spec.load["resolution"]), "--guidance-scale", str(spec.guidance[0])]
    if "max_sequence_length" in spec.load:
        args += ["--max-sequence-length", str(spec.load["max_sequence_length"])]
    if spec.video:
        args += ["--num-frames", str(spec.load["num_frames"])]
    main([*args, "--device", "cpu", "--out", str(tmp_path / "grid.png")])
    said = capsys.readouterr().out
    assert (tmp_path / "grid.png").stat().st_size > 0
    if spec.video:
        assert "wrote 2 videos" in said and (tmp_path / "grid.mp4").stat().st_size > 0
    else:
        assert "wrote 2 images" in said


@pytest.mark.parametrize("family", _params(core_only=True), indirect=True)
def test_flowrl_generate_writes_a_benchmark_folder(family, tmp_path, capsys):
    from flowrl.cli import main
    from flowrl.data import write_jsonl

    spec, folder, (_, test) = family
    records = read_jsonl(test)[:2]  # an edit record's source image: an absolute path, kept as it is
    write_jsonl(records, tmp_path / "prompts.jsonl")
    args = ["generate", "--model", str(folder), "--prompts", str(tmp_path / "prompts.jsonl"), "--layout", "flat"]
    args += ["-n", "1", "--num-steps", "2", "--resolution", str(spec.load["resolution"])]
    args += ["--guidance-scale", str(spec.guidance[0]), "--device", "cpu", "--out", str(tmp_path / "out")]
    if "max_sequence_length" in spec.load:
        args += ["--max-sequence-length", str(spec.load["max_sequence_length"])]
    if spec.video:
        args += ["--num-frames", str(spec.load["num_frames"])]
    main(args)
    said = capsys.readouterr().out
    assert f"wrote 2 {'videos' if spec.video else 'images'}" in said
    written = read_jsonl(tmp_path / "out" / "prompts.jsonl")
    assert [r["prompt"] for r in written] == [r["prompt"] for r in records]
    for key in ("image", "images"):  # the edit sources and FLUX.2's references travel along
        assert [r.get(key) for r in written] == [r.get(key) for r in records]
    for r in written:
        assert (tmp_path / "out" / r["file"]).stat().st_size > 0
        if spec.video:
            assert (tmp_path / "out" / r["file"]).with_suffix(".mp4").stat().st_size > 0


@pytest.mark.parametrize(
    "family", [p for p in _params(core_only=True) if FAMILIES[p.values[0]].prompts in ("edit", "i2v")], indirect=True
)
def test_flowrl_eval_gives_rewards_the_source_images(family, tmp_path):
    from flowrl.cli import main
    from flowrl.image_folders import load_image

    spec, folder, (_, test) = family
    records = read_jsonl(test)[:2]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    args = ["eval", "--model", str(folder), "--prompts", str(tmp_path / "prompts.jsonl"), "--num-steps", "2"]
    args += ["--reward", "families:source_brightness", "--images-per-prompt", "1", "--device", "cpu"]
    args += ["--resolution", str(spec.load["resolution"]), "--out", str(tmp_path / "eval.json")]
    if "max_sequence_length" in spec.load:
        args += ["--max-sequence-length", str(spec.load["max_sequence_length"])]
    main(args)
    mean = json.loads((tmp_path / "eval.json").read_text())["rewards"]["families:source_brightness"]["mean"]
    expected = torch.stack([load_image(r["image"]).mean() for r in records]).mean().item()
    assert mean == pytest.approx(expected, abs=1e-6)
