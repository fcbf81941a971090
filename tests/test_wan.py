"""The Wan adapter (`flowrl.models.WanModel`) on tiny random WanPipelines built here (UMT5, WanTransformer3DModel,
AutoencoderKLWan, an offline T5 tokenizer): video latents `(C, F, H, W)` sample as the stock pipeline does, train
through every rollout shape and DiffusionNFT, save LoRAs the stock pipeline loads, and come out as mp4."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import REPO, read_metrics, shape_overrides, tiny_overrides, tiny_pipeline
from families import FAMILIES
from tiny_pipelines.common import noise
from tiny_pipelines.wan import build_random_wan_pipeline, stock_wan

from flowrl.config import ConfigError, load_config
from flowrl.models import WanModel, load_model, model_class
from flowrl.trainer import Trainer

PROMPTS = ["a red circle moving left", "two blue squares moving up"]
SIDE, FRAMES = 16, 5  # 16 px, 5 frames: latents (4, 2, 4, 4)


wan = tiny_pipeline("wan", build_random_wan_pipeline)
wan22 = tiny_pipeline("wan22", build_random_wan_pipeline, two_experts=True)


def _model(folder: Path, **kwargs) -> WanModel:
    return load_model(folder, max_sequence_length=16, resolution=SIDE, num_frames=FRAMES, **kwargs)


def _video_overrides(folder: Path, prompts: tuple[Path, Path], out: Path, **extra) -> list[str]:
    """The conformance suite's settings for the Wan family (brightness, guidance 4), then ``extra``."""
    return tiny_overrides(folder, *prompts, out, **{**FAMILIES["WanModel"].run_settings, **extra})


# ----------------------------------------------------------------------------------------------- the adapter
def test_folder_checks_name_the_setting(wan, tmp_path, random_pipeline, prompt_files):
    assert model_class(wan) is WanModel
    assert WanModel.check_num_frames(wan, None) == 81 and WanModel.check_num_frames(wan, 9) == 9
    with pytest.raises(ValueError, match=r"num_frames 10 does not fit .*expected 4k\+1 frames .* e\.g\. 9"):
        WanModel.check_num_frames(wan, 10)
    with pytest.raises(
        ValueError, match="resolution 36 px .*multiple of 8 \\(VAE spatial compression 4 x patch size 2\\)"
    ):
        WanModel.check_resolution(wan, 36)
    largest = json.loads((wan / "transformer" / "config.json").read_text())["rope_max_seq_len"] * 8
    assert WanModel.check_resolution(wan, None) == min(480, largest)  # 480 px, or what the rotary embedding covers
    assert WanModel.scheduler_shift(wan) == 3.0
    with pytest.raises(ValueError, match="one transformer .* leave the expert unset"):
        WanModel.check_expert(wan, "low")
    # real Wan folders ship UniPC with flow sigmas: its flow_shift is the schedule's shift
    unipc = tmp_path / "unipc"
    shutil.copytree(wan, unipc)
    config = json.loads((unipc / "scheduler/scheduler_config.json").read_text())
    (unipc / "scheduler/scheduler_config.json").write_text(
        json.dumps(
            {
                "_class_name": "UniPCMultistepScheduler",
                "flow_shift": 5.0,
                "use_flow_sigmas": True,
                "prediction_type": "flow_prediction",
                "num_train_timesteps": config["num_train_timesteps"],
            }
        )
    )
    assert WanModel.scheduler_shift(unipc) == 5.0
    assert _model(unipc).shift == 5.0
    (unipc / "scheduler/scheduler_config.json").write_text(json.dumps({"_class_name": "UniPCMultistepScheduler"}))
    with pytest.raises(ValueError, match="UniPC scheduler without use_flow_sigmas"):
        WanModel.scheduler_shift(unipc)
    # config keys: the frame count is checked against the VAE before weights load; image models refuse it
    train, test = prompt_files
    with pytest.raises(ConfigError, match=r"'model.num_frames'.*4k\+1 frames"):
        Trainer(
            load_config(
                None,
                tiny_overrides(wan, train, test, tmp_path / "r", **{"model.num_frames": 6, "model.resolution": SIDE}),
            )
        )
    with pytest.raises(ConfigError, match="'model.num_frames'.*StableDiffusion3Pipeline, which draws images"):
        Trainer(
            load_config(None, tiny_overrides(random_pipeline, train, test, tmp_path / "r", **{"model.num_frames": 5}))
        )


