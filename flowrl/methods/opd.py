"""Flow-OPD, on-policy distillation for flow models (arXiv 2605.08063; project page costaliya.github.io/Flow-OPD; official
code CostaliyA/Flow-OPD ``scripts/train_sd3_opd_mix.py``, ``config/grpo.py`` ``mix_opd_8gpu``, commit 434ab16).

Single-reward teachers (flowrl runs of one reward each: their exported LoRAs) each serve the prompts of their task; the
student (the trained LoRA, cold-started from their merge: ``flowrl merge``) samples its own SDE rollouts, each of its
transitions is labelled by the teacher its prompt routes to, and a PPO update maximises the dense per-step reward.

Notation (code -> paper): ``x`` -> ``x_t`` (the student's stored state), ``sub.mean`` -> the sampling student's step mean
``mu_theta_old(x_t)``, ``v_T`` -> the routed teacher's velocity ``v_phi_k(x_t, t, c)``, ``std`` -> the step std
``sigma_t sqrt(|dt|)`` of the Flow-GRPO SDE (``sampling.kernel``), ``c`` -> ``train.opd.reward_scale``, ``lambda`` ->
``train.kl_beta``. For the transition ``(x_t -> x_t')`` of an image of prompt ``p``::

    k(p)   = the teacher whose tags, prompt file or metadata match p            (task routing, hard: one teacher)
    KL_t   = mean_d (mu_theta_old(x_t) - mu_phi_k(x_t))_d^2 / (2 std^2)         (two Gaussian steps of one std)
           = |dt| / 2 (sigma_t (1 - t) / (2t) + 1 / sigma_t)^2 mean_d (v_theta_old - v_phi_k)_d^2   (Flow-GRPO's SDE)
    r_t    = -c KL_t,    A_t = clip(r_t, -A_max, A_max)                          (dense reward, no outcome reward)
    L      = mean_t max(-A_t rho_t, -A_t clip(rho_t, 1 - eps, 1 + eps))          (rho_t = p_theta(x_t'|x_t) / p_old)
             + lambda mean_t KL(mu_theta(x_t) || mu_anchor(x_t))                (Manifold Anchor Regularization)

The project page writes the reward's KL with the squared norm (a sum over latent dims) and this exact std; the official
code means over dims and divides by the SDE's ``sigma_t^2`` alone (the KL times ``|dt|``: ``train.kl_type: flow_grpo``,
the preset's), with ``kl_scale -1`` (``c = 1``), ``adv_clip_max 5``, ``clip_range 1e-4`` and ``beta 0.04``. The anchor is
task-agnostic: the LoRA-disabled base (the official default) or a LoRA (``train.opd.anchor``, the official ``mar_lora``);
every transition takes its KL, as Flow-GRPO's KL term.

Teachers and the anchor are extra peft adapters of the student's transformer (no copies), each run alone without
gradients (:meth:`flowrl.models.FlowModel.adapter`); under FSDP2, whose wrapped transformer takes no new adapter, held
copies of the student's LoRA (each teacher merged to the student's rank first) swapped into it
(:meth:`FlowOPD.adapter`). Deviations from the official code: the reward is computed once per iteration from the
rollout's step means (the sampling student's, as LLM on-policy distillation), and gradients flow through the ratio
alone, as the paper states (the official recomputes the reward from the current student in each minibatch, with its
gradient); prompts are routed per prompt within one iteration rather than by alternating data sets per epoch
(``training_mode: alternate``).

The cold start (the paper's "merging the teachers, or SFT on their trajectories"; its project page: the SFT-based start
fine-tunes the student on teacher trajectories, the merge outperforming it out of distribution) is either
``train.opd.init`` (a LoRA: the teachers merged by ``flowrl merge``, the official code's only documented start) or
``train.opd.sft_steps`` (:meth:`FlowOPD.sft_cold_start`): before the first iteration of a fresh run, each train prompt's
routed teacher samples ``train.opd.sft_samples_per_prompt`` deterministic ODE images (Euler at ``sampling.num_steps``
and ``sampling.guidance_scale``), and the student's LoRA takes ``sft_steps`` AdamW steps of the conditional
flow-matching loss ``mean_d (v_theta(x_t, t, c) - (eps - x_0))^2`` on their latents, at logit-normal times on the
shifted schedule. The official code ships no teacher-trajectory SFT stage: this follows the paper's statement and
the official ``scripts/train_sd3_sft.py`` (flow_grpo's SFT: the flow-matching loss on the final latents of sampled
images at logit-normal times, no reward weighting here) and flowrl's ``sft`` method.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Optional

import torch

from ..fields import ConfigError, check, config_key, config_section, setting
from ..losses import step_kl
from ..samplers import ode_sample, recompute_log_prob
from .base import Rewards, SDESamples, register_method
from .forward import flow_matching_error, logit_normal_times
from .grpo import GRPO
from .shapes import step_subset

ANCHOR = "opd_anchor"
"""The peft adapter name of ``train.opd.anchor`` beside the trained ``default``."""


def teacher_adapter(name: str) -> str:
    """The peft adapter name of teacher `name` (``train.opd.teachers.NAME``)."""
    return f"opd_teacher_{name}"


@dataclass
class OPDTeacherConfig:
    """``train.opd.teachers.NAME.*``: one teacher and the prompts it serves. A prompt record is served when its ``tag``
    is in ``tags``, or its prompt is in the ``prompts`` file, or it has every ``where`` key=value; a teacher naming none
    of the three serves every record no other teacher serves."""

    lora: str = setting("", "the teacher: a LoRA folder, or a finished flowrl run (its lora/)")
    tags: list[str] = setting(factory=list, help="the records' GenEval tags (their 'tag') it serves")
    prompts: str = setting("", "a prompt file (any flowrl generate --prompts format): the prompts it serves")
    where: dict[str, Any] = setting(
        factory=dict, help="metadata key -> value (or a list of values) a record must all have to be served"
    )


@config_section("train", "opd", "Flow-OPD's teachers, routing and anchor (train.method opd)")
@dataclass
class OPDConfig:
    """``train.opd.*``: Flow-OPD (``train.method: opd``, arXiv 2605.08063)."""

    teachers: dict[str, Optional[OPDTeacherConfig]] = setting(
        factory=dict,
        help="name -> the teacher's LoRA and the prompts it serves (tags, prompts, where); null drops a preset's teacher",
    )
    anchor: str = setting(
        "", "the Manifold Anchor Regularization teacher, weight train.kl_beta: '' the LoRA-disabled base, or a LoRA"
    )
    reward_scale: float = setting(1.0, "c: the dense reward is -c KL to the routed teacher's step (official 1)")
    init: str = setting(
        "",
        "the cold start: a LoRA (or run) of model.lora_rank the student starts from, e.g. flowrl merge's of the "
        "teachers (--combination svd --rank R); '' a fresh LoRA",
    )
    sft_steps: int = setting(
        0,
        "the SFT cold start, instead of init: AdamW steps (train.learning_rate, train.minibatch_size images each) of "
        "the flow-matching loss on the routed teachers' ODE samples of the train prompts, before a fresh run's first "
        "iteration (a resumed run skips it); 0 off",
    )
    sft_prompts: int = setting(
        0, "train prompts the SFT cold start samples, drawn without replacement (seeded by run.seed); 0 every one"
    )
    sft_samples_per_prompt: int = setting(
        1, "images each prompt's teacher samples for the SFT cold start (Euler at sampling.num_steps, guidance_scale)"
    )

    def __post_init__(self):
        self.teachers = {name: t for name, t in self.teachers.items() if t is not None}
        check(self.reward_scale > 0, "train.opd.reward_scale", "> 0", self.reward_scale)
        check(self.sft_steps >= 0, "train.opd.sft_steps", ">= 0 (0: no SFT cold start)", self.sft_steps)
        check(self.sft_prompts >= 0, "train.opd.sft_prompts", ">= 0 (0: every train prompt)", self.sft_prompts)
        check(
            self.sft_samples_per_prompt >= 1, "train.opd.sft_samples_per_prompt", ">= 1", self.sft_samples_per_prompt
        )
        check(
            self.sft_steps == 0 or not self.init,
            "train.opd.sft_steps",
            "0 with train.opd.init (one cold start: the merged LoRA, or SFT on the teachers' samples)",
            self.sft_steps,
        )
        for name in self.teachers:
            check(
                re.fullmatch(r"[A-Za-z][A-Za-z0-9_]*", name) is not None,
                "train.opd.teachers",
                "teachers named by letters, digits and _ (each is a peft adapter name)",
                name,
            )


def _matches(value, wanted) -> bool:
    """A record's metadata `value` against a ``where`` value (a list: any of its items), compared as text too."""
    options = wanted if isinstance(wanted, (list, tuple)) else [wanted]
    return any(value == w or (value is not None and str(value) == str(w)) for w in options)


