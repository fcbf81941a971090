"""Folders of images: written by ``flowrl generate`` for a benchmark, read and scored by ``flowrl score``.

Two layouts:

- ``geneval`` (GenEval's own, which its ``evaluation/evaluate_images.py`` reads): ``<out>/<i:05d>/metadata.jsonl``
  holding prompt ``i``'s record as one JSON object, and ``<out>/<i:05d>/samples/<j:04d>.png``, sample ``j``.
- ``flat``: ``<out>/<n:05d>.png`` (``n = i * K + j``) and ``<out>/prompts.jsonl``, one line per image with its
  ``file``, ``index`` (prompt), ``sample``, ``seed`` and the prompt's record.

Image ``j`` of prompt ``i`` is drawn from seed ``seed + i * K + j`` whatever the batch size or the number of
processes, so a folder is the same however it was generated.
"""

from __future__ import annotations

import csv
import json
import re
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch

from .files import atomic_output, write_text_atomic

__all__ = [
    "LAYOUTS",
    "generate_folder",
    "load_image",
    "read_image_folder",
    "score_records",
    "write_scores",
]

LAYOUTS = ("geneval", "flat")
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp")
_SAMPLE = re.compile(r"\d+\.png")  # GenEval's evaluate_images.py reads only these names


def _save_png(image: torch.Tensor, path: Path) -> None:
    """Save a `(3, H, W)` float image in [0, 1] as an 8-bit PNG (atomically); a video `(F, 3, H, W)` as an mp4 beside
    the PNG, which then holds 8 of its frames side by side (:mod:`flowrl.video`)."""
    from PIL import Image

    if image.ndim == 4:
        from .video import frame_strip, write_mp4

        with atomic_output(path.with_suffix(".mp4")) as tmp:
            write_mp4(image, tmp)
        image = frame_strip(image, 8)  # (3, H, 8 W)
    array = (image.detach().float().clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).cpu().numpy()
    with atomic_output(path) as tmp:
        Image.fromarray(array).save(tmp, format="PNG")


def generate_folder(
    model,
    metas: list[dict],
    out: str | Path,
    k: int = 4,
    layout: str = "geneval",
    seed: int = 1234,
    num_steps: int = 20,
    guidance_scale: float = 4.5,
    shift: float | None = None,
    batch_size: int = 16,
    accelerator=None,
    progress: Callable[[int], None] | None = None,
) -> int:
    """Generate ``k`` images per prompt (deterministic ODE samples, :func:`flowrl.evaluation.generate`) into ``out``.

    Args:
        model: the pipeline adapter (its LoRA, if any, is active; bf16 autocast if the caller enters it).
        metas: the prompt records (:func:`flowrl.prompt_sets.read_prompt_set`), at least one.
        out: the folder (made if missing).
        k (`int`, `>= 1`): images per prompt. layout: one of :data:`LAYOUTS` (see the module docstring).
        seed: image ``j`` of prompt ``i`` uses ``seed + i * k + j``. num_steps, guidance_scale, shift: the sampler's.
        batch_size: images generated (and held in memory) at once.
        accelerator: an ``accelerate.Accelerator``; with ``P`` processes, process ``r`` draws the prompts
            ``r, r + P, ...`` (the files are the same as with one process); the main process writes ``prompts.jsonl``.
        progress: called with the number of images each time a batch is written.

    Returns:
        `int`: the number of images this process wrote.

    Raises:
        ValueError: ``k < 1``, no prompt, an unknown `layout`, or a prompt record without a string ``prompt``.
    """
    from . import evaluation  # the models and diffusers: loaded when a folder is drawn, not when the CLI starts

    if k < 1 or not metas:
        raise ValueError(f"generate_folder needs k >= 1 and at least one prompt; got k={k}, {len(metas)} prompts")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    out = Path(out)
    rank, procs = (0, 1) if accelerator is None else (accelerator.process_index, accelerator.num_processes)
    items = [(i, j) for i in range(rank, len(metas), procs) for j in range(k)]  # this process's images
    if layout == "flat" and rank == 0:
        lines = [
            {**m, "file": f"{i * k + j:05d}.png", "index": i, "sample": j, "seed": seed + i * k + j}
            for i, m in enumerate(metas)
            for j in range(k)
        ]
        out.mkdir(parents=True, exist_ok=True)
        write_text_atomic(out / "prompts.jsonl", "".join(json.dumps(line) + "\n" for line in lines))
    if layout == "geneval":
        for i in range(rank, len(metas), procs):
            (out / f"{i:05d}" / "samples").mkdir(parents=True, exist_ok=True)
            write_text_atomic(out / f"{i:05d}" / "metadata.jsonl", json.dumps(metas[i]) + "\n")
    for start in range(0, len(items), batch_size):
        chunk = items[start : start + batch_size]
        images = evaluation.generate(
            model,
            [metas[i]["prompt"] for i, _ in chunk],
            [seed + i * k + j for i, j in chunk],
            num_steps,
            guidance_scale,
            shift,
            batch_size,
            metas=[metas[i] for i, _ in chunk],
        )  # (b, 3, H, W) in [0, 1]
        for (i, j), image in zip(chunk, images):
            path = (
                out / f"{i:05d}" / "samples" / f"{j:04d}.png" if layout == "geneval" else out / f"{i * k + j:05d}.png"
            )
            _save_png(image, path)
        if progress is not None:
            progress(len(chunk))
    return len(items)


