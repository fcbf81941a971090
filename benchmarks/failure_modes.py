"""Why do a model's samples fail GenEval? Each failed image sorted into one of three failure modes.

For ``k`` ODE samples of every prompt of a GenEval-style prompt file (seeds ``seed + j``), the tiny-world
detector's colour segments are classified one by one, and a strictly wrong image gets the first mode
that applies:

- ``empty``: no coloured object at all on the background.
- ``unread_shape``: at least one object is not read as one of the prompt's shapes, with GenEval's
  confidence (0.9 for the ``counting`` tag, 0.3 otherwise): a blob, or a drawing closer to another shape.
  Fixing it needs shapes drawn more clearly, a rendering skill.
- ``composition``: every object is read as one of the prompt's shapes, yet a clause fails (a wrong count,
  colour or position). Fixing it needs a different layout or binding.

    python benchmarks/failure_modes.py [--model assets/tiny-sd3] [--lora DIR] [--prompts test] [-k 8]
        [--num-steps 20] [--guidance-scale 4.5] [--max-prompts N] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
from collections import Counter, defaultdict
from pathlib import Path
from typing import TYPE_CHECKING

from flowrl.data import REPO_ROOT, read_prompts

if TYPE_CHECKING:
    import torch

    from flowrl.models import FlowModel

MODES = ("empty", "unread_shape", "composition")


def failure_mode(image: torch.Tensor, meta: dict) -> str | None:
    """The failure mode of one image, or None when it is strictly correct.

    Args:
        image (`torch.Tensor` of shape `(3, H, W)`, float in [0, 1]): one sample.
        meta: its GenEval metadata (``include``, ``exclude``, ``tag``).

    Returns:
        None, or one of :data:`MODES` (see the module docstring).

    Raises:
        ValueError: as :func:`rewards.geneval.rules.evaluate` for malformed metadata.
    """
    from flowrl.rewards.geneval import keep_confident
    from flowrl.rewards.geneval.detector import detect, objects
    from flowrl.rewards.geneval.rules import evaluate

    kept = keep_confident(detect(image), meta)
    if evaluate(kept, meta)[0]:
        return None
    segments = objects(image)  # every coloured object, read or not (detect drops those that look like no shape)
    if not segments:
        return "empty"
    named = {clause["class"] for clause in meta["include"]}
    read = [d for d in kept if d.cls in named]
    return "unread_shape" if len(read) < len(segments) else "composition"


def failure_modes(
    model: FlowModel, metas: list[dict], k: int, num_steps: int = 20, guidance_scale: float = 4.5, seed: int = 1234
) -> dict[str, dict[str, float]]:
    """Per tag: strict accuracy and the fraction of samples in each failure mode, over ``k`` ODE samples per prompt.

    Args:
        metas: GenEval metadata of the prompts (each sampled ``k`` times, seeds ``seed + j``).
        k: samples per prompt (>= 1).

    Returns:
        ``{tag: {"images": int, "correct": float, "empty": float, "unread_shape": float, "composition": float}}``,
        fractions of the tag's images (they sum to 1 with ``correct``).

    Raises:
        ValueError: if ``k < 1`` or ``metas`` is empty.
    """
    from flowrl.evaluation import generate_per_prompt

    expanded, images = generate_per_prompt(model, metas, k, num_steps, guidance_scale, seed, "failure_modes")
    counts: dict[str, Counter] = defaultdict(Counter)
    for image, meta in zip(images, expanded):
        counts[meta["tag"]][failure_mode(image, meta) or "correct"] += 1
    return {
        tag: {"images": sum(c.values()), **{m: c[m] / sum(c.values()) for m in ("correct", *MODES)}}
        for tag, c in counts.items()
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(REPO_ROOT / "assets" / "tiny-sd3"))
    parser.add_argument("--lora", default=None, help="diffusers-format LoRA folder")
    parser.add_argument("--prompts", default="test", help="train | test | FILE.jsonl")
    parser.add_argument("-k", type=int, default=8, help="ODE samples per prompt")
    parser.add_argument("--num-steps", type=int, default=20)
    parser.add_argument("--guidance-scale", type=float, default=4.5)
    parser.add_argument("--max-prompts", type=int, default=0, help="use only the first N prompts (0: all)")
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda")
    parser.add_argument("--out", default=None, help="write the table as JSON here")
    args = parser.parse_args(argv)
    if args.k < 1:
        parser.error(f"-k must be at least 1, got {args.k}")
    from flowrl.models import load_model, resolve_device  # after the arguments: --help answers at once

    model = load_model(args.model, resolve_device(args.device))
    if args.lora:
        model.load_lora(args.lora)
    metas = read_prompts(args.prompts)
    metas = metas[: args.max_prompts] if args.max_prompts > 0 else metas
    table = failure_modes(model, metas, args.k, args.num_steps, args.guidance_scale)
    print(f"| tag | images | correct | {' | '.join(MODES)} |\n|---|---|---|---|---|---|")
    for tag, row in table.items():
        print(f"| {tag} | {row['images']} | " + " | ".join(f"{row[m]:.3f}" for m in ("correct", *MODES)) + " |")
    result = {
        "model": args.model,
        "lora": args.lora,
        "prompts": args.prompts,
        "k": args.k,
        "num_steps": args.num_steps,
        "guidance_scale": args.guidance_scale,
        "per_tag": table,
    }
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
