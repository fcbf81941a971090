"""Held-out evaluation: ODE sampling of GenEval-style prompts, scored by the tiny-world detector."""

from __future__ import annotations

import functools
import json
import math
import os
import platform
from collections import defaultdict

import torch
from tqdm import tqdm

from .models import FlowModel
from .samplers import ode_sample, start_latents


@functools.cache
def machine() -> str:
    """One line naming the hardware and torch build a measurement ran on, recorded in result files
    (read once per process: every evaluation of a run records the same line).

    E.g. ``"AMD EPYC (AVX512, native bf16), 2 CPU cores, no GPU, torch 2.15.0+cu132"``. The CPU model comes from
    ``/proc/cpuinfo`` where it exists (Linux), else from :mod:`platform`; the instruction set is the one torch
    dispatches to (``torch.backends.cpu.get_cpu_capability()``) and "native bf16" is oneDNN's answer
    (:func:`flowrl.precision.native_bf16`), both as this process sees them (``ATEN_CPU_CAPABILITY`` and
    ``ONEDNN_MAX_CPU_ISA`` lower them: docs/reliability.md). float32 and bf16 results can differ in the last bits
    between such CPUs, so they are compared on one machine.
    """
    from .cpu import model_name
    from .precision import native_bf16

    cpu = model_name() or platform.processor() or platform.machine()
    bf16 = "native bf16" if native_bf16("cpu") else "no native bf16"
    cpu += f" ({torch.backends.cpu.get_cpu_capability()}, {bf16})"
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return f"{cpu}, {os.cpu_count()} CPU cores, {gpu}, torch {torch.__version__}"


QUIET_IMAGES = 16
""":func:`generate` shows no bar for this many images or fewer (a grid, a sample: one short batch)."""


def generate(
    model: FlowModel,
    prompts: list[str],
    seeds: list[int],
    num_steps: int,
    guidance_scale: float,
    shift: float | None = None,
    batch_size: int = 64,
    metas: list[dict] | None = None,
) -> torch.Tensor:
    """Deterministic ODE (Euler) sampling: image i from ``torch.Generator().manual_seed(seeds[i])``.

    Args:
        model: the pipeline adapter (its LoRA, if any, is active).
        prompts: B prompts, B >= 1; seeds: B integer seeds.
        num_steps: Euler steps; guidance_scale: CFG w; shift: sigma-schedule shift, ``None``: the model
            scheduler's (:attr:`FlowModel.shift`; 3.0 for SD3.5, 1.0 for the tiny model).
        batch_size: images per forward.
        metas: the B prompt records of ``prompts`` (:mod:`flowrl.data`), for a family conditioned on more than the
            text (:meth:`FlowModel.prompt_table`: FLUX.1 Kontext's source ``image``); None: the prompts alone.

    Returns:
        float32 images ``(B, 3, H, W)`` (a video model's videos ``(B, F, 3, H, W)``) in [0, 1], on CPU.

    Raises:
        ValueError: if ``prompts`` is empty, or ``seeds`` or ``metas`` has another length.
    """
    if not prompts or len(seeds) != len(prompts) or (metas is not None and len(metas) != len(prompts)):
        raise ValueError(
            f"generate needs at least one prompt and one seed (and record, if any) per prompt; got "
            f"{len(prompts)} prompts, {len(seeds)} seeds, {'no' if metas is None else len(metas)} records"
        )
    sigmas = model.sigmas(num_steps, shift).to(model.device)  # the stock pipeline's spacing (SD3 or FLUX)
    images = []
    starts = range(0, len(prompts), batch_size)
    # a bar on local rank 0 that ticks at each Euler step of each batch (a batch of 64 images can take minutes on a
    # CPU), except for a batch of a few images (a grid, a sample)
    bar = tqdm(
        total=len(starts) * (sigmas.shape[0] - 1),
        desc=f"generate {len(prompts)} images",
        unit="step",
        leave=False,
        disable=len(prompts) <= QUIET_IMAGES or os.environ.get("LOCAL_RANK", "0") != "0",
    )
    with bar:
        for start in starts:
            bar.set_postfix_str(f"batch {start // batch_size + 1}/{len(starts)}", refresh=False)
            chunk = prompts[start : start + batch_size]
            records = [{"prompt": p} for p in chunk] if metas is None else metas[start : start + batch_size]
            images.append(_ode_batch(model, records, seeds[start : start + batch_size], sigmas, guidance_scale, bar))
    return torch.cat(images)


