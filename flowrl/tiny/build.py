"""Regenerate every asset of the tiny world from a seed: prompts, tiny CLIP, tiny VAE, tiny SD3 model.

``python -m flowrl.tiny.build --out assets`` writes

- ``assets/prompts/{train,test}.jsonl``: GenEval-style prompt files (``flowrl.tiny.prompts``);
- ``assets/tiny-clip/``: a transformers ``CLIPModel`` + ``CLIPProcessor`` (real CLIP BPE tokenizer),
  trained contrastively on rendered scenes and their captions;
- ``assets/tiny-sd3/``: a diffusers ``StableDiffusion3Pipeline`` folder: the tiny CLIP text tower as
  both text encoders, a tiny ``AutoencoderKL`` and a tiny ``SD3Transformer2DModel`` trained with
  rectified flow on the VAE latents (no T5: encode prompts with ``max_sequence_length=0``).

Pre-training captions cover the whole world, held-out combinations included, as a web-scale
pre-training set would; the held-out split only concerns the RL prompts.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import random
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from flowrl.data import write_jsonl
from flowrl.tiny.prompts import all_metadata, split
from flowrl.tiny.render import render, sample_scene

from ..rewards.geneval.world import BACKGROUND, IMAGE_SIZE, TAGS

VAE_FACTOR = 4
"""Spatial downsampling of the tiny VAE: 64x64 scenes -> 16x16 latents. (A 2x VAE with 32x32x4 latents
and patch 4 was tried: after 1000 transformer steps it drew fragments, worse than 4x.)"""

LATENT_CHANNELS = 8
"""Channels of the tiny VAE's latents."""

LATENT_SIZE = IMAGE_SIZE // VAE_FACTOR

PATCH_SIZE = 2
"""Transformer patch side in latent pixels: 8x8 = 64 image tokens."""

MAX_TOKENS = 16
"""Token length of the tiny tokenizer (the longest world prompt takes 13 with BOS/EOS)."""


def build_tokenizer():
    """The real CLIP BPE tokenizer (49408 tokens), built offline from open_clip's merges file.

    Returns:
        ``transformers.CLIPTokenizer`` with ``model_max_length = MAX_TOKENS``.
    """
    import open_clip
    from transformers import CLIPTokenizer

    with gzip.open(open_clip.tokenizer.default_bpe(), "rt", encoding="utf-8") as f:
        lines = f.read().split("\n")[1 : 49152 - 256 - 2 + 1]  # CLIP's merges; line 0 is a header
    merges = [tuple(line.split()) for line in lines]
    alphabet = list(_bytes_to_unicode().values())
    tokens = alphabet + [c + "</w>" for c in alphabet] + ["".join(m) for m in merges]
    tokens += ["<|startoftext|>", "<|endoftext|>"]
    tok = CLIPTokenizer(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, model_max_length=MAX_TOKENS)
    return tok


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2/CLIP's reversible byte -> printable unicode map (the BPE alphabet, in CLIP's order)."""
    bs = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def render_dataset(n: int, seed: int, tag_weights: dict[str, float] | None = None) -> tuple[torch.Tensor, list[str]]:
    """Render ``n`` captioned scenes, tags uniform (or drawn with ``tag_weights``), prompts uniform within a tag.

    Args:
        tag_weights: relative weight (>= 0) per GenEval tag; a tag left out gets 0. None: uniform.

    Returns:
        ``(images, captions)``: uint8 tensor ``(n, 3, 64, 64)`` and ``n`` prompt strings.

    Raises:
        ValueError: for an unknown tag, a negative weight, or weights that sum to 0.
    """
    if tag_weights is not None:
        unknown = set(tag_weights) - set(TAGS)
        if unknown or min(tag_weights.values(), default=0) < 0 or sum(tag_weights.values()) <= 0:
            raise ValueError(
                f"tag_weights must give tags of {list(TAGS)} weights >= 0 with a positive sum; got {tag_weights}"
            )
    rng = random.Random(seed)
    by_tag = {t: [m for m in all_metadata() if m["tag"] == t] for t in TAGS}
    weights = None if tag_weights is None else [tag_weights.get(t, 0.0) for t in TAGS]
    images = np.empty((n, IMAGE_SIZE, IMAGE_SIZE, 3), np.uint8)
    captions = []
    for i in range(n):
        tag = rng.choice(TAGS) if weights is None else rng.choices(TAGS, weights)[0]
        meta = rng.choice(by_tag[tag])
        images[i] = render(sample_scene(meta, rng))
        captions.append(meta["prompt"])
    return torch.from_numpy(images).permute(0, 3, 1, 2).contiguous(), captions


def _batches(n: int, batch: int, steps: int, gen: torch.Generator):
    for _ in range(steps):
        yield torch.randint(0, n, (batch,), generator=gen)


def _optimizer_step(loss, params, opt, sched, bar, max_grad_norm: float | None = None) -> None:
    """Backward, optional gradient clipping of the parameters ``params``, optimizer and scheduler step, and every 25
    steps (counted by the scheduler: ``bar.n`` only moves when the bar redraws) the step's loss on the bar."""
    opt.zero_grad(set_to_none=True)
    loss.backward()
    if max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
    opt.step()
    sched.step()
    if sched.last_epoch % 25 == 1:  # steps 1, 26, 51, ...: reading the loss waits for the device
        bar.set_postfix(loss=f"{loss.item():.4f}")


