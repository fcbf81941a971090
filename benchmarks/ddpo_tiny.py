"""Does DDPO learn on a CPU in minutes? JPEG compressibility of a tiny random SD 1.x UNet under DDPO's recipe.

Builds a seeded random-weight ``StableDiffusionPipeline`` (:func:`flowrl.tiny.sd15.build_random_sd15_pipeline`, 64 px
images from 16x16x4 latents; a 53K-parameter UNet) and trains ``configs/recipes/sd15_ddpo.yaml`` on it shrunk to CPU size
(:data:`CPU_OVERRIDES`): 20 DDIM steps at eta 1 with every step trained, guidance 5, 2 prompts x 8 images per iteration
from 4 ImageNet animal names (DDPO's prompt set), z-scored advantages within each prompt's group, 2 optimizer steps
per iteration, the JPEG size reward. A random UNet draws noise, whose JPEG is large (about 4 kB at quality 95); a
constant latent decodes to about 2.7 kB, so there is room to learn. Deviations from the recipe, for a tiny model: the
whole UNet is trained, lr 3e-3, PPO clip 1e-2. In single 25-iteration runs (seed 0) these moved the rollouts' JPEG
size by 0.23 kB; rank-8 LoRA on the UNet's attention (lr 1e-2, clip 1e-2) by 0.02 kB; the whole UNet at DDPO's clip
1e-4 (lr 1e-3 or 1e-2) by 0.04-0.05 kB, with 16-47% of the transitions clipped. Any of them can be given back as an
override.

For each seed in ``--seeds`` (``run.seed``; the model is the same, ``--model-seed``) it trains ``--iterations``
iterations into ``WORKDIR/seed-N`` and prints the mean JPEG size (kB) of the rollouts of the first and last 5
iterations, and of the ODE (eta 0) samples of 16 fixed-seed evaluation images before and after training. It
writes the per-iteration curves to ``--out`` (JSON) and ``--plot`` (PNG).

    python benchmarks/ddpo_tiny.py [CONFIG] [key=value ...] [--seeds 0 1 2] [--iterations 60] [--model-seed 0]
        [--workdir runs/ddpo_tiny] [--out FILE.json] [--plot FILE.png]

On a CPU shared with other jobs, ``OMP_NUM_THREADS=1`` keeps the tiny model's many small kernels from stalling on
busy cores (about 4 s an iteration with it, 30 s with 2 threads, on 2 cores with a test suite running beside it).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from flowrl.data import write_jsonl
from flowrl.files import REPO_ROOT
from flowrl.presets import finish_preset_result, parse_preset_args, preset_parser

PROMPTS = ["cat", "dog", "horse", "monkey"]
"""Training prompts: ImageNet animal names, as DDPO's ``imagenet_animals`` prompt function draws them."""

EVAL_REPEATS = 4
"""Evaluation images per prompt (image i of the prompt file drawn from seed ``eval.seed + i``): 16 in all."""

EDGE = 5
"""Iterations averaged for the start and end of the training curve."""

CPU_OVERRIDES = {
    "model.resolution": "null",
    "model.dtype": "float32",
    "model.lora_rank": 0,
    "sampling.num_steps": 20,
    "sampling.group_size": 8,
    "sampling.prompts_per_iteration": 2,
    "sampling.batch_size": 16,
    "train.learning_rate": 3.0e-3,
    "train.clip_range": 1.0e-2,
    "train.minibatch_size": 160,
    "train.micro_batch_size": "null",
    "eval.num_steps": 20,
    "run.device": "cpu",
    "run.mixed_precision": "no",
    "run.keep_checkpoints": 1,
}
"""configs/recipes/sd15_ddpo.yaml shrunk to a CPU: 16 images x 20 steps = 320 transitions per iteration, 2 minibatches of 160
(DDPO's 2 optimizer steps per epoch); the whole tiny UNet trained, lr and clip as the docstring says."""


