"""Typed run configuration: one dataclass per concern, loaded from YAML with ``key=value`` overrides.

OmegaConf structured configs do the parsing and type checks; unknown keys are rejected with the key
named. Checks that span fields live in ``__post_init__``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from .fields import SECTIONS, ConfigError, config_key, setting
from .fields import check as _check
from .fields import precision_value as _precision
from .files import REPO_ROOT, resolve_path
from .methods import METHODS, SHAPES, NFTConfig
from .methods.shapes import ProbeConfig, TreeConfig, WindowConfig
from .precision import PRECISIONS
from .samplers import KERNEL_SPECS, STOCHASTIC_KERNELS, UNIT_ETA_KERNELS

__all__ = [
    "REPO_ROOT",
    "Config",
    "ConfigError",
    "EvalConfig",
    "ModelConfig",
    "NFTConfig",
    "ProbeConfig",
    "RewardConfig",
    "RunConfig",
    "SamplingConfig",
    "TrainConfig",
    "TreeConfig",
    "WindowConfig",
    "config_key",
    "load_config",
    "preset_name",
    "resolve_config",
    "resolve_path",
    "save_config",
]


def _choices(summaries: dict[str, str]) -> str:
    """A registry's names for a help text, each with its summary: ``"grpo (SDE rollouts, ...) | flow_dppo (...)"``."""
    return " | ".join(f"{name} ({summary})" if summary else name for name, summary in summaries.items())


def _sampling_kernels() -> str:
    return "|".join(STOCHASTIC_KERNELS)


def _schedule_ends_above_zero(model_path: str) -> bool | None:
    """Whether the sampling grid of the model at `model_path` ends above ``t = 0``, read from its scheduler config: a
    DDPM scheduler with ``set_alpha_to_one: false`` ends at ``alphas_cumprod[0]`` (SD 1.5's ``sigma_N = 0.029``),
    every other schedule (the flow-matching ones, DDIM with alpha one) at ``t = 0``. None where the folder has no
    readable scheduler config (a model path that does not exist yet: loading it fails before any rollout)."""
    try:
        scheduler = json.loads((resolve_path(model_path) / "scheduler" / "scheduler_config.json").read_text())
    except (OSError, ValueError):
        return None
    return isinstance(scheduler, dict) and scheduler.get("set_alpha_to_one", True) is False


