"""The Qwen-Image-Edit adapters (`flowrl.models.QwenImageEditModel`, `QwenImageEditPlusModel`) on tiny random
QwenImageEditPipelines and QwenImageEditPlusPipelines built offline (a tiny Qwen2.5-VL with a vision tower, a
Qwen2VLProcessor and a byte-level BPE tokenizer trained here on the edit template): a source image per prompt record,
seen by the text encoder and the transformer, sampled as the stock pipeline samples an edit, given to the rewards, and
trained through the same trainer (configs/recipes/qwen_image_edit_flow_grpo.yaml shrunk) to a LoRA the stock pipeline loads."""

import json
from contextlib import ExitStack
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch
from conftest import REPO, record_reward_metadata, tiny_overrides, train_shrunk_recipe

from flowrl.config import ConfigError, load_config
from flowrl.data import read_jsonl, write_jsonl
from flowrl.models import QwenImageEditModel, QwenImageEditPlusModel, QwenImageModel, load_model, model_class
from flowrl.trainer import Trainer

SIDE = 32  # px of the edited images: VAE factor 4, 4 x 4 packed tokens
SOURCE = 64  # px: the tests' source_resolution; a square source -> 64 x 64 px (8 x 8 tokens), a 2:1 one -> 96 x 32
EDIT_SYSTEM = (
    "<|im_start|>system\nDescribe the key features of the input image (color, shape, size, texture, objects, "
    "background), then explain how the user's text instruction should alter or modify the image. Generate a new image "
    "that meets the user's requirements while maintaining consistency with the original input where appropriate."
    "<|im_end|>\n<|im_start|>user\n"
)
"""The edit pipelines' system prefix, 64 tokens with Qwen's tokenizer (``prompt_template_encode_start_idx``)."""
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>"]


