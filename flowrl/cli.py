"""``flowrl`` command line: ``train``, ``eval``, ``sample``, ``bench`` and ``overopt``."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from .config import load_config, resolve_path
from .data import prompt_file, read_jsonl
from .files import RunFolderInUse, atomic_output, check_model_folder, probe_output, write_text_atomic


USER_ERRORS = (ValueError, FileNotFoundError, FileExistsError, PermissionError, NotADirectoryError, IsADirectoryError,
               RunFolderInUse)
"""Exceptions that mean bad input (config key, file, checkpoint, output, a busy run folder), with the rewards' own
(:func:`user_errors`): reported in one line, exit status 2 (with the full traceback when the environment sets
``FLOWRL_TRACEBACK=1``, to tell a bug from bad input). ``ValueError`` covers :class:`flowrl.config.ConfigError`,
:class:`flowrl.checkpoint.CheckpointError` and :class:`flowrl.files.OutputError`. Any other exception (a
``KeyError`` or ``TypeError`` included) is a bug in flowrl and keeps its traceback."""


def user_errors() -> tuple[type[BaseException], ...]:
    """:data:`USER_ERRORS` with :class:`rewards.RewardError` (a reward raised) and :class:`rewards.RewardTypeError`
    (a reward spec, option or score of the wrong type); imported only when needed (``rewards`` imports torch)."""
    from rewards import RewardError, RewardTypeError

    return USER_ERRORS + (RewardError, RewardTypeError)

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".tif", ".tiff")
"""What ``flowrl sample --out`` may end with (the image formats PIL writes)."""


def _model(args):
    """The ``--model`` pipeline on ``--device``, with the ``--lora`` loaded if given.

    Raises:
        ValueError: for ``--device cuda`` without a CUDA device (before anything loads), a folder that is not a
            pipeline or holds damaged or pickled weights, a resolution the model cannot take, or a LoRA folder
            without weights.
    """
    from .models import model_class, resolve_device

    device, path = resolve_device(args.device), resolve_path(args.model)
    check_model_folder(path)  # readable JSON, whole safetensors weights (no pickles), each file named
    adapter = model_class(path)  # SD3 family or FLUX, from model_index.json
    if args.max_sequence_length is not None:
        try:
            adapter.check_max_sequence_length(args.max_sequence_length)
        except ValueError as e:
            raise ValueError(f"--max-sequence-length: {e}") from None
    if args.shift is None:  # the model's own schedule (SD3.5: 3, the tiny model: 1, FLUX.1 at 1024 px: 3.16)
        args.shift = adapter.scheduler_shift(path, args.resolution)
    model = adapter(path, device, max_sequence_length=args.max_sequence_length, resolution=args.resolution)
    if args.lora:
        model.load_lora(args.lora)
    return model


def cmd_train(args) -> dict:
    """``flowrl train CONFIG [key=value ...]``: run the job; returns :meth:`Trainer.train`'s result."""
    from .trainer import Trainer

    config = load_config(args.config, args.overrides)
    trainer = Trainer(config)
    result = trainer.train()
    b, a = result["before"], result["after"]
    if trainer.accelerator.is_main_process:
        print(f"GenEval strict accuracy on {config.eval.prompts} prompts: {b['overall']:.3f} -> {a['overall']:.3f} "
              f"in {result['wall_time_s'] / 60:.1f} min; run folder {config.run.output_dir}")
    _end(trainer.accelerator)
    return result


def _end(accelerator) -> None:
    """End a command that ran under ``accelerator``: every process waits for the others, then the process group
    (torchrun / ``accelerate launch``) is destroyed before the interpreter exits, as torch asks; a single process
    has none and this does nothing."""
    accelerator.wait_for_everyone()
    accelerator.end_training()


def cmd_eval(args) -> dict:
    """``flowrl eval``: GenEval strict accuracy of a model (and LoRA) on a prompt set, written as JSON."""
    import torch

    from .evaluate import evaluate

    metas = read_jsonl(prompt_file(args.prompts))
    probe_output(args.out, "--out", (".json",))  # before the work, not after it
    accelerator = None
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # accelerate launch / torchrun: split the images over the processes
        from accelerate import Accelerator

        accelerator = Accelerator(cpu=args.device == "cpu")
    model = _model(args)
    with torch.autocast(model.device.type, dtype=torch.bfloat16, enabled=args.bf16):
        result = evaluate(model, metas, args.images_per_tag, args.num_steps, args.guidance_scale, args.shift,
                          args.seed, accelerator=accelerator)
    if accelerator is None or accelerator.is_main_process:
        write_text_atomic(args.out, json.dumps(result, indent=1))
        print(json.dumps({"overall": result["overall"], "per_tag": result["per_tag"]}, indent=1))
    if accelerator is not None:
        _end(accelerator)
    return result


