"""The FLUX.1 Kontext adapter (`flowrl.models.FluxKontextModel`) on tiny random FluxKontextPipelines: a source image
per prompt (the prompt record's "image"), sampled as the stock pipeline samples an edit, given to the rewards, and
trained through the same trainer (configs/recipes/flux_kontext_grpo.yaml shrunk) to a LoRA the stock pipeline loads."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import REPO, build_random_flux_pipeline, record_reward_metadata, tiny_overrides, train_shrunk_recipe

from flowrl.config import load_config
from flowrl.data import read_jsonl, write_jsonl
from flowrl.models import FluxKontextModel, FluxModel, load_model, model_class
from flowrl.trainer import Trainer

PROMPTS = ["a photo of a red star", "a photo of two circles"]
SIDE = 32  # px: the tiny pipelines' resolution (VAE factor 4, 4 x 4 packed tokens)


def build_random_kontext_pipeline(folder: Path, guidance_embeds: bool = True) -> Path:
    """Save a random-weight FluxKontextPipeline to ``folder``: the components of conftest's tiny FLUX pipeline."""
    from diffusers import FluxKontextPipeline, FluxPipeline

    flux = build_random_flux_pipeline(folder.parent / f"{folder.name}-flux", guidance_embeds=guidance_embeds)
    FluxKontextPipeline(**FluxPipeline.from_pretrained(flux).components).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def kontext(tmp_path_factory) -> Path:
    return build_random_kontext_pipeline(tmp_path_factory.mktemp("random-kontext") / "pipe")


@pytest.fixture(scope="module")
def edit_prompts(tmp_path_factory) -> tuple[Path, Path]:
    """Train and test prompt files of the tiny world's prompts, each with a random 32 px source image (a path relative
    to the file)."""
    from PIL import Image

    from flowrl.tiny.prompts import split

    folder = tmp_path_factory.mktemp("edit-prompts")
    (folder / "sources").mkdir()
    rng = np.random.default_rng(0)
    files = []
    for name, metas in zip(("train", "test"), split(0)):
        records = []
        for i, m in enumerate(metas[:12]):
            image = f"sources/{name}{i}.png"
            Image.fromarray(rng.integers(0, 256, (SIDE, SIDE, 3), dtype=np.uint8)).save(folder / image)
            records.append({**m, "image": image})
        write_jsonl(records, folder / f"{name}.jsonl")
        files.append(folder / f"{name}.jsonl")
    return files[0], files[1]


def _stock_images(
    folder: Path, model: FluxKontextModel, metas: list[dict], num_steps: int, lora=None, **kwargs
) -> torch.Tensor:
    """The stock FluxKontextPipeline's edits of the records' source images, with its own schedule, from the noise of
    `flowrl.evaluation.generate` (seeds 0, 1)."""
    from diffusers import FluxKontextPipeline
    from PIL import Image

    pipe = FluxKontextPipeline.from_pretrained(folder)
    if lora is not None:
        pipe.load_lora_weights(str(lora))
    c, h, w = model.latent_shape
    noise = torch.stack([torch.randn(model.latent_shape, generator=torch.Generator().manual_seed(s)) for s in (0, 1)])
    sources = [Image.open(m["image"]).convert("RGB") for m in metas]
    with torch.no_grad():
        return pipe(
            prompt=[m["prompt"] for m in metas],
            image=sources,
            latents=pipe._pack_latents(noise, 2, c, h, w),
            num_inference_steps=num_steps,
            height=SIDE,
            width=SIDE,
            max_area=SIDE * SIDE,
            _auto_resize=False,
            max_sequence_length=model.max_sequence_length,
            output_type="pt",
            **kwargs,
        ).images


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
    stock = _stock_images(kontext, model, metas, 3, guidance_scale=2.5)
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
    stock = _stock_images(folder, model, metas, 3, true_cfg_scale=4.5, negative_prompt="")
    torch.testing.assert_close(ours, stock, rtol=0, atol=1e-4)


def test_kontext_recipe_trains_rewards_see_the_source_and_the_lora_loads_in_stock(tmp_path, kontext, edit_prompts):
    """configs/recipes/flux_kontext_grpo.yaml, shrunk onto the tiny random Kontext pipeline (the real-GenEval reward swapped for
    JPEG compressibility, which needs no download)."""
    from flowrl.evaluation import generate

    train, test = edit_prompts
    over = tiny_overrides(
        kontext,
        train,
        test,
        tmp_path / "run",
        **{
            "run.mixed_precision": "no",
            "model.dtype": "float32",
            "model.resolution": SIDE,
            "model.max_sequence_length": 8,
            "rewards.geneval": "null",
            "rewards.jpeg_compressibility.weight": 1.0,
            "sampling.group_size": 4,
            "sampling.batch_size": 8,
            "train.minibatch_size": 8,
            "train.micro_batch_size": "null",
        },
    )
    cfg = load_config(REPO / "configs" / "recipes" / "flux_kontext_grpo.yaml", over)
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
    stock = _stock_images(kontext, trainer.model, metas, 3, lora=tmp_path / "run" / "lora", guidance_scale=2.5)
    base = _stock_images(kontext, trainer.model, metas, 3, guidance_scale=2.5)
    assert (stock - base).abs().max() > 1e-4  # the LoRA changed the model
    torch.testing.assert_close(ours, stock, rtol=0, atol=1e-4)


# every method of 2026 on every family (CI): tests/test_conformance.py
@pytest.mark.parametrize("preset", ["dgpo"])
def test_new_methods_train_on_editing_prompts(preset, tmp_path, kontext, edit_prompts):
    """The forward-process methods of 2026 and GARDO take Kontext's source images through the prompt table."""
    extra = {
        "run.mixed_precision": "no",
        "model.dtype": "float32",
        "model.resolution": SIDE,
        "model.max_sequence_length": 8,
        "rewards.geneval": "null",
        "rewards.jpeg_compressibility.weight": 1.0,
        "sampling.group_size": 4,
        "sampling.guidance_scale": 2.5,
        "train.minibatch_size": 8,
        "train.gardo.auxiliary": "[]",
    }
    over = tiny_overrides(kontext, *edit_prompts, tmp_path / "run", **extra)
    trainer = Trainer(load_config(REPO / "configs" / f"{preset}.yaml", over))
    assert isinstance(trainer.model, FluxKontextModel)
    trainer.train()
    metrics = [json.loads(line) for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 2 and all(m["policy/optimizer_steps"] > 0 for m in metrics)