@dataclass
class ModelConfig:
    """``model.*``: which pipeline to load and how to train it (LoRA via peft, or the full transformer)."""

    path: str = setting(
        "assets/tiny-sd3",
        "a diffusers pipeline folder; the family is picked from its model_index.json (docs/models.md)",
    )
    max_sequence_length: Optional[int] = setting(
        None, "T5 tokens (null: 256 with a T5 encoder as SD3.5, 0 without, the tiny model; FLUX 512)"
    )
    lora_rank: int = setting(8, "LoRA rank of the trained network; 0 = full fine-tuning")
    lora_alpha: float = setting(16.0, "LoRA alpha (the LoRA scale is alpha / rank)")
    dtype: str = setting(
        "float32", "the frozen parts' dtype: float32 | bfloat16 | float16 (the trained network is float32 on a CPU)"
    )
    resolution: Optional[int] = setting(
        None,
        "image side in px for rollouts and evaluation (null: the model's own; a flowrl-built folder's trained size "
        "from its build.json, 32 for assets/tiny-wan)",
    )
    num_frames: Optional[int] = setting(
        None, "video models: frames per video, 4k+1 for Wan (null: the model's, 81; 9 for assets/tiny-wan)"
    )
    expert: Optional[str] = setting(
        None, "two-expert Wan 2.2: the trained one, high | low (null for every other model)"
    )
    negative_prompt: str = setting("", 'video models: the CFG negative prompt ("" as the stock WanPipeline)')
    prompt_cache: Optional[str] = setting(None, "a folder of encoded prompts (safetensors); null: encode every time")
    text_encoders: str = setting(
        "keep",
        "keep (on the device) | cpu (moved to the device only to encode) | "
        "drop_after_cache (freed once every prompt is in model.prompt_cache)",
    )
    vae_placement: str = setting("keep", "keep (on the device) | cpu (moved to the device only to decode or encode)")
    options: dict[str, Any] = setting(
        factory=dict,
        help="the family's own settings (its adapter's OPTIONS), e.g. "
        "HunyuanVideo {true_cfg_scale: 6.0}, SDXL "
        "{guidance_rescale: 0.7}",
    )

    def __post_init__(self):
        _check(self.lora_rank >= 0, "model.lora_rank", ">= 0", self.lora_rank)
        _check(
            self.resolution is None or self.resolution > 0,
            "model.resolution",
            "a positive number of pixels or null",
            self.resolution,
        )
        _check(self.lora_alpha > 0, "model.lora_alpha", "> 0 (the LoRA scale is alpha / rank)", self.lora_alpha)
        _check(
            self.max_sequence_length is None or self.max_sequence_length >= 0,
            "model.max_sequence_length",
            ">= 0 or null",
            self.max_sequence_length,
        )
        _check(self.dtype in ("float32", "bfloat16", "float16"), "model.dtype", "float32|bfloat16|float16", self.dtype)
        _check(self.num_frames is None or self.num_frames >= 1, "model.num_frames", ">= 1 or null", self.num_frames)
        _check(self.expert in (None, "high", "low"), "model.expert", "high|low or null", self.expert)
        _check(
            self.text_encoders in ("keep", "cpu", "drop_after_cache"),
            "model.text_encoders",
            "keep|cpu|drop_after_cache",
            self.text_encoders,
        )
        _check(
            self.text_encoders != "drop_after_cache" or bool(self.prompt_cache),
            "model.text_encoders",
            "keep or cpu unless model.prompt_cache is set (drop_after_cache encodes every prompt into it first)",
            self.text_encoders,
        )
        _check(
            self.text_encoders != "drop_after_cache" or self.lora_rank > 0,
            "model.text_encoders",
            "keep or cpu with full fine-tuning (model.lora_rank=0 saves the whole pipeline, text encoders included)",
            self.text_encoders,
        )
        _check(self.vae_placement in ("keep", "cpu"), "model.vae_placement", "keep|cpu", self.vae_placement)


def with_sections(base: type, parent: str) -> type:
    """The config dataclass of ``PARENT.*``: `base`'s own fields, then one field per settings section registered under
    `parent` (:data:`flowrl.fields.SECTIONS`: a method's ``train.nft``, a rollout shape's ``sampling.window``), so that a
    method or a shape brings its settings from its own file. `base`'s checks (``__post_init__``) run on the whole."""
    fields = [(name, cls, setting(factory=cls, help=help)) for name, (cls, help) in SECTIONS[parent].items()]
    whole = dataclasses.make_dataclass(base.__name__.strip("_").replace("Settings", "Config"), fields, bases=(base,))
    whole.__module__, whole.__doc__ = __name__, base.__doc__
    return whole


