"""The FLUX.2 adapters (`flowrl.models.Flux2KleinModel`, `flowrl.models.Flux2Model`) on tiny random Flux2KleinPipelines
(a tiny 27-layer Qwen3 text encoder, since the pipeline reads hidden states 9, 18 and 27, with the offline tokenizer
and the Qwen3 chat template of tests/tiny_pipelines/text.py) and Flux2Pipelines (a tiny 30-layer Mistral 3 with a
PixtralProcessor built offline) : what is special to FLUX.2. The conformance suite (tests/test_conformance.py,
families ``Flux2KleinModel`` and ``Flux2Model``, and ``Flux2KleinModel-references`` and ``Flux2Model-references`` on
records with reference images) checks sampling against the stock pipelines, the ratio, resume, LoRA and full
fine-tune export."""

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from conftest import (
    RECIPE_SIZES,
    REPO,
    WHOLE_MINIBATCHES,
    no_download,
    shrink_recipe,
    tiny_overrides,
    tiny_pipeline,
    train_shrunk_recipe,
)
from families import prompt_files as write_prompt_files
from tiny_pipelines.flux2 import build_random_flux2_klein_pipeline, build_random_flux2_pipeline

from flowrl.config import ConfigError, load_config
from flowrl.models import Flux2KleinModel, Flux2Model, load_model, model_class
from flowrl.trainer import Trainer

SIDE = 32  # px: VAE factor 4, 8 x 8 latents, 4 x 4 patchified latents (16 tokens)
LENGTH = 64  # prompt tokens: the chat template and the tiny world's prompts fit


klein = tiny_pipeline("klein", build_random_flux2_klein_pipeline)
klein_distilled = tiny_pipeline("klein_distilled", build_random_flux2_klein_pipeline, distilled=True)


def test_adapter_schedule_and_decoding_are_the_pipelines(klein, klein_distilled, tmp_path):
    from diffusers import Flux2KleinPipeline
    from diffusers.pipelines.flux2.pipeline_flux2_klein import compute_empirical_mu

    assert model_class(klein) is Flux2KleinModel and model_class(klein_distilled) is Flux2KleinModel
    model = load_model(klein, resolution=SIDE, max_sequence_length=LENGTH)
    assert model.latent_shape == (16, 4, 4) and load_model(klein, resolution=SIDE).max_sequence_length == 512
    pipe = Flux2KleinPipeline.from_pretrained(klein)
    for steps in (2, 4, 10):  # the shift follows the step count, as compute_empirical_mu
        mu = compute_empirical_mu(16, steps)
        pipe.scheduler.set_timesteps(sigmas=torch.linspace(1.0, 1 / steps, steps).tolist(), mu=mu)
        torch.testing.assert_close(model.sigmas(steps), pipe.scheduler.sigmas.float(), rtol=0, atol=1e-6)
    base, distilled = (Flux2KleinModel.scheduler_shift(p, SIDE) for p in (klein, klein_distilled))
    assert base == pytest.approx(math.exp(compute_empirical_mu(16, 50)))  # the pipeline's 50 steps
    assert distilled == pytest.approx(math.exp(compute_empirical_mu(16, 4)))  # klein's 4 steps
    # prompts: the pipeline's embeddings, fixed length, no pooled
    emb = model.encode(["", "a photo of a red star"])
    ref, _ = pipe.encode_prompt(["", "a photo of a red star"], max_sequence_length=LENGTH)
    assert emb.embeds.shape == (2, LENGTH, 48) and emb.pooled.shape == (2, 0)
    torch.testing.assert_close(emb.embeds, ref, rtol=0, atol=1e-6)
    # decoding undoes the VAE's batch norm (random statistics here) before the VAE
    z = torch.randn(2, *model.latent_shape, generator=torch.Generator().manual_seed(0))
    bn = pipe.vae.bn
    raw = pipe._unpatchify_latents(
        z * torch.sqrt(bn.running_var.view(1, -1, 1, 1) + 1e-4) + bn.running_mean.view(1, -1, 1, 1)
    )
    with torch.no_grad():
        expected = (pipe.vae.decode(raw, return_dict=False)[0] / 2 + 0.5).clamp(0, 1)
    torch.testing.assert_close(model.decode(z), expected, rtol=0, atol=1e-5)
    assert not model.encodes_images()  # the offline methods need the inverse: not built
    # a static scheduler: its own shift, whatever the steps
    static = tmp_path / "static"
    shutil.copytree(klein, static)
    config = json.loads((static / "scheduler/scheduler_config.json").read_text())
    config["use_dynamic_shifting"] = False
    (static / "scheduler/scheduler_config.json").write_text(json.dumps(config))
    assert Flux2KleinModel.scheduler_shift(static, SIDE) == 3.0


