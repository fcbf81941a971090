"""The Stable Diffusion 1.x adapter (`flowrl.models.SD15Model`) on tiny random StableDiffusionPipelines: a UNet seen as
a flow model (samplers/ddim.py) samples as the stock DDIM pipeline does, trains through the same trainer with the
PPO ratio exactly 1 before the first step, and saves a LoRA the stock pipeline loads."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import REPO, no_download, read_metrics, shrink_recipe, tiny_overrides, tiny_pipeline, train_shrunk_recipe
from tiny_pipelines.common import noise
from tiny_pipelines.sd15 import build_random_sd15_pipeline, stock_sd15

from flowrl.config import ConfigError, load_config
from flowrl.models import SD15Model, load_model, model_class
from flowrl.trainer import Trainer

PROMPTS = ["a photo of a red star", "a photo of two circles"]


sd15 = tiny_pipeline("sd15", build_random_sd15_pipeline)
sd15_v = tiny_pipeline("sd15_v", build_random_sd15_pipeline, prediction_type="v_prediction")


def _stock_images(folder: Path, model: SD15Model, num_steps: int, guidance_scale: float, lora=None) -> torch.Tensor:
    """The stock StableDiffusionPipeline's images of :data:`PROMPTS` (its DDIM, eta 0) from the noise of
    `flowrl.evaluation.generate` (seeds 0, 1)."""
    metas = [{"prompt": p} for p in PROMPTS]
    return stock_sd15(folder, model, metas, noise(model, 2), num_steps, guidance_scale, lora)


@pytest.mark.parametrize("folder", ["sd15_v"])  # epsilon prediction: tests/test_conformance.py
@pytest.mark.parametrize("num_steps,guidance_scale", [(4, 4.5), (7, 1.0)])
def test_deterministic_sampling_equals_the_stock_pipeline(folder, num_steps, guidance_scale, request):
    from flowrl.evaluation import generate

    path = request.getfixturevalue(folder)
    model = load_model(path)
    assert isinstance(model, SD15Model) and model.transformer is model.pipe.unet and model.resolution == 32
    ours = generate(model, PROMPTS, [0, 1], num_steps=num_steps, guidance_scale=guidance_scale)
    stock = _stock_images(path, model, num_steps, guidance_scale)
    assert ours.shape == stock.shape == (2, 3, 32, 32)
    torch.testing.assert_close(ours, stock, rtol=0, atol=1e-4)


def test_the_grid_is_the_stock_ddim_grid(sd15):
    from diffusers import DDIMScheduler

    from flowrl.samplers import flow_sigma

    model = load_model(sd15)
    scheduler = DDIMScheduler.from_pretrained(sd15, subfolder="scheduler")
    scheduler.set_timesteps(4)
    assert scheduler.timesteps.tolist() == [751, 501, 251, 1]  # leading spacing, steps_offset 1
    sigmas = model.sigmas(4)
    expected = flow_sigma(torch.cat([scheduler.alphas_cumprod[scheduler.timesteps], scheduler.alphas_cumprod[:1]]))
    torch.testing.assert_close(sigmas, expected, rtol=0, atol=1e-7)
    assert model.timesteps(sigmas[:-1]).tolist() == [751.0, 501.0, 251.0, 1.0]  # exact on the grid
    assert 251 < float(model.timesteps(sigmas[2:3] * 1.01)) < 501
    with pytest.raises(ValueError, match="no shift"):
        model.sigmas(4, shift=3.0)


def test_ddpo_style_training_keeps_the_ratio_exactly_one_and_the_lora_loads_in_stock(tmp_path, sd15, prompt_files):
    """configs/flow_grpo.yaml on the tiny SD 1.5 pipeline with DDPO's kernel (DDIM, eta 1), 2 iterations."""
    ddpo = {"sampling.kernel": "ddim", "sampling.noise_level": 1.0, "sampling.train_last_step": True}
    over = tiny_overrides(sd15, *prompt_files, tmp_path / "run", **ddpo, **no_download("geneval"))
    cfg = load_config(REPO / "configs" / "flow_grpo.yaml", over)
    trainer = Trainer(cfg)
    assert isinstance(trainer.model, SD15Model) and trainer.cfg.sampling.shift == 1.0
    train_shrunk_recipe(trainer)
    # the saved LoRA, loaded by the stock pipeline, samples what the trained adapter samples
    from flowrl.evaluation import generate

    ours = generate(trainer.model, PROMPTS, [0, 1], num_steps=3, guidance_scale=4.5)
    stock = _stock_images(sd15, trainer.model, 3, 4.5, lora=tmp_path / "run" / "lora")
    base = _stock_images(sd15, trainer.model, 3, 4.5)
    assert (stock - base).abs().max() > 1e-4  # the LoRA changed the model
    torch.testing.assert_close(ours, stock, rtol=0, atol=1e-4)


def test_other_rollout_shapes_run_on_sd15(tmp_path, sd15, prompt_files):
    """A MixGRPO window (Flow-GRPO SDE inside, DDIM = Euler outside) runs unchanged on the mapped UNet."""
    window = {"run.iterations": 1, "sampling.num_steps": 4, "sampling.window.size": 2}
    over = tiny_overrides(sd15, *prompt_files, tmp_path / "run", **window, **no_download("geneval"))
    Trainer(load_config(REPO / "configs" / "mix_grpo.yaml", over)).train()
    metrics = read_metrics(tmp_path / "run")
    assert metrics[0]["policy/ratio_first_max_dev"] == 0.0 and metrics[0]["cost/trained_transitions"] > 0


