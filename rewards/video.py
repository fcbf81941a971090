"""Video rewards: any image reward applied to frames, CLIP frame-to-frame consistency, and RAFT motion.

Videos are `(B, F, 3, H, W)` float tensors in `[0, 1]` (`F` frames); each reward here has
`accepts_video = True` and returns one `(B,)` float32 CPU score per video (see `rewards.base.Reward`).

- `frames`: an image reward on all frames or `num_frames` of them, flattened into one batch (prompt and
  metadata repeated per frame), aggregated per video by mean or min, or the mean over randomly drawn frames.
- `clip_temporal`: mean cosine similarity of the CLIP image embeddings of consecutive frames, in `[-1, 1]`.
- `motion`: mean optical-flow magnitude between consecutive frames from torchvision's RAFT (Teed & Deng,
  arXiv 2003.12039; torchvision `models/optical_flow/raft.py`), in input pixels per frame.
- `videoalign` (in `rewards.videoalign`): VideoAlign's VQ/MQ/TA reward model on Qwen2-VL.

`transformers` and `torchvision` are imported only when a model is loaded, so `import rewards` stays light.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from .base import (
    RewardTypeError,
    accepts_video,
    build_reward,
    check_batch_size,
    check_inputs,
    check_scores,
    chunk_slices,
    is_integer,
    load_pretrained,
    register_reward,
    reward_name,
)
from .clipscore import ClipScore, _pooled
from .frozen import channel_stats, frozen, placement

__all__ = ["ClipTemporal", "Frames", "Motion", "clip_temporal", "frame_indices", "frames", "motion"]

AGGREGATES = ("mean", "min", "sample")


def frame_indices(total: int, num_frames: int | None) -> torch.Tensor:
    """`num_frames` evenly spaced frame indices of a `total`-frame video, first and last included.

    Args:
        total (`int >= 1`): frames in the video.
        num_frames (`int >= 1` or None): how many to take; None takes all.

    Returns:
        `torch.Tensor` of shape `(k,)`, int64, increasing, in `[0, total)`: `round(linspace(0, total - 1, k))`
        (the middle frame when `k = 1`).

    Raises:
        ValueError: `num_frames` exceeds `total`.
    """
    if num_frames is None:
        return torch.arange(total)
    if num_frames > total:
        raise ValueError(f"frames: num_frames={num_frames} but the videos have {total} frames")
    if num_frames == 1:
        return torch.tensor([(total - 1) // 2])
    return torch.linspace(0, total - 1, num_frames, dtype=torch.float64).round().long()


class Frames:
    """An image reward scored on the frames of each video and aggregated per video.

    The chosen frames of all `B` videos are flattened into one `(B * k, 3, H, W)` batch (the wrapped
    reward's own `batch_size` option bounds its memory), each video's prompt and metadata repeated `k`
    times, so the wrapped reward is called once per batch.

    Args:
        reward (`Reward`): an image reward (`(N, 3, H, W)` -> `(N,)`); not one that already accepts videos.
        aggregate (`str`, default `"mean"`): `"mean"` or `"min"` of the scores of the `k` evenly spaced
            frames of each video (`frame_indices`); `"sample"`: the mean over `k` frames drawn uniformly at
            random without replacement, independently per video (an unbiased, cheaper estimate of the mean
            over all frames).
        num_frames (`int >= 1`, *optional*): `k`; default all frames for `"mean"`/`"min"`, 1 for `"sample"`.
        seed (`int`, default 0): seed of the generator drawing the `"sample"` frames (advanced every call).

    Returns (when called):
        `torch.Tensor` of shape `(B,)`, float32, CPU: in the wrapped reward's units and range.

    Raises:
        RewardTypeError (a TypeError): `reward` is not callable or already scores videos.
        ValueError: unknown `aggregate`, or `num_frames` not an integer >= 1; when called, malformed
            videos (`rewards.base.check_inputs` with `video=True`), `num_frames` above the frame count, or
            malformed scores from the wrapped reward (`rewards.base.check_scores`).
    """

    accepts_video = True

    def __init__(self, reward: Callable, aggregate: str = "mean", num_frames: int | None = None, seed: int = 0):
        if not callable(reward):
            raise RewardTypeError(f"frames: reward must be an image reward (a callable), got {type(reward).__name__}")
        if accepts_video(reward):
            raise RewardTypeError(f"frames: reward {reward_name(reward)!r} already scores videos; use it unwrapped")
        if aggregate not in AGGREGATES:
            raise ValueError(f"frames: aggregate must be one of {', '.join(AGGREGATES)}, got {aggregate!r}")
        if num_frames is not None and (not is_integer(num_frames) or num_frames < 1):
            raise ValueError(f"frames: num_frames must be an integer >= 1 or null, got {num_frames!r}")
        if not is_integer(seed):
            raise ValueError(f"frames: seed must be an integer, got {seed!r}")
        self.reward, self.aggregate = reward, aggregate
        self.num_frames = 1 if num_frames is None and aggregate == "sample" else num_frames
        self.generator = torch.Generator().manual_seed(int(seed))
        self.name = f"frames({reward_name(reward)})"

    def indices(self, batch: int, total: int) -> torch.Tensor:
        """The frames scored: `(batch, k)` int64 indices into `total` frames, increasing along each row."""
        if self.aggregate != "sample":
            return frame_indices(total, self.num_frames).expand(batch, -1)
        k = frame_indices(total, self.num_frames).numel()  # checks k <= total
        draws = torch.rand(batch, total, generator=self.generator).argsort(dim=1)[:, :k]  # (batch, k)
        return draws.sort(dim=1).values

    @property
    def differentiable(self) -> bool:
        """Whether the wrapped image reward has ``score_with_grad`` (then :meth:`score_with_grad` works): what the
        direct-reward methods need of a video family's reward."""
        return bool(getattr(self.reward, "differentiable", False))

    @torch.no_grad()
    def __call__(
        self, videos: torch.Tensor, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]]
    ) -> torch.Tensor:
        check_inputs(videos, prompts, metadata, video=True)
        return self._score(videos, prompts, metadata, self.reward, grad=False)

    def score_with_grad(
        self, videos: torch.Tensor, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]]
    ) -> torch.Tensor:
        """The scores of :meth:`__call__` with the graph back to `videos` `(B, F, 3, H, W)`: the wrapped reward's
        ``score_with_grad`` on the chosen frames, aggregated per video (the mean, or the min, differentiate);
        `(B,)` float32 on the wrapped reward's device. Equal to :meth:`__call__`'s scores for the same frames.

        Raises:
            RewardTypeError (a TypeError): the wrapped reward has no ``score_with_grad``.
        """
        if not self.differentiable:
            raise RewardTypeError(f"{self.name}: the wrapped reward has no score_with_grad (not differentiable)")
        check_inputs(videos.detach(), prompts, metadata, video=True)
        return self._score(videos, prompts, metadata, self.reward.score_with_grad, grad=True)

    def _score(self, videos, prompts, metadata, score: Callable, grad: bool) -> torch.Tensor:
        """The chosen frames of `videos` `(B, F, 3, H, W)` scored by `score` as one batch, aggregated per video."""
        batch, total = videos.shape[:2]
        index = self.indices(batch, total)  # (B, k)
        k = index.shape[1]
        if batch == 0:
            return torch.zeros(0)
        chosen = videos[torch.arange(batch).unsqueeze(1), index.to(videos.device)]  # (B, k, 3, H, W)
        flat = chosen.flatten(0, 1)  # (B * k, 3, H, W), video-major
        raw = score(flat, [p for p in prompts for _ in range(k)], [m for m in metadata for _ in range(k)])
        checked = check_scores(reward_name(self.reward), raw, batch * k)  # shape and finiteness (detached)
        scores = (raw if grad else checked).view(batch, k)  # (B, k)
        return scores.amin(dim=1) if self.aggregate == "min" else scores.mean(dim=1)


