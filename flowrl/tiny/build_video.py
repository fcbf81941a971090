"""Regenerate the tiny video world's assets from a seed: prompt files and a tiny Wan-architecture pipeline.

``python -m flowrl.tiny.build_video --out assets`` writes

- ``assets/prompts/video_{train,test}.jsonl``: the motion prompts split on held-out (colour, direction) pairs
  (``flowrl.tiny.video``);
- ``assets/tiny-wan/``: a diffusers ``WanPipeline`` folder: a T5 tokenizer over the world's words (built offline), a
  tiny ``UMT5EncoderModel``, a tiny ``AutoencoderKLWan`` (4x temporal and 4x spatial compression: 9 frames of 32x32
  -> latents ``(16, 3, 8, 8)``) trained on rendered clips, and a tiny ``WanTransformer3DModel`` trained with
  rectified flow on their latents jointly with the text encoder; ``FlowMatchEulerDiscreteScheduler`` at shift 1.
  ``build.json`` records the command, seed, settings and stage wall times.

Pre-training clips cover all 160 prompts, held-out pairs included (as a web-scale pre-training set would); the
held-out split only concerns the RL prompts. Wan: arXiv 2503.20314 (``diffusers/pipelines/wan/pipeline_wan.py``);
rectified flow: arXiv 2403.03206.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from flowrl.data import write_jsonl
from flowrl.tiny.build import _optimizer_step, _timed, builder_parser, refuse_finished_build
from flowrl.tiny.video import all_metadata, render_dataset, split

from ..rewards.geneval.world import BACKGROUND, COLORS, SHAPES
from ..rewards.motion_world import DIRECTIONS, NUM_FRAMES, VIDEO_SIZE

MAX_TOKENS = 16
"""UMT5 tokens per prompt (``model.max_sequence_length``; the world's prompts take at most 7 with ``</s>``)."""
LATENT_CHANNELS = 16
"""Channels of the tiny VAE's latents."""
TEXT_DIM = 64
"""Hidden size of the tiny UMT5 encoder."""


def build_tokenizer():
    """A T5 (SentencePiece unigram) tokenizer over the world's words, built offline.

    Whole words (``"\\u2581red"``), then single letters and ``"\\u2581"`` as fall-backs, so any text tokenizes;
    ``<pad>`` = 0, ``</s>`` = 1, ``<unk>`` = 2 as in T5.

    Returns:
        ``transformers.T5Tokenizer``.
    """
    from transformers import T5Tokenizer

    words = ["a", "an", "moving", *SHAPES, *COLORS, *DIRECTIONS]
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)] + [
        ("\u2581" + w, -1.0 - 0.01 * i) for i, w in enumerate(words)
    ]
    vocab += [(c, -5.0) for c in "abcdefghijklmnopqrstuvwxyz"] + [("\u2581", -6.0)]
    return T5Tokenizer(vocab=vocab, extra_ids=0)


def tiny_text_encoder(vocab_size: int, seed: int):
    """A freshly initialised 2-layer ``UMT5EncoderModel`` of width ``TEXT_DIM`` (4 heads of 16)."""
    from transformers import UMT5Config, UMT5EncoderModel

    torch.manual_seed(seed)
    return UMT5EncoderModel(
        UMT5Config(
            vocab_size=vocab_size,
            d_model=TEXT_DIM,
            d_kv=16,
            d_ff=128,
            num_layers=2,
            num_heads=4,
            relative_attention_num_buckets=8,
            pad_token_id=0,
            eos_token_id=1,
        )
    )


def tiny_vae(seed: int):
    """A freshly initialised ``AutoencoderKLWan``: 8 base channels, two down stages compressing time and space 2x
    each (4x4x4 in all), ``LATENT_CHANNELS`` latent channels, identity latent statistics until trained."""
    from diffusers import AutoencoderKLWan

    torch.manual_seed(seed)
    return AutoencoderKLWan(
        base_dim=8,
        z_dim=LATENT_CHANNELS,
        dim_mult=[1, 2, 2],
        num_res_blocks=1,
        temperal_downsample=[True, True],
        scale_factor_spatial=4,
        scale_factor_temporal=4,
        latents_mean=[0.0] * LATENT_CHANNELS,
        latents_std=[1.0] * LATENT_CHANNELS,
    )


