"""Rewards: plain callables `reward(images, prompts, metadata) -> scores`.

`images` is a `(B, 3, H, W)` float tensor in `[0, 1]`, `prompts` a list of `B` strings, `metadata` a
list of `B` GenEval-style dicts (possibly empty); `scores` is a `(B,)` float32 CPU tensor, higher is
better. See `rewards.base.Reward` for the full contract.

Importable on its own: this package never imports `flowrl` or `samplers`. Build a registered reward
with `build_reward("clipscore", model_path=...)`, or a user's own with
`build_reward("my_pkg.my_module:my_reward")`.
"""

from .base import (
    REWARDS,
    CombinedScores,
    Reward,
    RewardError,
    RewardTypeError,
    WeightedSum,
    build_reward,
    check_inputs,
    check_scores,
    register_reward,
    reward_name,
)
from .clipscore import ClipScore, clipscore
from .jpeg import jpeg_compressibility, jpeg_incompressibility, jpeg_size_kb

from .geneval import geneval, geneval_strict
from .pairwise import PrefWinRate, VLMJudge, bradley_terry_judge, pref_winrate, win_rates

__all__ = [
    "REWARDS",
    "ClipScore",
    "PrefWinRate",
    "VLMJudge",
    "CombinedScores",
    "Reward",
    "RewardError",
    "RewardTypeError",
    "WeightedSum",
    "bradley_terry_judge",
    "build_reward",
    "check_inputs",
    "check_scores",
    "clipscore",
    "geneval",
    "geneval_strict",
    "jpeg_compressibility",
    "jpeg_incompressibility",
    "jpeg_size_kb",
    "register_reward",
    "pref_winrate",
    "reward_name",
    "win_rates",
]
