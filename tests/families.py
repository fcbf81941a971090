"""One tiny random pipeline factory per model family, for the conformance suite (tests/test_conformance.py).

A family is a :class:`TinyFamily`: how to build a tiny random pipeline of its real diffusers classes offline (seconds),
the settings to load it with, how the stock pipeline samples from given noise (the reference the adapter must equal),
the guidance scales to check, and the training settings that shrink a run onto it. The builders and stock references
live in ``tests/tiny_pipelines/<family>.py``. Adding a family to flowrl is an adapter file in ``flowrl/models/``, its
tiny pipeline module and one entry in :data:`FAMILIES` (docs/models.md, "Adding a family"); the family's own test
module then holds only what is special to it.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from tiny_pipelines.common import noise
from tiny_pipelines.flux import build_random_flux_pipeline, stock_flux
from tiny_pipelines.flux2 import (
    build_random_flux2_klein_pipeline,
    build_random_flux2_pipeline,
    stock_flux2,
    stock_flux2_klein,
)
from tiny_pipelines.flux_kontext import build_random_kontext_pipeline, stock_flux_kontext
from tiny_pipelines.hunyuan_video import build_random_hunyuan_pipeline, stock_hunyuan_video
from tiny_pipelines.hunyuan_video15 import build_random_hunyuan_video15_pipeline, stock_hunyuan_video15
from tiny_pipelines.hunyuan_video15_i2v import build_random_hunyuan_video15_i2v_pipeline, stock_hunyuan_video15_i2v
from tiny_pipelines.ltx import build_random_ltx_pipeline, stock_ltx
from tiny_pipelines.ltx2 import build_random_ltx2_pipeline, stock_ltx2
from tiny_pipelines.qwen_image import build_random_qwen_image_pipeline, stock_qwen_image
from tiny_pipelines.qwen_image_edit import build_random_qwen_image_edit_pipeline, stock_qwen_image_edit
from tiny_pipelines.sana import (
    build_random_sana_pipeline,
    build_random_sana_sprint_pipeline,
    stock_sana,
    stock_sana_sprint,
)
from tiny_pipelines.sd3 import NO_T5, build_random_sd3_pipeline, stock_sd3
from tiny_pipelines.sd15 import SD15_STOCK, build_random_sd15_pipeline, stock_sd15
from tiny_pipelines.sdxl import SDXL_STOCK, build_random_sdxl_pipeline, stock_sdxl
from tiny_pipelines.wan import build_random_wan_pipeline, stock_wan
from tiny_pipelines.wan_i2v import build_random_wan_i2v_pipeline, stock_wan_i2v
from tiny_pipelines.z_image import build_random_z_image_pipeline, stock_z_image

Stock = Callable[..., torch.Tensor]
"""``stock(folder, model, metas, noise, num_steps, guidance_scale, **kwargs)``: a ``tiny_pipelines`` stock function."""
IMAGE_TRAIN = {"rewards.geneval": "null", "rewards.jpeg_compressibility.weight": 1.0}
"""The training overrides of an image family: JPEG compressibility, which needs no download, for the GenEval reward."""
VIDEO_TRAIN = {"rewards.geneval": "null", "rewards.families:brightness.weight": 1.0}
"""The training overrides of a video family: :func:`brightness` for the GenEval reward."""
HUNYUAN_VIDEO15_RECIPE = {
    "model.dtype": "float32",
    "model.lora_rank": 2,
    "rewards.frames": "null",
    "rewards.families:brightness.weight": 1.0,
    "sampling.window.size": 1,
    "sampling.batch_size": 4,
    "train.minibatch_size": 2,
    "train.learning_rate": 1e-3,
    "eval.images_per_tag": 1,
}
"""The HunyuanVideo 1.5 recipes (text-to-video and image-to-video) shrunk for two iterations on the tiny pipelines:
PickScore over the frames swapped for :func:`brightness`, which needs no download; their 8-step SDE window of 16 steps
one of 3; the LoRA of rank 2 at a learning rate that moves it."""
DDPM_REFUSES = ("diffusion_nft", "mix_grpo_flash")
"""What the DDPM families (SD 1.x, SDXL) refuse: the flow-matching loss on clean samples and Flash re-spacing."""


@dataclass(frozen=True)
class TinyFamily:
    """A model family as the conformance suite tests it.

    Attributes:
        id: the suite's parametrization id: the adapter's class name, or for a second entry of one adapter (other
            prompt records), that name and a suffix (``Flux2Model-references``).
        build: ``build(folder) -> folder``: saves a tiny random pipeline of the family's real classes there.
        stock: ``stock(folder, model, metas, noise, num_steps, guidance_scale, **kwargs)``: the stock pipeline's images
            ``(B, 3, H, W)`` (videos ``(B, F, 3, H, W)``) in [0, 1] for the prompt records ``metas`` from the noise
            ``noise (B, *model.latent_shape)`` (:meth:`stock_images` gives it the noise of
            :func:`flowrl.evaluation.generate` with seeds ``0..B-1``).
        load: keyword arguments of :func:`flowrl.models.load_model` (resolution, prompt length, frames).
        guidance: the guidance scales at which sampling must equal the stock pipeline; the first is the one trained
            at where :attr:`guided`.
        guided: training and evaluation sample at ``guidance[0]`` (the video families always do).
        extra: overrides of a shrunk training run beyond :attr:`train`'s.
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
    stock: Stock
    load: dict = field(default_factory=lambda: {"resolution": 32})
    guidance: tuple[float, ...] = (4.0, 1.0)
    guided: bool = False
    extra: dict = field(default_factory=dict)
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

    @property
    def model_settings(self) -> dict:
        """:attr:`load` as ``model.*`` config keys (the prompt length ``null`` where the family takes none)."""
        frames = {"model.num_frames": self.load["num_frames"]} if "num_frames" in self.load else {}
        length = self.load.get("max_sequence_length", "null")
        return {"model.resolution": self.load["resolution"], "model.max_sequence_length": length, **frames}

    @property
    def run_settings(self) -> dict:
        """The config overrides that shrink a run onto the family's tiny pipeline: :attr:`model_settings` and
        :attr:`train`."""
        return {**self.model_settings, **self.train}

    @property
    def train(self) -> dict:
        """Overrides of a shrunk training run (beside ``tests/conftest.py``'s ``tiny_overrides``): the rewards of
        :data:`VIDEO_TRAIN` or :data:`IMAGE_TRAIN`, the trained guidance scale where :attr:`guided` (or a video
        family), and :attr:`extra`."""
        scale = self.guidance[0]
        guided = {"sampling.guidance_scale": scale, "eval.guidance_scale": scale} if self.guided or self.video else {}
        return {**(VIDEO_TRAIN if self.video else IMAGE_TRAIN), **guided, **self.extra}

    def stock_images(self, folder: Path, model, metas: list[dict], num_steps: int, guidance_scale: float, **kwargs):
        """:attr:`stock` from the noise :func:`flowrl.evaluation.generate` draws for seeds ``0..len(metas)-1``
        (``kwargs``: the suite's ``negative_prompt``)."""
        return self.stock(folder, model, metas, noise(model, len(metas)), num_steps, guidance_scale, **kwargs)


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


