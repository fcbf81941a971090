"""The Wan family (``WanPipeline``): Wan 2.1 and Wan 2.2 text-to-video, sampled and trained as flow models over latent
videos ``(C, F, H, W)``.

Wan (arXiv 2503.20314; reference implementation ``diffusers/pipelines/wan/pipeline_wan.py``) is a rectified-flow
video DiT: a UMT5 text encoder, ``WanTransformer3DModel`` over 1x2x2 patches of the latents of ``AutoencoderKLWan``
(a causal 3-D VAE compressing 4x in time, 8x in space for Wan 2.1 / 16x for Wan 2.2 TI2V-5B). The samplers see
latents ``(N, C, F, H, W)`` through :meth:`FlowModel.velocity_fn` as they see images: every kernel, window, tree and
probe reduces over all non-batch dimensions.

Wan 2.2 A14B folders carry two experts (``transformer`` for high noise, ``transformer_2`` for low noise, switched at
``boundary_ratio * 1000``): the adapter samples with both, as the stock pipeline does (the same guidance scale for
both, the stock default), and trains one of them, the config's choice (``model.expert``: ``high`` or ``low``); the
other stays frozen.
"""

from __future__ import annotations

import contextlib
import functools
from pathlib import Path

import torch

from .base import (
    PromptEmbeds,
    _config_shift,
    _json,
    _model_index,
    _pipeline_folder,
    _scheduler_file,
    built_sample_size,
    make_batch_invariant,
    register_family,
)
from .video import VideoModel

WAN_LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0")
"""Flow-GRPO's LoRA targets for Wan (``scripts/train_wan2_1.py``): the query, key, value and output projections of
every block's self-attention (``attn1``) and cross-attention (``attn2``); its ``add_*`` targets exist only in the
image-to-video transformers."""

EXPERTS = ("high", "low")
"""``model.expert`` values for a two-expert Wan 2.2 folder: ``high`` trains ``transformer`` (the steps at times
``>= boundary_ratio``), ``low`` trains ``transformer_2`` (the steps below it)."""


def wan_scheduler_shift(cfg: dict, where: str | Path) -> float:
    """The flow shift of a Wan folder's scheduler config: ``flow_shift`` of a ``UniPCMultistepScheduler`` with
    ``use_flow_sigmas`` (what Wan checkpoints ship: 3.0 for 480P, 5.0 for 720P), or ``shift`` of a
    ``FlowMatchEulerDiscreteScheduler``. flowrl samples with its own kernels on the flow-matching Euler scheduler's
    sigmas at that shift (:meth:`WanModel.sigmas`).

    Raises:
        ValueError: naming ``where``, for a UniPC scheduler without flow sigmas, a dynamic shift, or a shift that is not
            a number > 0.
    """
    if cfg.get("_class_name") == "UniPCMultistepScheduler" or "flow_shift" in cfg:
        if not cfg.get("use_flow_sigmas"):
            raise ValueError(f"{where} is a UniPC scheduler without use_flow_sigmas: not a flow-matching schedule")
        return _config_shift({"shift": cfg.get("flow_shift", 1.0)}, where)
    return _config_shift(cfg, where)


