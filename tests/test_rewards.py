"""Tests of the `rewards` package: contract checks, registry, JPEG and CLIP rewards (tiny, offline)."""

import inspect
import math
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from tiny_pipelines.clip import cut_clip_tokenizer, save_random_clip

from flowrl import rewards
from flowrl.rewards import (
    REWARDS,
    WeightedSum,
    build_reward,
    check_inputs,
    check_scores,
    clipscore,
    jpeg_compressibility,
    jpeg_incompressibility,
    register_reward,
)


def _batch(batch=2, size=16, seed=0):
    images = torch.rand(batch, 3, size, size, generator=torch.Generator().manual_seed(seed))
    prompts = [f"a photo of {i} cats" for i in range(batch)]
    return images, prompts, [{} for _ in range(batch)]


def brightness(images, prompts, metadata):
    """A user reward defined outside the package: mean pixel value, in [0, 1]."""
    return images.mean(dim=(1, 2, 3))


def make_scaled_brightness(scale):
    """A user factory: returns a reward."""
    return lambda images, prompts, metadata: scale * images.mean(dim=(1, 2, 3))


# --- registry ---------------------------------------------------------------------------------


def test_registry_holds_builtin_rewards():
    assert {"clipscore", "jpeg_compressibility", "jpeg_incompressibility"} <= set(REWARDS)
    reward = build_reward("jpeg_compressibility", quality=80)
    assert reward.name == "jpeg_compressibility" and reward.quality == 80


def test_unknown_name_lists_registered():
    with pytest.raises(ValueError, match=r"unknown reward 'nope'; registered rewards: .*clipscore.*jpeg_comp"):
        build_reward("nope")


def test_unknown_option_is_named():
    with pytest.raises(TypeError, match=r"'jpeg_compressibility'.*'qualty'.*accepted options: quality"):
        build_reward("jpeg_compressibility", qualty=90)


