"""The shipped tiny world: prompt files, the tiny SD3 pipeline and CLIP load offline, sizes, and a short run."""

import json

import pytest
import torch
from conftest import ASSETS

from flowrl.data import read_jsonl
from flowrl.tiny.prompts import HELD_OUT_COLOR_PAIRS, HELD_OUT_COUNTS, HELD_OUT_SHAPE_PAIRS, is_held_out

pytestmark = pytest.mark.skipif(not (ASSETS / "tiny-sd3" / "model_index.json").is_file(), reason="assets not built")


def test_assets_stay_small():
    size = sum(p.stat().st_size for p in ASSETS.rglob("*") if p.is_file())
    # the image world ~50.5 MiB (the float32 text tower, 12.9 MiB, is stored twice, as text_encoder and
    # text_encoder_2) and the video world's tiny Wan ~5.8 MiB (test_tiny_video: at most 25 MiB)
    assert size < 60 * 2**20, f"assets take {size / 2**20:.1f} MiB"


def test_test_prompts_hold_only_unseen_combinations():
    train, test = read_jsonl(ASSETS / "prompts/train.jsonl"), read_jsonl(ASSETS / "prompts/test.jsonl")
    assert not any(is_held_out(m) for m in train)
    assert all(is_held_out(m) for m in test if m["tag"] != "single_object")
    train_prompts = {m["prompt"] for m in train}
    assert not any(m["prompt"] in train_prompts for m in test if m["tag"] != "single_object")
    for m in train:
        for c in m["include"]:
            assert (c["class"], c.get("color")) not in HELD_OUT_COLOR_PAIRS
        if m["tag"] == "counting":
            assert (m["include"][0]["class"], m["include"][0]["count"]) not in HELD_OUT_COUNTS
        if len(m["include"]) == 2:
            assert frozenset(c["class"] for c in m["include"]) not in HELD_OUT_SHAPE_PAIRS
    assert {m["tag"] for m in test} == {"single_object", "two_object", "counting", "colors", "position", "color_attr"}


def test_tiny_pipeline_loads_like_sd35():
    from diffusers import StableDiffusion3Pipeline

    pipe = StableDiffusion3Pipeline.from_pretrained(
        ASSETS / "tiny-sd3", text_encoder_3=None, tokenizer_3=None, dtype=torch.float32
    )
    assert len(pipe.tokenizer) == 49408  # the real CLIP BPE vocabulary
    images = pipe(
        "a photo of a red star",
        num_inference_steps=4,
        height=64,
        width=64,
        max_sequence_length=0,
        output_type="pt",
        generator=torch.Generator().manual_seed(0),
    ).images
    assert images.shape == (1, 3, 64, 64) and torch.isfinite(images).all()


def test_tiny_clip_scores_matching_captions_higher():
    import random

    from flowrl.rewards import build_reward
    from flowrl.tiny.render import render, sample_scene

    reward = build_reward("clipscore", model_path=str(ASSETS / "tiny-clip"))
    metas = read_jsonl(ASSETS / "prompts/train.jsonl")[:32]
    rng = random.Random(0)
    images = torch.stack(
        [torch.from_numpy(render(sample_scene(m, rng))).permute(2, 0, 1).float() / 255 for m in metas]
    )
    prompts = [m["prompt"] for m in metas]
    right = reward(images, prompts, metas)
    wrong = reward(images, prompts[1:] + prompts[:1], metas)
    assert (right > wrong).float().mean() > 0.7


def test_base_model_accuracy_is_published():
    base = json.loads((ASSETS / "tiny-sd3" / "base_eval.json").read_text())
    assert 0.0 <= base["overall"] < 0.9 and len(base["per_tag"]) == 6


def test_read_jsonl_names_the_file_and_line_of_a_bad_line(tmp_path):
    import pytest

    bad = tmp_path / "p.jsonl"
    bad.write_text('{"prompt": "a photo of a star"}\na photo of a circle\n')
    with pytest.raises(ValueError, match=r"p\.jsonl:2: not a JSON line"):
        read_jsonl(bad)
    bad.write_text('"the prompt"\n')
    with pytest.raises(ValueError, match=r"p\.jsonl:1: expected a JSON object"):
        read_jsonl(bad)
