"""How much of the tiny video world a Wan VAE keeps: ground-truth clips of the held-out prompts judged by the motion
world's checker as rendered and after the VAE's round trip (encode to the latent mean, decode).

A policy whose samples pass through the VAE cannot score above what the round trip of a perfect clip scores, so
these are the ceiling of the tiny video main job (configs/tiny_video.yaml).

    python benchmarks/video_vae_headroom.py [--model assets/tiny-wan] [--clips 4] [--out FILE.json]

Prints (and writes) per setting the mean dense score, motion accuracy and strict accuracy.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def scores(videos: torch.Tensor, metas: list[dict]) -> dict[str, float]:
    """Mean dense, motion and strict scores of float ``(B, F, 3, H, W)`` videos in [0, 1]."""
    from flowrl.rewards.motion_world import MotionWorld

    judged = MotionWorld().judge(videos, [m["prompt"] for m in metas], metas)
    return {k: sum(getattr(j, k) for j in judged) / len(judged) for k in ("dense", "motion", "strict")}


def round_trip(vae, clips: torch.Tensor, batch: int = 32) -> torch.Tensor:
    """uint8 ``(N, F, H, W, 3)`` -> float ``(N, F, 3, H, W)`` in [0, 1] after encoding to the latent mean and decoding."""
    import torch

    with torch.no_grad():
        out = []
        for i in range(0, len(clips), batch):
            x = clips[i : i + batch].permute(0, 4, 1, 2, 3).float() / 127.5 - 1.0  # (B, 3, F, H, W)
            rec = vae.decode(vae.encode(x).latent_dist.mean).sample
            out.append(((rec.clamp(-1, 1) + 1) / 2).permute(0, 2, 1, 3, 4))
        return torch.cat(out)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(ROOT / "assets/tiny-wan"), help="a WanPipeline folder")
    p.add_argument("--clips", type=int, default=4, help="ground-truth clips per held-out prompt")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="also write the result as JSON here")
    a = p.parse_args(argv)
    import torch  # after the arguments: --help answers at once
    from diffusers import AutoencoderKLWan

    from flowrl.tiny.video import render_dataset, split

    _, test = split()
    clips, drawn = render_dataset(test, len(test) * a.clips, a.seed)
    clips = torch.from_numpy(clips)
    rendered = clips.permute(0, 1, 4, 2, 3).float() / 255
    vae = AutoencoderKLWan.from_pretrained(a.model, subfolder="vae").eval()
    result = {
        "model": a.model,
        "clips": len(drawn),
        "rendered": scores(rendered, drawn),
        "vae_round_trip": scores(round_trip(vae, clips), drawn),
    }
    print(json.dumps(result, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
