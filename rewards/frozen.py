"""What the rewards that score with a frozen network share: the dtype option, the network's placement (device, dtype,
eval mode, no gradients to its weights), the per-channel normalisation of its image input, and chunked scoring with
a differentiable twin.

Imports torch only (and :mod:`rewards.base`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .base import check_batch_size, check_inputs, score_in_chunks

__all__ = ["FrozenNetworkReward", "as_dtype", "channel_stats", "frozen", "placement"]


def as_dtype(dtype: torch.dtype | str, reward: str = "") -> torch.dtype:
    """`torch.float16` or `"float16"` / `"torch.float16"` -> `torch.float16` (floating types only).

    Raises:
        ValueError: for anything else; the message starts with ``"REWARD: "`` when `reward` is given.
    """
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        prefix = f"{reward}: " if reward else ""
        raise ValueError(f"{prefix}dtype must be a floating torch dtype such as 'float32' or 'bfloat16', got {dtype}")
    return dtype


def frozen(module: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """`module` moved to `device` and `dtype`, in eval mode, its weights without gradients (a reward's network)."""
    return module.to(device=device, dtype=dtype).eval().requires_grad_(False)


def channel_stats(
    mean: Sequence[float], std: Sequence[float], device: torch.device, reward: str = ""
) -> tuple[torch.Tensor, torch.Tensor]:
    """A network's per-channel image normalisation as tensors `(1, 3, 1, 1)` float32 on `device`.

    Raises:
        ValueError: `mean` or `std` does not hold 3 values (the message starts with ``"REWARD: "`` when given).
    """
    if len(mean) != 3 or len(std) != 3:
        prefix = f"{reward}: " if reward else ""
        raise ValueError(f"{prefix}image_mean and image_std need 3 values, got {mean!r} and {std!r}")
    return tuple(torch.tensor(v, dtype=torch.float32, device=device).view(1, 3, 1, 1) for v in (mean, std))


def placement(
    device: str | torch.device, dtype: torch.dtype | str, batch_size: int | None, reward: str
) -> tuple[int | None, torch.device, torch.dtype]:
    """A reward's ``(batch_size, device, dtype)`` options, checked: images per forward (None: all at once), where
    its network runs and in which floating dtype.

    Raises:
        ValueError: naming `reward`, for a `batch_size` that is not an integer >= 1 or None, or a `dtype` that is
            not floating.
    """
    return check_batch_size(batch_size, reward), torch.device(device), as_dtype(dtype)


class FrozenNetworkReward:
    """Base of a reward that scores `(B, 3, H, W)` images in `[0, 1]` and their prompts with a frozen network, in
    chunks of :attr:`batch_size` images: a subclass sets its options with :meth:`place` and defines
    ``_score(images (b, 3, H, W), prompts (b,)) -> (b,)`` on the CPU, with the graph back to `images`.

    Attributes:
        name (`str`): the reward's name, in error messages.
        differentiable (`bool`): True: :meth:`score_with_grad` back-propagates (the direct-reward methods train on
            it).
        batch_size (`int` or None), device (`torch.device`), dtype (`torch.dtype`): set by :meth:`place`.
    """

    name = ""
    differentiable = True

    def place(self, device: str | torch.device, dtype: torch.dtype | str, batch_size: int | None) -> None:
        """Check and set :attr:`batch_size` (images per forward, None: all at once), :attr:`device` and :attr:`dtype`.

        Raises:
            ValueError: a `batch_size` that is not an integer >= 1 or None, or a `dtype` that is not floating.
        """
        self.batch_size, self.device, self.dtype = placement(device, dtype, batch_size, self.name)

    @torch.no_grad()
    def __call__(
        self, images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]]
    ) -> torch.Tensor:
        """Scores `(B,)` float32 on the CPU of `images` `(B, 3, H, W)` in `[0, 1]` and their `prompts`, in chunks.

        Raises:
            TypeError / ValueError: malformed inputs (see `rewards.base.check_inputs`).
        """
        check_inputs(images, prompts, metadata)
        return score_in_chunks(self._score, images, prompts, self.batch_size).float()

    def score_with_grad(
        self, images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]]
    ) -> torch.Tensor:
        """The scores of :meth:`__call__` with the graph back to `images` `(B, 3, H, W)` in `[0, 1]` (the
        preprocessing is torch), in one forward; `(B,)` on the CPU, float32 (float64 for a float64 network, for
        gradient checks). The network's weights stay frozen.

        Raises:
            TypeError / ValueError: malformed inputs (see `rewards.base.check_inputs`).
        """
        check_inputs(images.detach(), prompts, metadata)
        return self._score(images, prompts)

    def _score(self, images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        raise NotImplementedError