@dataclass
class _SamplingSettings:
    """``sampling.*``: the rollout: schedule, kernel, guidance, group shape and the rollout shape (flat groups with
    an optional MixGRPO window, a BranchGRPO tree or single-step probes: :mod:`flowrl.methods.shapes`)."""

    num_steps: int = setting(10, "denoising steps of a training rollout")
    guidance_scale: float = setting(4.5, "classifier-free guidance scale w (1 = off)")
    kernel: str = setting(
        "flow_sde",
        "the stochastic transition kernel (flowrl.samplers.KERNEL_SPECS): "
        + _choices({name: KERNEL_SPECS[name].summary for name in STOCHASTIC_KERNELS}),
    )
    noise_level: float = setting(
        0.7, f"Flow-GRPO's noise level a (DanceGRPO's eta; an eta in (0, 1] for {', '.join(UNIT_ETA_KERNELS)})"
    )
    shift: Optional[float] = setting(
        None, "time shift of the sigma schedule (null: the model scheduler's, 3 for SD3.5, 1 for the tiny model)"
    )
    group_size: int = setting(8, "G images per prompt (a group)")
    prompts_per_iteration: int = setting(8, "prompts per iteration and process (each process draws its own)")
    shared_noise: bool = setting(False, "one initial noise per group")
    batch_size: int = setting(64, "images per sampler forward")
    overlap_rewards: bool = setting(
        False,
        "sample the rollout in chunks of lcm(batch_size, group_size) images and decode and score each finished chunk "
        "in a worker thread while the next one samples (same results as false; flat groups without shared_noise, "
        "or a forward-process method)",
    )
    decode_precision: str = setting(
        "auto",
        "auto | bf16 | no (float32): VAE decode of the rollout images (reward "
        "input only); auto = bf16 where the device has it natively",
    )
    ode_precision: str = setting(
        "auto", "auto | bf16 | no (float32): the rollout's deterministic steps, which record no log-prob"
    )
    train_last_step: bool = setting(False, "also train the step onto t = 0")
    shape: str = setting(
        "flat",
        "the rollout shape (flowrl.methods.shapes.SHAPES): "
        + _choices({name: shape.summary for name, shape in SHAPES.items()}),
    )

    def __post_init__(self):
        self.decode_precision, self.ode_precision = _precision(self.decode_precision), _precision(self.ode_precision)
        _check(self.num_steps >= 2, "sampling.num_steps", ">= 2", self.num_steps)
        _check(
            self.decode_precision in PRECISIONS,
            "sampling.decode_precision",
            "|".join(PRECISIONS),
            self.decode_precision,
        )
        _check(self.ode_precision in PRECISIONS, "sampling.ode_precision", "|".join(PRECISIONS), self.ode_precision)
        _check(self.shape in SHAPES, "sampling.shape", "|".join(SHAPES), self.shape)
        _check(
            self.shape == "tree" or not self.tree.split_steps,
            "sampling.tree.split_steps",
            "empty unless sampling.shape is 'tree'",
            self.tree.split_steps,
        )
        _check(self.group_size >= 2, "sampling.group_size", ">= 2 (group-relative advantages)", self.group_size)
        _check(1.0 <= self.guidance_scale <= 100.0, "sampling.guidance_scale", "in [1, 100]", self.guidance_scale)
        _check(
            self.kernel in STOCHASTIC_KERNELS,
            "sampling.kernel",
            f"a stochastic kernel of flowrl.samplers.KERNEL_SPECS: {_sampling_kernels()}",
            self.kernel,
        )
        _check(self.noise_level > 0, "sampling.noise_level", "> 0", self.noise_level)
        _check(
            self.kernel not in UNIT_ETA_KERNELS or self.noise_level <= 1,
            "sampling.noise_level",
            f"in (0, 1] for kernel {self.kernel!r} (eta)",
            self.noise_level,
        )
        _check(self.shift is None or self.shift > 0, "sampling.shift", "> 0 or null", self.shift)
        _check(self.batch_size >= 1, "sampling.batch_size", ">= 1", self.batch_size)
        _check(self.prompts_per_iteration >= 1, "sampling.prompts_per_iteration", ">= 1", self.prompts_per_iteration)


SamplingConfig = with_sections(_SamplingSettings, "sampling")


@dataclass
class RewardConfig:
    """``rewards.NAME.*``: a reward's weight in the weighted sum and the keyword options of its factory."""

    weight: float = setting(1.0, "the reward's weight in the weighted sum")
    options: dict[str, Any] = setting(
        factory=dict, help="keyword options of the reward's factory (flowrl rewards lists the rewards)"
    )
    spec: Optional[str] = setting(
        None,
        "what builds the reward, where NAME is not itself a reward: package.module:function or FILE.py:function "
        "(default: NAME); Trainer(rewards=...) records here the import path of a callable that has one",
    )


