"""A seeded random-weight Qwen2-VL or Qwen2.5-VL folder with its processor, built offline (no download).

``random_qwen_vl()`` builds, and ``build_random_qwen_vl(folder)`` saves, a ``Qwen2_5_VLForConditionalGeneration``
(or, with ``arch="qwen2_vl"``, a ``Qwen2VLForConditionalGeneration``) of the real transformers class at a tiny size (2
text layers of width 32, a 2-block vision tower with 14-pixel patches merged 2 x 2) and a processor of the matching class: a byte-level
``Qwen2Tokenizer`` (the 256 byte symbols, Qwen's chat and vision special tokens, and merges that make ``Yes``, ``yes``,
`` yes`` and ``No`` one token each, as they are in Qwen's real vocabulary), a ``Qwen2VLImageProcessor`` with its
default resize bounds, a ``Qwen2VLVideoProcessor`` and a Qwen-style chat template. The VLM rewards' tests
(VQAScore, VideoAlign, HPSv3) build it here.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

QWEN_SPECIAL_TOKENS = (
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
"""Qwen's chat and vision special tokens, in the tiny tokenizer."""

WORD_MERGES = (("Ġ", "y"), ("Ġy", "e"), ("Ġye", "s"), ("Y", "e"), ("Ye", "s"), ("y", "e"), ("ye", "s"), ("N", "o"))
"""BPE merges of the tiny tokenizer (in rank order): ``Ġyes`` (`` yes``), ``Yes``, ``yes`` and ``No`` become single
tokens; every other text is one token per byte."""

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for c in message['content'] %}"
    "{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% else %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""The layout of Qwen2.5-VL-Instruct's chat template: a default system message, each image or video as
``<|vision_start|><|image_pad|><|vision_end|>`` (``<|video_pad|>``) in place, ``<|im_start|>assistant\\n`` as the
generation prompt."""

PLAIN_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{% for c in message['content'] %}"
    "{% if c['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ c['text'] }}{% endif %}"
    "{% endfor %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""The same layout without the default system turn (the VideoAlign and HPSv3 tests' processors)."""

ARCHS = ("qwen2_5_vl", "qwen2_vl")


def build_tokenizer(extra_tokens: Sequence[str] = ()):
    """The tiny byte-level Qwen2 tokenizer (see the module docstring), with `extra_tokens` added as special tokens.

    Returns:
        ``transformers.Qwen2Tokenizer`` (pad and end-of-text token ``<|endoftext|>``).
    """
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import Qwen2Tokenizer

    vocab = {c: i for i, c in enumerate(sorted(ByteLevel.alphabet()))}
    for a, b in WORD_MERGES:
        vocab[a + b] = len(vocab)
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=list(WORD_MERGES))
    tokenizer.add_special_tokens({"additional_special_tokens": [*QWEN_SPECIAL_TOKENS, *extra_tokens]})
    return tokenizer


def random_qwen_vl(
    arch: str = "qwen2_5_vl",
    extra_tokens: Sequence[str] = (),
    chat_template: str = CHAT_TEMPLATE,
    video_size: dict[str, int] | None = None,
    vision_depth: int = 2,
    seed: int = 0,
):
    """A random-weight Qwen2.5-VL (or Qwen2-VL) model and its processor, in memory (see the module docstring).

    Args:
        arch (`str`): ``"qwen2_5_vl"`` (``Qwen2_5_VLForConditionalGeneration`` + ``Qwen2_5_VLProcessor``) or
            ``"qwen2_vl"`` (``Qwen2VLForConditionalGeneration`` + ``Qwen2VLProcessor``).
        extra_tokens: more special tokens for the tokenizer (e.g. VideoAlign's ``<|VQ_reward|>``).
        chat_template (`str`): the processor's Jinja chat template; default :data:`CHAT_TEMPLATE`
            (:data:`PLAIN_CHAT_TEMPLATE`: no system turn).
        video_size (`dict`, *optional*): the video processor's ``size`` (``shortest_edge`` / ``longest_edge`` in
            pixels per frame); default the processor's own.
        vision_depth (`int`): blocks of the vision tower (Qwen2.5-VL's last one full attention).
        seed (`int`): ``torch.manual_seed`` before the weights are drawn: the same seed gives the same weights.

    Returns:
        `(model, processor)`: the model in float32, eval mode not set.

    Raises:
        ValueError: an unknown `arch`.
    """
    import transformers as tf

    if arch not in ARCHS:
        raise ValueError(f"random_qwen_vl: arch must be one of {', '.join(ARCHS)}, got {arch!r}")
    tokenizer = build_tokenizer(extra_tokens)
    ids = tokenizer.convert_tokens_to_ids
    text = dict(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]},
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        eos_token_id=ids("<|im_end|>"),
    )
    vision = dict(depth=vision_depth, num_heads=2, patch_size=14, spatial_merge_size=2, temporal_patch_size=2)
    if arch == "qwen2_5_vl":
        config_class, model_class, processor_class = (
            tf.Qwen2_5_VLConfig,
            tf.Qwen2_5_VLForConditionalGeneration,
            tf.Qwen2_5_VLProcessor,
        )
        full = [vision_depth - 1]
        vision.update(hidden_size=32, intermediate_size=64, out_hidden_size=32, fullatt_block_indexes=full)
    else:
        config_class, model_class, processor_class = (
            tf.Qwen2VLConfig,
            tf.Qwen2VLForConditionalGeneration,
            tf.Qwen2VLProcessor,
        )
        vision.update(embed_dim=32, hidden_size=32, mlp_ratio=2)
    config = config_class(
        text_config=text,
        vision_config=vision,
        image_token_id=ids("<|image_pad|>"),
        video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"),
        vision_end_token_id=ids("<|vision_end|>"),
    )
    torch.manual_seed(seed)
    model = model_class(config)
    video_processor = tf.Qwen2VLVideoProcessor(**({"size": video_size} if video_size else {}))
    processor = processor_class(
        image_processor=tf.Qwen2VLImageProcessor(),
        tokenizer=tokenizer,
        video_processor=video_processor,
        chat_template=chat_template,
    )
    return model, processor


def build_random_qwen_vl(folder: str | Path, arch: str = "qwen2_5_vl", **kwargs) -> Path:
    """Save :func:`random_qwen_vl`'s model and processor (same `arch` and keyword arguments) to `folder` (created
    if missing) with ``save_pretrained``.

    Returns:
        `Path`: `folder`.

    Raises:
        ValueError: an unknown `arch`.
    """
    model, processor = random_qwen_vl(arch, **kwargs)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    return folder
