"""The Z-Image adapter (`flowrl.models.ZImageModel`) on tiny random ZImagePipelines built offline (a tiny Qwen3 text
encoder with the offline byte-level BPE tokenizer of tests/tiny_pipelines/text.py and a Qwen3-style chat template): it
samples as the stock pipeline does (its schedule, its guidance convention ``w - 1``, ``cfg_normalization`` and
``cfg_truncation``), and trains through the same trainer (configs/recipes/z_image_flow_grpo.yaml shrunk) to a LoRA the stock
pipeline loads."""

import math
import shutil

import pytest
import torch
from conftest import (
    RECIPE_SIZES,
    WHOLE_MINIBATCHES,
    no_download,
    shrink_recipe,
    tiny_overrides,
    tiny_pipeline,
    train_shrunk_recipe,
)
from tiny_pipelines.common import noise
from tiny_pipelines.z_image import build_random_z_image_pipeline, stock_z_image

from flowrl.config import ConfigError, load_config
from flowrl.models import PromptEmbeds, ZImageModel, load_model, model_class
from flowrl.trainer import Trainer

PROMPTS = ["a photo of a red star", "a photo of two blue circles and a green square"]  # of different token lengths
SIDE = 32  # px: VAE factor 4, 8 x 8 latents, 4 x 4 patches


zimage = tiny_pipeline("zimage", build_random_z_image_pipeline)


def test_prompts_schedule_and_resolution_are_the_pipelines(zimage, tmp_path):
    from diffusers import FlowMatchEulerDiscreteScheduler, ZImagePipeline
    from diffusers.pipelines.z_image.pipeline_z_image import calculate_shift

    assert model_class(zimage) is ZImageModel
    assert ZImageModel.scheduler_shift(zimage, SIDE) == 3.0  # static: the resolution does not matter
    model = load_model(zimage, resolution=SIDE)
    assert model.max_sequence_length == 512 and model.latent_shape == (4, 8, 8) and model.shift == 3.0
    emb = model.encode(["", *PROMPTS])
    stock, _ = ZImagePipeline.from_pretrained(zimage).encode_prompt(["", *PROMPTS], do_classifier_free_guidance=False)
    lengths = emb.mask.sum(1).tolist()
    assert lengths == [len(s) for s in stock] and lengths[0] < lengths[1] < lengths[2] == emb.embeds.shape[1]
    for row, mask, ref in zip(emb.embeds, emb.mask, stock):
        torch.testing.assert_close(row[mask.bool()], ref, rtol=0, atol=1e-6)
    assert emb.pooled.shape == (3, 0) and (emb.embeds[0, lengths[0] :] == 0).all()
    # a dynamically shifting scheduler: exp(mu) of the pipeline's calculate_shift, the pipeline's sigmas
    dynamic = tmp_path / "dynamic"
    shutil.copytree(zimage, dynamic)
    config = dict(base_image_seq_len=256, base_shift=0.5, max_image_seq_len=4096, max_shift=1.15)
    FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, **config).save_pretrained(dynamic / "scheduler")
    mu = calculate_shift(16, 256, 4096, 0.5, 1.15)  # 4 x 4 image patches at 32 px
    assert ZImageModel.scheduler_shift(dynamic, SIDE) == pytest.approx(math.exp(mu))
    model = load_model(dynamic, resolution=SIDE)
    pipe = ZImagePipeline.from_pretrained(dynamic)
    for steps in (3, 8):
        pipe.scheduler.set_timesteps(sigmas=torch.linspace(1.0, 1 / steps, steps).tolist(), mu=mu)
        torch.testing.assert_close(model.sigmas(steps), pipe.scheduler.sigmas.float(), rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="resolution 20 px .* multiple of 8"):
        ZImageModel.check_resolution(zimage, 20)
    with pytest.raises(ValueError, match="resolution 264 px .* from 8 to 256"):  # 32 rotary positions a side
        ZImageModel.check_resolution(zimage, 264)
    assert ZImageModel.check_resolution(zimage, None) == 256  # the pipeline's 1024, capped by the rotary embedding
    with pytest.raises(ValueError, match="max_sequence_length must be >= 1 for Z-Image"):
        load_model(zimage, max_sequence_length=0, resolution=SIDE)
    with pytest.raises(ValueError, match="cfg_truncation must be in"):
        load_model(zimage, resolution=SIDE, cfg_truncation=1.5)