@dataclass
class _TrainSettings:
    """``train.*``: the objective (GRPO: advantages, PPO clip, KL, GRPO-Guard options; or DiffusionNFT) and AdamW."""

    method: str = setting(
        "grpo",
        "the method (flowrl.methods.METHODS): " + _choices({name: m.summary for name, m in METHODS.items()}),
    )
    learning_rate: float = setting(3e-4, "AdamW learning rate")
    adam_betas: tuple[float, float] = setting((0.9, 0.999), "AdamW betas")
    weight_decay: float = setting(1e-4, "AdamW weight decay")
    max_grad_norm: float = setting(1.0, "gradient clipping norm")
    clip_range: float = setting(1e-4, "PPO clip range eps on the ratio")
    adv_clip_max: float = setting(5.0, "advantages clipped to +-adv_clip_max")
    adv_std: str = setting(
        "global",
        "z-score advantages by the std of the whole gathered batch (global, Flow-GRPO) or of each group (group)",
    )
    kl_beta: float = setting(0.0, "weight of the KL to the LoRA-disabled base")
    inner_epochs: int = setting(1, "passes over an iteration's transitions")
    minibatch_size: int = setting(64, "transitions (or noised rows) per optimizer step, per process")
    micro_batch_size: Optional[int] = setting(
        None, "transitions per forward/backward (gradient accumulation); null: the minibatch"
    )
    ema_decay: float = setting(0.0, "EMA of the trained weights for evaluation and export (0 = none)")
    timestep_fraction: float = setting(1.0, "DanceGRPO: train a random fraction of each sample's trained steps")
    ratio_norm: bool = setting(False, "GRPO-Guard's RatioNorm of the log-ratio")
    step_weighting: str = setting(
        "none", "none | guard (GRPO-Guard gradient reweighting) | noise_aware (TempFlow-GRPO)"
    )
    kl_type: str = setting(
        "mean",
        "mean (exact KL of the Gaussian steps) | flow_grpo (Flow-GRPO's code: that times "
        "|dt|) | velocity (squared velocity difference)",
    )
    reward_aggregation: str = setting(
        "reward",
        "several rewards: z-score their weighted sum (reward) | sum their z-scores (advantage, MixGRPO) | z-score each "
        "in its group, sum, normalise over the batch (gdpo, Flow-Factory's GDPO)",
    )
    best_of_n: int = setting(0, "train only the best and worst best_of_n / 2 samples of each group (0 = all)")
    step_grad_norms: str = setting(
        "velocity", "per-step gradient-norm diagnostic: none | velocity (free) | params (one backward per step)"
    )
    gradient_checkpointing: bool = setting(
        False, "recompute the network's activations in backward: less memory, about one more forward"
    )
    optimizer: str = setting("adamw", "adamw (torch) | adamw_8bit (bitsandbytes' 8-bit AdamW: CUDA only, extra 'bnb')")

    def __post_init__(self):
        _check(self.method in METHODS, "train.method", "|".join(METHODS), self.method)
        _check(self.adv_std in ("global", "group"), "train.adv_std", "global|group", self.adv_std)
        _check(0 < self.learning_rate <= 1, "train.learning_rate", "in (0, 1]", self.learning_rate)
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
        _check(
            self.micro_batch_size is None or self.micro_batch_size >= 1,
            "train.micro_batch_size",
            ">= 1 or null",
            self.micro_batch_size,
        )
        _check(
            self.step_weighting in ("none", "guard", "noise_aware"),
            "train.step_weighting",
            "none|guard|noise_aware",
            self.step_weighting,
        )
        _check(
            self.reward_aggregation in ("reward", "advantage", "gdpo"),
            "train.reward_aggregation",
            "reward|advantage|gdpo",
            self.reward_aggregation,
        )
        _check(self.best_of_n == 0 or self.best_of_n >= 2, "train.best_of_n", "0 or >= 2", self.best_of_n)
        _check(
            self.kl_type in ("mean", "flow_grpo", "velocity"), "train.kl_type", "mean|flow_grpo|velocity", self.kl_type
        )
        _check(
            self.step_grad_norms in ("none", "velocity", "params"),
            "train.step_grad_norms",
            "none|velocity|params",
            self.step_grad_norms,
        )
        _check(0 < self.timestep_fraction <= 1, "train.timestep_fraction", "in (0, 1]", self.timestep_fraction)
        _check(self.optimizer in ("adamw", "adamw_8bit"), "train.optimizer", "adamw|adamw_8bit", self.optimizer)


TrainConfig = with_sections(_TrainSettings, "train")


