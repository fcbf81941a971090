"""Typed run configuration: one dataclass per concern, loaded from YAML with ``key=value`` overrides.

OmegaConf structured configs do the parsing and type checks; unknown keys are rejected with the key
named. Checks that span fields live in ``__post_init__``.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from .precision import PRECISIONS

REPO_ROOT = Path(__file__).resolve().parent.parent


class ConfigError(ValueError):
    """A configuration value or key is wrong; the message names the key and what was expected."""


def _check(cond: bool, key: str, expected: str, value: Any) -> None:
    if not cond:
        raise ConfigError(f"config key '{key}' must be {expected}, got {value!r}")


def _precision(value: Any) -> Any:
    """A precision key's value with YAML's reading of a bare ``no`` (false) turned back into ``"no"``."""
    return "no" if value in ("False", "false", "none") else value


@dataclass
class ModelConfig:
    """``model.*``: which pipeline to load and how to train it (LoRA via peft, or the full transformer)."""

    path: str = "assets/tiny-sd3"  # a StableDiffusion3Pipeline or FluxPipeline folder
    max_sequence_length: Optional[int] = None  # T5 tokens (null: 256 with a T5 encoder as SD3.5, 0 without, the tiny model; FLUX 512)
    lora_rank: int = 8  # 0 = full fine-tuning of the transformer
    lora_alpha: float = 16.0
    dtype: str = "float32"  # frozen parts: float32 | bfloat16 | float16
    resolution: Optional[int] = None  # image side in px for rollouts and evaluation (null: the model's default)
    num_frames: Optional[int] = None  # video models: frames per video, 4k+1 for Wan (null: the model's default, 81)
    expert: Optional[str] = None  # two-expert Wan 2.2: the trained one, high | low (null for every other model)
    negative_prompt: str = ""  # video models: the CFG negative prompt ("" as the stock WanPipeline)
    prompt_cache: Optional[str] = None  # a folder of encoded prompts (safetensors); null: encode every time
    text_encoders: str = "keep"  # keep (on the device) | cpu (moved to the device only to encode) | drop_after_cache
    vae_placement: str = "keep"  # keep (on the device) | cpu (moved to the device only to decode or encode)
    options: dict[str, Any] = field(default_factory=dict)  # the family's own settings (its adapter's OPTIONS), e.g.
    # HunyuanVideo {true_cfg_scale: 6.0}, SDXL {guidance_rescale: 0.7}

    def __post_init__(self):
        _check(self.lora_rank >= 0, "model.lora_rank", ">= 0", self.lora_rank)
        _check(self.resolution is None or self.resolution > 0, "model.resolution", "a positive number of pixels or null",
               self.resolution)
        _check(self.lora_alpha > 0, "model.lora_alpha", "> 0 (the LoRA scale is alpha / rank)", self.lora_alpha)
        _check(self.max_sequence_length is None or self.max_sequence_length >= 0, "model.max_sequence_length",
               ">= 0 or null", self.max_sequence_length)
        _check(self.dtype in ("float32", "bfloat16", "float16"), "model.dtype", "float32|bfloat16|float16", self.dtype)
        _check(self.num_frames is None or self.num_frames >= 1, "model.num_frames", ">= 1 or null", self.num_frames)
        _check(self.expert in (None, "high", "low"), "model.expert", "high|low or null", self.expert)
        _check(self.text_encoders in ("keep", "cpu", "drop_after_cache"), "model.text_encoders",
               "keep|cpu|drop_after_cache", self.text_encoders)
        _check(self.text_encoders != "drop_after_cache" or bool(self.prompt_cache), "model.text_encoders",
               "keep or cpu unless model.prompt_cache is set (drop_after_cache encodes every prompt into it first)",
               self.text_encoders)
        _check(self.text_encoders != "drop_after_cache" or self.lora_rank > 0, "model.text_encoders",
               "keep or cpu with full fine-tuning (model.lora_rank=0 saves the whole pipeline, text encoders included)",
               self.text_encoders)
        _check(self.vae_placement in ("keep", "cpu"), "model.vae_placement", "keep|cpu", self.vae_placement)


@dataclass
class WindowConfig:
    """MixGRPO (arXiv 2507.21802): SDE and training on a sliding window of steps, ODE elsewhere."""

    size: int = 0  # steps in the window; 0 = no window (every step SDE, Flow-GRPO / DanceGRPO)
    schedule: str = "progressive"  # progressive | decay | exp_decay | random | fixed (see samplers.windows)
    stride: int = 1  # steps the window moves per shift
    interval: int = 25  # iterations per shift (tau)
    min_interval: int = 1  # the smallest tau of 'decay'
    roll_back: bool = True  # back to step 0 after the last step
    flash_ratio: float = 0.0  # MixGRPO-Flash: > 0 re-spaces the steps after the window (DPM-Solver++ 2M)

    def __post_init__(self):
        from samplers import WINDOW_SCHEDULES

        _check(self.size >= 0, "sampling.window.size", ">= 0", self.size)
        _check(self.schedule in WINDOW_SCHEDULES, "sampling.window.schedule", "|".join(WINDOW_SCHEDULES), self.schedule)
        _check(self.interval >= 1, "sampling.window.interval", ">= 1", self.interval)
        _check(self.stride >= 0, "sampling.window.stride", ">= 0 (0 keeps the window where it starts)", self.stride)
        _check(self.min_interval >= 1, "sampling.window.min_interval", ">= 1", self.min_interval)
        _check(0 <= self.flash_ratio <= 1, "sampling.window.flash_ratio", "in [0, 1]", self.flash_ratio)


@dataclass
class TreeConfig:
    """BranchGRPO (arXiv 2509.06040): tree rollouts that split at chosen steps."""

    split_steps: list[int] = field(default_factory=list)  # empty = no tree (flat groups)
    branch: int = 2  # children per split; group_size must be branch ** len(split_steps)
    sde_steps: list[int] = field(default_factory=list)  # BranchGRPO-Mix: SDE only here and at splits (empty = all)
    fusion: str = "mean"  # leaf-reward fusion into inner nodes: mean | prob
    width_keep: int = 0  # width pruning: train only the chains of the best and worst `width_keep` leaves (0 = off)
    depth_prune: list[int] = field(default_factory=list)  # steps left out of the backward pass
    flash_ratio: float = 0.0  # with sde_steps: > 0 re-spaces the steps after the last SDE step (DPM-Solver++ 2M)

    def __post_init__(self):
        _check(self.branch >= 2, "sampling.tree.branch", ">= 2", self.branch)
        _check(self.fusion in ("mean", "prob"), "sampling.tree.fusion", "mean|prob", self.fusion)
        _check(self.width_keep >= 0, "sampling.tree.width_keep", ">= 0", self.width_keep)
        _check(0 <= self.flash_ratio <= 1, "sampling.tree.flash_ratio", "in [0, 1]", self.flash_ratio)
        _check(len(set(self.split_steps)) == len(self.split_steps), "sampling.tree.split_steps", "distinct steps",
               self.split_steps)


@dataclass
class ProbeConfig:
    """Single-step branching with ODE completion: TempFlow-GRPO, G2RPO, TP-GRPO (see samplers.probes)."""

    method: str = ""  # "" (off) | tempflow | g2rpo | tp_grpo
    steps: list[int] = field(default_factory=list)  # probe steps; empty = every step but the last
    children: int = 4  # tempflow: SDE children per trunk and probe step (g2rpo uses group_size, tp_grpo none)
    granularities: list[int] = field(default_factory=lambda: [1])  # g2rpo: ODE-completion strides
    adv_group: str = "prompt"  # tempflow: normalise over the prompt's branches (prompt) or one trunk's (seed)
    balance: bool = True  # tp_grpo: as many positive as negative turning points (the largest |R_n - R_0| of each)

    def __post_init__(self):
        _check(self.method in ("", "tempflow", "g2rpo", "tp_grpo"), "sampling.probe.method", "''|tempflow|g2rpo|tp_grpo",
               self.method)
        _check(self.children >= 1, "sampling.probe.children", ">= 1", self.children)
        _check(bool(self.granularities) and min(self.granularities) >= 1, "sampling.probe.granularities",
               "a non-empty list of strides >= 1", self.granularities)
        _check(self.adv_group in ("prompt", "seed"), "sampling.probe.adv_group", "prompt|seed", self.adv_group)
        _check(self.method != "tp_grpo" or len(self.granularities) == 1, "sampling.probe.granularities",
               "one stride for tp_grpo (one ODE completion per SDE step)", self.granularities)


@dataclass
class SamplingConfig:
    """``sampling.*``: the rollout: schedule, kernel, guidance, group shape and the rollout shape (flat,
    MixGRPO window, BranchGRPO tree or single-step probes)."""

    num_steps: int = 10  # denoising steps of a training rollout
    guidance_scale: float = 4.5  # classifier-free guidance w (1 = off)
    kernel: str = "flow_sde"  # samplers.KERNELS stochastic kernel: flow_sde | dance_sde | cps | ddim (DDPO's DDIM, eta) | ddpm
    noise_level: float = 0.7  # Flow-GRPO's a (or DanceGRPO's eta)
    shift: float | None = None  # timestep shift of the sigma schedule (None: the model scheduler's, 3 for SD3.5, 1 tiny)
    group_size: int = 8  # G images per prompt
    prompts_per_iteration: int = 8  # per process (accelerate launch: each process draws its own prompts)
    shared_noise: bool = False  # one initial noise per group
    batch_size: int = 64  # images per sampler forward
    decode_precision: str = "auto"  # auto | bf16 | no (float32): VAE decode of the rollout images (reward input only)
    ode_precision: str = "auto"  # auto | bf16 | no (float32): the rollout's deterministic steps, which record no log-prob
    train_last_step: bool = False
    window: WindowConfig = field(default_factory=WindowConfig)
    tree: TreeConfig = field(default_factory=TreeConfig)
    probe: ProbeConfig = field(default_factory=ProbeConfig)

    def __post_init__(self):
        self.decode_precision, self.ode_precision = _precision(self.decode_precision), _precision(self.ode_precision)
        # first: the window, tree and probe checks below are stated in terms of num_steps
        _check(self.num_steps >= 2, "sampling.num_steps", ">= 2", self.num_steps)
        _check(self.decode_precision in PRECISIONS, "sampling.decode_precision", "|".join(PRECISIONS),
               self.decode_precision)
        _check(self.ode_precision in PRECISIONS, "sampling.ode_precision", "|".join(PRECISIONS), self.ode_precision)
        if self.probe.method:
            _check(all(0 <= k < self.num_steps - 1 for k in self.probe.steps), "sampling.probe.steps",
                   f"steps in [0, {self.num_steps - 1})", self.probe.steps)
            _check(not self.tree.split_steps and self.window.size == 0, "sampling.probe.method",
                   "used without sampling.tree / sampling.window", self.probe.method)
        if self.tree.split_steps:
            t = self.tree
            _check(self.group_size == t.branch ** len(t.split_steps), "sampling.group_size",
                   f"branch ** len(split_steps) = {t.branch ** len(t.split_steps)} for a tree", self.group_size)
            for key, steps in (("split_steps", t.split_steps), ("sde_steps", t.sde_steps),
                               ("depth_prune", t.depth_prune)):
                _check(all(0 <= k < self.num_steps for k in steps), f"sampling.tree.{key}",
                       f"steps in [0, {self.num_steps})", steps)
            _check(self.window.size == 0, "sampling.window.size", "0 with a tree (use sampling.tree.sde_steps)",
                   self.window.size)
            if t.flash_ratio > 0:  # the deterministic tail after the last SDE step is what gets re-spaced
                last = max(t.sde_steps + t.split_steps)
                _check(bool(t.sde_steps) and last < self.num_steps - 1, "sampling.tree.flash_ratio",
                       "0 unless sampling.tree.sde_steps leaves deterministic steps after the last SDE step "
                       + (f"(the last SDE step is {last}, the last step {self.num_steps - 1})" if t.sde_steps
                          else "(sde_steps is empty: every step is SDE)"), t.flash_ratio)
        _check(self.window.size < self.num_steps, "sampling.window.size", f"< sampling.num_steps ({self.num_steps})",
               self.window.size)
        _check(self.group_size >= 2, "sampling.group_size", ">= 2 (group-relative advantages)", self.group_size)
        _check(self.guidance_scale >= 1.0, "sampling.guidance_scale", ">= 1", self.guidance_scale)
        _check(self.kernel in ("flow_sde", "dance_sde", "cps", "ddim", "ddpm"), "sampling.kernel",
               "flow_sde|dance_sde|cps|ddim|ddpm", self.kernel)
        _check(self.noise_level > 0, "sampling.noise_level", "> 0", self.noise_level)
        _check(self.kernel not in ("cps", "ddim", "ddpm") or self.noise_level <= 1, "sampling.noise_level",
               f"in (0, 1] for kernel {self.kernel!r} (eta)", self.noise_level)
        _check(not (self.kernel == "cps" and self.train_last_step), "sampling.train_last_step",
               "false with kernel 'cps' (its last step lands on t = 0 with std 0: no log-prob)", self.train_last_step)
        _check(self.shift is None or self.shift > 0, "sampling.shift", "> 0 or null", self.shift)
        _check(self.batch_size >= 1, "sampling.batch_size", ">= 1", self.batch_size)
        _check(self.prompts_per_iteration >= 1, "sampling.prompts_per_iteration", ">= 1", self.prompts_per_iteration)


@dataclass
class RewardConfig:
    """``rewards.NAME.*``: a reward's weight in the weighted sum and the keyword options of its factory."""

    weight: float = 1.0
    options: dict[str, Any] = field(default_factory=dict)  # keyword options of the reward factory


