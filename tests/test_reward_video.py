"""Tests of the video rewards (`rewards.video`): the video contract, the frames wrapper, CLIP temporal
consistency and RAFT motion, on tiny random models built from the real classes (offline)."""

import math

import pytest
import torch
import torch.nn.functional as F
from tiny_pipelines.clip import cut_clip_tokenizer, save_random_clip

from flowrl.rewards import REWARDS, WeightedSum, build_reward, check_inputs
from flowrl.rewards.video import ClipTemporal, Frames, Motion, clip_temporal, frame_indices, frames, motion, raft_size


def _videos(batch=2, num_frames=5, size=8, seed=0):
    videos = torch.rand(batch, num_frames, 3, size, size, generator=torch.Generator().manual_seed(seed))
    return videos, [f"prompt {i}" for i in range(batch)], [{"i": i} for i in range(batch)]


def brightness(images, prompts, metadata):
    """An image reward: mean pixel value of each image, in [0, 1]."""
    return images.mean(dim=(1, 2, 3))


class Recorder:
    """An image reward that records what it was called with and returns the brightness."""

    def __init__(self):
        self.calls = []

    def __call__(self, images, prompts, metadata):
        self.calls.append((images.shape, list(prompts), list(metadata)))
        return brightness(images, prompts, metadata)


# --- the contract -----------------------------------------------------------------------------


def test_check_inputs_videos():
    videos, prompts, metadata = _videos()
    check_inputs(videos, prompts, metadata, video=True)
    check_inputs(videos[:, 0], prompts, metadata)  # images unchanged
    with pytest.raises(ValueError, match=r"videos must have shape \(B, F, 3, H, W\).*\(2, 3, 8, 8\)"):
        check_inputs(videos[:, 0], prompts, metadata, video=True)
    with pytest.raises(ValueError, match=r"images must have shape \(B, 3, H, W\).*wrap an image reward in 'frames'"):
        check_inputs(videos, prompts, metadata)
    with pytest.raises(ValueError, match=r"must lie in \[0, 1\]"):
        check_inputs(videos * 2 - 1, prompts, metadata, video=True)
    with pytest.raises(ValueError, match="2 images, 1 prompts"):
        check_inputs(videos, prompts[:1], metadata, video=True)


def test_weighted_sum_scores_videos_and_names_an_image_reward():
    videos, prompts, metadata = _videos(batch=3)
    combined = WeightedSum({"frames": (Frames(brightness), 2.0)})
    torch.testing.assert_close(combined(videos, prompts, metadata).total, 2 * videos.mean(dim=(1, 2, 3, 4)))
    with pytest.raises(ValueError, match=r"reward 'brightness' scores images, not .* videos; .*'frames'"):
        WeightedSum({"frames": (Frames(brightness), 1.0), "brightness": (brightness, 1.0)})(videos, prompts, metadata)


def test_registered():
    assert {"frames", "clip_temporal", "motion"} <= set(REWARDS)


# --- frames -----------------------------------------------------------------------------------


def test_frame_indices():
    assert frame_indices(5, None).tolist() == [0, 1, 2, 3, 4]
    assert frame_indices(5, 3).tolist() == [0, 2, 4]
    assert frame_indices(8, 3).tolist() == [0, 4, 7]  # round(3.5) = 4 (half to even)
    assert frame_indices(5, 1).tolist() == [2]
    with pytest.raises(ValueError, match="num_frames=6 but the videos have 5 frames"):
        frame_indices(5, 6)


