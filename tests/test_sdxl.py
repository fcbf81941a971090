"""The Stable Diffusion XL adapter (`flowrl.models.SDXLModel`) on tiny random StableDiffusionXLPipelines: two CLIP text
encoders, pooled embeddings and added time ids; sampling equals the stock pipeline with DDIM, training (DDPM's
ancestral kernel, DanceGRPO's recipe) keeps the PPO ratio exactly 1 before the first step and resumes exactly, and the
saved LoRA loads in the stock pipeline."""

import json
from pathlib import Path

import pytest
import torch
from conftest import REPO, no_download, read_metrics, shrink_recipe, tiny_overrides, tiny_pipeline
from safetensors.torch import load_file
from tiny_pipelines.common import noise
from tiny_pipelines.sdxl import build_random_sdxl_pipeline, stock_sdxl

from flowrl.config import ConfigError, load_config
from flowrl.models import SDXLModel, load_model, model_class
from flowrl.trainer import Trainer

PROMPTS = ["a photo of a red star", "a photo of two circles"]


sdxl = tiny_pipeline("sdxl", build_random_sdxl_pipeline)
# v-prediction, and the CFG negative is the empty prompt's embeddings (not zeros).
sdxl_v = tiny_pipeline("sdxl_v", build_random_sdxl_pipeline, prediction_type="v_prediction", force_zeros=False)


def _stock_images(
    folder: Path, model: SDXLModel, num_steps: int, guidance_scale: float, lora=None, **kwargs
) -> torch.Tensor:
    """The stock StableDiffusionXLPipeline's images of :data:`PROMPTS`, with DDIM (eta 0) on its scheduler config,
    from the noise of `flowrl.evaluation.generate` (seeds 0, 1); ``kwargs``: the pipeline's (``guidance_rescale``)."""
    metas = [{"prompt": p} for p in PROMPTS]
    return stock_sdxl(folder, model, metas, noise(model, 2), num_steps, guidance_scale, lora, **kwargs)


@pytest.mark.parametrize(
    "folder,num_steps,guidance_scale,rescale",
    [("sdxl_v", 4, 5.0, 0.0), ("sdxl_v", 3, 5.0, 0.7)],  # epsilon prediction: tests/test_conformance.py
)
def test_deterministic_sampling_equals_the_stock_pipeline(folder, num_steps, guidance_scale, rescale, request):
    from flowrl.evaluation import generate

    path = request.getfixturevalue(folder)
    model = load_model(path)
    assert isinstance(model, SDXLModel) and model.transformer is model.pipe.unet and model.resolution == 32
    model.guidance_rescale = rescale
    ours = generate(model, PROMPTS, [0, 1], num_steps=num_steps, guidance_scale=guidance_scale)
    stock = _stock_images(path, model, num_steps, guidance_scale, guidance_rescale=rescale)
    assert ours.shape == stock.shape == (2, 3, 32, 32)
    torch.testing.assert_close(ours, stock, rtol=0, atol=1e-4)


def test_prompts_and_micro_conditioning_are_the_pipelines(sdxl):
    model = load_model(sdxl, resolution=48)
    assert model_class(sdxl) is SDXLModel and model.latent_shape == (4, 12, 12)
    emb = model.encode(PROMPTS)
    embeds, _, pooled, _ = model.pipe.encode_prompt(PROMPTS, device="cpu", do_classifier_free_guidance=False)
    assert emb.embeds.shape == (2, model.pipe.tokenizer.model_max_length, 64) and emb.pooled.shape == (2, 32)
    torch.testing.assert_close(emb.embeds, embeds, rtol=0, atol=0)
    torch.testing.assert_close(emb.pooled, pooled, rtol=0, atol=0)
    time_ids = model.pipe._get_add_time_ids((48, 48), (0, 0), (48, 48), torch.float32, 32)  # the pipeline's defaults
    assert torch.equal(model.time_ids(3, torch.float32), time_ids.expand(3, 6))
    # the time ids reach the UNet: another resolution's ids change the prediction
    x, t = torch.randn(1, *model.latent_shape, generator=torch.Generator().manual_seed(0)), torch.tensor([0.5])
    with torch.no_grad():
        at_48 = model.velocity(x, t, emb[torch.tensor([0])], None, 1.0)
        model.resolution = 64
        assert not torch.allclose(model.velocity(x, t, emb[torch.tensor([0])], None, 1.0), at_48)


