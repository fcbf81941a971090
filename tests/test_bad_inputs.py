"""Hostile inputs (docs/reliability.md): each ends in one line on stderr with exit status 2, or in a correct
recovery, and nothing a verified checkpoint needs is lost. Damaged checkpoints, two writers on one run folder,
unwritable outputs, broken or pickled model files and LoRAs, rewards that raise, and out-of-range options."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO, tiny_overrides
from safetensors.torch import save_file

from flowrl import cli
from flowrl.checkpoint import (
    CheckpointError,
    choose_checkpoint,
    latest_checkpoint,
    load_checkpoint,
    prune_checkpoints,
    save_checkpoint,
    verify_checkpoint,
)
from flowrl.config import load_config
from flowrl.files import OutputError, RunFolderInUse, RunLock, check_safetensors
from flowrl.trainer import Trainer


def bad_key_reward(images, prompts, metadata):
    """A user reward with a bug of its own."""
    raise KeyError("score_key")


def _fails(capsys, *argv) -> str:
    """Run ``flowrl ARGV`` in-process; assert exit status 2 and one line on stderr, and return that line."""
    with pytest.raises(SystemExit) as exit_info:
        cli.main([str(a) for a in argv])
    assert exit_info.value.code == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert "Traceback" not in "\n".join(lines)
    errors = [line for line in lines if line.startswith("flowrl ") and ": error: " in line]  # beside progress lines
    assert len(errors) == 1, lines
    return errors[0]


def _cli(*args, env=None) -> subprocess.CompletedProcess:
    """``python -m flowrl.cli ARGS`` in a subprocess (from the repository root)."""
    return subprocess.run(
        [sys.executable, "-m", "flowrl.cli", *map(str, args)],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, **(env or {})},
        timeout=600,
    )


def _one_error_line(r: subprocess.CompletedProcess) -> str:
    """The one ``flowrl ...: error:`` line of a failed command (exit status 2, no traceback)."""
    assert r.returncode == 2, r.stderr[-2000:]
    assert "Traceback" not in r.stderr, r.stderr[-2000:]
    errors = [line for line in r.stderr.splitlines() if ": error: " in line]
    assert len(errors) == 1, r.stderr[-2000:]
    return errors[0]


def _tiny_config(tmp_path, random_pipeline, prompt_files, out="run", reward="jpeg_compressibility", **extra):
    (tmp_path / "c.yaml").write_text(f"rewards:\n  {reward!r}:\n    weight: 1.0\n")
    return tmp_path / "c.yaml", tiny_overrides(
        random_pipeline, *prompt_files, tmp_path / out, **{"run.mixed_precision": "no", **extra}
    )


# ------------------------------------------------------------------------------------------- checkpoints
def _three_checkpoints(folder: Path) -> list[Path]:
    w = torch.nn.Parameter(torch.arange(4.0))
    opt = torch.optim.AdamW([w])
    return [save_checkpoint(folder, it, {"w": w}, opt) for it in (1, 2, 3)]


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-7])


@pytest.mark.parametrize(
    "damage, reason",
    [
        (lambda c: _truncate(c / "trainable.safetensors"), "trainable.safetensors has .* bytes"),
        (lambda c: _truncate(c / "optimizer.safetensors"), "optimizer.safetensors has .* bytes"),
        (
            lambda c: (c / "trainable.safetensors").write_bytes(
                b"\x80\x04" + bytes((c / "trainable.safetensors").stat().st_size - 2)
            ),
            "trainable.safetensors does not match its SHA-256",
        ),
        (lambda c: (c / "optimizer.safetensors").unlink(), "incomplete: no optimizer.safetensors"),
        (lambda c: (c / "state.json").write_text('{"iteration": 3, "opt'), "unreadable state.json"),
        (
            lambda c: (c / "state.json").write_text(
                json.dumps({k: v for k, v in json.loads((c / "state.json").read_text()).items() if k != "optimizer"})
            ),
            "no key 'optimizer'",
        ),
    ],
)
def test_a_damaged_newest_checkpoint_is_skipped_with_the_reason(tmp_path, damage, reason):
    *_, newest = _three_checkpoints(tmp_path)
    damage(newest)
    path, skipped = choose_checkpoint(tmp_path)
    assert path.name == "checkpoint-000002" and [p.name for p, _ in skipped] == ["checkpoint-000003"]
    assert pytest.raises(CheckpointError, verify_checkpoint, newest).match(reason)
    w = torch.nn.Parameter(torch.zeros(4))
    with pytest.raises(CheckpointError, match=reason):  # loading it directly is refused before anything changes
        load_checkpoint(newest, {"w": w}, torch.optim.AdamW([w]))
    assert torch.equal(w.detach(), torch.zeros(4))
    assert load_checkpoint(path, {"w": w}, torch.optim.AdamW([w]))["iteration"] == 2


def test_state_json_records_every_file_and_prune_keeps_verified_ones(tmp_path):
    first, second, third = _three_checkpoints(tmp_path)
    files = json.loads((third / "state.json").read_text())["files"]
    assert set(files) == {"trainable.safetensors", "optimizer.safetensors"}
    assert files["trainable.safetensors"]["size"] == (third / "trainable.safetensors").stat().st_size
    _truncate(third / "trainable.safetensors")
    _truncate(second / "optimizer.safetensors")
    assert prune_checkpoints(tmp_path, 1) == []  # only checkpoint 1 verifies: it is the one kept
    assert latest_checkpoint(tmp_path) == first and first.is_dir()


def test_a_checkpoint_without_checksums_is_not_trusted(tmp_path):
    *_, newest = _three_checkpoints(tmp_path)
    state = json.loads((newest / "state.json").read_text())
    del state["files"]
    (newest / "state.json").write_text(json.dumps(state))
    with pytest.raises(CheckpointError, match="no file checksums"):
        verify_checkpoint(newest)


@pytest.fixture(scope="module")
def killed_run(tmp_path_factory, random_pipeline, prompt_files):
    """A 2-iteration run with a checkpoint after each iteration (what a run killed after iteration 2 leaves)."""
    tmp = tmp_path_factory.mktemp("killed")
    config, overrides = _tiny_config(tmp, random_pipeline, prompt_files)
    Trainer(load_config(config, overrides)).train()
    return tmp, config, overrides


def _copy_run(killed_run, tmp_path) -> Path:
    shutil.copytree(killed_run[0] / "run", tmp_path / "run")
    return tmp_path / "run"


def test_resume_skips_a_corrupt_newest_checkpoint_and_says_so(tmp_path, killed_run, capsys):
    _, config, overrides = killed_run
    run = _copy_run(killed_run, tmp_path)
    _truncate(run / "checkpoints/checkpoint-000002/trainable.safetensors")
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"iteration": 3, "rew')  # a row torn by the crash
    cfg = load_config(config, [*overrides, f"run.output_dir={run}", "run.resume=true"])
    Trainer(cfg).train()
    err = capsys.readouterr().err
    line = next(line for line in err.splitlines() if "resuming" in line)
    assert "from checkpoint-000001" in line and "skipped newer" in line and "checkpoint-000002" in line
    assert "trainable.safetensors has" in line
    assert [json.loads(l)["iteration"] for l in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert verify_checkpoint(run / "checkpoints/checkpoint-000002")["iteration"] == 2  # written again, whole
    assert verify_checkpoint(run / "checkpoints/checkpoint-000001")["iteration"] == 1


def test_resume_with_no_verified_checkpoint_refuses_and_deletes_nothing(tmp_path, killed_run):
    _, config, overrides = killed_run
    run = _copy_run(killed_run, tmp_path)
    for c in (run / "checkpoints").iterdir():
        (c / "state.json").write_text("{")
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file() and p.name != ".flowrl.lock"}
    r = _cli("train", config, *overrides, f"run.output_dir={run}", "run.resume=true")
    line = _one_error_line(r)
    assert "holds no verified checkpoint" in line and "nothing was deleted" in line
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file() and p.name != ".flowrl.lock"} == before


def test_resume_with_metrics_but_no_checkpoint_refuses(tmp_path, random_pipeline, prompt_files):
    config, overrides = _tiny_config(tmp_path, random_pipeline, prompt_files, **{"run.resume": "true"})
    (tmp_path / "run").mkdir()
    (tmp_path / "run/metrics.jsonl").write_text('{"iteration": 1}\n')
    trainer = Trainer(load_config(config, overrides))
    with pytest.raises(CheckpointError, match="metrics.jsonl has rows"):
        trainer.checkpointer.resume()
    assert (tmp_path / "run/metrics.jsonl").read_text() == '{"iteration": 1}\n'


def test_resume_needs_a_readable_eval_before(tmp_path, killed_run):
    _, config, overrides = killed_run
    run = _copy_run(killed_run, tmp_path)
    (run / "eval_before.json").unlink()
    rows = (run / "metrics.jsonl").read_text()
    line = _one_error_line(
        _cli("train", config, *overrides, f"run.output_dir={run}", "run.resume=true", "run.iterations=3")
    )
    assert "eval_before.json" in line and (run / "metrics.jsonl").read_text() == rows


def test_an_existing_run_is_recognised_before_its_first_iteration(tmp_path, random_pipeline, prompt_files, capsys):
    config, overrides = _tiny_config(tmp_path, random_pipeline, prompt_files)
    (tmp_path / "run").mkdir()
    (tmp_path / "run/config.yaml").write_text("original")  # a run that has not finished iteration 1
    line = _fails(capsys, "train", config, *overrides)
    assert "already holds a run (config.yaml)" in line and "run.resume=true" in line
    assert (tmp_path / "run/config.yaml").read_text() == "original"


# ------------------------------------------------------------------------------------------ two writers
_HOLDER = (
    "import sys, time; from flowrl.files import RunLock; RunLock(sys.argv[1]).acquire(); "
    "print('locked', flush=True); time.sleep(600)"
)


def _hold_lock(folder: Path) -> subprocess.Popen:
    """Another process holding ``folder``'s lock (until it is killed)."""
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(folder)], cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    assert holder.stdout.readline().strip() == "locked"
    return holder


