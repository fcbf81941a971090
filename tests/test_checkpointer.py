"""The run folder's checkpoints and exports (flowrl.checkpointer): save with pruning, resume with its checks, the
evaluation files and the artifacts of a finished run, with a real run folder and verified checkpoints around a fake
policy, method and model."""

import contextlib
import json
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from flowrl.checkpoint import save_checkpoint, verify_checkpoint
from flowrl.checkpointer import Checkpointer
from flowrl.config import ConfigError, load_config
from flowrl.rewards import WeightedSum
from flowrl.run import RunFolder


class _Policy:
    """Writes real checkpoints of one tensor; restores only their JSON state."""

    plain_export = False
    lockstep = False  # one process: nothing gathered

    def __init__(self):
        self.weights, self.in_ema = {"w": torch.arange(3.0)}, False

    def save(self, directory, iteration, extra, write_extra_files):
        optimizer = {"state": {}, "param_groups": []}
        return save_checkpoint(
            directory, iteration, self.weights, optimizer, extra=extra, write_extra_files=write_extra_files
        )

    def load(self, path):
        return verify_checkpoint(path)

    def exported(self):
        return self.weights

    def checkpoint_mib(self, extra_copies=0):
        return 12.0

    @contextlib.contextmanager
    def ema_weights(self):
        self.in_ema = True
        yield
        self.in_ema = False


class _Method:
    def __init__(self):
        self.loaded, self.files_from = None, None

    def state_dict(self):
        return {"beta": 0.5}

    def load_state_dict(self, state):
        self.loaded = state

    def save_files(self, folder):
        (folder / "method.txt").write_text("held")

    def load_files(self, path):
        self.files_from = path

    def sampling_weights(self):
        return None


class _Model:
    def __init__(self):
        self.saved = []

    def save_lora(self, folder, weights):
        folder.mkdir(parents=True)
        (folder / "lora.txt").write_text(str(sorted(weights)))
        self.saved.append(("lora", folder.name))

    def save_pipeline(self, folder, plain_copy):
        self.saved.append(("pipeline", folder.name, plain_copy))


def _checkpointer(tmp_path, resume=False, main=True, **over):
    overrides = {"run.iterations": 3, "run.save_every": 1, "run.keep_checkpoints": 2, "model.lora_rank": 2, **over}
    cfg = load_config(None, [f"{k}={v}" for k, v in overrides.items()])
    processes = SimpleNamespace(is_main_process=main, num_processes=1)
    run = RunFolder(tmp_path / "run", processes, resume)
    run.path.mkdir(parents=True, exist_ok=True)
    return Checkpointer(cfg, run, _Model(), _Policy(), _Method())


def _rows(path) -> list[int]:
    return [json.loads(line)["iteration"] for line in path.read_text().splitlines()]


def test_save_writes_verified_checkpoints_and_keeps_the_newest(tmp_path):
    checkpointer = _checkpointer(tmp_path)
    for it in (1, 2, 3):
        checkpointer.save(it, elapsed=10.0 * it)
    folders = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    assert folders == ["checkpoint-000002", "checkpoint-000003"]  # run.keep_checkpoints=2
    state = verify_checkpoint(tmp_path / "run" / "checkpoints" / "checkpoint-000003")
    assert state["extra"] == {"elapsed_s": 30.0, "beta": 0.5}
    assert {"method.txt", "lora/lora.txt"} <= set(state["files"])  # sealed inside the checkpoint


def test_resume_restores_the_newest_checkpoint_then_cuts_the_metrics(tmp_path):
    first = _checkpointer(tmp_path)
    assert first.resume() == (0, 0.0) and first.method.loaded is None  # run.resume off
    for it in (1, 2):
        first.save(it, elapsed=5.0 * it)
    first.write_eval("eval_before.json", {"overall": 0.25})
    metrics = tmp_path / "run" / "metrics.jsonl"
    metrics.write_text("".join(json.dumps({"iteration": i}) + "\n" for i in (1, 2, 3)))  # row 3: after the checkpoint
    resumed = _checkpointer(tmp_path, resume=True)
    assert resumed.resume() == (2, 10.0)
    assert resumed.method.loaded == {"elapsed_s": 10.0, "beta": 0.5}
    assert resumed.method.files_from.name == "checkpoint-000002"
    assert _rows(metrics) == [1, 2]


