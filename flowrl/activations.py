"""The activations a network's training forward keeps for its backward, counted on the meta device (no weights, no
compute): the part of a GPU update's peak memory that grows with the micro-batch, the resolution and the frames.

:func:`activation_bytes` runs the network's forward once on meta tensors of the recipe's shapes (built from the
published ``config.json`` by :data:`INPUTS`, one builder per network class), with

- every tensor the autograd graph saves counted once (``torch.autograd.graph.saved_tensors_hooks``; views of one
  storage counted once; the module's own parameters and buffers not counted: they are the weights' share of the plan);
- CUDA's bf16 autocast emulated (:class:`_Autocast`: matrix products, convolutions and attention take bf16 inputs,
  as ``torch.autocast("cuda", torch.bfloat16)`` casts them; a float32 weight's bf16 copy is saved as on a GPU);
- attention counted as the flash / memory-efficient SDPA kernels save it (:class:`_FlashAttention`: queries, keys,
  values, the output and the float32 log-sum-exp per query; never the ``(S, S)`` probabilities), which is what
  ``F.scaled_dot_product_attention`` runs on an H100/H200 in bf16;
- the blocks diffusers checkpoints (``enable_gradient_checkpointing``: the model's own ``_gradient_checkpointing_func``
  calls, one per transformer block, or per resnet / attention of a UNet) recorded: their inputs and what each saves.

From one forward come both plans: without checkpointing the whole count; with it, what is saved outside the blocks,
the blocks' inputs (what ``torch.utils.checkpoint`` keeps) and the largest block's own count (recomputed during its
backward). Checked against what an H200 measured (docs/distributed.md, benchmarks/results/gpu_scale_sd35m*.json) by
tests/test_plan.py.
"""

from __future__ import annotations

import dataclasses
import warnings

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

GLYPH_TOKENS = 256
"""HunyuanVideo 1.5's ByT5 tokens of a prompt's glyph text (its text in quotes): the pipeline's
``tokenizer_2_max_length``, capped at ``max_sequence_length`` (:meth:`flowrl.models.HunyuanVideo15Model.encode`, and
this planner's inputs). The transformer masks the padding out, so a shorter cap changes no video whose glyph text
fits, only the cost: every glyph token passes the ByT5 projection (2048 wide)."""

LOW_PRECISION = (
    F.linear,
    F.conv1d,
    F.conv2d,
    F.conv3d,
    torch.matmul,
    torch.mm,
    torch.bmm,
    torch.addmm,
    torch.baddbmm,
    torch.Tensor.matmul,
    torch.Tensor.__matmul__,
)
"""The operations CUDA autocast runs in its low-precision dtype (PyTorch's autocast op reference, "CUDA Ops that can
autocast to float16"); their floating inputs are cast to it."""


class _FlashAttention(torch.autograd.Function):
    """``scaled_dot_product_attention`` as the flash kernel saves it: ``q, k, v, out`` and the float32 log-sum-exp
    ``(..., S_q)``. Forward only (the output is an empty tensor of the right shape; meta tensors carry no values)."""

    @staticmethod
    def forward(ctx, q, k, v):
        out = q.new_empty(*q.shape[:-1], v.shape[-1])
        lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad):  # pragma: no cover - the count never runs a backward
        raise NotImplementedError("activation counting runs forwards only")


