"""Video out: mp4 files (H.264 through PyAV, the FFmpeg bindings) and contact sheets (PNG grids of frames).

Videos are float tensors ``(B, F, 3, H, W)`` in [0, 1], as :meth:`flowrl.models.WanModel.decode` and the video
rewards use them.
"""

from __future__ import annotations

from pathlib import Path

import torch

__all__ = ["check_videos", "contact_sheet", "frame_strip", "read_video", "save_videos", "tile_videos", "write_mp4"]


def check_videos(videos: torch.Tensor, name: str = "videos") -> None:
    """Raise ValueError, naming `name`, unless `videos` is a float tensor ``(B, F, 3, H, W)`` with ``B, F >= 1``."""
    if (
        not torch.is_tensor(videos)
        or not videos.is_floating_point()
        or videos.ndim != 5
        or videos.shape[2] != 3
        or 0 in videos.shape
    ):
        shape = tuple(videos.shape) if torch.is_tensor(videos) else type(videos).__name__
        raise ValueError(f"{name} must be a float tensor (B, F, 3, H, W) with B, F >= 1 in [0, 1]; got {shape}")


def _uint8(frames: torch.Tensor) -> torch.Tensor:
    """Frames ``(..., 3, H, W)`` in [0, 1] -> uint8 ``(..., H, W, 3)`` on CPU (rounded, clamped)."""
    return (frames.detach().float().cpu().clamp(0, 1) * 255).round().to(torch.uint8).movedim(-3, -1)


def write_mp4(video: torch.Tensor, path: str | Path, fps: int = 16, crf: int = 18) -> Path:
    """Write one video as an H.264 mp4 (``yuv420p``, what every player opens), through PyAV.

    H.264 in ``yuv420p`` needs even sides: an odd height or width is padded by one pixel (edge replicated).

    Args:
        video (`torch.Tensor` of shape `(F, 3, H, W)`, float): frames in [0, 1] (clamped).
        path: the ``.mp4`` file to write (its folder must exist).
        fps (`int`): frames per second, >= 1 (16: Wan's rate).
        crf (`int`): x264's constant rate factor, 0 (lossless) to 51; 18 is visually lossless.

    Returns:
        `Path`: ``path``.

    Raises:
        ValueError: for a tensor that is not ``(F, 3, H, W)``, ``fps < 1`` or ``crf`` outside [0, 51].
    """
    import av

    check_videos(video[None] if torch.is_tensor(video) else video, "video")
    if fps < 1 or not 0 <= crf <= 51:
        raise ValueError(f"write_mp4 needs fps >= 1 and crf in [0, 51]; got fps={fps}, crf={crf}")
    frames = _uint8(video)  # (F, H, W, 3)
    pad_h, pad_w = frames.shape[1] % 2, frames.shape[2] % 2
    if pad_h or pad_w:
        frames = torch.nn.functional.pad(frames.permute(0, 3, 1, 2).float(), (0, pad_w, 0, pad_h), mode="replicate")
        frames = frames.to(torch.uint8).permute(0, 2, 3, 1)  # (F, H', W', 3) with even sides
    with av.open(str(path), mode="w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = frames.shape[2], frames.shape[1], "yuv420p"
        stream.options = {"crf": str(crf)}
        for frame in frames.contiguous().numpy():
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())  # flush the encoder
    return Path(path)


def read_video(path: str | Path) -> torch.Tensor:
    """Decode a video file with PyAV: float32 ``(F, 3, H, W)`` in [0, 1].

    Raises:
        FileNotFoundError: if ``path`` does not exist. ValueError: naming ``path``, if it holds no video frame.
    """
    import av

    if not Path(path).is_file():
        raise FileNotFoundError(f"video file {path} not found")
    with av.open(str(path)) as container:
        frames = [torch.from_numpy(f.to_ndarray(format="rgb24")) for f in container.decode(video=0)]
    if not frames:
        raise ValueError(f"{path} holds no video frame")
    return torch.stack(frames).permute(0, 3, 1, 2).float() / 255  # (F, 3, H, W)


