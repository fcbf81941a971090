"""The training prompts: the records a config key names, and the draw of each iteration's prompts from them."""

from __future__ import annotations

import random
from collections import defaultdict

from .config import config_key
from .data import read_prompts

__all__ = ["PromptSampler", "read_prompt_records"]


def iteration_seed(seed: int, iteration: int, process: int) -> int:
    """The seed of iteration `iteration`'s generator on process `process` for ``run.seed`` `seed` (any in
    ``[0, 2^63)``): ``seed * 1000003 + iteration * 1009 + process`` modulo ``2^64``, the range ``torch.Generator``
    takes (below ``2^64``, every seed of a run that fitted before gets the same draws)."""
    return (seed * 1_000_003 + iteration * 1009 + process) % 2**64


def read_run_prompts(cfg, require_image: bool = False) -> tuple[list[dict], list[dict], list[dict]]:
    """The run's prompt records (a :class:`flowrl.config.Config`'s): ``train_prompts``, ``eval.prompts`` and
    ``eval.held_out`` (empty where unset), each as :func:`read_prompt_records` reads it."""
    held_out = read_prompt_records("eval.held_out", cfg.eval.held_out, require_image) if cfg.eval.held_out else []
    return (
        read_prompt_records("train_prompts", cfg.train_prompts, require_image),
        read_prompt_records("eval.prompts", cfg.eval.prompts, require_image),
        held_out,
    )


def read_prompt_records(key: str, name: str, require_image: bool = False) -> list[dict]:
    """The prompt records of config key `key` (a shipped set's name or a JSONL file: :func:`flowrl.data.read_prompts`),
    each naming its source ``image`` where `require_image` (an image-to-video model).

    Raises:
        FileNotFoundError: a missing file. ConfigError: naming `key`, for a malformed line, a record without its
            ``image`` where `require_image`, or no prompt.
    """
    with config_key(key):
        return read_prompts(name, require_image)


class PromptSampler:
    """Draws each iteration's prompt records, with replacement, deterministic in the seed, the iteration and the
    process (a resumed run draws the prompts it would have drawn; each process draws its own).

    Args:
        metas (`list[dict]`): the training prompt records (each with ``prompt``, optionally ``tag``), at least one.
        cfg (:class:`flowrl.config.Config`): ``sampling.prompts_per_iteration`` (records per draw), ``tag_balanced``
            (draw a tag uniformly, then a prompt of it; else a prompt uniformly) and ``run.seed``.
        process_index (`int`): this process's index.
    """

    def __init__(self, metas: list[dict], cfg, process_index: int = 0):
        self.metas, self.cfg, self.process_index = metas, cfg, process_index

    def __call__(self, iteration: int) -> list[dict]:
        """The ``sampling.prompts_per_iteration`` prompt records of `iteration` (records of `metas`, not copies)."""
        rng = random.Random(self.cfg.run.seed * 7919 + iteration * 104729 + self.process_index)
        n = self.cfg.sampling.prompts_per_iteration
        if not self.cfg.tag_balanced:
            return [rng.choice(self.metas) for _ in range(n)]
        by_tag = defaultdict(list)
        for m in self.metas:
            by_tag[m.get("tag", "all")].append(m)
        tags = sorted(by_tag)
        return [rng.choice(by_tag[rng.choice(tags)]) for _ in range(n)]
