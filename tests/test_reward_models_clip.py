"""Tests of the CLIP-backbone preference rewards `pickscore`, `hpsv2` and `aesthetic`, and of `rewards.convert`.

Every model is tiny and random, built offline from the real classes (transformers `CLIPModel`,
open_clip `CLIP` from a registered tiny config); scores are compared with direct computations
through those libraries and their own image preprocessing.
"""

import json
import pickle
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from tiny_pipelines.clip import cut_clip_tokenizer, save_random_clip

from flowrl.rewards import REWARDS, build_reward, clipscore
from flowrl.rewards.aesthetic import aesthetic, aesthetic_mlp
from flowrl.rewards.convert import convert_to_safetensors, load_state_dict
from flowrl.rewards.convert import main as convert_main
from flowrl.rewards.hps import HPS_FILES, hps_preprocess, hpsv2
from flowrl.rewards.pickscore import PICKSCORE_MODEL, PICKSCORE_PROCESSOR, pickscore

TINY_ARCH = "flowrl-tiny-hps-vit"


def _smooth_images(batch, height, width, seed):
    """Smooth `(batch, 3, height, width)` images in [0, 1], exactly representable in uint8."""
    coarse = torch.rand(batch, 3, 6, 5, generator=torch.Generator().manual_seed(seed))
    return F.interpolate(coarse, size=(height, width), mode="bilinear").mul(255).round() / 255


def _to_pil(images):
    return [Image.fromarray((image.permute(1, 2, 0) * 255).round().byte().numpy()) for image in images]


def _fake_hub_cache(cache, repo_id, files):
    """Lay out `files` ({name: source path}) as the cached snapshot of `repo_id` under `cache` (HF cache layout)."""
    commit = "0" * 40
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for name, source in files.items():
        (snapshot / name).write_bytes(source.read_bytes())
    return snapshot


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An empty Hugging Face cache, used instead of the user's for this test."""
    import huggingface_hub

    cache = tmp_path / "hf_cache"
    cache.mkdir()
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    return cache


# --- a tiny transformers CLIP (PickScore, aesthetic) ------------------------------------------


@pytest.fixture(scope="module")
def tiny_clip_dir(tmp_path_factory):
    """A random-weight CLIPModel (2 + 2 layers, seed 0) with a CLIP tokenizer cut to 300 merges and a 32 px image
    processor, saved as from the hub."""
    return save_random_clip(tmp_path_factory.mktemp("tiny_clip"), cut_clip_tokenizer(300))


# --- pickscore --------------------------------------------------------------------------------


def test_names_registered():
    assert {"pickscore", "hpsv2", "aesthetic"} <= set(REWARDS)


