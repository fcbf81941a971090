"""The tiny Qwen2-VL of the Qwen2-VL reward tests (VideoAlign, HPSv3): :func:`flowrl.tiny.qwen_vl.random_qwen_vl` with
a one-block vision tower, no system turn in the chat template and 56x56 to 56x84-pixel video frames."""

from __future__ import annotations

from collections.abc import Sequence

from flowrl.tiny.qwen_vl import PLAIN_CHAT_TEMPLATE, random_qwen_vl


def tiny_qwen2vl(extra_tokens: Sequence[str] = (), seed: int = 0):
    """``(Qwen2VLForConditionalGeneration, Qwen2VLProcessor)`` in float32, weights drawn under `seed`, the tokenizer
    with `extra_tokens` added."""
    video_size = {"shortest_edge": 56 * 56, "longest_edge": 56 * 84}
    return random_qwen_vl(
        "qwen2_vl", extra_tokens, PLAIN_CHAT_TEMPLATE, video_size=video_size, vision_depth=1, seed=seed
    )