def test_one_line_errors(klein, klein_distilled, tmp_path, prompt_files):
    with pytest.raises(ValueError, match=r"^resolution 20 px .* multiple of 8 \(VAE factor 4 x FLUX.2's"):
        Flux2KleinModel.check_resolution(klein, 20)
    with pytest.raises(ValueError, match="^max_sequence_length must be >= 1 for FLUX.2"):
        load_model(klein, resolution=SIDE, max_sequence_length=0)
    model = load_model(klein_distilled, resolution=SIDE, max_sequence_length=LENGTH)
    assert model.cfg_rows(1.0) == 1
    table = model.prompt_table([{"prompt": "a star"}])
    x, t = torch.zeros(1, *model.latent_shape), torch.ones(1)
    with pytest.raises(
        ValueError, match=r"^guidance_scale 4.0: .* step-distilled FLUX.2 klein .* use guidance_scale 1.0$"
    ):
        model.velocity(x, t, table[torch.ones(1, dtype=torch.long)], table[torch.zeros(1, dtype=torch.long)], 4.0)
    train, test = prompt_files
    for key in ("sampling.guidance_scale", "eval.guidance_scale"):
        settings = {"model.resolution": SIDE, "sampling.guidance_scale": 1.0, "eval.guidance_scale": 1.0, key: 3.0}
        over = tiny_overrides(klein_distilled, train, test, tmp_path / "run", **settings)
        with pytest.raises(
            ConfigError, match=rf"^config key '{key}': .* step-distilled .* set it to 1.0 \(got 3.0\)$"
        ):
            Trainer(load_config(None, over))


def test_klein_recipe_trains_two_iterations(tmp_path, klein_distilled, prompt_files):
    """configs/recipes/flux2_klein_flow_grpo.yaml shrunk onto the tiny distilled pipeline (its 1-step SDE window and guidance 1
    kept; PickScore swapped for JPEG compressibility, which needs no download)."""
    settings = {"model.resolution": SIDE, "model.max_sequence_length": LENGTH, **no_download("pickscore")}
    settings.update({**RECIPE_SIZES, "train.minibatch_size": 4, **WHOLE_MINIBATCHES, "train.ema_decay": 0.0})
    cfg = shrink_recipe("flux2_klein_flow_grpo", klein_distilled, prompt_files, tmp_path / "run", True, **settings)
    assert cfg.sampling.window.size == 1 and cfg.sampling.guidance_scale == 1.0 and cfg.eval.guidance_scale == 1.0
    trainer = Trainer(cfg)
    assert isinstance(trainer.model, Flux2KleinModel)
    assert trainer.cfg.sampling.shift == pytest.approx(Flux2KleinModel.scheduler_shift(klein_distilled, SIDE))
    train_shrunk_recipe(trainer)
    assert (tmp_path / "run/lora/pytorch_lora_weights.safetensors").is_file()


dev = tiny_pipeline("dev", build_random_flux2_pipeline)


