"""Flow-GRPO (arXiv 2505.05470) on flowrl's tiny model in one readable file, the way cleanrl writes PPO.

This is what ``flowrl train configs/flow_grpo.yaml`` runs through :class:`flowrl.Trainer`, written out top to bottom
on flowrl's parts: the model adapter (prompt table, guided velocity, decode), :mod:`flowrl.samplers` (the Flow-GRPO
SDE step plan and its stored transitions), :mod:`flowrl.advantages` and :mod:`flowrl.losses`. One iteration:

1. draw ``prompts_per_iteration`` prompts (a tag at random, then a prompt of it) and ``group_size`` SDE rollouts of
   each from the current policy, storing every transition ``(x, x', mean, std, log_prob)``;
2. score the images with the tiny world's GenEval reward;
3. advantages: group z-scores with the std of the whole batch, clipped to +-5; groups with equal rewards drop out;
4. one pass of PPO over the kept transitions in minibatches: the log-probs recomputed in float32 at the std that drew
   each sample, ``max(-A r, -A clip(r, 1 - eps, 1 + eps))``, AdamW with gradient clipping.

No evaluation, checkpoints, several processes or other rollout shapes: for those use the trainer. A test
(``tests/test_example.py``) checks that one iteration of this file ends on the trainer's LoRA weights (1e-6).

    python examples/minimal_flow_grpo.py --iterations 60 --seed 0
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import time
from collections import defaultdict

import torch

from flowrl.advantages import group_advantages
from flowrl.data import read_prompts
from flowrl.losses import ppo_loss
from flowrl.models import load_model
from flowrl.rewards import WeightedSum, build_reward
from flowrl.samplers import StepPlan, recompute_log_prob, sample, start_latents


@dataclasses.dataclass
class Args:
    """The settings of ``configs/flow_grpo.yaml`` (through its base ``tiny_geneval.yaml``) that this file uses."""

    model: str = "assets/tiny-sd3"  # a StableDiffusion3Pipeline folder
    prompts: str = "train"  # the shipped GenEval-style train prompts, or a .jsonl file
    seed: int = 0
    iterations: int = 60
    num_steps: int = 10  # denoising steps of a rollout
    guidance_scale: float = 4.5
    noise_level: float = 0.7  # Flow-GRPO's a: sigma_t = a sqrt(t / (1 - t))
    group_size: int = 8  # G images per prompt
    prompts_per_iteration: int = 8
    batch_size: int = 64  # images per sampler forward
    lora_rank: int = 16
    lora_alpha: float = 32.0
    learning_rate: float = 3e-4
    weight_decay: float = 1e-4
    max_grad_norm: float = 1.0
    clip_range: float = 1e-4  # PPO's eps on the ratio (log-probs are means over latent dimensions)
    adv_clip_max: float = 5.0
    minibatch_size: int = 72  # transitions per optimizer step


def sample_prompts(records: list[dict], seed: int, iteration: int, n: int) -> list[dict]:
    """`n` prompt records, each of a tag drawn uniformly (the trainer's ``tag_balanced``), seeded by iteration."""
    rng = random.Random(seed * 7919 + iteration * 104729)
    by_tag = defaultdict(list)
    for r in records:
        by_tag[r.get("tag", "all")].append(r)
    tags = sorted(by_tag)
    return [rng.choice(by_tag[rng.choice(tags)]) for _ in range(n)]


def chunked(velocity, size: int):
    """`velocity` over at most `size` rows at a time (bounds the activation memory of one forward)."""

    def fn(x, t, cond):
        return torch.cat(
            [velocity(x[i : i + size], t[i : i + size], cond[i : i + size]) for i in range(0, len(x), size)]
        )

    return fn


@torch.no_grad()
def rollout(model, metas: list[dict], sigmas: torch.Tensor, args: Args, generator: torch.Generator):
    """``G`` Flow-GRPO SDE rollouts per prompt (every step stochastic, all but the last trained).

    Returns:
        ``(transitions, images (B, 3, H, W) in [0, 1], prompt index (B,), prompt table)``.
    """
    table = model.prompt_table(metas)  # the empty prompt (CFG's negative) and the prompts
    velocity = chunked(model.velocity_fn(table, args.guidance_scale), args.batch_size)
    prompt_index = torch.arange(len(metas)).repeat_interleave(args.group_size)  # (B,) the groups
    noise = torch.randn((len(prompt_index), *model.latent_shape), generator=generator)
    noise = start_latents(noise, sigmas[0])
    plan = StepPlan.sde(args.num_steps, kernel="flow_sde", noise_level=args.noise_level)
    ro = sample(
        velocity,
        noise.to(model.device),
        table.rows(prompt_index),
        prompt_index,
        sigmas.to(model.device),
        plan,
        generator=generator,
    )
    size = args.batch_size
    images = torch.cat([model.decode(ro.final[i : i + size]) for i in range(0, len(ro.final), size)]).cpu()
    return ro, images, prompt_index, table


def advantages(rewards: torch.Tensor, prompt_index: torch.Tensor, ro, args: Args):
    """Per-transition advantages `(M,)` (each its image's group z-score) and the transitions that enter the loss."""
    adv, zero = group_advantages(rewards, prompt_index, std="global", clip=args.adv_clip_max)  # (B,) each
    leaf = ro.leaf.cpu()
    return adv[leaf].to(ro.state.device), ro.trained & ~zero[leaf].to(ro.state.device)


def ppo_update(
    model,
    table,
    ro,
    adv: torch.Tensor,
    keep: torch.Tensor,
    params: list,
    optimizer,
    args: Args,
    generator: torch.Generator,
) -> dict[str, float]:
    """One PPO pass over the kept transitions in a random order, one AdamW step per minibatch."""
    rows = keep.nonzero().squeeze(1)
    kept, adv = ro.select(rows), adv[rows]
    velocity = model.velocity_fn(table, args.guidance_scale)  # guided, as the rollout
    order = torch.randperm(len(kept), generator=generator).to(model.device)
    stats = defaultdict(list)
    model.transformer.train()
    for start in range(0, len(kept), args.minibatch_size):
        mb = order[start : start + args.minibatch_size]
        sub = kept.select(mb)
        v = velocity(sub.state, sub.sigma, sub.cond)  # (m, C, H, W) the current policy
        log_prob, _ = recompute_log_prob(sub, v)  # float32 at the std that drew each sample
        loss, st = ppo_loss(log_prob, sub.log_prob, adv[mb], args.clip_range)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        stats["loss"].append(loss.item())
        stats["grad_norm"].append(grad_norm.item())
        stats["clipfrac"].append(st["policy/clipfrac"].item())
        stats["approx_kl"].append(st["policy/approx_kl"].item())
    model.transformer.eval()
    return {k: sum(v) / len(v) for k, v in stats.items()}


def train(args: Args, log=print) -> dict:
    """Run `args.iterations` iterations of Flow-GRPO on the CPU.

    Returns:
        ``{"weights": {name: tensor}, "rewards": [mean reward per iteration]}``: the trained LoRA and the curve.
    """
    model = load_model(args.model, "cpu")
    torch.manual_seed(args.seed)  # the LoRA's initialisation
    params = model.add_lora(args.lora_rank, args.lora_alpha)
    optimizer = torch.optim.AdamW(params, lr=args.learning_rate, weight_decay=args.weight_decay)
    reward = WeightedSum({"geneval": (build_reward("geneval"), 1.0)})
    records = read_prompts(args.prompts)
    sigmas = model.sigmas(args.num_steps)  # the model scheduler's own schedule and shift
    curve = []
    for it in range(args.iterations):
        t0 = time.time()
        generator = torch.Generator().manual_seed(args.seed * 1_000_003 + it * 1009)  # every random draw
        metas = sample_prompts(records, args.seed, it, args.prompts_per_iteration)
        ro, images, prompt_index, table = rollout(model, metas, sigmas, args, generator)
        leaf_metas = [{**metas[i], "group": i} for i in prompt_index.tolist()]
        total = reward(images, [m["prompt"] for m in leaf_metas], leaf_metas).total  # (B,)
        adv, keep = advantages(total, prompt_index, ro, args)
        stats = ppo_update(model, table, ro, adv, keep, params, optimizer, args, generator)
        curve.append(total.mean().item())
        # what shows learning: the reward and how far the update moved the policy (the PPO loss at ratio 1 is ~0)
        log(
            f"iteration {it + 1}: reward {curve[-1]:.3f}, approx KL {stats.get('approx_kl', 0.0):.2e}, "
            f"clipfrac {stats.get('clipfrac', 0.0):.3f}, {time.time() - t0:.1f} s"
        )
    weights = {n: p.detach().clone() for n, p in model.transformer.named_parameters() if p.requires_grad}
    return {"weights": weights, "rewards": curve}


def main(argv: list[str] | None = None) -> dict:
    """Command line: every field of :class:`Args` as ``--field value``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for f in dataclasses.fields(Args):
        parser.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=f.default)
    return train(Args(**vars(parser.parse_args(argv))))


if __name__ == "__main__":
    main()