def test_frames_mean_and_min_equal_the_image_reward_by_hand():
    videos, prompts, metadata = _videos(batch=2, num_frames=5)
    per_frame = torch.stack([brightness(videos[:, f], prompts, metadata) for f in range(5)], dim=1)  # (2, 5)
    recorder = Recorder()
    torch.testing.assert_close(Frames(recorder)(videos, prompts, metadata), per_frame.mean(dim=1))
    ((shape, seen_prompts, seen_metadata),) = recorder.calls  # one call, all frames in one batch
    assert shape == (10, 3, 8, 8)
    assert seen_prompts == ["prompt 0"] * 5 + ["prompt 1"] * 5 and seen_metadata == [{"i": 0}] * 5 + [{"i": 1}] * 5
    torch.testing.assert_close(Frames(brightness, "min")(videos, prompts, metadata), per_frame.amin(dim=1))
    torch.testing.assert_close(
        Frames(brightness, "mean", num_frames=3)(videos, prompts, metadata), per_frame[:, [0, 2, 4]].mean(dim=1)
    )
    torch.testing.assert_close(
        Frames(brightness, "min", num_frames=2)(videos, prompts, metadata), per_frame[:, [0, 4]].amin(dim=1)
    )
    empty = Frames(brightness)(videos[:0], [], [])
    assert empty.shape == (0,) and empty.dtype == torch.float32


def test_frames_of_a_differentiable_reward_carry_its_gradient():
    """What the direct-reward methods score on a video family: ``frames`` over the tiny CLIP score, equal to the plain
    scores (mean and min), its gradient the finite differences' (float64), and none on the frames it does not score."""
    from conftest import REPO

    from flowrl.rewards.base import RewardTypeError

    clip = build_reward("clipscore", model_path=str(REPO / "assets" / "tiny-clip"), dtype="float64")
    assert Frames(clip).differentiable and not Frames(brightness).differentiable
    gen = torch.Generator().manual_seed(0)
    videos = torch.rand(2, 3, 3, 4, 4, dtype=torch.float64, generator=gen) * 0.8 + 0.1  # (B, F, 3, H, W)
    prompts, metadata = ["a red circle", "two blue squares"], [{}, {}]
    for aggregate in ("mean", "min"):
        wrapped = Frames(clip, aggregate, num_frames=2)  # frames 0 and 2 of 3
        with_grad = wrapped.score_with_grad(videos, prompts, metadata)
        torch.testing.assert_close(with_grad.float(), wrapped(videos, prompts, metadata), rtol=0, atol=1e-5)
        leaf = videos.clone().requires_grad_()
        wrapped.score_with_grad(leaf, prompts, metadata).sum().backward()
        assert leaf.grad[:, 1].abs().max() == 0 and leaf.grad[:, [0, 2]].abs().max() > 0
    score = lambda v: wrapped.score_with_grad(v, prompts[:1], metadata[:1])  # noqa: E731
    assert torch.autograd.gradcheck(score, (videos[:1].clone().requires_grad_(),), eps=1e-6, atol=1e-5, rtol=1e-4)
    with pytest.raises(RewardTypeError, match=r"frames\(brightness\): the wrapped reward has no score_with_grad"):
        Frames(brightness).score_with_grad(videos, prompts, metadata)


def test_frames_sample_draws_frames_per_video():
    videos, prompts, metadata = _videos(batch=64, num_frames=6)
    per_frame = videos.mean(dim=(2, 3, 4))  # (64, 6)
    one = Frames(brightness, "sample", seed=3)
    scores = one(videos, prompts, metadata)  # one random frame per video
    hits = (per_frame == scores.unsqueeze(1)).sum(dim=1)
    assert (hits == 1).all()  # every score is exactly one of the video's own frame scores
    chosen = (per_frame == scores.unsqueeze(1)).float().argmax(dim=1)
    assert len(set(chosen.tolist())) > 3  # frames differ between videos
    torch.testing.assert_close(Frames(brightness, "sample", seed=3)(videos, prompts, metadata), scores)  # seeded
    torch.testing.assert_close(
        Frames(brightness, "sample", num_frames=6)(videos, prompts, metadata), per_frame.mean(dim=1)
    )  # all frames drawn: the mean
    pairs = Frames(brightness, "sample", num_frames=2, seed=1)
    index = pairs.indices(64, 6)
    assert index.shape == (64, 2) and (index[:, 0] < index[:, 1]).all()


