"""Checkpoints: trainable weights, EMA and optimizer state in safetensors, plus the LoRA in diffusers
format and a JSON of the iteration and RNG state. No pickles: ``torch.load`` is never called."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file


def _flatten_optimizer(state: dict) -> tuple[dict[str, torch.Tensor], dict]:
    tensors, meta = {}, {"param_groups": state["param_groups"], "scalars": {}}
    for pid, pstate in state["state"].items():
        for key, value in pstate.items():
            if torch.is_tensor(value):
                tensors[f"{pid}.{key}"] = value.contiguous()
            else:
                meta["scalars"][f"{pid}.{key}"] = value
    return tensors, meta


def _unflatten_optimizer(tensors: dict[str, torch.Tensor], meta: dict) -> dict:
    state: dict[int, dict] = {}
    for name, value in list(tensors.items()) + list(meta["scalars"].items()):
        pid, key = name.split(".", 1)
        state.setdefault(int(pid), {})[key] = value
    return {"state": state, "param_groups": meta["param_groups"]}


def save_checkpoint(directory: str | Path, iteration: int, params: dict[str, torch.Tensor],
                    optimizer: torch.optim.Optimizer, ema: dict[str, torch.Tensor] | None = None,
                    extra: dict | None = None) -> Path:
    """Write ``directory/checkpoint-{iteration:06d}`` atomically (written to a temp folder, then renamed).

    Args:
        params: trainable tensors by name (float32).
        optimizer: its state is flattened to tensors (safetensors) and JSON.
        ema: EMA shadow tensors by name, or None.
        extra: JSON-serialisable state (e.g. schedule state) stored beside the RNG states.

    Returns:
        The checkpoint folder.
    """
    directory = Path(directory)
    final = directory / f"checkpoint-{iteration:06d}"
    tmp = directory / f".tmp-checkpoint-{iteration:06d}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file({k: v.detach().float().contiguous().cpu() for k, v in params.items()}, tmp / "trainable.safetensors")
    tensors, meta = _flatten_optimizer(optimizer.state_dict())
    save_file({k: v.cpu() for k, v in tensors.items()}, tmp / "optimizer.safetensors")
    if ema is not None:
        save_file({k: v.detach().cpu().contiguous() for k, v in ema.items()}, tmp / "ema.safetensors")
    torch_rng = torch.get_rng_state()
    state = {
        "iteration": iteration,
        "optimizer": meta,
        "rng": {"python": random.getstate()[1], "numpy": [v.tolist() if hasattr(v, "tolist") else v for v in np.random.get_state()[1:]],
                "torch": torch_rng.tolist()},
        "extra": extra or {},
    }
    (tmp / "state.json").write_text(json.dumps(state))
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    return final


def latest_checkpoint(directory: str | Path) -> Path | None:
    """The newest complete ``checkpoint-*`` folder under ``directory``, or None."""
    found = sorted(Path(directory).glob("checkpoint-*"))
    return found[-1] if found else None


def load_checkpoint(path: str | Path, params: dict[str, torch.Tensor], optimizer: torch.optim.Optimizer,
                    ema: dict[str, torch.Tensor] | None = None) -> dict:
    """Restore a checkpoint written by :func:`save_checkpoint` in place.

    Returns:
        The JSON state (``iteration``, ``extra``).

    Raises:
        FileNotFoundError: if the folder lacks a file; KeyError naming a trainable tensor that is missing.
    """
    path = Path(path)
    for name in ("trainable.safetensors", "optimizer.safetensors", "state.json"):
        if not (path / name).is_file():
            raise FileNotFoundError(f"checkpoint {path} is incomplete: no {name}")
    saved = load_file(path / "trainable.safetensors")
    with torch.no_grad():
        for name, tensor in params.items():
            if name not in saved:
                raise KeyError(f"checkpoint {path} has no trainable tensor {name!r}: was it made with another model.lora_rank?")
            tensor.copy_(saved[name])
    state = json.loads((path / "state.json").read_text())
    optimizer.load_state_dict(_unflatten_optimizer(load_file(path / "optimizer.safetensors"), state["optimizer"]))
    if ema is not None and (path / "ema.safetensors").is_file():
        for name, value in load_file(path / "ema.safetensors").items():
            ema[name].copy_(value)
    rng = state["rng"]
    random.setstate((3, tuple(rng["python"]), None))
    keys, pos, has_gauss, cached = rng["numpy"]
    np.random.set_state(("MT19937", np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(torch.tensor(rng["torch"], dtype=torch.uint8))
    return state
