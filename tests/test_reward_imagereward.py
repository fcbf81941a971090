"""The `imagereward` reward on a tiny random BLIP: the score formula, the preprocessing against the
package's torchvision pipeline, and the checkpoint key mapping (package names -> transformers' BLIP)."""

import importlib

import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from flowrl import rewards
from flowrl.rewards import REWARDS, build_reward
from flowrl.rewards import imagereward as imagereward_module_factory
from flowrl.rewards.imagereward import (
    IMAGEREWARD_MEAN,
    IMAGEREWARD_STD,
    ImageReward,
    ImageRewardModel,
    convert_imagereward_state_dict,
    imagereward_config,
    load_converted,
)

WORDS = [
    "[PAD]",
    "[UNK]",
    "[CLS]",
    "[SEP]",
    "[MASK]",
    "a",
    "an",
    "the",
    "photo",
    "of",
    "cat",
    "dog",
    "red",
    "blue",
    "on",
    "mat",
    "sofa",
    "painting",
    "astronaut",
    "riding",
    "horse",
    "##s",
    "in",
    "space",
    ".",
]


def tiny_config(vocab_size):
    from transformers import BlipConfig

    text = dict(
        vocab_size=vocab_size,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=40,
        layer_norm_eps=1e-12,
        pad_token_id=0,
        bos_token_id=None,
        sep_token_id=3,
        encoder_hidden_size=48,
        is_decoder=True,
    )
    vision = dict(
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=3,
        image_size=32,
        patch_size=8,
        layer_norm_eps=1e-6,
        initializer_range=0.02,
    )
    return BlipConfig(text_config=text, vision_config=vision)


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import BertTokenizer

    tok = BertTokenizer(vocab={w: i for i, w in enumerate(WORDS)})
    tok.add_tokens(["[DEC]", "[ENC]"], special_tokens=True)
    return tok


def random_model(tokenizer, seed=0):
    """A tiny ImageRewardModel with every parameter random (so that a swapped mapping changes the output)."""
    torch.manual_seed(seed)
    model = ImageRewardModel(tiny_config(len(tokenizer))).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(1.0 if "norm" in name.lower() and name.endswith("weight") else 0.0, 0.2)
    return model


def package_state_dict(model):
    """`model`'s weights under the image-reward package's names (BLIP's vit.py and med.py, ImageReward.MLP),
    written out independently of the converter, plus the extra entries the package's checkpoint carries."""
    ours = model.state_dict()
    out = {
        "blip.visual_encoder.cls_token": ours["vision_model.embeddings.class_embedding"],
        "blip.visual_encoder.pos_embed": ours["vision_model.embeddings.position_embedding"],
        "blip.visual_encoder.patch_embed.proj.weight": ours["vision_model.embeddings.patch_embedding.weight"],
        "blip.visual_encoder.patch_embed.proj.bias": ours["vision_model.embeddings.patch_embedding.bias"],
        "blip.visual_encoder.norm.weight": ours["vision_model.post_layernorm.weight"],
        "blip.visual_encoder.norm.bias": ours["vision_model.post_layernorm.bias"],
    }
    for i in range(model.config.vision_config.num_hidden_layers):
        for theirs, mine in [
            ("norm1", "layer_norm1"),
            ("attn.qkv", "self_attn.qkv"),
            ("attn.proj", "self_attn.projection"),
            ("norm2", "layer_norm2"),
            ("mlp.fc1", "mlp.fc1"),
            ("mlp.fc2", "mlp.fc2"),
        ]:
            for kind in ("weight", "bias"):
                mapped = ours[f"vision_model.encoder.layers.{i}.{mine}.{kind}"]
                out[f"blip.visual_encoder.blocks.{i}.{theirs}.{kind}"] = mapped
    for key, tensor in ours.items():
        if key.startswith("text_encoder."):
            out["blip." + key] = tensor
    # ImageReward.MLP: nn.Sequential(Linear, Dropout, Linear, Dropout, Linear, Dropout, Linear, Linear)
    for theirs, mine in zip([0, 2, 4, 6, 7], range(5)):
        out[f"mlp.layers.{theirs}.weight"] = ours[f"head.{mine}.weight"]
        out[f"mlp.layers.{theirs}.bias"] = ours[f"head.{mine}.bias"]
    text_width, vision_width = model.config.text_config.hidden_size, model.config.vision_config.hidden_size
    out["blip.text_encoder.embeddings.position_ids"] = torch.arange(40).expand(1, -1)  # a persistent buffer in med.py
    out["blip.vision_proj.weight"], out["blip.vision_proj.bias"] = torch.randn(256, vision_width), torch.randn(256)
    out["blip.text_proj.weight"], out["blip.text_proj.bias"] = torch.randn(256, text_width), torch.randn(256)
    return out


