"""Public benchmark prompt sets, read from the files their authors publish (nothing is downloaded here).

- GenEval (Ghosh et al., arXiv 2310.11513): ``prompts/evaluation_metadata.jsonl`` of github.com/djghosh13/geneval,
  553 lines, each an object with ``tag``, ``include``, ``exclude`` and ``prompt``: read as it is.
- DrawBench (Saharia et al., Imagen, arXiv 2205.11487): the 200-prompt CSV with columns ``Prompts`` and
  ``Category`` (e.g. from the ``shunk031/DrawBench`` dataset or Google's sheet, saved as CSV).
- PartiPrompts (Yu et al., arXiv 2206.10789): ``PartiPrompts.tsv`` of github.com/google-research/parti, columns
  ``Prompt``, ``Category``, ``Challenge``, ``Note``.
- HPDv2's benchmark (Wu et al., arXiv 2306.09341): one JSON list of prompt strings per style (``anime.json``,
  ``concept-art.json``, ``paintings.json``, ``photo.json``), as the ``hpsv2`` package ships them; the style
  (the file name) becomes the tag.
- Any plain text file: one prompt per line.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

from .data import prompt_file, read_jsonl

__all__ = ["FORMATS", "read_prompt_set"]

FORMATS = ("auto", "jsonl", "csv", "tsv", "json", "txt")
"""Prompt-file formats; ``auto`` picks one from the file's suffix (``.jsonl``, ``.csv``, ``.tsv``, ``.json``,
anything else: ``txt``)."""

PROMPT_COLUMNS = ("Prompts", "Prompt", "prompt", "prompts", "text", "caption")
"""Column names read as the prompt in a CSV/TSV (DrawBench: ``Prompts``; PartiPrompts: ``Prompt``)."""
TAG_COLUMNS = ("Category", "category", "tag", "Tag")
"""Column names read as the tag (per-tag means in ``flowrl score``); DrawBench's and PartiPrompts' ``Category``."""


def _table(path: Path, delimiter: str) -> list[dict]:
    """Rows of a CSV/TSV with a header: ``prompt``, ``tag`` (from :data:`TAG_COLUMNS`) and the other non-empty
    columns under their own names."""
    with path.open(newline="", encoding="utf-8-sig") as f:
        reader = csv.DictReader(f, delimiter=delimiter)
        header = reader.fieldnames or []
        column = next((c for c in PROMPT_COLUMNS if c in header), None)
        if column is None:
            raise ValueError(
                f"prompt file {path}: no prompt column; expected one of {', '.join(PROMPT_COLUMNS)} in the "
                f"header, got {header}"
            )
        tag = next((c for c in TAG_COLUMNS if c in header), None)
        metas = []
        for line, row in enumerate(reader, 2):
            prompt = (row.get(column) or "").strip()
            if not prompt:
                raise ValueError(f"{path}:{line}: empty {column!r}; every row needs a prompt")
            meta = {"prompt": prompt}
            if tag is not None and (row.get(tag) or "").strip():
                meta["tag"] = row[tag].strip()
            meta.update({k: v for k, v in row.items() if k not in (column, tag) and k and v not in (None, "")})
            metas.append(meta)
    return metas


def _json(path: Path) -> list[dict]:
    """A JSON list of prompt strings (HPDv2's per-style files; tag: the file's stem) or of objects with a prompt."""
    text = path.read_text(encoding="utf-8")  # not UTF-8: named by read_prompt_set
    try:
        items = json.loads(text)
    except ValueError as e:
        raise ValueError(f"prompt file {path} is not valid JSON ({e})") from None
    if not isinstance(items, list):
        raise ValueError(
            f"prompt file {path} must hold a JSON list of prompts (strings or objects with 'prompt'), "
            f"got a {type(items).__name__}"
        )
    metas = []
    for i, item in enumerate(items):
        if isinstance(item, str) and item.strip():
            metas.append({"prompt": item.strip(), "tag": path.stem})
        elif isinstance(item, dict) and isinstance(item.get("prompt"), str):
            metas.append(dict(item))
        else:
            raise ValueError(f"{path}: item {i} must be a prompt string or an object with a string 'prompt'")
    return metas


def read_prompt_set(name: str | Path, fmt: str = "auto", require_image: bool = False) -> list[dict]:
    """The prompt records of a benchmark prompt file: one dict per prompt, with ``prompt`` and, where the file
    has one, ``tag`` (GenEval's tag, DrawBench's and PartiPrompts' category, HPDv2's style) and the other fields.

    Args:
        name: a path (or a shipped set's name, ``train`` / ``test``, see :func:`flowrl.data.prompt_file`).
        fmt (`str`): one of :data:`FORMATS`.
        require_image (`bool`): every record names its source ``image`` (an image-to-video model,
            ``FlowModel.SOURCE_REQUIRED``): a JSON lines file read with :func:`flowrl.data.read_jsonl`'s check; the
            other formats name no source images and are refused.

    Returns:
        `list[dict]`, at least one, in file order. GenEval records keep every key of the file, so that they can be
        written back unchanged into GenEval's folder layout.

    Raises:
        FileNotFoundError: naming the file. ValueError: an unknown `fmt`, a file that is not UTF-8 or holds no
            prompt (the file named), or a malformed line or row (file and line named); with `require_image`, a
            record without ``image`` (file and line) or a format other than JSON lines (the file).
    """
    if fmt not in FORMATS:
        raise ValueError(f"prompt format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    path = prompt_file(name)
    if not path.is_file():
        raise FileNotFoundError(f"prompt file {path} does not exist")
    if fmt == "auto":
        suffix = path.suffix.lower().lstrip(".")
        fmt = suffix if suffix in ("jsonl", "csv", "tsv", "json") else "txt"
    if fmt == "jsonl":
        return read_jsonl(path, require_image)
    if require_image:
        raise ValueError(
            f"prompt file {path} is read as {fmt}, which names no source images; this model starts each video from "
            "its record's source image: give a JSON lines file (.jsonl) whose records name it ('image', a path "
            "relative to the file)"
        )
    try:
        if fmt in ("csv", "tsv"):
            metas = _table(path, "," if fmt == "csv" else "\t")
        elif fmt == "json":
            metas = _json(path)
        else:
            metas = [
                {"prompt": line.strip()} for line in path.read_text(encoding="utf-8").splitlines() if line.strip()
            ]
    except UnicodeDecodeError as e:
        raise ValueError(f"prompt file {path} is not UTF-8 text (byte {e.start}: {e.reason})") from None
    if not metas:
        raise ValueError(f"prompt file {path} holds no prompts")
    return metas
