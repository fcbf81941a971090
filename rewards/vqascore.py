"""VQAScore: the probability that a vision-language model answers "Yes" when asked whether an image shows its prompt.

VQAScore (Lin et al., "Evaluating Text-to-Visual Generation with Image-to-Text Generation", arXiv 2404.01291;
reference implementation github.com/linzhiqiu/t2v_metrics, ``t2v_metrics/models/vqascore_models/qwen2vl_model.py``)
asks the VLM ``Does this figure show "{prompt}"? Please answer Yes or No.`` about the image and scores it by the
probability of the answer ``Yes`` right after the question. Here the answer is teacher-forced: the chat-template
prompt (image, then question, then the generation prompt) is followed by the answer's tokens, one forward pass
gives the logits at each answer position, and the score is the geometric mean of the answer tokens' softmax
probabilities, ``exp(mean_j log p(a_j | image, question, a_<j))``. For a one-token answer (``Yes`` in Qwen's
vocabulary) that is t2v_metrics' Qwen2.5-VL score (``generate`` with ``max_new_tokens=1``, the softmax of the
first new token's logits at the answer's token); for a longer answer it is CLIP-FlanT5's ``exp(-mean CE)`` of the
labels, while t2v_metrics' Qwen path with its default ``max_new_tokens=1`` reads only the first answer token.
t2v_metrics reads the logits from ``generate(..., output_scores=True)``, which passes them through the logits
processors of the checkpoint's ``generation_config.json``: a ``repetition_penalty`` there changes its score (the
question holds "Yes" and "No"); this reward reads the model's logits as they are.

Backends: Qwen2.5-VL (``Qwen2_5_VLForConditionalGeneration``, e.g. ``Qwen/Qwen2.5-VL-7B-Instruct``, t2v_metrics'
``qwen2.5-vl-7b``) and Qwen2-VL (``Qwen2VLForConditionalGeneration``), chosen from the folder's ``config.json``.
CLIP-FlanT5 (t2v_metrics' ``clip-flant5-xxl``, the paper's model) is a custom architecture outside transformers
and is not supported. :class:`VQAScore` is also the local backend of ``vlm_yes`` (``flowrl.rewards.vlm``), which
reads ``P(yes) / (P(yes) + P(no))`` from the same first-answer-position logits.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .base import (
    check_batch_size,
    check_inputs,
    check_json_files,
    chunk_slices,
    is_integer,
    load_pretrained,
    register_reward,
)
from .frozen import as_dtype, frozen
from .options import check_folder

__all__ = [
    "ARCHITECTURES",
    "VQASCORE_ANSWER",
    "VQASCORE_QUESTION",
    "VQASCORE_QUESTION_T5",
    "VQAScore",
    "check_options",
    "check_template",
    "load_vlm",
    "vqascore",
]

VQASCORE_QUESTION = 'Does this figure show "{prompt}"? Please answer Yes or No.'
"""The question t2v_metrics asks its Qwen2.5-VL / Qwen2-VL models (``qwen2vl_model.py``'s default
``question_template``, ``{}`` written ``{prompt}``); the default of ``vqascore``."""

VQASCORE_QUESTION_T5 = 'Does this figure show "{prompt}"? Please answer yes or no.'
"""The paper's question, t2v_metrics' default for CLIP-FlanT5 (lower-case "yes or no")."""

VQASCORE_ANSWER = "Yes"
"""The answer whose probability is the score (t2v_metrics' default ``answer_template``)."""

ARCHITECTURES = {
    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
    "qwen2_vl": "Qwen2VLForConditionalGeneration",
}
"""``config.json``'s ``model_type`` -> the transformers class :func:`vqascore` loads."""


def chat_texts(processor: Any, media: str, texts: Sequence[str]) -> list[str]:
    """The processor's chat template for each of `texts`: one user turn of the `media` (``"image"`` or ``"video"``)
    then the text, and the generation prompt (untokenized strings, one per text)."""
    messages = [[{"role": "user", "content": [{"type": media}, {"type": "text", "text": text}]}] for text in texts]
    return processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def check_template(reward: str, option: str, text: Any) -> str:
    """`text` if it is a string whose only placeholder is ``{prompt}``.

    Raises:
        ValueError: ``"{reward}: {option} ..."``, for a non-string or another placeholder (literal braces are
            written ``{{ }}``).
    """
    if not isinstance(text, str):
        raise ValueError(f"{reward}: {option} must be a string with the placeholder {{prompt}}, got {text!r}")
    try:
        text.format(prompt="")
    except (KeyError, IndexError, ValueError) as err:
        raise ValueError(
            f"{reward}: {option} may hold only the placeholder {{prompt}} (write other braces as {{{{ }}}}); "
            f"{type(err).__name__}: {err}"
        ) from None
    return text


def check_options(
    reward: str, question: Any, answer: Any, max_pixels: Any, dtype: Any, batch_size: Any
) -> tuple[str, str, torch.dtype]:
    """The options of :class:`VQAScore` that need no model, checked (the factories call it before loading one).

    Returns:
        `(question, answer, dtype)`, the dtype as a `torch.dtype`.

    Raises:
        ValueError: naming `reward` and the option: a template with another placeholder than ``{prompt}``, a
            `max_pixels` or `batch_size` that is not an integer >= 1 or None, a dtype that is not floating.
    """
    question, answer = check_template(reward, "question", question), check_template(reward, "answer", answer)
    if max_pixels is not None and (not is_integer(max_pixels) or max_pixels < 1):
        raise ValueError(f"{reward}: max_pixels must be an integer >= 1 or null, got {max_pixels!r}")
    check_batch_size(batch_size, reward)
    try:
        return question, answer, as_dtype(dtype)
    except ValueError as err:
        raise ValueError(f"{reward}: {err}") from None


class VQAScore:
    """Score images by a VLM's probability of answering `answer` to `question` about them (VQAScore).

    Use the :func:`vqascore` factory to load one from a folder; build this class directly to wrap a model already
    in memory. Each image goes through the processor's chat template as one user turn (the image, then the
    question with ``{prompt}`` filled in) with the generation prompt, followed by the answer (``{prompt}`` filled
    in too); the processor resizes the image (its ``min_pixels`` / ``max_pixels`` bounds, or `max_pixels`) and
    normalises it. Only the language model's final hidden states at the answer positions go through ``lm_head``.

    Args:
        model (`transformers.Qwen2_5_VLForConditionalGeneration` or `Qwen2VLForConditionalGeneration`): put in eval
            mode, frozen, and moved to `device` and `dtype`.
        processor (`transformers.Qwen2_5_VLProcessor` or `Qwen2VLProcessor`): the checkpoint's tokenizer, image
            processor and chat template.
        question (`str`): the user's text after the image; ``{prompt}`` is its only placeholder
            (default :data:`VQASCORE_QUESTION`).
        answer (`str`): the assistant's answer whose probability is the score, ``{prompt}`` its only placeholder
            (default ``"Yes"``); it must tokenize to at least one token.
        max_pixels (`int >= 1`, *optional*): the image processor's largest pixel count after resizing; default the
            processor's own (Qwen2.5-VL-Instruct's: 12845056, as qwen_vl_utils').
        device (`str` or `torch.device`), dtype (`torch.dtype` or `str`): where and in what the model runs
            (``bfloat16`` on a GPU, as t2v_metrics; the softmax is taken in float32).
        batch_size (`int >= 1`, *optional*): images per forward; default all at once.

    Returns (when called):
        `torch.Tensor` of shape `(B,)`, float32, CPU, in `(0, 1]`: the geometric mean over the answer's tokens of
        their teacher-forced probabilities (the probability of "Yes" for the default answer).

    Raises:
        ValueError: a bad `question` / `answer` (see :func:`check_template`), an empty answer, a bad `max_pixels`
            or `batch_size`, or a dtype that is not floating; when called, malformed inputs
            (`rewards.base.check_inputs`), or an answer that the chat template's text around it tokenizes
            differently from the answer alone.
    """

    name = "vqascore"

    def __init__(
        self,
        model: torch.nn.Module,
        processor: Any,
        question: str = VQASCORE_QUESTION,
        answer: str = VQASCORE_ANSWER,
        max_pixels: int | None = None,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | str = torch.float32,
        batch_size: int | None = None,
    ):
        self.question, self.answer, self.dtype = check_options(
            self.name, question, answer, max_pixels, dtype, batch_size
        )
        if not processor.tokenizer.encode(answer.format(prompt=""), add_special_tokens=False):
            raise ValueError(f"{self.name}: answer must be a non-empty text (the tokens whose probability is scored)")
        self.processor, self.max_pixels, self.batch_size = processor, max_pixels, batch_size
        self.device = torch.device(device)
        self.model = frozen(model, self.device, self.dtype)

    def texts(self, prompts: Sequence[str]) -> list[str]:
        """The model's text for each prompt: the chat template (image, question, generation prompt) + answer."""
        chats = chat_texts(self.processor, "image", [self.question.format(prompt=prompt) for prompt in prompts])
        return [chat + self.answer.format(prompt=prompt) for chat, prompt in zip(chats, prompts)]

    def inputs(self, images: torch.Tensor, prompts: Sequence[str]) -> dict[str, torch.Tensor]:
        """The processor's batch (on `device`) for `(b, 3, H, W)` images in `[0, 1]` and `b` prompts: token ids with
        the image's placeholder tokens expanded, ``attention_mask`` (padding where 0), ``pixel_values`` and
        ``image_grid_thw``."""
        options: dict[str, Any] = {"do_rescale": False}
        if self.max_pixels is not None:
            shortest = self.processor.image_processor.size["shortest_edge"]
            options["size"] = {"shortest_edge": min(shortest, self.max_pixels), "longest_edge": self.max_pixels}
        batch = self.processor(
            text=self.texts(prompts),
            images=[image.float().cpu() for image in images],
            padding=True,
            return_tensors="pt",
            images_kwargs=options,
        )
        return {k: v.to(self.device) for k, v in batch.items()}

    def answer_logits(
        self, images: torch.Tensor, prompts: Sequence[str]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Teacher-forced logits of the answer tokens (one forward of the batch).

        Args:
            images (`(b, 3, H, W)` float in [0, 1]), prompts (`b` strings).

        Returns:
            logits (`(b, n, V)` float32): position ``j`` holds the logits predicting answer token ``j`` (``j = 0``:
                the first token after the generation prompt), ``n`` the longest answer in tokens;
            targets (`(b, n)` int64): the answer's token ids (0 past a row's answer);
            mask (`(b, n)` bool): True on a row's answer tokens.

        Raises:
            ValueError: the answer's tokens are not the last tokens of the tokenized text (the template's text
                merged with them); the message names the answer.
        """
        batch = self.inputs(images, prompts)
        tokenizer = self.processor.tokenizer
        answers = [tokenizer.encode(self.answer.format(prompt=p), add_special_tokens=False) for p in prompts]
        n = max(len(a) for a in answers)
        targets = torch.zeros(len(prompts), n, dtype=torch.long)
        mask = torch.zeros(len(prompts), n, dtype=torch.bool)
        for row, answer in enumerate(answers):
            targets[row, : len(answer)], mask[row, : len(answer)] = torch.tensor(answer), True
        lengths = mask.sum(dim=1).to(self.device)  # (b,)
        last = batch["attention_mask"].cumsum(dim=1).argmax(dim=1)  # (b,): last attended position (any padding side)
        start = last - lengths + 1  # (b,): first answer token
        offsets = torch.arange(n, device=self.device)
        positions = torch.minimum(start.unsqueeze(1) + offsets, last.unsqueeze(1))  # (b, n), clamped past the answer
        rows = torch.arange(len(prompts), device=self.device).unsqueeze(1)
        found = batch["input_ids"][rows, positions].cpu()  # (b, n)
        if not torch.equal(found[mask], targets[mask]):
            raise ValueError(
                f"{self.name}: answer {self.answer!r} does not tokenize the same after the chat template as alone; "
                "start it with a character that cannot merge with the generation prompt"
            )
        hidden = self.model.model(**batch).last_hidden_state  # (b, L, D), after the final norm
        logits = self.model.lm_head(hidden[rows, positions - 1])  # (b, n, V): each predicts the token after it
        return logits.float().cpu(), targets, mask

    def scores(self, logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """`(b,)` float32: ``exp`` of the mean over each row's answer tokens of their log-softmax probability."""
        log_probs = logits.log_softmax(dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # (b, n)
        return ((log_probs * mask).sum(dim=1) / mask.sum(dim=1)).exp()

    @torch.no_grad()
    def __call__(
        self, images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]]
    ) -> torch.Tensor:
        check_inputs(images, prompts, metadata)
        prompts = list(prompts)
        out = [
            self.scores(*self.answer_logits(images[part], prompts[part]))
            for part in chunk_slices(len(prompts), self.batch_size)
        ]
        return torch.cat(out) if out else torch.zeros(0)