def test_frames_refuses_bad_options():
    videos, prompts, metadata = _videos(num_frames=3)
    with pytest.raises(ValueError, match="aggregate must be one of mean, min, sample, got 'max'"):
        Frames(brightness, "max")
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="num_frames must be an integer >= 1"):
            Frames(brightness, num_frames=bad)
    with pytest.raises(ValueError, match="num_frames=4 but the videos have 3 frames"):
        Frames(brightness, num_frames=4)(videos, prompts, metadata)
    with pytest.raises(TypeError, match="already scores videos"):
        Frames(Frames(brightness))
    with pytest.raises(TypeError, match="missing a required argument: 'reward'; accepted options: reward"):
        build_reward("frames")
    with pytest.raises(ValueError, match="unknown reward 'nope'"):
        build_reward("frames", reward="nope")
    with pytest.raises(TypeError, match="reward_options are the options of a reward given by name"):
        frames(brightness, reward_options={"a": 1})
    with pytest.raises(ValueError, match=r"videos must have shape \(B, F, 3, H, W\)"):
        Frames(brightness)(videos[:, 0], prompts, metadata)


def test_frames_of_clipscore_through_build_reward(tiny_clip_dir):
    from flowrl.rewards import clipscore

    videos, prompts, metadata = _videos(batch=2, num_frames=4, size=32, seed=4)
    reward = build_reward(
        "frames", reward="clipscore", reward_options={"model_path": str(tiny_clip_dir)}, aggregate="min", num_frames=2
    )
    image_reward = clipscore(tiny_clip_dir)
    by_hand = torch.stack([image_reward(videos[:, f], prompts, metadata) for f in (0, 3)], dim=1).amin(dim=1)
    torch.testing.assert_close(reward(videos, prompts, metadata), by_hand, rtol=1e-5, atol=1e-5)
    assert reward.name == "frames(clipscore)"


# --- CLIP temporal ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_clip_dir(tmp_path_factory):
    """A random-weight CLIPModel (1 text layer, 2 vision layers, seed 0) with a CLIP tokenizer cut to 500 merges and a
    32 px image processor, saved as from the hub."""
    return save_random_clip(tmp_path_factory.mktemp("tiny_clip"), cut_clip_tokenizer(500), text_layers=1)


def test_clip_temporal_matches_the_formula(tiny_clip_dir):
    """Mean cosine of consecutive frames' CLIPModel.get_image_features, from the full CLIPModel."""
    from transformers import CLIPModel

    reward = build_reward("clip_temporal", model_path=str(tiny_clip_dir))
    videos = torch.rand(2, 4, 3, 40, 48, generator=torch.Generator().manual_seed(5))
    videos[1, 2] = videos[1, 1]  # one repeated frame pair
    full = CLIPModel.from_pretrained(tiny_clip_dir, local_files_only=True).eval()
    with torch.no_grad():
        out = full.get_image_features(pixel_values=reward.preprocess(videos.flatten(0, 1)))
    features = out if isinstance(out, torch.Tensor) else out.pooler_output
    e = F.normalize(features, dim=-1).view(2, 4, -1)  # (B, F, D)
    expected = torch.stack([sum(torch.dot(e[b, f], e[b, f + 1]) for f in range(3)) / 3 for b in range(2)])
    scores = reward(videos, ["a", "b"], [{}, {}])
    torch.testing.assert_close(scores, expected, rtol=1e-5, atol=1e-5)
    assert scores.dtype == torch.float32 and (scores.abs() <= 1 + 1e-6).all()
    static = videos[:, :1].expand(-1, 3, -1, -1, -1)
    torch.testing.assert_close(reward(static, ["a", "b"], [{}, {}]), torch.ones(2), rtol=0, atol=1e-5)
    chunked = clip_temporal(tiny_clip_dir, batch_size=3)(videos, ["a", "b"], [{}, {}])
    torch.testing.assert_close(chunked, scores, rtol=1e-5, atol=1e-5)