def tiny_transformer(seed: int, num_layers: int = 4, width: int = 64):
    """A freshly initialised ``WanTransformer3DModel``: 1x2x2 patches (48 tokens for 9 frames of 32x32), heads of 32
    features, feed-forward ``4 width``.

    Raises:
        ValueError: if ``width`` is not a positive multiple of 32 or ``num_layers < 1``.
    """
    from diffusers import WanTransformer3DModel

    if width < 32 or width % 32 or num_layers < 1:
        raise ValueError(
            f"--dit-layers must be >= 1 and --dit-width a positive multiple of 32; got {num_layers}, {width}"
        )
    torch.manual_seed(seed)
    return WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=width // 32,
        attention_head_dim=32,
        in_channels=LATENT_CHANNELS,
        out_channels=LATENT_CHANNELS,
        text_dim=TEXT_DIM,
        freq_dim=64,
        ffn_dim=4 * width,
        num_layers=num_layers,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=32,
    )


def umt5_condition(text_encoder, input_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``WanPipeline``'s prompt embeddings, differentiably: the UMT5 encoder's last hidden states, zero past each
    prompt's tokens (``_get_t5_prompt_embeds``).

    Args:
        input_ids, mask: long ``(B, MAX_TOKENS)`` token ids and attention mask, padded to ``MAX_TOKENS``.

    Returns:
        float ``(B, MAX_TOKENS, TEXT_DIM)``.
    """
    hidden = text_encoder(input_ids, mask).last_hidden_state  # (B, T, D)
    return hidden * mask[..., None].to(hidden.dtype)


def _to_float(videos: torch.Tensor) -> torch.Tensor:
    """uint8 ``(B, F, H, W, 3)`` -> float ``(B, 3, F, H, W)`` in [-1, 1], the Wan VAE's layout."""
    return videos.permute(0, 4, 1, 2, 3).float() / 127.5 - 1.0


def train_vae(vae, videos: torch.Tensor, steps: int, seed: int, batch: int = 8, lr: float = 2e-3):
    """Train the tiny Wan VAE on clips: L1 + MSE reconstruction weighted 10x on object pixels (small shapes are not
    averaged into the background), plus a 1e-6-weighted KL; one-cycle learning rate. Then sets ``latents_mean`` and
    ``latents_std`` in its config to the per-channel statistics of the latent means, as the Wan VAE's config carries.

    Args:
        videos: uint8 ``(N, F, H, W, 3)`` clips, ``F = 4k + 1``.

    Returns:
        The VAE (float32, eval mode), trained in place.
    """
    params = list(vae.parameters())
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=max(steps, 1), pct_start=0.05)
    gen = torch.Generator().manual_seed(seed)
    background = torch.tensor(BACKGROUND).view(1, 3, 1, 1, 1) / 127.5 - 1.0
    vae.train()
    bar = tqdm(range(steps), desc="tiny Wan VAE")
    for _ in bar:
        x = _to_float(videos[torch.randint(0, len(videos), (batch,), generator=gen)])  # (B, 3, F, H, W)
        post = vae.encode(x).latent_dist
        rec = vae.decode(post.sample(generator=gen)).sample
        weight = 1 + 9 * ((x - background).abs().amax(1, keepdim=True) > 0.1).float()  # (B, 1, F, H, W)
        loss = (weight * ((rec - x).abs() + (rec - x) ** 2)).mean() + 1e-6 * post.kl().mean()
        _optimizer_step(loss, params, opt, sched, bar, max_grad_norm=1.0)
    vae.eval()
    z = encode_latents(vae, videos[:512])  # (N, C, f, h, w)
    vae.register_to_config(latents_mean=z.mean((0, 2, 3, 4)).tolist(), latents_std=z.std((0, 2, 3, 4)).tolist())
    return vae


