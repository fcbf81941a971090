"""The FLUX.1 Kontext adapter (`flowrl.models.FluxKontextModel`) on tiny random FluxKontextPipelines: a source image
per prompt (the prompt record's "image"), sampled as the stock pipeline samples an edit, given to the rewards, and
trained through the same trainer (configs/recipes/flux_kontext_grpo.yaml shrunk) to a LoRA the stock pipeline loads."""

from pathlib import Path

import pytest
import torch
from conftest import (
    RECIPE_SIZES,
    REPO,
    read_metrics,
    record_reward_metadata,
    shrink_recipe,
    tiny_overrides,
    tiny_pipeline,
    train_shrunk_recipe,
)
from families import IMAGE_TRAIN, prompt_files
from tiny_pipelines.common import noise
from tiny_pipelines.flux_kontext import build_random_kontext_pipeline, stock_flux_kontext

from flowrl.config import load_config
from flowrl.data import read_jsonl, write_jsonl
from flowrl.models import FluxKontextModel, FluxModel, load_model, model_class
from flowrl.trainer import Trainer

PROMPTS = ["a photo of a red star", "a photo of two circles"]
SIDE = 32  # px: the tiny pipelines' resolution (VAE factor 4, 4 x 4 packed tokens)


kontext = tiny_pipeline("kontext", build_random_kontext_pipeline)


@pytest.fixture(scope="module")
def edit_prompts(tmp_path_factory) -> tuple[Path, Path]:
    """Train and test prompt files of the tiny world's prompts, each with a random 32 px source image (a path relative
    to the file): the conformance suite's (:func:`families.prompt_files`)."""
    return prompt_files("edit", tmp_path_factory.mktemp("edit-prompts"))


def test_adapter_and_the_prompt_records_source_image(kontext, edit_prompts, tmp_path):
    assert model_class(kontext) is FluxKontextModel and issubclass(FluxKontextModel, FluxModel)
    train, _ = edit_prompts
    record = read_jsonl(train)[0]
    assert record["image"] == str((train.parent / "sources" / "train0.png").resolve())  # made absolute
    bad = tmp_path / "bad.jsonl"
    write_jsonl([{"prompt": "a star", "image": "missing.png"}], bad)
    with pytest.raises(ValueError, match=r"bad.jsonl:1: 'image' 'missing.png' is not an image file"):
        read_jsonl(bad)
    (tmp_path / "notes.png").write_text("not an image")
    model = load_model(kontext, max_sequence_length=8, resolution=SIDE)
    with pytest.raises(ValueError, match="source image .*notes.png cannot be read as an image"):
        model.prompt_table([{"prompt": "a star", "image": str(tmp_path / "notes.png")}])
    several = {"prompt": "a star", "images": [record["image"], record["image"]]}  # FLUX.2's multi-reference records
    with pytest.raises(ValueError, match=r"'a star' names several reference images .*FLUX.1 Kontext takes one"):
        model.prompt_table([several])


def test_editing_samples_as_the_stock_pipeline(kontext, edit_prompts):
    from flowrl.evaluation import generate

    metas = read_jsonl(edit_prompts[0])[:2]
    model = load_model(kontext, max_sequence_length=8, resolution=SIDE)
    ours = generate(model, [m["prompt"] for m in metas], [0, 1], num_steps=3, guidance_scale=2.5, metas=metas)
    stock = stock_flux_kontext(kontext, model, metas, noise(model, 2), 3, 2.5)
    assert ours.shape == stock.shape == (2, 3, SIDE, SIDE)
    torch.testing.assert_close(ours, stock, rtol=0, atol=1e-4)
    text_only = generate(model, [m["prompt"] for m in metas], [0, 1], num_steps=3, guidance_scale=2.5)
    assert (text_only - ours).abs().max() > 1e-3  # the source image conditions the edit
    # a batch mixing edits and text-to-image rows: each row as in its own batch
    mixed = generate(
        model,
        [m["prompt"] for m in metas],
        [0, 1],
        num_steps=3,
        guidance_scale=2.5,
        metas=[metas[0], {"prompt": metas[1]["prompt"]}],
    )
    torch.testing.assert_close(mixed, torch.stack([ours[0], text_only[1]]), rtol=0, atol=1e-5)


