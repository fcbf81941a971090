"""MixGRPO sliding windows: which consecutive steps are SDE and trained, as training advances.

MixGRPO (Li et al., arXiv 2507.21802) samples with the ODE everywhere except a window of ``size``
consecutive denoising steps, where it uses the Flow-GRPO SDE and trains. The window's start ``l`` moves
with the training iteration following a schedule:

- ``"progressive"``: every ``interval`` iterations (the paper's shift interval tau) ``l += stride``;
  past the last trainable step ``l`` rolls back to 0 (``roll_back``) or stays at the last step.
- ``"decay"``: as progressive, with an interval that shrinks linearly in ``l``:
  ``tau(l) = max(tau_min, int(tau (1 - p) + tau_min p))``, ``p = l / last``.
- ``"exp_decay"``: as progressive, with ``tau(l) = ceil(tau exp(-k max(0, l - l_thr)))``
  (``k = 0.1``, ``l_thr = 13`` in the published code).
- ``"random"``: every iteration ``l ~ Uniform{0, ..., last - size + 1}``, drawn from ``(seed, iteration)``
  so that a resumed run draws the same windows (the published code draws unseeded).
- ``"fixed"``: ``l`` never moves (MixGRPO-Flash*, the frozen first window).

Steps are indexed ``0 .. N-1``; ``last = N - 2`` is the last trainable step (the final step, which lands on
``t = 0``, is never trained, as in Flow-GRPO). The window is ``[l, min(l + size - 1, last)]``: it shrinks
near the end instead of becoming empty. The published code caps the window one step earlier, at ``N - 3``:
it never trains step ``N - 2``, its windows shrink one step sooner and are empty at ``l = N - 2``, and its
``"random"`` starts range over one step fewer (at 25 steps, start 20 of a 4-step window trains [20, 21, 22]
there and [20 .. 23] here).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import torch

from .rollout import StepPlan
from .schedule import respace_tail

__all__ = ["WINDOW_SCHEDULES", "SlidingWindow", "mix_plan"]

WINDOW_SCHEDULES = ("progressive", "decay", "exp_decay", "random", "fixed")


@dataclass
class SlidingWindow:
    """The MixGRPO window position as a function of the training iteration (see the module docstring).

    Attributes:
        num_steps (`int`): denoising steps ``N`` of the sampling schedule, `>= 2`.
        size (`int`): window length ``w`` in steps (4 of 25 in the paper), `>= 1`.
        schedule (`str`): one of :data:`WINDOW_SCHEDULES`.
        stride (`int`): steps the start moves per shift (1 in the paper), `>= 0`.
        interval (`int`): iterations per shift, tau (25 for MixGRPO, 20 for Flash), `>= 1`.
        min_interval (`int`): the smallest interval of ``"decay"`` (1 in the paper's script), `>= 1`.
        roll_back (`bool`): past the last step, return to 0 instead of staying at the end.
        exp_k (`float`), exp_threshold (`int`): ``"exp_decay"``'s ``k`` and ``l_thr``.
        seed (`int`): seed of the ``"random"`` schedule.
        start (`int`): current start ``l`` (state, saved in checkpoints).
        count (`int`): iterations spent at the current start (state).
        iteration (`int`): iterations advanced so far (state).

    Raises:
        ValueError: (in `__post_init__`) naming the attribute, if a value is out of range.
    """

    num_steps: int
    size: int = 4
    schedule: str = "progressive"
    stride: int = 1
    interval: int = 25
    min_interval: int = 1
    roll_back: bool = True
    exp_k: float = 0.1
    exp_threshold: int = 13
    seed: int = 0
    start: int = 0
    count: int = 0
    iteration: int = 0

    def __post_init__(self):
        if self.schedule not in WINDOW_SCHEDULES:
            raise ValueError(f"SlidingWindow.schedule={self.schedule!r}; expected one of {WINDOW_SCHEDULES}")
        for name, low in (
            ("num_steps", 2),
            ("size", 1),
            ("stride", 0),
            ("interval", 1),
            ("min_interval", 1),
            ("exp_threshold", 0),
            ("start", 0),
            ("count", 0),
            ("iteration", 0),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"SlidingWindow.{name}={value!r} must be an integer >= {low}")
        if self.size > self.last + 1:
            raise ValueError(
                f"SlidingWindow.size={self.size} must be <= {self.last + 1} (the trainable steps 0..N-2 "
                f"of {self.num_steps} steps)"
            )
        if not (math.isfinite(self.exp_k) and self.exp_k >= 0):
            raise ValueError(f"SlidingWindow.exp_k={self.exp_k} must be finite and >= 0")
        if not 0 <= self.start <= self.last:
            raise ValueError(
                f"SlidingWindow.start={self.start} must lie in [0, {self.last}] for {self.num_steps} steps"
            )
        if self.schedule == "random" and self.iteration == 0 and self.count == 0:
            self.start = self._random_start(0)

    @property
    def last(self) -> int:
        """The last trainable step, ``N - 2``."""
        return self.num_steps - 2

    @property
    def steps(self) -> list[int]:
        """The current window's step indices, ``[l, ..., min(l + size - 1, last)]`` (never empty)."""
        return list(range(self.start, min(self.start + self.size - 1, self.last) + 1))

    def current_interval(self) -> int:
        """Iterations the window stays at its current start (tau, or tau(l) for the decaying schedules)."""
        if self.schedule == "decay":
            p = self.start / max(self.last, 1)
            return max(self.min_interval, int(self.interval * (1 - p) + self.min_interval * p))
        if self.schedule == "exp_decay":
            return math.ceil(self.interval * math.exp(-self.exp_k * max(0, self.start - self.exp_threshold)))
        return self.interval

    def _random_start(self, iteration: int) -> int:
        rng = random.Random(self.seed * 1_000_003 + iteration)
        return rng.randint(0, max(self.last - self.size + 1, 0))

    def advance(self) -> None:
        """Move to the next training iteration (call once per iteration, after its rollout)."""
        self.iteration += 1
        if self.schedule == "fixed":
            return
        if self.schedule == "random":
            self.start = self._random_start(self.iteration)
            return
        self.count += 1
        if self.count >= self.current_interval():
            self.count = 0
            self.start += self.stride
            if self.start > self.last:
                self.start = 0 if self.roll_back else self.last

    def state_dict(self) -> dict[str, int]:
        """The mutable state (``start``, ``count``, ``iteration``), JSON-serialisable, for checkpoints."""
        return {"start": self.start, "count": self.count, "iteration": self.iteration}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Restore :meth:`state_dict`'s output.

        Raises:
            KeyError: if a field is missing; ValueError: if the start is outside ``[0, last]``.
        """
        start = int(state["start"])
        if not 0 <= start <= self.last:
            raise ValueError(f"window state start={start} is outside [0, {self.last}] for {self.num_steps} steps")
        self.start, self.count, self.iteration = start, int(state["count"]), int(state["iteration"])


def mix_plan(
    sigmas: torch.Tensor,
    window: list[int],
    kernel: str = "flow_sde",
    noise_level: float = 0.7,
    flash_ratio: float | None = None,
    shift: float = 3.0,
) -> tuple[torch.Tensor, StepPlan]:
    """The MixGRPO rollout for a window: schedule and step plan (arXiv 2507.21802, Sec. 3.2-3.3).

    Without `flash_ratio`: the original schedule, `kernel` on the window, Euler ODE elsewhere. With it
    (MixGRPO-Flash): steps up to the window's end ``l_end`` keep the original schedule; the
    ``R = N - l`` steps after it, with ``l = l_end + 1`` the first step after the window (the ``l`` of
    ``n = max(1, round((N - l) * ratio))`` in the formula), are re-spaced into ``n = max(1, round(R *
    flash_ratio))`` steps solved with DPM-Solver++(2M) (:func:`samplers.kernels.dpm_solver_2m_step`);
    Python's ``round`` rounds halves to even. The published code uses ``max(int((N - l_end) * ratio), 1) - 1``
    steps: at ratio 0.4 and 25 steps one step fewer than here at every window end, at ratio 0.2 up to two
    fewer (window ending at step 1: 3 against 5), and none at all (a partly noisy image) once ``(N - l_end) *
    ratio < 2``, which flowrl's ``max(1, ...)`` avoids.

    Args:
        sigmas (`torch.Tensor` of shape `(N + 1,)`): the base schedule (:func:`samplers.flow_sigmas`).
        window (`list[int]`): the window's steps (:attr:`SlidingWindow.steps`).
        kernel (`str`), noise_level (`float`): the SDE inside the window.
        flash_ratio (`float`, optional): compression ratio in `(0, 1]` (0.4 for Flash, 0.2 for Flash*).
        shift (`float`): the base schedule's time shift.

    Returns:
        ``(sigmas, plan)``: `(N' + 1,)` float32 schedule and an `N'`-step :class:`StepPlan`.

    Raises:
        ValueError: if `flash_ratio` is outside `(0, 1]`, the window is invalid, or (with `flash_ratio`) the
            window reaches the last step ``N - 1`` (nothing is left to re-space).
    """
    num_steps = sigmas.shape[0] - 1
    plan = StepPlan.window(num_steps, window, kernel, noise_level)
    if flash_ratio is None:
        return sigmas, plan
    if not 0 < flash_ratio <= 1:
        raise ValueError(f"flash_ratio must lie in (0, 1]; got {flash_ratio}")
    end = max(window)
    if end >= num_steps - 1:
        raise ValueError(
            f"window {sorted(window)} reaches the last step {num_steps - 1}; MixGRPO-Flash needs at "
            "least one step after the window to re-space"
        )
    tail = max(1, round((num_steps - 1 - end) * flash_ratio))
    keep = end + 1
    return respace_tail(sigmas, keep, tail, shift), StepPlan(
        plan.kernels[:keep] + ["dpm_solver_2m"] * tail,
        plan.noise_levels[:keep] + [0.0] * tail,
        plan.trained[:keep] + [False] * tail,
    )
