"""``flowrl`` command line: ``train``, ``eval``, ``sample``, ``generate``, ``score``, ``serve-reward``, ``rewards``,
``bench``, ``overopt`` and ``merge``."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from .data import prompt_file, read_jsonl
from .deferred import defer
from .fields import config_key
from .files import (
    RunFolderInUse,
    atomic_output,
    check_folder_writable,
    check_model_folder,
    probe_output,
    resolve_option_paths,
    resolve_path,
    write_text_atomic,
)

USER_ERRORS = (
    ValueError,
    FileNotFoundError,
    FileExistsError,
    PermissionError,
    NotADirectoryError,
    IsADirectoryError,
    RunFolderInUse,
)
"""Exceptions that mean bad input (config key, file, checkpoint, output, a busy run folder), with the rewards' own
(:func:`user_errors`): reported in one line, exit status 2 (with the full traceback when the environment sets
``FLOWRL_TRACEBACK=1``, to tell a bug from bad input). ``ValueError`` covers :class:`flowrl.config.ConfigError`,
:class:`flowrl.checkpoint.CheckpointError` and :class:`flowrl.files.OutputError`. Any other exception (a
``KeyError`` or ``TypeError`` included) is a bug in flowrl and keeps its traceback."""


def user_errors() -> tuple[type[BaseException], ...]:
    """:data:`USER_ERRORS` with :class:`rewards.RewardError` (a reward raised) and :class:`rewards.RewardTypeError`
    (a reward spec, option or score of the wrong type) once their torch-free module :mod:`rewards.options` is loaded
    (:func:`_reward_checks`): before that no reward can have raised or been checked."""
    options = sys.modules.get("flowrl.rewards.options")
    return USER_ERRORS + ((options.RewardError, options.RewardTypeError) if options is not None else ())


def _reward_checks():
    """:mod:`rewards.options`, the torch-free checks of the built-in rewards' options, loaded without executing
    ``flowrl.rewards``' ``__init__`` (which imports every reward, and torch): it is put in ``sys.modules`` under its
    own name, so that the package, when it imports, takes this module object as its own (the same classes)."""
    name = "flowrl.rewards.options"
    if name not in sys.modules:
        import importlib.util

        package = importlib.util.find_spec("flowrl.rewards")  # its folder; executes flowrl only, not flowrl.rewards
        spec = importlib.util.spec_from_file_location(name, Path(package.submodule_search_locations[0], "options.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
    return sys.modules[name]


def _check_reward_options(spec: str, options: dict) -> None:
    """Refuse a built-in reward's missing, unknown or unusable options (a weights file that is not there) before
    torch and the rewards import (:func:`rewards.options.check_options`), with the paths resolved as the reward
    will get them (:func:`flowrl.files.resolve_option_paths`); a user's reward or a plug-in is checked when built.

    Raises:
        rewards.RewardTypeError, FileNotFoundError, ValueError: naming the reward and the option.
    """
    _reward_checks().check_options(spec, resolve_option_paths(options))


IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".tif", ".tiff")
"""What ``flowrl sample --out`` may end with (the image formats PIL writes)."""

CONFIG_HELP = (
    "a YAML file, or a preset or recipe by name: dgpo is configs/dgpo.yaml, sd35m_pickscore "
    "configs/recipes/sd35m_pickscore.yaml (flowrl config --list)"
)
"""The help of every command's config argument (``train``, ``config``, ``memory``): one spelling, name or path."""

PRESETS_HELP = "presets of configs/, by name (dgpo) or path (configs/dgpo.yaml)"
"""The help of ``--presets`` (``bench``, ``overopt``), completed with what the command does with them."""

JSON_HELP = "print JSON instead of text"
"""The help of ``--json`` (``config``, ``memory``): a flag everywhere; files are written with ``--out``."""

OPTION_HELP = (
    "a reward option, e.g. model_path=assets/tiny-clip; NAME.KEY=VALUE names the reward (needed with several "
    "rewards); repeat for more"
)
"""The help of ``--option`` (``eval``, ``score``, ``serve-reward``): one spelling, read by :func:`_reward_options`."""