def test_resume_refuses_fewer_iterations_than_the_checkpoint_before_loading(tmp_path):
    first = _checkpointer(tmp_path)
    first.save(3, elapsed=1.0)
    first.write_eval("eval_before.json", {"overall": 0.25})
    metrics = tmp_path / "run" / "metrics.jsonl"
    metrics.write_text("".join(json.dumps({"iteration": i}) + "\n" for i in (1, 2, 3)))
    short = _checkpointer(tmp_path, resume=True, **{"run.iterations": 2})
    with pytest.raises(ConfigError, match=r"config key 'run.iterations': 2 is below .*set run.iterations >= 3"):
        short.resume()
    assert short.method.loaded is None and _rows(metrics) == [1, 2, 3]  # nothing loaded or cut


def test_the_evaluation_files_round_trip(tmp_path):
    checkpointer = _checkpointer(tmp_path)
    checkpointer.write_eval("eval.json", {"before": {"overall": 0.25}, "iterations": 3})
    assert checkpointer.read_eval("eval.json") == {"before": {"overall": 0.25}, "iterations": 3}
    grid = torch.rand(12, 3, 8, 8)
    checkpointer.write_grid_before(grid)
    assert torch.equal(load_file(tmp_path / "run" / "grid_before.safetensors")["images"], grid)


def test_full_fine_tuning_without_a_checkpoint_limit_is_warned_about(tmp_path):
    with pytest.warns(UserWarning, match="keeps all 3 checkpoints of about 12 MiB each"):
        _checkpointer(tmp_path, **{"model.lora_rank": 0, "run.keep_checkpoints": "null"})


def _finished_run(checkpointer) -> None:
    """The files a finished run has before its export: metrics, eval.json and the grid's before half."""
    rows = [{"iteration": i, "reward/total/mean": 0.1 * i, "reward/gold/mean": 0.2 * i} for i in (1, 2, 3)]
    (checkpointer.out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    evaluation = {"overall": 0.5, "per_tag": {"colors": 0.5}}
    checkpointer.write_eval("eval.json", {"before": evaluation, "after": evaluation, "iterations": 3})
    checkpointer.write_grid_before(torch.rand(12, 3, 8, 8))


def test_export_writes_the_plots_the_grid_and_the_lora_on_the_main_process(tmp_path):
    logged = []
    trackers = SimpleNamespace(log_images=lambda name, images, it: logged.append((name, tuple(images.shape), it)))
    grid = lambda: torch.rand(12, 3, 8, 8)  # noqa: E731
    evaluator = SimpleNamespace(grid_images=grid, shared_grid=grid, grid_metas=lambda: [{"prompt": "p"}] * 12)
    rewards = WeightedSum({"total": (lambda *a: None, 1.0), "gold": (lambda *a: None, 0.0)})
    checkpointer = _checkpointer(tmp_path)
    _finished_run(checkpointer)
    checkpointer.export(evaluator, trackers, rewards)
    assert all(
        (tmp_path / "run" / name).stat().st_size > 0 for name in ("reward_curve.png", "diagnostics.png", "grid.png")
    )
    assert logged == [("grid/after", (12, 3, 8, 8), 3)] and checkpointer.model.saved == [("lora", "lora")]
    other = _checkpointer(tmp_path / "other", main=False)
    other.export(evaluator, trackers, rewards)  # not the main process: nothing read or written
    assert not any(other.out.iterdir()) and other.model.saved == []


def test_export_of_a_full_fine_tune_saves_the_pipeline_with_the_ema_weights(tmp_path):
    checkpointer = _checkpointer(tmp_path, **{"model.lora_rank": 0})
    _finished_run(checkpointer)
    seen = []
    checkpointer.model.save_pipeline = lambda folder, plain_copy: seen.append(
        (folder.name, checkpointer.policy.in_ema)
    )
    grid = lambda: torch.rand(12, 3, 8, 8)  # noqa: E731
    evaluator = SimpleNamespace(grid_images=grid, shared_grid=grid, grid_metas=lambda: [{"prompt": "p"}] * 12)
    checkpointer.export(
        evaluator, SimpleNamespace(log_images=lambda *a: None), WeightedSum({"r": (lambda *a: None, 1.0)})
    )
    assert seen == [("pipeline", True)]
