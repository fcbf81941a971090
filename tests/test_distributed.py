"""Two processes on CPU (torchrun, gloo): the transformer wrapped by accelerate (DDP), no deadlock when the processes
keep different numbers of transitions, identical weights on every process, the gradient of the union of their
transitions, and a split evaluation equal to the single-process one."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import tiny_overrides
from flowrl.config import load_config
from flowrl.methods import DiffusionNFT
from flowrl.trainer import Trainer

HERE = Path(__file__).parent
pytestmark = pytest.mark.slow  # torchrun launches of two processes: run in CI (CI=true) or with -m slow


@pytest.fixture(scope="module")
def two_process_run(tmp_path_factory, random_pipeline, prompt_files):
    tmp = tmp_path_factory.mktemp("ddp")
    (tmp / "c.yaml").write_text("rewards:\n  distributed_worker:rank_reward:\n    weight: 1.0\n")
    overrides = tiny_overrides(random_pipeline, *prompt_files, tmp / "run", **{
        "run.mixed_precision": "no", "run.iterations": 3, "eval.images_per_tag": 3, "train.minibatch_size": 2,
        # step weights normalised over both processes' minibatch; each minibatch accumulated in parts of 3
        "train.step_weighting": "noise_aware", "train.micro_batch_size": 3})
    _launch(tmp, overrides)
    return tmp, overrides


def _env() -> dict[str, str]:
    """The environment of a two-process CPU run: one thread per process, gloo on the loopback only."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo")}


