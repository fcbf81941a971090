"""The training loop reproduces recorded runs: two iterations of five methods on a seeded random tiny pipeline.

``tests/data/golden_metrics_<capability>_<vendor>.json`` holds every metric (times aside) of these runs, in float32,
and the final trainable weights' sums; a restructured loop must give the same numbers. One file per CPU kind: the
instruction set torch dispatches (``torch.backends.cpu.get_cpu_capability()``: ``avx512``, ``avx2``) and the vendor
(``intel``, ``amd``: MKL runs other matrix-product kernels on an Intel Xeon than on an AMD EPYC of the same instruction
set, even with ``MKL_ENABLE_INSTRUCTIONS=AVX2``). Those kernels round differently in the last bits, and the rewards
(JPEG sizes, detector thresholds) turn that into other advantages. Re-record (only for an intended change of
behaviour, on each kind) with ``python tests/test_golden.py --record``, and the AVX2 file with
``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 python tests/test_golden.py --record``
(the emulation of an AVX2-only CPU, docs/reliability.md). A CPU kind without a file skips the test, naming the file.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from conftest import shape_overrides, tiny_overrides  # noqa: E402


def golden_file() -> Path:
    """This CPU kind's golden file: ``tests/data/golden_metrics_<capability>_<vendor>.json``
    (:func:`flowrl.cpu.vendor`)."""
    import torch

    from flowrl.cpu import vendor

    capability = torch.backends.cpu.get_cpu_capability().lower()
    return Path(__file__).parent / "data" / f"golden_metrics_{capability}_{vendor()}.json"


PRESETS = ("flow_grpo", "mix_grpo", "branch_grpo", "tempflow_grpo", "diffusion_nft")
REPO = Path(__file__).resolve().parent.parent


def run_preset(name: str, model: Path, train: Path, test: Path, out: Path) -> dict:
    """Two iterations of preset `name` in float32; returns its metrics rows (``time/*`` and ``memory/*`` dropped), the evaluations
    and the sum and sum of squares of the final trainable weights."""
    from flowrl.config import load_config
    from flowrl.trainer import Trainer

    extra = {
        "run.mixed_precision": "no",
        "rewards.jpeg_compressibility.weight": 1.0,
        **shape_overrides(load_config(REPO / "configs" / f"{name}.yaml")),
    }
    trainer = Trainer(load_config(REPO / "configs" / f"{name}.yaml", tiny_overrides(model, train, test, out, **extra)))
    result = trainer.train()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [{k: v for k, v in r.items() if not k.startswith(("time/", "memory/"))} for r in rows]
    params = trainer.policy.params if hasattr(trainer, "params") else trainer.policy.params
    weights = {
        "sum": sum(p.detach().double().sum().item() for p in params.values()),
        "sq": sum(p.detach().double().pow(2).sum().item() for p in params.values()),
    }
    return {
        "metrics": rows,
        "before": result["before"]["overall"],
        "after": result["after"]["overall"],
        "weights": weights,
    }


def _close(a, b, path: str) -> None:
    if isinstance(a, dict):
        assert set(a) == set(b), f"{path}: keys differ: {sorted(set(a) ^ set(b))}"
        for k in a:
            _close(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, list):
        assert len(a) == len(b), f"{path}: {len(a)} rows against {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            _close(x, y, f"{path}[{i}]")
    elif isinstance(a, float) and isinstance(b, (int, float)):
        # exact on the machine that recorded them (FLOWRL_GOLDEN_EXACT=1 checks that); other CPUs' float32
        # kernels may round differently
        tol = (0.0, 0.0) if os.environ.get("FLOWRL_GOLDEN_EXACT") == "1" else (1e-5, 1e-7)
        assert math.isclose(a, b, rel_tol=tol[0], abs_tol=tol[1]), f"{path}: {a} recorded, {b} now"
    else:
        assert a == b, f"{path}: {a!r} recorded, {b!r} now"


@pytest.mark.parametrize(
    "name", [pytest.param(p, marks=pytest.mark.slow) if p in ("tempflow_grpo", "branch_grpo") else p for p in PRESETS]
)
def test_loop_reproduces_recorded_run(name, tmp_path, random_pipeline, prompt_files):
    golden = golden_file()
    if not golden.is_file():
        pytest.skip(
            f"no golden run recorded for this CPU kind ({golden.name}): python tests/test_golden.py --record writes it"
        )
    golden = json.loads(golden.read_text())[name]
    now = run_preset(name, random_pipeline, *prompt_files, tmp_path / "run")
    _close(golden, json.loads(json.dumps(now)), name)


if __name__ == "__main__" and "--record" in sys.argv:
    import tempfile

    from tiny_pipelines.sd3 import build_random_sd3_pipeline

    from flowrl.data import write_jsonl
    from flowrl.tiny.prompts import split

    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        model = build_random_sd3_pipeline(d / "model")
        train, test = split(0)
        write_jsonl(train, d / "train.jsonl")
        write_jsonl(test, d / "test.jsonl")
        out = {name: run_preset(name, model, d / "train.jsonl", d / "test.jsonl", d / name) for name in PRESETS}
    golden = golden_file()
    golden.parent.mkdir(exist_ok=True)
    golden.write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
    print(f"wrote {golden}")
