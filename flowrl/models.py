"""Model adapters: a thin layer over a diffusers pipeline loaded with ``from_pretrained``.

An adapter encodes prompts, predicts velocity with classifier-free guidance, decodes latents to images
and names its LoRA target modules. Two families: the SD3 family (:class:`FlowModel`: SD3, SD3.5 and
flowrl's shipped tiny model) and FLUX.1 (:class:`FluxModel`); :func:`load_model` picks the adapter a
pipeline folder's ``model_index.json`` names. The sampler only ever sees :meth:`FlowModel.velocity_fn`.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from samplers import flow_sigmas

SD3_LORA_TARGETS = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
                    "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out")
"""Flow-GRPO's LoRA targets for SD3 transformers: both streams of every joint attention block."""

FLUX_LORA_TARGETS = SD3_LORA_TARGETS + ("ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2")
"""LoRA targets for FLUX.1 transformers, as diffusers' FLUX LoRA training script: both streams' attention and
feed-forward layers of the dual-stream blocks; the attention suffixes also match the single-stream blocks'
``attn.to_q / to_k / to_v``."""

MIN_ROWS = {torch.nn.Linear: (2, 16), torch.nn.Conv2d: (4, 4)}
"""For each layer type: the input rank that carries one row per sample, and the fewest rows it runs at."""


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


def check_guidance(guidance_scale: float) -> None:
    """Raise ValueError unless the CFG scale ``guidance_scale >= 1`` (1 = no guidance)."""
    if guidance_scale < 1:
        raise ValueError(f"guidance_scale must be >= 1 (1 = no guidance), got {guidance_scale}")


def make_batch_invariant(module: torch.nn.Module, probe: Callable[[], object]) -> int:
    """Make the per-sample layers of `module` give each sample the same bits at any batch size.

    Matrix-product libraries pick a different kernel, with a different summation order, for a product
    of only a few rows: on an AVX-512 CPU, MKL's results for a linear layer on up to 5-10 rows, and
    oneDNN's for a convolution of a single image, differ in the last bits from those of larger batches.
    In an SD3 transformer that hits the conditioning path (timestep and pooled-text embedders and the
    AdaLayerNorm modulation run linear layers on `(N, features)`, one row per sample) and the patch
    embedding (a `Conv2d` on `(N, C, H, W)`). A sample's velocity would then depend on how many samples
    share its forward call, the log-probs recomputed for training (minibatches of any composition)
    would differ from the rollout's (a tree node evaluated with few rows), and the PPO ratio before the
    first optimizer step would not be exactly 1. Zero-padding such inputs up to the row counts of
    :data:`MIN_ROWS` (16 rows for a 2-D linear input, 4 images for a convolution) and dropping the
    padded outputs keeps every call on the large-batch kernel. Only the layers that `probe` shows
    receiving per-sample inputs are padded; the token-wise layers, whose inputs
    `(N, tokens, features)` are large already, get no hook. This is measured, not guaranteed: another
    BLAS or a GPU may switch kernels elsewhere.

    Args:
        module (`torch.nn.Module`): e.g. an `SD3Transformer2DModel`, with or without peft LoRA layers.
        probe (callable): runs one forward of `module` (any batch size); it is called once, under
            `torch.no_grad()`, to see which `torch.nn.Linear` and `torch.nn.Conv2d` layers receive
            inputs of the per-sample rank (2-D for a linear layer, 4-D for a convolution).

    Returns:
        `int`: the number of layers newly padded (a layer already padded is skipped, so calling it again
        after adding an adapter pads only the adapter's per-sample layers).
    """
    rules = {m: rule for m in module.modules() if not hasattr(m, "_flowrl_min_rows")
             for kind, rule in MIN_ROWS.items() if isinstance(m, kind)}  # layer -> (rank, min rows)
    seen: set[torch.nn.Module] = set()

    def record(layer, args):
        if args and torch.is_tensor(args[0]) and args[0].ndim == rules[layer][0]:
            seen.add(layer)

    handles = [m.register_forward_pre_hook(record) for m in rules]
    try:
        with torch.no_grad():
            probe()
    finally:
        for handle in handles:
            handle.remove()
    for layer in seen:
        layer._flowrl_ndim, layer._flowrl_min_rows = rules[layer]
        layer._flowrl_rows = None
        layer.register_forward_pre_hook(_pad_rows)
        layer.register_forward_hook(_unpad_rows)
    return len(seen)


