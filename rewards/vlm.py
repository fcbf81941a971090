r"""Pointwise VLM judges: a vision-language model behind an OpenAI-compatible server scores each image.

``unifiedreward`` asks UnifiedReward (Wang et al., "Unified Reward Model for Multimodal Understanding and
Generation", arXiv 2503.05236; models ``CodeGoat24/UnifiedReward-7b-v1.5`` and siblings, served by vLLM or
SGLang) its pointwise image-generation question, which asks for a score from 1 to 5 after ``Final Score:``,
and reads that score back. The question, the image-then-text message order, the sampling at temperature 0 and
the division by 5 are those of flow_grpo's UnifiedReward SGLang client (the flow_grpo repository,
github.com/yifan123/flow_grpo), which reads ``Final Score:\s*([1-5](?:\.\d+)?)`` and scores ``score / 5``.

``vlm_yes`` reads ``P(yes) / (P(yes) + P(no))`` of a VLM's one-token answer to whether the image shows its prompt,
either from a served model's top log-probabilities (``base_url``) or in-process from a local Qwen2.5-VL / Qwen2-VL
folder (``model_path``) through :class:`flowrl.rewards.vqascore.VQAScore`'s teacher-forced forward.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from .base import check_inputs, is_integer, register_reward
from .pairwise import _data_url, chat_client
from .vqascore import VQASCORE_ANSWER, VQAScore, check_options, load_vlm

__all__ = [
    "UNIFIEDREWARD_QUESTION",
    "VLMScore",
    "VLMYes",
    "VLMYesLocal",
    "YES_QUESTION",
    "unifiedreward",
    "vlm_yes",
    "yes_no_token_ids",
    "yes_probability",
]

YES_QUESTION = "Does this image show: {prompt}? Answer Yes or No."
"""``vlm_yes``'s default question; ``{prompt}`` is replaced by the image's prompt."""

UNIFIEDREWARD_QUESTION = (
    "<image>\nYou are given a text caption and a generated image based on that caption. Your task is to evaluate "
    "this image based on two key criteria:\n1. Alignment with the Caption: Assess how well this image aligns with "
    "the provided caption. Consider the accuracy of depicted objects, their relationships, and attributes as "
    "described in the caption.\n2. Overall Image Quality: Examine the visual quality of this image, including "
    "clarity, detail preservation, color accuracy, and overall aesthetic appeal.\nBased on the above criteria, "
    "assign a score from 1 to 5 after 'Final Score:'.\nYour task is provided as follows:\nText Caption: [{prompt}]"
)
"""UnifiedReward's pointwise question for a generated image (the template the model was trained on);
``{prompt}`` is replaced by the image's prompt."""

_NUMBER = r"[-+]?\d+(?:\.\d+)?"
NORMALIZE = ("max", "minmax", "none")
"""How :class:`VLMScore` maps a score ``s`` on the scale ``[low, high]``: ``"max"``: ``s / high`` (flow_grpo's
``score / 5``, in ``[low / high, 1]``), ``"minmax"``: ``(s - low) / (high - low)`` in ``[0, 1]``, ``"none"``: ``s``."""


def parse_score(text: str, low: float = 1.0, high: float = 5.0) -> float | None:
    """The final numeric score in a judge's reply, or ``None`` when there is none in ``[low, high]``.

    Looks, in order, at the text after the last ``Final Score`` (any case; ``Final Score: 4``, ``final score is
    **3.5**``, ``Final Score: 4/5``), inside the last ``<answer>...</answer>`` tag (reasoning judges such as
    UnifiedReward-Think), after the last ``score``, and finally at a reply that is a bare number. The first
    number found there is the score (``4/5`` reads 4, ``4 out of 5`` reads 4); one outside ``[low, high]``
    counts as none.

    Args:
        text (`str`): the reply. low, high (`float`): the score range the question asked for.

    Returns:
        `float` in ``[low, high]``, or ``None``.
    """
    candidates = []
    final = re.split(r"final\s*score", text, flags=re.IGNORECASE)
    if len(final) > 1:
        candidates.append(final[-1])
    tagged = re.findall(r"<answer>(.*?)</answer>", text, flags=re.IGNORECASE | re.DOTALL)
    if tagged:
        candidates.append(tagged[-1])
    scored = re.split(r"score", text, flags=re.IGNORECASE)
    if len(scored) > 1:
        candidates.append(scored[-1])
    if re.fullmatch(rf"\s*\**\s*{_NUMBER}\s*\**\s*\.?\s*", text):
        candidates.append(text)
    for tail in candidates:
        match = re.search(_NUMBER, tail)
        if match:
            value = float(match.group())
            return value if low <= value <= high else None
    return None


