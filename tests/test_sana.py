"""The SANA adapters (`flowrl.models.SanaModel`, `flowrl.models.SanaSprintModel`) on tiny random SanaPipelines and
SanaSprintPipelines built offline (a one-layer Gemma2 text encoder with an offline Gemma BPE tokenizer trained on the
pipeline's complex human instruction and the tiny world's prompts, a DC-AE of factor 4): what is special to SANA. The
conformance suite (tests/test_conformance.py, families ``SanaModel`` and ``SanaSprintModel``) checks sampling against
the stock pipelines, the ratio, resume, LoRA and full fine-tune export."""

import inspect
import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import REPO, tiny_overrides

from flowrl.config import load_config
from flowrl.models import SanaModel, SanaSprintModel, load_model, model_class
from flowrl.trainer import Trainer

SIDE = 32  # px: the pipelines' unit; VAE factor 4, 8 x 8 latents
LENGTH = 16  # prompt tokens (the pipelines' default is 300)
PROMPTS = ["A photo of a Red star", "a photo of two blue circles and a green square"]


def build_gemma_tokenizer():
    """A GemmaTokenizer (BPE with byte fallback, BOS added) of 300 tokens, trained on the SANA pipeline's complex human
    instruction followed by the tiny world's prompts."""
    from diffusers import SanaPipeline
    from tokenizers import Tokenizer, normalizers, pre_tokenizers
    from tokenizers.models import BPE
    from tokenizers.trainers import BpeTrainer
    from transformers import GemmaTokenizer

    from flowrl.tiny.prompts import split

    instruction = "\n".join(inspect.signature(SanaPipeline.__call__).parameters["complex_human_instruction"].default)
    train, test = split(0)
    bpe = Tokenizer(BPE(unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    bpe.normalizer = normalizers.Replace(" ", "▁")  # GemmaTokenizer's
    bpe.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous", invert=False)
    trainer = BpeTrainer(vocab_size=300, special_tokens=["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"])
    bpe.train_from_iterator([instruction + m["prompt"].lower() for m in train + test] * 2, trainer)
    model = json.loads(bpe.to_str())["model"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    return GemmaTokenizer(vocab=model["vocab"], merges=merges, add_bos_token=True)


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
    te = Gemma2Model(
        Gemma2Config(
            vocab_size=len(tok),
            hidden_size=8,
            intermediate_size=16,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=4,
            max_position_embeddings=1024,
            pad_token_id=tok.pad_token_id,
            bos_token_id=tok.bos_token_id,
            eos_token_id=tok.eos_token_id,
        )
    )
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
    """Save a random-weight SanaPipeline to ``folder``: the tiny Gemma2 encoder and tokenizer, a DC-AE of factor 4 with
    4 latent channels, a two-block SANA transformer (8 latents a side: 32 px) and SANA's DPM-Solver flow scheduler
    config (flow_shift 3)."""
    return _build(folder, sprint=False)


def build_random_sana_sprint_pipeline(folder: Path) -> Path:
    """Save a random-weight SanaSprintPipeline to ``folder``: as :func:`build_random_sana_pipeline` with a
    guidance-embedding, QK-normed transformer and Sprint's TrigFlow SCM scheduler (sigma_data 0.5)."""
    return _build(folder, sprint=True)


def stock_sana(folder: Path, model, metas: list[dict], noise: torch.Tensor, num_steps: int, guidance_scale: float):
    """The stock SanaPipeline's images ``(B, 3, H, W)`` float32 in [0, 1] for the prompt records ``metas`` from the
    latents ``noise (B, *model.latent_shape)``, with its DPM-Solver replaced by ``FlowMatchEulerDiscreteScheduler`` at
    the folder's flow_shift (what flowrl samples with), CFG against the empty prompt, at ``model.resolution`` itself
    (no resolution binning)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, SanaPipeline

    pipe = SanaPipeline.from_pretrained(folder)
    pipe.scheduler = FlowMatchEulerDiscreteScheduler(shift=pipe.scheduler.config.flow_shift)
    pipe.set_progress_bar_config(disable=True)
    with torch.no_grad():
        return pipe(
            prompt=[m["prompt"] for m in metas],
            negative_prompt="",
            guidance_scale=guidance_scale,
            latents=noise,
            num_inference_steps=num_steps,
            height=model.resolution,
            width=model.resolution,
            max_sequence_length=model.max_sequence_length,
            use_resolution_binning=False,
            output_type="pt",
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
    folder: Path,
    model,
    metas: list[dict],
    noise: torch.Tensor,
    num_steps: int,
    guidance_scale: float,
    deterministic: bool = True,
    generator: torch.Generator | None = None,
):
    """The stock SanaSprintPipeline's images ``(B, 3, H, W)`` float32 in [0, 1] from the unit noise ``noise (B,
    *model.latent_shape)`` (the pipeline scales it by sigma_data), at its embedded guidance scale, with its default
    angles (``intermediate_timesteps`` 1.3 at 2 steps). ``deterministic``: its SCM step with the fresh noise replaced by
    the model's own estimate (the ODE flowrl's Euler sampling follows); False: the stock stochastic step, drawing from
    ``generator``."""
    from diffusers import SanaSprintPipeline

    pipe = SanaSprintPipeline.from_pretrained(folder)
    if deterministic:
        pipe.scheduler = _deterministic_scm().from_config(pipe.scheduler.config)
    pipe.set_progress_bar_config(disable=True)
    with torch.no_grad():
        return pipe(
            prompt=[m["prompt"] for m in metas],
            guidance_scale=guidance_scale,
            latents=noise,
            num_inference_steps=num_steps,
            intermediate_timesteps=1.3 if num_steps == 2 else None,
            generator=generator,
            height=model.resolution,
            width=model.resolution,
            max_sequence_length=model.max_sequence_length,
            use_resolution_binning=False,
            output_type="pt",
        ).images


def _noise(model, n: int) -> torch.Tensor:
    return torch.stack([torch.randn(model.latent_shape, generator=torch.Generator().manual_seed(s)) for s in range(n)])


@pytest.fixture(scope="module")
def sana(tmp_path_factory) -> Path:
    return build_random_sana_pipeline(tmp_path_factory.mktemp("random-sana"))


@pytest.fixture(scope="module")
def sprint(tmp_path_factory) -> Path:
    return build_random_sana_sprint_pipeline(tmp_path_factory.mktemp("random-sana-sprint"))


def test_prompts_schedule_and_decoding_are_the_pipelines(sana, tmp_path):
    from diffusers import FlowMatchEulerDiscreteScheduler, SanaPipeline

    assert model_class(sana) is SanaModel and SanaModel.scheduler_shift(sana) == 3.0
    model = load_model(sana, resolution=SIDE, max_sequence_length=LENGTH)
    assert model.latent_shape == (4, 8, 8) and model.shift == 3.0 and model.cfg_rows(4.5) == 2
    assert load_model(sana).max_sequence_length == 300 and load_model(sana).resolution == SIDE  # sample_size 8 x 4
    pipe = SanaPipeline.from_pretrained(sana)
    # prompts: with the complex human instruction, lower-cased; the empty prompt as the pipeline's negative
    emb = model.encode(["", *PROMPTS])
    pos, pos_mask, neg, neg_mask = pipe.encode_prompt(
        PROMPTS,
        max_sequence_length=LENGTH,
        complex_human_instruction=model.instruction,
        negative_prompt="",
    )
    assert emb.embeds.shape == (3, LENGTH, 8) and emb.mask.shape == (3, LENGTH) and emb.pooled.shape == (3, 0)
    torch.testing.assert_close(emb.embeds[1:], pos, rtol=0, atol=1e-6)
    torch.testing.assert_close(emb.embeds[:1], neg[:1], rtol=0, atol=1e-6)
    assert torch.equal(emb.mask[1:], pos_mask) and torch.equal(emb.mask[:1], neg_mask[:1])
    assert 0 < emb.mask[0].sum() < emb.mask[1].sum()  # the negative is short, the instruction fills the prompt rows
    torch.testing.assert_close(model.encode([PROMPTS[0].lower()]).embeds, emb.embeds[1:2], rtol=0, atol=1e-6)
    # schedule: the flow-matching Euler scheduler at the DPM-Solver's flow_shift
    euler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    for steps in (3, 10):
        euler.set_timesteps(steps)
        torch.testing.assert_close(model.sigmas(steps), euler.sigmas.float(), rtol=0, atol=1e-6)
    # decoding: the DC-AE on z / scaling_factor
    z = torch.randn(2, *model.latent_shape, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = (pipe.vae.decode(z / 0.41407, return_dict=False)[0] / 2 + 0.5).clamp(0, 1)
    torch.testing.assert_close(model.decode(z), expected, rtol=0, atol=1e-5)
    assert not model.encodes_images()  # the offline methods need the inverse: not built
    # a DPM-Solver without flow sigmas is not a flow-matching schedule
    vp = tmp_path / "vp"
    shutil.copytree(sana, vp)
    config = json.loads((vp / "scheduler/scheduler_config.json").read_text())
    (vp / "scheduler/scheduler_config.json").write_text(json.dumps({**config, "use_flow_sigmas": False}))
    with pytest.raises(
        ValueError, match=r"^.*scheduler_config.json is a DPMSolverMultistepScheduler without use_flow"
    ):
        SanaModel.scheduler_shift(vp)


def test_one_line_errors(sana, sprint, tmp_path):
    with pytest.raises(
        ValueError, match=r"^resolution 48 px .* multiple of 32 \(the pipeline's 32 px and VAE factor 4"
    ):
        SanaModel.check_resolution(sana, 48)
    with pytest.raises(ValueError, match=r"^max_sequence_length must be >= 3 for SANA .* got 2$"):
        load_model(sana, resolution=SIDE, max_sequence_length=2)
    wrong = tmp_path / "wrong"
    shutil.copytree(sprint, wrong)
    config = json.loads((wrong / "scheduler/scheduler_config.json").read_text())
    (wrong / "scheduler/scheduler_config.json").write_text(json.dumps({**config, "prediction_type": "epsilon"}))
    with pytest.raises(
        ValueError, match=r"prediction_type 'epsilon'; SANA-Sprint's is an SCMScheduler .* 'trigflow'$"
    ):
        SanaSprintModel.scheduler_shift(wrong)


def test_sprint_time_guidance_and_sampler_are_the_pipelines(sprint):
    """Sprint's TrigFlow angles as flow times, its embedded guidance (one row), 1-step ODE sampling equal to the
    stock pipeline, and the stock stochastic multistep sampler equal to flowrl's ``cps`` kernel at noise level 1."""
    from diffusers import SCMScheduler

    from flowrl.evaluation import generate
    from flowrl.samplers import cps_step

    assert model_class(sprint) is SanaSprintModel and SanaSprintModel.scheduler_shift(sprint) == 1.0
    model = load_model(sprint, resolution=SIDE, max_sequence_length=LENGTH)
    assert model.cfg_rows(4.5) == 1
    scm = SCMScheduler()
    for steps, middle in ((2, 1.3), (4, None)):
        scm.set_timesteps(steps, intermediate_timesteps=middle)
        s = scm.timesteps.double()
        expected = (s.sin() / (s.sin() + s.cos())).float()
        assert expected[0] > 1.0  # 1.57080 is pi/2 rounded up
        ours = model.sigmas(steps)
        assert ours[0] == 1.0 and ours[-1] == 0.0
        torch.testing.assert_close(ours[1:], expected[1:], rtol=0, atol=1e-6)
    torch.testing.assert_close(model.sigmas(4, shift=3.0)[1:-1], 3 * ours[1:-1] / (1 + 2 * ours[1:-1]))
    metas = [{"prompt": p} for p in PROMPTS]
    noise = _noise(model, 2)
    # one step is deterministic in the stock pipeline too
    ours = generate(model, PROMPTS, [0, 1], 1, 4.5)
    stock = stock_sana_sprint(sprint, model, metas, noise, 1, 4.5, deterministic=False)
    torch.testing.assert_close(ours, stock, rtol=0, atol=1e-4)
    # three stochastic stock steps = three cps steps at noise level 1 with the pipeline generator's noise
    stock = stock_sana_sprint(sprint, model, metas, noise, 3, 4.5, False, torch.Generator().manual_seed(7))
    cond, draws, sigmas = model.encode(PROMPTS), torch.Generator().manual_seed(7), model.sigmas(3)
    x = noise
    with torch.no_grad():
        for t, t_next in zip(sigmas[:-1], sigmas[1:]):
            v = model.velocity(x, t.expand(2), cond, None, 4.5)
            x = cps_step(x, v, t, t_next, 1.0, noise=torch.randn(x.shape, generator=draws)).prev_sample
        ours = model.decode(x)
    torch.testing.assert_close(ours, stock, rtol=0, atol=1e-4)
    assert (ours - generate(model, PROMPTS, [0, 1], 3, 4.5)).abs().max() > 1e-3  # not the ODE


def test_sana_recipe_trains_two_iterations(tmp_path, sana, prompt_files):
    """configs/recipes/sana_diffusion_nft.yaml shrunk onto the tiny pipeline (its DiffusionNFT settings kept: CFG-free
    sampling, 9 noised copies of each image, every group kept, the ramped soft update; PickScore swapped for JPEG
    compressibility, which needs no download)."""
    train, test = prompt_files
    over = tiny_overrides(
        sana,
        train,
        test,
        tmp_path / "run",
        **{
            "model.dtype": "float32",
            "model.resolution": SIDE,
            "model.max_sequence_length": LENGTH,
            "rewards.pickscore": "null",
            "rewards.jpeg_compressibility.weight": 1.0,
            "sampling.group_size": 2,
            "train.minibatch_size": 36,  # one optimizer step: 2 prompts x 2 images x 9 noised copies
            "train.micro_batch_size": "null",
            "train.gradient_checkpointing": False,
            "train.ema_decay": 0.0,
        },
    )
    cfg = load_config(REPO / "configs" / "recipes" / "sana_diffusion_nft.yaml", over)
    assert cfg.train.method == "nft" and cfg.sampling.guidance_scale == 1.0 and cfg.train.nft.keep_flat_groups
    trainer = Trainer(cfg)
    assert isinstance(trainer.model, SanaModel) and trainer.cfg.sampling.shift == 3.0  # the DPM-Solver's flow_shift
    before = {n: p.detach().clone() for n, p in trainer.policy.params.items()}
    trainer.train()
    metrics = [json.loads(line) for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 2 and all(m["policy/optimizer_steps"] > 0 for m in metrics)
    assert any(not torch.equal(p.detach(), before[n]) for n, p in trainer.policy.params.items())
    assert (tmp_path / "run/lora/pytorch_lora_weights.safetensors").is_file()
