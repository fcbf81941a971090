"""The SANA family (``SanaPipeline``: SANA, arXiv 2410.10629, and SANA 1.5) and its few-step distillation
(``SanaSprintPipeline``: SANA-Sprint, arXiv 2503.09641), and small ones.

Reference implementation: diffusers ``pipelines/sana/pipeline_sana.py`` (``SanaPipeline``),
``pipelines/sana/pipeline_sana_sprint.py`` (``SanaSprintPipeline``), ``schedulers/scheduling_scm.py``
(``SCMScheduler``), ``models/transformers/sana_transformer.py`` (``SanaTransformer2DModel``: a linear-attention DiT
with cross-attention to a Gemma2 text encoder's last hidden states) and ``models/autoencoders/autoencoder_dc.py``
(``AutoencoderDC``, the 32x deep-compression VAE); the adapter calls them.
Notation (code -> pipeline): ``t`` (flowrl's time, 1 = noise) -> SANA's flow sigma (the transformer's ``timestep``
is ``1000 t x timestep_scale``); for Sprint, ``t`` -> ``scm_timestep = sin(s) / (sin(s) + cos(s))`` of the SCM
scheduler's TrigFlow angle ``s``, latents ``x`` -> ``latents / (sigma_data (sin s + cos s))`` (the pipeline's
``latent_model_input``), ``v`` -> the transformer's raw output (before the pipeline's TrigFlow conversion) and ``w`` ->
``guidance_scale`` (both pipelines: SANA's CFG ``v_u + w (v_c - v_u)``, Sprint's embedded ``guidance``).
"""

from __future__ import annotations

import inspect
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from .base import FlowModel, PromptEmbeds, _scheduler_file, check_guidance, register_family
from .wan import wan_scheduler_shift

SANA_LORA_TARGETS = (
    "attn1.to_q",
    "attn1.to_k",
    "attn1.to_v",
    "attn1.to_out.0",
    "attn2.to_q",
    "attn2.to_k",
    "attn2.to_v",
    "attn2.to_out.0",
)
"""LoRA targets for SANA transformers, cosmos-rl's SANA recipes (github.com/nvidia-cosmos/cosmos-rl,
``configs/sana/sana-image-nft.toml`` and ``sana-image-sft-lora.toml``, ``target_modules``; diffusers'
``SanaTransformerBlock`` names): the projections of the linear self-attention (``attn1``) and of the cross-attention to
the text (``attn2``) of every block. The GLUMBConv feed-forward convolutions are not adapted."""

RESOLUTION_UNIT = 32
"""Pixels both ``SanaPipeline`` and ``SanaSprintPipeline`` require each side to be a multiple of (``check_inputs``)."""


@dataclass
class SanaPromptEmbeds(PromptEmbeds):
    """Gemma2 prompt embeddings: ``embeds (P, T, D)`` float32 (``T = max_sequence_length``, padded on the right), their
    padding ``mask (P, T)`` long (1 for a token, 0 for padding; the transformer's ``encoder_attention_mask``) and
    ``pooled``, an empty ``(P, 0)`` (SANA has no pooled embedding)."""

    mask: torch.Tensor = None


def _dc_vae_factor(path: Path) -> int:
    """The ``AutoencoderDC``'s spatial factor of the pipeline folder ``path`` (the pipelines' ``vae_scale_factor``:
    ``2 ** (len(encoder_block_out_channels) - 1)``, 32 for SANA's DC-AE f32)."""
    return 2 ** (len(json.loads((path / "vae" / "config.json").read_text())["encoder_block_out_channels"]) - 1)


