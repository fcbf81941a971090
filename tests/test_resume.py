"""A resume keeps the run's own settings (flowrl.resume): ``flowrl train PRESET run.resume=true KEY=VALUE`` takes the
run folder's ``config.yaml``, applies the keys given with it in one named line, and refuses those that would evaluate the
resumed run differently from its ``eval_before.json``; two evaluations that differ are never printed as one comparison."""

from __future__ import annotations

import json

import pytest
from conftest import read_metrics, tiny_overrides

from flowrl import cli
from flowrl.config import ConfigError, load_config, save_config
from flowrl.evaluator import before_after_line
from flowrl.resume import changed_keys, check_resume, load_run_config, reconcile


def _saved_run(tmp_path, **over) -> tuple:
    """A run folder holding a config.yaml (``over`` on the defaults) and an eval_before.json; (folder, its config)."""
    folder = tmp_path / "run"
    folder.mkdir()
    saved = load_config(None, [f"run.output_dir={folder}", *(f"{k}={v}" for k, v in over.items())])
    save_config(saved, folder / "config.yaml")
    (folder / "eval_before.json").write_text(json.dumps({"overall": 0.25, "per_tag": {}}))
    return folder, saved


def test_a_resume_names_each_changed_key_in_one_line(tmp_path):
    folder, saved = _saved_run(tmp_path, **{"run.iterations": 2})
    given = load_config(
        None, [f"run.output_dir={folder}", "run.resume=true", "run.iterations=3", "train.learning_rate=0.5"]
    )
    lines = check_resume(given, folder)
    assert len(lines) == 1
    assert lines[0].startswith(f"resuming with {folder / 'config.yaml'}; changed: ")
    assert (
        "run.iterations 2 -> 3" in lines[0]
        and "train.learning_rate 0.0003 -> 0.5" in lines[0]
        and "run.resume" not in lines[0]
    )
    same = load_config(None, [f"run.output_dir={folder}", "run.resume=true", "run.iterations=2"])
    assert check_resume(same, folder) == []  # only the switch differs: nothing to say


@pytest.mark.parametrize(
    "key, value",
    [
        ("eval.images_per_tag", 8),
        ("eval.prompts", "train"),
        ("rewards.jpeg_compressibility.weight", 1.0),
        ("model.resolution", 64),
        ("run.mixed_precision", "bf16"),
    ],
)
def test_a_resume_refuses_a_key_that_changes_the_evaluation(tmp_path, key, value):
    folder, saved = _saved_run(tmp_path, **{"eval.images_per_tag": 2})
    given = load_config(None, [f"run.output_dir={folder}", "run.resume=true", f"{key}={value}", "run.iterations=9"])
    with pytest.raises(ConfigError) as e:
        reconcile(saved, given, folder / "config.yaml")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("run.resume: ") and f"{key} " in msg and "eval_before.json" in msg
    assert "run.iterations" not in msg  # only the refused keys are named


def test_placement_and_eval_every_are_not_refused(tmp_path):
    folder, saved = _saved_run(tmp_path)
    given = load_config(None, [f"run.output_dir={folder}", "eval.every=5", "model.vae_placement=cpu"])
    assert set(changed_keys(saved, given)) == {"eval.every", "model.vae_placement"}
    assert len(reconcile(saved, given, folder / "config.yaml")) == 1


def test_a_reward_server_moved_to_another_port_is_not_refused(tmp_path):
    """A reward's connection options (a server restarted on another port, its timeout) change where the reward is
    reached, not what it judges: the resume names them; its model is still refused."""
    server = {"rewards.remote.weight": 1.0, "rewards.remote.options": "{url: 'http://127.0.0.1:1', timeout: 30}"}
    folder, saved = _saved_run(tmp_path, **server)
    moved = "rewards.remote.options={url: 'http://127.0.0.1:2', timeout: 60}"
    given = load_config(None, [f"run.output_dir={folder}", "rewards.remote.weight=1.0", moved])
    lines = reconcile(saved, given, folder / "config.yaml")
    assert len(lines) == 1 and "rewards.remote.options.url" in lines[0]
    other = "rewards.remote.options={url: 'http://127.0.0.1:1', timeout: 30, model: other}"
    with pytest.raises(ConfigError, match=r"rewards\.remote\.options\.model"):
        reconcile(saved, load_config(None, [f"run.output_dir={folder}", "rewards.remote.weight=1.0", other]), "c")


