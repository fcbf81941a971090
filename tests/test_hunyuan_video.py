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
from conftest import REPO, shape_overrides, tiny_overrides

from flowrl.config import ConfigError, load_config
from flowrl.models import HunyuanVideoModel, load_model, model_class
from flowrl.trainer import Trainer

PROMPTS = ["a red circle moving left", "two blue squares moving up, then a green star appears"]  # different lengths
SIDE, FRAMES, TOKENS = 32, 5, 16  # 32 px, 5 frames: latents (4, 2, 4, 4); 16 Llama tokens after the crop
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
    r"\s*[\r\n]+|\s+(?!\S)|\s+"
)  # Llama 3's pre-tokenizer pattern (its tokenizer.json)
LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]


def brightness(images, prompts, metadata):
    """A tiny video reward: the mean brightness of each video `(B, F, 3, H, W)` in [0, 1] -> `(B,)` float32 CPU."""
    return images.float().mean(dim=(1, 2, 3, 4)).cpu()


brightness.accepts_video = True


def build_llama3_tokenizer():
    """A Llama-3-style tokenizer (byte-level BPE behind Llama 3's pre-tokenizer, ``<|begin_of_text|>`` prepended, the
    header and end-of-turn special tokens, padding on the right) trained on HunyuanVideo's prompt template and the
    prompts here: the template's system part is 95 tokens, as with LLaVA-Llama-3's tokenizer, so the pipeline's
    ``crop_start`` (95) drops exactly that part. Wrapped in ``PreTrainedTokenizerFast``, the class Llama 3 ships."""
    from diffusers.pipelines.hunyuan_video.pipeline_hunyuan_video import DEFAULT_PROMPT_TEMPLATE
    from tokenizers import Regex, Tokenizer, decoders, pre_tokenizers, processors
    from tokenizers.models import BPE
    from tokenizers.trainers import BpeTrainer
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(BPE())
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    bpe.decoder = decoders.ByteLevel()
    texts = [DEFAULT_PROMPT_TEMPLATE["template"].format(p) for p in PROMPTS + ["a blurry static video"]]
    bpe.train_from_iterator(
        texts * 3,
        BpeTrainer(
            vocab_size=600,
            special_tokens=LLAMA3_SPECIALS,
            show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    bpe.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", 0)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        bos_token="<|begin_of_text|>",
        eos_token="<|end_of_text|>",
        pad_token="<|end_of_text|>",
        padding_side="right",
    )


def build_random_hunyuan_pipeline(folder: Path) -> Path:
    """Save a random-weight HunyuanVideoPipeline to `folder`: the tokenizer above with a 3-layer Llama (hidden 32; the
    pipeline reads the third-last hidden states), a 1-layer CLIP text model with the tiny CLIP tokenizer (77 positions:
    the pipeline pads CLIP prompts to 77), a HunyuanVideo VAE (4 latent channels, 4x temporal, 8x spatial compression),
    a transformer of one dual-stream, one single-stream and one refiner block with guidance embedding, and the
    flow-matching Euler scheduler at HunyuanVideo's shift 7."""
    from diffusers import (
        AutoencoderKLHunyuanVideo,
        FlowMatchEulerDiscreteScheduler,
        HunyuanVideoPipeline,
        HunyuanVideoTransformer3DModel,
    )
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer, LlamaConfig, LlamaModel

    torch.manual_seed(0)
    tok = build_llama3_tokenizer()
    llama = LlamaModel(
        LlamaConfig(
            vocab_size=len(tok),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
            bos_token_id=tok.bos_token_id,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        )
    )
    clip_tok = CLIPTokenizer.from_pretrained(REPO / "assets" / "tiny-sd3" / "tokenizer")
    clip = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=len(clip_tok),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            max_position_embeddings=77,
            bos_token_id=clip_tok.bos_token_id,
            eos_token_id=clip_tok.eos_token_id,
            pad_token_id=clip_tok.pad_token_id,
        )
    )
    vae = AutoencoderKLHunyuanVideo(
        latent_channels=4,
        block_out_channels=(4, 4, 4, 4),
        layers_per_block=1,
        norm_num_groups=2,
        spatial_compression_ratio=8,
        temporal_compression_ratio=4,
    )
    dit = HunyuanVideoTransformer3DModel(
        in_channels=4,
        out_channels=4,
        num_attention_heads=2,
        attention_head_dim=8,
        num_layers=1,
        num_single_layers=1,
        num_refiner_layers=1,
        patch_size=2,
        patch_size_t=1,
        text_embed_dim=32,
        pooled_projection_dim=32,
        rope_axes_dim=(2, 2, 4),
        guidance_embeds=True,
    )
    pipe = HunyuanVideoPipeline(
        text_encoder=llama,
        tokenizer=tok,
        transformer=dit,
        vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0),
        text_encoder_2=clip,
        tokenizer_2=clip_tok,
    )
    pipe.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def hunyuan(tmp_path_factory) -> Path:
    return build_random_hunyuan_pipeline(tmp_path_factory.mktemp("random-hunyuan"))


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