def test_dev_encodes_with_mistral_and_takes_the_guidance_as_an_input(dev, tmp_path):
    from diffusers import Flux2Pipeline

    assert model_class(dev) is Flux2Model
    model = load_model(dev, resolution=SIDE, max_sequence_length=LENGTH)
    assert not model.is_distilled and model.guidance_embeds
    assert Flux2Model.scheduler_shift(dev, SIDE) == pytest.approx(Flux2KleinModel.scheduler_shift(dev, SIDE))
    pipe = Flux2Pipeline.from_pretrained(dev)
    emb = model.encode(["", "a photo of a red star"])  # BFL's system message, Mistral layers 10, 20, 30
    ref, _ = pipe.encode_prompt(["", "a photo of a red star"], max_sequence_length=LENGTH)
    assert emb.embeds.shape == (2, LENGTH, 48)
    torch.testing.assert_close(emb.embeds, ref, rtol=0, atol=1e-6)
    assert (emb.embeds[0] - emb.embeds[1]).abs().max() > 1e-3  # the prompt survives the system message's tokens
    # the guidance scale is the transformer's input: one row per sample, and it changes the velocity
    assert model.cfg_rows(4.0) == 1
    table = model.prompt_table([{"prompt": "a star"}])
    x, t, row = torch.randn(1, *model.latent_shape), torch.full((1,), 0.7), torch.ones(1, dtype=torch.long)
    v1, v4 = (model.velocity(x, t, table[row], None, w) for w in (1.0, 4.0))
    assert (v1 - v4).abs().max() > 1e-4
    # a Flux2Pipeline transformer without a guidance embedding: the stock pipeline ignores the scale, flowrl refuses it
    plain = build_random_flux2_pipeline(tmp_path / "plain", guidance_embeds=False)
    model = load_model(plain, resolution=SIDE, max_sequence_length=LENGTH)
    table = model.prompt_table([{"prompt": "a star"}])
    model.velocity(x, t, table[row], None, 1.0)
    with pytest.raises(ValueError, match=r"^guidance_scale 4.0: .* no guidance embedding .* use guidance_scale 1.0$"):
        model.velocity(x, t, table[row], None, 4.0)


@pytest.mark.parametrize(
    "recipe", ["flux2_flow_grpo", pytest.param("flux2_edit_flow_grpo", marks=pytest.mark.slow)]
)  # the edit recipe's reference images: ODE sampling and ratio in tests/test_conformance.py -k references
def test_dev_recipe_trains_two_iterations(tmp_path, dev, prompt_files, recipe):
    """configs/recipes/flux2_flow_grpo.yaml and flux2_edit_flow_grpo.yaml (on records with reference images: the tiny world's
    prompts, each with one or two) shrunk onto the tiny Flux2Pipeline (their 1-step SDE window, embedded guidance 4
    and gdpo aggregation kept; CLIP and PickScore swapped for JPEG compressibility and brightness, which need no
    download)."""
    prompts = prompt_files if recipe == "flux2_flow_grpo" else write_prompt_files("references", tmp_path / "p")
    rewards = load_config(REPO / "configs" / "recipes" / f"{recipe}.yaml").rewards
    settings = {"model.resolution": SIDE, "model.max_sequence_length": LENGTH, **no_download(*rewards)}
    settings.update({"rewards.families:brightness.weight": 0.5, **RECIPE_SIZES, "sampling.num_steps": 3})
    settings.update({"train.minibatch_size": 4, **WHOLE_MINIBATCHES, "train.ema_decay": 0.0})
    cfg = shrink_recipe(recipe, dev, prompts, tmp_path / "run", keep_shape=True, **settings)
    assert cfg.sampling.window.size == 1 and cfg.sampling.guidance_scale == 4.0 == cfg.eval.guidance_scale
    assert cfg.train.reward_aggregation == "gdpo"
    trainer = Trainer(cfg)
    assert isinstance(trainer.model, Flux2Model)
    if recipe == "flux2_edit_flow_grpo":
        assert trainer.model.reference_resolution == 384  # model.options.reference_resolution: the recipe's cap
    train_shrunk_recipe(trainer)