def tile_videos(videos: torch.Tensor, nrow: int = 8, padding: int = 1) -> torch.Tensor:
    """Tile ``B`` videos ``(B, F, 3, H, W)`` into one ``(F, 3, H', W')`` video: at each frame the grid
    ``torchvision.utils.make_grid`` makes of the ``B`` frames (``nrow`` per row, ``padding`` px of black).

    Raises:
        ValueError: as :func:`check_videos`.
    """
    from torchvision.utils import make_grid

    check_videos(videos)
    return torch.stack([make_grid(videos[:, f], nrow=nrow, padding=padding) for f in range(videos.shape[1])])


def frame_strip(video: torch.Tensor, max_frames: int = 8) -> torch.Tensor:
    """At most ``max_frames`` frames of ``video (F, 3, H, W)``, evenly spaced from the first to the last, side by
    side: ``(3, H, n W)``.

    Raises:
        ValueError: for ``max_frames < 1`` or a tensor that is not ``(F, 3, H, W)``.
    """
    check_videos(video[None] if torch.is_tensor(video) else video, "video")
    if max_frames < 1:
        raise ValueError(f"max_frames must be >= 1; got {max_frames}")
    count = min(max_frames, video.shape[0])
    picks = torch.linspace(0, video.shape[0] - 1, count).round().long()  # (n,)
    return torch.cat(list(video[picks]), dim=-1)  # (3, H, n W)


def contact_sheet(videos: torch.Tensor, max_frames: int = 8, padding: int = 1) -> torch.Tensor:
    """One row per video of at most ``max_frames`` evenly spaced frames (the first and last included): float32
    ``(3, H', W')`` in [0, 1], ``padding`` px of black between the frames.

    Raises:
        ValueError: as :func:`check_videos`, or for ``max_frames < 1``.
    """
    from torchvision.utils import make_grid

    check_videos(videos)
    if max_frames < 1:
        raise ValueError(f"max_frames must be >= 1; got {max_frames}")
    count = min(max_frames, videos.shape[1])
    picks = torch.linspace(0, videos.shape[1] - 1, count).round().long()  # (n,)
    frames = videos[:, picks].flatten(0, 1).float().clamp(0, 1)  # (B n, 3, H, W), video-major
    return make_grid(frames, nrow=count, padding=padding)


def save_videos(
    videos: torch.Tensor,
    sheet: str | Path,
    fps: int = 16,
    nrow: int = 8,
    max_frames: int = 8,
    mp4: str | Path | None = None,
) -> tuple[Path, Path]:
    """Write ``B`` videos as one mp4 (tiled ``nrow`` per row: :func:`tile_videos`) and a contact-sheet image of
    their frames (:func:`contact_sheet`): ``sheet`` (a PNG or any image format PIL writes) and ``mp4`` (default:
    ``sheet`` with the suffix ``.mp4``).

    Args:
        videos (`torch.Tensor` of shape `(B, F, 3, H, W)`, float): in [0, 1].
        sheet: the contact sheet's path.
        fps, nrow, max_frames: as :func:`write_mp4`, :func:`tile_videos`, :func:`contact_sheet`.
        mp4: the video's path (None: beside the sheet).

    Returns:
        ``(sheet, mp4)`` paths.

    Raises:
        ValueError: as :func:`check_videos` and :func:`write_mp4`.
    """
    from torchvision.utils import save_image

    check_videos(videos)
    sheet = Path(sheet)
    mp4 = sheet.with_suffix(".mp4") if mp4 is None else Path(mp4)
    write_mp4(tile_videos(videos, nrow=min(nrow, videos.shape[0])), mp4, fps=fps)
    save_image(contact_sheet(videos, max_frames), sheet)
    return sheet, mp4