def load_vlm(reward: str, model_path: str | os.PathLike) -> tuple[torch.nn.Module, Any]:
    """Load `(model, processor)` of a Qwen2.5-VL or Qwen2-VL folder (or a hub id in the local cache; nothing is
    downloaded), the class chosen by ``config.json``'s ``model_type`` (:data:`ARCHITECTURES`).

    Raises:
        FileNotFoundError: `model_path` is neither a folder nor a cached hub id, or has no ``config.json``.
        ValueError: another ``model_type``; the message names it and the supported ones. A ``*.json`` file of the
            folder that is not JSON, named.
    """
    import transformers
    from transformers import AutoConfig, AutoProcessor

    folder = check_folder(model_path, "model_path", need_config=False, reward=reward)
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(
            f"{reward}: model_path '{model_path}' has no config.json (save it with save_pretrained)"
        )
    check_json_files(folder, reward)  # an HTML page saved as config.json: named, not a transformers OSError
    model_type = AutoConfig.from_pretrained(folder, local_files_only=True).model_type
    if model_type not in ARCHITECTURES:
        raise ValueError(
            f"{reward}: model_path '{model_path}' is a {model_type!r} model; supported: "
            f"{', '.join(ARCHITECTURES)} (Qwen2.5-VL, Qwen2-VL)"
        )
    model = load_pretrained(getattr(transformers, ARCHITECTURES[model_type]), folder, reward)
    return model, AutoProcessor.from_pretrained(folder, local_files_only=True)


