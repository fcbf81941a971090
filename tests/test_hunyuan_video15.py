"""The HunyuanVideo 1.5 adapter (`flowrl.models.HunyuanVideo15Model`) on tiny random HunyuanVideo15Pipelines built
offline (a 2-layer Qwen2.5-VL text model with a byte-level BPE tokenizer trained on the pipeline's chat template, a
1-layer ByT5 encoder with the byte tokenizer, HunyuanVideo15Transformer3DModel, AutoencoderKLHunyuanVideo15, the
ClassifierFreeGuidance guider): what is special to HunyuanVideo 1.5. The conformance suite (tests/test_conformance.py,
family ``HunyuanVideo15Model``; its slow checks with CI=true) checks sampling against the stock pipeline, the ratio,
resume, LoRA and full fine-tune export."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import REPO, shrink_recipe, tiny_overrides, tiny_pipeline, train_shrunk_recipe
from families import FAMILIES, HUNYUAN_VIDEO15_RECIPE
from tiny_pipelines.common import noise
from tiny_pipelines.hunyuan_video15 import (
    PROMPTS,
    build_random_hunyuan_video15_pipeline,
    stock_hunyuan_video15,
    system_message,
)

from flowrl.config import ConfigError, load_config
from flowrl.models import HunyuanVideo15Model, load_model, model_class
from flowrl.models.hunyuan_video15 import HunyuanVideo15PromptEmbeds
from flowrl.trainer import Trainer

SIDE, FRAMES, TOKENS = 32, 5, 16  # 32 px, 5 frames: latents (4, 2, 4, 4); 16 Qwen tokens after the crop


hv15 = tiny_pipeline("hv15", build_random_hunyuan_video15_pipeline)


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
    'Text "GO". '), and they condition the transformer; the ByT5 tokens are capped at max_sequence_length (the stock
    pipeline pads them to 256), which changes no velocity: the transformer masks the padding out."""
    from diffusers import HunyuanVideo15Pipeline

    model = _model(hv15)
    pipe = model.pipe
    prefix = f"<|im_start|>system\n{system_message()}<|im_end|>\n<|im_start|>user\n"
    assert len(pipe.tokenizer(prefix).input_ids) == pipe.prompt_template_encode_start_idx == 108
    emb = model.encode(["", *PROMPTS])
    assert emb.embeds.shape == (3, TOKENS, 32) and emb.mask.shape == (3, TOKENS) and emb.pooled.shape == (3, 0)
    glyphs = min(256, TOKENS)
    assert emb.embeds_2.shape == (3, glyphs, 32) and emb.mask_2.shape == (3, glyphs)
    tail = len(pipe.tokenizer(" <|im_end|>\n<|im_start|>assistant\n").input_ids)  # "" is templated as " "
    assert emb.mask.sum(1).tolist()[0] == tail < emb.mask.sum(1).tolist()[1]
    stock = HunyuanVideo15Pipeline.from_pretrained(hv15)
    stock.tokenizer_max_length = TOKENS
    embeds, mask, embeds_2, mask_2 = stock.encode_prompt(["", *PROMPTS], batch_size=3)
    torch.testing.assert_close(emb.embeds, embeds, rtol=0, atol=1e-6)
    assert embeds_2.shape[1] == 256 and not mask_2[:, glyphs:].any()  # the stock padding beyond the cap
    torch.testing.assert_close(emb.embeds_2, embeds_2[:, :glyphs], rtol=0, atol=1e-6)
    assert emb.mask.tolist() == mask.long().tolist() and emb.mask_2.tolist() == mask_2[:, :glyphs].long().tolist()
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
    padded = HunyuanVideo15PromptEmbeds(row.embeds, row.pooled, row.mask, embeds_2[2:].float(), mask_2[2:].long())
    with torch.no_grad():
        v = model.velocity(x, t, row, None, 1.0)
        assert (v - model.velocity(x, t, no_glyph, None, 1.0)).abs().max() > 1e-4
        torch.testing.assert_close(v, model.velocity(x, t, padded, None, 1.0), rtol=0, atol=1e-5)


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
    settings = {**FAMILIES["HunyuanVideo15Model"].model_settings, **HUNYUAN_VIDEO15_RECIPE}
    trainer = Trainer(shrink_recipe("hunyuan_video15_flow_grpo", hv15, video_prompts, tmp_path / "run", **settings))
    assert isinstance(trainer.model, HunyuanVideo15Model) and trainer.cfg.sampling.shift == 5.0
    train_shrunk_recipe(trainer)
    assert (tmp_path / "run" / "lora" / "pytorch_lora_weights.safetensors").is_file()
