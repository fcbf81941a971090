"""LoRA merging: several diffusers-format LoRA folders (what every flowrl run exports) into one, with a weight per LoRA;
Flow-OPD's cold start (arXiv 2605.08063, "Flow-based Cold-Start": the student starts from the merged single-reward
teachers) and ``flowrl merge``.

Notation: LoRA ``i`` adds ``dW_i = s_i B_i A_i`` to a layer's weight, with ``A_i`` `(r_i, in)`, ``B_i`` `(out, r_i)` and
the scale ``s_i = alpha_i / r_i``; ``w_i`` is its merge weight. The combinations (named as peft's
``add_weighted_adapter`` names them):

- ``cat``: ``A = [w_1 s_1 A_1; ...; w_n s_n A_n]`` (rows), ``B = [B_1, ..., B_n]`` (columns), rank ``sum r_i``, scale 1:
  exactly ``dW = sum_i w_i s_i B_i A_i``, the weighted sum of the LoRAs' weight deltas (the default);
- ``linear``: ``A = sum_i w_i A_i``, ``B = sum_i w_i B_i`` at the common rank and alpha: the official Flow-OPD merge
  script's factor-wise average (``scripts/merge.py`` of CostaliyA/Flow-OPD, weights 1/n), not the sum of the deltas;
- ``svd``: the rank-``rank`` truncated SVD of ``sum_i w_i s_i B_i A_i`` (``B = U S``, ``A = V^T``, scale 1).

peft's ``add_weighted_adapter`` computes the same combinations on adapters loaded into a model; here they are computed
on the files, so that no base model is loaded to merge LoRAs. With a base pipeline (:func:`merge_into_pipeline`) the
merged LoRA is fused into its network by diffusers (``fuse_lora``) and the whole pipeline written.
"""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import dataclass
from pathlib import Path

LORA_FILE = "pytorch_lora_weights.safetensors"
"""The weights file of a diffusers-format LoRA folder (``save_lora_weights``, flowrl's exports)."""
METADATA_KEY = "lora_adapter_metadata"
"""The safetensors metadata entry where diffusers keeps each component's peft config (``r``, ``lora_alpha``, ...)."""
COMBINATIONS = ("cat", "linear", "svd")
"""How :func:`merge_loras` combines the LoRAs (module docstring)."""


def lora_folder(path: str | Path, what: str) -> Path:
    """The LoRA folder `path` names: a folder holding :data:`LORA_FILE`, or a finished flowrl run folder (its exported
    ``lora/``), or a run's checkpoint folder (its ``lora/``).

    Args:
        path: the folder. what (`str`): how the error names it (``--lora``, ``config key 'train.opd.anchor'``).

    Raises:
        FileNotFoundError: `path` does not exist, or holds no LoRA (naming what was expected).
    """
    from .files import resolve_path

    folder = resolve_path(path)
    if not folder.is_dir():
        raise FileNotFoundError(f"{what}: {path} is not a folder (a LoRA folder or a flowrl run folder)")
    for candidate in (folder, folder / "lora"):
        if (candidate / LORA_FILE).is_file():
            return candidate
    extra = (
        " (the run trained the full network: it exported pipeline/, not a LoRA)"
        if (folder / "pipeline").is_dir()
        else ""
    )
    raise FileNotFoundError(
        f"{what}: {path} holds no {LORA_FILE} (expected a LoRA folder, or a finished flowrl run folder with lora/){extra}"
    )


@dataclass
class LoRAFile:
    """One LoRA file, read.

    Attributes:
        folder (`Path`): where it was read from.
        modules (`dict[str, tuple[torch.Tensor, torch.Tensor]]`): the module's key prefix (``transformer.blocks.0.
            attn.to_q``) -> ``(A (r, in), B (out, r))`` float32.
        scale (`dict[str, float]`): each component's (``transformer``, ``unet``) scale ``alpha / r``.
        metadata (`dict`): the diffusers metadata, component-prefixed peft config keys (``transformer.r``, ...).
    """

    folder: Path
    modules: dict
    scale: dict[str, float]
    metadata: dict