@register_reward("frames", modality="video", weights="the wrapped image reward's")
def frames(
    reward: str | Callable,
    reward_options: Mapping[str, Any] | None = None,
    aggregate: str = "mean",
    num_frames: int | None = None,
    seed: int = 0,
) -> Frames:
    """Score videos with an image reward on their frames (`Frames`).

    In a config: `rewards: {frames: {weight: 1, options: {reward: clipscore, reward_options: {model_path:
    /ckpt/clip}, aggregate: mean, num_frames: 4}}}`.

    Args:
        reward (`str` or `Reward`): a registered name or `"package.module:attr"` (built with
            `reward_options` by `rewards.build_reward`), or an image reward callable.
        reward_options (`dict`, *optional*): options of the wrapped reward's factory (only with a name).
        aggregate, num_frames, seed: see `Frames`.

    Returns:
        A `Frames` reward: `(B, F, 3, H, W)` videos in `[0, 1]` -> `(B,)` float32 CPU scores.

    Raises:
        ValueError / TypeError: as `rewards.build_reward` for the wrapped reward, `reward_options` given
            with a callable, or the checks of `Frames`.
    """
    if isinstance(reward, str):
        reward = build_reward(reward, **dict(reward_options or {}))
    elif reward_options:
        raise RewardTypeError("frames: reward_options are the options of a reward given by name; got a callable")
    return Frames(reward, aggregate, num_frames, seed)