def cmd_sample(args) -> None:
    """``flowrl sample``: ``-n`` images of one prompt (ODE, fixed seeds) saved as one grid PNG."""
    import torch
    from torchvision.utils import save_image

    from .evaluate import generate

    probe_output(args.out, "--out", IMAGE_SUFFIXES)  # before the work, not after it
    model = _model(args)
    with torch.autocast(model.device.type, dtype=torch.bfloat16, enabled=args.bf16):
        images = generate(model, [args.prompt] * args.n, [args.seed + i for i in range(args.n)], args.num_steps,
                          args.guidance_scale, args.shift)
    with atomic_output(args.out) as tmp:
        save_image(images, tmp, nrow=min(args.n, 8), padding=1)
    print(f"wrote {args.n} images to {args.out}")


def cmd_bench(args) -> dict:
    """``flowrl bench``: every sampler preset on the tiny world (see :mod:`flowrl.bench`); ``--presets`` may
    name any preset in configs/ (e.g. ``diffusion_nft``)."""
    from .bench import PRESETS, run_bench
    from .config import REPO_ROOT

    available = sorted(p.stem for p in (REPO_ROOT / "configs").glob("*.yaml"))
    unknown = set(args.presets) - set(available)
    if unknown:
        raise ValueError(f"unknown bench preset(s) {sorted(unknown)}; default {list(PRESETS)}, available {available}")
    probe_output(Path(args.out).with_suffix(".md"), "--out")  # and its .json: before the work
    probe_output(args.out, "--out")
    results = run_bench(args.presets, args.iterations, args.warmup, args.budget_s, args.overrides, args.out,
                        args.preset_overrides)
    print(Path(args.out).with_suffix(".md").read_text())
    return results


def cmd_overopt(args) -> dict:
    """``flowrl overopt``: train on the clipscore proxy and track the GenEval gold reward."""
    from .config import REPO_ROOT
    from .overopt import run_overopt

    known = {p.stem for p in (REPO_ROOT / "configs").glob("*.yaml")}
    unknown = set(args.presets) - known
    if unknown:
        raise ValueError(f"unknown preset(s) {sorted(unknown)}; choose from configs/: {sorted(known)}")
    probe_output(Path(args.out).with_suffix(".md"), "--out")  # and its .json: before the work
    probe_output(args.out, "--out")
    results = run_overopt(args.presets, args.iterations, args.eval_every, overrides=args.overrides, out=args.out)
    print(Path(args.out).with_suffix(".md").read_text())
    return results


def _at_least(low: float, kind: type = int, strict: bool = False):
    """An argparse ``type``: ``kind(text)``, refused (one line, naming the option) unless ``>= low`` (``> low``
    with ``strict``), so that a bad value fails before the model loads."""
    def parse(text: str):
        value = kind(text)  # a ValueError here is argparse's "invalid int value: 'x'"
        if not value >= low or (strict and value == low):  # NaN fails too
            raise argparse.ArgumentTypeError(f"must be {'>' if strict else '>='} {low}, got {text}")
        return value

    parse.__name__ = kind.__name__
    return parse


def _finite(text: str) -> float:
    """An argparse ``type``: a finite float (``nan`` and ``inf`` refused, naming the option)."""
    import math

    value = float(text)
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
    return value


def _non_empty(text: str) -> str:
    """An argparse ``type``: a string with something besides spaces in it."""
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty")
    return text


def _device(text: str) -> str:
    """An argparse ``type`` for ``--device``: ``auto`` or a torch device name (``cpu``, ``cuda``, ``cuda:1``)."""
    import torch

    if text != "auto":
        try:
            torch.device(text)
        except RuntimeError:
            raise argparse.ArgumentTypeError(f"must be auto, cpu or cuda[:N], got {text!r}") from None
    return text


def _model_args(p: argparse.ArgumentParser) -> None:
    """The options ``eval`` and ``sample`` share: model, LoRA, sampling and device."""
    p.add_argument("--model", default="assets/tiny-sd3", help="StableDiffusion3Pipeline or FluxPipeline folder")
    p.add_argument("--lora", default=None, help="diffusers-format LoRA folder (e.g. RUN/lora)")
    p.add_argument("--max-sequence-length", type=_at_least(0), default=None,
                   help="T5 tokens (default: SD3 256 with a T5 encoder, 0 without one as the tiny model; FLUX 512)")
    p.add_argument("--resolution", type=_at_least(1), default=None, help="image side in px (default: the model's)")
    p.add_argument("--num-steps", type=_at_least(1), default=20, help="Euler ODE steps")
    p.add_argument("--guidance-scale", type=_finite, default=4.5)
    p.add_argument("--shift", type=_at_least(0, float, strict=True), default=None,
                   help="sigma-schedule shift (default: the model scheduler's)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--device", type=_device, default="auto", help="auto | cpu | cuda[:N]")
    p.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=True, help="bf16 autocast")


def _add_train(sub) -> None:
    """The ``train`` sub-command: ``CONFIG`` and ``key=value`` overrides, run by :func:`cmd_train`."""
    t = sub.add_parser("train", help="run a training job (GRPO or DiffusionNFT) from a YAML preset")
    t.add_argument("config", help="configs/*.yaml")
    t.add_argument("overrides", nargs="*", help="key=value overrides, e.g. run.iterations=10")
    t.set_defaults(fn=cmd_train)