def read_lora(folder: Path) -> LoRAFile:
    """Read a LoRA folder's :data:`LORA_FILE` (safetensors, its header checked whole first).

    Raises:
        ValueError: naming the file: damaged, keys that are not ``*.lora_A.weight`` / ``*.lora_B.weight`` pairs of one
            rank, or a peft config with per-module ranks or alphas (``rank_pattern`` / ``alpha_pattern``: not merged).
    """
    from safetensors import safe_open

    from .files import check_safetensors

    file = folder / LORA_FILE
    check_safetensors(file)
    with safe_open(str(file), framework="pt", device="cpu") as f:
        raw = (f.metadata() or {}).get(METADATA_KEY)
        tensors = {k: f.get_tensor(k).float() for k in f.keys()}
    metadata = json.loads(raw) if raw else {}
    modules: dict[str, list] = {}
    for key, tensor in tensors.items():
        for part, slot in ((".lora_A.weight", 0), (".lora_B.weight", 1)):
            if key.endswith(part):
                modules.setdefault(key[: -len(part)], [None, None])[slot] = tensor
                break
        else:
            raise ValueError(f"{file}: key {key!r} is not a LoRA factor (*.lora_A.weight or *.lora_B.weight)")
    for name, (a, b) in modules.items():
        if a is None or b is None or a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
            raise ValueError(f"{file}: module {name!r} has no matching lora_A (r, in) and lora_B (out, r) pair")
    scale = {}
    for component in sorted({name.split(".", 1)[0] for name in modules}):
        if metadata.get(f"{component}.rank_pattern") or metadata.get(f"{component}.alpha_pattern"):
            raise ValueError(f"{file}: per-module ranks or alphas (rank_pattern / alpha_pattern) are not merged")
        rank = next(a.shape[0] for n, (a, _) in modules.items() if n.split(".", 1)[0] == component)
        alpha = metadata.get(f"{component}.lora_alpha", rank)  # diffusers' default without metadata: alpha = rank
        scale[component] = float(alpha) / float(metadata.get(f"{component}.r", rank))
    return LoRAFile(folder, {n: (a, b) for n, (a, b) in modules.items()}, scale, metadata)


def lora_as_params(folder: Path, params: dict, lora_alpha: float, lora_rank: int) -> dict:
    """A LoRA folder's factors as a trained LoRA's tensors by its parameter names (peft's default adapter,
    ``MODULE.lora_A.default.weight``), whole, float32, each ``B`` rescaled by the ratio of the file's scale ``alpha /
    r`` to the trained LoRA's ``lora_alpha / lora_rank``, so that the weight deltas ``scale B A`` are the file's: a
    distilled student, a cold start or a teacher written into (or swapped into) the trained LoRA.

    Args:
        folder (`Path`): a LoRA folder (:data:`LORA_FILE`; :func:`lora_folder` resolves a run's).
        params (`dict[str, torch.Tensor]`): the trained LoRA's parameters by name (their whole shapes: a ``DTensor``'s
            ``shape`` is the whole one).
        lora_alpha (`float`), lora_rank (`int`): the trained LoRA's.

    Raises:
        ValueError: the file unreadable (:func:`read_lora`), or a LoRA of other modules or another rank than the
            trained one's.
    """
    lora = read_lora(folder)
    scale = lora_alpha / lora_rank
    out = {}
    for name, (a, b) in lora.modules.items():
        module = name.split(".", 1)[1]  # without the component prefix (transformer., unet.)
        out[f"{module}.lora_A.default.weight"] = a
        out[f"{module}.lora_B.default.weight"] = b * lora.scale[name.split(".", 1)[0]] / scale
    trained = {n for n in params if ".lora_" in n}
    if out.keys() != trained or any(tuple(v.shape) != tuple(params[n].shape) for n, v in out.items()):
        raise ValueError(
            f"{lora.folder} is a LoRA of other modules or rank than the trained one (rank {lora_rank} of the family's "
            f"targets); merge it to that rank with flowrl merge --combination svd --rank {lora_rank}"
        )
    return out