def test_the_cli_resume_reads_the_run_config_not_the_preset(tmp_path):
    folder, _ = _saved_run(tmp_path, **{"sampling.prompts_per_iteration": 4, "eval.images_per_tag": 2})
    preset = tmp_path / "preset.yaml"
    preset.write_text("sampling:\n  prompts_per_iteration: 16\neval:\n  images_per_tag: 64\n")
    config, note = load_run_config(preset, [f"run.output_dir={folder}", "run.resume=true", "run.iterations=3"])
    assert config.sampling.prompts_per_iteration == 4 and config.eval.images_per_tag == 2
    assert config.run.iterations == 3 and config.run.resume and config.run.output_dir == str(folder)
    assert str(preset) in note and "config.yaml" in note
    fresh, note = load_run_config(preset, [f"run.output_dir={tmp_path / 'new'}", "run.resume=true"])
    assert fresh.sampling.prompts_per_iteration == 16 and note is None  # nothing saved: the preset
    # docs/rewards.md's `flowrl train RUN/config.yaml run.resume=true`: that file is read, not set aside
    config, note = load_run_config(folder / "config.yaml", ["run.resume=true", "run.iterations=3"])
    assert config.sampling.prompts_per_iteration == 4 and "with the run's own" in note and "not read" not in note


def test_different_evaluations_are_not_printed_as_one_comparison():
    before = {"overall": 0.25, "n_images": 12, "num_steps": 20, "guidance_scale": 4.5}
    after = {**before, "overall": 0.279}
    assert before_after_line(before, after, "test") == "GenEval strict accuracy on test prompts: 0.250 -> 0.279"
    line = before_after_line(before, {**after, "n_images": 384}, "test")
    assert "->" not in line and "12 images" in line and "384 images" in line and "not compared" in line


def test_resume_with_overrides_keeps_the_run_settings(tmp_path, random_pipeline, prompt_files, capsys):
    """The issue's case: a run started with 2 prompts per iteration and 1 image per tag, resumed from the CLI with the
    default preset's larger settings plus run.iterations=2: iteration 2 draws as many images as iteration 1, and the
    final evaluation as many as the base one."""
    (tmp_path / "c.yaml").write_text("rewards:\n  jpeg_compressibility:\n    weight: 1.0\n")
    run = tmp_path / "run"
    first = tiny_overrides(random_pipeline, *prompt_files, run, **{"run.iterations": 1})
    cli.main(["train", str(tmp_path / "c.yaml"), *first])
    said = [line.removeprefix("flowrl train: ") for line in capsys.readouterr().err.splitlines()]
    # a line before each long piece of work: loading, the base evaluation and its grid, the export
    for start in ("loading ", "checking the rewards", "evaluating the base model", "base model: ", "trained model: "):
        assert any(line.startswith(start) for line in said), start
    # the preset as a user would pass it again, with other sizes than the run's: they are not read
    (tmp_path / "c.yaml").write_text(
        "rewards:\n  jpeg_compressibility:\n    weight: 1.0\nsampling:\n  prompts_per_iteration: 4\n"
        "eval:\n  images_per_tag: 3\n"
    )
    cli.main(["train", str(tmp_path / "c.yaml"), f"run.output_dir={run}", "run.resume=true", "run.iterations=2"])
    captured = capsys.readouterr()
    assert "changed: run.iterations 1 -> 2" in captured.err
    rows = read_metrics(run)
    assert [r["iteration"] for r in rows] == [1, 2]
    assert rows[0]["cost/nfe"] == rows[1]["cost/nfe"]  # the same number of rollouts in both iterations
    result = json.loads((run / "eval.json").read_text())
    assert result["before"]["n_images"] == result["after"]["n_images"]
    assert " -> " in captured.out and "not compared" not in captured.out
    with pytest.raises(SystemExit) as exit_info:  # a key that changes the evaluation: refused, one line
        cli.main(
            ["train", str(tmp_path / "c.yaml"), f"run.output_dir={run}", "run.resume=true", "eval.images_per_tag=3"]
        )
    assert exit_info.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if ": error: " in line]
    assert len(errors) == 1 and "eval.images_per_tag 1 -> 3" in errors[0]