def _images(batch=3, height=40, width=56, seed=0):
    """Smooth random images (upsampled noise), quantised to uint8 levels like a decoded generation."""
    noise = torch.rand(batch, 3, height // 4, width // 4, generator=torch.Generator().manual_seed(seed))
    images = F.interpolate(noise, size=(height, width), mode="bilinear", align_corners=False)
    return (images * 255).round() / 255


PROMPTS = ["a photo of a cat on a mat", "an astronaut riding a horse in space", "the red dog"]


# --- the score ---------------------------------------------------------------------------------


def test_constants_are_the_packages():
    assert IMAGEREWARD_MEAN == 0.16717362830052426 and IMAGEREWARD_STD == 1.0333394966054072
    config = imagereward_config()
    vision, text = config.vision_config, config.text_config
    assert (
        vision.hidden_size,
        vision.num_hidden_layers,
        vision.num_attention_heads,
        vision.image_size,
        vision.patch_size,
        vision.layer_norm_eps,
    ) == (1024, 24, 16, 224, 16, 1e-6)
    assert (text.vocab_size, text.hidden_size, text.num_hidden_layers, text.encoder_hidden_size) == (
        30524,
        768,
        12,
        1024,
    )


def test_scores_equal_direct_formula(tokenizer):
    model = random_model(tokenizer)
    reward = ImageReward(model, tokenizer)
    images = _images()
    scores = reward(images, PROMPTS, [{}] * 3)
    assert scores.dtype == torch.float32 and scores.shape == (3,)

    # the package: tokenizer(padding="max_length", truncation=True, max_length=35), image embeds from the ViT,
    # the text encoder cross-attending to them, [CLS] -> MLP -> (r - mean) / std
    tokens = tokenizer(PROMPTS, padding="max_length", truncation=True, max_length=35, return_tensors="pt")
    assert tokens["input_ids"].shape == (3, 35) and (tokens["input_ids"][:, 0] == tokenizer.cls_token_id).all()
    with torch.no_grad():
        image_embeds = model.vision_model(pixel_values=reward.preprocess(images)).last_hidden_state
        image_mask = torch.ones(image_embeds.shape[:2], dtype=torch.long)
        text = model.text_encoder(
            input_ids=tokens["input_ids"],
            attention_mask=tokens["attention_mask"],
            encoder_hidden_states=image_embeds,
            encoder_attention_mask=image_mask,
        ).last_hidden_state
        hidden = text[:, 0]
        for layer in model.head:  # five affine maps, no activation in between
            hidden = hidden @ layer.weight.T + layer.bias
    expected = (hidden.squeeze(-1) - 0.16717362830052426) / 1.0333394966054072
    torch.testing.assert_close(scores, expected, rtol=1e-5, atol=1e-5)
    assert scores.std() > 1e-3  # the images and prompts are told apart

    # the image matters through cross-attention: another image, another score
    other = reward(_images(seed=1), PROMPTS, [{}] * 3)
    assert (other - scores).abs().max() > 1e-4


def test_preprocess_matches_package_torchvision_pipeline(tokenizer):
    from torchvision.transforms import CenterCrop, Compose, InterpolationMode, Normalize, Resize, ToTensor

    reward = ImageReward(random_model(tokenizer), tokenizer)
    package = Compose(
        [
            Resize(32, interpolation=InterpolationMode.BICUBIC),
            CenterCrop(32),
            ToTensor(),
            Normalize((0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)),
        ]
    )
    for height, width in [(40, 56), (96, 64), (37, 51), (32, 32)]:
        images = _images(batch=2, height=height, width=width, seed=height)
        ours = reward.preprocess(images)
        assert ours.shape == (2, 3, 32, 32)
        for image, mine in zip(images, ours):
            pil = Image.fromarray((image * 255).round().byte().permute(1, 2, 0).numpy())
            # PIL rounds its resized pixels to uint8 (1/255 = 0.015 after the CLIP std); the tensor path does not
            torch.testing.assert_close(mine, package(pil), atol=0.05, rtol=0)


def test_batching_empty_batch_and_bad_options(tokenizer):
    model = random_model(tokenizer)
    images = _images()
    whole = ImageReward(model, tokenizer)(images, PROMPTS, [{}] * 3)
    chunked = ImageReward(model, tokenizer, batch_size=2)(images, PROMPTS, [{}] * 3)
    torch.testing.assert_close(chunked, whole, rtol=1e-5, atol=1e-5)
    assert ImageReward(model, tokenizer)(torch.zeros(0, 3, 32, 32), [], []).shape == (0,)
    with pytest.raises(ValueError, match="batch_size must be an integer >= 1"):
        ImageReward(model, tokenizer, batch_size=0)
    big = type(tokenizer)(vocab={f"w{i}": i for i in range(200)} | {"[UNK]": 200})
    with pytest.raises(ValueError, match=r"the tokenizer has \d+ tokens, the model only 27"):
        ImageReward(model, big)
    with pytest.raises(ValueError, match="images must lie in"):
        ImageReward(model, tokenizer)(images * 2, PROMPTS, [{}] * 3)


# --- differentiable scores (ReFL and the other direct methods) ---------------------------------


def test_score_with_grad_equals_the_scores_with_a_graph_to_the_pixels(tokenizer):
    """ReFL's `score_gard`: the scores of `__call__`, now with a graph back to the pixels, the weights frozen."""
    assert REWARDS["imagereward"].differentiable
    reward = ImageReward(random_model(tokenizer), tokenizer, batch_size=2)
    assert reward.differentiable
    images = _images(height=40, width=56).requires_grad_()
    scores = reward.score_with_grad(images, PROMPTS, [{}] * 3)  # one forward, batch_size does not split it
    assert scores.dtype == torch.float32 and scores.shape == (3,) and scores.grad_fn is not None
    torch.testing.assert_close(scores, reward(images.detach(), PROMPTS, [{}] * 3), rtol=0, atol=1e-5)
    (gradient,) = torch.autograd.grad(scores.sum(), images)
    assert gradient.abs().amax(dim=(1, 2, 3)).min() > 0  # every image gets a gradient through the resize
    assert all(p.grad is None and not p.requires_grad for p in reward.model.parameters())


def test_score_with_grad_gradient_equals_finite_differences(tokenizer):
    """In float64, the gradient through resize, crop, normalise, ViT, cross-attention and head equals finite
    differences, and the scores equal `__call__`'s."""
    reward = ImageReward(random_model(tokenizer, seed=6), tokenizer, dtype="float64")
    images = _images(batch=2, height=20, width=28, seed=7).double() * 0.8 + 0.1  # away from the [0, 1] clip
    prompts = PROMPTS[:2]
    scores = reward.score_with_grad(images.clone().requires_grad_(), prompts, [{}, {}])
    assert scores.dtype == torch.float64
    torch.testing.assert_close(scores, reward(images, prompts, [{}, {}]).double(), rtol=1e-7, atol=0)  # float32 there

    def f(x):
        return reward.score_with_grad(x, prompts, [{}, {}])

    assert torch.autograd.gradcheck(f, (images.requires_grad_(),), eps=1e-6, atol=1e-6, rtol=1e-4, fast_mode=True)


# --- the checkpoint mapping --------------------------------------------------------------------


def test_converter_round_trips_package_names(tokenizer):
    source = random_model(tokenizer, seed=1)
    converted = convert_imagereward_state_dict(package_state_dict(source))
    assert set(converted) == set(source.state_dict())  # projections and the position_ids buffer dropped
    target = random_model(tokenizer, seed=2)
    load_converted(target, package_state_dict(source))
    for key, tensor in source.state_dict().items():
        torch.testing.assert_close(target.state_dict()[key], tensor, rtol=0, atol=0)
    images = _images()
    torch.testing.assert_close(
        ImageReward(target, tokenizer)(images, PROMPTS, [{}] * 3),
        ImageReward(source, tokenizer)(images, PROMPTS, [{}] * 3),
        rtol=0,
        atol=0,
    )
    assert (
        convert_imagereward_state_dict(source.state_dict()).keys() == source.state_dict().keys()
    )  # already converted


def test_vision_mapping_matches_a_timm_style_vit(tokenizer):
    """BLIP's vit.py computed by hand from the package-named weights equals the converted BlipVisionModel."""
    model = random_model(tokenizer, seed=3)
    weights = package_state_dict(model)
    heads, eps = model.config.vision_config.num_attention_heads, 1e-6
    pixels = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))

    def w(name):
        return weights[f"blip.visual_encoder.{name}"]

    x = F.conv2d(pixels, w("patch_embed.proj.weight"), w("patch_embed.proj.bias"), stride=8).flatten(2).transpose(1, 2)
    x = torch.cat([w("cls_token").expand(2, -1, -1), x], dim=1) + w("pos_embed")  # (2, 17, 48)
    for i in range(model.config.vision_config.num_hidden_layers):
        b = f"blocks.{i}."
        h = F.layer_norm(x, (48,), w(b + "norm1.weight"), w(b + "norm1.bias"), eps)
        qkv = F.linear(h, w(b + "attn.qkv.weight"), w(b + "attn.qkv.bias"))  # (2, 17, 3 * 48)
        q, k, v = qkv.reshape(2, 17, 3, heads, 16).permute(2, 0, 3, 1, 4)  # each (2, heads, 17, 16)
        attn = ((q @ k.transpose(-2, -1)) * 16**-0.5).softmax(-1) @ v  # (2, heads, 17, 16)
        x = x + F.linear(attn.transpose(1, 2).reshape(2, 17, 48), w(b + "attn.proj.weight"), w(b + "attn.proj.bias"))
        h = F.layer_norm(x, (48,), w(b + "norm2.weight"), w(b + "norm2.bias"), eps)
        h = F.gelu(F.linear(h, w(b + "mlp.fc1.weight"), w(b + "mlp.fc1.bias")))
        x = x + F.linear(h, w(b + "mlp.fc2.weight"), w(b + "mlp.fc2.bias"))
    expected = F.layer_norm(x, (48,), w("norm.weight"), w("norm.bias"), eps)

    fresh = random_model(tokenizer, seed=4)
    load_converted(fresh, weights)
    with torch.no_grad():
        torch.testing.assert_close(
            fresh.vision_model(pixel_values=pixels).last_hidden_state, expected, rtol=1e-4, atol=1e-4
        )


