"""Help texts a new user reads first: built from the registries (a new method appears by registering), every builder
option with its default, every command with a description."""

from __future__ import annotations

import pytest

from flowrl.cli import _parser
from flowrl.methods import METHODS


def _sub(name: str):
    parser = _parser()
    return next(a for a in parser._subparsers._group_actions if a.dest == "command").choices[name], parser


def test_flowrl_help_names_every_registered_method():
    _, parser = _sub("train")
    text = " ".join(parser.format_help().split())
    assert all(name in text for name in METHODS) and "GRPO or DiffusionNFT" not in text


def test_flowrl_rewards_help_says_what_it_lists():
    rewards, _ = _sub("rewards")
    assert rewards.description and "registered reward" in rewards.description


@pytest.mark.parametrize("module", ["flowrl.tiny.build", "flowrl.tiny.build_video"])
def test_builder_help_shows_every_default(module, capsys, monkeypatch):
    import importlib

    main = importlib.import_module(module).main
    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out
    assert "(default: 0)" in text  # --seed
    options = [line.split()[0] for line in text.splitlines() if line.startswith("  --")]  # not -h, --help
    assert "--dit-steps" in options and text.count("(default:") >= len(options)  # each option says its default
