"""VideoAlign's VideoReward: visual quality (VQ), motion quality (MQ) and text alignment (TA) of a video.

VideoAlign (Liu et al., arXiv 2501.13918; reference implementation github.com/KwaiVGI/VideoAlign, `trainer.py`
`Qwen2VLRewardModelBT` and `inference.py`) is a Qwen2-VL-2B whose language model reads the video and a
prompt template; a linear head without bias (`rm_head`, hidden size -> 3) maps hidden states to the three
scores. With the released template (`detailed_special`) the prompt holds the tokens `<|VQ_reward|>`,
`<|MQ_reward|>` and `<|TA_reward|>`, and VQ is read from the head's output 0 at the VQ token, MQ from output 1
at the MQ token, TA from output 2 at the TA token (`reward_token="special"`); other checkpoints read all three
at the last token (`reward_token="last"`). Scores may be standardised per dimension with the checkpoint's
means and stds, and the reward is their weighted sum (weights 1, 1, 1: VideoAlign's "Overall").

Frames and resolution follow VideoAlign's video reader (`vision_process.py`, qwen-vl-utils' `smart_nframes` and
`smart_resize`): an even number of evenly spaced frames, `num_frames` of them or `fps` per second of a video
recorded at `video_fps` (at least 4, at most 768), each resized (bicubic, antialiased) to multiples of 28 pixels
with `min_pixels <= height * width <= max_pixels` (the checkpoint's `max_frame_pixels`; VideoAlign's reader floors
videos at 128 * 28 * 28 pixels). `python -m flowrl.rewards.videoalign_convert` turns the released checkpoint into
the folder `videoalign` loads and writes these settings there.

Built on transformers' `Qwen2VLForConditionalGeneration` and `Qwen2VLProcessor`; runs in-process, offline.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .base import check_batch_size, check_inputs, chunk_slices, is_integer, load_pretrained, register_reward
from .frozen import as_dtype, frozen
from .video import _check_folder, frame_indices
from .vqascore import chat_texts

__all__ = ["DIMENSIONS", "VideoAlign", "sampled_frame_count", "videoalign"]

DIMENSIONS = ("VQ", "MQ", "TA")
"""The three scores, in the order of the reward head's outputs."""

SPECIAL_TOKENS = tuple(f"<|{d}_reward|>" for d in DIMENSIONS)
PROMPT_FILE = "videoalign_prompt.txt"
HEAD_FILE = "rm_head.safetensors"
FRAME_FACTOR = 2
"""Qwen2-VL's temporal patch: VideoAlign takes frames in pairs."""
MIN_FRAMES, MAX_FRAMES = 4, 768
"""Bounds of the frame count sampled at `fps` (qwen-vl-utils' `FPS_MIN_FRAMES`, `FPS_MAX_FRAMES`)."""


