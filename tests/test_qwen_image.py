"""The Qwen-Image adapter (`flowrl.models.QwenImageModel`) on tiny random QwenImagePipelines built offline (a tiny
Qwen2.5-VL text encoder with a byte-level BPE tokenizer trained here on the pipeline's prompt template): it samples as
the stock pipeline does (dynamic shift, terminal stretch, true CFG), and trains through the same trainer
(configs/recipes/qwen_image_flow_grpo.yaml shrunk) to a LoRA the stock pipeline loads."""

import math
from pathlib import Path

import pytest
import torch
from conftest import (
    RECIPE_SIZES,
    REPO,
    WHOLE_MINIBATCHES,
    no_download,
    read_metrics,
    shrink_recipe,
    tiny_overrides,
    tiny_pipeline,
    train_shrunk_recipe,
)
from tiny_pipelines.common import noise
from tiny_pipelines.qwen_image import build_random_qwen_image_pipeline, stock_qwen_image

from flowrl.config import ConfigError, load_config
from flowrl.models import QwenImageModel, load_model, model_class
from flowrl.trainer import Trainer

PROMPTS = ["a photo of a red star", "a photo of two blue circles and a green square"]  # of different token lengths
SIDE = 32  # px: VAE factor 4, 4 x 4 packed tokens


qwen = tiny_pipeline("qwen", build_random_qwen_image_pipeline)


def _stock_images(folder: Path, model: QwenImageModel, guidance_scale: float, lora=None) -> torch.Tensor:
    """The stock QwenImagePipeline's images of :data:`PROMPTS` at 3 steps from the noise of
    `flowrl.evaluation.generate` (seeds 0, 1)."""
    return stock_qwen_image(folder, model, [{"prompt": p} for p in PROMPTS], noise(model, 2), 3, guidance_scale, lora)


def test_offline_tokenizer_matches_the_pipeline_template(qwen):
    from diffusers import QwenImagePipeline

    pipe = QwenImagePipeline.from_pretrained(qwen)
    prefix = pipe.prompt_template_encode.split("{}")[0]
    assert len(pipe.tokenizer(prefix).input_ids) == pipe.prompt_template_encode_start_idx == 34
    model = load_model(qwen, resolution=SIDE)
    emb = model.encode(["", *PROMPTS])
    lengths = emb.mask.sum(1).tolist()
    assert lengths[0] == 5 and lengths[1] < lengths[2] == emb.embeds.shape[1]  # "" keeps the template's 5-token tail
    assert emb.pooled.shape == (3, 0) and (emb.embeds[0, 5:] == 0).all()


def test_schedule_is_the_stock_dynamic_shift_with_its_terminal_stretch(qwen):
    from diffusers import QwenImagePipeline
    from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift

    assert model_class(qwen) is QwenImageModel
    mu = calculate_shift(16, 256, 8192, 0.5, 0.9)  # 4 x 4 image tokens at 32 px
    assert QwenImageModel.scheduler_shift(qwen, SIDE) == pytest.approx(math.exp(mu))
    assert QwenImageModel.scheduler_shift(qwen, 128) == pytest.approx(math.exp(0.5))  # 16 x 16 = base_image_seq_len
    model = load_model(qwen, resolution=SIDE)
    assert model.max_sequence_length == 512 and model.shift == pytest.approx(math.exp(mu))
    pipe = QwenImagePipeline.from_pretrained(qwen)
    for steps in (3, 10):
        pipe.scheduler.set_timesteps(sigmas=[1 - i / steps for i in range(steps)], mu=mu)
        torch.testing.assert_close(model.sigmas(steps), pipe.scheduler.sigmas.float(), rtol=0, atol=1e-6)
    assert model.sigmas(3)[-2].item() == pytest.approx(0.02)  # shift_terminal
    with pytest.raises(ValueError, match="resolution 20 px .* multiple of 8"):
        QwenImageModel.check_resolution(qwen, 20)
    with pytest.raises(ValueError, match="max_sequence_length must be in 1..1024 for Qwen-Image"):
        load_model(qwen, max_sequence_length=2000, resolution=SIDE)


def test_qwen_image_recipe_trains_and_the_lora_loads_in_stock(tmp_path, qwen, prompt_files):
    """configs/recipes/qwen_image_flow_grpo.yaml, shrunk onto the tiny random Qwen-Image pipeline (its 2-step random window
    kept; the PickScore reward swapped for JPEG compressibility, which needs no download)."""
    from flowrl.evaluation import generate

    settings = {
        "model.resolution": SIDE,
        "model.max_sequence_length": 64,
        **no_download("pickscore"),
        **RECIPE_SIZES,
    }
    settings.update({"train.minibatch_size": 8, **WHOLE_MINIBATCHES})
    cfg = shrink_recipe("qwen_image_flow_grpo", qwen, prompt_files, tmp_path / "run", keep_shape=True, **settings)
    assert cfg.sampling.window.size == 2 and cfg.sampling.noise_level == 1.2 and cfg.sampling.guidance_scale == 4.0
    trainer = Trainer(cfg)
    assert isinstance(trainer.model, QwenImageModel) and trainer.cfg.sampling.shift == pytest.approx(
        trainer.model.shift
    )
    train_shrunk_recipe(trainer)
    # the saved LoRA, loaded by the stock pipeline, samples what the trained adapter samples
    ours = generate(trainer.model, PROMPTS, [0, 1], num_steps=3, guidance_scale=4.0)
    stock = _stock_images(qwen, trainer.model, 4.0, lora=tmp_path / "run" / "lora")
    base = _stock_images(qwen, trainer.model, 4.0)
    assert (stock - base).abs().max() > 1e-4  # the LoRA changed the model
    torch.testing.assert_close(ours, stock, rtol=0, atol=1e-4)


def test_qwen_config_errors_name_the_key(tmp_path, qwen, prompt_files):
    train, test = prompt_files
    over = tiny_overrides(qwen, train, test, tmp_path / "run", **{"model.resolution": 20})
    with pytest.raises(ConfigError, match="'model.resolution'.*multiple of 8"):
        Trainer(load_config(None, over))


# every method of 2026 on every family (CI): tests/test_conformance.py
@pytest.mark.parametrize("preset", ["awm"])
def test_new_methods_train_on_qwen_image(preset, tmp_path, qwen, prompt_files):
    """The methods of 2026 on Qwen-Image's normalised latents (the offline ones refuse the family: its latents are not
    the VAE's scaled ones)."""
    extra = {
        "run.mixed_precision": "no",
        "model.resolution": SIDE,
        "model.max_sequence_length": 64,
        "rewards.geneval": "null",
        "rewards.jpeg_compressibility.weight": 1.0,
        "sampling.group_size": 4,
        "train.minibatch_size": 8,
        "train.gardo.auxiliary": "[]",
        "rewards.clipscore": "null",
    }
    trainer = Trainer(
        load_config(REPO / "configs" / f"{preset}.yaml", tiny_overrides(qwen, *prompt_files, tmp_path / "r", **extra))
    )
    trainer.train()
    metrics = read_metrics(tmp_path / "r")
    assert len(metrics) == 2 and all(m["policy/optimizer_steps"] > 0 for m in metrics)
