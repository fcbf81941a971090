"""Two processes on CPU (torchrun, gloo): the transformer wrapped by accelerate (DDP), no deadlock when the processes
keep different numbers of transitions, identical weights on every process, the gradient of the union of their
transitions, and a split evaluation equal to the single-process one."""

import contextlib
import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from conftest import built_once, read_metrics, save_random_lora, tiny_overrides
from safetensors.torch import load_file

from flowrl.config import load_config
from flowrl.methods import DiffusionNFT
from flowrl.trainer import Trainer

HERE = Path(__file__).parent
pytestmark = pytest.mark.slow  # torchrun launches of two processes: run in CI (CI=true) or with -m slow


@pytest.fixture(scope="module")
def two_process_run(tmp_path_factory, random_pipeline, prompt_files):
    """A DDP run of two processes, three iterations (launched once per test session: :func:`conftest.built_once`)."""
    with built_once(tmp_path_factory, "ddp") as (tmp, todo):
        if todo:
            (tmp / "c.yaml").write_text("rewards:\n  distributed_worker:rank_reward:\n    weight: 1.0\n")
            overrides = tiny_overrides(
                random_pipeline,
                *prompt_files,
                tmp / "run",
                **{
                    "run.mixed_precision": "no",
                    "run.iterations": 3,
                    "eval.images_per_tag": 3,
                    "train.minibatch_size": 2,
                    # step weights normalised over both processes' minibatch; each minibatch accumulated in parts of 3
                    "train.step_weighting": "noise_aware",
                    "train.micro_batch_size": 3,
                },
            )
            _launch(tmp, overrides)
            (tmp / "overrides.json").write_text(json.dumps(overrides))
    return tmp, _fixture_overrides(tmp)


def _fixture_overrides(folder: Path) -> list[str]:
    """The overrides :func:`two_process_run` trained ``folder`` with."""
    return json.loads((folder / "overrides.json").read_text())


def _engine_run(tmp_path_factory, two_process_run, name: str, **engine) -> tuple[Path, Path, list[str]]:
    """The DDP fixture's config and data launched under another engine (:func:`_launch`'s `engine` keywords) into the
    session folder `name`, once per test session (:func:`conftest.built_once`). Returns the folder, the DDP run's
    folder and the overrides."""
    ddp, overrides = two_process_run
    with built_once(tmp_path_factory, name) as (tmp, todo):
        overrides = [o for o in overrides if not o.startswith("run.output_dir=")] + [f"run.output_dir={tmp / 'run'}"]
        if todo:
            (tmp / "c.yaml").write_text((ddp / "c.yaml").read_text())
            _launch(tmp, overrides, **engine)
    return tmp, ddp, overrides


@pytest.fixture(scope="module")
def fsdp2_run(tmp_path_factory, two_process_run):
    """The DDP run's config and data under FSDP2 (accelerate's FSDP2 path forced onto the CPU processes)."""
    tmp, ddp, overrides = _engine_run(tmp_path_factory, two_process_run, "fsdp2", fsdp2=True)
    return tmp, ddp


def _env() -> dict[str, str]:
    """The environment of a two-process CPU run: one thread per process, gloo on the loopback only."""
    return {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
        "PYTHONFAULTHANDLER": "1",  # a process that aborts (ABORT below) prints every thread's Python stack
    }


def _launch(tmp: Path, overrides: list[str], fsdp2: bool | str = False, zero: str = "") -> None:
    """Train ``tmp/c.yaml`` with ``overrides`` in two torchrun processes (see distributed_worker.py), under FSDP2 when
    ``fsdp2`` (``"full_shard"``: resharding after each forward), DeepSpeed ZeRO when ``zero`` (``"stage"`` or
    ``"stage:offload device"``), else DDP."""
    _torchrun(tmp, [str(tmp / "c.yaml"), str(tmp), *overrides], fsdp2, zero)


def _launch_runs(tmp: Path, runs: list[dict], fsdp2: bool | str = False, zero: str = "") -> None:
    """Train several runs (``{"config", "out", "overrides"}`` each) one after another in one launch of two torchrun
    processes, under the engine :func:`_launch` names."""
    (tmp / "runs.json").write_text(json.dumps(runs))
    _torchrun(tmp, ["--runs", str(tmp / "runs.json")], fsdp2, zero)


ABORT = "terminate called without an active exception"
"""A C++ abort (a ``std::thread`` destroyed while joinable) seen in a few CI runs, each time in one process of a
two-process launch while a second pytest-xdist worker ran beside it, under the AVX2 emulation recipe (none in a run on
the native CPU). In the one run whose log showed where (``PYTHONFAULTHANDLER=1``), rank 0 aborted at interpreter exit,
after the run, its evaluation and its exports had finished, with no Python frame on the main thread. The launch is
retried once on it, from a clean run folder (:func:`_run_folders`), with a warning, so that it stays visible without
failing CI."""


def _run_folders(worker_args: list[str]) -> list[Path]:
    """The run folders (``run.output_dir=``) a launch of distributed_worker.py with ``worker_args`` writes, its
    ``--runs`` file's too."""
    overrides = list(worker_args)
    if "--runs" in worker_args:
        runs = json.loads(Path(worker_args[worker_args.index("--runs") + 1]).read_text())
        overrides += [o for run in runs for o in run["overrides"]]
    return [Path(o.split("=", 1)[1]) for o in overrides if o.startswith("run.output_dir=")]


LAUNCH_TIMEOUT_S = float(os.environ.get("FLOWRL_TEST_LAUNCH_TIMEOUT_S", 1200))
"""Seconds a two-process launch may take before it is killed (its whole process group) and the test fails
(``FLOWRL_TEST_LAUNCH_TIMEOUT_S`` sets it): a mismatched collective (one process calling the sharded module more often
than the other) may hang rather than fail."""


