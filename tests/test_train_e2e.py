"""Few-iteration training runs on a random tiny SD3 pipeline: artefacts, ratio, resume, LoRA, errors, CLI."""

import json
import subprocess
import sys

import pytest
import torch
from conftest import tiny_overrides
from safetensors.torch import load_file

from flowrl.config import ConfigError, load_config
from flowrl.trainer import Trainer


def nan_reward(images, prompts, metadata):
    """A user reward that is broken on purpose."""
    return torch.full((len(prompts),), float("nan"))


def _config(tmp_path, random_pipeline, prompt_files, out="run", rewards="jpeg_compressibility", **extra):
    (tmp_path / "c.yaml").write_text(f"rewards:\n  {rewards!r}:\n    weight: 1.0\n")
    train, test = prompt_files
    return load_config(tmp_path / "c.yaml", tiny_overrides(random_pipeline, train, test, tmp_path / out, **extra))


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, random_pipeline, prompt_files):
    tmp = tmp_path_factory.mktemp("run")
    cfg = _config(tmp, random_pipeline, prompt_files, **{"run.mixed_precision": "no"})
    trainer = Trainer(cfg)
    before = {n: p.detach().clone() for n, p in trainer.policy.params.items()}
    result = trainer.train()
    return cfg, trainer, before, result


def test_run_folder_has_every_artefact(finished_run):
    cfg, _, _, result = finished_run
    out = cfg.run.output_dir
    from pathlib import Path

    out = Path(out)
    for name in (
        "config.yaml",
        "metrics.jsonl",
        "eval.json",
        "reward_curve.png",
        "grid.png",
        "diagnostics.png",
        "lora/pytorch_lora_weights.safetensors",
        "checkpoints/checkpoint-000002/trainable.safetensors",
    ):
        assert (out / name).is_file(), name
    metrics = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["iteration"] for m in metrics] == [1, 2]
    # the process's peak resident memory so far: this test process holds the tiny pipeline and torch, >= 100 MiB
    assert 0.1 < metrics[0]["memory/host_peak_gib"] <= metrics[1]["memory/host_peak_gib"] < 64
    assert "memory/gpu_peak_gib" not in metrics[0]  # a CPU run
    tags = {json.loads(l)["tag"] for l in Path(cfg.train_prompts).read_text().splitlines()}
    for m in metrics:  # every logged tag is a training tag; the overall mean lies between the tag means
        logged = {k.split("/")[2] for k in m if k.startswith("reward/tag/")}
        assert logged and logged <= tags
        means = [m[f"reward/tag/{t}/mean"] for t in logged]
        assert min(means) - 1e-5 <= m["reward/total/mean"] <= max(means) + 1e-5
    assert {"overall", "per_tag", "n_images"} <= set(result["after"])
    assert load_config(out / "config.yaml").run.iterations == 2  # the saved config reloads


def test_ratio_is_exactly_one_before_the_first_step(finished_run):
    _, _, _, _ = finished_run
    cfg = finished_run[0]
    from pathlib import Path

    metrics = [json.loads(l) for l in (Path(cfg.run.output_dir) / "metrics.jsonl").read_text().splitlines()]
    for m in metrics:
        assert m["policy/optimizer_steps"] >= 2
        assert m["policy/ratio_first_max_dev"] == 0.0


def test_trainable_parameters_changed(finished_run):
    _, trainer, before, _ = finished_run
    changed = [n for n, p in trainer.policy.params.items() if not torch.equal(p.detach(), before[n])]
    assert changed and all("lora" in n for n in trainer.policy.params)


