"""The config's help where the code can read it: every key has a help text, ``flowrl config`` prints each key with its
type, value, default and help, and ``flowrl train --help`` points to it."""

from __future__ import annotations

import json
import subprocess
import sys

from flowrl.config import describe, load_config


def test_every_config_key_has_a_help_text():
    rows = describe()
    missing = [r["key"] for r in rows if not r["help"].strip()]
    assert not missing, f"config keys without help (flowrl.fields.setting): {missing}"
    assert len(rows) > 80 and len({r["key"] for r in rows}) == len(rows)
    keys = {r["key"] for r in rows}
    assert {
        "sampling.kernel",
        "sampling.shape",
        "sampling.tree.split_steps",
        "train.nft.beta",
        "run.mixed_precision",
        "eval.held_out",
    } <= keys


def test_describe_shows_a_presets_values_beside_the_defaults():
    rows = {r["key"]: r for r in describe(load_config("configs/branch_grpo.yaml"))}
    assert rows["sampling.kernel"]["value"] == "dance_sde" and rows["sampling.kernel"]["default"] == "flow_sde"
    assert rows["sampling.shape"]["value"] == "tree" and rows["sampling.tree.split_steps"]["value"] == [0, 2, 4]


def test_flowrl_config_lists_the_presets_and_the_recipes_apart(capsys):
    from flowrl.cli import main

    main(["config", "--list"])
    out = capsys.readouterr().out
    presets, recipes = out.split("Recipes for real models")
    assert "configs/quickstart.yaml" in presets and "configs/recipes/" not in presets
    line = next(x for x in recipes.splitlines() if "configs/recipes/sd35m_pickscore.yaml" in x)
    assert "Flow-GRPO's PickScore recipe" in line and "configs/quickstart.yaml" not in recipes
    main(["config"])  # the defaults' keys, then what there is to start from
    assert "train.method: str = 'grpo'" in (out := capsys.readouterr().out) and "Recipes for real models (" in out


def test_flowrl_config_prints_every_key_and_train_help_points_to_it(capsys):
    from flowrl.cli import main

    main(["config", "configs/quickstart.yaml", "run.iterations=7"])
    out = capsys.readouterr().out
    assert "run.iterations: int = 7  (default 100)" in out and "\n    training iterations\n" in out
    assert "train.method: str = 'nft'  (default 'grpo')" in out
    main(["config", "--json"])
    rows = json.loads(capsys.readouterr().out)
    assert {"key", "type", "value", "default", "help"} == set(rows[0])
    help_text = subprocess.run(
        [sys.executable, "-m", "flowrl.cli", "train", "--help"], capture_output=True, text=True, check=True
    ).stdout
    assert "flowrl config [CONFIG]" in help_text


def test_train_last_step_is_refused_for_every_unit_eta_kernel_on_a_schedule_that_ends_at_zero(tmp_path):
    """The config refuses what the first rollout would: a unit-eta kernel's step onto t = 0 has std 0 (no log-prob).
    A DDPM scheduler that keeps the final alpha below one (SD 1.5's, DDPO's recipe) ends above 0 and trains it."""
    import pytest

    from flowrl.config import ConfigError
    from flowrl.samplers import UNIT_ETA_KERNELS

    assert {"cps", "ddim", "ddpm"} <= set(UNIT_ETA_KERNELS)
    for kernel in UNIT_ETA_KERNELS:
        over = [f"sampling.kernel={kernel}", "sampling.noise_level=1.0", "sampling.train_last_step=true"]
        with pytest.raises(ConfigError, match=f"'sampling.train_last_step' must be false with kernel '{kernel}'"):
            load_config(None, over)  # assets/tiny-sd3: a flow-matching schedule
        assert load_config(None, over[:2]).sampling.train_last_step is False
    (tmp_path / "scheduler").mkdir()
    config = {"_class_name": "DDIMScheduler", "set_alpha_to_one": False}
    (tmp_path / "scheduler" / "scheduler_config.json").write_text(json.dumps(config))
    over = [
        f"model.path={tmp_path}",
        "sampling.kernel=ddim",
        "sampling.noise_level=1.0",
        "sampling.train_last_step=true",
    ]
    assert load_config(None, over).sampling.train_last_step
    (tmp_path / "scheduler" / "scheduler_config.json").write_text(json.dumps({**config, "set_alpha_to_one": True}))
    with pytest.raises(ConfigError, match="sampling.train_last_step"):
        load_config(None, over)


def test_the_help_of_registered_names_is_read_from_the_registries():
    """train.method, sampling.kernel and sampling.shape list every registered name (a new one touches no list here)."""
    from flowrl.methods import METHODS, SHAPES
    from flowrl.samplers import STOCHASTIC_KERNELS

    rows = {r["key"]: r["help"] for r in describe()}
    for key, names in (("train.method", METHODS), ("sampling.kernel", STOCHASTIC_KERNELS), ("sampling.shape", SHAPES)):
        assert all(f"{name} (" in rows[key] for name in names), (key, rows[key])
    assert "grpo (SDE rollouts" in rows["train.method"] and "ddim (DDPO)" in rows["sampling.kernel"]