@pytest.mark.parametrize(
    "guidance_scale,options",
    [(4.0, {}), (1.0, {}), (4.0, {"cfg_normalization": 1.0, "cfg_truncation": 0.3})],
    ids=["cfg", "no-cfg", "cfg-normalized-truncated"],
)
def test_deterministic_sampling_equals_the_stock_pipeline(zimage, guidance_scale, options):
    from flowrl.evaluation import generate

    model = load_model(zimage, resolution=SIDE, **options)
    assert model.cfg_rows(guidance_scale) == (2 if guidance_scale > 1 else 1)
    metas = [{"prompt": p} for p in PROMPTS]
    ours = generate(model, PROMPTS, [0, 1], num_steps=3, guidance_scale=guidance_scale)
    stock = stock_z_image(zimage, model, metas, noise(model, 2), 3, guidance_scale, **options)
    assert ours.shape == stock.shape == (2, 3, SIDE, SIDE)
    torch.testing.assert_close(ours, stock, rtol=0, atol=1e-4)
    if guidance_scale > 1 and not options:  # the guidance matters, and so do the options
        plain = generate(model, PROMPTS, [0, 1], num_steps=3, guidance_scale=1.0)
        assert (plain - ours).abs().max() > 1e-3
        for option in ({"cfg_normalization": 1.0}, {"cfg_truncation": 0.3}):  # 1 - t is 0, 0.14, 0.4 at 3 steps
            shaped = generate(load_model(zimage, resolution=SIDE, **option), PROMPTS, [0, 1], 3, guidance_scale)
            assert (shaped - ours).abs().max() > 1e-3


def test_z_image_recipe_trains_and_the_lora_loads_in_stock(tmp_path, zimage, prompt_files):
    """configs/recipes/z_image_flow_grpo.yaml, shrunk onto the tiny random Z-Image pipeline (its 1-step random window kept;
    the PickScore reward swapped for JPEG compressibility, which needs no download; no EMA, so that the saved LoRA is
    the trained weights)."""
    from diffusers import ZImagePipeline

    settings = {"model.resolution": SIDE, "model.max_sequence_length": 64, **no_download("pickscore")}
    settings.update({**RECIPE_SIZES, "train.minibatch_size": 4, **WHOLE_MINIBATCHES})
    settings["train.ema_decay"] = 0.0  # run/lora holds the EMA when there is one: here the trained weights
    cfg = shrink_recipe("z_image_flow_grpo", zimage, prompt_files, tmp_path / "run", keep_shape=True, **settings)
    assert cfg.sampling.window.size == 1 and cfg.sampling.noise_level == 0.7 and cfg.sampling.guidance_scale == 5.0
    trainer = Trainer(cfg)
    assert isinstance(trainer.model, ZImageModel) and trainer.cfg.sampling.shift == 3.0
    train_shrunk_recipe(trainer)
    # the saved LoRA, loaded by the stock pipeline, gives the trained velocity (the stock network under the adapter)
    model = trainer.model
    table = model.prompt_table([{"prompt": p} for p in PROMPTS])
    cond, uncond = table[PromptEmbeds.rows(torch.arange(2))], table[torch.zeros(2, dtype=torch.long)]
    x = torch.randn(2, *model.latent_shape, generator=torch.Generator().manual_seed(0))
    t = torch.tensor([0.7, 0.4])
    stock = load_model(zimage, resolution=SIDE, max_sequence_length=64)
    pipe = ZImagePipeline.from_pretrained(zimage)
    stock.pipe, stock.transformer = pipe, pipe.transformer
    with torch.no_grad():
        base = stock.velocity(x, t, cond, uncond, 5.0)
        pipe.load_lora_weights(str(tmp_path / "run" / "lora"))
        loaded = stock.velocity(x, t, cond, uncond, 5.0)
        ours = model.velocity(x, t, cond, uncond, 5.0)
    assert (base - ours).abs().max() > 1e-5  # the LoRA trained
    torch.testing.assert_close(loaded, ours, rtol=1e-4, atol=1e-4)


def test_z_image_config_errors_name_the_key(tmp_path, zimage, prompt_files):
    train, test = prompt_files
    for key, value, match in (
        ("model.resolution", 20, "'model.resolution'.*multiple of 8"),
        ("model.options.cfg_normalization", -1, "'model.options.cfg_normalization'.*>= 0"),
        ("model.options.cfg_scale", 2, "'model.options.cfg_scale'.*its options: cfg_normalization, cfg_truncation"),
    ):
        over = tiny_overrides(zimage, train, test, tmp_path / "run", **{"model.resolution": SIDE, key: value})
        with pytest.raises(ConfigError, match=match):
            Trainer(load_config(None, over))