@dataclass
class EvalConfig:
    """``eval.*``: GenEval-style evaluation (or reward means) with Euler ODE sampling, before and after training."""

    prompts: str = setting("test", "train | test | a .jsonl file of prompt records")
    every: int = setting(0, "iterations between evaluations during training (0 = only before and after)")
    images_per_tag: int = setting(
        64,
        "images per prompt tag, each tag's prompts taken in turn with new seeds (every prompt file: GenEval metadata "
        "or not; records without a tag are one tag); 0: each prompt once",
    )
    num_steps: int = setting(20, "Euler ODE steps")
    guidance_scale: float = setting(4.5, "classifier-free guidance scale")
    seed: int = setting(1234, "seed of the evaluation's noise (the same images before and after)")
    held_out: Optional[str] = setting(
        None,
        "a second prompt set evaluated before and after training only (e.g. the "
        "held-out test prompts when eval.prompts are the trained ones), "
        "printed beside; null: none",
    )
    held_out_images_per_tag: int = setting(32, "images per tag of eval.held_out, as eval.images_per_tag")

    def __post_init__(self):
        _check(self.every >= 0, "eval.every", ">= 0 (0 = only before and after training)", self.every)
        _check(self.images_per_tag >= 0, "eval.images_per_tag", ">= 0 (0: each prompt once)", self.images_per_tag)
        _check(
            self.held_out_images_per_tag >= 0,
            "eval.held_out_images_per_tag",
            ">= 0 (0: each prompt once)",
            self.held_out_images_per_tag,
        )
        _check(self.num_steps >= 1, "eval.num_steps", ">= 1", self.num_steps)
        _check(1.0 <= self.guidance_scale <= 100.0, "eval.guidance_scale", "in [1, 100]", self.guidance_scale)
        _check(0 <= self.seed < 2**63, "eval.seed", "in [0, 2^63)", self.seed)


@dataclass
class RunConfig:
    """``run.*``: the run folder, length, checkpointing, device and precision."""

    output_dir: str = setting("runs/tiny_geneval", "the run folder (config, metrics, checkpoints, plots, LoRA)")
    seed: int = setting(0, "seed of every random draw (prompts, noise, minibatch order, the LoRA init)")
    iterations: int = setting(100, "training iterations")
    save_every: int = setting(10, "iterations between checkpoints (the last is always saved)")
    keep_checkpoints: Optional[int] = setting(None, "keep only the newest N checkpoints (null: keep all)")
    resume: bool = setting(False, "continue from the newest verified checkpoint in output_dir")
    device: str = setting("auto", "auto | cpu | cuda")
    mixed_precision: str = setting(
        "auto",
        "auto (bf16 where the device computes it natively, else float32) | bf16 "
        "(autocast) | no (float32); log-probs are float32 always",
    )
    log_with: list[str] = setting(factory=list, help="trackers besides metrics.jsonl: tensorboard | wandb | trackio")
    project: str = setting("flowrl", "the trackers' project name")
    diversity_model: Optional[str] = setting(
        "auto",
        "CLIP folder whose image embeddings give diversity/clip each iteration (auto: the shipped assets/tiny-clip "
        "where it exists; '' or null: off)",
    )
    stop_if: list[str] = setting(
        factory=list,
        help="rules 'METRIC OP VALUE [for N]' (e.g. 'diversity/clip < 0.05 for 3') that end the run cleanly",
    )
    log_images_every: int = setting(
        0, "every N iterations, log a few rollout images to the trackers (0 = only the before/after grids)"
    )

    def __post_init__(self):
        from .trackers import check_trackers

        self.mixed_precision = _precision(self.mixed_precision)
        with config_key("run.log_with"):
            check_trackers(list(self.log_with))
        _check(
            self.log_images_every >= 0,
            "run.log_images_every",
            ">= 0 (0 = only the before/after grids)",
            self.log_images_every,
        )
        _check(self.iterations >= 1, "run.iterations", ">= 1", self.iterations)
        _check(0 <= self.seed < 2**63, "run.seed", "in [0, 2^63)", self.seed)
        from .diversity import parse_stop_rule

        self.stop_if = list(self.stop_if)
        with config_key("run.stop_if"):
            for rule in self.stop_if:
                parse_stop_rule(rule)
        _check(self.save_every >= 1, "run.save_every", ">= 1 (the last iteration is always saved)", self.save_every)
        _check(
            self.keep_checkpoints is None or self.keep_checkpoints >= 1,
            "run.keep_checkpoints",
            ">= 1 or null (keep all)",
            self.keep_checkpoints,
        )
        _check(
            self.mixed_precision in PRECISIONS,
            "run.mixed_precision",
            "auto|bf16|no (fp16 needs loss scaling, which flowrl does not do)",
            self.mixed_precision,
        )
        _check(self.device in ("auto", "cpu", "cuda"), "run.device", "auto|cpu|cuda", self.device)