def _ode_batch(
    model: FlowModel, records: list[dict], seeds: list[int], sigmas, guidance_scale: float, bar
) -> torch.Tensor:
    """One batch of :func:`generate`: the images of `records` (``b`` prompt records) from `seeds`, each Euler step
    ticking `bar`; float32 ``(b, 3, H, W)`` (videos ``(b, F, 3, H, W)``) in [0, 1] on CPU."""
    keys = [json.dumps(m, sort_keys=True, default=str) for m in records]
    unique = dict(zip(keys, records))  # each distinct record (prompt and conditioning) is encoded once
    table = model.prompt_table(list(unique.values()))
    row = {k: i + 1 for i, k in enumerate(unique)}
    cond = torch.tensor([row[k] for k in keys], device=model.device)
    noise = torch.stack(
        [torch.randn(model.latent_shape, generator=torch.Generator().manual_seed(s)) for s in seeds]
    ).to(model.device)  # (b, C, H, W)
    noise = start_latents(noise, sigmas[0])  # the state at the first time (noise itself at sigma 1)
    velocity = model.velocity_fn(table, guidance_scale)

    def ticking(x: torch.Tensor, t: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        v = velocity(x, t, c)  # one call per Euler step
        bar.update(1)
        return v

    with torch.no_grad():
        latents = ode_sample(ticking, noise, cond, sigmas)
        return model.decode(latents).cpu()


def generate_per_prompt(
    model: FlowModel,
    metas: list[dict],
    k: int,
    num_steps: int = 20,
    guidance_scale: float = 4.5,
    seed: int = 1234,
    caller: str = "generate_per_prompt",
) -> tuple[list[dict], torch.Tensor]:
    """``k`` deterministic ODE samples of every prompt (:func:`generate`; sample ``j`` of each prompt from seed ``seed + j``).

    Args:
        metas: P GenEval metadata dicts (with ``prompt``).
        k: samples per prompt (>= 1).
        caller: the name the error message gives.

    Returns:
        ``(expanded, images)``: the ``P * k`` metadata dicts, prompt-major, and float32 images ``(P * k, 3, H, W)``
        in [0, 1], on CPU.

    Raises:
        ValueError: if ``k < 1`` or ``metas`` is empty.
    """
    if k < 1 or not metas:
        raise ValueError(f"{caller} needs k >= 1 and at least one prompt; got k={k}, {len(metas)} prompts")
    expanded = [m for m in metas for _ in range(k)]
    images = generate(
        model, [m["prompt"] for m in expanded], [seed + j for _ in metas for j in range(k)], num_steps, guidance_scale
    )
    return expanded, images


def sharded(fn, n: int, accelerator=None) -> torch.Tensor:
    """``fn`` over items ``0..n-1`` split across the processes of ``accelerator``, results gathered in item order.

    Process ``r`` of ``P`` calls ``fn`` once with the items ``r, r + P, r + 2P, ...`` (a process with none
    makes no call); ``fn(idx)`` returns a float tensor ``(len(idx), K)``. Every process gets the whole
    ``(n, K)`` result on CPU (two all-gathers: the width K, then the padded rows). Without an accelerator, or with one process,
    it is ``fn(list(range(n)))``. In lockstep (:func:`flowrl.sharding.lockstep`: the model's weights gathered in every
    forward) every process calls ``fn`` with ``ceil(n / P)`` items, its own padded with repeats of its last (item 0
    where it has none), so that all draw the same batches; the padded rows are dropped before the gather.
    """
    from .sharding import lockstep

    procs = 1 if accelerator is None else accelerator.num_processes
    if procs == 1:
        return fn(list(range(n)))
    rank = accelerator.process_index
    idx = list(range(rank, n, procs))
    if lockstep(accelerator) and n:  # every process draws ceil(n / P) images
        padded = idx + [idx[-1] if idx else 0] * (-(-n // procs) - len(idx))
        drawn = fn(padded)
        mine = drawn[: len(idx)] if idx else None
    else:
        mine = fn(idx) if idx else None
    # every process needs K for the padded buffer: processes without items (-1) learn it from the others
    ks = accelerator.gather(torch.tensor([mine.shape[1] if mine is not None else -1], device=accelerator.device))
    k = int(ks.max())
    if k < 0:  # n == 0
        return torch.empty(0, 0)
    rows = -(-n // procs)
    buf = torch.zeros(rows, k, device=accelerator.device)
    if mine is not None:
        buf[: len(idx)] = mine.to(accelerator.device)
    full = accelerator.gather(buf).cpu().reshape(procs, rows, k)
    out = torch.empty(n, k)
    for r in range(procs):
        count = len(range(r, n, procs))
        out[r::procs] = full[r, :count]
    return out


def expand_per_tag(metas: list[dict], images_per_tag: int) -> list[dict]:
    """Exactly ``images_per_tag`` entries per tag, its prompts taken round-robin (every tag is then
    estimated from the same number of images); ``images_per_tag <= 0`` keeps every prompt once."""
    by_tag: dict[str, list[dict]] = defaultdict(list)
    for m in metas:
        by_tag[m.get("tag", "all")].append(m)
    out = []
    for tag_metas in by_tag.values():
        n = images_per_tag if images_per_tag > 0 else len(tag_metas)
        out += [tag_metas[i % len(tag_metas)] for i in range(n)]
    return out


def _draw(model, metas: list[dict], idx: list[int], seed: int, num_steps, guidance_scale, shift, batch_size):
    """:func:`generate` for the records ``metas[i]``, ``i`` in `idx`, each with the seed ``seed + i`` (so an image is the
    same whichever process or batch draws it): images `(len(idx), 3, H, W)` (videos `(len(idx), F, 3, H, W)`)."""
    rows = [metas[i] for i in idx]
    return generate(
        model, [m["prompt"] for m in rows], [seed + i for i in idx], num_steps, guidance_scale, shift, batch_size, rows
    )


def evaluate(
    model: FlowModel,
    metas: list[dict],
    images_per_tag: int = 64,
    num_steps: int = 20,
    guidance_scale: float = 4.5,
    shift: float | None = None,
    seed: int = 1234,
    batch_size: int = 64,
    return_images: bool = False,
    accelerator=None,
    judge=None,
) -> dict:
    """GenEval strict accuracy (arXiv 2310.11513): per-tag mean of correct images, overall mean of tags.

    Args:
        model: the pipeline adapter (its LoRA, if any, is active; bf16 autocast if the caller enters it).
        metas: GenEval metadata dicts (with ``tag``, ``prompt``, ``include``), at least one.
        images_per_tag: images generated per tag (prompts repeated round-robin with new seeds); ``<= 0``: each
            prompt once.
        num_steps, guidance_scale, shift: Euler ODE steps, CFG w and sigma-schedule shift (:func:`generate`).
        seed: image i is drawn from seed ``seed + i``; batch_size: images per forward.
        return_images: also return the images and their judgements.
        accelerator: an ``accelerate.Accelerator``; with several processes each draws and judges every
            P-th image (image i keeps seed ``seed + i``) and every process returns the gathered result.
        judge: the :class:`rewards.geneval.GenEval` that reads the images (its ``judge`` method); None: the
            tiny world's detector. Real images need the real backend (``geneval(segmenter_path=..., clip_path=...)``).

    Returns:
        ``{"overall", "per_tag", "dense_overall", "dense_per_tag", "n_images", "num_steps",
        "guidance_scale", "bf16", "machine"}`` (``bf16``: whether bf16 autocast was on; ``machine``:
        :func:`machine`, since bf16 results depend on the CPU), plus ``"images"`` float ``(N, 3, H, W)``,
        ``"correct"``, ``"prompts"`` and the ``"metas"`` of each image when asked.

    Raises:
        ValueError: for no prompt, or ``return_images`` with several processes.
    """
    from .rewards.geneval import geneval

    if not metas:
        raise ValueError("evaluate needs at least one prompt; got an empty prompt list")
    if return_images and accelerator is not None and accelerator.num_processes > 1:
        raise ValueError(
            "evaluate: return_images needs a single process (the images stay on the process that drew them)"
        )
    metas = expand_per_tag(metas, images_per_tag)
    prompts = [m["prompt"] for m in metas]
    images = None
    reader = judge if judge is not None else geneval()

    def draw_and_judge(idx: list[int]) -> torch.Tensor:  # (len(idx), 2): strict, dense
        nonlocal images
        images = _draw(model, metas, idx, seed, num_steps, guidance_scale, shift, batch_size)
        strict, dense = reader.judge(images, [prompts[i] for i in idx], [metas[i] for i in idx])  # one detection pass
        return torch.stack([strict.float(), dense.float()], dim=1)

    kind = model.device.type
    bf16 = torch.is_autocast_enabled(kind) and torch.get_autocast_dtype(kind) == torch.bfloat16
    strict, dense = sharded(draw_and_judge, len(metas), accelerator).unbind(1)
    per_tag, dense_tag = defaultdict(list), defaultdict(list)
    for m, s, d in zip(metas, strict.tolist(), dense.tolist()):
        per_tag[m.get("tag", "all")].append(s)
        dense_tag[m.get("tag", "all")].append(d)

    def mean(xs):
        return sum(xs) / len(xs)

    result = {
        "overall": mean([mean(v) for v in per_tag.values()]),
        "per_tag": {t: mean(v) for t, v in per_tag.items()},
        "dense_overall": mean([mean(v) for v in dense_tag.values()]),
        "dense_per_tag": {t: mean(v) for t, v in dense_tag.items()},
        "n_images": len(metas),
        "num_steps": num_steps,
        "guidance_scale": guidance_scale,
        "bf16": bf16,
        "machine": machine(),
    }
    if return_images:
        result.update(images=images, correct=strict, prompts=prompts, metas=metas)
    return result


def evaluate_reward(
    model: FlowModel,
    metas: list[dict],
    reward,
    images_per_prompt: int = 1,
    num_steps: int = 20,
    guidance_scale: float = 4.5,
    shift: float | None = None,
    seed: int = 1234,
    batch_size: int = 64,
    accelerator=None,
) -> dict:
    """Reward statistics of ODE samples of a prompt set (``flowrl eval --reward``; the trainer's evaluation of prompt
    sets without GenEval metadata, e.g. PickScore prompts).

    Args:
        model: the pipeline adapter (its LoRA, if any, is active; bf16 autocast if the caller enters it).
        metas: P prompt records (with ``prompt``, optionally ``tag``), e.g. from
            :func:`flowrl.prompt_sets.read_prompt_set`.
        reward: a callable ``(images, prompts, metadata) -> CombinedScores`` (``rewards.WeightedSum``).
        images_per_prompt: K samples of each prompt; image ``i = p * K + j`` (sample j of prompt p) is drawn from
            seed ``seed + i``, as ``flowrl generate -n K --seed S`` draws it.
        num_steps, guidance_scale, shift, batch_size: as in :func:`evaluate`.
        accelerator: as in :func:`evaluate` (images split over the processes, result gathered).

    Returns:
        ``{"overall": mean weighted total, "per_reward": {name: mean}, "per_tag": {tag: mean total},
        "rewards": {name: {"n_images", "mean", "std", "per_tag": {tag: mean}}}, "n_images", "num_steps",
        "guidance_scale", "bf16", "machine"}``: means over the ``P * K`` images in the reward's own units, ``std``
        the sample standard deviation (0 for one image), tags from the records' ``tag`` (none without).

    Example (what ``flowrl eval --reward clipscore --option model_path=assets/tiny-clip`` computes)::

        from flowrl.models import load_model
        from flowrl.prompt_sets import read_prompt_set
        from .rewards import WeightedSum, build_reward

        reward = WeightedSum({"clipscore": (build_reward("clipscore", model_path="assets/tiny-clip"), 1.0)})
        result = evaluate_reward(load_model("assets/tiny-sd3"), read_prompt_set("prompts.jsonl"), reward)
        result["rewards"]["clipscore"]["mean"]
    """

    metas = [m for m in metas for _ in range(images_per_prompt)]
    prompts = [m["prompt"] for m in metas]
    names = []

    def score(idx: list[int]) -> torch.Tensor:  # (len(idx), 1 + rewards): total, then each reward
        images = _draw(model, metas, idx, seed, num_steps, guidance_scale, shift, batch_size)
        scores = reward(images, [prompts[i] for i in idx], [metas[i] for i in idx])
        names[:] = list(scores.per_reward)
        return torch.stack([scores.total.float(), *(v.float() for v in scores.per_reward.values())], dim=1)

    kind = model.device.type
    bf16 = torch.is_autocast_enabled(kind) and torch.get_autocast_dtype(kind) == torch.bfloat16
    table = sharded(score, len(metas), accelerator)  # (P * K, 1 + rewards)
    if not names:  # this process drew no image (fewer images than processes)
        names = list(getattr(reward, "rewards", {}))
    records = [{"metadata": m} for m in metas]
    stats = {k: summarize(records, table[:, 1 + j].tolist()) for j, k in enumerate(names)}
    return {
        "overall": table[:, 0].mean().item(),
        "per_reward": {k: v["mean"] for k, v in stats.items()},
        "per_tag": summarize(records, table[:, 0].tolist())["per_tag"],
        "rewards": stats,
        "n_images": len(metas),
        "num_steps": num_steps,
        "guidance_scale": guidance_scale,
        "bf16": bf16,
        "machine": machine(),
    }


def summarize(records: list[dict], scores: list[float]) -> dict:
    """``{"n_images", "mean", "std", "per_tag": {tag: mean}}`` of the scores (tags from each record's metadata;
    ``std`` is the sample standard deviation, 0 for one image)."""
    values = torch.tensor(scores, dtype=torch.float64)
    by_tag = defaultdict(list)
    for record, score in zip(records, scores):
        if "tag" in record["metadata"]:
            by_tag[str(record["metadata"]["tag"])].append(score)
    return {
        "n_images": len(scores),
        "mean": values.mean().item() if scores else math.nan,
        "std": values.std().item() if len(scores) > 1 else 0.0,
        "per_tag": {t: sum(v) / len(v) for t, v in sorted(by_tag.items())},
    }
