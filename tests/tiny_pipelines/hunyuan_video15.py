"""HunyuanVideo 1.5 text-to-video: a tiny random ``HunyuanVideo15Pipeline`` (a 2-layer Qwen2.5-VL text model with a
byte-level BPE tokenizer trained on the pipeline's chat template, a 1-layer ByT5 encoder with the byte tokenizer,
``HunyuanVideo15Transformer3DModel``, ``AutoencoderKLHunyuanVideo15``, the ClassifierFreeGuidance guider) and the
stock pipeline's videos."""

from __future__ import annotations

import inspect
from pathlib import Path

import torch

from .common import per_record, sized, stock_pipeline
from .text import QWEN_ROPE, QWEN_SPECIALS, qwen2_tokenizer, t5_config, text_model_config

PROMPTS = ["a red circle moving left", 'a sign that says "GO" moving up']  # the second has glyph text for ByT5
"""The HunyuanVideo 1.5 tests' prompts, which the Qwen tokenizer is trained on (with the motion prompts)."""
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""Qwen2.5-VL's chat template for text-only conversations (its ``<|im_start|>role`` turns)."""
HV15_TRANSFORMER = dict(
    in_channels=9,
    out_channels=4,
    num_attention_heads=2,
    attention_head_dim=16,
    num_layers=1,
    num_refiner_layers=1,
    mlp_ratio=2.0,
    text_embed_dim=32,
    text_embed_2_dim=32,
    image_embed_dim=16,
    rope_axes_dim=(4, 6, 6),
)
"""The tiny 1-block HunyuanVideo 1.5 transformer (in_channels 2 x 4 + 1: the latents, the image-condition latents and
their mask), bar its task and target size."""


def system_message() -> str:
    """HunyuanVideo15Pipeline's default system message for the Qwen chat template."""
    from diffusers import HunyuanVideo15Pipeline

    return inspect.signature(HunyuanVideo15Pipeline._get_mllm_prompt_embeds).parameters["system_message"].default


def build_qwen_chat_tokenizer():
    """A Qwen2Tokenizer of 500 tokens (:func:`tiny_pipelines.text.qwen2_tokenizer`) with :data:`CHAT_TEMPLATE`, trained
    on HunyuanVideo 1.5's system message and the prompts here: the template's part before the prompt is then 108
    tokens (one per pre-tokenized piece, as with Qwen2.5-VL's own tokenizer), the pipeline's
    ``prompt_template_encode_start_idx``, so the crop leaves the prompt and the template's tail."""
    texts = [
        f"<|im_start|>system\n{system_message()}<|im_end|>\n<|im_start|>user\n{p}<|im_end|>\n<|im_start|>assistant\n"
        for p in [*PROMPTS, "two blue squares moving up", "a green star moving right", "blurry static", " "]
    ]
    tok = qwen2_tokenizer(texts, 500, QWEN_SPECIALS)
    tok.chat_template = CHAT_TEMPLATE
    return tok


def random_hunyuan_video15_text_components() -> dict:
    """The prompt components of a tiny HunyuanVideo 1.5 pipeline (seeded; the pipelines' keyword names): the tokenizer
    above with a 2-layer Qwen2.5-VL text model (hidden 32; the pipeline reads the hidden states two layers below the
    top, here the token embeddings) and a 1-layer T5 encoder (d_model 32) with ByT5's byte tokenizer for the glyph
    text, the flow-matching Euler scheduler at 480p's shift 5 and a ClassifierFreeGuidance guider at 480p's scale 6."""
    from diffusers import ClassifierFreeGuidance, FlowMatchEulerDiscreteScheduler
    from transformers import ByT5Tokenizer, Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel, T5Config, T5EncoderModel

    torch.manual_seed(0)
    tok = build_qwen_chat_tokenizer()
    config = text_model_config(tok, 32, 2, max_position_embeddings=2048, rope_parameters=QWEN_ROPE)
    qwen = Qwen2_5_VLTextModel(Qwen2_5_VLTextConfig(**config))
    byt5_tok = ByT5Tokenizer()
    ids = dict(pad_token_id=byt5_tok.pad_token_id, eos_token_id=byt5_tok.eos_token_id)
    byt5 = T5EncoderModel(T5Config(**t5_config(len(byt5_tok), **ids)))
    return {
        "text_encoder": qwen,
        "tokenizer": tok,
        "text_encoder_2": byt5,
        "tokenizer_2": byt5_tok,
        "scheduler": FlowMatchEulerDiscreteScheduler(shift=5.0),
        "guider": ClassifierFreeGuidance(guidance_scale=6.0),
    }


def build_random_hunyuan_video15_pipeline(folder: Path) -> Path:
    """Save a random-weight HunyuanVideo15Pipeline to ``folder`` (seeded; seconds): the prompt components of
    :func:`random_hunyuan_video15_text_components`, an AutoencoderKLHunyuanVideo15 compressing 8x in space and 4x in
    time into 4 channels with scaling factor 0.9 (so that decoding checks the division) and a 1-block
    HunyuanVideo15Transformer3DModel (:data:`HV15_TRANSFORMER`)."""
    from diffusers import AutoencoderKLHunyuanVideo15, HunyuanVideo15Pipeline, HunyuanVideo15Transformer3DModel

    text = random_hunyuan_video15_text_components()
    vae = AutoencoderKLHunyuanVideo15(
        latent_channels=4,
        block_out_channels=(8, 16, 16, 16),
        layers_per_block=1,
        spatial_compression_ratio=8,
        temporal_compression_ratio=4,
        scaling_factor=0.9,
    )
    dit = HunyuanVideo15Transformer3DModel(
        patch_size=1, patch_size_t=1, target_size=64, task_type="t2v", **HV15_TRANSFORMER
    )
    pipe = HunyuanVideo15Pipeline(transformer=dit, vae=vae, **text)
    pipe.save_pretrained(folder)
    return folder


def stock_hunyuan_video15(
    folder, model, metas, noise, num_steps, guidance_scale, negative_prompt=None
) -> torch.Tensor:
    """The stock HunyuanVideo15Pipeline's videos ``(B, F, 3, H, W)`` float32 in [0, 1] for the prompt records ``metas``
    from the initial latents ``noise (B, *model.latent_shape)``, at the model's frames, side and prompt length (the
    pipeline's ``tokenizer_max_length``), guided by its guider at ``guidance_scale``
    (``guider.new(guidance_scale=...)``: the pipeline takes no guidance argument). The guider's other settings are the
    folder's. One video per call: the stock VAE cannot decode two at once (diffusers PR #13133)."""
    pipe = stock_pipeline(folder, "HunyuanVideo15Pipeline")
    pipe.tokenizer_max_length = model.max_sequence_length
    pipe.guider = pipe.guider.new(guidance_scale=guidance_scale)
    settings = sized(model, num_steps, length=False, frames=True)

    def one(meta, z):
        return pipe(meta["prompt"], negative_prompt=negative_prompt, latents=z, **settings).frames

    return per_record(one, metas, noise)