@dataclass
class NFTConfig:
    """``train.nft.*``: DiffusionNFT (arXiv 2509.16117), used when ``train.method`` is ``nft``."""

    beta: float = 1.0  # step of the implicit positive / negative policies (the paper's GenEval setting)
    timesteps: int = 4  # noised copies of each image per iteration, at times of the sampler's grid
    old_decay: float = 0.0  # soft update of the sampling policy, theta_old <- d theta_old + (1 - d) theta (0: it follows theta)
    min_time: float = 0.0  # noised copies only at grid times t >= min_time (1 = noise): weight training towards layout
    guidance_scale: float | None = None  # CFG of the trained velocity (None: sampling.guidance_scale); 1 with guided sampling trains the conditional velocity off-policy
    keep_flat_groups: bool = False  # also train groups without reward variance, at r = 1/2 (the published code's); False drops them
    solver: str = "euler"  # the deterministic rollout sampler: euler | dpm_solver_2m (the published code's, DPM-Solver++ 2M)
    decay_ramp: float = 0.0  # > 0: the soft update's decay is min(decay_ramp * optimizer steps so far, old_decay) (the published code's 0.001)

    def __post_init__(self):
        _check(self.beta > 0, "train.nft.beta", "> 0", self.beta)
        _check(self.timesteps >= 1, "train.nft.timesteps", ">= 1", self.timesteps)
        _check(0 <= self.old_decay < 1, "train.nft.old_decay", "in [0, 1)", self.old_decay)
        _check(0 <= self.min_time < 1, "train.nft.min_time", "in [0, 1)", self.min_time)
        _check(self.guidance_scale is None or self.guidance_scale >= 1, "train.nft.guidance_scale", ">= 1 or null",
               self.guidance_scale)
        _check(self.decay_ramp >= 0, "train.nft.decay_ramp", ">= 0", self.decay_ramp)
        _check(self.solver in ("euler", "dpm_solver_2m"), "train.nft.solver", "euler|dpm_solver_2m", self.solver)