def test_option_declarations_are_the_factories_signatures():
    """What the CLI checks before torch imports (``rewards.options``, read from the source) is each registered
    factory's signature as ``inspect`` reads it (a ``__signature__`` set after the ``def``, which the source does not
    show, only makes it accept more: ``build_reward`` checks those), and each reward's cheap check takes its factory's
    defaults."""
    from flowrl.rewards.options import OPTION_CHECKS, FactoryOptions, factory_options

    for name, factory in REWARDS.items():
        params = inspect.signature(factory).parameters.values()
        keyword = [p for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        required = tuple(p.name for p in keyword if p.default is p.empty)
        any_other = any(p.kind is p.VAR_KEYWORD for p in params)
        declared = factory_options(name)
        if "__signature__" in vars(factory):
            assert declared.any_other and set(declared.required) <= set(required), name
        else:
            assert declared == FactoryOptions(tuple(p.name for p in keyword), required, any_other), name
    assert factory_options("nope") is None and factory_options("pkg.mod:fn") is None
    for name, check in OPTION_CHECKS.items():
        defaults = inspect.signature(REWARDS[name]).parameters
        for p in inspect.signature(check).parameters.values():
            assert p.kind is p.VAR_KEYWORD or p.default == defaults[p.name].default, (name, p.name)


def test_check_options_refuses_what_build_reward_refuses(tmp_path):
    """``check_options`` (torch-free, run by the CLI first) refuses a missing or unknown option in the words of
    ``build_reward``, runs a reward's own cheap check, and passes a reward that is not built in."""
    for name, options in [("jpeg_compressibility", {"qualty": 90}), ("clipscore", {}), ("remote", {})]:
        with pytest.raises(rewards.RewardTypeError) as checked:
            rewards.check_options(name, options)
        with pytest.raises(rewards.RewardTypeError) as built:
            build_reward(name, **options)
        assert str(checked.value) == str(built.value)
    with pytest.raises(FileNotFoundError, match=r"^hpsv2: model_path '.*missing.pt' not found"):
        rewards.check_options("hpsv2", {"model_path": str(tmp_path / "missing.pt")})
    with pytest.raises(ValueError, match=r"^clipscore: batch_size must be an integer >= 1"):
        rewards.check_options("clipscore", {"model_path": str(tmp_path), "batch_size": 0})
    rewards.check_options("jpeg_compressibility", {"quality": 80})
    rewards.check_options(f"{__name__}:make_scaled_brightness", {"anything": 1})  # build_reward checks it


def test_register_refuses_duplicate_name():
    with pytest.raises(ValueError, match="already registered"):
        register_reward("clipscore")(lambda: None)


def test_dotted_path_user_reward_and_factory():
    images, prompts, metadata = _batch()
    reward = build_reward(f"{__name__}:brightness")
    assert reward is brightness
    torch.testing.assert_close(reward(images, prompts, metadata), images.mean(dim=(1, 2, 3)))
    scaled = build_reward(f"{__name__}:make_scaled_brightness", scale=2.0)
    torch.testing.assert_close(scaled(images, prompts, metadata), 2 * images.mean(dim=(1, 2, 3)))


def test_dotted_path_from_user_module(tmp_path, monkeypatch):
    (tmp_path / "my_user_rewards.py").write_text(
        "import torch\ndef ones(images, prompts, metadata):\n    return torch.ones(len(prompts))\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    images, prompts, metadata = _batch(batch=3)
    assert build_reward("my_user_rewards:ones")(images, prompts, metadata).tolist() == [1.0, 1.0, 1.0]


def test_dotted_path_errors_name_what_is_missing():
    with pytest.raises(ValueError, match="module 'no_such_module_xyz' not found"):
        build_reward("no_such_module_xyz:f")
    with pytest.raises(ValueError, match="has no attribute 'no_such_function'"):
        build_reward(f"{__name__}:no_such_function")
    with pytest.raises(ValueError, match="must look like 'package.module:function'"):
        build_reward("rewards:")


def test_bad_spec_types_are_refused_with_one_line():
    with pytest.raises(
        TypeError, match="reward spec must be a registered name or 'package.module:function', got None"
    ):
        build_reward(None)
    with pytest.raises(TypeError, match=r"reward spec 'flowrl:__name__' names a str, not a callable"):
        build_reward("flowrl:__name__", scale=2.0)  # with options: used to fail inside the signature check
    with pytest.raises(ValueError, match="names a function of Python's standard library"):
        build_reward("math:pi")


def test_import_rewards_pulls_in_neither_the_trainer_nor_samplers_nor_transformers():
    """``import flowrl.rewards`` loads no other flowrl module but the package's stdlib-only :mod:`flowrl.cpu` (run at
    import: MKL's reproducible mode), and neither transformers nor diffusers."""
    code = (
        "import sys, flowrl.rewards; print(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('transformers', 'diffusers') or (m.startswith('flowrl.') and not m.startswith('flowrl.rewards') "
        "and m != 'flowrl.cpu')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_a_users_rewards_and_samplers_modules_in_the_working_folder_change_nothing(tmp_path):
    """flowrl installs one top-level package: a user's ``rewards.py`` or ``samplers.py`` beside their script (where
    custom rewards live) neither shadows flowrl's nor is imported by it."""
    for name in ("rewards", "samplers"):
        (tmp_path / f"{name}.py").write_text(f"raise ImportError('the user\\'s {name}.py was imported')\n")
    code = (
        "import flowrl.rewards, flowrl.samplers, flowrl.trainer, flowrl.cli; "
        "from flowrl.rewards import build_reward; assert build_reward('jpeg_compressibility') is not None; "
        "import sys; assert 'rewards' not in sys.modules and 'samplers' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], cwd=tmp_path, check=True, timeout=120)
    out = subprocess.run(
        [sys.executable, "-m", "flowrl.cli", "rewards"], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0 and "jpeg_compressibility" in out.stdout, out.stderr[-2000:]


# --- contract checks --------------------------------------------------------------------------


def test_check_scores_converts_lists_and_arrays():
    import numpy as np

    for raw in ([1, 2, 3], np.array([1.0, 2.0, 3.0], dtype=np.float64), torch.tensor([1, 2, 3])):
        out = check_scores("foo", raw, 3)
        assert out.dtype == torch.float32 and out.device.type == "cpu" and out.tolist() == [1.0, 2.0, 3.0]


@pytest.mark.parametrize(
    "scores, match",
    [
        (torch.zeros(3, 1), r"reward 'foo' returned scores of shape \(3, 1\); expected \(3,\)"),
        (torch.zeros(2), r"reward 'foo' returned scores of shape \(2,\); expected \(3,\)"),
        (torch.tensor([0.0, math.nan, math.nan]), r"reward 'foo' returned 2 NaN scores \(at \[1, 2\]\)"),
        (torch.tensor([math.inf, 0.0, -math.inf]), r"reward 'foo' returned 2 inf scores \(at \[0, 2\]\)"),
        (["a", "b", "c"], r"reward 'foo' returned list that is not numeric"),
    ],
)
def test_check_scores_rejects_malformed(scores, match):
    with pytest.raises((ValueError, TypeError), match=match):
        check_scores("foo", scores, 3)


def test_check_inputs():
    images, prompts, metadata = _batch(batch=2)
    check_inputs(images, prompts, metadata)
    with pytest.raises(ValueError, match=r"\(B, 3, H, W\)"):
        check_inputs(images[:, :1], prompts, metadata)
    with pytest.raises(ValueError, match="2 images, 1 prompts, 2 metadata"):
        check_inputs(images, prompts[:1], metadata)
    with pytest.raises(ValueError, match=r"must lie in \[0, 1\]"):
        check_inputs(images * 2 - 1, prompts, metadata)
    with pytest.raises(ValueError, match="NaN or inf"):
        check_inputs(torch.full_like(images, float("nan")), prompts, metadata)
    with pytest.raises(TypeError, match="floating-point"):
        check_inputs((images * 255).to(torch.uint8), prompts, metadata)
    with pytest.raises(TypeError, match=r"metadata\[1\] must be a dict .*got NoneType"):
        check_inputs(images, prompts, [{}, None])
    with pytest.raises(TypeError, match=r"prompts\[0\] must be a str, got int"):
        check_inputs(images, [0, "p"], metadata)


def test_weighted_sum_arithmetic():
    images, prompts, metadata = _batch(batch=3)
    ones = lambda images, prompts, metadata: torch.ones(len(prompts))  # noqa: E731
    combined = WeightedSum({"bright": (brightness, 2.0), "ones": (ones, -0.5)})
    total, per_reward = combined(images, prompts, metadata)
    mean = images.mean(dim=(1, 2, 3))
    torch.testing.assert_close(per_reward["bright"], mean)
    torch.testing.assert_close(per_reward["ones"], torch.ones(3))
    torch.testing.assert_close(total, 2.0 * mean - 0.5)
    assert total.dtype == torch.float32 and total.shape == (3,)


def test_weighted_sum_names_the_bad_reward():
    images, prompts, metadata = _batch(batch=2)
    nan = lambda images, prompts, metadata: torch.full((2,), math.nan)  # noqa: E731
    with pytest.raises(ValueError, match="reward 'broken' returned 2 NaN"):
        WeightedSum({"ok": (brightness, 1.0), "broken": (nan, 1.0)})(images, prompts, metadata)
    with pytest.raises(ValueError, match="reward 'ok' has weight nan"):
        WeightedSum({"ok": (brightness, math.nan)})
    with pytest.raises(ValueError, match="reward 'ok' has weight True"):
        WeightedSum({"ok": (brightness, True)})


def test_weighted_sum_accepts_numpy_weights():
    import numpy as np

    images, prompts, metadata = _batch(batch=2)
    total = WeightedSum({"bright": (brightness, np.float32(0.5))})(images, prompts, metadata).total
    torch.testing.assert_close(total, 0.5 * images.mean(dim=(1, 2, 3)))


def test_empty_batch_gives_empty_scores():
    empty = (torch.zeros(0, 3, 16, 16), [], [])
    for reward in (jpeg_compressibility(), build_reward("geneval")):
        scores = reward(*empty)
        assert scores.shape == (0,) and scores.dtype == torch.float32


# --- JPEG -------------------------------------------------------------------------------------


def test_jpeg_flat_image_is_more_compressible_than_noise():
    noise, prompts, metadata = _batch(batch=1, size=64)
    images = torch.cat([torch.full_like(noise, 0.5), noise])  # (2, 3, 64, 64): flat, noise
    prompts, metadata = prompts * 2, metadata * 2
    small = jpeg_compressibility()(images, prompts, metadata)
    large = jpeg_incompressibility()(images, prompts, metadata)
    assert small.shape == (2,) and small.dtype == torch.float32
    assert (small < 0).all() and (large > 0).all()
    torch.testing.assert_close(small, -large)
    assert small[0] > small[1] and large[0] < large[1]


def test_jpeg_quality_checked():
    import numpy as np

    for bad in (0, 101, "80", 80.5, True, np.bool_(True)):
        with pytest.raises(ValueError, match=r"quality must be an integer in \[1, 100\]"):
            jpeg_compressibility(quality=bad)

    assert jpeg_compressibility(quality=np.int64(80))(torch.rand(1, 3, 8, 8), ["p"], [{}]).shape == (1,)


# --- CLIP -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_clip_dir(tmp_path_factory):
    """A random-weight CLIPModel (2 + 2 layers, seed 0) with a CLIP tokenizer cut to 500 merges and a 32 px image
    processor, saved as from the hub."""
    return save_random_clip(tmp_path_factory.mktemp("tiny_clip"), cut_clip_tokenizer(500))


def test_clipscore_tiny_model(tiny_clip_dir):
    reward = build_reward("clipscore", model_path=str(tiny_clip_dir))
    assert len(reward.tokenizer) == 2 + 512 + 500  # the reloaded tokenizer kept its vocabulary
    images = torch.rand(3, 3, 40, 48, generator=torch.Generator().manual_seed(1))
    prompts = ["a red cube", "two dogs on a sofa " * 10, ""]  # the long one is truncated to 16 tokens
    metadata = [{}, {"tag": "counting"}, {}]
    scores = reward(images, prompts, metadata)
    assert scores.shape == (3,) and scores.dtype == torch.float32 and scores.device.type == "cpu"
    assert torch.isfinite(scores).all()
    assert (scores.abs() <= reward.model.logit_scale.exp() + 1e-4).all()
    torch.testing.assert_close(reward(images, prompts, metadata), scores, rtol=0, atol=0)


def test_clipscore_matches_transformers_reference(tiny_clip_dir):
    """Score = diagonal of CLIPModel's logits_per_image; preprocessing ~ the CLIP image processor."""
    import numpy as np
    from PIL import Image
    from transformers import CLIPProcessor

    reward = clipscore(tiny_clip_dir)
    processor = CLIPProcessor.from_pretrained(tiny_clip_dir, local_files_only=True)
    # Smooth images, exactly representable in uint8. (On pixel noise, the processor's uint8 resize
    # clips bicubic overshoot between its two 1-D passes, so a few pixels differ by up to ~10 levels.)
    coarse = torch.rand(2, 3, 6, 5, generator=torch.Generator().manual_seed(2))
    images = F.interpolate(coarse, size=(48, 40), mode="bilinear").mul(255).round() / 255  # (2, 3, 48, 40)
    pil = [Image.fromarray((image.permute(1, 2, 0) * 255).round().byte().numpy()) for image in images]
    reference_pixels = processor(images=pil, return_tensors="pt")["pixel_values"]
    # atol 0.03 is about 1.5 uint8 levels after normalisation
    torch.testing.assert_close(reward.preprocess(images), reference_pixels, rtol=0, atol=0.03)

    prompts = ["a red cube", "a blue ball"]
    tokens = processor(text=prompts, padding=True, return_tensors="pt")
    with torch.no_grad():
        logits = reward.model(**tokens, pixel_values=reward.preprocess(images)).logits_per_image
    torch.testing.assert_close(reward(images, prompts, [{}, {}]), logits.diagonal(), rtol=1e-5, atol=1e-5)
    assert np.isfinite(logits.numpy()).all()


def test_clipscore_batch_size_chunks_and_empty_batch(tiny_clip_dir):
    images = torch.rand(5, 3, 32, 32, generator=torch.Generator().manual_seed(3))
    prompts = ["a red cube", "a blue ball", "two dogs", "", "a cat"]
    whole = clipscore(tiny_clip_dir)(images, prompts, [{}] * 5)
    chunked = clipscore(tiny_clip_dir, batch_size=2)(images, prompts, [{}] * 5)
    torch.testing.assert_close(chunked, whole, rtol=1e-5, atol=1e-5)
    empty = clipscore(tiny_clip_dir)(torch.zeros(0, 3, 32, 32), [], [])
    assert empty.shape == (0,) and empty.dtype == torch.float32
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="clipscore: batch_size must be an integer >= 1"):
            clipscore(tiny_clip_dir, batch_size=bad)


def test_clipscore_missing_folder_or_config(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"model_path '.*nowhere' is not a local folder"):
        clipscore(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        clipscore(tmp_path)


def test_clipscore_bad_dtype(tiny_clip_dir):
    with pytest.raises(ValueError, match="floating torch dtype"):
        clipscore(tiny_clip_dir, dtype="int8")


def test_public_names_exported():
    for name in rewards.__all__:
        assert hasattr(rewards, name), name
