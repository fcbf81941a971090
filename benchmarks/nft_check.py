"""Does a forward-process method reach the held-out prompts where GRPO does not? DiffusionNFT on the main job.

DiffusionNFT (Zheng et al., arXiv 2509.16117; ../shared/ALGORITHMS.md "Forward-process methods") needs
no log-probs: each iteration draws ``sampling.group_size`` deterministic Euler samples (with the
config's guidance scale) of ``sampling.prompts_per_iteration`` training prompts, scores them, turns the
group-relative advantages into optimality weights ``r = clip(A / A_max) / 2 + 1/2`` and trains the
guided velocity with the negative-aware flow-matching loss (:func:`nft_loss`) on ``--timesteps`` noised
copies of every image of a group with reward variance, in ``--optimizer-steps`` steps. The old policy is
the one that drew the samples (DiffusionNFT's soft old-policy update at decay 0, which its schedule
starts from). It shares the trainer's model, LoRA, rewards, prompts, advantages and held-out evaluation
(``eval.*``, under ``run.mixed_precision``), so its accuracies compare with the main job's. Sampling and
training run under ``--precision`` (default bf16: there is no ratio to protect from rounding). A
diagnostic, not a flowrl method: no checkpoints, no resume.

    python benchmarks/nft_check.py [CONFIG] [key=value ...] [--iterations N] [--eval-every N]
        [--timesteps K] [--beta B] [--optimizer-steps S] [--precision bf16|no] [--save-lora DIR] [--out FILE.json]
"""

from __future__ import annotations

import time
from collections import defaultdict

import torch

from flowrl.advantages import group_advantages
from flowrl.config import finish_preset_result, load_config, parse_preset_args, preset_parser
from flowrl.trainer import Trainer
from samplers import ode_sample


def nft_loss(v: torch.Tensor, v_old: torch.Tensor, x_t: torch.Tensor, x0: torch.Tensor, t: torch.Tensor,
             r: torch.Tensor, beta: float = 1.0, adv_max: float = 5.0) -> torch.Tensor:
    """DiffusionNFT's negative-aware flow-matching loss (arXiv 2509.16117, Eq. 8 with its adaptive weight).

    ``v+ = beta v + (1 - beta) v_old`` and ``v- = (1 + beta) v_old - beta v`` are the implicit positive and
    negative policies; with ``x0(u) = x_t - t u`` and ``w(u) = mean |x0(u) - x0|`` (no gradient) the loss is
    ``A_max / beta * mean_b[r |x0(v+) - x0|^2 / w(v+) + (1 - r) |x0(v-) - x0|^2 / w(v-)]`` (squares
    averaged over C, H, W). At ``v = v_old`` its gradient is that of the advantage-weighted flow-matching
    loss ``(2 r - 1)``-scaled: towards the sample for ``r > 1/2``, away for ``r < 1/2``, none at 1/2.

    Args:
        v: ``(B, C, H, W)`` float32 velocity of the policy being trained (with gradient).
        v_old: ``(B, C, H, W)`` velocity of the old (sampling) policy at the same inputs, no gradient.
        x_t: ``(B, C, H, W)`` noised samples ``(1 - t) x0 + t eps``; x0: ``(B, C, H, W)`` clean samples.
        t: ``(B,)`` times in (0, 1] (1 = noise).
        r: ``(B,)`` optimality weights in [0, 1].
        beta: the implicit policies' step, > 0 (DiffusionNFT's GenEval setting is 1).
        adv_max: the advantage clip ``A_max`` that scaled ``r`` (restores the loss scale).

    Returns:
        Scalar float32 loss.

    Raises:
        ValueError: for ``beta <= 0`` or ``r`` outside [0, 1].
    """
    if beta <= 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    if r.min() < 0 or r.max() > 1:
        raise ValueError(f"optimality weights r must lie in [0, 1], got [{r.min().item()}, {r.max().item()}]")
    t = t.view(-1, *([1] * (x0.dim() - 1)))

    def weighted(u: torch.Tensor) -> torch.Tensor:  # (B,)
        err = x_t - t * u - x0
        scale = err.detach().abs().mean(dim=tuple(range(1, err.dim())), keepdim=True).clamp(min=1e-5)
        return (err**2 / scale).mean(dim=tuple(range(1, err.dim())))

    positive = weighted(beta * v + (1 - beta) * v_old)
    negative = weighted((1 + beta) * v_old - beta * v)
    return (adv_max / beta * (r * positive + (1 - r) * negative)).mean()