class VLMScore:
    """A pointwise reward served by an OpenAI-compatible chat-completions server (vLLM, SGLang, ...).

    Each image is one request: the image as a PNG data URL, then the question with ``{prompt}`` filled in
    (UnifiedReward's order); ``concurrency`` requests are in flight at once; the ``openai`` client applies
    ``timeout`` (seconds per request) and retries a failed request ``max_retries`` times with backoff. The
    reply is read with :func:`parse_score` and normalised by ``normalize`` (see :data:`NORMALIZE`).

    Args:
        base_url (`str`): the server, e.g. ``http://127.0.0.1:8000/v1``.
        model (`str`): the served model name (``--served-model-name`` of vLLM / SGLang).
        api_key (`str`): sent as a bearer token (local servers ignore it).
        timeout (`float`, `> 0`): seconds per request. max_retries (`int`, `>= 0`): retries per request.
        concurrency (`int`, `>= 1`): requests in flight. max_tokens (`int`, `>= 1`): reply length limit.
        question (`str`): the instruction, with the placeholder ``{prompt}`` only.
        score_range (`(low, high)`): the scale the question asks for; a parsed score outside it is unparsed.
        normalize (`str`): one of :data:`NORMALIZE`.
        unparsed (`str`): what a reply without a score gives: ``"raise"`` (a `ValueError` quoting the reply) or
            ``"lowest"`` (the lowest score, as flow_grpo's scorer gives 0; counted in :attr:`unparsed_count`).

    Attributes:
        unparsed_count (`int`): replies without a score so far (with ``unparsed="lowest"``).

    Raises:
        ValueError: an option out of range (named), or a `question` with a placeholder other than ``{prompt}``.
        ImportError: the ``openai`` package is missing (``pip install openai``).
    """

    name = "vlm_score"

    def __init__(
        self,
        base_url: str,
        model: str,
        api_key: str = "EMPTY",
        timeout: float = 60.0,
        max_retries: int = 3,
        concurrency: int = 8,
        max_tokens: int = 512,
        question: str = UNIFIEDREWARD_QUESTION,
        score_range: Sequence[float] = (1.0, 5.0),
        normalize: str = "max",
        unparsed: str = "raise",
    ):
        if normalize not in NORMALIZE:
            raise ValueError(f"{self.name}: normalize must be one of {', '.join(NORMALIZE)}, got {normalize!r}")
        if unparsed not in ("raise", "lowest"):
            raise ValueError(f"{self.name}: unparsed must be 'raise' or 'lowest', got {unparsed!r}")
        try:
            low, high = (float(v) for v in score_range)
        except (TypeError, ValueError):
            raise ValueError(
                f"{self.name}: score_range must be two numbers [low, high], got {score_range!r}"
            ) from None
        if not low < high or (normalize == "max" and not high > 0):
            raise ValueError(
                f"{self.name}: score_range must have low < high (and high > 0 with normalize='max'), "
                f"got {score_range!r}"
            )
        self.client = chat_client(
            self.name, base_url, api_key, timeout, max_retries, concurrency, max_tokens, question
        )
        self.base_url, self.model, self.concurrency, self.max_tokens = base_url, model, concurrency, max_tokens
        self.question, self.low, self.high = question, low, high
        self.normalize, self.unparsed = normalize, unparsed
        self.unparsed_count = 0

    def _scale(self, score: float) -> float:
        if self.normalize == "max":
            return score / self.high
        if self.normalize == "minmax":
            return (score - self.low) / (self.high - self.low)
        return score

    def _ask(self, image: torch.Tensor, prompt: str, read, **options):
        """``read(reply)`` of the server's reply to the image (a PNG data URL) then the question for `prompt`, at
        temperature 0 with `options` (``max_tokens``, ``logprobs``, ...).

        Raises:
            RuntimeError: naming the server and the prompt, when the request (or reading it) fails after the openai
                client's retries.
        """
        content = [
            {"type": "image_url", "image_url": {"url": _data_url(image)}},
            {"type": "text", "text": self.question.format(prompt=prompt)},
        ]
        try:
            reply = self.client.chat.completions.create(
                model=self.model, temperature=0.0, messages=[{"role": "user", "content": content}], **options
            )
            return read(reply)
        except Exception as e:  # the openai client has already retried
            raise RuntimeError(
                f"{self.name}: request to {self.base_url} for prompt {prompt!r} failed: "
                f"{type(e).__name__}: {' '.join(str(e).split())}"
            ) from e

    def _one(self, image: torch.Tensor, prompt: str) -> float:
        text = self._ask(
            image, prompt, lambda reply: reply.choices[0].message.content or "", max_tokens=self.max_tokens
        )
        score = parse_score(text, self.low, self.high)
        if score is None:
            if self.unparsed == "raise":
                shown = " ".join(text.split())[:200]
                raise ValueError(
                    f"{self.name}: the reply of {self.base_url} for prompt {prompt!r} holds no score in "
                    f"[{self.low:g}, {self.high:g}]: {shown!r} (set unparsed: lowest to score such "
                    "replies lowest)"
                )
            self.unparsed_count += 1
            score = self.low
        return self._scale(score)

    def __call__(
        self, images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]]
    ) -> torch.Tensor:
        """Scores `(B,)` float32 on CPU: the parsed score, normalised (``"max"``: in ``[low / high, 1]``,
        ``"minmax"``: in ``[0, 1]``, ``"none"``: in ``[low, high]``).

        Args:
            images (`(B, 3, H, W)` float in [0, 1]), prompts (`B` strings), metadata (`B` dicts, unused).

        Raises:
            RuntimeError: naming the server and the prompt, when a request still fails after its retries.
            ValueError: a reply without a score (with ``unparsed="raise"``), quoting it; malformed inputs.
        """
        check_inputs(images, prompts, metadata)
        with ThreadPoolExecutor(max_workers=self.concurrency) as pool:
            scores = list(pool.map(self._one, images, prompts))
        return torch.tensor(scores, dtype=torch.float32)


