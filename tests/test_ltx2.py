"""The LTX-2 adapter (`flowrl.models.LTX2Model`) on tiny random LTX2Pipelines built offline (a one-layer
Gemma3ForConditionalGeneration with an offline Gemma BPE tokenizer, LTX2TextConnectors with learnable registers,
LTX2VideoTransformer3DModel, a timestep-conditioned AutoencoderKLLTX2Video and an AutoencoderKLLTX2Audio with random
latent statistics, LTX2Vocoder, LTX-2's dynamically shifting scheduler with its shift_terminal): what is special to
LTX-2. The conformance suite (tests/test_conformance.py, family ``LTX2Model``; its slow checks with CI=true) checks
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
from tiny_pipelines.ltx2 import build_random_ltx2_pipeline, stock_ltx2

from flowrl.config import ConfigError, load_config
from flowrl.models import LTX2Model, load_model, model_class
from flowrl.trainer import Trainer

PROMPTS = ["a red circle moving left", "two blue squares moving up then a green star appears"]  # different lengths
SIDE, FRAMES, TOKENS = 32, 9, 16  # 32 px, 9 frames: video latents (8, 3, 4, 4), 48 video tokens; 16 Gemma tokens
AUDIO_TOKENS = 19  # round(9 frames / 24 fps * 16000 Hz / 80 hop / 4): audio latents (2, 19, 2), 19 tokens of 4


def _model(folder: Path, **kwargs) -> LTX2Model:
    return load_model(folder, **{"max_sequence_length": TOKENS, "resolution": SIDE, "num_frames": FRAMES, **kwargs})


ltx2 = tiny_pipeline("ltx2", build_random_ltx2_pipeline)


def _overrides(folder: Path, prompts: tuple[Path, Path], out: Path, **extra) -> list[str]:
    """The conformance suite's model settings and rewards for the family (without its guidance), then ``extra``."""
    return tiny_overrides(folder, *prompts, out, **{**FAMILIES["LTX2Model"].model_settings, **VIDEO_TRAIN, **extra})


def test_prompts_latents_schedule_and_folder_checks_are_the_pipelines(ltx2, tmp_path):
    """Gemma states through the connectors as the pipeline's; the joint latents' layout; the sigmas of the stock
    scheduler at mu = calculate_shift(F_lat H W video tokens) with the shift_terminal stretch; the defaults and the
    one-line refusals."""
    from diffusers import LTX2Pipeline
    from diffusers.pipelines.ltx2.pipeline_ltx2 import calculate_shift

    assert model_class(ltx2) is LTX2Model
    model = _model(ltx2)
    assert model.video_grid == (3, 4, 4) and model.audio_frames == AUDIO_TOKENS
    size = 48 * 8 + AUDIO_TOKENS * 4
    assert model.latent_shape == (size,) and model.decoded_shape == (FRAMES, 3, SIDE, SIDE)
    video, audio = model.split_latents(torch.arange(2.0 * size).view(2, size))
    assert video.shape == (2, 48, 8) and audio.shape == (2, AUDIO_TOKENS, 4) and audio[1, -1, -1] == 2 * size - 1
    pipe = LTX2Pipeline.from_pretrained(ltx2)
    emb = model.encode(["", *PROMPTS])
    states, mask, _, _ = pipe.encode_prompt(["", *PROMPTS], do_classifier_free_guidance=False, max_sequence_length=16)
    stock_video, stock_audio, stock_mask = pipe.connectors(states, mask, padding_side="left")
    assert emb.embeds.shape == (3, TOKENS, 8) and emb.audio.shape == (3, TOKENS, 8) and emb.pooled.shape == (3, 0)
    assert emb.mask.tolist() == stock_mask.long().tolist()  # all ones: the registers fill the padding
    torch.testing.assert_close(emb.embeds, stock_video, rtol=0, atol=1e-6)
    torch.testing.assert_close(emb.audio, stock_audio, rtol=0, atol=1e-6)
    assert (emb.embeds[1] - emb.embeds[2]).abs().max() > 1e-3
    mu = calculate_shift(48, 1024, 4096, 0.95, 2.05)  # the video tokens only, as LTX2Pipeline
    assert model.shift == pytest.approx(math.exp(mu)) == LTX2Model.scheduler_shift(ltx2, SIDE, FRAMES)
    for steps in (2, 5):
        pipe.scheduler.set_timesteps(sigmas=torch.linspace(1.0, 1 / steps, steps).tolist(), mu=mu)
        torch.testing.assert_close(model.sigmas(steps), pipe.scheduler.sigmas.float(), rtol=0, atol=1e-6)
    # the stock defaults: 121 frames, 512 px, 1024 Gemma tokens, 24 fps; CFG only
    assert LTX2Model.check_num_frames(ltx2, None) == 121 and LTX2Model.check_resolution(ltx2, None) == 512
    assert LTX2Model.default_max_sequence_length(ltx2) == 1024 and model.frame_rate == 24.0
    assert (model.cfg_rows(4.0), model.cfg_rows(1.0)) == (2, 1)
    with pytest.raises(ValueError, match=r"num_frames 10 does not fit .*expected 4k\+1 frames"):
        LTX2Model.check_num_frames(ltx2, 10)
    with pytest.raises(ValueError, match=r"resolution 48 px .*multiple of 32 \(32, LTX2Pipeline's rule"):
        LTX2Model.check_resolution(ltx2, 48)
    with pytest.raises(ValueError, match="max_sequence_length 12 does not fit .* 8 learnable registers.* e.g. 8"):
        _model(ltx2, max_sequence_length=12)
    with pytest.raises(ValueError, match="is an LTX-2 model .*one transformer.* leave the expert unset"):
        _model(ltx2, expert="high")
    with pytest.raises(ValueError, match=r"blocks \[2\] that .* does not have \(blocks 0 to 1\)"):
        _model(ltx2, stg_scale=1.0, spatio_temporal_guidance_blocks=[0, 2])
    mismatched = tmp_path / "mismatched"
    shutil.copytree(ltx2, mismatched)
    config = json.loads((mismatched / "audio_vae" / "config.json").read_text())
    (mismatched / "audio_vae" / "config.json").write_text(json.dumps({**config, "mel_bins": 16}))
    with pytest.raises(ValueError, match="packs 8 features an audio token .* audio_in_channels 4: they must be equal"):
        _model(mismatched)