@register_family
class WanModel(VideoModel):
    """A Wan 2.1 / 2.2 text-to-video flow model (``WanPipeline`` folder), with :class:`FlowModel`'s interface
    (:class:`~flowrl.models.video.VideoModel`).

    - Latents: ``(C, F_lat, H/f, W/f)`` per video (:attr:`latent_shape`), ``F_lat = (num_frames - 1) / t + 1`` with
      the VAE's temporal compression ``t`` (4) and spatial compression ``f`` (8, or 16 for Wan 2.2 TI2V-5B).
    - Frames: ``num_frames`` (``model.num_frames``; default 81, ``WanPipeline``'s) must be ``t k + 1`` (the stock
      pipeline would round it silently; flowrl refuses it). Resolution: square, a multiple of ``f`` x the patch size
      (16 for Wan 2.1), up to the rotary embedding's ``rope_max_seq_len`` patches; default 480 px (Wan 480P's short side).
    - Prompts: the pipeline's own ``encode_prompt`` (UMT5, ``max_sequence_length`` tokens, default 512 as
      ``WanPipeline``; embeddings past a prompt's length are zero). No pooled embedding (``pooled`` is ``(P, 0)``).
    - CFG: ``v_neg + w (v_c - v_neg)`` with the embedding of ``negative_prompt`` (default ``""``: the stock pipeline's
      default, and Flow-GRPO's Wan recipe's) as the negative (row 0 of every prompt table is re-encoded to it).
    - Schedule: the folder's flow shift (:func:`wan_scheduler_shift`: the UniPC scheduler's ``flow_shift``), with the
      flow-matching Euler scheduler's step spacing (:meth:`sigmas`): the ODE equals ``WanPipeline`` given
      ``FlowMatchEulerDiscreteScheduler(shift=flow_shift)`` (a test checks it within 1e-4).
    - Wan 2.2 two experts: both sample (each at its times, the same guidance scale, as the stock default
      ``guidance_scale_2 = guidance_scale``); ``expert`` (``model.expert``, required for such a folder and refused for
      others) picks the trained one. The rollout trains only the steps at the trained expert's times
      (:meth:`trainable_times`): the frozen expert's steps are sampled but neither stored for the loss nor
      back-propagated (their velocity does not depend on the trained weights). A LoRA of ``low`` loads in the stock
      pipeline with ``load_lora_weights(folder, load_into_transformer_2=True)``. Wan 2.2 TI2V-5B (``expand_timesteps``) gets its
      timestep per latent token, as the stock pipeline gives it.
    - Decode: to videos ``(B, F, 3, H, W)`` float32 in [0, 1], :attr:`decode_chunk` videos per VAE call; the Wan VAE
      decodes one latent frame at a time with its causal cache, so frames are chunked by the VAE itself.
    - LoRA: :data:`WAN_LORA_TARGETS`, saved in diffusers' format (``WanPipeline.load_lora_weights`` loads it).

    Args:
        path, device, dtype, max_sequence_length, resolution: as :class:`FlowModel`.
        num_frames: frames per video (None: 81).
        expert: ``"high"`` or ``"low"`` for a two-expert Wan 2.2 folder, None otherwise.
        negative_prompt: the CFG negative prompt.

    Raises:
        FileNotFoundError, ValueError: as :class:`FlowModel`; ValueError also for a frame count, expert or scheduler
            the folder cannot take (:meth:`check_num_frames`, :meth:`check_expert`, :func:`wan_scheduler_shift`).
    """

    PIPELINE = "WanPipeline"
    """The diffusers pipeline class this adapter loads (``_class_name`` in ``model_index.json``)."""
    FAMILY = "Wan"
    PROMPT_LENGTH = (1, None)
    PROMPT_RULE = "its UMT5 tokens condition every block"
    OPTIONAL = ("transformer_2",)
    """Components a folder may leave out: the second expert (Wan 2.1 and Wan 2.2 TI2V-5B have none)."""
    LORA_TARGETS = WAN_LORA_TARGETS
    SIGMA_SPACING = "sd3"
    """The flow-matching Euler scheduler's spacing (:func:`samplers.flow_sigmas`)."""
    DEFAULT_FRAMES = 81
    """Frames per video when none is given (``WanPipeline``'s default)."""
    DEFAULT_SIDE = 480
    """Video side in px when no resolution is given (Wan 480P's short side)."""

    frozen = None
    """The other expert of a two-expert folder, frozen (None for one transformer)."""
    boundary = None
    """The timestep ``boundary_ratio * num_train_timesteps`` at which a two-expert folder switches (None: none)."""

    def _after_load(self) -> None:
        """The switching boundary and, with two experts, the other expert frozen and made batch-invariant."""
        ratio = self.pipe.config.boundary_ratio
        self.boundary = None if ratio is None else ratio * self.pipe.scheduler.config.num_train_timesteps
        if self.expert is not None:
            self.frozen = self.pipe.transformer if self.expert == "low" else self.pipe.transformer_2
            self.frozen.requires_grad_(False).eval()
            make_batch_invariant(self.frozen, functools.partial(self._probe_expert, self.frozen))

    # ------------------------------------------------------------------------------ folder checks
    @staticmethod
    def _default_length(index: dict) -> int:
        """512 UMT5 tokens, ``WanPipeline``'s default."""
        return 512

    @staticmethod
    def _transformer_config(path: Path) -> dict:
        """The config of the folder's first present expert."""
        index = _model_index(path)
        name = "transformer" if (index.get("transformer") or [None])[0] else "transformer_2"
        return _json(path / name / "config.json")

    @classmethod
    def _resolution_grid(cls, path: Path) -> tuple[int, int, int | None, str]:
        """Default 480 px, or the side a flowrl-built folder was trained at (:func:`built_sample_size`: 32 px for the
        shipped tiny one), or the largest side the folder's rotary embedding covers when that is smaller; a multiple
        of the VAE's spatial compression x the patch size, up to ``rope_max_seq_len`` patches."""
        vae, dit = _json(path / "vae" / "config.json"), cls._transformer_config(path)
        factor, patch = vae.get("scale_factor_spatial", 8), dit["patch_size"][1]
        unit = factor * patch
        largest = dit.get("rope_max_seq_len", 1024) * unit
        side = built_sample_size(path).get("resolution", cls.DEFAULT_SIDE)
        default = min(int(side) // unit * unit, largest)
        return default, unit, largest, f"VAE spatial compression {factor} x patch size {patch}"

    @classmethod
    def check_num_frames(cls, path: str | Path, num_frames: int | None) -> int:
        """The frames per video the folder ``path`` draws: ``num_frames`` checked, or 81 (a flowrl-built folder's own,
        :func:`built_sample_size`: 9 for the shipped tiny one), no weights loaded.

        Raises:
            FileNotFoundError: if ``path`` is not a pipeline folder.
            ValueError: naming the folder, unless ``num_frames = t k + 1 >= 1`` (``t`` the VAE's temporal compression)
                with at most ``rope_max_seq_len`` latent frames.
        """
        path = _pipeline_folder(path)
        t = _json(path / "vae" / "config.json").get("scale_factor_temporal", 4)
        frames = (
            int(built_sample_size(path).get("num_frames", cls.DEFAULT_FRAMES)) if num_frames is None else num_frames
        )
        largest = (cls._transformer_config(path).get("rope_max_seq_len", 1024) - 1) * t + 1
        if frames < 1 or (frames - 1) % t or frames > largest:
            raise ValueError(
                f"num_frames {frames} does not fit the model at {path}: expected {t}k+1 frames (the VAE "
                f"compresses time {t}x), from 1 to {largest}, e.g. {(max(frames, 1) - 1) // t * t + 1}"
            )
        return frames

    @classmethod
    def network_name(cls, expert: str | None = None) -> str:
        """``transformer_2`` for the low-noise expert of a Wan 2.2 folder (``model.expert=low``), else
        ``transformer``."""
        return "transformer_2" if expert == "low" else cls.NETWORK

    @classmethod
    def check_expert(cls, path: str | Path, expert: str | None) -> str | None:
        """The expert trained in the folder ``path``: ``expert`` for a two-expert Wan 2.2 folder (``transformer_2``
        and ``boundary_ratio`` present), None for a single-transformer one.

        Raises:
            FileNotFoundError: if ``path`` is not a pipeline folder.
            ValueError: naming the folder, for a two-expert folder without ``high`` / ``low``, or an expert given for a
                single-transformer folder.
        """
        index = _model_index(path)
        two = bool((index.get("transformer_2") or [None])[0]) and index.get("boundary_ratio") is not None
        if two and expert not in EXPERTS:
            raise ValueError(
                f"{Path(path)} is a two-expert Wan 2.2 model (boundary_ratio {index['boundary_ratio']}): "
                f"choose the trained expert, high (transformer) or low (transformer_2); got {expert!r}"
            )
        if not two and expert is not None:
            raise ValueError(
                f"{Path(path)} has one transformer (no transformer_2 and boundary_ratio): leave the expert "
                f"unset, got {expert!r}"
            )
        return expert

    @classmethod
    def scheduler_shift(cls, path: str | Path, resolution: int | None = None, num_frames: int | None = None) -> float:
        """The flow shift of the folder's scheduler (:func:`wan_scheduler_shift`), read without loading weights (the
        same at every resolution and frame count).

        Raises:
            FileNotFoundError: if ``path`` has no scheduler config. ValueError: as :func:`wan_scheduler_shift`.
        """
        file = _scheduler_file(path)
        return wan_scheduler_shift(_json(file), file)

    @property
    def shift(self) -> float:
        """:meth:`scheduler_shift` of the loaded scheduler."""
        return wan_scheduler_shift(dict(self.pipe.scheduler.config), Path(self.path) / "scheduler")

    # ------------------------------------------------------------------------------ the model
    @torch.no_grad()
    def encode(self, prompts: list[str]) -> PromptEmbeds:
        """Encode prompts with ``WanPipeline.encode_prompt``: UMT5 states ``(P, max_sequence_length, D)`` float32 (zero
        past each prompt's tokens) and an empty pooled ``(P, 0)``."""
        embeds, _ = self.pipe.encode_prompt(
            prompts,
            do_classifier_free_guidance=False,
            max_sequence_length=self.max_sequence_length,
            device=self.device,
        )
        return PromptEmbeds(embeds.float(), embeds.new_zeros(len(prompts), 0).float())

    def _call(
        self, net: torch.nn.Module, x: torch.Tensor, t: torch.Tensor, cond: PromptEmbeds, dtype: torch.dtype
    ) -> torch.Tensor:
        """One expert on rows ``x (N, C, F, H, W)`` at times ``t (N,)``: timestep ``1000 t`` per row, or per latent token
        (``expand_timesteps``, Wan 2.2 TI2V-5B: ``(N, F * H/2 * W/2)``), as ``WanPipeline`` gives it."""
        timestep = t.to(dtype) * 1000
        if self.pipe.config.expand_timesteps:
            p_f, p_h, p_w = net.config.patch_size
            tokens = (x.shape[2] // p_f) * (x.shape[3] // p_h) * (x.shape[4] // p_w)
            timestep = timestep[:, None].expand(-1, tokens)  # (N, tokens)
        return net(
            hidden_states=x.to(dtype),
            timestep=timestep,
            encoder_hidden_states=cond.embeds.to(dtype),
            return_dict=False,
        )[0]

    def trainable_times(self, sigmas: torch.Tensor) -> torch.Tensor | None:
        """Two experts: the times on the trained expert's side of the boundary, as :meth:`_forward` switches."""
        if self.frozen is None:
            return None
        high = sigmas.float().cpu() * 1000 >= self.boundary
        return high if self.expert == "high" else ~high

    def _forward(self, x, t, cond: PromptEmbeds, dtype) -> torch.Tensor:
        if self.frozen is None:
            return self._call(self.network(), x, t, cond, dtype)
        high = t.float() * 1000 >= self.boundary  # (N,) rows of the high-noise expert, as WanPipeline switches
        mine = high if self.expert == "high" else ~high
        rows = [torch.nonzero(mine).flatten(), torch.nonzero(~mine).flatten()]  # trained rows, frozen rows
        nets = [(self.network(), dtype), (self.frozen, next(self.frozen.parameters()).dtype)]
        parts = [
            self._call(net, x[r], t[r], cond[r], net_dtype).float() if len(r) else None
            for r, (net, net_dtype) in zip(rows, nets)
        ]  # (n_trained, ...), (n_frozen, ...)
        out = torch.cat([p for p in parts if p is not None])  # (N, C, F, H, W) in the order of `rows`
        if parts[0] is None and torch.is_grad_enabled():  # only the frozen expert's times: a zero gradient, not none
            out = out + 0.0 * sum(p.sum() for p in self.transformer.parameters() if p.requires_grad)
        return out[torch.argsort(torch.cat(rows))]

    def _probe(self) -> None:
        """One forward of the trained expert on one sample (for :func:`make_batch_invariant`)."""
        self._probe_expert(self.transformer)

    def _probe_expert(self, net: torch.nn.Module) -> None:
        """One forward of the expert ``net`` on one sample (for :func:`make_batch_invariant`)."""
        x = torch.zeros(1, *self.latent_shape, device=self.device)
        self._call(net, x, torch.ones(1, device=self.device), self.encode([""]), next(net.parameters()).dtype)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Decode latents ``(B, C, F_lat, h, w)`` to videos float32 ``(B, F, 3, H, W)`` in [0, 1], as ``WanPipeline``
        (``z * latents_std + latents_mean``, the VAE, ``x / 2 + 0.5`` clamped), :attr:`decode_chunk` videos per call."""
        vae = self.pipe.vae
        shape = (1, vae.config.z_dim, 1, 1, 1)
        mean = torch.tensor(vae.config.latents_mean).view(shape).to(latents.device, vae.dtype)
        std = torch.tensor(vae.config.latents_std).view(shape).to(latents.device, vae.dtype)
        videos = []
        for chunk in latents.split(self.decode_chunk):
            z = chunk.to(vae.dtype) * std + mean
            videos.append(vae.decode(z, return_dict=False)[0].float().permute(0, 2, 1, 3, 4))  # (b, F, 3, H, W)
        return (torch.cat(videos) / 2 + 0.5).clamp(0, 1)

    def load_lora(self, directory: str | Path, adapter_name: str | None = None) -> None:
        """:meth:`FlowModel.load_lora` into the trained expert (``transformer_2`` for ``expert="low"``, loaded as the
        stock pipeline's ``load_lora_weights(directory, load_into_transformer_2=True)``)."""
        context = contextlib.nullcontext()
        if self.expert == "low":
            context = _loads_into_transformer_2(self.pipe)
        with context:
            super().load_lora(directory, adapter_name)


@contextlib.contextmanager
def _loads_into_transformer_2(pipe):
    """Within: ``pipe.load_lora_weights(...)`` loads into ``transformer_2`` (``load_into_transformer_2=True``)."""
    pipe.load_lora_weights = functools.partial(type(pipe).load_lora_weights, pipe, load_into_transformer_2=True)
    try:
        yield
    finally:
        del pipe.load_lora_weights
