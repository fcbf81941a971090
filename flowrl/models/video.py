"""What the video families share: latent videos ``(C, F, H, W)``, the frame count, one trained expert (or a refusal of
one), the CFG negative prompt and the decoded videos' shape (:class:`VideoModel`, the base of Wan, HunyuanVideo,
HunyuanVideo 1.5 and LTX-Video)."""

from __future__ import annotations

from pathlib import Path

import torch

from ..fields import config_key
from ..files import resolve_path
from .base import FlowModel


class VideoModel(FlowModel):
    """The base of the video families: :class:`FlowModel` over latents ``(C, F_lat, H, W)`` decoded to videos ``(B, F,
    3, H, W)``, with a frame count, a trained expert and a negative prompt; not a family itself.

    A subclass provides :meth:`check_num_frames` (the frame counts its VAE takes, the default :attr:`DEFAULT_FRAMES`)
    and, for a folder of two experts, :meth:`check_expert` (Wan 2.2); the one-transformer families refuse an expert.

    Args:
        path, device, dtype, max_sequence_length, resolution: as :class:`FlowModel`.
        num_frames: frames per video (None: the family's default, :meth:`check_num_frames`).
        expert: the trained expert of a two-expert folder (``model.expert``), None otherwise.
        negative_prompt: the CFG negative prompt (``""``: the prompt table's empty row).
        options: the family's own settings (:attr:`FlowModel.OPTIONS`).

    Raises:
        FileNotFoundError, ValueError: as :class:`FlowModel`; ValueError also for a frame count or expert the folder
            cannot take.
    """

    VIDEO = True
    VAE_CHANNELS_LAST = False
    """The video VAEs' convolutions are 3-D (channels-last is a 4-D format)."""
    DECODE_CHUNK = 4
    """Videos per VAE decode call."""
    DEFAULT_FRAMES = 0
    """Frames per video when none is given (the stock pipeline's ``num_frames``; set by each family)."""

    def __init__(
        self,
        path,
        device="cpu",
        dtype=torch.float32,
        max_sequence_length=None,
        resolution=None,
        num_frames: int | None = None,
        expert: str | None = None,
        negative_prompt: str = "",
        **options,
    ):
        self.num_frames = self.check_num_frames(path, num_frames)
        self.expert = self.check_expert(path, expert)
        self.NETWORK = self.network_name(self.expert)  # the trained network; base loading holds it as self.transformer
        self.negative_prompt = negative_prompt
        super().__init__(path, device, dtype, max_sequence_length, resolution, **options)

    @classmethod
    def check_num_frames(cls, path: str | Path, num_frames: int | None) -> int:
        """The frames per video the folder ``path`` draws: ``num_frames`` checked, or the default (no weights loaded).

        Raises:
            ValueError: naming the folder, for a frame count its VAE cannot take.
        """
        raise NotImplementedError

    @classmethod
    def check_expert(cls, path: str | Path, expert: str | None) -> str | None:
        """The trained expert of the folder ``path``: None, the family having one transformer.

        Raises:
            ValueError: naming the folder, for an expert given.
        """
        if expert is not None:
            article = "an" if cls.FAMILY.startswith(("LTX", "A", "E", "I", "O", "U")) else "a"
            raise ValueError(
                f"{Path(path)} is {article} {cls.FAMILY} model (one transformer): leave the expert unset, got {expert!r}"
            )
        return None

    @classmethod
    def check_config(cls, cfg) -> None:
        """:meth:`FlowModel.check_config`, and ``model.num_frames`` and ``model.expert`` (:meth:`check_num_frames`,
        :meth:`check_expert`), before weights load.

        Raises:
            flowrl.fields.ConfigError: naming the key.
        """
        super().check_config(cfg)
        path = resolve_path(cfg.model.path)
        for key, check in (("num_frames", cls.check_num_frames), ("expert", cls.check_expert)):
            with config_key(f"model.{key}"):
                check(path, getattr(cfg.model, key))

    def vae_factors(self) -> tuple[int, int]:
        """``(spatial, temporal)`` compression of the loaded VAE (the pipeline's ``vae_scale_factor_spatial`` and
        ``vae_scale_factor_temporal``)."""
        return self.pipe.vae_scale_factor_spatial, self.pipe.vae_scale_factor_temporal

    @property
    def video_grid(self) -> tuple[int, int, int]:
        """``(F_lat, H, W)`` of one video's latents: ``F_lat = (num_frames - 1) / t + 1``, ``H = W = resolution / s``
        (``s``, ``t`` the VAE's spatial and temporal compression, :meth:`vae_factors`)."""
        spatial, temporal = self.vae_factors()
        side = self.resolution // spatial
        return ((self.num_frames - 1) // temporal + 1, side, side)

    @property
    def latent_shape(self) -> tuple[int, ...]:
        """``(C, F_lat, H, W)`` of one video's latents: the transformer's ``in_channels`` and :attr:`video_grid`."""
        return (self.transformer.config.in_channels, *self.video_grid)

    @property
    def decoded_shape(self) -> tuple[int, int, int, int]:
        """``(F, 3, H, W)`` of one decoded video (what the rewards get per sample)."""
        return (self.num_frames, 3, self.resolution, self.resolution)
