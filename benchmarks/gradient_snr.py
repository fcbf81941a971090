"""Is one iteration's policy gradient signal or noise? Cosine between independent batches' gradients.

Each of ``--batches`` rollouts of the config's sampler (its own prompts and seeds, the base policy)
gives the GRPO policy gradient at ratio 1, ``-mean_m A_m grad log p_m`` over the kept transitions
(group advantages as the trainer computes them), flattened over the trainable parameters. If the
gradient were mostly signal, two independent batches would point the same way (cosine near 1); a
cosine near 0 means one iteration's update is mostly noise, and the policy random-walks. With
gradients ``s + n_i`` whose noise has variance ``sigma^2 / B`` for B images, the expected cosine is
``|s|^2 / (|s|^2 + sigma^2 / B)``: a batch ``(1 - c) / c`` times larger lifts a cosine ``c`` to 1/2.

    python benchmarks/gradient_snr.py [CONFIG] [key=value ...] [--batches 3] [--out FILE.json]
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

from flowrl.files import REPO_ROOT
from flowrl.presets import finish_preset_result, parse_preset_args, preset_parser

if TYPE_CHECKING:
    import torch

    from flowrl.trainer import Trainer


def policy_gradient(trainer: Trainer, iteration: int) -> torch.Tensor:
    """float32 ``(P,)``: the flattened gradient of ``-mean(A log p)`` at the current policy for the rollout of
    ``iteration`` (its prompts and generator); groups with zero reward variance are left out as in training."""
    import torch

    from flowrl.advantages import group_advantages
    from flowrl.samplers import recompute_log_prob

    t = trainer.cfg.train
    metas = trainer.sample_prompts(iteration)
    samples = trainer.method.rollout(metas, trainer._generator(iteration))
    ro, images, table = samples.rollout, samples.images, samples.table
    group = ro.group.cpu()
    with torch.no_grad():
        total = trainer.score(images, group, metas).total
    adv, zero = group_advantages(total, group, t.adv_std, t.adv_clip_max)
    rows = (ro.trained & ~zero.to(ro.trained.device)[ro.leaf]).nonzero().squeeze(1)
    tv, a = ro.select(rows), adv.to(trainer.device)[ro.leaf][rows]
    velocity = trainer.model.velocity_fn(table, trainer.cfg.sampling.guidance_scale)
    for p in trainer.policy.params.values():
        p.grad = None
    for start in range(0, len(tv), 64):
        sub = tv.select(torch.arange(start, min(start + 64, len(tv)), device=rows.device))
        with trainer.policy.autocast():
            v = velocity(sub.state, sub.sigma, sub.cond)
        log_prob, _ = recompute_log_prob(sub, v)
        (-(a[start : start + 64] * log_prob).sum() / max(len(tv), 1)).backward()
    return torch.cat([p.grad.flatten().float() for p in trainer.policy.params.values()])


def main(argv: list[str] | None = None) -> dict:
    parser = preset_parser(__doc__.splitlines()[0], str(REPO_ROOT / "configs" / "tiny_geneval.yaml"))
    parser.add_argument("--batches", type=int, default=3, help="independent rollouts (>= 2)")
    args = parse_preset_args(parser, argv)
    if args.batches < 2:
        parser.error(f"--batches must be >= 2; got {args.batches}")
    import torch  # after the arguments: --help answers at once

    from flowrl.config import load_config
    from flowrl.trainer import Trainer

    trainer = Trainer(load_config(args.config, ["run.output_dir=runs/gradient_snr", *args.overrides]))
    grads = [policy_gradient(trainer, it) for it in range(args.batches)]
    cos = [torch.nn.functional.cosine_similarity(x, y, dim=0).item() for x, y in itertools.combinations(grads, 2)]
    images = trainer.cfg.sampling.prompts_per_iteration * trainer.cfg.sampling.group_size
    result = {
        "pairwise_cosine": cos,
        "mean_cosine": sum(cos) / len(cos),
        "grad_norms": [g.norm().item() for g in grads],
        "images_per_batch": images,
    }
    print(
        f"{images} images per batch: pairwise cosines {[round(c, 3) for c in cos]}, mean {result['mean_cosine']:.3f}"
    )
    return finish_preset_result(args, result)


if __name__ == "__main__":
    main()
