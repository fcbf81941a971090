"""Pairwise preference rewards: judges that compare two images, and Pref-GRPO win rates over a group.

A pairwise judge is a callable::

    p = judge(images_a, images_b, prompts, metadata)   # (B, 3, H, W) x 2 in [0, 1] -> (B,) P(a preferred)

returning float32 values in [0, 1] on CPU; 0.5 is a tie (and what an unparseable answer counts as).
``pref_winrate`` turns a judge into an ordinary (pointwise-contract) reward for GRPO: within each group
(the images of one prompt in the batch) every pair is judged, in BOTH orders to cancel position bias
(Pref-GRPO, arXiv 2508.20751, whose published code judges one order only; an antisymmetric judge such as
the Bradley-Terry one is judged in one order, which is the same), and each image's reward is its win
rate ``wins / (G - 1)`` (win 1, tie 0.5).
"""

from __future__ import annotations

import base64
import io
import re
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from .base import RewardTypeError, build_reward, check_inputs, check_scores, is_integer, register_reward, reward_name
from .vqascore import check_template

__all__ = ["PrefWinRate", "VLMJudge", "bradley_terry_judge", "parse_choice", "pref_winrate", "win_rates"]

PairwiseJudge = Callable[[torch.Tensor, torch.Tensor, Sequence[str], Sequence[Mapping[str, Any]]], torch.Tensor]


class _BradleyTerryJudge:
    """See :func:`bradley_terry_judge`. Exactly antisymmetric (``judge(b, a) = 1 - judge(a, b)``), and its
    probabilities come from one pointwise score per image, which :func:`win_rates` uses to score each image
    once instead of once per pair."""

    antisymmetric = True

    def __init__(self, reward: Callable, temperature: float):
        self.reward, self.temperature = reward, temperature
        self.name = f"bradley_terry({reward_name(reward)})"

    def scores(self, images, prompts, metadata) -> torch.Tensor:
        """The pointwise reward, float32 ``(B,)`` on CPU."""
        return torch.as_tensor(self.reward(images, list(prompts), list(metadata))).float().cpu()

    def prob(self, r_a: torch.Tensor, r_b: torch.Tensor) -> torch.Tensor:
        """``sigmoid((r_a - r_b) / temperature)`` from two score tensors of equal shape."""
        return torch.sigmoid((r_a - r_b) / self.temperature)

    def __call__(self, images_a, images_b, prompts, metadata) -> torch.Tensor:
        both = self.scores(torch.cat([images_a, images_b]), list(prompts) * 2, list(metadata) * 2)
        return self.prob(both[: len(prompts)], both[len(prompts) :])


def bradley_terry_judge(reward: Callable, temperature: float = 1.0) -> PairwiseJudge:
    """Any pointwise reward as a Bradley-Terry judge: ``P(a > b) = sigmoid((r(a) - r(b)) / temperature)``.

    The judge is exactly antisymmetric, so :func:`win_rates` judges one order only, and it scores every
    image of a batch once (``B`` reward evaluations instead of ``2`` per pair).

    Args:
        reward: a pointwise reward ``(images, prompts, metadata) -> (B,)``.
        temperature (`float`): in the reward's units, `> 0`.

    Returns:
        A pairwise judge ``(images_a, images_b, prompts, metadata) -> (B,)`` float32 CPU probabilities
        in (0, 1), with ``scores`` and ``prob`` methods that :func:`win_rates` uses.

    Raises:
        ValueError: if `temperature <= 0`.
    """
    if not temperature > 0:
        raise ValueError(f"Bradley-Terry temperature must be > 0, got {temperature}")
    return _BradleyTerryJudge(reward, temperature)