def brightness(images, prompts, metadata):
    """A reward callable at a module's top level: its import path is recorded."""
    return images.flatten(1).mean(1)


class _Scaled:
    def __call__(self, images, prompts, metadata):
        return 2 * images.flatten(1).mean(1)


SCALED = _Scaled()


def test_a_reward_callables_import_path_is_what_builds_it_again():
    import functools

    from flowrl.rewards import build_reward, reward_spec

    assert reward_spec(brightness) == f"{__name__}:brightness" and build_reward(reward_spec(brightness)) is brightness
    assert reward_spec(SCALED) == f"{__name__}:SCALED" and build_reward(f"{__name__}:SCALED") is SCALED

    def local(images, prompts, metadata):
        return images.flatten(1).mean(1)

    script = type("Script", (), {"__call__": lambda self, *a: None, "__module__": "__main__"})()
    for unrecorded in (local, lambda i, p, m: i.mean(), functools.partial(brightness), script):
        assert reward_spec(unrecorded) is None


def test_a_recorded_spec_builds_the_reward_and_a_missing_one_says_what_to_set():
    from flowrl.config import RewardConfig
    from flowrl.scoring import build_rewards

    built = build_rewards({"bright": RewardConfig(weight=2.0, spec=f"{__name__}:brightness")})
    assert built.rewards == {"bright": (brightness, 2.0)}
    with pytest.raises(
        ConfigError, match=r"'rewards\.redness': unknown reward 'redness'.*set rewards\.redness\.spec="
    ):
        build_rewards({"redness": RewardConfig()})


def test_a_resume_may_record_a_spec_the_run_left_unset_but_not_change_one(tmp_path):
    folder, saved = _saved_run(tmp_path, **{"rewards.redness.weight": 1.0})
    given = load_config(None, [f"run.output_dir={folder}", "rewards.redness.weight=1.0", "rewards.redness.spec=m:f"])
    assert reconcile(saved, given, folder / "config.yaml") == [
        f"resuming with {folder / 'config.yaml'}; changed: rewards.redness.spec None -> 'm:f'"
    ]
    other = load_config(None, [f"run.output_dir={folder}", "rewards.redness.weight=1.0", "rewards.redness.spec=m:g"])
    with pytest.raises(ConfigError, match=r"rewards\.redness\.spec 'm:f' -> 'm:g' would evaluate"):
        reconcile(given, other, folder / "config.yaml")


def test_a_run_started_in_python_with_a_reward_callable_resumes_from_the_cli(
    tmp_path, random_pipeline, prompt_files, capsys
):
    """``Trainer(config, rewards={"brightness": brightness})`` records ``rewards.brightness.spec``; ``flowrl train
    RUN/config.yaml run.resume=true`` rebuilds the callable from it and trains on."""
    from flowrl import Trainer

    run = tmp_path / "run"
    config = load_config(None, tiny_overrides(random_pipeline, *prompt_files, run, **{"run.iterations": 1}))
    Trainer(config, rewards={"brightness": (brightness, 2.0)}).train()
    saved = load_config(run / "config.yaml")
    assert set(saved.rewards) == {"brightness"} and saved.rewards["brightness"].spec == f"{__name__}:brightness"
    capsys.readouterr()
    cli.main(["train", str(run / "config.yaml"), "run.resume=true", "run.iterations=2"])
    assert "changed: run.iterations 1 -> 2" in capsys.readouterr().err
    rows = read_metrics(run)
    assert [r["iteration"] for r in rows] == [1, 2] and "reward/brightness/mean" in rows[1]