def test_lora_loads_in_stock_diffusers(finished_run, random_pipeline):
    from pathlib import Path

    from diffusers import StableDiffusion3Pipeline

    cfg, trainer, _, _ = finished_run
    pipe = StableDiffusion3Pipeline.from_pretrained(random_pipeline, text_encoder_3=None, tokenizer_3=None)
    x = torch.randn(2, 4, 16, 16, generator=torch.Generator().manual_seed(0))
    emb = trainer.model.encode(["a photo of a star", "a photo of two circles"])
    kwargs = dict(
        hidden_states=x,
        encoder_hidden_states=emb.embeds,
        pooled_projections=emb.pooled,
        timestep=torch.tensor([500.0, 500.0]),
    )
    with torch.no_grad():
        base = pipe.transformer(**kwargs).sample
        pipe.load_lora_weights(str(Path(cfg.run.output_dir) / "lora"))
        stock = pipe.transformer(**kwargs).sample
        ours = trainer.model.transformer(**kwargs).sample
    assert not torch.allclose(base, ours)
    torch.testing.assert_close(stock, ours, rtol=1e-4, atol=1e-5)


def test_full_finetuning_writes_a_pipeline_that_loads_in_stock_diffusers(tmp_path, random_pipeline, prompt_files):
    from pathlib import Path

    from diffusers import StableDiffusion3Pipeline

    cfg = _config(
        tmp_path,
        random_pipeline,
        prompt_files,
        **{"model.lora_rank": 0, "run.iterations": 1, "run.mixed_precision": "no"},
    )
    with pytest.warns(UserWarning, match="run.keep_checkpoints unset keeps all 1 checkpoints"):
        trainer = Trainer(cfg)
    before = {n: p.detach().clone() for n, p in trainer.policy.params.items()}
    trainer.train()
    out = Path(cfg.run.output_dir)
    assert not (out / "lora").exists()
    saved = StableDiffusion3Pipeline.from_pretrained(
        out / "pipeline", text_encoder_3=None, tokenizer_3=None
    ).transformer.state_dict()
    trained = {n: p.detach() for n, p in trainer.policy.params.items()}
    assert set(trained) <= set(saved)  # the state dict also holds buffers (the position embedding)
    assert any(not torch.equal(trained[n], before[n]) for n in trained)  # it trained, and what it wrote is that
    for n, p in trained.items():
        torch.testing.assert_close(saved[n].float(), p, rtol=0, atol=0)


