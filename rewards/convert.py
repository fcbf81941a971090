"""Read reward-model weight files without unpickling code, and convert them to safetensors once.

Published reward checkpoints (HPS v2's `HPS_v2.1_compressed.pt`, LAION's aesthetic head
`sac+logos+ava1-l14-linearMSE.pth`) are PyTorch pickles. They are read here with
`torch.load(..., weights_only=True)`, which refuses anything but tensors and plain containers;
`.safetensors` files are read with `safetensors`. To convert a file once::

    python -m rewards.convert HPS_v2.1_compressed.pt HPS_v2.1.safetensors
"""

from __future__ import annotations

import argparse
import os
import pickle
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

__all__ = ["convert_to_safetensors", "load_state_dict", "main"]


def load_state_dict(path: str | os.PathLike, reward: str = "convert") -> dict[str, torch.Tensor]:
    """Load a state dict from a `.safetensors` file or a weights-only PyTorch file, on CPU.

    A checkpoint holding `{"state_dict": {...}, ...}` (as HPS v2's) is unwrapped, and a `module.`
    prefix on every key (a DistributedDataParallel save) is removed.

    Args:
        path (`str` or path): the file. `.safetensors` is read with `safetensors.torch.load_file`,
            anything else with `torch.load(path, map_location="cpu", weights_only=True)`.
        reward (`str`): name used at the start of error messages.

    Returns:
        `dict[str, torch.Tensor]`: parameter name -> tensor, dtypes as stored, on CPU.

    Raises:
        FileNotFoundError: `path` is not a file.
        ValueError: the file holds Python objects beyond tensors (refused, not unpickled), cannot be
            read, or is not a mapping of names to tensors.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{reward}: weights file '{path}' not found")
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            checkpoint = load_file(path, device="cpu")
        else:
            checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else "unpickling refused"
        raise ValueError(
            f"{reward}: '{path}' is not a weights-only checkpoint ({first_line}); it is not unpickled for "
            "safety: save its state_dict() instead"
        ) from None
    except (RuntimeError, OSError, EOFError) as err:
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(f"{reward}: cannot read weights file '{path}' ({first_line})") from err
    if isinstance(checkpoint, dict) and isinstance(checkpoint.get("state_dict"), dict):
        checkpoint = checkpoint["state_dict"]
    if (
        not isinstance(checkpoint, dict)
        or not checkpoint
        or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in checkpoint.items())
    ):
        raise ValueError(f"{reward}: '{path}' does not hold a state dict (a non-empty mapping of names to tensors)")
    if all(key.startswith("module.") for key in checkpoint):
        checkpoint = {key.removeprefix("module."): value for key, value in checkpoint.items()}
    return dict(checkpoint)


def convert_to_safetensors(src: str | os.PathLike, dst: str | os.PathLike) -> Path:
    """Write the state dict of `src` (see `load_state_dict`) to the safetensors file `dst`.

    Tensors are stored as they are (dtype kept); tensors sharing memory are copied apart, as
    safetensors requires.

    Args:
        src (`str` or path): a `.pt` / `.pth` / `.bin` (weights-only) or `.safetensors` file.
        dst (`str` or path): the output file; must end in `.safetensors`; its folder must exist.

    Returns:
        `Path`: `dst`.

    Raises:
        ValueError: `dst` does not end in `.safetensors`, or `src` cannot be read (see `load_state_dict`).
        FileNotFoundError: `src` is not a file, or the folder of `dst` does not exist.
    """
    from safetensors.torch import save_file

    dst = Path(dst)
    if dst.suffix != ".safetensors":
        raise ValueError(f"convert: output '{dst}' must end in .safetensors")
    if not dst.parent.is_dir():
        raise FileNotFoundError(f"convert: output folder '{dst.parent}' does not exist")
    tensors, seen = {}, set()
    for key, value in load_state_dict(src, "convert").items():
        value = value.detach().contiguous()
        storage = value.untyped_storage().data_ptr()
        tensors[key] = value.clone() if storage in seen else value  # (tied weights, views of one buffer)
        seen.add(storage)
    save_file(tensors, dst)
    return dst


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m rewards.convert IN OUT`: convert one weights file to safetensors; returns the exit code."""
    parser = argparse.ArgumentParser(prog="python -m rewards.convert", description=__doc__.splitlines()[0])
    parser.add_argument("src", help="weights file to read (.pt/.pth/.bin, weights-only, or .safetensors)")
    parser.add_argument("dst", help="safetensors file to write")
    args = parser.parse_args(argv)
    return run_conversion(lambda: convert_to_safetensors(args.src, args.dst))


def run_conversion(convert: Callable[[], Path]) -> int:
    """A converter command's body: ``convert()``, then ``wrote PATH`` and exit code 0, or ``error: MESSAGE`` on
    stderr and exit code 2 for a missing input (FileNotFoundError) or a bad one (ValueError)."""
    try:
        out = convert()
    except (FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
