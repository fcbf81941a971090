"""Does one policy update move log-probs in the direction of the advantages?

One rollout of the main job's sampler, random per-image advantages, one call of the GRPO method's
``optimize`` (its PPO epochs); then the log-probs of the same transitions are recomputed under the updated policy.
Prints the correlation between the change of log-prob and the advantage (> 0: the update favours
positive-advantage transitions) and the mean change.

    python benchmarks/policy_step_check.py [CONFIG] [key=value ...] [--out FILE.json]
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from flowrl.files import REPO_ROOT
from flowrl.presets import finish_preset_result, parse_preset_args, preset_parser

if TYPE_CHECKING:
    import torch


def log_probs(trainer, ro, rows, table) -> torch.Tensor:
    """float32 ``(M,)`` log-probs of transitions ``rows`` of ``ro`` under the current policy."""
    import torch

    from flowrl.samplers import recompute_log_prob

    velocity = trainer.model.velocity_fn(table, trainer.cfg.sampling.guidance_scale)
    tv = ro.select(rows)
    out = []
    with torch.no_grad(), trainer.policy.autocast():
        for start in range(0, len(tv), 64):
            sub = tv.select(torch.arange(start, min(start + 64, len(tv))))
            out.append(recompute_log_prob(sub, velocity(sub.state, sub.sigma, sub.cond))[0].float())
    return torch.cat(out)


def main(argv: list[str] | None = None) -> dict:
    args = parse_preset_args(
        preset_parser(__doc__.splitlines()[0], str(REPO_ROOT / "configs" / "tiny_geneval.yaml")), argv
    )
    import torch  # after the arguments: --help answers at once

    from flowrl.config import load_config
    from flowrl.trainer import Trainer

    trainer = Trainer(load_config(args.config, ["run.output_dir=runs/policy_step_check", *args.overrides]))
    gen = torch.Generator().manual_seed(0)
    samples = trainer.method.rollout(trainer.sample_prompts(0), gen)
    ro, images, table = samples.rollout, samples.images, samples.table
    advantages = torch.randn(len(images), generator=gen)[ro.leaf.cpu()].to(trainer.device)  # (M,)
    rows = ro.trained.nonzero().squeeze(1)
    before = log_probs(trainer, ro, rows, table)
    stats = trainer.method.optimize(ro, advantages, ro.trained.clone(), table, gen)
    change = log_probs(trainer, ro, rows, table) - before
    a = advantages[rows].float().cpu()
    result = {
        "corr_change_advantage": torch.corrcoef(torch.stack([change.cpu(), a]))[0, 1].item(),
        "mean_change": change.mean().item(),
        "optimizer_steps": stats["policy/optimizer_steps"],
        "clipfrac": stats["policy/clipfrac"],
    }
    print(result)
    return finish_preset_result(args, result)


if __name__ == "__main__":
    main()
