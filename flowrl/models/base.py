"""The model-adapter contract: what a model family provides to flowrl, and the machinery every family shares.

An adapter is a thin layer over a diffusers pipeline loaded with ``from_pretrained``. The samplers see only
:meth:`FlowModel.velocity_fn` (a velocity over latents of any trailing shape); the trainer and the evaluation
use the rest. A family (one file beside this one) subclasses :class:`FlowModel`, registers it
(:func:`register_family`) and provides:

====================================  ==========================================================================
``PIPELINE``                          the diffusers pipeline class name its folders' ``model_index.json`` names
``OPTIONAL``                          components a folder may leave out (``null`` in ``model_index.json``)
``LORA_TARGETS``                      module-name suffixes a LoRA adapts
``SIGMA_SPACING``                     how the stock pipeline spaces its steps (:func:`samplers.flow_sigmas`)
``PROMPT_LENGTH``, ``PROMPT_RULE``    the prompt lengths the family takes and why (:meth:`check_max_sequence_length`)
``_resolution_grid`` (classmethod)    default side, unit and largest side in px a folder can draw (read from configs)
``scheduler_shift`` / ``shift``       the sigma-schedule shift read from the scheduler config (static by default)
``_default_length`` (staticmethod)    the prompt length the stock pipeline uses (``max_sequence_length``)
``latent_shape``                      ``(C, H, W)`` of one sample's latents at :attr:`resolution`
``encode``                            prompts -> :class:`PromptEmbeds` with the pipeline's own ``encode_prompt``
``_forward``                          one transformer call: latents, times in [0, 1], embeddings -> prediction
====================================  ==========================================================================

What a family supports, declared as class attributes (a method names what it needs in its ``requires``, and
:func:`flowrl.pairing.check_pairing` refuses a method a family cannot run, before any weight loads):

====================================  ==========================================================================
``FORWARD_PROCESS`` (True)            ``x_t = (1 - t) x0 + t eps`` holds for its latents at every flow time ``t``
                                      (False: the DDPM families, whose samples end at ``final_alpha_cumprod``)
``VAE_INVERSE`` (False)               :meth:`FlowModel.encode_latents` inverts :meth:`FlowModel.decode` (latents
                                      are the VAE's scaled ones: SD3, FLUX.1, Z-Image)
``TEXT_ONLY`` (True)                  a prompt record is its text alone (False: the families that read a source
                                      or reference image from the record: edit, image-to-video, FLUX.2)
``VIDEO`` (False)                     it draws videos and takes ``model.num_frames`` / ``model.expert``
``SOURCE_REQUIRED`` (False)           every prompt record of a run names its source ``image`` (image-to-video)
====================================  ==========================================================================

Guidance, once for every family (:meth:`FlowModel.velocity`): the CFG pair batched as one forward of
``PromptEmbeds.cat([negative, cond])`` (every field), the negative prompt put into the table's row 0
(:meth:`FlowModel.velocity_fn`), ``v_u + w (v_c - v_u)``, then ``guidance_rescale``. A family whose mathematics
differs overrides a hook, not the velocity: :meth:`~FlowModel.cfg_scale` and :meth:`~FlowModel.embedded_guidance`
(the scale as a transformer input: FLUX.1-dev, FLUX.2 [dev], SANA-Sprint, HunyuanVideo and its true CFG),
:meth:`~FlowModel.guided_rows` (CFG truncation), :meth:`~FlowModel._guide` (another combination: Qwen-Image's norm
rescale, Z-Image's normalisation), :meth:`~FlowModel._cfg_batch` (a negative per row: Qwen-Image-Edit) and
:attr:`PromptEmbeds.SHARED` (a negative that sees the row's source image).

Shared here as well: loading (every component in ``dtype``, the trained network in float32 on CPU), chunked decoding,
LoRA (add, save in diffusers' format, load, the LoRA-disabled reference), full fine-tuning and saving the whole
pipeline, and batch invariance (:func:`make_batch_invariant`: the PPO ratio is exactly 1 before the first optimizer
step). :func:`flowrl.models.load_model` picks the family from a folder's ``model_index.json`` (:data:`FAMILIES`).
"""

from __future__ import annotations

import contextlib
import json
import warnings
from dataclasses import dataclass, fields, replace
from pathlib import Path

import torch

from ..fields import config_key
from ..files import resolve_path
from ..samplers import flow_sigmas
from .invariance import make_batch_invariant

JOINT_ATTENTION_TARGETS = (
    "attn.to_q",
    "attn.to_k",
    "attn.to_v",
    "attn.to_out.0",
    "attn.add_q_proj",
    "attn.add_k_proj",
    "attn.add_v_proj",
    "attn.to_add_out",
)
"""LoRA targets of the joint-attention (MMDiT) transformers: both streams' query, key, value and output projections of
every dual-stream block (Flow-GRPO's for SD3); FLUX.1, FLUX.2, Qwen-Image and HunyuanVideo 1.5 add their
feed-forward layers."""


def resolve_device(name: str, option: str = "--device") -> str:
    """The device a ``--device`` / ``run.device`` value names: ``"auto"`` is ``"cuda"`` when PyTorch sees a GPU,
    else ``"cpu"``; any other value (``"cpu"``, ``"cuda"``, ``"cuda:1"``) is returned as it is.

    Raises:
        ValueError: naming `option`, for a CUDA device when PyTorch sees none (before anything loads).
    """
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if torch.device(name).type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{option} {name}: no CUDA device is available; use {option} auto or cpu")
    return name


MAX_GUIDANCE = 100.0
"""The largest classifier-free guidance scale accepted (the field's recipes use 1-15)."""


def check_guidance(guidance_scale: float) -> None:
    """Raise ValueError unless the CFG scale is in ``[1, 100]`` (1 = no guidance; above 100 the images saturate)."""
    if not 1 <= guidance_scale <= MAX_GUIDANCE:
        raise ValueError(f"guidance_scale must be in [1, {MAX_GUIDANCE:g}] (1 = no guidance), got {guidance_scale}")


