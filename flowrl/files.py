"""Files the commands read and write, guarded: one writer per run folder, outputs probed before the work,
results replaced atomically, and model folders checked to hold safetensors that are whole.

Everything here raises one-line errors naming the file and what was expected (the ``flowrl`` command prints
them as ``flowrl COMMAND: error: ...`` with exit status 2; see ``docs/reliability.md``).
"""

from __future__ import annotations

import fcntl
import json
import os
import struct
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

LOCK_FILE = ".flowrl.lock"
"""The lock file inside a run folder; :class:`RunLock` holds an exclusive ``flock`` on it."""

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
"""Weight files that are pickles: flowrl never loads them."""

REPO_ROOT = Path(__file__).resolve().parent.parent
"""The repository's root folder (``assets/``, ``configs/``): where a relative path that does not exist is looked up."""


def resolve_path(path: str | Path) -> Path:
    """``path`` as given if it exists or is absolute, else relative to :data:`REPO_ROOT` (for ``assets/...`` from any
    working folder)."""
    path = Path(path)
    return path if path.exists() or path.is_absolute() else REPO_ROOT / path


PATH_OPTIONS = ("path", "_dir", "_file", "checkpoint")
"""How the names of a reward's path options end (``model_path``, ``processor_path``, ``checkpoint``, ...): the options
:func:`resolve_option_paths` resolves."""


def resolve_option_paths(options: dict) -> dict:
    """A reward's options with every relative path option (a key ending in one of :data:`PATH_OPTIONS`, in nested
    option dicts too) resolved as :func:`resolve_path` does, where the file is in the repository only: the working
    folder's file first, else the repository's (``model_path: assets/tiny-clip`` from any working folder). A value
    found in neither is left as given (a hub id such as ``openai/clip-vit-large-patch14``, or a missing folder the
    reward names)."""
    out = {}
    for key, value in options.items():
        if isinstance(value, dict):
            value = resolve_option_paths(value)
        elif isinstance(value, str) and value and str(key).endswith(PATH_OPTIONS):
            path = Path(value)
            if not path.is_absolute() and not path.exists() and (REPO_ROOT / path).exists():
                value = str(REPO_ROOT / path)
        out[key] = value
    return out


class RunFolderInUse(RuntimeError):
    """Another process holds a run folder's lock; the message names the folder and that process's id."""


class OutputError(ValueError):
    """An output path that cannot be written (no permission, a folder in the way, an unknown suffix)."""


# ------------------------------------------------------------------------------------------------ the lock
class RunLock:
    """An exclusive, OS-level lock on a run folder (``fcntl.flock`` on ``folder/.flowrl.lock``), released by the
    OS when the holding process ends, however it ends. The holder's process id is written into the lock file so
    that a refused process can name it.

    Args:
        folder (`Path`): the run folder (created, with its parents, by :meth:`acquire`).

    Use ``with RunLock(folder):`` or :meth:`acquire` / :meth:`release`.
    """

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self.path = self.folder / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> RunLock:
        """Create the folder and take the lock without waiting.

        Raises:
            RunFolderInUse: "run folder X is in use by process P" when another process holds it.
            OutputError: if the folder or its lock file cannot be created.
        """
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise OutputError(f"run folder {self.folder} cannot be written: {e.strerror or e}") from None
        try:
            _lock_or_refuse(fd, self.folder)
        except RunFolderInUse:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        """Release the lock (the lock file stays: deleting it would let two processes lock two different files)."""
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    @property
    def held(self) -> bool:
        """Whether this object holds the lock now."""
        return self._fd is not None

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def check_not_in_use(folder: str | Path) -> None:
    """Refuse early, creating nothing, if another process holds ``folder``'s :class:`RunLock`.

    Raises:
        RunFolderInUse: naming the folder and the holding process.
    """
    path = Path(folder) / LOCK_FILE
    if not path.is_file():
        return
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return  # unreadable: RunLock.acquire names the problem when the run starts
    try:
        _lock_or_refuse(fd, Path(folder))
        fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _lock_or_refuse(fd: int, folder: Path) -> None:
    """Take the exclusive lock on the open lock file `fd` without waiting, or raise RunFolderInUse naming `folder`
    and the process id its holder wrote into the file."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        raise RunFolderInUse(f"run folder {folder} is in use by process {holder}") from None


# --------------------------------------------------------------------------------------------- outputs
def _nearest_existing(path: Path) -> Path:
    """``path`` or its closest ancestor that exists."""
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_folder_writable(folder: str | Path, what: str) -> None:
    """Check, creating nothing, that ``folder`` can be created (or, existing, written into).

    Args:
        folder (`Path`): the folder.
        what (`str`): how the error names it (e.g. ``"config key 'run.output_dir'"``).

    Raises:
        OutputError: naming `what` and `folder`, for a file in the way or a folder without write permission.
    """
    folder = Path(folder)
    base = _nearest_existing(folder)
    if not base.is_dir():
        raise OutputError(f"{what}: {folder} cannot be a folder: {base} is a file")
    if not os.access(base, os.W_OK | os.X_OK):
        raise OutputError(f"{what}: {folder} cannot be written: no write permission on {base}")


def probe_output(path: str | Path, what: str, suffixes: tuple[str, ...] | None = None) -> Path:
    """Make sure ``path`` can be written before the work that produces it: the suffix is one of `suffixes`, the
    parent folder is created, and a probe file is created and removed beside it.

    Args:
        path (`Path`): the output file.
        what (`str`): how the errors name it (e.g. ``"--out"``).
        suffixes (`tuple[str, ...]`, optional): accepted lower-case suffixes (with the dot); None: any.

    Returns:
        `Path`: ``path``.

    Raises:
        OutputError: naming `what` and `path`: an unknown suffix, a folder at `path`, or a place that cannot be
            written (with the OS's reason).
    """
    path = Path(path)
    if path.is_dir():
        raise OutputError(f"{what} {path} is a folder; expected a file name")
    if suffixes is not None and path.suffix.lower() not in suffixes:
        raise OutputError(
            f"{what} {path}: unknown file type {path.suffix or '(none)'!r}; expected one of "
            f"{', '.join(sorted(suffixes))}"
        )
    probe = path.with_name(f".{path.name}.probe-{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
        if path.exists() and not os.access(path, os.W_OK):
            raise PermissionError(13, "Permission denied")
    except OSError as e:
        raise OutputError(f"{what} {path} cannot be written: {e.strerror or e}") from None
    return path


@contextmanager
def atomic_output(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path beside ``path`` (same suffix) to write; on success it replaces ``path`` in one
    rename, on error it is removed and ``path`` is untouched.

    Args:
        path (`Path`): the final file.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.stem}.tmp-{os.getpid()}{path.suffix}")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_text_atomic(path: str | Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename (a reader sees the old or the new file)."""
    with atomic_output(path) as tmp:
        tmp.write_text(text)


# ---------------------------------------------------------------------------------------- model folders
def check_safetensors(path: str | Path) -> None:
    """Check that ``path`` is a whole safetensors file: its header parses and the file is exactly as long as the
    header says (a truncated file, or a pickle saved under a ``.safetensors`` name, fails). Reads the header only.

    Raises:
        ValueError: naming the file and what is wrong with it.
    """
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{path} is not a safetensors file ({size} bytes): truncated or another format")
        (length,) = struct.unpack("<Q", head)
        if length > min(size - 8, 100 << 20):
            raise ValueError(
                f"{path} is not a safetensors file: its header is unreadable (truncated, or a pickle "
                "saved under a .safetensors name)"
            )
        try:
            header = json.loads(f.read(length))
        except ValueError:
            raise ValueError(f"{path} is not a safetensors file: its header is not JSON") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path} is not a safetensors file: its header is not a mapping")
    try:
        end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
    except (TypeError, KeyError, IndexError, ValueError):
        raise ValueError(f"{path} is not a safetensors file: its header has no valid tensor offsets") from None
    if size != 8 + length + end:
        raise ValueError(f"{path} is damaged: {size} bytes, its header describes {8 + length + end} (truncated?)")