def test_ddpm_training_keeps_the_ratio_one_resumes_exactly_and_the_lora_loads_in_stock(tmp_path, sdxl, prompt_files):
    """configs/flow_grpo.yaml on the tiny SDXL pipeline with DDPM's ancestral kernel, every step trained, 2 iterations;
    then 1 iteration + a resume ends on the same weights; the saved LoRA, loaded by the stock pipeline, samples what
    the trained adapter samples."""
    from flowrl.evaluation import generate

    train, test = prompt_files
    extra = {
        "run.mixed_precision": "no",
        "sampling.kernel": "ddpm",
        "sampling.noise_level": 1.0,
        "sampling.train_last_step": True,
        "rewards.geneval": "null",
        "rewards.jpeg_compressibility.weight": 1.0,
    }
    full = tiny_overrides(sdxl, train, test, tmp_path / "full", **extra)
    cfg = load_config(REPO / "configs" / "flow_grpo.yaml", full)
    trainer = Trainer(cfg)
    assert isinstance(trainer.model, SDXLModel) and trainer.cfg.sampling.shift == 1.0
    before = {n: p.detach().clone() for n, p in trainer.policy.params.items()}
    trainer.train()
    metrics = read_metrics(tmp_path / "full")
    assert len(metrics) == 2
    assert all(m["policy/ratio_first_max_dev"] == 0.0 and m["policy/optimizer_steps"] > 0 for m in metrics)
    # every step of every kept image is trained (a group whose two JPEG sizes tie has no variance and is dropped)
    assert all(
        m["cost/trained_transitions"] == round(2 * 2 * 3 * (1 - m["advantage/zero_variance_frac"])) > 0
        for m in metrics
    )  # 2 prompts x 2 images x all 3 steps
    assert any(not torch.equal(p.detach(), before[n]) for n, p in trainer.policy.params.items())

    ours = generate(trainer.model, PROMPTS, [0, 1], num_steps=3, guidance_scale=4.5)
    stock = _stock_images(sdxl, trainer.model, 3, 4.5, lora=tmp_path / "full" / "lora")
    base = _stock_images(sdxl, trainer.model, 3, 4.5)
    assert (stock - base).abs().max() > 1e-4  # the LoRA changed the model
    torch.testing.assert_close(ours, stock, rtol=0, atol=1e-4)

    part = tiny_overrides(sdxl, train, test, tmp_path / "part", **extra)
    Trainer(load_config(REPO / "configs" / "flow_grpo.yaml", part + ["run.iterations=1"])).train()
    Trainer(load_config(REPO / "configs" / "flow_grpo.yaml", part + ["run.resume=true"])).train()
    a = load_file(tmp_path / "full/checkpoints/checkpoint-000002/trainable.safetensors")
    b = load_file(tmp_path / "part/checkpoints/checkpoint-000002/trainable.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6)


def test_the_dance_grpo_recipe_shrunk_onto_a_tiny_pipeline_trains(tmp_path, sdxl, prompt_files):
    """configs/recipes/sdxl_dance_grpo.yaml (DanceGRPO's SD settings) with only its sizes, paths and reward shrunk: DDIM at
    eta 1, shared noise per group, every step but the last trained, two iterations with the ratio exactly 1."""
    native = {"model.dtype": "float32", "model.resolution": "null", "train.micro_batch_size": "null"}  # 32 px
    native.update({"sampling.batch_size": 8, **no_download("hpsv2")})
    cfg = shrink_recipe("sdxl_dance_grpo", sdxl, prompt_files, tmp_path / "run", **native)
    assert (cfg.sampling.kernel, cfg.sampling.noise_level, cfg.sampling.shared_noise) == ("ddim", 1.0, True)
    assert not cfg.sampling.train_last_step and cfg.train.clip_range == 1e-4 and cfg.sampling.guidance_scale == 5.0
    trainer = Trainer(cfg)
    assert isinstance(trainer.model, SDXLModel)
    trainer.train()
    metrics = read_metrics(tmp_path / "run")
    assert len(metrics) == 2 and all(m["policy/ratio_first_max_dev"] == 0.0 for m in metrics)
    assert all(m["cost/trained_transitions"] == 2 * 2 * 2 for m in metrics)  # 2 prompts x 2 images x steps 0-1 of 3


def test_folders_it_cannot_follow_are_one_clear_error(tmp_path, sdxl):
    """An added embedding whose width does not match the time ids and pooled projection, and an EDM-style VAE with
    latents_mean/std, are refused naming the folder, before any sampling."""
    import shutil

    cases = (
        ("unet", {"addition_time_embed_dim": 4}, r"unet: the added embedding takes 80 features, but 6 time ids"),
        ("vae", {"latents_mean": [0.0] * 4, "latents_std": [1.0] * 4}, r"vae sets latents_mean/latents_std"),
    )
    for part, change, message in cases:
        folder = tmp_path / part
        shutil.copytree(sdxl, folder)
        config = json.loads((folder / part / "config.json").read_text())
        (folder / part / "config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(ValueError, match=message) as error:
            load_model(folder)
        assert "\n" not in str(error.value)


def test_guidance_rescale_is_a_config_option(tmp_path, sdxl, prompt_files):
    """``model.options.guidance_rescale`` reaches the SDXL adapter; outside [0, 1] it is one ConfigError."""
    over = tiny_overrides(sdxl, *prompt_files, tmp_path / "run", **{"model.options.guidance_rescale": 0.7})
    assert Trainer(load_config(None, over)).model.guidance_rescale == 0.7
    bad = tiny_overrides(sdxl, *prompt_files, tmp_path / "bad", **{"model.options.guidance_rescale": 2.0})
    with pytest.raises(ConfigError, match=r"'model\.options\.guidance_rescale': guidance_rescale must be in \[0, 1\]"):
        Trainer(load_config(None, bad))