def sampled_frame_count(
    total: int, num_frames: int | None = None, fps: float | None = None, video_fps: float | None = None
) -> int:
    """How many evenly spaced frames VideoAlign reads from a `total`-frame video (`smart_nframes` in VideoAlign's
    `vision_process.py`).

    Args:
        total (`int >= 1`): frames in the video.
        num_frames (`int`, *optional*): the count asked for; rounded to a multiple of 2 (Python's `round`).
        fps (`float > 0`, *optional*): used when `num_frames` is None: `total / video_fps * fps` frames, clamped to
            `[4, min(768, total)]` (bounds taken to multiples of 2), rounded to a multiple of 2.
        video_fps (`float > 0`): the video's frame rate; needed with `fps`.

    Returns:
        `int` in `[1, total]`: the count, at most `total`; `total` when both `num_frames` and `fps` are None.

    Raises:
        ValueError: `fps` without a positive `video_fps`.
    """
    if num_frames is not None:
        count = round(num_frames / FRAME_FACTOR) * FRAME_FACTOR
    elif fps is not None:
        if video_fps is None or not video_fps > 0:
            raise ValueError(f"videoalign: sampling at fps={fps} needs video_fps > 0, got {video_fps!r}")
        low = math.ceil(MIN_FRAMES / FRAME_FACTOR) * FRAME_FACTOR
        high = math.floor(min(MAX_FRAMES, total) / FRAME_FACTOR) * FRAME_FACTOR
        count = round(min(max(total / video_fps * fps, low), high) / FRAME_FACTOR) * FRAME_FACTOR
    else:
        return total
    return max(1, min(count, total))


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
        num_frames (`int >= 2`, *optional*): frames given to the model, evenly spaced (`frame_indices`), rounded
            to an even count and capped at the video's length as VideoAlign does (`sampled_frame_count`).
        fps (`float > 0`, *optional*): when `num_frames` is None, sample `fps` frames per second of video
            (VideoAlign's `data_config.fps`, 2 in its `train.sh`); needs `video_fps`. With neither,
            every frame is given.
        video_fps (`float > 0`, *optional*): frame rate of the scored videos (16 for Wan, 24 for HunyuanVideo).
        max_pixels, min_pixels (`int >= 1`, *optional*): bounds on the pixels per frame after the video
            processor's resize (VideoAlign's `max_frame_pixels` and its reader's floor of 128 * 28 * 28);
            default the processor's own settings.
        device (`str` or `torch.device`), dtype (`torch.dtype` or `str`): where and in what the model runs.
        batch_size (`int >= 1`, *optional*): videos per forward; default all at once.

    Returns (when called):
        `torch.Tensor` of shape `(B,)`, float32, CPU: `sum_d weights[d] * (r_d - mean[d]) / std[d]`, unbounded
        (the released model's raw scores are roughly in `[-5, 5]` per dimension). `last_scores` keeps the
        `(B, 3)` standardised VQ, MQ, TA of the last call for logging.

    Raises:
        ValueError: an unknown `reward_token` or dimension, a template without `{text_prompt}`, a non-finite
            weight, a non-positive std, reward tokens missing from the tokenizer or the prompt, bad
            `num_frames` / `fps` / `video_fps` / `max_pixels` / `min_pixels` / `batch_size`, or `fps` without
            `video_fps`; when called, malformed videos (`rewards.base.check_inputs` with `video=True`).
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
        fps: float | None = None,
        video_fps: float | None = None,
        min_pixels: int | None = None,
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
        for option, value in (("max_pixels", max_pixels), ("min_pixels", min_pixels)):
            if value is not None and (not is_integer(value) or value < 1):
                raise ValueError(f"videoalign: {option} must be an integer >= 1 or null, got {value!r}")
        _check_sampling(num_frames, fps, video_fps)
        check_batch_size(batch_size, self.name)
        self.reward_token, self.prompt_template = reward_token, prompt_template
        self.processor, self.num_frames, self.fps, self.video_fps = processor, num_frames, fps, video_fps
        self.max_pixels, self.min_pixels, self.batch_size = max_pixels, min_pixels, batch_size
        self.device, self.dtype = torch.device(device), as_dtype(dtype)
        self.model = frozen(model, self.device, self.dtype)
        self.rm_head = frozen(rm_head, self.device, self.dtype)
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
        `sampled_frame_count` evenly spaced frames, the video processor's resize and normalisation), on `device`."""
        count = sampled_frame_count(videos.shape[1], self.num_frames, self.fps, self.video_fps)
        index = frame_indices(videos.shape[1], count).to(videos.device)
        clips = [video[index].float().cpu() for video in videos]  # B x (k, 3, H, W) in [0, 1]
        texts = chat_texts(self.processor, "video", [self.prompt_template.format(text_prompt=p) for p in prompts])
        # VideoAlign bounds each frame's pixels only (its max_pixels replaces qwen-vl-utils' total-video budget)
        video_options: dict[str, Any] = {"do_rescale": False, "do_sample_frames": False, "cap_pixels_per_frame": False}
        if self.max_pixels is not None or self.min_pixels is not None:
            size = self.processor.video_processor.size
            video_options["size"] = {
                "shortest_edge": size.shortest_edge if self.min_pixels is None else self.min_pixels,
                "longest_edge": size.longest_edge if self.max_pixels is None else self.max_pixels,
            }
        batch = self.processor(
            text=texts, videos=clips, padding=True, return_tensors="pt", videos_kwargs=video_options
        )
        return {k: v.to(self.device) for k, v in batch.items()}

    def raw_scores(self, videos: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        """`(B, 3)` float32 CPU: the head's VQ, MQ, TA before standardisation (one forward per chunk)."""
        out = []
        for part in chunk_slices(len(prompts), self.batch_size):
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


def _check_sampling(num_frames: Any, fps: Any, video_fps: Any) -> None:
    """ValueError unless `num_frames` is None or an integer >= 2, `fps` and `video_fps` None or numbers > 0, and
    `video_fps` is given when frames are sampled at `fps`."""
    if num_frames is not None and (not is_integer(num_frames) or num_frames < 2):
        raise ValueError(f"videoalign: num_frames must be an integer >= 2 or null, got {num_frames!r}")
    for option, value in (("fps", fps), ("video_fps", video_fps)):
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf
        ):
            raise ValueError(f"videoalign: {option} must be a number > 0 or null, got {value!r}")
    if num_frames is None and fps is not None and video_fps is None:
        raise ValueError(
            f"videoalign: frames are sampled at fps={fps}; give video_fps (the frame rate of the scored videos, "
            "e.g. 16 for Wan) or num_frames"
        )


def _first(mask: torch.Tensor) -> torch.Tensor:
    """`(b, L)` bool -> `(b,)` index of the first True in each row; ValueError if a row has none."""
    if not bool(mask.any(dim=1).all()):
        raise ValueError("videoalign: a reward token is missing from the tokenized prompt (truncated?)")
    return mask.int().argmax(dim=1)


@register_reward(
    "videoalign",
    modality="video",
    weights="KwaiVGI/VideoReward converted by python -m flowrl.rewards.videoalign_convert (+ Qwen2-VL-2B-Instruct)",
)
def videoalign(
    model_path: str | os.PathLike,
    prompt_template: str | None = None,
    reward_token: str | None = None,
    weights: Mapping[str, float] | None = None,
    normalize: bool = True,
    num_frames: int | None = None,
    max_pixels: int | None = None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | str = torch.float32,
    batch_size: int | None = None,
    fps: float | None = None,
    video_fps: float | None = None,
    min_pixels: int | None = None,
) -> VideoAlign:
    """Load a `VideoAlign` reward from a local folder (nothing is downloaded).

    The folder (what `python -m flowrl.rewards.videoalign_convert` writes from the released checkpoint) holds: a
    `Qwen2VLForConditionalGeneration` saved with `save_pretrained` (the LoRA of the released checkpoint merged
    in) with its `Qwen2VLProcessor` (tokenizer with the reward tokens, chat template); `rm_head.safetensors` (one
    tensor `weight` of shape `(3, hidden_size)`); optionally `videoalign_prompt.txt` (the prompt template) and
    VideoAlign's `model_config.json`: its `inference_config` gives the means and stds, its `model_config.reward_token`
    the default of `reward_token`, and its `data_config` keys `num_frames`, `fps`, `max_frame_pixels` and
    `min_frame_pixels` (the last written by the converter) the defaults of `num_frames`, `fps`, `max_pixels` and
    `min_pixels`; a key it lacks leaves the processor's own setting (all frames, the processor's pixel bounds).

    Args:
        model_path (`str` or path): the folder above.
        prompt_template (`str`, *optional*): see `VideoAlign`; default the folder's `videoalign_prompt.txt`.
        reward_token (`str`, *optional*): see `VideoAlign`; default `model_config.json`'s, else `"special"`.
        weights, max_pixels, min_pixels, video_fps, device, dtype, batch_size: see `VideoAlign`.
        num_frames, fps (*optional*): see `VideoAlign`. Either one given here replaces both of `model_config.json`.
        normalize (`bool`, default True): standardise with `model_config.json`'s `inference_config` when present.

    Returns:
        A `VideoAlign`: `(B, F, 3, H, W)` videos in `[0, 1]` -> `(B,)` float32 CPU.

    Raises:
        FileNotFoundError: `model_path` is not a folder with `config.json`, or `rm_head.safetensors` is
            missing, or there is neither `prompt_template` nor `videoalign_prompt.txt`.
        ValueError: a head of the wrong shape, both `num_frames` and `fps` given, or the checks of `VideoAlign`
            (among them: the folder samples at `fps` and no `video_fps` is given).
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
    if num_frames is not None and fps is not None:
        raise ValueError(f"videoalign: give num_frames or fps, not both (got {num_frames} and {fps})")
    if num_frames is None and fps is None:
        num_frames, fps = data_config.get("num_frames"), data_config.get("fps")
    _check_sampling(num_frames, fps, video_fps)  # before the model loads
    reward_token = (
        (config.get("model_config") or {}).get("reward_token", "special") if reward_token is None else reward_token
    )
    model = load_pretrained(Qwen2VLForConditionalGeneration, folder, "videoalign")
    weight = load_file(folder / HEAD_FILE)["weight"]
    hidden = model.config.get_text_config().hidden_size
    if weight.shape != (len(DIMENSIONS), hidden):
        raise ValueError(f"videoalign: {HEAD_FILE} weight has shape {tuple(weight.shape)}, expected (3, {hidden})")
    rm_head = torch.nn.Linear(hidden, len(DIMENSIONS), bias=False)
    rm_head.weight.data.copy_(weight)
    processor = AutoProcessor.from_pretrained(folder, local_files_only=True)
    mean = {d: stats[f"{d}_mean"] for d in DIMENSIONS} if normalize and stats else None
    std = {d: stats[f"{d}_std"] for d in DIMENSIONS} if normalize and stats else None
    max_pixels = data_config.get("max_frame_pixels") if max_pixels is None else max_pixels
    min_pixels = data_config.get("min_frame_pixels") if min_pixels is None else min_pixels
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
        fps,
        video_fps,
        min_pixels,
    )