def win_rates(
    judge: PairwiseJudge,
    images: torch.Tensor,
    prompts: Sequence[str],
    metadata: Sequence[Mapping[str, Any]],
    group: torch.Tensor,
    both_orders: bool = True,
    soft: bool = False,
) -> torch.Tensor:
    """Pref-GRPO win rates (arXiv 2508.20751, Sec. 3.2) of every image against the rest of its group.

    All pairs ``(i, j), i < j`` of every group go to the judge in one call (and the swapped pairs in a
    second call when `both_orders`, unless the judge declares itself ``antisymmetric``), so that
    ``p_ij = (judge(i, j) + 1 - judge(j, i)) / 2``. A judge with ``scores`` and ``prob`` methods
    (:func:`bradley_terry_judge`) scores each image once instead of once per pair. With ``soft=False``
    ``i`` wins (1 point) if ``p_ij > 0.5``, loses if below, and a tie gives each 0.5; with ``soft=True``
    ``i`` scores ``p_ij`` and ``j`` scores ``1 - p_ij``. Then ``win_i = points_i / (G - 1)``.

    Args:
        judge: a pairwise judge (see the module docstring).
        images (`(B, 3, H, W)` in [0, 1]), prompts (`B` strings), metadata (`B` dicts).
        group (`torch.Tensor` of shape `(B,)`, long, any device): group id of each image.
        both_orders (`bool`): also judge every pair swapped and average (cancels position bias).
        soft (`bool`): count the preference probability instead of hard wins.

    Returns:
        `torch.Tensor` of shape `(B,)`, float32 in [0, 1] (0.5 for an image alone in its group).

    Raises:
        ValueError: if `group` is not `(B,)`, or the judge returns the wrong shape or values outside [0, 1].
    """
    return _win_rates(judge, images, prompts, metadata, group, both_orders, soft)[0]


def _win_rates(judge, images, prompts, metadata, group, both_orders, soft) -> tuple[torch.Tensor, int]:
    """:func:`win_rates` and the number of judgements it made (pairs sent to the judge, each order
    counted, or images scored by a pointwise judge)."""
    group = torch.as_tensor(group).cpu()
    if group.shape != (len(prompts),):
        raise ValueError(f"win_rates: group must have shape ({len(prompts)},); got {tuple(group.shape)}")
    pairs = [
        (i, j)
        for g in group.unique().tolist()
        for idx in [(group == g).nonzero().squeeze(1).tolist()]
        for a, i in enumerate(idx)
        for j in idx[a + 1 :]
    ]
    points = torch.zeros(len(prompts), dtype=torch.float32)
    inverse = torch.unique(group, return_inverse=True)[1]
    size = torch.bincount(inverse).float()[inverse]  # (B,) size of each image's group
    if not pairs:
        return torch.full((len(prompts),), 0.5, dtype=torch.float32), 0
    a = torch.tensor([p[0] for p in pairs])
    b = torch.tensor([p[1] for p in pairs])
    name = reward_name(judge)
    calls = 0

    def check(p, n):
        p = torch.as_tensor(p, dtype=torch.float32).cpu()
        if p.shape != (n,) or bool(((p < 0) | (p > 1) | p.isnan()).any()):
            got = f"values {p.flatten()[:8].tolist()}" if p.shape == (n,) else f"shape {tuple(p.shape)}"
            raise ValueError(f"pairwise judge {name!r} must return ({n},) probabilities in [0, 1]; got {got}")
        return p

    if hasattr(judge, "scores") and hasattr(judge, "prob"):  # pointwise judge: one score per image
        r = check_scores(str(name), judge.scores(images, prompts, metadata), len(prompts))
        calls = len(prompts)

        def ask(x, y):
            return check(judge.prob(r[x], r[y]), len(x))
    else:

        def ask(x, y):
            nonlocal calls
            calls += len(x)
            return check(
                judge(images[x], images[y], [prompts[k] for k in x.tolist()], [metadata[k] for k in x.tolist()]),
                len(x),
            )

    p = ask(a, b)
    if both_orders and not getattr(judge, "antisymmetric", False):
        p = (p + 1 - ask(b, a)) / 2
    if soft:
        score_a, score_b = p, 1 - p
    else:
        score_a = torch.where(p > 0.5, 1.0, torch.where(p < 0.5, 0.0, 0.5))
        score_b = 1 - score_a
    points.index_add_(0, a, score_a)
    points.index_add_(0, b, score_b)
    return torch.where(size > 1, points / (size - 1).clamp(min=1), torch.full_like(points, 0.5)), calls


