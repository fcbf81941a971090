"""The diagnostic scripts under benchmarks/: gradient signal-to-noise and per-step reward influence."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from conftest import tiny_overrides


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, Path(__file__).parent.parent / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def preset(tmp_path, random_pipeline, prompt_files):
    (tmp_path / "c.yaml").write_text("rewards:\n  jpeg_compressibility:\n    weight: 1.0\n")
    over = tiny_overrides(
        random_pipeline,
        *prompt_files,
        tmp_path / "run",
        **{"run.mixed_precision": "no", "sampling.group_size": 4, "sampling.num_steps": 4},
    )
    return [str(tmp_path / "c.yaml"), *[o for o in over if not o.startswith("run.output_dir")]]


def test_gradient_snr_is_deterministic_per_batch_and_bounded(preset):
    from flowrl.config import load_config
    from flowrl.trainer import Trainer

    snr = _script("gradient_snr")
    trainer = Trainer(load_config(preset[0], preset[1:]))
    a, b = snr.policy_gradient(trainer, 0), snr.policy_gradient(trainer, 0)
    assert a.norm() > 0 and torch.allclose(a, b)  # same rollout, same gradient
    result = snr.main([*preset, "--batches", "3"])
    assert len(result["pairwise_cosine"]) == 3 and all(-1 <= c <= 1 for c in result["pairwise_cosine"])
    assert result["images_per_batch"] == 2 * 4


def test_step_influence_has_one_row_per_stochastic_step(preset, tmp_path):
    result = _script("step_influence").main([*preset, "--iterations", "1", "--out", str(tmp_path / "s.json")])
    assert [r["step"] for r in result["per_step"]] == [0, 1, 2]  # 4 steps, the last one deterministic
    assert all(r["within_group_var"] >= 0 for r in result["per_step"]) and (tmp_path / "s.json").is_file()
    assert result["full_sde"]["within_group_var"] > 0  # independent noise: the images of a group differ


@pytest.mark.slow
def test_base_headroom_pass_at_k_bounds_the_mean_and_reconstruction_is_scored(tmp_path):
    headroom = _script("base_headroom")
    out = tmp_path / "h.json"
    result = headroom.main(
        ["--prompts", "test", "--max-prompts", "3", "-k", "2", "--times", "0", "1", "--out", str(out)]
    )
    assert result == {
        **json.loads(out.read_text()),
        "denoise_from_scenes": {0.0: result["denoise_from_scenes"][0.0], 1.0: result["denoise_from_scenes"][1.0]},
    }
    for tag in result["pass_at_k"].values():
        assert 0 <= tag["mean"] <= tag["pass_at_k"] <= 1
    assert sum(t["prompts"] for t in result["pass_at_k"].values()) == 3
    assert result["denoise_from_scenes"][0.0] >= 2 / 3  # the shipped VAE reconstructs rendered scenes
    with pytest.raises(ValueError, match="times"):
        headroom.denoise_from_scenes(None, [], [1.5])


def test_decode_precision_check_scores_the_same_rollouts_both_ways():
    result = _script("decode_precision_check").main(
        ["--rollouts", "1", "sampling.prompts_per_iteration=1", "sampling.group_size=2", "sampling.num_steps=2"]
    )
    assert result["images"] == 2 and 0 <= result["identical_reward_frac"] <= 1
    assert 0 < result["max_pixel_diff"] < 0.05 and result["decode_s_bf16"] > 0


def test_failure_mode_sorts_rendered_scenes():
    from flowrl.tiny.render import Obj, render

    mode = _script("failure_modes").failure_mode
    three = {"tag": "counting", "include": [{"class": "star", "count": 3}], "exclude": [{"class": "star", "count": 4}]}
    stars = [Obj("star", "red", 14, 14, 16), Obj("star", "blue", 48, 14, 16), Obj("star", "green", 14, 48, 16)]

    def as_tensor(scene):
        return torch.from_numpy(render(scene)).permute(2, 0, 1).float() / 255  # (3, H, W) in [0, 1]

    assert mode(as_tensor(stars), three) is None
    assert mode(as_tensor([]), three) == "empty"
    assert mode(as_tensor(stars[:2]), three) == "composition"  # two clean stars: a wrong count
    assert mode(as_tensor(stars[:2] + [Obj("circle", "green", 14, 48, 16)]), three) == "unread_shape"


def test_nft_text_encoders_trains_both_text_towers(preset, tmp_path):
    from flowrl.config import load_config

    script = _script("nft_text_encoders")
    over = [*preset[1:], "train.method=nft", "train.nft.old_decay=0.5", f"run.output_dir={tmp_path / 'te'}"]
    trainer = script.text_encoder_trainer(load_config(preset[0], over), text_lr=1e-2)
    pipe = trainer.model.pipe
    before = {n: p.detach().clone() for n, p in trainer.policy.params.items() if n.startswith("text_encoder")}
    assert {n.split(".")[0] for n in before} == set(script.TEXT_ENCODERS)
    table = trainer.model.encode(["", "a photo of a star"])
    with torch.no_grad(), trainer.policy.holding({**trainer.policy.params, **{n: p + 1 for n, p in before.items()}}):
        shifted = table[torch.tensor([1])].embeds  # encoded by the weights held when indexed
    assert not torch.equal(shifted, table[torch.tensor([1])].embeds)
    trainer.train()
    moved = [n for n, p in before.items() if not torch.equal(p, trainer.policy.params[n].detach())]
    assert any(n.startswith("text_encoder.") for n in moved) and any(n.startswith("text_encoder_2.") for n in moved)
    assert pipe.text_encoder.text_model.embeddings.token_embedding.weight.requires_grad