# --- CLIP temporal consistency ------------------------------------------------------------------


class ClipTemporal:
    """Frame-to-frame consistency: mean cosine similarity of the CLIP image embeddings of consecutive frames.

    `score(video) = mean_{f < F-1} cos(e_f, e_{f+1})` with `e_f` the projected CLIP image embedding of
    frame `f`, preprocessed as `ClipScore.preprocess` does (resize the short side, centre crop, normalise,
    on tensors). The same consistency measure as VBench's subject/background consistency (arXiv 2311.17982),
    there with DINO/CLIP features against the first and previous frames.

    Use the `clip_temporal` factory to load one from a folder; build this class directly to wrap a model
    already in memory.

    Args:
        model (`transformers.CLIPVisionModelWithProjection` or `transformers.CLIPModel`): put in eval mode,
            frozen, and moved to `device` and `dtype`.
        image_mean, image_std (`Sequence[float]` of length 3): the model's preprocessing statistics.
        device (`str` or `torch.device`), dtype (`torch.dtype` or `str`): where and in what the model runs.
        batch_size (`int >= 1`, *optional*): frames per forward; default all frames of the batch at once.

    Returns (when called):
        `torch.Tensor` of shape `(B,)`, float32, CPU, in `[-1, 1]` (1: all consecutive frames embed alike).

    Raises (when called):
        TypeError / ValueError: malformed videos (`rewards.base.check_inputs` with `video=True`), or
            videos of fewer than 2 frames.
    """

    name = "clip_temporal"
    accepts_video = True
    preprocess = ClipScore.preprocess  # reads image_size, image_mean, image_std, device and dtype set below

    def __init__(
        self,
        model: torch.nn.Module,
        image_mean: Sequence[float],
        image_std: Sequence[float],
        device: str | torch.device = "cpu",
        dtype: torch.dtype | str = torch.float32,
        batch_size: int | None = None,
    ):
        self.batch_size, self.device, self.dtype = placement(device, dtype, batch_size, self.name)
        self.image_mean, self.image_std = channel_stats(image_mean, image_std, self.device)
        self.model = frozen(model, self.device, self.dtype)
        vision_config = getattr(model.config, "vision_config", model.config)
        self.image_size = int(vision_config.image_size)

    def embed(self, images: torch.Tensor) -> torch.Tensor:
        """`(N, 3, H, W)` images in `[0, 1]` -> `(N, D)` float32 unit-norm CLIP image embeddings, on `device`."""
        out = []
        for part in chunk_slices(images.shape[0], self.batch_size):
            pixels = self.preprocess(images[part])  # (n, 3, S, S)
            if hasattr(self.model, "get_image_features"):
                features = _pooled(self.model.get_image_features(pixel_values=pixels))
            else:
                features = self.model(pixel_values=pixels).image_embeds
            out.append(F.normalize(features.float(), dim=-1))  # (n, D)
        return torch.cat(out)

    @torch.no_grad()
    def __call__(
        self, videos: torch.Tensor, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]]
    ) -> torch.Tensor:
        check_inputs(videos, prompts, metadata, video=True)
        batch, total = videos.shape[:2]
        if total < 2:
            raise ValueError(f"{self.name}: videos need at least 2 frames, got {total}")
        if batch == 0:
            return torch.zeros(0)
        embeddings = self.embed(videos.flatten(0, 1)).view(batch, total, -1)  # (B, F, D)
        cosine = (embeddings[:, 1:] * embeddings[:, :-1]).sum(-1)  # (B, F-1)
        return cosine.mean(dim=1).cpu()


