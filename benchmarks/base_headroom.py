"""How much can RL on this base gain, and where does the base fail? Pass@k and denoising from real scenes.

Two measurements of a model (optionally with a LoRA) on a GenEval-style prompt file:

- *Pass@k per tag*: ``k`` ODE samples of every prompt (seeds ``seed + j``); the per-tag mean strict
  accuracy and the fraction of prompts with at least one correct sample among the ``k``. A method that
  only sharpens the base's own distribution towards its correct samples (what GRPO does in a few hundred
  updates) is bounded by pass@k for large k; a tag whose pass@k is near 0 has no correct sample to
  reinforce.
- *Denoising from rendered scenes*: ground-truth scenes of the same prompts are encoded by the VAE,
  noised to time ``t`` (``x_t = (1 - t) x_0 + t eps``) and ODE-denoised by the model from ``t`` with the
  prompt (SDEdit, arXiv 2108.01073). Strict accuracy against ``t`` shows at which noise level the model
  loses the scene: ``t = 0`` is the VAE's reconstruction.

    python benchmarks/base_headroom.py [--model assets/tiny-sd3] [--lora DIR] [--prompts test] [-k 8]
        [--times 0 0.4 0.6 0.8] [--num-steps 20] [--max-prompts N] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import random
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING

from flowrl.data import REPO_ROOT, read_prompts

if TYPE_CHECKING:
    from flowrl.models import FlowModel


def pass_at_k(
    model: FlowModel, metas: list[dict], k: int, num_steps: int = 20, guidance_scale: float = 4.5, seed: int = 1234
) -> dict[str, dict[str, float]]:
    """Per-tag mean strict accuracy and pass@k of ``k`` ODE samples per prompt.

    Args:
        metas: GenEval metadata of the prompts (each sampled ``k`` times, seeds ``seed + j``).
        k: samples per prompt (>= 1).

    Returns:
        ``{tag: {"mean": float in [0, 1], "pass_at_k": float in [0, 1], "prompts": int}}``.

    Raises:
        ValueError: if ``k < 1`` or ``metas`` is empty.
    """
    import torch

    from flowrl.evaluation import generate_per_prompt
    from flowrl.rewards.geneval import geneval

    with torch.no_grad():
        expanded, images = generate_per_prompt(
            model, metas, k, num_steps, guidance_scale, seed, "pass_at_k"
        )  # prompt-major
        correct = geneval(strict=True)(images, [m["prompt"] for m in expanded], expanded).view(len(metas), k)  # (P, k)
        by_tag: dict[str, list[int]] = defaultdict(list)
        for i, m in enumerate(metas):
            by_tag[m.get("tag", "all")].append(i)
        return {
            tag: {
                "mean": correct[rows].mean().item(),
                "pass_at_k": (correct[rows].amax(1) > 0).float().mean().item(),
                "prompts": len(rows),
            }
            for tag, rows in sorted(by_tag.items())
        }


def denoise_from_scenes(
    model: FlowModel,
    metas: list[dict],
    times: list[float],
    num_steps: int = 20,
    guidance_scale: float = 4.5,
    seed: int = 0,
) -> dict[float, float]:
    """Strict accuracy of rendered scenes noised to time ``t`` and ODE-denoised by the model from ``t``.

    Each prompt gets one scene (``flowrl.tiny.render.sample_scene``); denoising runs the Euler ODE on the
    ``num_steps``-step schedule from its first sigma ``<= t`` to 0 (``t = 0``: the VAE reconstruction).

    Args:
        times: noise levels in [0, 1].

    Returns:
        ``{t: strict accuracy in [0, 1]}``.

    Raises:
        ValueError: if a time is outside [0, 1].
    """
    import numpy as np
    import torch

    from flowrl.rewards.geneval import geneval
    from flowrl.samplers import flow_sigmas, ode_sample
    from flowrl.tiny.build import encode_latents
    from flowrl.tiny.render import render, sample_scene

    with torch.no_grad():
        if any(not 0.0 <= t <= 1.0 for t in times):
            raise ValueError(f"times must be in [0, 1]; got {times}")
        rng = random.Random(seed)
        scenes = torch.from_numpy(np.stack([render(sample_scene(m, rng)) for m in metas])).permute(
            0, 3, 1, 2
        )  # (P, 3, H, W) uint8
        vae = model.pipe.vae
        latents = (encode_latents(vae, scenes).float() - (vae.config.shift_factor or 0.0)) * vae.config.scaling_factor
        latents = latents.to(model.device)  # (P, C, h, w) scaled as the transformer sees them
        prompts = [m["prompt"] for m in metas]
        unique = list(dict.fromkeys(prompts))
        table = model.encode([""] + unique)
        cond = torch.tensor([unique.index(p) + 1 for p in prompts], device=model.device)
        sigmas = flow_sigmas(num_steps).to(model.device)
        noise = torch.randn(latents.shape, generator=torch.Generator().manual_seed(seed)).to(model.device)
        judge, out = geneval(strict=True), {}
        for t in times:
            start = int((sigmas > t + 1e-6).sum())  # first schedule sigma <= t
            s = float(sigmas[start])
            x = (1 - s) * latents + s * noise  # (P, C, h, w)
            if start < num_steps:
                x = ode_sample(model.velocity_fn(table, guidance_scale), x, cond, sigmas[start:])
            out[t] = judge(model.decode(x), prompts, metas).float().mean().item()
        return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(REPO_ROOT / "assets" / "tiny-sd3"))
    p.add_argument("--lora", default=None)
    p.add_argument("--prompts", default="test", help="train | test | FILE.jsonl")
    p.add_argument("-k", type=int, default=8, help="samples per prompt for pass@k")
    p.add_argument("--times", type=float, nargs="*", default=[0.0, 0.4, 0.6, 0.8, 1.0])
    p.add_argument("--num-steps", type=int, default=20, help="Euler ODE steps of every sample")
    p.add_argument("--max-prompts", type=int, default=0, help="use only the first N prompts (0: all)")
    p.add_argument("--out", default="")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    a = p.parse_args(argv)
    from flowrl.models import load_model, resolve_device  # after the arguments: --help answers at once

    model = load_model(a.model, resolve_device(a.device))
    if a.lora:
        model.load_lora(a.lora)
    metas = read_prompts(a.prompts)
    metas = metas[: a.max_prompts] if a.max_prompts > 0 else metas
    result = {
        "model": a.model,
        "lora": a.lora,
        "prompts": a.prompts,
        "k": a.k,
        "num_steps": a.num_steps,
        "pass_at_k": pass_at_k(model, metas, a.k, a.num_steps),
        "denoise_from_scenes": denoise_from_scenes(model, metas, a.times, a.num_steps),
    }
    for tag, r in result["pass_at_k"].items():
        print(f"{tag:14s} mean {r['mean']:.3f}  pass@{a.k} {r['pass_at_k']:.3f}  ({r['prompts']} prompts)")
    print("denoised from t:", {t: round(v, 3) for t, v in result["denoise_from_scenes"].items()})
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
