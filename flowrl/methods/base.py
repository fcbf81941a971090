"""The method contract: what the training loop asks of an online RL method, the typed data passed between them, and the
parts methods share.

Each iteration the loop (:meth:`flowrl.trainer.Trainer.step`) calls, in order:

1. :meth:`Method.rollout` -> a :class:`Samples` (or a subclass: :class:`SDESamples`, :class:`ProbeSamples`,
   :class:`FinalSamples`): images drawn for the iteration's prompts by the old policy, and what the method needs later;
2. the rewards on those images; the loop gathers them over the processes once (:class:`Rewards`);
3. :meth:`Method.advantages` -> per-row advantages and which rows enter the loss;
4. :meth:`Method.update` -> the method's loss and optimizer steps, through :class:`flowrl.policy.Policy`;
5. :meth:`Method.end_iteration` -> anything that moves once per iteration (a sliding window, a soft-updated
   sampling policy).

The iteration's generator (every random draw) is passed to each call that draws. A method's state beyond the
policy's (a window position, an old policy) goes into checkpoints through :meth:`Method.state_dict` /
:meth:`Method.save_files` and comes back through their ``load_`` twins. Methods register themselves in
:data:`METHODS` with :func:`register_method`; ``train.method`` is checked against it, and the model family against
what the method needs (:attr:`Method.requires`).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch

from ..advantages import aggregate_advantages, best_of_n, gdpo_advantages, group_advantages

METHODS: dict[str, type[Method]] = {}
"""``train.method`` -> the method class (:func:`register_method`)."""


def register_in(table: dict[str, type], kind: str, name: str, summary: str):
    """A class decorator that registers its class in `table` under `name` and sets the class's ``name`` and ``summary``
    (a few words for the config's help); what :func:`register_method` and
    :func:`flowrl.methods.shapes.register_shape` return.

    Raises:
        ValueError: (when it decorates) `name` is registered in `table` already; `kind` names the table.
    """

    def register(cls: type) -> type:
        if name in table:
            raise ValueError(f"{kind} {name!r} is registered already ({table[name].__name__})")
        cls.name, cls.summary = name, summary
        table[name] = cls
        return cls

    return register


def register_method(name: str, summary: str = ""):
    """Class decorator: register a :class:`Method` subclass as ``train.method: NAME`` (sets its ``name``, and its
    ``summary``: the few words ``train.method``'s help shows beside the name).

    Raises:
        ValueError: `name` is registered already.
    """
    return register_in(METHODS, "method", name, summary)


# ---------------------------------------------------------------------------------------------- typed data
@dataclass
class Samples:
    """One iteration's rollout, as the loop sees it.

    Attributes:
        images (`torch.Tensor` of shape `(B, 3, H, W)`, or `(B, F, 3, H, W)` for video, float32 in [0, 1], CPU): what
            the rewards score.
        image_prompt (`torch.Tensor` of shape `(B,)`, long, CPU): the prompt slot (index into the iteration's
            prompts) each image was drawn for.
        nfe (`int`): transformer rows the rollout cost (CFG counted twice).
    """

    images: torch.Tensor
    image_prompt: torch.Tensor
    nfe: int


@dataclass
class SDESamples(Samples):
    """A rollout of stored stochastic transitions (the GRPO family's flat groups, windows and trees).

    Attributes:
        rollout (:class:`flowrl.samplers.Rollout`): every stored transition (`M` rows), its ``cond`` rows of `table`.
        table (:class:`flowrl.models.PromptEmbeds`): the iteration's prompt table (:meth:`FlowModel.prompt_table`).
    """

    rollout: object
    table: object


@dataclass
class ProbeSamples(SDESamples):
    """A single-step-branching rollout (TempFlow-GRPO, G2RPO, TP-GRPO): ``rollout`` is ``probes.rollout``.

    Attributes:
        probes (:class:`flowrl.samplers.ProbeRollout`): the probes, their steps, roots and ODE granularities.
    """

    probes: object


@dataclass
class FinalSamples(Samples):
    """Clean samples of a forward-process method (DiffusionNFT): no transitions, only where the sampler ended.

    Attributes:
        x0 (`torch.Tensor` of shape `(B, *latent_shape)`, float32): the final latents, on the device.
        cond (`torch.Tensor` of shape `(B,)`, long): each sample's row of `table`.
        table (:class:`flowrl.models.PromptEmbeds`): the iteration's prompt table.
    """

    x0: torch.Tensor
    cond: torch.Tensor
    table: object


@dataclass
class Rewards:
    """An iteration's rewards, gathered over the processes once, by the loop (:meth:`Trainer.gather_rewards`).

    Attributes:
        local (:class:`flowrl.rewards.CombinedScores`): this process's scores, ``.total`` `(B,)` and ``.per_reward``.
        total (`torch.Tensor` of shape `(B_all,)`, float32, CPU): every process's totals, process by process.
        per_reward (`dict[str, torch.Tensor]`, each `(B_all,)` float32, CPU): every process's unweighted scores.
        group (`torch.Tensor` of shape `(B_all,)`, long, CPU): each image's prompt, unique over processes
            (``image_prompt + process_index * prompts``): the groups of group-relative advantages.
        mine (`slice`): this process's rows of the gathered tensors.
    """

    local: object
    total: torch.Tensor
    per_reward: dict[str, torch.Tensor]
    group: torch.Tensor
    mine: slice


@dataclass(frozen=True)
class MicroBatch:
    """Where one micro-batch of :meth:`Method.optimizer_steps` sits (its ``micro_loss``'s third argument).

    Attributes:
        step (`int`): the optimizer step, 1-based, counted over every pass.
        epoch (`int`): the pass over the rows (``train.inner_epochs``), 0-based.
        first (`bool`): the first micro-batch of its step.
        frac (`float`): its share of this process's minibatch, in `(0, 1]`.
        scale (`float`): its weight in the backward: `frac` times this process's share of the global minibatch.
        pad (`bool`): a micro-batch of zero-weight rows that only keeps this process's calls of the sharded module in
            step with the others' (:meth:`flowrl.policy.Policy.padding`): its loss is back-propagated times 0 and its
            statistics dropped; the method leaves its own records (diagnostics) alone for it.
    """

    step: int
    epoch: int
    first: bool
    frac: float
    scale: float
    pad: bool = False


def _loss_and_stats(out) -> tuple[torch.Tensor, dict[str, float]]:
    """A ``micro_loss`` result, ``loss`` or ``(loss, micro_stats)``, as the pair."""
    return out if isinstance(out, tuple) else (out, {})


# ------------------------------------------------------------------------------------------------ the contract
class Method:
    """Base of the methods: holds the config, the model adapter, the policy and the rewards, and provides the
    helpers every method uses (chunked velocity calls, decoding, group-relative advantages).

    Args:
        cfg (:class:`flowrl.config.Config`): the whole resolved config.
        model (:class:`flowrl.models.FlowModel`): the adapter (its transformer holds the policy).
        policy (:class:`flowrl.policy.Policy`): trainable weights, optimizer, minibatches, autocast.
        rewards (:class:`flowrl.rewards.WeightedSum`): the configured rewards (their weights matter to
            ``train.reward_aggregation: advantage``).

    Raises:
        ConfigError: a policy under an engine the method does not run under (:meth:`engine_blockers`; refused at
            launch already, :func:`flowrl.policy.check_launch`).
    """

    name = ""
    online = True  # False: an offline method (its rollout reads a data set; the loop scores nothing)
    requires: tuple[str, ...] = ()
    """What the method needs of a model family, by capability name (:data:`flowrl.models.base.CAPABILITIES`, each a
    family's class flag): ``"forward_process"`` (it trains the flow-matching loss at arbitrary times from clean samples:
    :class:`flowrl.methods.forward.ForwardProcess`), ``"vae_inverse"`` (it encodes images into latents: the offline
    methods), ``"text_only"`` (its data rows are text prompts alone: the offline methods). A family lacking one is
    refused in one line before any weight loads (:func:`flowrl.pairing.check_pairing`). Default: nothing."""
    lockstep = False
    """Whether the method's update makes the same calls of the transformer on every process once its micro-batches are
    padded with zero-weight rows (:meth:`optimizer_steps`, ``pad_row``) and its forwards without gradients over its own
    rows padded to the same chunks (:meth:`chunked`'s ``pad``), so that it runs where the weights are gathered
    in every forward (FSDP2 full shard, ZeRO-3: :func:`flowrl.sharding.lockstep`); :meth:`lockstep_blocker` says
    which setting stops it. Default: no (refused there, naming ``train.method``)."""
    differentiable_reward = False
    """Whether the method back-propagates the reward (the direct-reward methods): it then needs rewards with
    ``score_with_grad``, refused in one line naming the reward otherwise."""

    def __init__(self, cfg, model, policy, rewards):
        self.cfg, self.model, self.policy, self.rewards = cfg, model, policy, rewards
        self.accelerator, self.device = policy.accelerator, policy.device
        self.sigmas = model.sigmas(cfg.sampling.num_steps, cfg.sampling.shift)  # (N + 1,) the stock pipeline's grid
        if self.differentiable_reward:
            self.check_rewards_differentiable(rewards)
        if policy.engine is not None or policy.sharded:  # refused at launch already; here for a policy built otherwise
            from ..policy import check_not_sharded

            check_not_sharded(self.engine_blockers(cfg), "DeepSpeed" if policy.engine is not None else "FSDP2")

    def check_rewards_differentiable(self, rewards) -> None:
        """Refuse a weighted reward without ``score_with_grad`` for a method that back-propagates the reward
        (:attr:`differentiable_reward`); a reward of weight 0 is only logged.

        Raises:
            ConfigError: naming ``rewards.NAME`` and the differentiable rewards.
        """
        from ..fields import ConfigError
        from ..rewards import REWARDS

        for name, (reward, weight) in rewards.rewards.items():
            if weight != 0 and not getattr(reward, "differentiable", False):
                grad = ", ".join(sorted(n for n, f in REWARDS.items() if getattr(f, "differentiable", False)))
                raise ConfigError(
                    f"config key 'rewards.{name}': train.method {self.name!r} back-propagates through the reward, and "
                    f"{name} has no score_with_grad (differentiable: {grad}, and for videos frames over one of them); "
                    "give it weight 0 to log it only"
                )

    @classmethod
    def check_config(cls, cfg) -> None:
        """Refuse settings this method cannot run, naming the key (:class:`flowrl.config.ConfigError`); called when
        the config is built. Default: nothing to refuse."""

    @classmethod
    def lockstep_blocker(cls, cfg) -> str | None:
        """The config key (with its value) that keeps this method, under `cfg`, from calling the transformer alike on
        every process (:attr:`lockstep`), or None when it does. Default: ``train.method`` unless :attr:`lockstep`."""
        return None if cls.lockstep else f"train.method {cfg.train.method!r}"

    @classmethod
    def engine_blockers(cls, cfg) -> dict[str, str]:
        """The engines (``"FSDP2"``, ``"DeepSpeed"``) this method, under `cfg`, does not run under, each with why (it
        keeps tensors beside the transformer the engine wraps that the engine's gradients or wrapping do not reach),
        refused at launch before any weights load (:func:`flowrl.policy.check_not_sharded`). Default: none."""
        return {}

    @classmethod
    def read_data(cls, cfg):
        """What the method reads from files besides the prompt sets (an offline method's data set), read by the
        trainer before the model loads, so that a bad file is refused first, and given to the constructor as
        ``data`` (:func:`flowrl.methods.build_method`). Default: None, nothing to read."""
        return None

    def begin(self, metas: list[dict]) -> None:
        """Called once by the trainer at the start of a fresh run (not on resume: the checkpoint holds what it did),
        before the base evaluation, with the ``train_prompts`` records `metas`: a cold start that trains
        (Flow-OPD's SFT on its teachers' samples). Every process calls it. Default: nothing."""

    def rollout(self, metas: list[dict], generator: torch.Generator) -> Samples:
        """Draw this iteration's images for the prompt records `metas` (``P`` prompts)."""
        raise NotImplementedError

    @classmethod
    def chunked_rollout(cls, cfg) -> bool:
        """Whether this method, under `cfg`, has :meth:`rollout_in_chunks` (``sampling.overlap_rewards`` is refused
        where it has not). Default: no."""
        return False

    def rollout_in_chunks(self, metas: list[dict], generator: torch.Generator, size: int, on_chunk) -> Samples:
        """:meth:`rollout` sampled `size` images at a time (whole groups, whole sampler forwards), each chunk's final
        latents handed over undecoded as soon as they exist, so the caller decodes and scores them while the next
        chunk samples (``sampling.overlap_rewards``). Equal to :meth:`rollout` with the same `generator` in every
        field but ``images``, which is left empty ``(0,)``: the caller sets it from the chunks it decoded.

        Args:
            size (`int`): images per chunk, a multiple of ``sampling.group_size`` and ``sampling.batch_size``.
            on_chunk: ``on_chunk(latents (n, *latent_shape), image_prompt (n,) long CPU) -> None``, called per chunk in
                order of the images; an exception it raises stops the rollout and propagates.
        """
        raise NotImplementedError

    def advantages(self, samples: Samples, rewards: Rewards, generator: torch.Generator):
        """Per-row advantages of `samples` from the gathered `rewards`; returns ``(advantages, keep (bool), stats)``."""
        raise NotImplementedError

    def update(self, samples: Samples, adv: torch.Tensor, keep: torch.Tensor, generator: torch.Generator) -> dict:
        """The method's optimizer steps on the kept rows; returns ``policy/*`` and ``cost/*`` metrics."""
        raise NotImplementedError

    def end_iteration(self, stats: dict) -> None:
        """Called once per iteration after :meth:`update` (may add to ``stats``)."""

    def sampling_weights(self) -> dict[str, torch.Tensor] | None:
        """The weights the rollouts are drawn with, if not the current ones (None)."""
        return None

    def state_dict(self) -> dict:
        """JSON-serialisable state for a checkpoint's ``state.json``."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s output."""

    @classmethod
    def held_copies(cls, cfg) -> int:
        """How many copies of the trainable tensors (float32, as :meth:`flowrl.policy.Policy.copy` makes them) the
        method holds besides them under `cfg`: its :meth:`snapshots` (an old, sampler, reference or EMA copy, a held
        score and its AdamW moments), for the memory plan (:func:`flowrl.plan.memory_plan`). Default: none."""
        return 0

    def snapshots(self) -> dict[str, dict[str, torch.Tensor]]:
        """The method's held copies of the trainable weights (an old, sampler, reference or EMA copy) by checkpoint
        file name (``*.safetensors``); :meth:`save_files` and :meth:`load_files` write and read them. None here."""
        return {}

    snapshot_origin = ""
    """What writes the snapshots, for the error of a checkpoint without them (default: ``train.method NAME``)."""

    def save_files(self, folder: Path, snapshots: dict | None = None) -> None:
        """Write the method's tensors (:meth:`snapshots`, or `snapshots`: the same made whole by every process under
        FSDP2 full shard, :meth:`flowrl.policy.Policy.whole`) into a checkpoint folder before it is sealed."""
        from safetensors.torch import save_file

        for name, store in (self.snapshots() if snapshots is None else snapshots).items():
            save_file({n: v.detach().cpu().contiguous() for n, v in store.items()}, folder / name)

    def load_files(self, folder: Path) -> None:
        """Read what :meth:`save_files` wrote into the held copies.

        Raises:
            ValueError: naming the checkpoint and the file, for a snapshot it does not hold.
        """
        from safetensors.torch import load_file

        for name, store in self.snapshots().items():
            file = folder / name
            if not file.is_file():
                origin = self.snapshot_origin or f"by train.method {self.name}"
                raise ValueError(f"checkpoint {folder} has no {name}: it was not written {origin}")
            for n, v in load_file(file).items():
                store[n].copy_(self.policy.part_of(n, v))  # FSDP2 full shard, ZeRO-3: this process's part

    def optimizer_steps(self, count: int, generator: torch.Generator, micro_loss, unit: int = 1, pad_row: int = 0):
        """The optimizer steps of ``train.inner_epochs`` passes over `count` rows (or units of `unit` rows:
        :meth:`flowrl.policy.Policy.minibatches`), each minibatch micro-batched for gradient accumulation; a process
        without rows in a step joins it with a zero gradient. In lockstep (:attr:`flowrl.policy.Policy.lockstep`) each
        step ends with the micro-batches this process owes (:meth:`flowrl.policy.Policy.padding`): ``micro_loss`` of
        row (unit) `pad_row` alone, with ``at.pad`` set, back-propagated times 0, so that every process makes the
        step's forwards and backwards alike; the method's data then holds row `pad_row` even where `count` is 0.

        Args:
            count (`int`): this process's rows (units). generator: the iteration's generator (the order).
            micro_loss: ``micro_loss(idx, stats, at) -> loss`` (a scalar tensor with the graph) of the rows (units)
                `idx` of the micro-batch `at` (:class:`MicroBatch`: its optimizer step, pass and weights); it may append
                statistics to `stats`, or return ``(loss, micro_stats)``: a dict of floats merged over the step's
                micro-batches (weighted by their ``frac``; a ``*max_dev`` key takes their maximum) and appended to
                `stats` once per step.
            unit (`int`): rows per unit.

        Returns:
            ``(stats, steps)``: the per-step and per-micro-batch statistics (``policy/loss``, ``policy/grad_norm``
            and the method's) and the optimizer steps taken.
        """
        policy = self.policy
        stats: dict[str, list[float]] = defaultdict(list)
        steps = 0
        self.model.transformer.train()
        pad = torch.tensor([pad_row], device=self.device)
        for epoch, _, mb, total in policy.minibatches(count, generator, unit=unit):
            steps += 1
            parts, merged = [], {}
            share = len(mb) / total if len(mb) else 0.0  # this process's part of the global minibatch
            for start, idx, frac in policy.micro_batches(mb, unit=unit) if len(mb) else ():  # gradient accumulation
                at = MicroBatch(steps, epoch, start == 0, frac, frac * share)
                loss, micro_stats = _loss_and_stats(micro_loss(idx, stats, at))
                policy.backward(loss, at.scale)
                parts.append(loss.item() * frac)
                for k, x in micro_stats.items():
                    merged[k] = max(merged.get(k, x), x) if k.endswith("max_dev") else merged.get(k, 0) + x * frac
            for _ in policy.padding():  # lockstep: zero-weight micro-batches up to the step's count
                at = MicroBatch(steps, epoch, not parts, 0.0, 0.0, pad=True)
                loss, _ = _loss_and_stats(micro_loss(pad, defaultdict(list), at))
                policy.backward(loss, 0.0)
            # None: this process had no rows in this step, the others had (a zero gradient)
            policy.step(sum(parts) if parts else None, stats)
            for k, x in merged.items():
                stats[k].append(x)
        self.model.transformer.eval()
        return stats, steps

    def update_metrics(self, stats: dict, steps: int, trained: int | None = None, nfe: int | None = None, **extra):
        """What an update returns, from :meth:`optimizer_steps`' ``(stats, steps)``: each statistic's mean over its
        entries (the maximum for a ``*first_max*`` one, gathered in the first step), ``policy/optimizer_steps``,
        the `extra` values, and where given ``cost/trained_transitions`` (`trained` rows a pass, times
        ``train.inner_epochs``) and ``cost/nfe``.

        Returns:
            `dict[str, float]`.
        """
        out = {k: max(v) if "first_max" in k else sum(v) / len(v) for k, v in stats.items()}
        out["policy/optimizer_steps"] = steps
        out.update(extra)
        if trained is not None:
            out["cost/trained_transitions"] = trained * self.cfg.train.inner_epochs
        if nfe is not None:
            out["cost/nfe"] = nfe
        return out

    # ------------------------------------------------------------------------------ shared parts
    def chunked(self, fn, size: int | None = None, pad: bool = False):
        """`fn` (a :class:`flowrl.samplers.VelocityFn`) evaluated in consecutive chunks of at most `size` rows (default
        ``sampling.batch_size``: bounds the activation memory of one forward), concatenated.

        With `pad`, for rows whose count differs between processes (a method's forwards over its own kept rows): in
        lockstep (:attr:`flowrl.policy.Policy.lockstep`) the call then adds, after its own chunks, as many calls of
        `fn` on its first row as the process with the most chunks makes more (:meth:`Policy.calls_owed`; their
        outputs discarded), so that every process calls the transformer alike; every process must then call it at
        the same point, with at least one row (:meth:`ForwardProcess.stand_in`).

        Raises:
            RuntimeError: (when called) a padded call without rows in lockstep.
        """
        size = size or self.cfg.sampling.batch_size

        def chunked(x, t, cond):
            out = [fn(x[i : i + size], t[i : i + size], cond[i : i + size]) for i in range(0, len(x), size)]
            owed = self.policy.calls_owed(len(out)) if pad else 0
            if owed and not len(x):
                raise RuntimeError("a padded forward in lockstep needs a row to repeat (ForwardProcess.stand_in)")
            for _ in range(owed):  # lockstep: the calls the process with the most chunks makes beyond ours
                fn(x[:1], t[:1], cond[:1])
            return torch.cat(out)

        return chunked

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents `(B, *latent_shape)` to float32 images `(B, 3, H, W)` in [0, 1] on the CPU, for the rewards
        (bf16 autocast if ``sampling.decode_precision`` says so: the images never enter a log-prob)."""
        size = self.cfg.sampling.batch_size
        with self.policy.autocast(self.cfg.sampling.decode_precision):
            return torch.cat(
                [self.model.decode(latents[i : i + size]) for i in range(0, latents.shape[0], size)]
            ).cpu()

    def group_advantages(self, rewards: Rewards) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
        """Group-relative advantages over every process's images (flat groups: GRPO and DiffusionNFT;
        arXiv 2402.03300's group z-score with ``train.adv_std``, clipped at ``train.adv_clip_max``).

        With ``train.reward_aggregation: advantage`` and several rewards, each reward is z-scored in its group and
        the weighted z-scores summed (MixGRPO's advantage aggregation); with ``train.best_of_n``, only the best
        and worst ``best_of_n / 2`` of each group are kept (DanceGRPO).

        Returns:
            ``(adv (B_all,) float32, zero (B_all,) bool: untrained (no reward variance, or outside best-of-n),
            {"advantage/zero_variance_frac", "advantage/abs_mean"})``.
        """
        t, group = self.cfg.train, rewards.group
        rank = (
            rewards.total
        )  # best-of-n ranks by the unclipped advantage, as DanceGRPO; within a group the total orders alike
        if t.reward_aggregation == "gdpo":
            weights = {k: w for k, (_, w) in self.rewards.rewards.items()}
            adv, zero = gdpo_advantages(rewards.per_reward, weights, group, t.adv_clip_max)
        elif t.reward_aggregation == "advantage" and len(rewards.per_reward) > 1:
            weights = {k: w for k, (_, w) in self.rewards.rewards.items()}
            adv, zero = aggregate_advantages(rewards.per_reward, weights, group, t.adv_std, t.adv_clip_max)
            if t.best_of_n:  # sum_k w_k z_k may order a group unlike the total reward
                rank = aggregate_advantages(rewards.per_reward, weights, group, t.adv_std, float("inf"))[0]
        else:
            adv, zero = group_advantages(rewards.total, group, t.adv_std, t.adv_clip_max)
        if t.best_of_n:
            zero = zero | ~best_of_n(rank, group, t.best_of_n)
        return (
            adv,
            zero,
            {
                "advantage/zero_variance_frac": zero.float().mean().item(),
                "advantage/abs_mean": adv.abs().mean().item(),
            },
        )