def test_ode_latents_equal_the_stock_pipeline(ltx2):
    """The final video and audio latents of flowrl's Euler ODE (the audio carried in the state) are the stock
    pipeline's output_type="latent" ones within 1e-4, with CFG against a negative prompt."""
    from flowrl.samplers import ode_sample

    model = _model(ltx2, negative_prompt="blurry static")
    start = noise(model, 2)
    table = model.prompt_table([{"prompt": p} for p in PROMPTS])
    final = ode_sample(model.velocity_fn(table, 4.0), start, torch.arange(1, 3), model.sigmas(3))
    video, audio = model.stock_latents(final)
    stock_video, stock_audio = stock_ltx2(
        ltx2,
        model,
        [{"prompt": p} for p in PROMPTS],
        start,
        3,
        4.0,
        output_type="latent",
        negative_prompt="blurry static",
    )
    assert video.shape == stock_video.shape == (2, 8, 3, 4, 4) and audio.shape == stock_audio.shape == (
        2,
        2,
        AUDIO_TOKENS,
        2,
    )
    torch.testing.assert_close(video, stock_video, rtol=0, atol=1e-4)
    torch.testing.assert_close(audio, stock_audio, rtol=0, atol=1e-4)


@pytest.mark.slow  # 3 x 3-20 s on 2 shared cores; the conformance suite checks plain CFG and the negative prompt
@pytest.mark.parametrize(
    "guidance, kwargs, rows",
    [
        (
            3.0,
            dict(
                stg_scale=1.0,
                spatio_temporal_guidance_blocks=[1],
                modality_scale=3.0,
                guidance_rescale=0.7,
                audio_guidance_scale=7.0,
                audio_stg_scale=1.0,
                audio_modality_scale=3.0,
                audio_guidance_rescale=0.7,
            ),
            4,
        ),
        (1.0, dict(audio_guidance_scale=7.0), 2),
        (4.0, dict(frame_rate=12.0, decode_timestep=0.05, decode_noise_scale=0.0), 2),
    ],
    ids=["stock-defaults", "audio-cfg-only", "frame-rate-decode"],
)
def test_guidance_options_equal_the_stock_pipeline(ltx2, guidance, kwargs, rows):
    """Each of the pipeline's own settings given to flowrl and to LTX2Pipeline gives the same videos within 1e-4, and
    changes them: LTX2Pipeline's default guidance (CFG, STG at the tiny transformer's last block, modality guidance,
    rescale, the audio's own terms), audio CFG alone at guidance 1 (the negative row is still needed), and another
    frame rate (another audio length) with the decoder's timestep."""
    from flowrl.evaluation import generate

    metas = [{"prompt": p} for p in PROMPTS]
    model = _model(ltx2, **kwargs)
    assert model.cfg_rows(guidance) == rows
    ours = generate(model, PROMPTS, [0, 1], num_steps=3, guidance_scale=guidance)
    options = {k: v for k, v in kwargs.items() if k != "frame_rate"}  # the stock function reads the model's
    stock = stock_ltx2(ltx2, model, metas, noise(model, 2), 3, guidance, **options)
    assert ours.shape == stock.shape == (2, FRAMES, 3, SIDE, SIDE)
    torch.testing.assert_close(ours, stock, rtol=0, atol=1e-4)
    plain = generate(_model(ltx2), PROMPTS, [0, 1], num_steps=3, guidance_scale=guidance)
    assert (plain - ours).abs().max() > 1e-3