def _check_folder(name: str, path: str | os.PathLike, what: str, need_config: bool) -> Path:
    folder = Path(path)
    if not folder.is_dir():
        raise FileNotFoundError(
            f"{name}: {what} '{path}' is not a local folder; download it first and pass the folder"
        )
    if need_config and not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{name}: {what} '{path}' has no config.json (save the model with save_pretrained)")
    return folder


@register_reward("clip_temporal", modality="video", weights="a transformers CLIPModel folder")
def clip_temporal(
    model_path: str | os.PathLike,
    processor_path: str | os.PathLike | None = None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | str = torch.float32,
    batch_size: int | None = None,
) -> ClipTemporal:
    """Load a `ClipTemporal` reward from local folders (nothing is downloaded).

    Args:
        model_path (`str` or path): folder of a transformers `CLIPModel` (e.g. `openai/clip-vit-large-patch14`
            downloaded beforehand); only its image tower and projection are used.
        processor_path (`str` or path, *optional*): folder with the image processor config
            (`preprocessor_config.json`, for the normalisation statistics); defaults to `model_path`.
        device, dtype, batch_size: see `ClipTemporal`.

    Returns:
        A `ClipTemporal`: `(B, F, 3, H, W)` videos in `[0, 1]` with `F >= 2` -> `(B,)` float32 CPU in `[-1, 1]`.

    Raises:
        FileNotFoundError: a path is not a local folder, or `model_path` has no `config.json`.
        OSError: no image processor config in `processor_path`.
        ValueError: `dtype` not a floating dtype, or `batch_size` not an integer >= 1.
    """
    from transformers import AutoImageProcessor, CLIPModel

    model_dir = _check_folder("clip_temporal", model_path, "model_path", need_config=True)
    processor_dir = _check_folder("clip_temporal", processor_path or model_path, "processor_path", need_config=False)
    try:
        image_processor = AutoImageProcessor.from_pretrained(processor_dir, local_files_only=True)
    except (OSError, ValueError) as err:
        first_line = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise OSError(
            f"clip_temporal: cannot load a CLIP image processor from '{processor_dir}' ({first_line})"
        ) from err
    model = load_pretrained(CLIPModel, model_dir, "clip_temporal")
    return ClipTemporal(model, image_processor.image_mean, image_processor.image_std, device, dtype, batch_size)


# --- RAFT motion --------------------------------------------------------------------------------

RAFT_MIN_SIDE = 128
"""RAFT's correlation pyramid needs feature maps of at least 16 x 16, i.e. inputs of at least 128 pixels a side."""

DIRECTIONS = ("reward", "penalize")


def raft_size(height: int, width: int) -> tuple[int, int]:
    """The default RAFT input size for `height x width` frames: scaled up (aspect kept) so the short side
    is at least `RAFT_MIN_SIDE`, then each side rounded up to a multiple of 8."""
    scale = max(1.0, RAFT_MIN_SIDE / min(height, width))
    return tuple(8 * math.ceil(round(side * scale, 6) / 8) for side in (height, width))  # type: ignore[return-value]