@pytest.mark.slow  # 15 s of subprocesses: in CI (CI=true); the default run keeps the default suite under 15 min
def test_two_writers_cannot_share_a_run_folder(tmp_path, random_pipeline, prompt_files):
    config, overrides = _tiny_config(tmp_path, random_pipeline, prompt_files)
    holder = _hold_lock(tmp_path / "run")
    try:
        for extra in ([], ["run.resume=true"]):
            line = _one_error_line(_cli("train", config, *overrides, *extra))
            assert line == f"flowrl train: error: run folder {tmp_path / 'run'} is in use by process {holder.pid}"
        assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [".flowrl.lock"]  # nothing written
        trainer_cfg = load_config(config, overrides)
        with pytest.raises(RunFolderInUse, match=f"in use by process {holder.pid}"):
            Trainer(trainer_cfg)
    finally:
        holder.kill()  # a crash: the OS releases the lock
        holder.wait()
    with RunLock(tmp_path / "run") as lock:  # free again, and now held here
        assert lock.held
        with pytest.raises(RunFolderInUse, match=f"in use by process {os.getpid()}"):
            RunLock(tmp_path / "run").acquire()


def test_only_the_main_process_probes_the_lock(tmp_path, monkeypatch):
    """The processes of one run build their RunFolder at once; had each probed the lock file, one probe could find
    another's and refuse the run (a resumed folder keeps its lock file). Only the main process probes; the others
    take its verdict."""
    from types import SimpleNamespace

    import accelerate.utils

    from flowrl.run import RunFolder

    monkeypatch.setattr(accelerate.utils, "broadcast_object_list", lambda objs, from_process=0: [None, None])
    with RunLock(tmp_path / "run"):  # the lock file exists and is taken, as another process's probe would hold it
        RunFolder(tmp_path / "run", SimpleNamespace(is_main_process=False, num_processes=2), resume=True)
        with pytest.raises(RunFolderInUse):  # the main process does probe it
            RunFolder(tmp_path / "run", SimpleNamespace(is_main_process=True, num_processes=1), resume=True)