def _alias(parser: argparse.ArgumentParser, old: str, dest: str, **kwargs) -> None:
    """Accept `old`, the former spelling of the option stored in `dest`, hidden from ``--help`` (the new option's help
    names it): scripts written for it keep working. ``kwargs`` (``type``, ...) are the new option's; errors name `old`,
    as the user wrote it."""
    kwargs.update(dest=dest, default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    parser.add_argument(old, **kwargs)


def _model(args):
    """The ``--model`` pipeline on ``--device``, with the ``--lora`` loaded if given.

    Raises:
        ValueError: for ``--device cuda`` without a CUDA device (before anything loads), a folder that is not a
            pipeline or holds damaged or pickled weights, a resolution the model cannot take, or a LoRA folder
            without weights.
    """
    from .models import build_adapter, resolve_device

    device, path = resolve_device(args.device), resolve_path(args.model)
    adapter = _family(args)
    if args.max_sequence_length is not None:
        try:
            adapter.check_max_sequence_length(args.max_sequence_length)
        except ValueError as e:
            raise ValueError(f"--max-sequence-length: {e}") from None
    if args.shift is None:  # the model's own schedule (SD3.5: 3, the tiny model: 1, FLUX.1 at 1024 px: 3.16)
        frames = {"num_frames": getattr(args, "num_frames", None)} if adapter.VIDEO else {}
        args.shift = adapter.scheduler_shift(path, args.resolution, **frames)
    video = {}
    if getattr(args, "num_frames", None) is not None:  # video families only (Wan: 4k+1 frames), checked before loading
        if not adapter.VIDEO:
            raise ValueError(f"--num-frames: {path} holds a {adapter.PIPELINE}, which draws images")
        try:
            video["num_frames"] = adapter.check_num_frames(path, args.num_frames)
        except ValueError as e:
            raise ValueError(f"--num-frames: {e}") from None
    model = build_adapter(
        adapter, path, device, max_sequence_length=args.max_sequence_length, resolution=args.resolution, **video
    )
    if args.lora:
        model.load_lora(args.lora)
    return model


def _family(args):
    """The model family (:class:`flowrl.models.FlowModel` subclass) of the ``--model`` folder, from its
    ``model_index.json``; the folder is checked first (readable JSON, whole safetensors weights, no pickles, each file
    named) and no weight loads.

    Raises:
        FileNotFoundError, ValueError: as :func:`flowrl.files.check_model_folder` and
            :func:`flowrl.models.model_class`.
    """
    from .models import model_class

    path = resolve_path(args.model)
    check_model_folder(path)
    return model_class(path)


def _check_sources(args, read) -> None:
    """Where the ``--model`` family starts each video from a source image (``FlowModel.SOURCE_REQUIRED``:
    image-to-video), read the prompt file again with ``read(True)`` (a reader that requires every record's
    ``image``), so that a record without one is refused naming its file and line before the model loads, as
    ``flowrl train`` refuses it; an edit family draws a record without ``image`` as text-to-image and reads nothing.

    A ``--model`` that is not a pipeline folder is left to the model's own check (after the rewards' names and options
    are checked).

    Raises:
        ValueError: ``--prompts: FILE:LINE: no 'image'; ...``, or a prompt format that names no source images.
    """
    if not (resolve_path(args.model) / "model_index.json").is_file():
        return
    if _family(args).SOURCE_REQUIRED:
        try:
            read(True)
        except ValueError as e:
            raise ValueError(f"--prompts: {e}") from None


def cmd_train(args) -> dict:
    """``flowrl train CONFIG [key=value ...]``: run the job; returns :meth:`Trainer.train`'s result."""
    from .resume import load_run_config, say

    # before torch loads: a bad key is refused at once; a resume takes the run's own config.yaml
    config, note = load_run_config(args.config, args.overrides)
    checks = _reward_checks()
    for name, reward in config.rewards.items():  # refused now, as the trainer would refuse it after the model loads
        with config_key(f"rewards.{name}", (ValueError, checks.RewardTypeError)):
            _check_reward_options(reward.spec or name, reward.options)
    say([note] if note else [])
    from .trainer import Trainer

    trainer = Trainer(config)
    result = trainer.train()  # prints the before -> after line
    _end(trainer.accelerator)
    return result


def cmd_config(args) -> list[dict]:
    """``flowrl config [CONFIG] [key=value ...]``: every config key with its type, value (the preset's, or the
    default), default and help (:func:`flowrl.config.describe`); ``--json`` writes them as JSON instead."""
    from .config import describe, format_description, format_shipped_configs, load_config, shipped_configs

    if args.list:
        shipped = shipped_configs()
        print(json.dumps(shipped, indent=1) if args.json else format_shipped_configs(shipped))
        return shipped
    rows = describe(load_config(args.config, args.overrides) if args.config else None)
    print(json.dumps(rows, indent=1, default=str) if args.json else format_description(rows))
    if not args.config and not args.json:  # the defaults: say which presets and recipes there are to start from
        print("\n" + format_shipped_configs(shipped_configs()))
    return rows


def cmd_memory(args) -> dict:
    """``flowrl memory CONFIG [key=value ...] --processes N [--family NAME]``: print the run's trained weight count and
    the memory its trained weights, gradients, AdamW state, frozen parts and activations take per process under each
    engine (:func:`flowrl.plan.memory_plan`), from the model folder or the published model ``NAME``; reads no
    weights. ``--json`` prints the plan as JSON instead, ``--out FILE`` also writes it (``--json FILE``, the old
    spelling, writes it too). Returns the plan (bytes)."""
    from .config import load_config
    from .plan import format_plan, load_published, memory_plan  # torch loads only when the plan is worked out

    as_json, out = args.json, args.out
    if isinstance(as_json, str) and "=" in as_json and not as_json.endswith(".json"):  # --json key=value: a flag
        args.overrides, as_json = [*args.overrides, as_json], True
    if isinstance(as_json, str):  # the old spelling --json FILE: the text printed, the JSON written to FILE
        if out is not None and out != as_json:
            raise ValueError(f"--json {as_json} is the old spelling of --out FILE; give --out {out} alone")
        as_json, out = False, as_json
    config = load_config(args.config, args.overrides)
    if args.family is not None:
        load_published(args.family)  # ValueError naming the known ones
    if out:
        probe_output(out, "--out")  # before the work, not after it

    plan = memory_plan(config, args.processes, args.family)
    print(json.dumps(plan, indent=1) if as_json else format_plan(plan))
    if out:
        write_text_atomic(out, json.dumps(plan, indent=1))
    return plan


def _end(accelerator) -> None:
    """End a command that ran under ``accelerator``: every process waits for the others, then the process group
    (torchrun / ``accelerate launch``) is destroyed before the interpreter exits, as torch asks; a single process
    has none and this does nothing."""
    accelerator.wait_for_everyone()
    accelerator.end_training()


def cmd_eval(args) -> dict:
    """``flowrl eval``: GenEval strict accuracy of a model (and LoRA) on a prompt set, or with ``--reward`` the mean,
    std and per-tag means of each named reward (:func:`_eval_rewards`), written as JSON."""
    if args.reward is not None:
        return _eval_rewards(args)
    if args.option:
        raise ValueError("--option sets a reward's option; give the reward with --reward NAME")
    if args.images_per_prompt is not None:
        raise ValueError("--images-per-prompt is for --reward; the GenEval accuracy counts --images-per-tag")
    if args.format != "auto":
        raise ValueError("--format is for --reward; the GenEval accuracy reads GenEval metadata (.jsonl)")
    metas = read_jsonl(prompt_file(args.prompts))
    bare = [i for i, m in enumerate(metas, 1) if "include" not in m]
    if bare:  # before the model loads
        raise ValueError(
            f"--prompts {args.prompts}: line {bare[0]} (and {len(bare) - 1} more) has no GenEval metadata ('include'); "
            "the GenEval accuracy needs it: score plain prompts with --reward NAME"
        )
    probe_output(args.out, "--out", (".json",))  # before the work, not after it
    _check_sources(args, lambda required: read_jsonl(prompt_file(args.prompts), required))
    from .evaluation import evaluate
    from .precision import autocast

    accelerator = _eval_accelerator(args)
    model = _model(args)
    images_per_tag = 64 if args.images_per_tag is None else args.images_per_tag
    with autocast(model.device, args.bf16, "--bf16"):
        result = evaluate(
            model,
            metas,
            images_per_tag,
            args.num_steps,
            args.guidance_scale,
            args.shift,
            args.seed,
            accelerator=accelerator,
        )
    if accelerator is None or accelerator.is_main_process:
        write_text_atomic(args.out, json.dumps(result, indent=1))
        print(json.dumps({"overall": result["overall"], "per_tag": result["per_tag"]}, indent=1))
    if accelerator is not None:
        _end(accelerator)
    return result


def _eval_accelerator(args):
    """An ``accelerate.Accelerator`` under ``accelerate launch`` / torchrun (``WORLD_SIZE > 1``: the images are split
    over the processes), else None."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        from accelerate import Accelerator

        from .zero import quiet_cpu_notice

        quiet_cpu_notice()
        return Accelerator(cpu=args.device == "cpu")
    return None


def _reward_specs(text: str) -> list[str]:
    """The rewards of ``--reward NAME[,NAME...]``, in order.

    Raises:
        ValueError: an empty name or one given twice.
    """
    specs = [s.strip() for s in text.split(",")]
    if not all(specs):
        raise ValueError(f"--reward {text!r}: expected NAME or NAME,NAME,... with no empty name")
    twice = sorted({s for s in specs if specs.count(s) > 1})
    if twice:
        raise ValueError(f"--reward {text!r} names {', '.join(twice)} twice")
    return specs


def _reward_options(specs: list[str], pairs: list[str] | None) -> dict[str, dict]:
    """Each reward's options from ``--option`` pairs, spelt alike by ``eval``, ``score`` and ``serve-reward``:
    ``NAME.key=value``, or ``key=value`` when there is one reward; the name is everything before the key's last dot,
    so a dotted-path reward ``pkg.mod:fn`` takes ``pkg.mod:fn.key=v``. Each value is read as YAML (:func:`_options`).

    Raises:
        ValueError: a pair without ``=``, without a reward name among several rewards, or naming a reward that is
            not among `specs`.
    """
    grouped: dict[str, list[str]] = {spec: [] for spec in specs}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise ValueError(
                f"--option {pair!r} must look like key=value or NAME.key=value (e.g. --option "
                "model_path=/ckpt/PickScore_v1)"
            )
        name, dot, option = key.strip().rpartition(".")
        if not dot and len(specs) > 1:
            raise ValueError(
                f"--option {pair!r}: with several rewards, name the reward: NAME.key=value "
                f"(--reward lists {', '.join(specs)})"
            )
        name = name if dot else specs[0]
        if name not in grouped:
            raise ValueError(
                f"--option {pair!r} is for reward {name!r}, not one of this command's: {', '.join(specs)}"
            )
        grouped[name].append(f"{option}={value}")
    return {spec: _options(opts) for spec, opts in grouped.items()}


def _checked_reward_options(specs: list[str], pairs: list[str] | None) -> dict[str, dict]:
    """:func:`_reward_options`, each built-in reward's options then checked before torch and the rewards import
    (:func:`_check_reward_options`): what ``eval``, ``score`` and ``serve-reward`` read their ``--option`` with.

    Raises:
        ValueError: as :func:`_reward_options`.
        rewards.RewardTypeError, FileNotFoundError, ValueError: a built-in reward's option missing, unknown or
            unusable (a weights file that is not there), naming the reward and the option.
    """
    options = _reward_options(specs, pairs)
    for spec, given in options.items():
        _check_reward_options(spec, given)
    return options


def _eval_rewards(args) -> dict:
    """``flowrl eval --reward``: ``--images-per-prompt`` ODE samples of every prompt of a prompt file (any
    :func:`flowrl.prompt_sets.read_prompt_set` format), scored by each reward (weight 1, unsummed); writes and
    returns ``{"rewards": {name: {"mean", "std", "per_tag", "n_images", "options"}}, ...}``
    (:func:`flowrl.evaluation.evaluate_reward`). The reward names are checked when the rewards are built, after the
    other checks: the reward registry imports torch."""
    from .prompt_sets import read_prompt_set

    if args.images_per_tag is not None:
        raise ValueError(
            "--images-per-tag is for the GenEval accuracy (no --reward); with --reward give --images-per-prompt"
        )
    specs = _reward_specs(args.reward)
    options = _checked_reward_options(specs, args.option)
    metas = read_prompt_set(args.prompts, args.format)
    probe_output(args.out, "--out", (".json",))  # before the work, not after it
    _check_sources(args, lambda required: read_prompt_set(args.prompts, args.format, required))
    from .evaluation import evaluate_reward
    from .precision import autocast
    from .rewards import WeightedSum, build_reward

    reward = WeightedSum({spec: (build_reward(spec, **resolve_option_paths(options[spec])), 1.0) for spec in specs})
    accelerator = _eval_accelerator(args)
    model = _model(args)
    k = 1 if args.images_per_prompt is None else args.images_per_prompt
    with autocast(model.device, args.bf16, "--bf16"):
        scored = evaluate_reward(
            model,
            metas,
            reward,
            k,
            args.num_steps,
            args.guidance_scale,
            args.shift,
            args.seed,
            accelerator=accelerator,
        )
    result = {
        "rewards": {spec: {**scored["rewards"][spec], "options": options[spec]} for spec in specs},
        "prompts": str(args.prompts),
        "n_prompts": len(metas),
        "images_per_prompt": k,
        "n_images": scored["n_images"],
        "model": str(args.model),
        "lora": args.lora,
        "seed": args.seed,
        "num_steps": args.num_steps,
        "guidance_scale": args.guidance_scale,
        "shift": args.shift,
        "bf16": scored["bf16"],
        "machine": scored["machine"],
    }
    if accelerator is None or accelerator.is_main_process:
        write_text_atomic(args.out, json.dumps(result, indent=1, default=str))  # an option YAML read as a date
        for spec, stats in result["rewards"].items():
            tags = "".join(f"\n  {tag}: {mean:.4f}" for tag, mean in stats["per_tag"].items())
            print(
                f"{spec}: mean {stats['mean']:.4f} (std {stats['std']:.4f}) over {stats['n_images']} images"
                + (f"; per tag:{tags}" if tags else "")
            )
        print(f"wrote {args.out}")
    if accelerator is not None:
        _end(accelerator)
    return result


def cmd_sample(args) -> None:
    """``flowrl sample``: ``--num-images`` images of one prompt (ODE, fixed seeds) saved as one grid PNG."""
    probe_output(args.out, "--out", IMAGE_SUFFIXES)  # before the work, not after it
    from torchvision.utils import save_image

    from .evaluation import generate
    from .precision import autocast

    model = _model(args)
    with autocast(model.device, args.bf16, "--bf16"):
        images = generate(
            model,
            [args.prompt] * args.num_images,
            [args.seed + i for i in range(args.num_images)],
            args.num_steps,
            args.guidance_scale,
            args.shift,
        )
    if images.ndim == 5:  # videos (n, F, 3, H, W): the contact sheet at --out, the tiled mp4 beside it
        from .video import save_videos

        with atomic_output(args.out) as tmp, atomic_output(Path(args.out).with_suffix(".mp4")) as tmp_mp4:
            save_videos(images, tmp, mp4=tmp_mp4)
        print(f"wrote {args.num_images} videos to {Path(args.out).with_suffix('.mp4')} and their frames to {args.out}")
        return
    with atomic_output(args.out) as tmp:
        save_image(images, tmp, nrow=min(args.num_images, 8), padding=1)
    print(f"wrote {args.num_images} images to {args.out}")


def cmd_generate(args) -> int:
    """``flowrl generate``: ``--images-per-prompt`` images per prompt of a prompt file (GenEval jsonl, DrawBench csv,
    PartiPrompts tsv, HPDv2 json, txt) in GenEval's folder layout or flat
    (:func:`flowrl.image_folders.generate_folder`)."""
    from .prompt_sets import read_prompt_set

    metas = read_prompt_set(args.prompts, args.format)
    out = Path(args.out)
    if out.is_file() or (out.is_dir() and any(out.iterdir())):
        raise FileExistsError(
            f"--out {out} exists and is not an empty folder; a benchmark folder must hold only "
            "this run's images (GenEval's script reads every numbered subfolder)"
        )
    _check_sources(args, lambda required: read_prompt_set(args.prompts, args.format, required))
    from .image_folders import generate_folder
    from .precision import autocast

    accelerator = None
    if (
        int(os.environ.get("WORLD_SIZE", "1")) > 1
    ):  # accelerate launch / torchrun: split the prompts over the processes
        from accelerate import Accelerator

        from .zero import quiet_cpu_notice

        quiet_cpu_notice()
        accelerator = Accelerator(cpu=args.device == "cpu")
        accelerator.wait_for_everyone()  # every process checked --out before any writes into it
    model = _model(args)
    with autocast(model.device, args.bf16, "--bf16"):
        written = generate_folder(
            model,
            metas,
            out,
            args.images_per_prompt,
            args.layout,
            args.seed,
            args.num_steps,
            args.guidance_scale,
            args.shift,
            args.batch_size,
            accelerator,
        )
    if accelerator is not None:
        _end(accelerator)
    if accelerator is None or accelerator.is_main_process:
        kind = "videos (mp4, and a PNG of 8 frames each)" if model.VIDEO else "images"
        print(
            f"wrote {len(metas) * args.images_per_prompt} {kind} ({len(metas)} prompts x {args.images_per_prompt}) "
            f"to {out} in the {args.layout} layout"
        )
    return written


def cmd_merge(args) -> Path:
    """``flowrl merge``: LoRA folders (or finished runs) merged with a weight each into one LoRA folder
    (:func:`flowrl.merge.merge_loras`), or with ``--base`` fused into that pipeline and written whole
    (:func:`flowrl.merge.merge_into_pipeline`). Python: ``flowrl.merge.merge_loras(folders, out, weights, combination)``.
    """
    import tempfile

    from .merge import LORA_FILE, check_merge_args, merge_into_pipeline, merge_loras

    check_merge_args(args.loras, args.weights, args.combination, args.rank)  # before torch loads
    out = Path(args.out)
    if args.base is not None:
        check_model_folder(resolve_path(args.base))
        if out.exists() and (not out.is_dir() or any(out.iterdir())):
            raise FileExistsError(f"--out {out} exists and is not an empty folder; name a new folder for the pipeline")
    elif (out / LORA_FILE).exists():
        raise FileExistsError(f"--out {out} holds a LoRA already; choose a new folder")
    check_folder_writable(out, "--out")
    if args.base is None:
        merge_loras(args.loras, out, args.weights, args.combination, args.rank)
        print(f"wrote the {args.combination} merge of {len(args.loras)} LoRAs to {out}")
        return out
    with tempfile.TemporaryDirectory() as tmp:
        merged = merge_loras(args.loras, Path(tmp) / "lora", args.weights, args.combination, args.rank)
        if out.is_dir():
            out.rmdir()  # empty: checked above
        merge_into_pipeline(merged, args.base, out, args.device)
    print(f"wrote {args.base} with the {args.combination} merge of {len(args.loras)} LoRAs fused in to {out}")
    return out


def _options(pairs: list[str] | None) -> dict:
    """``--option key=value`` pairs as a dict; each value read as YAML (``80`` an int, ``true`` a bool, ``[1, 5]`` a
    list, anything else a string)."""
    import yaml

    options = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise ValueError(
                f"--option {pair!r} must look like key=value (e.g. --option model_path=/ckpt/PickScore_v1)"
            )
        try:
            options[key.strip()] = yaml.safe_load(value) if value.strip() else ""
        except yaml.YAMLError:
            options[key.strip()] = value
    return options


def cmd_score(args) -> dict:
    """``flowrl score``: score a folder of images with a named reward; per-image rows to ``--out``, mean printed
    (:func:`flowrl.image_folders.score_records`)."""
    from .image_folders import read_image_folder, score_records, write_scores
    from .prompt_sets import read_prompt_set

    options = _checked_reward_options([args.reward], args.option)  # before the images are read
    prompts = read_prompt_set(args.prompts, args.format) if args.prompts else None
    records = read_image_folder(args.paths, prompts)
    if args.out:
        probe_output(args.out, "--out", (".jsonl", ".csv"))  # before the work, not after it
    if prompts is None and all(r["prompt"] == "" for r in records):
        print(
            f"flowrl score: note: no prompts for the {len(records)} images (score them with --prompts FILE for a "
            "prompt-dependent reward)",
            file=sys.stderr,
        )
    options = options[args.reward]
    from .evaluation import summarize
    from .rewards import build_reward

    reward = build_reward(args.reward, **resolve_option_paths(options))
    scores = score_records(reward, records, args.batch_size)
    summary = {"reward": args.reward, "options": options, **summarize(records, scores)}
    if args.out:
        write_scores(records, scores, args.out)
    tags = "".join(f"\n  {tag}: {mean:.4f}" for tag, mean in summary["per_tag"].items())
    print(
        f"{args.reward}: mean {summary['mean']:.4f} (std {summary['std']:.4f}) over {summary['n_images']} images"
        + (f"; per tag:{tags}" if tags else "")
        + (f"\nwrote {args.out}" if args.out else "")
    )
    return summary


def cmd_serve_reward(args) -> None:
    """``flowrl serve-reward NAME``: serve a reward over HTTP until Ctrl-C (:func:`rewards.serve`)."""
    options = resolve_option_paths(_checked_reward_options([args.name], args.option)[args.name])  # as score, eval
    from .rewards import serve

    serve(
        args.name,
        host=args.host,
        port=args.port,
        batch_size=args.batch_size,
        workers=args.workers,
        max_queue=args.max_queue,
        **options,
    )


def cmd_rewards(args) -> list[dict]:
    """``flowrl rewards``: every registered reward and installed ``flowrl.rewards`` entry point, one line each:
    name, modality (``image``, ``video`` or both), ``yes`` under GRAD for a differentiable reward (the direct methods
    train on it) and the weights it needs, as the factory declares them (:func:`rewards.register_reward`'s
    ``modality``, ``differentiable`` and ``weights``; ``-`` where a plug-in declares none).

    Returns:
        ``[{"name", "modality", "grad", "weights", "source", "summary"}, ...]``: registered names sorted, then entry points;
        ``summary`` is the first line of the factory's docstring.
    """
    import inspect

    from .rewards import REWARDS
    from .rewards.base import _entry_point, _entry_points

    def row(name: str, factory, source: str) -> dict:
        return {
            "name": name,
            "modality": getattr(factory, "modality", "-"),
            "grad": "yes" if getattr(factory, "differentiable", False) else "-",
            "weights": getattr(factory, "weights", "-"),
            "source": source,
            "summary": (inspect.getdoc(factory) or "").split("\n")[0],
        }

    rows = [row(name, factory, "built-in") for name, factory in sorted(REWARDS.items())]
    for ep in sorted(_entry_points(), key=lambda ep: ep.name):
        if ep.name in REWARDS or any(r["name"] == ep.name for r in rows):
            continue
        try:
            rows.append(row(ep.name, _entry_point(ep.name), f"entry point {ep.value}"))
        except (ValueError, TypeError) as e:  # a plug-in that does not load is listed, with why
            rows.append(
                {**row(ep.name, None, f"entry point {ep.value}"), "weights": f"(not loadable: {_one_line(e)})"}
            )
    header = {"name": "NAME", "modality": "MODALITY", "grad": "GRAD", "weights": "WEIGHTS IT NEEDS"}
    name_w, mod_w = (max(len(r[k]) for r in [header, *rows]) for k in ("name", "modality"))
    for r in [header, *rows]:
        print(f"{r['name']:<{name_w}}  {r['modality']:<{mod_w}}  {r['grad']:<4}  {r['weights']}")
    return rows


def cmd_bench(args) -> dict:
    """``flowrl bench``: every sampler preset on the tiny world (see :mod:`flowrl.bench`); ``--presets`` may
    name any preset in configs/ by name or path (``diffusion_nft``, ``configs/diffusion_nft.yaml``)."""
    from .bench import PRESETS, run_bench
    from .config import REPO_ROOT, preset_name

    args.presets = [preset_name(p) for p in args.presets]  # configs/dgpo.yaml -> dgpo
    available = sorted(p.stem for p in (REPO_ROOT / "configs").glob("*.yaml"))
    unknown = set(args.presets) - set(available)
    if unknown:
        raise ValueError(f"unknown bench preset(s) {sorted(unknown)}; default {list(PRESETS)}, available {available}")
    probe_output(Path(args.out).with_suffix(".md"), "--out")  # and its .json: before the work
    probe_output(args.out, "--out")
    results = run_bench(
        args.presets,
        args.timed_iterations,
        args.warmup,
        args.budget_s,
        args.overrides,
        args.out,
        args.preset_overrides,
    )
    print(Path(args.out).with_suffix(".md").read_text())
    return results


def cmd_overopt(args) -> dict:
    """``flowrl overopt``: train on the clipscore proxy and track the GenEval gold reward."""
    from .config import REPO_ROOT, preset_name
    from .overopt import run_overopt

    args.presets = [preset_name(p) for p in args.presets]  # configs/dgpo.yaml -> dgpo
    known = {p.stem for p in (REPO_ROOT / "configs").glob("*.yaml")}
    unknown = set(args.presets) - known
    if unknown:
        raise ValueError(f"unknown preset(s) {sorted(unknown)}; choose from configs/: {sorted(known)}")
    probe_output(Path(args.out).with_suffix(".md"), "--out")  # and its .json: before the work
    probe_output(args.out, "--out")
    results = run_overopt(args.presets, args.iterations, args.eval_every, overrides=args.overrides, out=args.out)
    print(Path(args.out).with_suffix(".md").read_text())
    return results


def _at_least(low: float, kind: type = int, strict: bool = False, high: float | None = None):
    """An argparse ``type``: ``kind(text)``, refused (one line, naming the option) unless ``>= low`` (``> low``
    with ``strict``) and, with `high`, ``< high`` (inf refused for floats), so that a bad value fails before the model
    loads."""
    import math

    def parse(text: str):
        value = kind(text)  # a ValueError here is argparse's "invalid int value: 'x'"
        if kind is float and not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
        if not value >= low or (strict and value == low):  # NaN fails too
            raise argparse.ArgumentTypeError(f"must be {'>' if strict else '>='} {low}, got {text}")
        if (high is not None and not value < high) or (kind is float and not math.isfinite(value)):
            raise argparse.ArgumentTypeError(
                f"must be a finite number{f' below {high:g}' if high else ''}, got {text}"
            )
        return value

    parse.__name__ = kind.__name__
    return parse


def _non_empty(text: str) -> str:
    """An argparse ``type``: a string with something besides spaces in it."""
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty")
    return text


def _device(text: str) -> str:
    """An argparse ``type`` for ``--device``: ``auto`` or a torch device name (``cpu``, ``cuda``, ``cuda:1``). The
    common names are read without torch; any other is asked of ``torch.device`` (which loads torch)."""
    import re

    if text == "auto" or re.fullmatch(r"(cpu|cuda|mps)(:(0|[1-9][0-9]*))?", text):
        return text
    import torch

    try:
        torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"must be auto, cpu or cuda[:N], got {text!r}") from None
    return text


def _model_args(p: argparse.ArgumentParser) -> None:
    """The options ``eval`` and ``sample`` share: model, LoRA, sampling and device."""
    p.add_argument(
        "--model",
        default="assets/tiny-sd3",
        help="a diffusers pipeline folder of any family flowrl has an adapter for (docs/models.md)",
    )
    p.add_argument("--lora", default=None, help="diffusers-format LoRA folder (e.g. RUN/lora)")
    p.add_argument(
        "--max-sequence-length",
        type=_at_least(0),
        default=None,
        help="T5 tokens (default: SD3 256 with a T5 encoder, 0 without one as the tiny model; FLUX 512)",
    )
    p.add_argument(
        "--resolution",
        type=_at_least(1),
        default=None,
        help="image side in px (default: the model's own: the size a flowrl-built folder was trained at, from its "
        "build.json, 32 for assets/tiny-wan; else the family's, e.g. 1024 for SD3.5-Medium, 480 for Wan)",
    )
    p.add_argument(
        "--num-frames",
        type=_at_least(1),
        default=None,
        help="frames per video, video models only (Wan: 4k+1; default: the model's, 9 for assets/tiny-wan, 81 for Wan)",
    )
    p.add_argument("--num-steps", type=_at_least(1), default=20, help="Euler ODE steps")
    p.add_argument(
        "--guidance-scale",
        type=_at_least(1, float, high=100.0 + 1e-9),
        default=4.5,
        help="classifier-free guidance scale in [1, 100] (1 = off)",
    )
    p.add_argument(
        "--shift",
        type=_at_least(0, float, strict=True),
        default=None,
        help="sigma-schedule shift (default: the model scheduler's)",
    )
    p.add_argument(
        "--seed",
        type=_at_least(0, high=2**63 - 10**6),
        default=1234,
        help="seed of the first image's noise (then seed + 1, ...)",
    )
    p.add_argument("--device", type=_device, default="auto", help="auto | cpu | cuda[:N]")
    p.add_argument(
        "--bf16",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="bf16 autocast (--no-bf16: float32; default: bf16 where the device computes it natively, "
        "float32 elsewhere)",
    )


def _add_train(sub) -> None:
    """The ``train`` sub-command: ``CONFIG`` and ``key=value`` overrides, run by :func:`cmd_train`; its help names the
    methods of the registry (:data:`flowrl.methods.METHODS`: a new method appears there by registering)."""
    from .methods import METHODS  # torch deferred: the registry's names and summaries load without it

    t = sub.add_parser(
        "train",
        help=f"run a training job from a YAML preset (train.method: {', '.join(sorted(METHODS))})",
        epilog="Every config key with its type, default and help: flowrl config [CONFIG]",
    )
    t.add_argument("config", help=CONFIG_HELP)
    t.add_argument(
        "overrides", nargs="*", help="key=value overrides, e.g. run.iterations=10 (flowrl config lists the keys)"
    )
    t.set_defaults(fn=cmd_train)
    c = sub.add_parser(
        "config", help="every config key with its type, value, default and help (of a preset, or the defaults)"
    )
    c.add_argument("config", nargs="?", default=None, help=CONFIG_HELP + " (default: the built-in defaults)")
    c.add_argument("overrides", nargs="*", help="key=value overrides")
    c.add_argument("--json", action="store_true", help=JSON_HELP)
    c.add_argument(
        "--list", action="store_true", help="list the presets in configs/ and the recipes in configs/recipes/ instead"
    )
    c.set_defaults(fn=cmd_config)
    m = sub.add_parser(
        "memory",
        help="memory per process of a run (weights, optimizer, activations) under each engine, from the model "
        "folder or a published model's configs (reads no weights)",
    )
    m.add_argument("config", help=CONFIG_HELP)
    m.add_argument("overrides", nargs="*", help="key=value overrides, e.g. model.path=/ckpt/flux model.lora_rank=0")
    m.add_argument("--processes", type=_at_least(1), default=8, help="processes (GPUs) of the run")
    m.add_argument(
        "--json",
        nargs="?",
        const=True,
        default=False,
        metavar="FILE",
        help=JSON_HELP + " (--json FILE, the old spelling of --out FILE, still writes FILE)",
    )
    m.add_argument("--out", default=None, help="also write the plan (bytes) to this FILE.json")
    m.add_argument(
        "--family",
        default=None,
        help="plan from a published model's configs shipped with flowrl (flux2_dev, sd35_medium, qwen_image, "
        "wan21_14b, ...: see flowrl/models/published/) instead of model.path's folder; nothing to download",
    )
    m.set_defaults(fn=cmd_memory)


def _add_eval(sub) -> None:
    """The ``eval`` sub-command: the model options, the prompt set and the JSON output, run by :func:`cmd_eval`."""
    from .prompt_sets import FORMATS

    e = sub.add_parser("eval", help="GenEval-style strict accuracy of a model (+ LoRA), or reward means (--reward)")
    _model_args(e)
    e.add_argument(
        "--prompts",
        default="test",
        help="train | test | FILE.jsonl (GenEval metadata); with --reward, any flowrl generate --prompts file",
    )
    e.add_argument("--format", choices=FORMATS, default="auto", help="--prompts file format, with --reward")
    e.add_argument(
        "--reward",
        type=_non_empty,
        default=None,
        help="NAME[,NAME...]: registered rewards or package.module:function (default: GenEval accuracy)",
    )
    e.add_argument("--option", action="append", metavar="[NAME.]KEY=VALUE", help=OPTION_HELP)
    e.add_argument(
        "--images-per-tag",
        type=_at_least(0),
        default=None,
        help="GenEval accuracy: images per tag (default 64; 0: each prompt once)",
    )
    e.add_argument(
        "--images-per-prompt",
        type=_at_least(1),
        default=None,
        help="with --reward: images per prompt, as generate's (default 1)",
    )
    e.add_argument("--out", required=True, help="FILE.json")
    e.set_defaults(fn=cmd_eval)


def _add_sample(sub) -> None:
    """The ``sample`` sub-command: the model options, the prompt, ``--num-images`` and the PNG output, run by
    :func:`cmd_sample`."""
    s = sub.add_parser("sample", help="a grid of images for one prompt")
    _model_args(s)
    s.add_argument("--prompt", type=_non_empty, required=True, help="the text prompt")
    s.add_argument(
        "--num-images",
        type=_at_least(1),
        default=8,
        help="images of the prompt in the grid, all of them (-n, the old spelling, still works)",
    )
    _alias(s, "-n", "num_images", type=_at_least(1))
    s.add_argument("--out", default="grid.png", help=f"image file ({', '.join(IMAGE_SUFFIXES)})")
    s.set_defaults(fn=cmd_sample)


def _add_generate(sub) -> None:
    """The ``generate`` sub-command: the model options, a benchmark prompt file, ``--images-per-prompt``, the layout
    and the output folder, run by :func:`cmd_generate`."""
    from .image_folders import LAYOUTS
    from .prompt_sets import FORMATS

    g = sub.add_parser("generate", help="images of a benchmark prompt file (GenEval, DrawBench, ...) in a folder")
    _model_args(g)
    g.add_argument(
        "--prompts",
        required=True,
        help="GenEval evaluation_metadata.jsonl, DrawBench .csv, PartiPrompts .tsv, HPDv2 .json, .txt",
    )
    g.add_argument("--format", choices=FORMATS, default="auto", help="prompt file format (auto: from the suffix)")
    g.add_argument("--out", required=True, help="a new (or empty) folder")
    g.add_argument(
        "--layout",
        choices=LAYOUTS,
        default="geneval",
        help="geneval: <i>/metadata.jsonl + <i>/samples/<j>.png; flat: <n>.png + prompts.jsonl",
    )
    g.add_argument(
        "--images-per-prompt",
        type=_at_least(1),
        default=4,
        help="images per prompt, as eval --reward's (GenEval: 4; -n, the old spelling, still works)",
    )
    _alias(g, "-n", "images_per_prompt", type=_at_least(1))
    g.add_argument("--batch-size", type=_at_least(1), default=16, help="images generated at once")
    g.set_defaults(fn=cmd_generate)


def _add_score(sub) -> None:
    """The ``score`` sub-command: image folders or files, a reward and its options, prompts and the output,
    run by :func:`cmd_score`."""
    from .prompt_sets import FORMATS

    s = sub.add_parser("score", help="score a folder of images with a named reward")
    s.add_argument("paths", nargs="+", help="a folder written by flowrl generate, a folder of images, or image files")
    s.add_argument("--reward", type=_non_empty, required=True, help="a registered name or package.module:function")
    s.add_argument("--option", action="append", metavar="[NAME.]KEY=VALUE", help=OPTION_HELP)
    s.add_argument("--prompts", default=None, help="prompts of loose images (any flowrl generate --prompts format)")
    s.add_argument("--format", choices=FORMATS, default="auto", help="--prompts file format")
    s.add_argument("--batch-size", type=_at_least(1), default=16, help="images per reward call")
    s.add_argument("--out", default=None, help="per-image scores, FILE.jsonl or FILE.csv")
    s.set_defaults(fn=cmd_score)


def _add_serve_reward(sub) -> None:
    """The ``serve-reward`` sub-command: a reward, its options, host, port and batch size, run by
    :func:`cmd_serve_reward`."""
    r = sub.add_parser("serve-reward", help="serve a reward over HTTP for the 'remote' reward of another process")
    r.add_argument("name", type=_non_empty, help="a registered reward or package.module:function")
    r.add_argument("--option", action="append", metavar="[NAME.]KEY=VALUE", help=OPTION_HELP)
    r.add_argument("--host", default="127.0.0.1", help="address to bind (no authentication: keep it local)")
    r.add_argument("--port", type=_at_least(0), default=8000, help="port (0: a free one, printed)")
    r.add_argument("--batch-size", type=_at_least(1), default=None, help="images per reward call (default: a request)")
    r.add_argument(
        "--workers", type=_at_least(1), default=1, help="reward calls at once (>1: thread-safe rewards only)"
    )
    r.add_argument("--max-queue", type=_at_least(0), default=64, help="requests waiting beyond them before a 503")
    r.set_defaults(fn=cmd_serve_reward)


def _add_rewards(sub) -> None:
    """The ``rewards`` sub-command, run by :func:`cmd_rewards`."""
    sub.add_parser(
        "rewards",
        help="list the registered rewards",
        description="Every registered reward and installed flowrl.rewards entry point, one line each: its name, "
        "modality (image, video or both), whether it is differentiable (GRAD: the direct methods train on it), the "
        "weights it needs and its summary. Use one in a config as rewards.NAME.weight=W (options under "
        "rewards.NAME.options), or score images with flowrl score --reward NAME.",
    ).set_defaults(fn=cmd_rewards)


def _add_bench(sub) -> None:
    """The ``bench`` sub-command: presets (default :data:`flowrl.bench.PRESETS`), timing and budget options,
    run by :func:`cmd_bench`."""
    from .bench import PRESETS

    b = sub.add_parser("bench", help="time every sampler preset on the tiny world (one table)")
    b.add_argument("--presets", nargs="+", default=list(PRESETS), help=PRESETS_HELP + " to time")
    b.add_argument(
        "--timed-iterations",
        type=int,
        default=3,
        help="timed iterations per preset, their median reported (--iterations, the old spelling, still works)",
    )
    _alias(b, "--iterations", "timed_iterations", type=int)
    b.add_argument("--warmup", type=int, default=1, help="untimed iterations before them")
    b.add_argument(
        "--budget-s",
        type=float,
        default=0.0,
        help="also train each preset this long (s) and report the eval accuracy at half and full budget",
    )
    b.add_argument("--out", default="runs/bench.json", help="the results as JSON, and a Markdown table beside it")
    b.add_argument(
        "--preset-overrides",
        default=None,
        help="YAML of per-preset key=value lists ('all' for every preset), e.g. benchmarks/scale_mixgrpo.yaml",
    )
    b.add_argument("overrides", nargs="*", help="key=value overrides for every preset")
    b.set_defaults(fn=cmd_bench)


def _add_overopt(sub) -> None:
    """The ``overopt`` sub-command: presets (default :data:`flowrl.overopt.PRESETS`), iterations and evaluation
    interval, run by :func:`cmd_overopt`."""
    from .overopt import PRESETS

    o = sub.add_parser("overopt", help="over-optimisation study: train on the clipscore proxy, track GenEval gold")
    o.add_argument("--presets", nargs="+", default=list(PRESETS), help=PRESETS_HELP + " to train")
    o.add_argument("--iterations", type=int, default=30, help="training iterations per preset, as run.iterations")
    o.add_argument("--eval-every", type=int, default=10, help="iterations between gold and proxy evaluations")
    o.add_argument("--out", default="runs/overopt.json", help="the results as JSON, and a Markdown table beside it")
    o.add_argument("overrides", nargs="*", help="key=value overrides for every preset")
    o.set_defaults(fn=cmd_overopt)


def _add_merge(sub) -> None:
    """The ``merge`` sub-command: LoRA folders, their weights, the combination and the output, run by
    :func:`cmd_merge`."""
    from .merge import COMBINATIONS

    m = sub.add_parser(
        "merge",
        help="merge LoRA folders (or finished runs) with a weight each into one LoRA, or fused into a pipeline "
        "(Flow-OPD's cold start)",
    )
    m.add_argument("loras", nargs="+", help="LoRA folders (pytorch_lora_weights.safetensors) or finished run folders")
    m.add_argument("--out", required=True, help="the merged LoRA's folder (with --base: the new pipeline folder)")
    m.add_argument(
        "--weights", type=float, nargs="+", default=None, help="one weight per LoRA (default: 1/n each, the average)"
    )
    m.add_argument(
        "--combination",
        choices=COMBINATIONS,
        default="cat",
        help="cat: the exact weighted sum of the weight deltas (rank: the sum); linear: the weighted sum of the "
        "factors (one rank and alpha; Flow-OPD's script); svd: the sum's truncated SVD at --rank",
    )
    m.add_argument("--rank", type=_at_least(1), default=None, help="svd only: the merged rank (default: the largest)")
    m.add_argument(
        "--base", default=None, help="a pipeline folder: fuse the merge into it and write the whole pipeline"
    )
    m.add_argument("--device", type=_device, default="cpu", help="with --base: where the pipeline loads")
    m.set_defaults(fn=cmd_merge)


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` with each option's default, except where there is none to show (None, False, a positional list)."""

    def _get_help_string(self, action):
        if action.default in (None, False) or action.nargs in ("*", "+") and not action.option_strings:
            return action.help
        return super()._get_help_string(action)


class _Parser(argparse.ArgumentParser):
    """flowrl's argument parser: ``--help`` shows each option's default, and a usage error is one line
    ``flowrl COMMAND: error: ...`` (exit status 2), as every other bad input, without argparse's usage block."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def _parser() -> argparse.ArgumentParser:
    """The ``flowrl`` parser: one sub-command each for train (and memory), eval, sample, generate, score, serve-reward,
    rewards, bench, overopt and merge (in that order, as ``--help`` lists them); each sets ``fn``, the ``cmd_*`` function that
    runs it."""
    parser = _Parser(prog="flowrl", description="Online RL for text-to-image and text-to-video flow models")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for add in (
        _add_train,
        _add_eval,
        _add_sample,
        _add_generate,
        _add_score,
        _add_serve_reward,
        _add_rewards,
        _add_bench,
        _add_overopt,
        _add_merge,
    ):
        add(sub)
    return parser


def _one_line(error: BaseException) -> str:
    """``error``'s message on one line (a multi-line message, e.g. a parser's, joined with spaces)."""
    return " ".join(str(error).split()) or type(error).__name__


def _machine_error(error: BaseException) -> str | None:
    """One line for an error of the machine rather than of flowrl: a read-only file system, a full disk or quota
    (an ``OSError``, or a safetensors write that says so), naming the file where the error does; None otherwise."""
    import errno

    # a run's full disk: its message names the checkpoint to resume from (not imported: no checkpoint was written)
    checkpoint = sys.modules.get("flowrl.checkpoint")
    if checkpoint is not None and isinstance(error, checkpoint.DiskFullError):
        return str(error)
    codes = {errno.EROFS: "the file system is read-only", errno.ENOSPC: "no space left on the device"}
    codes[errno.EDQUOT] = "the disk quota is exceeded"
    if isinstance(error, OSError) and error.errno in codes:
        where = f"{error.filename}: " if error.filename else ""
        return f"{where}{codes[error.errno]}; choose another output folder or free space (nothing else was changed)"
    if "No space left on device" in str(error):
        return (
            "no space left on the device while writing; the files written before it (earlier checkpoints) stay "
            "usable: free space and continue with run.resume=true"
        )
    return None


def _run(args: argparse.Namespace) -> None:
    """Run ``args.fn(args)``; a :func:`user_errors` exception prints ``flowrl COMMAND: error: ...`` (one line) on
    stderr and exits with status 2 (``SystemExit``) instead of a traceback, unless ``FLOWRL_TRACEBACK=1`` is set.
    Any other exception propagates with its traceback (a bug, not bad input)."""
    if "" not in sys.path and os.getcwd() not in sys.path:  # user rewards 'pkg.module:fn' from the working folder,
        sys.path.insert(0, os.getcwd())  # as with `python -m flowrl.cli` (the console script puts its bin/ first)
    try:
        args.fn(args)
    except Exception as e:
        machine = _machine_error(e)
        if os.environ.get("FLOWRL_TRACEBACK") == "1" or not (isinstance(e, user_errors()) or machine):
            raise
        if int(os.environ.get("RANK", "0")) == 0:  # under accelerate launch / torchrun every process fails alike
            print(f"flowrl {args.command}: error: {machine or _one_line(e)}", file=sys.stderr)
        sys.exit(2)


def main(argv: list[str] | None = None) -> None:
    """The ``flowrl`` command. Bad input (config key, file, reward, preset) exits with status 2 and a
    one-line ``flowrl COMMAND: error: ...`` on stderr instead of a traceback; no command prints the usage (the
    commands) on stderr and exits with status 2.

    torch and numpy, if not imported yet, are deferred (:func:`flowrl.deferred.defer`): they load when first used,
    after the command has checked its arguments, config, prompt file and output path, so that bad input is refused
    in a fraction of the second torch takes to import, and ``--help`` never loads it."""
    defer("torch", "numpy")
    parser = _parser()
    if not (sys.argv[1:] if argv is None else argv):
        parser.print_help(sys.stderr)
        raise SystemExit(2)
    args, extra = parser.parse_known_args(argv)
    if extra and isinstance(getattr(args, "overrides", None), list) and not any(x.startswith("-") for x in extra):
        args.overrides += extra  # key=value overrides after an option: flowrl memory C --family F model.lora_rank=0
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    _run(args)


if __name__ == "__main__":
    main()