def test_prompt_cache_rows_are_the_encoding_and_follow_the_connectors(ltx2, tmp_path):
    """The prompt cache stores the connectors' outputs (both streams and the mask) bit for bit, and its identity
    changes with the connectors' files, which take part in the encoding (flowrl/models/memory.py)."""
    import os

    from flowrl.models.memory import PromptCache, encoder_identity

    model = _model(ltx2)
    cache = PromptCache(model, tmp_path / "cache")
    first, again = cache(PROMPTS), cache(PROMPTS[::-1])
    direct = LTX2Model.encode(model, PROMPTS)
    assert cache.misses == 2 and cache.hits == 2
    for name in ("embeds", "audio", "mask", "pooled"):
        assert torch.equal(getattr(first, name), getattr(direct, name)), name
        assert torch.equal(getattr(again, name), getattr(direct, name).flip(0)), name
    identity = encoder_identity(model)
    weights = next((ltx2 / "connectors").glob("*.safetensors"))
    stat = weights.stat()
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))
    try:
        assert encoder_identity(model) != identity
    finally:
        os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))


def test_config_errors_name_the_key(ltx2, tmp_path, video_prompts):
    for key, value, match in (
        ("model.num_frames", 10, r"4k\+1 frames"),
        ("model.max_sequence_length", 20, "8 learnable registers"),
        ("model.options.stg_scale", -1, "stg_scale must be a number >= 0"),
        ("model.options.modality_scale", 0.5, "modality_scale must be a number >= 1"),
        ("model.options.audio_guidance_scale", 0.5, r"audio_guidance_scale must be a number in \[1, 100\]"),
        ("model.options.spatio_temporal_guidance_blocks", "[]", "must be a non-empty list of transformer block"),
        ("model.options.guidance_rescale", 1.5, r"guidance_rescale must be in \[0, 1\]"),
        ("model.options.true_cfg_scale", 2, "its options: frame_rate, guidance_rescale, decode_timestep"),
    ):
        over = _overrides(ltx2, video_prompts, tmp_path / "run", **{key: value})
        with pytest.raises(ConfigError, match=f"^config key '{key}': .*{match}"):
            Trainer(load_config(None, over))
    over = _overrides(ltx2, video_prompts, tmp_path / "run", **{"model.options.stg_scale": 1.0})
    with pytest.raises(ConfigError, match=r"^config key 'model.options.spatio_temporal_guidance_blocks': .*\[28\]"):
        Trainer(load_config(None, over))  # the stock default block 28 on a 2-block transformer


@pytest.mark.slow  # 20 s on 2 shared cores (two evaluations and two iterations)
def test_ltx2_recipe_trains_two_iterations(tmp_path, ltx2, video_prompts):
    """configs/recipes/ltx2_flow_grpo.yaml shrunk onto the tiny random pipeline (PickScore over the frames swapped for
    brightness, which needs no download; its CPS window and guidance kept): two iterations with the PPO ratio exactly 1
    before each first step, the LoRA on both streams moved."""
    recipe = load_config(REPO / "configs" / "recipes" / "ltx2_flow_grpo.yaml")
    s = recipe.sampling
    assert (recipe.model.num_frames, recipe.model.resolution, recipe.model.max_sequence_length) == (121, 512, 1024)
    assert (s.num_steps, s.kernel, s.noise_level, s.guidance_scale, s.group_size) == (24, "cps", 0.8, 1.0, 16)
    assert s.window.size == 3 and recipe.eval.guidance_scale == 4.0
    assert s.shift == pytest.approx(math.exp(2.05), abs=1e-3)  # 16 x 16 x 16 video tokens: calculate_shift's max
    over = _overrides(
        ltx2,
        video_prompts,
        tmp_path / "run",
        **{
            "rewards.frames": "null",
            "model.dtype": "float32",
            "sampling.shift": "null",
            "sampling.num_steps": 5,
            "sampling.group_size": 2,
            "sampling.batch_size": 4,
            "train.minibatch_size": 6,
            "train.micro_batch_size": "null",
            "train.gradient_checkpointing": False,
            "train.ema_decay": 0.0,
        },
    )
    trainer = Trainer(load_config(REPO / "configs" / "recipes" / "ltx2_flow_grpo.yaml", over))
    assert isinstance(trainer.model, LTX2Model) and trainer.cfg.sampling.shift == pytest.approx(trainer.model.shift)
    before = {n: p.detach().clone() for n, p in trainer.policy.params.items()}
    train_shrunk_recipe(trainer)
    moved = {n for n, p in trainer.policy.params.items() if not torch.equal(p.detach(), before[n])}
    assert any(".attn1." in n for n in moved) and any("audio_attn1." in n for n in moved)
    assert (tmp_path / "run" / "lora" / "pytorch_lora_weights.safetensors").is_file()
