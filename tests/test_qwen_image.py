"""The Qwen-Image adapter (`flowrl.models.QwenImageModel`) on tiny random QwenImagePipelines built offline (a tiny
Qwen2.5-VL text encoder with a byte-level BPE tokenizer trained here on the pipeline's prompt template): it samples as
the stock pipeline does (dynamic shift, terminal stretch, true CFG), and trains through the same trainer
(configs/recipes/qwen_image_flow_grpo.yaml shrunk) to a LoRA the stock pipeline loads."""

import json
import math
from pathlib import Path

import pytest
import torch
from conftest import REPO, shape_overrides, tiny_overrides, train_shrunk_recipe

from flowrl.config import ConfigError, load_config
from flowrl.models import QwenImageModel, load_model, model_class
from flowrl.trainer import Trainer

PROMPTS = ["a photo of a red star", "a photo of two blue circles and a green square"]  # of different token lengths
SIDE = 32  # px: VAE factor 4, 4 x 4 packed tokens


def build_qwen_tokenizer():
    """A Qwen2Tokenizer (byte-level BPE, Qwen2's pre-tokenizer) of 400 tokens, trained on the pipeline's prompt
    template and the tiny world's prompts, so the template's system prefix is 34 tokens, as with Qwen's own
    tokenizer: ``QwenImagePipeline`` drops exactly that many (``prompt_template_encode_start_idx``)."""
    from tokenizers import Regex, Tokenizer, normalizers, pre_tokenizers
    from tokenizers.models import BPE
    from tokenizers.trainers import BpeTrainer
    from transformers import Qwen2Tokenizer
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    from flowrl.tiny.prompts import split

    text = (
        "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, "
        "spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    bpe = Tokenizer(BPE())
    bpe.normalizer = normalizers.NFC()
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    train, test = split(0)
    bpe.train_from_iterator(
        [text.format(m["prompt"]) for m in train + test] * 3,
        BpeTrainer(
            vocab_size=400,
            special_tokens=specials,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    model = json.loads(bpe.to_str())["model"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    return Qwen2Tokenizer(vocab=model["vocab"], merges=merges, additional_special_tokens=specials[1:])


def build_random_qwen_image_pipeline(folder: Path) -> Path:
    """Save a random-weight QwenImagePipeline to ``folder``: a 1-layer Qwen2.5-VL text encoder (hidden 32, a 1-block
    vision tower it never uses), a Qwen-Image VAE of factor 4 with 4 latent channels, a 1-block Qwen-Image transformer
    and Qwen-Image's scheduler config (dynamic shift 0.5..0.9 over 256..8192 tokens, shift_terminal 0.02)."""
    from diffusers import (
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
        QwenImagePipeline,
        QwenImageTransformer2DModel,
    )
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(0)
    tok = build_qwen_tokenizer()
    n = len(tok)
    te = Qwen2_5_VLForConditionalGeneration(
        Qwen2_5_VLConfig(
            text_config=dict(
                vocab_size=n,
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=1,
                num_attention_heads=2,
                num_key_value_heads=1,
                max_position_embeddings=1024,
                bos_token_id=None,
                eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
            ),
            vision_config=dict(
                depth=1,
                hidden_size=16,
                intermediate_size=32,
                num_heads=2,
                out_hidden_size=32,
                fullatt_block_indexes=[0],
                patch_size=2,
                window_size=8,
            ),
            image_token_id=n + 1,
            video_token_id=n + 2,
            vision_start_token_id=n + 3,
            vision_end_token_id=n + 4,
        )
    )
    vae = AutoencoderKLQwenImage(
        base_dim=8,
        z_dim=4,
        dim_mult=[1, 2, 2],
        num_res_blocks=1,
        temperal_downsample=[False, True],
        latents_mean=[0.1, -0.2, 0.3, 0.0],
        latents_std=[1.5, 0.8, 1.2, 2.0],
    )
    dit = QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=16,
        out_channels=4,
        num_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        axes_dims_rope=(4, 6, 6),
    )
    scheduler = FlowMatchEulerDiscreteScheduler(
        base_image_seq_len=256,
        base_shift=0.5,
        max_image_seq_len=8192,
        max_shift=0.9,
        shift=1.0,
        shift_terminal=0.02,
        time_shift_type="exponential",
        use_dynamic_shifting=True,
    )
    pipe = QwenImagePipeline(scheduler=scheduler, vae=vae, text_encoder=te, tokenizer=tok, transformer=dit)
    pipe.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def qwen(tmp_path_factory) -> Path:
    return build_random_qwen_image_pipeline(tmp_path_factory.mktemp("random-qwen-image"))


def _stock_images(
    folder: Path, model: QwenImageModel, num_steps: int, guidance_scale: float, lora=None
) -> torch.Tensor:
    """The stock QwenImagePipeline's images (its schedule; true CFG against "" above 1) from the noise of
    `flowrl.evaluation.generate` (seeds 0, 1)."""
    from diffusers import QwenImagePipeline

    pipe = QwenImagePipeline.from_pretrained(folder)
    if lora is not None:
        pipe.load_lora_weights(str(lora))
    c, h, w = model.latent_shape
    noise = torch.stack([torch.randn(model.latent_shape, generator=torch.Generator().manual_seed(s)) for s in (0, 1)])
    with torch.no_grad():
        return pipe(
            PROMPTS,
            negative_prompt="" if guidance_scale > 1 else None,
            true_cfg_scale=guidance_scale,
            latents=pipe._pack_latents(noise, 2, c, h, w),
            num_inference_steps=num_steps,
            height=SIDE,
            width=SIDE,
            max_sequence_length=model.max_sequence_length,
            output_type="pt",
        ).images


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

    train, test = prompt_files
    preset = load_config(REPO / "configs" / "recipes" / "qwen_image_flow_grpo.yaml")
    over = tiny_overrides(
        qwen,
        train,
        test,
        tmp_path / "run",
        **{
            "run.mixed_precision": "no",
            "model.dtype": "float32",
            "model.resolution": SIDE,
            "model.max_sequence_length": 64,
            "rewards.pickscore": "null",
            "rewards.jpeg_compressibility.weight": 1.0,
            "sampling.group_size": 4,
            "sampling.batch_size": 8,
            "train.minibatch_size": 8,
            "train.micro_batch_size": "null",
            "train.gradient_checkpointing": False,
            **shape_overrides(preset),
        },
    )
    cfg = load_config(REPO / "configs" / "recipes" / "qwen_image_flow_grpo.yaml", over)
    assert cfg.sampling.window.size == 2 and cfg.sampling.noise_level == 1.2 and cfg.sampling.guidance_scale == 4.0
    trainer = Trainer(cfg)
    assert isinstance(trainer.model, QwenImageModel) and trainer.cfg.sampling.shift == pytest.approx(
        trainer.model.shift
    )
    train_shrunk_recipe(trainer)
    # the saved LoRA, loaded by the stock pipeline, samples what the trained adapter samples
    ours = generate(trainer.model, PROMPTS, [0, 1], num_steps=3, guidance_scale=4.0)
    stock = _stock_images(qwen, trainer.model, 3, 4.0, lora=tmp_path / "run" / "lora")
    base = _stock_images(qwen, trainer.model, 3, 4.0)
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
    metrics = [json.loads(line) for line in (tmp_path / "r/metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 2 and all(m["policy/optimizer_steps"] > 0 for m in metrics)
