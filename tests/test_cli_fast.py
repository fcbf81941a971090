"""The ``flowrl`` command checks its arguments, config, prompt file and output path before torch executes: bad input is
refused in one line without torch's import time, and ``--help`` never loads it (:mod:`flowrl.deferred`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

RUN = """
import json, sys
from flowrl.cli import main
try:
    main(sys.argv[1:])
finally:
    from flowrl.deferred import is_deferred
    heavy = ["torch._C", "diffusers", "transformers", "torchvision"]
    executed = [m for m in heavy if m in sys.modules] + ["numpy"] * ("numpy" in sys.modules and not is_deferred("numpy"))
    print(json.dumps({"executed": executed}))
"""
"""Run ``flowrl ARGV`` and print which of the heavy modules executed (``torch._C`` is imported by torch's own
``__init__``: a deferred torch never read has not imported it)."""


def _flowrl(tmp_path: Path, *argv: str) -> tuple[int, list[str], list[str]]:
    """``flowrl ARGV`` in a fresh interpreter in `tmp_path`, with an empty Hugging Face cache: its exit status, its
    stderr lines and the heavy modules that executed."""
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hf_cache"), "HF_HUB_OFFLINE": "1"}
    out = subprocess.run(
        [sys.executable, "-c", RUN, *argv], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    executed = json.loads(out.stdout.strip().splitlines()[-1])["executed"]
    return out.returncode, out.stderr.strip().splitlines(), executed


@pytest.mark.parametrize(
    "argv, line",
    [
        (
            ["sample", "--prompt", "a cube", "--out", "grid.bogus"],
            "flowrl sample: error: --out grid.bogus: unknown file type '.bogus'; expected one of .bmp, .jpeg, .jpg, "
            ".png, .tif, .tiff, .webp",
        ),
        (["train", "missing.yaml"], "flowrl train: error: config file missing.yaml does not exist"),
        (
            ["train", str(REPO / "configs" / "quickstart.yaml"), "run.no_such_key=1"],
            "flowrl train: error: config key 'run.no_such_key': Key 'no_such_key' not in 'RunConfig'",
        ),
        (
            ["eval", "--prompts", "missing.jsonl", "--out", "r.json"],
            f"flowrl eval: error: prompt file {REPO / 'missing.jsonl'} does not exist",
        ),
        (
            ["eval", "--reward", "clipscore", "--option", "model_path=assets/tiny-clip", "--prompts", "missing.txt"]
            + ["--out", "r.json"],
            f"flowrl eval: error: prompt file {REPO / 'missing.txt'} does not exist",
        ),
        (
            ["generate", "--prompts", "missing.txt", "--out", "images"],
            f"flowrl generate: error: prompt file {REPO / 'missing.txt'} does not exist",
        ),
        (
            ["sample", "--prompt", "a cube", "--device", "cuda:1", "--out", "grid.gif"],
            "flowrl sample: error: --out grid.gif: unknown file type '.gif'; expected one of .bmp, .jpeg, .jpg, "
            ".png, .tif, .tiff, .webp",
        ),
        (
            ["memory", str(REPO / "configs" / "quickstart.yaml"), "--family", "flux9"],
            "flowrl memory: error: --family 'flux9': no published model of that name; known: "
            + ", ".join(sorted(p.stem for p in (REPO / "flowrl/models/published").glob("*.json"))),
        ),
        (
            ["serve-reward", "clipscore", "--option", "no_equals_sign"],
            "flowrl serve-reward: error: --option 'no_equals_sign' must look like key=value or NAME.key=value (e.g. "
            "--option model_path=/ckpt/PickScore_v1)",
        ),
        (  # a reward's options are checked before torch and the reward's own imports (open_clip)
            ["serve-reward", "hpsv2"],
            "flowrl serve-reward: error: hpsv2: no model_path given and HPS_v2.1_compressed.pt of xswu/HPSv2 is not "
            "in the local Hugging Face cache; download it (`hf download xswu/HPSv2 HPS_v2.1_compressed.pt`) or pass "
            "model_path",
        ),
        (
            ["score", ".", "--reward", "clipscore"],
            "flowrl score: error: reward 'clipscore': missing a required argument: 'model_path'; accepted options: "
            "model_path, processor_path, device, dtype, batch_size",
        ),
        (
            ["eval", "--reward", "hpsv2", "--option", "modelpath=hps.pt", "--prompts", "p.txt", "--out", "r.json"],
            "flowrl eval: error: reward 'hpsv2': got an unexpected keyword argument 'modelpath'; accepted options: "
            "model_path, version, arch, device, dtype, batch_size",
        ),
        (
            ["train", str(REPO / "configs" / "quickstart.yaml"), "rewards.clipscore.options.model_path=no_clip"],
            "flowrl train: error: clipscore: model_path 'no_clip' is not a local folder or a hub id in the local "
            "Hugging Face cache; download it first (e.g. `hf download <repo>` or `hf download <repo> --local-dir "
            "<folder>`)",
        ),
    ],
)
def test_bad_input_is_refused_in_one_line_before_torch_executes(tmp_path, argv, line):
    status, err, executed = _flowrl(tmp_path, *argv)
    assert (status, err, executed) == (2, [line], [])


@pytest.mark.parametrize("argv", [["--help"], ["train", "--help"], ["sample", "--help"], ["eval", "--help"]])
def test_help_does_not_execute_torch(tmp_path, argv):
    status, err, executed = _flowrl(tmp_path, *argv)
    assert (status, err, executed) == (0, [], [])


@pytest.mark.parametrize("preset", [str(REPO / "configs" / "quickstart.yaml"), "dgpo"])
def test_a_valid_config_loads_without_torch(tmp_path, preset):
    """``flowrl config PRESET`` (a path, or a preset's name) validates every key (methods, kernels, rollout shapes,
    precision) torch-free."""
    status, err, executed = _flowrl(tmp_path, "config", preset, "--json")
    assert (status, err, executed) == (0, [], [])


def _package(tmp_path: Path, monkeypatch) -> str:
    """A package ``deferme_pkg`` (with a submodule ``sub``) in `tmp_path` that appends to ``sys.deferme_log`` when it
    executes."""
    pkg = tmp_path / "deferme_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("import sys\nsys.deferme_log.append('executed')\nVALUE = 3\n")
    (pkg / "sub.py").write_text("from . import VALUE\nDOUBLE = 2 * VALUE\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "deferme_log", [], raising=False)
    return "deferme_pkg"


def test_a_deferred_module_executes_on_first_use_and_is_then_the_module(tmp_path, monkeypatch):
    from flowrl.deferred import DeferredModule, defer, is_deferred

    name = _package(tmp_path, monkeypatch)
    try:
        assert defer(name, "no_such_module_anywhere") == [name]
        import deferme_pkg  # the import statement reads __spec__ only

        assert is_deferred(name) and sys.deferme_log == []
        assert deferme_pkg.VALUE == 3 and sys.deferme_log == ["executed"]
        assert type(deferme_pkg) is not DeferredModule and sys.modules[name] is deferme_pkg
        from deferme_pkg.sub import DOUBLE  # submodules import as usual

        assert DOUBLE == 6 and sys.deferme_log == ["executed"]
        assert defer(name) == []  # imported already: left alone
        with pytest.raises(ValueError, match=r"defer\('deferme_pkg.sub'\): expected a top-level module name"):
            defer("deferme_pkg.sub")
    finally:
        for module in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
            del sys.modules[module]


def test_the_tiny_video_model_samples_at_its_trained_size_by_default():
    """``flowrl sample --model assets/tiny-wan`` without ``--resolution`` / ``--num-frames`` draws the 32 px x 9
    frames the model was trained at (its ``build.json``), not Wan's published 480 px x 81 frames."""
    from flowrl import cli

    args = cli._parser().parse_args(["sample", "--model", "assets/tiny-wan", "--prompt", "a ball", "--device", "cpu"])
    assert args.resolution is None and args.num_frames is None
    model = cli._model(args)
    assert (model.resolution, model.num_frames) == (32, 9)
