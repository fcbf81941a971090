"""The FLUX.1 adapter (`flowrl.models.FluxModel`) on random tiny FluxPipelines: it samples as the stock pipeline does,
with distilled guidance and with classifier-free guidance, and trains through the same trainer to a LoRA that the
stock pipeline loads."""

import json
import math

import pytest
import torch
from conftest import RECIPE_SIZES, REPO, read_metrics, shape_overrides, shrink_recipe, tiny_overrides, tiny_pipeline
from tiny_pipelines.common import noise
from tiny_pipelines.flux import build_random_flux_pipeline, stock_flux

from flowrl.config import ConfigError, load_config
from flowrl.models import FluxModel, SD3Model, load_model, model_class
from flowrl.trainer import Trainer

PROMPTS = ["a photo of a red star", "a photo of two circles"]


# A FLUX pipeline whose transformer is not guidance-distilled (as FLUX.1-schnell).
schnell_like = tiny_pipeline("schnell_like", build_random_flux_pipeline, guidance_embeds=False)


def test_adapter_is_picked_from_model_index(random_flux_pipeline, random_pipeline, tmp_path):
    assert model_class(random_flux_pipeline) is FluxModel and model_class(random_pipeline) is SD3Model
    with pytest.raises(ValueError, match="not StableDiffusion3Pipeline: load it with flowrl.models.load_model"):
        SD3Model(random_flux_pipeline)
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "KandinskyV22Pipeline"}))
    with pytest.raises(ValueError, match="model_index.json names pipeline 'KandinskyV22Pipeline'"):
        model_class(tmp_path)


def test_shift_is_the_dynamic_shift_at_the_resolution(random_flux_pipeline):
    # FLUX.1's scheduler: mu = 1.15 at 4096 image tokens (1024 px with VAE factor 8), 0.5 at 256; factor 4 here
    assert FluxModel.scheduler_shift(random_flux_pipeline, 512) == pytest.approx(math.exp(1.15))
    assert FluxModel.scheduler_shift(random_flux_pipeline, 128) == pytest.approx(math.exp(0.5))
    assert FluxModel.scheduler_shift(random_flux_pipeline) == pytest.approx(math.exp(1.15))  # default: 128 latents
    model = load_model(random_flux_pipeline, max_sequence_length=8, resolution=32)
    assert model.shift == FluxModel.scheduler_shift(random_flux_pipeline, 32)
    with pytest.raises(ValueError, match="resolution 36 px .* multiple of 8"):
        FluxModel.check_resolution(random_flux_pipeline, 36)
    with pytest.raises(ValueError, match="max_sequence_length must be >= 1 for FLUX"):
        load_model(random_flux_pipeline, max_sequence_length=0, resolution=32)


def test_classifier_free_guidance_samples_as_the_stock_true_cfg(schnell_like):
    from flowrl.evaluation import generate

    model = load_model(schnell_like, max_sequence_length=8, resolution=32)
    assert model.cfg_rows(4.5) == 2 and model.cfg_rows(1.0) == 1
    ours = generate(model, PROMPTS, [0, 1], num_steps=3, guidance_scale=4.5)
    stock = stock_flux(schnell_like, model, [{"prompt": p} for p in PROMPTS], noise(model, 2), 3, 4.5)  # true CFG
    torch.testing.assert_close(ours, stock, rtol=0, atol=1e-4)


def test_dance_grpo_flux_recipe_trains_and_the_lora_loads_in_stock_diffusers(
    tmp_path, random_flux_pipeline, prompt_files
):
    """configs/recipes/flux_dance_grpo.yaml, shrunk onto the tiny random FLUX pipeline (the reward swapped for one that needs
    no download)."""
    from diffusers import FluxPipeline

    settings = {"model.resolution": 32, "model.max_sequence_length": 8, "model.lora_rank": 2, "rewards.hpsv2": "null"}
    settings.update({"rewards.jpeg_compressibility.weight": 1.0, **RECIPE_SIZES})
    cfg = shrink_recipe("flux_dance_grpo", random_flux_pipeline, prompt_files, tmp_path / "run", **settings)
    assert cfg.sampling.kernel == "dance_sde" and cfg.sampling.guidance_scale == 3.5 and cfg.sampling.shift == 3.0
    trainer = Trainer(cfg)
    assert isinstance(trainer.model, FluxModel)
    trainer.train()
    metrics = read_metrics(tmp_path / "run")
    assert all(m["policy/ratio_first_max_dev"] == 0.0 and m["policy/optimizer_steps"] > 0 for m in metrics)
    # one transformer row per velocity (distilled guidance): the 2 groups' shared noise once, then 8 images x 2 steps
    assert metrics[0]["cost/nfe"] == 2 + 8 * 2
    model = trainer.model
    x = torch.randn(2, *model.latent_shape, generator=torch.Generator().manual_seed(0))
    t, emb = torch.tensor([0.5, 0.5]), model.encode(PROMPTS)
    pipe = FluxPipeline.from_pretrained(random_flux_pipeline)
    stock = load_model(random_flux_pipeline, max_sequence_length=8, resolution=32)
    stock.pipe, stock.transformer = pipe, pipe.transformer  # the adapter's packing around the stock transformer
    with torch.no_grad():
        base = stock.velocity(x, t, emb, None, 3.5)
        pipe.load_lora_weights(str(tmp_path / "run" / "lora"))
        loaded = stock.velocity(x, t, emb, None, 3.5)
        ours = model.velocity(x, t, emb, None, 3.5)
    assert not torch.allclose(base, ours)
    torch.testing.assert_close(loaded, ours, rtol=1e-4, atol=1e-5)


