"""Which denoising steps decide the reward? (Where GRPO's credit can be assigned.)

For each step k of the training sampler, every image of a group starts from the same initial noise and
the rollout is an ODE everywhere except at step k, where it takes the configured SDE step. The mean
within-group variance of the reward is then the variance that step k's noise alone explains. Steps
whose noise explains next to nothing only add noise to the policy gradient; a window
(``sampling.window.size`` with ``schedule=fixed``) that trains just the steps that matter is the cure
(MixGRPO, arXiv 2507.21802, trains a window of steps for this kind of reason).

    python benchmarks/step_influence.py [CONFIG] [key=value ...] [--iterations N] [--out FILE.json]

Prints one line per step and, last, the within-group variance of the same prompts when every step is
SDE with independent initial noise (the main job's sampler), for scale.
"""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING

from flowrl.files import REPO_ROOT
from flowrl.presets import finish_preset_result, parse_preset_args, preset_parser

if TYPE_CHECKING:
    from flowrl.trainer import Trainer


def within_group_variance(trainer: Trainer, iterations: int) -> tuple[float, float]:
    """Mean reward and mean within-group (population) variance of the reward over ``iterations`` rollouts
    of the trainer's current sampler (prompts and generators of iterations 0..iterations-1)."""
    import torch

    means, within = [], []
    for it in range(iterations):
        metas = trainer.sample_prompts(it)
        samples = trainer.method.rollout(metas, trainer._generator(it))
        ro, images = samples.rollout, samples.images
        group = ro.group.cpu()
        with torch.no_grad():
            scores = trainer.score(images, group, metas).total
        means.append(scores.mean().item())
        within += [scores[group == p].var(unbiased=False).item() for p in range(len(metas))]
    return statistics.mean(means), statistics.mean(within)


def main(argv: list[str] | None = None) -> dict:
    parser = preset_parser(__doc__.splitlines()[0], str(REPO_ROOT / "configs" / "tiny_geneval.yaml"))
    parser.add_argument(
        "--iterations", type=int, default=2, help="rollouts (of prompts_per_iteration groups) per step"
    )
    args = parse_preset_args(parser, argv)
    from flowrl.config import load_config  # after the arguments: --help answers at once, before torch
    from flowrl.trainer import Trainer

    common = ["run.output_dir=runs/step_influence", *args.overrides]
    one_step = Trainer(
        load_config(
            args.config,
            [*common, "sampling.shared_noise=true", "sampling.window.size=1", "sampling.window.schedule=fixed"],
        )
    )
    window, sigmas = one_step.method.shape.window, one_step.method.sigmas  # MixGRPO's one-step window, placed by hand
    rows = []
    for k in range(window.last + 1):
        window.start = k
        mean, var = within_group_variance(one_step, args.iterations)
        rows.append({"step": k, "sigma": sigmas[k].item(), "reward_mean": mean, "within_group_var": var})
        print(
            f"step {k} (sigma {rows[-1]['sigma']:.2f}): reward {mean:.3f}, within-group variance {var:.4f}", flush=True
        )
    mean, var = within_group_variance(Trainer(load_config(args.config, common)), args.iterations)
    print(f"every step SDE, independent initial noise: reward {mean:.3f}, within-group variance {var:.4f}")
    result = {
        "per_step": rows,
        "full_sde": {"reward_mean": mean, "within_group_var": var},
        "iterations": args.iterations,
    }
    return finish_preset_result(args, result)


if __name__ == "__main__":
    main()