def test_the_lock_is_taken_in_train_after_the_constructor_checks(tmp_path, random_pipeline, prompt_files):
    """Two trainers built for one folder: the one that trains first holds it; the other is refused in train()."""
    config, overrides = _tiny_config(tmp_path, random_pipeline, prompt_files, **{"run.iterations": 1})
    first, second = (Trainer(load_config(config, overrides)) for _ in range(2))
    with first.run.hold():
        with pytest.raises(RunFolderInUse, match=f"in use by process {os.getpid()}"):
            second.train()
    assert not first.run.lock.held
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [".flowrl.lock"]


# --------------------------------------------------------------------------------------------- outputs
@pytest.mark.parametrize(
    "command, out, message",
    [
        ("sample", "g.xyz", "unknown file type '.xyz'"),
        ("sample", "blocker/g.png", "cannot be written"),
        ("eval", "e.txt", "unknown file type '.txt'"),
        ("eval", "blocker/e.json", "cannot be written"),
        ("eval", ".", "is a folder"),
    ],
)
def test_outputs_are_probed_before_the_model_loads(tmp_path, capsys, monkeypatch, command, out, message):
    monkeypatch.setattr(cli, "_model", lambda args: pytest.fail("the model loaded"))
    (tmp_path / "blocker").write_text("a file where a folder should be")
    target = tmp_path / out if out != "." else tmp_path
    extra = ["--prompts", "test"] if command == "eval" else ["--prompt", "x"]
    line = _fails(capsys, command, "--out", target, *extra)
    assert line.startswith(f"flowrl {command}: error: --out {target}") and message in line


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_an_output_folder_without_permission_is_refused_first(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(cli, "_model", lambda args: pytest.fail("the model loaded"))
    (tmp_path / "ro").mkdir(mode=0o500)
    assert "cannot be written" in _fails(capsys, "sample", "--prompt", "x", "--out", tmp_path / "ro/g.png")


def test_an_unwritable_run_folder_is_refused_before_the_model_loads(tmp_path, random_pipeline, prompt_files, capsys):
    config, overrides = _tiny_config(tmp_path, random_pipeline, prompt_files)
    (tmp_path / "blocker").write_text("")
    line = _fails(capsys, "train", config, *overrides, f"run.output_dir={tmp_path / 'blocker/run'}")
    assert "config key 'run.output_dir'" in line and "is a file" in line


def test_sample_and_eval_write_whole_files_only(tmp_path, random_pipeline, prompt_files):
    r = _cli(
        "sample",
        "--model",
        random_pipeline,
        "--prompt",
        "a photo of a star",
        "-n",
        1,
        "--num-steps",
        1,
        "--out",
        tmp_path / "g.jpg",
    )
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "g.jpg").read_bytes()[:2] == b"\xff\xd8"  # a JPEG, written through a temporary file
    assert sorted(p.name for p in tmp_path.iterdir()) == ["g.jpg"]