def check_mergeable(loras: list[LoRAFile]) -> None:
    """Refuse LoRAs that are not of one base model, in one line naming the two folders.

    Raises:
        ValueError: different modules targeted, or a module of different ``in`` / ``out`` features.
    """
    first = loras[0]
    for other in loras[1:]:
        if other.modules.keys() != first.modules.keys():
            only = sorted(first.modules.keys() ^ other.modules.keys())
            raise ValueError(
                f"LoRA folders {first.folder} and {other.folder} target different modules ({len(only)} in one only, "
                f"e.g. {only[0]}): not LoRAs of one model with one target list"
            )
        for name, (a, b) in first.modules.items():
            a2, b2 = other.modules[name]
            if a.shape[1] != a2.shape[1] or b.shape[0] != b2.shape[0]:
                raise ValueError(
                    f"LoRA folders {first.folder} and {other.folder} are not of one base model: module {name} is "
                    f"{b.shape[0]}x{a.shape[1]} in one, {b2.shape[0]}x{a2.shape[1]} in the other"
                )


def merge_factors(loras: list[LoRAFile], weights: list[float], combination: str, rank: int | None = None):
    """The merged LoRA's factors and rank.

    Args:
        loras: at least one, mergeable (:func:`check_mergeable`). weights: one finite float per LoRA.
        combination: one of :data:`COMBINATIONS`. rank: ``svd`` only: the merged rank (default the largest input rank).

    Returns:
        ``(modules, rank, alpha)``: module -> ``(A (r, in), B (out, r))`` float32, the merged rank ``r`` and alpha
        (``cat`` and ``svd``: alpha = r, scale 1; ``linear``: the inputs' alpha).

    Raises:
        ValueError: ``linear`` over LoRAs of different ranks or alphas (its factor-wise sum needs one of each).
    """
    import torch

    out = {}
    ranks = {a.shape[0] for lora in loras for a, _ in lora.modules.values()}
    if combination == "linear":
        scales = {s for lora in loras for s in lora.scale.values()}
        if len(ranks) > 1 or len(scales) > 1:
            raise ValueError(
                f"combination linear sums the LoRAs' factors, which needs one rank and one alpha (ranks {sorted(ranks)}, "
                f"scales alpha/r {sorted(scales)}); use cat (exact) or svd"
            )
        r = ranks.pop()
        for name in loras[0].modules:
            a = sum(w * lora.modules[name][0] for lora, w in zip(loras, weights))  # (r, in)
            b = sum(w * lora.modules[name][1] for lora, w in zip(loras, weights))  # (out, r)
            out[name] = (a, b)
        return out, r, next(iter(scales)) * r
    for name in loras[0].modules:
        component = name.split(".", 1)[0]
        parts = [
            (w * lora.scale[component] * lora.modules[name][0], lora.modules[name][1])
            for lora, w in zip(loras, weights)
        ]
        if combination == "cat":
            out[name] = (
                torch.cat([a for a, _ in parts]),
                torch.cat([b for _, b in parts], dim=1),
            )  # (R, in), (out, R)
        else:  # svd of the summed delta (float64), zero-padded where a layer has fewer singular values than the rank
            delta = sum(b.double() @ a.double() for a, b in parts)  # (out, in)
            u, s, vh = torch.linalg.svd(delta, full_matrices=False)
            k = rank or max(ranks)
            a, b = vh[:k].float(), (u[:, :k] * s[:k]).float()  # (<=k, in), (out, <=k)
            pad = k - a.shape[0]
            out[name] = (torch.nn.functional.pad(a, (0, 0, 0, pad)), torch.nn.functional.pad(b, (0, pad)))
    r = next(iter(out.values()))[0].shape[0]  # cat: sum r_i; svd: the rank
    return out, r, float(r)