def _launch(tmp: Path, overrides: list[str]) -> None:
    """Train ``tmp/c.yaml`` with ``overrides`` in two torchrun processes (see distributed_worker.py)."""
    env = {**_env(), "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                        str(HERE / "distributed_worker.py"), str(tmp / "c.yaml"), str(tmp), *overrides],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]


def test_two_processes_train_to_identical_weights(two_process_run):
    tmp, _ = two_process_run
    w0, w1 = load_file(tmp / "rank0.safetensors"), load_file(tmp / "rank1.safetensors")
    assert w0.keys() == w1.keys() and all(torch.equal(w0[k], w1[k]) for k in w0)
    assert any(w0[k].abs().sum() > 0 for k in w0 if "lora_B" in k)  # trained (LoRA B starts at zero)
    rows = [json.loads(line) for line in (tmp / "run/metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [1, 2, 3]  # written once, by the main process
    # process 0 alone keeps transitions; the other process still took every optimizer step with it
    assert all(r["policy/optimizer_steps"] >= 1 for r in rows)
    assert (tmp / "run/eval.json").exists()


def test_two_processes_train_diffusion_nft_to_identical_weights(tmp_path, random_pipeline, prompt_files):
    """DiffusionNFT under two processes: process 1's groups have no reward variance, so it keeps no rows and
    takes every optimizer step with a zero gradient; the soft-updated sampling policy stays in step too."""
    (tmp_path / "c.yaml").write_text("base: " + str(HERE.parent / "configs/diffusion_nft.yaml") +
                                     "\nrewards:\n  geneval: null\n  distributed_worker:rank_reward:\n    weight: 1.0\n")
    _launch(tmp_path, tiny_overrides(random_pipeline, *prompt_files, tmp_path / "run", **{
        "run.mixed_precision": "no", "train.minibatch_size": 3, "train.micro_batch_size": 2, "train.nft.timesteps": 2,
        "train.nft.old_decay": 0.5}))
    w0, w1 = load_file(tmp_path / "rank0.safetensors"), load_file(tmp_path / "rank1.safetensors")
    assert w0.keys() == w1.keys() and all(torch.equal(w0[k], w1[k]) for k in w0)
    assert any(w0[k].abs().sum() > 0 for k in w0 if "lora_B" in k)
    rows = [json.loads(line) for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [1, 2] and all(r["policy/optimizer_steps"] >= 2 for r in rows)
    assert (tmp_path / "run/checkpoints/checkpoint-000002" / DiffusionNFT.OLD_POLICY_FILE).is_file()


def test_split_evaluation_equals_the_single_process_one(two_process_run):
    tmp, overrides = two_process_run
    r0, r1 = (json.loads((tmp / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0["num_processes"] == 2 and r0["before"] == r1["before"] and r0["after"] == r1["after"]
    assert r0["wrapped"] == "DistributedDataParallel"  # gradients summed by accelerate's wrapped model
    assert r0["sharded"] == r1["sharded"] == [0.0, 10.0, 20.0, 30.0, 40.0, 50.0, 60.0]
    assert r0["sharded_calls"] == [[0, 2, 4, 6]] and r1["sharded_calls"] == [[1, 3, 5]]
    sys.path.insert(0, str(HERE))
    try:
        single = Trainer(load_config(tmp / "c.yaml", [*overrides, f"run.output_dir={tmp / 'single'}"]))
    finally:
        sys.path.remove(str(HERE))
    before = single.run_eval()
    assert before["n_images"] == r0["before"]["n_images"] == 18
    assert before["per_tag"] == r0["before"]["per_tag"] and before["dense_per_tag"] == r0["before"]["dense_per_tag"]


def test_split_transitions_give_the_gradient_of_their_union(two_process_run):
    """One rollout's transitions, every third on process 0 and the rest on process 1, give the same step as
    all of them on process 0, and as all of them in a single process: the mean over all transitions (with
    the step weights normalised over all of them), whatever the shares."""
    tmp, overrides = two_process_run
    g0, g1 = load_file(tmp / "grads0.safetensors"), load_file(tmp / "grads1.safetensors")
    sys.path.insert(0, str(HERE))
    try:
        from distributed_worker import split_gradient

        single = Trainer(load_config(tmp / "c.yaml", [*overrides, f"run.output_dir={tmp / 'reference'}"]))
        _, reference = split_gradient(single)  # one process keeping every transition
    finally:
        sys.path.remove(str(HERE))
    n = len([k for k in g0 if k.startswith("split.")])
    assert n == len(reference) > 0
    for i in range(n):
        split, whole, ref = g0[f"split.{i}"], g0[f"whole.{i}"], reference[i]
        assert torch.equal(split, g1[f"split.{i}"]) and torch.equal(whole, g1[f"whole.{i}"])  # all-reduced
        tol = 1e-5 * ref.abs().max().item()
        torch.testing.assert_close(whole, ref, rtol=1e-4, atol=tol)
        torch.testing.assert_close(split, ref, rtol=1e-4, atol=tol)
    assert any(r.abs().max() > 0 for r in reference)


def test_flowrl_eval_under_torchrun_equals_one_process(tmp_path, random_pipeline, prompt_files):
    """`torchrun --nproc_per_node 2 -m flowrl.cli eval` splits the images over the processes, writes the
    single process's result once, and both processes exit cleanly (the process group torn down together)."""
    env = _env()
    args = ["eval", "--model", str(random_pipeline), "--prompts", str(prompt_files[1]), "--images-per-tag", "2",
            "--num-steps", "2", "--device", "cpu", "--no-bf16"]
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                          "-m", "flowrl.cli", *args, "--out", str(tmp_path / "two.json")],
                         capture_output=True, text=True, env=env, timeout=600)
    assert two.returncode == 0, two.stderr[-3000:]
    one = subprocess.run([sys.executable, "-m", "flowrl.cli", *args, "--out", str(tmp_path / "one.json")],
                         capture_output=True, text=True, env=env, timeout=600)
    assert one.returncode == 0, one.stderr[-3000:]
    r2, r1 = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("two", "one"))
    assert r2["n_images"] == r1["n_images"] == 12
    assert r2["per_tag"] == r1["per_tag"] and r2["dense_per_tag"] == r1["dense_per_tag"]