def _to_float(images: torch.Tensor) -> torch.Tensor:
    return images.float() / 127.5 - 1.0  # (B, 3, H, W) in [-1, 1]


def train_clip(images, captions, tokenizer, steps: int, seed: int, batch: int = 256):
    """Contrastive (CLIP, arXiv 2103.00020) training of a tiny ``CLIPModel`` on scenes and captions.

    Args:
        images: uint8 ``(N, 3, 64, 64)``; captions: ``N`` strings.

    Returns:
        The trained ``CLIPModel`` (float32, eval mode).
    """
    from transformers import CLIPConfig, CLIPModel

    torch.manual_seed(seed)
    text = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        max_position_embeddings=MAX_TOKENS,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    vision = dict(
        hidden_size=64,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        image_size=IMAGE_SIZE,
        patch_size=8,
    )
    model = CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=64))
    unique = sorted(set(captions))
    ids = tokenizer(
        unique, padding="max_length", max_length=MAX_TOKENS, truncation=True, return_tensors="pt"
    ).input_ids
    index = {c: i for i, c in enumerate(unique)}
    cap_idx = torch.tensor([index[c] for c in captions])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-3, total_steps=steps, pct_start=0.1)
    mean, std = torch.tensor([0.5, 0.5, 0.5]).view(1, 3, 1, 1), torch.tensor([0.5, 0.5, 0.5]).view(1, 3, 1, 1)
    gen = torch.Generator().manual_seed(seed)
    model.train()
    bar = tqdm(_batches(len(captions), batch, steps, gen), total=steps, desc="tiny CLIP")
    for idx in bar:
        pix = (images[idx].float() / 255 - mean) / std  # (B, 3, 64, 64)
        tok = ids[cap_idx[idx]]  # (B, T)
        same = cap_idx[idx][:, None] == cap_idx[idx][None, :]  # duplicate captions are positives too
        out = model(input_ids=tok, pixel_values=pix)  # float32: bf16 autocast is slower here
        logits = out.logits_per_image.float()  # (B, B)
        target = same.float() / same.sum(1, keepdim=True)
        loss = (F.cross_entropy(logits, target) + F.cross_entropy(logits.T, target)) / 2
        _optimizer_step(loss, model.parameters(), opt, sched, bar)
    return model.eval()


def train_vae(images, steps: int, seed: int, batch: int = 32):
    """Train a tiny ``AutoencoderKL`` (``VAE_FACTOR`` downsampling, ``LATENT_CHANNELS`` channels) on scenes.

    Loss: L1 + MSE reconstruction, weighted 10x on object pixels so that small shapes are not averaged
    into the background, plus a 1e-6-weighted KL. Sets ``shift_factor`` and
    ``scaling_factor`` in its config so that scaled latents have zero mean and unit variance, as SD3's.

    Returns:
        The trained ``AutoencoderKL`` (float32, eval mode).
    """
    from diffusers import AutoencoderKL

    torch.manual_seed(seed)
    levels = int(math.log2(VAE_FACTOR)) + 1
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * levels,
        up_block_types=("UpDecoderBlock2D",) * levels,
        block_out_channels=(32, 64, 64, 64)[:levels],
        layers_per_block=1,
        latent_channels=LATENT_CHANNELS,
        norm_num_groups=16,
        sample_size=IMAGE_SIZE,
    )
    background = _to_float(torch.tensor(BACKGROUND, dtype=torch.uint8).view(1, 3, 1, 1))
    opt = torch.optim.AdamW(vae.parameters(), lr=1e-3, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-3, total_steps=steps, pct_start=0.05)
    gen = torch.Generator().manual_seed(seed)
    vae.train()
    bar = tqdm(_batches(len(images), batch, steps, gen), total=steps, desc="tiny VAE")
    for idx in bar:
        x = _to_float(images[idx])  # (B, 3, 64, 64)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            post = vae.encode(x).latent_dist
            z = post.sample(generator=gen)
            rec = vae.decode(z).sample.float()
        kl = post.kl().mean() / z[0].numel()
        weight = 1 + 9 * ((x - background).abs().amax(1, keepdim=True) > 0.1).float()  # (B, 1, H, W): objects x10
        loss = (weight * ((rec - x).abs() + (rec - x) ** 2)).mean() + 1e-6 * kl
        _optimizer_step(loss, vae.parameters(), opt, sched, bar, max_grad_norm=1.0)
    vae.eval()
    with torch.no_grad():
        z = encode_latents(vae, images[:2048])
    vae.register_to_config(shift_factor=float(z.mean()), scaling_factor=float(1.0 / z.std()))
    return vae


