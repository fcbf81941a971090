"""``examples/minimal_flow_grpo.py``, Flow-GRPO in one file, equals ``configs/flow_grpo.yaml`` through the trainer: one
iteration from the same seed ends on the same LoRA weights (1e-6) and the same reward."""

from __future__ import annotations

import importlib.util
import sys

import torch
from conftest import FLOAT32, REPO


def _example():
    spec = importlib.util.spec_from_file_location("minimal_flow_grpo", REPO / "examples" / "minimal_flow_grpo.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass resolves annotations through it
    spec.loader.exec_module(module)
    return module


def test_one_iteration_of_the_example_equals_the_trainers(tmp_path):
    from flowrl import Trainer, load_config

    example = _example()
    small = dict(iterations=1, prompts_per_iteration=2, group_size=4, num_steps=4, minibatch_size=8, seed=3)
    logged = []
    ours = example.train(example.Args(**small), log=logged.append)
    assert len(logged) == 1 and logged[0].startswith("iteration 1: reward")
    over = {
        "sampling.prompts_per_iteration": 2,
        "sampling.group_size": 4,
        "sampling.num_steps": 4,
        "train.minibatch_size": 8,
        "run.seed": 3,
        "run.output_dir": str(tmp_path / "run"),
        **FLOAT32,
    }
    trainer = Trainer(load_config(REPO / "configs" / "flow_grpo.yaml", [f"{k}={v}" for k, v in over.items()]))
    start = {n: p.detach().clone() for n, p in trainer.policy.params.items()}
    metrics = trainer.step(0)
    theirs = trainer.policy.params
    assert ours["weights"].keys() == theirs.keys() and len(theirs) > 0
    assert any(not torch.equal(start[n], theirs[n]) for n in theirs)  # the iteration trained
    for n in theirs:
        torch.testing.assert_close(ours["weights"][n], theirs[n].detach(), rtol=0, atol=1e-6)
    assert abs(ours["rewards"][0] - metrics["reward/total/mean"]) < 1e-6
    assert metrics["cost/trained_transitions"] > 0
