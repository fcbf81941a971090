"""The asset builder's pieces run and produce what the pipeline expects (a few steps each)."""

import torch

from flowrl.tiny.build import (LATENT_CHANNELS, LATENT_SIZE, MAX_TOKENS, build_tokenizer, encode_latents, render_dataset,
                               tiny_transformer, train_clip, train_transformer, train_vae)


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
    train_transformer(model, torch.randn(8, LATENT_CHANNELS, LATENT_SIZE, LATENT_SIZE), torch.randn(3, MAX_TOKENS, 128), torch.randn(3, 128),
                      torch.randint(0, 3, (8,)), steps=2, seed=0, batch=4)
    assert not torch.equal(before, model.proj_out.weight)
