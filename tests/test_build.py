"""The asset builder's pieces run and produce what the pipeline expects (a few steps each)."""

import pytest
import torch

from flowrl.tiny.build import (
    LATENT_CHANNELS,
    LATENT_SIZE,
    MAX_TOKENS,
    build_tokenizer,
    encode_latents,
    render_dataset,
    tiny_transformer,
    train_clip,
    train_transformer,
    train_vae,
)


def test_the_builder_bar_shows_the_moving_loss():
    """The bar's loss is the loss of a recent step, not the first step's repeated (tqdm's ``n`` lags its loop)."""
    from tqdm import tqdm

    from flowrl.tiny.build import _optimizer_step

    w = torch.nn.Parameter(torch.tensor(1.0))
    opt = torch.optim.SGD([w], lr=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
    shown = []
    bar = tqdm(range(60), disable=True)
    for step in bar:
        _optimizer_step(w * (step + 1), [w], opt, sched, bar)  # loss = step + 1
        shown.append(bar.postfix)
    assert shown[0] == "loss=1.0000" and shown[25] == "loss=26.0000" and shown[59] == "loss=51.0000"


def test_tokenizer_is_the_real_clip_bpe():
    tok = build_tokenizer()
    assert len(tok) == 49408 and tok.model_max_length == MAX_TOKENS
    ids = tok("a photo of three crosses").input_ids
    assert ids[0] == 49406 and ids[-1] == 49407 and tok.decode(ids[1:-1]) == "a photo of three crosses"


def test_build_loops_train_and_shapes_match():
    images, captions = render_dataset(32, seed=0)
    assert images.shape == (32, 3, 64, 64) and images.dtype == torch.uint8 and len(captions) == 32
    vae = train_vae(images, steps=2, seed=0, batch=4)
    latents = encode_latents(vae, images[:4])
    assert latents.shape == (4, LATENT_CHANNELS, LATENT_SIZE, LATENT_SIZE)
    assert vae.config.scaling_factor > 0
    clip = train_clip(images, captions, build_tokenizer(), steps=2, seed=0, batch=8)
    assert clip.config.projection_dim == 64
    model = tiny_transformer(128, 128, seed=0)
    before = model.proj_out.weight.detach().clone()
    train_transformer(
        model,
        torch.randn(8, LATENT_CHANNELS, LATENT_SIZE, LATENT_SIZE),
        torch.randn(3, MAX_TOKENS, 128),
        torch.randn(3, 128),
        torch.randint(0, 3, (8,)),
        steps=2,
        seed=0,
        batch=4,
    )
    assert not torch.equal(before, model.proj_out.weight)


def test_transformer_ema_returns_the_average_not_the_last_weights():
    args = (
        torch.randn(8, LATENT_CHANNELS, LATENT_SIZE, LATENT_SIZE),
        torch.randn(3, MAX_TOKENS, 128),
        torch.randn(3, 128),
        torch.randint(0, 3, (8,)),
    )
    init = tiny_transformer(128, 128, seed=0).proj_out.weight.detach().clone()
    raw = train_transformer(
        tiny_transformer(128, 128, seed=0), *args, steps=3, seed=0, batch=4
    ).proj_out.weight.detach()
    ema = train_transformer(
        tiny_transformer(128, 128, seed=0), *args, steps=3, seed=0, batch=4, ema_decay=0.9
    ).proj_out.weight.detach()
    assert not torch.equal(ema, raw) and not torch.equal(ema, init)
    assert (ema - init).norm() < (raw - init).norm()  # the average lags behind the last weights
    with pytest.raises(ValueError, match="ema_decay"):
        train_transformer(tiny_transformer(128, 128, seed=0), *args, steps=1, seed=0, batch=4, ema_decay=1.0)


def test_clip_condition_matches_the_pipeline_and_joint_training_moves_the_text_tower():
    from diffusers import StableDiffusion3Pipeline

    from flowrl.tiny.build import clip_condition

    pipe = StableDiffusion3Pipeline.from_pretrained(
        "assets/tiny-sd3", text_encoder_3=None, tokenizer_3=None, dtype=torch.float32
    )
    prompts = ["", "a photo of a red star left of a blue cross"]
    with torch.no_grad():
        ref, _, ref_pooled, _ = pipe.encode_prompt(
            prompts, prompts, prompts, do_classifier_free_guidance=False, max_sequence_length=0
        )
        ids = pipe.tokenizer(
            prompts, padding="max_length", max_length=MAX_TOKENS, truncation=True, return_tensors="pt"
        ).input_ids
        cond, pooled = clip_condition(pipe.text_encoder, ids)
    torch.testing.assert_close(cond, ref)
    torch.testing.assert_close(pooled, ref_pooled)

    text = pipe.text_encoder
    before = text.text_model.embeddings.token_embedding.weight[ids[1]].clone()
    model = tiny_transformer(cond.shape[-1], pooled.shape[-1], seed=0)
    train_transformer(
        model,
        torch.randn(8, LATENT_CHANNELS, LATENT_SIZE, LATENT_SIZE),
        None,
        None,
        torch.randint(1, 2, (8,)),
        steps=2,
        seed=0,
        batch=4,
        text_encoder=text,
        input_ids=ids,
        text_lr=1e-3,
    )
    assert not torch.equal(before, text.text_model.embeddings.token_embedding.weight[ids[1]])
    assert not text.training and not any(p.requires_grad for p in text.parameters())
    with pytest.raises(ValueError, match="text_lr"):
        train_transformer(
            model,
            torch.randn(8, LATENT_CHANNELS, LATENT_SIZE, LATENT_SIZE),
            None,
            None,
            torch.randint(1, 2, (8,)),
            steps=1,
            seed=0,
            batch=4,
            text_lr=1e-3,
        )


def test_render_dataset_tag_weights_draw_only_the_weighted_tags():
    from flowrl.tiny.prompts import all_metadata

    tag_of = {m["prompt"]: m["tag"] for m in all_metadata()}
    _, captions = render_dataset(40, seed=0, tag_weights={"two_object": 1.0, "counting": 3.0})
    tags = [tag_of[c] for c in captions]
    assert set(tags) == {"two_object", "counting"} and tags.count("counting") > tags.count("two_object")
    assert render_dataset(3, seed=0)[1] == [  # uniform: the scenes the shipped assets were built from
        "a photo of a yellow star",
        "a photo of a green triangle",
        "a photo of a cross and a circle",
    ]
    for bad in ({"two_objects": 1.0}, {"two_object": -1.0}, {"two_object": 0.0}):
        with pytest.raises(ValueError, match="tag_weights"):
            render_dataset(4, seed=0, tag_weights=bad)


def test_transformer_size_options_and_their_errors():
    model = tiny_transformer(128, 128, seed=0, num_layers=2, width=64)
    assert model.config.num_layers == 2 and model.config.num_attention_heads == 2
    assert model.config.caption_projection_dim == 64
    with pytest.raises(ValueError, match="multiple of 32"):
        tiny_transformer(128, 128, seed=0, width=48)


def test_fresh_transformer_keeps_the_init_text_tower_but_not_its_transformer(tmp_path):
    from transformers import CLIPTextModelWithProjection

    from flowrl.tiny.build import _text_encoder_and_transformer

    init = "assets/tiny-sd3"
    text, fresh = _text_encoder_and_transformer(tmp_path, init, seed=0, fresh=True, layers=2, width=64)
    shipped = CLIPTextModelWithProjection.from_pretrained(f"{init}/text_encoder", dtype=torch.float32)
    assert all(torch.equal(a, b) for a, b in zip(text.state_dict().values(), shipped.state_dict().values()))
    assert fresh.config.num_layers == 2 and fresh.config.caption_projection_dim == 64
    _, kept = _text_encoder_and_transformer(tmp_path, init, seed=0)
    assert kept.config.num_layers == 5  # without fresh: the init transformer, to continue


def test_the_transformer_stage_continues_an_init_pipeline(tmp_path):
    """The stage every `python -m flowrl.tiny.build` command of docs/tiny_world.md reaches (it passed `steps` and
    `seed` where train_transformer now takes the text tower, a TypeError): one step on 8 scenes moves the shipped
    transformer and leaves the text tower (text_lr 0) as it was."""
    from diffusers import AutoencoderKL, SD3Transformer2DModel

    from flowrl.tiny.build import _transformer_stage

    init = "assets/tiny-sd3"
    images, captions = render_dataset(8, seed=0)
    vae = AutoencoderKL.from_pretrained(f"{init}/vae")
    options = dict(batch=4, lr=1e-3, t_mean=0.0, ema_decay=0.0, text_lr=0.0)
    text, transformer = _transformer_stage(tmp_path, images, captions, build_tokenizer(), vae, init, 1, 0, **options)
    shipped = SD3Transformer2DModel.from_pretrained(f"{init}/transformer").state_dict()
    assert any(not torch.equal(v, shipped[k]) for k, v in transformer.state_dict().items())
    assert not text.training and not transformer.training


@pytest.mark.parametrize(
    "args",
    [
        ["--fresh-transformer"],  # no --init to take the VAE and text tower from
        ["--init", "assets/tiny-sd3", "--dit-layers", "8"],  # sizes a new transformer, but --init continues its own
        ["--dit-width", "48"],  # not a multiple of 32
        ["--dit-layers", "0"],
    ],
)
def test_build_usage_errors_come_before_any_work(args, tmp_path):
    from flowrl.tiny.build import main

    with pytest.raises(SystemExit) as err:
        main(["--out", str(tmp_path / "out"), *args])
    assert err.value.code == 2 and not (tmp_path / "out").exists()


@pytest.mark.parametrize("module, folder", [("build", "tiny-sd3"), ("build_video", "tiny-wan")])
def test_a_finished_build_is_not_overwritten_unless_asked(module, folder, tmp_path, capsys):
    import importlib

    main = importlib.import_module(f"flowrl.tiny.{module}").main
    (tmp_path / folder).mkdir()
    (tmp_path / folder / "model_index.json").write_text("{}")
    with pytest.raises(SystemExit) as err:
        main(["--out", str(tmp_path), "--seed", "0"])
    assert err.value.code == 2 and "pass --overwrite to replace it" in capsys.readouterr().err
    assert (tmp_path / folder / "model_index.json").read_text() == "{}"  # untouched, nothing else written
    assert sorted(p.name for p in tmp_path.iterdir()) == [folder]


def test_saved_pipeline_loads_in_float32_in_stock_diffusers(tmp_path):
    import json

    from diffusers import StableDiffusion3Pipeline
    from tiny_pipelines.sd3 import build_random_sd3_pipeline

    from flowrl.tiny.build import _save_pipeline

    half = StableDiffusion3Pipeline.from_pretrained(
        build_random_sd3_pipeline(tmp_path / "src"), text_encoder_3=None, tokenizer_3=None, dtype=torch.float16
    )
    _save_pipeline(tmp_path / "out", half.transformer, half.vae, half.text_encoder, half.tokenizer)
    for name in ("text_encoder", "text_encoder_2"):
        assert json.loads((tmp_path / "out" / name / "config.json").read_text())["dtype"] == "float32"
    pipe = StableDiffusion3Pipeline.from_pretrained(tmp_path / "out", text_encoder_3=None, tokenizer_3=None)
    assert {getattr(pipe, n).dtype for n in ("text_encoder", "text_encoder_2", "transformer", "vae")} == {
        torch.float32
    }
