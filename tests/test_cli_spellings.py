"""One spelling per meaning across the ``flowrl`` commands, the old spellings kept working: configs and presets by
name or path, images per prompt, ``--option [NAME.]KEY=VALUE``, ``--json`` a flag with files written by ``--out``,
and ``bench --timed-iterations`` apart from training iterations."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from flowrl import cli
from flowrl.config import REPO_ROOT, load_config, preset_name, resolve_config


def _parse(*argv: str):
    return cli._parser().parse_args(list(argv))


def _actions(command: str) -> dict:
    """The options of ``flowrl COMMAND``: ``{option string: argparse action}``."""
    sub = cli._parser()._subparsers._group_actions[0].choices[command]
    return {option: action for action in sub._actions for option in action.option_strings}


def _fails(capsys, *argv) -> str:
    """Run ``flowrl ARGV`` in-process; assert exit status 2 and return the one line it wrote on stderr."""
    with pytest.raises(SystemExit) as exit_info:
        cli.main([str(a) for a in argv])
    assert exit_info.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


# ------------------------------------------------------------------------------ configs by name or by path
def test_a_preset_or_recipe_is_named_as_bench_names_it():
    assert resolve_config("dgpo") == REPO_ROOT / "configs" / "dgpo.yaml"
    assert resolve_config("sd35m_pickscore") == REPO_ROOT / "configs" / "recipes" / "sd35m_pickscore.yaml"
    assert load_config("dgpo", ["run.iterations=3"]) == load_config("configs/dgpo.yaml", ["run.iterations=3"])
    assert load_config("dgpo").train.method == "dgpo"


def test_a_repository_path_loads_from_any_working_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert load_config("configs/dgpo.yaml").train.method == "dgpo"
    (tmp_path / "dgpo").mkdir()  # a folder of the preset's name is not a config file: the preset is read
    assert resolve_config("dgpo") == REPO_ROOT / "configs" / "dgpo.yaml"
    own = tmp_path / "configs" / "dgpo.yaml"  # the working folder's file wins over the repository's
    own.parent.mkdir()
    own.write_text("base: " + str(REPO_ROOT / "configs" / "dgpo.yaml") + "\nrun:\n  iterations: 5\n")
    assert resolve_config("configs/dgpo.yaml") == Path("configs/dgpo.yaml")
    assert load_config("configs/dgpo.yaml").run.iterations == 5


def test_an_unknown_name_is_refused_naming_where_it_was_looked_for(capsys):
    line = _fails(capsys, "config", "dgpx")
    assert line == (
        "flowrl config: error: config file dgpx does not exist, nor a preset configs/dgpx.yaml or recipe "
        "configs/recipes/dgpx.yaml (flowrl config --list lists them)"
    )
    assert _fails(capsys, "train", "nope.yaml") == "flowrl train: error: config file nope.yaml does not exist"


def test_flowrl_config_takes_a_preset_name_as_docs_methods_writes_it(capsys):
    cli.main(["config", "dgpo", "--json"])
    rows = {r["key"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["train.method"]["value"] == "dgpo"
    cli.main(["config", "sd35m_pickscore"])
    assert "model.path: str = '/ckpt/stable-diffusion-3.5-medium'" in capsys.readouterr().out  # the recipe's


def test_bench_and_overopt_take_presets_by_path_too(tmp_path, monkeypatch, capsys):
    assert preset_name("configs/dgpo.yaml") == preset_name(REPO_ROOT / "configs" / "dgpo.yaml") == "dgpo"
    assert preset_name("dgpo") == "dgpo" and preset_name("sd35m_pickscore") == "sd35m_pickscore"  # not a preset
    calls = {}

    def fake(name):
        def run(presets, *args, **kwargs):
            calls[name] = (list(presets), args, kwargs)
            out = Path(kwargs.get("out", args[-2] if name == "bench" else "x"))
            out.with_suffix(".md").write_text("table\n")
            return {}

        return run

    import flowrl.bench
    import flowrl.overopt

    monkeypatch.setattr(flowrl.bench, "run_bench", fake("bench"))
    monkeypatch.setattr(flowrl.overopt, "run_overopt", fake("overopt"))
    out = tmp_path / "b.json"
    cli.main(["bench", "--presets", "configs/dgpo.yaml", "flow_grpo", "--iterations", "2", "--out", str(out)])
    presets, args, _ = calls["bench"]
    assert presets == ["dgpo", "flow_grpo"] and args[0] == 2  # the old --iterations is --timed-iterations
    cli.main(["overopt", "--presets", str(REPO_ROOT / "configs/flow_grpo.yaml"), "--out", str(tmp_path / "o.json")])
    assert calls["overopt"][0] == ["flow_grpo"]
    capsys.readouterr()
    line = _fails(capsys, "bench", "--presets", "configs/recipes/sd35m_pickscore.yaml", "--out", out)
    assert line.startswith("flowrl bench: error: unknown bench preset(s) ['configs/recipes/sd35m_pickscore.yaml']")


def test_bench_timed_iterations_and_its_old_spelling():
    assert _parse("bench").timed_iterations == 3
    assert _parse("bench", "--timed-iterations", "5").timed_iterations == 5
    assert _parse("bench", "--iterations", "4").timed_iterations == 4
    assert _parse("overopt", "--iterations", "7").iterations == 7  # training iterations, as run.iterations
    bench = _actions("bench")
    assert (
        bench["--iterations"].help == argparse.SUPPRESS
        and "--iterations, the old spelling" in bench["--timed-iterations"].help
    )


# ------------------------------------------------------------------------------ images per prompt
@pytest.mark.parametrize("spelling", ["--images-per-prompt", "-n"])
def test_generate_counts_images_per_prompt_as_eval_does(spelling):
    args = _parse("generate", "--prompts", "p.txt", "--out", "d", spelling, "3")
    assert args.images_per_prompt == 3 and not hasattr(args, "n")
    assert _parse("generate", "--prompts", "p.txt", "--out", "d").images_per_prompt == 4
    assert (
        _parse("eval", "--reward", "clipscore", "--out", "e.json", "--images-per-prompt", "3").images_per_prompt == 3
    )


@pytest.mark.parametrize("spelling", ["--num-images", "-n"])
def test_sample_counts_the_images_of_its_one_prompt(spelling):
    assert _parse("sample", "--prompt", "a star", spelling, "2").num_images == 2
    assert _parse("sample", "--prompt", "a star").num_images == 8


def test_the_old_spellings_are_checked_and_hidden(capsys):
    assert _fails(capsys, "generate", "--prompts", "p.txt", "--out", "d", "-n", "0") == (
        "flowrl generate: error: argument -n: must be >= 1, got 0"
    )
    for command, new in (("generate", "--images-per-prompt"), ("sample", "--num-images")):
        options = _actions(command)
        assert options["-n"].help == argparse.SUPPRESS and "-n, the old spelling, still works" in options[new].help


# ------------------------------------------------------------------------------ --option [NAME.]KEY=VALUE
def test_reward_options_are_spelt_alike_with_or_without_the_reward_name():
    one = cli._reward_options(["pickscore"], ["pickscore.model_path=/ckpt/p", "batch=8"])
    assert one == {"pickscore": {"model_path": "/ckpt/p", "batch": 8}}
    spec = "/tmp/rewards.py:score"  # a reward file's path: its dots are not the option's
    assert cli._reward_options([spec], [f"{spec}.offset=1.5", "scale=2"]) == {spec: {"offset": 1.5, "scale": 2}}
    with pytest.raises(
        ValueError, match=r"--option 'clipscore.x=1' is for reward 'clipscore', not one of .*pickscore"
    ):
        cli._reward_options(["pickscore"], ["clipscore.x=1"])


def test_score_and_serve_reward_take_the_reward_named_option(tmp_path, monkeypatch, capsys):
    import flowrl.rewards

    served = {}
    monkeypatch.setattr(flowrl.rewards, "serve", lambda name, **kwargs: served.update(name=name, **kwargs))
    cli.main(["serve-reward", "jpeg_compressibility", "--option", "jpeg_compressibility.quality=80", "--port", "0"])
    assert served["name"] == "jpeg_compressibility" and served["quality"] == 80
    cli.main(["serve-reward", "jpeg_compressibility", "--option", "quality=70", "--port", "0"])
    assert served["quality"] == 70
    line = _fails(capsys, "score", tmp_path, "--reward", "jpeg_compressibility", "--option", "pickscore.quality=80")
    assert "is for reward 'pickscore', not one of this command's: jpeg_compressibility" in line


# ------------------------------------------------------------------------------ --json a flag, files by --out
@pytest.fixture
def plan(monkeypatch):
    """flowrl.plan's memory plan stubbed: the CLI's handling of its output is what is tested."""
    import flowrl.plan

    plan = {"processes": 2, "trained_params": 10}
    monkeypatch.setattr(
        flowrl.plan, "memory_plan", lambda config, processes, family: {**plan, "lr": config.train.learning_rate}
    )
    monkeypatch.setattr(flowrl.plan, "format_plan", lambda p: "TEXT PLAN")
    return plan


def test_memory_json_is_a_flag_as_configs_and_out_writes_the_file(tmp_path, capsys, plan):
    cli.main(["memory", "quickstart", "--json"])
    assert json.loads(capsys.readouterr().out)["processes"] == 2
    out = tmp_path / "plan.json"
    cli.main(["memory", "quickstart", "--out", str(out)])
    assert capsys.readouterr().out.strip() == "TEXT PLAN" and json.loads(out.read_text())["trained_params"] == 10
    cli.main(["memory", "quickstart", "--json", "train.learning_rate=0.5"])  # an override after the flag
    assert json.loads(capsys.readouterr().out)["lr"] == 0.5


def test_memory_json_file_the_old_spelling_still_writes_it(tmp_path, capsys, plan):
    out = tmp_path / "old.json"
    cli.main(["memory", "quickstart", "--json", str(out)])
    assert capsys.readouterr().out.strip() == "TEXT PLAN" and json.loads(out.read_text())["processes"] == 2
    new = tmp_path / "new.json"
    line = _fails(capsys, "memory", "quickstart", "--json", out, "--out", new)
    assert line == f"flowrl memory: error: --json {out} is the old spelling of --out FILE; give --out {new} alone"