def test_clip_temporal_refuses_bad_input(tiny_clip_dir, tmp_path):
    reward = clip_temporal(tiny_clip_dir)
    with pytest.raises(ValueError, match="clip_temporal: videos need at least 2 frames, got 1"):
        reward(torch.rand(1, 1, 3, 32, 32), ["a"], [{}])
    with pytest.raises(FileNotFoundError, match=r"clip_temporal: model_path '.*nowhere' is not a local folder"):
        clip_temporal(tmp_path / "nowhere")
    with pytest.raises(ValueError, match="clip_temporal: batch_size must be an integer >= 1"):
        clip_temporal(tiny_clip_dir, batch_size=0)
    assert isinstance(reward, ClipTemporal) and reward.accepts_video


# --- RAFT motion ------------------------------------------------------------------------------


class StubFlow(torch.nn.Module):
    """RAFT's call signature; the flow is the mean brightness change (second - first) at each pixel in both
    components, so a static video has zero flow. Records its inputs."""

    def forward(self, first, second, num_flow_updates=12):
        self.seen = (first, second, num_flow_updates)
        change = (second - first).mean(dim=1, keepdim=True)  # (N, 1, H', W')
        return [torch.zeros_like(change).expand(-1, 2, -1, -1), change.expand(-1, 2, -1, -1)]


def test_raft_size():
    assert raft_size(100, 120) == (128, 160)
    assert raft_size(256, 480) == (256, 480)
    assert raft_size(250, 300) == (256, 304)


def test_motion_formula_on_a_stubbed_flow():
    from torchvision.models.optical_flow import Raft_Small_Weights

    stub = StubFlow()
    reward = Motion(stub, num_flow_updates=3)
    static = torch.rand(1, 1, 3, 64, 64).expand(2, 4, -1, -1, -1)
    torch.testing.assert_close(reward(static, ["a", "b"], [{}, {}]), torch.zeros(2), rtol=0, atol=0)

    # frames 0 -> 1 -> 2: uniform steps of +0.25 then 0 in brightness; RAFT runs at 128 x 128 (2x the input)
    videos = torch.stack([torch.full((3, 64, 64), v) for v in (0.25, 0.5, 0.5)]).unsqueeze(0)  # (1, 3, 3, 64, 64)
    scores = reward(videos, ["a"], [{}])
    first, second, updates = stub.seen
    assert first.shape == (2, 3, 128, 128) and updates == 3
    # RAFT input is torchvision's OpticalFlow preset ([0, 1] -> [-1, 1])
    frame0, frame1 = (
        F.interpolate(videos[0, i : i + 1], size=(128, 128), mode="bilinear", antialias=True) for i in (0, 1)
    )
    reference, _ = Raft_Small_Weights.C_T_V2.transforms()(frame0, frame1)
    torch.testing.assert_close(first[:1], reference)
    # flow in RAFT pixels: (0.5, 0.5) then 0, i.e. (0.25, 0.25) input pixels: magnitude 0.25 * sqrt(2), mean /2
    expected = 0.25 * math.sqrt(2) / 2
    torch.testing.assert_close(scores, torch.tensor([expected]))
    torch.testing.assert_close(
        Motion(stub, normalize=True)(videos, ["a"], [{}]), torch.tensor([expected / math.hypot(64, 64)])
    )
    torch.testing.assert_close(Motion(stub, direction="penalize")(videos, ["a"], [{}]), torch.tensor([-expected]))
    torch.testing.assert_close(
        Motion(stub, size=(128, 256), batch_size=1)(videos, ["a"], [{}]), torch.tensor([math.hypot(0.25, 0.125) / 2])
    )  # u scaled by 64/256, v by 64/128


@pytest.fixture(scope="module")
def raft_small_file(tmp_path_factory):
    from torchvision.models.optical_flow import raft_small

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("raft") / "raft_small_random.pth"
    torch.save(raft_small(weights=None).state_dict(), path)
    return path