@dataclass
class Routing:
    """Which teacher serves which prompt record (Flow-OPD's task routing), read before the model loads.

    Attributes:
        names (`list[str]`): the teachers, in config order. folders (`list[Path]`): their LoRA folders.
        specs (`list[OPDTeacherConfig]`): their routes. prompts (`list[set[str] | None]`): each one's prompt file's
            prompts (None: no file).
    """

    names: list[str]
    folders: list[Path]
    specs: list[OPDTeacherConfig]
    prompts: list[set[str] | None]

    def serving(self, meta: dict) -> list[int]:
        """The teachers whose route names the record `meta` (the fallback teacher, naming none, excluded)."""
        out = []
        for k, (spec, prompts) in enumerate(zip(self.specs, self.prompts)):
            hit = bool(spec.tags) and meta.get("tag") in spec.tags
            hit = hit or (prompts is not None and meta.get("prompt") in prompts)
            hit = hit or (bool(spec.where) and all(_matches(meta.get(key), v) for key, v in spec.where.items()))
            if hit:
                out.append(k)
        return out

    @property
    def fallback(self) -> int | None:
        """The teacher that names no prompts (it serves the rest), or None."""
        rest = [k for k, s in enumerate(self.specs) if not (s.tags or s.where or self.prompts[k] is not None)]
        return rest[0] if rest else None

    def teacher_of(self, meta: dict) -> int:
        """The index of the teacher serving `meta`.

        Raises:
            ConfigError: no teacher or several serve it (naming the record and the teachers).
        """
        serving = self.serving(meta)
        if len(serving) > 1:
            names = " and ".join(self.names[k] for k in serving)
            raise ConfigError(
                f"config key 'train.opd.teachers': the record {meta.get('prompt')!r} (tag {meta.get('tag')!r}) is "
                f"served by teachers {names}; route each prompt to one teacher"
            )
        if not serving and self.fallback is None:
            raise ConfigError(
                f"config key 'train.opd.teachers': the record {meta.get('prompt')!r} (tag {meta.get('tag')!r}) is "
                "served by no teacher; add its tag, prompt or metadata to one, or add a teacher naming none (it serves "
                "the rest)"
            )
        return serving[0] if serving else self.fallback