class _Autocast(TorchFunctionMode):
    """CUDA autocast to ``dtype`` for meta tensors (``torch.autocast`` has no meta device), attention through
    :class:`_FlashAttention`, and a test of a meta tensor's value false (HunyuanVideo 1.5's "are the image embeddings
    all zero": the image-to-video side, which attends to them)."""

    def __init__(self, dtype: torch.dtype | None):
        super().__init__()
        self.dtype = dtype

    def _cast(self, a):
        low = self.dtype is not None and isinstance(a, torch.Tensor) and a.is_floating_point()
        return a.to(self.dtype) if low and a.dtype != self.dtype else a

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.Tensor.__bool__, torch.Tensor.item) and args[0].is_meta:
            return False if func is torch.Tensor.__bool__ else 0  # a branch on values takes its false side
        if func is F.scaled_dot_product_attention:
            named = [kwargs.get(name) for name in ("query", "key", "value")]
            q, k, v = (self._cast(a) for a in (*args[:3], *named[len(args[:3]) :]))
            if kwargs.get("enable_gqa") and k.shape[-3] != q.shape[-3]:
                k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
                v = v.repeat_interleave(q.shape[-3] // v.shape[-3], dim=-3)
            return _FlashAttention.apply(q, k, v)
        if func in LOW_PRECISION:
            args = tuple(self._cast(a) for a in args)
            kwargs = {k: self._cast(v) for k, v in kwargs.items()}
        return func(*args, **kwargs)


@dataclasses.dataclass
class Activations:
    """What one training forward saves for its backward, in bytes.

    Attributes:
        total: everything saved (the plan without checkpointing).
        outside: saved outside the checkpointed blocks (embeddings, the final layer, the loss's inputs).
        block_inputs: the checkpointed blocks' tensor inputs, each storage once (what checkpointing keeps of them).
        largest_block: the most one block saves (recomputed in its backward under checkpointing).
        blocks: the checkpointed block calls counted (0: the network checkpoints nothing).
    """

    total: int
    outside: int
    block_inputs: int
    largest_block: int
    blocks: int

    @property
    def checkpointed(self) -> int:
        """The peak of saved activations with checkpointing: ``outside + block_inputs + largest_block``."""
        return self.outside + self.block_inputs + self.largest_block

    def peak(self, checkpointing: bool) -> int:
        """Saved activations at the backward's start plus its working set (the largest block's count again: the
        gradients of that block's intermediate tensors; under checkpointing also its recomputed activations)."""
        return (self.checkpointed if checkpointing else self.total) + self.largest_block


def activation_bytes(
    network: torch.nn.Module, inputs: dict, dtype: torch.dtype | None = torch.bfloat16
) -> Activations:
    """Count what ``network(**inputs)`` saves for its backward (this module's docstring says how).

    Args:
        network: a diffusers network on the meta device, its trained parameters requiring gradients (a LoRA added,
            or every weight); it is left with gradient checkpointing on (:meth:`enable_gradient_checkpointing` with a
            counting function: the forward is not checkpointed by it).
        inputs: the forward's keyword arguments on the meta device (:data:`INPUTS`).
        dtype: the autocast dtype (``torch.bfloat16``: ``run.mixed_precision=bf16``), or None for none.

    Returns:
        :class:`Activations`.

    Raises:
        ValueError: a network without gradient checkpointing support (every family's has it).
    """
    if not getattr(network, "_supports_gradient_checkpointing", False):
        raise ValueError(f"{type(network).__name__} does not support gradient checkpointing")
    own = {t.untyped_storage()._cdata for t in [*network.parameters(), *network.buffers()]}
    seen: dict[int, tuple[int, int | None]] = {}  # storage -> (bytes, index of the block call that saved it)
    keep: list[torch.Tensor] = []  # holds the storages so their ids are not reused
    calls: list[list[int]] = []  # per block call: [input bytes, saved bytes]
    current: list[int | None] = [None]

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s._cdata not in own and s._cdata not in seen:
            seen[s._cdata] = (s.nbytes(), current[-1])
            keep.append(t)
        return t

    def block(module, *args, **kwargs):
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        calls.append(
            [sum(t.untyped_storage().nbytes() for t in {t.untyped_storage()._cdata: t for t in tensors}.values()), 0]
        )
        current.append(len(calls) - 1)
        try:
            return module(*args, **kwargs)
        finally:
            current.pop()

    network.enable_gradient_checkpointing(gradient_checkpointing_func=block)
    network.train()
    from torch.fx.experimental import _config as fx_config

    hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
    every = fx_config.patch(meta_nonzero_assume_all_nonzero=True)  # masks select every token: the padded length
    with hooks, every, _Autocast(dtype), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # bf16 inputs against float32 norm weights: as under autocast on a GPU
        network(**inputs)
    for size, where in seen.values():
        if where is not None:
            calls[where][1] += size
    outside = sum(size for size, where in seen.values() if where is None)
    return Activations(
        total=sum(size for size, _ in seen.values()),
        outside=outside,
        block_inputs=sum(c[0] for c in calls),
        largest_block=max((c[1] for c in calls), default=0),
        blocks=len(calls),
    )


@dataclasses.dataclass(frozen=True)
class Shape:
    """The shape of one training forward.

    Attributes:
        rows: rows through the network at once (the micro-batch, doubled under classifier-free guidance).
        latent: ``(frames, height, width)`` of the VAE's latent grid (frames 1 for images), before any patching
            (:func:`latent_grid`).
        text_tokens: the text stream's tokens (the padded length the family encodes to; SD3: CLIP's 77 and T5's).
        dtype: the network's input dtype (the frozen weights' ``model.dtype``).
    """

    rows: int
    latent: tuple[int, int, int]
    text_tokens: int = 256
    dtype: torch.dtype = torch.bfloat16


VAE_FACTORS = {
    "SD3Transformer2DModel": (8, 1),
    "FluxTransformer2DModel": (8, 1),
    "Flux2Transformer2DModel": (8, 1),
    "QwenImageTransformer2DModel": (8, 1),
    "ZImageTransformer2DModel": (8, 1),
    "SanaTransformer2DModel": (32, 1),
    "UNet2DConditionModel": (8, 1),
    "WanTransformer3DModel": (8, 4),
    "HunyuanVideoTransformer3DModel": (8, 4),
    "HunyuanVideo15Transformer3DModel": (16, 4),
    "LTXVideoTransformer3DModel": (32, 8),
}
"""``(spatial, temporal)`` compression of the published VAE each network class is paired with."""


def latent_grid(
    network_class: str, height: int, width: int, frames: int = 1, spatial: int | None = None
) -> tuple[int, int, int]:
    """The latent grid ``(frames, height, width)`` of ``frames`` frames of ``height x width`` pixels under the published
    VAE of ``network_class`` (:data:`VAE_FACTORS`; a causal video VAE keeps the first frame: ``(F - 1) / t + 1``), or
    under a VAE of ``spatial`` compression (a folder's own)."""
    published, temporal = VAE_FACTORS[network_class]
    spatial = spatial or published
    return ((frames - 1) // temporal + 1 if temporal > 1 else 1), height // spatial, width // spatial


def _e(*shape, dtype=None, s: Shape) -> torch.Tensor:
    """An empty meta tensor of ``shape`` in ``dtype`` (default: the shape's)."""
    return torch.empty(*shape, dtype=dtype or s.dtype, device="meta")


def _sd3(c: dict, s: Shape) -> dict:
    """SD3 / SD3.5 (``StableDiffusion3Pipeline``): 8x VAE; the text: CLIP's tokens, then T5's."""
    return dict(
        hidden_states=_e(s.rows, c["in_channels"], *s.latent[1:], s=s),
        encoder_hidden_states=_e(s.rows, s.text_tokens, c["joint_attention_dim"], s=s),
        pooled_projections=_e(s.rows, c["pooled_projection_dim"], s=s),
        timestep=_e(s.rows, s=s),
    )


def _flux(c: dict, s: Shape, references: int = 0) -> dict:
    """FLUX.1 (``FluxPipeline``; Kontext with ``references`` source images of the same size): 8x VAE, 2x2 packing."""
    tokens = (s.latent[1] // 2) * (s.latent[2] // 2) * (1 + references)
    return dict(
        hidden_states=_e(s.rows, tokens, c["in_channels"], s=s),
        timestep=_e(s.rows, s=s),
        guidance=_e(s.rows, s=s) if c.get("guidance_embeds") else None,
        pooled_projections=_e(s.rows, c["pooled_projection_dim"], s=s),
        encoder_hidden_states=_e(s.rows, s.text_tokens, c["joint_attention_dim"], s=s),
        txt_ids=_e(s.text_tokens, 3, s=s),
        img_ids=_e(tokens, 3, s=s),
    )


def _flux2(c: dict, s: Shape) -> dict:
    """FLUX.2 [dev] and klein (``Flux2Pipeline``, ``Flux2KleinPipeline``): 8x VAE, 2x2 patches, 4-axis positions."""
    tokens = (s.latent[1] // 2) * (s.latent[2] // 2)
    return dict(
        hidden_states=_e(s.rows, tokens, c["in_channels"], s=s),
        encoder_hidden_states=_e(s.rows, s.text_tokens, c["joint_attention_dim"], s=s),
        timestep=_e(s.rows, s=s),
        img_ids=_e(tokens, 4, dtype=torch.int64, s=s),
        txt_ids=_e(s.text_tokens, 4, dtype=torch.int64, s=s),
        guidance=_e(s.rows, s=s) if c.get("guidance_embeds") else None,
    )


def _qwen_image(c: dict, s: Shape) -> dict:
    """Qwen-Image (``QwenImagePipeline``): 8x VAE, 2x2 packing, the text's padding mask."""
    h, w = s.latent[1] // 2, s.latent[2] // 2
    return dict(
        hidden_states=_e(s.rows, h * w, c["in_channels"], s=s),
        timestep=_e(s.rows, s=s),
        encoder_hidden_states=_e(s.rows, s.text_tokens, c["joint_attention_dim"], s=s),
        encoder_hidden_states_mask=_e(s.rows, s.text_tokens, dtype=torch.int64, s=s),
        img_shapes=[[(1, h, w)]] * s.rows,
    )


def _z_image(c: dict, s: Shape) -> dict:
    """Z-Image (``ZImagePipeline``): 8x VAE; lists of per-sample latents and caption features."""
    return dict(
        x=[_e(c["in_channels"], 1, *s.latent[1:], s=s) for _ in range(s.rows)],
        t=_e(s.rows, dtype=torch.float32, s=s),
        cap_feats=[_e(s.text_tokens, c["cap_feat_dim"], s=s) for _ in range(s.rows)],
    )


def _sana(c: dict, s: Shape) -> dict:
    """SANA and SANA-Sprint (``SanaPipeline``, ``SanaSprintPipeline``): 32x DC-AE, the text's padding mask."""
    return dict(
        hidden_states=_e(s.rows, c["in_channels"], *s.latent[1:], s=s),
        encoder_hidden_states=_e(s.rows, s.text_tokens, c["caption_channels"], s=s),
        encoder_attention_mask=_e(s.rows, s.text_tokens, dtype=torch.int64, s=s),
        timestep=_e(s.rows, s=s),
        **({"guidance": _e(s.rows, s=s)} if c.get("guidance_embeds") else {}),
    )


def _unet(c: dict, s: Shape) -> dict:
    """SD 1.x / 2.x and SDXL (a UNet): 8x VAE; SDXL's pooled text and six time ids."""
    out = dict(
        sample=_e(s.rows, c["in_channels"], *s.latent[1:], s=s),
        timestep=_e(s.rows, s=s),
        encoder_hidden_states=_e(s.rows, s.text_tokens, c["cross_attention_dim"], s=s),
    )
    if c.get("addition_embed_type") == "text_time":
        pooled = c["projection_class_embeddings_input_dim"] - 6 * c["addition_time_embed_dim"]
        out["added_cond_kwargs"] = {"text_embeds": _e(s.rows, pooled, s=s), "time_ids": _e(s.rows, 6, s=s)}
    return out


def _wan(c: dict, s: Shape) -> dict:
    """Wan 2.1 / 2.2 (``WanPipeline``, ``WanImageToVideoPipeline``): 8x spatial and 4x temporal VAE; image-to-video
    with CLIP image tokens (257) where the config has ``image_dim``."""
    f, h, w = s.latent
    out = dict(
        hidden_states=_e(s.rows, c["in_channels"], f, h, w, s=s),
        timestep=_e(s.rows, s=s),
        encoder_hidden_states=_e(s.rows, s.text_tokens, c["text_dim"], s=s),
    )
    if c.get("image_dim"):
        out["encoder_hidden_states_image"] = _e(s.rows, 257, c["image_dim"], s=s)
    return out


def _hunyuan_video(c: dict, s: Shape) -> dict:
    """HunyuanVideo (``HunyuanVideoPipeline``): 8x spatial and 4x temporal VAE, embedded guidance."""
    f, h, w = s.latent
    return dict(
        hidden_states=_e(s.rows, c["in_channels"], f, h, w, s=s),
        timestep=_e(s.rows, s=s),
        encoder_hidden_states=_e(s.rows, s.text_tokens, c["text_embed_dim"], s=s),
        encoder_attention_mask=_e(s.rows, s.text_tokens, s=s),
        pooled_projections=_e(s.rows, c["pooled_projection_dim"], s=s),
        guidance=_e(s.rows, s=s),
    )


def _hunyuan_video15(c: dict, s: Shape) -> dict:
    """HunyuanVideo 1.5 (``HunyuanVideo15Pipeline`` and its image-to-video one): 16x spatial and 4x temporal VAE, the
    image tokens (729) and a second text stream (ByT5 glyph tokens: :data:`GLYPH_TOKENS`, or the text stream's tokens if
    fewer, as :meth:`flowrl.models.HunyuanVideo15Model.encode` caps them)."""
    f, h, w = s.latent
    glyphs = min(GLYPH_TOKENS, s.text_tokens)
    return dict(
        hidden_states=_e(s.rows, c["in_channels"], f, h, w, s=s),
        image_embeds=_e(s.rows, 729, c["image_embed_dim"], s=s),
        timestep=_e(s.rows, s=s),
        encoder_hidden_states=_e(s.rows, s.text_tokens, c["text_embed_dim"], s=s),
        encoder_attention_mask=_e(s.rows, s.text_tokens, s=s),
        encoder_hidden_states_2=_e(s.rows, glyphs, c["text_embed_2_dim"], s=s),
        encoder_attention_mask_2=_e(s.rows, glyphs, s=s),
    )


def _ltx(c: dict, s: Shape) -> dict:
    """LTX-Video (``LTXPipeline``): 32x spatial and 8x temporal VAE, tokens of one latent pixel."""
    f, h, w = s.latent
    return dict(
        hidden_states=_e(s.rows, f * h * w, c["in_channels"], s=s),
        encoder_hidden_states=_e(s.rows, s.text_tokens, c["caption_channels"], s=s),
        timestep=_e(s.rows, s=s),
        encoder_attention_mask=_e(s.rows, s.text_tokens, s=s),
        num_frames=f,
        height=h,
        width=w,
        rope_interpolation_scale=(8 / 25, 32, 32),
    )


INPUTS = {
    "SD3Transformer2DModel": _sd3,
    "FluxTransformer2DModel": _flux,
    "Flux2Transformer2DModel": _flux2,
    "QwenImageTransformer2DModel": _qwen_image,
    "ZImageTransformer2DModel": _z_image,
    "SanaTransformer2DModel": _sana,
    "UNet2DConditionModel": _unet,
    "WanTransformer3DModel": _wan,
    "HunyuanVideoTransformer3DModel": _hunyuan_video,
    "HunyuanVideo15Transformer3DModel": _hunyuan_video15,
    "LTXVideoTransformer3DModel": _ltx,
}
"""The training forward's keyword arguments of each network class, ``build(config, shape) -> kwargs``, on the meta
device: the shapes the family's adapter gives it (tests/test_plan.py checks each against the adapter on its tiny
pipeline). LTX-2 (audio and video streams) is not modelled: its plan has no activations."""