def _references(spec: TinyFamily) -> TinyFamily:
    """A FLUX.2 family's second entry: records with reference images, checked at its CFG scale only (the negative
    sees the references too)."""
    return dataclasses.replace(spec, id=f"{spec.id}-references", guidance=spec.guidance[:1], prompts="references")


def _ddpm(id: str, build, stock: Stock, scale: float, stock_kwargs: dict) -> TinyFamily:
    """A DDPM family (a UNet seen as a flow model): GRPO trains it on DDPM's kernels, and it refuses the flow-matching
    loss on clean samples and Flash re-spacing (:data:`DDPM_REFUSES`); checked at CFG ``scale`` and without."""
    ddpm = dict(trains="flow_grpo", refuses=DDPM_REFUSES)
    return TinyFamily(id, build, stock, guidance=(scale, 1.0), stock_kwargs=stock_kwargs, **ddpm)


def _families() -> list[TinyFamily]:
    """The entries of :data:`FAMILIES`, images first (guidance (4, 1) and 32 px unless an entry says otherwise)."""
    flux = {"resolution": 32, "max_sequence_length": 8}
    qwen3 = {"resolution": 32, "max_sequence_length": 64}  # Z-Image and FLUX.2: the chat template fits
    sana = {"resolution": 32, "max_sequence_length": 16}
    klein = TinyFamily("Flux2KleinModel", build_random_flux2_klein_pipeline, stock_flux2_klein, qwen3)
    dev = TinyFamily("Flux2Model", build_random_flux2_pipeline, stock_flux2, qwen3)
    images = [
        TinyFamily(
            "SD3Model", build_random_sd3_pipeline, stock_sd3, guidance=(4.5, 1.0), stock_kwargs=NO_T5, offline=True
        ),
        TinyFamily(
            "FluxModel", build_random_flux_pipeline, stock_flux, flux, guidance=(3.5, 1.0), guided=True, offline=True
        ),
        TinyFamily(
            "FluxKontextModel",
            build_random_kontext_pipeline,
            stock_flux_kontext,
            flux,
            guidance=(2.5, 1.0),
            guided=True,
            prompts="edit",
        ),
        _ddpm("SD15Model", build_random_sd15_pipeline, stock_sd15, 4.5, SD15_STOCK),
        _ddpm("SDXLModel", build_random_sdxl_pipeline, stock_sdxl, 5.0, SDXL_STOCK),
        TinyFamily("QwenImageModel", build_random_qwen_image_pipeline, stock_qwen_image),
        TinyFamily(
            "QwenImageEditModel",
            build_random_qwen_image_edit_pipeline,
            stock_qwen_image_edit,
            {"resolution": 32, "source_resolution": 64},
            extra={"model.options.source_resolution": 64},
            prompts="edit",
        ),
        TinyFamily("ZImageModel", build_random_z_image_pipeline, stock_z_image, qwen3, offline=True),
        TinyFamily("SanaModel", build_random_sana_pipeline, stock_sana, sana, guidance=(4.5, 1.0)),
        TinyFamily(
            "SanaSprintModel",
            build_random_sana_sprint_pipeline,
            stock_sana_sprint,
            sana,
            guidance=(4.5, 1.0),
            guided=True,
        ),
        klein,
        dev,
        _references(klein),
        _references(dev),
    ]
    video = {"resolution": 32, "num_frames": 5, "max_sequence_length": 16}
    ltx = {"resolution": 32, "num_frames": 9, "max_sequence_length": 16}  # LTX's frames: 8k + 1
    small = {"resolution": 16, "num_frames": 5, "max_sequence_length": 16}  # the image-to-video pipelines' 16 px
    negative = dict(negative_prompt=True)  # a video family takes a negative prompt, bar HunyuanVideo
    videos = [
        TinyFamily("WanModel", build_random_wan_pipeline, stock_wan, small, prompts="video", **negative),
        TinyFamily(
            "WanImageToVideoModel",
            build_random_wan_i2v_pipeline,
            stock_wan_i2v,
            {"resolution": 16, "num_frames": 5},
            guidance=(5.0, 1.0),
            prompts="i2v",
            **negative,
        ),
        TinyFamily(
            "HunyuanVideoModel",
            build_random_hunyuan_pipeline,
            stock_hunyuan_video,
            video,
            guidance=(6.0, 1.0),
            prompts="video",
        ),
        TinyFamily("LTXVideoModel", build_random_ltx_pipeline, stock_ltx, ltx, prompts="video", **negative),
        TinyFamily("LTX2Model", build_random_ltx2_pipeline, stock_ltx2, ltx, prompts="video", **negative),
        TinyFamily(
            "HunyuanVideo15Model",
            build_random_hunyuan_video15_pipeline,
            stock_hunyuan_video15,
            video,
            guidance=(6.0, 1.0),
            prompts="video",
            **negative,
        ),
        TinyFamily(
            "HunyuanVideo15ImageToVideoModel",
            build_random_hunyuan_video15_i2v_pipeline,
            stock_hunyuan_video15_i2v,
            small,
            guidance=(6.0, 1.0),
            prompts="i2v",
            **negative,
        ),
    ]
    return images + videos