@dataclass
class TrainConfig:
    """``train.*``: the objective (GRPO: advantages, PPO clip, KL, GRPO-Guard options; or DiffusionNFT) and AdamW."""

    method: str = "grpo"  # grpo (SDE rollouts, PPO on log-prob ratios) | nft (ODE samples, DiffusionNFT loss)
    nft: NFTConfig = field(default_factory=NFTConfig)
    learning_rate: float = 3e-4
    adam_betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 1e-4
    max_grad_norm: float = 1.0
    clip_range: float = 1e-4  # PPO eps on the ratio
    adv_clip_max: float = 5.0
    adv_std: str = "global"  # global | group
    kl_beta: float = 0.0  # weight of the KL to the LoRA-disabled base
    inner_epochs: int = 1
    minibatch_size: int = 64  # transitions per optimizer step, per process
    micro_batch_size: Optional[int] = None  # transitions per forward/backward (gradient accumulation); null: the minibatch
    ema_decay: float = 0.0  # 0 = no EMA
    timestep_fraction: float = 1.0  # DanceGRPO: train a random fraction of each sample's trained steps
    ratio_norm: bool = False  # GRPO-Guard RatioNorm of the log-ratio
    step_weighting: str = "none"  # none | guard (GRPO-Guard gradient reweighting) | noise_aware (TempFlow-GRPO)
    kl_type: str = "mean"  # mean (exact KL of the Gaussian steps) | flow_grpo (Flow-GRPO's code: that times |dt|) | velocity (squared velocity difference)
    reward_aggregation: str = "reward"  # several rewards: z-score their weighted sum (reward) | sum their z-scores (advantage)
    best_of_n: int = 0  # train only the best and worst best_of_n / 2 samples of each group (0 = all)
    step_grad_norms: str = "velocity"  # per-step gradient-norm diagnostic: none | velocity (free) | params (1 backward per step)
    gradient_checkpointing: bool = False  # recompute the transformer's activations in backward: less memory, ~1 more forward
    optimizer: str = "adamw"  # adamw (torch) | adamw_8bit (bitsandbytes' 8-bit AdamW: CUDA only, extra 'bnb')

    def __post_init__(self):
        _check(self.method in ("grpo", "nft"), "train.method", "grpo|nft", self.method)
        _check(self.adv_std in ("global", "group"), "train.adv_std", "global|group", self.adv_std)
        _check(self.learning_rate > 0, "train.learning_rate", "> 0", self.learning_rate)
        betas = list(self.adam_betas)
        _check(len(betas) == 2 and all(0 <= b < 1 for b in betas), "train.adam_betas", "two values in [0, 1)", betas)
        _check(self.weight_decay >= 0, "train.weight_decay", ">= 0", self.weight_decay)
        _check(self.max_grad_norm > 0, "train.max_grad_norm", "> 0", self.max_grad_norm)
        _check(self.adv_clip_max > 0, "train.adv_clip_max", "> 0", self.adv_clip_max)
        _check(self.kl_beta >= 0, "train.kl_beta", ">= 0", self.kl_beta)
        _check(self.inner_epochs >= 1, "train.inner_epochs", ">= 1", self.inner_epochs)
        _check(self.clip_range > 0, "train.clip_range", "> 0", self.clip_range)
        _check(0 <= self.ema_decay < 1, "train.ema_decay", "in [0, 1)", self.ema_decay)
        _check(self.minibatch_size >= 1, "train.minibatch_size", ">= 1", self.minibatch_size)
        _check(self.micro_batch_size is None or self.micro_batch_size >= 1, "train.micro_batch_size", ">= 1 or null",
               self.micro_batch_size)
        _check(self.step_weighting in ("none", "guard", "noise_aware"), "train.step_weighting", "none|guard|noise_aware",
               self.step_weighting)
        _check(self.reward_aggregation in ("reward", "advantage"), "train.reward_aggregation", "reward|advantage",
               self.reward_aggregation)
        _check(self.best_of_n == 0 or self.best_of_n >= 2, "train.best_of_n", "0 or >= 2", self.best_of_n)
        _check(self.kl_type in ("mean", "flow_grpo", "velocity"), "train.kl_type", "mean|flow_grpo|velocity",
               self.kl_type)
        _check(self.step_grad_norms in ("none", "velocity", "params"), "train.step_grad_norms", "none|velocity|params",
               self.step_grad_norms)
        _check(0 < self.timestep_fraction <= 1, "train.timestep_fraction", "in (0, 1]", self.timestep_fraction)
        _check(self.optimizer in ("adamw", "adamw_8bit"), "train.optimizer", "adamw|adamw_8bit", self.optimizer)


