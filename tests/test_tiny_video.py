"""The tiny video world: its checker reads ground-truth renders and refuses wrong ones, its prompt files match their
generator, and its builder makes a tiny Wan pipeline that the stock WanPipeline and flowrl's adapter load."""

import json
import random

import numpy as np
import pytest
import torch
from conftest import REPO
from safetensors.torch import load_file
from scipy import ndimage

from flowrl.data import read_prompts
from flowrl.rewards import build_reward
from flowrl.rewards.motion_world import DIRECTIONS, NUM_FRAMES, SPEED, VIDEO_SIZE, check_motion_metadata, judge_video
from flowrl.tiny.video import (
    HELD_OUT_PAIRS,
    all_metadata,
    make_metadata,
    render_clip,
    render_dataset,
    sample_clip,
    split,
)


def _as_tensor(videos: np.ndarray) -> torch.Tensor:
    """uint8 ``(B, F, H, W, 3)`` -> float ``(B, F, 3, H, W)`` in [0, 1], the reward contract's videos."""
    return torch.from_numpy(videos).permute(0, 1, 4, 2, 3).float() / 255


@pytest.fixture(scope="module")
def ground_truth():
    """120 seeded clips over all 160 prompts."""
    return render_dataset(all_metadata(), 120, seed=3)


def test_checker_reads_ground_truth_renders(ground_truth):
    videos, metas = ground_truth
    assert videos.shape == (120, NUM_FRAMES, VIDEO_SIZE, VIDEO_SIZE, 3)
    judgements = build_reward("motion_world").judge(_as_tensor(videos), [m["prompt"] for m in metas], metas)
    assert np.mean([j.strict for j in judgements]) >= 0.99
    assert np.mean([j.dense for j in judgements]) >= 0.99
    for j, m in zip(judgements[:20], metas):  # the fitted velocity is the rendered one
        dx, dy = DIRECTIONS[m["direction"]]
        np.testing.assert_allclose(j.velocity, (dx * SPEED, dy * SPEED), atol=0.1)
    # blurred by a 3x3 box and noised (sigma 0.03): a decoder's softness does not fool it
    blurred = ndimage.uniform_filter(videos.astype(np.float32), size=(1, 1, 3, 3, 1))
    noisy = blurred + np.random.default_rng(0).normal(0, 0.03 * 255, blurred.shape)
    noisy = np.clip(noisy, 0, 255).round().astype(np.uint8)
    assert np.mean([judge_video(v, m).strict for v, m in zip(noisy[:60], metas)]) >= 0.99


def test_checker_rejects_static_reversed_and_wrong_videos(ground_truth):
    videos, metas = ground_truth
    videos, metas = videos[:12], metas[:12]
    reward, strict = build_reward("motion_world_direction"), build_reward("motion_world_strict")
    dense = build_reward("motion_world")
    prompts = [m["prompt"] for m in metas]
    good = dense(_as_tensor(videos), prompts, metas)
    static = _as_tensor(np.repeat(videos[:, :1], NUM_FRAMES, axis=1))
    reversed_ = _as_tensor(videos[:, ::-1].copy())
    for bad in (static, reversed_):
        assert reward(bad, prompts, metas).sum() == 0 and strict(bad, prompts, metas).sum() == 0
        assert (dense(bad, prompts, metas) <= good - 0.45).all()  # the motion half of the dense score is lost
    turn = {"left": "up", "up": "right", "right": "down", "down": "left"}  # a perpendicular direction
    for key, change in (("direction", turn), ("color", None), ("shape", None)):
        other = []
        for m in metas:
            if change is None:
                vocab = sorted({x[key] for x in all_metadata()})
                other.append({**m, key: vocab[(vocab.index(m[key]) + 1) % len(vocab)]})
            else:
                other.append({**m, key: change[m[key]]})
        assert strict(_as_tensor(videos), prompts, other).sum() == 0, key
        assert (dense(_as_tensor(videos), prompts, other) < good).all(), key
    # a shape of another prompt moving the right way: motion holds, strict does not
    wrong_shape = [{**m, "shape": "square" if m["shape"] != "square" else "circle"} for m in metas]
    assert reward(_as_tensor(videos), prompts, wrong_shape).mean() == 1.0