def test_unsupported_settings_are_one_clear_config_error(tmp_path, sd15, prompt_files):
    assert model_class(sd15) is SD15Model
    train, test = prompt_files
    cases = {
        "configs/diffusion_nft.yaml": ({}, "config key 'train.method': 'nft' (DiffusionNFT) needs a flow-matching"),
        "configs/awm.yaml": ({}, "config key 'train.method': 'awm' (AWM) needs a flow-matching"),
        "configs/crd.yaml": ({}, "config key 'train.method': 'crd' (CRD) needs a flow-matching"),
        "configs/sft.yaml": ({}, "config key 'train.method': 'sft' (SFT) needs a flow-matching"),
        "configs/mix_grpo_flash.yaml": ({"sampling.num_steps": 5}, "config key 'sampling.window.flash_ratio'"),
        "configs/flow_grpo.yaml": ({"sampling.shift": 3.0}, "config key 'sampling.shift'"),
    }
    for preset, (extra, message) in cases.items():
        over = tiny_overrides(sd15, train, test, tmp_path / "run", **extra)
        with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")) as error:
            Trainer(load_config(REPO / preset, over))
        assert "\n" not in str(error.value)
    clipping = tmp_path / "clipping"
    shutil.copytree(sd15, clipping, dirs_exist_ok=True)
    config = json.loads((clipping / "scheduler" / "scheduler_config.json").read_text())
    (clipping / "scheduler" / "scheduler_config.json").write_text(json.dumps({**config, "clip_sample": True}))
    with pytest.raises(ConfigError, match="'model.path': .*sets clip_sample: true; flowrl's DDIM kernels do not clip"):
        Trainer(load_config(None, tiny_overrides(clipping, train, test, tmp_path / "run2")))


def test_the_ddpo_recipe_shrunk_onto_a_tiny_pipeline_trains(tmp_path, sd15, prompt_files):
    """configs/recipes/sd15_ddpo.yaml (DDPO's settings) with only its sizes and paths shrunk: DDIM at eta 1, every step
    trained, group statistics, two iterations with the ratio exactly 1 before each first step."""
    native = {"model.dtype": "float32", "model.resolution": "null", "train.micro_batch_size": "null"}  # 32 px
    native["sampling.batch_size"] = 8
    cfg = shrink_recipe("sd15_ddpo", sd15, prompt_files, tmp_path / "run", **native)
    assert (cfg.sampling.kernel, cfg.sampling.noise_level, cfg.sampling.train_last_step) == ("ddim", 1.0, True)
    trainer = Trainer(cfg)
    trainer.train()
    metrics = read_metrics(tmp_path / "run")
    assert len(metrics) == 2 and all(m["policy/ratio_first_max_dev"] == 0.0 for m in metrics)
    assert all(m["cost/trained_transitions"] == 2 * 2 * 3 for m in metrics)  # 2 prompts x 2 images x all 3 steps


def test_the_random_pipeline_is_seeded(tmp_path, sd15):
    """`flowrl.tiny.sd15.build_random_sd15_pipeline`: the same seed gives the same weights, another seed others."""
    from safetensors.torch import load_file

    unet = "unet/diffusion_pytorch_model.safetensors"
    again, other = (load_file(build_random_sd15_pipeline(tmp_path / str(s), seed=s) / unet) for s in (0, 1))
    reference = load_file(sd15 / unet)
    assert all(torch.equal(reference[k], again[k]) for k in reference)
    assert not all(torch.equal(reference[k], other[k]) for k in reference)
    with pytest.raises(ValueError, match="sample_size must be a positive even number"):
        build_random_sd15_pipeline(tmp_path / "odd", sample_size=7)


@pytest.mark.parametrize("preset", ["flow_dppo", pytest.param("gardo", marks=pytest.mark.slow)])
def test_grpo_variants_of_2026_run_on_sd15(preset, tmp_path, sd15, prompt_files):
    """Flow-DPPO and GARDO are the GRPO update on stored transitions: they run on the mapped UNet (the forward-process
    methods are refused above); the ratio is exactly 1 before the first optimizer step."""
    train, test = prompt_files
    extra = {"run.mixed_precision": "no", "sampling.num_steps": 4, "sampling.group_size": 4}
    extra.update(
        {"rewards.geneval": "null", "rewards.jpeg_compressibility.weight": 1.0, "train.gardo.auxiliary": "[]"}
    )
    extra.update({"rewards.clipscore": "null"})
    over = tiny_overrides(sd15, train, test, tmp_path / "run", **extra)
    Trainer(load_config(REPO / "configs" / f"{preset}.yaml", over)).train()
    metrics = read_metrics(tmp_path / "run")
    assert len(metrics) == 2 and all(m["policy/ratio_first_max_dev"] == 0.0 for m in metrics)


@pytest.mark.parametrize("threads", [1, 2])
def test_the_velocity_is_batch_invariant_on_one_thread_too(sd15, threads):
    """A sample's guided velocity has the same bits alone, in small batches and in a batch of 20, with one torch thread
    as with two: on one thread oneDNN picks other convolution kernels for small batches, so the UNet's convolutions are
    padded further there (flowrl.models.invariance.MIN_ROWS_ONE_THREAD); without it the ratio drifted by 6e-8."""
    model = load_model(sd15)
    table = model.encode(["", *PROMPTS])
    velocity = model.velocity_fn(table, guidance_scale=4.5)
    gen = torch.Generator().manual_seed(0)
    n = 20
    x = torch.randn(n, *model.latent_shape, generator=gen)
    t, cond = torch.rand(n, generator=gen), torch.randint(1, 3, (n,), generator=gen)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.no_grad():
            full = velocity(x, t, cond)
            for rows in ([0], [1, 2], [3, 4, 5, 6, 7], list(range(8, 19))):
                idx = torch.tensor(rows)
                assert torch.equal(velocity(x[idx], t[idx], cond[idx]), full[idx]), rows
    finally:
        torch.set_num_threads(before)
