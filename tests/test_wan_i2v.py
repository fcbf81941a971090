"""The Wan image-to-video adapter (`flowrl.models.WanImageToVideoModel`) on tiny random WanImageToVideoPipelines built
offline (the text-to-video pipeline's UMT5, T5 tokenizer, Wan VAE and scheduler; an image-to-video WanTransformer3DModel of
2 x 4 + 4 input channels; for Wan 2.1 a tiny CLIP vision tower and its processor): what is special to the family, the
source frame from the prompt record, its refusals, the Wan 2.2 layout (two experts, no image encoder) and the recipe
(configs/recipes/wan_i2v_flow_grpo.yaml) shrunk to two iterations. The conformance suite (tests/test_conformance.py -k
WanImageToVideoModel) checks the rest on the Wan 2.1 layout."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import (
    REPO,
    no_download,
    record_reward_metadata,
    shrink_recipe,
    tiny_overrides,
    tiny_pipeline,
    train_shrunk_recipe,
)
from tiny_pipelines.common import noise
from tiny_pipelines.wan_i2v import build_random_wan_i2v_pipeline, stock_wan_i2v

from flowrl.config import ConfigError, load_config
from flowrl.data import read_jsonl
from flowrl.models import WanImageToVideoModel, load_model, model_class
from flowrl.trainer import Trainer

SIDE, FRAMES = 16, 5  # 16 px (the pipeline's multiple of 16), 5 frames: latents (4, 2, 4, 4), condition (8, 2, 4, 4)


wan21 = tiny_pipeline("wan21", build_random_wan_i2v_pipeline)
wan22 = tiny_pipeline("wan22", build_random_wan_i2v_pipeline, image_encoder=False, two_experts=True)


def _model(folder: Path, **kwargs) -> WanImageToVideoModel:
    return load_model(folder, resolution=SIDE, num_frames=FRAMES, **kwargs)


def test_the_source_frame_conditions_the_video(wan21, i2v_prompts):
    """Each record's own source (its first frame, its CLIP tokens) conditions its video; a record without one starts from
    the blank frame, as the stock pipeline given that frame (the negative prompt, which sees the row's source: the
    conformance suite)."""
    from flowrl.evaluation import generate

    model = _model(wan21)
    metas = read_jsonl(i2v_prompts[0])[:3]
    table = model.prompt_table(metas[:2])
    assert model.latent_shape == (4, 2, 4, 4) and table.condition.shape == (3, 8, 2, 4, 4)
    assert table.image.shape == (3, 17, 32) and table.embeds.shape == (3, 512, 32)
    assert torch.equal(table.condition[1, :4, 0], torch.ones(4, 4, 4))  # the mask: the source frame given,
    assert not table.condition[1, :4, 1].any()  # the next latent frame drawn
    prompts = [m["prompt"] for m in metas[:2]]
    ours = generate(model, prompts, [0, 1], 3, 4.0, metas=metas[:2])
    swapped = [{**metas[0], "image": metas[1]["image"]}, {**metas[1], "image": metas[2]["image"]}]
    assert (generate(model, prompts, [0, 1], 3, 4.0, metas=swapped) - ours).abs().amax(dim=(1, 2, 3, 4)).min() > 1e-3
    blank = generate(model, prompts, [0, 1], 3, 4.0)  # the prompts alone: the blank frame
    torch.testing.assert_close(
        blank,
        stock_wan_i2v(wan21, model, [{"prompt": p} for p in prompts], noise(model, 2), 3, 4.0),
        rtol=0,
        atol=1e-4,
    )


def test_wan22_layout_two_experts_without_image_encoder(wan22, i2v_prompts):
    """Wan 2.2 I2V A14B's layout: no CLIP tokens (any prompt length), the trained expert chosen by model.expert, both
    experts sample (switching at boundary_ratio) as the stock pipeline does."""
    from flowrl.evaluation import generate

    assert model_class(wan22) is WanImageToVideoModel
    with pytest.raises(ValueError, match="two-expert Wan 2.2 model .* choose the trained expert"):
        _model(wan22)
    model = _model(wan22, expert="low", max_sequence_length=16)  # no CLIP tokens: any prompt length
    assert model.transformer is model.pipe.transformer_2 and model.pipe.image_encoder is None
    metas = read_jsonl(i2v_prompts[0])[:2]
    assert model.prompt_table(metas).image.shape == (3, 0, 0)
    ours = generate(model, [m["prompt"] for m in metas], [0, 1], 4, 3.0, metas=metas)
    stock = stock_wan_i2v(wan22, model, metas, noise(model, 2), 4, 3.0)
    torch.testing.assert_close(ours, stock, rtol=0, atol=1e-4)


def test_refusals_name_the_setting(wan21, tmp_path, i2v_prompts):
    assert WanImageToVideoModel.check_resolution(wan21, None) == 256  # what the rotary embedding covers, /16
    with pytest.raises(
        ValueError,
        match=r"resolution 24 px .*multiple of 16 \(VAE spatial compression 4 x patch size 2 and the pipeline's 16\)",
    ):
        WanImageToVideoModel.check_resolution(wan21, 24)
    with pytest.raises(ValueError, match="max_sequence_length must be 512 .*CLIP image tokens"):
        _model(wan21, max_sequence_length=16)
    model = _model(wan21)
    (tmp_path / "notes.png").write_text("not an image")
    with pytest.raises(ValueError, match="source image .*notes.png cannot be read as an image"):
        model.prompt_table([{"prompt": "a star", "image": str(tmp_path / "notes.png")}])
    for name, change, message in (
        ("ti2v", {"model_index.json": {"expand_timesteps": True}}, "expand_timesteps .* not built"),
        ("t2v", {"transformer/config.json": {"in_channels": 4}}, "takes 4 channels, not the 12 of image-to-video"),
        ("noclip", {"model_index.json": {"image_encoder": [None, None]}}, "image_dim 32.* no image_encoder"),
    ):
        folder = tmp_path / name
        shutil.copytree(wan21, folder)
        for file, values in change.items():
            config = json.loads((folder / file).read_text())
            (folder / file).write_text(json.dumps({**config, **values}))
        with pytest.raises(ValueError, match=message):
            WanImageToVideoModel.check_layout(folder)
    over = tiny_overrides(
        tmp_path / "ti2v",
        *i2v_prompts,
        tmp_path / "run",
        **{"model.resolution": SIDE, "model.num_frames": FRAMES, "rewards.geneval": "null"},
    )
    with pytest.raises(ConfigError, match="'model.path'.*expand_timesteps"):
        Trainer(load_config(None, over))
    over = tiny_overrides(
        wan21,
        *i2v_prompts,
        tmp_path / "run",
        **{"model.resolution": SIDE, "model.num_frames": FRAMES, "model.max_sequence_length": 64},
    )
    with pytest.raises(ConfigError, match="'model.max_sequence_length'.* must be 512"):
        Trainer(load_config(None, over))


def test_wan_i2v_recipe_trains_and_the_rewards_see_the_source(tmp_path, wan21, i2v_prompts):
    """configs/recipes/wan_i2v_flow_grpo.yaml shrunk onto the tiny Wan 2.1 I2V pipeline (its 1-step random SDE window and
    guidance 5 kept; PickScore over the frames swapped for brightness, which needs no download)."""
    recipe = load_config(REPO / "configs" / "recipes" / "wan_i2v_flow_grpo.yaml")
    assert (recipe.model.num_frames, recipe.model.resolution, recipe.sampling.num_steps) == (5, 240, 10)
    assert recipe.sampling.window.size == 1 and recipe.sampling.guidance_scale == 5.0
    settings = {"model.dtype": "float32", "model.resolution": SIDE, "model.num_frames": FRAMES}
    settings.update({**no_download("frames", "geneval", reward="families:brightness"), "sampling.num_steps": 5})
    settings.update({"sampling.group_size": 2, "sampling.batch_size": 4, "train.minibatch_size": 2})
    settings["train.ema_decay"] = 0.0
    trainer = Trainer(shrink_recipe("wan_i2v_flow_grpo", wan21, i2v_prompts, tmp_path / "run", **settings))
    assert isinstance(trainer.model, WanImageToVideoModel) and trainer.cfg.sampling.shift == 3.0
    seen = record_reward_metadata(trainer)
    train_shrunk_recipe(trainer)
    assert seen and all(Path(m["image"]).is_file() for m in seen)
    lora = trainer.model.transformer.peft_config["default"]
    assert {"ffn.net.0.proj", "ffn.net.2", "to_q"} <= set(lora.target_modules)