def test_two_experts_sample_as_the_stock_pipeline_and_train_the_chosen_one(wan22, tmp_path, video_prompts):
    """Wan 2.2 A14B's layout: both experts sample (switching at boundary_ratio), the chosen one trains, and its LoRA
    loads into the stock pipeline's transformer_2 with load_into_transformer_2=True."""
    from diffusers import WanPipeline

    from flowrl.evaluation import generate

    with pytest.raises(ValueError, match="two-expert Wan 2.2 model .* choose the trained expert, high .* or low"):
        _model(wan22)
    model = _model(wan22, expert="low")
    assert model.transformer is model.pipe.transformer_2 and model.frozen is model.pipe.transformer
    ours = generate(model, PROMPTS, [0, 1], num_steps=4, guidance_scale=4.0)
    stock = stock_wan(wan22, model, [{"prompt": p} for p in PROMPTS], noise(model, 2), 4, 4.0)
    torch.testing.assert_close(ours, stock, rtol=0, atol=1e-4)

    over = _video_overrides(
        wan22,
        video_prompts,
        tmp_path / "run",
        **{"model.expert": "low", "run.iterations": 1, "sampling.num_steps": 5, "sampling.shift": 1.0},
    )
    # sigmas 1, 0.8, 0.6, 0.4, 0.2, 0: steps 3 and 4 are the low-noise expert's (step 3 trained)
    trainer = Trainer(load_config(REPO / "configs" / "flow_grpo.yaml", over))
    high = {n: p.detach().clone() for n, p in trainer.model.frozen.named_parameters()}
    trainer.train()
    metrics = read_metrics(tmp_path / "run")
    assert all(m["policy/ratio_first_max_dev"] == 0.0 and m["policy/optimizer_steps"] > 0 for m in metrics)
    # only step 3 is trained: steps 0-2 run the frozen expert, step 4 is the untrained last step
    assert trainer.method.shape.plan.trained == [False, False, False, True, False]
    groups = 1 - metrics[0]["advantage/zero_variance_frac"]
    assert metrics[0]["cost/trained_transitions"] == round(2 * 2 * groups) > 0  # 2 prompts x 2 videos x 1 step
    assert all(torch.equal(p, high[n]) for n, p in trainer.model.frozen.named_parameters())  # the frozen expert
    x = torch.randn(2, *model.latent_shape, generator=torch.Generator().manual_seed(0))
    t, emb = torch.tensor([0.3, 0.2]), trainer.model.encode(PROMPTS)  # low-noise times: the trained expert
    pipe = WanPipeline.from_pretrained(wan22)
    stock = _model(wan22, expert="low")
    with torch.no_grad():
        base = stock.velocity(x, t, emb, None, 1.0)
        pipe.load_lora_weights(str(tmp_path / "run" / "lora"), load_into_transformer_2=True)
        loaded = pipe.transformer_2(
            hidden_states=x, timestep=t * 1000, encoder_hidden_states=emb.embeds, return_dict=False
        )[0]
        ours = trainer.model.velocity(x, t, emb, None, 1.0)
    assert not torch.allclose(base, ours)
    torch.testing.assert_close(loaded, ours, rtol=1e-4, atol=1e-5)
    reloaded = _model(wan22, expert="low")
    reloaded.load_lora(tmp_path / "run" / "lora")
    with torch.no_grad():
        torch.testing.assert_close(reloaded.velocity(x, t, emb, None, 1.0), ours, rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------------------------------------- training
@pytest.mark.parametrize(
    "preset",
    [
        "flow_grpo",
        "diffusion_nft",
        *(pytest.param(p, marks=pytest.mark.slow) for p in ("mix_grpo", "branch_grpo", "tempflow_grpo")),
    ],
)
def test_presets_train_on_video_latents(preset, tmp_path, wan, video_prompts):
    """Every rollout shape on 5-D latents: full SDE, a MixGRPO window, a BranchGRPO tree, TempFlow probes; the PPO
    ratio is exactly 1 before the first optimizer step; DiffusionNFT changes the LoRA."""
    cfg = load_config(REPO / "configs" / f"{preset}.yaml")
    each_once = {"eval.images_per_tag": 0}  # each of the 2 untagged evaluation prompts once
    over = _video_overrides(wan, video_prompts, tmp_path / "run", **shape_overrides(cfg), **each_once)
    trainer = Trainer(load_config(REPO / "configs" / f"{preset}.yaml", over))
    before = {n: p.detach().clone() for n, p in trainer.policy.params.items()}
    result = trainer.train()
    assert result["after"]["n_images"] == 2
    metrics = read_metrics(tmp_path / "run")
    assert all(m["cost/trained_transitions"] > 0 and m["policy/optimizer_steps"] > 0 for m in metrics)
    if cfg.train.method == "grpo":
        assert all(m["policy/ratio_first_max_dev"] == 0.0 for m in metrics)
    assert any(not torch.equal(p.detach(), before[n]) for n, p in trainer.policy.params.items())
    assert (tmp_path / "run" / "grid.png").is_file()


def test_wan_flow_grpo_recipe_trains_and_the_lora_loads_in_stock_diffusers(tmp_path, wan, video_prompts):
    """configs/recipes/wan_flow_grpo.yaml, shrunk onto the tiny random Wan pipeline (the OCR reward swapped for brightness)."""
    from diffusers import WanPipeline

    recipe = load_config(REPO / "configs" / "recipes" / "wan_flow_grpo.yaml")
    assert (recipe.model.num_frames, recipe.model.resolution, recipe.sampling.num_steps) == (33, 320, 20)
    assert recipe.sampling.kernel == "flow_sde" and recipe.sampling.guidance_scale == 4.5
    over = _video_overrides(
        wan,
        video_prompts,
        tmp_path / "run",
        **{
            "rewards.frames": "null",
            "model.dtype": "float32",
            "model.lora_rank": 2,
            "sampling.group_size": 2,
            "sampling.prompts_per_iteration": 2,
            "sampling.batch_size": 4,
            "train.minibatch_size": 4,
            "train.micro_batch_size": 2,
            "eval.num_steps": 2,
            "sampling.num_steps": 3,
        },
    )
    trainer = Trainer(load_config(REPO / "configs" / "recipes" / "wan_flow_grpo.yaml", over))
    assert isinstance(trainer.model, WanModel) and trainer.model.shift == 3.0
    trainer.train()
    metrics = read_metrics(tmp_path / "run")
    assert len(metrics) == 2
    assert all(m["policy/ratio_first_max_dev"] == 0.0 and m["policy/optimizer_steps"] > 0 for m in metrics)
    model = trainer.model
    x = torch.randn(2, *model.latent_shape, generator=torch.Generator().manual_seed(0))
    t, emb = torch.tensor([0.9, 0.4]), model.encode(PROMPTS)
    pipe = WanPipeline.from_pretrained(wan)
    with torch.no_grad():
        base = pipe.transformer(
            hidden_states=x, timestep=t * 1000, encoder_hidden_states=emb.embeds, return_dict=False
        )[0]
        pipe.load_lora_weights(str(tmp_path / "run" / "lora"))
        loaded = pipe.transformer(
            hidden_states=x, timestep=t * 1000, encoder_hidden_states=emb.embeds, return_dict=False
        )[0]
        with trainer.policy.ema_weights():  # the recipe's EMA: the saved LoRA is the averaged one
            ours = model.velocity(x, t, emb, None, 1.0)
    assert not torch.allclose(base, ours)
    torch.testing.assert_close(loaded, ours, rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------------------------------------ video out
def test_videos_come_out_as_mp4_and_a_contact_sheet(tmp_path):
    from PIL import Image

    from flowrl.video import contact_sheet, read_video, save_videos, write_mp4

    t = torch.linspace(0, 1, 9)
    ramp = torch.linspace(0.1, 0.9, 32)
    videos = torch.stack(
        [
            (ramp[None, None, None, :] * (1 - t[:, None, None, None]) + 0.5 * t[:, None, None, None])
            .expand(9, 3, 24, 32)
            .clone(),
            torch.full((9, 3, 24, 32), 0.25),
        ]
    )  # (2, 9, 3, 24, 32)
    written = read_video(write_mp4(videos[0], tmp_path / "one.mp4", fps=8))
    assert written.shape == (9, 3, 24, 32)
    assert (written - videos[0]).abs().mean() < 0.02  # H.264 at crf 18: visually lossless
    sheet, mp4 = save_videos(videos, tmp_path / "sheet.png", fps=8, max_frames=4)
    tiled = read_video(mp4)
    assert tiled.shape == (9, 3, 24 + 2, 2 * 33 + 2)  # side by side, 1 px padding, the odd width padded to even
    assert Image.open(sheet).size == (4 * 33 + 1, 2 * 25 + 1)  # 4 frames (0, 3, 5, 8) per video, one row each
    torch.testing.assert_close(contact_sheet(videos, 4)[:, 1:25, 1:33], videos[0, 0])
    torch.testing.assert_close(contact_sheet(videos, 4)[:, 1:25, -33:-1], videos[0, 8])
    with pytest.raises(ValueError, match=r"videos must be a float tensor \(B, F, 3, H, W\)"):
        save_videos(videos[0], tmp_path / "bad.png")


def test_cli_samples_a_wan_folder_to_mp4(tmp_path, wan, capsys):
    from flowrl.cli import main
    from flowrl.video import read_video

    out = tmp_path / "sheet.png"
    main(
        [
            "sample",
            "--model",
            str(wan),
            "--prompt",
            PROMPTS[0],
            "-n",
            "2",
            "--resolution",
            str(SIDE),
            "--num-frames",
            str(FRAMES),
            "--max-sequence-length",
            "16",
            "--num-steps",
            "2",
            "--device",
            "cpu",
            "--out",
            str(out),
        ]
    )
    assert "wrote 2 videos" in capsys.readouterr().out
    assert read_video(out.with_suffix(".mp4")).shape == (FRAMES, 3, SIDE + 2, 2 * (SIDE + 1) + 2)


def test_generate_writes_an_mp4_per_video(tmp_path, wan):
    from flowrl.evaluation import generate
    from flowrl.image_folders import generate_folder
    from flowrl.video import read_video

    model = _model(wan)
    assert generate_folder(model, [{"prompt": PROMPTS[0]}], tmp_path / "out", k=2, layout="flat", num_steps=2) == 2
    drawn = generate(model, [PROMPTS[0]] * 2, [1234, 1235], 2, 4.5)  # the folder's seeds
    for n in range(2):
        video = read_video(tmp_path / "out" / f"{n:05d}.mp4")
        assert video.shape == (FRAMES, 3, SIDE, SIDE)
        assert (video - drawn[n]).abs().mean() < 0.05  # the video drawn for that seed, through H.264
        assert (tmp_path / "out" / f"{n:05d}.png").is_file()


@pytest.mark.parametrize("preset", ["awm"])  # every method of 2026 on every family (CI): tests/test_conformance.py
def test_new_methods_train_on_video_latents(preset, tmp_path, wan, video_prompts):
    """The online methods of 2026 on 5-D latents for two iterations (GARDO's diversity from pooled frames, without
    auxiliary rewards); the offline ones refuse the family in one line."""
    extra = {"sampling.group_size": 4, "train.minibatch_size": 8, "train.gardo.auxiliary": "[]"}
    extra.update({"rewards.clipscore": "null", "rewards.jpeg_compressibility": "null"})  # GARDO's image judges
    over = _video_overrides(wan, video_prompts, tmp_path / "run", **extra)
    trainer = Trainer(load_config(REPO / "configs" / f"{preset}.yaml", over))
    before = {n: p.detach().clone() for n, p in trainer.policy.params.items()}
    trainer.train()
    metrics = read_metrics(tmp_path / "run")
    assert len(metrics) == 2 and all(m["policy/optimizer_steps"] > 0 for m in metrics)
    assert any(not torch.equal(p.detach(), before[n]) for n, p in trainer.policy.params.items())


def test_offline_methods_refuse_video_latents(tmp_path, wan, video_prompts):
    over = _video_overrides(wan, video_prompts, tmp_path / "run")
    with pytest.raises(ValueError, match="WanModel family's latents are its own"):
        Trainer(load_config(REPO / "configs" / "sft.yaml", over))
