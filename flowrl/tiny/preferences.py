"""The tiny world's offline data sets: preference pairs and SFT images drawn by the shipped tiny model and ranked by
the world's GenEval checker (what ``configs/dpo_offline.yaml`` and ``configs/sft.yaml`` train on).

For each prompt of the train split, ``k`` deterministic samples (Euler, 10 steps, CFG 4.5, seeds ``seed + j``) are
scored by the dense ``geneval`` reward (the fraction of the prompt's clauses met); a prompt whose samples differ gives
one pair, its best and its worst sample, and a prompt's best sample is an SFT row when it meets every clause. Output::

    OUT/pairs.jsonl      {"prompt", "image_w", "image_l", "reward_w", "reward_l"} per pair (flowrl's layout)
    OUT/sft.jsonl        {"prompt", "image", "reward"} per image
    OUT/images/*.png

Rebuild (about three minutes on 2 CPU cores)::

    python -m flowrl.tiny.preferences --out assets/preferences
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


def build_preferences(
    out: str | Path,
    model_path: str | Path = "assets/tiny-sd3",
    prompts: str = "train",
    max_pairs: int = 256,
    k: int = 8,
    seed: int = 0,
) -> tuple[int, int]:
    """Draw, rank and write the data sets (module docstring).

    Args:
        out: the output folder (created). model_path: a pipeline folder. prompts: a prompt set or file.
        max_pairs (`int` >= 1): stop after this many pairs. k (`int` >= 2): samples per prompt. seed: the first seed.

    Returns:
        ``(pairs, sft_rows)`` written.

    Raises:
        ValueError: for ``k < 2`` or ``max_pairs < 1``.
    """
    from PIL import Image

    from ..data import read_prompts
    from ..evaluation import generate_per_prompt
    from ..models import load_model
    from ..rewards import build_reward

    if k < 2 or max_pairs < 1:
        raise ValueError(f"build_preferences needs k >= 2 and max_pairs >= 1; got k={k}, max_pairs={max_pairs}")
    out = Path(out)
    (out / "images").mkdir(parents=True, exist_ok=True)
    model = load_model(model_path)
    reward = build_reward("geneval")
    metas = read_prompts(prompts)
    pairs, sft = [], []

    def save(image: torch.Tensor, name: str) -> str:
        pixels = (image.permute(1, 2, 0).numpy() * 255).round().clip(0, 255).astype("uint8")
        Image.fromarray(pixels).save(out / "images" / name)
        return f"images/{name}"

    for start in range(0, len(metas), 32):
        chunk = metas[start : start + 32]
        expanded, images = generate_per_prompt(model, chunk, k, num_steps=10, guidance_scale=4.5, seed=seed)
        scores = reward(images, [m["prompt"] for m in expanded], expanded).float()
        for p, meta in enumerate(chunk):
            s = scores[p * k : (p + 1) * k]
            best, worst, i = int(s.argmax()), int(s.argmin()), start + p
            w = save(images[p * k + best], f"{i:04d}_w.png") if s[best] == 1.0 or s[best] > s[worst] else None
            if s[best] == 1.0:
                sft.append({"prompt": meta["prompt"], "image": w, "reward": 1.0})
            if s[best] > s[worst]:
                lose = save(images[p * k + worst], f"{i:04d}_l.png")
                pairs.append({"prompt": meta["prompt"], "image_w": w, "image_l": lose,
                              "reward_w": float(s[best]), "reward_l": float(s[worst])})  # fmt: skip
            if len(pairs) >= max_pairs:
                break
        if len(pairs) >= max_pairs:
            break
    for name, rows in (("pairs.jsonl", pairs), ("sft.jsonl", sft)):
        (out / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return len(pairs), len(sft)


def main(argv: list[str] | None = None) -> None:
    """``python -m flowrl.tiny.preferences``: see the module docstring."""
    parser = argparse.ArgumentParser(prog="python -m flowrl.tiny.preferences", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="assets/preferences", help="output folder (default: %(default)s)")
    parser.add_argument("--model", default="assets/tiny-sd3", help="pipeline folder (default: %(default)s)")
    parser.add_argument("--prompts", default="train", help="prompt set or file (default: %(default)s)")
    parser.add_argument("--pairs", type=int, default=256, help="most pairs written (default: %(default)s)")
    parser.add_argument("-k", type=int, default=8, help="samples per prompt (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="first seed (default: %(default)s)")
    a = parser.parse_args(argv)
    try:
        n_pairs, n_sft = build_preferences(a.out, a.model, a.prompts, a.pairs, a.k, a.seed)
    except ValueError as e:
        parser.error(str(e))
    print(f"wrote {n_pairs} pairs and {n_sft} SFT images to {a.out}")


if __name__ == "__main__":
    main()