@dataclass
class Config:
    """The whole run: ``model``, ``sampling``, ``rewards``, ``train``, ``eval``, ``run`` and the prompt
    sets. Built by :func:`load_config`; every field is validated when it is built (``ConfigError`` names
    the key); ``flowrl config [PRESET]`` prints every key with its value and help."""

    model: ModelConfig = setting(factory=ModelConfig, help="the pipeline and how it is trained")
    sampling: SamplingConfig = setting(factory=SamplingConfig, help="the rollouts")
    rewards: dict[str, Optional[RewardConfig]] = setting(
        factory=dict,
        help="name (registered, or 'package.module:function') -> weight, options and spec (what builds it, default "
        "the name); empty = geneval; null drops a reward inherited from a base preset",
    )
    train_prompts: str = setting("train", "train | test | a .jsonl file of prompt records")
    tag_balanced: bool = setting(True, "draw a tag uniformly, then a prompt of that tag")
    train: TrainConfig = setting(factory=TrainConfig, help="the objective and the optimizer")
    eval: EvalConfig = setting(factory=EvalConfig, help="the evaluations")
    run: RunConfig = setting(factory=RunConfig, help="the run folder, length, device and precision")

    def __post_init__(self):
        self.rewards = {name: r for name, r in self.rewards.items() if r is not None}
        if not self.rewards:  # a default in the schema would be merged into, not replaced by, a preset's rewards
            self.rewards = {"geneval": RewardConfig()}
        _check(
            self.train.kl_beta == 0 or self.model.lora_rank > 0,
            "train.kl_beta",
            "0 unless model.lora_rank > 0 (the KL reference is the LoRA-disabled base)",
            self.train.kl_beta,
        )
        sampling = self.sampling
        _check(
            not (sampling.train_last_step and sampling.kernel in UNIT_ETA_KERNELS)
            or _schedule_ends_above_zero(self.model.path) is not False,
            "sampling.train_last_step",
            f"false with kernel {sampling.kernel!r} on the schedule of {self.model.path} (its step onto t = 0 has std "
            "0: no log-prob; only a DDPM scheduler with set_alpha_to_one false ends above 0)",
            sampling.train_last_step,
        )
        self._check_stop_rules()
        METHODS[self.train.method].check_config(self)  # what the method (and its rollout shape) cannot run
        if self.sampling.overlap_rewards:  # only where the method samples in chunks
            chunked = sorted(name for name, method in METHODS.items() if method.chunked_rollout(self))
            _check(
                self.train.method in chunked,
                "sampling.overlap_rewards",
                f"false with train.method {self.train.method!r} here (chunked rollouts: train.method "
                f"{' | '.join(chunked)}; the GRPO family with sampling.shape flat and no sampling.shared_noise)",
                True,
            )

    def _check_stop_rules(self) -> None:
        """``run.stop_if`` against the metrics known before the run (:func:`flowrl.diversity.check_stop_metrics`)."""
        from .diversity import check_stop_metrics

        with config_key("run.stop_if"):
            check_stop_metrics(self.run.stop_if, list(self.rewards))


def _load_yaml(path: Path, chain: tuple[Path, ...] = ()):
    """A YAML preset with its ``base:`` chain merged underneath (a base path is relative to the file)."""
    path = path.resolve()
    if path in chain:
        raise ConfigError(f"config key 'base' of {path} makes a cycle: {' -> '.join(str(c) for c in chain + (path,))}")
    if not path.is_file():
        raise FileNotFoundError(
            f"config file {path} does not exist" + (f" (the 'base' of {chain[-1]})" if chain else "")
        )
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {path} is not UTF-8 text (byte {e.start}: {e.reason})") from None
    if not text.strip() or all(not line.strip() or line.lstrip().startswith("#") for line in text.splitlines()):
        raise ConfigError(
            f"config file {path} is empty: it names no model and no rewards (start from a preset in configs/, or "
            "write base: configs/quickstart.yaml and the keys to change)"
        )
    try:
        top = yaml.safe_load(text)  # its shape: OmegaConf.load reads a lone string as a key
        cfg = OmegaConf.load(path)
    except yaml.YAMLError as e:  # a syntax error: name the file and the line, in one line
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise ConfigError(f"config file {path} is not valid YAML{where}: {getattr(e, 'problem', None) or e}") from None
    if text.lstrip()[:15].lower().startswith(("<!doctype html", "<html")):
        raise ConfigError(f"config file {path} is an HTML page (a failed download?), not YAML")
    if not isinstance(top, dict) or not isinstance(cfg, DictConfig):
        raise ConfigError(
            f"config file {path} must hold a mapping of keys (model:, sampling:, train:, ...), "
            f"got a {type(top).__name__}"
        )
    base = cfg.pop("base", None)
    if base is None:
        return cfg
    return OmegaConf.merge(_load_yaml(path.parent / str(base), chain + (path,)), cfg)


