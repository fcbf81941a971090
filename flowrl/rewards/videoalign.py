"""VideoAlign's VideoReward: visual quality (VQ), motion quality (MQ) and text alignment (TA) of a video.

VideoAlign (Liu et al., arXiv 2501.13918; reference implementation github.com/KwaiVGI/VideoAlign, `trainer.py`
`Qwen2VLRewardModelBT` and `inference.py`) is a Qwen2-VL-2B whose language model reads the video and a
prompt template; a linear head without bias (`rm_head`, hidden size -> 3) maps hidden states to the three
scores. With the released template (`detailed_special`) the prompt holds the tokens `<|VQ_reward|>`,
`<|MQ_reward|>` and `<|TA_reward|>`, and VQ is read from the head's output 0 at the VQ token, MQ from output 1
at the MQ token, TA from output 2 at the TA token (`reward_token="special"`); other checkpoints read all three
at the last token (`reward_token="last"`). Scores may be standardised per dimension with the checkpoint's
means and stds, and the reward is their weighted sum (weights 1, 1, 1: VideoAlign's "Overall").

Built on transformers' `Qwen2VLForConditionalGeneration` and `Qwen2VLProcessor`; runs in-process, offline.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .base import check_batch_size, check_inputs, is_integer, register_reward
from .clipscore import _as_dtype
from .video import _check_folder, _chunks, frame_indices

__all__ = ["DIMENSIONS", "VideoAlign", "videoalign"]

DIMENSIONS = ("VQ", "MQ", "TA")
"""The three scores, in the order of the reward head's outputs."""

SPECIAL_TOKENS = tuple(f"<|{d}_reward|>" for d in DIMENSIONS)
PROMPT_FILE = "videoalign_prompt.txt"
HEAD_FILE = "rm_head.safetensors"


