"""The frozen parts' memory: encoded prompts cached on disk, text encoders and VAE kept on the CPU between uses.

A run encodes the same prompts again and again (every rollout builds its prompt table, :meth:`FlowModel.prompt_table`),
and the text encoders of the large families are big: T5-XXL (4.8B parameters: SD3.5, FLUX.1), Llama 3 8B
(HunyuanVideo), UMT5-XXL (Wan), Qwen2.5-VL 7B (Qwen-Image). :class:`PromptCache` takes the place of the adapter's
``encode`` (an attribute of the instance, so the family's own ``encode`` and ``prompt_table`` overrides, and every
caller inside the adapter, go through it unchanged) and

- keeps each prompt's encoded row in ``DIR/<Family>-<identity>/<sha256 of the prompt>.safetensors``, the identity a
  hash of what decides the row (:func:`encoder_identity`): the text encoders', tokenizers' and text connectors' files
  (name, size, modification time), the family, ``max_sequence_length``, the dtype, the device type and the torch and
  transformers versions; a row is read back only when its file's checksum, prompt, identity and fields agree, else it
  is encoded again with a warning;
- moves the text encoders to the device only while they encode (``model.text_encoders=cpu``), or frees them once every
  prompt of the run is in the cache (``drop_after_cache``).

:func:`place_vae` does the same for the VAE (``model.vae_placement=cpu``): on the CPU except inside ``decode`` (and
FLUX.1 Kontext's ``encode_images``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import hashlib
import json
import warnings
from pathlib import Path

import torch

from .base import FlowModel, PromptEmbeds

CACHE_VERSION = 2
"""Bumped when the file layout or the encoding changes (part of :func:`encoder_identity`); 2: the text encoders'
per-prompt layers are padded to 16 rows (:func:`flowrl.models.base.make_batch_invariant`), so a prompt's row has
the same bits whatever batch it is encoded in, on every CPU kind."""


def text_encoder_names(pipe) -> list[str]:
    """The pipeline's text-encoder components present (``text_encoder``, ``text_encoder_2``, ...), sorted."""
    return sorted(
        name
        for name, module in pipe.components.items()
        if name.startswith("text_encoder") and isinstance(module, torch.nn.Module)
    )


def encoder_identity(model: FlowModel) -> str:
    """SHA-256 (hex) of what decides an encoded prompt besides its text: every file under the model folder's
    ``text_encoder*``, ``tokenizer*`` and ``connectors`` folders (LTX-2's text connectors run inside its ``encode``;
    relative path, size in bytes, modification time in ns), the family's class, ``max_sequence_length``, the frozen
    parts' dtype, the device type (CPU and GPU kernels round differently), the torch and transformers versions and
    :data:`CACHE_VERSION`. Reads no weights: a replaced or touched encoder file makes a new identity (a cache miss),
    never a stale hit."""
    import transformers

    folder = Path(model.path)
    files = [
        [p.relative_to(folder).as_posix(), p.stat().st_size, p.stat().st_mtime_ns]
        for sub in sorted(folder.iterdir())
        if sub.is_dir() and sub.name.startswith(("text_encoder", "tokenizer", "connectors"))
        for p in sorted(sub.rglob("*"))
        if p.is_file()
    ]
    record = {
        "version": CACHE_VERSION,
        "family": type(model).__qualname__,
        "pipeline": model.PIPELINE,
        "max_sequence_length": model.max_sequence_length,
        "dtype": str(model.dtype),
        "device": model.device.type,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "files": files,
    }
    return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()


