"""The command line of the scripts under ``benchmarks/`` that run a preset: ``[CONFIG.yaml] [key=value ...]`` plus
their own options, and the JSON file of their result.

Imports nothing of flowrl and nothing heavy, so that such a script parses its arguments, and answers ``--help``, before
it imports torch and the trainer.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

__all__ = ["finish_preset_result", "parse_preset_args", "preset_parser"]


def preset_parser(description: str, default: str = "configs/tiny_geneval.yaml"):
    """An ``argparse.ArgumentParser`` for scripts that take ``[CONFIG.yaml] [key=value ...]`` plus options.

    Parse with :func:`parse_preset_args`, which sets ``args.config`` (``default`` when the first positional
    is not a ``.yaml``/``.yml`` file) and ``args.overrides`` (the other positionals).
    """
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument(
        "args",
        nargs="*",
        metavar="[CONFIG] key=value",
        help=f"a .yaml preset (default {default}), then overrides of it",
    )
    parser.add_argument("--out", default="", help="also write the result as JSON here")
    parser.set_defaults(default_config=default)
    return parser


def parse_preset_args(parser, argv: list[str] | None = None):
    """Parse ``argv`` with a :func:`preset_parser` (options may come between the overrides)."""
    args = parser.parse_intermixed_args(argv)
    given = args.args[:1] if args.args and args.args[0].endswith((".yaml", ".yml")) else []
    args.config, args.overrides = (given or [args.default_config])[0], args.args[len(given) :]
    return args


def finish_preset_result(args, result: dict) -> dict:
    """Add ``config`` and ``overrides`` to a script's ``result``; write it as JSON to ``args.out`` if given."""
    result = {**result, "config": args.config, "overrides": args.overrides}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return result
