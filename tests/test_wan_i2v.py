"""The Wan image-to-video adapter (`flowrl.models.WanImageToVideoModel`) on tiny random WanImageToVideoPipelines built
offline (test_wan.py's UMT5, T5 tokenizer, Wan VAE and scheduler; an image-to-video WanTransformer3DModel of
2 x 4 + 4 input channels; for Wan 2.1 a tiny CLIP vision tower and its processor): what is special to the family, the
source frame from the prompt record, its refusals, the Wan 2.2 layout (two experts, no image encoder) and the recipe
(configs/recipes/wan_i2v_flow_grpo.yaml) shrunk to two iterations. The conformance suite (tests/test_conformance.py -k
WanImageToVideoModel) checks the rest on the Wan 2.1 layout."""

import json
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from conftest import REPO, record_reward_metadata, tiny_overrides, train_shrunk_recipe
from families import prompt_files

from flowrl.config import ConfigError, load_config
from flowrl.data import read_jsonl
from flowrl.models import WanImageToVideoModel, load_model, model_class
from flowrl.trainer import Trainer

SIDE, FRAMES = 16, 5  # 16 px (the pipeline's multiple of 16), 5 frames: latents (4, 2, 4, 4), condition (8, 2, 4, 4)


def build_random_wan_i2v_pipeline(folder: Path, image_encoder: bool = True, two_experts: bool = False) -> Path:
    """Save a random-weight WanImageToVideoPipeline to `folder`: the tokenizer, 1-layer UMT5, Wan VAE (4 latent
    channels, 4x temporal and spatial compression) and flow-matching scheduler (shift 3) of test_wan.py's tiny
    WanPipeline, and a 2-block image-to-video transformer taking 2 x 4 + 4 channels (noise, mask, source latents).
    Its cross-attention keys are normalised with weight 8, not 1: at random weights the prompt's few tokens would be
    drowned by the 500 padding tokens of the 512 the image-to-video attention needs (guidance and the negative prompt
    would change the videos by about 3e-4; a trained model attends to the prompt).
    `image_encoder` (Wan 2.1's layout): a 2-layer CLIP vision tower (32 px, 8 px patches: 17 tokens of 32) with its
    CLIPImageProcessor, whose second-to-last hidden states the transformer attends to (``image_dim`` 32). Without it
    (Wan 2.2's layout) `two_experts` adds a second transformer and boundary_ratio 0.5 (Wan 2.2 I2V A14B's)."""
    from diffusers import WanImageToVideoPipeline, WanPipeline, WanTransformer3DModel
    from test_wan import build_random_wan_pipeline
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    with tempfile.TemporaryDirectory() as tmp:
        t2v = WanPipeline.from_pretrained(build_random_wan_pipeline(Path(tmp)))  # seeds 0
    clip = processor = None
    if image_encoder:
        clip = CLIPVisionModel(
            CLIPVisionConfig(
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=2,
                num_attention_heads=2,
                image_size=32,
                patch_size=8,
            )
        )
        processor = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})

    def transformer():
        dit = WanTransformer3DModel(
            patch_size=(1, 2, 2),
            num_attention_heads=2,
            attention_head_dim=8,
            in_channels=12,
            out_channels=4,
            text_dim=32,
            freq_dim=16,
            ffn_dim=32,
            num_layers=2,
            cross_attn_norm=True,
            qk_norm="rms_norm_across_heads",
            image_dim=32 if image_encoder else None,
            added_kv_proj_dim=16 if image_encoder else None,  # the transformer's width, as Wan 2.1 I2V's
            rope_max_seq_len=32,
        )
        for block in dit.blocks:  # sharpen the text attention: see the docstring
            block.attn2.norm_k.weight.data.fill_(8.0)
        return dit

    pipe = WanImageToVideoPipeline(
        tokenizer=t2v.tokenizer,
        text_encoder=t2v.text_encoder,
        vae=t2v.vae,
        scheduler=t2v.scheduler,
        image_processor=processor,
        image_encoder=clip,
        transformer=transformer(),
        transformer_2=transformer() if two_experts else None,
        boundary_ratio=0.5 if two_experts else None,
    )
    pipe.save_pretrained(folder)
    return folder


