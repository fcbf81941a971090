"""The sweep of docs/reliability.md ("Tested cases"): at every place a command or a preset reads a file, what a careless
user gives it there: a missing, empty, truncated, mis-encoded (latin-1), wrong-format (YAML for JSON, a prompt file
for a config, text for an image, JSON for a CSV) and HTML-instead-of-JSON file. Each case ends with exit status 2 and
one line ``flowrl COMMAND: error: ...`` naming the file, before any model loads (the model loaders are replaced by a
failure here; ``sample --lora`` loads the tiny model first, as it must)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from conftest import REPO

KINDS = ("missing", "empty", "truncated", "latin1", "wrong_format", "html")
HTML = b"<!DOCTYPE html>\n<html><head><title>404 Not Found</title></head><body>Not Found</body></html>\n"
PNG_HEAD = b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\x00\x00\x00\x10"  # a PNG's first bytes where text is read


class Place:
    """A file a command reads: its `good` text (with a non-ASCII letter, so that its latin-1 bytes are not UTF-8),
    the `cut` of it a torn download leaves, what a user gives instead (`wrong`), and `argv(tmp, path)`, the command
    that reads it at `path`. `kinds`: the damages that apply (a binary file has no encoding)."""

    def __init__(self, file: str, good: bytes | str, cut: int, wrong: bytes | str, argv, kinds=KINDS, setup=None):
        self.file, self.cut, self.argv, self.kinds, self.setup = file, cut, argv, kinds, setup
        self.good = good.encode() if isinstance(good, str) else good
        self.latin1 = good.encode("latin-1") if isinstance(good, str) else None
        self.wrong = wrong.encode() if isinstance(wrong, str) else wrong

    def content(self, kind: str) -> bytes | None:
        """The bytes of the damaged file of `kind` (None: no file)."""
        table = {"missing": None, "empty": b"", "truncated": self.good[: self.cut], "latin1": self.latin1}
        return table.get(kind, self.wrong if kind == "wrong_format" else HTML)


def _train(preset: str, *overrides: str):
    """``flowrl train configs/PRESET.yaml`` with `overrides` (``{path}`` the damaged file) into ``TMP/run``."""

    def argv(tmp: Path, path: Path) -> list:
        given = [o.format(path=path, tmp=tmp) for o in overrides]
        return [
            "train",
            REPO / "configs" / f"{preset}.yaml",
            f"run.output_dir={tmp / 'run'}",
            "run.device=cpu",
            *given,
        ]

    return argv


CONFIG = "# my run (café)\nmodel: {path: assets/tiny-sd3}\nrewards: {jpeg_compressibility: {weight: 1.0}}\n"
CONFIG_WRONG = '{"prompt": "a cat", "tag": "animal"}\n{"prompt": "a dog", "tag": "animal"}\n'  # a prompt file
JSONL = '{"prompt": "a café on a corner", "tag": "place"}\n{"prompt": "a dog", "tag": "animal"}\n'
JSONL_WRONG = "- prompt: a café on a corner\n  tag: place\n"  # YAML where JSON lines belong
GENEVAL = '{"prompt": "a photo of a café", "tag": "single_object", "include": [{"class": "cup", "count": 1}]}\n'
PAIRS = '{"prompt": "a café", "image_w": "a.png", "image_l": "b.png"}\n'
MODEL_INDEX = '{"_class_name": "StableDiffusion3Pipeline", "_note": "café", "transformer": ["diffusers", "X"]}'
_HEADER = b'{"a.lora_A.weight":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}'
LORA = len(_HEADER).to_bytes(8, "little") + _HEADER + bytes(16)  # a safetensors file of one tensor
FACTORY = 'def factory(device=\'cpu\'):\n    """My café\'s scores."""\n    return lambda images, prompts, metadata: [0.0] * len(images)\n'


def _tiny_png() -> bytes:
    """A 4x4 RGB PNG's bytes."""
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (4, 4), (200, 30, 30)).save(buffer, format="PNG")
    return buffer.getvalue()