def test_resume_continues_a_killed_run_exactly(tmp_path, random_pipeline, prompt_files, finished_run):
    cfg_full = finished_run[0]
    from pathlib import Path

    part = _config(
        tmp_path, random_pipeline, prompt_files, out="part", **{"run.mixed_precision": "no", "run.iterations": 1}
    )
    Trainer(part).train()  # "killed" after iteration 1 (its checkpoint is all that counts)
    first_config = (tmp_path / "part/config.yaml").read_text()
    with open(tmp_path / "part/metrics.jsonl", "a") as f:
        f.write('{"iteration": 2, "reward/to')  # a line torn by the crash
    # the resumed part also recomputes activations in backward: the update must not change
    resumed = _config(
        tmp_path,
        random_pipeline,
        prompt_files,
        out="part",
        **{
            "run.mixed_precision": "no",
            "run.resume": "true",
            "run.keep_checkpoints": 1,
            "train.gradient_checkpointing": "true",
        },
    )
    trainer = Trainer(resumed)
    assert trainer.model.transformer.is_gradient_checkpointing
    trainer.train()
    a = load_file(Path(cfg_full.run.output_dir) / "checkpoints/checkpoint-000002/trainable.safetensors")
    b = load_file(tmp_path / "part/checkpoints/checkpoint-000002/trainable.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6)
    lines = (tmp_path / "part/metrics.jsonl").read_text().splitlines()
    assert [json.loads(l)["iteration"] for l in lines] == [1, 2]
    assert (tmp_path / "part/config.yaml").read_text() == first_config  # the first part's config is kept
    assert "resume: true" in (tmp_path / "part/config-resume-000001.yaml").read_text()
    assert (tmp_path / "part/checkpoints/checkpoint-000002/lora").is_dir()  # sealed inside the checkpoint
    assert sorted(p.name for p in (tmp_path / "part/checkpoints").iterdir()) == [
        "checkpoint-000002"
    ]  # keep_checkpoints=1


def test_existing_run_folder_needs_resume(tmp_path, random_pipeline, prompt_files):
    cfg = _config(tmp_path, random_pipeline, prompt_files)
    (tmp_path / "run").mkdir()
    (tmp_path / "run/metrics.jsonl").write_text("")
    (tmp_path / "run/config.yaml").write_text("original")
    cfg.model.path = str(tmp_path / "no-model-needed")  # the check comes before the model is loaded
    with pytest.raises(FileExistsError, match="run.resume=true"):
        Trainer(cfg)
    assert (tmp_path / "run/config.yaml").read_text() == "original"


def test_resume_without_a_checkpoint_says_it_starts_over(tmp_path, random_pipeline, prompt_files):
    """Nothing to lose (no checkpoint, no metrics row): resume starts over. With rows or damaged checkpoints it
    refuses instead (tests/test_bad_inputs.py)."""
    cfg = _config(tmp_path, random_pipeline, prompt_files, **{"run.resume": "true"})
    (tmp_path / "run").mkdir()
    (tmp_path / "run/metrics.jsonl").write_text("")  # a run killed before its first iteration ended
    trainer = Trainer(cfg)
    with pytest.warns(UserWarning, match="holds no complete checkpoint: starting the run from iteration 0"):
        assert trainer.checkpointer.resume() == (0, 0.0)
    assert not (tmp_path / "run/metrics.jsonl").exists()


def test_bad_reward_is_named_before_any_work(tmp_path, random_pipeline, prompt_files):
    cfg = _config(tmp_path, random_pipeline, prompt_files, rewards="test_train_e2e:nan_reward")
    with pytest.raises(ValueError, match="nan_reward.*NaN"):
        Trainer(cfg)
    cfg = _config(tmp_path, random_pipeline, prompt_files, rewards="no_such_reward")
    with pytest.raises(ValueError, match="unknown reward 'no_such_reward'"):
        Trainer(cfg)


def test_bad_paths_are_named(tmp_path, random_pipeline, prompt_files):
    with pytest.raises(FileNotFoundError, match="missing-model"):
        Trainer(_config(tmp_path, tmp_path / "missing-model", prompt_files))
    train, _ = prompt_files
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        Trainer(_config(tmp_path, random_pipeline, (train, tmp_path / "nope.jsonl")))


def test_kl_needs_lora(tmp_path, random_pipeline, prompt_files):
    with pytest.raises(ConfigError, match="train.kl_beta"):  # from the config, before the model is loaded
        (_config(tmp_path, random_pipeline, prompt_files, **{"train.kl_beta": 0.1, "model.lora_rank": 0}))


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "flowrl.cli", *map(str, args)], capture_output=True, text=True)


@pytest.mark.slow  # 15 s of subprocesses: in CI (CI=true); the default run keeps the default suite under 15 min
def test_cli_sample_and_eval(tmp_path, random_pipeline, prompt_files, finished_run):
    from pathlib import Path

    lora = Path(finished_run[0].run.output_dir) / "lora"
    r = _cli(
        "sample",
        "--model",
        random_pipeline,
        "--lora",
        lora,
        "--prompt",
        "a photo of a star",
        "-n",
        2,
        "--num-steps",
        2,
        "--out",
        tmp_path / "g.png",
    )
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "g.png").is_file()
    r = _cli(
        "eval",
        "--model",
        random_pipeline,
        "--prompts",
        prompt_files[1],
        "--images-per-tag",
        1,
        "--num-steps",
        2,
        "--out",
        tmp_path / "e.json",
    )
    assert r.returncode == 0, r.stderr
    result = json.loads((tmp_path / "e.json").read_text())
    assert set(result["per_tag"]) == {"single_object", "two_object", "counting", "colors", "position", "color_attr"}
    assert result["n_images"] == 6 and 0.0 <= result["overall"] <= 1.0
    from flowrl.precision import native_bf16

    # `flowrl eval` autocasts where the CPU computes bf16 natively (--bf16 / --no-bf16 force it)
    assert result["bf16"] is native_bf16("cpu") and "CPU cores" in result["machine"]


