"""The LTX-Video adapter (`flowrl.models.LTXVideoModel`) on tiny random LTXPipelines built offline (a 1-layer T5 encoder
with an offline T5 tokenizer, LTXVideoTransformer3DModel, a timestep-conditioned AutoencoderKLLTXVideo with random
latent statistics, LTX-Video's dynamically shifting scheduler with its shift_terminal): what is special to LTX-Video.
The conformance suite (tests/test_conformance.py, family ``LTXVideoModel``; its slow checks with CI=true) checks
sampling against the stock pipeline, the ratio, resume, LoRA and full fine-tune export."""

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from conftest import REPO, tiny_overrides, tiny_pipeline, train_shrunk_recipe
from families import FAMILIES, VIDEO_TRAIN
from tiny_pipelines.common import noise
from tiny_pipelines.ltx import build_random_ltx_pipeline, stock_ltx

from flowrl.config import ConfigError, load_config
from flowrl.models import LTXVideoModel, load_model, model_class
from flowrl.models.ltx import vae_compression
from flowrl.pairing import resolve_model
from flowrl.trainer import Trainer

PROMPTS = ["a red circle moving left", "two blue squares moving up then a green star appears"]  # different lengths
SIDE, FRAMES, TOKENS = 32, 9, 16  # 32 px, 9 frames: latents (8, 3, 4, 4), 48 video tokens; 16 T5 tokens


def _model(folder: Path, **kwargs) -> LTXVideoModel:
    return load_model(folder, **{"max_sequence_length": TOKENS, "resolution": SIDE, "num_frames": FRAMES, **kwargs})


ltx = tiny_pipeline("ltx", build_random_ltx_pipeline)


def _overrides(folder: Path, prompts: tuple[Path, Path], out: Path, **extra) -> list[str]:
    """The conformance suite's model settings and rewards for the family (without its guidance), then ``extra``."""
    return tiny_overrides(
        folder, *prompts, out, **{**FAMILIES["LTXVideoModel"].model_settings, **VIDEO_TRAIN, **extra}
    )


def test_prompts_schedule_and_folder_checks_are_the_pipelines(ltx, tmp_path):
    """T5 states and mask as encode_prompt; the sigmas of the stock scheduler at mu = calculate_shift(F_lat H W) for
    several step and frame counts (the shift follows the video's token count) with the shift_terminal stretch; the
    defaults and the one-line refusals."""
    from diffusers import LTXPipeline
    from diffusers.pipelines.ltx.pipeline_ltx import calculate_shift

    assert model_class(ltx) is LTXVideoModel
    assert vae_compression(ltx) == (8, 4)
    model = _model(ltx)
    assert model.latent_shape == (8, 3, 4, 4) and model.decoded_shape == (FRAMES, 3, SIDE, SIDE)
    assert model.rope_interpolation_scale == (4 / 25, 8, 8)
    pipe = LTXPipeline.from_pretrained(ltx)
    emb = model.encode(["", *PROMPTS])
    embeds, mask, _, _ = pipe.encode_prompt(["", *PROMPTS], do_classifier_free_guidance=False, max_sequence_length=16)
    assert emb.embeds.shape == (3, TOKENS, 32) and emb.pooled.shape == (3, 0)
    assert emb.mask.tolist() == mask.long().tolist() and 1 == emb.mask[0].sum() < emb.mask[1].sum() < emb.mask[2].sum()
    torch.testing.assert_close(emb.embeds, embeds, rtol=0, atol=1e-6)
    for frames in (FRAMES, 17):
        tokens = ((frames - 1) // 4 + 1) * 16
        mu = calculate_shift(tokens, 1024, 4096, 0.95, 2.05)
        assert LTXVideoModel.scheduler_shift(ltx, SIDE, frames) == pytest.approx(math.exp(mu))
        sized = _model(ltx, num_frames=frames)
        assert sized.shift == pytest.approx(math.exp(mu))
        for steps in (2, 3, 8):
            pipe.scheduler.set_timesteps(sigmas=torch.linspace(1.0, 1 / steps, steps).tolist(), mu=mu)
            torch.testing.assert_close(sized.sigmas(steps), pipe.scheduler.sigmas.float(), rtol=0, atol=1e-6)
            assert sized.sigmas(steps)[-2] == pytest.approx(0.1)  # shift_terminal
    with pytest.raises(ValueError, match="shift_terminal 0.1, which needs at least 2 steps"):
        model.sigmas(1)
    # the stock defaults: 161 frames, 512 px, 128 T5 tokens; the shift at them
    assert LTXVideoModel.check_num_frames(ltx, None) == 161 and LTXVideoModel.check_resolution(ltx, None) == 512
    assert LTXVideoModel.default_max_sequence_length(ltx) == 128
    default_tokens = (160 // 4 + 1) * (512 // 8) ** 2
    assert LTXVideoModel.scheduler_shift(ltx) == pytest.approx(
        math.exp(calculate_shift(default_tokens, 1024, 4096, 0.95, 2.05))
    )
    with pytest.raises(ValueError, match=r"num_frames 10 does not fit .*expected 4k\+1 frames .* e\.g\. 9"):
        LTXVideoModel.check_num_frames(ltx, 10)
    with pytest.raises(ValueError, match=r"resolution 48 px .*multiple of 32 \(32, LTXPipeline's rule"):
        LTXVideoModel.check_resolution(ltx, 48)
    with pytest.raises(ValueError, match="max_sequence_length must be >= 1 for LTX-Video"):
        _model(ltx, max_sequence_length=0)
    with pytest.raises(ValueError, match="one transformer.* leave the expert unset"):
        _model(ltx, expert="high")
    patched = tmp_path / "patched"
    shutil.copytree(ltx, patched)
    config = json.loads((patched / "transformer" / "config.json").read_text())
    (patched / "transformer" / "config.json").write_text(json.dumps({**config, "patch_size": 2}))
    with pytest.raises(ValueError, match="patch_size 2, patch_size_t 1; LTXPipeline .* both must be 1"):
        _model(patched)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"guidance_rescale": 0.7},
        {"frame_rate": 8},
        {"decode_timestep": 0.05, "decode_noise_scale": 0.025},
    ],
    ids=["guidance-rescale", "frame-rate", "decode-noise"],
)
def test_sampling_options_equal_the_stock_pipeline(ltx, kwargs):
    """Each of the pipeline's own settings, given to flowrl and to LTXPipeline, gives the same videos within 1e-4, and
    changes them (the decode noise: flowrl's global RNG and the stock pipeline's generator seeded alike)."""
    from flowrl.evaluation import generate

    metas = [{"prompt": p} for p in PROMPTS]
    plain = _model(ltx)
    model = _model(ltx, **kwargs)
    torch.manual_seed(7)  # flowrl draws the decode noise from the global RNG, the stock pipeline from its generator
    ours = generate(model, PROMPTS, [0, 1], num_steps=3, guidance_scale=4.0)
    stock = stock_ltx(ltx, model, metas, noise(model, 2), 3, 4.0, generator=torch.Generator().manual_seed(7), **kwargs)
    assert ours.shape == stock.shape == (2, FRAMES, 3, SIDE, SIDE)
    torch.testing.assert_close(ours, stock, rtol=0, atol=1e-4)
    assert (generate(plain, PROMPTS, [0, 1], num_steps=3, guidance_scale=4.0) - ours).abs().max() > 1e-3