# ---------------------------------------------------------------------------------------- error contract
@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["eval", "--guidance-scale", "nan", "--out", "e.json"],
            "argument --guidance-scale: must be a finite number, got nan",
        ),
        (["eval", "--images-per-tag", "-5", "--out", "e.json"], "argument --images-per-tag: must be >= 0, got -5"),
        (["sample", "--prompt", ""], "argument --prompt: must not be empty"),
        (["sample", "--prompt", "x", "--shift", "nan"], "argument --shift: must be a finite number, got nan"),
    ],
)
def test_out_of_range_options_are_one_line(capsys, monkeypatch, argv, message):
    monkeypatch.setattr(cli, "_model", lambda args: pytest.fail("the model loaded"))
    assert _fails(capsys, *argv).endswith(f"error: {message}")


def test_a_reward_that_raises_is_named_with_its_exception(tmp_path, random_pipeline, prompt_files, capsys):
    config, overrides = _tiny_config(tmp_path, random_pipeline, prompt_files, reward="test_bad_inputs:bad_key_reward")
    line = _fails(capsys, "train", config, *overrides)
    assert line == "flowrl train: error: reward test_bad_inputs:bad_key_reward raised KeyError: 'score_key'"
    r = _cli("train", config, *overrides, env={"FLOWRL_TRACEBACK": "1", "PYTHONPATH": str(Path(__file__).parent)})
    assert r.returncode != 0 and "Traceback" in r.stderr and "KeyError: 'score_key'" in r.stderr


def test_a_bad_reward_option_is_named_by_its_config_key(tmp_path, random_pipeline, prompt_files, capsys):
    config, overrides = _tiny_config(tmp_path, random_pipeline, prompt_files)
    config.write_text("rewards:\n  jpeg_compressibility:\n    weight: 1.0\n    options: {no_such_option: 1}\n")
    line = _fails(capsys, "train", config, *overrides)
    assert "config key 'rewards.jpeg_compressibility'" in line and "no_such_option" in line