def build_qwen_edit_tokenizer():
    """A Qwen2Tokenizer (byte-level BPE, Qwen2's pre-tokenizer) of 500 tokens with Qwen2.5-VL's vision tokens, trained on
    the edit template and the tiny world's prompts, so that the template's system prefix is 64 tokens, as with Qwen's
    own tokenizer: the edit pipelines drop exactly that many (``prompt_template_encode_start_idx``)."""
    from tokenizers import Regex, Tokenizer, normalizers, pre_tokenizers
    from tokenizers.models import BPE
    from tokenizers.trainers import BpeTrainer
    from transformers import Qwen2Tokenizer
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    from flowrl.tiny.prompts import split

    text = EDIT_SYSTEM + "<|vision_start|><|image_pad|><|vision_end|>{}<|im_end|>\n<|im_start|>assistant\n"
    specials = [*SPECIALS, "<|video_pad|>"]
    bpe = Tokenizer(BPE())
    bpe.normalizer = normalizers.NFC()
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    train, test = split(0)
    bpe.train_from_iterator(
        [text.format(m["prompt"]) for m in train + test] * 3,
        BpeTrainer(
            vocab_size=500,
            special_tokens=specials,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    model = json.loads(bpe.to_str())["model"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    return Qwen2Tokenizer(vocab=model["vocab"], merges=merges, additional_special_tokens=specials[1:])


def build_random_qwen_image_edit_pipeline(folder: Path, plus: bool = False) -> Path:
    """Save a random-weight QwenImageEditPipeline (``plus``: QwenImageEditPlusPipeline) to ``folder``: a 1-layer
    Qwen2.5-VL (hidden 32) with a 1-block vision tower (4 px patches, 2 x 2 merge), a Qwen2VLProcessor whose image
    processor keeps at most 32 x 32 px, a Qwen-Image VAE of factor 4 with 4 latent channels, a 1-block Qwen-Image
    transformer and Qwen-Image's scheduler config (dynamic shift 0.5..0.9 over 256..8192 tokens, shift_terminal
    0.02). Seeded; builds in about a second."""
    from diffusers import (
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
        QwenImageEditPipeline,
        QwenImageEditPlusPipeline,
        QwenImageTransformer2DModel,
    )
    from transformers import (
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2VLImageProcessor,
        Qwen2VLProcessor,
        Qwen2VLVideoProcessor,
    )

    torch.manual_seed(0)
    tok = build_qwen_edit_tokenizer()
    ids = tok.convert_tokens_to_ids
    vision = dict(patch_size=4, temporal_patch_size=2, merge_size=2, min_pixels=8 * 8, max_pixels=SIDE * SIDE)
    te = Qwen2_5_VLForConditionalGeneration(
        Qwen2_5_VLConfig(
            text_config=dict(
                vocab_size=len(tok),
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=1,
                num_attention_heads=2,
                num_key_value_heads=1,
                max_position_embeddings=1024,
                bos_token_id=None,
                eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
            ),
            vision_config=dict(
                depth=1,
                hidden_size=16,
                intermediate_size=32,
                num_heads=2,
                out_hidden_size=32,
                fullatt_block_indexes=[0],
                patch_size=vision["patch_size"],
                temporal_patch_size=vision["temporal_patch_size"],
                spatial_merge_size=vision["merge_size"],
                window_size=16,
            ),
            image_token_id=ids("<|image_pad|>"),
            video_token_id=ids("<|video_pad|>"),
            vision_start_token_id=ids("<|vision_start|>"),
            vision_end_token_id=ids("<|vision_end|>"),
        )
    )
    processor = Qwen2VLProcessor(
        image_processor=Qwen2VLImageProcessor(**vision),
        tokenizer=tok,
        video_processor=Qwen2VLVideoProcessor(**vision),
    )
    vae = AutoencoderKLQwenImage(
        base_dim=8,
        z_dim=4,
        dim_mult=[1, 2, 2],
        num_res_blocks=1,
        temperal_downsample=[False, True],
        latents_mean=[0.1, -0.2, 0.3, 0.0],
        latents_std=[1.5, 0.8, 1.2, 2.0],
    )
    dit = QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=16,
        out_channels=4,
        num_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        axes_dims_rope=(4, 6, 6),
    )
    scheduler = FlowMatchEulerDiscreteScheduler(
        base_image_seq_len=256,
        base_shift=0.5,
        max_image_seq_len=8192,
        max_shift=0.9,
        shift=1.0,
        shift_terminal=0.02,
        time_shift_type="exponential",
        use_dynamic_shifting=True,
    )
    cls = QwenImageEditPlusPipeline if plus else QwenImageEditPipeline
    pipe = cls(scheduler=scheduler, vae=vae, text_encoder=te, tokenizer=tok, processor=processor, transformer=dit)
    pipe.save_pretrained(folder)
    return folder


def edit_prompt_files(folder: Path) -> tuple[Path, Path]:
    """Write ``folder/train.jsonl`` and ``folder/test.jsonl``: the tiny world's prompts (12 each), each with a random
    source image (a path relative to the file, under ``folder/sources``): even records 32 x 32 px, odd ones 48 x 24 (2:1,
    so a batch holds sources of two shapes). Returns the two files."""
    from PIL import Image

    from flowrl.tiny.prompts import split

    (folder / "sources").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    files = []
    for name, metas in zip(("train", "test"), split(0)):
        records = []
        for i, m in enumerate(metas[:12]):
            image = f"sources/{name}{i}.png"
            h, w = (24, 48) if i % 2 else (32, 32)
            Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(folder / image)
            records.append({**m, "image": image})
        write_jsonl(records, folder / f"{name}.jsonl")
        files.append(folder / f"{name}.jsonl")
    return files[0], files[1]


def stock_qwen_image_edit(
    folder: Path, model, metas: list[dict], noise: torch.Tensor, num_steps: int, guidance_scale: float, lora=None
) -> torch.Tensor:
    """The stock pipeline's edits ``(B, 3, H, W)`` float32 in [0, 1] (``output_type="pt"``) of the records ``metas``
    (dicts with ``prompt`` and ``image``) from the noise latents ``noise (B, *model.latent_shape)``, one record per
    call (QwenImageEditPipeline sizes every source of a call by the first one's; the Plus pipeline takes one prompt),
    with its own schedule and true CFG against ``""`` above 1; ``lora``: a LoRA folder it loads first.

    The one constant changed is the area the pipeline gives a source image in the VAE, 1024 * 1024 in both
    (``calculate_dimensions(1024 * 1024, ratio)``; ``VAE_IMAGE_SIZE``): it is set to ``model.source_resolution ** 2``,
    as flowrl's ``model.options.source_resolution`` (and Flow-GRPO's Qwen-Image-Edit-Plus script) set it."""
    import diffusers
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit as edit
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus as plus
    from PIL import Image

    pipe = getattr(diffusers, model.PIPELINE).from_pretrained(folder)
    if lora is not None:
        pipe.load_lora_weights(str(lora))
    c, h, w = model.latent_shape
    area = model.source_resolution**2
    images = []
    with ExitStack() as patches, torch.no_grad():
        original = edit.calculate_dimensions
        patches.enter_context(mock.patch.object(edit, "calculate_dimensions", lambda _, r: original(area, r)))
        patches.enter_context(mock.patch.object(plus, "VAE_IMAGE_SIZE", area))
        for i, meta in enumerate(metas):
            source = Image.open(meta["image"]).convert("RGB")
            images.append(
                pipe(
                    image=[source] if isinstance(model, QwenImageEditPlusModel) else source,
                    prompt=[meta["prompt"]],
                    negative_prompt=[""] if guidance_scale > 1 else None,
                    true_cfg_scale=guidance_scale,
                    latents=pipe._pack_latents(noise[i : i + 1], 1, c, h, w),
                    num_inference_steps=num_steps,
                    height=model.resolution,
                    width=model.resolution,
                    output_type="pt",
                ).images
            )
    return torch.cat(images)


def _noise(model, seeds) -> torch.Tensor:
    """The noise `flowrl.evaluation.generate` draws for `seeds`: ``(B, *model.latent_shape)``."""
    return torch.stack([torch.randn(model.latent_shape, generator=torch.Generator().manual_seed(s)) for s in seeds])


@pytest.fixture(scope="module")
def edit(tmp_path_factory) -> Path:
    return build_random_qwen_image_edit_pipeline(tmp_path_factory.mktemp("random-qwen-image-edit"))


@pytest.fixture(scope="module")
def plus(tmp_path_factory) -> Path:
    return build_random_qwen_image_edit_pipeline(tmp_path_factory.mktemp("random-qwen-image-edit-plus"), plus=True)


@pytest.fixture(scope="module")
def edit_prompts(tmp_path_factory) -> tuple[Path, Path]:
    return edit_prompt_files(tmp_path_factory.mktemp("edit-prompts"))


def test_adapters_from_model_index_and_bad_sources(edit, plus, edit_prompts, tmp_path):
    from diffusers import QwenImageEditPipeline

    assert model_class(edit) is QwenImageEditModel and model_class(plus) is QwenImageEditPlusModel
    assert issubclass(QwenImageEditPlusModel, QwenImageEditModel) and issubclass(QwenImageEditModel, QwenImageModel)
    pipe = QwenImageEditPipeline.from_pretrained(edit)
    assert len(pipe.tokenizer(EDIT_SYSTEM).input_ids) == pipe.prompt_template_encode_start_idx == 64
    train, _ = edit_prompts
    assert read_jsonl(train)[1]["image"] == str((train.parent / "sources" / "train1.png").resolve())  # made absolute
    model = load_model(edit, resolution=SIDE, source_resolution=SOURCE)
    assert model.source_resolution == SOURCE and load_model(plus, resolution=SIDE).source_resolution == 1024
    (tmp_path / "notes.png").write_text("not an image")
    with pytest.raises(ValueError, match="source image .*notes.png cannot be read as an image"):
        model.prompt_table([{"prompt": "a star", "image": str(tmp_path / "notes.png")}])
    from PIL import Image

    Image.new("RGB", (200, 2)).save(tmp_path / "strip.png")
    with pytest.raises(ValueError, match=r"strip.png \(200 x 2 px\) has a side that rounds to 0 px"):
        model.prompt_table([{"prompt": "a star", "image": str(tmp_path / "strip.png")}])
    for bad in (16, 64.0, True):
        with pytest.raises(ValueError, match="source_resolution must be an integer number of pixels >= 32"):
            QwenImageEditModel.check_source_resolution(bad)
    base = {"model.resolution": SIDE, "model.max_sequence_length": 64, "rewards.geneval": "null"}
    for extra, message in (
        ({"model.options.source_resolution": 8}, "'model.options.source_resolution'.*>= 32"),
        (
            {"model.prompt_cache": str(tmp_path / "cache"), "model.text_encoders": "drop_after_cache"},
            "'model.text_encoders'.*source image.*use keep or cpu",
        ),
    ):
        over = tiny_overrides(edit, *edit_prompts, tmp_path / "run", **base, **extra)
        with pytest.raises(ConfigError, match=message):
            Trainer(load_config(None, over))


@pytest.mark.parametrize("family", ["edit", "plus"])
@pytest.mark.parametrize("guidance_scale", [4.0, 1.0])
def test_ode_sampling_equals_the_stock_pipeline(family, guidance_scale, request, edit_prompts):
    """A square and a 2:1 source in one batch (two transformer calls, one per source shape) edit as the stock pipeline
    edits each, with true CFG (each row against the empty prompt with its own source) and without."""
    from flowrl.evaluation import generate

    folder = request.getfixturevalue(family)
    metas = read_jsonl(edit_prompts[0])[:2]
    model = load_model(folder, resolution=SIDE, source_resolution=SOURCE)
    table = model.prompt_table(metas)
    assert table.grid.tolist() == [[0, 0], [8, 8], [4, 12]] and table.image.shape == (3, 64, 16)
    assert model.cfg_rows(guidance_scale) == (2 if guidance_scale > 1 else 1)
    ours = generate(model, [m["prompt"] for m in metas], [0, 1], 3, guidance_scale, metas=metas)
    stock = stock_qwen_image_edit(folder, model, metas, _noise(model, [0, 1]), 3, guidance_scale)
    assert ours.shape == stock.shape == (2, 3, SIDE, SIDE)
    torch.testing.assert_close(ours, stock, rtol=0, atol=1e-4)


def test_the_source_image_conditions_the_edit_and_batches_mix(edit, edit_prompts):
    from flowrl.evaluation import generate

    model = load_model(edit, resolution=SIDE, source_resolution=SOURCE)
    metas = read_jsonl(edit_prompts[0])[:4]
    prompts = [m["prompt"] for m in metas[:2]]
    ours = generate(model, prompts, [0, 1], 3, 4.0, metas=metas[:2])
    swapped = [{**metas[0], "image": metas[2]["image"]}, {**metas[1], "image": metas[3]["image"]}]
    assert (generate(model, prompts, [0, 1], 3, 4.0, metas=swapped) - ours).abs().amax(dim=(1, 2, 3)).min() > 1e-4
    text_only = generate(model, prompts, [0, 1], 3, 4.0)  # the records without their source: text-to-image
    assert (text_only - ours).abs().amax(dim=(1, 2, 3)).min() > 1e-3
    mixed = generate(model, prompts, [0, 1], 3, 4.0, metas=[metas[0], {"prompt": prompts[1]}])
    torch.testing.assert_close(mixed, torch.stack([ours[0], text_only[1]]), rtol=0, atol=1e-5)


def test_edit_recipe_trains_rewards_see_the_source_and_the_lora_loads_in_stock(tmp_path, edit, edit_prompts):
    """configs/recipes/qwen_image_edit_flow_grpo.yaml, shrunk onto the tiny random QwenImageEditPipeline (sources at 64 px of
    side; the real-GenEval reward swapped for JPEG compressibility, which needs no download)."""
    from flowrl.evaluation import generate

    train, test = edit_prompts
    over = tiny_overrides(
        edit,
        train,
        test,
        tmp_path / "run",
        **{
            "model.dtype": "float32",
            "model.resolution": SIDE,
            "model.max_sequence_length": 64,
            "model.options.source_resolution": SOURCE,
            "rewards.geneval": "null",
            "rewards.jpeg_compressibility.weight": 1.0,
            "sampling.group_size": 4,
            "sampling.batch_size": 8,
            "train.minibatch_size": 8,
            "train.micro_batch_size": "null",
            "train.gradient_checkpointing": False,
        },
    )
    cfg = load_config(REPO / "configs" / "recipes" / "qwen_image_edit_flow_grpo.yaml", over)
    assert cfg.sampling.guidance_scale == 4.0 and cfg.sampling.noise_level == 1.0 and cfg.sampling.window.size == 0
    trainer = Trainer(cfg)
    assert isinstance(trainer.model, QwenImageEditModel) and trainer.model.source_resolution == SOURCE
    seen = record_reward_metadata(trainer)
    train_shrunk_recipe(trainer)
    assert seen and all(
        Path(m["image"]).is_file() and m["image"].startswith(str(train.parent.resolve())) for m in seen
    )
    # the saved LoRA, loaded by the stock pipeline, edits as the trained adapter does
    metas = read_jsonl(train)[:2]
    model = trainer.model
    ours = generate(model, [m["prompt"] for m in metas], [0, 1], 3, 4.0, metas=metas)
    stock = stock_qwen_image_edit(edit, model, metas, _noise(model, [0, 1]), 3, 4.0, lora=tmp_path / "run" / "lora")
    base = stock_qwen_image_edit(edit, model, metas, _noise(model, [0, 1]), 3, 4.0)
    assert (stock - base).abs().max() > 1e-4  # the LoRA changed the model
    torch.testing.assert_close(ours, stock, rtol=0, atol=1e-4)
