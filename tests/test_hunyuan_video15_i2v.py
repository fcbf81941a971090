"""The HunyuanVideo 1.5 image-to-video adapter (`flowrl.models.HunyuanVideo15ImageToVideoModel`) on tiny random
HunyuanVideo15ImageToVideoPipelines built offline (the text-to-video pipeline's prompt components, a cheaper
AutoencoderKLHunyuanVideo15 compressing 4x in space and time, an image-to-video HunyuanVideo15Transformer3DModel, a
1-layer SigLIP vision tower and its processor): what is special to the family, the source frame from the prompt record,
its refusals and the recipe (configs/recipes/hunyuan_video15_i2v_flow_grpo.yaml) shrunk to two iterations. The conformance
suite (tests/test_conformance.py -k HunyuanVideo15ImageToVideoModel) checks sampling against the stock pipeline in the
default run and the rest with CI=true; the tests here that build a pipeline run with CI=true too."""

import json
from pathlib import Path

import pytest
import torch
from conftest import REPO, record_reward_metadata, shrink_recipe, tiny_overrides, tiny_pipeline, train_shrunk_recipe
from families import FAMILIES, HUNYUAN_VIDEO15_RECIPE
from tiny_pipelines.common import noise
from tiny_pipelines.hunyuan_video15_i2v import build_random_hunyuan_video15_i2v_pipeline, stock_hunyuan_video15_i2v

from flowrl.config import ConfigError, load_config
from flowrl.data import read_jsonl
from flowrl.models import HunyuanVideo15ImageToVideoModel, load_model, model_class
from flowrl.models.hunyuan_video15 import HunyuanVideo15I2VPromptEmbeds
from flowrl.trainer import Trainer

SIDE, FRAMES, TOKENS = 16, 5, 16  # 16 px, 5 frames: latents (4, 2, 4, 4), condition (5, 2, 4, 4); 16 Qwen tokens


def _config_folder(folder: Path, index: dict | None = None, transformer: dict | None = None) -> Path:
    """A pipeline folder of configs only (no weights): ``model_index.json`` of an image-to-video pipeline and a
    transformer config, each updated with the given entries (what :meth:`check_layout` reads)."""
    base = {
        "_class_name": "HunyuanVideo15ImageToVideoPipeline",
        "image_encoder": ["transformers", "SiglipVisionModel"],
    }
    base["feature_extractor"] = ["transformers", "SiglipImageProcessor"]
    (folder / "transformer").mkdir(parents=True)
    (folder / "model_index.json").write_text(json.dumps({**base, **(index or {})}))
    (folder / "transformer" / "config.json").write_text(json.dumps({"in_channels": 65, **(transformer or {})}))
    return folder


def test_folder_layout_refusals_name_the_folder(tmp_path):
    """No weights: a folder without the SigLIP encoder or its processor, or with a MeanFlow (step-distilled)
    transformer, is refused naming the folder; the image-to-video folder picks this adapter."""
    ok = _config_folder(tmp_path / "ok")
    HunyuanVideo15ImageToVideoModel.check_layout(ok)
    assert model_class(ok) is HunyuanVideo15ImageToVideoModel
    for name, index, transformer, match in (
        ("noclip", {"image_encoder": [None, None]}, None, "has no image_encoder: .* encodes the source image"),
        ("nofe", {"feature_extractor": [None, None]}, None, "has no feature_extractor"),
        ("meanflow", None, {"use_meanflow": True}, "sets use_meanflow .* not built in flowrl"),
    ):
        folder = _config_folder(tmp_path / name, index, transformer)
        with pytest.raises(ValueError, match=f"{name}.*{match}"):
            HunyuanVideo15ImageToVideoModel.check_layout(folder)


hv15_i2v = tiny_pipeline("hv15_i2v", build_random_hunyuan_video15_i2v_pipeline)


def _model(folder: Path, **kwargs) -> HunyuanVideo15ImageToVideoModel:
    return load_model(folder, **{"max_sequence_length": TOKENS, "resolution": SIDE, "num_frames": FRAMES, **kwargs})