def _digest(tensors: dict[str, torch.Tensor]) -> str:
    """SHA-256 (hex) over the names, dtypes, shapes and bytes of ``tensors``."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def _embeds_class(name: str) -> type[PromptEmbeds] | None:
    """The :class:`PromptEmbeds` class (or subclass) of qualified name ``name`` among those imported, or None."""
    todo = [PromptEmbeds]
    while todo:
        cls = todo.pop()
        if cls.__qualname__ == name:
            return cls
        todo.extend(cls.__subclasses__())
    return None


@contextlib.contextmanager
def on_device(modules: list[torch.nn.Module], device: torch.device):
    """Context in which ``modules`` are on ``device``, moved back to the CPU when it ends (nothing moves when ``device``
    is the CPU)."""
    if device.type == "cpu":
        yield
        return
    for m in modules:
        m.to(device)
    try:
        yield
    finally:
        for m in modules:
            m.to("cpu")
        if device.type == "cuda":
            torch.cuda.empty_cache()


class PromptCache:
    """The adapter's ``encode`` with encoded prompts cached on disk and the text encoders placed by option.

    Args:
        model (:class:`FlowModel`): the adapter; its family's own ``encode`` does the encoding.
        directory (`str` or `Path`, optional): ``model.prompt_cache``; None: no disk cache (only the placement).
        text_encoders (`str`): ``keep`` (on the device), ``cpu`` (on the CPU but while encoding) or
            ``drop_after_cache`` (:meth:`drop_encoders` frees them; a prompt missing from the cache is then an error).

    Calling it with ``P`` prompts returns what the family's ``encode`` returns for them, :class:`PromptEmbeds` (or the
    family's subclass: every tensor field is stored), float32 rows on the model's device, bit for bit: a miss is
    encoded (with the other misses; a row does not depend on its batch: :data:`CACHE_VERSION`) and written; a hit is
    read. The counters ``hits``, ``misses`` (prompts) and ``encoder_calls`` (calls of the family's ``encode``) are for
    tests and logs.

    Raises:
        ValueError: for an unknown ``text_encoders``, or ``drop_after_cache`` without a directory.
    """

    def __init__(self, model: FlowModel, directory: str | Path | None = None, text_encoders: str = "keep"):
        if text_encoders not in ("keep", "cpu", "drop_after_cache"):
            raise ValueError(f"text_encoders must be keep|cpu|drop_after_cache, got {text_encoders!r}")
        if text_encoders == "drop_after_cache" and directory is None:
            raise ValueError("text_encoders='drop_after_cache' needs a prompt cache directory (model.prompt_cache)")
        self.model, self.placement = model, text_encoders
        self._encode = type(model).encode.__get__(model)  # the family's own, not an earlier cache's
        self.identity = encoder_identity(model) if directory is not None else None
        self.folder = None if directory is None else Path(directory) / f"{type(model).__name__}-{self.identity[:16]}"
        self.dropped = False
        self.hits = self.misses = self.encoder_calls = 0
        if text_encoders == "cpu":
            for name in text_encoder_names(model.pipe):
                getattr(model.pipe, name).to("cpu")

    # ------------------------------------------------------------------------------------------ encode
    def __call__(self, prompts: list[str]) -> PromptEmbeds:
        """The encoded ``prompts`` (``P`` rows), from the cache where it holds them.

        Raises:
            RuntimeError: naming the prompt and ``model.text_encoders``, for a prompt not in the cache after
                :meth:`drop_encoders`.
        """
        if self.folder is None or not prompts:
            return self._run(list(prompts))
        rows = {p: self._load(p) for p in dict.fromkeys(prompts)}
        missing = [p for p, row in rows.items() if row is None]
        self.hits += len(rows) - len(missing)
        self.misses += len(missing)
        if missing:
            self.folder.mkdir(parents=True, exist_ok=True)
            fresh = self._run(missing)
            for i, p in enumerate(missing):
                rows[p] = self._store(p, fresh, i)
        return self._assemble([rows[p] for p in prompts])

    def _run(self, prompts: list[str]) -> PromptEmbeds:
        """The family's ``encode`` with the text encoders on the device for the call."""
        if self.dropped:
            first = (prompts or [""])[0]
            raise RuntimeError(
                f"prompt {first!r} is not in the prompt cache {self.folder} and the text encoders were "
                "freed (model.text_encoders=drop_after_cache): every prompt must be encoded before; use "
                "model.text_encoders=keep or cpu"
            )
        self.encoder_calls += 1
        modules = [getattr(self.model.pipe, n) for n in text_encoder_names(self.model.pipe)]
        with on_device(modules, self.model.device) if self.placement == "cpu" else contextlib.nullcontext():
            return self._encode(prompts)

    def precompute(self, prompts: list[str], chunk: int = 32) -> None:
        """Encode into the cache every one of ``prompts`` it does not hold yet, ``chunk`` prompts per call."""
        unique = list(dict.fromkeys(prompts))
        for start in range(0, len(unique), chunk):
            self(unique[start : start + chunk])

    def drop_encoders(self) -> None:
        """Free the text encoders (set to None in the pipeline): from now on only cached prompts can be encoded."""
        for name in text_encoder_names(self.model.pipe):
            setattr(self.model.pipe, name, None)
        self.dropped = True
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    # -------------------------------------------------------------------------------------------- files
    def file(self, prompt: str) -> Path:
        """The cache file of ``prompt``."""
        return self.folder / f"{hashlib.sha256(prompt.encode()).hexdigest()}.safetensors"

    def _row(self, table: PromptEmbeds, i: int) -> dict[str, torch.Tensor]:
        """Row ``i`` of every tensor field of ``table``, on the CPU; a family padding to the batch's longest prompt
        (:attr:`FlowModel.PROMPT_PADDING` ``"longest"``) loses its padding tokens (its ``mask``'s zeros)."""
        row = {
            f.name: getattr(table, f.name)[i].detach().cpu()
            for f in dataclasses.fields(table)
            if torch.is_tensor(getattr(table, f.name))
        }
        if self.model.PROMPT_PADDING == "longest":
            length = int(row["mask"].sum())
            row = {k: v[:length] if k in ("embeds", "mask") else v for k, v in row.items()}
        return row

    def _store(self, prompt: str, table: PromptEmbeds, i: int) -> tuple[type, dict[str, torch.Tensor]]:
        """Write row ``i`` of ``table`` as ``prompt``'s file; a float32 tensor that the model's dtype holds exactly
        (the encoders ran in bf16 or fp16) is stored in that dtype and read back as float32."""
        from safetensors.torch import save_file

        from ..files import atomic_output

        row = self._row(table, i)
        stored, dtypes = {}, {}
        for name, t in row.items():
            small = t.to(self.model.dtype) if t.dtype == torch.float32 and self.model.dtype != torch.float32 else t
            exact = small is not t and torch.equal(small.float(), t)
            stored[name], dtypes[name] = (small, "float32") if exact else (t, "")
        metadata = {
            "prompt": prompt,
            "identity": self.identity,
            "class": type(table).__qualname__,
            "upcast": json.dumps({k: v for k, v in dtypes.items() if v}),
            "sha256": _digest(stored),
        }
        with atomic_output(self.file(prompt)) as tmp:
            save_file({k: v.contiguous() for k, v in stored.items()}, tmp, metadata=metadata)
        return type(table), row

    def _load(self, prompt: str) -> tuple[type, dict[str, torch.Tensor]] | None:
        """``prompt``'s class and row from its file; None when there is none, or (with a warning naming the file
        and why) when it does not verify."""
        from safetensors import safe_open

        file = self.file(prompt)
        if not file.is_file():
            return None
        try:
            with safe_open(str(file), framework="pt") as f:
                meta = f.metadata() or {}
                stored = {k: f.get_tensor(k) for k in f.keys()}
        except Exception as e:  # safetensors raises its own error types for a torn or foreign file
            return self._damaged(file, f"unreadable: {type(e).__name__}")
        cls = _embeds_class(meta.get("class", ""))
        if meta.get("sha256") != _digest(stored):
            return self._damaged(file, "its tensors do not match their SHA-256")
        if meta.get("prompt") != prompt or meta.get("identity") != self.identity:
            return self._damaged(file, "written for another prompt or encoder")
        if cls is None or not {"embeds", "pooled"} <= stored.keys():
            return self._damaged(file, f"no prompt embeddings of a known class ({meta.get('class')!r})")
        for name, dtype in json.loads(meta.get("upcast", "{}")).items():
            stored[name] = stored[name].to(getattr(torch, dtype))
        return cls, stored

    @staticmethod
    def _damaged(file: Path, why: str) -> None:
        """Warn that ``file`` is not used (it is encoded again and replaced); returns None (a miss)."""
        warnings.warn(
            f"prompt cache file {file} is damaged ({why}): encoding the prompt again", UserWarning, stacklevel=4
        )
        return None

    def _assemble(self, rows: list[tuple[type, dict[str, torch.Tensor]]]) -> PromptEmbeds:
        """The table of ``rows`` (in order) on the model's device; ``"longest"`` padding families get their rows padded
        with zeros to the longest one, as their ``encode`` pads a batch."""
        cls = rows[0][0]
        fields = rows[0][1].keys()
        if self.model.PROMPT_PADDING == "longest":
            length = max(r["mask"].shape[0] for _, r in rows)
            rows = [
                (
                    c,
                    {
                        k: torch.nn.functional.pad(v, (0, 0) * (v.ndim - 1) + (0, length - v.shape[0]))
                        if k in ("embeds", "mask")
                        else v
                        for k, v in r.items()
                    },
                )
                for c, r in rows
            ]
        return cls(**{k: torch.stack([r[k] for _, r in rows]).to(self.model.device) for k in fields})


def place_text_encoders(
    model: FlowModel, directory: str | Path | None = None, text_encoders: str = "keep", prompts: list[str] = ()
) -> PromptCache | None:
    """Install a :class:`PromptCache` as ``model.encode`` (None and nothing installed for no directory and ``keep``);
    with ``drop_after_cache``, encode ``prompts`` (and the empty prompt) into the cache first, then free the text
    encoders.

    Raises:
        ValueError: as :class:`PromptCache`.
    """
    if directory is None and text_encoders == "keep":
        return None
    cache = PromptCache(model, directory, text_encoders)
    model.encode = cache  # an instance attribute: every self.encode(...) inside the adapter goes through it
    if text_encoders == "drop_after_cache":
        cache.precompute([""] + list(prompts))
        cache.drop_encoders()
    return cache


def place_vae(model: FlowModel, placement: str = "keep") -> None:
    """``cpu``: keep the VAE on the CPU except inside the adapter's ``decode`` (and ``encode_images``, FLUX.1 Kontext's
    source images and FLUX.2's reference images), which move it to the device for the call; ``keep`` does nothing.

    Raises:
        ValueError: for another placement.
    """
    if placement not in ("keep", "cpu"):
        raise ValueError(f"vae placement must be keep|cpu, got {placement!r}")
    if placement == "keep":
        return
    vae = model.pipe.vae.to("cpu")
    for name in ("decode", "encode_images"):
        method = getattr(model, name, None)
        if method is None:
            continue

        def moved(*args, _method=method, **kwargs):
            with on_device([vae], model.device):
                return _method(*args, **kwargs)

        moved.__doc__ = method.__doc__
        setattr(model, name, moved)


def place_frozen(
    model: FlowModel,
    prompt_cache: str | Path | None = None,
    text_encoders: str = "keep",
    vae: str = "keep",
    prompts: list[str] = (),
) -> PromptCache | None:
    """Place the frozen parts of ``model`` (``model.prompt_cache``, ``model.text_encoders``, ``model.vae_placement``):
    cache encoded prompts in the folder ``prompt_cache`` and keep the text encoders on the device (``keep``), on the
    CPU but while they encode (``cpu``) or free them once ``prompts`` are cached (``drop_after_cache``); keep the VAE
    on the device or on the CPU but while it decodes (:func:`place_vae`).

    Returns:
        The :class:`PromptCache` now behind ``model.encode``, or None.

    Raises:
        ValueError: for an unknown placement, or ``drop_after_cache`` without ``prompt_cache``.
    """
    place_vae(model, vae)
    return place_text_encoders(model, prompt_cache, text_encoders, prompts)


def prepare_for_training(
    model: FlowModel, m, seed: int, gradient_checkpointing: bool, prompts: list[str], accelerator
) -> None:
    """Make ``model`` trainable as the run's ``model.*`` settings `m` say: a LoRA of ``m.lora_rank`` (seeded by
    `seed`: runs with one seed start from the same weights) or full fine-tuning (rank 0), gradient checkpointing of
    the transformer's blocks (only forwards with gradients, training, are checkpointed), and the frozen parts placed
    (:func:`place_frozen`: prompt cache of `prompts` and ``m.negative_prompt``, text encoders, VAE), the main process
    of `accelerator` first (it encodes into the shared cache)."""
    torch.manual_seed(seed)
    if m.lora_rank > 0:
        model.add_lora(m.lora_rank, m.lora_alpha)
    else:
        model.full_finetune()
    if gradient_checkpointing:
        model.transformer.enable_gradient_checkpointing()
    if m.prompt_cache or m.text_encoders != "keep" or m.vae_placement != "keep":
        with accelerator.main_process_first():
            place_frozen(model, m.prompt_cache, m.text_encoders, m.vae_placement, [*prompts, m.negative_prompt])