def test_motion_raft_small_end_to_end(raft_small_file):
    from torchvision.models.optical_flow import raft_small

    reward = build_reward("motion", model_path=str(raft_small_file), num_flow_updates=2)
    saved = torch.load(raft_small_file, weights_only=True)
    assert all(torch.equal(saved[k], v) for k, v in reward.model.state_dict().items())
    assert type(reward.model) is type(raft_small(weights=None))
    videos = torch.rand(1, 3, 3, 100, 120, generator=torch.Generator().manual_seed(6))
    flow = reward.flow(videos)
    assert flow.shape == (1, 2, 2, 128, 160) and torch.isfinite(flow).all()
    scores = reward(videos, ["a"], [{}])
    torch.testing.assert_close(scores, flow.norm(dim=2).mean().view(1))
    assert scores.shape == (1,) and scores.dtype == torch.float32 and (scores >= 0).all()


def test_motion_refuses_bad_files_and_options(raft_small_file, tmp_path):
    with pytest.raises(ValueError, match=r"motion: model_path '.*' is not a raft_large state dict"):
        motion(raft_small_file, arch="raft_large")
    with pytest.raises(ValueError, match="arch must be one of raft_small, raft_large"):
        motion(raft_small_file, arch="raft")
    with pytest.raises(FileNotFoundError, match=r"motion: model_path '.*nowhere.pth' is not a file"):
        motion(tmp_path / "nowhere.pth")
    torch.save({"weight": torch.zeros(1)}, tmp_path / "other.pth")
    with pytest.raises(ValueError, match="not a raft_small or raft_large state dict"):
        motion(tmp_path / "other.pth")
    for options, match in [
        ({"size": (100, 128)}, "size must be"),
        ({"direction": "up"}, "direction must be"),
        ({"num_flow_updates": 0}, "num_flow_updates must be"),
    ]:
        with pytest.raises(ValueError, match=f"motion: {match}"):
            Motion(StubFlow(), **options)
    with pytest.raises(ValueError, match="motion: videos need at least 2 frames"):
        Motion(StubFlow())(torch.rand(1, 1, 3, 8, 8), ["a"], [{}])


# --- VideoAlign -------------------------------------------------------------------------------

TEMPLATE = "Rate the video for {text_prompt}. Visual <|VQ_reward|> motion <|MQ_reward|> text <|TA_reward|>"


@pytest.fixture(scope="module")
def tiny_videoalign_dir(tmp_path_factory):
    """A random-weight Qwen2-VL (2 layers, hidden 32) with a byte-level Qwen2 tokenizer holding the reward tokens,
    a Qwen2-VL processor with a Qwen-style chat template, a random reward head and VideoAlign's model_config.json."""
    import json

    from safetensors.torch import save_file
    from tiny_qwen2vl import tiny_qwen2vl

    model, processor = tiny_qwen2vl(extra_tokens=("<|VQ_reward|>", "<|MQ_reward|>", "<|TA_reward|>"))
    folder = tmp_path_factory.mktemp("tiny_videoalign")
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    save_file({"weight": torch.randn(3, 32)}, folder / "rm_head.safetensors")
    (folder / "videoalign_prompt.txt").write_text(TEMPLATE)
    stats = {"VQ_mean": 0.5, "VQ_std": 2.0, "MQ_mean": -1.0, "MQ_std": 0.5, "TA_mean": 0.0, "TA_std": 4.0}
    (folder / "model_config.json").write_text(
        json.dumps({"data_config": {"num_frames": 4}, "inference_config": stats})
    )
    return folder


