"""HunyuanVideo: a tiny random ``HunyuanVideoPipeline`` (a 3-layer Llama with a byte-level BPE tokenizer trained on the
pipeline's prompt template, a 1-layer CLIP with the tiny CLIP tokenizer, ``HunyuanVideoTransformer3DModel``,
``AutoencoderKLHunyuanVideo``) and the stock pipeline's videos."""

from __future__ import annotations

from pathlib import Path

import torch

from .common import stock_text_to_video
from .text import clip_text_config, text_model_config, tiny_clip_tokenizer

PROMPTS = ["a red circle moving left", "two blue squares moving up, then a green star appears"]  # different lengths
"""The HunyuanVideo tests' prompts, which the Llama tokenizer is trained on (with a negative prompt)."""
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
    r"\s*[\r\n]+|\s+(?!\S)|\s+"
)  # Llama 3's pre-tokenizer pattern (its tokenizer.json)
LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]


def build_llama3_tokenizer():
    """A Llama-3-style tokenizer (byte-level BPE behind Llama 3's pre-tokenizer, ``<|begin_of_text|>`` prepended, the
    header and end-of-turn special tokens, padding on the right) trained on HunyuanVideo's prompt template and
    :data:`PROMPTS`: the template's system part is 95 tokens, as with LLaVA-Llama-3's tokenizer, so the pipeline's
    ``crop_start`` (95) drops exactly that part. Wrapped in ``PreTrainedTokenizerFast``, the class Llama 3 ships."""
    from diffusers.pipelines.hunyuan_video.pipeline_hunyuan_video import DEFAULT_PROMPT_TEMPLATE
    from tokenizers import Regex, Tokenizer, decoders, pre_tokenizers, processors
    from tokenizers.models import BPE
    from tokenizers.trainers import BpeTrainer
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(BPE())
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    bpe.decoder = decoders.ByteLevel()
    texts = [DEFAULT_PROMPT_TEMPLATE["template"].format(p) for p in PROMPTS + ["a blurry static video"]]
    bpe.train_from_iterator(
        texts * 3,
        BpeTrainer(
            vocab_size=600,
            special_tokens=LLAMA3_SPECIALS,
            show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    bpe.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", 0)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        bos_token="<|begin_of_text|>",
        eos_token="<|end_of_text|>",
        pad_token="<|end_of_text|>",
        padding_side="right",
    )


def build_random_hunyuan_pipeline(folder: Path) -> Path:
    """Save a random-weight HunyuanVideoPipeline to `folder` (seeded): :func:`build_llama3_tokenizer` with a 3-layer
    Llama (hidden 32; the pipeline reads the third-last hidden states), a 1-layer CLIP text model with the tiny CLIP
    tokenizer (77 positions: the pipeline pads CLIP prompts to 77), a HunyuanVideo VAE (4 latent channels, 4x
    temporal, 8x spatial compression), a transformer of one dual-stream, one single-stream and one refiner block with
    guidance embedding, and the flow-matching Euler scheduler at HunyuanVideo's shift 7."""
    from diffusers import (
        AutoencoderKLHunyuanVideo,
        FlowMatchEulerDiscreteScheduler,
        HunyuanVideoPipeline,
        HunyuanVideoTransformer3DModel,
    )
    from transformers import CLIPTextConfig, CLIPTextModel, LlamaConfig, LlamaModel

    torch.manual_seed(0)
    tok = build_llama3_tokenizer()
    extra = dict(num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    llama = LlamaModel(LlamaConfig(**text_model_config(tok, 32, 3, **extra)))
    clip_tok = tiny_clip_tokenizer()
    clip = CLIPTextModel(CLIPTextConfig(**clip_text_config(clip_tok, 1, 77)))
    vae = AutoencoderKLHunyuanVideo(
        latent_channels=4,
        block_out_channels=(4, 4, 4, 4),
        layers_per_block=1,
        norm_num_groups=2,
        spatial_compression_ratio=8,
        temporal_compression_ratio=4,
    )
    dit = HunyuanVideoTransformer3DModel(
        in_channels=4,
        out_channels=4,
        num_attention_heads=2,
        attention_head_dim=8,
        num_layers=1,
        num_single_layers=1,
        num_refiner_layers=1,
        patch_size=2,
        patch_size_t=1,
        text_embed_dim=32,
        pooled_projection_dim=32,
        rope_axes_dim=(2, 2, 4),
        guidance_embeds=True,
    )
    pipe = HunyuanVideoPipeline(
        text_encoder=llama,
        tokenizer=tok,
        transformer=dit,
        vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0),
        text_encoder_2=clip,
        tokenizer_2=clip_tok,
    )
    pipe.save_pretrained(folder)
    return folder


def stock_hunyuan_video(
    folder: Path, model, metas: list[dict], noise: torch.Tensor, num_steps: int, guidance_scale: float, **kwargs
) -> torch.Tensor:
    """The stock HunyuanVideoPipeline's videos (:func:`tiny_pipelines.common.stock_text_to_video`): its embedded
    guidance at ``guidance_scale``; ``kwargs``: ``lora``, ``negative_prompt`` and the pipeline's ``true_cfg_scale``."""
    cls = "HunyuanVideoPipeline"
    return stock_text_to_video(cls, folder, model, metas, noise, num_steps, guidance_scale, **kwargs)
