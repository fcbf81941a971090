"""Tests of the GenEval reward: the hand-made detector on tiny-world renders, and GenEval's rules."""

import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from flowrl.rewards.base import REWARDS, build_reward
from flowrl.rewards.geneval import (
    COUNTING_THRESHOLD,
    Detection,
    detect,
    detect_batch,
    evaluate,
    geneval,
    keep_confident,
    relative_position,
)
from flowrl.rewards.geneval.world import BACKGROUND, COLORS, IMAGE_SIZE, MAX_SIZE, MIN_SIZE, SHAPES
from flowrl.tiny.prompts import split
from flowrl.tiny.render import Obj, render, sample_scene

N_SCENES = 600


def _tensor(image: np.ndarray) -> torch.Tensor:
    """uint8 (H, W, 3) -> float (3, H, W) in [0, 1]."""
    return torch.from_numpy(image.copy()).permute(2, 0, 1).float() / 255


def _degrade(images: torch.Tensor, seed: int, noise: float = 0.03) -> torch.Tensor:
    """Blur (B, 3, H, W) with a 3x3 binomial (Gaussian, sigma ~0.85) kernel and add Gaussian noise."""
    k = torch.tensor([1.0, 2.0, 1.0])
    kernel = (torch.outer(k, k) / 16).expand(3, 1, 3, 3)  # (3, 1, 3, 3)
    blurred = F.conv2d(F.pad(images, (1, 1, 1, 1), mode="replicate"), kernel, groups=3)
    generator = torch.Generator().manual_seed(seed)
    return (blurred + noise * torch.randn(blurred.shape, generator=generator)).clamp(0, 1)


@pytest.fixture(scope="module")
def rendered():
    """N_SCENES seeded scenes, half from train and half from test prompts: (images, prompts, metadata)."""
    train, test = split()
    rng = random.Random(0)
    metas = [rng.choice(test if i % 2 else train) for i in range(N_SCENES)]
    images = torch.stack([_tensor(render(sample_scene(m, rng))) for m in metas])  # (N, 3, 64, 64)
    return images, [m["prompt"] for m in metas], metas


def test_clean_renders_are_scored_correct(rendered):
    images, prompts, metas = rendered
    strict = geneval(strict=True)(images, prompts, metas)
    dense = geneval()(images, prompts, metas)
    assert strict.shape == dense.shape == (N_SCENES,) and strict.dtype == dense.dtype == torch.float32
    assert set(strict.tolist()) <= {0.0, 1.0} and bool((dense >= strict).all()) and bool((dense <= 1).all())
    assert strict.mean().item() >= 0.99  # 1.000 here, and on 2000 scenes of seeds 0 and 5


def test_blurred_noisy_renders_are_scored_correct(rendered):
    images, prompts, metas = rendered
    strict = geneval(strict=True)(_degrade(images, seed=1), prompts, metas)
    assert strict.mean().item() >= 0.95  # 1.000 here, and on 2000 scenes of seeds 0 and 5


@pytest.mark.parametrize("shape", SHAPES)
def test_each_shape_at_extreme_sizes_in_every_colour(shape):
    for color in COLORS:
        for size in (MIN_SIZE, MAX_SIZE):
            obj = Obj(shape, color, 21, 40, size)
            clean = render([obj])
            blurred = _degrade(_tensor(clean)[None], seed=size)[0]
            for image, box_tolerance in (
                (clean, 1.5),
                (blurred, 3.0),
            ):  # a star spans 0.95 of its box; blur erases tips
                (det,) = detect(image)
                assert (det.cls, det.color) == (shape, color)
                assert det.score >= COUNTING_THRESHOLD
                assert np.allclose(det.box, obj.box, atol=box_tolerance)


def test_blank_and_noise_images_have_no_detections():
    blank = np.full((IMAGE_SIZE, IMAGE_SIZE, 3), BACKGROUND, dtype=np.uint8)
    assert detect(blank) == [] and detect(_tensor(blank)) == []
    assert detect_batch(_degrade(_tensor(blank)[None].repeat(2, 1, 1, 1), seed=0)) == [[], []]
    noise = torch.rand(3, IMAGE_SIZE, IMAGE_SIZE, generator=torch.Generator().manual_seed(0))
    assert detect(noise) == []


def test_detect_accepts_uint8_and_float_alike_and_checks_shapes():
    image = render([Obj("star", "blue", 20, 20, 15), Obj("circle", "white", 45, 45, 13)])
    assert detect(image) == detect(_tensor(image)) == detect_batch(_tensor(image)[None])[0]
    assert sorted((d.cls, d.color) for d in detect(image)) == [("circle", "white"), ("star", "blue")]
    with pytest.raises(ValueError, match="shape"):
        detect(_tensor(image)[None])
    with pytest.raises(ValueError, match="uint8"):
        detect(image.astype(np.float32))
    with pytest.raises(ValueError, match=r"\(B, 3, H, W\)"):
        detect_batch(_tensor(image))
    with pytest.raises(ValueError, match="floating point"):
        detect_batch((_tensor(image)[None] * 255).to(torch.uint8))


