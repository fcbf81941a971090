"""Direct reward fine-tuning: the reward's gradient back-propagated through the last sampling steps and the VAE
decoder into the policy (the reward is a differentiable function, not a black box).

- ``refl``, ReFL (Xu et al., ImageReward, arXiv 2304.05977; THUDM/ImageReward ``ImageReward/ReFL.py``): each
  iteration, sampling without gradient to a random late step ``k`` of the ``N``-step grid (``k`` uniform in
  ``[int(refl_from N), N - 1]``; the official 30-39 of 40), one velocity with gradient there, the one-step
  prediction ``x0 = x_k - t_k v`` decoded and scored; loss ``mean(relu(margin - r)) * scale`` (the official margin 2
  for ImageReward's scale and 1e-3), or ``-mean(r) * scale`` with ``margin`` null.
- ``alignprop``, AlignProp (arXiv 2310.03739): DRaFT with the truncation drawn at random each iteration and each step
  with gradient checkpointed (:class:`AlignProp`).
- ``draft``, DRaFT-K (Clark et al., arXiv 2309.17400): sampling without gradient for ``N - K`` steps, then the last
  ``K`` Euler steps with gradient, the final sample decoded and scored; loss ``-mean(r) * scale`` (K = 1 is DRaFT-1;
  ``train.direct.lv_samples = n`` is DRaFT-LV: the final sample noised ``n`` times to the last step, :class:`DRaFT`).

Both sample with the rollout's CFG (``sampling.guidance_scale``) and train through it, take one noise per image
(``sampling.group_size`` images per prompt, for logging and the group statistics), optionally add
``train.direct.kl_beta`` times the velocity KL to the base at the steps with gradient, and need differentiable rewards
(``score_with_grad``: ``clipscore``, ``pickscore``, ``hpsv2``, ``aesthetic``; a reward without it is refused naming
its key). Reward hacking is the
known failure of both: watch ``diversity/clip`` and the held-out evaluation, and end the run with ``run.stop_if``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..fields import check, config_section, setting
from .base import Samples, register_method
from .forward import ForwardProcess


@config_section("train", "direct", "the direct-reward methods' settings (train.method refl, draft, alignprop, srpo)")
@dataclass
class DirectConfig:
    """``train.direct.*``: ReFL and DRaFT-K (``train.method: refl | draft``)."""

    grad_steps: int = setting(1, "DRaFT-K's K: the last steps sampled with gradient (1: DRaFT-1)")
    refl_from: float = setting(0.75, "ReFL's step k is drawn from [int(refl_from N), N - 1] (official 30-39 of 40)")
    margin: Optional[float] = setting(None, "loss relu(margin - r) (ReFL's 2.0 for ImageReward); null: -r")
    scale: float = setting(1.0, "the loss times this (ReFL's grad_scale 1e-3)")
    kl_beta: float = setting(0.0, "weight of the velocity KL to the base at the steps with gradient (needs a LoRA)")
    alignprop_range: list[float] = setting(
        factory=lambda: [0.0, 1.0],
        help="AlignProp's truncation: the first step with gradient drawn from [int(lo N), min(int(hi N), N - 1)] "
        "each iteration (official (0, 50) of 50 steps)",
    )
    checkpoint_steps: bool = setting(
        True, "AlignProp: recompute each step's activations in backward (gradient checkpointing per step)"
    )
    lv_samples: int = setting(
        0,
        "DRaFT-LV: > 0 noises each final sample this many times to the last step's time and takes that step with "
        "gradient from each (needs grad_steps 1; the paper's n = 2); 0: DRaFT-K",
    )

    def __post_init__(self):
        check(self.grad_steps >= 1, "train.direct.grad_steps", ">= 1", self.grad_steps)
        check(0 <= self.refl_from < 1, "train.direct.refl_from", "in [0, 1)", self.refl_from)
        check(self.scale > 0, "train.direct.scale", "> 0", self.scale)
        check(self.kl_beta >= 0, "train.direct.kl_beta", ">= 0", self.kl_beta)
        r = self.alignprop_range
        ok = isinstance(r, (list, tuple)) and len(r) == 2 and 0 <= float(r[0]) <= float(r[1]) <= 1
        check(ok, "train.direct.alignprop_range", "[lo, hi] with 0 <= lo <= hi <= 1", r)
        check(self.lv_samples >= 0, "train.direct.lv_samples", ">= 0", self.lv_samples)
        check(
            self.lv_samples == 0 or self.grad_steps == 1,
            "train.direct.lv_samples",
            "0 unless train.direct.grad_steps is 1 (DRaFT-LV re-noises the last step only)",
            self.lv_samples,
        )
        self.alignprop_range = [float(x) for x in r]


@dataclass
class DirectSamples(Samples):
    """A rollout of a direct method: the images for the loop's rewards and where the steps with gradient start.

    Attributes:
        start (`torch.Tensor` of shape `(B, *latent_shape)`, float32): the state at step :attr:`step`, on the device.
        step (`int`): the grid index the steps with gradient start from.
        cond (`torch.Tensor` of shape `(B,)`, long): each sample's row of `table`. table: the prompt table.
        prompts (`list[str]`), metadata (`list[dict]`): each sample's, for the differentiable rewards.
        final (`torch.Tensor` of shape `(B, *latent_shape)`, float32): the clean latents the rollout ended at, on the
            device (SRPO's Direct-Align noises them again).
    """

    start: torch.Tensor
    step: int
    cond: torch.Tensor
    table: object
    prompts: list
    metadata: list
    final: torch.Tensor = None


class DirectReward(ForwardProcess):
    """Base of ReFL and DRaFT-K (module docstring). Args: as :class:`flowrl.methods.base.Method`.

    Raises:
        ConfigError: naming ``rewards.NAME`` for a weighted reward without ``score_with_grad`` (a video family takes
            ``frames`` over a differentiable image reward).
    """

    requires = ()
    """Nothing of the family: the direct-reward methods sample and decode (they run on the DDPM families too)."""
    differentiable_reward = True
    lockstep = True  # every process holds as many rows and starts its gradient at process 0's step: equal forwards

    @classmethod
    def check_config(cls, cfg) -> None:
        from ..fields import ConfigError

        cls.check_final_samples(cfg, "it back-propagates the reward")
        cls.check_base_reference(cfg, "train.direct.kl_beta", cfg.train.direct.kl_beta)
        if cfg.train.direct.lv_samples and cls.name != "draft":
            raise ConfigError(
                f"config key 'train.direct.lv_samples': DRaFT-LV is train.method 'draft' with grad_steps 1; "
                f"{cls.name!r} does not read it (set it to 0)"
            )

    def start_step(self, generator: torch.Generator) -> int:
        """The grid index where the steps with gradient start."""
        raise NotImplementedError

    def shared_start_step(self, generator: torch.Generator) -> int:
        """:meth:`start_step`, process 0's draw on every process: each then runs as many forwards with gradient, which
        FSDP2 needs (it gathers the weights at each forward, a collective call); one draw per iteration, as the
        papers draw it."""
        step = self.start_step(generator)
        accelerator = self.policy.accelerator
        if accelerator.num_processes > 1:
            step = int(accelerator.gather(torch.tensor([step], device=self.device))[0])
        return step

    def rollout(self, metas: list[dict], generator: torch.Generator) -> DirectSamples:
        """``G`` Euler samples per prompt without gradient: the final images for the loop's rewards and the state at
        :meth:`start_step` (drawn once per iteration, the same on every process)."""
        cfg, model = self.cfg, self.model
        step = self.shared_start_step(generator)
        table = model.prompt_table(metas)
        prompt_index = torch.arange(len(metas), device=self.device).repeat_interleave(cfg.sampling.group_size)
        cond = table.rows(prompt_index)
        x = torch.randn((len(cond), *model.latent_shape), generator=generator).to(self.device)
        velocity = self.chunked(model.velocity_fn(table, cfg.sampling.guidance_scale))
        sigmas = self.sigmas.to(self.device)
        start = x
        with torch.no_grad(), self.policy.autocast():
            for j in range(len(sigmas) - 1):
                if j == step:
                    start = x.clone()
                t = sigmas[j].expand(len(x))
                x = x + (sigmas[j + 1] - sigmas[j]) * velocity(x, t, cond).float()
        nfe = len(cond) * cfg.sampling.num_steps * model.cfg_rows(cfg.sampling.guidance_scale)
        picked = [metas[i] for i in prompt_index.tolist()]
        return DirectSamples(
            self.decode(x), prompt_index.cpu(), nfe, start, step, cond, table, [m["prompt"] for m in picked], picked, x
        )

    def advantages(self, samples, rewards, generator):
        """No advantages: every image enters the loss (``keep`` all); the group statistics are logged."""
        _, _, stats = self.group_advantages(rewards)
        n = len(samples.image_prompt)
        return torch.zeros(n), torch.ones(n, dtype=torch.bool), stats

    def predict(self, velocity, x: torch.Tensor, cond: torch.Tensor, step: int, kl: list) -> torch.Tensor:
        """The clean latents, with gradient, from the states `x` at grid index `step` (ReFL: one step's prediction;
        DRaFT: the last K Euler steps); appends each step's velocity KL to the base to `kl` when asked."""
        raise NotImplementedError

    def reward_with_grad(self, images: torch.Tensor, prompts: list, metadata: list) -> torch.Tensor:
        """``sum_k w_k r_k(images)`` `(b,)` with the graph back to `images`."""
        total = 0
        for reward, weight in self.rewards.rewards.values():
            if weight != 0:
                total = total + weight * reward.score_with_grad(images, prompts, metadata).to(images.device)
        return total

    def update(self, samples: DirectSamples, adv, keep, generator: torch.Generator) -> dict:
        """Optimizer steps over the images in minibatches: the steps with gradient, the decoder, the rewards and the
        loss (module docstring); returns ``policy/loss``, ``policy/reward`` (the differentiable total), ``policy/kl``,
        ``policy/grad_norm``, ``policy/optimizer_steps`` and ``cost/*``."""
        d, model = self.cfg.train.direct, self.model
        velocity = model.velocity_fn(samples.table, self.cfg.sampling.guidance_scale)

        def micro_loss(idx, stats, at):
            kl: list = []
            images = model.decode_with_grad(
                self.predict(velocity, samples.start[idx], samples.cond[idx], samples.step, kl), clean=self.clean
            )
            rows = idx.tolist()
            r = self.reward_with_grad(images, [samples.prompts[i] for i in rows], [samples.metadata[i] for i in rows])
            loss = (torch.relu(d.margin - r) if d.margin is not None else -r).mean() * d.scale
            if kl:
                loss = loss + d.kl_beta * torch.stack(kl).mean()
                stats["policy/kl"].append(torch.stack(kl).mean().item())
            stats["policy/reward"].append(r.mean().item())
            return loss

        stats, steps = self.optimizer_steps(len(samples.cond), generator, micro_loss)
        rows = len(samples.cond) * (len(self.sigmas) - 1 - samples.step if isinstance(self, DRaFT) else 1)
        nfe = rows * model.cfg_rows(self.cfg.sampling.guidance_scale) * (2 if d.kl_beta > 0 else 1)
        return self.update_metrics(stats, steps, rows, nfe, **{"policy/start_step": samples.step})

    checkpointed = False  # AlignProp: each step's forward recomputed in backward
    clean = False
    """:meth:`predict` gives clean latents at time 0 (ReFL), not the sampler's final states (DRaFT, AlignProp): what
    :meth:`~flowrl.models.FlowModel.decode_with_grad` is told (they differ for the DDPM families only)."""

    def _velocity(self, velocity, x, t, cond, kl: list) -> torch.Tensor:
        with self.policy.autocast():
            if self.checkpointed and self.cfg.train.direct.checkpoint_steps:
                from torch.utils.checkpoint import checkpoint

                v = checkpoint(velocity, x, t, cond, use_reentrant=False).float()
            else:
                v = velocity(x, t, cond).float()
        if self.cfg.train.direct.kl_beta > 0:
            with torch.no_grad(), self.model.reference(), self.policy.autocast():
                v_ref = velocity(x, t, cond).float()
            kl.append((v - v_ref).pow(2).flatten(1).mean(1).mean())
        return v


@register_method("refl", "direct reward: one late step with gradient")
class ReFL(DirectReward):
    """``train.method: refl`` (module docstring)."""

    clean = True

    def start_step(self, generator: torch.Generator) -> int:
        n = len(self.sigmas) - 1
        low = min(int(self.cfg.train.direct.refl_from * n), n - 1)
        return int(torch.randint(low, n, (1,), generator=generator))

    def predict(self, velocity, x, cond, step, kl):
        t = self.sigmas[step].to(x.device)
        v = self._velocity(velocity, x, t.expand(len(x)), cond, kl)
        return x - t * v  # x_t = (1 - t) x0 + t eps and v = eps - x0


@register_method("draft", "direct reward through the last K steps")
class DRaFT(DirectReward):
    """``train.method: draft``: DRaFT-K (module docstring), and DRaFT-LV with ``train.direct.lv_samples = n > 0``
    (Clark et al., arXiv 2309.17400, Sec. 4.3): each final sample ``x0`` noised ``n`` times with fresh noise to the last
    step's time ``t``, ``x_t = (1 - t) x0 + t eps_i``, and that one step taken with gradient from each, the ``n``
    rewards averaged (a lower-variance gradient of DRaFT-1 for ``n`` times its cost)."""

    def start_step(self, generator: torch.Generator) -> int:
        return max(0, len(self.sigmas) - 1 - self.cfg.train.direct.grad_steps)

    def rollout(self, metas: list[dict], generator: torch.Generator) -> DirectSamples:
        """:meth:`DirectReward.rollout`; for DRaFT-LV its trained rows are each sample's ``n`` re-noised copies."""
        samples = super().rollout(metas, generator)
        n = self.cfg.train.direct.lv_samples
        if n == 0:
            return samples
        final = samples.final.repeat_interleave(n, dim=0)  # (B n, ...): each sample's n copies together
        eps = torch.randn(final.shape, generator=generator).to(final.device)
        t = self.sigmas[samples.step].to(final.device)
        rows = torch.arange(len(samples.cond)).repeat_interleave(n).tolist()
        samples.start = (1 - t) * final + t * eps  # (B n, ...): the last step's state, noised n times
        samples.cond = samples.cond.repeat_interleave(n)
        samples.prompts = [samples.prompts[i] for i in rows]
        samples.metadata = [samples.metadata[i] for i in rows]
        samples.final = final
        return samples

    def predict(self, velocity, x, cond, step, kl):
        sigmas = self.sigmas.to(x.device)
        for j in range(step, len(sigmas) - 1):
            v = self._velocity(velocity, x, sigmas[j].expand(len(x)), cond, kl)
            x = x + (sigmas[j + 1] - sigmas[j]) * v
        return x


@register_method("alignprop", "direct reward through a random truncation")
class AlignProp(DRaFT):
    """``train.method: alignprop``: AlignProp (Prabhudesai et al., arXiv 2310.03739; mihirp1998/AlignProp, and trl's
    port): randomized truncated back-propagation. Each iteration the first step with gradient is drawn uniformly from
    ``train.direct.alignprop_range`` of the grid; every later step's velocity is computed with gradient (each step
    checkpointed: its activations recomputed in backward) and the final sample scored. With Euler steps the earlier
    steps, sampled without gradient, carry no gradient to the weights, so this is DRaFT with a random K per iteration
    (trl's port draws the truncation anew at every step; the paper, and flowrl, once per iteration)."""

    checkpointed = True

    def start_step(self, generator: torch.Generator) -> int:
        n = len(self.sigmas) - 1
        lo, hi = self.cfg.train.direct.alignprop_range
        low, high = min(int(lo * n), n - 1), min(int(hi * n), n - 1)
        return int(torch.randint(low, high + 1, (1,), generator=generator))