class Motion:
    """Optical-flow magnitude between consecutive frames, from torchvision's RAFT.

    RAFT (Teed & Deng, arXiv 2003.12039; reference implementation torchvision
    `torchvision/models/optical_flow/raft.py`) predicts the flow from frame `f` to frame `f+1` at every pixel.
    Frames are resized (bilinear) to `size`, mapped to `[-1, 1]` as torchvision's `OpticalFlow` preset does,
    and the final flow estimate is rescaled back to the input's pixel grid (`u * W / W'`, `v * H / H'`), so

        `motion(video) = mean_{f, pixels} ||flow_f||_2`   in input pixels per frame (>= 0),

    divided by the frame diagonal `sqrt(H^2 + W^2)` when `normalize` (a fraction of the diagonal per frame,
    independent of resolution). `direction="penalize"` returns its negative (favour still videos).

    Args:
        model (`torchvision.models.optical_flow.RAFT`): e.g. `raft_large(weights=None)` with a state dict
            loaded; put in eval mode, frozen, and moved to `device` (runs in float32).
        size (`(int, int)`, *optional*): RAFT input `(H', W')`, multiples of 8 and at least 128; default
            `raft_size(H, W)`.
        num_flow_updates (`int >= 1`, default 12): RAFT's recurrent refinement steps (torchvision's default).
        normalize (`bool`, default False): divide by the frame diagonal.
        direction (`str`, default `"reward"`): `"reward"` (more motion scores higher) or `"penalize"`.
        device (`str` or `torch.device`): where RAFT runs.
        batch_size (`int >= 1`, *optional*): frame pairs per forward; default all pairs at once.

    Returns (when called):
        `torch.Tensor` of shape `(B,)`, float32, CPU: `+-` mean flow magnitude as above.

    Raises:
        ValueError: bad `size`, `num_flow_updates`, `direction` or `batch_size`; when called, malformed videos
            (`rewards.base.check_inputs` with `video=True`) or fewer than 2 frames.
    """

    name = "motion"
    accepts_video = True

    def __init__(
        self,
        model: torch.nn.Module,
        size: Sequence[int] | None = None,
        num_flow_updates: int = 12,
        normalize: bool = False,
        direction: str = "reward",
        device: str | torch.device = "cpu",
        batch_size: int | None = None,
    ):
        if size is not None and (
            len(size) != 2 or not all(is_integer(s) and s % 8 == 0 and s >= RAFT_MIN_SIDE for s in size)
        ):
            raise ValueError(
                f"motion: size must be [height, width], multiples of 8 and >= {RAFT_MIN_SIDE}, got {size!r}"
            )
        if not is_integer(num_flow_updates) or num_flow_updates < 1:
            raise ValueError(f"motion: num_flow_updates must be an integer >= 1, got {num_flow_updates!r}")
        if direction not in DIRECTIONS:
            raise ValueError(f"motion: direction must be one of {', '.join(DIRECTIONS)}, got {direction!r}")
        check_batch_size(batch_size, self.name)
        self.size = None if size is None else (int(size[0]), int(size[1]))
        self.num_flow_updates, self.normalize, self.direction = int(num_flow_updates), bool(normalize), direction
        self.device, self.batch_size = torch.device(device), batch_size
        self.model = model.to(self.device).float().eval().requires_grad_(False)

    def prepare(self, frames: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
        """`(N, 3, H, W)` in `[0, 1]` -> `(N, 3, *size)` float32 in `[-1, 1]` on `device` (RAFT's input)."""
        pixels = frames.to(device=self.device, dtype=torch.float32)
        if tuple(pixels.shape[-2:]) != size:
            pixels = F.interpolate(pixels, size=size, mode="bilinear", antialias=True, align_corners=False)
        return (pixels * 2 - 1).clamp(-1, 1)

    def flow(self, videos: torch.Tensor) -> torch.Tensor:
        """Flow from each frame to the next, in input pixels.

        Args:
            videos (`torch.Tensor` of shape `(B, F, 3, H, W)`, in `[0, 1]`, `F >= 2`).

        Returns:
            `torch.Tensor` of shape `(B, F-1, 2, H', W')`, float32, on `device`: `(u, v)` displacement along
            width and height, in pixels of the `H x W` input, sampled on RAFT's `H' x W'` grid.
        """
        batch, total, _, height, width = videos.shape
        size = self.size or raft_size(height, width)
        first = videos[:, :-1].flatten(0, 1)  # (B*(F-1), 3, H, W)
        second = videos[:, 1:].flatten(0, 1)  # (B*(F-1), 3, H, W)
        flows = []
        for part in chunk_slices(first.shape[0], self.batch_size):
            predictions = self.model(
                self.prepare(first[part], size),
                self.prepare(second[part], size),
                num_flow_updates=self.num_flow_updates,
            )
            flows.append(predictions[-1].float())  # (n, 2, H', W'): the last refinement
        scale = torch.tensor([width / size[1], height / size[0]], device=self.device).view(1, 2, 1, 1)
        return (torch.cat(flows) * scale).view(batch, total - 1, 2, *size)

    @torch.no_grad()
    def __call__(
        self, videos: torch.Tensor, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]]
    ) -> torch.Tensor:
        check_inputs(videos, prompts, metadata, video=True)
        batch, total, _, height, width = videos.shape
        if total < 2:
            raise ValueError(f"{self.name}: videos need at least 2 frames, got {total}")
        if batch == 0:
            return torch.zeros(0)
        magnitude = self.flow(videos).norm(dim=2).mean(dim=(1, 2, 3))  # (B,) pixels per frame
        if self.normalize:
            magnitude = magnitude / math.hypot(height, width)
        return (magnitude if self.direction == "reward" else -magnitude).cpu()


