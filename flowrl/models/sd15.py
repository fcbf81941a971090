"""The Stable Diffusion 1.x / 2.x family (``StableDiffusionPipeline``): a variance-preserving UNet seen as a flow model.

The samplers speak in flow time ``sigma`` and velocity. :mod:`samplers.ddim` shows that with
``sigma = sqrt(1 - a) / (sqrt(a) + sqrt(1 - a))`` and ``x_flow = x / (sqrt(a) + sqrt(1 - a))`` (``a`` =
``alphas_cumprod``) DDIM with noise ``eta`` is the ``"ddim"`` kernel and deterministic DDIM is the flow Euler step
(``"ode"``), when the adapter returns the velocity ``v = eps_hat - x0_hat`` of the UNet's epsilon or v prediction.
So this adapter provides:

- :meth:`SD15Model.sigmas`: the flow times of the timesteps ``DDIMScheduler.set_timesteps`` picks from the folder's
  scheduler config (``timestep_spacing``, ``steps_offset`` as the stock pipeline), then of ``final_alpha_cumprod``;
- :meth:`SD15Model._forward`: flow time -> timestep (exact on the training grid, linear in between), the UNet on
  ``s x_flow``, its prediction -> velocity (:func:`samplers.flow_velocity`); CFG on ``v`` equals CFG on ``eps``
  (``v`` is affine in it);
- the two ends: unit noise is the state at the first timestep (the samplers' callers apply
  :func:`samplers.start_latents`, the identity on flow schedules), and :meth:`SD15Model.decode` decodes the state at
  ``final_alpha_cumprod`` as the stock pipeline does (``x = s(a_N) x_flow``).

Where diffusers' DDIM steps to ``t - T // N`` but evaluates the next step at another timestep (``timestep_spacing``
``linspace``, or ``trailing`` with ``N`` not dividing ``T``), flowrl steps to the timestep it evaluates next (one
grid, consistent DDIM); with ``leading`` (SD 1.x) and ``trailing`` with ``N | T`` the two are the same.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..fields import ConfigError, config_key
from ..files import resolve_path
from ..samplers import flow_sigma, flow_velocity, vp_scale
from .base import FlowModel, PromptEmbeds, _scheduler_file, _vae_factor, register_family

SD15_LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0")
"""The UNet's attention projections (self- and cross-attention), as DDPO and diffusers' SD LoRA training adapt."""


def _check_scheduler(cfg: dict, where) -> None:
    """Refuse scheduler settings the flow kernels cannot follow (ValueError naming the file and the key)."""
    if cfg.get("clip_sample") or cfg.get("thresholding"):
        key = "clip_sample" if cfg.get("clip_sample") else "thresholding"
        raise ValueError(f"{where} sets {key}: true; flowrl's DDIM kernels do not clip x0_hat (set it false)")
    if cfg.get("prediction_type", "epsilon") not in ("epsilon", "v_prediction"):
        raise ValueError(
            f"{where} has prediction_type {cfg.get('prediction_type')!r}; SD 1.x/2.x UNets predict "
            "'epsilon' or 'v_prediction'"
        )


@register_family
class SD15Model(FlowModel):
    """A Stable Diffusion 1.x / 2.x text-to-image UNet (``StableDiffusionPipeline`` folder), sampled and trained as a
    flow model through the change of variables of :mod:`samplers.ddim`.

    Prompts: the CLIP text encoder's last hidden states (the tokenizer's ``model_max_length`` tokens; no pooled
    embedding). Prediction: ``epsilon`` or ``v_prediction``, from the scheduler config. :attr:`transformer` is the
    UNet (the trained network, :attr:`NETWORK`). Resolution: a multiple of the VAE factor x the UNet's
    downsampling; default ``sample_size`` latents (512 px for SD 1.5).

    Args, Raises: as :class:`FlowModel`; also ValueError for a scheduler that clips or thresholds ``x0_hat``.
    """

    PIPELINE = "StableDiffusionPipeline"
    """The diffusers pipeline class this adapter loads (``_class_name`` in ``model_index.json``)."""
    OPTIONAL = ("safety_checker", "feature_extractor", "image_encoder")
    """Components a folder may leave out (``null`` in ``model_index.json``)."""
    LORA_TARGETS = SD15_LORA_TARGETS
    NETWORK = "unet"
    """The trained component: the UNet, held as :attr:`transformer`."""
    FAMILY = "SD 1.x"
    PROMPT_LENGTH = (0, 0)
    PROMPT_RULE = "CLIP encodes prompts at the tokenizer's length: leave it unset"
    FORWARD_PROCESS = False
    """The samples end at ``final_alpha_cumprod`` and the times at the largest training timestep, not at the flow's
    ``x_0`` and ``t = 1``: the forward-process methods are refused (:func:`flowrl.pairing.check_pairing`)."""

    def __init__(self, path, device="cpu", dtype=torch.float32, max_sequence_length=None, resolution=None, **options):
        from diffusers import DDIMScheduler

        file = _scheduler_file(path)
        config = json.loads(file.read_text())
        _check_scheduler(config, file)
        self.ddim = DDIMScheduler.from_config(config)  # the stock DDIM grid only; never stepped
        self.prediction_type = self.ddim.config.prediction_type
        self._table = flow_sigma(self.ddim.alphas_cumprod.double()).float()  # (T,) CPU, increasing in the timestep
        self.final_sigma = float(flow_sigma(self.ddim.final_alpha_cumprod.double().reshape(1)).float())
        super().__init__(path, device, dtype, max_sequence_length, resolution, **options)  # probes the UNet

    # ------------------------------------------------------------------------------ folder checks
    @staticmethod
    def _default_length(index: dict) -> int:
        """0: SD 1.x prompts are the tokenizer's ``model_max_length`` tokens, not a T5 length."""
        return 0

    @classmethod
    def _resolution_grid(cls, path: Path) -> tuple[int, int, int | None, str]:
        """Default ``sample_size`` latents; any multiple of the VAE factor x the UNet's downsampling
        ``2^(blocks - 1)``."""
        cfg = json.loads((path / "unet" / "config.json").read_text())
        factor = _vae_factor(path)
        unit = factor * 2 ** (len(cfg["block_out_channels"]) - 1)
        return cfg["sample_size"] * factor, unit, None, f"VAE factor {factor} x UNet downsampling {unit // factor}"

    @classmethod
    def scheduler_shift(cls, path: str | Path, resolution: int | None = None) -> float:
        """1.0: the DDPM schedule has no shift (its grid is the scheduler's timesteps).

        Raises:
            FileNotFoundError: if ``path`` has no scheduler config.
        """
        _scheduler_file(path)
        return 1.0

    @property
    def shift(self) -> float:
        """1.0 (see :meth:`scheduler_shift`)."""
        return 1.0

    @classmethod
    def check_config(cls, cfg) -> None:
        """Refuse what the flow-variable mapping does not cover, naming the key: MixGRPO-Flash / BranchGRPO-Flash
        re-spacing (``sampling.window.flash_ratio``, ``sampling.tree.flash_ratio``: a shifted flow schedule ending at
        ``sigma = 0``), a ``sampling.shift`` other than 1, and (``model.path``) a scheduler config that clips or
        thresholds ``x0_hat`` or predicts ``sample``. The forward-process methods (DiffusionNFT, AWM, DGPO,
        Diffusion-DPO, CRD, SFT) are refused by :attr:`FORWARD_PROCESS`.

        Raises:
            flowrl.fields.ConfigError: naming the key.
        """
        super().check_config(cfg)  # the family's options (SDXL's guidance_rescale)
        file = _scheduler_file(resolve_path(cfg.model.path))
        with config_key("model.path"):
            _check_scheduler(json.loads(file.read_text()), file)
        where = f"model.path {cfg.model.path} is a {cls.PIPELINE} (DDPM)"
        for key, value in (
            ("sampling.window.flash_ratio", cfg.sampling.window.flash_ratio),
            ("sampling.tree.flash_ratio", cfg.sampling.tree.flash_ratio),
        ):
            if value > 0:
                raise ConfigError(f"config key '{key}': Flash re-spacing is a flow-matching schedule; {where}: set 0")
        if cfg.sampling.shift not in (None, 1.0):
            raise ConfigError(f"config key 'sampling.shift': {where}, whose schedule has no shift; set it null or 1")

    # ------------------------------------------------------------------------------ schedule and ends
    def sigmas(self, num_steps: int, shift: float | None = None) -> torch.Tensor:
        """The flow times ``(num_steps + 1,)`` float32 (CPU) of the stock pipeline's DDIM grid: ``flow_sigma(a)`` of
        each timestep ``DDIMScheduler.set_timesteps(num_steps)`` picks, then of ``final_alpha_cumprod`` (0 if the
        scheduler sets alpha to one; ``sigma_N = 0.0292`` for SD 1.5, whose last step lands on ``alphas_cumprod[0]``).

        Raises:
            ValueError: if ``num_steps < 1``, or ``shift`` is not None or 1.
        """
        if num_steps < 1:
            raise ValueError(f"num_steps must be >= 1; got {num_steps}")
        if shift not in (None, 1.0):
            raise ValueError(f"the DDPM schedule of {self.path} has no shift; got shift={shift} (use None or 1)")
        self.ddim.set_timesteps(num_steps)
        timesteps = self.ddim.timesteps.long()  # (N,) decreasing
        return torch.cat([self._table[timesteps], torch.tensor([self.final_sigma])])  # (N + 1,)

    def timesteps(self, t: torch.Tensor) -> torch.Tensor:
        """The UNet timestep of flow times ``t`` `(N,)` float32: the training timestep whose ``flow_sigma`` it is
        (exact on the grid of :meth:`sigmas`), linear in ``sigma`` between two, clamped to ``[0, T - 1]``.

        Returns:
            `torch.Tensor` of shape `(N,)`, float32.
        """
        table = self._table.to(t.device).double()  # (T,)
        t = t.double().clamp(float(table[0]), float(table[-1]))
        hi = torch.searchsorted(table, t).clamp(1, table.shape[0] - 1)  # (N,) first entry >= t
        lo = hi - 1
        weight = (t - table[lo]) / (table[hi] - table[lo])  # 1.0 exactly on a grid point
        return (lo.double() + weight).float()

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Decode the flow state at the grid's last time ``sigma_N`` to images float32 ``(B, 3, H*f, W*f)`` in
        [0, 1]: the stock pipeline decodes the VP state ``s(a_N) x_flow`` (:meth:`FlowModel.decode`)."""
        return FlowModel.decode.__wrapped__(self, latents * float(vp_scale(torch.tensor(self.final_sigma))))

    def decode_with_grad(self, latents: torch.Tensor, clean: bool = False) -> torch.Tensor:
        """:meth:`FlowModel.decode_with_grad`: clean latents (time 0, where the VP state is the flow state) decoded as
        they are, the sampler's final states as :meth:`decode` does."""
        return FlowModel.decode.__wrapped__(self, latents) if clean else super().decode_with_grad(latents)

    # ------------------------------------------------------------------------------ prompts and forward
    @property
    def latent_shape(self) -> tuple[int, int, int]:
        """``(C, H, W)`` of the latents at :attr:`resolution` (``H = W = resolution / vae_scale_factor``)."""
        side = self.resolution // self.pipe.vae_scale_factor
        return (self.transformer.config.in_channels, side, side)

    @torch.no_grad()
    def encode(self, prompts: list[str]) -> PromptEmbeds:
        """Encode prompts with the pipeline's own ``encode_prompt`` (CLIP, padded to ``model_max_length``).

        Returns:
            :class:`PromptEmbeds` with ``P = len(prompts)`` rows: ``embeds (P, 77, D)`` float32 and an empty
            ``pooled (P, 0)`` (SD 1.x has none).
        """
        embeds, _ = self.pipe.encode_prompt(prompts, self.device, 1, do_classifier_free_guidance=False)
        return PromptEmbeds(embeds.float(), embeds.new_zeros(len(prompts), 0).float())

    def _forward(self, x, t, cond: PromptEmbeds, dtype) -> torch.Tensor:
        """The UNet on the VP state ``s(t) x`` at the timestep of ``t``; its prediction as a flow velocity
        ``(N, C, H, W)`` float32. Times above the largest training time are evaluated at it."""
        t = self._clamp(t)  # (N,)
        return flow_velocity(x, self._predict(x, t, cond, dtype), t, self.prediction_type)

    def _clamp(self, t: torch.Tensor) -> torch.Tensor:
        """Flow times ``t`` `(N,)` as float32 within the training grid ``[sigma(a_0), sigma(a_{T-1})]``."""
        return t.float().clamp(float(self._table[0]), float(self._table[-1]))

    def _predict(self, x, t, cond: PromptEmbeds, dtype) -> torch.Tensor:
        """The UNet's own output (epsilon or v, ``(N, C, H, W)`` in ``dtype``) on the VP state ``s(t) x`` at the
        timestep of the (clamped) flow times ``t`` `(N,)`, conditioned by :meth:`_conditions`."""
        scale = vp_scale(t).reshape(-1, *([1] * (x.ndim - 1)))  # (N, 1, 1, 1)
        return self.network()(
            sample=(x.float() * scale).to(dtype),
            timestep=self.timesteps(t),
            return_dict=False,
            **self._conditions(cond, dtype),
        )[0]

    def _conditions(self, cond: PromptEmbeds, dtype) -> dict:
        """The UNet's prompt inputs: ``encoder_hidden_states`` ``(N, 77, D)`` in ``dtype``."""
        return {"encoder_hidden_states": cond.embeds.to(dtype)}

    def _probe(self) -> None:
        """One forward of the UNet on one sample at the largest training time (for :func:`make_batch_invariant`)."""
        cond = self.encode([""])
        x = torch.zeros(1, *self.latent_shape, device=self.device)
        self._forward(x, self._table[-1:].to(self.device), cond, next(self.transformer.parameters()).dtype)

    def save_lora(self, directory: str | Path, weights: dict[str, torch.Tensor] | None = None) -> None:
        """Write the UNet LoRA in diffusers' format (``pytorch_lora_weights.safetensors``, keys ``unet.*``), loadable by
        the stock pipeline's ``load_lora_weights(directory)`` (``StableDiffusionPipeline``,
        ``StableDiffusionXLPipeline``); ``weights``: as :meth:`FlowModel.lora_state`."""
        state = self.lora_state(weights)
        metadata = self.transformer.peft_config["default"].to_dict()  # carries lora_alpha
        type(self.pipe).save_lora_weights(directory, unet_lora_layers=state, unet_lora_adapter_metadata=metadata)