def stock_wan_i2v(
    folder: Path,
    model,
    metas: list[dict],
    noise: torch.Tensor,
    num_steps: int,
    guidance_scale: float,
    negative_prompt: str | None = None,
    lora: Path | None = None,
) -> torch.Tensor:
    """The stock pipeline's videos ``(B, F, 3, H, W)`` float32 in [0, 1] (``output_type="pt"``) of the records `metas`
    from the noise latents ``noise (B, *model.latent_shape)``: one call per record (the pipeline takes one image), its
    source read as RGB (a record without one: the adapter's blank frame), CFG against `negative_prompt` (None: ``""``)
    above 1; `lora`: a LoRA folder it loads first. The scheduler is the folder's flow-matching Euler one."""
    from diffusers import WanImageToVideoPipeline
    from PIL import Image

    from flowrl.models.wan_i2v import BLANK_SOURCE

    pipe = WanImageToVideoPipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    if lora is not None:
        pipe.load_lora_weights(str(lora))
    videos = []
    for i, meta in enumerate(metas):
        if meta.get("image"):
            source = Image.open(meta["image"]).convert("RGB")
        else:
            source = Image.new("RGB", (model.resolution, model.resolution), BLANK_SOURCE)
        with torch.no_grad():
            videos.append(
                pipe(
                    image=source,
                    prompt=[meta["prompt"]],
                    negative_prompt=[negative_prompt] if negative_prompt else None,
                    latents=noise[i : i + 1],
                    num_frames=model.num_frames,
                    height=model.resolution,
                    width=model.resolution,
                    num_inference_steps=num_steps,
                    guidance_scale=guidance_scale,
                    max_sequence_length=model.max_sequence_length,
                    output_type="pt",
                ).frames
            )
    return torch.cat(videos)


def _noise(model, seeds) -> torch.Tensor:
    """The noise `flowrl.evaluation.generate` draws for `seeds`: ``(B, *model.latent_shape)``."""
    return torch.stack([torch.randn(model.latent_shape, generator=torch.Generator().manual_seed(s)) for s in seeds])


@pytest.fixture(scope="module")
def wan21(tmp_path_factory) -> Path:
    return build_random_wan_i2v_pipeline(tmp_path_factory.mktemp("random-wan21-i2v"))


@pytest.fixture(scope="module")
def wan22(tmp_path_factory) -> Path:
    return build_random_wan_i2v_pipeline(
        tmp_path_factory.mktemp("random-wan22-i2v"), image_encoder=False, two_experts=True
    )


@pytest.fixture(scope="module")
def i2v_prompts(tmp_path_factory) -> tuple[Path, Path]:
    return prompt_files("i2v", tmp_path_factory.mktemp("i2v-prompts"))


def _model(folder: Path, **kwargs) -> WanImageToVideoModel:
    return load_model(folder, resolution=SIDE, num_frames=FRAMES, **kwargs)


def test_the_source_frame_conditions_the_video(wan21, i2v_prompts):
    """Each record's own source (its first frame, its CLIP tokens) conditions its video; a record without one starts from
    the blank frame, as the stock pipeline given that frame (the negative prompt, which sees the row's source: the
    conformance suite)."""
    from flowrl.evaluation import generate

    model = _model(wan21)
    metas = read_jsonl(i2v_prompts[0])[:3]
    table = model.prompt_table(metas[:2])
    assert model.latent_shape == (4, 2, 4, 4) and table.condition.shape == (3, 8, 2, 4, 4)
    assert table.image.shape == (3, 17, 32) and table.embeds.shape == (3, 512, 32)
    assert torch.equal(table.condition[1, :4, 0], torch.ones(4, 4, 4))  # the mask: the source frame given,
    assert not table.condition[1, :4, 1].any()  # the next latent frame drawn
    prompts = [m["prompt"] for m in metas[:2]]
    ours = generate(model, prompts, [0, 1], 3, 4.0, metas=metas[:2])
    swapped = [{**metas[0], "image": metas[1]["image"]}, {**metas[1], "image": metas[2]["image"]}]
    assert (generate(model, prompts, [0, 1], 3, 4.0, metas=swapped) - ours).abs().amax(dim=(1, 2, 3, 4)).min() > 1e-3
    blank = generate(model, prompts, [0, 1], 3, 4.0)  # the prompts alone: the blank frame
    torch.testing.assert_close(
        blank,
        stock_wan_i2v(wan21, model, [{"prompt": p} for p in prompts], _noise(model, [0, 1]), 3, 4.0),
        rtol=0,
        atol=1e-4,
    )


def test_wan22_layout_two_experts_without_image_encoder(wan22, i2v_prompts):
    """Wan 2.2 I2V A14B's layout: no CLIP tokens (any prompt length), the trained expert chosen by model.expert, both
    experts sample (switching at boundary_ratio) as the stock pipeline does."""
    from flowrl.evaluation import generate

    assert model_class(wan22) is WanImageToVideoModel
    with pytest.raises(ValueError, match="two-expert Wan 2.2 model .* choose the trained expert"):
        _model(wan22)
    model = _model(wan22, expert="low", max_sequence_length=16)  # no CLIP tokens: any prompt length
    assert model.transformer is model.pipe.transformer_2 and model.pipe.image_encoder is None
    metas = read_jsonl(i2v_prompts[0])[:2]
    assert model.prompt_table(metas).image.shape == (3, 0, 0)
    ours = generate(model, [m["prompt"] for m in metas], [0, 1], 4, 3.0, metas=metas)
    stock = stock_wan_i2v(wan22, model, metas, _noise(model, [0, 1]), 4, 3.0)
    torch.testing.assert_close(ours, stock, rtol=0, atol=1e-4)