def nft_iteration(trainer: Trainer, it: int, timesteps: int, beta: float, optimizer_steps: int,
                  precision: str = "bf16") -> dict:
    """One DiffusionNFT iteration of ``trainer``'s configuration (see the module docstring).

    Returns:
        ``{"reward": mean reward, "zero_variance_frac": float, "rows": trained rows, "loss": mean loss,
        "seconds": wall time}``.
    """
    cfg, model, t0 = trainer.cfg, trainer.model, time.time()
    gen = trainer._generator(it)
    metas = trainer.sample_prompts(it)
    table = model.encode([""] + [m["prompt"] for m in metas])
    cond = torch.arange(len(metas), device=trainer.device).repeat_interleave(cfg.sampling.group_size) + 1  # (B,)
    noise = torch.randn((len(cond), *model.latent_shape), generator=gen).to(trainer.device)
    velocity = model.velocity_fn(table, cfg.sampling.guidance_scale)  # guided, against the empty prompt (row 0)
    with torch.no_grad(), trainer._autocast(precision):
        x0 = ode_sample(velocity, noise, cond, trainer.sigmas.to(trainer.device))
    scores = trainer.score(trainer._decode(x0), (cond - 1).cpu(), metas).total
    adv, zero = group_advantages(scores, cond.cpu(), cfg.train.adv_std, cfg.train.adv_clip_max)
    result = {"reward": scores.mean().item(), "zero_variance_frac": zero.float().mean().item(), "rows": 0, "loss": 0.0}
    rows = (~zero).nonzero().squeeze(1).repeat_interleave(timesteps)  # (N,) K noised copies of each image
    if len(rows):
        sig = trainer.sigmas[:-1]  # the sampler's own times
        t = sig[torch.randint(0, len(sig), (len(rows),), generator=gen)].to(trainer.device)
        eps = torch.randn((len(rows), *model.latent_shape), generator=gen).to(trainer.device)
        x_0, c = x0[rows], cond[rows.to(trainer.device)]
        x_t = (1 - t.view(-1, 1, 1, 1)) * x_0 + t.view(-1, 1, 1, 1) * eps
        r = (adv[rows] / cfg.train.adv_clip_max / 2 + 0.5).clamp(0, 1).to(trainer.device)
        with torch.no_grad(), trainer._autocast(precision):
            v_old = trainer._chunked(velocity, cfg.sampling.batch_size)(x_t, t, c)
        stats = defaultdict(list)
        for part in torch.randperm(len(rows), generator=gen).chunk(optimizer_steps):
            with trainer._autocast(precision):
                v = velocity(x_t[part], t[part], c[part])
            loss = nft_loss(v, v_old[part], x_t[part], x_0[part], t[part], r[part], beta, cfg.train.adv_clip_max)
            trainer.accelerator.backward(loss)
            trainer._step_optimizer(loss.item(), stats)  # the trainer's clip, AdamW step and EMA update
        result.update(rows=len(rows), loss=sum(stats["policy/loss"]) / len(stats["policy/loss"]))
    return {**result, "seconds": time.time() - t0}


def main(argv: list[str] | None = None) -> dict:
    parser = preset_parser(__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=50)
    parser.add_argument("--eval-every", type=int, default=0, help="also evaluate every N iterations (0: at the end only)")
    parser.add_argument("--timesteps", type=int, default=4, help="noised copies of each image per iteration")
    parser.add_argument("--beta", type=float, default=1.0)
    parser.add_argument("--optimizer-steps", type=int, default=2, help="optimizer steps per iteration")
    parser.add_argument("--precision", choices=("bf16", "no"), default="bf16", help="of sampling and training")
    parser.add_argument("--save-lora", default="", help="write the trained LoRA here (diffusers format, for flowrl eval)")
    parser.add_argument("--skip-before", action="store_true", help="do not evaluate the base first")
    args = parse_preset_args(parser, argv)
    if args.iterations < 1 or args.timesteps < 1 or args.optimizer_steps < 1:
        parser.error("--iterations, --timesteps and --optimizer-steps must be at least 1")
    trainer = Trainer(load_config(args.config, ["run.output_dir=runs/nft_check", *args.overrides]))
    evals, start = {}, time.time()
    if not args.skip_before:
        evals[0] = trainer.run_eval()
    history = []
    for it in range(args.iterations):
        history.append(nft_iteration(trainer, it, args.timesteps, args.beta, args.optimizer_steps,
                                     args.precision))
        h = history[-1]
        print(f"iteration {it + 1}: reward {h['reward']:.3f}, {h['rows']} rows, loss {h['loss']:.3f}, {h['seconds']:.1f} s",
              flush=True)
        if (args.eval_every and (it + 1) % args.eval_every == 0) or it + 1 == args.iterations:
            evals[it + 1] = trainer.run_eval()
            print(f"held-out strict accuracy after {it + 1} iterations: {evals[it + 1]['overall']:.3f}", flush=True)
    if args.save_lora:
        trainer.model.save_lora(args.save_lora)
    result = {"held_out": {k: {"overall": v["overall"], "per_tag": v["per_tag"]} for k, v in evals.items()},
              "train_reward": [h["reward"] for h in history], "trained_rows": [h["rows"] for h in history],
              "seconds_per_iteration_median": sorted(h["seconds"] for h in history)[len(history) // 2],
              "wall_time_s": time.time() - start}
    return finish_preset_result(args, result)


if __name__ == "__main__":
    main()