@register_reward(
    "vqascore",
    modality="image",
    weights="a Qwen2.5-VL or Qwen2-VL folder (e.g. Qwen/Qwen2.5-VL-7B-Instruct)",
)
def vqascore(
    model_path: str | os.PathLike,
    question: str = VQASCORE_QUESTION,
    answer: str = VQASCORE_ANSWER,
    max_pixels: int | None = None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | str = torch.float32,
    batch_size: int | None = None,
) -> VQAScore:
    """Load a :class:`VQAScore` reward (arXiv 2404.01291; t2v_metrics' ``qwen2vl_model.py``) from a local folder.

    Args:
        model_path (`str` or path): a Qwen2.5-VL or Qwen2-VL folder saved with ``save_pretrained`` with its
            processor (e.g. ``hf download Qwen/Qwen2.5-VL-7B-Instruct --local-dir <folder>``), or that hub id when it
            is in the local Hugging Face cache.
        question, answer, max_pixels, device, dtype, batch_size: see :class:`VQAScore`.

    Returns:
        A :class:`VQAScore`: `(B, 3, H, W)` images in `[0, 1]` -> `(B,)` float32 CPU scores in `(0, 1]`.

    Raises:
        FileNotFoundError, ValueError: see :func:`load_vlm` and :class:`VQAScore`.
    """
    check_options("vqascore", question, answer, max_pixels, dtype, batch_size)  # before the (slow) load
    model, processor = load_vlm("vqascore", model_path)
    return VQAScore(model, processor, question, answer, max_pixels, device, dtype, batch_size)
