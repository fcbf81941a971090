"""Tiny random CLIP models for the reward tests (PickScore, CLIPScore, aesthetic, MPS, GenEval's color classifier,
CLIP temporal consistency) and the CLIP vision tower of Wan 2.1's image-to-video pipeline, built offline."""

from __future__ import annotations

import gzip
from pathlib import Path

from .text import clip_text_config

CLIP_VISION = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=32, patch_size=8
)
"""A 2-layer CLIP vision tower on 32 px images in 8 px patches (17 tokens of width 32)."""


def cut_clip_tokenizer(num_merges: int, **kwargs):
    """A real CLIP BPE tokenizer cut to the first ``num_merges`` merges of open_clip's vocabulary file (offline):
    ``2 * 256 + num_merges + 2`` tokens; ``kwargs``: the ``CLIPTokenizer``'s (``model_max_length``)."""
    import open_clip
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import CLIPTokenizer

    with gzip.open(open_clip.tokenizer.default_bpe(), "rt", encoding="utf-8") as f:
        lines = f.read().split("\n")[1 : num_merges + 1]  # first line is a version header
    merges = [tuple(line.split()) for line in lines]
    alphabet = sorted(ByteLevel.alphabet())
    tokens = alphabet + [c + "</w>" for c in alphabet] + ["".join(m) for m in merges]
    tokens += ["<|startoftext|>", "<|endoftext|>"]
    return CLIPTokenizer(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, **kwargs)


def clip_image_processor():
    """A CLIPImageProcessor that resizes and crops to 32 x 32 px."""
    from transformers import CLIPImageProcessor

    return CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})


def random_clip(
    tokenizer,
    text_layers: int = 2,
    vision_layers: int = 2,
    positions: int = 16,
    projection_dim: int = 16,
    seed: int = 0,
):
    """A random-weight ``CLIPModel`` drawn after ``torch.manual_seed(seed)``: a 32-wide text tower of ``text_layers``
    layers and ``positions`` positions over ``tokenizer``, :data:`CLIP_VISION` with ``vision_layers`` layers, and
    ``projection_dim`` projections; with its ``CLIPProcessor`` (``tokenizer`` and :func:`clip_image_processor`).
    Returns ``(model, processor)``."""
    import torch
    from transformers import CLIPConfig, CLIPModel, CLIPProcessor

    text = clip_text_config(tokenizer, text_layers, positions)
    vision = {**CLIP_VISION, "num_hidden_layers": vision_layers}
    torch.manual_seed(seed)
    model = CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=projection_dim))
    return model, CLIPProcessor(image_processor=clip_image_processor(), tokenizer=tokenizer)


def save_random_clip(folder: Path, tokenizer, **kwargs) -> Path:
    """Save :func:`random_clip` (``kwargs``: its sizes and seed) with its processor to ``folder``, as a CLIP folder
    from the hub; returns ``folder``."""
    model, processor = random_clip(tokenizer, **kwargs)
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    return folder