def test_converter_refuses_what_does_not_fit(tokenizer):
    model = random_model(tokenizer)
    weights = package_state_dict(model)
    with pytest.raises(ValueError, match=r"no counterpart.*blip\.visual_encoder\.blocks\.0\.attn\.q_norm\.weight"):
        convert_imagereward_state_dict({**weights, "blip.visual_encoder.blocks.0.attn.q_norm.weight": torch.ones(3)})
    with pytest.raises(ValueError, match=r"no counterpart.*mlp\.layers\.9\.weight"):
        convert_imagereward_state_dict({**weights, "mlp.layers.9.weight": torch.ones(3)})
    with pytest.raises(ValueError, match="is it ImageReward.pt"):
        convert_imagereward_state_dict({"model": torch.ones(1)})
    missing = {k: v for k, v in weights.items() if k != "mlp.layers.7.bias"}
    with pytest.raises(ValueError, match=r"checkpoint 'x.pt' does not fit.*missing \['head\.4\.bias'\]"):
        load_converted(model, missing, source="checkpoint 'x.pt'")
    wrong = {**weights, "mlp.layers.0.weight": torch.zeros(1024, 7)}
    with pytest.raises(ValueError, match=r"shape mismatches \['head\.0\.weight: \(1024, 7\) vs \(1024, 32\)'\]"):
        load_converted(model, wrong)