def test_pickscore_is_logit_scale_times_cosine_over_scale(tiny_clip_dir):
    """PickScore = diagonal of CLIPModel's logits_per_image (logit_scale.exp() * cosine), divided by `scale`."""
    from transformers import CLIPProcessor

    images = _smooth_images(3, 48, 40, seed=1)
    prompts = ["a red cube", "a blue ball on grass", ""]
    metadata = [{}, {"tag": "counting"}, {}]
    raw = build_reward("pickscore", model_path=str(tiny_clip_dir), processor_path=str(tiny_clip_dir))
    assert raw.name == "pickscore" and raw.scale == 1.0
    scores = raw(images, prompts, metadata)
    assert scores.shape == (3,) and scores.dtype == torch.float32 and scores.device.type == "cpu"

    processor = CLIPProcessor.from_pretrained(tiny_clip_dir, local_files_only=True)
    tokens = processor(text=prompts, padding=True, return_tensors="pt")
    with torch.no_grad():
        logits = raw.model(**tokens, pixel_values=raw.preprocess(images)).logits_per_image  # (3, 3)
        image = raw.model.get_image_features(pixel_values=raw.preprocess(images))
        text = raw.model.get_text_features(**tokens)
    image = image if isinstance(image, torch.Tensor) else image.pooler_output
    text = text if isinstance(text, torch.Tensor) else text.pooler_output
    by_hand = raw.model.logit_scale.exp() * F.cosine_similarity(image, text, dim=-1)
    torch.testing.assert_close(scores, logits.diagonal(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(scores, by_hand, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(scores, clipscore(tiny_clip_dir)(images, prompts, metadata), rtol=0, atol=0)

    scaled = pickscore(tiny_clip_dir, tiny_clip_dir, scale=26)
    torch.testing.assert_close(scaled(images, prompts, metadata), scores / 26, rtol=1e-6, atol=1e-6)
    chunked = pickscore(tiny_clip_dir, tiny_clip_dir, scale=26, batch_size=2)
    torch.testing.assert_close(chunked(images, prompts, metadata), scores / 26, rtol=1e-5, atol=1e-5)


def test_pickscore_defaults_come_from_the_hub_cache(tiny_clip_dir, hub_cache):
    with pytest.raises(
        FileNotFoundError,
        match=(
            r"^pickscore: model_path 'yuvalkirstain/PickScore_v1' is not a local folder or a hub id in the local "
            r"Hugging Face cache; download it first"
        ),
    ):
        pickscore()
    files = {path.name: path for path in tiny_clip_dir.iterdir()}
    weights = ("config.json", "model.safetensors")
    _fake_hub_cache(hub_cache, PICKSCORE_MODEL, {k: v for k, v in files.items() if k in weights})
    with pytest.raises(
        FileNotFoundError, match=r"^pickscore: processor_path 'laion/CLIP-ViT-H-14-laion2B-s32B-b79K' is"
    ):
        pickscore()
    _fake_hub_cache(hub_cache, PICKSCORE_PROCESSOR, {k: v for k, v in files.items() if k not in weights})
    images, prompts = _smooth_images(2, 32, 32, seed=2), ["a cat", "a dog"]
    torch.testing.assert_close(
        pickscore()(images, prompts, [{}, {}]), clipscore(tiny_clip_dir)(images, prompts, [{}, {}]), rtol=0, atol=0
    )


def test_pickscore_bad_options_named_before_loading(tmp_path, tiny_clip_dir):
    for bad in (0, -1.0, float("nan"), float("inf"), True, "26"):
        with pytest.raises(ValueError, match="^pickscore: scale must be a finite number > 0"):
            pickscore(tmp_path / "nowhere", scale=bad)
    with pytest.raises(FileNotFoundError, match=r"^pickscore: model_path '.*nowhere' is not a local folder"):
        pickscore(tmp_path / "nowhere", tiny_clip_dir)
    with pytest.raises(FileNotFoundError, match=r"^pickscore: model_path '.*' has no config.json"):
        pickscore(tmp_path, tiny_clip_dir)
    with pytest.raises(ValueError, match="^pickscore: batch_size must be an integer >= 1"):
        pickscore(tiny_clip_dir, tiny_clip_dir, batch_size=0)


# --- hpsv2 ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_hps(tmp_path_factory):
    """A tiny random open_clip ViT (registered as TINY_ARCH) saved like HPS: `{"state_dict": ...}` in a .pt file."""
    import open_clip

    folder = tmp_path_factory.mktemp("tiny_hps")
    config = {
        "embed_dim": 16,
        "vision_cfg": {"image_size": 32, "layers": 2, "width": 32, "head_width": 16, "patch_size": 8},
        "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 2},
    }
    (folder / f"{TINY_ARCH}.json").write_text(json.dumps(config))
    open_clip.add_model_config(folder / f"{TINY_ARCH}.json")
    torch.manual_seed(0)
    model = open_clip.create_model(TINY_ARCH, pretrained=None)
    with torch.no_grad():  # a logit scale != 1 so a score that used it would differ
        model.logit_scale.fill_(np.log(50.0))
    checkpoint = folder / "HPS_v2.1_compressed.pt"
    torch.save({"state_dict": model.state_dict(), "epoch": 3}, checkpoint)
    return checkpoint


def _open_clip_reference(checkpoint):
    """The open_clip model, tokenizer and own val transform, loaded the way hpsv2/img_score.py loads them."""
    import open_clip

    model, _, preprocess_val = open_clip.create_model_and_transforms(TINY_ARCH, pretrained=None)
    model.load_state_dict(torch.load(checkpoint, weights_only=True)["state_dict"])
    return model.eval(), open_clip.get_tokenizer(TINY_ARCH), preprocess_val


def test_hps_preprocess_matches_open_clip_val_transforms(tiny_hps):
    import open_clip

    reward = hpsv2(tiny_hps, arch=TINY_ARCH)
    _, _, preprocess_val = _open_clip_reference(tiny_hps)
    # Square images: hpsv2's resize-longer-side-and-pad equals open_clip's resize-shorter-side-and-crop.
    square = _smooth_images(2, 48, 48, seed=3)
    reference = torch.stack([preprocess_val(image) for image in _to_pil(square)])
    torch.testing.assert_close(reward.preprocess(square), reference, rtol=0, atol=0.03)  # ~1.5 uint8 levels
    # Non-square: open_clip's "longest" mode (resize the longer side, centre pad with black) is hpsv2's ResizeMaxSize.
    longest = open_clip.image_transform(32, is_train=False, resize_mode="longest", fill_color=0)
    for height, width in ((48, 40), (40, 61), (20, 24)):  # down, down with odd padding, up
        images = _smooth_images(2, height, width, seed=height)
        reference = torch.stack([longest(image) for image in _to_pil(images)])
        ours = reward.preprocess(images)
        assert ours.shape == (2, 3, 32, 32)
        torch.testing.assert_close(ours, reference, rtol=0, atol=0.03)
    # The padding is black, normalised: -mean / std.
    padded = hps_preprocess(torch.ones(1, 3, 32, 16), 32, reward.image_mean, reward.image_std)
    torch.testing.assert_close(padded[0, :, :, :8], (-reward.image_mean / reward.image_std)[0].expand(3, 32, 8))


def test_hpsv2_score_is_cosine_as_in_hpsv2_img_score(tiny_hps):
    """score = diagonal(image_features @ text_features.T) of open_clip's output dict: cosine, no logit scale."""
    reward = build_reward("hpsv2", model_path=str(tiny_hps), arch=TINY_ARCH)
    model, tokenizer, preprocess_val = _open_clip_reference(tiny_hps)
    images = _smooth_images(3, 48, 48, seed=4)
    prompts = ["a red cube", "two dogs on a sofa " * 20, ""]  # the long one is truncated to 77 tokens
    scores = reward(images, prompts, [{}, {"tag": "counting"}, {}])
    assert scores.shape == (3,) and scores.dtype == torch.float32 and scores.device.type == "cpu"
    assert (scores.abs() <= 1 + 1e-5).all()

    with torch.no_grad():
        out = model(reward.preprocess(images), tokenizer(prompts))  # (image_features, text_features, logit_scale)
        exact = torch.diagonal(out[0] @ out[1].T)
        pil = torch.stack([preprocess_val(image) for image in _to_pil(images)])
        out_pil = model(pil, tokenizer(prompts))
        via_pil = torch.diagonal(out_pil[0] @ out_pil[1].T)
    assert abs(out[2].item() - 50.0) < 1e-3  # the logit scale exists and is not applied
    torch.testing.assert_close(scores, exact, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(scores, via_pil, rtol=0, atol=2e-3)

    chunked = hpsv2(tiny_hps, arch=TINY_ARCH, batch_size=2)(images, prompts, [{}] * 3)
    torch.testing.assert_close(chunked, scores, rtol=1e-5, atol=1e-5)
    half = hpsv2(tiny_hps, arch=TINY_ARCH, dtype="bfloat16")(images, prompts, [{}] * 3)
    assert half.dtype == torch.float32 and (half - scores).abs().max() < 0.05
    empty = reward(torch.zeros(0, 3, 32, 32), [], [])
    assert empty.shape == (0,) and empty.dtype == torch.float32


def test_hpsv2_finds_checkpoint_in_folder_cache_or_safetensors(tiny_hps, hub_cache, tmp_path):
    images, prompts = _smooth_images(2, 40, 40, seed=5), ["a cat", "a dog"]
    expected = hpsv2(tiny_hps, arch=TINY_ARCH)(images, prompts, [{}, {}])
    from_folder = hpsv2(tiny_hps.parent, version="v2.1", arch=TINY_ARCH)(images, prompts, [{}, {}])
    torch.testing.assert_close(from_folder, expected, rtol=0, atol=0)
    with pytest.raises(FileNotFoundError, match=r"^hpsv2: model_path folder '.*' has no HPS_v2_compressed.pt"):
        hpsv2(tiny_hps.parent, version="v2", arch=TINY_ARCH)

    with pytest.raises(
        FileNotFoundError,
        match=(
            r"^hpsv2: no model_path given and HPS_v2.1_compressed.pt of xswu/HPSv2 is not in the local Hugging Face "
            r"cache; download it \(`hf download xswu/HPSv2 HPS_v2.1_compressed.pt`\)"
        ),
    ):
        hpsv2(arch=TINY_ARCH)
    _fake_hub_cache(hub_cache, "xswu/HPSv2", {HPS_FILES["v2.1"]: tiny_hps})
    torch.testing.assert_close(hpsv2(arch=TINY_ARCH)(images, prompts, [{}, {}]), expected, rtol=0, atol=0)

    converted = convert_to_safetensors(tiny_hps, tmp_path / "hps.safetensors")
    torch.testing.assert_close(hpsv2(converted, arch=TINY_ARCH)(images, prompts, [{}, {}]), expected, rtol=0, atol=0)


def test_hpsv2_errors_are_one_line_and_named(tiny_hps, tmp_path):
    with pytest.raises(FileNotFoundError, match=r"^hpsv2: model_path '.*missing.pt' not found; download HPS_v2.1"):
        hpsv2(tmp_path / "missing.pt", arch=TINY_ARCH)
    with pytest.raises(ValueError, match=r"^hpsv2: version must be one of \['v2', 'v2.0', 'v2.1'\], got 'v3'"):
        hpsv2(tiny_hps, version="v3")
    with pytest.raises(ValueError, match=r"^hpsv2: arch 'ViT-Nope' is not an open_clip model config"):
        hpsv2(tiny_hps, arch="ViT-Nope")
    with pytest.raises(ValueError, match="^hpsv2: batch_size must be an integer >= 1"):
        hpsv2(tiny_hps, arch=TINY_ARCH, batch_size=1.5)
    with pytest.raises(ValueError, match="floating torch dtype"):
        hpsv2(tiny_hps, arch=TINY_ARCH, dtype="int8")

    state = load_state_dict(tiny_hps)
    del state["visual.proj"]
    state["extra.weight"] = torch.zeros(1)
    torch.save(state, tmp_path / "partial.pt")
    with pytest.raises(
        ValueError,
        match=(
            r"^hpsv2: checkpoint '.*partial.pt' does not fit open_clip 'flowrl-tiny-hps-vit': "
            r"1 missing keys \(e.g. \['visual.proj'\]\), 1 unexpected"
        ),
    ):
        hpsv2(tmp_path / "partial.pt", arch=TINY_ARCH)
    state = load_state_dict(tiny_hps)
    state["visual.proj"] = torch.zeros(3, 3)
    torch.save(state, tmp_path / "shape.pt")
    with pytest.raises(ValueError, match=r"^hpsv2: checkpoint '.*shape.pt' does not fit open_clip .*size mismatch"):
        hpsv2(tmp_path / "shape.pt", arch=TINY_ARCH)


# --- convert ----------------------------------------------------------------------------------


class _NotATensor:
    pass


def test_load_state_dict_refuses_pickled_objects_and_unwraps(tmp_path):
    with open(tmp_path / "evil.pt", "wb") as f:
        pickle.dump({"layers.0.weight": _NotATensor()}, f, protocol=2)
    with pytest.raises(ValueError, match=r"^aesthetic: '.*evil.pt' is not a weights-only checkpoint .*not unpickled"):
        load_state_dict(tmp_path / "evil.pt", "aesthetic")
    torch.save({"module.a": torch.ones(2), "module.b": torch.zeros(1)}, tmp_path / "ddp.pt")
    assert sorted(load_state_dict(tmp_path / "ddp.pt")) == ["a", "b"]
    torch.save({"a": 1}, tmp_path / "numbers.pt")
    with pytest.raises(ValueError, match=r"does not hold a state dict"):
        load_state_dict(tmp_path / "numbers.pt", "hpsv2")
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match=r"^hpsv2: .*junk.pt"):
        load_state_dict(tmp_path / "junk.pt", "hpsv2")


def test_convert_cli_round_trip_keeps_dtypes_and_shared_tensors(tmp_path, capsys):
    weight = torch.randn(4, 3, dtype=torch.float16)
    torch.save({"state_dict": {"w": weight, "tied": weight, "b": torch.arange(3)}}, tmp_path / "in.pth")
    assert convert_main([str(tmp_path / "in.pth"), str(tmp_path / "out.safetensors")]) == 0
    out = load_state_dict(tmp_path / "out.safetensors")
    assert out["w"].dtype == torch.float16 and torch.equal(out["w"], weight) and torch.equal(out["tied"], weight)
    assert torch.equal(out["b"], torch.arange(3))
    assert convert_main([str(tmp_path / "in.pth"), str(tmp_path / "out.bin")]) == 2
    assert "convert: output '" in capsys.readouterr().err
    result = subprocess.run(
        [sys.executable, "-m", "flowrl.rewards.convert", str(tmp_path / "nope.pt"), str(tmp_path / "x.safetensors")],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2
    assert result.stderr.strip() == f"error: convert: weights file '{tmp_path / 'nope.pt'}' not found"


# --- aesthetic --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_head(tmp_path_factory):
    """A random LAION-structured head taking the tiny CLIP's 16-d embeddings, saved like the published .pth."""
    torch.manual_seed(1)
    head = aesthetic_mlp(16)
    path = tmp_path_factory.mktemp("aesthetic") / "head.pth"
    torch.save({f"layers.{key}": value for key, value in head.state_dict().items()}, path)
    return path


def test_aesthetic_head_has_published_keys():
    keys = list(aesthetic_mlp().state_dict())
    expected = [f"{i}.{p}" for i in (0, 2, 4, 6, 7) for p in ("weight", "bias")]
    assert keys == expected
    assert [tuple(aesthetic_mlp().state_dict()[f"{i}.weight"].shape) for i in (0, 2, 4, 6, 7)] == [
        (1024, 768),
        (128, 1024),
        (64, 128),
        (16, 64),
        (1, 16),
    ]


def test_aesthetic_matches_direct_computation(tiny_clip_dir, tiny_head):
    from transformers import CLIPImageProcessor, CLIPModel

    reward = build_reward("aesthetic", model_path=str(tiny_head), clip_path=str(tiny_clip_dir))
    images = _smooth_images(3, 48, 40, seed=6)
    scores = reward(images, ["a", "b", "c"], [{}] * 3)
    assert scores.shape == (3,) and scores.dtype == torch.float32 and scores.device.type == "cpu"
    torch.testing.assert_close(reward(images, ["x", "", "z"], [{}] * 3), scores, rtol=0, atol=0)  # prompts unused

    clip = CLIPModel.from_pretrained(tiny_clip_dir, local_files_only=True).eval()
    processor = CLIPImageProcessor.from_pretrained(tiny_clip_dir, local_files_only=True)
    pixels = processor(images=_to_pil(images), return_tensors="pt")["pixel_values"]
    torch.testing.assert_close(reward.preprocess(images), pixels, rtol=0, atol=0.03)
    state = torch.load(tiny_head, weights_only=True)

    def by_hand(pixel_values):
        with torch.no_grad():
            embedding = clip.get_image_features(pixel_values=pixel_values)
        embedding = embedding if isinstance(embedding, torch.Tensor) else embedding.pooler_output
        x = embedding / embedding.norm(dim=-1, keepdim=True)
        for i in (0, 2, 4, 6, 7):  # linear layers only; dropouts are identity in eval
            x = F.linear(x, state[f"layers.{i}.weight"], state[f"layers.{i}.bias"])
        return x.squeeze(-1)

    torch.testing.assert_close(scores, by_hand(reward.preprocess(images)), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(scores, by_hand(pixels), rtol=0, atol=5e-3)
    chunked = build_reward("aesthetic", model_path=str(tiny_head), clip_path=str(tiny_clip_dir), batch_size=2)
    torch.testing.assert_close(chunked(images, ["a", "b", "c"], [{}] * 3), scores, rtol=1e-5, atol=1e-5)


def test_aesthetic_errors_are_one_line_and_named(tiny_clip_dir, tiny_head, tmp_path, hub_cache):
    with pytest.raises(FileNotFoundError, match=r"^aesthetic: weights file '.*nope.pth' not found$"):
        aesthetic(tmp_path / "nope.pth", tiny_clip_dir)
    with pytest.raises(
        FileNotFoundError,
        match=(
            r"^aesthetic: clip_path 'openai/clip-vit-large-patch14' is not a "
            r"local folder or a hub id in the local Hugging Face cache"
        ),
    ):
        aesthetic(tiny_head)
    torch.save({f"layers.{k}": v for k, v in aesthetic_mlp(768).state_dict().items()}, tmp_path / "l14.pth")
    with pytest.raises(
        ValueError, match=r"^aesthetic: the head takes 768-d embeddings but the CLIP model gives 16-d$"
    ):
        aesthetic(tmp_path / "l14.pth", tiny_clip_dir)
    torch.save({"fc.weight": torch.zeros(1, 16)}, tmp_path / "other.pth")
    with pytest.raises(ValueError, match=r"^aesthetic: '.*other.pth' has no 2-d 'layers.0.weight'"):
        aesthetic(tmp_path / "other.pth", tiny_clip_dir)
    state = torch.load(tiny_head, weights_only=True)
    del state["layers.7.bias"]
    torch.save(state, tmp_path / "partial.pth")
    with pytest.raises(
        ValueError, match=r"^aesthetic: '.*partial.pth' does not fit the LAION aesthetic head \(.*layers.7.b"
    ):
        aesthetic(tmp_path / "partial.pth", tiny_clip_dir)
    with pytest.raises(ValueError, match="^aesthetic: batch_size must be an integer >= 1"):
        aesthetic(tiny_head, tiny_clip_dir, batch_size=0)


# --- differentiable scores (the direct-reward methods) ---------------------------------------


def _gradcheck(reward, images, prompts, atol=1e-5):
    """`score_with_grad` equals the scores of `__call__` and its gradient equals finite differences (float64; open_clip
    computes its layer norms in float32, hence `atol` for HPS)."""
    with_grad = reward.score_with_grad(images.clone().requires_grad_(), prompts, [{}] * len(prompts))
    assert with_grad.dtype == torch.float64 and with_grad.requires_grad
    torch.testing.assert_close(with_grad, reward(images, prompts, [{}] * len(prompts)).double(), rtol=0, atol=1e-6)
    f = lambda x: reward.score_with_grad(x, prompts, [{}] * len(prompts))  # noqa: E731
    eps = 1e-6 if atol < 1e-4 else 1e-3
    x = images.clone().requires_grad_()
    assert torch.autograd.gradcheck(f, (x,), eps=eps, atol=atol, rtol=1e-3, fast_mode=True)


@pytest.mark.parametrize("name", ["pickscore", "hpsv2", "aesthetic"])
def test_preference_rewards_have_a_gradient_equal_to_finite_differences(name, tiny_clip_dir, tiny_hps, tiny_head):
    """PickScore, HPS v2 and the aesthetic head are differentiable (the direct methods can train on them): their
    `score_with_grad` is the scores with the graph back to the pixels, through the torch preprocessing."""
    options = {
        "pickscore": {"model_path": str(tiny_clip_dir), "processor_path": str(tiny_clip_dir), "scale": 26},
        "hpsv2": {"model_path": str(tiny_hps), "arch": TINY_ARCH},
        "aesthetic": {"model_path": str(tiny_head), "clip_path": str(tiny_clip_dir)},
    }[name]
    reward = build_reward(name, dtype="float64", **options)
    assert reward.differentiable
    if name == "aesthetic":
        reward.layers = reward.layers.double()  # the head is float32 by construction
    images = torch.rand(2, 3, 12, 10, dtype=torch.float64, generator=torch.Generator().manual_seed(0)) * 0.8 + 0.1
    _gradcheck(reward, images, ["a red cube", "two dogs"], atol=1e-3 if name == "hpsv2" else 1e-5)