def check_fraction(value, name: str, off: str) -> float:
    """A model option that must be a number in ``[0, 1]`` (``guidance_rescale``, ``cfg_truncation``), as a float.

    Args:
        value: the option's value as given (a bool is refused: YAML reads ``yes`` as one).
        name: the option's name, for the error. off: the value that turns it off, for the error.

    Raises:
        ValueError: naming the option, for anything but an int or float in ``[0, 1]``.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise ValueError(f"{name} must be in [0, 1] ({off} = off), got {value!r}")
    return float(value)


def source_image(meta: dict, family: str) -> str | None:
    """The one source image a prompt record names for an edit or image-to-video family (its ``image`` path, None
    for none).

    Raises:
        ValueError: naming the prompt and `family`, for a record naming several references (``images``), which only
            FLUX.2 reads: drawn from the first one or from none, the record would silently not be what it asks.
    """
    if "images" in meta:
        raise ValueError(
            f"prompt record {meta.get('prompt')!r} names several reference images ('images'); {family} takes one "
            "source image per record ('image'); several references: FLUX.2"
        )
    return meta.get("image")


@dataclass
class PromptEmbeds:
    """Encoded prompts: ``embeds (P, T, D)`` and ``pooled (P, D_pooled)`` on the model's device; a family's subclass adds
    fields (a padding ``mask (P, T)``, a source image's latents), every one a tensor with one row per prompt.

    A prompt table (:meth:`FlowModel.prompt_table`) holds the empty prompt, the CFG negative, in row
    :attr:`NEGATIVE_ROW` and the iteration's prompt ``p`` in row ``rows(p)``: samplers and methods index it through
    :meth:`rows`, never by arithmetic of their own. Indexing (``table[rows]``) and :meth:`cat` keep every field and the
    subclass.
    """

    embeds: torch.Tensor
    pooled: torch.Tensor

    NEGATIVE_ROW = 0
    """The row of the empty prompt (the CFG negative) in a prompt table."""
    SHARED = ()
    """Fields a CFG negative takes from the row it guides, not from the negative prompt (a source image's latents and
    tokens: the negative of an edit or image-to-video row sees that row's source); every other field is the text's."""

    @staticmethod
    def rows(prompt_index: torch.Tensor) -> torch.Tensor:
        """The prompt-table rows `(N,)` long of prompt slots `prompt_index` `(N,)` (indices into the records the table
        was built from)."""
        return prompt_index + 1

    @staticmethod
    def cat(parts: list[PromptEmbeds]) -> PromptEmbeds:
        """The rows of several tables of one class, stacked in order: every tensor field concatenated on dim 0."""
        return type(parts[0])(**{f.name: torch.cat([getattr(p, f.name) for p in parts]) for f in fields(parts[0])})

    @classmethod
    def text_fields(cls) -> tuple[str, ...]:
        """The fields that encode a prompt's text (all but :attr:`SHARED`)."""
        return tuple(f.name for f in fields(cls) if f.name not in cls.SHARED)

    def negative(self, uncond: PromptEmbeds) -> PromptEmbeds:
        """The CFG negative of these ``N`` rows: the text fields of ``uncond`` (``N`` rows of the negative prompt) with
        the :attr:`SHARED` fields of these rows."""
        return replace(self, **{name: getattr(uncond, name) for name in self.text_fields()})

    def with_negative(self, negative: PromptEmbeds) -> PromptEmbeds:
        """This table with the text of row :attr:`NEGATIVE_ROW` (0) replaced by ``negative``'s one row (a re-encoded
        negative prompt); its :attr:`SHARED` fields and the other rows kept."""
        return replace(
            self, **{n: torch.cat([getattr(negative, n), getattr(self, n)[1:]]) for n in self.text_fields()}
        )

    def __getitem__(self, index: torch.Tensor) -> PromptEmbeds:
        """The rows `index` (`(N,)` long) of every field, in this class: ``(N, T, D)``, ``(N, D_pooled)``, ..."""
        return type(self)(**{f.name: getattr(self, f.name)[index] for f in fields(self)})


def _pipeline_folder(path: str | Path) -> Path:
    """``path`` as a Path, if it is a diffusers pipeline folder (has ``model_index.json``).

    Raises:
        FileNotFoundError: naming the path, otherwise.
    """
    path = Path(path)
    if not (path / "model_index.json").is_file():
        raise FileNotFoundError(f"model path {path} is not a diffusers pipeline folder (no model_index.json)")
    return path


def _absent(index: dict, name: str) -> bool:
    """Whether the pipeline's ``model_index.json`` (parsed: ``index``) leaves the component ``name`` out."""
    return (index.get(name) or [None])[0] is None


def _config_shift(cfg: dict, where: str | Path) -> float:
    """The ``shift`` of a flow-matching scheduler config read from ``where`` (named in the errors).

    Raises:
        ValueError: if the scheduler shifts dynamically, or its shift is not a number > 0.
    """
    if cfg.get("use_dynamic_shifting"):
        raise ValueError(f"{where} shifts dynamically (the shift depends on the resolution); set the shift explicitly")
    shift = cfg.get("shift", 1.0)
    if not isinstance(shift, (int, float)) or not shift > 0:
        raise ValueError(f"{where} has shift {shift!r}; expected a number > 0")
    return float(shift)


def _scheduler_file(path: str | Path) -> Path:
    """``scheduler/scheduler_config.json`` of the pipeline folder ``path``.

    Raises:
        FileNotFoundError: if ``path`` is not a pipeline folder or has no scheduler config.
    """
    file = _pipeline_folder(path) / "scheduler" / "scheduler_config.json"
    if not file.is_file():
        raise FileNotFoundError(f"{file} not found: cannot read the model's sigma-schedule shift; set it explicitly")
    return file


def _vae_factor(path: Path) -> int:
    """The VAE's downsampling factor of the pipeline folder ``path`` (as the pipelines' ``vae_scale_factor``)."""
    return 2 ** (len(json.loads((path / "vae" / "config.json").read_text())["block_out_channels"]) - 1)


def built_sample_size(path: str | Path) -> dict:
    """The sampling size a folder built by flowrl was trained at: ``build.json``'s ``sample`` (``{"resolution": px,
    "num_frames": n, "max_sequence_length": tokens}``, :mod:`flowrl.tiny.build_video`), or ``{}`` for any other folder
    (a published checkpoint). The defaults of a small model then draw what it learned instead of the family's
    published size."""
    file = Path(path) / "build.json"
    try:
        sample = json.loads(file.read_text()).get("sample", {}) if file.is_file() else {}
    except (OSError, ValueError, AttributeError):
        return {}
    return sample if isinstance(sample, dict) else {}


def _model_index(path: str | Path) -> dict:
    """The parsed ``model_index.json`` of the pipeline folder ``path`` (FileNotFoundError if there is none)."""
    return json.loads((_pipeline_folder(path) / "model_index.json").read_text())


def _json(path: Path) -> dict:
    """A parsed JSON config file."""
    return json.loads(path.read_text())


def _stretch_to_terminal(sigmas: torch.Tensor, terminal: float) -> torch.Tensor:
    """diffusers' ``FlowMatchEulerDiscreteScheduler.stretch_shift_to_terminal``: the schedule ``sigmas (N,)`` (without
    the final 0) scaled in ``1 - sigma`` so that its last value is ``terminal``: ``1 - (1 - s) (1 - terminal) / (1 -
    s_N)``."""
    one_minus = 1 - sigmas
    return 1 - one_minus / (one_minus[-1] / (1 - terminal))


FAMILIES: dict[str, type[FlowModel]] = {}
"""The registered families by the pipeline class they load (``PIPELINE``, the ``_class_name`` of a folder's
``model_index.json``): :func:`register_family`; :func:`flowrl.models.model_class` looks a folder's family up here."""


def register_family(cls: type[FlowModel]) -> type[FlowModel]:
    """Class decorator: register a :class:`FlowModel` subclass as the family of its ``PIPELINE`` (:data:`FAMILIES`).

    Raises:
        ValueError: naming the class, for one without ``PIPELINE`` or a pipeline registered already.
    """
    if not cls.PIPELINE:
        raise ValueError(f"{cls.__name__} names no PIPELINE: a family registers under its diffusers pipeline class")
    if cls.PIPELINE in FAMILIES:
        raise ValueError(f"pipeline {cls.PIPELINE} is registered already ({FAMILIES[cls.PIPELINE].__name__})")
    FAMILIES[cls.PIPELINE] = cls
    return cls


CAPABILITIES = ("forward_process", "vae_inverse", "text_only")
"""What a family may support, each a boolean class attribute of :class:`FlowModel` of the same name in capitals
(``FORWARD_PROCESS``, ``VAE_INVERSE``, ``TEXT_ONLY``): the names a method's ``requires`` lists
(:class:`flowrl.methods.base.Method`)."""


class FlowModel:
    """The base of every model adapter: a flow-matching text-to-image (or video) pipeline behind one contract
    (this module's docstring lists what a family provides). Construct a family's subclass, or let
    :func:`flowrl.models.load_model` pick it from the folder.

    Args:
        path: a local pipeline folder (``model_index.json`` + subfolders), e.g. ``assets/tiny-sd3`` or a
            downloaded ``stabilityai/stable-diffusion-3.5-medium``.
        device: torch device for every component.
        dtype: dtype of the frozen components (text encoders, VAE); the transformer is kept in float32
            on CPU and in ``dtype`` elsewhere (LoRA parameters are float32 everywhere).
        max_sequence_length: T5 tokens; None: :meth:`default_max_sequence_length` (the stock pipeline's).
        resolution: image side in pixels for sampling and evaluation (square images); None for the
            family's default (:meth:`check_resolution`).
        options: the family's own settings (:attr:`OPTIONS`), each checked by its ``check_<name>``.

    Raises:
        FileNotFoundError: if ``path`` is not a folder with ``model_index.json``.
        ValueError: for a ``resolution``, ``max_sequence_length`` or option value the family cannot take, or a folder
            of another pipeline class.
        TypeError: for an option the family does not take.
    """

    PIPELINE: str | None = None
    """The diffusers pipeline class this adapter loads (``_class_name`` in ``model_index.json``)."""
    OPTIONAL: tuple[str, ...] = ()
    """Components a folder may leave out (``null`` in ``model_index.json``)."""
    LORA_TARGETS: tuple[str, ...] = ()
    """Module-name suffixes of the transformer layers a LoRA adapts."""
    SIGMA_SPACING = "sd3"
    """How the stock pipeline spaces its steps (:func:`samplers.flow_sigmas`' ``spacing``)."""
    NETWORK = "transformer"
    """The pipeline component that is trained, held as :attr:`transformer` (``"unet"`` for the UNet families)."""

    @classmethod
    def network_name(cls, expert: str | None = None) -> str:
        """The pipeline component trained for ``model.expert`` (:attr:`NETWORK`; Wan 2.2 overrides it per expert)."""
        return cls.NETWORK

    OPTIONS: tuple[str, ...] = ()
    """The family's own settings, keyword arguments of its constructor that ``model.options`` may set (e.g.
    HunyuanVideo's ``true_cfg_scale``, SDXL's ``guidance_rescale``): each is checked by the family's ``check_<name>``
    (:meth:`check_option`) and kept as the attribute of its name, whose class value is its default."""
    VIDEO = False
    """Whether the family draws videos (latents ``(C, F, H, W)`` decoded to ``(B, F, 3, H, W)``); only a video family
    takes ``model.num_frames`` and ``model.expert`` (its constructor's ``num_frames`` and ``expert``)."""
    VAE_CHANNELS_LAST = True
    """Whether the VAE runs in channels-last memory format (False for a VAE of 3-D convolutions, Qwen-Image's)."""
    DECODE_CHUNK = 32
    """Latents per VAE decode call (:attr:`decode_chunk`; see :meth:`decode`)."""
    PROMPT_PADDING = "fixed"
    """How :meth:`encode` pads a batch's tokens: ``"fixed"`` (to a length that does not depend on the batch) or
    ``"longest"`` (to the batch's longest prompt, marked by a ``mask`` field: Qwen-Image); the prompt cache
    (:mod:`flowrl.models.memory`) stores a ``"longest"`` row without its padding."""
    FAMILY = ""
    """The family's name in error messages (``"FLUX"``, ``"Wan"``)."""
    PROMPT_LENGTH: tuple[int, int | None] = (0, None)
    """The ``max_sequence_length`` values the family takes, ``(least, most or None)`` (SD3: any ``>= 0``, 0 without
    T5), checked by :meth:`check_max_sequence_length`."""
    PROMPT_RULE = ""
    """Why the family limits the prompt length, for the error (``"its T5 tokens condition every block"``)."""
    SHIFT_TERMINAL = False
    """Whether :meth:`sigmas` stretches the schedule to the scheduler config's ``shift_terminal`` as the stock pipeline's
    scheduler does (Qwen-Image, Z-Image, FLUX.2, LTX-Video)."""
    FORWARD_PROCESS = True
    """Capability: the flow-matching forward process ``x_t = (1 - t) x0 + t eps`` holds for the family's latents (the
    forward-process methods train on it); False for the DDPM families (SD 1.x, SDXL)."""
    VAE_INVERSE = False
    """Capability: :meth:`encode_latents` is the inverse of :meth:`decode` (the family's latents are the VAE's scaled
    ones and it decodes with :meth:`FlowModel.decode`): what the offline methods encode their images with."""
    TEXT_ONLY = True
    """Capability: a prompt record is its text alone; False for a family that reads a source or reference image from
    the record (edit and image-to-video families, FLUX.2)."""
    SOURCE_REQUIRED = False
    """Whether every prompt record a run trains or evaluates on must name its source ``image`` (the image-to-video
    families: the video's first frame; a record without one would start from a blank frame), checked when the prompt
    files are read, before the model loads."""
    negative_prompt = ""
    """The CFG negative prompt: ``""`` (the prompt table's empty row) unless a family takes one (the video families'
    ``negative_prompt``); :meth:`velocity_fn` puts a non-empty one into the table's row 0."""
    guidance_rescale = 0.0
    """The ``guidance_rescale`` of :meth:`_guide` in [0, 1] (0: off); a family that takes it sets it (from an option or
    the folder's guider)."""
    _negative: tuple[str, PromptEmbeds] | None = None  # (negative prompt, its encoding): negative_encoding's cache

    @classmethod
    def supports(cls, capability: str) -> bool:
        """Whether the family has ``capability`` (one of :data:`CAPABILITIES`, the lower-case name of its flag).

        Raises:
            KeyError: naming the known capabilities, for another name.
        """
        if capability not in CAPABILITIES:
            raise KeyError(f"unknown family capability {capability!r}; known: {', '.join(CAPABILITIES)}")
        return bool(getattr(cls, capability.upper()))

    def __init__(
        self,
        path: str | Path,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        max_sequence_length: int | None = None,
        resolution: int | None = None,
        **options,
    ):
        import diffusers

        from ..rewards.base import quiet_loading  # the leaf's switch for every model flowrl loads

        path = Path(path)
        index = _model_index(path)  # the folder, its pipeline class and resolution are checked before weights load
        if self.PIPELINE is None:
            raise TypeError(
                "FlowModel is the adapters' base: construct a family (SD3Model, FluxModel) or use "
                "flowrl.models.load_model"
            )
        if index.get("_class_name") != self.PIPELINE:
            raise ValueError(
                f"{path / 'model_index.json'} names pipeline {index.get('_class_name')!r}, not "
                f"{self.PIPELINE}: load it with flowrl.models.load_model"
            )
        self.check_folder(path)
        self._set_options(path, options)
        self.resolution = self.check_resolution(path, resolution)
        self.max_sequence_length = self._default_length(index) if max_sequence_length is None else max_sequence_length
        self.check_prompt_length(path, self.max_sequence_length)
        kwargs = {name: None for name in self.OPTIONAL if _absent(index, name)}  # optional parts the folder leaves out
        with quiet_loading():  # the pipeline's and its text encoders' loading bars: off for this load only
            self.pipe = (
                getattr(diffusers, self.PIPELINE)
                .from_pretrained(path, dtype=dtype, use_safetensors=True, **kwargs)
                .to(device)
            )
        self.pipe.set_progress_bar_config(disable=True)
        self.transformer = getattr(self.pipe, self.NETWORK)  # the trained network (a transformer, or a UNet)
        train_dtype = torch.float32 if torch.device(device).type == "cpu" else dtype
        if self.transformer.dtype != train_dtype:
            self.transformer.to(train_dtype)
        self.transformer.requires_grad_(False)
        for name in ("vae", "text_encoder", "text_encoder_2", "text_encoder_3", "image_encoder"):
            if (module := getattr(self.pipe, name, None)) is not None:
                module.requires_grad_(False).eval()
        if self.VAE_CHANNELS_LAST:
            self.pipe.vae.to(memory_format=torch.channels_last)  # its convolutions run faster so, on CPU as on GPU
        self.device, self.dtype, self.path = torch.device(device), dtype, path
        self.decode_chunk = self.DECODE_CHUNK  # latents per VAE decode call (:meth:`decode`)
        self.wrapped = None  # the transformer wrapped for several processes (DDP), set by flowrl.policy.Policy
        make_batch_invariant(self.transformer, self._probe)  # the ratio is exactly 1 before the first optimizer step
        for name in ("text_encoder", "text_encoder_2", "text_encoder_3"):  # a prompt's row whatever its batch: the
            if isinstance(module := getattr(self.pipe, name, None), torch.nn.Module):  # prompt cache equals encode
                make_batch_invariant(module, None)
        self._after_load()

    @classmethod
    def check_option_names(cls, names) -> None:
        """Refuse a keyword the family's constructor does not take.

        Raises:
            TypeError: naming the family, the first unknown name and its :attr:`OPTIONS`.
        """
        unknown = [name for name in names if name not in cls.OPTIONS]
        if unknown:
            takes = ", ".join(cls.OPTIONS) or "none"
            raise TypeError(f"{cls.__name__} takes no option {unknown[0]!r}; its options: {takes}")

    def _set_options(self, path: Path, options: dict) -> None:
        """Each option given (:attr:`OPTIONS`), checked (:meth:`check_option`), as the attribute of its name; the others
        keep their class defaults.

        Raises:
            TypeError: for a name the family does not take. ValueError: as :meth:`check_option`.
        """
        self.check_option_names(options)
        for name, value in options.items():
            setattr(self, name, self.check_option(path, name, value))

    def _after_load(self) -> None:
        """A family's own set-up once the pipeline is loaded and batch-invariant (a frozen second expert, a check of the
        loaded tokenizer). Default: nothing."""

    @classmethod
    def check_folder(cls, path: Path) -> None:
        """Refuse a pipeline folder of this class that the family cannot run, reading its configs (no weights loaded):
        called before loading and by :meth:`check_config` (``model.path``). Default: nothing to refuse.

        Raises:
            ValueError, FileNotFoundError: naming the folder and what does not fit.
        """

    @classmethod
    def default_max_sequence_length(cls, path: str | Path) -> int:
        """The T5 prompt length the pipeline folder ``path`` is used with when none is given, read from its
        ``model_index.json`` (no weights loaded): 256 (diffusers' SD3 default) if it has a T5 text encoder
        (``text_encoder_3``), else 0: without T5, ``encode_prompt`` pads that many zero tokens, which the tiny model
        never saw. Flow-GRPO's SD3.5 recipe sets 128 explicitly. A flowrl-built folder's own length first
        (:func:`built_sample_size`: 16 for the shipped tiny Wan).

        Raises:
            FileNotFoundError: if ``path`` is not a folder with ``model_index.json``.
        """
        index = _model_index(path)
        return int(built_sample_size(path).get("max_sequence_length", cls._default_length(index)))

    @staticmethod
    def _default_length(index: dict) -> int:
        """The family's default prompt length for a parsed ``model_index.json``."""
        raise NotImplementedError

    @classmethod
    def check_prompt_length(cls, path: Path, length: int) -> None:
        """Check the prompt length against the pipeline folder ``path`` before anything loads: by default
        :meth:`check_max_sequence_length`; a family whose folder bounds it further (Wan 2.1 I2V's CLIP tokens, LTX-2's
        registers) adds its check.

        Raises:
            ValueError: for a length this family or folder cannot take.
        """
        cls.check_max_sequence_length(length)

    @classmethod
    def check_max_sequence_length(cls, length: int) -> None:
        """Check a prompt length before anything loads against :attr:`PROMPT_LENGTH` (SD3: any ``>= 0``; 0 without T5).

        Raises:
            ValueError: ``max_sequence_length must be >= 1 for FLUX (its T5 tokens condition every block), got 0``,
                for a length this family cannot take.
        """
        least, most = cls.PROMPT_LENGTH
        if least <= length and (most is None or length <= most):
            return
        span = f">= {least}" if most is None else str(least) if least == most else f"in {least}..{most}"
        family = f" for {cls.FAMILY} ({cls.PROMPT_RULE})" if cls.PROMPT_RULE else ""
        raise ValueError(f"max_sequence_length must be {span}{family}, got {length}")

    @classmethod
    def check_resolution(cls, path: str | Path, resolution: int | None) -> int:
        """The image side in pixels the pipeline folder ``path`` draws: ``resolution`` checked, or the default
        (no weights loaded).

        Raises:
            FileNotFoundError: if ``path`` is not a folder with ``model_index.json``.
            ValueError: naming the folder, for a resolution that is not a multiple of the family's unit from the
                unit up to its largest side (:meth:`_resolution_grid`).
        """
        path = _pipeline_folder(path)
        default, unit, largest, why = cls._resolution_grid(path)
        if resolution is None:
            return default
        if resolution < unit or resolution % unit or (largest is not None and resolution > largest):
            span = "" if largest is None else f" from {unit} to {largest}"
            raise ValueError(
                f"resolution {resolution} px does not fit the model at {path}: expected a multiple of "
                f"{unit} ({why}){span}"
            )
        return resolution

    @classmethod
    def _resolution_grid(cls, path: Path) -> tuple[int, int, int | None, str]:
        """The pixel sides the pipeline folder ``path`` can draw, from its configs: ``(default, unit, largest or None,
        what makes the unit)``; any multiple of ``unit`` from ``unit`` to ``largest`` fits."""
        raise NotImplementedError

    @classmethod
    def check_config(cls, cfg) -> None:
        """Refuse run settings this family cannot sample or train, before weights load: the folder (:meth:`check_folder`,
        ``model.path``) and each ``model.options`` value (:meth:`check_option`). ``cfg`` is a
        :class:`flowrl.config.Config`, read by its keys (a family imports no config module); what a method needs of
        the family is checked apart (:func:`flowrl.pairing.check_pairing`).

        Raises:
            flowrl.fields.ConfigError: naming the key.
        """
        path = resolve_path(cfg.model.path)
        with config_key("model.path", (ValueError, FileNotFoundError)):
            cls.check_folder(path)
        for name, value in cfg.model.options.items():
            with config_key(f"model.options.{name}"):
                cls.check_option(path, name, value)

    @classmethod
    def check_option(cls, path: Path, name: str, value):
        """``value`` of the family's option ``name`` (one of :attr:`OPTIONS`) checked, by the family's ``check_<name>``
        (its constructor calls the same).

        Raises:
            ValueError: naming the option, for a value it cannot take.
        """
        return getattr(cls, f"check_{name}")(value)

    @classmethod
    def scheduler_shift(cls, path: str | Path, resolution: int | None = None, num_frames: int | None = None) -> float:
        """The sigma-schedule shift of the pipeline folder ``path``, read from ``scheduler/scheduler_config.json``
        (no weights loaded): 3.0 for Stable Diffusion 3 / 3.5, 1.0 for the shipped tiny model. ``resolution``
        matters only to the families whose shift depends on the token count (FLUX, Qwen-Image, Z-Image, FLUX.2,
        LTX-Video); ``num_frames`` (video families only: callers pass it to a ``VIDEO`` adapter) to LTX-Video.

        Raises:
            FileNotFoundError: if ``path`` is not a folder with ``model_index.json``, or has no scheduler config.
            ValueError: if the scheduler shifts dynamically (its shift depends on the resolution, as FLUX's), or
                its shift is not a positive number.
        """
        file = _scheduler_file(path)
        return _config_shift(json.loads(file.read_text()), file)

    @property
    def shift(self) -> float:
        """The sigma-schedule shift of the loaded pipeline's scheduler (as :meth:`scheduler_shift`): the default
        of every sampler and evaluation that is given no shift.

        Raises:
            ValueError: as :meth:`scheduler_shift`.
        """
        return _config_shift(dict(self.pipe.scheduler.config), Path(self.path) / "scheduler")

    def sigmas(self, num_steps: int, shift: float | None = None) -> torch.Tensor:
        """The sigma schedule ``(num_steps + 1,)`` float32 (CPU) from 1 to 0 that the stock pipeline samples with
        (:func:`samplers.flow_sigmas` with :attr:`SIGMA_SPACING`), at ``shift`` (None: :attr:`shift`); with
        :attr:`SHIFT_TERMINAL`, stretched to end at the scheduler's ``shift_terminal`` when it has one, then 0.

        Raises:
            ValueError: as :func:`samplers.flow_sigmas`.
        """
        sigmas = flow_sigmas(num_steps, self.shift if shift is None else shift, spacing=self.SIGMA_SPACING)  # (N + 1,)
        terminal = self.pipe.scheduler.config.get("shift_terminal") if self.SHIFT_TERMINAL else None
        if not terminal:
            return sigmas
        return torch.cat([_stretch_to_terminal(sigmas[:-1].double(), terminal).float(), sigmas[-1:]])

    @property
    def latent_shape(self) -> tuple[int, ...]:
        """``(C, H, W)`` (or ``(C, F, H, W)`` for video) of one sample's latents at :attr:`resolution`."""
        raise NotImplementedError

    def encode(self, prompts: list[str]) -> PromptEmbeds:
        """Encode ``P`` prompts with the pipeline's own ``encode_prompt``: :class:`PromptEmbeds`, float32."""
        raise NotImplementedError

    def prompt_table(self, metas: list[dict]) -> PromptEmbeds:
        """The prompt table the samplers index (:meth:`velocity_fn`) for ``P`` prompt records (dicts with a ``prompt``):
        ``P + 1`` rows, row 0 the empty prompt (the CFG negative), row ``1 + p`` the record ``metas[p]``.

        The hook for conditioning beyond the text: a family whose prompts carry more (an image-editing model's source
        image, :class:`flowrl.models.FluxKontextModel`) reads it from the records here; every other family encodes the
        prompts alone (this default).

        Raises:
            KeyError: for a record without ``prompt`` (the prompt files are checked when read, :mod:`flowrl.data`).
        """
        return self.encode([""] + [m["prompt"] for m in metas])  # row NEGATIVE_ROW, then rows(p) = p + 1

    def add_lora(self, rank: int, alpha: float, targets: tuple[str, ...] | None = None) -> list[torch.nn.Parameter]:
        """Add a peft LoRA adapter (Gaussian init of A, zero B) to the transformer.

        Returns:
            The trainable LoRA parameters (float32).
        """
        from peft import LoraConfig

        config = LoraConfig(
            r=rank, lora_alpha=alpha, init_lora_weights="gaussian", target_modules=list(targets or self.LORA_TARGETS)
        )
        self.transformer.add_adapter(config)
        make_batch_invariant(self.transformer, self._probe)  # the adapter's own per-sample layers, if any
        params = [p for p in self.transformer.parameters() if p.requires_grad]
        for p in params:
            p.data = p.data.float()
        return params

    def full_finetune(self) -> list[torch.nn.Parameter]:
        """Make every transformer parameter trainable (float32); returns them."""
        self.transformer.float().requires_grad_(True)
        return list(self.transformer.parameters())

    @contextlib.contextmanager
    def reference(self):
        """Context in which the transformer is the base model (LoRA adapters disabled).

        Raises:
            RuntimeError: if the transformer has no LoRA adapter (full fine-tuning has no separate base).
        """
        if not getattr(self.transformer, "_hf_peft_config_loaded", False):
            raise RuntimeError("the KL reference is the LoRA-disabled base: set model.lora_rank > 0 to use kl_beta")
        self.transformer.disable_adapters()
        try:
            yield
        finally:
            self.transformer.enable_adapters()

    @contextlib.contextmanager
    def adapter(self, name: str):
        """Context in which the transformer runs the LoRA adapter `name` alone (loaded by :meth:`load_lora` with
        ``adapter_name``), for forwards without gradients; the trained adapter (``default``) is active again after it,
        its parameters trainable (peft's ``set_adapter`` sets ``requires_grad`` of the active adapter only)."""
        self.transformer.set_adapter(name)
        try:
            yield
        finally:
            self.transformer.set_adapter("default")

    # ------------------------------------------------------------------------------ guidance
    def velocity(
        self, x: torch.Tensor, t: torch.Tensor, cond: PromptEmbeds, uncond: PromptEmbeds | None, guidance_scale: float
    ) -> torch.Tensor:
        """Velocity with guidance: the family's CFG ``v = v_u + w (v_c - v_u)`` against ``uncond`` in one batched
        forward of both rows (:meth:`_cfg_batch`, :meth:`_guide`) at the CFG scale :meth:`cfg_scale`, the guidance
        scale given to the transformer where it takes one (:meth:`embedded_guidance`); one row per sample when the CFG
        scale is 1, ``uncond`` is None, or no row is guided at its time (:meth:`guided_rows`).

        Args:
            x: latents ``(N, *latent_shape)``; t: ``(N,)`` times in [0, 1] (1 = noise).
            cond: ``N`` prompt embeddings; uncond: ``N`` rows of the negative prompt, or None (no CFG).
            guidance_scale: w in [1, 100].

        Returns:
            float32 ``(N, *latent_shape)``.

        Raises:
            ValueError: for a ``guidance_scale`` outside [1, 100] or one the family cannot take (:meth:`cfg_scale`).
        """
        scale = self.cfg_scale(guidance_scale)
        dtype = next(self.transformer.parameters()).dtype
        inputs = self.embedded_guidance(guidance_scale)
        rows = self.guided_rows(t)  # (N,) bool or None (every row)
        if uncond is None or scale == 1.0 or (rows is not None and not rows.any()):
            return self._forward(x, t, cond, dtype, **inputs).float()
        both = self._cfg_batch(cond, uncond)  # (2N) rows: the negatives, then the prompts
        v_u, v_c = self._forward(torch.cat([x, x]), torch.cat([t, t]), both, dtype, **inputs).float().chunk(2)
        v = self._guide(x, t, v_u, v_c, scale)
        return v if rows is None else torch.where(rows.view(-1, *[1] * (v.ndim - 1)), v, v_c)

    def cfg_scale(self, guidance_scale: float) -> float:
        """The classifier-free guidance scale a velocity at ``guidance_scale`` applies against the negative prompt
        (1: none, one row per sample): ``guidance_scale`` itself; a family whose transformer takes the scale as an input
        returns 1 (or its true-CFG scale: HunyuanVideo).

        Raises:
            ValueError: for a ``guidance_scale`` outside [1, 100] (:func:`check_guidance`), or one the family refuses.
        """
        check_guidance(guidance_scale)
        return guidance_scale

    def uses_negative(self, guidance_scale: float) -> bool:
        """Whether a velocity at ``guidance_scale`` evaluates the negative prompt (a CFG scale other than 1).

        Raises:
            ValueError: as :meth:`cfg_scale`.
        """
        return self.cfg_scale(guidance_scale) != 1.0

    def embedded_guidance(self, guidance_scale: float) -> dict:
        """Keyword arguments of :meth:`_forward` that give the transformer the guidance scale (``{"guidance": w}`` for
        the guidance-distilled transformers: FLUX.1-dev, FLUX.2 [dev], SANA-Sprint, HunyuanVideo); ``{}`` for CFG."""
        return {}

    def guided_rows(self, t: torch.Tensor) -> torch.Tensor | None:
        """Which rows at times ``t`` `(N,)` CFG guides, `(N,)` bool (the others take the conditional velocity: CFG
        truncation, Z-Image); None: every row."""
        return None

    def _cfg_batch(self, cond: PromptEmbeds, uncond: PromptEmbeds) -> PromptEmbeds:
        """The ``2N`` rows of one CFG forward: the negatives (``uncond``'s text with ``cond``'s
        :attr:`PromptEmbeds.SHARED` fields, :meth:`PromptEmbeds.negative`), then ``cond``; every field batched."""
        return PromptEmbeds.cat([cond.negative(uncond), cond])

    def _guide(
        self, x: torch.Tensor, t: torch.Tensor, v_u: torch.Tensor, v_c: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """The guided velocity ``(N, *latent_shape)`` float32 from the negative's and the prompt's, ``v_u + w (v_c -
        v_u)`` at CFG scale ``w = scale``, then pulled towards ``v_c``'s per-sample standard deviation by
        :attr:`guidance_rescale` (Lin et al., arXiv 2305.08891, Sec. 3.4; diffusers' ``rescale_noise_cfg``) when it is
        set. ``x (N, *latent_shape)`` and ``t (N,)``: the state and times, for a family whose combination reads them."""
        v = v_u + scale * (v_c - v_u)
        if not self.guidance_rescale:
            return v
        from diffusers.guiders.guider_utils import rescale_noise_cfg

        return rescale_noise_cfg(v, v_c, guidance_rescale=self.guidance_rescale)

    def negative_encoding(self) -> PromptEmbeds:
        """The encoding of :attr:`negative_prompt` (one row), cached until the prompt changes."""
        cached = self._negative
        if cached is None or cached[0] != self.negative_prompt:
            self._negative = (self.negative_prompt, self.encode([self.negative_prompt]))
        return self._negative[1]

    def _probe(self) -> None:
        """One forward of the transformer on one sample (for :func:`make_batch_invariant`)."""
        cond = self.encode([""])
        x = torch.zeros(1, *self.latent_shape, device=self.device)
        self._forward(x, torch.ones(1, device=self.device), cond, next(self.transformer.parameters()).dtype)

    def network(self) -> torch.nn.Module:
        """The module a forward calls: :attr:`wrapped` (accelerate's DDP wrapper, whose backward sums the gradients
        over processes) for a forward with gradients when there is one, else the transformer itself (sampling,
        evaluation, the reference policy: no gradients to sum, no collective call to match across processes)."""
        return self.wrapped if self.wrapped is not None and torch.is_grad_enabled() else self.transformer

    def _forward(self, x: torch.Tensor, t: torch.Tensor, cond: PromptEmbeds, dtype: torch.dtype) -> torch.Tensor:
        """One transformer call: latents ``x (N, *latent_shape)`` at times ``t (N,)`` in [0, 1] (1 = noise), prompt
        embeddings ``cond`` (``N`` rows), inputs cast to ``dtype``; returns the prediction ``(N, *latent_shape)``. A
        family with embedded guidance also takes :meth:`embedded_guidance`'s ``guidance`` (the scale, None or absent:
        1)."""
        raise NotImplementedError

    def trainable_times(self, sigmas: torch.Tensor) -> torch.Tensor | None:
        """Whether a step starting at each time in ``sigmas`` (``(N,)`` float in [0, 1], 1 = noise) runs the trained
        network, ``(N,)`` bool; None when every step does (one network: every family but a two-expert Wan 2.2). A
        step that does not cannot move the trained weights, so the rollout does not train it."""
        return None

    def cfg_rows(self, guidance_scale: float) -> int:
        """Transformer rows one velocity evaluation costs per sample (the ``cost/nfe`` unit): 2 when it evaluates the
        negative prompt too (:meth:`uses_negative`, as :meth:`velocity` batches them), else 1."""
        return 2 if self.uses_negative(guidance_scale) else 1

    def velocity_fn(self, table: PromptEmbeds, guidance_scale: float):
        """A :class:`samplers.VelocityFn` ``fn(x (N, *latent_shape), t (N,), cond (N,) long) -> (N, *latent_shape)``
        float32 over a table of prompts: ``cond`` indexes ``table``, whose row 0 is the CFG negative: the empty prompt,
        or :attr:`negative_prompt` re-encoded into it (its text; the row's :attr:`PromptEmbeds.SHARED` fields kept)
        when that is set and the velocity evaluates it (:meth:`uses_negative`).

        Raises:
            ValueError: as :meth:`cfg_scale`.
        """
        guided = self.uses_negative(guidance_scale)
        if guided and self.negative_prompt:
            table = table.with_negative(self.negative_encoding())  # (P + 1) rows, row 0 the negative prompt's text

        def fn(x: torch.Tensor, t: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
            uncond = table[torch.full_like(cond, table.NEGATIVE_ROW)] if guided else None
            return self.velocity(x, t, table[cond], uncond, guidance_scale)

        return fn

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Decode scaled latents ``(B, C, H, W)`` to images float32 ``(B, 3, H*f, W*f)`` in [0, 1], in chunks of
        at most :attr:`decode_chunk` latents.

        The chunks keep diffusers' ``Upsample2D`` on the channels-last path: from 64 images on it copies its
        input to NCHW (a workaround for an old PyTorch bug), which on the CPU made decoding 64 tiny-model
        latents about 1.5x (bf16 autocast) and 1.6x (float32) slower than two chunks of 32
        (``benchmarks/decode_precision_check.py --decode-chunk 64`` against ``32``).
        """
        vae = self.pipe.vae
        images = []
        for chunk in latents.split(self.decode_chunk):
            z = chunk.to(vae.dtype) / vae.config.scaling_factor + (vae.config.shift_factor or 0.0)
            z = z.contiguous(memory_format=torch.channels_last)
            images.append(vae.decode(z, return_dict=False)[0].float())
        return (torch.cat(images) / 2 + 0.5).clamp(0, 1)

    def decode_with_grad(self, latents: torch.Tensor, clean: bool = False) -> torch.Tensor:
        """The family's :meth:`decode` with the graph back to `latents` (the VAE frozen): what the direct-reward
        methods score. Images float32 ``(B, 3, H, W)`` (videos ``(B, F, 3, H, W)``) in [0, 1], as :meth:`decode`.

        Args:
            latents (`torch.Tensor`): ``(B, *latent_shape)`` float32: the sampler's final states (at the grid's last
                time) or, with `clean`, clean latents at time 0 (a one-step prediction ``x_t - t v``).
            clean (`bool`): the latents are at time 0. The same as the final states for the flow-matching families,
                whose grids end at 0; the DDPM families' end at their final timestep's time (:meth:`SD15Model.decode`).
        """
        decode = type(self).decode
        return getattr(decode, "__wrapped__", decode)(self, latents)  # the body under its @torch.no_grad()

    def encodes_images(self) -> bool:
        """Whether :meth:`encode_latents` is this family's inverse of :meth:`decode` (:attr:`VAE_INVERSE`: the families
        whose latents are the VAE's scaled ones, SD3, FLUX.1, Z-Image)."""
        return self.VAE_INVERSE

    @torch.no_grad()
    def encode_latents(self, images: torch.Tensor) -> torch.Tensor:
        """The inverse of :meth:`decode`: images ``(B, 3, H, W)`` in [0, 1] (``H = W = resolution``) to scaled latents
        ``(B, *latent_shape)`` float32 on the model's device, ``(mode - shift_factor) * scaling_factor`` of the VAE's
        posterior, :attr:`decode_chunk` images per call (the offline methods' data).

        Raises:
            NotImplementedError: for a family whose :meth:`decode` is its own (its latents are not the VAE's scaled).
        """
        if not self.VAE_INVERSE:
            raise NotImplementedError(f"{type(self).__name__} decodes its own latents: encoding images is not built")
        vae = self.pipe.vae
        out = []
        for chunk in images.split(self.decode_chunk):
            x = (chunk.to(self.device, vae.dtype) * 2 - 1).contiguous()
            z = vae.encode(x, return_dict=False)[0].mode()
            out.append(((z - (vae.config.shift_factor or 0.0)) * vae.config.scaling_factor).float())
        return torch.cat(out)

    def lora_state(self, weights: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """The LoRA tensors in peft's naming (adapter name stripped), from ``weights`` (trainable tensors by the
        transformer's parameter names, e.g. :meth:`flowrl.policy.Policy.weights` or its EMA) or, for None, the
        transformer's own state dict (under FSDP2 that would be its shards: pass ``weights`` there)."""
        from peft.utils import get_peft_model_state_dict

        if weights is not None:
            weights = {n: w.detach().cpu() for n, w in weights.items()}
        return get_peft_model_state_dict(self.transformer, state_dict=weights)

    def save_lora(self, directory: str | Path, weights: dict[str, torch.Tensor] | None = None) -> None:
        """Write the LoRA in diffusers' format (``pytorch_lora_weights.safetensors``), loadable by the stock
        pipeline's ``load_lora_weights(directory)`` (``StableDiffusion3Pipeline``, ``FluxPipeline``); ``weights``: as
        :meth:`lora_state`."""
        state = self.lora_state(weights)
        metadata = self.transformer.peft_config["default"].to_dict()  # carries lora_alpha: without it alpha = rank
        type(self.pipe).save_lora_weights(
            directory, transformer_lora_layers=state, transformer_lora_adapter_metadata=metadata
        )

    def save_pipeline(self, directory: str | Path, plain_copy: bool = False, state: dict | None = None) -> None:
        """Write the whole pipeline, with the transformer as it is now (float32 on CPU), as a diffusers
        folder of safetensors: what full fine-tuning (``model.lora_rank=0``) leaves, loadable by
        ``flowrl eval --model directory`` and ``StableDiffusion3Pipeline.from_pretrained(directory)``.
        For SD3.5-Medium that is the text encoders and the VAE too, several GB.

        ``plain_copy``: write a plain CPU copy of the transformer built from its config, parameters and buffers
        (under FSDP2, whose gathered weights are the trained ones while the module's own state dict holds shards);
        ``state``: those parameters and buffers, whole, by name, where the module holds only shards (FSDP2 full shard:
        :meth:`flowrl.policy.Policy.module_state`)."""
        from diffusers.utils import logging as diffusers_logging

        attr, module = self.NETWORK, self.transformer
        if plain_copy:
            if state is None:
                state = {n: t.detach().cpu().clone() for n, t in [*module.named_parameters(), *module.named_buffers()]}
            copy = type(module).from_config(module.config)
            copy.load_state_dict(state)
            setattr(self.pipe, attr, copy)
        verbosity = diffusers_logging.get_verbosity()
        diffusers_logging.set_verbosity_error()  # not the warning for each absent optional part (T5)
        try:
            self.pipe.save_pretrained(directory, safe_serialization=True)
        finally:
            diffusers_logging.set_verbosity(verbosity)
            setattr(self.pipe, attr, module)

    def load_lora(self, directory: str | Path, adapter_name: str | None = None) -> None:
        """Load a diffusers-format LoRA folder into the transformer: as diffusers names it (the first adapter), or as
        the extra peft adapter `adapter_name` beside the trained one (a Flow-OPD teacher: :meth:`adapter`).

        Raises:
            FileNotFoundError: if the folder has no ``pytorch_lora_weights.safetensors``.
            ValueError: naming the file, if it is damaged (truncated, a pickle under that name) or holds no LoRA
                weights for this transformer.
        """
        from .. import files

        file = Path(directory) / "pytorch_lora_weights.safetensors"
        if not file.is_file():
            pickled = sorted(p.name for p in Path(directory).glob("*") if p.suffix in files.PICKLE_SUFFIXES)
            why = (
                f" (it holds {', '.join(pickled)}: pickles, which flowrl never loads; convert them to safetensors)"
                if pickled
                else ""
            )
            raise FileNotFoundError(f"LoRA folder {directory} has no pytorch_lora_weights.safetensors{why}")
        files.check_safetensors(file)
        before = {n for n, _ in self.transformer.named_parameters() if "lora_" in n}
        from diffusers.utils import logging as diffusers_logging

        verbosity = diffusers_logging.get_verbosity()
        diffusers_logging.set_verbosity_error()  # not "no LoRA keys for the text encoders": flowrl trains none
        try:
            named = {} if adapter_name is None else {"adapter_name": adapter_name}
            with warnings.catch_warnings():  # peft's notice that a second adapter joins the first: the point here
                warnings.filterwarnings("ignore", message="Already found a `peft_config` attribute")
                self.pipe.load_lora_weights(str(directory), use_safetensors=True, **named)
        except (ValueError, KeyError, RuntimeError) as e:  # diffusers' and peft's "not a LoRA of this model"
            message = " ".join(str(e).split())[:300]
            raise ValueError(f"{file} is not a LoRA of this model ({type(e).__name__}: {message})") from None
        finally:
            diffusers_logging.set_verbosity(verbosity)
        if {n for n, _ in self.transformer.named_parameters() if "lora_" in n} == before:
            raise ValueError(f"{file} holds no LoRA weights for this model's transformer")