def test_cli_errors_are_one_line(tmp_path):
    r = _cli("train", "configs/tiny_geneval.yaml", "train.lerning_rate=1")
    assert r.returncode == 2 and "train.lerning_rate" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    r = _cli("eval", "--model", tmp_path, "--out", tmp_path / "e.json")
    assert r.returncode == 2 and "model_index.json" in r.stderr


def test_accelerate_fp16_is_refused_before_the_model_loads(tmp_path):
    import os

    env = {**os.environ, "ACCELERATE_MIXED_PRECISION": "fp16"}  # what `accelerate launch --mixed_precision fp16` sets
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "flowrl.cli",
            "train",
            "configs/tiny_geneval.yaml",
            f"run.output_dir={tmp_path / 'run'}",
        ],
        capture_output=True,
        text=True,
        env=env,
    )
    assert r.returncode == 2 and "fp16" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not (tmp_path / "run/metrics.jsonl").exists()


def test_accelerate_bf16_without_run_bf16_is_warned_about(tmp_path):
    import os

    env = {**os.environ, "ACCELERATE_MIXED_PRECISION": "bf16"}  # what `accelerate launch --mixed_precision bf16` sets
    code = (
        "from flowrl.config import load_config; from flowrl.trainer import Trainer; "
        f"Trainer(load_config('configs/tiny_geneval.yaml', ['run.output_dir={tmp_path / 'run'}', 'run.device=cpu']))"
    )
    r = subprocess.run(
        [sys.executable, "-W", "error::UserWarning", "-c", code], capture_output=True, text=True, env=env
    )
    assert r.returncode != 0 and "run.mixed_precision" in r.stderr and "is not used" in r.stderr, r.stderr[-2000:]


def test_mix_grpo_window_moves_counts_nfe_and_resumes(tmp_path, random_pipeline, prompt_files):
    mix = {
        "run.mixed_precision": "no",
        "sampling.num_steps": 6,
        "sampling.window.size": 2,
        "sampling.window.interval": 1,
        "sampling.window.flash_ratio": 0.5,
        "run.iterations": 3,
    }
    Trainer(_config(tmp_path, random_pipeline, prompt_files, out="full", **mix)).train()
    full = [json.loads(l) for l in (tmp_path / "full/metrics.jsonl").read_text().splitlines()]
    assert [m["sampling/window_start"] for m in full] == [0, 1, 2]
    # window [l, l+1] keeps l + 2 steps, the 6 - 1 - (l + 1) after it become round(half) DPM steps; 2 prompts x 2 images, CFG x2
    assert [m["cost/nfe"] for m in full] == [(l + 2 + max(1, round((4 - l) / 2))) * 4 * 2 for l in (0, 1, 2)]
    assert all(m["cost/trained_transitions"] <= 2 * 4 for m in full)
    Trainer(_config(tmp_path, random_pipeline, prompt_files, out="part", **{**mix, "run.iterations": 1})).train()
    Trainer(_config(tmp_path, random_pipeline, prompt_files, out="part", **{**mix, "run.resume": "true"})).train()
    part = [json.loads(l) for l in (tmp_path / "part/metrics.jsonl").read_text().splitlines()]
    assert [m["sampling/window_start"] for m in part] == [0, 1, 2]


