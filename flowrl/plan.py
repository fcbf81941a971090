"""What a run's weights, gradients and optimizer state take per process under each engine, worked out from the model
folder before any weights load (``flowrl memory``): the most common failure of a first run on GPUs is running out of
memory, and the arithmetic of ``docs/distributed.md`` needs the trained weight count, which this reads off the folder.

The trained network is built on the meta device from its ``config.json`` (no weights read; with the run's LoRA added
through peft, as :meth:`flowrl.models.FlowModel.add_lora` adds it), so the count is exact; the frozen parts' weight
counts come from their safetensors headers, placed as ``model.text_encoders`` and ``model.vae_placement`` place them,
in ``model.dtype``. Activations are not estimated (they depend on the resolution, frames, micro-batch and
gradient checkpointing; ``memory/gpu_peak_gib`` in ``metrics.jsonl`` measures the whole).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

ENGINES = ("ddp", "fsdp2", "zero1", "zero2", "zero2_offload")
"""The engines of ``configs/accelerate/``: DDP, FSDP2 (weights kept gathered, a unit per block), DeepSpeed ZeRO-1,
ZeRO-2, ZeRO-2 with the optimizer offloaded to the CPU."""
ZERO_BUCKET = 5e8
"""DeepSpeed's default ``reduce_bucket_size`` (elements): ZeRO-2's reduction bucket, float32."""


def trained_counts(
    path: str | Path, network: str, lora_rank: int, lora_alpha: float, targets: tuple[str, ...]
) -> tuple[int, int, int]:
    """Weights of the trained network of the pipeline folder ``path`` (built on the meta device from
    ``path/network/config.json``).

    Args:
        path: a pipeline folder; network: its trained component (``transformer``, ``unet``, ``transformer_2``).
        lora_rank: ``model.lora_rank`` (0: full fine-tuning); lora_alpha, targets: the LoRA's, as the adapter adds it.

    Returns:
        ``(network weights, trained weights, largest trained block)``: the network's parameter count, the trained
        ones (the LoRA, or every weight), and the most trained weights in one child of a ``ModuleList`` (a
        transformer block, FSDP2's unit; 0 where the network has none).

    Raises:
        FileNotFoundError: without ``path/network/config.json``. ValueError: a ``_class_name`` diffusers lacks.
    """
    import diffusers
    from peft import LoraConfig

    config = json.loads((Path(path) / network / "config.json").read_text())
    cls = getattr(diffusers, config.get("_class_name", ""), None)
    if cls is None:
        raise ValueError(
            f"{Path(path) / network / 'config.json'} names class {config.get('_class_name')!r}, which "
            f"diffusers {diffusers.__version__} does not have"
        )
    with torch.device("meta"):
        model = cls.from_config(cls.load_config(Path(path), subfolder=network))
        total = sum(p.numel() for p in model.parameters())
        if lora_rank > 0:
            model.add_adapter(
                LoraConfig(
                    r=lora_rank, lora_alpha=lora_alpha, init_lora_weights="gaussian", target_modules=list(targets)
                )
            )
        else:
            model.requires_grad_(True)
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    blocks = [
        sum(p.numel() for p in child.parameters() if p.requires_grad)
        for m in model.modules()
        if isinstance(m, torch.nn.ModuleList)
        for child in m
    ]
    return total, trained, max(blocks, default=0)


def component_elements(path: str | Path) -> dict[str, int]:
    """Weights stored in each component folder of the pipeline folder ``path`` (from its safetensors headers; no
    weights read), by folder name, for the folders that hold safetensors files."""
    from safetensors import safe_open

    counts = {}
    for sub in sorted(Path(path).iterdir()):
        files = sorted(sub.glob("*.safetensors")) if sub.is_dir() else []
        if not files:
            continue
        counts[sub.name] = 0
        for file in files:
            with safe_open(file, "pt") as f:
                for key in f.keys():
                    counts[sub.name] += int(torch.Size(f.get_slice(key).get_shape()).numel())
    return counts


def frozen_gpu_bytes(
    elements: dict[str, int],
    network: str,
    network_params: int,
    lora: bool,
    dtype_bytes: int,
    text_encoders: str,
    vae_placement: str,
) -> dict[str, int]:
    """Bytes of the frozen parts on each process's accelerator between uses, in ``model.dtype`` (``dtype_bytes`` per
    weight; ``elements``: :func:`component_elements`): the trained network's base under LoRA (under full fine-tuning
    its ``network_params`` float32 weights are the engine table's, its saved buffers, e.g. SD3's positional table,
    float32 here), the text encoders unless ``model.text_encoders`` is ``cpu`` or ``drop_after_cache``, the VAE unless
    ``model.vae_placement`` is ``cpu``, and every other component (Wan 2.2's frozen expert)."""
    out = {}
    for name, n in elements.items():
        if name == network:
            if lora:
                out[name] = n * dtype_bytes
            elif n > network_params:
                out[f"{name} buffers"] = (n - network_params) * 4
        elif name.startswith("text_encoder"):
            if text_encoders == "keep":
                out[name] = n * dtype_bytes
        elif name == "vae":
            if vae_placement == "keep":
                out[name] = n * dtype_bytes
        else:
            out[name] = n * dtype_bytes
    return out


def engine_bytes(trained: int, block: int, processes: int) -> dict[str, dict[str, float]]:
    """Bytes per process of ``trained`` float32 weights, their gradients and AdamW's state under each of
    :data:`ENGINES` over ``processes`` processes (``docs/distributed.md``'s tables): ``{engine: {"weights",
    "gradients", "optimizer", "gpu", "host"}}`` (``optimizer``: moments and, under ZeRO, the float32 master copy;
    ``gpu``: their sum on the accelerator at a backward's peak; ``host``: what the engine keeps in CPU memory)."""
    n, p = float(trained), float(processes)
    rows = {
        "ddp": dict(weights=4 * n, gradients=8 * n, optimizer=8 * n),  # gradients: the tensors and DDP's buckets
        "fsdp2": dict(weights=4 * n + 4 * n / p, gradients=4 * n / p + 4 * block, optimizer=8 * n / p),
        "zero1": dict(weights=4 * n, gradients=4 * n, optimizer=12 * n / p),
        "zero2": dict(weights=4 * n, gradients=4 * n / p + 4 * min(ZERO_BUCKET, n), optimizer=12 * n / p),
        "zero2_offload": dict(weights=4 * n, gradients=4 * n / p + 4 * min(ZERO_BUCKET, n), optimizer=0.0),
    }
    for name, row in rows.items():
        row["gpu"] = row["weights"] + row["gradients"] + row["optimizer"]
        row["host"] = 16 * n / p if name == "zero2_offload" else 0.0  # master, moments, the gradient partition
    return rows


def memory_plan(cfg, processes: int = 1) -> dict:
    """The memory plan of the run ``cfg`` (a :class:`flowrl.config.Config`) over ``processes`` processes.

    Returns:
        `dict`: ``model`` (path, family, network), ``network_params``, ``trained_params``, ``largest_block``,
        ``frozen_gpu_bytes`` (:func:`frozen_gpu_bytes`) and ``engines`` (:func:`engine_bytes`, in bytes; each row's
        ``total_gpu`` adds the frozen parts).

    Raises:
        ConfigError: as :func:`flowrl.pairing.resolve_model` (a bad ``model.path`` and the like), or ``processes < 1``.
    """
    from .config import ConfigError, resolve_path
    from .pairing import resolve_model

    if processes < 1:
        raise ConfigError(f"--processes must be >= 1, got {processes}")
    adapter = resolve_model(cfg)
    path = resolve_path(cfg.model.path)
    network = adapter.network_name(cfg.model.expert)
    m = cfg.model
    total, trained, block = trained_counts(path, network, m.lora_rank, m.lora_alpha, adapter.LORA_TARGETS)
    dtype_bytes = {"float32": 4, "bfloat16": 2, "float16": 2}[m.dtype]
    frozen = frozen_gpu_bytes(
        component_elements(path), network, total, m.lora_rank > 0, dtype_bytes, m.text_encoders, m.vae_placement
    )
    engines = engine_bytes(trained, block, processes)
    for row in engines.values():
        row["total_gpu"] = row["gpu"] + sum(frozen.values())
    return {
        "model": {"path": str(path), "family": adapter.__name__, "network": network, "dtype": m.dtype},
        "processes": processes,
        "network_params": total,
        "trained_params": trained,
        "largest_block": block,
        "frozen_gpu_bytes": frozen,
        "engines": engines,
    }


def format_plan(plan: dict) -> str:
    """``plan`` (:func:`memory_plan`) as the lines ``flowrl memory`` prints: the counts, the files, and a Markdown
    table of GiB per process."""
    gib = 2.0**30
    unit, scale = ("GiB", gib) if max(r["total_gpu"] for r in plan["engines"].values()) >= gib else ("MiB", 2.0**20)
    m = plan["model"]
    what = (
        "full fine-tuning"
        if plan["trained_params"] == plan["network_params"]
        else f"LoRA: {plan['trained_params'] / 1e6:.1f}M trained"
    )
    frozen = plan["frozen_gpu_bytes"]
    lines = [
        f"{m['path']}: {m['family']}, {m['network']} of {plan['network_params'] / 1e9:.3f}B weights ({what}); "
        f"largest trained block {plan['largest_block'] / 1e6:.1f}M",
        f"frozen parts on each GPU in {m['dtype']}: "
        + (
            ", ".join(f"{k} {v / gib:.2f} GiB" if v >= gib else f"{k} {v / 2**20:.1f} MiB" for k, v in frozen.items())
            or "none"
        ),
        f"per process over {plan['processes']} processes, before activations ({unit}): the trained float32 "
        "weights, their gradients, AdamW's state (ZeRO: with the master copy), their sum, and with the frozen "
        "parts:",
        "| engine | weights | gradients | optimizer | trained | with frozen | host |",
        "|---|---|---|---|---|---|---|",
    ]
    columns = ("weights", "gradients", "optimizer", "gpu", "total_gpu", "host")
    for name, row in plan["engines"].items():
        lines.append(f"| {name} | " + " | ".join(f"{row[k] / scale:.2f}" for k in columns) + " |")
    return "\n".join(lines)