def _add_eval(sub) -> None:
    """The ``eval`` sub-command: the model options, the prompt set and the JSON output, run by :func:`cmd_eval`."""
    e = sub.add_parser("eval", help="GenEval-style strict accuracy of a model (+ LoRA)")
    _model_args(e)
    e.add_argument("--prompts", default="test", help="train | test | FILE.jsonl")
    e.add_argument("--images-per-tag", type=_at_least(0), default=64, help="images per tag (0: each prompt once)")
    e.add_argument("--out", required=True, help="FILE.json")
    e.set_defaults(fn=cmd_eval)


def _add_sample(sub) -> None:
    """The ``sample`` sub-command: the model options, the prompt, ``-n`` and the PNG output, run by
    :func:`cmd_sample`."""
    s = sub.add_parser("sample", help="a grid of images for one prompt")
    _model_args(s)
    s.add_argument("--prompt", type=_non_empty, required=True)
    s.add_argument("-n", type=_at_least(1), default=8, help="images")
    s.add_argument("--out", default="grid.png", help=f"image file ({', '.join(IMAGE_SUFFIXES)})")
    s.set_defaults(fn=cmd_sample)


def _add_bench(sub) -> None:
    """The ``bench`` sub-command: presets (default :data:`flowrl.bench.PRESETS`), timing and budget options,
    run by :func:`cmd_bench`."""
    from .bench import PRESETS

    b = sub.add_parser("bench", help="time every sampler preset on the tiny world (one table)")
    b.add_argument("--presets", nargs="+", default=list(PRESETS))
    b.add_argument("--iterations", type=int, default=3, help="timed iterations per preset (median)")
    b.add_argument("--warmup", type=int, default=1)
    b.add_argument("--budget-s", type=float, default=0.0, help="also train each preset this long (s) and report the eval accuracy at half and full budget")
    b.add_argument("--out", default="runs/bench.json")
    b.add_argument("--preset-overrides", default=None,
                   help="YAML of per-preset key=value lists ('all' for every preset), e.g. benchmarks/scale_mixgrpo.yaml")
    b.add_argument("overrides", nargs="*", help="key=value overrides for every preset")
    b.set_defaults(fn=cmd_bench)


def _add_overopt(sub) -> None:
    """The ``overopt`` sub-command: presets (default :data:`flowrl.overopt.PRESETS`), iterations and evaluation
    interval, run by :func:`cmd_overopt`."""
    from .overopt import PRESETS

    o = sub.add_parser("overopt", help="over-optimisation study: train on the clipscore proxy, track GenEval gold")
    o.add_argument("--presets", nargs="+", default=list(PRESETS))
    o.add_argument("--iterations", type=int, default=30)
    o.add_argument("--eval-every", type=int, default=10)
    o.add_argument("--out", default="runs/overopt.json")
    o.add_argument("overrides", nargs="*", help="key=value overrides for every preset")
    o.set_defaults(fn=cmd_overopt)


def _parser() -> argparse.ArgumentParser:
    """The ``flowrl`` parser: one sub-command each for train, eval, sample, bench and overopt (in that order,
    as ``--help`` lists them); each sets ``fn``, the ``cmd_*`` function that runs it."""
    parser = argparse.ArgumentParser(prog="flowrl", description="Online RL for text-to-image flow models")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (_add_train, _add_eval, _add_sample, _add_bench, _add_overopt):
        add(sub)
    return parser


def _one_line(error: BaseException) -> str:
    """``error``'s message on one line (a multi-line message, e.g. a parser's, joined with spaces)."""
    return " ".join(str(error).split()) or type(error).__name__


def _run(args: argparse.Namespace) -> None:
    """Run ``args.fn(args)``; a :func:`user_errors` exception prints ``flowrl COMMAND: error: ...`` (one line) on
    stderr and exits with status 2 (``SystemExit``) instead of a traceback, unless ``FLOWRL_TRACEBACK=1`` is set.
    Any other exception propagates with its traceback (a bug, not bad input)."""
    if "" not in sys.path and os.getcwd() not in sys.path:  # user rewards 'pkg.module:fn' from the working folder,
        sys.path.insert(0, os.getcwd())  # as with `python -m flowrl.cli` (the console script puts its bin/ first)
    try:
        args.fn(args)
    except Exception as e:
        if os.environ.get("FLOWRL_TRACEBACK") == "1" or not isinstance(e, user_errors()):
            raise
        print(f"flowrl {args.command}: error: {_one_line(e)}", file=sys.stderr)
        sys.exit(2)


def main(argv: list[str] | None = None) -> None:
    """The ``flowrl`` command. Bad input (config key, file, reward, preset) exits with status 2 and a
    one-line ``flowrl COMMAND: error: ...`` on stderr instead of a traceback."""
    _run(_parser().parse_args(argv))


if __name__ == "__main__":
    main()
