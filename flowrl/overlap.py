"""Scoring that overlaps sampling (``sampling.overlap_rewards``): a rollout sampled in chunks, each finished chunk
decoded and scored in a worker thread while the next one samples.

The loop's scorer (:meth:`flowrl.scoring.Scorer.overlapped_rollout`) hands a :class:`ChunkWorker`'s
:meth:`~ChunkWorker.submit` to the method's chunked rollout (:meth:`flowrl.methods.Method.rollout_in_chunks`), then
waits for the worker's results and joins them (:func:`cat_scores`). Only the host's waiting overlaps: a reward on the CPU, on another device
(``options.device``) or behind HTTP (``remote``) runs while the sampler's kernels do; a decode on the sampler's own
GPU shares its stream. Each process of a multi-process run overlaps its own chunks; the gathers that follow are
the same as without overlap.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from collections.abc import Callable

import torch

from .rewards import CombinedScores

__all__ = ["ChunkWorker", "cat_scores", "chunk_images"]


def chunk_images(batch_size: int, group_size: int) -> int:
    """Images per chunk of an overlapped rollout: ``lcm(batch_size, group_size)``, whole sampler forwards (so each
    image's velocity is computed with the same rows as in one batch) of whole groups (a group-wise reward such as
    Pref-GRPO's win rate sees its whole group)."""
    return math.lcm(batch_size, group_size)


def cat_scores(parts: list[CombinedScores]) -> CombinedScores:
    """The scores of consecutive chunks of one batch as the batch's: ``total`` and each ``per_reward`` `(B,)` joined
    in order.

    Raises:
        ValueError: no parts.
    """
    if not parts:
        raise ValueError("cat_scores needs the scores of at least one chunk")
    total = torch.cat([p.total for p in parts])  # (B,)
    return CombinedScores(total, {k: torch.cat([p.per_reward[k] for p in parts]) for k in parts[0].per_reward})


class ChunkWorker:
    """One worker thread that runs ``work(*job)`` under ``torch.no_grad()`` for each submitted job, one at a time in
    the order submitted, while the submitting thread goes on.

    The thread is a daemon: an interrupted or failing caller never waits for it, and it never keeps the process
    alive. Use it as a context manager: leaving the block tells it to stop after its current job.

    Args:
        work: the job, e.g. ``work(latents, image_prompt) -> (images, scores)``; an exception it raises is re-raised,
            unchanged, in the caller by the next :meth:`submit` or by :meth:`results`, and the worker stops.
        device (`torch.device`, optional): the caller's device; on CUDA the worker thread's current device is set to
            the caller's (a new thread starts on device 0).

    Attributes:
        busy_s (`float`): wall seconds the worker spent in jobs so far.
    """

    def __init__(self, work: Callable, device: torch.device | None = None):
        self._work, self._jobs, self._results = work, queue.SimpleQueue(), []
        self._error: BaseException | None = None
        self._stop = threading.Event()
        self._cuda = None
        if device is not None and torch.device(device).type == "cuda":
            device = torch.device(device)
            self._cuda = device.index if device.index is not None else torch.cuda.current_device()
        self.busy_s = 0.0
        self._thread = threading.Thread(target=self._run, name="flowrl-overlap", daemon=True)
        self._thread.start()

    def submit(self, *job) -> None:
        """Queue ``work(*job)``.

        Raises:
            The exception of an earlier job, if one failed (the caller stops early instead of sampling on).
        """
        self._raise()
        self._jobs.put(job)

    def results(self) -> list:
        """Wait for every submitted job; their results in the order submitted.

        Raises:
            The first failed job's exception, as it was raised in the worker.
        """
        self._jobs.put(None)
        self._thread.join()  # interruptible: Ctrl-C raises KeyboardInterrupt here
        self._raise()
        return self._results

    def close(self) -> None:
        """Tell the worker to stop after its current job (and skip the queued ones); does not wait for it."""
        self._stop.set()
        self._jobs.put(None)

    def __enter__(self) -> ChunkWorker:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _raise(self) -> None:
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        if self._cuda is not None:
            torch.cuda.set_device(self._cuda)
        while True:
            job = self._jobs.get()
            if job is None or self._stop.is_set():
                return
            start = time.perf_counter()
            try:
                with torch.no_grad():
                    self._results.append(self._work(*job))
            except BaseException as err:  # handed to the caller, which raises it
                self._error = err
                return
            finally:
                self.busy_s += time.perf_counter() - start
