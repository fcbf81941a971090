"""SANA and SANA-Sprint: tiny random ``SanaPipeline`` / ``SanaSprintPipeline`` (a one-layer Gemma2 text encoder with
the offline Gemma tokenizer, a DC-AE of factor 4) and the stock pipelines' images."""

from __future__ import annotations

from pathlib import Path

import torch

from .common import prompts_of, sized, stock_pipeline
from .text import build_gemma_tokenizer, text_model_config

SIDE = 32  # px: the pipelines' unit; VAE factor 4, 8 x 8 latents


def _build(folder: Path, sprint: bool) -> Path:
    from diffusers import (
        AutoencoderDC,
        DPMSolverMultistepScheduler,
        SanaPipeline,
        SanaSprintPipeline,
        SanaTransformer2DModel,
        SCMScheduler,
    )
    from transformers import Gemma2Config, Gemma2Model

    torch.manual_seed(0)
    tok = build_gemma_tokenizer()
    te = Gemma2Model(Gemma2Config(**text_model_config(tok, 8, 1, head_dim=4)))
    vae = AutoencoderDC(
        in_channels=3,
        latent_channels=4,
        attention_head_dim=2,
        encoder_block_types=("ResBlock", "ResBlock", "EfficientViTBlock"),
        decoder_block_types=("ResBlock", "ResBlock", "EfficientViTBlock"),
        encoder_block_out_channels=(8, 8, 8),
        decoder_block_out_channels=(8, 8, 8),
        encoder_qkv_multiscales=((), (), (5,)),
        decoder_qkv_multiscales=((), (), (5,)),
        encoder_layers_per_block=(1, 1, 1),
        decoder_layers_per_block=(1, 1, 1),
        downsample_block_type="conv",
        upsample_block_type="interpolate",
        scaling_factor=0.41407,
    )
    dit = SanaTransformer2DModel(
        in_channels=4,
        out_channels=4,
        num_layers=2,
        num_attention_heads=2,
        attention_head_dim=4,
        num_cross_attention_heads=2,
        cross_attention_head_dim=4,
        cross_attention_dim=8,
        caption_channels=8,
        sample_size=SIDE // 4,
        guidance_embeds=sprint,
        qk_norm="rms_norm_across_heads" if sprint else None,
    )
    if sprint:
        scheduler = SCMScheduler(prediction_type="trigflow", sigma_data=0.5)
        cls = SanaSprintPipeline
    else:  # SANA's shipped scheduler: DPM-Solver++ with flow sigmas at flow_shift 3
        scheduler = DPMSolverMultistepScheduler(
            flow_shift=3.0, use_flow_sigmas=True, prediction_type="flow_prediction"
        )
        cls = SanaPipeline
    cls(tokenizer=tok, text_encoder=te, vae=vae, transformer=dit, scheduler=scheduler).save_pretrained(folder)
    return folder


def build_random_sana_pipeline(folder: Path) -> Path:
    """Save a random-weight SanaPipeline to ``folder`` (seeded): the tiny Gemma2 encoder (hidden 8) and
    :func:`tiny_pipelines.text.build_gemma_tokenizer`, a DC-AE of factor 4 with 4 latent channels, a two-block SANA
    transformer (8 latents a side: 32 px) and SANA's DPM-Solver flow scheduler config (flow_shift 3)."""
    return _build(folder, sprint=False)


def build_random_sana_sprint_pipeline(folder: Path) -> Path:
    """Save a random-weight SanaSprintPipeline to ``folder``: as :func:`build_random_sana_pipeline` with a
    guidance-embedding, QK-normed transformer and Sprint's TrigFlow SCM scheduler (sigma_data 0.5)."""
    return _build(folder, sprint=True)


def stock_sana(folder, model, metas, noise, num_steps, guidance_scale) -> torch.Tensor:
    """The stock SanaPipeline's images ``(B, 3, H, W)`` float32 in [0, 1] for the prompt records ``metas`` from the
    latents ``noise (B, *model.latent_shape)``, with its DPM-Solver replaced by ``FlowMatchEulerDiscreteScheduler`` at
    the folder's flow_shift (what flowrl samples with), CFG against the empty prompt, at ``model.resolution`` itself
    (no resolution binning)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    pipe = stock_pipeline(folder, "SanaPipeline")
    pipe.scheduler = FlowMatchEulerDiscreteScheduler(shift=pipe.scheduler.config.flow_shift)
    return _call(pipe, model, metas, noise, num_steps, guidance_scale=guidance_scale, negative_prompt="")


def _call(pipe, model, metas, noise, num_steps, **kwargs) -> torch.Tensor:
    """The SANA pipeline ``pipe``'s images for the records from the latents, at the model's size without resolution
    binning; ``kwargs``: its guidance arguments."""
    with torch.no_grad():
        return pipe(
            prompt=prompts_of(metas),
            latents=noise,
            use_resolution_binning=False,
            **sized(model, num_steps),
            **kwargs,
        ).images


def _deterministic_scm():
    from diffusers import SCMScheduler

    class DeterministicSCM(SCMScheduler):
        """The SCM step with the fresh noise replaced by the model's own estimate ``(x_s - cos(s) x0) / sin(s)``
        (DDIM in TrigFlow, Euler in flow variables)."""

        def step(self, model_output, timestep, sample, generator=None, return_dict=True):
            _, x0 = super().step(model_output, timestep, sample, generator, return_dict=False)
            s, t = self.timesteps[self.step_index - 1], self.timesteps[self.step_index]
            prev = t.cos() * x0 + t.sin() * (sample - s.cos() * x0) / s.sin()
            return (prev, x0)

    return DeterministicSCM


def stock_sana_sprint(
    folder, model, metas, noise, num_steps, guidance_scale, deterministic=True, generator=None
) -> torch.Tensor:
    """The stock SanaSprintPipeline's images ``(B, 3, H, W)`` float32 in [0, 1] from the unit noise ``noise (B,
    *model.latent_shape)`` (the pipeline scales it by sigma_data), at its embedded guidance scale, with its default
    angles (``intermediate_timesteps`` 1.3 at 2 steps). ``deterministic``: its SCM step with the fresh noise replaced by
    the model's own estimate (the ODE flowrl's Euler sampling follows); False: the stock stochastic step, drawing from
    ``generator`` (a ``torch.Generator``)."""
    pipe = stock_pipeline(folder, "SanaSprintPipeline")
    if deterministic:
        pipe.scheduler = _deterministic_scm().from_config(pipe.scheduler.config)
    middle = 1.3 if num_steps == 2 else None
    guidance = dict(guidance_scale=guidance_scale, intermediate_timesteps=middle, generator=generator)
    return _call(pipe, model, metas, noise, num_steps, **guidance)