def read_routing(opd: OPDConfig, metas: list[dict], key: str = "train_prompts") -> Routing:
    """The teachers' LoRA folders and routes, checked against the prompt records `metas` (config key `key`): every
    record served by one teacher, every teacher serving a record, every named tag a tag of the records.

    Raises:
        ConfigError: naming the ``train.opd`` key: no teachers, a teacher without its LoRA, two teachers naming no
            prompts, an unknown tag, a teacher serving no record, a record served by none or by several.
        FileNotFoundError: a teacher or anchor folder without a LoRA, or a missing prompt file (naming the key).
    """
    from ..merge import lora_folder
    from ..prompt_sets import read_prompt_set

    check(bool(opd.teachers), "train.opd.teachers", "at least one teacher (name: {lora: FOLDER, tags: [...]})", {})
    folders, prompt_sets = [], []
    for name, spec in opd.teachers.items():
        where = f"train.opd.teachers.{name}"
        check(bool(spec.lora), f"{where}.lora", "a LoRA folder or a finished flowrl run folder", spec.lora)
        folders.append(lora_folder(spec.lora, f"config key '{where}.lora'"))
        prompts = None
        if spec.prompts:
            with config_key(f"{where}.prompts", (ValueError, FileNotFoundError)):
                prompts = {r["prompt"] for r in read_prompt_set(spec.prompts)}
        prompt_sets.append(prompts)
    if opd.anchor:
        lora_folder(opd.anchor, "config key 'train.opd.anchor'")
    routing = Routing(list(opd.teachers), folders, list(opd.teachers.values()), prompt_sets)
    rest = [
        n for n, s, p in zip(routing.names, routing.specs, prompt_sets) if not (s.tags or s.where or p is not None)
    ]
    if len(rest) > 1:
        raise ConfigError(
            f"config key 'train.opd.teachers': teachers {' and '.join(rest)} both name no prompts (tags, prompts, "
            "where); at most one serves the rest"
        )
    tags = sorted({str(m["tag"]) for m in metas if m.get("tag") is not None})
    for name, spec in opd.teachers.items():
        unknown = [t for t in spec.tags if t not in tags]
        if unknown:
            raise ConfigError(
                f"config key 'train.opd.teachers.{name}.tags': {unknown[0]!r} is no tag of {key} (its tags: "
                f"{', '.join(tags) or 'none'})"
            )
    served = {routing.teacher_of(m) for m in metas}
    for k, name in enumerate(routing.names):
        if k not in served:
            raise ConfigError(f"config key 'train.opd.teachers.{name}': it serves no record of {key}")
    return routing


