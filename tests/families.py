"""One tiny random pipeline factory per model family, for the conformance suite (tests/test_conformance.py).

A family is a :class:`TinyFamily`: how to build a tiny random pipeline of its real diffusers classes offline (seconds),
the settings to load it with, how the stock pipeline samples from given noise (the reference the adapter must equal),
the guidance scales to check, and the training settings that shrink a run onto it. Adding a family to flowrl is an
adapter file in ``flowrl/models/`` plus one entry in :data:`FAMILIES` (docs/models.md, "Adding a family"); the family's
own test module then holds only what is special to it.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

Stock = Callable[[Path, object, list[dict], int, float], torch.Tensor]


@dataclass(frozen=True)
class TinyFamily:
    """A model family as the conformance suite tests it.

    Attributes:
        id: the suite's parametrization id: the adapter's class name, or for a second entry of one adapter (other
            prompt records), that name and a suffix (``Flux2Model-references``).
        build: ``build(folder) -> folder``: saves a tiny random pipeline of the family's real classes there.
        load: keyword arguments of :func:`flowrl.models.load_model` (resolution, prompt length, frames).
        stock: ``stock(folder, model, metas, num_steps, guidance_scale)``: the stock pipeline's images ``(B, 3, H,
            W)`` (videos ``(B, F, 3, H, W)``) in [0, 1] for the prompt records ``metas`` from the noise of
            :func:`flowrl.evaluation.generate` with seeds ``0..B-1``.
        guidance: the guidance scales at which sampling must equal the stock pipeline.
        train: overrides of a shrunk training run (beside ``tests/conftest.py``'s ``tiny_overrides``).
        prompts: ``"image"`` (the tiny world's prompts), ``"video"`` (motion prompts), ``"edit"`` (records with a
            source image), ``"i2v"`` (motion prompts, each with a source image: a video family) or ``"references"``
            (FLUX.2's: records alternately with one reference ``image`` and two ``images`` of other sizes, 64-80 px).
        stock_kwargs: keyword arguments of the stock ``from_pretrained``.
        trains: the preset whose run is trained, resumed and exported as a LoRA (DiffusionNFT where the family takes it).
        refuses: presets the family refuses with one ConfigError (the DDPM families: DiffusionNFT, Flash re-spacing).
        negative_prompt: the family takes a CFG negative prompt (``model.negative_prompt``): sampling with one must
            equal the stock pipeline's ``negative_prompt``, given to ``stock`` as the keyword ``negative_prompt``.
        offline: the offline methods (``dpo_offline``, ``sft``) train the family on the shipped preference data set
            (its latents are the VAE's scaled ones and it takes no source images); the other families refuse them in
            one line.
    """

    id: str
    build: Callable[[Path], Path]
    load: dict
    stock: Stock
    guidance: tuple[float, ...]
    train: dict = field(default_factory=dict)
    prompts: str = "image"
    stock_kwargs: dict = field(default_factory=dict)
    trains: str = "diffusion_nft"
    refuses: tuple[str, ...] = ()
    negative_prompt: bool = False
    offline: bool = False

    @property
    def video(self) -> bool:
        return self.prompts in ("video", "i2v")

    @property
    def adapter(self) -> str:
        """The adapter's class name: :attr:`id` up to a ``-`` suffix."""
        return self.id.split("-")[0]


def brightness(images, prompts, metadata):
    """A reward that needs no download: mean pixel value per image or video -> ``(B,)`` in [0, 1]."""
    return images.float().flatten(1).mean(dim=1)


brightness.accepts_video = True


def source_brightness(images, prompts, metadata):
    """A reward that reads each record's source image (an edit or image-to-video record's ``image``, an absolute
    path): its mean pixel value -> ``(B,)`` in [0, 1]; a KeyError for a record without one."""
    from flowrl.image_folders import load_image

    return torch.stack([load_image(m["image"]).mean() for m in metadata])


source_brightness.accepts_video = True


def noise(model, n: int) -> torch.Tensor:
    """The noise :func:`flowrl.evaluation.generate` draws for seeds ``0..n-1``: ``(n, *model.latent_shape)``."""
    return torch.stack([torch.randn(model.latent_shape, generator=torch.Generator().manual_seed(s)) for s in range(n)])


def _builder(module: str, name: str) -> Callable[[Path], Path]:
    """The factory ``module.name(folder)``, imported when the family is first built (a family's test module is
    imported only by the tests that use it)."""

    def build(folder: Path) -> Path:
        return getattr(importlib.import_module(module), name)(folder)

    return build


def _stock_from_noise(module: str, name: str) -> Stock:
    """A family module's stock function ``module.name(folder, model, metas, noise, num_steps, guidance_scale,
    **kwargs)``, given :func:`noise`'s noise for seeds ``0..B-1`` (``kwargs``: the suite's ``negative_prompt``)."""

    def stock(folder, model, metas, num_steps, guidance_scale, **kwargs):
        stock_images = getattr(importlib.import_module(module), name)
        return stock_images(folder, model, metas, noise(model, len(metas)), num_steps, guidance_scale, **kwargs)

    return stock


def _pt(folder: Path, cls_name: str, **kwargs):
    import diffusers

    pipe = getattr(diffusers, cls_name).from_pretrained(folder, **kwargs)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _prompts(metas: list[dict]) -> list[str]:
    return [m["prompt"] for m in metas]


def _sd3_stock(folder, model, metas, num_steps, guidance_scale):
    pipe = _pt(folder, "StableDiffusion3Pipeline", **NO_T5)
    if pipe.vae.config.shift_factor is None:  # the random VAE has none; the stock decode adds it (flowrl: 0)
        pipe.vae.register_to_config(shift_factor=0.0)
    with torch.no_grad():
        return pipe(
            _prompts(metas),
            latents=noise(model, len(metas)),
            num_inference_steps=num_steps,
            guidance_scale=guidance_scale,
            height=model.resolution,
            width=model.resolution,
            max_sequence_length=model.max_sequence_length,
            output_type="pt",
        ).images


def _flux_stock(folder, model, metas, num_steps, guidance_scale):
    pipe = _pt(folder, "FluxPipeline")
    c, h, w = model.latent_shape
    cfg = {} if model.guidance_embeds else {"true_cfg_scale": guidance_scale, "negative_prompt": ""}
    with torch.no_grad():
        return pipe(
            _prompts(metas),
            latents=pipe._pack_latents(noise(model, len(metas)), len(metas), c, h, w),
            num_inference_steps=num_steps,
            guidance_scale=guidance_scale,
            height=model.resolution,
            width=model.resolution,
            max_sequence_length=model.max_sequence_length,
            output_type="pt",
            **cfg,
        ).images


def _kontext_stock(folder, model, metas, num_steps, guidance_scale):
    from PIL import Image

    pipe = _pt(folder, "FluxKontextPipeline")
    c, h, w = model.latent_shape
    side = model.resolution
    with torch.no_grad():
        return pipe(
            prompt=_prompts(metas),
            image=[Image.open(m["image"]).convert("RGB") for m in metas],
            latents=pipe._pack_latents(noise(model, len(metas)), len(metas), c, h, w),
            num_inference_steps=num_steps,
            guidance_scale=guidance_scale,
            height=side,
            width=side,
            max_area=side * side,
            _auto_resize=False,
            max_sequence_length=model.max_sequence_length,
            output_type="pt",
        ).images


def _ddim_stock(cls_name: str, **load):
    def stock(folder, model, metas, num_steps, guidance_scale):
        from diffusers import DDIMScheduler

        pipe = _pt(folder, cls_name, **load)
        pipe.scheduler = DDIMScheduler.from_config(pipe.scheduler.config)  # what flowrl samples: DDIM, eta 0
        with torch.no_grad():
            return pipe(
                _prompts(metas),
                latents=noise(model, len(metas)),
                num_inference_steps=num_steps,
                guidance_scale=guidance_scale,
                eta=0.0,
                height=model.resolution,
                width=model.resolution,
                output_type="pt",
            ).images

    return stock


def _qwen_stock(folder, model, metas, num_steps, guidance_scale):
    pipe = _pt(folder, "QwenImagePipeline")
    c, h, w = model.latent_shape
    with torch.no_grad():
        return pipe(
            _prompts(metas),
            negative_prompt="" if guidance_scale > 1 else None,
            true_cfg_scale=guidance_scale,
            latents=pipe._pack_latents(noise(model, len(metas)), len(metas), c, h, w),
            num_inference_steps=num_steps,
            height=model.resolution,
            width=model.resolution,
            max_sequence_length=model.max_sequence_length,
            output_type="pt",
        ).images


def _video_stock(cls_name: str):
    def stock(folder, model, metas, num_steps, guidance_scale, negative_prompt=None):
        pipe = _pt(folder, cls_name)
        with torch.no_grad():
            return pipe(
                _prompts(metas),
                negative_prompt=[negative_prompt] * len(metas) if negative_prompt else None,
                latents=noise(model, len(metas)),
                num_frames=model.num_frames,
                height=model.resolution,
                width=model.resolution,
                num_inference_steps=num_steps,
                guidance_scale=guidance_scale,
                max_sequence_length=model.max_sequence_length,
                output_type="pt",
            ).frames

    return stock


NO_T5 = {"text_encoder_3": None, "tokenizer_3": None}
"""The tiny SD3 pipelines have no T5 encoder (``null`` is not saved in ``model_index.json``)."""
DDPM_REFUSES = ("diffusion_nft", "mix_grpo_flash")
"""What the DDPM families (SD 1.x, SDXL) refuse: the flow-matching loss on clean samples and Flash re-spacing."""
IMAGE_TRAIN = {"rewards.geneval": "null", "rewards.jpeg_compressibility.weight": 1.0}
VIDEO_TRAIN = {"rewards.geneval": "null", "rewards.families:brightness.weight": 1.0}

FAMILIES: dict[str, TinyFamily] = {
    f.id: f
    for f in (
        TinyFamily(
            "SD3Model",
            _builder("conftest", "build_random_pipeline"),
            {"resolution": 32},
            _sd3_stock,
            (4.5, 1.0),
            IMAGE_TRAIN,
            stock_kwargs=NO_T5,
            offline=True,
        ),
        TinyFamily(
            "FluxModel",
            _builder("conftest", "build_random_flux_pipeline"),
            {"resolution": 32, "max_sequence_length": 8},
            _flux_stock,
            (3.5, 1.0),
            {**IMAGE_TRAIN, "sampling.guidance_scale": 3.5, "eval.guidance_scale": 3.5},
            offline=True,
        ),
        TinyFamily(
            "FluxKontextModel",
            _builder("test_flux_kontext", "build_random_kontext_pipeline"),
            {"resolution": 32, "max_sequence_length": 8},
            _kontext_stock,
            (2.5, 1.0),
            {**IMAGE_TRAIN, "sampling.guidance_scale": 2.5, "eval.guidance_scale": 2.5},
            prompts="edit",
        ),
        TinyFamily(
            "SD15Model",
            _builder("flowrl.tiny.sd15", "build_random_sd15_pipeline"),
            {"resolution": 32},
            _ddim_stock("StableDiffusionPipeline", safety_checker=None, feature_extractor=None),
            (4.5, 1.0),
            IMAGE_TRAIN,
            stock_kwargs={"safety_checker": None, "feature_extractor": None},
            trains="flow_grpo",
            refuses=DDPM_REFUSES,
        ),
        TinyFamily(
            "SDXLModel",
            _builder("test_sdxl", "build_random_sdxl_pipeline"),
            {"resolution": 32},
            _ddim_stock("StableDiffusionXLPipeline", add_watermarker=False),
            (5.0, 1.0),
            IMAGE_TRAIN,
            stock_kwargs={"add_watermarker": False},
            trains="flow_grpo",
            refuses=DDPM_REFUSES,
        ),
        TinyFamily(
            "QwenImageModel",
            _builder("test_qwen_image", "build_random_qwen_image_pipeline"),
            {"resolution": 32},
            _qwen_stock,
            (4.0, 1.0),
            IMAGE_TRAIN,
        ),
        TinyFamily(
            "QwenImageEditModel",
            _builder("test_qwen_image_edit", "build_random_qwen_image_edit_pipeline"),
            {"resolution": 32, "source_resolution": 64},
            _stock_from_noise("test_qwen_image_edit", "stock_qwen_image_edit"),
            (4.0, 1.0),
            {**IMAGE_TRAIN, "model.options.source_resolution": 64},
            prompts="edit",
        ),
        TinyFamily(
            "ZImageModel",
            _builder("test_z_image", "build_random_z_image_pipeline"),
            {"resolution": 32, "max_sequence_length": 64},
            _stock_from_noise("test_z_image", "stock_z_image"),
            (4.0, 1.0),
            IMAGE_TRAIN,
            offline=True,
        ),
        TinyFamily(
            "SanaModel",
            _builder("test_sana", "build_random_sana_pipeline"),
            {"resolution": 32, "max_sequence_length": 16},
            _stock_from_noise("test_sana", "stock_sana"),
            (4.5, 1.0),
            IMAGE_TRAIN,
        ),
        TinyFamily(
            "SanaSprintModel",
            _builder("test_sana", "build_random_sana_sprint_pipeline"),
            {"resolution": 32, "max_sequence_length": 16},
            _stock_from_noise("test_sana", "stock_sana_sprint"),
            (4.5, 1.0),
            {**IMAGE_TRAIN, "sampling.guidance_scale": 4.5, "eval.guidance_scale": 4.5},
        ),
        TinyFamily(
            "Flux2KleinModel",
            _builder("test_flux2", "build_random_flux2_klein_pipeline"),
            {"resolution": 32, "max_sequence_length": 64},
            _stock_from_noise("test_flux2", "stock_flux2_klein"),
            (4.0, 1.0),
            IMAGE_TRAIN,
        ),
        TinyFamily(
            "Flux2Model",
            _builder("test_flux2", "build_random_flux2_pipeline"),
            {"resolution": 32, "max_sequence_length": 64},
            _stock_from_noise("test_flux2", "stock_flux2"),
            (4.0, 1.0),
            IMAGE_TRAIN,
        ),
        TinyFamily(
            "Flux2KleinModel-references",
            _builder("test_flux2", "build_random_flux2_klein_pipeline"),
            {"resolution": 32, "max_sequence_length": 64},
            _stock_from_noise("test_flux2", "stock_flux2_klein"),
            (4.0,),  # CFG: the negative sees the references too
            IMAGE_TRAIN,
            prompts="references",
        ),
        TinyFamily(
            "Flux2Model-references",
            _builder("test_flux2", "build_random_flux2_pipeline"),
            {"resolution": 32, "max_sequence_length": 64},
            _stock_from_noise("test_flux2", "stock_flux2"),
            (4.0,),
            IMAGE_TRAIN,
            prompts="references",
        ),
        TinyFamily(
            "WanModel",
            _builder("test_wan", "build_random_wan_pipeline"),
            {"resolution": 16, "num_frames": 5, "max_sequence_length": 16},
            _video_stock("WanPipeline"),
            (4.0, 1.0),
            {**VIDEO_TRAIN, "sampling.guidance_scale": 4.0, "eval.guidance_scale": 4.0},
            prompts="video",
            negative_prompt=True,
        ),
        TinyFamily(
            "WanImageToVideoModel",
            _builder("test_wan_i2v", "build_random_wan_i2v_pipeline"),
            {"resolution": 16, "num_frames": 5},
            _stock_from_noise("test_wan_i2v", "stock_wan_i2v"),
            (5.0, 1.0),
            {**VIDEO_TRAIN, "sampling.guidance_scale": 5.0, "eval.guidance_scale": 5.0},
            prompts="i2v",
            negative_prompt=True,
        ),
        TinyFamily(
            "HunyuanVideoModel",
            _builder("test_hunyuan_video", "build_random_hunyuan_pipeline"),
            {"resolution": 32, "num_frames": 5, "max_sequence_length": 16},
            _video_stock("HunyuanVideoPipeline"),
            (6.0, 1.0),
            {**VIDEO_TRAIN, "sampling.guidance_scale": 6.0, "eval.guidance_scale": 6.0},
            prompts="video",
        ),
        TinyFamily(
            "LTXVideoModel",
            _builder("test_ltx", "build_random_ltx_pipeline"),
            {"resolution": 32, "num_frames": 9, "max_sequence_length": 16},
            _stock_from_noise("test_ltx", "stock_ltx"),
            (4.0, 1.0),
            {**VIDEO_TRAIN, "sampling.guidance_scale": 4.0, "eval.guidance_scale": 4.0},
            prompts="video",
            negative_prompt=True,
        ),
        TinyFamily(
            "LTX2Model",
            _builder("test_ltx2", "build_random_ltx2_pipeline"),
            {"resolution": 32, "num_frames": 9, "max_sequence_length": 16},
            _stock_from_noise("test_ltx2", "stock_ltx2"),
            (4.0, 1.0),
            {**VIDEO_TRAIN, "sampling.guidance_scale": 4.0, "eval.guidance_scale": 4.0},
            prompts="video",
            negative_prompt=True,
        ),
        TinyFamily(
            "HunyuanVideo15Model",
            _builder("test_hunyuan_video15", "build_random_hunyuan_video15_pipeline"),
            {"resolution": 32, "num_frames": 5, "max_sequence_length": 16},
            _stock_from_noise("test_hunyuan_video15", "stock_hunyuan_video15"),
            (6.0, 1.0),
            {**VIDEO_TRAIN, "sampling.guidance_scale": 6.0, "eval.guidance_scale": 6.0},
            prompts="video",
            negative_prompt=True,
        ),
        TinyFamily(
            "HunyuanVideo15ImageToVideoModel",
            _builder("test_hunyuan_video15_i2v", "build_random_hunyuan_video15_i2v_pipeline"),
            {"resolution": 16, "num_frames": 5, "max_sequence_length": 16},
            _stock_from_noise("test_hunyuan_video15_i2v", "stock_hunyuan_video15_i2v"),
            (6.0, 1.0),
            {**VIDEO_TRAIN, "sampling.guidance_scale": 6.0, "eval.guidance_scale": 6.0},
            prompts="i2v",
            negative_prompt=True,
        ),
    )
}
"""Every family the conformance suite runs, by adapter class name."""


def prompt_files(kind: str, folder: Path) -> tuple[Path, Path]:
    """Train and test prompt files of ``kind`` (:attr:`TinyFamily.prompts`) written into ``folder``."""
    from flowrl.data import write_jsonl
    from flowrl.tiny.prompts import split

    folder.mkdir(parents=True, exist_ok=True)
    train, test = split(0)
    if kind in ("video", "i2v"):
        prompts = ["a red circle moving left", "two blue squares moving up", "a green star moving right"]
        records = [{"prompt": p, "tag": "motion"} for p in prompts]
        if kind == "i2v":  # each with a source image, its first frame (a path relative to the file)
            from PIL import Image

            (folder / "sources").mkdir(exist_ok=True)
            rng = np.random.default_rng(0)
            for i, r in enumerate(records):
                r["image"] = f"sources/{i}.png"
                Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(folder / r["image"])
        lines = [json.dumps(r) for r in records]
        (folder / "train.jsonl").write_text("\n".join(lines) + "\n")
        (folder / "test.jsonl").write_text("\n".join(lines[:2]) + "\n")
    elif kind == "references":  # FLUX.2: sources of >= 64 px (its pipelines refuse smaller), one or two per record
        from PIL import Image

        (folder / "sources").mkdir(exist_ok=True)
        rng = np.random.default_rng(0)
        for name, metas in (("train", train), ("test", test)):
            records = []
            for i, m in enumerate(metas[:12]):
                sizes = [(64, 64)] if i % 2 == 0 else [(80, 64), (64, 72)]  # (width, height); 72: cropped to 64
                images = [f"sources/{name}{i}-{k}.png" for k in range(len(sizes))]
                for image, (w, h) in zip(images, sizes):
                    Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(folder / image)
                records.append({**m, "image": images[0]} if len(images) == 1 else {**m, "images": images})
            write_jsonl(records, folder / f"{name}.jsonl")
    elif kind == "edit":
        from PIL import Image

        (folder / "sources").mkdir(exist_ok=True)
        rng = np.random.default_rng(0)
        for name, metas in (("train", train), ("test", test)):
            records = []
            for i, m in enumerate(metas[:12]):
                image = f"sources/{name}{i}.png"
                Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(folder / image)
                records.append({**m, "image": image})
            write_jsonl(records, folder / f"{name}.jsonl")
    else:
        write_jsonl(train, folder / "train.jsonl")
        write_jsonl(test, folder / "test.jsonl")
    return folder / "train.jsonl", folder / "test.jsonl"
