"""Prompt files: one JSON object per line, each with a ``prompt`` and, for GenEval-style rewards and evaluation,
its metadata (``tag``, ``include``, ``exclude``; see :mod:`rewards.geneval`). An image-editing prompt
(:class:`flowrl.models.FluxKontextModel`) names its source image in ``image``: a path relative to the prompt file
(or absolute), which :func:`read_jsonl` checks and makes absolute, so the model and the rewards (which receive every
record as metadata) find it. A FLUX.2 record (:class:`flowrl.models.Flux2Model`) may name several reference images in
``images``, a list of such paths, made absolute the same way.

The training path reads prompts only through here; the tiny world's generator of prompt sets
(:mod:`flowrl.tiny.prompts`) is a separate command that writes such files.
"""

from __future__ import annotations

import json
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PROMPTS = REPO_ROOT / "assets" / "prompts"
"""The shipped prompt files: ``train``, ``test`` (the tiny world's GenEval-style split) and ``quickstart``."""


def prompt_file(name: str | Path) -> Path:
    """The file a prompt-set name refers to: a shipped set's name (``train``, ``test``, ... : a file
    ``assets/prompts/<name>.jsonl``) or a path (as given if it exists, else relative to the repository root).

    No existence check: :func:`read_prompts` names a missing file.
    """
    name = str(name)
    shipped = PROMPTS / f"{name}.jsonl"
    if "/" not in name and not name.endswith(".jsonl") and shipped.is_file():
        return shipped
    path = Path(name)
    return path if path.exists() or path.is_absolute() else REPO_ROOT / path


def write_jsonl(metas: list[dict], path: str | Path) -> None:
    """Write one JSON object per line (a prompt file :func:`read_jsonl` reads back)."""
    Path(path).write_text("".join(json.dumps(m) + "\n" for m in metas))


def read_jsonl(path: str | Path, require_image: bool = False) -> list[dict]:
    """Read a prompt file: one JSON object with a string ``prompt`` per non-empty line (any GenEval metadata file).
    A record's optional ``image`` (an editing model's source image) is a path relative to the file, returned absolute;
    its optional ``images`` (FLUX.2's reference images) a non-empty list of such paths, each returned absolute. With
    `require_image` (an image-to-video model, ``FlowModel.SOURCE_REQUIRED``) every record must name its ``image``.

    Raises:
        FileNotFoundError: naming the path.
        ValueError: naming the file, for a file that is not UTF-8; naming the file and line of a line that is not JSON, or not an object with a string
            ``prompt``, or whose ``image`` is not a string naming an existing file (or ``images`` not a non-empty list
            of them), or without ``image`` where `require_image`; naming the file when it holds no prompt at all.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"prompt file {path} does not exist")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"prompt file {path} is not UTF-8 text (byte {e.start}: {e.reason})") from None
    metas = []
    for i, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                meta = json.loads(line)
            except ValueError as e:
                raise ValueError(
                    f"{path}:{i}: not a JSON line ({e.msg}); expected a JSON object with a 'prompt' key"
                ) from None
            if not isinstance(meta, dict) or not isinstance(meta.get("prompt"), str):
                raise ValueError(f"{path}:{i}: expected a JSON object with a 'prompt' key")
            if require_image and "image" not in meta:
                raise ValueError(
                    f"{path}:{i}: no 'image'; this model starts each video from its record's source image (a path "
                    "relative to the prompt file)"
                )
            if "image" in meta:
                image = path.parent / str(meta["image"])  # an absolute path stays as it is
                if not isinstance(meta["image"], str) or not image.is_file():
                    raise ValueError(
                        f"{path}:{i}: 'image' {meta['image']!r} is not an image file (expected a path "
                        "relative to the prompt file)"
                    )
                meta["image"] = str(image.resolve())
            if "images" in meta:
                meta["images"] = _image_list(meta["images"], path, i)
            metas.append(meta)
    if not metas:
        raise ValueError(f"prompt file {path} holds no prompts; expected one JSON object with a 'prompt' key per line")
    return metas


def _image_list(value, path: Path, line: int) -> list[str]:
    """A record's ``images``: each path made absolute (relative to the prompt file ``path``).

    Raises:
        ValueError: naming the file and line, for anything but a non-empty list of strings naming existing files.
    """
    strings = isinstance(value, list) and all(isinstance(v, str) for v in value)
    files = [path.parent / v for v in value] if strings else []  # an absolute path stays as it is
    if not files or not all(f.is_file() for f in files):
        raise ValueError(
            f"{path}:{line}: 'images' {value!r} is not a list of image files (expected paths relative to the prompt "
            "file, at least one)"
        )
    return [str(f.resolve()) for f in files]


def read_prompts(name: str | Path, require_image: bool = False) -> list[dict]:
    """The prompt records of a shipped set's name or a file (:func:`prompt_file`, :func:`read_jsonl` with
    `require_image`).

    Raises:
        FileNotFoundError, ValueError: as :func:`read_jsonl`.
    """
    return read_jsonl(prompt_file(name), require_image)