@dataclass
class OPDSamples(SDESamples):
    """A Flow-OPD rollout: the student's SDE transitions and the teacher each prompt routes to.

    Attributes:
        teacher (`torch.Tensor` of shape `(P,)`, long, CPU): the teacher index (``Routing.names``) of each prompt slot.
    """

    teacher: torch.Tensor


def opd_advantages(kl: torch.Tensor, reward_scale: float, clip: float) -> torch.Tensor:
    """Flow-OPD's per-transition advantage: the dense reward ``-c KL`` clipped to ``[-A_max, A_max]`` (module
    docstring), with no group normalisation (the official ``kl_norm: none``).

    Args:
        kl (`torch.Tensor` of shape `(M,)`): each transition's KL to its teacher's step, >= 0.
        reward_scale (`float`): ``c`` > 0. clip (`float`): ``A_max`` > 0 (``train.adv_clip_max``).

    Returns:
        `torch.Tensor` of shape `(M,)`, of `kl`'s dtype, in ``[-A_max, 0]``.
    """
    return (-reward_scale * kl).clamp(-clip, clip)


@register_method("opd", "Flow-OPD: PPO on the routed teachers' dense per-step KL, with an anchor KL")
class FlowOPD(GRPO):
    """``train.method: opd``: Flow-OPD (module docstring) on GRPO's rollout shapes, PPO update and KL term (the
    Manifold Anchor Regularization, weight ``train.kl_beta``, to :meth:`reference`).

    Attributes:
        routing (:class:`Routing`): the teachers and the prompts each serves.

    Args: as :class:`flowrl.methods.base.Method`, and `data`: the :class:`Routing` :meth:`read_data` read (None: read
    now).

    Raises:
        ConfigError: as :class:`flowrl.methods.base.Method`, or a teacher (anchor) LoRA that is not of the model, or
            under FSDP2 and DeepSpeed not of the student's rank (naming its key).
    """

    @classmethod
    def check_config(cls, cfg) -> None:
        """GRPO's checks, a LoRA student (the teachers are adapters beside it), a Gaussian-step KL for the reward
        (``train.kl_type: mean | flow_grpo``), a teacher at least and a rollout of whole trajectories (``sampling.shape:
        flat | tree``); the folders and routes are read by :meth:`read_data`."""
        super().check_config(cfg)
        check(cfg.model.lora_rank > 0, "model.lora_rank", "> 0 with train.method opd (teachers are LoRA adapters)", 0)
        check(
            cfg.train.kl_type in ("mean", "flow_grpo"),
            "train.kl_type",
            "mean|flow_grpo with train.method opd (its reward is the KL of the Gaussian steps)",
            cfg.train.kl_type,
        )
        check(bool(cfg.train.opd.teachers), "train.opd.teachers", "at least one teacher with train.method opd", {})
        check(
            cfg.sampling.shape in ("flat", "tree"),
            "sampling.shape",
            "flat|tree with train.method opd (whole SDE trajectories of the student)",
            cfg.sampling.shape,
        )

    @classmethod
    def read_data(cls, cfg) -> Routing:
        """The routing (:func:`read_routing`) over ``train_prompts``, and the cold start's rank (``train.opd.init``),
        checked before the model loads.

        Raises:
            ConfigError, FileNotFoundError: as :func:`read_routing`; a ``train.opd.init`` LoRA of another rank than
                ``model.lora_rank``.
        """
        from ..merge import lora_folder, read_lora
        from ..prompt_sampler import read_prompt_records

        routing = read_routing(cfg.train.opd, read_prompt_records("train_prompts", cfg.train_prompts))
        if cfg.train.opd.init:  # the cold start's rank, before the model loads
            lora = read_lora(lora_folder(cfg.train.opd.init, "config key 'train.opd.init'"))
            ranks = {a.shape[0] for a, _ in lora.modules.values()}
            if ranks != {cfg.model.lora_rank}:
                raise ConfigError(
                    f"config key 'train.opd.init': {lora.folder} is a LoRA of rank {', '.join(map(str, sorted(ranks)))}, "
                    f"the student's is model.lora_rank {cfg.model.lora_rank}; merge the teachers with flowrl merge "
                    f"--combination svd --rank {cfg.model.lora_rank}"
                )
        return routing

    def __init__(self, cfg, model, policy, rewards, data: Routing | None = None):
        super().__init__(cfg, model, policy, rewards)
        from ..merge import lora_folder

        self.routing = data if data is not None else self.read_data(cfg)
        # under FSDP2 and DeepSpeed the wrapped transformer takes no new adapter: the teachers are held copies of the
        # student's LoRA (FSDP2 full shard: shards; ZeRO-3: partitions), swapped in for their forwards
        held = policy.sharded or policy.engine is not None
        self.held: dict[str, dict[str, torch.Tensor]] | None = {} if held else None
        r = self.routing
        loras = [(teacher_adapter(n), f, f"train.opd.teachers.{n}.lora") for n, f in zip(r.names, r.folders)]
        if cfg.train.opd.anchor:
            loras.append(
                (ANCHOR, lora_folder(cfg.train.opd.anchor, "config key 'train.opd.anchor'"), "train.opd.anchor")
            )
        for adapter, folder, key in loras:
            with config_key(key):
                if self.held is None:
                    model.load_lora(folder, adapter_name=adapter)
                else:
                    whole = self.as_student(folder, f"config key '{key}'")
                    self.held[adapter] = {n: policy.part_of(n, v) for n, v in whole.items()}  # full shard: shards
        model.transformer.set_adapter("default")  # the student, trainable
        if cfg.train.opd.init:
            self.cold_start(cfg.train.opd.init)
        self._teacher_nfe = 0
        self._sft_stats: dict[str, float] = {}  # the SFT cold start's, logged with the first iteration

    def as_student(self, path, key: str) -> dict[str, torch.Tensor]:
        """The LoRA folder (or run) `path` as the student's trainable tensors (whole, float32: its weight deltas the
        file's, :func:`flowrl.merge.lora_as_params`): a teacher, anchor or cold start.

        Raises:
            ConfigError: naming `key`: a LoRA of another rank than ``model.lora_rank`` or of other modules.
        """
        from ..merge import lora_as_params, lora_folder

        m = self.cfg.model
        shapes = {n: torch.empty(shape, device="meta") for n, shape in self.policy.whole_shapes().items()}
        try:
            return lora_as_params(lora_folder(path, key), shapes, m.lora_alpha, m.lora_rank)
        except ValueError as e:
            raise ConfigError(f"{key}: {e}") from None  # lora_folder's FileNotFoundError names the key already

    def adapter(self, name: str):
        """Context in which the transformer is teacher (or anchor) adapter `name`: peft's adapter, or under FSDP2 its
        held copy swapped into the student's LoRA."""
        if self.held is None:
            return self.model.adapter(name)
        return self.policy.holding(self.held[name])

    def cold_start(self, path: str) -> None:
        """Flow-OPD's cold start: set the student's LoRA to the LoRA folder (or run) `path` (:meth:`as_student`: its
        weight deltas the file's); the EMA copy follows. A resumed run's checkpoint then replaces them.

        Raises:
            ConfigError: naming ``train.opd.init``: a LoRA of another rank than ``model.lora_rank`` or of other modules.
        """
        self.policy.assign(self.as_student(path, "config key 'train.opd.init'"))
        if self.policy.ema is not None:
            self.policy.ema = self.policy.copy()

    # ------------------------------------------------------------------------------ the SFT cold start
    def begin(self, metas: list[dict]) -> None:
        """With ``train.opd.sft_steps > 0``, the SFT cold start (:meth:`sft_cold_start`) on the train prompt records
        `metas`, with a generator of its own (:func:`flowrl.prompt_sampler.iteration_seed` of iteration -1, process
        0: the same on every process), so that the iterations draw what they draw without it."""
        if self.cfg.train.opd.sft_steps == 0:
            return
        from ..prompt_sampler import iteration_seed

        generator = torch.Generator().manual_seed(iteration_seed(self.cfg.run.seed, -1, 0))
        self._sft_stats = self.sft_cold_start(metas, generator)

    def teacher_samples(self, metas: list[dict], generator: torch.Generator):
        """Each record's routed teacher's ``train.opd.sft_samples_per_prompt`` deterministic samples: Euler
        (:func:`flowrl.samplers.ode_sample`) over the sampler's grid (``sampling.num_steps``, ``sampling.shift``) at
        ``sampling.guidance_scale``, the teacher's adapter alone, without gradients; noise drawn from `generator`.

        Returns:
            ``(x0, cond, table)``: the final latents `(N, *latent_shape)` float32 on the device (``N = len(metas) *
            sft_samples_per_prompt``, a record's images together), each image's prompt-table row `(N,)` long, the
            prompt table.

        Raises:
            ConfigError: a record no teacher (or several) serves (:meth:`Routing.teacher_of`).
        """
        model, per = self.model, self.cfg.train.opd.sft_samples_per_prompt
        table = model.prompt_table(metas)
        prompt_index = torch.arange(len(metas), device=self.device).repeat_interleave(per)  # (N,)
        cond = table.rows(prompt_index)  # (N,)
        teacher = torch.tensor([self.routing.teacher_of(m) for m in metas]).repeat_interleave(per)  # (N,) CPU
        noise = torch.randn((len(cond), *model.latent_shape), generator=generator).to(self.device)
        velocity = self.chunked(model.velocity_fn(table, self.cfg.sampling.guidance_scale))
        x0 = torch.zeros_like(noise, dtype=torch.float32)
        with torch.no_grad(), self.policy.autocast():
            for k, name in enumerate(self.routing.names):  # the same teachers in the same order on every process
                idx = (teacher == k).nonzero().squeeze(1).to(self.device)
                if len(idx):
                    with self.adapter(teacher_adapter(name)):
                        x0[idx] = ode_sample(velocity, noise[idx], cond[idx], self.sigmas.to(self.device)).float()
        return x0, cond, table

    def sft_loss(self, velocity, x0: torch.Tensor, cond: torch.Tensor, times: torch.Tensor, eps: torch.Tensor):
        """The SFT cold start's loss of one micro-batch: the student's conditional flow-matching error
        :func:`flowrl.methods.forward.flow_matching_error` at ``x_t = (1 - t) x0 + t eps``, averaged over the rows.

        Args:
            velocity: the student (:meth:`FlowModel.velocity_fn`, guidance 1). x0, eps (`(n, *latent_shape)`): the
                teacher's samples and the noise; cond (`(n,)` long): their prompt rows; times (`(n,)`): in (0, 1).

        Returns:
            A scalar float32 tensor with the student's graph.
        """
        t = times.view((-1,) + (1,) * (x0.ndim - 1))
        with self.policy.autocast():
            v = velocity((1 - t) * x0 + t * eps, times, cond)
        return flow_matching_error(v, x0, eps).mean()

    def sft_cold_start(self, metas: list[dict], generator: torch.Generator) -> dict[str, float]:
        """Flow-OPD's SFT cold start (module docstring): the routed teachers' samples (:meth:`teacher_samples`) of
        ``train.opd.sft_prompts`` records of `metas` (0: all, else drawn without replacement from `generator`), then
        ``train.opd.sft_steps`` AdamW steps of :meth:`sft_loss`, each on ``train.minibatch_size`` images drawn with
        replacement, logit-normal times (:func:`flowrl.methods.forward.logit_normal_times` at ``sampling.shift``)
        and fresh noise, micro-batched at ``train.micro_batch_size``, clipped at ``train.max_grad_norm``. Then the
        AdamW state is cleared and the EMA (``train.ema_decay``) set to the student, so that the RL phase starts as
        from ``train.opd.init``. Every process draws, samples and trains alike (the gradient is the mean of equal
        ones: one process's), so that the transformer is called alike under FSDP2 full shard.

        Returns:
            ``opd/sft_loss`` (the mean over the steps), ``opd/sft_loss_first``, ``opd/sft_loss_last``,
            ``opd/sft_images`` and ``cost/sft_nfe`` (the teachers' and the student's transformer rows).
        """
        from collections import defaultdict

        opd, train, policy = self.cfg.train.opd, self.cfg.train, self.policy
        if opd.sft_prompts and opd.sft_prompts < len(metas):
            metas = [metas[i] for i in torch.randperm(len(metas), generator=generator)[: opd.sft_prompts].tolist()]
        x0, cond, table = self.teacher_samples(metas, generator)
        velocity = self.model.velocity_fn(table, 1.0)  # the conditional velocity, as flowrl's sft and flow_grpo's
        size, shift = train.minibatch_size, float(self.cfg.sampling.shift or 1.0)
        stats, losses = defaultdict(list), []
        self.model.transformer.train()
        for _ in range(opd.sft_steps):
            pick = torch.randint(0, len(x0), (size,), generator=generator).to(self.device)  # (size,)
            times = logit_normal_times(size, shift, generator).to(self.device)
            eps = torch.randn((size, *x0.shape[1:]), generator=generator).to(self.device)
            parts = []
            for _, idx, frac in policy.micro_batches(torch.arange(size, device=self.device)):
                rows = pick[idx]
                loss = self.sft_loss(velocity, x0[rows], cond[rows], times[idx], eps[idx])
                policy.backward(loss, frac / self.accelerator.num_processes)  # every process alike: their mean
                parts.append(loss.item() * frac)
            losses.append(sum(parts))
            policy.step(losses[-1], stats)
        self.model.transformer.eval()
        policy.reset_optimizer()  # the RL phase's AdamW starts afresh, as after train.opd.init
        if policy.ema is not None:
            policy.ema = policy.copy()
        rows = self.model.cfg_rows(self.cfg.sampling.guidance_scale)
        nfe = len(x0) * self.cfg.sampling.num_steps * rows + opd.sft_steps * size
        return {
            "opd/sft_loss": sum(losses) / len(losses),
            "opd/sft_loss_first": losses[0],
            "opd/sft_loss_last": losses[-1],
            "opd/sft_images": float(len(x0)),
            "cost/sft_nfe": float(nfe),
        }

    # ------------------------------------------------------------------------------ the contract
    def rollout(self, metas: list[dict], generator: torch.Generator) -> OPDSamples:
        """The rollout shape's student SDE rollout, with each prompt's teacher (:meth:`Routing.teacher_of`)."""
        samples = super().rollout(metas, generator)
        teacher = torch.tensor([self.routing.teacher_of(m) for m in metas], dtype=torch.long)  # (P,)
        return OPDSamples(**{f.name: getattr(samples, f.name) for f in fields(samples)}, teacher=teacher)

    def advantages(self, samples: OPDSamples, rewards: Rewards, generator: torch.Generator):
        """The dense per-transition advantages :func:`opd_advantages` of the trained transitions (with
        ``train.timestep_fraction < 1`` DanceGRPO's random subset of each image's, drawn from `generator`), each from
        its routed teacher's step; the rewards the loop scored are logged only.

        Returns:
            ``(adv (M,) float32, keep (M,) bool, stats)``: ``opd/kl`` (the mean KL to the teachers), per teacher
            ``opd/NAME/kl`` and ``opd/NAME/transitions``, ``advantage/abs_mean``.
        """
        ro, train = samples.rollout, self.cfg.train
        keep = ro.trained.clone()
        if train.timestep_fraction < 1:
            keep = keep & step_subset(ro, train.timestep_fraction, generator).to(keep.device)
        rows = keep.nonzero().squeeze(1)  # (M',)
        teacher = samples.teacher.to(ro.leaf.device)[samples.image_prompt.to(ro.leaf.device)[ro.leaf]]  # (M,)
        kl = torch.zeros(len(ro), device=ro.leaf.device)  # (M,)
        # in lockstep (FSDP2 full shard) each teacher's forwards padded to the process with the most chunks
        velocity = self.chunked(self.model.velocity_fn(samples.table, self.cfg.sampling.guidance_scale), pad=True)
        stats, nfe = {}, 0
        for k, name in enumerate(self.routing.names):
            idx = rows[teacher[rows] == k]  # (m,) this teacher's transitions
            stats[f"opd/{name}/transitions"] = float(len(idx))
            if len(idx) == 0 and not self.policy.lockstep:
                continue
            sub = ro.select(idx if len(idx) else torch.zeros(1, dtype=torch.long, device=idx.device))  # a stand-in
            with torch.no_grad(), self.adapter(teacher_adapter(name)), self.policy.autocast():
                v_teacher = velocity(sub.state, sub.sigma, sub.cond)  # (m, *latent_shape)
            if len(idx) == 0:  # lockstep: the stand-in's forwards made, its result discarded
                continue
            kl[idx] = self.step_kl(sub, v_teacher)
            stats[f"opd/{name}/kl"] = kl[idx].mean().item()
            nfe += len(idx) * self.model.cfg_rows(self.cfg.sampling.guidance_scale)
        self._teacher_nfe = nfe
        adv = torch.zeros(len(ro), device=kl.device)
        adv[rows] = opd_advantages(kl[rows], train.opd.reward_scale, train.adv_clip_max)
        stats["opd/kl"] = kl[rows].mean().item() if len(rows) else 0.0
        stats["advantage/abs_mean"] = adv[rows].abs().mean().item() if len(rows) else 0.0
        return adv, keep, stats

    def update(self, samples: OPDSamples, adv: torch.Tensor, keep: torch.Tensor, generator: torch.Generator) -> dict:
        """GRPO's PPO epochs on the dense advantages, with the MAR term (``train.kl_beta``); ``cost/nfe`` counts the
        teachers' forwards; the first iteration's row adds the SFT cold start's statistics (:meth:`sft_cold_start`)."""
        out = super().update(samples, adv, keep, generator)
        out["cost/nfe"] = out.get("cost/nfe", 0) + self._teacher_nfe
        out["cost/teacher_nfe"] = self._teacher_nfe
        if self._sft_stats:  # the SFT cold start's, once, with the first iteration (its forwards in cost/nfe)
            out.update(self._sft_stats)
            out["cost/nfe"] += self._sft_stats["cost/sft_nfe"]
            self._sft_stats = {}
        return out

    # ------------------------------------------------------------------------------ the reward and the anchor
    def step_kl(self, sub, v_teacher: torch.Tensor) -> torch.Tensor:
        """Each transition's KL between the sampling student's stored step and the teacher's step from the same state
        (:func:`flowrl.losses.step_kl`; ``train.kl_type: flow_grpo`` divides by the SDE's ``sigma_t^2``, the official
        code's, i.e. the exact KL times ``|dt|``). Returns `(m,)` float32."""
        _, teacher_mean = recompute_log_prob(sub, v_teacher)  # (m, *latent_shape)
        std = sub.std
        if self.cfg.train.kl_type == "flow_grpo":
            std = std / (sub.sigma - sub.sigma_next).abs().sqrt()
        return step_kl(sub.mean, teacher_mean, std)

    def reference(self):
        """The anchor of the Manifold Anchor Regularization: the adapter ``train.opd.anchor`` alone, or the
        LoRA-disabled base."""
        return self.adapter(ANCHOR) if self.cfg.train.opd.anchor else self.model.reference()
