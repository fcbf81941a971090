"""Tests of the `mps` reward (MPS, arXiv 2405.14705) on a tiny random transformers `CLIPModel` and condition branch.

The checkpoint is written in the layout of the reference wrapper's `state_dict()` (github.com/Kwai-Kolors/MPS,
`trainer/models/clip_model.py` and `cross_modeling.py`): `model.*` for the CLIP, `cross_model.layers.<i>.<0|1>.fn.*`
for the condition branch, with the key names and shapes spelled out here, independently of `flowrl.rewards.mps`.
Scores are compared with a functional forward written from the reference's formulas.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from tiny_pipelines.clip import cut_clip_tokenizer, random_clip

from flowrl.rewards import REWARDS, build_reward
from flowrl.rewards.mps import MPS, MPS_CONDITION, MPSModel, condition_mask, mps

DIM, HEADS, DIM_HEAD, FF_INNER, DEPTH = 16, 2, 8, 64, 2  # the cross model: CLIP's projection dim, 4 x dim inner


def _cross_model_state(generator):
    """Random condition-branch weights under the reference's key names (`Cross_model(dim, layer_num, heads)`)."""

    def randn(*shape, scale=0.3):
        return torch.randn(*shape, generator=generator) * scale

    inner = HEADS * DIM_HEAD
    state = {}
    for i in range(DEPTH):
        cross, block = f"cross_model.layers.{i}.0.fn.", f"cross_model.layers.{i}.1.fn."
        state |= {
            cross + "norm.weight": 1 + randn(DIM, scale=0.1),
            cross + "norm.bias": torch.zeros(DIM),  # a buffer of the reference's bias-free LayerNorm
            cross + "to_q.weight": randn(inner, DIM),
            cross + "to_kv.weight": randn(2 * DIM_HEAD, DIM),
            cross + "to_out.weight": randn(DIM, inner),
            cross + "ff.0.weight": randn(2 * FF_INNER, DIM),
            cross + "ff.2.weight": randn(DIM, FF_INNER, scale=0.1),
            block + "norm.weight": 1 + randn(DIM, scale=0.1),
            block + "norm.bias": torch.zeros(DIM),
            block + "rotary_emb.inv_freq": 1.0 / 10000 ** (torch.arange(0, DIM_HEAD, 2).float() / DIM_HEAD),
            block + "fused_attn_ff_proj.weight": randn(inner + 2 * DIM_HEAD + 2 * FF_INNER, DIM),
            block + "attn_out.weight": randn(DIM, inner),
            block + "ff_out.1.weight": randn(DIM, FF_INNER, scale=0.1),
        }
    return state


