"""Shared fixtures: seeded random tiny SD3 and FLUX pipelines (built in seconds, no download) and prompts."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent


def pytest_collection_modifyitems(config, items):
    """Tests marked ``slow`` (end-to-end runs of a minute or more) run in CI (``CI=true``, as ``.ci/run``) or when
    asked for (``-m slow``); the default run skips them, so that it stays within a few minutes on 2 cores."""
    if os.environ.get("CI", "").lower() in ("1", "true", "yes") or config.getoption("markexpr"):
        return
    skip = pytest.mark.skip(reason="slow: runs with CI=true (as .ci/run does) or -m slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


ASSETS = REPO / "assets"


def build_random_pipeline(folder: Path) -> Path:
    """Save a random-weight StableDiffusion3Pipeline with the tiny model's architecture to ``folder``."""
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    from flowrl.tiny.build import MAX_TOKENS, build_tokenizer

    torch.manual_seed(0)
    tok = build_tokenizer()
    te = CLIPTextModelWithProjection(
        CLIPTextConfig(
            vocab_size=len(tok),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            max_position_embeddings=MAX_TOKENS,
            projection_dim=32,
            bos_token_id=tok.bos_token_id,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        )
    )
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 3,
        up_block_types=("UpDecoderBlock2D",) * 3,
        block_out_channels=(8, 16, 16),
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=8,
        sample_size=64,
    )
    dit = SD3Transformer2DModel(
        sample_size=16,
        patch_size=2,
        in_channels=4,
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=64,
        caption_projection_dim=32,
        pooled_projection_dim=64,
        out_channels=4,
        pos_embed_max_size=16,
        qk_norm="rms_norm",
    )
    pipe = StableDiffusion3Pipeline(
        transformer=dit,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=1.0),
        vae=vae,
        text_encoder=te,
        tokenizer=tok,
        text_encoder_2=te,
        tokenizer_2=tok,
        text_encoder_3=None,
        tokenizer_3=None,
    )
    pipe.save_pretrained(folder)
    return folder


def build_random_flux_pipeline(folder: Path, guidance_embeds: bool = True) -> Path:
    """Save a random-weight FluxPipeline to ``folder``: CLIP and a 1-layer T5 (both with the tiny CLIP tokenizer), a
    VAE with factor 4 and FLUX's scaling and shift factors, a FLUX transformer of one dual- and one single-stream
    block, and FLUX.1's dynamically shifting scheduler."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    from flowrl.tiny.build import MAX_TOKENS, build_tokenizer

    torch.manual_seed(0)
    tok = build_tokenizer()
    clip = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=len(tok),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            max_position_embeddings=MAX_TOKENS,
            bos_token_id=tok.bos_token_id,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        )
    )
    t5 = T5EncoderModel(
        T5Config(
            vocab_size=len(tok),
            d_model=32,
            d_kv=8,
            d_ff=64,
            num_layers=1,
            num_heads=4,
            relative_attention_num_buckets=8,
            pad_token_id=tok.pad_token_id,
        )
    )
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 3,
        up_block_types=("UpDecoderBlock2D",) * 3,
        block_out_channels=(8, 16, 16),
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=8,
        sample_size=32,
        scaling_factor=0.3611,
        shift_factor=0.1159,
        use_quant_conv=False,
        use_post_quant_conv=False,
    )
    dit = FluxTransformer2DModel(
        patch_size=1,
        in_channels=16,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        pooled_projection_dim=32,
        guidance_embeds=guidance_embeds,
        axes_dims_rope=(4, 6, 6),
    )
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
        text_encoder=clip,
        tokenizer=tok,
        text_encoder_2=t5,
        tokenizer_2=tok,
        transformer=dit,
    )
    pipe.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def random_flux_pipeline(tmp_path_factory) -> Path:
    return build_random_flux_pipeline(tmp_path_factory.mktemp("random-flux"))


@pytest.fixture(scope="session")
def random_pipeline(tmp_path_factory) -> Path:
    return build_random_pipeline(tmp_path_factory.mktemp("random-sd3"))


@pytest.fixture(scope="session")
def prompt_files(tmp_path_factory) -> tuple[Path, Path]:
    from flowrl.data import write_jsonl
    from flowrl.tiny.prompts import split

    folder = tmp_path_factory.mktemp("prompts")
    train, test = split(0)
    write_jsonl(train, folder / "train.jsonl")
    write_jsonl(test, folder / "test.jsonl")
    return folder / "train.jsonl", folder / "test.jsonl"


def shape_overrides(cfg) -> dict:
    """Step and group counts that keep a preset's own rollout shape (its tree, window or probe steps) at the tiny size
    of :func:`tiny_overrides`; `cfg` is the preset's loaded :class:`flowrl.config.Config`."""
    if cfg.sampling.tree.split_steps:
        return {"sampling.num_steps": 6, "sampling.group_size": 8}
    if cfg.sampling.window.size:
        return {"sampling.num_steps": 5}
    if cfg.sampling.shape in ("tempflow", "g2rpo", "tp_grpo"):
        return {"sampling.num_steps": 8}
    return {}


