"""The HunyuanVideo 1.5 adapter (`flowrl.models.HunyuanVideo15Model`) on tiny random HunyuanVideo15Pipelines built
offline (a 2-layer Qwen2.5-VL text model with a byte-level BPE tokenizer trained on the pipeline's chat template, a
1-layer ByT5 encoder with the byte tokenizer, HunyuanVideo15Transformer3DModel, AutoencoderKLHunyuanVideo15, the
ClassifierFreeGuidance guider): what is special to HunyuanVideo 1.5. The conformance suite (tests/test_conformance.py,
family ``HunyuanVideo15Model``; its slow checks with CI=true) checks sampling against the stock pipeline, the ratio,
resume, LoRA and full fine-tune export."""

import inspect
import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import REPO, tiny_overrides, train_shrunk_recipe
from families import noise, prompt_files

from flowrl.config import ConfigError, load_config
from flowrl.models import HunyuanVideo15Model, load_model, model_class
from flowrl.models.hunyuan_video15 import HunyuanVideo15PromptEmbeds
from flowrl.trainer import Trainer

PROMPTS = ["a red circle moving left", 'a sign that says "GO" moving up']  # the second has glyph text for ByT5
SIDE, FRAMES, TOKENS = 32, 5, 16  # 32 px, 5 frames: latents (4, 2, 4, 4); 16 Qwen tokens after the crop
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""Qwen2.5-VL's chat template for text-only conversations (its ``<|im_start|>role`` turns)."""


def _system_message() -> str:
    from diffusers import HunyuanVideo15Pipeline

    return inspect.signature(HunyuanVideo15Pipeline._get_mllm_prompt_embeds).parameters["system_message"].default


