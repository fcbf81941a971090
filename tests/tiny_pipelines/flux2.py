"""FLUX.2: tiny random ``Flux2KleinPipeline`` (a tiny 27-layer Qwen3 text encoder, since the pipeline reads hidden
states 9, 18 and 27) and ``Flux2Pipeline`` (a tiny 30-layer Mistral 3 with a PixtralProcessor built offline), and the
stock pipelines' images with the records' reference images."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from .common import AUTOENCODER_KL, per_record, prompts_of, sized, stock_pipeline
from .text import QWEN3_CHAT_TEMPLATE, build_qwen_tokenizer, text_model_config, tiny_world_prompts

MISTRAL_CHAT_TEMPLATE = (
    "{%- for message in messages %}[{{ message['role'] | upper }}]"
    "{%- for part in message['content'] %}{%- if part['type'] == 'text' %}{{ part['text'] }}{%- endif %}{%- endfor %}"
    "[/{{ message['role'] | upper }}]{%- endfor %}"
)
"""A chat template of the shape Flux2Pipeline's ``format_input`` messages take (a system and a user turn whose
contents are lists of typed parts)."""


def build_random_flux2_klein_pipeline(folder: Path, distilled: bool = False) -> Path:
    """Save a random-weight Flux2KleinPipeline to ``folder`` (seeded; seconds): a 27-layer Qwen3ForCausalLM (hidden
    16) with the offline Qwen2 tokenizer and Qwen3's chat template, an AutoencoderKLFlux2 of factor 4 with 4 latent
    channels and random batch-norm statistics (so that decoding checks the de-normalisation), a Flux2 transformer of
    one dual- and one single-stream block (16 input channels: 4 x the 2x2 patches) without guidance embedding, and
    klein's scheduler config (dynamic exponential shifting: the pipeline passes ``mu``). ``distilled`` sets the
    pipeline's ``is_distilled`` (klein 4B / 9B; False: a base model, sampled with CFG)."""
    from diffusers import (
        AutoencoderKLFlux2,
        FlowMatchEulerDiscreteScheduler,
        Flux2KleinPipeline,
        Flux2Transformer2DModel,
    )
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    tok = build_qwen_tokenizer()
    tok.chat_template = QWEN3_CHAT_TEMPLATE
    te = Qwen3ForCausalLM(Qwen3Config(**text_model_config(tok, 16, 27, head_dim=8, tie_word_embeddings=True)))
    bare = dict(use_quant_conv=False, use_post_quant_conv=False, mid_block_add_attention=False)  # FLUX.2's VAE
    vae = AutoencoderKLFlux2(**AUTOENCODER_KL, sample_size=32, **bare)
    vae.bn.running_mean.copy_(torch.randn(16) * 0.2)
    vae.bn.running_var.copy_(torch.rand(16) + 0.5)
    dit = Flux2Transformer2DModel(
        in_channels=16,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=48,  # 3 Qwen3 layers x hidden 16
        timestep_guidance_channels=32,
        axes_dims_rope=(4, 4, 4, 4),
        guidance_embeds=False,
    )
    scheduler = FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, time_shift_type="exponential"
    )
    pipe = Flux2KleinPipeline(
        scheduler=scheduler, vae=vae, text_encoder=te, tokenizer=tok, transformer=dit, is_distilled=distilled
    )
    pipe.save_pretrained(folder)
    return folder