class VideoAlign:
    """Score videos with a VideoAlign reward model.

    Use the `videoalign` factory to load one from a folder; build this class directly to wrap a model
    already in memory.

    Args:
        model (`transformers.Qwen2VLForConditionalGeneration`): the backbone; put in eval mode, frozen, and
            moved to `device` and `dtype`. Only `model.model` (vision tower and language model, without the
            language-model head) runs.
        rm_head (`torch.nn.Linear`): `hidden_size -> 3` (VQ, MQ, TA).
        processor (`transformers.Qwen2VLProcessor`): tokenizer (with the three reward tokens when
            `reward_token="special"`), video processor and chat template of the checkpoint.
        prompt_template (`str`): the text after the video, with `{text_prompt}` where the prompt goes
            (VideoAlign's `prompt_template.py`, e.g. `DETAILED_PROMPT_WITH_SPECIAL_TOKEN`).
        reward_token (`str`, default `"special"`): `"special"` or `"last"` (see the module docstring).
        weights (`Mapping[str, float]`, *optional*): weight of each of VQ, MQ, TA (missing ones count 0);
            default 1 each.
        mean, std (`Mapping[str, float]`, *optional*): per-dimension standardisation `(r - mean) / std`
            applied before weighting (VideoAlign's `inference_config`); default none.
        num_frames (`int >= 1`, *optional*): frames given to the model, evenly spaced (`frame_indices`);
            default all. Qwen2-VL groups frames in pairs (an odd count repeats the last frame).
        max_pixels (`int`, *optional*): pixels per frame after the video processor's resize (VideoAlign's
            `max_frame_pixels`); default the processor's own setting.
        device (`str` or `torch.device`), dtype (`torch.dtype` or `str`): where and in what the model runs.
        batch_size (`int >= 1`, *optional*): videos per forward; default all at once.

    Returns (when called):
        `torch.Tensor` of shape `(B,)`, float32, CPU: `sum_d weights[d] * (r_d - mean[d]) / std[d]`, unbounded
        (the released model's raw scores are roughly in `[-5, 5]` per dimension). `last_scores` keeps the
        `(B, 3)` standardised VQ, MQ, TA of the last call for logging.

    Raises:
        ValueError: an unknown `reward_token` or dimension, a template without `{text_prompt}`, a non-finite
            weight, a non-positive std, reward tokens missing from the tokenizer or the prompt, or bad
            `num_frames` / `max_pixels` / `batch_size`; when called, malformed videos
            (`rewards.base.check_inputs` with `video=True`).
    """

    name = "videoalign"
    accepts_video = True

    def __init__(
        self,
        model: torch.nn.Module,
        rm_head: torch.nn.Linear,
        processor: Any,
        prompt_template: str,
        reward_token: str = "special",
        weights: Mapping[str, float] | None = None,
        mean: Mapping[str, float] | None = None,
        std: Mapping[str, float] | None = None,
        num_frames: int | None = None,
        max_pixels: int | None = None,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | str = torch.float32,
        batch_size: int | None = None,
    ):
        if reward_token not in ("special", "last"):
            raise ValueError(f"videoalign: reward_token must be 'special' or 'last', got {reward_token!r}")
        if "{text_prompt}" not in prompt_template:
            raise ValueError("videoalign: prompt_template must contain '{text_prompt}' where the prompt goes")
        for option, values in (("weights", weights), ("mean", mean), ("std", std)):
            unknown = sorted(set(values or {}) - set(DIMENSIONS))
            if unknown:
                raise ValueError(f"videoalign: {option} has unknown dimensions {unknown}; use {', '.join(DIMENSIONS)}")
        weights = {d: 1.0 for d in DIMENSIONS} if weights is None else weights
        if not all(
            isinstance(w, (int, float)) and not isinstance(w, bool) and math.isfinite(w) for w in weights.values()
        ):
            raise ValueError(f"videoalign: weights must be finite numbers, got {dict(weights)!r}")
        if std and not all(s > 0 for s in std.values()):
            raise ValueError(f"videoalign: std values must be > 0, got {dict(std)!r}")
        for option, value in (("num_frames", num_frames), ("max_pixels", max_pixels)):
            if value is not None and (not is_integer(value) or value < 1):
                raise ValueError(f"videoalign: {option} must be an integer >= 1 or null, got {value!r}")
        check_batch_size(batch_size, self.name)
        self.reward_token, self.prompt_template = reward_token, prompt_template
        self.processor, self.num_frames, self.max_pixels, self.batch_size = (
            processor,
            num_frames,
            max_pixels,
            batch_size,
        )
        self.device, self.dtype = torch.device(device), _as_dtype(dtype)
        self.model = model.to(device=self.device, dtype=self.dtype).eval().requires_grad_(False)
        self.rm_head = rm_head.to(device=self.device, dtype=self.dtype).eval().requires_grad_(False)
        self.weights = torch.tensor([float(weights.get(d, 0.0)) for d in DIMENSIONS])  # (3,)
        self.mean = torch.tensor([float((mean or {}).get(d, 0.0)) for d in DIMENSIONS])  # (3,)
        self.std = torch.tensor([float((std or {}).get(d, 1.0)) for d in DIMENSIONS])  # (3,)
        self.special_ids = None
        if reward_token == "special":
            ids = processor.tokenizer.convert_tokens_to_ids(list(SPECIAL_TOKENS))
            if processor.tokenizer.unk_token_id in ids or None in ids:
                raise ValueError(
                    f"videoalign: the tokenizer lacks the reward tokens {', '.join(SPECIAL_TOKENS)}; "
                    "use the checkpoint's processor, or reward_token='last'"
                )
            if not all(token in prompt_template for token in SPECIAL_TOKENS):
                raise ValueError(
                    f"videoalign: reward_token='special' needs {', '.join(SPECIAL_TOKENS)} in prompt_template"
                )
            self.special_ids = torch.tensor(ids)  # (3,)
        self.last_scores = torch.zeros(0, 3)

    def inputs(self, videos: torch.Tensor, prompts: Sequence[str]) -> dict[str, torch.Tensor]:
        """The processor's batch for `(B, F, 3, H, W)` videos in `[0, 1]` and `B` prompts (chat template,
        `num_frames` evenly spaced frames, the video processor's resize and normalisation), on `device`."""
        index = frame_indices(videos.shape[1], self.num_frames).to(videos.device)
        clips = [video[index].float().cpu() for video in videos]  # B x (k, 3, H, W) in [0, 1]
        messages = [
            [
                {
                    "role": "user",
                    "content": [
                        {"type": "video"},
                        {"type": "text", "text": self.prompt_template.format(text_prompt=prompt)},
                    ],
                }
            ]
            for prompt in prompts
        ]
        texts = self.processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        video_options: dict[str, Any] = {"do_rescale": False, "do_sample_frames": False}
        if self.max_pixels is not None:
            shortest = self.processor.video_processor.size.shortest_edge
            video_options["size"] = {"shortest_edge": min(shortest, self.max_pixels), "longest_edge": self.max_pixels}
        batch = self.processor(
            text=texts, videos=clips, padding=True, return_tensors="pt", videos_kwargs=video_options
        )
        return {k: v.to(self.device) for k, v in batch.items()}

    def raw_scores(self, videos: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        """`(B, 3)` float32 CPU: the head's VQ, MQ, TA before standardisation (one forward per chunk)."""
        out = []
        for part in _chunks(len(prompts), self.batch_size):
            batch = self.inputs(videos[part], prompts[part])
            hidden = self.model.model(**batch).last_hidden_state  # (b, L, D), after the final norm
            ids = batch["input_ids"]  # (b, L)
            rows = torch.arange(ids.shape[0], device=ids.device)
            if self.reward_token == "special":
                positions = torch.stack([_first(ids == t) for t in self.special_ids.tolist()], dim=1)  # (b, 3)
                logits = self.rm_head(hidden[rows.unsqueeze(1), positions])  # (b, 3 tokens, 3 outputs)
                out.append(logits.diagonal(dim1=1, dim2=2).float().cpu())  # (b, 3): VQ@VQ, MQ@MQ, TA@TA
            else:
                last = batch["attention_mask"].cumsum(dim=1).argmax(dim=1)  # (b,): last attended position
                out.append(self.rm_head(hidden[rows, last]).float().cpu())  # (b, 3)
        return torch.cat(out)

    @torch.no_grad()
    def __call__(
        self, videos: torch.Tensor, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]]
    ) -> torch.Tensor:
        check_inputs(videos, prompts, metadata, video=True)
        if len(prompts) == 0:
            return torch.zeros(0)
        self.last_scores = (self.raw_scores(videos, list(prompts)) - self.mean) / self.std  # (B, 3)
        return self.last_scores @ self.weights  # (B,)