FREE_FORM = ("model.options", "rewards.*.options")
"""Keys whose values a family or a reward factory reads (and checks) itself: :func:`check_finite` leaves them alone."""


def check_finite(values: dict, prefix: str = "") -> None:
    """Check that every number of a config (nested dicts and lists, as ``OmegaConf.to_container`` gives them) is
    finite: a weight, a scale, a rate or a bound of ``inf`` or ``nan`` is a typo, never a setting (``train.awm.kl_beta``
    of ``inf`` would train on NaN). :data:`FREE_FORM` keys are skipped.

    Raises:
        ConfigError: ``config key 'KEY' must be a finite number, got inf`` (a list's item named ``KEY[i]``).
    """
    for key, value in values.items():
        name = f"{prefix}{key}"
        if any(re.fullmatch(pattern.replace(".", r"\.").replace("*", r"[^.]+"), name) for pattern in FREE_FORM):
            continue
        items = [(name, value)] if not isinstance(value, list) else [(f"{name}[{i}]", v) for i, v in enumerate(value)]
        for label, item in items:
            if isinstance(item, dict):
                check_finite(item, label + ".")
            elif isinstance(item, float):
                _check(math.isfinite(item), label, "a finite number", item)


CONFIG_FOLDERS = ("configs", "configs/recipes")
"""Where :func:`resolve_config` looks for a preset or recipe given by name (relative to :data:`REPO_ROOT`)."""


def resolve_config(path: str | Path) -> Path:
    """The YAML file a config argument names: a file (the working folder's, else the repository's, as
    :func:`resolve_path` reads paths), or a preset or recipe by name: ``dgpo`` is ``configs/dgpo.yaml``,
    ``sd35m_pickscore`` is ``configs/recipes/sd35m_pickscore.yaml`` (``flowrl config --list`` lists them).

    Raises:
        FileNotFoundError: ``config file PATH does not exist``; for a bare name, also that no preset or recipe has it.
    """
    given = Path(path)
    if resolve_path(given).is_file():
        return resolve_path(given)
    bare = given.suffix not in (".yaml", ".yml") and len(given.parts) == 1
    if bare:
        for folder in CONFIG_FOLDERS:
            if (REPO_ROOT / folder / f"{given}.yaml").is_file():
                return REPO_ROOT / folder / f"{given}.yaml"
        raise FileNotFoundError(
            f"config file {path} does not exist, nor a preset configs/{path}.yaml or recipe "
            f"configs/recipes/{path}.yaml (flowrl config --list lists them)"
        )
    raise FileNotFoundError(f"config file {path} does not exist")


def preset_name(path: str | Path) -> str:
    """The name of a preset in ``configs/`` given by name (``dgpo``) or by path (``configs/dgpo.yaml``, from any
    working folder), as ``flowrl bench`` and ``flowrl overopt`` take them; anything else is returned as given (their
    check names it)."""
    try:
        file = resolve_config(path).resolve()
    except FileNotFoundError:
        return str(path)
    return file.stem if file.parent == (REPO_ROOT / "configs").resolve() else str(path)


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> Config:
    """Load a YAML preset, apply ``key=value`` overrides and validate.

    A preset may name another preset as ``base: other.yaml`` (relative to its own folder): it is loaded
    first and the preset's keys override it (``rewards`` entries are merged, not replaced).

    Args:
        path: a YAML file (``configs/*.yaml``), a preset or recipe by name (``"dgpo"``: :func:`resolve_config`), or
            None for the defaults.
        overrides: dot-list strings like ``train.learning_rate=1e-4``.

    Returns:
        A validated :class:`Config`.

    Raises:
        FileNotFoundError: if ``path`` names no file, preset or recipe.
        ConfigError: for an unknown key, a value of the wrong type or out of range (the key is named), or a
            preset that is not valid YAML or not a mapping (the file and line are named).
    """
    schema = OmegaConf.structured(Config)
    try:
        parts = [schema]
        if path is not None:
            parts.append(_load_yaml(resolve_config(path)))
        for item in overrides:
            if "=" not in item:
                raise ConfigError(f"override {item!r} must look like key=value")
        parts.append(OmegaConf.from_dotlist(list(overrides)))
        merged = OmegaConf.merge(*parts)
        check_finite(OmegaConf.to_container(merged, resolve=True))
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None)
        msg = str(e).splitlines()[0]
        raise ConfigError(f"config key '{key}': {msg}" if key else f"config: {msg}") from None