@dataclass
class EvalConfig:
    """``eval.*``: held-out GenEval-style evaluation with Euler ODE sampling."""

    prompts: str = "test"  # train | test | a .jsonl file
    every: int = 0  # iterations between evaluations (0 = only before and after)
    images_per_tag: int = 64
    num_steps: int = 20  # ODE steps
    guidance_scale: float = 4.5
    seed: int = 1234
    # a second prompt set evaluated before and after training only (e.g. the held-out test prompts when eval.prompts
    # are the trained ones), reported beside eval.prompts' result; null: none
    held_out: Optional[str] = None
    held_out_images_per_tag: int = 32

    def __post_init__(self):
        _check(self.every >= 0, "eval.every", ">= 0 (0 = only before and after training)", self.every)
        _check(self.images_per_tag >= 1, "eval.images_per_tag", ">= 1", self.images_per_tag)
        _check(self.held_out_images_per_tag >= 1, "eval.held_out_images_per_tag", ">= 1", self.held_out_images_per_tag)
        _check(self.num_steps >= 1, "eval.num_steps", ">= 1", self.num_steps)
        _check(self.guidance_scale >= 1.0, "eval.guidance_scale", ">= 1", self.guidance_scale)


@dataclass
class RunConfig:
    """``run.*``: the run folder, length, checkpointing, device and precision."""

    output_dir: str = "runs/tiny_geneval"
    seed: int = 0
    iterations: int = 100
    save_every: int = 10
    keep_checkpoints: Optional[int] = None  # keep only the newest N checkpoints (null: keep all)
    resume: bool = False  # continue from the newest checkpoint in output_dir
    device: str = "auto"  # auto | cpu | cuda
    # auto (bf16 where the device computes it natively, else float32: flowrl.precision) | bf16 (autocast) | no
    # (float32); fp16 would need loss scaling, which flowrl does not do
    mixed_precision: str = "auto"
    log_with: list[str] = field(default_factory=list)  # trackers besides metrics.jsonl: tensorboard | wandb | trackio
    project: str = "flowrl"  # the trackers' project name
    log_images_every: int = 0  # every N iterations, log a few rollout images to the trackers (0 = only the grids)

    def __post_init__(self):
        from .trackers import check_trackers

        self.mixed_precision = _precision(self.mixed_precision)
        try:
            check_trackers(list(self.log_with))
        except ValueError as e:
            raise ConfigError(str(e)) from None
        _check(self.log_images_every >= 0, "run.log_images_every", ">= 0 (0 = only the before/after grids)",
               self.log_images_every)
        _check(self.iterations >= 1, "run.iterations", ">= 1", self.iterations)
        _check(self.save_every >= 1, "run.save_every", ">= 1 (the last iteration is always saved)", self.save_every)
        _check(self.keep_checkpoints is None or self.keep_checkpoints >= 1, "run.keep_checkpoints", ">= 1 or null (keep all)",
               self.keep_checkpoints)
        _check(self.mixed_precision in PRECISIONS, "run.mixed_precision",
               "auto|bf16|no (fp16 needs loss scaling, which flowrl does not do)", self.mixed_precision)
        _check(self.device in ("auto", "cpu", "cuda"), "run.device", "auto|cpu|cuda", self.device)


