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
from conftest import REPO, tiny_overrides, train_shrunk_recipe
from families import noise, prompt_files
from test_ltx import LTX_SCHEDULER
from test_sana import build_gemma_tokenizer

from flowrl.config import ConfigError, load_config
from flowrl.models import LTX2Model, load_model, model_class
from flowrl.trainer import Trainer

PROMPTS = ["a red circle moving left", "two blue squares moving up then a green star appears"]  # different lengths
SIDE, FRAMES, TOKENS = 32, 9, 16  # 32 px, 9 frames: video latents (8, 3, 4, 4), 48 video tokens; 16 Gemma tokens
AUDIO_TOKENS = 19  # round(9 frames / 24 fps * 16000 Hz / 80 hop / 4): audio latents (2, 19, 2), 19 tokens of 4
STOCK_OFF = dict(
    stg_scale=0.0,
    modality_scale=1.0,
    guidance_rescale=0.0,
    audio_guidance_scale=None,
    audio_stg_scale=None,
    audio_modality_scale=None,
    audio_guidance_rescale=None,
)
"""LTX2Pipeline's guidance arguments as flowrl's defaults set them: CFG only, the audio terms following the video's
(the stock defaults are LTX-2.3's: STG 1 at block 28, modality guidance 3, rescale 0.7, audio CFG 7)."""


def build_random_ltx2_pipeline(folder: Path) -> Path:
    """Save a random-weight LTX2Pipeline to ``folder`` (seeded; seconds): a Gemma BPE tokenizer
    (:func:`test_sana.build_gemma_tokenizer`) with a one-layer Gemma3ForConditionalGeneration (hidden size 8, a
    one-layer SigLIP tower the pipeline never runs), LTX-2.0-style LTX2TextConnectors (one block each, 8 learnable
    registers: prompt lengths must be multiples of 8), a 2-block LTX2VideoTransformer3DModel (8 video channels, 4 audio
    features, both streams 32 wide), an AutoencoderKLLTX2Video compressing 8x in space and 4x in time into 8 channels
    with a timestep-conditioned decoder, random ``latents_mean`` / ``latents_std`` and scaling factor 0.9, an
    AutoencoderKLLTX2Audio of 2 latent channels over 8 mel bins at hop 80 (50 latent frames a second) with random latent
    statistics, a small LTX2Vocoder, and LTX-2's scheduler config (:data:`test_ltx.LTX_SCHEDULER`, as diffusers'
    scripts/convert_ltx2_to_diffusers.py).

    The widths and the audio rate keep the transformer batch invariant on the CPU (the ratio is exactly 1): with a
    16-wide stream the per-sample SiLU of the timestep embedding, and with 9 audio tokens a sample (hop 160) the audio
    stream's projections, round differently for one sample than for several (measured on AMD EPYC, PyTorch's CPU
    kernels); LTX-2's own streams are 4096 and 2048 wide over 126 audio tokens."""
    from diffusers import (
        AutoencoderKLLTX2Audio,
        AutoencoderKLLTX2Video,
        FlowMatchEulerDiscreteScheduler,
        LTX2Pipeline,
        LTX2VideoTransformer3DModel,
    )
    from diffusers.pipelines.ltx2 import LTX2TextConnectors
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    torch.manual_seed(0)
    tokenizer = build_gemma_tokenizer()
    text = dict(
        vocab_size=len(tokenizer),
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=4,
        max_position_embeddings=64,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    vision = dict(
        hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2, image_size=16, patch_size=8
    )
    encoder = Gemma3ForConditionalGeneration(
        Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=len(tokenizer))
    )
    connectors = LTX2TextConnectors(
        caption_channels=8,
        text_proj_in_factor=2,  # the encoder's hidden states: embeddings + 1 layer
        video_connector_num_attention_heads=2,
        video_connector_attention_head_dim=4,
        video_connector_num_layers=1,
        video_connector_num_learnable_registers=8,
        audio_connector_num_attention_heads=2,
        audio_connector_attention_head_dim=4,
        audio_connector_num_layers=1,
        audio_connector_num_learnable_registers=8,
        connector_rope_base_seq_len=32,
        rope_double_precision=False,
        rope_type="split",
    )
    dit = LTX2VideoTransformer3DModel(
        in_channels=8,
        out_channels=8,
        num_attention_heads=2,
        attention_head_dim=16,
        cross_attention_dim=32,
        audio_in_channels=4,
        audio_out_channels=4,
        audio_num_attention_heads=2,
        audio_attention_head_dim=16,
        audio_cross_attention_dim=32,
        audio_hop_length=80,
        num_layers=2,
        caption_channels=8,
        rope_double_precision=False,
        rope_type="split",
    )
    vae = AutoencoderKLLTX2Video(
        latent_channels=8,
        block_out_channels=(8, 8),
        down_block_types=("LTX2VideoDownBlock3D",) * 2,
        decoder_block_out_channels=(8, 16),
        layers_per_block=(1, 1, 1),
        decoder_layers_per_block=(1, 1, 1),
        spatio_temporal_scaling=(True, True),
        decoder_spatio_temporal_scaling=(True, True),
        decoder_inject_noise=(False, False, False),
        downsample_type=("spatiotemporal", "spatiotemporal"),
        upsample_type=("spatiotemporal", "spatiotemporal"),
        upsample_residual=(True, True),
        upsample_factor=(2, 2),
        timestep_conditioning=True,
        patch_size=2,
        patch_size_t=1,
        scaling_factor=0.9,
    )
    vae.latents_mean.copy_(torch.randn(8) * 0.3)
    vae.latents_std.copy_(torch.rand(8) + 0.5)
    audio_vae = AutoencoderKLLTX2Audio(
        base_channels=4,
        ch_mult=(1,),
        num_res_blocks=1,
        resolution=32,
        latent_channels=2,
        mel_bins=8,
        mel_hop_length=80,
    )
    audio_vae.latents_mean.copy_(torch.randn(4) * 0.3)
    audio_vae.latents_std.copy_(torch.rand(4) + 0.5)
    vocoder = LTX2Vocoder(
        in_channels=audio_vae.config.output_channels * audio_vae.config.mel_bins,
        hidden_channels=16,
        out_channels=2,
        upsample_kernel_sizes=[4, 4],
        upsample_factors=[2, 2],
        resnet_kernel_sizes=[3],
        resnet_dilations=[[1, 3, 5]],
        output_sampling_rate=16000,
    )
    LTX2Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**LTX_SCHEDULER),
        vae=vae,
        audio_vae=audio_vae,
        text_encoder=encoder,
        tokenizer=tokenizer,
        connectors=connectors,
        transformer=dit,
        vocoder=vocoder,
    ).save_pretrained(folder)
    return folder