def _image_beside(tmp: Path) -> Path:
    """A loose image to score, written into `tmp`."""
    (tmp / "img.png").write_bytes(_tiny_png())
    return tmp / "img.png"


def _geneval_folder(tmp: Path, path: Path) -> None:
    """A GenEval-layout folder ``gen/00000/`` with one sample beside the ``metadata.jsonl`` at `path`."""
    (path.parent / "samples").mkdir(parents=True, exist_ok=True)
    (path.parent / "samples" / "0000.png").write_bytes(_tiny_png())


def _model_folder(source: str, damaged: str):
    """A setup: a copy of ``assets/SOURCE`` as symbolic links, but for the file `damaged` (relative), written there."""

    def setup(tmp: Path, path: Path) -> None:
        for item in (REPO / "assets" / source).rglob("*"):
            rel = item.relative_to(REPO / "assets" / source)
            if item.is_file() and rel != Path(damaged):
                (path.parents[len(Path(damaged).parts) - 1] / rel).parent.mkdir(parents=True, exist_ok=True)
                os.symlink(item, path.parents[len(Path(damaged).parts) - 1] / rel)

    return setup


def _model_options(command: str):
    """``flowrl COMMAND`` with ``--model`` the folder of the damaged ``model_index.json``."""
    extra = {
        "eval": [
            "--reward",
            "jpeg_compressibility",
            "--prompts",
            REPO / "assets/prompts/test.jsonl",
            "--out",
            "r.json",
        ],
        "sample": ["--prompt", "a cat", "--out", "grid.png"],
        "generate": ["--prompts", REPO / "assets/prompts/test.jsonl", "--out", "images"],
    }[command]

    def argv(tmp: Path, path: Path) -> list:
        return [
            command,
            "--model",
            path.parent,
            *[tmp / a if a in ("r.json", "grid.png", "images") else a for a in extra],
        ]

    return argv


