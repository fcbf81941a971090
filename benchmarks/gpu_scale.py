"""Rollout and training cost of flowrl at real model sizes, against the stock diffusers pipeline.

For each family (random weights with the published transformer config, depth reducible with ``--layers``) and each
method preset, at one resolution, this measures:

- ``stock_s``: the stock pipeline (``StableDiffusion3Pipeline`` / ``FluxPipeline`` / ``WanPipeline``, the same transformer,
  its LoRA on) generating the rollout's images for the same steps, guidance and batch: the physical floor of a
  rollout (its denoising loop is the transformer calls and nothing else);
- ``rollout_s``: flowrl's rollout of the preset (SDE steps with their log-probs, ODE steps, trees), same batch;
- ``train_s`` and ``train_s_per_transition``: one policy update over the rollout's kept transitions;
- ``train_tflops`` and ``mfu``: the FLOPs of that update counted by ``torch.utils.flop_counter.FlopCounterMode``
  (matrix products and attention, forward and backward, in a separate untimed pass), divided by ``train_s`` and
  the device's dense bf16 peak (``--peak-tflops``; H100 SXM 989, H200 989, A100 312 are looked up by name);
- ``peak_gib_{stock,rollout,train}``: ``torch.cuda.max_memory_allocated`` of each phase (GPU only).

The text encoders and the VAE are random one-layer models with the real embedding widths (CLIP-L 768, CLIP-G 1280,
T5-XXL 4096 and 256 T5 tokens for SD3.5, 512 for FLUX; UMT5 4096 and 512 tokens for Wan, with a Wan VAE
compressing 8x in space and 4x in time), so the transformer sees the real sequence lengths; the
encoders' and the VAE's own cost is not the subject here. Run on a lent GPU (30 minutes in all, see
docs/distributed.md "Measuring on a GPU")::

    python benchmarks/gpu_scale.py --family sd35m --resolution 512 --steps 10 --out runs/gpu_scale_sd35m.json
    python benchmarks/gpu_scale.py --family flux_dev --layers 4 --resolution 512 --steps 6 --out runs/gpu_scale_flux.json
    python benchmarks/gpu_scale.py --family wan13b --resolution 480 --frames 33 --steps 10 --out runs/gpu_scale_wan.json

and at a tiny size on a CPU (what tests/test_benchmarks.py runs)::

    python benchmarks/gpu_scale.py --family tiny --resolution 64 --steps 2 --device cpu --out /tmp/gpu_scale.json

Writes a JSON file (one row per preset, with the device and the settings) and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]  # flowrl from the checkout; this file's reward as 'gpu_scale:brightness'

# Published transformer configs (the `transformer/config.json` of each hub repository, read 2025).
TRANSFORMERS = {
    # stabilityai/stable-diffusion-3.5-medium: MMDiT-X, 24 blocks of width 1536, dual attention in the first 13
    "sd35m": (
        "sd3",
        dict(
            sample_size=128,
            patch_size=2,
            in_channels=16,
            num_layers=24,
            attention_head_dim=64,
            num_attention_heads=24,
            joint_attention_dim=4096,
            caption_projection_dim=1536,
            pooled_projection_dim=2048,
            out_channels=16,
            pos_embed_max_size=384,
            dual_attention_layers=tuple(range(13)),
            qk_norm="rms_norm",
        ),
    ),
    # stabilityai/stable-diffusion-3.5-large: 38 blocks of width 2432
    "sd35l": (
        "sd3",
        dict(
            sample_size=128,
            patch_size=2,
            in_channels=16,
            num_layers=38,
            attention_head_dim=64,
            num_attention_heads=38,
            joint_attention_dim=4096,
            caption_projection_dim=2432,
            pooled_projection_dim=2048,
            out_channels=16,
            pos_embed_max_size=192,
            qk_norm="rms_norm",
        ),
    ),
    # black-forest-labs/FLUX.1-dev: 19 double- and 38 single-stream blocks of width 3072, guidance embedding
    "flux_dev": (
        "flux",
        dict(
            patch_size=1,
            in_channels=64,
            num_layers=19,
            num_single_layers=38,
            attention_head_dim=128,
            num_attention_heads=24,
            joint_attention_dim=4096,
            pooled_projection_dim=768,
            guidance_embeds=True,
            axes_dims_rope=(16, 56, 56),
        ),
    ),
    # Wan-AI/Wan2.1-T2V-1.3B-Diffusers: 30 blocks of width 1536 (12 heads of 128), UMT5-XXL text (4096)
    "wan13b": (
        "wan",
        dict(
            patch_size=(1, 2, 2),
            num_attention_heads=12,
            attention_head_dim=128,
            in_channels=16,
            out_channels=16,
            text_dim=4096,
            freq_dim=256,
            ffn_dim=8960,
            num_layers=30,
            cross_attn_norm=True,
            qk_norm="rms_norm_across_heads",
            eps=1e-6,
            rope_max_seq_len=1024,
        ),
    ),
    # Wan-AI/Wan2.1-T2V-14B-Diffusers: 40 blocks of width 5120 (40 heads of 128)
    "wan14b": (
        "wan",
        dict(
            patch_size=(1, 2, 2),
            num_attention_heads=40,
            attention_head_dim=128,
            in_channels=16,
            out_channels=16,
            text_dim=4096,
            freq_dim=256,
            ffn_dim=13824,
            num_layers=40,
            cross_attn_norm=True,
            qk_norm="rms_norm_across_heads",
            eps=1e-6,
            rope_max_seq_len=1024,
        ),
    ),
    # a few-MB Wan for the CPU test of this script
    "tiny_wan": (
        "wan",
        dict(
            patch_size=(1, 2, 2),
            num_attention_heads=2,
            attention_head_dim=16,
            in_channels=16,
            out_channels=16,
            text_dim=32,
            freq_dim=32,
            ffn_dim=64,
            num_layers=2,
            cross_attn_norm=True,
            qk_norm="rms_norm_across_heads",
            eps=1e-6,
            rope_max_seq_len=32,
        ),
    ),
    # a few-MB SD3 for the CPU test of this script
    "tiny": (
        "sd3",
        dict(
            sample_size=8,
            patch_size=2,
            in_channels=16,
            num_layers=2,
            attention_head_dim=16,
            num_attention_heads=2,
            joint_attention_dim=64,
            caption_projection_dim=32,
            pooled_projection_dim=64,
            out_channels=16,
            pos_embed_max_size=32,
            qk_norm="rms_norm",
        ),
    ),
}
PRESETS = ("flow_grpo", "mix_grpo_flash", "branch_grpo_mix", "diffusion_nft")
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "H800": 989.0, "A100": 312.0, "L40S": 362.0}
"""Dense bf16 tensor-core peak (TFLOP/s) by device-name substring (SXM figures; PCIe H100 is 756)."""


def brightness(images, prompts, metadata):
    """The benchmark's reward: mean pixel value per image or video, `(B, 3, H, W)` or `(B, F, 3, H, W)` in [0, 1]
    -> `(B,)` (cheap, never zero variance on random weights)."""
    return images.float().flatten(1).mean(dim=1).cpu()


brightness.accepts_video = True


def _text_encoders(family: str, hidden: tuple[int, ...], t5_dim: int | None):
    """One-layer random CLIP towers of the given widths (projection = width) and a one-layer T5 of width
    `t5_dim`, all with the shipped tiny CLIP tokenizer."""
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection, T5Config, T5EncoderModel

    from flowrl.tiny.build import build_tokenizer

    tok = build_tokenizer()
    clip_cls = CLIPTextModelWithProjection if family == "sd3" else CLIPTextModel
    clips = [
        clip_cls(
            CLIPTextConfig(
                vocab_size=len(tok),
                hidden_size=h,
                intermediate_size=256,
                num_hidden_layers=1,
                num_attention_heads=h // 64 if h >= 64 else 2,
                max_position_embeddings=77,
                projection_dim=h,
                bos_token_id=tok.bos_token_id,
                eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id,
            )
        )
        for h in hidden
    ]
    t5 = (
        None
        if t5_dim is None
        else T5EncoderModel(
            T5Config(
                vocab_size=len(tok),
                d_model=t5_dim,
                d_kv=64,
                d_ff=256,
                num_layers=1,
                num_heads=4,
                relative_attention_num_buckets=8,
                pad_token_id=tok.pad_token_id,
            )
        )
    )
    return tok, clips, t5


def build_pipeline(name: str, folder: Path, layers: int | None = None, dtype: torch.dtype | None = None) -> Path:
    """Save a random-weight pipeline of `name` (:data:`TRANSFORMERS`) to `folder`, its transformer in `dtype`.

    Args:
        name: ``sd35m`` | ``sd35l`` | ``flux_dev`` | ``wan13b`` | ``wan14b`` | ``tiny`` | ``tiny_wan``.
        layers: keep this many transformer blocks (FLUX: double and single blocks each); None = all.
        dtype: the transformer's weights (None: ``torch.bfloat16``).

    Returns:
        `folder`.
    """
    import torch
    from diffusers import (
        AutoencoderKL,
        AutoencoderKLWan,
        FlowMatchEulerDiscreteScheduler,
        FluxPipeline,
        FluxTransformer2DModel,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
        WanPipeline,
        WanTransformer3DModel,
    )

    dtype = torch.bfloat16 if dtype is None else dtype
    family, config = TRANSFORMERS[name]
    config = dict(config)
    if layers:
        config["num_layers"] = min(layers, config["num_layers"])
        if family == "flux":
            config["num_single_layers"] = min(layers, config["num_single_layers"])
        if "dual_attention_layers" in config:
            config["dual_attention_layers"] = tuple(
                i for i in config["dual_attention_layers"] if i < config["num_layers"]
            )
    torch.manual_seed(0)
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(16,) * 4,
        layers_per_block=1,
        latent_channels=16,
        norm_num_groups=8,
        sample_size=64,
        scaling_factor=1.5305 if family == "sd3" else 0.3611,
        shift_factor=0.0609 if family == "sd3" else 0.1159,
    )
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):  # random init of billions of weights: on GPU
        dit = {"sd3": SD3Transformer2DModel, "flux": FluxTransformer2DModel, "wan": WanTransformer3DModel}[family](
            **config
        )
    dit.to("cpu", dtype)
    if family == "wan":  # UMT5 of the real width (one layer), a Wan VAE compressing 8x in space and 4x in time
        from transformers import UMT5Config, UMT5EncoderModel

        from flowrl.tiny.build_video import build_tokenizer as t5_tokenizer

        tok = t5_tokenizer()
        umt5 = UMT5EncoderModel(
            UMT5Config(
                vocab_size=len(tok),
                d_model=config["text_dim"],
                d_kv=16,
                d_ff=64,
                num_layers=1,
                num_heads=4,
                relative_attention_num_buckets=8,
                pad_token_id=0,
                eos_token_id=1,
            )
        )
        wan_vae = AutoencoderKLWan(
            base_dim=8, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True]
        )
        pipe = WanPipeline(
            tokenizer=tok,
            text_encoder=umt5,
            vae=wan_vae,
            transformer=dit,
            scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        )
    elif family == "sd3":
        small = name == "tiny"
        tok, (clip_l, clip_g), t5 = _text_encoders(family, (32, 32) if small else (768, 1280), None if small else 4096)
        pipe = StableDiffusion3Pipeline(
            transformer=dit,
            scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
            vae=vae,
            text_encoder=clip_l,
            tokenizer=tok,
            text_encoder_2=clip_g,
            tokenizer_2=tok,
            text_encoder_3=t5,
            tokenizer_3=tok if t5 is not None else None,
        )
    else:
        tok, (clip_l,), t5 = _text_encoders(family, (768,), 4096)
        scheduler = FlowMatchEulerDiscreteScheduler(
            shift=3.0,
            use_dynamic_shifting=True,
            base_shift=0.5,
            max_shift=1.15,
            base_image_seq_len=256,
            max_image_seq_len=4096,
        )
        pipe = FluxPipeline(
            scheduler=scheduler,
            vae=vae,
            text_encoder=clip_l,
            tokenizer=tok,
            text_encoder_2=t5,
            tokenizer_2=tok,
            transformer=dit,
        )
    pipe.save_pretrained(folder)
    return folder


def _start(device: torch.device) -> float:
    """Wait for the device, reset its peak memory, and return the time: the start of a timed phase."""
    _sync(device)
    _reset_peak(device)
    return time.perf_counter()


def _sync(device: torch.device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak_gib(device: torch.device) -> float | None:
    import torch

    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def _reset_peak(device: torch.device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_tflops(device: torch.device, given: float | None) -> float | None:
    """The dense bf16 peak for MFU: `given`, else looked up from the CUDA device name; None on a CPU."""
    if given:
        return given
    if device.type != "cuda":
        return None
    import torch

    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_TFLOPS.items() if k in name), None)


def measure(folder: Path, preset: str, args, prompts_file: Path, device: torch.device) -> dict:
    """Time one preset on the pipeline in `folder`: the stock pipeline, flowrl's rollout, one update and its FLOPs."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from flowrl.config import REPO_ROOT, load_config
    from flowrl.trainer import Trainer

    gpu = device.type == "cuda"
    overrides = [
        f"model.path={folder}",
        f"train_prompts={prompts_file}",
        f"eval.prompts={prompts_file}",
        f"run.output_dir={Path(tempfile.mkdtemp()) / 'run'}",
        f"run.device={device.type}",
        f"run.mixed_precision={'bf16' if gpu else 'no'}",
        f"model.dtype={'bfloat16' if gpu else 'float32'}",
        f"model.resolution={args.resolution}",
        f"model.lora_rank={args.lora_rank}",
        f"sampling.num_steps={args.steps}",
        f"sampling.group_size={args.group_size}",
        f"sampling.prompts_per_iteration={args.prompts}",
        f"sampling.batch_size={args.prompts * args.group_size}",
        f"train.minibatch_size={args.minibatch}",
        f"train.gradient_checkpointing={args.gradient_checkpointing}",
        "tag_balanced=false",
    ]
    video = TRANSFORMERS[args.family][0] == "wan"
    if video:
        overrides += [
            f"model.num_frames={args.frames}",
            "model.max_sequence_length=32" if args.family == "tiny_wan" else "model.max_sequence_length=512",
        ]
    if preset in ("mix_grpo_flash",):
        overrides.append(f"sampling.window.size={min(4, args.steps - 1)}")
    if preset in ("branch_grpo_mix",):
        splits = [s for s in (0, max(1, args.steps // 3), max(2, 2 * args.steps // 3)) if s < args.steps - 1]
        splits = sorted(set(splits))[:3]
        overrides += [
            f"sampling.tree.split_steps={splits}",
            f"sampling.tree.sde_steps={splits}",
            f"sampling.group_size={2 ** len(splits)}",
        ]
    cfg_file = Path(tempfile.mkdtemp()) / "c.yaml"
    cfg_file.write_text(
        f"base: {REPO_ROOT / 'configs' / (preset + '.yaml')}\nrewards:\n  geneval: null\n"
        "  gpu_scale:brightness:\n    weight: 1.0\n"
    )
    trainer = Trainer(load_config(cfg_file, overrides))
    cfg, method, model = trainer.cfg, trainer.method, trainer.model
    metas = trainer.sample_prompts(0)
    images_per_rollout = len(metas) * cfg.sampling.group_size

    def stock() -> None:
        prompts = [m["prompt"] for m in metas for _ in range(cfg.sampling.group_size)]
        frames = {"num_frames": args.frames} if video else {}
        model.pipe(
            prompt=prompts,
            num_inference_steps=cfg.sampling.num_steps,
            guidance_scale=cfg.sampling.guidance_scale,
            height=args.resolution,
            width=args.resolution,
            output_type="pt",
            generator=torch.Generator(device).manual_seed(0),
            **frames,
        )

    row: dict = {"preset": preset, "images": images_per_rollout, "steps": cfg.sampling.num_steps}
    with torch.no_grad(), trainer.policy.autocast():
        stock()  # warm-up: kernels, allocator
        t0 = _start(device)
        for _ in range(args.repeats):
            stock()
        _sync(device)
        row["stock_s"] = (time.perf_counter() - t0) / args.repeats
        row["peak_gib_stock"] = _peak_gib(device)
    gen = lambda i: torch.Generator().manual_seed(i)  # noqa: E731
    method.rollout(metas, gen(0))  # warm-up
    t0 = _start(device)
    for i in range(args.repeats):
        samples = method.rollout(metas, gen(i + 1))
    _sync(device)
    row["rollout_s"] = (time.perf_counter() - t0) / args.repeats
    row["peak_gib_rollout"] = _peak_gib(device)
    row["rollout_over_stock"] = row["rollout_s"] / row["stock_s"]
    scores = trainer.score(samples.images, samples.image_prompt, metas)
    adv, keep, _ = method.advantages(
        samples, trainer.gather_rewards(scores, samples.image_prompt, len(metas)), gen(99)
    )
    method.update(samples, adv, keep, gen(100))  # warm-up (and the optimizer's state)
    t0 = _start(device)
    stats = method.update(samples, adv, keep, gen(101))
    _sync(device)
    row["train_s"] = time.perf_counter() - t0
    row["peak_gib_train"] = _peak_gib(device)
    row["trained_transitions"] = stats.get("cost/trained_transitions", 0)
    row["train_s_per_transition"] = row["train_s"] / max(1, row["trained_transitions"])
    with FlopCounterMode(display=False) as counter:
        method.update(samples, adv, keep, gen(102))
    row["train_tflops"] = counter.get_total_flops() / 1e12
    row["achieved_tflops_per_s"] = row["train_tflops"] / row["train_s"]
    peak = peak_tflops(device, args.peak_tflops)
    row["mfu"] = row["achieved_tflops_per_s"] / peak if peak else None
    del trainer
    if gpu:
        torch.cuda.empty_cache()
    return row


def markdown(rows: list[dict], meta: dict) -> str:
    """The rows as a Markdown table under a line naming the device and settings."""
    cols = (
        "preset",
        "images",
        "stock_s",
        "rollout_s",
        "rollout_over_stock",
        "train_s",
        "trained_transitions",
        "train_s_per_transition",
        "achieved_tflops_per_s",
        "mfu",
        "peak_gib_rollout",
        "peak_gib_train",
    )
    fmt = lambda v: "-" if v is None else (f"{v:.3g}" if isinstance(v, float) else str(v))  # noqa: E731
    lines = [
        f"{meta['family']} ({meta['transformer_params_b']:.2f} B transformer parameters, {meta['layers']} layers), "
        f"{meta['resolution']} px, {meta['steps']} steps, on {meta['device']}",
        "",
        "| " + " | ".join(cols) + " |",
        "|" + " --- |" * len(cols),
    ]
    lines += ["| " + " | ".join(fmt(r.get(c)) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    """Command line: see the module docstring. Returns the rows written."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--family", choices=sorted(TRANSFORMERS), default="sd35m")
    ap.add_argument("--layers", type=int, default=None, help="keep this many blocks (default: all)")
    ap.add_argument("--resolution", type=int, default=512)
    ap.add_argument("--frames", type=int, default=33, help="video families: frames per video (4k+1)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--prompts", type=int, default=2, help="prompts per rollout")
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--minibatch", type=int, default=4, help="transitions per optimizer step")
    ap.add_argument("--lora-rank", type=int, default=32)
    ap.add_argument("--gradient-checkpointing", action="store_true")
    ap.add_argument("--presets", default=",".join(PRESETS))
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument(
        "--peak-tflops", type=float, default=None, help="dense bf16 peak for MFU (default: by device name)"
    )
    ap.add_argument("--device", default="auto")
    ap.add_argument("--folder", default=None, help="build the pipeline here (default: a temporary folder)")
    ap.add_argument("--out", required=True, help="JSON file of the results")
    args = ap.parse_args(argv)
    import torch  # after the arguments: --help answers at once

    device = torch.device(
        "cuda"
        if args.device == "auto" and torch.cuda.is_available()
        else ("cpu" if args.device == "auto" else args.device)
    )
    folder = Path(args.folder or tempfile.mkdtemp()) / args.family
    if not (folder / "model_index.json").exists():
        build_pipeline(args.family, folder, args.layers, torch.bfloat16 if device.type == "cuda" else torch.float32)
    prompts = Path(tempfile.mkdtemp()) / "prompts.jsonl"
    prompts.write_text(
        "".join(
            json.dumps({"prompt": p, "tag": "all"}) + "\n"
            for p in ("a photo of a red apple", "a cat on a sofa", "a lighthouse at dusk", "two blue cups")
        )
    )
    params = transformer_params(folder)
    layers = json.loads((folder / "transformer" / "config.json").read_text()).get("num_layers")
    meta = {
        "family": args.family,
        "layers": layers,
        "transformer_params_b": params / 1e9,
        "resolution": args.resolution,
        "steps": args.steps,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "lora_rank": args.lora_rank,
        "group_size": args.group_size,
        "prompts": args.prompts,
        "minibatch": args.minibatch,
        "command": " ".join(sys.argv),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    rows = []
    for preset in args.presets.split(","):
        rows.append(measure(folder, preset, args, prompts, device))
        # written after each preset: a run stopped at a time limit keeps what it measured
        Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        print(json.dumps(rows[-1]), flush=True)
    print(markdown(rows, meta))
    return rows


def transformer_params(folder: Path) -> int:
    """The number of weights in the saved transformer of the pipeline `folder` (read from the safetensors headers)."""
    from safetensors import safe_open

    count = 0
    for shard in (folder / "transformer").glob("*.safetensors"):
        with safe_open(shard, "pt") as f:
            for key in f.keys():
                n = 1
                for size in f.get_slice(key).get_shape():
                    n *= size
                count += n
    return count


if __name__ == "__main__":
    main()
