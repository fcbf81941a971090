"""A tiny random-weight Qwen2-VL and its processor, built offline from transformers' real classes, for the tests of
the Qwen2-VL rewards (VideoAlign, HPSv3)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

CHAT = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{% for c in message['content'] %}"
    "{% if c['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ c['text'] }}{% endif %}"
    "{% endfor %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""A Qwen-style chat template (no system turn): `<|im_start|>user\\n<|vision_start|><|image_pad|><|vision_end|>TEXT
<|im_end|>\\n<|im_start|>assistant\\n`, `<|video_pad|>` for a video."""

QWEN_TOKENS = ("<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")


def tiny_qwen2vl(extra_tokens: Sequence[str] = (), seed: int = 0):
    """A `Qwen2VLForConditionalGeneration` (2 text layers, hidden 32, mrope sections 1/1/2; a 1-block vision tower
    with 14-pixel patches merged 2x2) and a `Qwen2VLProcessor` (byte-level Qwen2 tokenizer of 256 bytes plus
    `QWEN_TOKENS` and `extra_tokens`, the default image processor, a video processor of 56x56 to 56x84 pixels per
    frame, the `CHAT` template).

    Returns:
        `(model, processor)`: the model in float32 with weights drawn under `torch.manual_seed(seed)`.
    """
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import (
        Qwen2Tokenizer,
        Qwen2VLConfig,
        Qwen2VLForConditionalGeneration,
        Qwen2VLImageProcessor,
        Qwen2VLProcessor,
        Qwen2VLVideoProcessor,
    )

    tokenizer = Qwen2Tokenizer(vocab={c: i for i, c in enumerate(sorted(ByteLevel.alphabet()))}, merges=[])
    tokenizer.add_special_tokens({"additional_special_tokens": [*QWEN_TOKENS, *extra_tokens]})
    ids = tokenizer.convert_tokens_to_ids
    config = Qwen2VLConfig(
        text_config=dict(
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
        ),
        vision_config=dict(
            depth=1,
            embed_dim=32,
            hidden_size=32,
            num_heads=2,
            mlp_ratio=2,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
        ),
        image_token_id=ids("<|image_pad|>"),
        video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"),
        vision_end_token_id=ids("<|vision_end|>"),
    )
    torch.manual_seed(seed)
    model = Qwen2VLForConditionalGeneration(config)
    processor = Qwen2VLProcessor(
        image_processor=Qwen2VLImageProcessor(),
        tokenizer=tokenizer,
        chat_template=CHAT,
        video_processor=Qwen2VLVideoProcessor(size={"shortest_edge": 56 * 56, "longest_edge": 56 * 84}),
    )
    return model, processor