PLACES = {
    # ------------------------------------------------------------------- configs (every command that takes one)
    "train CONFIG": Place("c.yaml", CONFIG, -6, CONFIG_WRONG, lambda tmp, p: ["train", p]),
    "config CONFIG": Place("c.yaml", CONFIG, -6, CONFIG_WRONG, lambda tmp, p: ["config", p]),
    "memory CONFIG": Place("c.yaml", CONFIG, -6, CONFIG_WRONG, lambda tmp, p: ["memory", p, "--processes", "1"]),
    "config base:": Place(
        "b.yaml",
        CONFIG,
        -6,
        CONFIG_WRONG,
        lambda tmp, p: ["config", tmp / "c.yaml"],
        setup=lambda tmp, p: (tmp / "c.yaml").write_text("base: b.yaml\nrun: {iterations: 2}\n"),
    ),
    "train run.resume config.yaml": Place(
        "run/config.yaml",
        CONFIG,
        -6,
        CONFIG_WRONG,
        _train("flow_grpo", "run.resume=true"),
        kinds=KINDS[1:],  # without one, the preset is the config
        setup=lambda tmp, p: p.parent.mkdir(parents=True, exist_ok=True),
    ),
    "bench --preset-overrides": Place(
        "o.yaml",
        "all: [sampling.num_steps=4]  # café\n",
        -12,
        '["sampling.num_steps=4"]',
        lambda tmp, p: ["bench", "--presets", "flow_grpo", "--out", tmp / "b.json", "--preset-overrides", p],
    ),
    # ------------------------------------------------------------------- prompt files and data sets, by preset kind
    **{
        f"train {preset} {key}": Place("p.jsonl", JSONL, 15, JSONL_WRONG, _train(preset, f"{key}={{path}}"))
        for preset in ("flow_grpo", "diffusion_nft", "refl", "dpo_offline")
        for key in ("train_prompts", "eval.prompts")
    },
    "train dpo_offline train.offline.data": Place(
        "pairs.jsonl",
        PAIRS,
        15,
        "- prompt: a café\n  image_w: a.png\n",
        _train("dpo_offline", "train.offline.data={path}"),
    ),
    "train sft train.offline.data": Place(
        "images.jsonl", PAIRS, 15, "- prompt: a café\n  image: a.png\n", _train("sft", "train.offline.data={path}")
    ),
    "overopt eval.prompts": Place(
        "p.jsonl",
        JSONL,
        15,
        JSONL_WRONG,
        lambda tmp, p: [
            "overopt",
            "--presets",
            "flow_grpo",
            "--out",
            tmp / "o.json",
            f"eval.prompts={p}",
            "run.device=cpu",
        ],
    ),
    "eval --prompts (GenEval)": Place(
        "p.jsonl", GENEVAL, 15, JSONL_WRONG, lambda tmp, p: ["eval", "--prompts", p, "--out", tmp / "r.json"]
    ),
    "eval --reward --prompts (csv)": Place(
        "p.csv",
        "prompt,tag\na café,place\n",
        4,
        JSONL_WRONG,
        lambda tmp, p: ["eval", "--reward", "jpeg_compressibility", "--prompts", p, "--out", tmp / "r.json"],
    ),
    "generate --prompts (json)": Place(
        "p.json",
        '["a café", "a dog"]',
        6,
        "- a café\n- a dog\n",
        lambda tmp, p: ["generate", "--prompts", p, "--out", tmp / "images"],
    ),
    "score --prompts (jsonl)": Place(
        "p.jsonl",
        JSONL.splitlines()[0] + "\n",
        15,
        JSONL_WRONG,
        lambda tmp, p: ["score", _image_beside(tmp), "--reward", "jpeg_compressibility", "--prompts", p],
    ),
    # ------------------------------------------------------------------- images and folders of images to score
    "score IMAGE": Place(
        "i.png",
        _tiny_png(),
        40,
        JSONL,
        lambda tmp, p: ["score", p, "--reward", "jpeg_compressibility"],
        kinds=tuple(k for k in KINDS if k != "latin1"),
    ),
    "score GenEval folder metadata.jsonl": Place(
        "gen/00000/metadata.jsonl",
        GENEVAL,
        15,
        JSONL_WRONG,
        lambda tmp, p: ["score", tmp / "gen", "--reward", "jpeg_compressibility"],
        setup=_geneval_folder,
    ),
    # ------------------------------------------------------------------- model folders, LoRAs, reward models
    **{
        f"{command} --model model_index.json": Place(
            "m/model_index.json", MODEL_INDEX, 20, "_class_name: StableDiffusion3Pipeline\n", _model_options(command)
        )
        for command in ("eval", "sample", "generate")
    },
    "train model.path model_index.json": Place(
        "m/model_index.json",
        MODEL_INDEX,
        20,
        "_class_name: StableDiffusion3Pipeline\n",
        _train("flow_grpo", "model.path={path.parent}"),
    ),
    "memory model.path transformer/config.json": Place(
        "m/transformer/config.json",
        '{"_class_name": "SD3Transformer2DModel", "_note": "café", "num_layers": 2}',
        20,
        "_class_name: SD3Transformer2DModel\n",
        lambda tmp, p: [
            "memory",
            REPO / "configs/flow_grpo.yaml",
            f"model.path={p.parent.parent}",
            "--processes",
            "1",
        ],
        setup=_model_folder("tiny-sd3", "transformer/config.json"),
    ),
    "sample --model transformer/config.json": Place(
        "m/transformer/config.json",
        '{"_class_name": "SD3Transformer2DModel", "_note": "café", "num_layers": 2}',
        20,
        "_class_name: SD3Transformer2DModel\n",
        lambda tmp, p: ["sample", "--model", p.parent.parent, "--prompt", "a cat", "--out", tmp / "g.png"],
        setup=_model_folder("tiny-sd3", "transformer/config.json"),
    ),
    "sample --lora": Place(
        "lora/pytorch_lora_weights.safetensors",
        LORA,
        40,
        _tiny_png(),
        lambda tmp, p: ["sample", "--lora", p.parent, "--prompt", "a cat", "-n", "1", "--out", tmp / "g.png"],
        kinds=tuple(k for k in KINDS if k != "latin1"),
        setup=lambda tmp, p: p.parent.mkdir(parents=True, exist_ok=True),
    ),
    "merge LORA": Place(
        "lora/pytorch_lora_weights.safetensors",
        LORA,
        40,
        _tiny_png(),
        lambda tmp, p: ["merge", p.parent, p.parent, "--out", tmp / "merged"],
        kinds=tuple(k for k in KINDS if k != "latin1"),
        setup=lambda tmp, p: p.parent.mkdir(parents=True, exist_ok=True),
    ),
    "score --option model_path config.json": Place(
        "clip/config.json",
        '{"_note": "café", "model_type": "clip"}',
        10,
        "model_type: clip\n",
        lambda tmp, p: ["score", _image_beside(tmp), "--reward", "clipscore", "--option", f"model_path={p.parent}"],
        setup=_model_folder("tiny-clip", "config.json"),
    ),
    "train refl rewards.clipscore model_path config.json": Place(
        "clip/config.json",
        '{"_note": "café", "model_type": "clip"}',
        10,
        "model_type: clip\n",
        _train("refl", "rewards.clipscore.options.model_path={path.parent}"),
        setup=_model_folder("tiny-clip", "config.json"),
    ),
    # ------------------------------------------------------------------- code files
    "serve-reward FILE.py:factory": Place(
        "mine.py",
        FACTORY,
        20,
        PNG_HEAD,
        lambda tmp, p: ["serve-reward", f"{p}:factory", "--port", "0"],
    ),
}
CASES = [pytest.param(place, kind, id=f"{place}-{kind}") for place, p in PLACES.items() for kind in p.kinds]


