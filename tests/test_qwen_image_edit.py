"""The Qwen-Image-Edit adapters (`flowrl.models.QwenImageEditModel`, `QwenImageEditPlusModel`) on tiny random
QwenImageEditPipelines and QwenImageEditPlusPipelines built offline (a tiny Qwen2.5-VL with a vision tower, a
Qwen2VLProcessor and a byte-level BPE tokenizer trained here on the edit template): a source image per prompt record,
seen by the text encoder and the transformer, sampled as the stock pipeline samples an edit, given to the rewards, and
trained through the same trainer (configs/recipes/qwen_image_edit_flow_grpo.yaml shrunk) to a LoRA the stock pipeline loads."""

from pathlib import Path

import pytest
import torch
from conftest import (
    RECIPE_SIZES,
    WHOLE_MINIBATCHES,
    no_download,
    record_reward_metadata,
    shrink_recipe,
    tiny_overrides,
    tiny_pipeline,
    train_shrunk_recipe,
)
from families import source_prompt_files
from tiny_pipelines.common import noise
from tiny_pipelines.qwen_image_edit import EDIT_SYSTEM, build_random_qwen_image_edit_pipeline, stock_qwen_image_edit

from flowrl.config import ConfigError, load_config
from flowrl.data import read_jsonl
from flowrl.models import QwenImageEditModel, QwenImageEditPlusModel, QwenImageModel, load_model, model_class
from flowrl.trainer import Trainer

SIDE = 32  # px of the edited images: VAE factor 4, 4 x 4 packed tokens
SOURCE = 64  # px: the tests' source_resolution; a square source -> 64 x 64 px (8 x 8 tokens), a 2:1 one -> 96 x 32


edit = tiny_pipeline("edit", build_random_qwen_image_edit_pipeline)
plus = tiny_pipeline("plus", build_random_qwen_image_edit_pipeline, plus=True)


@pytest.fixture(scope="module")
def edit_prompts(tmp_path_factory) -> tuple[Path, Path]:
    """Train and test prompt files of the tiny world's prompts (12 each), each with a random source image: even
    records 32 x 32 px, odd ones 48 x 24 (2:1, so a batch holds sources of two shapes)."""
    sizes = lambda i: [(48, 24)] if i % 2 else [(32, 32)]  # noqa: E731  (width, height)
    return source_prompt_files(tmp_path_factory.mktemp("edit-prompts"), sizes)


def test_adapters_from_model_index_and_bad_sources(edit, plus, edit_prompts, tmp_path):
    from diffusers import QwenImageEditPipeline

    assert model_class(edit) is QwenImageEditModel and model_class(plus) is QwenImageEditPlusModel
    assert issubclass(QwenImageEditPlusModel, QwenImageEditModel) and issubclass(QwenImageEditModel, QwenImageModel)
    pipe = QwenImageEditPipeline.from_pretrained(edit)
    assert len(pipe.tokenizer(EDIT_SYSTEM).input_ids) == pipe.prompt_template_encode_start_idx == 64
    train, _ = edit_prompts
    assert read_jsonl(train)[1]["image"] == str((train.parent / "sources" / "train1.png").resolve())  # made absolute
    model = load_model(edit, resolution=SIDE, source_resolution=SOURCE)
    assert model.source_resolution == SOURCE and load_model(plus, resolution=SIDE).source_resolution == 1024
    (tmp_path / "notes.png").write_text("not an image")
    with pytest.raises(ValueError, match="source image .*notes.png cannot be read as an image"):
        model.prompt_table([{"prompt": "a star", "image": str(tmp_path / "notes.png")}])
    from PIL import Image

    Image.new("RGB", (200, 2)).save(tmp_path / "strip.png")
    with pytest.raises(ValueError, match=r"strip.png \(200 x 2 px\) has a side that rounds to 0 px"):
        model.prompt_table([{"prompt": "a star", "image": str(tmp_path / "strip.png")}])
    for bad in (16, 64.0, True):
        with pytest.raises(ValueError, match="source_resolution must be an integer number of pixels >= 32"):
            QwenImageEditModel.check_source_resolution(bad)
    base = {"model.resolution": SIDE, "model.max_sequence_length": 64, "rewards.geneval": "null"}
    for extra, message in (
        ({"model.options.source_resolution": 8}, "'model.options.source_resolution'.*>= 32"),
        (
            {"model.prompt_cache": str(tmp_path / "cache"), "model.text_encoders": "drop_after_cache"},
            "'model.text_encoders'.*source image.*use keep or cpu",
        ),
    ):
        over = tiny_overrides(edit, *edit_prompts, tmp_path / "run", **base, **extra)
        with pytest.raises(ConfigError, match=message):
            Trainer(load_config(None, over))