def test_bugs_are_not_disguised_as_bad_input(capsys):
    def buggy(args):
        raise KeyError("w")

    with pytest.raises(KeyError):  # a traceback, not "error: w"
        cli._run(argparse.Namespace(fn=buggy, command="train"))
    assert capsys.readouterr().err == ""


def test_traceback_on_request(monkeypatch):
    monkeypatch.setenv("FLOWRL_TRACEBACK", "1")

    def bad_input(args):
        raise ValueError("bad")

    with pytest.raises(ValueError, match="bad"):
        cli._run(argparse.Namespace(fn=bad_input, command="eval"))


# -------------------------------------------------------------------------------------- model files, LoRAs
@pytest.fixture
def model_copy(tmp_path, random_pipeline) -> Path:
    return Path(shutil.copytree(random_pipeline, tmp_path / "model"))


def _model_fails(capsys, model: Path, tmp_path: Path, prompt_files, random_pipeline) -> tuple[str, str]:
    """The one line of ``flowrl eval`` and of ``flowrl train`` on a damaged model folder."""
    evaluated = _fails(capsys, "eval", "--model", model, "--out", tmp_path / "e.json", "--prompts", prompt_files[1])
    config, overrides = _tiny_config(tmp_path, random_pipeline, prompt_files)
    trained = _fails(capsys, "train", config, *overrides, f"model.path={model}")
    assert not (tmp_path / "run").exists() and not (tmp_path / "e.json").exists()
    return evaluated, trained


def test_a_truncated_model_weight_file_is_one_line(tmp_path, model_copy, prompt_files, random_pipeline, capsys):
    weights = model_copy / "transformer/diffusion_pytorch_model.safetensors"
    _truncate(weights)
    for line in _model_fails(capsys, model_copy, tmp_path, prompt_files, random_pipeline):
        assert f"{weights} is damaged" in line


def test_a_broken_model_index_names_the_file(tmp_path, model_copy, prompt_files, random_pipeline, capsys):
    (model_copy / "model_index.json").write_text('{"_class_name": "StableDiffusion3Pipeline",')
    for line in _model_fails(capsys, model_copy, tmp_path, prompt_files, random_pipeline):
        assert f"{model_copy / 'model_index.json'} is not valid JSON" in line


def test_pickled_weights_only_are_refused_with_the_conversion(
    tmp_path, model_copy, prompt_files, random_pipeline, capsys
):
    (model_copy / "transformer/diffusion_pytorch_model.safetensors").rename(
        model_copy / "transformer/diffusion_pytorch_model.bin"
    )  # never unpickled: its contents do not matter
    for line in _model_fails(capsys, model_copy, tmp_path, prompt_files, random_pipeline):
        assert "holds only pickled weights (diffusion_pytorch_model.bin)" in line and "safe_serialization=True" in line


def test_the_pipeline_is_loaded_with_safetensors_only(monkeypatch, random_pipeline):
    import diffusers

    from flowrl.models import SD3Model

    seen = {}
    real = diffusers.StableDiffusion3Pipeline.from_pretrained.__func__

    def spy(cls, *args, **kwargs):
        seen.update(kwargs)
        return real(cls, *args, **kwargs)

    monkeypatch.setattr(diffusers.StableDiffusion3Pipeline, "from_pretrained", classmethod(spy))
    SD3Model(random_pipeline)
    assert seen["use_safetensors"] is True


def test_damaged_or_foreign_loras_are_one_line(tmp_path, random_pipeline, capsys, killed_run):
    lora = Path(shutil.copytree(killed_run[0] / "run/lora", tmp_path / "lora"))
    file = lora / "pytorch_lora_weights.safetensors"
    args = (
        "sample",
        "--model",
        random_pipeline,
        "--prompt",
        "x",
        "-n",
        1,
        "--num-steps",
        1,
        "--lora",
        lora,
        "--out",
        tmp_path / "g.png",
    )
    _truncate(file)
    assert f"{file} is damaged" in _fails(capsys, *args)
    shutil.copy(killed_run[0] / "run/checkpoints/checkpoint-000001/optimizer.safetensors", file)  # mislabelled
    assert f"{file} " in _fails(capsys, *args)
    file.write_bytes(b"\x80\x04\x95" + bytes(200))  # a pickle under the name
    assert "is not a safetensors file" in _fails(capsys, *args)
    assert not (tmp_path / "g.png").exists()