def test_refusals_name_the_setting(wan21, tmp_path, i2v_prompts):
    assert WanImageToVideoModel.check_resolution(wan21, None) == 256  # what the rotary embedding covers, /16
    with pytest.raises(
        ValueError,
        match=r"resolution 24 px .*multiple of 16 \(VAE spatial compression 4 x patch size 2 and the pipeline's 16\)",
    ):
        WanImageToVideoModel.check_resolution(wan21, 24)
    with pytest.raises(ValueError, match="max_sequence_length must be 512 .*CLIP image tokens"):
        _model(wan21, max_sequence_length=16)
    model = _model(wan21)
    (tmp_path / "notes.png").write_text("not an image")
    with pytest.raises(ValueError, match="source image .*notes.png cannot be read as an image"):
        model.prompt_table([{"prompt": "a star", "image": str(tmp_path / "notes.png")}])
    for name, change, message in (
        ("ti2v", {"model_index.json": {"expand_timesteps": True}}, "expand_timesteps .* not built"),
        ("t2v", {"transformer/config.json": {"in_channels": 4}}, "takes 4 channels, not the 12 of image-to-video"),
        ("noclip", {"model_index.json": {"image_encoder": [None, None]}}, "image_dim 32.* no image_encoder"),
    ):
        folder = tmp_path / name
        shutil.copytree(wan21, folder)
        for file, values in change.items():
            config = json.loads((folder / file).read_text())
            (folder / file).write_text(json.dumps({**config, **values}))
        with pytest.raises(ValueError, match=message):
            WanImageToVideoModel.check_layout(folder)
    over = tiny_overrides(
        tmp_path / "ti2v",
        *i2v_prompts,
        tmp_path / "run",
        **{"model.resolution": SIDE, "model.num_frames": FRAMES, "rewards.geneval": "null"},
    )
    with pytest.raises(ConfigError, match="'model.path'.*expand_timesteps"):
        Trainer(load_config(None, over))
    over = tiny_overrides(
        wan21,
        *i2v_prompts,
        tmp_path / "run",
        **{"model.resolution": SIDE, "model.num_frames": FRAMES, "model.max_sequence_length": 64},
    )
    with pytest.raises(ConfigError, match="'model.max_sequence_length'.* must be 512"):
        Trainer(load_config(None, over))


def test_wan_i2v_recipe_trains_and_the_rewards_see_the_source(tmp_path, wan21, i2v_prompts):
    """configs/recipes/wan_i2v_flow_grpo.yaml shrunk onto the tiny Wan 2.1 I2V pipeline (its 1-step random SDE window and
    guidance 5 kept; PickScore over the frames swapped for brightness, which needs no download)."""
    train, test = i2v_prompts
    recipe = load_config(REPO / "configs" / "recipes" / "wan_i2v_flow_grpo.yaml")
    assert (recipe.model.num_frames, recipe.model.resolution, recipe.sampling.num_steps) == (5, 240, 10)
    assert recipe.sampling.window.size == 1 and recipe.sampling.guidance_scale == 5.0
    over = tiny_overrides(
        wan21,
        train,
        test,
        tmp_path / "run",
        **{
            "model.dtype": "float32",
            "model.resolution": SIDE,
            "model.num_frames": FRAMES,
            "rewards.frames": "null",
            "rewards.families:brightness.weight": 1.0,
            "rewards.geneval": "null",
            "sampling.num_steps": 5,
            "sampling.group_size": 2,
            "sampling.batch_size": 4,
            "train.minibatch_size": 2,
            "train.ema_decay": 0.0,
        },
    )
    trainer = Trainer(load_config(REPO / "configs" / "recipes" / "wan_i2v_flow_grpo.yaml", over))
    assert isinstance(trainer.model, WanImageToVideoModel) and trainer.cfg.sampling.shift == 3.0
    seen = record_reward_metadata(trainer)
    train_shrunk_recipe(trainer)
    assert seen and all(Path(m["image"]).is_file() for m in seen)
    lora = trainer.model.transformer.peft_config["default"]
    assert {"ffn.net.0.proj", "ffn.net.2", "to_q"} <= set(lora.target_modules)