@register_reward(
    "unifiedreward",
    modality="image",
    weights="a UnifiedReward VLM behind an OpenAI-compatible server (vLLM, SGLang)",
)
def unifiedreward(
    base_url: str = "http://127.0.0.1:8000/v1",
    model: str = "UnifiedReward-7b-v1.5",
    api_key: str = "EMPTY",
    timeout: float = 60.0,
    max_retries: int = 3,
    concurrency: int = 8,
    max_tokens: int = 512,
    question: str = UNIFIEDREWARD_QUESTION,
    score_range: Sequence[float] = (1.0, 5.0),
    normalize: str = "max",
    unparsed: str = "raise",
) -> VLMScore:
    """UnifiedReward pointwise image score (arXiv 2503.05236) from a model served behind an OpenAI-compatible API.

    Serve the weights (e.g. ``CodeGoat24/UnifiedReward-7b-v1.5``, a Qwen2.5-VL fine-tune) with vLLM or SGLang,
    e.g. ``vllm serve CodeGoat24/UnifiedReward-7b-v1.5 --served-model-name UnifiedReward-7b-v1.5 --port 8000``,
    then point ``base_url`` at it. Options are those of :class:`VLMScore`.

    Returns:
        A `Reward` whose scores are `(B,)` float32 on CPU: the judge's 1-5 score divided by 5 (in ``[0.2, 1]``,
        flow_grpo's scale) by default; ``normalize="minmax"`` gives ``(s - 1) / 4`` in ``[0, 1]``, ``"none"`` the
        raw 1-5 score.

    Raises:
        ValueError: an option out of range; on call, a reply without a score (unless ``unparsed="lowest"``).
        RuntimeError (on call): naming the server URL and the prompt, when the server is down or keeps failing.
    """
    reward = VLMScore(
        base_url,
        model,
        api_key,
        timeout,
        max_retries,
        concurrency,
        max_tokens,
        question,
        score_range,
        normalize,
        unparsed,
    )
    reward.name = "unifiedreward"
    return reward