def test_true_cfg_gives_the_negative_the_source_image(tmp_path, edit_prompts):
    from flowrl.evaluation import generate

    folder = build_random_kontext_pipeline(tmp_path / "cfg", guidance_embeds=False)
    metas = read_jsonl(edit_prompts[0])[:2]
    model = load_model(folder, max_sequence_length=8, resolution=SIDE)
    assert model.cfg_rows(4.5) == 2
    ours = generate(model, [m["prompt"] for m in metas], [0, 1], num_steps=3, guidance_scale=4.5, metas=metas)
    stock = stock_flux_kontext(folder, model, metas, noise(model, 2), 3, 4.5)  # true CFG
    torch.testing.assert_close(ours, stock, rtol=0, atol=1e-4)


def test_kontext_recipe_trains_rewards_see_the_source_and_the_lora_loads_in_stock(tmp_path, kontext, edit_prompts):
    """configs/recipes/flux_kontext_grpo.yaml, shrunk onto the tiny random Kontext pipeline (the real-GenEval reward swapped for
    JPEG compressibility, which needs no download)."""
    from flowrl.evaluation import generate

    train, _ = edit_prompts
    settings = {"model.resolution": SIDE, "model.max_sequence_length": 8, **IMAGE_TRAIN, **RECIPE_SIZES}
    settings.update({"train.minibatch_size": 8, "train.micro_batch_size": "null"})
    cfg = shrink_recipe("flux_kontext_grpo", kontext, edit_prompts, tmp_path / "run", **settings)
    assert cfg.sampling.num_steps == 3 and cfg.sampling.guidance_scale == 2.5 and cfg.sampling.noise_level == 0.9
    trainer = Trainer(cfg)
    assert isinstance(trainer.model, FluxKontextModel)
    seen = record_reward_metadata(trainer)
    train_shrunk_recipe(trainer)
    assert seen and all(
        Path(m["image"]).is_file() and m["image"].startswith(str(train.parent.resolve())) for m in seen
    )
    # the saved LoRA (the recipe's EMA of the weights), loaded by the stock pipeline, edits as the trained adapter does
    metas = read_jsonl(train)[:2]
    with trainer.policy.ema_weights():
        ours = generate(
            trainer.model, [m["prompt"] for m in metas], [0, 1], num_steps=3, guidance_scale=2.5, metas=metas
        )
    model, lora = trainer.model, tmp_path / "run" / "lora"
    stock = stock_flux_kontext(kontext, model, metas, noise(model, 2), 3, 2.5, lora)
    base = stock_flux_kontext(kontext, model, metas, noise(model, 2), 3, 2.5)
    assert (stock - base).abs().max() > 1e-4  # the LoRA changed the model
    torch.testing.assert_close(ours, stock, rtol=0, atol=1e-4)


# every method of 2026 on every family (CI): tests/test_conformance.py
@pytest.mark.parametrize("preset", ["dgpo"])
def test_new_methods_train_on_editing_prompts(preset, tmp_path, kontext, edit_prompts):
    """The forward-process methods of 2026 and GARDO take Kontext's source images through the prompt table."""
    extra = {"model.dtype": "float32", "model.resolution": SIDE, "model.max_sequence_length": 8, **IMAGE_TRAIN}
    extra.update({"sampling.group_size": 4, "sampling.guidance_scale": 2.5, "train.minibatch_size": 8})
    extra["train.gardo.auxiliary"] = "[]"
    over = tiny_overrides(kontext, *edit_prompts, tmp_path / "run", **extra)
    trainer = Trainer(load_config(REPO / "configs" / f"{preset}.yaml", over))
    assert isinstance(trainer.model, FluxKontextModel)
    trainer.train()
    metrics = read_metrics(tmp_path / "run")
    assert len(metrics) == 2 and all(m["policy/optimizer_steps"] > 0 for m in metrics)