def stock_ltx2(
    folder: Path,
    model,
    metas: list[dict],
    noise: torch.Tensor,
    num_steps: int,
    guidance_scale: float,
    output_type: str = "pt",
    **kwargs,
):
    """The stock LTX2Pipeline's videos ``(B, F, 3, H, W)`` float32 in [0, 1] for the prompt records ``metas`` from
    flowrl's latents ``noise (B, *model.latent_shape)``: its video tokens as the pipeline's packed ``latents=``, its
    audio tokens de-normalised with the audio VAE's statistics as ``audio_latents=`` (the pipeline normalises what it is
    given), at the model's frames, frame rate, side and prompt length, with flowrl's default guidance terms
    (:data:`STOCK_OFF`); ``kwargs``: the pipeline's own arguments (``negative_prompt``, the guidance terms,
    ``decode_timestep``, ...). With ``output_type="latent"``: ``(video latents (B, C, F, h, w), audio latents (B, C_a,
    L, M))``, both de-normalised, as the pipeline returns them."""
    from diffusers import LTX2Pipeline

    pipe = LTX2Pipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    video, audio = model.split_latents(noise)  # (B, S_v, C), (B, S_a, C_a), normalised
    audio = audio * pipe.audio_vae.latents_std + pipe.audio_vae.latents_mean
    negative = kwargs.pop("negative_prompt", None)
    with torch.no_grad():
        frames, sound = pipe(
            [m["prompt"] for m in metas],
            negative_prompt=[negative] * len(metas) if negative else None,
            latents=video,
            audio_latents=audio,
            num_frames=model.num_frames,
            frame_rate=model.frame_rate,
            height=model.resolution,
            width=model.resolution,
            num_inference_steps=num_steps,
            guidance_scale=guidance_scale,
            max_sequence_length=model.max_sequence_length,
            output_type=output_type,
            return_dict=False,
            **{**STOCK_OFF, **kwargs},
        )
    return (frames, sound) if output_type == "latent" else frames


def _model(folder: Path, **kwargs) -> LTX2Model:
    return load_model(folder, **{"max_sequence_length": TOKENS, "resolution": SIDE, "num_frames": FRAMES, **kwargs})


@pytest.fixture(scope="module")
def ltx2(tmp_path_factory) -> Path:
    return build_random_ltx2_pipeline(tmp_path_factory.mktemp("random-ltx2"))


@pytest.fixture(scope="module")
def video_prompts(tmp_path_factory) -> tuple[Path, Path]:
    """Train and eval prompt files of motion prompts without GenEval metadata (the evaluation is then the rewards'
    mean): the conformance suite's (:func:`families.prompt_files`)."""
    return prompt_files("video", tmp_path_factory.mktemp("video-prompts"))


def _overrides(folder: Path, prompts: tuple[Path, Path], out: Path, **extra) -> list[str]:
    train, test = prompts
    settings = {
        "model.resolution": SIDE,
        "model.num_frames": FRAMES,
        "model.max_sequence_length": TOKENS,
        "rewards.geneval": "null",
        "rewards.families:brightness.weight": 1.0,
        **extra,
    }
    return tiny_overrides(folder, train, test, out, **settings)


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