@pytest.mark.slow
def test_the_source_frame_conditions_the_video(hv15_i2v, i2v_prompts):
    """The condition is the source's VAE latents in latent frame 0 and a mask of that frame, the image tokens its SigLIP
    states; each record's own source conditions its video; a record without one starts from the blank frame, as the
    stock pipeline given that frame; a batch mixing rows with and without image tokens gives each row its velocity
    alone (the transformer masks image tokens out only when all rows' are zero)."""
    from flowrl.evaluation import generate

    model = _model(hv15_i2v)
    metas = read_jsonl(i2v_prompts[0])[:3]
    table = model.prompt_table(metas[:2])
    assert isinstance(table, HunyuanVideo15I2VPromptEmbeds) and model.latent_shape == (4, 2, 4, 4)
    assert table.condition.shape == (3, 5, 2, 4, 4) and table.image.shape == (3, 4, 16)
    assert torch.equal(table.condition[1:, 4, 0], torch.ones(2, 4, 4)) and not table.condition[1:, :, 1].any()
    assert not table.condition[0].any() and not table.image[0].any() and table.image[1:].abs().amin() > 0
    pipe = model.pipe
    source = pipe.video_processor.resize(model.read_source(metas[0]["image"]), SIDE, SIDE, resize_mode="crop")
    pixels = pipe.video_processor.preprocess(source, SIDE, SIDE)[:, :, None]  # (1, 3, 1, 16, 16) in [-1, 1]
    with torch.no_grad():
        latents = pipe.vae.encode(pixels).latent_dist.mode() * pipe.vae.config.scaling_factor  # (1, 4, 1, 4, 4)
    torch.testing.assert_close(table.condition[1, :4, :1], latents[0], rtol=0, atol=1e-6)
    prompts = [m["prompt"] for m in metas[:2]]
    ours = generate(model, prompts, [0, 1], 2, 6.0, metas=metas[:2])
    swapped = [{**metas[0], "image": metas[1]["image"]}, {**metas[1], "image": metas[2]["image"]}]
    assert (generate(model, prompts, [0, 1], 2, 6.0, metas=swapped) - ours).abs().amax(dim=(1, 2, 3, 4)).min() > 1e-3
    blank = generate(model, prompts[:1], [0], 2, 6.0)  # the prompt alone: the blank frame
    stock = stock_hunyuan_video15_i2v(hv15_i2v, model, [{"prompt": prompts[0]}], noise(model, 1), 2, 6.0)
    torch.testing.assert_close(blank, stock, rtol=0, atol=1e-4)
    x, t = torch.randn(2, *model.latent_shape, generator=torch.Generator().manual_seed(0)), torch.tensor([0.7, 0.4])
    rows = table[torch.tensor([0, 1])]  # row 0 has no image tokens, row 1 has its source's
    with torch.no_grad():
        both = model.velocity(x, t, rows, None, 1.0)
        alone = [model.velocity(x[i : i + 1], t[i : i + 1], table[torch.tensor([i])], None, 1.0) for i in (0, 1)]
    torch.testing.assert_close(both, torch.cat(alone), rtol=0, atol=1e-6)


@pytest.mark.slow
def test_config_errors_name_the_setting(hv15_i2v, tmp_path, i2v_prompts):
    """A step-distilled (MeanFlow) folder and a source that is not an image are refused naming the setting or file."""
    import shutil

    meanflow = tmp_path / "meanflow"
    shutil.copytree(hv15_i2v, meanflow)
    config = json.loads((meanflow / "transformer" / "config.json").read_text())
    (meanflow / "transformer" / "config.json").write_text(json.dumps({**config, "use_meanflow": True}))
    over = tiny_overrides(
        meanflow,
        *i2v_prompts,
        tmp_path / "run",
        **{"model.resolution": SIDE, "model.num_frames": FRAMES, "rewards.geneval": "null"},
    )
    with pytest.raises(ConfigError, match="^config key 'model.path': .*use_meanflow"):
        Trainer(load_config(None, over))
    (tmp_path / "notes.png").write_text("not an image")
    with pytest.raises(ValueError, match="source image .*notes.png cannot be read as an image"):
        _model(hv15_i2v).prompt_table([{"prompt": "a star", "image": str(tmp_path / "notes.png")}])


@pytest.mark.slow
def test_hunyuan_video15_i2v_recipe_trains_and_the_rewards_see_the_source(tmp_path, hv15_i2v, i2v_prompts):
    """configs/recipes/hunyuan_video15_i2v_flow_grpo.yaml shrunk onto the tiny pipeline (PickScore over a frame swapped for
    brightness, which needs no download; its 8-step SDE window of 16 steps becomes 1 of 3): two iterations with the
    PPO ratio exactly 1 before each first step, the LoRA moved, every reward call given the records' sources."""
    recipe = load_config(REPO / "configs" / "recipes" / "hunyuan_video15_i2v_flow_grpo.yaml")
    s, t = recipe.sampling, recipe.train
    assert (recipe.model.num_frames, recipe.model.resolution, recipe.model.lora_rank) == (5, 480, 64)
    assert (s.num_steps, s.kernel, s.noise_level, s.shift, s.guidance_scale) == (16, "flow_sde", 0.25, 5.0, 1.0)
    assert (s.group_size, s.window.size, s.window.schedule) == (24, 8, "fixed")
    assert (t.learning_rate, t.clip_range, t.adv_std) == (1e-5, 1e-4, "global")
    settings = {**FAMILIES["HunyuanVideo15ImageToVideoModel"].model_settings, **HUNYUAN_VIDEO15_RECIPE}
    trainer = Trainer(
        shrink_recipe("hunyuan_video15_i2v_flow_grpo", hv15_i2v, i2v_prompts, tmp_path / "run", **settings)
    )
    assert isinstance(trainer.model, HunyuanVideo15ImageToVideoModel) and trainer.cfg.sampling.shift == 5.0
    seen = record_reward_metadata(trainer)
    train_shrunk_recipe(trainer)
    assert seen and all(Path(m["image"]).is_file() for m in seen)