def check_merge_args(folders, weights, combination: str, rank: int | None) -> tuple[list[Path], list[float]]:
    """Check :func:`merge_loras`' arguments before anything heavy is imported; returns the LoRA folders and weights.

    Raises:
        FileNotFoundError: a folder without a LoRA (:func:`lora_folder`). ValueError: no folder, a weight count that is
            not the folders', a weight that is not finite, an unknown combination, a rank below 1 or a rank given to
            a combination other than svd.
    """
    if not folders:
        raise ValueError("merge: name at least one LoRA folder")
    if combination not in COMBINATIONS:
        raise ValueError(f"combination {combination!r}: expected one of {', '.join(COMBINATIONS)}")
    if rank is not None and (combination != "svd" or rank < 1):
        raise ValueError(
            f"rank {rank}: a rank >= 1, with combination svd only (cat and linear keep the inputs' ranks)"
        )
    if weights is None:
        weights = [1.0 / len(folders)] * len(folders)  # the average, as Flow-OPD's cold start
    weights = [float(w) for w in weights]
    if len(weights) != len(folders):
        raise ValueError(f"weights: {len(weights)} given for {len(folders)} LoRA folders; give one per folder")
    if not all(math.isfinite(w) for w in weights):
        raise ValueError(f"weights {weights}: each must be a finite number")
    return [lora_folder(f, "LoRA") for f in folders], weights


def merge_loras(folders, out: str | Path, weights=None, combination: str = "cat", rank: int | None = None) -> Path:
    """Merge diffusers-format LoRA folders (or finished flowrl runs: their ``lora/``) into one LoRA folder `out`
    (module docstring: ``cat`` is the exact weighted sum of the weight deltas), loadable by the stock pipeline's
    ``load_lora_weights`` and by ``flowrl eval --lora``.

    Args:
        folders: LoRA or run folders, at least one. out: the new folder (must not hold a LoRA already).
        weights: one float per folder (default ``1 / n`` each: their average). combination: ``cat`` | ``linear`` |
            ``svd``. rank: ``svd``'s merged rank (default the largest input rank).

    Returns:
        `Path`: `out`.

    Raises:
        FileNotFoundError, ValueError: as :func:`check_merge_args`, :func:`read_lora`, :func:`check_mergeable` and
            :func:`merge_factors`; FileExistsError: `out` holds a LoRA already.
    """
    from safetensors.torch import save_file

    paths, weights = check_merge_args(folders, weights, combination, rank)
    out = Path(out)
    if (out / LORA_FILE).exists():
        raise FileExistsError(f"--out {out} holds a LoRA already; choose a new folder")
    loras = [read_lora(p) for p in paths]
    check_mergeable(loras)
    modules, r, alpha = merge_factors(loras, weights, combination, rank)
    tensors = {}
    for name, (a, b) in modules.items():
        tensors[f"{name}.lora_A.weight"] = a.contiguous()
        tensors[f"{name}.lora_B.weight"] = b.contiguous()
    metadata = dict(
        loras[0].metadata
    )  # without metadata diffusers reads alpha = rank: cat and svd's, linear's input's
    if metadata:
        for component in loras[0].scale:
            metadata.update({f"{component}.r": r, f"{component}.lora_alpha": alpha})
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / (LORA_FILE + ".tmp")
    header = {"format": "pt", **({METADATA_KEY: json.dumps(metadata, indent=2, sort_keys=True)} if metadata else {})}
    save_file(tensors, str(tmp), metadata=header)
    tmp.replace(out / LORA_FILE)
    return out


def merge_into_pipeline(lora: str | Path, base: str | Path, out: str | Path, device: str = "cpu") -> Path:
    """Fuse a LoRA folder into the network of the diffusers pipeline `base` (diffusers' ``fuse_lora`` then
    ``unload_lora``) and write the whole pipeline to `out` (safetensors): a model folder for ``flowrl eval --model``,
    ``flowrl train model.path=...`` or the stock pipeline class's ``from_pretrained``.

    Raises:
        FileNotFoundError, ValueError: `base` is not a pipeline folder flowrl loads, or the LoRA is not of its network.
    """
    from .files import check_model_folder, resolve_path
    from .models import build_adapter, model_class, resolve_device

    path = resolve_path(base)
    check_model_folder(path)
    model = build_adapter(model_class(path), path, resolve_device(device))
    model.load_lora(lora)
    model.transformer.fuse_lora()
    model.transformer.unload_lora()
    out = Path(out)
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pipeline(tmp)
    tmp.rename(out)
    return out