@torch.no_grad()
def encode_latents(vae, videos: torch.Tensor, batch: int = 64) -> torch.Tensor:
    """Unnormalised latent means of uint8 clips ``(N, F, H, W, 3)`` -> float32 ``(N, C, (F - 1) / 4 + 1, H / 4, W / 4)``."""
    return torch.cat(
        [vae.encode(_to_float(videos[i : i + batch])).latent_dist.mean for i in range(0, len(videos), batch)]
    )


def train_transformer(
    transformer,
    text_encoder,
    latents: torch.Tensor,
    input_ids: torch.Tensor,
    mask: torch.Tensor,
    cap_idx: torch.Tensor,
    steps: int,
    seed: int,
    batch: int = 64,
    lr: float = 1e-3,
    text_lr: float = 1e-3,
    uncond_p: float = 0.1,
):
    """Rectified-flow training of the tiny Wan transformer, jointly with the text encoder.

    x_t = (1 - t) x_0 + t eps with t ~ logit-normal(0, 1); loss = |v(x_t, 1000 t, c) - (eps - x_0)|^2 (the velocity
    ``WanPipeline`` integrates from t = 1 to 0). Captions drop to the empty prompt with probability ``uncond_p``
    (classifier-free guidance, as ``WanModel`` samples with the empty negative prompt).

    Args:
        latents: normalised latents ``(N, C, f, h, w)`` float32 (``(z - latents_mean) / latents_std``).
        input_ids, mask: ``(P, MAX_TOKENS)`` tokens of the unique captions; row 0 is the empty prompt.
        cap_idx: ``(N,)`` long, caption row of each clip.

    Returns:
        ``(transformer, text_encoder)`` in eval mode, trained in place.
    """
    groups = [{"params": list(transformer.parameters()), "lr": lr}]
    if text_lr > 0:
        groups.append({"params": list(text_encoder.parameters()), "lr": text_lr})
    text_encoder.requires_grad_(text_lr > 0)
    params = [p for g in groups for p in g["params"]]
    opt = torch.optim.AdamW(groups, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(
        opt, max_lr=[g["lr"] for g in groups], total_steps=max(steps, 1), pct_start=0.05
    )
    gen = torch.Generator().manual_seed(seed)
    transformer.train()
    text_encoder.train(text_lr > 0)
    bar = tqdm(range(steps), desc="tiny Wan transformer")
    for _ in bar:
        idx = torch.randint(0, len(latents), (batch,), generator=gen)
        x0 = latents[idx]  # (B, C, f, h, w)
        rows = torch.where(torch.rand(batch, generator=gen) < uncond_p, 0, cap_idx[idx])  # (B,)
        cond = umt5_condition(text_encoder, input_ids[rows], mask[rows])  # (B, T, D)
        t = torch.sigmoid(torch.randn(batch, generator=gen))  # (B,) logit-normal
        eps = torch.randn(x0.shape, generator=gen)
        tt = t.view(-1, 1, 1, 1, 1)
        v = transformer(
            hidden_states=(1 - tt) * x0 + tt * eps, timestep=t * 1000, encoder_hidden_states=cond, return_dict=False
        )[0]
        _optimizer_step(F.mse_loss(v, eps - x0), params, opt, sched, bar, max_grad_norm=1.0)
    return transformer.eval(), text_encoder.eval()


def build(
    out: str | Path,
    seed: int = 0,
    n_clips: int = 2000,
    vae_steps: int = 200,
    dit_steps: int = 1000,
    dit_batch: int = 64,
    dit_lr: float = 1e-3,
    text_lr: float = 1e-3,
    dit_layers: int = 4,
    dit_width: int = 64,
    vae_batch: int = 8,
    vae_from: str | Path | None = None,
    vae_clips: int | None = None,
) -> dict:
    """Regenerate the prompt files and ``out/tiny-wan`` (module docstring); returns the stage wall times in seconds.

    ``vae_from``: take the trained VAE of an earlier build (a ``tiny-wan`` folder) instead of training one, to try
    transformer settings without the VAE stage; the seeded VAE stage gives the same weights again on the same
    machine and thread count. ``vae_clips``: the VAE trains on the first ``vae_clips`` clips only (None: all); the
    render is seeded, so they are the clips a build with ``n_clips = vae_clips`` renders.

    Raises:
        FileNotFoundError: when ``vae_from`` holds no ``vae`` folder.
    """
    out, times = Path(out), {}
    with _timed(times, "render_s"):
        videos, drawn = _prompts_and_clips(out, seed, n_clips)
    with _timed(times, "vae_s"):
        vae = _vae_stage(videos, seed, vae_steps, vae_batch, vae_from, vae_clips)
    with _timed(times, "transformer_s"):
        tokenizer, text_encoder, transformer = _transformer_stage(
            vae, videos, drawn, seed, dit_steps, dit_layers, dit_width, batch=dit_batch, lr=dit_lr, text_lr=text_lr
        )
    _save_pipeline(out / "tiny-wan", tokenizer, text_encoder, vae, transformer)
    settings = {
        "seed": seed,
        "n_clips": n_clips,
        "vae_steps": vae_steps,
        "vae_batch": vae_batch,
        "vae_from": None if vae_from is None else str(vae_from),
        "vae_clips": vae_clips,
        "dit_steps": dit_steps,
        "dit_batch": dit_batch,
        "dit_lr": dit_lr,
        "text_lr": text_lr,
        "dit_layers": dit_layers,
        "dit_width": dit_width,
    }
    _write_build_json(out / "tiny-wan", settings, times)
    return times


def _prompts_and_clips(out: Path, seed: int, n_clips: int) -> tuple[torch.Tensor, list[dict]]:
    """The data stage: seed torch, write ``out/prompts/video_{train,test}.jsonl`` and render `n_clips` pre-training
    clips of all the world's prompts.

    Returns:
        ``(videos, drawn)``: uint8 ``(N, F, H, W, 3)`` clips and each clip's prompt record.
    """
    torch.manual_seed(seed)
    train, test = split()
    (out / "prompts").mkdir(parents=True, exist_ok=True)
    write_jsonl(train, out / "prompts" / "video_train.jsonl")
    write_jsonl(test, out / "prompts" / "video_test.jsonl")
    clips, drawn = render_dataset(all_metadata(), n_clips, seed)
    return torch.from_numpy(clips), drawn


def _vae_stage(videos: torch.Tensor, seed: int, steps: int, batch: int, vae_from, clips: int | None):
    """The VAE stage: the trained VAE of the ``tiny-wan`` folder `vae_from`, else a :func:`tiny_vae` trained on the
    first `clips` clips of `videos` (all when None) by :func:`train_vae`.

    Raises:
        FileNotFoundError: when `vae_from` holds no ``vae/config.json``.
    """
    from diffusers import AutoencoderKLWan

    if vae_from is None:
        return train_vae(tiny_vae(seed), videos[:clips], steps, seed, batch=batch)
    if not (Path(vae_from) / "vae" / "config.json").is_file():
        raise FileNotFoundError(f"--vae-from {vae_from}: no vae/config.json (expected a tiny-wan folder)")
    return AutoencoderKLWan.from_pretrained(vae_from, subfolder="vae").eval()


def _transformer_stage(vae, videos, drawn: list[dict], seed: int, steps: int, layers: int, width: int, **train):
    """The transformer stage: a new tokenizer, text encoder and transformer (`layers` blocks of width `width`), the
    captions' tokens and the clips' normalised latents, and :func:`train_transformer` for `steps` steps (`train`:
    its ``batch``, ``lr`` and ``text_lr``).

    Returns:
        ``(tokenizer, text_encoder, transformer)``, the last two trained in place.
    """
    tokenizer = build_tokenizer()
    text_encoder = tiny_text_encoder(len(tokenizer), seed)
    transformer = tiny_transformer(seed, layers, width)
    captions = [""] + sorted({m["prompt"] for m in drawn})
    tokens = tokenizer(
        captions,
        padding="max_length",
        max_length=MAX_TOKENS,
        truncation=True,
        add_special_tokens=True,
        return_attention_mask=True,
        return_tensors="pt",
    )
    row = {c: i for i, c in enumerate(captions)}
    cap_idx = torch.tensor([row[m["prompt"]] for m in drawn])
    z = encode_latents(vae, videos)
    stats = [torch.tensor(vae.config[k]).view(1, -1, 1, 1, 1) for k in ("latents_mean", "latents_std")]
    latents = (z - stats[0]) / stats[1]  # (N, C, f, h, w), as WanPipeline's latents
    ids, mask = tokens.input_ids, tokens.attention_mask
    train_transformer(transformer, text_encoder, latents, ids, mask, cap_idx, steps, seed, **train)
    return tokenizer, text_encoder, transformer


def _save_pipeline(folder: Path, tokenizer, text_encoder, vae, transformer) -> None:
    """Write the ``WanPipeline`` folder, with the Euler flow-matching scheduler at shift 1."""
    from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline

    scheduler = FlowMatchEulerDiscreteScheduler(shift=1.0)
    pipe = WanPipeline(
        tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, transformer=transformer, scheduler=scheduler
    )
    pipe.save_pretrained(folder)


def _write_build_json(folder: Path, settings: dict, times: dict[str, float]) -> None:
    """Write ``folder/build.json``: `settings` in their order, then ``times_s`` (stage wall times in seconds), the
    ``command`` line and the ``sample`` defaults."""
    record = {
        **settings,
        "times_s": times,
        "command": "python -m flowrl.tiny.build_video " + " ".join(sys.argv[1:]),
        "sample": {"resolution": VIDEO_SIZE, "num_frames": NUM_FRAMES, "max_sequence_length": MAX_TOKENS},
    }
    (folder / "build.json").write_text(json.dumps(record, indent=1))


def main(argv=None) -> None:
    p = builder_parser(__doc__, "tiny-wan")
    p.add_argument("--n-clips", type=int, default=2000, help="rendered pre-training clips")
    p.add_argument("--vae-steps", type=int, default=200, help="tiny Wan VAE optimizer steps")
    p.add_argument("--vae-batch", type=int, default=8, help="clips per VAE optimizer step")
    p.add_argument("--dit-steps", type=int, default=1000, help="transformer optimizer steps")
    p.add_argument("--dit-batch", type=int, default=64, help="clips per transformer optimizer step")
    p.add_argument("--dit-lr", type=float, default=1e-3, help="peak learning rate of the transformer")
    p.add_argument("--text-lr", type=float, default=1e-3, help="peak learning rate of the text encoder (0: frozen)")
    p.add_argument("--dit-layers", type=int, default=4, help="transformer blocks")
    p.add_argument("--dit-width", type=int, default=64, help="hidden size (a multiple of 32)")
    p.add_argument("--vae-from", default=None, help="reuse the VAE of an earlier build's tiny-wan folder")
    p.add_argument(
        "--vae-clips", type=int, default=None, help="train the VAE on the first N clips only (default: all)"
    )
    a = p.parse_args(argv)
    refuse_finished_build(p, a.out, "tiny-wan", a.overwrite)
    for key in ("n_clips", "vae_steps", "vae_batch", "dit_steps", "dit_batch", "vae_clips"):
        if getattr(a, key) is not None and getattr(a, key) < 1:
            p.error(f"--{key.replace('_', '-')} must be >= 1, got {getattr(a, key)}")
    try:
        tiny_transformer(0, a.dit_layers, a.dit_width)
    except ValueError as e:
        p.error(str(e))
    random.seed(a.seed)
    print(
        build(
            a.out,
            a.seed,
            a.n_clips,
            a.vae_steps,
            a.dit_steps,
            a.dit_batch,
            a.dit_lr,
            a.text_lr,
            a.dit_layers,
            a.dit_width,
            a.vae_batch,
            a.vae_from,
            a.vae_clips,
        )
    )


if __name__ == "__main__":
    main()