def train_seed(args, seed: int, pipeline: Path, prompts: Path, evals: Path) -> dict:
    """Train one seed into ``WORKDIR/seed-N``; its per-iteration JPEG sizes (kB), start/end means and evaluations."""
    from flowrl.config import load_config
    from flowrl.trainer import Trainer

    out = Path(args.workdir) / f"seed-{seed}"
    over = [f"{k}={v}" for k, v in CPU_OVERRIDES.items()] + [
        f"model.path={pipeline}",
        f"train_prompts={prompts}",
        f"eval.prompts={evals}",
        f"run.output_dir={out}",
        f"run.seed={seed}",
        f"run.iterations={args.iterations}",
        f"run.save_every={args.iterations}",
    ]
    cfg = load_config(args.config, over + args.overrides)
    t0 = time.time()
    result = Trainer(cfg).train()
    wall = time.time() - t0
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    kb = [-m["reward/jpeg_compressibility/mean"] for m in metrics]  # the reward is minus the JPEG size in kB
    edge = min(EDGE, len(kb))
    row = {
        "seed": seed,
        "jpeg_kb": kb,
        "start_kb": sum(kb[:edge]) / edge,
        "end_kb": sum(kb[-edge:]) / edge,
        "eval_before_kb": -result["before"]["per_reward"]["jpeg_compressibility"],
        "eval_after_kb": -result["after"]["per_reward"]["jpeg_compressibility"],
        "wall_s": wall,
        "s_per_iteration": metrics[-1]["time/elapsed_s"] / len(metrics),
        "run": str(out),
    }
    print(
        f"seed {seed}: rollouts {row['start_kb']:.3f} -> {row['end_kb']:.3f} kB (first/last {edge} iterations), "
        f"evaluation {row['eval_before_kb']:.3f} -> {row['eval_after_kb']:.3f} kB, {wall / 60:.1f} min"
    )
    return row


def save_plot(rows: list[dict], path: str) -> None:
    """Per-iteration mean JPEG size of the rollouts (points) and its 5-iteration moving average, one colour a seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from flowrl.plots import moving_average

    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=100)
    for i, row in enumerate(rows):
        x = range(1, len(row["jpeg_kb"]) + 1)
        ax.plot(x, row["jpeg_kb"], ".", color=f"C{i}", alpha=0.35)
        ax.plot(x, moving_average(row["jpeg_kb"], EDGE), color=f"C{i}", label=f"seed {row['seed']}")
    ax.set(
        xlabel="iteration",
        ylabel="JPEG size of rollouts (kB, lower = better)",
        title="DDPO on a tiny random SD 1.x UNet, CPU",
    )
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    parser = preset_parser(__doc__.splitlines()[0], str(REPO_ROOT / "configs" / "recipes" / "sd15_ddpo.yaml"))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="run.seed of each training run")
    parser.add_argument("--iterations", type=int, default=60, help="iterations per seed (>= 1)")
    parser.add_argument("--model-seed", type=int, default=0, help="seed of the random pipeline's weights")
    parser.add_argument("--workdir", default="runs/ddpo_tiny", help="folder of the pipeline, prompts and run folders")
    parser.add_argument("--plot", default="", help="also draw the curves to this PNG")
    args = parse_preset_args(parser, argv)
    if args.iterations < 1:
        parser.error(f"--iterations must be >= 1; got {args.iterations}")
    work = Path(args.workdir)
    busy = [s for s in args.seeds if (work / f"seed-{s}").exists()]
    if busy:
        parser.error(f"--workdir {work} already holds seed-{busy[0]}; remove it or pick another --workdir")
    from flowrl.evaluation import machine  # after the arguments: --help answers at once, before torch
    from flowrl.tiny.sd15 import build_random_sd15_pipeline

    pipeline = work / f"pipeline-{args.model_seed}"
    if not (pipeline / "model_index.json").is_file():
        build_random_sd15_pipeline(pipeline, seed=args.model_seed, sample_size=16)
    write_jsonl([{"prompt": p} for p in PROMPTS], work / "prompts.jsonl")
    write_jsonl([{"prompt": p} for p in PROMPTS for _ in range(EVAL_REPEATS)], work / "eval_prompts.jsonl")
    rows = [train_seed(args, s, pipeline, work / "prompts.jsonl", work / "eval_prompts.jsonl") for s in args.seeds]
    if args.plot:
        save_plot(rows, args.plot)
    return finish_preset_result(args, {"rows": rows, "model_seed": args.model_seed, "machine": machine()})


if __name__ == "__main__":
    main()