def _descendants(pid: int) -> list[int]:
    """The processes descended from ``pid`` (Linux: read from ``/proc``), children before grandchildren."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            children.setdefault(parent, []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        found = children.get(todo.pop(0), [])
        out += found
        todo += found
    return out


def _run_killable(command: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    """``command`` in a session of its own; past `timeout` seconds every process of the session (torchrun and its
    workers) is killed and the AssertionError names the hang."""
    import signal

    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        for pid in [*_descendants(proc.pid), proc.pid]:  # torchrun starts its workers in sessions of their own
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        out, err = proc.communicate(timeout=60)
        raise AssertionError(
            f"torchrun did not finish in {timeout:.0f} s (a mismatched collective hangs); killed. Its last output:\n"
            + (out + err)[-3000:]
        ) from None
    return subprocess.CompletedProcess(command, proc.returncode, out, err)


def _torchrun(tmp: Path, worker_args: list[str], fsdp2: bool | str, zero: str) -> None:
    """distributed_worker.py with ``worker_args`` in two torchrun processes; on failure, rank 0's output in the error
    and the whole log in ``tmp/torchrun.log``; killed and failed past :data:`LAUNCH_TIMEOUT_S`."""
    env = {
        **_env(),
        "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
        "FLOWRL_TEST_FSDP2": fsdp2 if isinstance(fsdp2, str) else "1" if fsdp2 else "0",
        "FLOWRL_TEST_ZERO": zero,
    }
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        str(HERE / "distributed_worker.py"),
        *worker_args,
    ]
    r = _run_killable(command, env, LAUNCH_TIMEOUT_S)
    if r.returncode and ABORT in r.stderr:  # once in two CI runs beside another test worker: launch again, and say so
        (tmp / "torchrun-aborted.log").write_text(r.stdout + r.stderr)
        warnings.warn(f"torchrun aborted ({ABORT!r}; log: {tmp / 'torchrun-aborted.log'}); launched again")
        for folder in _run_folders(worker_args):  # the aborted launch's run would refuse the new one
            shutil.rmtree(folder, ignore_errors=True)
        r = _run_killable(command, env, LAUNCH_TIMEOUT_S)
    if r.returncode:
        (tmp / "torchrun.log").write_text(r.stdout + r.stderr)
        own = [line for line in r.stderr.splitlines() if not line.startswith("[rank1]")]  # rank 1's is the echo
        raise AssertionError(f"torchrun failed (whole log: {tmp / 'torchrun.log'}):\n" + "\n".join(own)[-4000:])


def _free_port() -> int:
    """A TCP port free on the loopback now."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_train_to_the_one_node_weights(two_process_run, tmp_path):
    """The DDP run launched as two machines of one process each (torchrun ``--nnodes 2 --node_rank R`` against a
    rendezvous on this machine's loopback, as docs/distributed.md's multi-node command) trains the weights of the
    one-node two-process run: global rank 1 is local rank 0 of its node, and every file is still written once."""
    ddp, overrides = two_process_run
    (tmp_path / "c.yaml").write_text((ddp / "c.yaml").read_text())
    overrides = [o for o in overrides if not o.startswith("run.output_dir=")] + [f"run.output_dir={tmp_path / 'run'}"]
    env = {**_env(), "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    port = _free_port()
    nodes = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                "2",
                "--node_rank",
                str(rank),
                "--nproc_per_node",
                "1",
                "--master_addr",
                "127.0.0.1",
                "--master_port",
                str(port),
                str(HERE / "distributed_worker.py"),
                str(tmp_path / "c.yaml"),
                str(tmp_path),
                *overrides,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**env, "FLOWRL_TEST_FSDP2": "0", "FLOWRL_TEST_ZERO": ""},
        )
        for rank in (0, 1)
    ]
    logs = [node.communicate(timeout=1200)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], "\n".join(log[-3000:] for log in logs)
    for rank in (0, 1):
        one_node, two_nodes = (
            load_file(ddp / f"rank{rank}.safetensors"),
            load_file(tmp_path / f"rank{rank}.safetensors"),
        )
        assert one_node.keys() == two_nodes.keys()
        for k in one_node:
            torch.testing.assert_close(two_nodes[k], one_node[k], rtol=1e-4, atol=1e-6)
    rows = [json.loads(line) for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [1, 2, 3]  # written once, by the global main process


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
    takes every optimizer step with a zero gradient; the soft-updated sampling policy stays in step too. Under
    DeepSpeed ZeRO-2 (process 0 makes two backwards per step, process 1 a zero-gradient pass and one more) the
    weights and the sampling policy are DDP's within float tolerance."""
    runs = {}
    for name, zero in (("ddp", ""), ("zero2", "2")):
        tmp = tmp_path / name
        tmp.mkdir()
        (tmp / "c.yaml").write_text(
            "base: "
            + str(HERE.parent / "configs/diffusion_nft.yaml")
            + "\nrewards:\n  geneval: null\n  distributed_worker:rank_reward:\n    weight: 1.0\n"
        )
        _launch(
            tmp,
            tiny_overrides(
                random_pipeline,
                *prompt_files,
                tmp / "run",
                **{
                    "run.mixed_precision": "no",
                    "train.minibatch_size": 3,
                    "train.micro_batch_size": 2,
                    "train.nft.timesteps": 2,
                    "train.nft.old_decay": 0.5,
                },
            ),
            zero=zero,
        )
        w0, w1 = load_file(tmp / "rank0.safetensors"), load_file(tmp / "rank1.safetensors")
        assert w0.keys() == w1.keys() and all(torch.equal(w0[k], w1[k]) for k in w0)
        assert any(w0[k].abs().sum() > 0 for k in w0 if "lora_B" in k)
        rows = [json.loads(line) for line in (tmp / "run/metrics.jsonl").read_text().splitlines()]
        assert [r["iteration"] for r in rows] == [1, 2] and all(r["policy/optimizer_steps"] >= 2 for r in rows)
        old = tmp / "run/checkpoints/checkpoint-000002" / DiffusionNFT.OLD_POLICY_FILE
        assert old.is_file()
        runs[name] = (w0, load_file(old))
    for ddp, zero2 in zip(runs["ddp"], runs["zero2"]):  # the weights, then the sampling policy
        assert ddp.keys() == zero2.keys()
        for k in ddp:
            torch.testing.assert_close(zero2[k], ddp[k], rtol=1e-4, atol=1e-6)


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
    before = single.evaluator.evaluate()
    assert before["n_images"] == r0["before"]["n_images"] == 18
    assert before["per_tag"] == r0["before"]["per_tag"] and before["dense_per_tag"] == r0["before"]["dense_per_tag"]


def test_split_transitions_give_the_gradient_of_their_union(two_process_run):
    """One rollout's transitions, every third on process 0 and the rest on process 1, give the same step as
    all of them on process 0, and as all of them in a single process: the mean over all transitions (with
    the step weights normalised over all of them), whatever the shares."""
    tmp, overrides = two_process_run
    _assert_split_gradients_are_one_process(tmp, overrides, "split_gradient")


def _assert_split_gradients_are_one_process(tmp: Path, overrides: list[str], split: str) -> None:
    """The split and whole gradients the two processes recorded in ``tmp`` (``grads{rank}.safetensors``, by the
    worker's function named `split`) are all-reduced (equal on both) and equal to one process training every row of
    the same rollout (``tmp/c.yaml`` with `overrides`, the worker's `split` in this process)."""
    g0, g1 = load_file(tmp / "grads0.safetensors"), load_file(tmp / "grads1.safetensors")
    sys.path.insert(0, str(HERE))
    try:
        import distributed_worker

        single = Trainer(load_config(tmp / "c.yaml", [*overrides, f"run.output_dir={tmp / 'reference'}"]))
        _, reference = getattr(distributed_worker, split)(single)  # one process training every row
    finally:
        sys.path.remove(str(HERE))
    n = len([k for k in g0 if k.startswith("split.")])
    assert n == len(reference) > 0
    for i in range(n):
        split_grad, whole, ref = g0[f"split.{i}"], g0[f"whole.{i}"], reference[i]
        assert torch.equal(split_grad, g1[f"split.{i}"]) and torch.equal(whole, g1[f"whole.{i}"])  # all-reduced
        tol = 1e-5 * ref.abs().max().item()
        torch.testing.assert_close(whole, ref, rtol=1e-4, atol=tol)
        torch.testing.assert_close(split_grad, ref, rtol=1e-4, atol=tol)
    assert any(r.abs().max() > 0 for r in reference)


def test_flowrl_eval_under_torchrun_equals_one_process(tmp_path, random_pipeline, prompt_files):
    """`torchrun --nproc_per_node 2 -m flowrl.cli eval` splits the images over the processes, writes the
    single process's result once, and both processes exit cleanly (the process group torn down together)."""
    env = _env()
    args = [
        "eval",
        "--model",
        str(random_pipeline),
        "--prompts",
        str(prompt_files[1]),
        "--images-per-tag",
        "2",
        "--num-steps",
        "2",
        "--device",
        "cpu",
        "--no-bf16",
    ]
    two = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            "-m",
            "flowrl.cli",
            *args,
            "--out",
            str(tmp_path / "two.json"),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert two.returncode == 0, two.stderr[-3000:]
    one = subprocess.run(
        [sys.executable, "-m", "flowrl.cli", *args, "--out", str(tmp_path / "one.json")],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert one.returncode == 0, one.stderr[-3000:]
    r2, r1 = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("two", "one"))
    assert r2["n_images"] == r1["n_images"] == 12
    assert r2["per_tag"] == r1["per_tag"] and r2["dense_per_tag"] == r1["dense_per_tag"]


def test_fsdp2_trains_the_weights_ddp_trains(fsdp2_run):
    """Under FSDP2 (weights, gradients and AdamW state sharded over the two processes) the run takes the same
    optimizer steps as under DDP: identical weights on both processes, equal to DDP's within float tolerance
    (reduce-scatter and all-reduce add in other orders), the same evaluations, and a checkpoint of whole tensors."""
    tmp, ddp = fsdp2_run
    w0, w1 = load_file(tmp / "rank0.safetensors"), load_file(tmp / "rank1.safetensors")
    ref = load_file(ddp / "rank0.safetensors")
    assert w0.keys() == w1.keys() == ref.keys() and all(torch.equal(w0[k], w1[k]) for k in w0)
    assert any(w0[k].abs().sum() > 0 for k in w0 if "lora_B" in k)
    for k in w0:
        torch.testing.assert_close(w0[k], ref[k], rtol=1e-4, atol=1e-6)
    r0 = json.loads((tmp / "rank0.json").read_text())
    assert r0["wrapped"].startswith("FSDP")  # fully_shard's class around the transformer
    assert r0["before"] == json.loads((ddp / "rank0.json").read_text())["before"]
    saved = load_file(tmp / "run/checkpoints/checkpoint-000003/trainable.safetensors")
    assert saved.keys() == w0.keys() and all(torch.equal(saved[k], w0[k]) for k in w0)
    moments = load_file(tmp / "run/checkpoints/checkpoint-000003/optimizer.safetensors")
    assert {tuple(v.shape) for k, v in moments.items() if k.endswith("exp_avg")} == {
        tuple(v.shape) for v in w0.values()
    }


def test_fsdp2_split_transitions_give_the_gradient_of_their_union(fsdp2_run, two_process_run):
    """The sharded gradients, made whole, equal DDP's for the same split of one rollout's transitions."""
    _assert_sharded_gradients_are_ddps(*fsdp2_run)


def _assert_sharded_gradients_are_ddps(tmp: Path, ddp: Path) -> None:
    """The split-rollout gradients the two processes of the run in ``tmp`` recorded (made whole) are equal on both and
    equal to the DDP run's in ``ddp`` (rtol 1e-4)."""
    g0, g1, d0 = (
        load_file(p) for p in (tmp / "grads0.safetensors", tmp / "grads1.safetensors", ddp / "grads0.safetensors")
    )
    assert g0.keys() == d0.keys() and len(g0) > 0
    for k in g0:
        assert torch.equal(g0[k], g1[k])
        torch.testing.assert_close(g0[k], d0[k], rtol=1e-4, atol=1e-5 * d0[k].abs().max().item())


def test_fsdp2_resume_continues_the_run(fsdp2_run, tmp_path):
    """A two-process FSDP2 run resumed from its second checkpoint (whole weights and AdamW moments read back into
    each process's shards) trains the third iteration to the weights of the run that never stopped."""
    import shutil

    tmp, ddp = fsdp2_run
    shutil.copytree(tmp / "run", tmp_path / "run")
    shutil.rmtree(tmp_path / "run/checkpoints/checkpoint-000003")
    (tmp_path / "c.yaml").write_text((tmp / "c.yaml").read_text())
    overrides = [o for o in _fixture_overrides(ddp) if not o.startswith("run.output_dir=")]
    _launch(tmp_path, [*overrides, f"run.output_dir={tmp_path / 'run'}", "run.resume=true"], fsdp2=True)
    straight, resumed = load_file(tmp / "rank0.safetensors"), load_file(tmp_path / "rank0.safetensors")
    assert any(
        not torch.equal(straight[k], load_file(tmp / "run/checkpoints/checkpoint-000002/trainable.safetensors")[k])
        for k in straight
    )  # the third iteration moved the weights
    for k in straight:
        torch.testing.assert_close(resumed[k], straight[k], rtol=1e-5, atol=1e-7)


def test_fsdp2_full_fine_tuning_matches_ddp_and_exports_the_pipeline(tmp_path, two_process_run):
    """Full fine-tuning (every transformer weight trained) under FSDP2 and under DDP from the same start: the same
    weights within float tolerance, and FSDP2's exported pipeline holds the trained weights, whole."""
    _assert_full_fine_tuning_matches_ddp(tmp_path, two_process_run[0], {"fsdp2": {"fsdp2": True}}, [], "fsdp2")


def _full_fine_tuning_overrides(ddp_tmp: Path, extra: list[str]) -> list[str]:
    """The DDP fixture's overrides for full fine-tuning (every transformer weight, 2 iterations) with ``extra``, without
    ``run.output_dir``."""
    overrides = [o for o in _fixture_overrides(ddp_tmp) if not o.startswith(("run.output_dir=", "run.iterations="))]
    return overrides + ["model.lora_rank=0", "run.iterations=2", "train.learning_rate=1e-4", *extra]


def _assert_full_fine_tuning_matches_ddp(
    tmp_path: Path,
    ddp_tmp: Path,
    engines: dict[str, dict],
    extra: list[str],
    exported_by: str,
    ddp: Path | None = None,
) -> dict[str, Path]:
    """Train the DDP fixture's config with every transformer weight (2 iterations, ``extra`` overrides) under DDP (or
    take the DDP run folder ``ddp`` trained so) and under each of ``engines`` (name -> :func:`_launch` keywords): each
    engine's weights are trained and equal DDP's within float tolerance, and the pipeline ``exported_by`` wrote holds
    them, whole. Returns each run's folder by name."""
    from diffusers import SD3Transformer2DModel

    overrides = _full_fine_tuning_overrides(ddp_tmp, extra)
    runs, folders = {}, {}
    for name, launch in ({**engines} if ddp else {"ddp": {}, **engines}).items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "c.yaml").write_text((ddp_tmp / "c.yaml").read_text())
        _launch(tmp_path / name, [*overrides, f"run.output_dir={tmp_path / name / 'run'}"], **launch)
        folders[name] = tmp_path / name
    if ddp:
        folders["ddp"] = ddp
    runs = {name: load_file(folder / "rank0.safetensors") for name, folder in folders.items()}
    base = dict(
        SD3Transformer2DModel.from_pretrained(_fixture_pipeline(overrides), subfolder="transformer").named_parameters()
    )
    for name in engines:
        assert runs["ddp"].keys() == runs[name].keys() and len(runs["ddp"]) > 10
        assert any(not torch.equal(runs[name][k], base[k].detach()) for k in runs[name])  # trained
        for k in runs["ddp"]:
            torch.testing.assert_close(runs[name][k], runs["ddp"][k], rtol=1e-4, atol=1e-6)
    exported = dict(
        SD3Transformer2DModel.from_pretrained(
            tmp_path / exported_by / "run/pipeline", subfolder="transformer"
        ).named_parameters()
    )
    assert all(torch.equal(exported[k].detach(), runs[exported_by][k]) for k in runs[exported_by])
    return folders