@pytest.fixture
def no_model(monkeypatch):
    """Every model loader replaced by a failure: a case must be refused before any model loads (but ``--lora``'s)."""
    import flowrl.models as models
    import flowrl.trainer as trainer
    from flowrl.rewards import server

    def loaded(*args, **kwargs):
        pytest.fail("a model loaded")

    monkeypatch.setattr(trainer, "build_model", loaded)
    monkeypatch.setattr(server.RewardServer, "serve_forever", loaded)
    return lambda: monkeypatch.setattr(models, "build_adapter", loaded)


@pytest.mark.parametrize("place,kind", CASES)
def test_a_careless_file_is_refused_in_one_line_naming_it(place, kind, tmp_path, capsys, monkeypatch, no_model):
    from flowrl import cli

    spec = PLACES[place]
    if place != "sample --lora":
        no_model()
    monkeypatch.chdir(tmp_path)
    path = tmp_path / spec.file
    path.parent.mkdir(parents=True, exist_ok=True)
    if spec.setup is not None:
        spec.setup(tmp_path, path)
    content = spec.content(kind)
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(SystemExit) as exit_info:
        cli.main([str(a) for a in spec.argv(tmp_path, path)])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err[-2000:]
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if line.startswith("flowrl ") and ": error: " in line]
    assert len(errors) == 1, err[-2000:]
    line = errors[0]
    named = [str(path), str(path.resolve())]  # or its folder, naming the file's name: "FOLDER has no NAME"
    assert any(n in line for n in named) or (str(path.parent) in line and path.name in line), line


def test_the_sweep_covers_every_command_and_preset_kind():
    """Each command that reads a file, and each preset kind (online GRPO, forward-process, direct-reward, offline)."""
    commands = {place.split()[0] for place in PLACES}
    assert commands == {"train", "config", "memory", "bench", "overopt", "eval", "sample", "generate", "score",
                        "serve-reward", "merge"}  # fmt: skip
    presets = {place.split()[1] for place in PLACES if place.startswith("train ")}
    assert {"flow_grpo", "diffusion_nft", "refl", "dpo_offline", "sft"} <= presets
    assert len(CASES) == sum(len(p.kinds) for p in PLACES.values())