def _first(mask: torch.Tensor) -> torch.Tensor:
    """`(b, L)` bool -> `(b,)` index of the first True in each row; ValueError if a row has none."""
    if not bool(mask.any(dim=1).all()):
        raise ValueError("videoalign: a reward token is missing from the tokenized prompt (truncated?)")
    return mask.int().argmax(dim=1)


@register_reward(
    "videoalign",
    modality="video",
    weights="a VideoReward folder (KwaiVGI/VideoReward, Qwen2-VL-2B with its LoRA merged + rm_head)",
)
def videoalign(
    model_path: str | os.PathLike,
    prompt_template: str | None = None,
    reward_token: str = "special",
    weights: Mapping[str, float] | None = None,
    normalize: bool = True,
    num_frames: int | None = None,
    max_pixels: int | None = None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | str = torch.float32,
    batch_size: int | None = None,
) -> VideoAlign:
    """Load a `VideoAlign` reward from a local folder (nothing is downloaded).

    The folder holds: a `Qwen2VLForConditionalGeneration` saved with `save_pretrained` (the LoRA of the
    released checkpoint merged in) with its `Qwen2VLProcessor` (tokenizer with the reward tokens, chat
    template); `rm_head.safetensors` (one tensor `weight` of shape `(3, hidden_size)`); optionally
    `videoalign_prompt.txt` (the prompt template) and VideoAlign's `model_config.json` (its
    `inference_config` gives the means and stds; its `data_config.num_frames` and `max_frame_pixels` the
    defaults of `num_frames` and `max_pixels`).

    Args:
        model_path (`str` or path): the folder above.
        prompt_template (`str`, *optional*): see `VideoAlign`; default the folder's `videoalign_prompt.txt`.
        reward_token, weights, num_frames, max_pixels, device, dtype, batch_size: see `VideoAlign`.
        normalize (`bool`, default True): standardise with `model_config.json`'s `inference_config` when present.

    Returns:
        A `VideoAlign`: `(B, F, 3, H, W)` videos in `[0, 1]` -> `(B,)` float32 CPU.

    Raises:
        FileNotFoundError: `model_path` is not a folder with `config.json`, or `rm_head.safetensors` is
            missing, or there is neither `prompt_template` nor `videoalign_prompt.txt`.
        ValueError: a head of the wrong shape, or the checks of `VideoAlign`.
    """
    from safetensors.torch import load_file
    from transformers import AutoProcessor, Qwen2VLForConditionalGeneration

    folder = _check_folder("videoalign", model_path, "model_path", need_config=True)
    if prompt_template is None:
        if not (folder / PROMPT_FILE).is_file():
            raise FileNotFoundError(
                f"videoalign: no prompt_template given and no {PROMPT_FILE} in '{model_path}'; save "
                "the checkpoint's template there (VideoAlign's prompt_template.py)"
            )
        prompt_template = (folder / PROMPT_FILE).read_text(encoding="utf-8")
    if not (folder / HEAD_FILE).is_file():
        raise FileNotFoundError(
            f"videoalign: '{model_path}' has no {HEAD_FILE} (the reward head's weight, (3, hidden))"
        )
    config = json.loads((folder / "model_config.json").read_text()) if (folder / "model_config.json").is_file() else {}
    data_config, stats = config.get("data_config") or {}, config.get("inference_config") or {}
    model = Qwen2VLForConditionalGeneration.from_pretrained(folder, local_files_only=True)
    weight = load_file(folder / HEAD_FILE)["weight"]
    hidden = model.config.get_text_config().hidden_size
    if weight.shape != (len(DIMENSIONS), hidden):
        raise ValueError(f"videoalign: {HEAD_FILE} weight has shape {tuple(weight.shape)}, expected (3, {hidden})")
    rm_head = torch.nn.Linear(hidden, len(DIMENSIONS), bias=False)
    rm_head.weight.data.copy_(weight)
    processor = AutoProcessor.from_pretrained(folder, local_files_only=True)
    mean = {d: stats[f"{d}_mean"] for d in DIMENSIONS} if normalize and stats else None
    std = {d: stats[f"{d}_std"] for d in DIMENSIONS} if normalize and stats else None
    num_frames = data_config.get("num_frames") if num_frames is None else num_frames
    max_pixels = data_config.get("max_frame_pixels") if max_pixels is None else max_pixels
    return VideoAlign(
        model,
        rm_head,
        processor,
        prompt_template,
        reward_token,
        weights,
        mean,
        std,
        num_frames,
        max_pixels,
        device,
        dtype,
        batch_size,
    )