def _pad_rows(layer: torch.nn.Module, args: tuple):
    """Forward pre-hook: zero-pad a per-sample input of fewer than ``layer._flowrl_min_rows`` rows."""
    x = args[0]
    if x.ndim != layer._flowrl_ndim or x.shape[0] >= layer._flowrl_min_rows:
        layer._flowrl_rows = None
        return None
    layer._flowrl_rows = x.shape[0]
    pad = x.new_zeros(layer._flowrl_min_rows - x.shape[0], *x.shape[1:])
    return (torch.cat([x, pad]),) + args[1:]


def _unpad_rows(layer: torch.nn.Module, args: tuple, output: torch.Tensor):
    """Forward hook: drop the rows :func:`_pad_rows` added."""
    rows, layer._flowrl_rows = layer._flowrl_rows, None
    return output if rows is None else output[:rows]


@dataclass
class PromptEmbeds:
    """Encoded prompts: ``embeds (P, T, D)`` and ``pooled (P, D_pooled)`` on the model's device."""

    embeds: torch.Tensor
    pooled: torch.Tensor

    def __getitem__(self, index: torch.Tensor) -> PromptEmbeds:
        """The rows `index` (`(N,)` long) of both tensors: ``(N, T, D)`` and ``(N, D_pooled)``."""
        return PromptEmbeds(self.embeds[index], self.pooled[index])


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


def _dynamic_shift(cfg: dict, where: str | Path, image_tokens: int) -> float:
    """The static shift equal to a FLUX-style scheduler config's schedule at ``image_tokens`` packed latent tokens.

    A dynamic-shifting ``FlowMatchEulerDiscreteScheduler`` maps t to ``exp(mu) / (exp(mu) + 1/t - 1)`` (its exponential
    time shift) with ``mu = calculate_shift(image_tokens, ...)`` (diffusers' FLUX pipeline, linear in the token count
    between ``base_shift`` at ``base_image_seq_len`` and ``max_shift`` at ``max_image_seq_len``); that equals SD3's static
    shift ``s t / (1 + (s - 1) t)`` with ``s = exp(mu)``. A config without dynamic shifting gives its own ``shift``.

    Raises:
        ValueError: naming ``where``, for a linear time shift (no static equivalent) or a shift that is not > 0.
    """
    if not cfg.get("use_dynamic_shifting"):
        return _config_shift(cfg, where)
    if cfg.get("time_shift_type", "exponential") != "exponential":
        raise ValueError(f"{where} has time_shift_type {cfg['time_shift_type']!r}; flowrl supports 'exponential' (FLUX's)")
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift

    mu = calculate_shift(image_tokens, cfg.get("base_image_seq_len", 256), cfg.get("max_image_seq_len", 4096),
                         cfg.get("base_shift", 0.5), cfg.get("max_shift", 1.15))
    return math.exp(mu)


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


def _model_index(path: str | Path) -> dict:
    """The parsed ``model_index.json`` of the pipeline folder ``path`` (FileNotFoundError if there is none)."""
    return json.loads((_pipeline_folder(path) / "model_index.json").read_text())


def model_class(path: str | Path) -> type[FlowModel]:
    """The adapter class for the pipeline folder ``path``, from the ``_class_name`` of its ``model_index.json`` (no
    weights loaded): :class:`FlowModel` for ``StableDiffusion3Pipeline``, :class:`FluxModel` for ``FluxPipeline``.
    Its class methods (``check_resolution``, ``scheduler_shift``, ``default_max_sequence_length``,
    ``check_max_sequence_length``) check a folder and settings before anything loads.

    Raises:
        FileNotFoundError: if ``path`` is not a folder with ``model_index.json``.
        ValueError: naming the file, for any other pipeline class.
    """
    name = _model_index(path).get("_class_name")
    for cls in (FlowModel, FluxModel):
        if cls.PIPELINE == name:
            return cls
    raise ValueError(f"{Path(path) / 'model_index.json'} names pipeline {name!r}; flowrl adapts "
                     f"{FlowModel.PIPELINE} (SD3, SD3.5, the tiny model) and {FluxModel.PIPELINE} (FLUX.1)")