FAMILIES: dict[str, TinyFamily] = {f.id: f for f in _families()}
"""Every family the conformance suite runs, by adapter class name."""


def source_prompt_files(folder: Path, sizes: Callable[[int], list[tuple[int, int]]]) -> tuple[Path, Path]:
    """Train and test prompt files in ``folder`` of the tiny world's prompts (12 each), record ``i`` with random RGB
    source images of ``sizes(i)`` (``(width, height)`` px each, under ``folder/sources``, paths relative to the file):
    one as its ``image`` (``sources/<split><i>.png``), several as its ``images`` (``sources/<split><i>-<k>.png``)."""
    from PIL import Image

    from flowrl.data import write_jsonl
    from flowrl.tiny.prompts import split

    (folder / "sources").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for name, metas in zip(("train", "test"), split(0)):
        records = []
        for i, m in enumerate(metas[:12]):
            shapes = sizes(i)
            images = (
                [f"sources/{name}{i}.png"]
                if len(shapes) == 1
                else [f"sources/{name}{i}-{k}.png" for k in range(len(shapes))]
            )
            for image, (w, h) in zip(images, shapes):
                Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(folder / image)
            records.append({**m, "image": images[0]} if len(images) == 1 else {**m, "images": images})
        write_jsonl(records, folder / f"{name}.jsonl")
    return folder / "train.jsonl", folder / "test.jsonl"


def prompt_files(kind: str, folder: Path) -> tuple[Path, Path]:
    """Train and test prompt files of ``kind`` (:attr:`TinyFamily.prompts`) written into ``folder``."""
    from flowrl.data import write_jsonl
    from flowrl.tiny.prompts import split

    folder.mkdir(parents=True, exist_ok=True)
    if kind == "edit":
        return source_prompt_files(folder, lambda i: [(32, 32)])
    if kind == "references":  # FLUX.2: sources of >= 64 px (its pipelines refuse smaller), one or two per record
        return source_prompt_files(folder, lambda i: [(64, 64)] if i % 2 == 0 else [(80, 64), (64, 72)])  # 72: cropped
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
    else:
        train, test = split(0)
        write_jsonl(train, folder / "train.jsonl")
        write_jsonl(test, folder / "test.jsonl")
    return folder / "train.jsonl", folder / "test.jsonl"