def parse_choice(text: str) -> float:
    """P(image 1 preferred) from a judge's reply: 1.0 for 'Image 1', 0.0 for 'Image 2', 0.5 if unparseable.

    Reads the content of the last ``<answer>...</answer>`` tag if there is one (the tagged format of
    reasoning judges such as UnifiedReward-Think), else the part after the last 'answer' (``Final answer:
    Image N``, :data:`DEFAULT_QUESTION`'s format), else the whole reply. "Image N is better" (or preferred,
    superior; or "prefer Image N"; the last one) decides. Otherwise an answer naming exactly one image chooses it, but only in
    a tag or after 'answer': a free reply such as "Image 1 is blurry." is a tie, as in Pref-GRPO's code
    (which reads only "Image N is better" and calls everything else a tie).
    """
    tagged = re.findall(r"<answer>(.*?)</answer>", text, flags=re.IGNORECASE | re.DOTALL)
    parts = re.split(r"answer", text, flags=re.IGNORECASE)
    tail = tagged[-1] if tagged else parts[-1]
    better = re.findall(
        r"image\s*([12])\s+is\s+(?:better|preferred|superior)|prefer(?:s|red)?\s+image\s*([12])\b", tail, re.IGNORECASE
    )
    if better:
        return 1.0 if "1" in better[-1] else 0.0
    if not tagged and len(parts) == 1:  # no answer marked: naming an image is not choosing it
        return 0.5
    ones = re.search(r"image\s*1\b", tail, re.IGNORECASE) is not None
    twos = re.search(r"image\s*2\b", tail, re.IGNORECASE) is not None
    return 1.0 if ones and not twos else 0.0 if twos and not ones else 0.5


def _data_url(image: torch.Tensor) -> str:
    from PIL import Image

    array = (image.detach().float().clamp(0, 1) * 255).round().byte().permute(1, 2, 0).cpu().numpy()
    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def chat_client(
    reward: str,
    base_url: str,
    api_key: str,
    timeout: float,
    max_retries: int,
    concurrency: int,
    max_tokens: int,
    question: str,
):
    """The ``openai`` client of a reward served by an OpenAI-compatible chat-completions server, its options checked.

    Args:
        reward (`str`): the reward's name, in the messages. base_url, api_key: the server and its bearer token.
        timeout (`float`, `> 0`): seconds per request. max_retries (`int`, `>= 0`): the client's retries per request.
        concurrency, max_tokens (`int`, `>= 1`): requests in flight; reply length limit (checked here).
        question (`str`): the instruction, with the placeholder ``{prompt}`` only.

    Returns:
        `openai.OpenAI`.

    Raises:
        ValueError: an option out of range, or a `question` with another placeholder (named).
        ImportError: the ``openai`` package is missing (``pip install openai``).
    """
    for key, value, least in (
        ("concurrency", concurrency, 1),
        ("max_tokens", max_tokens, 1),
        ("max_retries", max_retries, 0),
    ):
        if not is_integer(value) or value < least:
            raise ValueError(f"{reward}: {key} must be an integer >= {least}, got {value!r}")
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not timeout > 0:
        raise ValueError(f"{reward}: timeout must be a number of seconds > 0, got {timeout!r}")
    check_template(reward, "question", question)
    try:
        from openai import OpenAI
    except ImportError as err:
        raise ImportError(f"{reward} needs the openai client: pip install openai ({err})") from err
    return OpenAI(base_url=base_url, api_key=api_key, timeout=timeout, max_retries=max_retries)