def test_check_safetensors_accepts_a_whole_file(tmp_path):
    save_file({"a": torch.zeros(3), "b": torch.ones(2, 2)}, tmp_path / "x.safetensors")
    check_safetensors(tmp_path / "x.safetensors")
    save_file({}, tmp_path / "empty.safetensors")
    check_safetensors(tmp_path / "empty.safetensors")
    with pytest.raises(ValueError, match="truncated"):
        (tmp_path / "y.safetensors").write_bytes(b"\x01")
        check_safetensors(tmp_path / "y.safetensors")


def test_output_error_is_a_user_error():
    assert issubclass(OutputError, cli.user_errors()) and issubclass(RunFolderInUse, cli.user_errors())
    assert issubclass(CheckpointError, cli.user_errors())
    assert not issubclass(KeyError, cli.user_errors()) and not issubclass(TypeError, cli.user_errors())


def test_an_unreachable_reward_server_is_one_line_before_any_work(tmp_path, random_pipeline, prompt_files, capsys):
    """A VLM judge whose server does not answer (a closed loopback port) stops `flowrl train` at the rewards' smoke
    call, before any sampling, with the reward, the server and the prompt named on one line."""
    (tmp_path / "c.yaml").write_text(
        "rewards:\n  pref_winrate:\n    weight: 1.0\n    options:\n      judge: vlm\n"
        "      base_url: http://127.0.0.1:1/v1\n      model: m\n      max_retries: 0\n"
        "      timeout: 5\n"
    )
    overrides = tiny_overrides(random_pipeline, *prompt_files, tmp_path / "run", **{"run.mixed_precision": "no"})
    line = _fails(capsys, "train", tmp_path / "c.yaml", *overrides)
    assert line.startswith(
        "flowrl train: error: reward pref_winrate raised RuntimeError: vlm_judge: request to "
        "http://127.0.0.1:1/v1 for prompt "
    ), line
    assert not (tmp_path / "run").exists()  # nothing written


_SAVER = """
import sys, time
import torch
from flowrl.checkpoint import save_checkpoint

folder, iteration = sys.argv[1], int(sys.argv[2])
w = torch.nn.Parameter(torch.arange(4.0) + iteration)
opt = torch.optim.AdamW([w])

def slow(tmp):  # the LoRA files are being written when the process is killed
    (tmp / "lora").mkdir()
    (tmp / "lora" / "pytorch_lora_weights.safetensors").write_bytes(b"partial")
    print("writing", flush=True)
    time.sleep(60)

save_checkpoint(folder, iteration, {"w": w}, opt, write_extra_files=slow if sys.argv[3:] == ["slow"] else None)
"""


def test_a_process_killed_while_writing_a_checkpoint_loses_nothing_checkpointed(tmp_path):
    """SIGKILL in the middle of writing checkpoint 3: checkpoints 1 and 2 stay intact and verified, resume takes 2,
    and saving iteration 3 again (as the resumed run does) replaces the torn attempt."""

    def save(iteration: int, wait: bool = False) -> None:
        p = subprocess.Popen(
            [sys.executable, "-c", _SAVER, str(tmp_path / "checkpoints"), str(iteration), *(["slow"] if wait else [])],
            stdout=subprocess.PIPE,
            text=True,
            cwd=REPO,
        )
        if wait:
            assert p.stdout.readline().strip() == "writing"
            p.kill()  # SIGKILL: no clean-up runs
        assert p.wait(timeout=120) == (-9 if wait else 0)

    save(1), save(2)
    before = {p: p.read_bytes() for p in (tmp_path / "checkpoints").rglob("*") if p.is_file()}
    save(3, wait=True)
    assert {p: p.read_bytes() for p in before} == before  # the two checkpoints are untouched
    assert any(p.name.startswith(".tmp") for p in (tmp_path / "checkpoints").iterdir())  # the torn attempt
    path, skipped = choose_checkpoint(tmp_path / "checkpoints")
    assert path.name == "checkpoint-000002" and skipped == []
    w = torch.nn.Parameter(torch.zeros(4))
    assert load_checkpoint(path, {"w": w}, torch.optim.AdamW([w]))["iteration"] == 2
    assert torch.equal(w.detach(), torch.arange(4.0) + 2)
    save(3)
    assert latest_checkpoint(tmp_path / "checkpoints").name == "checkpoint-000003"