def describe(config: Config | None = None) -> list[dict]:
    """Every key of `config` (default: the built-in defaults) with its type, value, default and help, in the order
    of the sections: what ``flowrl config [PRESET]`` prints.

    Returns:
        ``[{"key": "sampling.kernel", "type": "str", "value": ..., "default": ..., "help": "..."}, ...]``; the entries
        of a dict section (``rewards``, ``model.options``) are listed under it with their values.
    """
    import dataclasses

    config = Config() if config is None else config
    rows: list[dict] = []

    def walk(obj, default, prefix: str) -> None:
        for f in dataclasses.fields(obj):
            key, value = f"{prefix}{f.name}", getattr(obj, f.name)
            base = getattr(default, f.name) if default is not None else None
            if dataclasses.is_dataclass(value):
                walk(value, base if dataclasses.is_dataclass(base) else None, key + ".")
                continue
            rows.append(
                {
                    "key": key,
                    "type": str(f.type).replace("typing.", ""),
                    "value": value,
                    "default": base,
                    "help": f.metadata.get("help", ""),
                }
            )

    walk(config, Config(), "")
    return rows


def format_description(rows: list[dict]) -> str:
    """:func:`describe`'s rows as text: ``key: type = value`` (and ``(default X)`` where the value differs), then the
    help indented on the next line."""
    lines = []
    for r in rows:
        changed = "" if r["value"] == r["default"] else f"  (default {r['default']!r})"
        lines.append(f"{r['key']}: {r['type']} = {r['value']!r}{changed}")
        if r["help"]:
            lines.append(f"    {r['help']}")
    return "\n".join(lines)


def save_config(config: Config, path: str | Path) -> None:
    """Write the resolved config as YAML (reloadable with :func:`load_config`), through a temporary file and a
    rename."""
    from .files import write_text_atomic

    write_text_atomic(path, OmegaConf.to_yaml(OmegaConf.structured(config)))


def shipped_configs() -> dict[str, list[tuple[str, str]]]:
    """The YAML files flowrl ships: ``{"presets": [...], "recipes": [...]}``, each entry ``(path relative to the
    repository, the first line of its header comment)``: the method presets on the tiny world in ``configs/`` and the
    recipes for real models in ``configs/recipes/`` (what ``flowrl config --list`` prints). Empty lists in an installed
    package without the repository's ``configs/``."""

    def entries(folder: Path) -> list[tuple[str, str]]:
        out = []
        for path in sorted(folder.glob("*.yaml")):
            first = path.read_text(encoding="utf-8", errors="replace").partition("\n")[0]
            out.append((str(path.relative_to(REPO_ROOT)), first.lstrip("# ").strip() if first.startswith("#") else ""))
        return out

    return {"presets": entries(REPO_ROOT / "configs"), "recipes": entries(REPO_ROOT / "configs" / "recipes")}


def format_shipped_configs(shipped: dict[str, list[tuple[str, str]]], width: int = 119) -> str:
    """:func:`shipped_configs` as text: a heading per kind, then ``path  header`` lines cut to `width` characters."""
    lines = []
    for kind, heading in (("presets", "Presets on the tiny world"), ("recipes", "Recipes for real models")):
        lines.append(f"{heading} ({len(shipped[kind])}):")
        pad = max((len(path) for path, _ in shipped[kind]), default=0)
        for path, header in shipped[kind]:
            line = f"  {path:<{pad}}  {header}".rstrip()
            lines.append(line if len(line) <= width else line[: width - 3] + "...")
    return "\n".join(lines)
