"""The SANA adapters (`flowrl.models.SanaModel`, `flowrl.models.SanaSprintModel`) on tiny random SanaPipelines and
SanaSprintPipelines built offline (a one-layer Gemma2 text encoder with an offline Gemma BPE tokenizer trained on the
pipeline's complex human instruction and the tiny world's prompts, a DC-AE of factor 4): what is special to SANA. The
conformance suite (tests/test_conformance.py, families ``SanaModel`` and ``SanaSprintModel``) checks sampling against
the stock pipelines, the ratio, resume, LoRA and full fine-tune export."""

import json
import shutil

import pytest
import torch
from conftest import WHOLE_MINIBATCHES, no_download, read_metrics, shrink_recipe, tiny_pipeline
from tiny_pipelines.common import noise
from tiny_pipelines.sana import build_random_sana_pipeline, build_random_sana_sprint_pipeline, stock_sana_sprint

from flowrl.models import SanaModel, SanaSprintModel, load_model, model_class
from flowrl.trainer import Trainer

SIDE = 32  # px: the pipelines' unit; VAE factor 4, 8 x 8 latents
LENGTH = 16  # prompt tokens (the pipelines' default is 300)
PROMPTS = ["A photo of a Red star", "a photo of two blue circles and a green square"]


sana = tiny_pipeline("sana", build_random_sana_pipeline)
sprint = tiny_pipeline("sprint", build_random_sana_sprint_pipeline)


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
    start = noise(model, 2)
    # one step is deterministic in the stock pipeline too
    ours = generate(model, PROMPTS, [0, 1], 1, 4.5)
    stock = stock_sana_sprint(sprint, model, metas, start, 1, 4.5, deterministic=False)
    torch.testing.assert_close(ours, stock, rtol=0, atol=1e-4)
    # three stochastic stock steps = three cps steps at noise level 1 with the pipeline generator's noise
    stock = stock_sana_sprint(sprint, model, metas, start, 3, 4.5, False, torch.Generator().manual_seed(7))
    cond, draws, sigmas = model.encode(PROMPTS), torch.Generator().manual_seed(7), model.sigmas(3)
    x = start
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
    settings = {"model.dtype": "float32", "model.resolution": SIDE, "model.max_sequence_length": LENGTH}
    settings.update({**no_download("pickscore"), "sampling.group_size": 2, **WHOLE_MINIBATCHES})
    settings.update({"train.minibatch_size": 36, "train.ema_decay": 0.0})  # one step: 2 x 2 images x 9 noised copies
    cfg = shrink_recipe("sana_diffusion_nft", sana, prompt_files, tmp_path / "run", **settings)
    assert cfg.train.method == "nft" and cfg.sampling.guidance_scale == 1.0 and cfg.train.nft.keep_flat_groups
    trainer = Trainer(cfg)
    assert isinstance(trainer.model, SanaModel) and trainer.cfg.sampling.shift == 3.0  # the DPM-Solver's flow_shift
    before = {n: p.detach().clone() for n, p in trainer.policy.params.items()}
    trainer.train()
    metrics = read_metrics(tmp_path / "run")
    assert len(metrics) == 2 and all(m["policy/optimizer_steps"] > 0 for m in metrics)
    assert any(not torch.equal(p.detach(), before[n]) for n, p in trainer.policy.params.items())
    assert (tmp_path / "run/lora/pytorch_lora_weights.safetensors").is_file()