@torch.no_grad()
def encode_latents(vae, images: torch.Tensor, batch: int = 256) -> torch.Tensor:
    """Unscaled latent means of uint8 images ``(N, 3, 64, 64)`` -> float32 ``(N, LATENT_CHANNELS, LATENT_SIZE, LATENT_SIZE)``."""
    return torch.cat(
        [
            vae.encode(_to_float(images[i : i + batch]).to(vae.device)).latent_dist.mean.cpu()
            for i in range(0, len(images), batch)
        ]
    )


def check_transformer_size(num_layers: int, width: int) -> None:
    """Check the size of a new :func:`tiny_transformer`.

    Raises:
        ValueError: if ``num_layers < 1`` or ``width`` is not a positive multiple of 32 (heads of 32 features).
    """
    if width < 32 or width % 32 or num_layers < 1:
        raise ValueError(
            f"the transformer needs num_layers >= 1 and a width that is a positive multiple of 32; "
            f"got num_layers={num_layers}, width={width}"
        )


def tiny_transformer(
    joint_attention_dim: int, pooled_projection_dim: int, seed: int, num_layers: int = 5, width: int = 128
):
    """A freshly initialised tiny ``SD3Transformer2DModel`` (8x8 image tokens, attention heads of 32 features).

    Args:
        num_layers: joint transformer blocks (the shipped model has 5).
        width: hidden size, a positive multiple of 32 (the shipped model has 128, i.e. 4 heads).

    Raises:
        ValueError: if ``width`` is not a positive multiple of 32 or ``num_layers < 1``.
    """
    from diffusers import SD3Transformer2DModel

    check_transformer_size(num_layers, width)
    torch.manual_seed(seed)
    return SD3Transformer2DModel(
        sample_size=LATENT_SIZE,
        patch_size=PATCH_SIZE,
        in_channels=LATENT_CHANNELS,
        num_layers=num_layers,
        attention_head_dim=32,
        num_attention_heads=width // 32,
        joint_attention_dim=joint_attention_dim,
        caption_projection_dim=width,
        pooled_projection_dim=pooled_projection_dim,
        out_channels=LATENT_CHANNELS,
        pos_embed_max_size=LATENT_SIZE,
        qk_norm="rms_norm",
    )


