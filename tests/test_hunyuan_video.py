"""The HunyuanVideo adapter (`flowrl.models.HunyuanVideoModel`) on tiny random HunyuanVideoPipelines built here (a
3-layer Llama with a byte-level BPE tokenizer trained on the pipeline's prompt template, a 1-layer CLIP with the tiny
CLIP tokenizer, HunyuanVideoTransformer3DModel, AutoencoderKLHunyuanVideo): it samples as the stock pipeline does
(embedded guidance, true CFG, shift 7), trains through the GRPO rollout shapes and DiffusionNFT with the PPO ratio
exactly 1 before the first step, runs configs/recipes/hunyuan_dance_grpo.yaml shrunk, and saves LoRAs the stock pipeline
loads."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import REPO, read_metrics, shape_overrides, tiny_overrides, tiny_pipeline
from families import FAMILIES
from tiny_pipelines.common import noise, stock_pipeline
from tiny_pipelines.hunyuan_video import PROMPTS, build_random_hunyuan_pipeline, stock_hunyuan_video

from flowrl.config import ConfigError, load_config
from flowrl.models import HunyuanVideoModel, load_model, model_class
from flowrl.trainer import Trainer

SIDE, FRAMES, TOKENS = 32, 5, 16  # 32 px, 5 frames: latents (4, 2, 4, 4); 16 Llama tokens after the crop


hunyuan = tiny_pipeline("hunyuan", build_random_hunyuan_pipeline)


@pytest.fixture(scope="module")
def video_prompts(tmp_path_factory) -> tuple[Path, Path]:
    """Train and eval prompt files without GenEval metadata (the evaluation is then the rewards' mean)."""
    folder = tmp_path_factory.mktemp("video-prompts")
    lines = [json.dumps({"prompt": p, "tag": "motion"}) for p in PROMPTS + ["a green star moving right"]]
    (folder / "train.jsonl").write_text("\n".join(lines) + "\n")
    (folder / "test.jsonl").write_text("\n".join(lines[:2]) + "\n")
    return folder / "train.jsonl", folder / "test.jsonl"


def _model(folder: Path, **kwargs) -> HunyuanVideoModel:
    return load_model(folder, max_sequence_length=TOKENS, resolution=SIDE, num_frames=FRAMES, **kwargs)


def _stock_videos(folder: Path, model: HunyuanVideoModel, guidance_scale: float, **kwargs) -> torch.Tensor:
    """The stock HunyuanVideoPipeline's videos `(2, F, 3, H, W)` of :data:`PROMPTS` at 3 steps from the noise of
    `flowrl.evaluation.generate` (seeds 0, 1); ``kwargs``: ``lora``, ``negative_prompt``, ``true_cfg_scale``."""
    metas = [{"prompt": p} for p in PROMPTS]
    return stock_hunyuan_video(folder, model, metas, noise(model, 2), 3, guidance_scale, **kwargs)


def _video_overrides(folder: Path, prompts: tuple[Path, Path], out: Path, **extra) -> list[str]:
    """The conformance suite's settings for the HunyuanVideo family (brightness, embedded guidance 6), then ``extra``."""
    return tiny_overrides(folder, *prompts, out, **{**FAMILIES["HunyuanVideoModel"].run_settings, **extra})


# ----------------------------------------------------------------------------------------------- the adapter
def test_offline_tokenizer_and_prompt_encoding_follow_the_pipeline_template(hunyuan, tmp_path):
    """The template's system part is the 95 tokens the pipeline crops; the adapter's embeddings are the Llama states of
    the prompt tokens alone (three layers below the output), right-padded, with CLIP's pooled output."""
    from diffusers.pipelines.hunyuan_video.pipeline_hunyuan_video import DEFAULT_PROMPT_TEMPLATE as TEMPLATE

    model = _model(hunyuan)
    pipe = model.pipe
    prefix = TEMPLATE["template"].split("{}")[0]
    assert len(pipe.tokenizer(prefix).input_ids) == TEMPLATE["crop_start"] == 95
    emb = model.encode(PROMPTS)
    assert emb.embeds.shape == (2, TOKENS, 32) and emb.pooled.shape == (2, 32) and emb.mask.shape == (2, TOKENS)
    for i, prompt in enumerate(PROMPTS):
        own = pipe.tokenizer(prompt + "<|eot_id|>", add_special_tokens=False).input_ids
        ids = pipe.tokenizer(TEMPLATE["template"].format(prompt)).input_ids
        assert ids[95:] == own  # the crop leaves the prompt and its end-of-turn token
        assert emb.mask[i].tolist() == [1] * len(own) + [0] * (TOKENS - len(own))
        with torch.no_grad():
            states = pipe.text_encoder(torch.tensor([ids]), output_hidden_states=True).hidden_states[-3][0, 95:]
        torch.testing.assert_close(emb.embeds[i, : len(own)], states, rtol=1e-5, atol=1e-5)
    left = tmp_path / "left"
    shutil.copytree(hunyuan, left)
    config = json.loads((left / "tokenizer" / "tokenizer_config.json").read_text())
    (left / "tokenizer" / "tokenizer_config.json").write_text(json.dumps({**config, "padding_side": "left"}))
    with pytest.raises(ValueError, match="tokenizer pads on the left"):
        _model(left)


def test_folder_checks_name_the_setting(hunyuan, tmp_path, video_prompts):
    assert model_class(hunyuan) is HunyuanVideoModel
    assert HunyuanVideoModel.check_num_frames(hunyuan, None) == 129
    assert HunyuanVideoModel.check_num_frames(hunyuan, 53) == 53
    with pytest.raises(ValueError, match=r"num_frames 10 does not fit .*expected 4k\+1 frames .* e\.g\. 9"):
        HunyuanVideoModel.check_num_frames(hunyuan, 10)
    with pytest.raises(ValueError, match=r"resolution 40 px .*multiple of 16 \(16, HunyuanVideoPipeline's rule"):
        HunyuanVideoModel.check_resolution(hunyuan, 40)
    assert HunyuanVideoModel.check_resolution(hunyuan, None) == 720
    assert HunyuanVideoModel.scheduler_shift(hunyuan) == 7.0
    assert HunyuanVideoModel.default_max_sequence_length(hunyuan) == 256
    with pytest.raises(ValueError, match="one transformer.* leave the expert unset"):
        _model(hunyuan, expert="low")
    for key, value, match in (
        ("model.num_frames", 6, r"4k\+1 frames"),
        ("model.expert", "high", "one transformer"),
        ("model.negative_prompt", "blurry", "embedded guidance .* uses no negative prompt"),
    ):
        with pytest.raises(ConfigError, match=f"'{key}'.*{match}"):
            Trainer(load_config(None, _video_overrides(hunyuan, video_prompts, tmp_path / "r", **{key: value})))
    for options, match in (
        ({"model.options.true_cfg_scale": 0.5}, r"'model.options.true_cfg_scale'.*>= 1"),
        (
            {"model.options.guidance_rescale": 0.7},
            r"'model.options.guidance_rescale'.*"
            r"HunyuanVideoModel.*its options: true_cfg_scale",
        ),
    ):
        with pytest.raises(ConfigError, match=match):
            Trainer(load_config(None, _video_overrides(hunyuan, video_prompts, tmp_path / "r", **options)))
    # true CFG from the config: the negative prompt is then taken
    trainer = Trainer(
        load_config(
            None,
            _video_overrides(
                hunyuan,
                video_prompts,
                tmp_path / "t",
                **{"model.options.true_cfg_scale": 3.0, "model.negative_prompt": "blurry"},
            ),
        )
    )
    assert trainer.model.true_cfg_scale == 3.0 and trainer.model.negative_prompt == "blurry"
    assert trainer.model.cfg_rows(trainer.cfg.sampling.guidance_scale) == 2


def test_ode_sampling_equals_the_stock_pipeline(hunyuan):
    """Embedded guidance (the transformer's guidance input), shift 7 on HunyuanVideoPipeline's step spacing,
    right-padded prompts of different lengths; then true CFG against a negative prompt, as the stock true_cfg_scale."""
    from flowrl.evaluation import generate

    model = _model(hunyuan)
    assert model.latent_shape == (4, 2, 4, 4) and model.decoded_shape == (FRAMES, 3, SIDE, SIDE) and model.shift == 7.0
    assert model.cfg_rows(6.0) == 1
    ours = generate(model, PROMPTS, [0, 1], num_steps=3, guidance_scale=6.0)
    stock = _stock_videos(hunyuan, model, 6.0)
    assert ours.shape == stock.shape == (2, FRAMES, 3, SIDE, SIDE)
    torch.testing.assert_close(ours, stock, rtol=0, atol=1e-4)
    assert (_stock_videos(hunyuan, model, 1.0) - stock).abs().max() > 1e-3  # the embedded guidance matters
    model.true_cfg_scale, model.negative_prompt = 3.0, "a blurry static video"
    assert model.cfg_rows(6.0) == 2
    ours = generate(model, PROMPTS, [0, 1], num_steps=3, guidance_scale=6.0)
    stock_cfg = _stock_videos(hunyuan, model, 6.0, true_cfg_scale=3.0, negative_prompt=model.negative_prompt)
    torch.testing.assert_close(ours, stock_cfg, rtol=0, atol=1e-4)
    assert (stock_cfg - stock).abs().max() > 1e-3  # true CFG matters


# ------------------------------------------------------------------------------------------------- training
@pytest.mark.parametrize(
    "preset",
    [
        "flow_grpo",
        "diffusion_nft",
        "dgpo",
        *(pytest.param(p, marks=pytest.mark.slow) for p in ("mix_grpo", "branch_grpo", "tempflow_grpo")),
        # every method of 2026 on every family (CI): tests/test_conformance.py
    ],
)
def test_presets_train_on_video_latents(preset, tmp_path, hunyuan, video_prompts):
    """Every rollout shape on HunyuanVideo latents: full SDE, a MixGRPO window, a BranchGRPO tree, TempFlow probes; the
    PPO ratio is exactly 1 before the first optimizer step; DiffusionNFT changes the LoRA."""
    cfg = load_config(REPO / "configs" / f"{preset}.yaml")
    fewer = {"sampling.probe.steps": "[0,4]", "sampling.probe.children": 2} if cfg.sampling.shape == "tempflow" else {}
    images = {"rewards.clipscore": "null", "rewards.jpeg_compressibility": "null", "train.gardo.auxiliary": "[]"}
    over = _video_overrides(hunyuan, video_prompts, tmp_path / "run", **shape_overrides(cfg), **fewer, **images)
    trainer = Trainer(load_config(REPO / "configs" / f"{preset}.yaml", over))
    before = {n: p.detach().clone() for n, p in trainer.policy.params.items()}
    trainer.train()
    metrics = read_metrics(tmp_path / "run")
    assert len(metrics) == 2
    assert all(m["cost/trained_transitions"] > 0 and m["policy/optimizer_steps"] > 0 for m in metrics)
    if cfg.train.method in ("grpo", "flow_dppo", "gardo", "awm"):
        assert all(m["policy/ratio_first_max_dev"] == 0.0 for m in metrics)
    assert any(not torch.equal(p.detach(), before[n]) for n, p in trainer.policy.params.items())
    assert (tmp_path / "run" / "grid.png").is_file()


def test_hunyuan_dance_grpo_recipe_trains_and_the_lora_loads_in_stock_diffusers(tmp_path, hunyuan, video_prompts):
    """configs/recipes/hunyuan_dance_grpo.yaml shrunk onto the tiny random pipeline (VideoAlign swapped for brightness, the
    LoRA learning rate raised so two iterations move it visibly): two iterations with the ratio exactly 1 before the
    first step; the LoRA loads in the stock HunyuanVideoPipeline, changes its videos and gives the trained model's."""
    from flowrl.evaluation import generate

    recipe = load_config(REPO / "configs" / "recipes" / "hunyuan_dance_grpo.yaml")
    s, t = recipe.sampling, recipe.train
    assert (recipe.model.num_frames, recipe.model.resolution, s.num_steps, s.shift) == (53, 480, 16, 5.0)
    assert (s.kernel, s.noise_level, s.guidance_scale) == ("dance_sde", 0.25, 6.0)
    assert (s.group_size, s.prompts_per_iteration, s.shared_noise) == (24, 1, True)
    assert (t.timestep_fraction, t.best_of_n, t.clip_range, t.adv_std) == (0.6, 8, 1e-4, "group")
    assert set(recipe.rewards) == {"videoalign"} and recipe.rewards["videoalign"].options["weights"] == {"VQ": 1.0}
    over = _video_overrides(
        hunyuan,
        video_prompts,
        tmp_path / "run",
        **{
            "rewards.videoalign": "null",
            "model.dtype": "float32",
            "model.lora_rank": 2,
            "sampling.group_size": 4,
            "sampling.prompts_per_iteration": 2,
            "sampling.batch_size": 4,
            "sampling.num_steps": 4,
            "train.best_of_n": 2,
            "train.minibatch_size": 4,
            "train.micro_batch_size": 2,
            "train.learning_rate": 0.05,
            "eval.num_steps": 2,
        },
    )
    trainer = Trainer(load_config(REPO / "configs" / "recipes" / "hunyuan_dance_grpo.yaml", over))
    assert isinstance(trainer.model, HunyuanVideoModel) and trainer.cfg.sampling.shift == 5.0
    trainer.train()
    metrics = read_metrics(tmp_path / "run")
    assert len(metrics) == 2
    assert all(m["policy/ratio_first_max_dev"] == 0.0 and m["policy/optimizer_steps"] > 0 for m in metrics)
    model, lora = trainer.model, tmp_path / "run" / "lora"
    assert (lora / "pytorch_lora_weights.safetensors").is_file()
    loaded = stock_pipeline(hunyuan, "HunyuanVideoPipeline", lora)
    assert any("lora" in n for n, _ in loaded.transformer.named_parameters())
    before, after = _stock_videos(hunyuan, model, 6.0), _stock_videos(hunyuan, model, 6.0, lora=lora)
    assert (after - before).abs().max() > 1e-3  # the LoRA changes the stock pipeline's videos
    torch.testing.assert_close(after, generate(model, PROMPTS, [0, 1], 3, 6.0), rtol=0, atol=1e-4)
    reloaded = _model(hunyuan)
    reloaded.load_lora(lora)
    torch.testing.assert_close(generate(reloaded, PROMPTS, [0, 1], 3, 6.0), after, rtol=0, atol=1e-4)
