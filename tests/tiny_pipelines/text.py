"""Offline tokenizers and tiny text-encoder settings that several families' pipelines share.

Every tokenizer is built here without a download: the tiny world's CLIP tokenizer shipped in ``assets/``, word-piece
T5 vocabularies, and byte-level BPEs trained in a second on each pipeline's prompt template and the tiny world's
prompts, so that the template's prefix has the token count the pipeline crops.
"""

from __future__ import annotations

import json

QWEN_IMAGE_TEMPLATE = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, "
    "spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n"
    "<|im_start|>assistant\n"
)
"""QwenImagePipeline's prompt template (``prompt_template_encode``): its system prefix is 34 tokens with Qwen's
tokenizer."""

QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
"""Qwen2's end-of-text and chat-turn special tokens."""

QWEN3_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)
"""Qwen3's chat template for the single user message ``ZImagePipeline`` and ``Flux2KleinPipeline`` encode: with
``enable_thinking=True`` (the pipelines') the prompt ends with the assistant header, without the empty think block."""


def tiny_world_prompts() -> list[str]:
    """The tiny world's train and test prompts (``flowrl.tiny.prompts.split(0)``), in that order."""
    from flowrl.tiny.prompts import split

    train, test = split(0)
    return [m["prompt"] for m in train + test]


def tiny_clip_tokenizer():
    """The tiny world's CLIP tokenizer shipped in ``assets/tiny-sd3/tokenizer`` (the real CLIP BPE, 16 tokens)."""
    from transformers import CLIPTokenizer

    from flowrl.tiny.sd15 import TOKENIZER

    return CLIPTokenizer.from_pretrained(TOKENIZER)


def clip_text_config(tok, num_hidden_layers: int, max_position_embeddings: int, **extra) -> dict:
    """Keyword arguments of a ``CLIPTextConfig`` 32 wide (2 heads, MLP 64) over the tokenizer ``tok``'s vocabulary and
    special tokens, with ``num_hidden_layers`` layers and ``max_position_embeddings`` positions; ``extra`` added
    (``projection_dim``)."""
    return dict(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=2,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        **extra,
    )


def t5_config(vocab_size: int, **ids) -> dict:
    """Keyword arguments of a one-layer T5 / UMT5 encoder config (d_model 32, 4 heads of 8, MLP 64, 8 relative
    position buckets) over ``vocab_size`` tokens; ``ids``: its ``pad_token_id`` / ``eos_token_id``."""
    return dict(
        vocab_size=vocab_size,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=1,
        num_heads=4,
        relative_attention_num_buckets=8,
        **ids,
    )


def text_model_config(tok, hidden_size: int, num_hidden_layers: int, **extra) -> dict:
    """Keyword arguments of a tiny decoder-only text model config (Qwen2.5-VL, Qwen3, Mistral, Gemma, Llama) over the
    tokenizer ``tok``'s vocabulary and special tokens: ``hidden_size`` wide with an MLP twice as wide, 2 attention
    heads sharing 1 key-value head, 1024 positions, ``num_hidden_layers`` layers; ``extra`` overrides or adds keys
    (``head_dim``, ``rope_parameters``, ...)."""
    return {
        "vocab_size": len(tok),
        "hidden_size": hidden_size,
        "intermediate_size": 2 * hidden_size,
        "num_hidden_layers": num_hidden_layers,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "max_position_embeddings": 1024,
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.pad_token_id,
        **extra,
    }


QWEN_ROPE = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
"""Qwen2.5-VL's multimodal rotary settings at the tiny head size (16 = 2 x (2 + 3 + 3))."""


def word_t5_tokenizer(words: list[str]):
    """A ``T5Tokenizer`` (sentencepiece unigram) over a small vocabulary: pad, eos and unk, ``words`` as whole-word
    pieces (most likely first), the 26 lower-case letters and the word boundary alone."""
    from transformers import T5Tokenizer

    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)] + [
        ("\u2581" + w, -1.0 - 0.01 * i) for i, w in enumerate(words)
    ]
    vocab += [(c, -5.0) for c in "abcdefghijklmnopqrstuvwxyz"] + [("\u2581", -6.0)]
    return T5Tokenizer(vocab=vocab, extra_ids=0)


def _vocab_and_merges(bpe) -> tuple[dict, list[tuple[str, str]]]:
    """A trained ``tokenizers`` BPE's vocabulary and merges, as the slow tokenizer classes take them."""
    model = json.loads(bpe.to_str())["model"]
    return model["vocab"], [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]


def qwen2_tokenizer(texts: list[str], vocab_size: int, specials: list[str]):
    """A ``Qwen2Tokenizer`` (byte-level BPE behind Qwen2's pre-tokenizer, NFC-normalised) of ``vocab_size`` tokens
    trained on ``texts`` (three passes), ``specials`` first (the first is the end of text, the others are added as
    additional special tokens)."""
    from tokenizers import Regex, Tokenizer, normalizers, pre_tokenizers
    from tokenizers.models import BPE
    from tokenizers.trainers import BpeTrainer
    from transformers import Qwen2Tokenizer
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    bpe = Tokenizer(BPE())
    bpe.normalizer = normalizers.NFC()
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    bpe.train_from_iterator(
        texts * 3,
        BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=specials,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    vocab, merges = _vocab_and_merges(bpe)
    return Qwen2Tokenizer(vocab=vocab, merges=merges, additional_special_tokens=specials[1:])


def build_qwen_tokenizer():
    """A Qwen2Tokenizer of 400 tokens (:func:`qwen2_tokenizer`) trained on the Qwen-Image pipeline's prompt template
    (:data:`QWEN_IMAGE_TEMPLATE`) around the tiny world's prompts, so the template's system prefix is 34 tokens, as
    with Qwen's own tokenizer: ``QwenImagePipeline`` drops exactly that many (``prompt_template_encode_start_idx``).
    Z-Image and FLUX.2 klein take it with :data:`QWEN3_CHAT_TEMPLATE`."""
    return qwen2_tokenizer([QWEN_IMAGE_TEMPLATE.format(p) for p in tiny_world_prompts()], 400, QWEN_SPECIALS)


def build_gemma_tokenizer():
    """A GemmaTokenizer (BPE with byte fallback, BOS added) of 300 tokens, trained on the SANA pipeline's complex human
    instruction followed by the tiny world's prompts (SANA's and LTX-2's Gemma encoders)."""
    import inspect

    from diffusers import SanaPipeline
    from tokenizers import Tokenizer, normalizers, pre_tokenizers
    from tokenizers.models import BPE
    from tokenizers.trainers import BpeTrainer
    from transformers import GemmaTokenizer

    instruction = "\n".join(inspect.signature(SanaPipeline.__call__).parameters["complex_human_instruction"].default)
    bpe = Tokenizer(BPE(unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    bpe.normalizer = normalizers.Replace(" ", "▁")  # GemmaTokenizer's
    bpe.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous", invert=False)
    trainer = BpeTrainer(vocab_size=300, special_tokens=["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"])
    bpe.train_from_iterator([instruction + p.lower() for p in tiny_world_prompts()] * 2, trainer)
    vocab, merges = _vocab_and_merges(bpe)
    return GemmaTokenizer(vocab=vocab, merges=merges, add_bos_token=True)