@pytest.fixture(scope="module")
def full_ft_ddp(tmp_path_factory, two_process_run) -> tuple[Path, list[str]]:
    """Full fine-tuning under DDP, one transition per micro-batch (process 0 makes two backwards per optimizer step,
    process 1 none), with a held-out evaluation of 3 images (two on process 0, one on process 1): the reference of the
    ZeRO and FSDP2 full-shard full fine-tuning tests. Returns the run folder and the overrides beside the fixture's."""
    ddp_tmp = two_process_run[0]
    with built_once(tmp_path_factory, "full_ft_ddp") as (tmp, todo):
        extra = [
            "train.micro_batch_size=1",
            f"eval.held_out={tmp / 'held_out.jsonl'}",
            "eval.held_out_images_per_tag=3",
        ]
        if todo:
            test_prompts = next(
                o.split("=", 1)[1] for o in _fixture_overrides(ddp_tmp) if o.startswith("eval.prompts=")
            )
            (tmp / "held_out.jsonl").write_text(Path(test_prompts).read_text().splitlines()[0] + "\n")
            (tmp / "c.yaml").write_text((ddp_tmp / "c.yaml").read_text())
            _launch(tmp, [*_full_fine_tuning_overrides(ddp_tmp, extra), f"run.output_dir={tmp / 'run'}"])
    return tmp, extra