RAFT_ARCHS = ("raft_small", "raft_large")


def _load_raft(model_path: str | os.PathLike, arch: str | None) -> torch.nn.Module:
    """A torchvision RAFT with the state dict of `model_path` (a `.pth`, read with `weights_only=True`)."""
    from torchvision.models import optical_flow

    if arch is not None and arch not in RAFT_ARCHS:
        raise ValueError(f"motion: arch must be one of {', '.join(RAFT_ARCHS)} or null (inferred), got {arch!r}")
    if not Path(model_path).is_file():
        raise FileNotFoundError(
            f"motion: model_path '{model_path}' is not a file; download torchvision's RAFT weights (e.g. "
            "raft_large_C_T_SKHT_V2-ff5fadd5.pth) and pass the .pth file"
        )
    state = torch.load(model_path, map_location="cpu", weights_only=True)
    if not isinstance(state, Mapping) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(
            f"motion: model_path '{model_path}' is not a state dict of tensors (got {type(state).__name__})"
        )
    for name in [arch] if arch else RAFT_ARCHS:
        model = getattr(optical_flow, name)(weights=None)
        if set(model.state_dict()) == set(state):
            model.load_state_dict(state)
            return model
    expected = f"a {arch} state dict" if arch else "a raft_small or raft_large state dict"
    raise ValueError(f"motion: model_path '{model_path}' is not {expected} (its keys do not match)")


@register_reward("motion", modality="video", weights="torchvision RAFT raft_small or raft_large .pth")
def motion(
    model_path: str | os.PathLike,
    arch: str | None = None,
    size: Sequence[int] | None = None,
    num_flow_updates: int = 12,
    normalize: bool = False,
    direction: str = "reward",
    device: str | torch.device = "cpu",
    batch_size: int | None = None,
) -> Motion:
    """Load a `Motion` reward: torchvision's RAFT from a local state-dict file (nothing is downloaded).

    Args:
        model_path (`str` or path): a `.pth` state dict of `torchvision.models.optical_flow.raft_small` or
            `raft_large`, e.g. torchvision's `raft_large_C_T_SKHT_V2-ff5fadd5.pth`; loaded with
            `torch.load(..., weights_only=True)`.
        arch (`str`, *optional*): `"raft_small"` or `"raft_large"`; default inferred from the state dict's keys.
        size, num_flow_updates, normalize, direction, device, batch_size: see `Motion`.

    Returns:
        A `Motion`: `(B, F, 3, H, W)` videos in `[0, 1]` with `F >= 2` -> `(B,)` float32 CPU, mean flow
        magnitude in input pixels per frame (or a fraction of the frame diagonal with `normalize`).

    Raises:
        FileNotFoundError: `model_path` is not a file.
        ValueError: unknown `arch`, a file that is not a RAFT state dict of that arch, or a bad option.
    """
    return Motion(_load_raft(model_path, arch), size, num_flow_updates, normalize, direction, device, batch_size)