def _by_hand(folder, videos, prompts, frames_taken, template=TEMPLATE):
    """VideoAlign's forward written out: processor batch, Qwen2-VL hidden states, head at the reward tokens
    (VQ output at the VQ token, ...) and at the last token."""
    from safetensors.torch import load_file
    from transformers import AutoProcessor, Qwen2VLForConditionalGeneration

    processor = AutoProcessor.from_pretrained(folder, local_files_only=True)
    model = Qwen2VLForConditionalGeneration.from_pretrained(folder, local_files_only=True).eval()
    head = load_file(folder / "rm_head.safetensors")["weight"]  # (3, D)
    texts = [
        f"<|im_start|>user\n<|vision_start|><|video_pad|><|vision_end|>{template.format(text_prompt=p)}"
        "<|im_end|>\n<|im_start|>assistant\n"
        for p in prompts
    ]
    batch = processor(
        text=texts,
        videos=[v[frames_taken] for v in videos],
        padding=True,
        return_tensors="pt",
        videos_kwargs={"do_rescale": False, "do_sample_frames": False},
    )
    with torch.no_grad():
        hidden = model.model(**batch).last_hidden_state  # (B, L, D)
    special, last = [], []
    for b in range(len(prompts)):
        ids = batch["input_ids"][b].tolist()
        at = [ids.index(processor.tokenizer.convert_tokens_to_ids(f"<|{d}_reward|>")) for d in ("VQ", "MQ", "TA")]
        special.append(torch.stack([hidden[b, at[i]] @ head[i] for i in range(3)]))
        last.append(hidden[b, int(batch["attention_mask"][b].sum()) - 1] @ head.T)
    return torch.stack(special), torch.stack(last)


def test_videoalign_matches_the_reward_head_by_hand(tiny_videoalign_dir):
    from flowrl.rewards.videoalign import videoalign

    videos = torch.rand(2, 6, 3, 56, 84, generator=torch.Generator().manual_seed(7))
    prompts = ["a cat", "two dogs run on a beach"]  # different lengths: padding
    special, last = _by_hand(tiny_videoalign_dir, videos, prompts, frame_indices(6, 4))
    mean, std = torch.tensor([0.5, -1.0, 0.0]), torch.tensor([2.0, 0.5, 4.0])

    reward = build_reward("videoalign", model_path=str(tiny_videoalign_dir))
    scores = reward(videos, prompts, [{}, {}])
    torch.testing.assert_close(reward.last_scores, (special - mean) / std, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(scores, ((special - mean) / std).sum(dim=1), rtol=1e-4, atol=1e-5)  # "Overall"
    weighted = videoalign(tiny_videoalign_dir, weights={"MQ": 2.0}, normalize=False, batch_size=1)
    torch.testing.assert_close(weighted(videos, prompts, [{}, {}]), 2 * special[:, 1], rtol=1e-4, atol=1e-5)
    at_last = videoalign(tiny_videoalign_dir, reward_token="last", normalize=False)
    torch.testing.assert_close(at_last(videos, prompts, [{}, {}]), last.sum(dim=1), rtol=1e-4, atol=1e-5)
    total = WeightedSum({"videoalign": (reward, 1.0)})(videos, prompts, [{}, {}]).total
    torch.testing.assert_close(total, scores)


def test_videoalign_refuses_bad_options(tiny_videoalign_dir, tmp_path):
    from flowrl.rewards.videoalign import videoalign

    with pytest.raises(ValueError, match="reward_token must be 'special' or 'last'"):
        videoalign(tiny_videoalign_dir, reward_token="first")
    with pytest.raises(ValueError, match=r"weights has unknown dimensions \['Overall'\]"):
        videoalign(tiny_videoalign_dir, weights={"Overall": 1.0})
    with pytest.raises(ValueError, match="needs <|VQ_reward|>.* in prompt_template"):
        videoalign(tiny_videoalign_dir, prompt_template="rate {text_prompt}")
    with pytest.raises(ValueError, match="must contain '{text_prompt}'"):
        videoalign(tiny_videoalign_dir, prompt_template="rate it", reward_token="last")
    with pytest.raises(FileNotFoundError, match="videoalign: model_path '.*nowhere' is not a local folder"):
        videoalign(tmp_path / "nowhere")