DEFAULT_QUESTION = (
    "You are given a text prompt and two images generated from it. Which image follows the prompt better "
    "and looks better? Prompt: {prompt}\nEnd your reply with 'Final answer: Image 1' or 'Final answer: Image 2'."
)


class VLMJudge:
    """A pairwise judge served by an OpenAI-compatible chat-completions server (e.g. vLLM or SGLang
    serving UnifiedReward-Think, as Pref-GRPO does).

    Each pair is one request with the question and the two images as PNG data URLs; requests run
    ``concurrency`` at a time; the ``openai`` client applies the timeout (seconds) and its retries with
    backoff. The reply is parsed with :func:`parse_choice`.

    Args:
        base_url (`str`): e.g. ``http://localhost:8000/v1``.
        model (`str`): the served model name.
        api_key (`str`): sent as a bearer token (local servers ignore it).
        timeout (`float`): seconds per request. max_retries (`int`): retries per request.
        concurrency (`int`): requests in flight. max_tokens (`int`): reply length limit.
        question (`str`): the instruction; ``{prompt}`` is replaced by the image prompt. The default
            (:data:`DEFAULT_QUESTION`) is a generic one; a judge trained on its own template, such as
            UnifiedReward-Think (its ``<answer>Image N is better</answer>`` format), should get that template.

    Raises:
        ValueError: `concurrency` or `max_tokens` is not an integer >= 1, or `question` has a
            placeholder other than ``{prompt}``.
        RuntimeError (on call): naming the server and the prompt, when a request still fails after its
            retries.
    """

    name = "vlm_judge"

    def __init__(
        self,
        base_url: str,
        model: str,
        api_key: str = "EMPTY",
        timeout: float = 60.0,
        max_retries: int = 3,
        concurrency: int = 8,
        max_tokens: int = 512,
        question: str = DEFAULT_QUESTION,
    ):
        self.client = chat_client(
            self.name, base_url, api_key, timeout, max_retries, concurrency, max_tokens, question
        )
        self.base_url, self.model, self.concurrency = base_url, model, concurrency
        self.max_tokens, self.question = max_tokens, question

    def _one(self, image_a: torch.Tensor, image_b: torch.Tensor, prompt: str) -> float:
        content = [
            {"type": "text", "text": self.question.format(prompt=prompt)},
            {"type": "image_url", "image_url": {"url": _data_url(image_a)}},
            {"type": "image_url", "image_url": {"url": _data_url(image_b)}},
        ]
        try:
            reply = self.client.chat.completions.create(
                model=self.model,
                max_tokens=self.max_tokens,
                temperature=0.0,
                messages=[{"role": "user", "content": content}],
            )
        except Exception as e:  # the openai client has already retried
            raise RuntimeError(
                f"{self.name}: request to {self.base_url} for prompt {prompt!r} failed: {type(e).__name__}: {e}"
            ) from e
        return parse_choice(reply.choices[0].message.content or "")

    def __call__(self, images_a, images_b, prompts, metadata) -> torch.Tensor:
        """P(a preferred) per pair, `(B,)` float32 in {0, 0.5, 1}."""
        with ThreadPoolExecutor(max_workers=self.concurrency) as pool:
            out = list(pool.map(self._one, images_a, images_b, prompts))
        return torch.tensor(out, dtype=torch.float32)


