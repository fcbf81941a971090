"""Peak host memory per process of FSDP2 full fine-tuning on two CPU processes (gloo): one FSDP unit around the whole
transformer (``fsdp_auto_wrap_policy: NO_WRAP``) against a unit per transformer block (``TRANSFORMER_BASED_WRAP``, what
``configs/accelerate/fsdp2.yaml`` ships).

With one unit the whole gradient exists at the end of the backward before it is reduce-scattered into this process's
shard (``4N`` bytes for ``N`` float32 weights); with a unit per block each block's gradient is reduce-scattered right
after that block's backward, so only about one block's gradient is whole at a time. The transformer is SD3.5-Medium's
published config (``--family``) cut to ``--layers`` blocks, random weights (``benchmarks/gpu_scale.py``'s builder),
trained whole (``model.lora_rank=0``) for one iteration; the processes run ``tests/distributed_worker.py``
(accelerate's FSDP2 path forced onto CPU processes, as the tests do). Peak memory is each process's ``ru_maxrss`` (resident set, the whole
process: libraries, pipeline, rollout included), so the difference between the two runs is what the units change.

    python benchmarks/fsdp2_units_memory.py --layers 3 --out runs/fsdp2_units_memory.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ABORT = "terminate called without an active exception"
"""A C++ abort seen twice in CI at the trained model's evaluation of a two-process launch (under the AVX2 emulation
recipe both times): the launch is retried once on it, and says so."""
sys.path.insert(0, str(ROOT / "benchmarks"))

from gpu_scale import build_pipeline  # noqa: E402

REWARD = "rewards:\n  distributed_worker:rank_reward:\n    weight: 1.0\n"
"""Process 0 rewards brightness (its groups have reward variance and train), process 1 a constant (a zero-gradient
pass): both back-propagate through every weight."""


def run(pipeline: Path, folder: Path, wrap: str, resolution: int) -> dict:
    """One FSDP2 full fine-tuning iteration with ``fsdp_auto_wrap_policy`` ``wrap``; returns each process's peak
    resident memory (MiB), the FSDP unit count and the wall time."""
    folder.mkdir(parents=True)
    (folder / "c.yaml").write_text(REWARD)
    overrides = [
        f"model.path={pipeline}",
        "train_prompts=train",
        "eval.prompts=test",
        f"run.output_dir={folder / 'run'}",
        "run.iterations=1",
        "run.save_every=100",
        "run.device=cpu",
        "run.mixed_precision=no",
        "sampling.num_steps=2",
        "sampling.group_size=2",
        "sampling.prompts_per_iteration=1",
        "eval.images_per_tag=1",
        "eval.num_steps=1",
        "train.minibatch_size=4",
        "model.lora_rank=0",
        f"model.resolution={resolution}",
        "model.max_sequence_length=16",
        "run.keep_checkpoints=1",
    ]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
        "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]),
        "FLOWRL_TEST_FSDP2": "1",
        "FLOWRL_TEST_FSDP_WRAP": wrap,
        "FLOWRL_TEST_NO_SPLIT": "1",
        "PYTHONFAULTHANDLER": "1",  # a process that aborts prints every thread's Python stack
    }
    start = time.perf_counter()
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        str(ROOT / "tests/distributed_worker.py"),
        str(folder / "c.yaml"),
        str(folder),
        *overrides,
    ]
    r = subprocess.run(command, capture_output=True, text=True, env=env)
    if r.returncode and ABORT in r.stderr:  # the C++ abort tests/test_distributed.py also retries once
        print(f"torchrun aborted ({ABORT!r}); launched again:\n{r.stderr[-3000:]}", file=sys.stderr)
        start = time.perf_counter()
        r = subprocess.run(command, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        raise RuntimeError(f"the {wrap} run failed:\n{r.stderr[-3000:]}")
    ranks = [json.loads((folder / f"rank{i}.json").read_text()) for i in (0, 1)]
    return {
        "wrap": wrap,
        "fsdp_units": ranks[0]["fsdp_units"],
        "seconds": round(time.perf_counter() - start, 1),
        "peak_rss_after_update_mib": [round(x["peak_rss_after_update_mib"][0]) for x in ranks],
        "peak_rss_mib": [round(x["peak_rss_mib"]) for x in ranks],
    }


def trained_weights(pipeline: Path) -> tuple[int, int]:
    """The transformer's parameters (all trained under full fine-tuning; buffers such as the positional table are
    not) and those inside its blocks, counted on the meta device."""
    import torch
    from diffusers import SD3Transformer2DModel

    with torch.device("meta"):
        model = SD3Transformer2DModel.from_config(SD3Transformer2DModel.load_config(pipeline, subfolder="transformer"))
    return (sum(p.numel() for p in model.parameters()), sum(p.numel() for p in model.transformer_blocks.parameters()))


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--family",
        choices=("sd35m", "sd35l", "tiny"),
        default="sd35m",
        help="an SD3 transformer config of benchmarks/gpu_scale.py (tiny: the few-MB one of its CPU test)",
    )
    ap.add_argument("--layers", type=int, default=3, help="blocks kept (SD3.5-Medium has 24)")
    ap.add_argument("--resolution", type=int, default=128, help="image side in pixels")
    ap.add_argument("--out", type=Path, default=None, help="JSON file for the results")
    args = ap.parse_args(argv)
    import torch  # after the arguments: --help answers at once

    with tempfile.TemporaryDirectory() as tmp:
        pipeline = build_pipeline(args.family, Path(tmp) / "pipeline", layers=args.layers, dtype=torch.float32)
        n, in_blocks = trained_weights(pipeline)
        rows = [
            run(pipeline, Path(tmp) / wrap, wrap, args.resolution) for wrap in ("NO_WRAP", "TRANSFORMER_BASED_WRAP")
        ]
    result = {
        "machine": f"{os.cpu_count()} CPU cores, torch {torch.__version__}",
        "transformer": args.family,
        "layers": args.layers,
        "trained_params": n,
        "block_params": in_blocks,
        "gradient_mib": round(4 * n / 2**20),
        "blocks_gradient_mib": round(4 * in_blocks / 2**20),
        "runs": rows,
    }
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