def test_flux_config_errors_name_the_key(tmp_path, random_flux_pipeline, prompt_files):
    train, test = prompt_files
    over = tiny_overrides(random_flux_pipeline, train, test, tmp_path / "run", **{"model.resolution": 36})
    with pytest.raises(ConfigError, match="'model.resolution'.*multiple of 8"):
        Trainer(load_config(None, over))
    over = tiny_overrides(
        random_flux_pipeline, train, test, tmp_path / "run", **{"model.resolution": 32, "model.max_sequence_length": 0}
    )
    with pytest.raises(ConfigError, match="'model.max_sequence_length'.*>= 1 for FLUX"):
        Trainer(load_config(None, over))


@pytest.mark.parametrize(
    "preset",
    [
        "diffusion_nft_off_policy",
        "dpo_offline",  # every method of 2026 on every family: tests/test_conformance.py
    ],
)
def test_rollout_shapes_and_nft_run_on_flux(preset, tmp_path, random_flux_pipeline, prompt_files):
    """Off-policy DiffusionNFT and the methods of 2026 (the offline ones on the shipped data set, encoded by FLUX's VAE)
    on FLUX (every rollout shape: tests/test_conformance.py)."""
    cfg = load_config(REPO / "configs" / f"{preset}.yaml")
    extra = {
        "run.mixed_precision": "no",
        "model.resolution": 32,
        "model.max_sequence_length": 8,
        "sampling.guidance_scale": 3.5,
        "rewards.jpeg_compressibility.weight": 1.0,
        "train.offline.batch_size": 4,  # dpo_offline, sft: the shipped data set, encoded by FLUX's VAE
        **shape_overrides(cfg),
    }
    train, test = prompt_files
    over = tiny_overrides(random_flux_pipeline, train, test, tmp_path / "run", **extra)
    result = Trainer(load_config(REPO / "configs" / f"{preset}.yaml", over)).train()
    assert result["after"]["n_images"] > 0
    metrics = read_metrics(tmp_path / "run")
    assert all(m["cost/trained_transitions"] > 0 and m["policy/optimizer_steps"] > 0 for m in metrics)
    if cfg.train.method == "grpo":
        assert all(m["policy/ratio_first_max_dev"] == 0.0 for m in metrics)


def test_velocity_takes_any_memory_layout(random_flux_pipeline):
    model = load_model(random_flux_pipeline, max_sequence_length=8, resolution=32)
    emb = model.encode(PROMPTS)
    x = torch.randn(2, *model.latent_shape, generator=torch.Generator().manual_seed(0))
    t = torch.tensor([0.9, 0.4])
    with torch.no_grad():
        dense = model.velocity(x, t, emb, None, 3.5)
        strided = model.velocity(x.contiguous(memory_format=torch.channels_last), t, emb, None, 3.5)
    assert dense.shape == (2, *model.latent_shape)
    torch.testing.assert_close(strided, dense)


def test_cli_names_a_t5_length_flux_cannot_take(tmp_path, random_flux_pipeline, capsys):
    from flowrl.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(
            [
                "sample",
                "--model",
                str(random_flux_pipeline),
                "--prompt",
                "x",
                "--max-sequence-length",
                "0",
                "--resolution",
                "32",
                "--device",
                "cpu",
                "--out",
                str(tmp_path / "g.png"),
            ]
        )
    assert exit_.value.code == 2
    assert "--max-sequence-length: max_sequence_length must be >= 1 for FLUX" in capsys.readouterr().err