def clip_condition(text_encoder, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """SD3's CLIP conditioning of the tiny pipeline (both CLIP slots hold the same tower), differentiably.

    Mirrors ``StableDiffusion3Pipeline.encode_prompt`` with ``max_sequence_length=0`` and no T5: the
    penultimate hidden states of the tower in the CLIP-L and CLIP-G slots concatenated on features, and
    the projected pooled embeddings concatenated likewise.

    Args:
        text_encoder: a ``CLIPTextModelWithProjection`` (hidden size D, projection P).
        input_ids: long ``(B, MAX_TOKENS)`` token ids padded to ``MAX_TOKENS``.

    Returns:
        ``(cond, pooled)``: float ``(B, MAX_TOKENS, 2 D)`` and ``(B, 2 P)``.
    """
    out = text_encoder(input_ids, output_hidden_states=True)
    hidden = out.hidden_states[-2]  # (B, T, D)
    return torch.cat([hidden, hidden], dim=-1), torch.cat([out.text_embeds, out.text_embeds], dim=-1)


@dataclass(frozen=True)
class TransformerTraining:
    """How :func:`train_transformer` trains (its keyword options).

    Attributes:
        steps (`int`): optimizer steps; seed (`int`): the CPU generator of the batches, times and noise.
        batch (`int`): scenes per optimizer step.
        uncond_p (`float`): probability of dropping a caption to the empty prompt (classifier-free guidance).
        lr (`float`): peak learning rate of the one-cycle schedule (5% warm-up, cosine decay to ~0).
        t_mean (`float`): mean of the logit-normal time distribution (0 = SD3's; > 0 trains more at high noise,
            where the layout and shapes are decided).
        ema_decay (`float`): in (0, 1) keeps an exponential moving average of the weights (diffusers ``EMAModel``,
            with its warm-up) and returns it, as diffusion models are sampled; 0 returns the raw weights.
        checkpoints (`Path`, optional): the model (its EMA when kept) is saved to ``checkpoints/step-K`` every
            `checkpoint_every` steps (with the text tower in ``step-K/text_encoder`` when it trains).
        text_lr (`float`): `> 0` trains the CLIP text tower jointly at that peak learning rate (the EMA covers it).
        device: where the model (and text tower) train, under bf16 autocast; the random draws stay on the CPU
            generator, so a CUDA build draws the same batches, times and noise as a CPU one.

    Raises:
        ValueError: (in `__post_init__`) if `ema_decay` is not in [0, 1).
    """

    steps: int
    seed: int
    batch: int = 128
    uncond_p: float = 0.1
    lr: float = 1e-3
    t_mean: float = 0.0
    ema_decay: float = 0.0
    checkpoints: Path | None = None
    checkpoint_every: int = 1200
    text_lr: float = 0.0
    device: str | torch.device = "cpu"

    def __post_init__(self):
        if not 0.0 <= self.ema_decay < 1.0:
            raise ValueError(f"ema_decay must be in [0, 1), got {self.ema_decay}")


def train_transformer(model, latents, cond, pooled, cap_idx, text_encoder=None, input_ids=None, **options):
    """Rectified-flow training (SD3, arXiv 2403.03206) of a tiny ``SD3Transformer2DModel``.

    x_t = (1 - t) x_0 + t eps, t ~ logit-normal(t_mean, 1); loss = |v_theta(x_t, t) - (eps - x_0)|^2. Captions
    are dropped to the empty prompt with probability ``uncond_p`` for classifier-free guidance.

    Args:
        model: an ``SD3Transformer2DModel`` (see :func:`tiny_transformer`).
        latents: scaled latents ``(N, LATENT_CHANNELS, LATENT_SIZE, LATENT_SIZE)`` float32.
        cond: ``(P, T, D)`` prompt embeddings of the P unique captions; row 0 is the empty prompt.
        pooled: ``(P, D_pooled)`` pooled embeddings.
        cap_idx: ``(N,)`` long, caption row of each latent.
        text_encoder, input_ids: with ``text_lr > 0`` the CLIP text tower (a ``CLIPTextModelWithProjection``) that
            trains jointly; ``cond`` and ``pooled`` are then recomputed every step by :func:`clip_condition` from
            ``input_ids`` ``(P, MAX_TOKENS)`` (the token ids of the same P rows).
        **options: :class:`TransformerTraining`'s fields (``steps`` and ``seed`` required).

    Returns:
        ``model``, trained in place (float32, eval mode, moved to ``device``), holding the EMA weights when ``ema_decay > 0``
        (``text_encoder`` likewise, when it trains).

    Raises:
        ValueError: as :class:`TransformerTraining`, or ``text_lr > 0`` without ``text_encoder`` and ``input_ids``.
    """
    s = TransformerTraining(**options)
    joint = s.text_lr > 0
    if joint and (text_encoder is None or input_ids is None):
        raise ValueError("text_lr > 0 trains the text tower: pass text_encoder and input_ids too")
    device = torch.device(s.device)
    towers = [model.to(device)] + ([text_encoder.to(device)] if joint else [])
    latents, cap_idx, cond, pooled, input_ids = (
        None if x is None else x.to(device) for x in (latents, cap_idx, cond, pooled, input_ids)
    )
    params, opt, sched, ema = _transformer_optimizer(towers, s)
    gen = torch.Generator().manual_seed(s.seed)
    model.train()
    bar = tqdm(_batches(len(latents), s.batch, s.steps, gen), total=s.steps, desc="tiny SD3 transformer")
    for done, idx in enumerate(bar, 1):
        x0, eps, t, xt, rows = _noised_batch(latents, cap_idx, idx.to(device), gen, s.t_mean, s.uncond_p)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            c, p = clip_condition(text_encoder, input_ids[rows]) if joint else (cond[rows], pooled[rows])
            v = model(
                hidden_states=xt, encoder_hidden_states=c, pooled_projections=p, timestep=t * 1000
            ).sample.float()
        _optimizer_step(F.mse_loss(v, eps - x0), params, opt, sched, bar, max_grad_norm=1.0)
        if ema is not None:
            ema.step(params)
        if s.checkpoints is not None and done % s.checkpoint_every == 0:
            _save_checkpoint(s.checkpoints / f"step-{done}", model, text_encoder if joint else None, params, ema)
    if ema is not None:
        ema.copy_to(params)
    if joint:
        text_encoder.eval().requires_grad_(False)
    return model.eval()


def _transformer_optimizer(towers: list, s: TransformerTraining):
    """The parameters of `towers` (the transformer, then the text tower when it trains, set to train mode), AdamW
    over them (learning rates ``s.lr`` and ``s.text_lr``) with its one-cycle schedule, and the EMA (or None).

    Returns:
        ``(params, optimizer, scheduler, ema)``.
    """
    from diffusers.training_utils import EMAModel

    groups = [{"params": list(towers[0].parameters()), "lr": s.lr}]
    if len(towers) > 1:
        towers[1].train().requires_grad_(True)
        groups.append({"params": list(towers[1].parameters()), "lr": s.text_lr})
    params = [q for g in groups for q in g["params"]]
    ema = EMAModel(params, decay=s.ema_decay, use_ema_warmup=True) if s.ema_decay > 0 else None
    opt = torch.optim.AdamW(groups, weight_decay=0.0, betas=(0.9, 0.99))
    sched = torch.optim.lr_scheduler.OneCycleLR(
        opt, max_lr=[g["lr"] for g in groups], total_steps=s.steps, pct_start=0.05
    )
    return params, opt, sched, ema


def _noised_batch(
    latents: torch.Tensor,
    cap_idx: torch.Tensor,
    idx: torch.Tensor,
    gen: torch.Generator,
    t_mean: float,
    uncond_p: float,
):
    """One rectified-flow training batch, drawn from the CPU generator ``gen`` (noise, then times, then the
    caption drop) and placed on the latents' device.

    Args:
        latents: ``(N, C, h, w)`` scaled latents; cap_idx: ``(N,)`` caption row of each; idx: ``(B,)`` the batch.

    Returns:
        ``(x0, eps, t, xt, rows)``: latents, noise and ``xt = (1 - t) x0 + t eps`` of shape ``(B, C, h, w)``, times
        ``t`` ``(B,)`` in (0, 1) (logit-normal with mean ``t_mean``), and caption rows ``(B,)``, 0 (the empty
        prompt) with probability ``uncond_p``.
    """
    device = latents.device
    x0 = latents[idx]
    eps = torch.randn(x0.shape, generator=gen).to(device)
    t = torch.sigmoid(t_mean + torch.randn(len(idx), generator=gen)).to(device)
    xt = (1 - t.view(-1, 1, 1, 1)) * x0 + t.view(-1, 1, 1, 1) * eps
    drop = torch.rand(len(idx), generator=gen).to(device) < uncond_p
    return x0, eps, t, xt, torch.where(drop, 0, cap_idx[idx])


def _save_checkpoint(folder: Path, model, text_encoder, params: list, ema) -> None:
    """Save ``model`` (and ``text_encoder`` in ``folder/text_encoder``, unless None) to ``folder``, holding the EMA
    weights of ``params`` while saving when ``ema`` (a diffusers ``EMAModel``) is given."""
    if ema is not None:
        ema.store(params)
        ema.copy_to(params)
    model.save_pretrained(folder)
    if text_encoder is not None:
        text_encoder.save_pretrained(folder / "text_encoder")
    if ema is not None:
        ema.restore(params)


def text_tower(folder: Path):
    """The text tower of a saved ``CLIPModel`` as a ``CLIPTextModelWithProjection`` (float32, eval)."""
    from transformers import CLIPModel, CLIPTextModelWithProjection

    clip = CLIPModel.from_pretrained(folder, dtype=torch.float32)
    config = clip.config.text_config
    config.projection_dim = clip.config.projection_dim
    tower = CLIPTextModelWithProjection(config)
    tower.text_model.load_state_dict(clip.text_model.state_dict())
    tower.text_projection.load_state_dict(clip.text_projection.state_dict())
    return tower.eval()


def _save_clip(clip, tokenizer, folder: Path) -> None:
    from transformers import CLIPImageProcessor, CLIPProcessor

    processor = CLIPProcessor(
        image_processor=CLIPImageProcessor(
            size={"shortest_edge": IMAGE_SIZE},
            crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
            image_mean=[0.5, 0.5, 0.5],
            image_std=[0.5, 0.5, 0.5],
        ),
        tokenizer=tokenizer,
    )
    clip.half().save_pretrained(folder)  # float16 on disk: the 49408-token embeddings dominate the size
    processor.save_pretrained(folder)


def build(
    out: str | Path,
    seed: int = 0,
    n_scenes: int = 20000,
    clip_steps: int = 600,
    vae_steps: int = 900,
    dit_steps: int = 3000,
    resume: bool = False,
    init: str | Path | None = None,
    dit_lr: float = 1e-3,
    dit_t_mean: float = 0.0,
    dit_batch: int = 128,
    dit_ema: float = 0.0,
    text_lr: float = 0.0,
    tag_weights: dict[str, float] | None = None,
    device: str = "cpu",
    fresh_transformer: bool = False,
    dit_layers: int = 5,
    dit_width: int = 128,
) -> dict:
    """Regenerate every asset under ``out`` (see the module docstring); returns the wall times in seconds.

    ``resume`` keeps the stages an interrupted build finished (``out/tiny-clip``, the VAE in
    ``out/.build-cache``) instead of training them again. ``init`` (a finished ``tiny-sd3`` folder)
    continues training its transformer for ``dit_steps`` more steps (peak learning rate ``dit_lr``)
    with its VAE and text towers; the CLIP must then already be in ``out/tiny-clip``. ``text_lr > 0``
    trains the pipeline's text tower jointly with the transformer (see :func:`train_transformer`); the
    contrastive tiny CLIP in ``out/tiny-clip`` (the ``clipscore`` reward's default) is left as it was.
    ``tag_weights`` draws the scenes' tags with those weights (:func:`render_dataset`; None: uniform).
    ``device`` (``cpu``, ``cuda``) is where the transformer stage runs. ``fresh_transformer`` with ``init``
    keeps ``init``'s VAE and text tower but trains a new transformer of ``dit_layers`` blocks and width
    ``dit_width`` (:func:`tiny_transformer`), as does a build without ``init``.
    """
    out, times = Path(out), {}
    with _timed(times, "render_s"):
        images, captions = _prompts_and_scenes(out, seed, n_scenes, tag_weights)
    with _timed(times, "clip_s"):
        tokenizer = _clip_stage(out, images, captions, clip_steps, seed, resume)
    with _timed(times, "vae_s"):
        vae = _vae_stage(out, images, vae_steps, seed, resume, init)
    with _timed(times, "transformer_s"):
        text_encoder, transformer = _transformer_stage(
            out,
            images,
            captions,
            tokenizer,
            vae,
            init,
            dit_steps,
            seed,
            batch=dit_batch,
            lr=dit_lr,
            t_mean=dit_t_mean,
            ema_decay=dit_ema,
            text_lr=text_lr,
            device=device,
            fresh=fresh_transformer,
            layers=dit_layers,
            width=dit_width,
        )
    _save_pipeline(out / "tiny-sd3", transformer, vae, text_encoder, tokenizer)
    settings = {
        "seed": seed,
        "n_scenes": n_scenes,
        "clip_steps": clip_steps,
        "reused_clip": resume,
        "vae_steps": vae_steps,
        "dit_steps": dit_steps,
        "dit_lr": dit_lr,
        "dit_t_mean": dit_t_mean,
        "dit_batch": dit_batch,
        "dit_ema": dit_ema,
        "text_lr": text_lr,
        "tag_weights": tag_weights,
        "fresh_transformer": fresh_transformer,
        "dit_layers": transformer.config.num_layers,
        "dit_width": transformer.config.caption_projection_dim,
        "device": device,
        "init": None if init is None else str(init),
    }
    _write_build_json(out / "tiny-sd3", settings, times, init)
    return times


@contextmanager
def _timed(times: dict[str, float], key: str):
    """Store the wall time of the ``with`` body, in seconds, as ``times[key]`` (not when the body raises)."""
    t0 = time.time()
    yield
    times[key] = time.time() - t0


def _prompts_and_scenes(out: Path, seed: int, n_scenes: int, tag_weights: dict[str, float] | None):
    """The data stage: write the RL prompt files and render the pre-training scenes.

    Writes ``out/prompts/{train,test}.jsonl``, the GenEval-style prompts split by ``seed``
    (:func:`flowrl.tiny.prompts.split`), then renders ``n_scenes`` captioned scenes with :func:`render_dataset`.

    Returns:
        ``(images, captions)``: uint8 tensor ``(n_scenes, 3, 64, 64)`` and ``n_scenes`` prompt strings.

    Raises:
        ValueError: for bad ``tag_weights`` (see :func:`render_dataset`), once the prompt files are written.
    """
    train, test = split(seed)
    (out / "prompts").mkdir(parents=True, exist_ok=True)
    write_jsonl(train, out / "prompts" / "train.jsonl")
    write_jsonl(test, out / "prompts" / "test.jsonl")
    return render_dataset(n_scenes, seed, tag_weights)


def _clip_stage(out: Path, images: torch.Tensor, captions: list[str], steps: int, seed: int, resume: bool):
    """The tiny CLIP stage: train it (:func:`train_clip`, ``steps`` steps) and save it in ``out/tiny-clip``,
    unless ``resume`` finds ``out/tiny-clip/model.safetensors`` there already.

    Args:
        images: uint8 ``(N, 3, 64, 64)`` scenes; captions: their ``N`` prompt strings.

    Returns:
        The CLIP BPE tokenizer (:func:`build_tokenizer`), which the pipeline shares.
    """
    tokenizer = build_tokenizer()
    if not (resume and (out / "tiny-clip" / "model.safetensors").is_file()):
        _save_clip(train_clip(images, captions, tokenizer, steps, seed), tokenizer, out / "tiny-clip")
    return tokenizer


def _vae_stage(out: Path, images: torch.Tensor, steps: int, seed: int, resume: bool, init: str | Path | None):
    """The VAE stage: the ``init`` pipeline's VAE; else, with ``resume``, the one an interrupted build cached in
    ``out/.build-cache/vae``; else one trained on ``images`` (uint8 ``(N, 3, 64, 64)``) by :func:`train_vae` for
    ``steps`` steps and cached there.

    Returns:
        The ``AutoencoderKL`` (float32, eval mode).
    """
    from diffusers import AutoencoderKL

    cache = out / ".build-cache" / "vae"
    if init is not None:
        return AutoencoderKL.from_pretrained(Path(init) / "vae", dtype=torch.float32).eval()
    if resume and (cache / "config.json").is_file():
        return AutoencoderKL.from_pretrained(cache).eval()
    vae = train_vae(images, steps, seed)
    vae.save_pretrained(cache)
    return vae


def _transformer_stage(
    out: Path,
    images: torch.Tensor,
    captions: list[str],
    tokenizer,
    vae,
    init: str | Path | None,
    steps: int,
    seed: int,
    *,
    batch: int,
    lr: float,
    t_mean: float,
    ema_decay: float,
    text_lr: float,
    device: str = "cpu",
    fresh: bool = False,
    layers: int = 5,
    width: int = 128,
):
    """The transformer stage: rectified-flow training (:func:`train_transformer`) on the scenes' VAE latents.

    The text tower and transformer come from :func:`_text_encoder_and_transformer`; checkpoints go to
    ``out/.build-cache/transformer/step-K`` every ``max(1, steps // 6)`` steps.

    Args:
        images: uint8 ``(N, 3, 64, 64)`` scenes; captions: their ``N`` prompt strings.
        tokenizer: the CLIP tokenizer of :func:`build_tokenizer`; vae: the trained ``AutoencoderKL``.
        batch, lr, t_mean, ema_decay, text_lr, device: :func:`train_transformer`'s, as ``build``'s ``dit_*``,
            ``text_lr`` and ``device``.
        fresh, layers, width: :func:`_text_encoder_and_transformer`'s.

    Returns:
        ``(text_encoder, transformer)``, float32, eval mode and on the CPU, trained in place.
    """
    text_encoder, transformer = _text_encoder_and_transformer(out, init, seed, fresh, layers, width)
    input_ids, cap_idx = _caption_rows(tokenizer, captions)
    with torch.no_grad():
        cond, pooled = clip_condition(text_encoder, input_ids)  # the pipeline's encode_prompt (tested equal)
    latents = encode_latents(vae.to(device), images)
    vae.cpu()
    latents = (latents - vae.config.shift_factor) * vae.config.scaling_factor  # (N, C, h, w)
    train_transformer(
        transformer,
        latents,
        cond.float(),
        pooled.float(),
        cap_idx,
        steps=steps,
        seed=seed,
        batch=batch,
        lr=lr,
        checkpoints=out / ".build-cache" / "transformer",
        t_mean=t_mean,
        ema_decay=ema_decay,
        checkpoint_every=max(1, steps // 6),
        text_encoder=text_encoder,
        input_ids=input_ids,
        text_lr=text_lr,
        device=device,
    )
    return text_encoder.cpu(), transformer.cpu()


def _text_encoder_and_transformer(
    out: Path, init: str | Path | None, seed: int, fresh: bool = False, layers: int = 5, width: int = 128
):
    """The pipeline's text tower and transformer before training, both float32.

    With ``init``: its ``text_encoder`` (eval mode) and ``transformer``, to train on (with ``fresh``, a new
    :func:`tiny_transformer` of ``layers`` blocks and width ``width`` instead). Without: the text tower of
    the tiny CLIP in ``out/tiny-clip`` (:func:`text_tower`) and a fresh :func:`tiny_transformer` seeded with
    ``seed``, sized for that tower in both CLIP slots.

    Returns:
        ``(text_encoder, transformer)``: a ``CLIPTextModelWithProjection`` and an ``SD3Transformer2DModel``.
    """
    if init is not None:
        from diffusers import SD3Transformer2DModel
        from transformers import CLIPTextModelWithProjection

        text_encoder = CLIPTextModelWithProjection.from_pretrained(
            Path(init) / "text_encoder", dtype=torch.float32
        ).eval()
        if not fresh:
            return text_encoder, SD3Transformer2DModel.from_pretrained(Path(init) / "transformer", dtype=torch.float32)
    else:
        text_encoder = text_tower(out / "tiny-clip")
    joint = text_encoder.config.hidden_size * 2  # CLIP-L and CLIP-G slots, both the tiny tower
    return text_encoder, tiny_transformer(joint, text_encoder.config.projection_dim * 2, seed, layers, width)


def _caption_rows(tokenizer, captions: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids of the empty prompt and the sorted unique captions, and each caption's row among them.

    Returns:
        ``(input_ids, cap_idx)``: long ``(P, MAX_TOKENS)`` with row 0 the empty prompt (for classifier-free
        guidance), and long ``(N,)`` row of each of the ``N`` captions.
    """
    unique = [""] + sorted(set(captions))
    input_ids = tokenizer(
        unique, padding="max_length", max_length=MAX_TOKENS, truncation=True, return_tensors="pt"
    ).input_ids  # (P, MAX_TOKENS)
    index = {c: i for i, c in enumerate(unique)}
    return input_ids, torch.tensor([index[c] for c in captions])


def _save_pipeline(folder: Path, transformer, vae, text_encoder, tokenizer) -> None:
    """Write the ``StableDiffusion3Pipeline`` folder: the tiny text tower and tokenizer in both CLIP slots, no T5,
    Euler flow-matching scheduler (shift 1).

    Converts the models in place. The transformer and VAE are stored in float16, which diffusers loads into
    float32 when no ``torch_dtype`` is given. The text tower is stored in float32 (its config's ``dtype``):
    transformers loads a model in its config's dtype, and a float16 text tower then feeds float16
    embeddings into the float32 transformer of a stock ``StableDiffusion3Pipeline.from_pretrained(folder)``.
    """
    from diffusers import FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline

    pipe = StableDiffusion3Pipeline(
        transformer=transformer.half(),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=1.0),
        vae=vae.half(),
        text_encoder=text_encoder.float(),
        tokenizer=tokenizer,
        text_encoder_2=text_encoder,
        tokenizer_2=tokenizer,
        text_encoder_3=None,
        tokenizer_3=None,
    )
    pipe.save_pretrained(folder)


def _write_build_json(folder: Path, settings: dict, times: dict[str, float], init: str | Path | None) -> None:
    """Write ``folder/build.json``: ``settings`` in their order, then ``times_s`` (stage wall times in seconds),
    the ``command`` line and ``init_build``, the ``init`` pipeline's own ``build.json`` (or None)."""
    record = {
        **settings,
        "times_s": times,
        "command": "python -m flowrl.tiny.build " + " ".join(sys.argv[1:]),
        "init_build": _read_build(init),
    }
    (folder / "build.json").write_text(json.dumps(record, indent=1))


def _read_build(init: str | Path | None) -> dict | None:
    """The ``build.json`` of the ``init`` pipeline folder (nested in the new one), or None."""
    path = None if init is None else Path(init) / "build.json"
    return json.loads(path.read_text()) if path is not None and path.is_file() else None


def builder_parser(doc: str, folder: str) -> argparse.ArgumentParser:
    """An asset builder's command line, described by the first line of `doc`, with the arguments every builder takes:
    ``--out`` (the folder the pipeline folder `folder` is built in), ``--overwrite`` and ``--seed``."""
    p = argparse.ArgumentParser(
        description=doc.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )  # every option's help ends with its default
    p.add_argument("--out", default="assets", help=f"folder of the built assets ({folder} inside it)")
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace a finished build in --out (the shipped model, with the default --out)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the data, the initial weights and every draw")
    return p


def refuse_finished_build(p: argparse.ArgumentParser, out: str, folder: str, allowed: bool, other: str = "") -> None:
    """Stop with a usage error (exit 2) before any work when ``out/folder`` holds a finished build (its
    ``model_index.json``) and replacing it is not `allowed`; `other` names another way out in the message."""
    if (Path(out) / folder / "model_index.json").is_file() and not allowed:
        p.error(
            f"--out {out} holds a finished build ({Path(out) / folder}, the shipped model with the default "
            f"--out): pass --overwrite to replace it{other}, or --out another folder"
        )


def main(argv=None) -> None:
    p = builder_parser(__doc__, "tiny-sd3")
    p.add_argument("--n-scenes", type=int, default=20000, help="rendered training scenes")
    p.add_argument("--clip-steps", type=int, default=600, help="tiny CLIP optimizer steps")
    p.add_argument("--vae-steps", type=int, default=900, help="tiny VAE optimizer steps")
    p.add_argument("--dit-steps", type=int, default=3000, help="transformer optimizer steps")
    p.add_argument("--dit-lr", type=float, default=1e-3, help="peak learning rate of the transformer")
    p.add_argument("--dit-t-mean", type=float, default=0.0, help="logit-normal mean of the training times")
    p.add_argument("--dit-batch", type=int, default=128, help="scenes per transformer optimizer step")
    p.add_argument("--dit-ema", type=float, default=0.0, help="EMA decay of the transformer weights (0: none)")
    p.add_argument(
        "--text-lr",
        type=float,
        default=0.0,
        help="peak learning rate of the pipeline's text tower, trained jointly with the transformer (0: frozen)",
    )
    p.add_argument(
        "--tag-weights",
        nargs="+",
        default=None,
        metavar="TAG=W",
        help="draw the scenes' tags with these relative weights (tags left out: 0; default: uniform)",
    )
    p.add_argument("--resume", action="store_true", help="keep the stages an interrupted build finished")
    p.add_argument("--init", default=None, help="a finished tiny-sd3 folder: keep its VAE, continue its transformer")
    p.add_argument(
        "--fresh-transformer",
        action="store_true",
        help="with --init: keep its VAE and text tower but train a new transformer",
    )
    p.add_argument("--dit-layers", type=int, default=5, help="blocks of a new transformer")
    p.add_argument("--dit-width", type=int, default=128, help="hidden size of a new transformer (a multiple of 32)")
    p.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="where the transformer trains (auto: cuda when available)",
    )
    a = p.parse_args(argv)
    refuse_finished_build(p, a.out, "tiny-sd3", a.overwrite or a.resume, " (or --resume to continue it)")
    if a.fresh_transformer and a.init is None:
        p.error("--fresh-transformer keeps the VAE and text tower of an --init pipeline folder; pass --init")
    if a.init is not None and not a.fresh_transformer and (a.dit_layers, a.dit_width) != (5, 128):
        p.error("--dit-layers / --dit-width size a new transformer: with --init they need --fresh-transformer")
    try:
        check_transformer_size(a.dit_layers, a.dit_width)
    except ValueError as e:
        p.error(f"--dit-layers / --dit-width: {e}")
    from flowrl.models import resolve_device

    try:
        device = resolve_device(a.device)
    except ValueError as e:
        p.error(str(e))
    weights = None
    if a.tag_weights:
        try:
            weights = {k: float(v) for k, v in (item.split("=", 1) for item in a.tag_weights)}
        except ValueError:
            p.error(f"--tag-weights takes TAG=WEIGHT items, e.g. two_object=2; got {a.tag_weights}")
    print(
        build(
            a.out,
            a.seed,
            a.n_scenes,
            a.clip_steps,
            a.vae_steps,
            a.dit_steps,
            a.resume,
            a.init,
            a.dit_lr,
            a.dit_t_mean,
            a.dit_batch,
            a.dit_ema,
            a.text_lr,
            weights,
            device,
            a.fresh_transformer,
            a.dit_layers,
            a.dit_width,
        )
    )


if __name__ == "__main__":
    main()