def load_model(path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
               max_sequence_length: int | None = None, resolution: int | None = None) -> FlowModel:
    """Load the pipeline folder ``path`` with the adapter its ``model_index.json`` names (:func:`model_class`); the
    arguments are :class:`FlowModel`'s.

    Raises:
        FileNotFoundError, ValueError: as :func:`model_class` and the adapter's constructor.
    """
    return model_class(path)(path, device, dtype, max_sequence_length, resolution)


class FlowModel:
    """An SD3-family text-to-image flow model (``StableDiffusion3Pipeline`` folder); the base of every adapter
    (:class:`FluxModel`). :func:`load_model` picks the adapter from the folder.

    Args:
        path: a local pipeline folder (``model_index.json`` + subfolders), e.g. ``assets/tiny-sd3`` or a
            downloaded ``stabilityai/stable-diffusion-3.5-medium``.
        device: torch device for every component.
        dtype: dtype of the frozen components (text encoders, VAE); the transformer is kept in float32
            on CPU and in ``dtype`` elsewhere (LoRA parameters are float32 everywhere).
        max_sequence_length: T5 tokens; None: :meth:`default_max_sequence_length` (256 with a T5 encoder, 0 without
            one, as the tiny model, which was trained so).
        resolution: image side in pixels for sampling and evaluation (square images); None for the
            transformer's default (``sample_size`` latents: 64 px for the tiny model, 1024 px for SD3.5-Medium;
            Flow-GRPO trains SD3.5-Medium at 512).

    Raises:
        FileNotFoundError: if ``path`` is not a folder with ``model_index.json``.
        ValueError: for a ``resolution`` that is not a multiple of the VAE factor times the patch size, or
            larger than the transformer's position embedding covers; for a folder of another pipeline class.
    """

    PIPELINE = "StableDiffusion3Pipeline"
    """The diffusers pipeline class this adapter loads (``_class_name`` in ``model_index.json``)."""
    OPTIONAL = ("text_encoder_3", "tokenizer_3", "image_encoder", "feature_extractor")
    """Components a folder may leave out (``null`` in ``model_index.json``)."""
    LORA_TARGETS = SD3_LORA_TARGETS
    SIGMA_SPACING = "sd3"
    """How the stock pipeline spaces its steps (:func:`samplers.flow_sigmas`' ``spacing``)."""

    def __init__(self, path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                 max_sequence_length: int | None = None, resolution: int | None = None):
        import diffusers
        from diffusers.utils import logging as diffusers_logging
        from transformers.utils import logging as transformers_logging

        path = Path(path)
        index = _model_index(path)  # the folder, its pipeline class and resolution are checked before weights load
        if index.get("_class_name") != self.PIPELINE:
            raise ValueError(f"{path / 'model_index.json'} names pipeline {index.get('_class_name')!r}, not "
                             f"{self.PIPELINE}: load it with flowrl.models.load_model")
        self.resolution = self.check_resolution(path, resolution)
        self.max_sequence_length = self._default_length(index) if max_sequence_length is None else max_sequence_length
        self.check_max_sequence_length(self.max_sequence_length)
        kwargs = {name: None for name in self.OPTIONAL if _absent(index, name)}  # optional parts the folder leaves out
        diffusers_logging.disable_progress_bar()
        transformers_logging.disable_progress_bar()
        self.pipe = getattr(diffusers, self.PIPELINE).from_pretrained(path, dtype=dtype, **kwargs).to(device)
        self.pipe.set_progress_bar_config(disable=True)
        self.transformer = self.pipe.transformer
        train_dtype = torch.float32 if torch.device(device).type == "cpu" else dtype
        if self.transformer.dtype != train_dtype:
            self.transformer.to(train_dtype)
        self.transformer.requires_grad_(False)
        for name in ("vae", "text_encoder", "text_encoder_2", "text_encoder_3"):
            if (module := getattr(self.pipe, name, None)) is not None:
                module.requires_grad_(False).eval()
        self.pipe.vae.to(memory_format=torch.channels_last)  # its convolutions run faster so, on CPU as on GPU
        self.device, self.dtype, self.path = torch.device(device), dtype, path
        self.decode_chunk = 32  # latents per VAE decode call (:meth:`decode`)
        make_batch_invariant(self.transformer, self._probe)  # the ratio is exactly 1 before the first optimizer step

    @classmethod
    def default_max_sequence_length(cls, path: str | Path) -> int:
        """The T5 prompt length the pipeline folder ``path`` is used with when none is given, read from its
        ``model_index.json`` (no weights loaded): 256 (diffusers' SD3 default) if it has a T5 text encoder
        (``text_encoder_3``), else 0: without T5, ``encode_prompt`` pads that many zero tokens, which the tiny model
        never saw. Flow-GRPO's SD3.5 recipe sets 128 explicitly.

        Raises:
            FileNotFoundError: if ``path`` is not a folder with ``model_index.json``.
        """
        return cls._default_length(_model_index(path))

    @staticmethod
    def _default_length(index: dict) -> int:
        """:meth:`default_max_sequence_length` of a parsed ``model_index.json``."""
        return 0 if _absent(index, "text_encoder_3") else 256

    @staticmethod
    def check_max_sequence_length(length: int) -> None:
        """Check a T5 prompt length before anything loads (SD3: any ``>= 0``; 0 without T5).

        Raises:
            ValueError: for a length this family cannot take.
        """
        if length < 0:
            raise ValueError(f"max_sequence_length must be >= 0, got {length}")

    @classmethod
    def check_resolution(cls, path: str | Path, resolution: int | None) -> int:
        """The image side in pixels for the pipeline folder ``path``, read from its VAE and transformer configs
        (no weights loaded): ``resolution`` if the model can draw it, else the default.

        Raises:
            FileNotFoundError: if ``path`` is not a folder with ``model_index.json``.
            ValueError: as for the constructor's ``resolution``.
        """
        path = _pipeline_folder(path)
        cfg = json.loads((path / "transformer" / "config.json").read_text())
        factor = _vae_factor(path)
        if resolution is None:
            return cfg["sample_size"] * factor
        unit = factor * cfg.get("patch_size", 2)
        largest = (cfg.get("pos_embed_max_size") or cfg["sample_size"]) * unit
        if resolution < unit or resolution % unit or resolution > largest:
            raise ValueError(f"resolution {resolution} px does not fit the model at {path}: expected a multiple of "
                             f"{unit} (VAE factor {factor} x patch size {cfg.get('patch_size', 2)}) from {unit} to {largest}")
        return resolution

    @classmethod
    def scheduler_shift(cls, path: str | Path, resolution: int | None = None) -> float:
        """The sigma-schedule shift of the pipeline folder ``path``, read from ``scheduler/scheduler_config.json``
        (no weights loaded): 3.0 for Stable Diffusion 3 / 3.5, 1.0 for the shipped tiny model. ``resolution``
        matters only to :class:`FluxModel`, whose shift depends on it.

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
        (:func:`samplers.flow_sigmas` with :attr:`SIGMA_SPACING`), at ``shift`` (None: :attr:`shift`).

        Raises:
            ValueError: as :func:`samplers.flow_sigmas`.
        """
        return flow_sigmas(num_steps, self.shift if shift is None else shift, spacing=self.SIGMA_SPACING)

    @property
    def latent_shape(self) -> tuple[int, int, int]:
        """``(C, H, W)`` of the latents at :attr:`resolution` (``H = W = resolution / vae_scale_factor``)."""
        side = self.resolution // self.pipe.vae_scale_factor  # the check above used the same factor
        return (self.transformer.config.in_channels, side, side)

    @torch.no_grad()
    def encode(self, prompts: list[str]) -> PromptEmbeds:
        """Encode prompts with the pipeline's own ``encode_prompt`` (CLIP-L, CLIP-G and T5 where present).

        Returns:
            :class:`PromptEmbeds` with ``P = len(prompts)`` rows, float32.
        """
        embeds, _, pooled, _ = self.pipe.encode_prompt(
            prompts, prompts, prompts, device=self.device, do_classifier_free_guidance=False,
            max_sequence_length=self.max_sequence_length)
        return PromptEmbeds(embeds.float(), pooled.float())

    def add_lora(self, rank: int, alpha: float, targets: tuple[str, ...] | None = None) -> list[torch.nn.Parameter]:
        """Add a peft LoRA adapter (Gaussian init of A, zero B) to the transformer.

        Returns:
            The trainable LoRA parameters (float32).
        """
        from peft import LoraConfig

        config = LoraConfig(r=rank, lora_alpha=alpha, init_lora_weights="gaussian",
                            target_modules=list(targets or self.LORA_TARGETS))
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

    def velocity(self, x: torch.Tensor, t: torch.Tensor, cond: PromptEmbeds, uncond: PromptEmbeds | None,
                 guidance_scale: float) -> torch.Tensor:
        """Velocity with classifier-free guidance: v = v_u + w (v_c - v_u) (one batched forward).

        Args:
            x: latents ``(N, C, H, W)``; t: ``(N,)`` times in [0, 1] (1 = noise).
            cond: ``N`` prompt embeddings; uncond: ``N`` empty-prompt embeddings, or None when w = 1.
            guidance_scale: w >= 1.

        Returns:
            float32 ``(N, C, H, W)``.

        Raises:
            ValueError: if ``guidance_scale < 1``.
        """
        check_guidance(guidance_scale)
        dtype = next(self.transformer.parameters()).dtype
        if uncond is None or guidance_scale == 1.0:
            return self._forward(x, t, cond, dtype).float()
        both = PromptEmbeds(torch.cat([uncond.embeds, cond.embeds]), torch.cat([uncond.pooled, cond.pooled]))
        v_u, v_c = self._forward(torch.cat([x, x]), torch.cat([t, t]), both, dtype).float().chunk(2)
        return v_u + guidance_scale * (v_c - v_u)

    def _probe(self) -> None:
        """One forward of the transformer on one sample (for :func:`make_batch_invariant`)."""
        cond = self.encode([""])
        x = torch.zeros(1, *self.latent_shape, device=self.device)
        self._forward(x, torch.ones(1, device=self.device), cond, next(self.transformer.parameters()).dtype)

    def _forward(self, x, t, cond: PromptEmbeds, dtype) -> torch.Tensor:
        return self.transformer(hidden_states=x.to(dtype), encoder_hidden_states=cond.embeds.to(dtype),
                                pooled_projections=cond.pooled.to(dtype), timestep=t * 1000,
                                return_dict=False)[0]

    def cfg_rows(self, guidance_scale: float) -> int:
        """Transformer rows one velocity evaluation costs per sample (the ``cost/nfe`` unit): 2 under CFG
        (conditional and unconditional, as :meth:`velocity_fn` batches them), 1 at ``guidance_scale == 1``."""
        return 2 if guidance_scale != 1.0 else 1

    def velocity_fn(self, table: PromptEmbeds, guidance_scale: float):
        """A :class:`samplers.VelocityFn` ``fn(x (N, C, H, W), t (N,), cond (N,) long) -> (N, C, H, W)`` float32 over
        a table of prompts: ``cond`` indexes ``table``, whose row 0 must be the empty prompt (the CFG negative).

        Raises:
            ValueError: if ``guidance_scale < 1``.
        """
        check_guidance(guidance_scale)

        def fn(x: torch.Tensor, t: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
            uncond = table[torch.zeros_like(cond)] if guidance_scale != 1.0 else None
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

    def save_lora(self, directory: str | Path) -> None:
        """Write the LoRA in diffusers' format (``pytorch_lora_weights.safetensors``), loadable by the stock
        pipeline's ``load_lora_weights(directory)`` (``StableDiffusion3Pipeline``, ``FluxPipeline``)."""
        from peft.utils import get_peft_model_state_dict

        state = get_peft_model_state_dict(self.transformer)
        metadata = self.transformer.peft_config["default"].to_dict()  # carries lora_alpha: without it alpha = rank
        type(self.pipe).save_lora_weights(directory, transformer_lora_layers=state,
                                          transformer_lora_adapter_metadata=metadata)

    def save_pipeline(self, directory: str | Path) -> None:
        """Write the whole pipeline, with the transformer as it is now (float32 on CPU), as a diffusers
        folder of safetensors: what full fine-tuning (``model.lora_rank=0``) leaves, loadable by
        ``flowrl eval --model directory`` and ``StableDiffusion3Pipeline.from_pretrained(directory)``.
        For SD3.5-Medium that is the text encoders and the VAE too, several GB."""
        from diffusers.utils import logging as diffusers_logging

        verbosity = diffusers_logging.get_verbosity()
        diffusers_logging.set_verbosity_error()  # not the warning for each absent optional part (T5)
        try:
            self.pipe.save_pretrained(directory, safe_serialization=True)
        finally:
            diffusers_logging.set_verbosity(verbosity)

    def load_lora(self, directory: str | Path) -> None:
        """Load a diffusers-format LoRA folder into the transformer (as the default adapter).

        Raises:
            FileNotFoundError: if the folder has no ``pytorch_lora_weights.safetensors``.
        """
        if not (Path(directory) / "pytorch_lora_weights.safetensors").is_file():
            raise FileNotFoundError(f"LoRA folder {directory} has no pytorch_lora_weights.safetensors")
        self.pipe.load_lora_weights(str(directory))


class FluxModel(FlowModel):
    """A FLUX.1 text-to-image flow model (``FluxPipeline`` folder: FLUX.1-dev, FLUX.1-schnell or a small one), with
    :class:`FlowModel`'s interface; the samplers and the trainer see no difference.

    What the adapter does differently, all inside it:

    - Latents stay ``(B, C, H, W)`` (``C`` the VAE's latent channels, 16 for FLUX.1) for the samplers; :meth:`velocity`
      packs them into FLUX's tokens of 2x2 latent patches, with the pipeline's own ``_pack_latents``,
      ``_prepare_latent_image_ids`` and ``_unpack_latents``, and unpacks the prediction.
    - Guidance: a guidance-distilled transformer (``guidance_embeds``, FLUX.1-dev) takes the guidance scale as an
      input (one forward per sample, :meth:`cfg_rows` 1, the empty prompt unused), as ``FluxPipeline(guidance_scale=)``;
      one without it (FLUX.1-schnell) gets classifier-free guidance with the empty prompt, as SD3.
    - Prompts: CLIP-L's pooled output and ``max_sequence_length`` T5 tokens (default 512, as ``FluxPipeline``; at least 1).
    - Schedule: FLUX's scheduler shifts dynamically, by ``exp(mu)`` with ``mu`` linear in the number of image tokens,
      which equals SD3's static shift ``exp(mu)`` (:func:`_dynamic_shift`): 3.16 at 1024 px, 1.92 at 512 px; the
      steps are spaced as ``FluxPipeline`` spaces them (:meth:`sigmas`: ``linspace(1, 1/N, N)`` shifted, then 0), so
      the adapter's ODE sampling gives the stock pipeline's images (a test checks it).
    - Resolution: any multiple of 16 px (VAE factor 8 x the 2x2 packing; FLUX's rotary position embedding has no
      largest size); the default is ``FluxPipeline``'s 128 latents (1024 px).

    Args, Raises: as :class:`FlowModel`; ``ValueError`` also for ``max_sequence_length < 1``.
    """

    PIPELINE = "FluxPipeline"
    OPTIONAL = ("image_encoder", "feature_extractor")
    LORA_TARGETS = FLUX_LORA_TARGETS
    SIGMA_SPACING = "flux"
    DEFAULT_SAMPLE_SIZE = 128
    """Latents per image side when no resolution is given (``FluxPipeline.default_sample_size``)."""

    @staticmethod
    def _default_length(index: dict) -> int:
        return 512  # FluxPipeline's default; FLUX.1-schnell was trained with 256

    @staticmethod
    def check_max_sequence_length(length: int) -> None:
        """Raise ValueError for a T5 prompt length below 1 (FLUX's T5 tokens condition every block)."""
        if length < 1:
            raise ValueError(f"max_sequence_length must be >= 1 for FLUX (its T5 tokens condition every block), got {length}")

    @classmethod
    def check_resolution(cls, path: str | Path, resolution: int | None) -> int:
        """As :meth:`FlowModel.check_resolution`: ``resolution``, or ``DEFAULT_SAMPLE_SIZE`` latents x the VAE factor.

        Raises:
            FileNotFoundError: if ``path`` is not a folder with ``model_index.json``.
            ValueError: for a resolution that is not a positive multiple of the VAE factor x 2.
        """
        path = _pipeline_folder(path)
        factor = _vae_factor(path)
        if resolution is None:
            return cls.DEFAULT_SAMPLE_SIZE * factor
        unit = factor * 2  # 2x2 latent patches per token
        if resolution < unit or resolution % unit:
            raise ValueError(f"resolution {resolution} px does not fit the model at {path}: expected a multiple of "
                             f"{unit} (VAE factor {factor} x FLUX's 2x2 latent packing)")
        return resolution

    @classmethod
    def scheduler_shift(cls, path: str | Path, resolution: int | None = None) -> float:
        """The static shift equal to the folder's scheduler at ``resolution`` px (default: :meth:`check_resolution`'s),
        read without loading weights (:func:`_dynamic_shift`): 3.16 for FLUX.1 at 1024 px, 1.92 at 512 px.

        Raises:
            FileNotFoundError: if ``path`` is not a pipeline folder or has no scheduler config.
            ValueError: for a resolution the model cannot take, or a scheduler as :func:`_dynamic_shift` refuses.
        """
        file = _scheduler_file(path)
        tokens = cls._image_tokens(cls.check_resolution(path, resolution), _vae_factor(Path(path)))
        return _dynamic_shift(json.loads(file.read_text()), file, tokens)

    @property
    def shift(self) -> float:
        """:meth:`scheduler_shift` of the loaded scheduler at the model's :attr:`resolution`."""
        tokens = self._image_tokens(self.resolution, self.pipe.vae_scale_factor)
        return _dynamic_shift(dict(self.pipe.scheduler.config), Path(self.path) / "scheduler", tokens)

    @staticmethod
    def _image_tokens(resolution: int, vae_factor: int) -> int:
        """Packed image tokens of a square ``resolution`` px image: one per 2x2 latent patch."""
        return (resolution // (2 * vae_factor)) ** 2

    @property
    def latent_shape(self) -> tuple[int, int, int]:
        """``(C, H, W)`` of the unpacked latents: the VAE's latent channels, ``H = W = resolution / vae_scale_factor``."""
        side = self.resolution // self.pipe.vae_scale_factor
        return (self.pipe.vae.config.latent_channels, side, side)

    @property
    def guidance_embeds(self) -> bool:
        """Whether the transformer is guidance-distilled (takes the guidance scale as an input, FLUX.1-dev)."""
        return bool(self.transformer.config.guidance_embeds)

    @torch.no_grad()
    def encode(self, prompts: list[str]) -> PromptEmbeds:
        """Encode prompts with ``FluxPipeline.encode_prompt``: T5 tokens ``(P, max_sequence_length, D_t5)`` and CLIP-L's
        pooled output ``(P, D_clip)``, float32."""
        embeds, pooled, _ = self.pipe.encode_prompt(prompts, prompts, device=self.device,
                                                    max_sequence_length=self.max_sequence_length)
        return PromptEmbeds(embeds.float(), pooled.float())

    def velocity(self, x: torch.Tensor, t: torch.Tensor, cond: PromptEmbeds, uncond: PromptEmbeds | None,
                 guidance_scale: float) -> torch.Tensor:
        """Velocity ``(N, C, H, W)`` float32 of latents ``x (N, C, H, W)`` at times ``t (N,)`` in [0, 1]: with the
        guidance scale as the transformer's input if it is guidance-distilled (``uncond`` unused), else with
        classifier-free guidance as :meth:`FlowModel.velocity`.

        Raises:
            ValueError: if ``guidance_scale < 1``.
        """
        if not self.guidance_embeds:
            return super().velocity(x, t, cond, uncond, guidance_scale)
        check_guidance(guidance_scale)
        return self._forward(x, t, cond, next(self.transformer.parameters()).dtype, guidance_scale).float()

    def cfg_rows(self, guidance_scale: float) -> int:
        """Transformer rows per sample and velocity: 1 for a guidance-distilled transformer, else as SD3's."""
        return 1 if self.guidance_embeds else super().cfg_rows(guidance_scale)

    def _forward(self, x, t, cond: PromptEmbeds, dtype, guidance: float = 1.0) -> torch.Tensor:
        n, c, h, w = x.shape
        pipe = self.pipe
        tokens = pipe._pack_latents(x.to(dtype).contiguous(), n, c, h, w)  # (N, h/2 * w/2, 4C); it views its input
        img_ids = pipe._prepare_latent_image_ids(n, h // 2, w // 2, x.device, dtype)
        txt_ids = torch.zeros(cond.embeds.shape[1], 3, device=x.device, dtype=dtype)
        g = torch.full((n,), float(guidance), device=x.device) if self.guidance_embeds else None
        out = self.transformer(hidden_states=tokens, timestep=t.to(dtype), guidance=g,
                               pooled_projections=cond.pooled.to(dtype), encoder_hidden_states=cond.embeds.to(dtype),
                               txt_ids=txt_ids, img_ids=img_ids, return_dict=False)[0]
        factor = pipe.vae_scale_factor
        return pipe._unpack_latents(out, h * factor, w * factor, factor)