def yes_probability(top_logprobs: Sequence[tuple[str, float]]) -> float | None:
    """``P(yes) / (P(yes) + P(no))`` from the first answer token's top log-probabilities, every case and spacing of
    "yes" and "no" summed (Flow-Factory ``rewards/vllm_evaluate.py``, ``canonicalize=True``).

    Args:
        top_logprobs: ``(token, logprob)`` pairs.

    Returns:
        `float` in [0, 1], or None when neither word is among them.
    """
    yes = sum(math.exp(lp) for tok, lp in top_logprobs if tok.strip().lower() == "yes")
    no = sum(math.exp(lp) for tok, lp in top_logprobs if tok.strip().lower() == "no")
    return yes / (yes + no) if yes + no > 0 else None


class VLMYes(VLMScore):
    """A VLM judge's probability of "yes" to whether the image matches its prompt, read from the log-probabilities of
    its one-token answer (an OpenAI-compatible server that returns ``logprobs``: vLLM, SGLang, OpenAI).

    Each image is one request (image, then the question with ``{prompt}`` filled in), at temperature 0 with
    ``max_tokens=1``, ``logprobs=True`` and ``top_logprobs``; the score is :func:`yes_probability`. Options as
    :class:`VLMScore`, plus ``top_logprobs`` (`int`, 1-20); ``unparsed``: ``"lowest"`` (default, Flow-Factory's: a
    reply whose top tokens hold neither word scores 0, counted in :attr:`unparsed_count`) or ``"raise"``.

    Raises:
        ValueError: an option out of range (named). ImportError: without the ``openai`` package.
    """

    name = "vlm_yes"

    def __init__(self, base_url: str, model: str, top_logprobs: int = 20, **options):
        options.setdefault("question", YES_QUESTION)
        options.setdefault("unparsed", "lowest")
        super().__init__(base_url, model, score_range=(0.0, 1.0), normalize="none", **options)
        if not is_integer(top_logprobs) or not 1 <= top_logprobs <= 20:
            raise ValueError(f"{self.name}: top_logprobs must be an integer in [1, 20], got {top_logprobs!r}")
        self.top_logprobs = top_logprobs

    def _one(self, image: torch.Tensor, prompt: str) -> float:
        def read(reply) -> list[tuple[str, float]]:
            first = reply.choices[0].logprobs.content[0] if reply.choices[0].logprobs else None
            return [(t.token, t.logprob) for t in first.top_logprobs] if first is not None else []

        pairs = self._ask(image, prompt, read, max_tokens=1, logprobs=True, top_logprobs=self.top_logprobs)
        p = yes_probability(pairs)
        if p is None:
            if self.unparsed == "raise":
                raise ValueError(
                    f"{self.name}: the answer of {self.base_url} for prompt {prompt!r} has neither yes nor no among "
                    f"its top {self.top_logprobs} tokens ({[t for t, _ in pairs][:5]}); is logprobs served?"
                )
            self.unparsed_count += 1
            return 0.0
        return p