@pytest.mark.parametrize(
    "metadata, match",
    [
        ({"prompt": "p", "include": []}, "empty 'include'"),
        (
            {"prompt": "p", "include": [{"class": "star", "count": 1}], "exclude": [{"class": "star"}]},
            "exclude clause",
        ),
        ({"prompt": "p", "include": [{"class": "star", "count": "1"}]}, "'count' must be an integer"),
        (
            {
                "prompt": "p",
                "include": [
                    {"class": "star", "count": 1},
                    {"class": "circle", "count": 1, "position": ["left of", -1]},
                ],
            },
            "'position'",
        ),
        (
            {
                "prompt": "p",
                "include": [{"class": "star", "count": 1}, {"class": "circle", "count": 1, "position": ["right", 0]}],
            },
            "'position'",
        ),
        (
            {
                "prompt": "p",
                "include": [
                    {"class": "star", "count": 1},
                    {"class": "star", "count": 1},
                    {"class": "circle", "count": 1, "position": ["left of", True]},
                ],
            },
            "'position'",
        ),
        ({"prompt": "p"}, "empty 'include'"),
    ],
)
def test_malformed_metadata_is_named(metadata, match):
    with pytest.raises(ValueError, match=match):
        evaluate([], metadata)


def _det(cls, box, color="red", score=1.0):
    return Detection(cls, color, tuple(float(v) for v in box), score)


def test_counting_is_exact_through_exclude():
    meta = {
        "tag": "counting",
        "include": [{"class": "circle", "count": 2}],
        "exclude": [{"class": "circle", "count": 3}],
    }
    boxes = [(0, 0, 10, 10), (20, 0, 30, 10), (40, 0, 50, 10)]
    assert evaluate([_det("circle", b) for b in boxes[:2]], meta)[:2] == (True, 1.0)
    assert evaluate([_det("circle", b) for b in boxes], meta)[:2] == (False, 0.5)  # three for "two"
    assert evaluate([_det("circle", boxes[0])], meta)[:2] == (False, 0.5)  # one for "two"
    assert evaluate([_det("circle", b) for b in boxes[:2]] + [_det("square", boxes[2])], meta)[0]
    # GenEval's counting threshold: a third circle seen with confidence 0.5 is not counted.
    unsure = [_det("circle", b) for b in boxes[:2]] + [_det("circle", boxes[2], score=0.5)]
    assert evaluate(keep_confident(unsure, meta), meta)[0]
    assert not evaluate(keep_confident(unsure, {**meta, "tag": "two_object"}), meta)[0]


def test_colour_is_checked_on_the_most_confident_objects():
    meta = {"include": [{"class": "circle", "count": 1, "color": "red"}], "exclude": []}
    red, blue = _det("circle", (0, 0, 10, 10), "red", 0.6), _det("circle", (20, 0, 30, 10), "blue", 0.95)
    assert not evaluate([red, blue], meta)[0]  # the first circle (by confidence) is blue
    assert evaluate([red, _det("circle", (20, 0, 30, 10), "blue", 0.5)], meta)[0]
    assert not evaluate([_det("square", (0, 0, 10, 10), "red")], meta)[0]


def test_relative_position_margin():
    ref = (10, 10, 20, 20)
    assert relative_position((8, 40, 18, 50), ref) == {"below"}  # 2 px to the left is within the margin
    assert relative_position((5, 40, 15, 50), ref) == {"below"}  # dx shrinks to -3 of |offset| 30.4
    assert relative_position((40, 10, 50, 20), ref) == {"right of"}
    assert relative_position((40, 40, 50, 50), ref) == {"right of", "below"}
    assert relative_position((11, 11, 21, 21), ref) == set()  # shrunk to zero: no relation
    assert relative_position((10, 0, 20, 10), ref) == {"above"}
    meta = {"include": [{"class": "square", "count": 1}, {"class": "circle", "count": 1, "position": ["left of", 0]}]}
    assert not evaluate([_det("square", ref), _det("circle", (8, 40, 18, 50))], meta)[0]
    assert evaluate([_det("square", ref), _det("circle", (-20, 12, -10, 22))], meta)[0]


def test_failed_reference_fails_the_position_clause():
    meta = {"include": [{"class": "square", "count": 1}, {"class": "circle", "count": 1, "position": ["left of", 0]}]}
    correct, dense, failures = evaluate([_det("circle", (0, 0, 10, 10))], meta)
    assert (correct, dense, len(failures)) == (False, 0.0, 2)