@pytest.fixture(scope="module")
def full_shard_run(tmp_path_factory, two_process_run):
    """The DDP run's config and data under FSDP2 full shard (``configs/accelerate/fsdp2_full_shard.yaml``: each block's
    weights gathered for its forward and backward only), forced onto the CPU processes."""
    tmp, ddp, overrides = _engine_run(tmp_path_factory, two_process_run, "full_shard", fsdp2="full_shard")
    return tmp, ddp


def _checkpoint_files(run: Path) -> dict[str, dict[str, torch.Tensor]]:
    """Every safetensors file of a run folder's checkpoints and LoRA export, by path relative to ``run``."""
    return {
        str(f.relative_to(run)): load_file(f) for f in sorted(run.glob("**/*.safetensors")) if "grid" not in f.name
    }


def _assert_lockstep_run_is_ddps(tmp: Path, ddp: Path, wrapped: str) -> None:
    """The run in ``tmp``, under an engine that gathers the weights in every forward (the module wrapped by
    ``wrapped``), took the DDP run's optimizer steps while process 1 kept no transitions (it ran zero-weight
    micro-batches to match process 0's forwards and backwards) and its evaluation share was padded: the same weights
    within float tolerance on both processes, the same evaluation, the same split evaluation (process 1 padded to 4
    items), the same gradient norms, and checkpoints and LoRA export of the same files and tensors as DDP's (the
    moments within float tolerance)."""
    w0 = _assert_trains_like_ddp(tmp, ddp)
    r0, r1 = (json.loads((tmp / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0["wrapped"].startswith(wrapped)
    assert r0["sharded"] == r1["sharded"] == [0.0, 10.0, 20.0, 30.0, 40.0, 50.0, 60.0]
    assert r0["sharded_calls"] == [[0, 2, 4, 6]] and r1["sharded_calls"] == [[1, 3, 5, 5]]  # padded to 4 items
    files, reference = _checkpoint_files(tmp / "run"), _checkpoint_files(ddp / "run")
    assert (
        files.keys() == reference.keys() and any("optimizer" in f for f in files) and any("lora" in f for f in files)
    )
    for f in files:
        assert files[f].keys() == reference[f].keys(), f
        for k in files[f]:
            tol = (1e-3, 1e-9) if "optimizer" in f else (1e-4, 1e-6)
            torch.testing.assert_close(files[f][k], reference[f][k], rtol=tol[0], atol=tol[1])
    saved = files["checkpoints/checkpoint-000003/trainable.safetensors"]
    assert all(torch.equal(saved[k], w0[k]) for k in w0)
    meta = [
        json.loads((r / "run/checkpoints/checkpoint-000003/state.json").read_text())["optimizer"] for r in (tmp, ddp)
    ]
    assert meta[0] == meta[1]
    rows = [json.loads(line) for line in (tmp / "run/metrics.jsonl").read_text().splitlines()]
    ref_rows = [json.loads(line) for line in (ddp / "run/metrics.jsonl").read_text().splitlines()]
    assert len(rows) == len(ref_rows) == 3
    for r, d in zip(rows, ref_rows):
        assert r["policy/optimizer_steps"] == d["policy/optimizer_steps"]
        assert abs(r["policy/grad_norm"] - d["policy/grad_norm"]) <= 1e-4 * d["policy/grad_norm"]


def test_fsdp2_full_shard_trains_the_weights_ddp_trains_into_the_same_files(full_shard_run):
    """FSDP2 full shard (:func:`_assert_lockstep_run_is_ddps`), with a unit per block, and its sharded gradients of
    one split rollout, made whole, equal to DDP's."""
    tmp, ddp = full_shard_run
    _assert_lockstep_run_is_ddps(tmp, ddp, "FSDP")
    assert json.loads((tmp / "rank0.json").read_text())["fsdp_units"] > 1
    _assert_sharded_gradients_are_ddps(tmp, ddp)


def _assert_resume_is_exact(tmp: Path, ddp: Path, tmp_path: Path, close: bool = False, **launch) -> None:
    """The two-process run in ``tmp`` (the DDP fixture's config, DDP run in ``ddp``), resumed from its second
    checkpoint under the engine ``launch`` names (whole weights and AdamW moments read back into each process's shards
    or partitions), trains the third iteration to the very weights of the run that never stopped (with `close`, within
    rtol 1e-5, atol 1e-7: an offloaded optimizer steps on the CPU copy)."""
    import shutil

    shutil.copytree(tmp / "run", tmp_path / "run")
    shutil.rmtree(tmp_path / "run/checkpoints/checkpoint-000003")
    (tmp_path / "c.yaml").write_text((tmp / "c.yaml").read_text())
    overrides = [o for o in _fixture_overrides(ddp) if not o.startswith("run.output_dir=")]
    _launch(tmp_path, [*overrides, f"run.output_dir={tmp_path / 'run'}", "run.resume=true"], **launch)
    straight, resumed = load_file(tmp / "rank0.safetensors"), load_file(tmp_path / "rank0.safetensors")
    second = load_file(tmp / "run/checkpoints/checkpoint-000002/trainable.safetensors")
    assert any(not torch.equal(straight[k], second[k]) for k in straight)  # the third iteration moved the weights
    assert straight.keys() == resumed.keys()
    for k in straight:
        if close:
            torch.testing.assert_close(resumed[k], straight[k], rtol=1e-5, atol=1e-7)
        else:
            assert torch.equal(resumed[k], straight[k])


def test_fsdp2_full_shard_resume_continues_the_run(full_shard_run, tmp_path):
    """:func:`_assert_resume_is_exact` under FSDP2 full shard."""
    tmp, ddp = full_shard_run
    _assert_resume_is_exact(tmp, ddp, tmp_path, fsdp2="full_shard")


def test_fsdp2_full_shard_full_fine_tuning_matches_ddp_and_exports_the_pipeline(
    tmp_path, two_process_run, full_ft_ddp
):
    """Full fine-tuning under FSDP2 full shard, one transition per micro-batch: process 0 makes two backwards per
    optimizer step, process 1 (no transitions) two zero-weight ones, and of the 3 held-out evaluation images process 1
    draws its one and a padding one. The weights are DDP's within float tolerance, the evaluations DDP's, and the
    exported pipeline (gathered by every process, written by one) holds the trained weights, whole."""
    folders = _assert_full_fine_tuning_matches_ddp(
        tmp_path, two_process_run[0], {"full_shard": {"fsdp2": "full_shard"}}, full_ft_ddp[1], "full_shard",
        ddp=full_ft_ddp[0],
    )  # fmt: skip
    ours, ddp = (json.loads((folders[n] / "rank0.json").read_text()) for n in ("full_shard", "ddp"))
    assert ours["before"]["held_out"]["n_images"] == 3 and ours["before"] == ddp["before"]


@pytest.fixture(scope="module")
def zero2_run(tmp_path_factory, two_process_run):
    """The DDP run's config and data under DeepSpeed ZeRO-2 (forced onto the CPU processes)."""
    tmp, ddp, overrides = _engine_run(tmp_path_factory, two_process_run, "zero2", zero="2")
    return tmp, ddp, overrides


def _assert_trains_like_ddp(tmp: Path, ddp: Path) -> dict[str, torch.Tensor]:
    """Identical weights on both processes of the run in ``tmp``, trained, equal to the DDP run's within float
    tolerance, with its evaluation before training; returns them."""
    w0, w1 = load_file(tmp / "rank0.safetensors"), load_file(tmp / "rank1.safetensors")
    ref = load_file(ddp / "rank0.safetensors")
    assert w0.keys() == w1.keys() == ref.keys() and all(torch.equal(w0[k], w1[k]) for k in w0)
    assert any(w0[k].abs().sum() > 0 for k in w0 if "lora_B" in k)
    for k in w0:
        torch.testing.assert_close(w0[k], ref[k], rtol=1e-4, atol=1e-6)
    assert (
        json.loads((tmp / "rank0.json").read_text())["before"]
        == json.loads((ddp / "rank0.json").read_text())["before"]
    )
    return w0


def test_deepspeed_zero2_trains_the_weights_ddp_trains(zero2_run):
    """Under DeepSpeed ZeRO-2 (AdamW state and gradients partitioned; flowrl calls the engine's backward and step) the
    run takes DDP's optimizer steps: the same weights within float tolerance on both processes, and a checkpoint of
    whole tensors in torch AdamW's layout, whose moments are DDP's."""
    tmp, ddp, _ = zero2_run
    w0 = _assert_trains_like_ddp(tmp, ddp)
    assert json.loads((tmp / "rank0.json").read_text())["wrapped"] == "DeepSpeedEngine"
    saved = load_file(tmp / "run/checkpoints/checkpoint-000003/trainable.safetensors")
    assert saved.keys() == w0.keys() and all(torch.equal(saved[k], w0[k]) for k in w0)
    moments = load_file(tmp / "run/checkpoints/checkpoint-000003/optimizer.safetensors")
    reference = load_file(ddp / "run/checkpoints/checkpoint-000003/optimizer.safetensors")
    assert moments.keys() == reference.keys() and any(k.endswith("exp_avg_sq") for k in moments)
    for k in moments:
        torch.testing.assert_close(moments[k], reference[k], rtol=1e-3, atol=1e-9)
    meta = [
        json.loads((run / "run/checkpoints/checkpoint-000003/state.json").read_text())["optimizer"]
        for run in (tmp, ddp)
    ]
    assert meta[0] == meta[1]  # the same param_groups and layout: either run's checkpoint resumes under the other
    rows = [json.loads(line) for line in (tmp / "run/metrics.jsonl").read_text().splitlines()]
    ref_rows = [json.loads(line) for line in (ddp / "run/metrics.jsonl").read_text().splitlines()]
    for r, d in zip(rows, ref_rows):  # DeepSpeed's clipping norm is DDP's clip_grad_norm_ norm
        assert r["policy/optimizer_steps"] == d["policy/optimizer_steps"]
        assert abs(r["policy/grad_norm"] - d["policy/grad_norm"]) <= 1e-4 * d["policy/grad_norm"]


def test_deepspeed_zero2_resume_with_optimizer_offload_continues_the_run(zero2_run, tmp_path):
    """A ZeRO-2 run resumed from its second checkpoint with the optimizer offloaded to the CPU (whole weights, moments
    and step count written into each process's partitions of the master weights and AdamW state, held by the CPU
    optimizer) trains the third iteration to the weights of the run that never stopped."""
    import shutil

    tmp, _, overrides = zero2_run
    shutil.copytree(tmp / "run", tmp_path / "run")
    shutil.rmtree(tmp_path / "run/checkpoints/checkpoint-000003")
    (tmp_path / "c.yaml").write_text((tmp / "c.yaml").read_text())
    overrides = [o for o in overrides if not o.startswith("run.output_dir=")]
    _launch(tmp_path, [*overrides, f"run.output_dir={tmp_path / 'run'}", "run.resume=true"], zero="2:cpu")
    assert json.loads((tmp_path / "rank0.json").read_text())["optimizer_offload"]
    assert not json.loads((tmp / "rank0.json").read_text())["optimizer_offload"]
    straight, resumed = load_file(tmp / "rank0.safetensors"), load_file(tmp_path / "rank0.safetensors")
    assert any(
        not torch.equal(straight[k], load_file(tmp / "run/checkpoints/checkpoint-000002/trainable.safetensors")[k])
        for k in straight
    )  # the third iteration moved the weights
    for k in straight:
        torch.testing.assert_close(resumed[k], straight[k], rtol=1e-5, atol=1e-7)


def test_deepspeed_full_fine_tuning_matches_ddp_and_exports_the_pipeline(tmp_path, two_process_run, full_ft_ddp):
    """Full fine-tuning under ZeRO-1 and ZeRO-2, one transition per micro-batch: process 0 makes two backwards per
    optimizer step, process 1 (no transitions) a zero-gradient pass, and under ZeRO-2, whose every backward reduces,
    one more to match. Both end on DDP's weights within float tolerance, and the exported pipeline holds them."""
    _assert_full_fine_tuning_matches_ddp(
        tmp_path,
        two_process_run[0],
        {"zero1": {"zero": "1"}, "zero2": {"zero": "2"}},
        full_ft_ddp[1],
        "zero2",
        ddp=full_ft_ddp[0],
    )


@pytest.fixture(scope="module")
def zero3_run(tmp_path_factory, two_process_run):
    """The DDP run's config and data under DeepSpeed ZeRO-3 (``configs/accelerate/deepspeed_zero3.yaml``: the weights
    partitioned and gathered per module for each forward and backward), forced onto the CPU processes."""
    tmp, ddp, overrides = _engine_run(tmp_path_factory, two_process_run, "zero3", zero="3")
    return tmp, ddp


def test_deepspeed_zero3_trains_the_weights_ddp_trains_into_the_same_files(zero3_run):
    """DeepSpeed ZeRO-3 (:func:`_assert_lockstep_run_is_ddps`)."""
    tmp, ddp = zero3_run
    _assert_lockstep_run_is_ddps(tmp, ddp, "DeepSpeedEngine")


def test_deepspeed_zero3_resume_continues_the_run(zero3_run, tmp_path):
    """:func:`_assert_resume_is_exact` under DeepSpeed ZeRO-3."""
    tmp, ddp = zero3_run
    _assert_resume_is_exact(tmp, ddp, tmp_path, zero="3")


def test_deepspeed_zero3_offload_resumes_the_run_with_the_weights_and_optimizer_on_the_cpu(zero3_run, tmp_path):
    """ZeRO-3 with the weights and the optimizer offloaded to the CPU (``deepspeed_zero3_offload.yaml``): the ZeRO-3
    run resumed from its second checkpoint (whole weights, moments and step count read back into each process's
    offloaded partitions) trains the third iteration to the weights of the run that never stopped (float tolerance:
    the offloaded optimizer steps on the CPU copy)."""
    tmp, ddp = zero3_run
    _assert_resume_is_exact(tmp, ddp, tmp_path, close=True, zero="3:cpu:cpu")
    info = json.loads((tmp_path / "rank0.json").read_text())
    assert info["optimizer_offload"] and info["weights_offload"]


def test_deepspeed_zero3_full_fine_tuning_matches_ddp_and_exports_the_pipeline(tmp_path, two_process_run, full_ft_ddp):
    """Full fine-tuning under DeepSpeed ZeRO-3, one transition per micro-batch (process 1 pads two zero-weight
    backwards per step, and its held-out evaluation share): DDP's weights and evaluation, and the exported pipeline
    (gathered by every process, written by one) holds the trained weights, whole."""
    folders = _assert_full_fine_tuning_matches_ddp(
        tmp_path, two_process_run[0], {"zero3": {"zero": "3"}}, full_ft_ddp[1], "zero3", ddp=full_ft_ddp[0]
    )
    ours, ddp = (json.loads((folders[n] / "rank0.json").read_text()) for n in ("zero3", "ddp"))
    assert ours["before"]["held_out"]["n_images"] == 3 and ours["before"] == ddp["before"]


def _fixture_pipeline(overrides: list[str]) -> str:
    """The ``model.path`` among ``overrides``."""
    return next(o.split("=", 1)[1] for o in overrides if o.startswith("model.path="))


NEW_METHODS = ["awm", "crd", "dgpo", "dpo_online", "dpo_offline", "flow_dppo", "gardo", "sft"]
# on the tiny CLIP score's gradient; beside DDP under FSDP2 full shard and ZeRO-3 (LOCKSTEP_RUNS), which exercise
# FSDP2's and ZeRO's code paths and lockstep besides
DIRECT_METHODS = ["refl", "draft", "alignprop", "srpo"]
# a fake score with its own AdamW (refused under DeepSpeed), or teachers beside the student; tdm_r1 is tdm plus its
# surrogate, dmdr dmd plus its RL loss, so that tdm and dmd add no launch of their own; dmdr and flow_opd under FSDP2
# keeping the weights gathered too, tdm_r1 and flow_opd under FSDP2 full shard (LOCKSTEP_RUNS)
DDP_METHODS = ["dmdr", "tdm_r1", "flow_opd", "flow_opd_sft"]
FSDP2_TOO = ["dmdr", "flow_opd"]
# Flow-OPD under ZeRO-2 too (its teachers held copies, its cold start written into DeepSpeed's master partition, the
# SFT cold start's AdamW reset in DeepSpeed's partitions), and under ZeRO-3 (LOCKSTEP_RUNS)
ZERO2_TOO = ["flow_opd", "flow_opd_sft"]
VARIANTS = {
    "flow_opd_sft": (
        "flow_opd",
        {"train.opd.sft_steps": 2, "train.opd.sft_prompts": 2, "train.opd.sft_samples_per_prompt": 2},
    )
}
"""Runs of a preset with other settings: name -> (the preset, its overrides): Flow-OPD's SFT cold start (instead of
``train.opd.init``) on every process alike."""
# GRPO's tree and probe rollout shapes, under DDP as the reference of their LOCKSTEP_RUNS
SHAPE_PRESETS = ["branch_grpo", "g2rpo"]
ENGINES = {"ddp": {}, "fsdp2": {"fsdp2": True}, "zero2": {"zero": "2"}}
WRAPPED = {"ddp": "DistributedDataParallel", "fsdp2": "FSDP", "zero2": "DeepSpeedEngine"}


def held_copies(run: Path) -> int:
    """The copies of the trained weights the run in folder `run` (its ``c.yaml`` and ``overrides.json``) holds, as its
    method declares them (:meth:`flowrl.methods.base.Method.held_copies`, the memory plan's count)."""
    from flowrl.methods import METHODS

    cfg = load_config(run / "c.yaml", json.loads((run / "overrides.json").read_text()))
    return METHODS[cfg.train.method].held_copies(cfg)


# the held copies' resets within the two iterations: DPO's reference copied from the policy after each, GARDO's
# reference reset after each (its threshold passed by process 0's KL alone: process 1 keeps no rows), its KL on all
HELD_RESETS = {
    "dpo_online": {"train.dpo.ref_update_every": 1},
    "gardo": {"train.gardo.kl_threshold": 1e-12, "train.gardo.auxiliary": "[]"},
}
# the shapes' settings at 4 steps and 4 images a group: a tree split twice, probes at two steps
SHAPE_SIZES = {"branch_grpo": {"sampling.tree.split_steps": "[0,2]"}, "g2rpo": {"sampling.probe.steps": "[0,1]"}}


@pytest.fixture(scope="module")
def new_method_runs(tmp_path_factory, random_pipeline, prompt_files):
    """Every method of 2026 trained two iterations under DDP, FSDP2 and DeepSpeed ZeRO-2, the direct-reward, few-step,
    Flow-OPD and tree and probe presets under DDP: one torchrun launch per engine, the presets one after another in
    it, each in ``ROOT/ENGINE/PRESET`` (its overrides in ``overrides.json``), once per test session
    (:func:`conftest.built_once`). Returns ROOT."""
    with built_once(tmp_path_factory, "new_methods") as (root, todo):
        if todo:
            _train_new_methods(root, random_pipeline, prompt_files)
    return root


def _train_new_methods(root: Path, random_pipeline: Path, prompt_files: tuple[Path, Path]) -> None:
    """:func:`new_method_runs`'s launches, into ``root`` (under DDP DiffusionNFT too, :func:`lockstep_method_runs`'
    reference, :data:`DIRECT_METHODS`, :data:`DDP_METHODS` and :data:`SHAPE_PRESETS`)."""
    teacher = _random_lora(random_pipeline, root / "teacher")  # both of flow_opd's teachers
    ddp_only = ["diffusion_nft", *DIRECT_METHODS, *DDP_METHODS, *SHAPE_PRESETS]
    for engine, launch in ENGINES.items():
        presets = NEW_METHODS + {"ddp": ddp_only, "fsdp2": FSDP2_TOO, "zero2": ZERO2_TOO}[engine]
        runs = [
            _method_run(root / engine / preset, preset, random_pipeline, prompt_files, teacher) for preset in presets
        ]
        _launch_runs(root / engine, runs, **launch)


def _method_run(
    tmp: Path, preset: str, random_pipeline: Path, prompt_files: tuple[Path, Path], teacher: Path | None = None
) -> dict:
    """The run of ``configs/PRESET.yaml`` (or of a :data:`VARIANTS` entry) that :func:`new_method_runs` and
    :func:`lockstep_method_runs` launch, in the new folder ``tmp`` (its config and ``overrides.json`` written there):
    process 1's groups without reward variance (the direct methods score the tiny CLIP score, the offline ones JPEG
    compressibility), tiny sizes, two iterations; Flow-OPD's teachers both the LoRA ``teacher``, also its cold start
    (``train.opd.init``) unless the variant trains one (SFT). Returns :func:`_launch_runs`' entry."""
    tmp.mkdir(parents=True)
    base, variant = VARIANTS.get(preset, (preset, {}))
    reward = "distributed_worker:rank_reward" if preset not in ("dpo_offline", "sft") else "jpeg_compressibility"
    options = ""
    if preset in DIRECT_METHODS:
        reward, options = "clipscore", f"    options: {{model_path: {HERE.parent / 'assets' / 'tiny-clip'}}}\n"
    (tmp / "c.yaml").write_text(
        f"base: {HERE.parent / 'configs' / (base + '.yaml')}\n"
        f"rewards:\n  geneval: null\n{'  geneval_strict: null' + chr(10) if preset == 'tdm_r1' else ''}"
        f"  {reward}:\n    weight: 1.0\n{options}"
    )
    extra = {"run.mixed_precision": "no", "train.minibatch_size": 8, "train.micro_batch_size": 4}
    extra.update({"sampling.group_size": 4, "sampling.num_steps": 4, "train.offline.batch_size": 4})
    if base == "flow_opd":  # the teacher also the cold start (written into the student's shards under FSDP2)
        extra.update({f"train.opd.teachers.{n}.lora": teacher for n in ("geneval", "clipscore")})
        extra.update(variant or {"train.opd.init": teacher})
    extra.update({**HELD_RESETS.get(preset, {}), **SHAPE_SIZES.get(preset, {})})
    overrides = tiny_overrides(random_pipeline, *prompt_files, tmp / "run", **extra)
    (tmp / "overrides.json").write_text(json.dumps(overrides))
    return {"config": str(tmp / "c.yaml"), "out": str(tmp), "overrides": overrides}


LOCKSTEP_RUNS = {
    "full_shard": (
        ["diffusion_nft", "dgpo", "gardo", "refl", "draft", "branch_grpo", "tdm_r1", "flow_opd"],
        {"fsdp2": "full_shard"},
        "FSDP",
    ),
    "zero3": (
        ["awm", "crd", "dpo_online", "alignprop", "srpo", "g2rpo", "flow_opd"],
        {"zero": "3"},
        "DeepSpeedEngine",
    ),
}
"""Engine -> (presets, :func:`_launch` keywords, the wrapper's class name) of :func:`lockstep_method_runs`: each method
that runs in lockstep beside Flow-GRPO (its ``lockstep``) under one of the two engines that gather the weights in
every forward, and GRPO's tree and probe shapes, to keep the CI's cost to one launch of six presets per engine (the
held copies' forwards, CRD's two copies and DPO's reference, under ZeRO-3's partitions; AlignProp's recomputed steps
under ZeRO-3). Offline Diffusion-DPO and SFT (equal batches on every process, through DiffusionDPO's update and the
shared one) are not launched here."""


@pytest.fixture(scope="module")
def lockstep_method_runs(tmp_path_factory, random_pipeline, prompt_files, new_method_runs):
    """:data:`LOCKSTEP_RUNS`' presets trained as :func:`new_method_runs` trains them, under FSDP2 full shard and
    DeepSpeed ZeRO-3: one torchrun launch per engine, the presets one after another in it, each in
    ``ROOT/ENGINE/PRESET``, once per test session (:func:`conftest.built_once`). Returns ROOT and
    :func:`new_method_runs`' root (the DDP runs)."""
    with built_once(tmp_path_factory, "lockstep_methods") as (root, todo):
        if todo:
            for engine, (presets, launch, _) in LOCKSTEP_RUNS.items():
                teacher = new_method_runs / "teacher"  # flow_opd's, as under DDP
                runs = [_method_run(root / engine / p, p, random_pipeline, prompt_files, teacher) for p in presets]
                _launch_runs(root / engine, runs, **launch)
    return root, new_method_runs


@pytest.mark.parametrize(
    "preset, engine", [(preset, engine) for engine, (presets, _, _) in LOCKSTEP_RUNS.items() for preset in presets]
)
def test_methods_and_rollout_shapes_train_in_lockstep_to_ddps_weights(preset, engine, lockstep_method_runs):
    """DiffusionNFT, DGPO, GARDO, ReFL, DRaFT, BranchGRPO's trees, TDM-R1 and Flow-OPD under FSDP2 full shard, AWM,
    CRD, online Diffusion-DPO, AlignProp, SRPO, G2RPO's probes and Flow-OPD under ZeRO-3 (every process gathers the
    weights in each forward, so each must call the transformer alike): process 1 keeps no rows of the methods with advantages (no reward
    variance in its groups), so its update runs on a stand-in sample (CRD: group), its old, reference and EMA
    forwards are padded to process 0's chunks and its micro-batches are zero-weight ones (GARDO: a reference forward
    in every micro-batch); the direct-reward methods train every image on both. The weights and held copies (NFT's
    old policy, AWM's EMA, CRD's old and sampler copies, DPO's refreshed reference, GARDO's reset reference) end
    identical on both processes and equal to DDP's (rtol 1e-4), the weights trained, with DDP's optimizer steps and
    reference resets."""
    root, ddp_root = lockstep_method_runs
    tmp, ddp = root / engine / preset, ddp_root / "ddp" / preset
    w0, w1, ref = (
        load_file(f) for f in (tmp / "rank0.safetensors", tmp / "rank1.safetensors", ddp / "rank0.safetensors")
    )
    h0, h1, held = (
        load_file(f) for f in (tmp / "held0.safetensors", tmp / "held1.safetensors", ddp / "held0.safetensors")
    )
    assert w0.keys() == w1.keys() == ref.keys() and all(torch.equal(w0[k], w1[k]) for k in w0)
    assert h0.keys() == h1.keys() == held.keys() and all(torch.equal(h0[k], h1[k]) for k in h0)
    assert len(held) == held_copies(tmp) * len(ref)
    assert any(w0[k].abs().sum() > 0 for k in w0 if "lora_B" in k)
    assert json.loads((tmp / "rank0.json").read_text())["wrapped"].startswith(LOCKSTEP_RUNS[engine][2])
    rows, ref_rows = read_metrics(tmp / "run"), read_metrics(ddp / "run")
    assert [r["iteration"] for r in rows] == [1, 2]
    for r, d in zip(rows, ref_rows):
        assert r["policy/optimizer_steps"] == d["policy/optimizer_steps"] >= 1
    reset = {"dpo_online": "policy/reference_refreshed", "gardo": "gardo/reference_reset"}.get(preset)
    if reset:
        assert [r.get(reset) for r in rows] == [d.get(reset) for d in ref_rows] == [1.0, 1.0]
    for ours, theirs in ((w0, ref), (h0, held)):
        for k in theirs:
            torch.testing.assert_close(ours[k], theirs[k], rtol=1e-4, atol=1e-6)


def _random_lora(pipeline: Path, folder: Path) -> Path:
    """A rank-2 LoRA of `pipeline` with random (nonzero) factors saved into `folder` (:func:`save_random_lora`)."""
    from flowrl.models import load_model

    return save_random_lora(load_model(pipeline), folder, 2, 4.0, seed=0)


@pytest.mark.parametrize("preset", ["refl", "draft", "alignprop"])
def test_direct_methods_under_ddp_give_the_gradient_of_one_process(preset, new_method_runs):
    """ReFL, DRaFT and AlignProp under DDP (two gloo processes): one rollout's images split between the processes
    (every third on process 0, the rest on process 1) give the same optimizer step as all of them on process 0, and
    as all of them in a single process: the gradient of the mean loss over every image."""
    tmp = new_method_runs / "ddp" / preset
    overrides = json.loads((tmp / "overrides.json").read_text())
    _assert_split_gradients_are_one_process(tmp, overrides, "split_direct_gradient")


def test_flow_opd_under_ddp_gives_the_gradient_of_one_process(new_method_runs):
    """Flow-OPD's PPO update under DDP: one rollout's transitions split between the processes (every third on process
    0) give the step of one process training them all (:func:`_assert_split_gradients_are_one_process`)."""
    tmp = new_method_runs / "ddp" / "flow_opd"
    overrides = json.loads((tmp / "overrides.json").read_text())
    _assert_split_gradients_are_one_process(tmp, overrides, "split_gradient")


@pytest.mark.parametrize("preset", NEW_METHODS + DIRECT_METHODS + DDP_METHODS)
def test_each_new_method_trains_alike_on_both_processes_and_under_each_engine(preset, new_method_runs):
    """Every method of 2026 under DDP, FSDP2 and DeepSpeed ZeRO-2 (two gloo processes), the direct-reward methods (also
    under full sharding: :data:`LOCKSTEP_RUNS`), the few-step presets (DMDR: DMD's student and fake score; TDM-R1:
    TDM's and a surrogate) under DDP and Flow-OPD under DDP, FSDP2 and ZeRO-2 (with its SFT cold start too, under DDP
    and ZeRO-2: :data:`VARIANTS`): process 1's groups have no reward variance (the online methods of 2026 keep no rows
    there and take each optimizer step with a zero gradient; the direct ones train on every image's reward gradient, the few-step ones
    distil on every row); under each engine the weights and the method's held copies (AWM's EMA, CRD's old and
    sampler copies, DPO's refreshed reference, GARDO's reset reference, the fake score and TDM-R1's surrogate with
    their AdamW moments) end identical on both processes, the weights trained (the fake score and the surrogate
    too), and FSDP2's and ZeRO-2's equal to DDP's (rtol 1e-4, atol 1% of the learning rate)."""
    engines = ["ddp"] + ["fsdp2"] * (preset in FSDP2_TOO) + ["zero2"] * (preset in ZERO2_TOO)
    engines = list(ENGINES) if preset in NEW_METHODS else engines
    runs = {}
    for engine in engines:
        tmp = new_method_runs / engine / preset
        w0, w1 = load_file(tmp / "rank0.safetensors"), load_file(tmp / "rank1.safetensors")
        h0, h1 = load_file(tmp / "held0.safetensors"), load_file(tmp / "held1.safetensors")
        assert w0.keys() == w1.keys() and all(torch.equal(w0[k], w1[k]) for k in w0)
        assert h0.keys() == h1.keys() and all(torch.equal(h0[k], h1[k]) for k in h0)
        assert any(w0[k].abs().sum() > 0 for k in w0 if "lora_B" in k)
        for score in ("fake_score", "surrogate"):  # start at the teacher (B zeroed), trained through the student's DDP
            held = [h0[k] for k in h0 if k.startswith(f"{score}.safetensors/") and "lora_B" in k]
            assert not held or any(h.abs().sum() > 0 for h in held)
        assert json.loads((tmp / "rank0.json").read_text())["wrapped"].startswith(WRAPPED[engine])
        rows = [json.loads(line) for line in (tmp / "run/metrics.jsonl").read_text().splitlines()]
        assert [r["iteration"] for r in rows] == [1, 2] and all(r["policy/optimizer_steps"] >= 1 for r in rows)
        reset = {"dpo_online": "policy/reference_refreshed", "gardo": "gardo/reference_reset"}.get(preset)
        if reset:
            assert [r.get(reset) for r in rows] == [1.0, 1.0]
        if preset == "flow_opd_sft":  # the SFT cold start ran (2 prompts x 2 teacher samples), logged once
            assert rows[0]["opd/sft_images"] == 4.0 and "opd/sft_images" not in rows[1]
        runs[engine] = w0, h0
    assert len(runs["ddp"][1]) == held_copies(new_method_runs / "ddp" / preset) * len(runs["ddp"][0])
    # an absolute tolerance of 1% of one AdamW step (the learning rate): the engines sum and clip the gradients in
    # other orders, and AdamW's first steps, about lr * sign(gradient), turn a last-bit difference in a gradient
    # that nearly cancels into a visible one in that element (DPO offline under ZeRO-2 on an Intel Xeon: one element
    # of 64 off by 1.2e-6 at lr 3e-4); an engine that dropped or doubled a gradient would be off by whole steps
    lr = load_config(new_method_runs / "ddp" / preset / "run" / "config.yaml").train.learning_rate
    for engine in engines:
        for ddp, other in zip(runs["ddp"], runs[engine]):  # the weights, then the held copies
            assert ddp.keys() == other.keys()
            for k in ddp:
                torch.testing.assert_close(other[k], ddp[k], rtol=1e-4, atol=max(1e-6, 0.01 * lr))
