"""The shipped pipeline runs in stock diffusers as documented: no ``dtype`` argument, one image end to end."""

import json

import pytest
import torch
from conftest import ASSETS

PIPELINE = ASSETS / "tiny-sd3"
pytestmark = pytest.mark.skipif(not (PIPELINE / "model_index.json").is_file(), reason="assets not built")


def test_text_encoders_are_stored_in_float32():
    from safetensors import safe_open

    for name in ("text_encoder", "text_encoder_2"):
        assert json.loads((PIPELINE / name / "config.json").read_text())["dtype"] == "float32"
        with safe_open(PIPELINE / name / "model.safetensors", "pt") as f:
            assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"F32"}


def test_stock_pipeline_generates_an_image_without_a_dtype():
    from diffusers import StableDiffusion3Pipeline

    pipe = StableDiffusion3Pipeline.from_pretrained(PIPELINE, text_encoder_3=None, tokenizer_3=None)
    for name in ("text_encoder", "text_encoder_2", "transformer", "vae"):
        assert getattr(pipe, name).dtype == torch.float32, name
    images = pipe(
        prompt="a photo of a red star",
        height=64,
        width=64,
        num_inference_steps=2,
        output_type="pt",
        generator=torch.Generator().manual_seed(0),
    ).images
    assert images.shape == (1, 3, 64, 64) and images.dtype == torch.float32
    assert torch.isfinite(images).all() and 0 <= images.min() and images.max() <= 1