def load_image(path: str | Path) -> torch.Tensor:
    """An image file as a float32 `(3, H, W)` tensor in [0, 1] (RGB; alpha and palettes converted by PIL).

    Raises:
        ValueError: naming the file, when PIL cannot read it.
    """
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as image:
            array = np.asarray(image.convert("RGB"))  # (H, W, 3) uint8
    except (UnidentifiedImageError, OSError) as e:
        raise ValueError(f"image {path} cannot be read: {e}") from None
    return torch.from_numpy(array.copy()).permute(2, 0, 1).float() / 255


def _geneval_folder(folder: Path) -> list[dict]:
    """The records of a GenEval-layout folder (``<i>/metadata.jsonl`` + ``<i>/samples/<j>.png``).

    Raises:
        ValueError: naming the file, for a ``metadata.jsonl`` that is not one JSON object with a string ``prompt``, or
            missing beside a ``samples`` folder.
    """
    records = []
    for sub in sorted(p for p in folder.iterdir() if p.is_dir() and p.name.isdigit()):
        meta_file = sub / "metadata.jsonl"
        if not meta_file.is_file():
            if (sub / "samples").is_dir():  # its images would be left out without a word
                raise ValueError(
                    f"{meta_file} does not exist; GenEval's layout has the prompt's record beside {sub / 'samples'}"
                )
            continue
        try:
            meta = json.loads(meta_file.read_text())
        except ValueError as e:
            raise ValueError(
                f"{meta_file} is not one JSON object ({e}); GenEval's layout has the prompt's record there"
            ) from None
        if not isinstance(meta, dict) or not isinstance(meta.get("prompt"), str):
            raise ValueError(f"{meta_file} must hold one JSON object with a string 'prompt'")
        samples = sub / "samples"
        names = sorted(p.name for p in samples.iterdir() if _SAMPLE.fullmatch(p.name)) if samples.is_dir() else []
        records += [{"file": str(samples / n), "prompt": meta["prompt"], "metadata": meta} for n in names]
    return records


def _flat_folder(folder: Path) -> list[dict]:
    """The records of a flat folder with ``prompts.jsonl`` (a ``file`` key per line)."""
    from .data import read_jsonl

    records = []
    for n, line in enumerate(read_jsonl(folder / "prompts.jsonl"), 1):
        if not isinstance(line.get("file"), str):
            raise ValueError(f"{folder / 'prompts.jsonl'}:{n}: needs a 'file' key naming the image")
        meta = {k: v for k, v in line.items() if k not in ("file", "index", "sample", "seed")}
        records.append({"file": str(folder / line["file"]), "prompt": line["prompt"], "metadata": meta})
    return records


