"""What the tiny pipelines and their stock references share: the noise flowrl's sampling draws, the stock pipeline
loader and the small VAE settings of the SD3 / FLUX / SDXL / Z-Image pipelines."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]

AUTOENCODER_KL = dict(
    in_channels=3,
    out_channels=3,
    down_block_types=("DownEncoderBlock2D",) * 3,
    up_block_types=("UpDecoderBlock2D",) * 3,
    block_out_channels=(8, 16, 16),
    layers_per_block=1,
    latent_channels=4,
    norm_num_groups=8,
)
"""A tiny ``AutoencoderKL`` (factor 4, 4 latent channels); each family adds its sample size and scaling factors."""

FLUX_VAE = dict(
    AUTOENCODER_KL,
    sample_size=32,
    scaling_factor=0.3611,
    shift_factor=0.1159,
    use_quant_conv=False,
    use_post_quant_conv=False,
)
"""FLUX.1's VAE settings (its scaling and shift factors, no quant convolutions) at the tiny size; Z-Image's VAE is
FLUX's."""


def noise(model, seeds: int | Iterable[int]) -> torch.Tensor:
    """The noise :func:`flowrl.evaluation.generate` draws for ``seeds`` (an int ``n``: seeds ``0..n-1``): ``(B,
    *model.latent_shape)`` float32, one ``torch.Generator().manual_seed(s)`` draw per seed."""
    seeds = range(seeds) if isinstance(seeds, int) else seeds
    return torch.stack([torch.randn(model.latent_shape, generator=torch.Generator().manual_seed(s)) for s in seeds])


def prompts_of(metas: list[dict]) -> list[str]:
    """The ``prompt`` of each prompt record."""
    return [m["prompt"] for m in metas]


def stock_pipeline(folder: Path, cls_name: str, lora: Path | None = None, **kwargs):
    """The stock diffusers pipeline ``cls_name`` loaded from ``folder`` with ``from_pretrained(folder, **kwargs)``,
    its progress bar off; ``lora``: a LoRA folder it loads with ``load_lora_weights``."""
    import diffusers

    pipe = getattr(diffusers, cls_name).from_pretrained(folder, **kwargs)
    pipe.set_progress_bar_config(disable=True)
    if lora is not None:
        pipe.load_lora_weights(str(lora))
    return pipe


def sized(model, num_steps: int, length: bool = True, frames: bool = False) -> dict:
    """The stock call's keyword arguments for flowrl's ``model`` loaded at its size: ``num_steps`` steps at its side
    (``height`` and ``width``), its prompt length where ``length`` (``max_sequence_length``), its frames where
    ``frames`` (``num_frames``), ``output_type="pt"``: float32 tensors in [0, 1]."""
    side = {"height": model.resolution, "width": model.resolution}
    if length:
        side["max_sequence_length"] = model.max_sequence_length
    if frames:
        side["num_frames"] = model.num_frames
    return {"num_inference_steps": num_steps, **side, "output_type": "pt"}


def per_record(call, metas: list[dict], noise: torch.Tensor) -> torch.Tensor:
    """``call(meta, latents)`` for each record with its own noise ``(1, *latent_shape)`` (pipelines that take one
    source image a call), without gradients; the outputs concatenated along the batch."""
    with torch.no_grad():
        return torch.cat([call(meta, z[None]) for meta, z in zip(metas, noise)])


def stock_text_to_video(
    cls_name: str, folder, model, metas, noise, num_steps, guidance_scale, negative_prompt=None, lora=None, **kwargs
) -> torch.Tensor:
    """The text-to-video pipeline ``cls_name``'s videos ``(B, F, 3, H, W)`` in [0, 1] for the records ``metas`` from
    the latents ``noise (B, *model.latent_shape)``, at the model's frames, side and prompt length, with
    ``negative_prompt`` for every record (None: the pipeline's default); ``lora``: a LoRA folder it loads first;
    ``kwargs``: the pipeline's own (``true_cfg_scale``)."""
    pipe = stock_pipeline(folder, cls_name, lora)
    negative = [negative_prompt] * len(metas) if negative_prompt else None
    with torch.no_grad():
        return pipe(
            prompts_of(metas),
            negative_prompt=negative,
            latents=noise,
            guidance_scale=guidance_scale,
            **sized(model, num_steps, frames=True),
            **kwargs,
        ).frames