def _stock_pipe(folder: Path, lora: Path | None = None):
    from diffusers import HunyuanVideoPipeline

    pipe = HunyuanVideoPipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    if lora is not None:
        pipe.load_lora_weights(str(lora))
    return pipe


def _stock_videos(pipe, model: HunyuanVideoModel, num_steps: int, guidance_scale: float, **kwargs) -> torch.Tensor:
    """The stock HunyuanVideoPipeline's videos `(2, F, 3, H, W)` from the noise of `flowrl.evaluation.generate` (seeds 0,
    1)."""
    noise = torch.stack([torch.randn(model.latent_shape, generator=torch.Generator().manual_seed(s)) for s in (0, 1)])
    with torch.no_grad():
        return pipe(
            PROMPTS,
            latents=noise,
            num_frames=FRAMES,
            height=SIDE,
            width=SIDE,
            num_inference_steps=num_steps,
            guidance_scale=guidance_scale,
            max_sequence_length=TOKENS,
            output_type="pt",
            **kwargs,
        ).frames


def _video_overrides(folder: Path, prompts: tuple[Path, Path], out: Path, **extra) -> list[str]:
    train, test = prompts
    return tiny_overrides(
        folder,
        train,
        test,
        out,
        **{
            "run.mixed_precision": "no",
            "model.resolution": SIDE,
            "model.num_frames": FRAMES,
            "model.max_sequence_length": TOKENS,
            "rewards.geneval": "null",
            "rewards.test_hunyuan_video:brightness.weight": 1.0,
            "sampling.guidance_scale": 6.0,
            "eval.guidance_scale": 6.0,
            **extra,
        },
    )


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


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
    pipe = _stock_pipe(hunyuan)
    ours = generate(model, PROMPTS, [0, 1], num_steps=3, guidance_scale=6.0)
    stock = _stock_videos(pipe, model, 3, 6.0)
    assert ours.shape == stock.shape == (2, FRAMES, 3, SIDE, SIDE)
    torch.testing.assert_close(ours, stock, rtol=0, atol=1e-4)
    assert (_stock_videos(pipe, model, 3, 1.0) - stock).abs().max() > 1e-3  # the embedded guidance matters
    model.true_cfg_scale, model.negative_prompt = 3.0, "a blurry static video"
    assert model.cfg_rows(6.0) == 2
    ours = generate(model, PROMPTS, [0, 1], num_steps=3, guidance_scale=6.0)
    stock_cfg = _stock_videos(pipe, model, 3, 6.0, true_cfg_scale=3.0, negative_prompt=[model.negative_prompt] * 2)
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
    metrics = _metrics(tmp_path / "run")
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
    metrics = _metrics(tmp_path / "run")
    assert len(metrics) == 2
    assert all(m["policy/ratio_first_max_dev"] == 0.0 and m["policy/optimizer_steps"] > 0 for m in metrics)
    model, lora = trainer.model, tmp_path / "run" / "lora"
    assert (lora / "pytorch_lora_weights.safetensors").is_file()
    base, loaded = _stock_pipe(hunyuan), _stock_pipe(hunyuan, lora)
    assert any("lora" in n for n, _ in loaded.transformer.named_parameters())
    before, after = _stock_videos(base, model, 3, 6.0), _stock_videos(loaded, model, 3, 6.0)
    assert (after - before).abs().max() > 1e-3  # the LoRA changes the stock pipeline's videos
    torch.testing.assert_close(after, generate(model, PROMPTS, [0, 1], 3, 6.0), rtol=0, atol=1e-4)
    reloaded = _model(hunyuan)
    reloaded.load_lora(lora)
    torch.testing.assert_close(generate(reloaded, PROMPTS, [0, 1], 3, 6.0), after, rtol=0, atol=1e-4)