def read_image_folder(paths: Sequence[str | Path], prompts: list[dict] | None = None) -> list[dict]:
    """The images to score, each with its prompt and metadata.

    Each path is a GenEval-layout folder (prompts from its ``metadata.jsonl`` files), a flat folder with
    ``prompts.jsonl`` (as ``flowrl generate`` writes), another folder (its image files, sorted by name), or an
    image file. Loose images take their prompts from `prompts`: records with a ``file`` key are matched by file
    name; otherwise one record per image in sorted order, or a single record for every image. Without `prompts`,
    loose images get the empty prompt (enough for prompt-free rewards such as ``jpeg_compressibility``).

    Args:
        paths: folders and files. prompts: prompt records (:func:`flowrl.prompt_sets.read_prompt_set`) or None.

    Returns:
        ``[{"file": str, "prompt": str, "metadata": dict}, ...]`` in a stable order.

    Raises:
        FileNotFoundError: a path that does not exist. ValueError: no image found, `prompts` given for folders
            that carry their own, or `prompts` that do not match the loose images (counts or names given).
    """
    records, loose = [], []
    for path in map(Path, paths):
        if not path.exists():
            raise FileNotFoundError(f"{path} does not exist")
        if path.is_file():
            if path.suffix.lower() not in IMAGE_SUFFIXES:
                raise ValueError(f"{path} is not an image file (expected {', '.join(IMAGE_SUFFIXES)}) or a folder")
            loose.append(path)
        elif (path / "prompts.jsonl").is_file():
            records += _flat_folder(path)
        elif geneval := _geneval_folder(path):
            records += geneval
        else:
            loose += sorted(p for p in path.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
    if prompts is not None and records:
        raise ValueError(
            "--prompts is for loose images; the folders given carry their own prompts "
            "(metadata.jsonl or prompts.jsonl)"
        )
    if loose:
        metas = [{"prompt": ""}] * len(loose) if prompts is None else _match(loose, prompts)
        records += [{"file": str(p), "prompt": m["prompt"], "metadata": m} for p, m in zip(loose, metas)]
    if not records:
        raise ValueError(
            f"no images found in {', '.join(map(str, paths))} (image files {', '.join(IMAGE_SUFFIXES)}, "
            "a GenEval-layout folder, or a folder with prompts.jsonl)"
        )
    return records


def _match(files: list[Path], prompts: list[dict]) -> list[dict]:
    """The prompt record of each loose image: by ``file`` name, by position, or the one record for all."""
    if all("file" in m for m in prompts):
        by_name = {Path(str(m["file"])).name: m for m in prompts}
        missing = [f.name for f in files if f.name not in by_name]
        if missing:
            raise ValueError(f"--prompts has no record with 'file' {missing[0]!r} ({len(missing)} images unmatched)")
        return [by_name[f.name] for f in files]
    if len(prompts) == 1:
        return prompts * len(files)
    if len(prompts) != len(files):
        raise ValueError(
            f"--prompts holds {len(prompts)} prompts for {len(files)} images; give one per image (in the "
            "images' name order), one for all, or records with a 'file' key"
        )
    return prompts


def score_records(
    reward, records: list[dict], batch_size: int = 16, progress: Callable[[int], None] | None = None
) -> list[float]:
    """Score every image of `records` (:func:`read_image_folder`) with `reward`.

    Consecutive images of the same size are scored together, `batch_size` at a time.

    Args:
        reward: a reward callable ``(images, prompts, metadata) -> (B,)``, or a `rewards.WeightedSum`.
        batch_size (`int`, `>= 1`). progress: called with the number of images after each batch.

    Returns:
        One float score per record, in order.

    Raises:
        rewards.RewardError: the reward raised (named, chained); ValueError: a malformed score or image.
    """
    from .rewards import WeightedSum, reward_name

    combined = reward if isinstance(reward, WeightedSum) else WeightedSum({reward_name(reward): (reward, 1.0)})
    scores: list[float] = []
    batch: list[torch.Tensor] = []
    start = 0

    def flush():
        nonlocal batch, start
        chunk = records[start : start + len(batch)]
        total = combined(torch.stack(batch), [r["prompt"] for r in chunk], [r["metadata"] for r in chunk]).total
        scores.extend(total.tolist())
        start += len(batch)
        batch = []
        if progress is not None:
            progress(len(chunk))

    for record in records:
        image = load_image(record["file"])  # (3, H, W)
        if batch and (image.shape != batch[0].shape or len(batch) == batch_size):
            flush()
        batch.append(image)
    if batch:
        flush()
    return scores


def write_scores(records: list[dict], scores: list[float], out: str | Path) -> None:
    """Write one row per image, ``file``, ``prompt``, ``tag`` and ``score``: CSV for a ``.csv`` path, else JSON lines."""
    rows = [
        {"file": r["file"], "prompt": r["prompt"], "tag": r["metadata"].get("tag", ""), "score": s}
        for r, s in zip(records, scores)
    ]
    with atomic_output(out) as tmp:
        with open(tmp, "w", newline="") as f:
            if str(out).lower().endswith(".csv"):
                writer = csv.DictWriter(f, fieldnames=["file", "prompt", "tag", "score"])
                writer.writeheader()
                writer.writerows(rows)
            else:
                f.writelines(json.dumps(row) + "\n" for row in rows)