def build_qwen_chat_tokenizer():
    """A Qwen2Tokenizer (byte-level BPE behind Qwen2's pre-tokenizer, 500 tokens) with :data:`CHAT_TEMPLATE`, trained
    on HunyuanVideo 1.5's system message and the prompts here: the template's part before the prompt is then 108 tokens
    (one per pre-tokenized piece, as with Qwen2.5-VL's own tokenizer), the pipeline's
    ``prompt_template_encode_start_idx``, so the crop leaves the prompt and the template's tail."""
    from tokenizers import Regex, Tokenizer, normalizers, pre_tokenizers
    from tokenizers.models import BPE
    from tokenizers.trainers import BpeTrainer
    from transformers import Qwen2Tokenizer
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    bpe = Tokenizer(BPE())
    bpe.normalizer = normalizers.NFC()
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    texts = [
        f"<|im_start|>system\n{_system_message()}<|im_end|>\n<|im_start|>user\n{p}<|im_end|>\n<|im_start|>assistant\n"
        for p in [*PROMPTS, "two blue squares moving up", "a green star moving right", "blurry static", " "]
    ]
    bpe.train_from_iterator(
        texts * 3,
        BpeTrainer(
            vocab_size=500,
            special_tokens=specials,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    model = json.loads(bpe.to_str())["model"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    tok = Qwen2Tokenizer(vocab=model["vocab"], merges=merges, additional_special_tokens=specials[1:])
    tok.chat_template = CHAT_TEMPLATE
    return tok


def random_hunyuan_video15_text_components() -> dict:
    """The prompt components of a tiny HunyuanVideo 1.5 pipeline (seeded; the pipelines' keyword names): the tokenizer
    above with a 2-layer Qwen2.5-VL text model (hidden 32; the pipeline reads the hidden states two layers below the
    top, here the token embeddings) and a 1-layer T5 encoder (d_model 32) with ByT5's byte tokenizer for the glyph
    text, the flow-matching Euler scheduler at 480p's shift 5 and a ClassifierFreeGuidance guider at 480p's scale 6."""
    from diffusers import ClassifierFreeGuidance, FlowMatchEulerDiscreteScheduler
    from transformers import ByT5Tokenizer, Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel, T5Config, T5EncoderModel

    torch.manual_seed(0)
    tok = build_qwen_chat_tokenizer()
    qwen = Qwen2_5_VLTextModel(
        Qwen2_5_VLTextConfig(
            vocab_size=len(tok),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=2048,
            bos_token_id=None,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
        )
    )
    byt5_tok = ByT5Tokenizer()
    byt5 = T5EncoderModel(
        T5Config(
            vocab_size=len(byt5_tok),
            d_model=32,
            d_kv=8,
            d_ff=64,
            num_layers=1,
            num_heads=4,
            relative_attention_num_buckets=8,
            pad_token_id=byt5_tok.pad_token_id,
            eos_token_id=byt5_tok.eos_token_id,
        )
    )
    return {
        "text_encoder": qwen,
        "tokenizer": tok,
        "text_encoder_2": byt5,
        "tokenizer_2": byt5_tok,
        "scheduler": FlowMatchEulerDiscreteScheduler(shift=5.0),
        "guider": ClassifierFreeGuidance(guidance_scale=6.0),
    }


def build_random_hunyuan_video15_pipeline(folder: Path) -> Path:
    """Save a random-weight HunyuanVideo15Pipeline to ``folder`` (seeded; seconds): the prompt components of
    :func:`random_hunyuan_video15_text_components`, an AutoencoderKLHunyuanVideo15 compressing 8x in space and 4x in
    time into 4 channels with scaling factor 0.9 (so that decoding checks the division) and a 1-block
    HunyuanVideo15Transformer3DModel (in_channels 2 x 4 + 1: the latents, the image-condition latents and their
    mask)."""
    from diffusers import AutoencoderKLHunyuanVideo15, HunyuanVideo15Pipeline, HunyuanVideo15Transformer3DModel

    text = random_hunyuan_video15_text_components()
    vae = AutoencoderKLHunyuanVideo15(
        latent_channels=4,
        block_out_channels=(8, 16, 16, 16),
        layers_per_block=1,
        spatial_compression_ratio=8,
        temporal_compression_ratio=4,
        scaling_factor=0.9,
    )
    dit = HunyuanVideo15Transformer3DModel(
        in_channels=9,
        out_channels=4,
        num_attention_heads=2,
        attention_head_dim=16,
        num_layers=1,
        num_refiner_layers=1,
        mlp_ratio=2.0,
        patch_size=1,
        patch_size_t=1,
        text_embed_dim=32,
        text_embed_2_dim=32,
        image_embed_dim=16,
        rope_axes_dim=(4, 6, 6),
        target_size=64,
        task_type="t2v",
    )
    pipe = HunyuanVideo15Pipeline(transformer=dit, vae=vae, **text)
    pipe.save_pretrained(folder)
    return folder


def stock_hunyuan_video15(
    folder: Path,
    model,
    metas: list[dict],
    latents: torch.Tensor,
    num_steps: int,
    guidance_scale: float,
    negative_prompt: str | None = None,
) -> torch.Tensor:
    """The stock HunyuanVideo15Pipeline's videos ``(B, F, 3, H, W)`` float32 in [0, 1] for the prompt records ``metas``
    from the initial latents ``latents (B, *model.latent_shape)``, at the model's frames, side and prompt length (the
    pipeline's ``tokenizer_max_length``), guided by its guider at ``guidance_scale``
    (``guider.new(guidance_scale=...)``: the pipeline takes no guidance argument). The guider's other settings are the
    folder's. One video per call: the stock VAE cannot decode two at once (diffusers PR #13133)."""
    from diffusers import HunyuanVideo15Pipeline

    pipe = HunyuanVideo15Pipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    pipe.tokenizer_max_length = model.max_sequence_length
    pipe.guider = pipe.guider.new(guidance_scale=guidance_scale)
    videos = []
    with torch.no_grad():
        for meta, start in zip(metas, latents):
            videos.append(
                pipe(
                    meta["prompt"],
                    negative_prompt=negative_prompt,
                    latents=start[None],
                    num_frames=model.num_frames,
                    height=model.resolution,
                    width=model.resolution,
                    num_inference_steps=num_steps,
                    output_type="pt",
                ).frames
            )
    return torch.cat(videos)


@pytest.fixture(scope="module")
def hv15(tmp_path_factory) -> Path:
    return build_random_hunyuan_video15_pipeline(tmp_path_factory.mktemp("random-hunyuan-video15"))


@pytest.fixture(scope="module")
def video_prompts(tmp_path_factory) -> tuple[Path, Path]:
    return prompt_files("video", tmp_path_factory.mktemp("video-prompts"))


def _model(folder: Path, **kwargs) -> HunyuanVideo15Model:
    return load_model(folder, **{"max_sequence_length": TOKENS, "resolution": SIDE, "num_frames": FRAMES, **kwargs})


def _edited(folder: Path, out: Path, component: str, **changes) -> Path:
    """A copy of the pipeline ``folder`` at ``out`` with ``changes`` written into ``component``'s config (``None``
    deletes the component's folder)."""
    shutil.copytree(folder, out, dirs_exist_ok=True)
    name = "guider_config.json" if component == "guider" else "config.json"
    config = json.loads((folder / component / name).read_text())
    (out / component / name).write_text(json.dumps({**config, **changes}))
    return out


def test_prompts_are_the_chat_template_and_the_glyph_text(hv15):
    """The template's part before the prompt is the 108 tokens the pipeline crops; the embeddings are
    encode_prompt's (the empty prompt templated as " "); only a prompt with text in quotes has ByT5 tokens (those of
    'Text "GO". '), and they condition the transformer."""
    from diffusers import HunyuanVideo15Pipeline

    model = _model(hv15)
    pipe = model.pipe
    prefix = f"<|im_start|>system\n{_system_message()}<|im_end|>\n<|im_start|>user\n"
    assert len(pipe.tokenizer(prefix).input_ids) == pipe.prompt_template_encode_start_idx == 108
    emb = model.encode(["", *PROMPTS])
    assert emb.embeds.shape == (3, TOKENS, 32) and emb.mask.shape == (3, TOKENS) and emb.pooled.shape == (3, 0)
    assert emb.embeds_2.shape == (3, 256, 32) and emb.mask_2.shape == (3, 256)
    tail = len(pipe.tokenizer(" <|im_end|>\n<|im_start|>assistant\n").input_ids)  # "" is templated as " "
    assert emb.mask.sum(1).tolist()[0] == tail < emb.mask.sum(1).tolist()[1]
    stock = HunyuanVideo15Pipeline.from_pretrained(hv15)
    stock.tokenizer_max_length = TOKENS
    embeds, mask, embeds_2, mask_2 = stock.encode_prompt(["", *PROMPTS], batch_size=3)
    torch.testing.assert_close(emb.embeds, embeds, rtol=0, atol=1e-6)
    torch.testing.assert_close(emb.embeds_2, embeds_2, rtol=0, atol=1e-6)
    assert emb.mask.tolist() == mask.long().tolist() and emb.mask_2.tolist() == mask_2.long().tolist()
    glyph = pipe.tokenizer_2('Text "GO". ').input_ids  # the glyph text's bytes and </s>
    assert emb.mask_2.sum(1).tolist() == [0, 0, len(glyph)] and (emb.embeds_2[:2] == 0).all()
    with torch.no_grad():
        states = pipe.text_encoder_2(torch.tensor([glyph]))[0][0]
    torch.testing.assert_close(emb.embeds_2[2, : len(glyph)], states, rtol=1e-5, atol=1e-5)
    x, t = torch.randn(1, *model.latent_shape, generator=torch.Generator().manual_seed(0)), torch.tensor([0.7])
    row = emb[torch.tensor([2])]
    no_glyph = HunyuanVideo15PromptEmbeds(
        row.embeds, row.pooled, row.mask, torch.zeros_like(row.embeds_2), torch.zeros_like(row.mask_2)
    )
    with torch.no_grad():
        assert (model.velocity(x, t, row, None, 1.0) - model.velocity(x, t, no_glyph, None, 1.0)).abs().max() > 1e-4


def test_folder_checks_and_config_errors_name_the_setting(hv15, tmp_path, video_prompts):
    assert model_class(hv15) is HunyuanVideo15Model
    assert (
        HunyuanVideo15Model.check_num_frames(hv15, None) == 121 and HunyuanVideo15Model.check_num_frames(hv15, 9) == 9
    )
    with pytest.raises(ValueError, match=r"num_frames 10 does not fit .*expected 4k\+1 frames .* e\.g\. 9"):
        HunyuanVideo15Model.check_num_frames(hv15, 10)
    assert HunyuanVideo15Model.check_resolution(hv15, None) == 64  # the transformer's target_size
    with pytest.raises(ValueError, match=r"resolution 36 px .*multiple of 8 \(VAE spatial compression 8 x patch"):
        HunyuanVideo15Model.check_resolution(hv15, 36)
    assert HunyuanVideo15Model.scheduler_shift(hv15) == 5.0
    assert HunyuanVideo15Model.default_max_sequence_length(hv15) == 1000
    assert HunyuanVideo15Model.check_guider(hv15) == 0.0
    with pytest.raises(ValueError, match="max_sequence_length must be >= 1 for HunyuanVideo 1.5"):
        _model(hv15, max_sequence_length=0)
    with pytest.raises(ValueError, match="one transformer.* leave the expert unset"):
        _model(hv15, expert="high")
    copy = tmp_path / "copy"
    for changes, match in (
        ({"use_original_formulation": True}, "sets use_original_formulation True; flowrl guides as"),
        ({"stop": 0.5}, "sets stop 0.5; flowrl guides as ClassifierFreeGuidance's default stop 1.0"),
        ({"enabled": False}, "sets enabled False"),
        ({"guidance_rescale": 1.5}, r"guidance_rescale must be in \[0, 1\]"),
        ({"_class_name": "AdaptiveProjectedGuidance"}, "is a 'AdaptiveProjectedGuidance'; flowrl samples with"),
    ):
        with pytest.raises(ValueError, match=f"guider_config.json.*{match}"):
            HunyuanVideo15Model.check_guider(_edited(hv15, copy, "guider", **changes))
    _edited(hv15, copy, "transformer", in_channels=4)
    with pytest.raises(ValueError, match=r"takes 4 channels and predicts 4; .* expected 9 in, 4 out"):
        HunyuanVideo15Model.check_channels(copy)
    _edited(hv15, copy, "guider", stop=0.5)
    for folder, key, value, match in (
        (hv15, "model.num_frames", 6, r"4k\+1 frames"),
        (hv15, "model.expert", "low", "one transformer"),
        (hv15, "model.options.true_cfg_scale", 2, "takes no option 'true_cfg_scale'"),
        (copy, "model.path", str(copy), "transformer takes 4 channels|sets stop 0.5"),
    ):
        over = tiny_overrides(folder, *video_prompts, tmp_path / "run", **{key: value, "rewards.geneval": "null"})
        with pytest.raises(ConfigError, match=f"^config key '{key}': .*({match})"):
            Trainer(load_config(None, over))


def test_the_guiders_guidance_rescale_equals_the_stock_pipeline(hv15, tmp_path):
    """A guider config with guidance_rescale (0 in the published folders) is applied as the stock guider applies it."""
    from flowrl.evaluation import generate

    rescaled = _edited(hv15, tmp_path / "rescaled", "guider", guidance_rescale=0.7)
    model = _model(rescaled)
    assert model.guidance_rescale == 0.7
    metas = [{"prompt": PROMPTS[0]}]
    ours = generate(model, [PROMPTS[0]], [0], num_steps=2, guidance_scale=6.0)
    stock = stock_hunyuan_video15(rescaled, model, metas, noise(model, 1), 2, 6.0)
    torch.testing.assert_close(ours, stock, rtol=0, atol=1e-4)
    plain = generate(_model(hv15), [PROMPTS[0]], [0], num_steps=2, guidance_scale=6.0)
    assert (plain - ours).abs().max() > 1e-3


def test_the_lora_loads_into_the_stock_transformer(hv15, tmp_path):
    """HunyuanVideo15Pipeline has no load_lora_weights (diffusers issue #14420): the saved LoRA loads into its
    transformer with load_lora_adapter(prefix="transformer") and gives the adapter's velocity; flowrl loads it back."""
    from diffusers import HunyuanVideo15Pipeline

    model = _model(hv15)
    for p in model.add_lora(2, 4.0):
        p.data.normal_(0, 0.5, generator=torch.Generator().manual_seed(p.numel()))  # B too: the LoRA does something
    model.save_lora(tmp_path / "lora")
    table = model.prompt_table([{"prompt": p} for p in PROMPTS])
    cond, uncond = table[torch.tensor([1, 2])], table[torch.zeros(2, dtype=torch.long)]
    x, t = torch.randn(2, *model.latent_shape, generator=torch.Generator().manual_seed(1)), torch.tensor([0.8, 0.3])
    stock, fresh = _model(hv15), _model(hv15)
    pipe = HunyuanVideo15Pipeline.from_pretrained(hv15)
    stock.pipe, stock.transformer = pipe, pipe.transformer  # the stock transformer under the adapter
    with torch.no_grad():
        base = stock.velocity(x, t, cond, uncond, 6.0)
        pipe.transformer.load_lora_adapter(str(tmp_path / "lora"), prefix="transformer", use_safetensors=True)
        loaded = stock.velocity(x, t, cond, uncond, 6.0)
        fresh.load_lora(tmp_path / "lora")
        ours, again = model.velocity(x, t, cond, uncond, 6.0), fresh.velocity(x, t, cond, uncond, 6.0)
    assert (base - ours).abs().max() > 1e-3
    torch.testing.assert_close(loaded, ours, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(again, ours, rtol=0, atol=1e-6)
    assert not hasattr(fresh.pipe, "load_lora_weights")


def test_hunyuan_video15_recipe_trains_two_iterations(tmp_path, hv15, video_prompts):
    """configs/recipes/hunyuan_video15_flow_grpo.yaml shrunk onto the tiny random pipeline (PickScore swapped for brightness,
    which needs no download; its 8-step SDE window of 16 steps becomes 1 of 3): two iterations with the PPO ratio
    exactly 1 before each first step, the LoRA moved."""
    recipe = load_config(REPO / "configs" / "recipes" / "hunyuan_video15_flow_grpo.yaml")
    s, t = recipe.sampling, recipe.train
    assert (recipe.model.num_frames, recipe.model.resolution, recipe.model.lora_rank) == (5, 480, 64)
    assert (s.num_steps, s.kernel, s.noise_level, s.shift, s.guidance_scale) == (16, "flow_sde", 0.25, 5.0, 1.0)
    assert (s.group_size, s.window.size, s.window.schedule) == (24, 8, "fixed")
    assert (t.learning_rate, t.clip_range, t.adv_std, t.minibatch_size) == (1e-5, 1e-4, "global", 576)
    assert recipe.rewards["frames"].options["reward_options"]["scale"] == 26
    over = tiny_overrides(
        hv15,
        *video_prompts,
        tmp_path / "run",
        **{
            "model.resolution": SIDE,
            "model.num_frames": FRAMES,
            "model.max_sequence_length": TOKENS,
            "model.dtype": "float32",
            "model.lora_rank": 2,
            "rewards.frames": "null",
            "rewards.families:brightness.weight": 1.0,
            "sampling.window.size": 1,
            "sampling.batch_size": 4,
            "train.minibatch_size": 2,
            "train.learning_rate": 1e-3,
            "eval.images_per_tag": 1,
        },
    )
    trainer = Trainer(load_config(REPO / "configs" / "recipes" / "hunyuan_video15_flow_grpo.yaml", over))
    assert isinstance(trainer.model, HunyuanVideo15Model) and trainer.cfg.sampling.shift == 5.0
    train_shrunk_recipe(trainer)
    assert (tmp_path / "run" / "lora" / "pytorch_lora_weights.safetensors").is_file()