def test_metadata_and_options_are_checked():
    with pytest.raises(ValueError, match=r"prompt 'x'.*'direction' must be one of \('left', 'right', 'up', 'down'\)"):
        check_motion_metadata({"prompt": "x", "shape": "circle", "color": "red", "direction": "sideways", "speed": 1})
    with pytest.raises(ValueError, match="'speed' must be a number > 0"):
        make_metadata("circle", "red", "left", speed=0)
    with pytest.raises(ValueError, match="score must be one of"):
        build_reward("motion_world", score="loose")
    with pytest.raises(ValueError, match="at least 2 frames"):
        build_reward("motion_world")(torch.zeros(1, 1, 3, 32, 32), ["p"], [make_metadata("circle", "red", "left")])
    with pytest.raises(ValueError, match="moves 40.0 px"):
        sample_clip(make_metadata("star", "blue", "up", speed=5.0), random.Random(0))


def test_prompt_files_match_the_generator_and_hold_out_pairs():
    train, test = split()
    assert len(train) == len(test) == 80
    assert read_prompts(REPO / "assets/prompts/video_train.jsonl") == json.loads(json.dumps(train))
    assert read_prompts(REPO / "assets/prompts/video_test.jsonl") == json.loads(json.dumps(test))
    for m in train + test:
        check_motion_metadata(m)
        assert (
            m["prompt"].endswith(f"{m['color']} {m['shape']} moving {m['direction']}") and m["tag"] == m["direction"]
        )
    assert all((m["color"], m["direction"]) in HELD_OUT_PAIRS for m in test)
    assert not any((m["color"], m["direction"]) in HELD_OUT_PAIRS for m in train)
    assert {m["prompt"] for m in train}.isdisjoint(m["prompt"] for m in test)
    for split_ in (train, test):  # every direction, colour and shape in both splits, directions balanced
        assert {d: sum(m["direction"] == d for m in split_) for d in DIRECTIONS} == {d: 20 for d in DIRECTIONS}
        assert len({m["color"] for m in split_}) == 8 and len({m["shape"] for m in split_}) == 5


def test_renders_follow_their_clip():
    meta = make_metadata("cross", "green", "down")
    clip = sample_clip(meta, random.Random(1))
    video = render_clip(clip)
    j = judge_video(video, meta)
    assert j.presence == 1.0 and j.shape == 1.0 and j.velocity == pytest.approx((0.0, SPEED), abs=0.05)
    assert clip.at(NUM_FRAMES - 1).cy - clip.at(0).cy == pytest.approx(SPEED * (NUM_FRAMES - 1))