def _save_tiny_mps(folder):
    """(processor folder, weights file, state dict, CLIPModel): a tiny MPS saved in `folder` as the converted
    checkpoint, with the CLIP config, tokenizer and image processor MPS reads from LAION's folder."""
    clip, clip_processor = random_clip(cut_clip_tokenizer(2000, model_max_length=77), positions=77, projection_dim=DIM)
    clip.eval()
    processor = folder / "clip-processor"
    clip.config.save_pretrained(processor)  # config, tokenizer and image processor only, as MPS needs of LAION's
    clip_processor.save_pretrained(processor)
    state = {f"model.{key}": value for key, value in clip.state_dict().items()}
    for tower, positions in (("text", 77), ("vision", (32 // 8) ** 2 + 1)):  # buffers transformers 4.27 saved
        state[f"model.{tower}_model.embeddings.position_ids"] = torch.arange(positions)[None]
    state |= _cross_model_state(torch.Generator().manual_seed(1))
    weights = folder / "MPS_overall_checkpoint.safetensors"
    save_file({key: value.contiguous() for key, value in state.items()}, weights)
    return processor, weights, state, clip


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tensors here are tiny: one intra-op thread, since syncing two took seconds a forward on a busy 2-core host."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny_mps(tmp_path_factory):
    return _save_tiny_mps(tmp_path_factory.mktemp("tiny_mps"))


def _images(batch, seed):
    """Smooth `(batch, 3, 32, 32)` images in [0, 1] (the tiny model's input size: no resize)."""
    coarse = torch.rand(batch, 3, 4, 4, generator=torch.Generator().manual_seed(seed))
    return F.interpolate(coarse, size=(32, 32), mode="bilinear")


PROMPTS = ["a red cube on a table", "two hands holding a glass of water, soft light", "an old man's face, color photo"]


# --- the reference formulas, written out on the raw tensors ----------------------------------------------------------


def _layer_norm(x, state, prefix):
    return F.layer_norm(x, x.shape[-1:], state[prefix + "norm.weight"], state[prefix + "norm.bias"])


def _swiglu(x):
    x, gate = x.chunk(2, dim=-1)
    return F.silu(gate) * x


def _cross_attention(state, prefix, x, context, mask):
    """`CrossAttention(parallel_ff=True)`: multi-query attention of `x` to `context` with an additive mask."""
    x = _layer_norm(x, state, prefix)
    q = (x @ state[prefix + "to_q.weight"].T).unflatten(-1, (HEADS, DIM_HEAD)).transpose(1, 2) * DIM_HEAD**-0.5
    k, v = (context @ state[prefix + "to_kv.weight"].T).chunk(2, dim=-1)
    sim = torch.einsum("bhid,bjd->bhij", q, k) + mask[:, None]
    attn = (sim - sim.amax(dim=-1, keepdim=True)).softmax(dim=-1)
    out = torch.einsum("bhij,bjd->bhid", attn, v).transpose(1, 2).flatten(2)
    return (
        out @ state[prefix + "to_out.weight"].T
        + _swiglu(x @ state[prefix + "ff.0.weight"].T) @ state[prefix + "ff.2.weight"].T
    )


def _parallel_block(state, prefix, x):
    """`ParallelTransformerBlock`: fused q / k / v / feed-forward projection, rotary q and k, no mask."""
    x = _layer_norm(x, state, prefix)
    inner = HEADS * DIM_HEAD
    q, k, v, ff = (x @ state[prefix + "fused_attn_ff_proj.weight"].T).split(
        (inner, DIM_HEAD, DIM_HEAD, 2 * FF_INNER), dim=-1
    )
    freqs = torch.einsum("i,j->ij", torch.arange(x.shape[1]).float(), state[prefix + "rotary_emb.inv_freq"])
    pos = torch.cat((freqs, freqs), dim=-1)

    def rotary(t):
        half = t.shape[-1] // 2
        return t * pos.cos() + torch.cat((-t[..., half:], t[..., :half]), dim=-1) * pos.sin()

    q = rotary(q.unflatten(-1, (HEADS, DIM_HEAD)).transpose(1, 2)) * DIM_HEAD**-0.5
    sim = torch.einsum("bhid,bjd->bhij", q, rotary(k))
    attn = (sim - sim.amax(dim=-1, keepdim=True)).softmax(dim=-1)
    out = torch.einsum("bhij,bjd->bhid", attn, v).transpose(1, 2).flatten(2)
    return out @ state[prefix + "attn_out.weight"].T + _swiglu(ff) @ state[prefix + "ff_out.1.weight"].T


def _reference_score(state, clip, tokenizer, pixel_values, prompt, condition, threshold=0.3):
    """`infer_one_sample` of the reference's eval scripts: one `(1, 3, S, S)` image and one prompt -> `(1,)`."""

    def text_features(caption):
        ids = tokenizer(caption, max_length=77, padding="max_length", truncation=True, return_tensors="pt").input_ids
        out = clip.text_model(input_ids=ids)
        return clip.text_projection(out.last_hidden_state), clip.text_projection(out.pooler_output)

    text_f, text_eos = text_features(prompt)
    condition_f, _ = text_features(condition)
    image_f = clip.visual_projection(clip.vision_model(pixel_values=pixel_values).last_hidden_state)
    sim = torch.einsum("bid,bjd->bji", text_f, condition_f).max(dim=1, keepdim=True)[0]
    sim = sim / sim.max()
    mask = torch.where(sim > threshold, 0.0, float("-inf")).repeat(1, image_f.shape[1], 1)
    x = image_f
    for i in range(DEPTH):
        x = x + _cross_attention(state, f"cross_model.layers.{i}.0.fn.", x, text_f, mask)
        x = x + _parallel_block(state, f"cross_model.layers.{i}.1.fn.", x)
    image = x[:, 0] / x[:, 0].norm(dim=-1, keepdim=True)
    text = text_eos / text_eos.norm(dim=-1, keepdim=True)
    return (clip.logit_scale.exp() * text @ image.T)[0]


# --- tests ------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reward(tiny_mps):
    """The tiny MPS loaded through the registry, as a config names it."""
    processor, weights, _, _ = tiny_mps
    return build_reward("mps", model_path=str(weights), processor_path=str(processor))


def _with(reward, **options):
    """Another `MPS` over a copy of `reward`'s network (no reload), with other `condition`, `dtype` or `batch_size`."""
    kwargs = dict(condition=reward.condition, dtype=reward.dtype, batch_size=reward.batch_size) | options
    mean, std = reward.image_mean.flatten().tolist(), reward.image_std.flatten().tolist()
    return MPS(copy.deepcopy(reward.model), reward.tokenizer, mean, std, **kwargs)


def test_registered_and_keys_are_the_reference_layout(tiny_mps, reward):
    _, _, state, _ = tiny_mps
    factory = REWARDS["mps"]
    assert factory is mps and factory.modality == "image" and factory.differentiable
    assert reward.name == "mps" and isinstance(reward.model, MPSModel) and reward.condition == MPS_CONDITION
    assert set(reward.model.state_dict()) == {key for key in state if not key.endswith("position_ids")}


def test_scores_equal_the_reference_formula(tiny_mps, reward):
    _, _, state, clip = tiny_mps
    images = _images(3, seed=2)
    scores = reward(images, PROMPTS, [{}, {}, {}])
    assert scores.shape == (3,) and scores.dtype == torch.float32 and scores.device.type == "cpu"
    assert torch.isfinite(scores).all()
    keep = condition_mask(reward.model.encode_text(reward.tokenize(PROMPTS))[0], reward.condition_tokens)
    assert (keep.sum(-1) > 0).all() and (keep.sum(-1) < 77).any()  # the mask drops prompt tokens, never all
    with torch.no_grad():
        expected = torch.cat(
            [
                _reference_score(state, clip, reward.tokenizer, reward.preprocess(images[i : i + 1]), p, MPS_CONDITION)
                for i, p in enumerate(PROMPTS)
            ]
        )
    torch.testing.assert_close(scores, expected, rtol=1e-5, atol=1e-5)


def test_condition_text_changes_the_score(reward):
    images, metadata = _images(3, seed=3), [{}, {}, {}]
    hands = _with(reward, condition="shape, face, hair, hands, limbs")
    assert (reward(images, PROMPTS, metadata) - hands(images, PROMPTS, metadata)).abs().max() > 1e-3


def test_scores_do_not_depend_on_batching_or_order(reward):
    images, metadata = _images(3, seed=4), [{}, {}, {}]
    whole = reward(images, PROMPTS, metadata)
    torch.testing.assert_close(_with(reward, batch_size=1)(images, PROMPTS, metadata), whole, rtol=1e-5, atol=1e-5)
    order = [2, 0, 1]
    flipped = reward(images[order], [PROMPTS[i] for i in order], metadata)
    torch.testing.assert_close(flipped, whole[order], rtol=1e-5, atol=1e-5)


def test_score_with_grad_matches_and_its_gradient_is_finite_differences(reward):
    double = _with(reward, dtype="float64")
    images, prompts, metadata = _images(1, seed=5).double(), PROMPTS[1:2], [{}]
    pixels = images.clone().requires_grad_(True)
    scores = double.score_with_grad(pixels, prompts, metadata)
    assert scores.dtype == torch.float64
    torch.testing.assert_close(scores.float(), reward(images.float(), prompts, metadata), rtol=1e-5, atol=1e-5)
    (gradient,) = torch.autograd.grad(scores.sum(), pixels)
    direction = torch.randn(images.shape, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    step = 1e-6
    with torch.no_grad():
        plus = double.score_with_grad(images + step * direction, prompts, metadata).sum()
        minus = double.score_with_grad(images - step * direction, prompts, metadata).sum()
    assert gradient.abs().sum() > 0
    torch.testing.assert_close((plus - minus) / (2 * step), (gradient * direction).sum(), rtol=1e-5, atol=1e-8)


def test_errors_are_one_line_and_named(tiny_mps, reward, tmp_path):
    processor, weights, state, _ = tiny_mps

    def error(exc, match, *args, **kwargs):
        with pytest.raises(exc, match=match) as info:
            mps(*args, **kwargs)
        assert "\n" not in str(info.value)

    error(
        FileNotFoundError,
        r"^mps: model_path '.*nowhere.safetensors' not found; pass the MPS weights file",
        tmp_path / "nowhere.safetensors",
        processor,
    )
    error(FileNotFoundError, r"^mps: model_path '.*' is a folder", tmp_path, processor)
    error(FileNotFoundError, r"^mps: processor_path '.*none' is not a local folder", weights, tmp_path / "none")
    error(FileNotFoundError, r"^mps: processor_path '.*' has no config.json", weights, tmp_path)
    error(ValueError, r"^mps: condition must be a non-empty string", weights, processor, condition=" ")
    error(ValueError, r"^mps: batch_size must be an integer >= 1", weights, processor, batch_size=0)

    pickled = tmp_path / "MPS_overall_checkpoint.pth"
    torch.save(torch.nn.Linear(2, 2), pickled)  # a whole pickled module, as the released file is
    error(
        ValueError,
        r"^mps: '.*MPS_overall_checkpoint.pth' is not a weights-only checkpoint; the released .* convert it once",
        pickled,
        processor,
    )
    clip_only = tmp_path / "clip_only.safetensors"
    save_file({k: v.contiguous() for k, v in state.items() if k.startswith("model.")}, clip_only)
    error(ValueError, r"^mps: '.*clip_only.safetensors' has no MPS condition branch", clip_only, processor)
    misfit = tmp_path / "misfit.safetensors"
    save_file({k: v.contiguous() for k, v in state.items() if "vision_model.encoder.layers.1." not in k}, misfit)
    error(
        ValueError,
        r"^mps: '.*misfit.safetensors' does not fit the CLIP config of processor_path: 16 missing",
        misfit,
        processor,
    )
    as_pt = tmp_path / "mps_state.pt"  # the same state dict as a weights-only .pt loads too
    torch.save(state, as_pt)
    images = _images(1, seed=7)
    torch.testing.assert_close(mps(as_pt, processor)(images, PROMPTS[:1], [{}]), reward(images, PROMPTS[:1], [{}]))