def build_pixtral_processor():
    """A PixtralProcessor (the FLUX.2 [dev] tokenizer's class) built offline: a byte-level BPE of 500 tokens trained on
    BFL's system message and the tiny world's prompts (system message and prompt fit in 40 tokens), with Pixtral's
    image tokens, and :data:`MISTRAL_CHAT_TEMPLATE`."""
    from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE
    from tokenizers import Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE
    from tokenizers.trainers import BpeTrainer
    from transformers import PixtralImageProcessor, PixtralProcessor, PreTrainedTokenizerFast

    specials = [
        "<pad>",
        "<s>",
        "</s>",
        "[IMG]",
        "[IMG_BREAK]",
        "[IMG_END]",
        "[SYSTEM]",
        "[/SYSTEM]",
        "[USER]",
        "[/USER]",
    ]
    bpe = Tokenizer(BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    text = [f"[SYSTEM]{SYSTEM_MESSAGE}[/SYSTEM][USER]{p}[/USER]" for p in tiny_world_prompts()]
    trainer = BpeTrainer(
        vocab_size=500,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(text * 3, trainer)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        additional_special_tokens=specials[3:],
    )
    images = PixtralImageProcessor(patch_size=4, size={"longest_edge": 32})
    return PixtralProcessor(image_processor=images, tokenizer=tok, patch_size=4, chat_template=MISTRAL_CHAT_TEMPLATE)


def build_random_flux2_pipeline(folder: Path, guidance_embeds: bool = True) -> Path:
    """Save a random-weight Flux2Pipeline (FLUX.2 [dev]'s layout) to ``folder`` (seeded; seconds): a
    Mistral3ForConditionalGeneration with a 30-layer text model (hidden 16; the pipeline reads hidden states 10, 20
    and 30) and a one-layer Pixtral vision tower, :func:`build_pixtral_processor`, and the VAE, transformer and
    scheduler of :func:`build_random_flux2_klein_pipeline`, the transformer with a guidance embedding
    (``guidance_embeds``, as [dev]: the guidance scale is its input)."""
    from diffusers import Flux2KleinPipeline, Flux2Pipeline, Flux2Transformer2DModel
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration, MistralConfig, PixtralVisionConfig

    klein = build_random_flux2_klein_pipeline(folder / "klein")
    base = Flux2KleinPipeline.from_pretrained(klein)
    torch.manual_seed(0)
    processor = build_pixtral_processor()
    tok = processor.tokenizer
    text = MistralConfig(**text_model_config(tok, 16, 30, head_dim=8))
    vision = PixtralVisionConfig(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        head_dim=8,
        image_size=32,
        patch_size=4,
    )
    te = Mistral3ForConditionalGeneration(
        Mistral3Config(
            text_config=text,
            vision_config=vision,
            image_token_index=tok.convert_tokens_to_ids("[IMG]"),
            spatial_merge_size=1,
        )
    )
    transformer = base.transformer
    if guidance_embeds:
        transformer = Flux2Transformer2DModel.from_config({**transformer.config, "guidance_embeds": True})
    pipe = Flux2Pipeline(
        scheduler=base.scheduler, vae=base.vae, text_encoder=te, tokenizer=processor, transformer=transformer
    )
    shutil.rmtree(klein)
    pipe.save_pretrained(folder)
    return folder


def _references(meta: dict) -> list[str]:
    """A prompt record's reference image paths: its ``image``, or its ``images`` (none: ``[]``)."""
    return [meta["image"]] if "image" in meta else meta.get("images", [])


def _stock(cls_name: str, folder, model, metas, noise, num_steps, guidance_scale) -> torch.Tensor:
    """The stock pipeline ``cls_name``'s images ``(B, 3, H, W)`` float32 in [0, 1] for the prompt records ``metas``
    from the latents ``noise (B, *model.latent_shape)`` (the patchified latents the pipeline takes as ``latents=`` and
    packs itself): one call for text-only records; one call per record with its reference images (``image`` or
    ``images``, opened as PIL images) as ``image=`` otherwise, since the pipeline gives every prompt of a call the
    same references."""
    from PIL import Image

    pipe = stock_pipeline(folder, cls_name)
    settings = {"guidance_scale": guidance_scale, **sized(model, num_steps)}
    if not any(_references(m) for m in metas):
        with torch.no_grad():
            return pipe(prompt=prompts_of(metas), latents=noise, **settings).images

    def one(meta, z):
        image = [Image.open(p).convert("RGB") for p in _references(meta)] or None
        return pipe(prompt=[meta["prompt"]], image=image, latents=z, **settings).images

    return per_record(one, metas, noise)


def stock_flux2_klein(folder, model, metas, noise, num_steps, guidance_scale) -> torch.Tensor:
    """The stock Flux2KleinPipeline's images (:func:`_stock`) at the pipeline's guidance scale (the same convention as
    flowrl's; ignored when distilled)."""
    return _stock("Flux2KleinPipeline", folder, model, metas, noise, num_steps, guidance_scale)


def stock_flux2(folder, model, metas, noise, num_steps, guidance_scale) -> torch.Tensor:
    """The stock Flux2Pipeline's images (:func:`_stock`) at the embedded guidance scale ``guidance_scale``."""
    return _stock("Flux2Pipeline", folder, model, metas, noise, num_steps, guidance_scale)