def yes_no_token_ids(tokenizer: Any) -> tuple[list[int], list[int]]:
    """The ids of every token of `tokenizer` that reads "yes", and of every one that reads "no", in any case and with
    any surrounding whitespace (``Yes``, `` yes``, ``YES``, ``No``, ...): the words :func:`yes_probability` sums.

    Returns:
        `(yes_ids, no_ids)`, lists of `int`.

    Raises:
        ValueError: the vocabulary has no single-token "yes" or no "no".
    """
    vocab = tokenizer.get_vocab()  # token string -> id; byte-level and sentencepiece spellings keep the letters
    candidates = [i for token, i in vocab.items() if "yes" in token.lower() or "no" in token.lower()]
    words = {i: tokenizer.decode([i]).strip().lower() for i in candidates}
    yes, no = (sorted(i for i, w in words.items() if w == word) for word in ("yes", "no"))
    if not yes or not no:
        raise ValueError("vlm_yes: the tokenizer has no single token for 'yes' or for 'no'; use another model")
    return yes, no


class VLMYesLocal(VQAScore):
    """``vlm_yes`` in-process: a local VLM's ``P(yes) / (P(yes) + P(no))`` at its first answer token.

    The forward is :class:`flowrl.rewards.vqascore.VQAScore`'s (the image, then `question` with ``{prompt}`` filled
    in, through the processor's chat template with the generation prompt); the score is :func:`yes_probability`'s
    over the whole vocabulary instead of a server's top 20 tokens: every token reading "yes" (any case and spacing,
    :func:`yes_no_token_ids`) against every one reading "no", from the softmax of the first answer position's
    logits, summed in log space. Options as :class:`VQAScore` (``question`` defaults to :data:`YES_QUESTION`).

    Returns (when called):
        `torch.Tensor` of shape `(B,)`, float32, CPU, in `(0, 1)`.

    Raises:
        ValueError: the tokenizer has no "yes" or "no" token, or :class:`VQAScore`'s checks.
    """

    name = "vlm_yes"

    def __init__(self, model: torch.nn.Module, processor: Any, question: str = YES_QUESTION, **options):
        super().__init__(model, processor, question, VQASCORE_ANSWER, **options)
        yes, no = yes_no_token_ids(processor.tokenizer)
        self.yes_ids, self.no_ids = torch.tensor(yes), torch.tensor(no)

    def scores(self, logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """`(b,)` float32: ``P(yes) / (P(yes) + P(no))`` from the `(b, n, V)` logits' first answer position."""
        log_probs = logits[:, 0].log_softmax(dim=-1)  # (b, V)
        yes = log_probs[:, self.yes_ids].logsumexp(dim=-1)  # (b,)
        no = log_probs[:, self.no_ids].logsumexp(dim=-1)  # (b,)
        return (yes - torch.logaddexp(yes, no)).exp()


SERVER_DEFAULTS = dict(
    model="Qwen2.5-VL-7B-Instruct",
    api_key="EMPTY",
    timeout=60.0,
    max_retries=3,
    concurrency=8,
    top_logprobs=20,
    unparsed="lowest",
)
"""``vlm_yes``'s server options and their defaults (with ``base_url``)."""

LOCAL_DEFAULTS = dict(max_pixels=None, device="cpu", dtype=torch.float32, batch_size=None)
"""``vlm_yes``'s local options and their defaults (with ``model_path``)."""


@register_reward(
    "vlm_yes",
    modality="image",
    weights="a VLM behind an OpenAI-compatible server returning logprobs, or a local Qwen2.5-VL / Qwen2-VL folder",
)
def vlm_yes(
    base_url: str | None = None,
    model: str | None = None,
    api_key: str | None = None,
    timeout: float | None = None,
    max_retries: int | None = None,
    concurrency: int | None = None,
    question: str = YES_QUESTION,
    top_logprobs: int | None = None,
    unparsed: str | None = None,
    model_path: str | os.PathLike | None = None,
    max_pixels: int | None = None,
    device: str | torch.device | None = None,
    dtype: torch.dtype | str | None = None,
    batch_size: int | None = None,
) -> VLMYes | VLMYesLocal:
    """P("yes") of a VLM asked whether the image matches its prompt (the VQAScore idea, arXiv 2404.01291; Flow-Factory's
    ``vllm_evaluate`` reward), from a served model or a local one.

    The backend is chosen by which of `base_url` and `model_path` is given (exactly one):

    - ``base_url``: a VLM behind an OpenAI-compatible server (:class:`VLMYes`), e.g. ``vllm serve
      Qwen/Qwen2.5-VL-7B-Instruct --served-model-name Qwen2.5-VL-7B-Instruct`` and
      ``base_url: http://127.0.0.1:8000/v1`` (no longer the default: leaving out both is an error). Its options (null: the default) are ``model``
      (``"Qwen2.5-VL-7B-Instruct"``), ``api_key`` (``"EMPTY"``), ``timeout`` (60 s), ``max_retries`` (3),
      ``concurrency`` (8), ``top_logprobs`` (20) and ``unparsed`` (``"lowest"``), as :class:`VLMYes`.
    - ``model_path``: a local Qwen2.5-VL or Qwen2-VL folder (or cached hub id) run in-process (:class:`VLMYesLocal`,
      the forward of :class:`flowrl.rewards.vqascore.VQAScore`); nothing is served or downloaded. Its options are
      ``max_pixels`` (the processor's), ``device`` (``"cpu"``), ``dtype`` (float32) and ``batch_size`` (all at once).

    Args:
        question (`str`): the question after the image, ``{prompt}`` its only placeholder; both backends.

    Returns:
        A `Reward` whose scores are `(B,)` float32 on CPU in [0, 1]: ``P(yes) / (P(yes) + P(no))`` of the first
        answer token, every case and spacing of each word summed (:func:`yes_probability`; locally over the whole
        vocabulary, from a server over its top ``top_logprobs`` tokens).

    Raises:
        ValueError: both or neither of `base_url` and `model_path`, an option of the other backend (named), or an
            option out of range; RuntimeError (on call) naming the server and the prompt when it fails.
        FileNotFoundError: `model_path` is not a folder with ``config.json``.
    """
    if (base_url is None) == (model_path is None):
        given = "both" if base_url is not None else "neither"
        raise ValueError(
            "vlm_yes: give exactly one of base_url (a VLM behind an OpenAI-compatible server) and model_path "
            f"(a local Qwen2.5-VL folder), got {given}"
        )
    options = dict(
        model=model,
        api_key=api_key,
        timeout=timeout,
        max_retries=max_retries,
        concurrency=concurrency,
        top_logprobs=top_logprobs,
        unparsed=unparsed,
        max_pixels=max_pixels,
        device=device,
        dtype=dtype,
        batch_size=batch_size,
    )
    local = model_path is not None
    own, other = (LOCAL_DEFAULTS, SERVER_DEFAULTS) if local else (SERVER_DEFAULTS, LOCAL_DEFAULTS)
    stray = [key for key in other if options[key] is not None]
    if stray:
        backends = (
            ("base_url (the server backend)", "model_path")
            if local
            else ("model_path (the local backend)", "base_url")
        )
        raise ValueError(
            f"vlm_yes: {', '.join(stray)} {'applies' if len(stray) == 1 else 'apply'} to {backends[0]}, "
            f"not with {backends[1]}"
        )
    chosen = {key: default if options[key] is None else options[key] for key, default in own.items()}
    if local:
        check_options(
            "vlm_yes", question, VQASCORE_ANSWER, chosen["max_pixels"], chosen["dtype"], chosen["batch_size"]
        )
        vlm, processor = load_vlm("vlm_yes", model_path)
        return VLMYesLocal(vlm, processor, question, **chosen)
    return VLMYes(base_url, chosen.pop("model"), chosen.pop("top_logprobs"), question=question, **chosen)