def test_dense_is_the_fraction_of_clauses_met():
    meta = {
        "tag": "color_attr",
        "include": [{"class": "circle", "count": 1, "color": "red"}, {"class": "star", "count": 1, "color": "blue"}],
        "exclude": [],
    }
    dets = [_det("circle", (0, 0, 10, 10), "red"), _det("star", (20, 0, 30, 10), "green")]
    assert evaluate(dets, meta)[:2] == (False, 0.5)
    image = _tensor(render([Obj("circle", "red", 15, 15, 14), Obj("star", "green", 45, 45, 16)]))[None]
    assert geneval()(image, ["a red circle and a blue star"], [meta]).tolist() == [0.5]
    assert geneval(strict=True)(image, ["a red circle and a blue star"], [meta]).tolist() == [0.0]


def test_reward_is_registered_and_needs_geneval_metadata():
    assert {"geneval", "geneval_strict"} <= set(REWARDS)
    assert build_reward("geneval").strict is False and build_reward("geneval_strict").strict is True
    images = torch.full((1, 3, 64, 64), 0.5)
    with pytest.raises(ValueError, match="a photo of a cat"):
        geneval()(images, ["a photo of a cat"], [{"tag": "single_object"}])


def test_metadata_is_checked_before_detection(monkeypatch):
    import sys

    geneval_module = sys.modules[
        "flowrl.rewards.geneval"
    ]  # the attribute flowrl.rewards.geneval is the factory function

    def no_detection(*args, **kwargs):
        raise AssertionError("metadata should be refused before detection")

    monkeypatch.setattr(geneval_module, "detect_batch", no_detection)
    images = torch.full((2, 3, 64, 64), 0.5)
    good = {"tag": "single_object", "include": [{"class": "star", "count": 1}], "exclude": []}
    bad = {"tag": "counting", "include": [{"class": "star", "count": "2"}], "exclude": []}
    with pytest.raises(ValueError, match="'count' must be an integer"):
        geneval()(images, ["a star", "two stars"], [good, bad])


@pytest.mark.parametrize("clause", [{"class": "dog", "count": 1}, {"class": "star", "count": 1, "color": "pink"}])
def test_classes_and_colours_outside_the_tiny_world_are_named(clause):
    # real-photo GenEval metadata would otherwise score 0 everywhere without a word
    meta = {"tag": "colors", "include": [clause], "exclude": []}
    with pytest.raises(
        ValueError, match=r"geneval: metadata of prompt 'a photo of a dog' asks for .*knows the shapes"
    ):
        geneval()(torch.full((1, 3, 64, 64), 0.5), ["a photo of a dog"], [meta])


def test_graded_dense_weighs_holding_clauses_by_confidence():
    meta = {"include": [{"class": "circle", "count": 2}], "exclude": [{"class": "circle", "count": 3}]}
    dets = [_det("circle", (0, 0, 10, 10), score=0.5), _det("circle", (20, 0, 30, 10), score=0.7)]
    ok, dense, _ = evaluate(dets, meta, graded=True)
    assert ok and dense == pytest.approx(1 - (1 - 0.6) / 2)  # include holds at mean confidence 0.6
    assert evaluate(dets, meta)[1] == 1.0  # ungraded: a clause that holds counts 1
    assert evaluate(dets[:1], meta, graded=True)[1] == 0.5  # a failed clause counts 0 either way


def test_lenient_reward_grades_rough_shapes_and_matches_on_clean_renders(rendered):
    images, prompts, metas = rendered
    lenient = geneval(lenient=True)(images[:100], prompts[:100], metas[:100])
    strict = geneval(strict=True)(images[:100], prompts[:100], metas[:100])
    assert bool((lenient[strict == 1] > 0.9).all())  # clean renders keep (almost) full credit
    # a rough square (two 5 px corners bitten off) is rejected by the gold detector but graded leniently
    image = np.full((IMAGE_SIZE, IMAGE_SIZE, 3), BACKGROUND, np.uint8)
    image[20:42, 20:42] = COLORS["red"]
    image[20:25, 20:25] = BACKGROUND
    image[37:42, 37:42] = BACKGROUND
    meta = {"tag": "colors", "include": [{"class": "square", "count": 1, "color": "red"}], "exclude": []}
    gold = geneval()(_tensor(image)[None], ["a photo of a red square"], [meta])
    soft = geneval(lenient=True)(_tensor(image)[None], ["a photo of a red square"], [meta])
    assert detect(image) == [] and gold.item() == 0.0
    assert 0.5 < soft.item() < 1
