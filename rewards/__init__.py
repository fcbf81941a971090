"""Rewards: plain callables `reward(images, prompts, metadata) -> scores`.

`images` is a `(B, 3, H, W)` float tensor in `[0, 1]`, `prompts` a list of `B` strings, `metadata` a
list of `B` GenEval-style dicts (possibly empty); `scores` is a `(B,)` float32 CPU tensor, higher is
better. See `rewards.base.Reward` for the full contract.

The repository's top-level `rewards/` folder, installed as `flowrl.rewards`: one of the two leaves every other layer
builds on, importable on its own; it imports nothing else of flowrl (not the samplers). Build a registered reward
with `build_reward("clipscore", model_path=...)`, or a user's own with
`build_reward("my_pkg.my_module:my_reward")`, or one an installed package declares under the `flowrl.rewards`
entry-point group by its name. `check_options` checks a built-in reward's options without importing torch (the CLI runs
it before the rewards import). `serve` and the `remote` reward run a reward in another process over HTTP.
"""

from .aesthetic import AestheticScore, aesthetic
from .base import (
    REWARDS,
    CombinedScores,
    Reward,
    RewardError,
    RewardTypeError,
    WeightedSum,
    accepts_video,
    build_reward,
    check_inputs,
    check_scores,
    register_reward,
    reward_name,
    reward_spec,
)
from .clipscore import ClipScore, clipscore
from .geneval import geneval, geneval_strict
from .hps import HPSv2, hpsv2
from .hpsv3 import HPSv3, hpsv3
from .imagereward import ImageReward, imagereward
from .jpeg import jpeg_compressibility, jpeg_incompressibility, jpeg_size_kb
from .motion_world import MotionWorld, motion_world, motion_world_direction, motion_world_strict
from .mps import MPS, mps
from .ocr import OcrReward, ocr
from .options import check_options, factory_options
from .pairwise import PrefWinRate, VLMJudge, bradley_terry_judge, pref_winrate, win_rates
from .pickscore import PickScore, pickscore
from .server import RemoteReward, RewardServer, remote, serve
from .video import ClipTemporal, Frames, Motion, clip_temporal, frames, motion
from .videoalign import VideoAlign, videoalign
from .vlm import VLMScore, VLMYes, VLMYesLocal, unifiedreward, vlm_yes
from .vqascore import VQAScore, vqascore

__all__ = [
    "REWARDS",
    "RemoteReward",
    "RewardServer",
    "VLMScore",
    "VLMYes",
    "VLMYesLocal",
    "VQAScore",
    "remote",
    "serve",
    "unifiedreward",
    "vlm_yes",
    "vqascore",
    "ClipScore",
    "PickScore",
    "pickscore",
    "HPSv2",
    "hpsv2",
    "MPS",
    "mps",
    "HPSv3",
    "hpsv3",
    "AestheticScore",
    "aesthetic",
    "PrefWinRate",
    "VLMJudge",
    "CombinedScores",
    "Reward",
    "RewardError",
    "RewardTypeError",
    "WeightedSum",
    "ClipTemporal",
    "Frames",
    "Motion",
    "VideoAlign",
    "accepts_video",
    "bradley_terry_judge",
    "clip_temporal",
    "frames",
    "motion",
    "videoalign",
    "MotionWorld",
    "motion_world",
    "motion_world_direction",
    "motion_world_strict",
    "build_reward",
    "check_inputs",
    "check_options",
    "check_scores",
    "clipscore",
    "geneval",
    "factory_options",
    "geneval_strict",
    "jpeg_compressibility",
    "jpeg_incompressibility",
    "jpeg_size_kb",
    "ImageReward",
    "OcrReward",
    "imagereward",
    "ocr",
    "register_reward",
    "pref_winrate",
    "reward_name",
    "reward_spec",
    "win_rates",
]
