"""What ``sampling.decode_precision=bf16`` costs and changes: VAE decode time of 64 rollout latents in float32
and under bf16 autocast, and the main job's reward on the same rollouts decoded both ways.

    python benchmarks/decode_precision_check.py [--rollouts 8] [--decode-chunk 32] [key=value ...]
        (key=value: overrides of configs/tiny_geneval.yaml; --decode-chunk: latents per VAE call, FlowModel.decode_chunk)
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

from flowrl.files import REPO_ROOT


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rollouts", type=int, default=8, help="main-job rollouts (64 images each) scored both ways")
    p.add_argument(
        "--decode-chunk",
        type=int,
        default=None,
        help="latents per VAE decode call (default: FlowModel's, 32; 64 times one call per rollout)",
    )
    p.add_argument("overrides", nargs="*")
    a = p.parse_args(argv)
    import torch  # after the arguments: --help answers at once

    from flowrl.config import load_config
    from flowrl.trainer import Trainer

    with tempfile.TemporaryDirectory() as tmp:
        trainer = Trainer(
            load_config(
                REPO_ROOT / "configs" / "tiny_geneval.yaml",
                [f"run.output_dir={tmp}/run", "eval.every=0", *a.overrides],
            )
        )
        s = trainer.cfg.sampling
        if a.decode_chunk is not None:
            trainer.model.decode_chunk = a.decode_chunk
        scores, max_diff, times = {"no": [], "bf16": []}, 0.0, {"no": [], "bf16": []}
        for it in range(a.rollouts):
            metas = trainer.sample_prompts(it)
            ro = trainer.method.rollout(metas, trainer._generator(it)).rollout
            expanded = [m for m in metas for _ in range(s.group_size)]
            images = {}
            for precision in ("no", "bf16"):
                s.decode_precision = precision
                t0 = time.time()
                images[precision] = trainer.method.decode(ro.final)
                times[precision].append(time.time() - t0)
                total = trainer.rewards(images[precision], [m["prompt"] for m in expanded], expanded)
                scores[precision].append(getattr(total, "total", total))
            max_diff = max(max_diff, (images["no"] - images["bf16"]).abs().max().item())
    full, half = torch.cat(scores["no"]), torch.cat(scores["bf16"])
    result = {
        "images": len(full),
        "decode_chunk": trainer.model.decode_chunk,
        "decode_s_float32": statistics.median(times["no"]),
        "decode_s_bf16": statistics.median(times["bf16"]),
        "identical_reward_frac": (full == half).float().mean().item(),
        "mean_reward_float32": full.mean().item(),
        "mean_reward_bf16": half.mean().item(),
        "max_pixel_diff": max_diff,
    }
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