@dataclass
class Config:
    """The whole run: ``model``, ``sampling``, ``rewards``, ``train``, ``eval``, ``run`` and the prompt
    sets. Built by :func:`load_config`; every field is validated when it is built (``ConfigError`` names
    the key)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    # name or 'pkg.module:fn' -> weight, options; {} = geneval; null drops a reward inherited from a base preset
    rewards: dict[str, Optional[RewardConfig]] = field(default_factory=dict)
    train_prompts: str = "train"  # train | test | a .jsonl file
    tag_balanced: bool = True  # sample a tag uniformly, then a prompt of that tag
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    run: RunConfig = field(default_factory=RunConfig)

    def __post_init__(self):
        self.rewards = {name: r for name, r in self.rewards.items() if r is not None}
        if not self.rewards:  # a default in the schema would be merged into, not replaced by, a preset's rewards
            self.rewards = {"geneval": RewardConfig()}
        _check(self.train.kl_beta == 0 or self.model.lora_rank > 0, "train.kl_beta",
               "0 unless model.lora_rank > 0 (the KL reference is the LoRA-disabled base)", self.train.kl_beta)
        if self.train.method == "nft":  # DiffusionNFT samples plain ODE groups: no rollout shape, no log-probs
            s = self.sampling
            for key, value, off in (("sampling.window.size", s.window.size, 0), ("sampling.tree.split_steps",
                                    s.tree.split_steps, []), ("sampling.probe.method", s.probe.method, ""),
                                    ("sampling.shared_noise", s.shared_noise, False),
                                    ("train.kl_beta", self.train.kl_beta, 0.0)):
                _check(value == off, key, f"{off!r} with train.method 'nft' (it trains on final samples)", value)
            _check(not (self.train.nft.keep_flat_groups and self.train.best_of_n), "train.nft.keep_flat_groups",
                   "false with train.best_of_n (which drops samples)", self.train.nft.keep_flat_groups)


def _load_yaml(path: Path, chain: tuple[Path, ...] = ()):
    """A YAML preset with its ``base:`` chain merged underneath (a base path is relative to the file)."""
    path = path.resolve()
    if path in chain:
        raise ConfigError(f"config key 'base' of {path} makes a cycle: {' -> '.join(str(c) for c in chain + (path,))}")
    if not path.is_file():
        raise FileNotFoundError(f"config file {path} does not exist" + (f" (the 'base' of {chain[-1]})" if chain else ""))
    try:
        cfg = OmegaConf.load(path)
    except yaml.YAMLError as e:  # a syntax error: name the file and the line, in one line
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise ConfigError(f"config file {path} is not valid YAML{where}: {getattr(e, 'problem', None) or e}") from None
    if not isinstance(cfg, DictConfig):
        raise ConfigError(f"config file {path} must hold a mapping of keys (model:, sampling:, train:, ...), "
                          f"got a {type(cfg).__name__.removesuffix('Config').lower()}")
    base = cfg.pop("base", None)
    if base is None:
        return cfg
    return OmegaConf.merge(_load_yaml(path.parent / str(base), chain + (path,)), cfg)


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> Config:
    """Load a YAML preset, apply ``key=value`` overrides and validate.

    A preset may name another preset as ``base: other.yaml`` (relative to its own folder): it is loaded
    first and the preset's keys override it (``rewards`` entries are merged, not replaced).

    Args:
        path: a YAML file (``configs/*.yaml``) or None for the defaults.
        overrides: dot-list strings like ``train.learning_rate=1e-4``.

    Returns:
        A validated :class:`Config`.

    Raises:
        FileNotFoundError: if ``path`` does not exist.
        ConfigError: for an unknown key, a value of the wrong type or out of range (the key is named), or a
            preset that is not valid YAML or not a mapping (the file and line are named).
    """
    schema = OmegaConf.structured(Config)
    try:
        parts = [schema]
        if path is not None:
            if not Path(path).is_file():
                raise FileNotFoundError(f"config file {path} does not exist")
            parts.append(_load_yaml(Path(path)))
        for item in overrides:
            if "=" not in item:
                raise ConfigError(f"override {item!r} must look like key=value")
        parts.append(OmegaConf.from_dotlist(list(overrides)))
        merged = OmegaConf.merge(*parts)
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None)
        msg = str(e).splitlines()[0]
        raise ConfigError(f"config key '{key}': {msg}" if key else f"config: {msg}") from None


def save_config(config: Config, path: str | Path) -> None:
    """Write the resolved config as YAML (reloadable with :func:`load_config`), through a temporary file and a
    rename."""
    from .files import write_text_atomic

    write_text_atomic(path, OmegaConf.to_yaml(OmegaConf.structured(config)))


def resolve_path(path: str | Path) -> Path:
    """A path as given if it exists, else relative to the repository root (for ``assets/...``)."""
    path = Path(path)
    return path if path.exists() or path.is_absolute() else REPO_ROOT / path


def preset_parser(description: str, default: str = "configs/tiny_geneval.yaml"):
    """An ``argparse.ArgumentParser`` for scripts that take ``[CONFIG.yaml] [key=value ...]`` plus options.

    Parse with :func:`parse_preset_args`, which sets ``args.config`` (``default`` when the first positional
    is not a ``.yaml``/``.yml`` file) and ``args.overrides`` (the other positionals).
    """
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("args", nargs="*", metavar="[CONFIG] key=value",
                        help=f"a .yaml preset (default {default}), then overrides of it")
    parser.add_argument("--out", default="", help="also write the result as JSON here")
    parser.set_defaults(default_config=default)
    return parser


def parse_preset_args(parser, argv: list[str] | None = None):
    """Parse ``argv`` with a :func:`preset_parser` (options may come between the overrides)."""
    args = parser.parse_intermixed_args(argv)
    given = args.args[:1] if args.args and args.args[0].endswith((".yaml", ".yml")) else []
    args.config, args.overrides = (given or [args.default_config])[0], args.args[len(given):]
    return args


def finish_preset_result(args, result: dict) -> dict:
    """Add ``config`` and ``overrides`` to a script's ``result``; write it as JSON to ``args.out`` if given."""
    result = {**result, "config": args.config, "overrides": args.overrides}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return result