FLOAT32 = {"run.mixed_precision": "no", "sampling.decode_precision": "no", "sampling.ode_precision": "no"}
"""Every precision setting float32: tests compute in float32 unless they test bf16, so that they give the same
numbers on CPUs with and without native bf16 (``auto`` would pick bf16 on one and float32 on the other)."""


def tiny_overrides(model: Path, train: Path, test: Path, out: Path, **extra) -> list[str]:
    """Overrides that make a run take seconds, in float32 (:data:`FLOAT32`); `extra` overrides them."""
    base = {
        "model.path": str(model),
        "train_prompts": str(train),
        "eval.prompts": str(test),
        "run.output_dir": str(out),
        "run.iterations": 2,
        "run.save_every": 1,
        "run.device": "cpu",
        "sampling.num_steps": 3,
        "sampling.group_size": 2,
        "sampling.prompts_per_iteration": 2,
        "eval.images_per_tag": 1,
        "eval.num_steps": 2,
        "train.minibatch_size": 4,
        "model.lora_rank": 2,
        "run.diversity_model": "",  # off: test_diversity.py measures it
        **FLOAT32,
    }
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


def train_shrunk_recipe(trainer, iterations: int = 2) -> list[dict]:
    """Train a recipe shrunk onto a tiny pipeline and check what every family's recipe test checks: ``iterations``
    rows in ``metrics.jsonl``, the PPO ratio exactly 1 before each iteration's first step, an optimizer step in each,
    and the trained parameters moved. Returns the metrics rows."""
    import json

    before = {n: p.detach().clone() for n, p in trainer.policy.params.items()}
    trainer.train()
    rows = Path(trainer.cfg.run.output_dir, "metrics.jsonl").read_text().splitlines()
    metrics = [json.loads(line) for line in rows]
    assert len(metrics) == iterations
    assert all(m["policy/ratio_first_max_dev"] == 0.0 and m["policy/optimizer_steps"] > 0 for m in metrics)
    assert any(not torch.equal(p.detach(), before[n]) for n, p in trainer.policy.params.items())
    return metrics


def record_reward_metadata(trainer) -> list[dict]:
    """Wrap ``trainer``'s rewards so that each call's metadata rows (the prompt records the rewards receive: source
    images of edit and image-to-video families) are appended to the returned list."""
    seen, inner = [], trainer.rewards

    class Recording:
        rewards = inner.rewards

        def __call__(self, images, prompts, metadata):
            seen.extend(metadata)
            return inner(images, prompts, metadata)

    trainer.rewards = trainer.method.rewards = Recording()
    return seen


def assert_resume_is_exact(config: Path, overrides, out: Path):
    """Train `config` for 2 iterations straight and for 1 iteration + a resume for the second (``overrides(folder)``:
    the run's ``key=value`` list for an output folder) and check they end on the same weights (atol 1e-6) and log the
    same second iteration: rollout noise, prompts and optimizer state are restored; the resumed iteration trained.
    Returns the straight run's :class:`flowrl.trainer.Trainer` (after training)."""
    import json

    from safetensors.torch import load_file

    from flowrl.config import load_config
    from flowrl.trainer import Trainer

    runs, trainers = {}, {}
    for name, passes in (("full", [[]]), ("part", [["run.iterations=1"], ["run.resume=true"]])):
        for more in passes:
            trainers[name] = Trainer(load_config(config, overrides(out / name) + more))
            trainers[name].train()
        lines = (out / name / "metrics.jsonl").read_text().splitlines()
        runs[name] = (
            load_file(out / name / "checkpoints/checkpoint-000002/trainable.safetensors"),
            json.loads(lines[-1]),
        )
    (a, last_a), (b, last_b) = runs["full"], runs["part"]
    assert a.keys() == b.keys() and len(a) > 0
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6)
    first = load_file(out / "part/checkpoints/checkpoint-000001/trainable.safetensors")
    assert any(not torch.equal(first[k], b[k]) for k in b)  # the resumed iteration trained
    assert last_a["iteration"] == last_b["iteration"] == 2
    key = "reward/total/mean" if "reward/total/mean" in last_a else "policy/loss"  # offline methods score nothing
    assert last_a[key] == last_b[key]
    return trainers["full"]