@pytest.mark.parametrize("family", ["edit", "plus"])
@pytest.mark.parametrize("guidance_scale", [4.0, 1.0])
def test_ode_sampling_equals_the_stock_pipeline(family, guidance_scale, request, edit_prompts):
    """A square and a 2:1 source in one batch (two transformer calls, one per source shape) edit as the stock pipeline
    edits each, with true CFG (each row against the empty prompt with its own source) and without."""
    from flowrl.evaluation import generate

    folder = request.getfixturevalue(family)
    metas = read_jsonl(edit_prompts[0])[:2]
    model = load_model(folder, resolution=SIDE, source_resolution=SOURCE)
    table = model.prompt_table(metas)
    assert table.grid.tolist() == [[0, 0], [8, 8], [4, 12]] and table.image.shape == (3, 64, 16)
    assert model.cfg_rows(guidance_scale) == (2 if guidance_scale > 1 else 1)
    ours = generate(model, [m["prompt"] for m in metas], [0, 1], 3, guidance_scale, metas=metas)
    stock = stock_qwen_image_edit(folder, model, metas, noise(model, 2), 3, guidance_scale)
    assert ours.shape == stock.shape == (2, 3, SIDE, SIDE)
    torch.testing.assert_close(ours, stock, rtol=0, atol=1e-4)


def test_the_source_image_conditions_the_edit_and_batches_mix(edit, edit_prompts):
    from flowrl.evaluation import generate

    model = load_model(edit, resolution=SIDE, source_resolution=SOURCE)
    metas = read_jsonl(edit_prompts[0])[:4]
    prompts = [m["prompt"] for m in metas[:2]]
    ours = generate(model, prompts, [0, 1], 3, 4.0, metas=metas[:2])
    swapped = [{**metas[0], "image": metas[2]["image"]}, {**metas[1], "image": metas[3]["image"]}]
    assert (generate(model, prompts, [0, 1], 3, 4.0, metas=swapped) - ours).abs().amax(dim=(1, 2, 3)).min() > 1e-4
    text_only = generate(model, prompts, [0, 1], 3, 4.0)  # the records without their source: text-to-image
    assert (text_only - ours).abs().amax(dim=(1, 2, 3)).min() > 1e-3
    mixed = generate(model, prompts, [0, 1], 3, 4.0, metas=[metas[0], {"prompt": prompts[1]}])
    torch.testing.assert_close(mixed, torch.stack([ours[0], text_only[1]]), rtol=0, atol=1e-5)


def test_edit_recipe_trains_rewards_see_the_source_and_the_lora_loads_in_stock(tmp_path, edit, edit_prompts):
    """configs/recipes/qwen_image_edit_flow_grpo.yaml, shrunk onto the tiny random QwenImageEditPipeline (sources at 64 px of
    side; the real-GenEval reward swapped for JPEG compressibility, which needs no download)."""
    from flowrl.evaluation import generate

    train, _ = edit_prompts
    settings = {"model.resolution": SIDE, "model.max_sequence_length": 64, "model.options.source_resolution": SOURCE}
    settings.update({**no_download("geneval"), **RECIPE_SIZES, "train.minibatch_size": 8, **WHOLE_MINIBATCHES})
    cfg = shrink_recipe("qwen_image_edit_flow_grpo", edit, edit_prompts, tmp_path / "run", **settings)
    assert cfg.sampling.guidance_scale == 4.0 and cfg.sampling.noise_level == 1.0 and cfg.sampling.window.size == 0
    trainer = Trainer(cfg)
    assert isinstance(trainer.model, QwenImageEditModel) and trainer.model.source_resolution == SOURCE
    seen = record_reward_metadata(trainer)
    train_shrunk_recipe(trainer)
    assert seen and all(
        Path(m["image"]).is_file() and m["image"].startswith(str(train.parent.resolve())) for m in seen
    )
    # the saved LoRA, loaded by the stock pipeline, edits as the trained adapter does
    metas = read_jsonl(train)[:2]
    model = trainer.model
    ours = generate(model, [m["prompt"] for m in metas], [0, 1], 3, 4.0, metas=metas)
    stock = stock_qwen_image_edit(edit, model, metas, noise(model, 2), 3, 4.0, lora=tmp_path / "run" / "lora")
    base = stock_qwen_image_edit(edit, model, metas, noise(model, 2), 3, 4.0)
    assert (stock - base).abs().max() > 1e-4  # the LoRA changed the model
    torch.testing.assert_close(ours, stock, rtol=0, atol=1e-4)