def test_config_errors_name_the_key(ltx, tmp_path, video_prompts):
    plain_vae = tmp_path / "plain-vae"  # a decoder without timestep conditioning (LTX-Video 0.9.0's)
    shutil.copytree(ltx, plain_vae)
    config = json.loads((plain_vae / "vae" / "config.json").read_text())
    (plain_vae / "vae" / "config.json").write_text(json.dumps({**config, "timestep_conditioning": False}))
    for folder, key, value, match in (
        (ltx, "model.num_frames", 10, r"4k\+1 frames"),
        (ltx, "model.expert", "low", "one transformer"),
        (ltx, "model.options.frame_rate", 0, "frame_rate must be a number > 0"),
        (ltx, "model.options.guidance_rescale", 1.5, r"guidance_rescale must be in \[0, 1\]"),
        (ltx, "model.options.decode_noise_scale", -0.1, r"decode_noise_scale must be a number in \[0, 1\]"),
        (plain_vae, "model.options.decode_timestep", 0.05, "decodes without a timestep"),
        (ltx, "model.options.true_cfg_scale", 2, "its options: frame_rate, guidance_rescale, decode_timestep"),
    ):
        over = _overrides(folder, video_prompts, tmp_path / "run", **{key: value})
        with pytest.raises(ConfigError, match=f"^config key '{key}': .*{match}"):
            Trainer(load_config(None, over))


def test_ltx_video_recipe_trains_two_iterations(tmp_path, ltx, video_prompts):
    """configs/recipes/ltx_video_flow_grpo.yaml shrunk onto the tiny random pipeline (the OCR reward swapped for brightness,
    which needs no download): two iterations with the PPO ratio exactly 1 before each first step, the LoRA moved."""
    recipe = load_config(REPO / "configs" / "recipes" / "ltx_video_flow_grpo.yaml")
    s = recipe.sampling
    assert (recipe.model.num_frames, recipe.model.resolution, recipe.model.max_sequence_length) == (33, 320, 128)
    assert (s.num_steps, s.kernel, s.noise_level, s.guidance_scale, s.group_size) == (20, "flow_sde", 0.7, 5.0, 4)
    tokens = ((33 - 1) // 8 + 1) * (320 // 32) ** 2  # the recipe's shift: the stock pipeline's at its video size
    assert s.shift == pytest.approx(math.exp(0.95 + (tokens - 1024) * (2.05 - 0.95) / (4096 - 1024)), abs=1e-3)
    over = _overrides(
        ltx,
        video_prompts,
        tmp_path / "run",
        **{
            "rewards.frames": "null",
            "model.lora_rank": 2,
            "sampling.num_steps": 3,
            "sampling.group_size": 2,
            "sampling.batch_size": 4,
            "train.minibatch_size": 4,
            "train.micro_batch_size": "null",
            "train.gradient_checkpointing": False,
            "train.ema_decay": 0.0,
            "eval.num_steps": 2,
        },
    )
    unset = load_config(REPO / "configs" / "recipes" / "ltx_video_flow_grpo.yaml", [*over, "sampling.shift=null"])
    resolve_model(unset)  # an unset shift is filled at the config's frame count and resolution, not the default's
    assert unset.sampling.shift == pytest.approx(LTXVideoModel.scheduler_shift(ltx, SIDE, FRAMES))
    assert unset.sampling.shift != pytest.approx(LTXVideoModel.scheduler_shift(ltx, SIDE))
    trainer = Trainer(load_config(REPO / "configs" / "recipes" / "ltx_video_flow_grpo.yaml", over))
    assert isinstance(trainer.model, LTXVideoModel) and trainer.cfg.sampling.guidance_scale == 5.0
    train_shrunk_recipe(trainer)
    assert (tmp_path / "run" / "lora" / "pytorch_lora_weights.safetensors").is_file()
