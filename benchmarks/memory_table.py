"""What each published model needs per GPU, before anything is downloaded: ``flowrl memory``'s plan
(:func:`flowrl.plan.memory_plan`, activations included) for LoRA on one 80 GB GPU and full fine-tuning on eight, at
each model's recipe (micro-batch, resolution, frames, prompt length, guidance), the cheapest engine that fits.

For each published model (``flowrl/models/published/NAME.json``) and its recipe (:data:`RECIPES`), the settings are
tried from the cheapest to the most frugal (:data:`SETTINGS`); within each, the engines in the order of
:data:`ENGINE_ORDER` (the least communication first). The first plan whose ``total_gpu`` is under an H100's 81,559 MiB
is the row's answer; "does not fit" gives the smallest total and what takes it. Full fine-tuning is planned without the
KL term (``train.kl_beta=0``: its reference is the LoRA-disabled base, which full fine-tuning does not have); the
recipe's EMA (``train.ema_decay``) is a held copy of the trained weights. Engines flowrl refuses for the recipe (the
plan's ``refused``: :func:`flowrl.plan.refused_engines`) are marked. Writes JSON and prints the Markdown table of
docs/distributed.md::

    python benchmarks/memory_table.py --out benchmarks/results/memory_table.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

RECIPES = {
    "flux1_dev": "flux_dance_grpo",
    "flux1_kontext_dev": "flux_kontext_grpo",
    "flux2_dev": "flux2_flow_grpo",
    "flux2_klein_4b": "flux2_klein_flow_grpo",
    "flux2_klein_9b": "flux2_klein_flow_grpo",
    "hunyuan_video": "hunyuan_dance_grpo",
    "hunyuan_video15": "hunyuan_video15_flow_grpo",
    "ltx2": "ltx2_flow_grpo",
    "ltx_video": "ltx_video_flow_grpo",
    "qwen_image": "qwen_image_flow_grpo",
    "qwen_image_edit": "qwen_image_edit_flow_grpo",
    "sana_1600m": "sana_diffusion_nft",
    "sana_sprint_1600m": "sana_diffusion_nft",
    "sd15": "sd15_ddpo",
    "sd35_large": "sd35m_pickscore",
    "sd35_medium": "sd35m_pickscore",
    "sdxl": "sdxl_dance_grpo",
    "wan21_14b": "wan_flow_grpo",
    "wan21_1_3b": "wan_flow_grpo",
    "wan21_i2v_14b": "wan_i2v_flow_grpo",
    "wan22_a14b": "wan_flow_grpo",
    "z_image": "z_image_flow_grpo",
}
"""The recipe in ``configs/recipes/`` whose settings each published model is planned at."""
ENGINE_ORDER = ("ddp", "zero1", "zero2", "fsdp2", "fsdp2_full_shard", "zero3", "zero2_offload", "zero3_offload")
"""Engines from the least communication and host memory to the most."""
H100 = 81559 * 2**20
"""An H100 80 GB's memory as ``nvidia-smi`` reports it (81,559 MiB)."""
CKPT, BF16 = ["train.gradient_checkpointing=true"], ["model.dtype=bfloat16", "run.mixed_precision=bf16"]
SETTINGS = ([], CKPT, CKPT + BF16, CKPT + BF16 + ["model.text_encoders=cpu", "model.vae_placement=cpu"])
"""The settings tried in turn: the recipe's, checkpointing, the frozen parts in bf16 under bf16 autocast (the Wan and
LTX-Video recipes keep float32 without autocast, as their scripts do), then the frozen parts on the CPU between
uses."""


def cheapest(name: str, recipe: str, extra: list[str], processes: int) -> dict:
    """The first (settings, engine) of :data:`SETTINGS` x :data:`ENGINE_ORDER` under :data:`H100` for the published
    model ``name`` at ``recipe`` with ``extra`` overrides over ``processes`` GPUs, or the smallest when none fits."""
    from flowrl.config import load_config
    from flowrl.plan import memory_plan

    best = None
    for settings in SETTINGS:
        cfg = load_config(ROOT / "configs/recipes" / f"{recipe}.yaml", [*extra, *settings])
        plan = memory_plan(cfg, processes, family=name)
        for engine in ENGINE_ORDER:
            total = plan["engines"][engine]["total_gpu"]
            row = {
                "engine": engine,
                "runs_in_flowrl": plan["engines"][engine]["refused"] is None,
                "settings": settings,
                "total_gib": total / 2**30,
                "host_gib": plan["engines"][engine]["host"] / 2**30,
                "activations_gib": (plan["activations"] or {}).get(
                    "with_checkpointing" if settings else "without_checkpointing", 0
                )
                / 2**30,
                "activations_modelled": plan["activations"] is not None,
                "trained_params": plan["trained_params"],
                "frozen_gib": sum(plan["frozen_gpu_bytes"].values()) / 2**30,
            }
            if total < H100:
                return {**row, "fits": True}
            if best is None or total < best["total_gib"] * 2**30:
                best = row
    return {**best, "fits": False}


def cell(row: dict) -> str:
    """A Markdown cell: the engine and its GiB, with the settings it needs, or why nothing fits."""
    what = {
        "train.gradient_checkpointing=true": "ckpt",
        "model.dtype=bfloat16": "bf16",
        "run.mixed_precision=bf16": None,
        "model.text_encoders=cpu": "encoders on CPU",
        "model.vae_placement=cpu": None,
    }
    needs = ", ".join(w for s in row["settings"] if (w := what[s]))
    engine = row["engine"] if row["runs_in_flowrl"] else f"{row['engine']} (not run yet)"
    text = f"{engine} {row['total_gib']:.1f}" + (f" ({needs})" if needs else "")
    if row["host_gib"] > 0.05:
        text += f", host {row['host_gib']:.0f}"
    if not row["activations_modelled"]:
        text += ", activations not modelled"
    return text if row["fits"] else f"does not fit: best {text}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--names", nargs="*", default=None, help="published models (default: all)")
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    args = ap.parse_args()
    from flowrl.config import load_config  # after the arguments: --help answers at once, before torch
    from flowrl.plan import published_names

    rows = []
    for name in args.names or published_names():
        start = time.perf_counter()
        recipe = RECIPES[name]
        rank = load_config(ROOT / "configs/recipes" / f"{recipe}.yaml", []).model.lora_rank or 32
        lora = cheapest(name, recipe, [f"model.lora_rank={rank}"], 1)  # rank 32 where the recipe fine-tunes fully
        full = cheapest(name, recipe, ["model.lora_rank=0", "train.kl_beta=0"], 8)  # no LoRA-disabled reference
        rows.append({"name": name, "recipe": recipe, "lora_1gpu": lora, "full_8gpu": full})
        print(f"{name}: {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    print(
        "| model (recipe) | trained (full) | LoRA, one 80 GB GPU (GiB) | full fine-tuning, 8 x 80 GB (GiB per GPU) |"
    )
    print("|---|---|---|---|")
    for r in rows:
        n = r["full_8gpu"]["trained_params"] / 1e9
        print(f"| {r['name']} (`{r['recipe']}`) | {n:.1f}B | {cell(r['lora_1gpu'])} | {cell(r['full_8gpu'])} |")
    if args.out:
        meta = {"command": "python benchmarks/memory_table.py --out " + args.out, "limit_mib": H100 // 2**20}
        Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