def _read_json(path: Path) -> dict:
    """A JSON object from ``path``; ValueError naming the file and the parser's line and column otherwise."""
    try:
        value = json.loads(path.read_text())
    except UnicodeDecodeError:
        raise ValueError(f"{path} is not a JSON text file") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(value).__name__}")
    return value


def check_weights_folder(folder: str | Path, convert_hint: str) -> None:
    """Check a folder of weights: every ``*.safetensors`` whole (:func:`check_safetensors`), and not only pickles.

    Args:
        folder (`Path`): a model component's or a LoRA's folder.
        convert_hint (`str`): how the error says to convert pickled weights.

    Raises:
        ValueError: naming the file, for a damaged safetensors file or a folder whose weights are all pickles.
    """
    folder = Path(folder)
    safe = sorted(folder.glob("*.safetensors"))
    pickled = sorted(p.name for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES and p.is_file())
    if pickled and not safe:
        raise ValueError(
            f"{folder} holds only pickled weights ({', '.join(pickled)}); flowrl loads safetensors "
            f"only: {convert_hint}"
        )
    for file in safe:
        check_safetensors(file)


def check_model_folder(path: str | Path) -> None:
    """Check a diffusers pipeline folder before anything loads: ``model_index.json`` and each component's
    ``config.json`` are readable JSON objects, and each component's weights are whole safetensors files.

    Args:
        path (`Path`): the pipeline folder.

    Raises:
        FileNotFoundError: if ``path`` has no ``model_index.json``, or a component folder holds weights without their
            ``config.json`` (named).
        ValueError: naming the file: a broken JSON file, a damaged weight file, or pickled weights only (with
            the conversion to run).
    """
    path = Path(path)
    index_file = path / "model_index.json"
    if not index_file.is_file():
        raise FileNotFoundError(f"model path {path} is not a diffusers pipeline folder (no model_index.json)")
    index = _read_json(index_file)
    hint = (
        f'convert it once with `python -c "import diffusers; diffusers.DiffusionPipeline.from_pretrained('
        f"'{path}').save_pretrained('{path}-safetensors', safe_serialization=True)\"` (this unpickles: only for "
        "files you trust)"
    )
    for name, value in index.items():
        folder = path / name
        if name.startswith("_") or not isinstance(value, list) or not folder.is_dir():
            continue
        if (folder / "config.json").is_file():
            _read_json(folder / "config.json")
            check_weights_folder(folder, hint)
        elif any(p.suffix in (".safetensors", *PICKLE_SUFFIXES) for p in folder.iterdir()):
            raise FileNotFoundError(
                f"{folder / 'config.json'} does not exist: the weights of the model's {name} need it (copy or "
                "download the file again)"
            )
