"""The method contract: what the training loop asks of an online RL method, and the parts methods share.

Each iteration the loop (:meth:`flowrl.trainer.Trainer.step`) calls, in order:

1. :meth:`Method.rollout` -> :class:`Samples`: images drawn for the iteration's prompts by the old policy;
2. the rewards on those images (the loop scores them, gathering the totals over processes);
3. :meth:`Method.advantages` -> per-row advantages and which rows enter the loss;
4. :meth:`Method.update` -> the method's loss and optimizer steps, through :class:`flowrl.policy.Policy`;
5. :meth:`Method.end_iteration` -> anything that moves once per iteration (a sliding window, a soft-updated
   sampling policy).

A method's state beyond the policy's (a window position, an old policy) goes into checkpoints through
:meth:`Method.state_dict` / :meth:`Method.save_files` and comes back through their ``load_`` twins.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..advantages import aggregate_advantages, best_of_n, group_advantages


@dataclass
class Samples:
    """One iteration's rollout.

    Attributes:
        images (`torch.Tensor` of shape `(B, 3, H, W)`, float32 in [0, 1], CPU): what the rewards score.
        image_prompt (`torch.Tensor` of shape `(B,)`, long, CPU): the prompt slot (index into the iteration's
            prompts) each image was drawn for.
        nfe (`int`): transformer rows the rollout cost (CFG counted twice).
        data (`dict`): the method's own tensors (its rollout, prompt table, final latents ...).
    """

    images: torch.Tensor
    image_prompt: torch.Tensor
    nfe: int
    data: dict = field(default_factory=dict)


class Method:
    """Base of the methods: holds the config, the model adapter, the policy and the rewards, and provides the
    helpers every method uses (chunked velocity calls, decoding, group-relative advantages).

    Args:
        cfg (:class:`flowrl.config.Config`): the whole resolved config.
        model (:class:`flowrl.models.FlowModel`): the adapter (its transformer holds the policy).
        policy (:class:`flowrl.policy.Policy`): trainable weights, optimizer, minibatches, autocast.
        rewards (:class:`rewards.WeightedSum`): the configured rewards (their weights matter to
            ``train.reward_aggregation: advantage``).
    """

    name = ""

    def __init__(self, cfg, model, policy, rewards):
        self.cfg, self.model, self.policy, self.rewards = cfg, model, policy, rewards
        self.accelerator, self.device = policy.accelerator, policy.device
        self.sigmas = model.sigmas(cfg.sampling.num_steps, cfg.sampling.shift)  # (N + 1,) the stock pipeline's grid

    # ---------------------------------------------------------------------------- the contract
    def rollout(self, metas: list[dict], generator: torch.Generator) -> Samples:
        """Draw this iteration's images for the prompt records `metas` (``P`` prompts)."""
        raise NotImplementedError

    def advantages(self, samples: Samples, scores, total: torch.Tensor, prompts: int):
        """Per-row advantages of `samples` from this process's reward set ``scores`` and the totals ``total
        (B_all,)`` gathered over every process; returns ``(advantages, keep (bool), stats dict)``."""
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

    def save_files(self, folder: Path) -> None:
        """Write the method's tensors into a checkpoint folder before it is sealed."""

    def load_files(self, folder: Path) -> None:
        """Read what :meth:`save_files` wrote (ValueError naming the checkpoint if it is missing)."""

    # ------------------------------------------------------------------------------ shared parts
    def chunked(self, fn, size: int | None = None):
        """`fn` (a :class:`samplers.VelocityFn`) evaluated in consecutive chunks of at most `size` rows (default
        ``sampling.batch_size``: bounds the activation memory of one forward), concatenated."""
        size = size or self.cfg.sampling.batch_size

        def chunked(x, t, cond):
            return torch.cat([fn(x[i:i + size], t[i:i + size], cond[i:i + size]) for i in range(0, len(x), size)])
        return chunked

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents `(B, *latent_shape)` to float32 images `(B, 3, H, W)` in [0, 1] on the CPU, for the rewards
        (bf16 autocast if ``sampling.decode_precision`` says so: the images never enter a log-prob)."""
        size = self.cfg.sampling.batch_size
        with self.policy.autocast(self.cfg.sampling.decode_precision):
            return torch.cat([self.model.decode(latents[i:i + size]) for i in range(0, latents.shape[0], size)]).cpu()

    def group_advantages(self, scores, total: torch.Tensor, image_prompt: torch.Tensor,
                         prompts: int) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
        """Group-relative advantages over every process's images (flat groups: GRPO and DiffusionNFT;
        arXiv 2402.03300's group z-score with ``train.adv_std``, clipped at ``train.adv_clip_max``).

        Args:
            scores: this process's reward set scores (``.per_reward`` for ``train.reward_aggregation: advantage``).
            total: ``(B_all,)`` float32 total rewards gathered over the processes.
            image_prompt: ``(B,)`` long prompt slot of each of this process's images, in ``[0, prompts)``.
            prompts: prompts per process (``sampling.prompts_per_iteration``).

        Returns:
            ``(adv (B_all,) float32, zero (B_all,) bool: untrained (no reward variance, or outside best-of-n),
            {"advantage/zero_variance_frac", "advantage/abs_mean"})``.
        """
        t, acc = self.cfg.train, self.accelerator
        group = acc.gather((image_prompt + acc.process_index * prompts).to(self.device)).cpu()
        rank = total  # best-of-n ranks by the unclipped advantage, as DanceGRPO; within a group `total` orders alike
        if t.reward_aggregation == "advantage" and len(scores.per_reward) > 1:
            per = {k: acc.gather(v.to(self.device)).cpu() for k, v in scores.per_reward.items()}
            weights = {k: w for k, (_, w) in self.rewards.rewards.items()}
            adv, zero = aggregate_advantages(per, weights, group, t.adv_std, t.adv_clip_max)
            if t.best_of_n:  # sum_k w_k z_k may order a group unlike the total reward
                rank = aggregate_advantages(per, weights, group, t.adv_std, float("inf"))[0]
        else:
            adv, zero = group_advantages(total, group, t.adv_std, t.adv_clip_max)
        if t.best_of_n:
            zero = zero | ~best_of_n(rank, group, t.best_of_n)
        return adv, zero, {"advantage/zero_variance_frac": zero.float().mean().item(),
                           "advantage/abs_mean": adv.abs().mean().item()}

    def mine(self, rows: int) -> slice:
        """This process's slice of a batch gathered over processes, each holding ``rows`` rows."""
        i = self.accelerator.process_index
        return slice(i * rows, (i + 1) * rows)