def sana_scheduler_shift(cfg: dict, where: str | Path) -> float:
    """The flow shift of a SANA folder's scheduler config: ``flow_shift`` of the ``DPMSolverMultistepScheduler`` SANA
    ships (``prediction_type`` ``flow_prediction`` with ``use_flow_sigmas``: 3.0 for the 1024 px models), or ``shift``
    of a ``FlowMatchEulerDiscreteScheduler``. flowrl samples with its own kernels on the flow-matching Euler
    scheduler's sigmas at that shift (:meth:`SanaModel.sigmas`).

    Raises:
        ValueError: naming ``where``, for a DPM-Solver without flow sigmas or flow prediction, a dynamic shift, or a
            shift that is not a number > 0.
    """
    if "flow_shift" in cfg and not (cfg.get("use_flow_sigmas") and cfg.get("prediction_type") == "flow_prediction"):
        raise ValueError(
            f"{where} is a {cfg.get('_class_name', 'scheduler')} without use_flow_sigmas and prediction_type "
            f"'flow_prediction' (got {cfg.get('prediction_type')!r}): not a flow-matching schedule"
        )
    return wan_scheduler_shift(cfg, where)


@register_family
class SanaModel(FlowModel):
    """A SANA text-to-image flow model (``SanaPipeline`` folder: SANA 0.6B / 1.6B, SANA 1.5 or a small one), with
    :class:`FlowModel`'s interface; the samplers and the trainer see no difference.

    What the adapter does differently, all inside it:

    - Prompts: ``SanaPipeline.encode_prompt`` with the pipeline's complex human instruction (the default of its
      ``__call__``'s ``complex_human_instruction``, :attr:`instruction`) prepended to each lower-cased prompt, the
      Gemma2 text encoder's last hidden states at ``max_sequence_length`` tokens (default 300, as the pipeline: the
      BOS token and the last ``L - 1`` tokens of instruction and prompt) and their padding mask, given to the
      transformer as ``encoder_attention_mask`` (:class:`SanaPromptEmbeds`). The empty prompt, the CFG negative, is
      encoded without the instruction, as the pipeline encodes its ``negative_prompt``: a training prompt ``""`` is
      therefore the stock negative, not the instruction with nothing after it.
    - Latents stay ``(C, H, W)`` (32 channels for the DC-AE); the transformer takes them as they are, with time
      ``1000 t x timestep_scale``, and predicts the flow velocity; a learned-sigma output (twice the channels) is cut
      to its first half, as the pipeline does.
    - Guidance: classifier-free, ``v_u + w (v_c - v_u)`` against the empty prompt (:meth:`FlowModel.velocity`, the
      pipeline's own formula).
    - Schedule: SANA ships a DPM-Solver++ (2M) with flow sigmas; flowrl's samplers are Euler / SDE steps, so the
      schedule is the flow-matching Euler scheduler's at the folder's ``flow_shift`` (:func:`sana_scheduler_shift`;
      SANA's own code samples with ``flow_euler`` at that shift too): ODE sampling equals ``SanaPipeline`` with its
      scheduler replaced by ``FlowMatchEulerDiscreteScheduler(shift=flow_shift)`` (a test checks it within 1e-4), not
      the stock DPM-Solver's images.
    - Decoding: ``vae.decode(z / scaling_factor)`` (the DC-AE has no shift factor, :meth:`decode`). Its inverse, which
      the offline and direct-reward methods need, is not built for this family.
    - Resolution: any multiple of 32 px (the pipelines' check) and of the VAE factor x the patch size; the default is
      the transformer's ``sample_size`` latents a side (1024 px for the 1024 px models). flowrl samples at
      ``model.resolution`` itself: the stock pipeline's ``use_resolution_binning`` (on by default) would draw at its
      aspect-ratio bin (1024 px square for a 1024 px model) and resize; the two agree at the bin sizes.

    Args, Raises: as :class:`FlowModel`; ValueError also for ``max_sequence_length < 3``.
    """

    PIPELINE = "SanaPipeline"
    FAMILY = "SANA"
    LORA_TARGETS = SANA_LORA_TARGETS
    PROMPT_LENGTH = (3, None)
    PROMPT_RULE = "the pipeline keeps L - 2 prompt tokens after its instruction"
    SIGMA_SPACING = "sd3"
    """The flow-matching Euler scheduler's spacing (:func:`samplers.flow_sigmas`)."""
    _ENCODE_KWARGS = {"do_classifier_free_guidance": False}
    """Extra keyword arguments of the pipeline's ``encode_prompt`` (the negative is encoded by :meth:`encode`)."""

    @staticmethod
    def _default_length(index: dict) -> int:
        return 300  # the pipelines' max_sequence_length

    @classmethod
    def _resolution_grid(cls, path: Path) -> tuple[int, int, int | None, str]:
        """Default ``sample_size`` latents a side; any multiple of 32 px and of the VAE factor x the patch size (the
        transformer has no position embedding, or recomputes its sin-cos one at any size: no largest side)."""
        factor = _dc_vae_factor(path)
        config = json.loads((path / "transformer" / "config.json").read_text())
        patch = config.get("patch_size", 1)
        unit = math.lcm(RESOLUTION_UNIT, factor * patch)
        why = f"the pipeline's {RESOLUTION_UNIT} px and VAE factor {factor} x patch {patch}"
        return config.get("sample_size", 32) * factor, unit, None, why

    @classmethod
    def scheduler_shift(cls, path: str | Path, resolution: int | None = None) -> float:
        """The folder's flow shift (:func:`sana_scheduler_shift`), read without loading weights.

        Raises:
            FileNotFoundError: if ``path`` has no scheduler config. ValueError: as :func:`sana_scheduler_shift`.
        """
        file = _scheduler_file(path)
        return sana_scheduler_shift(json.loads(file.read_text()), file)

    @property
    def shift(self) -> float:
        """:meth:`scheduler_shift` of the loaded scheduler."""
        return sana_scheduler_shift(dict(self.pipe.scheduler.config), Path(self.path) / "scheduler")

    @property
    def latent_shape(self) -> tuple[int, int, int]:
        """``(C, H, W)``: the transformer's ``in_channels`` (32 for SANA), ``H = W = resolution / vae_scale_factor``."""
        side = self.resolution // self.pipe.vae_scale_factor
        return (self.transformer.config.in_channels, side, side)

    @property
    def instruction(self) -> list[str]:
        """The pipeline's complex human instruction: the default of its ``__call__``'s ``complex_human_instruction``
        (lines joined by newlines and prepended to each prompt)."""
        return list(inspect.signature(type(self.pipe).__call__).parameters["complex_human_instruction"].default)

    @torch.no_grad()
    def encode(self, prompts: list[str]) -> SanaPromptEmbeds:
        """Encode prompts with the pipeline's ``encode_prompt``: ``embeds (P, max_sequence_length, D)`` float32 and
        ``mask (P, max_sequence_length)`` long; each prompt with :attr:`instruction`, the empty prompt without it (the
        pipeline's negative)."""
        prompts = list(prompts)
        rows = {}
        for negative in (True, False):
            group = [i for i, p in enumerate(prompts) if (p == "") == negative]
            if group:
                out = self.pipe.encode_prompt(
                    [prompts[i] for i in group],
                    device=self.device,
                    max_sequence_length=self.max_sequence_length,
                    complex_human_instruction=None if negative else self.instruction,
                    **self._ENCODE_KWARGS,
                )  # (n, L, D), (n, L) and, for SanaPipeline, no negatives
                rows.update(zip(group, zip(out[0], out[1])))
        embeds = torch.stack([rows[i][0] for i in range(len(prompts))]).float()  # (P, L, D)
        mask = torch.stack([rows[i][1] for i in range(len(prompts))]).long()  # (P, L)
        return SanaPromptEmbeds(embeds, embeds.new_zeros(len(prompts), 0), mask)

    def _conditioning(self, t: torch.Tensor, guidance_scale: float) -> dict[str, torch.Tensor]:
        """The transformer's time input: ``timestep (N,)`` float32, the scheduler's ``1000 t`` times
        ``timestep_scale``, as ``SanaPipeline`` passes it (no guidance input)."""
        steps = self.pipe.scheduler.config.num_train_timesteps
        return {"timestep": t.float() * steps * self.transformer.config.timestep_scale}

    def _forward(self, x, t, cond: SanaPromptEmbeds, dtype, guidance: float = 1.0) -> torch.Tensor:
        """One transformer call: latents ``x (N, C, H, W)`` at flow times ``t (N,)`` with ``cond``'s embeddings and
        padding masks (``guidance``: Sprint's embedded guidance scale) -> the velocity ``(N, C, H, W)`` in ``dtype``."""
        out = self.network()(
            x.to(dtype),
            encoder_hidden_states=cond.embeds.to(dtype),
            encoder_attention_mask=cond.mask,
            return_dict=False,
            **self._conditioning(t, guidance),
        )[0]  # (N, C or 2 C, H, W)
        return out[:, : x.shape[1]]  # (N, C, H, W): a learned-sigma output's first half, as the pipeline

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Decode latents ``(B, C, H, W)`` to images float32 ``(B, 3, H f, W f)`` in [0, 1] as the pipelines do
        (``vae.decode(z / scaling_factor)``), in chunks of :attr:`decode_chunk`."""
        vae = self.pipe.vae
        images = []
        for chunk in latents.split(self.decode_chunk):
            z = (chunk.to(vae.dtype) / vae.config.scaling_factor).contiguous(memory_format=torch.channels_last)
            images.append(vae.decode(z, return_dict=False)[0].float())
        return (torch.cat(images) / 2 + 0.5).clamp(0, 1)


@register_family
class SanaSprintModel(SanaModel):
    """A SANA-Sprint few-step model (``SanaSprintPipeline`` folder: SANA-Sprint 0.6B / 1.6B or a small one): SANA's
    prompts, latents, decoding and LoRA, with Sprint's time and guidance conventions.

    - Time: Sprint's ``SCMScheduler`` works in TrigFlow angles ``s`` (``x_s = cos(s) x0 + sin(s) z``, scaled by
      ``sigma_data``). The pipeline feeds the transformer ``latents / (sigma_data (sin s + cos s))`` at
      ``timestep = sin(s) / (sin(s) + cos(s))``: exactly flowrl's flow state ``x_t = (1 - t) x0 + t z`` at ``t`` =
      that timestep. Its TrigFlow conversion of the output, followed by the scheduler's ``x0 = cos(s) x_s - sin(s)
      F``, gives ``x0 = x_t - t v`` with ``v`` the raw output: the transformer is a flow-velocity model in ``t``, and
      ``sigma_data`` cancels. :meth:`_forward` passes ``t`` as the timestep and returns the raw output.
    - Schedule (:meth:`sigmas`): the scheduler's angles, ``[max_timesteps, intermediate_timesteps, 0]`` for 2 steps
      (1.5708, 1.3, 0: the pipeline's defaults) and ``linspace(max_timesteps, 0, N + 1)`` otherwise, mapped to
      ``t = sin / (sin + cos)``, then shifted by ``sampling.shift`` (the folder's is 1: no shift). The first angle,
      1.57080, is pi/2 rounded up, ``t = 1 + 3.7e-6``; flowrl starts at ``t = 1`` from the unit noise (the stock
      pipeline's first state and timestep are larger by that factor, under 1e-5 in its images).
    - Sampler: the stock multistep sampler is not an ODE. Each step predicts ``x0`` and re-noises it with fresh noise,
      ``x_{t'} = (1 - t') x0 + t' eps``: flowrl's ``cps`` kernel at ``sampling.noise_level=1.0`` (a test checks it
      against the stock pipeline, noise for noise). flowrl's ODE (Euler) sampling equals the stock pipeline at 1
      step, and at more steps the stock pipeline with the fresh noise replaced by the model's own noise estimate
      (DDIM, which is Euler in these variables).
    - Guidance: embedded, not CFG: ``w x guidance_embeds_scale`` goes to the transformer's ``guidance`` input, one
      forward per sample (:meth:`cfg_rows` 1; the empty prompt is unused), as ``SanaSprintPipeline(guidance_scale=w)``
      (default 4.5).

    Args, Raises: as :class:`SanaModel`.
    """

    PIPELINE = "SanaSprintPipeline"
    _ENCODE_KWARGS = {}

    def _scm_default(self, name: str) -> float:
        """The default of the pipeline's ``__call__``'s ``name`` (``max_timesteps`` 1.5708 or ``intermediate_timesteps``
        1.3)."""
        return float(inspect.signature(type(self.pipe).__call__).parameters[name].default)

    @staticmethod
    def _check_scm(cfg: dict, where: str | Path) -> None:
        """Raise ValueError naming ``where`` unless the scheduler config is a TrigFlow ``SCMScheduler``'s."""
        if cfg.get("_class_name", "SCMScheduler") != "SCMScheduler" or cfg.get("prediction_type") != "trigflow":
            raise ValueError(
                f"{where} is a {cfg.get('_class_name')!r} with prediction_type {cfg.get('prediction_type')!r}; "
                "SANA-Sprint's is an SCMScheduler with prediction_type 'trigflow'"
            )

    @classmethod
    def scheduler_shift(cls, path: str | Path, resolution: int | None = None) -> float:
        """1.0: the SCM scheduler's grid is used unshifted (after checking the config is a TrigFlow ``SCMScheduler``).

        Raises:
            FileNotFoundError: if ``path`` has no scheduler config. ValueError: for another scheduler.
        """
        file = _scheduler_file(path)
        cls._check_scm(json.loads(file.read_text()), file)
        return 1.0

    @property
    def shift(self) -> float:
        """1.0 (:meth:`scheduler_shift`)."""
        self._check_scm(dict(self.pipe.scheduler.config), Path(self.path) / "scheduler")
        return 1.0

    def sigmas(self, num_steps: int, shift: float | None = None) -> torch.Tensor:
        """The stock SCM schedule ``(num_steps + 1,)`` float32 (CPU) as flow times from 1 to 0 (the class docstring),
        shifted by ``shift`` (None or 1: unshifted), ``s t / (1 + (s - 1) t)``.

        Raises:
            ValueError: if ``num_steps < 1`` or ``shift <= 0``.
        """
        shift = 1.0 if shift is None else shift
        if num_steps < 1 or shift <= 0:
            raise ValueError(f"num_steps must be >= 1 and shift > 0; got {num_steps} and {shift}")
        top = self._scm_default("max_timesteps")
        if num_steps == 2:
            angles = torch.tensor([top, self._scm_default("intermediate_timesteps"), 0.0], dtype=torch.float64)
        else:
            angles = torch.linspace(top, 0.0, num_steps + 1, dtype=torch.float64)  # (N + 1,)
        t = (angles.sin() / (angles.sin() + angles.cos())).clamp(max=1.0)  # (N + 1,): t_0 = 1, t_N = 0
        return (shift * t / (1 + (shift - 1) * t)).float()

    def cfg_scale(self, guidance_scale: float) -> float:
        """1: the guidance scale is an input of the transformer (:meth:`embedded_guidance`), not CFG; ``uncond`` is not
        used.

        Raises:
            ValueError: if ``guidance_scale`` is not in ``[1, 100]``.
        """
        check_guidance(guidance_scale)
        return 1.0

    def embedded_guidance(self, guidance_scale: float) -> dict:
        """``{"guidance": w}``: Sprint's transformer takes the scale (``SanaSprintPipeline(guidance_scale=w)``)."""
        return {"guidance": guidance_scale}

    def _conditioning(self, t: torch.Tensor, guidance_scale: float) -> dict[str, torch.Tensor]:
        """``timestep (N,)`` float32: the flow time itself (the pipeline's ``scm_timestep``); ``guidance (N,)``: ``w``
        in the text encoder's dtype times ``guidance_embeds_scale``, as the pipeline computes it."""
        guidance = torch.full(t.shape, float(guidance_scale), device=t.device).to(self.dtype)
        return {"timestep": t.float(), "guidance": guidance * self.transformer.config.guidance_embeds_scale}