class PrefWinRate:
    """Pref-GRPO's win-rate reward as an ordinary reward: images of the same prompt in the batch form a
    group (the trainer keeps each group's images together), scored by :func:`win_rates`.

    Args:
        judge: a pairwise judge. both_orders (`bool`), soft (`bool`): see :func:`win_rates`.

    Attributes:
        judge_calls (`int`): cumulative number of judgements made: pairs sent to a pairwise judge (each
            order counted), or images scored by a pointwise (Bradley-Terry) judge. The trainer logs its
            increase per iteration as ``cost/judge_calls``.
    """

    name = "pref_winrate"

    def __init__(self, judge: PairwiseJudge, both_orders: bool = True, soft: bool = False):
        self.judge, self.both_orders, self.soft = judge, both_orders, soft
        self.judge_calls = 0

    def __call__(self, images, prompts, metadata) -> torch.Tensor:
        """Win rates `(B,)` float32 in [0, 1] within each group: the images sharing ``metadata[b]["group"]``
        when every record has one (the trainer sets it, so a prompt drawn twice makes two groups), else
        the images sharing a prompt.

        Raises:
            ValueError, TypeError: for malformed inputs (:func:`rewards.check_inputs`), ``"group"`` set in
                some metadata records but not all, or judge output.
        """
        check_inputs(images, prompts, metadata)
        with_group = sum("group" in m for m in metadata)
        if 0 < with_group < len(metadata):
            raise ValueError(
                f"{self.name}: metadata 'group' is set in {with_group} of {len(metadata)} records; "
                "set it in all (the trainer does) or in none (group by prompt)"
            )
        keys = [m["group"] for m in metadata] if with_group else list(prompts)
        ids = {k: i for i, k in enumerate(dict.fromkeys(keys))}
        group = torch.tensor([ids[k] for k in keys], dtype=torch.long)
        rates, calls = _win_rates(self.judge, images, prompts, metadata, group, self.both_orders, self.soft)
        self.judge_calls += calls
        return rates


@register_reward(
    "pref_winrate",
    modality="image",
    weights="its judge's: a pointwise reward's (bt), or a VLM server (vlm)",
)
def pref_winrate(
    judge: str = "bt",
    reward: str = "clipscore",
    reward_options: dict | None = None,
    temperature: float | None = None,
    both_orders: bool = True,
    soft: bool = False,
    **vlm_options,
) -> PrefWinRate:
    """Pref-GRPO win-rate reward.

    Args:
        judge (`str`): ``"bt"`` (a pointwise reward as Bradley-Terry judge) or ``"vlm"`` (:class:`VLMJudge`).
        reward (`str`), reward_options (`dict`): the ``"bt"`` judge's pointwise reward.
        temperature (`float`, `> 0`, default 1): the ``"bt"`` judge's scale, in the reward's units. It only
            matters with ``soft=True``: a hard win ``r_a > r_b`` does not depend on it.
        both_orders, soft: see :func:`win_rates` (the ``"bt"`` judge is antisymmetric, so it is judged in
            one order whatever `both_orders` says).
        vlm_options: keyword arguments of :class:`VLMJudge` (``base_url``, ``model``, ``timeout``, ...).

    Raises:
        ValueError: for an unknown `judge`, or a `temperature` given with ``soft=False`` (it would have no
            effect); TypeError: for VLM options given with ``judge="bt"``, or `temperature` with ``judge="vlm"``.
    """
    if judge == "bt":
        if vlm_options:
            raise RewardTypeError(
                f"pref_winrate: options {sorted(vlm_options)} are not accepted with judge='bt' "
                "(accepted: reward, reward_options, temperature, both_orders, soft)"
            )
        if temperature is not None and not soft:
            raise ValueError(
                f"pref_winrate: temperature={temperature} has no effect with soft=false (a hard win only "
                "compares the two rewards); set soft=true or drop temperature"
            )
        bt = bradley_terry_judge(
            build_reward(reward, **(reward_options or {})), 1.0 if temperature is None else temperature
        )
        return PrefWinRate(bt, both_orders, soft)
    if judge == "vlm":
        if temperature is not None:
            raise RewardTypeError(
                "pref_winrate: temperature is an option of judge='bt' only (the VLM judge samples at 0)"
            )
        return PrefWinRate(VLMJudge(**vlm_options), both_orders, soft)
    raise ValueError(f"pref_winrate judge must be 'bt' or 'vlm', got {judge!r}")