def test_branch_grpo_tree_run_prunes_and_counts(tmp_path, random_pipeline, prompt_files):
    tree = {
        "run.mixed_precision": "no",
        "sampling.num_steps": 5,
        "sampling.group_size": 4,
        "sampling.shape": "tree",
        "sampling.tree.split_steps": "[0,2]",
        "sampling.tree.width_keep": 1,
        "sampling.tree.fusion": "prob",
    }
    result = Trainer(_config(tmp_path, random_pipeline, prompt_files, **tree)).train()
    metrics = [json.loads(l) for l in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    # 2 prompts: per tree 1 + 2 + 2 + 4 + 4 velocity rows over the 5 steps, doubled by CFG
    assert all(m["cost/nfe"] == 2 * 13 * 2 for m in metrics)
    # trained steps 0-3 hold 2 + 2 + 4 + 4 transitions per tree; after the last split (step 2) width pruning
    # keeps the chains of the best and the worst leaf: 2 of the 4 at step 3
    assert all(m["cost/trained_transitions"] == 2 * (2 + 2 + 4 + 2) for m in metrics)  # (24 without pruning)
    assert result["after"]["n_images"] > 0
    with pytest.raises(ConfigError, match="sampling.group_size"):
        _config(tmp_path, random_pipeline, prompt_files, **{**tree, "sampling.group_size": 8})


def test_grpo_guard_run_logs_per_step_diagnostics(tmp_path, random_pipeline, prompt_files):
    guard = {
        "run.mixed_precision": "no",
        "train.ratio_norm": "true",
        "train.step_weighting": "guard",
        "train.kl_beta": 0.01,
        "train.kl_type": "velocity",
        "sampling.kernel": "dance_sde",
        "sampling.noise_level": 0.3,
    }
    Trainer(_config(tmp_path, random_pipeline, prompt_files, **guard)).train()
    metrics = [json.loads(l) for l in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    assert all(m["policy/ratio_first_max_dev"] == 0.0 for m in metrics)  # RatioNorm of a zero move is exactly 0
    assert {"diag/step_00/ratio_mean", "diag/step_01/clip_high", "policy/kl"} <= set(metrics[-1])
    assert (tmp_path / "run/diagnostics.png").is_file()


def test_advantage_aggregation_and_best_of_n_run(tmp_path, random_pipeline, prompt_files):
    over = {
        "run.mixed_precision": "no",
        "rewards.jpeg_incompressibility.weight": 0.5,
        "sampling.group_size": 4,
        "train.reward_aggregation": "advantage",
        "train.best_of_n": 2,
    }
    Trainer(_config(tmp_path, random_pipeline, prompt_files, **over)).train()
    metrics = [json.loads(l) for l in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    # best-of-2 of 4 per group: half the samples' transitions (2 prompts x 2 kept x 2 trained steps)
    assert all(m["cost/trained_transitions"] == 2 * 2 * 2 for m in metrics)
    assert {"reward/jpeg_compressibility/mean", "reward/jpeg_incompressibility/mean"} <= set(metrics[0])


def test_a_single_prompt_file_trains_and_fills_the_grid(tmp_path, random_pipeline, prompt_files):
    one = tmp_path / "one.jsonl"
    one.write_text(prompt_files[0].read_text().splitlines()[0] + "\n")
    cfg = _config(tmp_path, random_pipeline, (one, one), **{"run.iterations": 1, "run.mixed_precision": "no"})
    trainer = Trainer(cfg)
    assert (
        len({m["prompt"] for m in trainer.evaluator.grid_metas()}) == 1 and len(trainer.evaluator.grid_metas()) == 12
    )
    trainer.train()
    assert load_file(tmp_path / "run/grid_before.safetensors")["images"].shape[0] == 12


def test_bf16_decode_gives_float32_images_close_to_the_float32_decode(tmp_path, random_pipeline, prompt_files):
    trainer = Trainer(_config(tmp_path, random_pipeline, prompt_files, **{"sampling.decode_precision": "bf16"}))
    latents = torch.randn((3, *trainer.model.latent_shape), generator=torch.Generator().manual_seed(0))
    half = trainer.method.decode(latents)
    trainer.cfg.sampling.decode_precision = "no"
    full = trainer.method.decode(latents)
    assert half.dtype == torch.float32 and half.shape == full.shape
    assert 0 < (half - full).abs().max() < 0.05  # bf16 really ran, and the images agree
    with pytest.raises(ConfigError, match="sampling.decode_precision"):
        _config(tmp_path, random_pipeline, prompt_files, **{"sampling.decode_precision": "fp16"})
    cfg = _config(
        tmp_path,
        random_pipeline,
        prompt_files,
        **{
            "sampling.decode_precision": "no",  # a bare `no`, as typed
            "sampling.ode_precision": "no",
        },
    )
    assert (cfg.sampling.decode_precision, cfg.sampling.ode_precision) == ("no", "no")


@pytest.mark.parametrize("tree", [False, True])
def test_rollout_images_decode_in_decode_precision_whatever_the_rollout_precision(
    tmp_path, random_pipeline, prompt_files, tree
):
    extra = (
        {
            "sampling.shape": "tree",
            "sampling.tree.split_steps": "[0]",
            "sampling.tree.branch": 2,
            "sampling.kernel": "dance_sde",
        }
        if tree
        else {}
    )
    trainer = Trainer(
        _config(
            tmp_path,
            random_pipeline,
            prompt_files,
            **{"run.mixed_precision": "bf16", "sampling.decode_precision": "no", **extra},
        )
    )
    assert (trainer.method.shape.name == "tree") == tree
    seen, decode = [], trainer.model.decode
    trainer.model.decode = lambda latents: seen.append(torch.is_autocast_enabled("cpu")) or decode(latents)
    trainer.method.rollout(trainer.sample_prompts(0), torch.Generator().manual_seed(0))
    assert seen and not any(seen)  # float32 decode, though the rollout ran under bf16 autocast


def _captured_grads(trainer):
    """Replace the optimizer step by a recorder of the gradients it would apply (the weights stay put), and
    move the weights by the same random amount between the rollout and the training pass, as an earlier
    update would: the ratio then differs from 1, some transitions are clipped and the KL is not 0."""
    grads = []
    trainer.policy.optimizer.step = lambda *a, **k: grads.append(
        [p.grad.clone() for p in trainer.policy.params.values()]
    )
    optimize = trainer.method.optimize

    def moved_then_optimize(*args, **kwargs):
        g = torch.Generator().manual_seed(3)
        with torch.no_grad():
            for p in trainer.policy.params.values():
                p.add_(torch.randn(p.shape, generator=g) * 0.001)
        return optimize(*args, **kwargs)

    trainer.method.optimize = moved_then_optimize
    return grads


def test_micro_batches_accumulate_the_minibatch_gradient(tmp_path, random_pipeline, prompt_files):
    extra = {
        "run.mixed_precision": "no",
        "train.minibatch_size": 5,
        "train.kl_beta": 0.05,
        "train.step_weighting": "noise_aware",
        "train.max_grad_norm": 1e9,
    }
    whole = Trainer(_config(tmp_path, random_pipeline, prompt_files, out="whole", **extra))
    micro = Trainer(
        _config(tmp_path, random_pipeline, prompt_files, out="micro", **extra, **{"train.micro_batch_size": 2})
    )  # chunks of 2, 2, 1
    g_whole, g_micro = _captured_grads(whole), _captured_grads(micro)
    m_whole, m_micro = whole.step(0), micro.step(0)
    assert len(g_whole) == len(g_micro) == m_whole["policy/optimizer_steps"] >= 2
    for a, b in zip(g_whole, g_micro):
        for x, y in zip(a, b):
            torch.testing.assert_close(y, x, rtol=1e-4, atol=1e-5 * x.abs().max().item())  # summation order only
    assert (
        m_whole["policy/kl"] > 0 and 0 < m_whole["policy/clipfrac"] < 1 and m_whole["policy/ratio_first_max_dev"] > 0
    )
    for key in ("policy/loss", "policy/kl", "policy/clipfrac", "policy/ratio_first_max_dev", "policy/approx_kl"):
        assert m_micro[key] == pytest.approx(m_whole[key], rel=1e-4, abs=1e-9), key


def test_resolution_sets_the_rollout_size_and_is_checked_first(tmp_path, random_pipeline, prompt_files):
    with pytest.raises(ConfigError, match=r"model.resolution.*multiple of 8"):
        Trainer(_config(tmp_path, random_pipeline, prompt_files, out="bad", **{"model.resolution": 36}))
    trainer = Trainer(_config(tmp_path, random_pipeline, prompt_files, **{"model.resolution": 32}))
    assert trainer.model.latent_shape == (4, 8, 8)
    samples = trainer.method.rollout(trainer.sample_prompts(0), torch.Generator().manual_seed(0))
    assert samples.images.shape[1:] == (3, 32, 32) and samples.rollout.state.shape[1:] == (4, 8, 8)
    assert trainer.evaluator.evaluate()["n_images"] > 0


def test_held_out_prompts_are_evaluated_before_and_after_and_printed(tmp_path, random_pipeline, prompt_files, capsys):
    from flowrl.cli import main

    train, test = prompt_files
    (tmp_path / "c.yaml").write_text("rewards:\n  jpeg_compressibility:\n    weight: 1.0\n")
    main(
        [
            "train",
            str(tmp_path / "c.yaml"),
            *tiny_overrides(
                random_pipeline,
                train,
                train,
                tmp_path / "run",
                **{"run.iterations": 1, "eval.held_out": str(test), "eval.held_out_images_per_tag": 2},
            ),
        ]
    )
    result = json.loads((tmp_path / "run/eval.json").read_text())
    tags = {json.loads(line)["tag"] for line in test.read_text().splitlines()}
    for when in ("before", "after"):
        held_out = result[when]["held_out"]
        assert held_out["prompts"] == str(test) and held_out["n_images"] == 2 * len(tags)
        assert "held_out" not in json.loads((tmp_path / "run/eval_before.json").read_text())["held_out"]
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert f"held-out {test} prompts: {result['before']['held_out']['overall']:.3f} -> " in line


def test_trainer_takes_reward_callables_directly_as_trl_does(tmp_path, random_pipeline, prompt_files):
    import flowrl

    calls = []

    def brightness(images, prompts, metadata):
        calls.append(len(prompts))
        return images.flatten(1).mean(1)

    train, test = prompt_files
    cfg = flowrl.load_config(
        None,
        tiny_overrides(
            random_pipeline, train, test, tmp_path / "run", **{"run.iterations": 1, "eval.prompts": str(train)}
        ),
    )
    trainer = flowrl.Trainer(cfg, rewards={"brightness": (brightness, 2.0)})
    assert list(trainer.rewards.rewards) == ["brightness"] and trainer.rewards.rewards["brightness"][1] == 2.0
    assert list(trainer.cfg.rewards) == ["brightness"] and list(cfg.rewards) == ["geneval"]  # the caller's is kept
    trainer.train()
    metrics = json.loads((tmp_path / "run/metrics.jsonl").read_text().splitlines()[-1])
    assert "reward/brightness/mean" in metrics and calls
    with pytest.raises(TypeError, match="reward 'x' is a int, not a callable"):
        flowrl.Trainer(cfg, rewards={"x": 3})
    with pytest.raises(TypeError, match="takes a flowrl.Config"):
        flowrl.Trainer({"run": {}})


def test_the_public_face_is_importable_from_flowrl():
    import flowrl
    from flowrl import (
        KERNELS,
        METHODS,
        REWARDS,
        Config,
        Trainer,
        autocast,
        evaluate,
        generate,
        load_config,
        load_model,
        register_reward,
    )

    assert callable(evaluate) and callable(generate) and callable(load_model) and callable(register_reward)
    assert "grpo" in METHODS and "flow_sde" in KERNELS and "geneval" in REWARDS and callable(autocast)
    assert isinstance(load_config(None), Config) and Trainer.__name__ == "Trainer"
    assert set(flowrl.__all__) <= set(dir(flowrl))