def test_builder_makes_a_pipeline_stock_diffusers_and_flowrl_load(tmp_path):
    from diffusers import WanPipeline

    from flowrl.models import WanModel, load_model
    from flowrl.tiny.build_video import MAX_TOKENS, build, umt5_condition

    times = build(tmp_path, seed=0, n_clips=8, vae_steps=1, dit_steps=1, dit_batch=2, vae_batch=1)
    assert set(times) == {"render_s", "vae_s", "transformer_s"}
    record = json.loads((tmp_path / "tiny-wan/build.json").read_text())
    assert record["seed"] == 0 and record["command"].startswith("python -m flowrl.tiny.build_video")
    assert read_prompts(tmp_path / "prompts/video_test.jsonl") == json.loads(json.dumps(split()[1]))
    pipe = WanPipeline.from_pretrained(tmp_path / "tiny-wan")
    pipe.set_progress_bar_config(disable=True)
    prompts = ["a red circle moving left", "a white star moving up"]
    # the builder's differentiable conditioning is the stock pipeline's encode_prompt
    stock, _ = pipe.encode_prompt(prompts, do_classifier_free_guidance=False, max_sequence_length=MAX_TOKENS)
    tokens = pipe.tokenizer(
        prompts,
        padding="max_length",
        max_length=MAX_TOKENS,
        truncation=True,
        return_attention_mask=True,
        return_tensors="pt",
    )
    with torch.no_grad():
        ours = umt5_condition(pipe.text_encoder, tokens.input_ids, tokens.attention_mask)
    # the same float32 encoder summed in other orders (batch and mask handling): a few ulps per layer apart on some
    # CPUs (1 element of 2048 1.2e-6 apart, relative 9e-7, on an AVX2-only one), not bit-equal
    torch.testing.assert_close(ours, stock, rtol=1e-5, atol=1e-6)
    assert pipe.tokenizer.tokenize("a red circle moving left") == [
        "\u2581a",
        "\u2581red",
        "\u2581circle",
        "\u2581moving",
        "\u2581left",
    ]
    with torch.no_grad():
        frames = pipe(
            prompts[0],
            num_frames=NUM_FRAMES,
            height=VIDEO_SIZE,
            width=VIDEO_SIZE,
            num_inference_steps=1,
            max_sequence_length=MAX_TOKENS,
            output_type="pt",
        ).frames
    assert frames.shape == (1, NUM_FRAMES, 3, VIDEO_SIZE, VIDEO_SIZE)
    model = load_model(
        tmp_path / "tiny-wan", max_sequence_length=MAX_TOKENS, resolution=VIDEO_SIZE, num_frames=NUM_FRAMES
    )
    assert isinstance(model, WanModel) and model.latent_shape == (16, 3, 8, 8)
    # --vae-from: the earlier build's VAE, weights and latent statistics as they were; the same seed trains it again
    build(tmp_path / "again", seed=0, n_clips=8, dit_steps=1, dit_batch=2, vae_from=tmp_path / "tiny-wan")
    build(tmp_path / "fresh", seed=0, n_clips=8, vae_steps=1, dit_steps=1, dit_batch=2, vae_batch=1)
    vae = "tiny-wan/vae/diffusion_pytorch_model.safetensors"
    first, again, fresh = (load_file(f / vae) for f in (tmp_path, tmp_path / "again", tmp_path / "fresh"))
    assert all(torch.equal(first[k], again[k]) and torch.equal(first[k], fresh[k]) for k in first)
    assert json.loads((tmp_path / "again/tiny-wan/build.json").read_text())["vae_from"] == str(tmp_path / "tiny-wan")
    with pytest.raises(FileNotFoundError, match="--vae-from .*no vae/config.json"):
        build(tmp_path / "bad", seed=0, n_clips=8, dit_steps=1, vae_from=tmp_path)


def test_shipped_pipeline_is_small_and_recorded():
    folder = REPO / "assets/tiny-wan"
    size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
    assert size <= 25 * 2**20
    record = json.loads((folder / "build.json").read_text())
    assert record["command"].startswith("python -m flowrl.tiny.build_video") and "seed" in record
    index = json.loads((folder / "model_index.json").read_text())
    assert index["_class_name"] == "WanPipeline"


def test_main_job_runs_from_the_cli_on_the_shipped_model(tmp_path, capsys):
    """`flowrl train configs/tiny_video.yaml`, shrunk (2 iterations, 2 steps, 4 videos each): the held-out evaluation
    reports each configured reward, and the command's summary line names them (not GenEval's accuracy)."""
    from flowrl.cli import main

    main(
        [
            "train",
            str(REPO / "configs/tiny_video.yaml"),
            f"model.path={REPO / 'assets/tiny-wan'}",
            f"run.output_dir={tmp_path / 'run'}",
            "run.iterations=2",
            "sampling.num_steps=2",
            "sampling.group_size=2",
            "sampling.prompts_per_iteration=2",
            "sampling.batch_size=4",
            "eval.num_steps=2",
            "train.minibatch_size=16",
        ]
    )
    result = json.loads((tmp_path / "run/eval.json").read_text())
    for when in ("before", "after"):
        assert set(result[when]["per_reward"]) == {"motion_world", "motion_world_direction", "motion_world_strict"}
        assert result[when]["rewards"]["motion_world_direction"]["n_images"] == 80
    out = capsys.readouterr().out
    assert "mean weighted reward on" in out and "motion_world_direction" in out and "GenEval" not in out
