"""What a run takes in memory per process under each engine, worked out before any weights load (``flowrl memory``):
the most common failure of a first run on GPUs is running out of memory.

Two sources, neither of which reads a weight:

- a model folder (``model.path``): the trained network is built on the meta device from its ``config.json`` (with the
  run's LoRA added through peft, as :meth:`flowrl.models.FlowModel.add_lora` adds it), so the count is exact; the
  frozen parts' weight counts come from their safetensors headers, or, in a folder holding only the configs, from
  their ``config.json`` built on the meta device;
- a published model (``--family NAME``): the package's ``flowrl/models/published/NAME.json``, the configs of the
  model's hub repository (each file names its source) and the components' weight counts.

The frozen parts are placed as ``model.text_encoders`` and ``model.vae_placement`` place them, in ``model.dtype``.
Activations are counted by :func:`flowrl.activations.activation_bytes` at the run's micro-batch (doubled under
classifier-free guidance), resolution, frames and prompt length, with and without ``train.gradient_checkpointing``;
the update's peak is the engine's weights, gradients and optimizer state, the frozen parts and the activations.
``memory/gpu_peak_gib`` in ``metrics.jsonl`` measures the whole.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

ENGINES = ("ddp", "fsdp2", "zero1", "zero2", "zero2_offload", "fsdp2_full_shard", "zero3", "zero3_offload")
"""DDP, FSDP2 (weights kept gathered, a unit per block), DeepSpeed ZeRO-1, ZeRO-2, ZeRO-2 with the optimizer offloaded
to the CPU, FSDP2 resharding after each forward, ZeRO-3, and ZeRO-3 with the optimizer and weights offloaded to the
CPU (the engines of ``configs/accelerate/``)."""
NOT_RUN: tuple[str, ...] = ()
"""Engines :data:`ENGINES` plans that flowrl does not run yet (docs/distributed.md, "Full sharding")."""
FULL_SHARDING = ("fsdp2_full_shard", "zero3", "zero3_offload")
"""Engines that gather the weights in every forward, so every process must call the transformer alike
(:attr:`flowrl.methods.base.Method.lockstep`)."""


def refused_engines(cfg) -> dict[str, str]:
    """The engines of :data:`ENGINES` flowrl refuses for the run ``cfg``'s ``train.method``, each with why: those
    flowrl does not run (:data:`NOT_RUN`), the method's :meth:`~flowrl.methods.base.Method.engine_blockers` (``FSDP2``:
    fsdp2 and fsdp2_full_shard, ``DeepSpeed``: the zero ones) and its
    :meth:`~flowrl.methods.base.Method.lockstep_blocker` under :data:`FULL_SHARDING`. The plan still counts their
    bytes; ``flowrl memory`` brackets them and says why."""
    from .methods import METHODS

    method = METHODS[cfg.train.method]
    blockers, lockstep = method.engine_blockers(cfg), method.lockstep_blocker(cfg)
    out = {}
    for engine in ENGINES:
        kind = "DeepSpeed" if engine.startswith("zero") else "FSDP2" if engine.startswith("fsdp2") else None
        if engine in NOT_RUN:
            out[engine] = "flowrl does not run it yet"
        elif kind in blockers:
            out[engine] = blockers[kind]
        elif engine in FULL_SHARDING and lockstep:
            out[engine] = f"{lockstep} does not call the transformer alike on every process"
    return out


PUBLISHED = Path(__file__).resolve().parent / "models" / "published"
"""The published models' configs (``NAME.json``: ``pipeline``, ``network``, ``components`` with each one's library,
class and ``config``, ``params`` per component, ``source``)."""
PROMPT_PREFIX = {"StableDiffusion3Pipeline": 77}
"""Text tokens a family puts before its ``max_sequence_length`` ones (SD3: CLIP's 77 before T5's)."""
FIXED_PROMPT = {"StableDiffusionPipeline": 77, "StableDiffusionXLPipeline": 77}
"""Families whose text stream has a fixed length (CLIP's 77 tokens)."""
ZERO_BUCKET = 5e8
"""DeepSpeed's default ``reduce_bucket_size`` (elements): ZeRO-2's reduction bucket, float32."""


def build_network(
    library_class: str,
    config: dict,
    lora_rank: int,
    lora_alpha: float,
    targets: tuple[str, ...],
    frozen_dtype: torch.dtype | None = None,
) -> torch.nn.Module:
    """The diffusers network ``library_class`` built on the meta device from its ``config`` (no weights), its trained
    parameters requiring gradients in float32: the LoRA of rank ``lora_rank`` on ``targets`` (peft, as
    :meth:`flowrl.models.FlowModel.add_lora` adds it; the frozen base in ``frozen_dtype``, ``model.dtype`` on a GPU),
    or every weight when ``lora_rank`` is 0.

    Raises:
        ValueError: a class diffusers lacks.
    """
    import diffusers
    from peft import LoraConfig

    cls = getattr(diffusers, library_class, None)
    if cls is None:
        raise ValueError(f"class {library_class!r} is not in diffusers {diffusers.__version__}")
    config = {k: v for k, v in config.items() if not k.startswith("_")}
    with torch.device("meta"):
        model = cls.from_config(config)
        if lora_rank > 0:
            model.requires_grad_(False)
            level = diffusers.logging.get_verbosity()
            diffusers.logging.set_verbosity_error()  # its notice on casting with to(): no module here needs float32
            try:
                model.to(frozen_dtype or torch.float32)
            finally:
                diffusers.logging.set_verbosity(level)
            model.add_adapter(
                LoraConfig(
                    r=lora_rank, lora_alpha=lora_alpha, init_lora_weights="gaussian", target_modules=list(targets)
                )
            )
        else:
            model.requires_grad_(True)
    return model


def network_counts(model: torch.nn.Module) -> tuple[int, int, int]:
    """``(network weights, trained weights, largest trained block)`` of a :func:`build_network` model: the
    parameter count without the LoRA, the trained ones (the LoRA, or every weight), and the most trained weights in
    one child of a ``ModuleList`` (a transformer block, FSDP2's unit; 0 where the network has none)."""
    total = sum(p.numel() for n, p in model.named_parameters() if "lora_" not in n)
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    blocks = [
        sum(p.numel() for p in child.parameters() if p.requires_grad)
        for m in model.modules()
        if isinstance(m, torch.nn.ModuleList)
        for child in m
    ]
    return total, trained, max(blocks, default=0)


def trained_counts(
    path: str | Path, network: str, lora_rank: int, lora_alpha: float, targets: tuple[str, ...]
) -> tuple[int, int, int]:
    """:func:`network_counts` of the trained network of the pipeline folder ``path`` (built on the meta device from
    ``path/network/config.json``).

    Args:
        path: a pipeline folder; network: its trained component (``transformer``, ``unet``, ``transformer_2``).
        lora_rank: ``model.lora_rank`` (0: full fine-tuning); lora_alpha, targets: the LoRA's, as the adapter adds it.

    Raises:
        FileNotFoundError: without ``path/network/config.json``. ValueError: a ``_class_name`` diffusers lacks.
    """
    config = json.loads((Path(path) / network / "config.json").read_text())
    return network_counts(build_network(config.get("_class_name", ""), config, lora_rank, lora_alpha, targets))


def component_count(library: str, class_name: str, config: dict, buffers: bool = False) -> int:
    """Weights of one pipeline component built on the meta device from its ``config.json``: a diffusers class, or a
    transformers one (``library`` ``"transformers"``) from its config class; with ``buffers``, a diffusers
    component's saved buffers too (SD3's positional table), as its safetensors file holds them.

    Raises:
        ValueError: a class the library lacks.
    """
    import diffusers
    import transformers

    module = diffusers if library == "diffusers" else transformers
    cls = getattr(module, class_name, None)
    if cls is None:
        raise ValueError(f"class {class_name!r} is not in {library} {module.__version__}")
    config = {k: v for k, v in config.items() if not k.startswith("_") and k != "architectures"}
    with torch.device("meta"):
        model = cls.from_config(config) if module is diffusers else cls._from_config(cls.config_class(**config))
    if buffers and module is diffusers:
        return sum(t.numel() for t in model.state_dict().values())
    return sum(p.numel() for p in model.parameters())


def component_elements(path: str | Path) -> dict[str, int]:
    """Weights stored in each component folder of the pipeline folder ``path`` by folder name: from its safetensors
    headers (no weights read), or, for a folder holding only its ``config.json`` (a configs-only download), from the
    component built on the meta device (:func:`component_count`; the library and class from ``model_index.json``)."""
    from safetensors import safe_open

    index = json.loads((Path(path) / "model_index.json").read_text())
    counts = {}
    for sub in sorted(Path(path).iterdir()):
        files = sorted(sub.glob("*.safetensors")) if sub.is_dir() else []
        entry = index.get(sub.name)
        if (
            not files
            and (sub / "config.json").is_file()
            and isinstance(entry, list)
            and entry[0] in ("diffusers", "transformers")
        ):
            config = json.loads((sub / "config.json").read_text())
            counts[sub.name] = component_count(entry[0], entry[1], config, buffers=True)
            continue
        if not files:
            continue
        counts[sub.name] = 0
        for file in files:
            with safe_open(file, "pt") as f:
                for key in f.keys():
                    counts[sub.name] += int(torch.Size(f.get_slice(key).get_shape()).numel())
    return counts


def vae_factor(path: Path) -> int | None:
    """The spatial compression of the folder's VAE where its config tells it (``block_out_channels``: one halving
    between each two), else None (the published VAE's, :data:`flowrl.activations.VAE_FACTORS`)."""
    file = Path(path) / "vae" / "config.json"
    channels = json.loads(file.read_text()).get("block_out_channels") if file.is_file() else None
    return 2 ** (len(channels) - 1) if isinstance(channels, list) and channels else None


def published_names() -> list[str]:
    """The names ``--family`` takes: the files of :data:`PUBLISHED`."""
    return sorted(p.stem for p in PUBLISHED.glob("*.json"))


def load_published(name: str) -> dict:
    """The published model ``name`` (:data:`PUBLISHED`).

    Raises:
        ValueError: an unknown name (the message lists the known ones).
    """
    file = PUBLISHED / f"{name}.json"
    if not file.is_file():
        raise ValueError(f"--family {name!r}: no published model of that name; known: {', '.join(published_names())}")
    return json.loads(file.read_text())


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
        elif name.startswith(("text_encoder", "image_encoder", "connectors")):
            if text_encoders == "keep":
                out[name] = n * dtype_bytes
        elif name in ("vae", "audio_vae", "vocoder"):
            if vae_placement == "keep":
                out[name] = n * dtype_bytes
        elif name != "safety_checker":  # flowrl loads no safety checker
            out[name] = n * dtype_bytes
    return out


def engine_bytes(trained: int, block: int, processes: int, held: int = 0) -> dict[str, dict[str, float]]:
    """Bytes per process of ``trained`` float32 weights, their gradients, AdamW's state and ``held`` float32 copies of
    them (a method's old, reference, EMA copies and held scores: :meth:`flowrl.methods.base.Method.held_copies`, and
    the policy's EMA) under each of :data:`ENGINES` over ``processes`` processes (``docs/distributed.md``'s tables):
    ``{engine: {"weights", "gradients", "optimizer", "held", "gpu", "host"}}`` (``optimizer``: moments and, under ZeRO,
    the float32 master copy; ``gpu``: their sum on the accelerator at a backward's peak; ``host``: what the engine
    keeps in CPU memory). The fully sharded engines hold two gathered units (``block`` weights each: the one computing
    and the one prefetched) and held copies of their shards; ZeRO-3 offload keeps the weights' and the optimizer's
    partitions, and the held copies of them, in CPU memory."""
    n, p, b = float(trained), float(processes), float(block)
    bucket = 4 * min(ZERO_BUCKET, n)
    rows = {
        "ddp": dict(weights=4 * n, gradients=8 * n, optimizer=8 * n),  # gradients: the tensors and DDP's buckets
        "fsdp2": dict(weights=4 * n + 4 * n / p, gradients=4 * n / p + 4 * b, optimizer=8 * n / p),
        "zero1": dict(weights=4 * n, gradients=4 * n, optimizer=12 * n / p),
        "zero2": dict(weights=4 * n, gradients=4 * n / p + bucket, optimizer=12 * n / p),
        "zero2_offload": dict(weights=4 * n, gradients=4 * n / p + bucket, optimizer=0.0),
        "fsdp2_full_shard": dict(weights=4 * n / p + 8 * b, gradients=4 * n / p + 4 * b, optimizer=8 * n / p),
        "zero3": dict(weights=4 * n / p + 8 * b, gradients=4 * n / p + bucket, optimizer=12 * n / p),
        "zero3_offload": dict(weights=8 * b, gradients=bucket, optimizer=0.0),
    }
    copies = 4 * n * held
    for name, row in rows.items():
        row["held"] = {"fsdp2_full_shard": copies / p, "zero3": copies / p, "zero3_offload": 0.0}.get(name, copies)
        row["gpu"] = row["weights"] + row["gradients"] + row["optimizer"] + row["held"]
        row["host"] = {"zero2_offload": 16 * n / p, "zero3_offload": 20 * n / p + copies / p}.get(name, 0.0)
    return rows


def update_rows(cfg, guidance_embedded: bool) -> int:
    """Rows through the network in one forward of the update: ``train.micro_batch_size`` (else the minibatch),
    doubled where the update runs classifier-free guidance (the GRPO family and DiffusionNFT at a guidance scale above
    1 on a family that is not guidance-distilled; the other methods train the conditional velocity)."""
    train = cfg.train
    micro = train.micro_batch_size or train.minibatch_size
    scale = 1.0
    if train.method == "nft":
        scale = train.nft.guidance_scale if train.nft.guidance_scale is not None else cfg.sampling.guidance_scale
    elif train.method in ("grpo", "flow_dppo", "gardo"):
        scale = cfg.sampling.guidance_scale
    return micro * (2 if scale > 1 and not guidance_embedded else 1)


def activation_plan(
    network: torch.nn.Module, pipeline: str, cfg, index: dict, side: int, spatial: int | None = None
) -> dict | None:
    """The update's activations of ``network`` (a :func:`build_network` model) for the run ``cfg``
    (:func:`flowrl.activations.activation_bytes`) at ``side`` pixels: ``{"rows", "latent", "text_tokens",
    "without_checkpointing", "with_checkpointing"}`` (bytes, at the backward's peak), or None for a network class
    :data:`flowrl.activations.INPUTS` does not model (LTX-2). ``index``: the folder's ``model_index.json`` (the
    family's default prompt length); ``spatial``: the folder's VAE compression (None: the published VAE's)."""
    from .activations import INPUTS, Shape, activation_bytes, latent_grid
    from .models import FAMILIES

    name = type(network).__name__
    if name not in INPUTS:
        return None
    m, adapter = cfg.model, FAMILIES[pipeline]
    frames = (m.num_frames or 81) if adapter.VIDEO else 1
    length = m.max_sequence_length if m.max_sequence_length is not None else adapter._default_length(index)
    text = FIXED_PROMPT.get(pipeline, PROMPT_PREFIX.get(pipeline, 0) + length)
    rows = update_rows(cfg, bool(network.config.get("guidance_embeds")) and pipeline != "SanaSprintPipeline")
    dtype = getattr(torch, m.dtype)  # model.dtype: float32 | bfloat16 | float16
    shape = Shape(rows, latent_grid(name, side, side, frames, spatial), text, dtype)
    autocast = None if cfg.run.mixed_precision == "no" else torch.bfloat16
    counted = activation_bytes(network, INPUTS[name](dict(network.config), shape), autocast)
    return {
        "rows": rows,
        "latent": list(shape.latent),
        "text_tokens": text,
        "without_checkpointing": counted.peak(False),
        "with_checkpointing": counted.peak(True),
    }


def memory_plan(cfg, processes: int = 1, family: str | None = None) -> dict:
    """The memory plan of the run ``cfg`` (a :class:`flowrl.config.Config`) over ``processes`` processes, from its
    model folder or from the published model ``family`` (:func:`load_published`).

    Returns:
        `dict`: ``model`` (path or repository, family, network, dtype, source), ``network_params``,
        ``trained_params``, ``largest_block``, ``frozen_gpu_bytes`` (:func:`frozen_gpu_bytes`), ``activations``
        (:func:`activation_plan`, None where not modelled), ``gradient_checkpointing`` (the run's), ``held_copies``
        (the method's and the EMA's copies of the trained weights) and ``engines``
        (:func:`engine_bytes`, in bytes; each row's ``total_gpu`` adds the frozen parts and the activations at the
        run's checkpointing, ``total_gpu_checkpointing`` / ``total_gpu_no_checkpointing`` at each; ``refused``: why
        flowrl refuses the engine for the run's ``train.method``, :func:`refused_engines`, or None).

    Raises:
        ConfigError: as :func:`flowrl.pairing.resolve_model` (a bad ``model.path`` and the like), ``processes < 1``,
            or an unknown ``family``.
    """
    from .config import ConfigError, resolve_path
    from .models import FAMILIES

    if processes < 1:
        raise ConfigError(f"--processes must be >= 1, got {processes}")
    m = cfg.model
    if family is not None:
        try:
            spec = load_published(family)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        adapter = FAMILIES[spec["pipeline"]]
        network = adapter.network_name(m.expert)
        part = spec["components"][network]
        config, cls_name, elements = part["config"], part["class"], dict(spec["params"])
        index = {k: [v["library"], v["class"]] for k, v in spec["components"].items()}
        where = {"path": spec["repo"], "source": f"flowrl/models/published/{family}.json"}
        default = 8 * config["sample_size"] if isinstance(config.get("sample_size"), int) else 1024
        side, spatial = m.resolution or (480 if adapter.VIDEO else default), None
    else:
        from .pairing import resolve_model

        adapter = resolve_model(cfg)
        path = resolve_path(m.path)
        network = adapter.network_name(m.expert)
        config = json.loads((path / network / "config.json").read_text())
        cls_name = config.get("_class_name", "")
        elements = component_elements(path)
        index = json.loads((path / "model_index.json").read_text())
        where = {"path": str(path), "source": str(path)}
        side, spatial = adapter.check_resolution(path, m.resolution), vae_factor(path)
    dtype = getattr(torch, m.dtype)  # model.dtype: float32 | bfloat16 | float16
    model = build_network(cls_name, config, m.lora_rank, m.lora_alpha, adapter.LORA_TARGETS, dtype)
    total, trained, block = network_counts(model)
    if family is not None:  # the stored buffers (SD3's positional table) beside the published weight count
        elements[network] += sum(b.numel() for b in model.buffers())
    dtype_bytes = dtype.itemsize
    frozen = frozen_gpu_bytes(elements, network, total, m.lora_rank > 0, dtype_bytes, m.text_encoders, m.vae_placement)
    activations = activation_plan(model, adapter.PIPELINE, cfg, index, side, spatial)
    from .methods import METHODS

    held = METHODS[cfg.train.method].held_copies(cfg) + int(cfg.train.ema_decay > 0)
    engines, refused = engine_bytes(trained, block, processes, held), refused_engines(cfg)
    for name, row in engines.items():
        row["refused"] = refused.get(name)
        base = row["gpu"] + sum(frozen.values())
        row["total_gpu_no_checkpointing"] = base + (activations["without_checkpointing"] if activations else 0)
        row["total_gpu_checkpointing"] = base + (activations["with_checkpointing"] if activations else 0)
        row["total_gpu"] = row[f"total_gpu_{'' if cfg.train.gradient_checkpointing else 'no_'}checkpointing"]
    return {
        "model": {**where, "family": adapter.__name__, "network": network, "dtype": m.dtype},
        "processes": processes,
        "network_params": total,
        "trained_params": trained,
        "largest_block": block,
        "frozen_gpu_bytes": frozen,
        "activations": activations,
        "gradient_checkpointing": cfg.train.gradient_checkpointing,
        "held_copies": held,
        "engines": engines,
    }


def format_plan(plan: dict) -> str:
    """``plan`` (:func:`memory_plan`) as the lines ``flowrl memory`` prints: the counts, the frozen parts, the
    activations and a Markdown table of GiB per process."""
    gib = 2.0**30
    m, act = plan["model"], plan["activations"]
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
    ]
    if act:
        f, h, w = act["latent"]
        lines.append(
            f"activations of one update forward ({act['rows']} rows, latent {f}x{h}x{w}, {act['text_tokens']} text "
            f"tokens): {act['without_checkpointing'] / gib:.2f} GiB, {act['with_checkpointing'] / gib:.2f} GiB with "
            "gradient checkpointing"
        )
    else:
        lines.append("activations: not modelled for this network (the totals leave them out)")
    lines += [
        f"per process over {plan['processes']} processes (GiB): the trained float32 weights, their gradients, "
        f"AdamW's state (ZeRO: with the master copy), the method's {plan['held_copies']} held copies of them, their "
        "sum, and the totals with the frozen parts and the "
        "activations (* marks the run's train.gradient_checkpointing; engines flowrl refuses for this run in brackets):",
        "| engine | weights | gradients | optimizer | held | trained | total | total, checkpointing | host |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    ckpt = plan["gradient_checkpointing"]
    for name, row in plan["engines"].items():
        cells = [row[k] / gib for k in ("weights", "gradients", "optimizer", "held", "gpu")]
        no, yes = row["total_gpu_no_checkpointing"] / gib, row["total_gpu_checkpointing"] / gib
        cells_text = [f"{c:.2f}" for c in cells] + [
            f"{no:.2f}" + ("" if ckpt else "*"),
            f"{yes:.2f}" + ("*" if ckpt else ""),
        ]
        label = f"({name})" if row.get("refused") else name
        lines.append(f"| {label} | " + " | ".join(cells_text) + f" | {row['host'] / gib:.2f} |")
    for reason in dict.fromkeys(r["refused"] for r in plan["engines"].values() if r.get("refused")):
        names = ", ".join(n for n, r in plan["engines"].items() if r.get("refused") == reason)
        lines.append(f"({names}): refused, {reason}")
    return "\n".join(lines)
