"""Checkpoints: trainable weights, EMA and optimizer state in safetensors, plus the LoRA in diffusers
format and a JSON of the iteration and RNG state. No pickles: ``torch.load`` is never called.

Every checkpoint is verified: ``state.json``, written last, records the size and SHA-256 of every other file
(``"files"``), and :func:`verify_checkpoint` checks them before anything is read, so a truncated or replaced
file makes the checkpoint unusable rather than half-loaded (see ``docs/reliability.md``)."""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from .files import write_text_atomic


def _flatten_optimizer(state: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """An optimizer ``state_dict`` as safetensors tensors and JSON: each entry of a parameter's state under the name
    ``"<param id>.<key>"``, and an entry of a nested dict under ``"<param id>.<key>.<sub key>"`` (bitsandbytes' 8-bit
    optimizers nest their uint8 moments, float32 block maxima and quantization maps under one key); tensors keep their
    dtype, other values go to the JSON ``"scalars"``."""
    tensors, meta = {}, {"param_groups": state["param_groups"], "scalars": {}}

    def put(name: str, value) -> None:
        if isinstance(value, dict):
            for key, sub in value.items():
                put(f"{name}.{key}", sub)
        elif torch.is_tensor(value):
            tensors[name] = value.contiguous()
        else:
            meta["scalars"][name] = value

    for pid, pstate in state["state"].items():
        put(str(pid), pstate)
    return tensors, meta


def _unflatten_optimizer(tensors: dict[str, torch.Tensor], meta: dict) -> dict:
    """The ``state_dict`` :func:`_flatten_optimizer` flattened (nested dicts rebuilt from the dotted names)."""
    state: dict[int, dict] = {}
    for name, value in list(tensors.items()) + list(meta["scalars"].items()):
        pid, *path = name.split(".")
        node = state.setdefault(int(pid), {})
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return {"state": state, "param_groups": meta["param_groups"]}


CHECKPOINT_FILES = ("trainable.safetensors", "optimizer.safetensors", "state.json")  # every checkpoint has these
STATE_KEYS = ("iteration", "optimizer", "rng", "extra", "files")  # every state.json has these


class CheckpointError(ValueError):
    """A checkpoint that fails verification or does not fit the model; the message names the folder and why."""


class DiskFullError(OSError):
    """The disk filled up during a run: the message names the newest verified checkpoint, the one a resume continues
    from (:func:`disk_full_error`)."""


def is_disk_full(error: BaseException) -> bool:
    """Whether ``error`` is a full disk or quota (``ENOSPC`` / ``EDQUOT``, or a writer's message saying so)."""
    import errno

    codes = (errno.ENOSPC, errno.EDQUOT)
    return (isinstance(error, OSError) and error.errno in codes) or "No space left on device" in str(error)


def disk_full_error(error: BaseException, directory: str | Path) -> DiskFullError:
    """A :class:`DiskFullError` for ``error`` (a full disk while a run wrote) naming the newest verified checkpoint
    under ``directory`` (the run's ``checkpoints/``), or saying that none was written yet."""
    where = f" ({error.filename})" if getattr(error, "filename", None) else ""
    latest = latest_checkpoint(directory)
    if latest is None:
        after = "no checkpoint had been written yet: free space and start the run again"
    else:
        after = (
            f"{latest} (iteration {checkpoint_iteration(latest)}) is verified and usable: free space and continue "
            "with run.resume=true"
        )
    return DiskFullError(f"no space left on the device while writing{where}; {after}")


@contextmanager
def explain_disk_full(directory: str | Path):
    """Re-raise a full disk or quota met inside the block (:func:`is_disk_full`) as a :class:`DiskFullError` naming
    the newest verified checkpoint under ``directory`` (:func:`disk_full_error`); other errors pass unchanged."""
    try:
        yield
    except OSError as e:
        if isinstance(e, DiskFullError) or not is_disk_full(e):
            raise
        raise disk_full_error(e, directory) from e


def _digest(path: Path) -> dict:
    """``{"size": bytes, "sha256": hex}`` of one file, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return {"size": path.stat().st_size, "sha256": h.hexdigest()}


def _manifest(folder: Path) -> dict[str, dict]:
    """The :func:`_digest` of every file under ``folder`` but ``state.json``, by path relative to it."""
    return {
        p.relative_to(folder).as_posix(): _digest(p)
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.relative_to(folder).as_posix() != "state.json"
    }


def verify_checkpoint(path: str | Path) -> dict:
    """Verify a checkpoint folder against its ``state.json``: readable, with every key of :data:`STATE_KEYS`, and
    every file it lists present with the recorded size and SHA-256. Reads every file once; loads nothing.

    Args:
        path (`str` or `Path`): a folder written by :func:`save_checkpoint`.

    Returns:
        `dict`: the parsed ``state.json``.

    Raises:
        CheckpointError: naming the folder and the first problem found (a missing or unreadable file, a missing
            key, a size or checksum that differs).
    """
    path = Path(path)
    for name in CHECKPOINT_FILES:
        if not (path / name).is_file():
            raise CheckpointError(f"checkpoint {path} is incomplete: no {name}")
    try:
        state = json.loads((path / "state.json").read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint {path} has an unreadable state.json ({type(e).__name__})") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"checkpoint {path}: state.json is not a JSON object")
    missing = [key for key in STATE_KEYS if key not in state]
    if missing:
        reason = "no file checksums (written by an older flowrl)" if missing == ["files"] else f"no key {missing[0]!r}"
        raise CheckpointError(f"checkpoint {path}: state.json has {reason}")
    files = state["files"]
    if not isinstance(files, dict) or not {"trainable.safetensors", "optimizer.safetensors"} <= files.keys():
        raise CheckpointError(f"checkpoint {path}: state.json's 'files' does not list the weights")
    for name, want in files.items():
        want, file = want if isinstance(want, dict) else {}, path / name
        if not file.is_file():
            raise CheckpointError(f"checkpoint {path} is incomplete: no {name}")
        if file.stat().st_size != want.get("size"):
            raise CheckpointError(
                f"checkpoint {path}: {name} has {file.stat().st_size} bytes, {want.get('size')} "
                "were written (truncated or replaced)"
            )
        if _digest(file)["sha256"] != want.get("sha256"):
            raise CheckpointError(f"checkpoint {path}: {name} does not match its SHA-256 (damaged or replaced)")
    return state


def _fsync(path: Path) -> None:
    """Flush one file or folder entry to disk; a no-op where the platform cannot (e.g. folders on Windows)."""
    flags = os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if path.is_dir() else 0)
    try:
        fd = os.open(path, flags)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _fsync_tree(folder: Path) -> None:
    """Flush every file of `folder` and the folder itself (so that a rename after it is durable)."""
    for path in sorted(folder.rglob("*")) + [folder]:
        _fsync(path)


def save_checkpoint(
    directory: str | Path,
    iteration: int,
    params: dict[str, torch.Tensor],
    optimizer: torch.optim.Optimizer | dict,
    ema: dict[str, torch.Tensor] | None = None,
    extra: dict | None = None,
    write_extra_files: Callable[[Path], None] | None = None,
) -> Path:
    """Write ``directory/checkpoint-{iteration:06d}`` atomically.

    Everything is written to a temp folder and flushed to disk, and ``state.json`` is written last, recording
    the size and SHA-256 of every other file (:func:`verify_checkpoint` checks them); the
    folder is then renamed into place. A crash at any point leaves the previous checkpoints intact and at
    most a ``.tmp-*`` folder (ignored by :func:`latest_checkpoint`). Re-saving an existing iteration moves
    the old folder aside first and deletes it only after the new one is in place.

    Args:
        directory (`str` or `Path`): the run's checkpoint folder (created if missing).
        iteration (`int`): iterations completed, `>= 0`; names the folder.
        params (`dict[str, torch.Tensor]`): trainable tensors by name (saved as float32 safetensors).
        optimizer (`torch.optim.Optimizer` or `dict`): the optimizer, or its ``state_dict()`` (whole tensors: what
            :meth:`flowrl.policy.Policy.save` gathers under FSDP2); flattened to tensors (safetensors) and JSON.
        ema (`dict[str, torch.Tensor]`, optional): EMA shadow tensors by name.
        extra (`dict`, optional): JSON-serialisable state (e.g. schedule state) stored beside the RNG states.
        write_extra_files (callable, optional): called with the temp folder to add files (e.g. the LoRA in
            diffusers format) before the checkpoint is sealed.

    Returns:
        `Path`: the checkpoint folder.

    Raises:
        OSError: if the folder cannot be written; TypeError: if `extra` is not JSON-serialisable.
    """
    directory = Path(directory)
    final = directory / f"checkpoint-{iteration:06d}"
    tmp = directory / f".tmp-checkpoint-{iteration:06d}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file({k: v.detach().float().contiguous().cpu() for k, v in params.items()}, tmp / "trainable.safetensors")
    tensors, meta = _flatten_optimizer(optimizer if isinstance(optimizer, dict) else optimizer.state_dict())
    save_file({k: v.cpu() for k, v in tensors.items()}, tmp / "optimizer.safetensors")
    if ema is not None:
        save_file({k: v.detach().cpu().contiguous() for k, v in ema.items()}, tmp / "ema.safetensors")
    torch_rng = torch.get_rng_state()
    state = {
        "iteration": iteration,
        "optimizer": meta,
        "rng": {
            "python": random.getstate()[1],
            "numpy": [v.tolist() if hasattr(v, "tolist") else v for v in np.random.get_state()[1:]],
            "torch": torch_rng.tolist(),
        },
        "extra": extra or {},
    }
    if write_extra_files is not None:
        write_extra_files(tmp)
    state["files"] = _manifest(tmp)
    (tmp / "state.json").write_text(json.dumps(state))  # last: its presence marks a complete checkpoint
    _fsync_tree(tmp)
    old = directory / f".old-checkpoint-{iteration:06d}"
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        final.rename(old)
    tmp.rename(final)
    _fsync(directory)
    shutil.rmtree(old, ignore_errors=True)
    return final


def checkpoint_iteration(path: Path) -> int:
    """The iteration a ``checkpoint-<iteration>`` folder is named after."""
    return int(path.name.split("-")[1])


def _checkpoint_folders(directory: str | Path) -> list[Path]:
    """The ``checkpoint-<iteration>`` folders under ``directory``, newest (highest iteration) first."""
    folders = [
        p for p in Path(directory).glob("checkpoint-*") if p.is_dir() and re.fullmatch(r"checkpoint-\d+", p.name)
    ]
    return sorted(folders, key=checkpoint_iteration, reverse=True)


def choose_checkpoint(directory: str | Path) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The newest ``checkpoint-*`` folder under ``directory`` that passes :func:`verify_checkpoint`, and the newer
    ones it skipped, each with the reason.

    Args:
        directory (`str` or `Path`): the run's checkpoint folder (may be missing).

    Returns:
        `tuple`: ``(folder or None, [(skipped folder, reason), ...])``, the skipped ones newest first.
    """
    skipped = []
    for path, problem in _verified(_checkpoint_folders(directory)):
        if problem is None:
            return path, skipped
        skipped.append((path, problem))
    return None, skipped


def _verified(folders: list[Path], trusted: str | None = None):
    """Yield ``(folder, None)`` for each of `folders` (in order) that passes :func:`verify_checkpoint`, else
    ``(folder, reason)``; the folder named `trusted` (one :func:`save_checkpoint` has just written) counts as
    verified without reading its files again."""
    for path in folders:
        if path.name == trusted:
            yield path, None
            continue
        try:
            verify_checkpoint(path)
        except CheckpointError as e:
            yield path, str(e)
            continue
        yield path, None


def latest_checkpoint(directory: str | Path) -> Path | None:
    """The newest verified ``checkpoint-*`` folder under ``directory`` (:func:`choose_checkpoint`), or None. An
    incomplete or damaged newer folder is skipped in favour of the one before it."""
    return choose_checkpoint(directory)[0]


def prune_checkpoints(directory: str | Path, keep: int, just_saved: str | Path | None = None) -> list[Path]:
    """Delete the oldest checkpoints so that the newest `keep` verified ones remain (as transformers'
    ``save_total_limit``). Only folders older than the oldest kept one are deleted, so an incomplete or
    damaged newer folder is never the reason a verified one goes, and `just_saved` is always kept (and counts as
    verified without its files being read again: it was just written). Verifies
    the newest folders only until `keep` pass.

    Args:
        directory (`str` or `Path`): the run's checkpoint folder.
        keep (`int`, `>= 1`): verified checkpoints to keep (as :func:`verify_checkpoint` judges).
        just_saved (`str` or `Path`, optional): the folder :func:`save_checkpoint` just returned.

    Returns:
        `list[Path]`: the deleted folders, oldest first.

    Raises:
        ValueError: if `keep < 1`.
    """
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    folders = _checkpoint_folders(directory)  # newest first
    saved = Path(just_saved).name if just_saved is not None else None
    verified = []
    for path, problem in _verified(folders, trusted=saved):
        if problem is None:
            verified.append(path)
            if len(verified) == keep:
                break
    if len(verified) < keep:
        return []
    oldest_kept = checkpoint_iteration(verified[-1])
    doomed = [p for p in reversed(folders) if checkpoint_iteration(p) < oldest_kept and p.name != saved]
    for path in doomed:
        shutil.rmtree(path)
    return doomed


def load_checkpoint(
    path: str | Path,
    params: dict[str, torch.Tensor],
    optimizer: torch.optim.Optimizer,
    ema: dict[str, torch.Tensor] | None = None,
) -> dict:
    """Restore a checkpoint written by :func:`save_checkpoint` in place.

    Args:
        path (`str` or `Path`): a folder written by :func:`save_checkpoint`.
        params (`dict[str, torch.Tensor]`): the trainable tensors, overwritten in place.
        optimizer (`torch.optim.Optimizer`, or an object with its ``load_state_dict``): its state is replaced.
        ema (`dict[str, torch.Tensor]`, optional): EMA tensors, overwritten in place (from the saved EMA, or
            from the restored `params` when the checkpoint has none).

    Returns:
        The JSON state (``iteration``, ``extra``); the Python, numpy and torch RNG states are restored.

    Raises:
        CheckpointError (a ValueError): a folder that fails :func:`verify_checkpoint`, a trainable tensor that is
        missing or whose shape differs (e.g. another LoRA rank), each named. Nothing is overwritten when one of
        these is raised.
    """
    path = Path(path)
    state = verify_checkpoint(path)
    saved = load_file(path / "trainable.safetensors")
    for name, tensor in params.items():  # all checked before any is overwritten
        if name not in saved:
            raise CheckpointError(
                f"checkpoint {path} has no trainable tensor {name!r}: was it made with another "
                "model.lora_rank or model?"
            )
        if (
            saved[name].shape != tensor.shape
        ):  # LoRA names do not depend on the rank; copy_ would broadcast (1, n) silently
            raise CheckpointError(
                f"checkpoint {path} has trainable tensor {name!r} of shape {tuple(saved[name].shape)}, "
                f"the model's is {tuple(tensor.shape)}: was it made with another model.lora_rank?"
            )
    with torch.no_grad():
        for name, tensor in params.items():
            tensor.copy_(saved[name])
    optimizer.load_state_dict(_unflatten_optimizer(load_file(path / "optimizer.safetensors"), state["optimizer"]))
    if ema is not None:
        if (path / "ema.safetensors").is_file():
            for name, value in load_file(path / "ema.safetensors").items():
                ema[name].copy_(value)
        else:  # EMA switched on at resume: start it from the restored weights, not the initial ones
            for name, tensor in params.items():
                ema[name].copy_(tensor.detach())
    rng = state["rng"]
    random.setstate((3, tuple(rng["python"]), None))
    keys, pos, has_gauss, cached = rng["numpy"]
    np.random.set_state(("MT19937", np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(torch.tensor(rng["torch"], dtype=torch.uint8))
    return state


def truncate_metrics(path: str | Path, iteration: int) -> None:
    """Cut a run's ``metrics.jsonl`` back to the rows of iterations ``<= iteration`` (a resumed run repeats the
    rest), dropping a line torn by a crash, and replace the file atomically (absent: an empty file)."""
    path = Path(path)
    kept = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            if json.loads(line)["iteration"] <= iteration:
                kept.append(line)
        except (ValueError, KeyError):  # a line torn by a crash while it was written
            continue
    write_text_atomic(path, "".join(line + "\n" for line in kept))