# --- the factory -------------------------------------------------------------------------------


def test_factory_loads_pt_folder_and_safetensors(tmp_path, tokenizer, monkeypatch):
    from safetensors.torch import save_file

    module = importlib.import_module("flowrl.rewards.imagereward")  # `flowrl.rewards.imagereward` is the factory

    source = random_model(tokenizer, seed=5)
    weights = package_state_dict(source)
    (tmp_path / "ckpt").mkdir()
    torch.save(weights, tmp_path / "ckpt" / "ImageReward.pt")
    save_file({k: v.contiguous() for k, v in weights.items()}, tmp_path / "ir.safetensors")
    tokenizer.save_pretrained(tmp_path / "tok")
    monkeypatch.setattr(module, "imagereward_config", lambda: tiny_config(len(tokenizer)))  # v1.0 is 470M parameters

    assert REWARDS["imagereward"] is rewards.imagereward is imagereward_module_factory
    images = _images()
    expected = ImageReward(source, tokenizer)(images, PROMPTS, [{}] * 3)
    for checkpoint in [tmp_path / "ckpt" / "ImageReward.pt", tmp_path / "ckpt", tmp_path / "ir.safetensors"]:
        reward = build_reward("imagereward", checkpoint=str(checkpoint), tokenizer_path=str(tmp_path / "tok"))
        assert reward.name == "imagereward" and len(reward.tokenizer) == len(tokenizer)
        torch.testing.assert_close(reward(images, PROMPTS, [{}] * 3), expected, rtol=1e-5, atol=1e-5)


class NotATensor:
    pass


def test_factory_errors(tmp_path, tokenizer):
    tokenizer.save_pretrained(tmp_path / "tok")
    with pytest.raises(FileNotFoundError, match="nor a folder with ImageReward.pt.*hf download THUDM/ImageReward"):
        build_reward("imagereward", checkpoint=str(tmp_path), tokenizer_path=str(tmp_path / "tok"))
    torch.save({"x": NotATensor()}, tmp_path / "evil.pt")
    with pytest.raises(FileNotFoundError, match="tokenizer_path .* is not a local folder"):
        build_reward("imagereward", checkpoint=str(tmp_path / "evil.pt"), tokenizer_path=str(tmp_path / "none"))
    with pytest.raises(ValueError, match="evil.pt' is not a weights-only checkpoint"):  # never unpickled
        build_reward("imagereward", checkpoint=str(tmp_path / "evil.pt"), tokenizer_path=str(tmp_path / "tok"))