def _write_image(path: Path, width: int, height: int, seed: int) -> str:
    """A random RGB PNG of ``width x height`` px at ``path``; its path as a string."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(path)
    return str(path)


def test_reference_images_are_the_pipelines(klein, tmp_path, prompt_files):
    """Reference images (a record's ``image`` / ``images``) are encoded and placed as the pipeline's
    ``prepare_image_latents`` does, capped at ``reference_resolution ** 2`` px (Flow-Factory's condition_image_size);
    a mixed batch equals its rows alone; a table without references is the text-only one. Sampling against the stock
    pipelines: tests/test_conformance.py -k references."""
    from PIL import Image

    from flowrl.data import read_jsonl
    from flowrl.models import PromptEmbeds
    from flowrl.models.flux2 import Flux2PromptEmbeds

    big, small = _write_image(tmp_path / "big.png", 96, 80, 0), _write_image(tmp_path / "small.png", 64, 64, 1)
    model = load_model(klein, resolution=SIDE, max_sequence_length=LENGTH, reference_resolution=64)
    metas = [{"prompt": "a red star", "images": [big, small]}, {"prompt": "a blue square"}]
    table = model.prompt_table(metas)
    assert isinstance(table, Flux2PromptEmbeds) and table.image.shape == (3, 56 + 64, 16)
    # the stock preparation of the references, the big one first shrunk to 64 * 64 px of area (as Flow-Factory does)
    pipe = model.pipe  # its own components: prepare_image_latents is the stock code path
    shrunk = pipe.image_processor._resize_to_target_area(Image.open(big).convert("RGB"), 64 * 64)  # 70 x 58 px
    pixels = [
        pipe.image_processor.preprocess(image, height=h, width=w, resize_mode="crop")
        for image, (w, h) in ((shrunk, (64, 56)), (Image.open(small).convert("RGB"), (64, 64)))
    ]
    with torch.no_grad():
        tokens, ids = pipe.prepare_image_latents(pixels, 1, None, "cpu", torch.float32)  # (1, R, C'), (1, R, 4)
    assert ids[0, :, 0].unique().tolist() == [10, 20] and tokens.shape[1] == 8 * 7 + 8 * 8
    torch.testing.assert_close(table.image[1, : tokens.shape[1]], tokens[0], rtol=0, atol=1e-5)
    assert torch.equal(table.image_ids[1, : tokens.shape[1]], ids[0])
    assert (table.image_ids[[0, 2]] == -1).all()  # the empty prompt and the text-only record: no references
    # a batch mixing rows with and without references equals each row alone; the references change the velocity
    x = torch.randn(2, *model.latent_shape, generator=torch.Generator().manual_seed(0))
    t, rows, uncond = torch.tensor([0.8, 0.5]), torch.tensor([1, 2]), table[torch.zeros(2, dtype=torch.long)]
    with torch.no_grad():
        both = model.velocity(x, t, table[rows], uncond, 4.0)
        alone = [model.velocity(x[i : i + 1], t[i : i + 1], table[rows[i : i + 1]], uncond[:1], 4.0) for i in (0, 1)]
        text = model.prompt_table([{"prompt": "a red star"}])
        plain = model.velocity(x[:1], t[:1], text[torch.ones(1, dtype=torch.long)], text[torch.zeros(1).long()], 4.0)
    torch.testing.assert_close(both, torch.cat(alone), rtol=0, atol=1e-6)
    assert (alone[0] - plain).abs().max() > 1e-3
    assert type(text) is PromptEmbeds  # no references: the text-to-image table, sampled as before
    # prompt files: "images" made absolute; bad records named
    (tmp_path / "refs").mkdir()
    _write_image(tmp_path / "refs" / "a.png", 64, 64, 2)
    (tmp_path / "refs" / "p.jsonl").write_text(json.dumps({"prompt": "p", "images": ["a.png", "a.png"]}) + "\n")
    assert read_jsonl(tmp_path / "refs" / "p.jsonl")[0]["images"] == [str((tmp_path / "refs" / "a.png").resolve())] * 2
    (tmp_path / "refs" / "q.jsonl").write_text(json.dumps({"prompt": "p", "images": "a.png"}) + "\n")
    with pytest.raises(ValueError, match=r"q.jsonl:1: 'images' 'a.png' is not a list of image files"):
        read_jsonl(tmp_path / "refs" / "q.jsonl")
    tiny = _write_image(tmp_path / "tiny.png", 48, 64, 3)
    with pytest.raises(ValueError, match=r"^reference image .*tiny.png: Image too small: 48×64.*Flux2KleinPipeline"):
        model.prompt_table([{"prompt": "p", "image": tiny}])
    with pytest.raises(ValueError, match=r"^prompt record 'p' names reference images in both 'image' and 'images'"):
        model.prompt_table([{"prompt": "p", "image": small, "images": [small]}])
    with pytest.raises(ValueError, match=r"^reference_resolution must be an integer number of pixels >= 64"):
        load_model(klein, resolution=SIDE, reference_resolution=32)
    train, test = prompt_files
    over = tiny_overrides(klein, train, test, tmp_path / "run", **{"model.options.reference_resolution": 48})
    with pytest.raises(ConfigError, match=r"^config key 'model.options.reference_resolution': reference_resolution"):
        Trainer(load_config(None, over))
