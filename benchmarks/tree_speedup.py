"""Batched against node-by-node BranchGRPO tree rollouts, timed on their own.

For each named preset (a config in ``configs/`` with ``sampling.tree``), one tree rollout of all the
iteration's prompts (:func:`samplers.sample_tree`, the preset's step plan and branching) is timed with
every depth's nodes in one velocity call (``batched=True``) and with one call per node (the published
BranchGRPO code's way), the median of ``--repeats`` runs each (:func:`flowrl.bench.bench_tree`). Both
draw identical noise, so they build the same tree.

    python benchmarks/tree_speedup.py [--repeats 5] [--out FILE.json] PRESET [PRESET ...] [--overrides key=value ...]

Prints one JSON line per preset: ``batched_s``, ``node_by_node_s`` (seconds) and ``speedup``.
"""

from __future__ import annotations

import argparse
import json
import tempfile

from flowrl.files import REPO_ROOT


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("presets", nargs="+", help="preset names in configs/ with a tree, e.g. branch_grpo")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", help="also write the results to this JSON file")
    parser.add_argument("--overrides", nargs="*", default=[], help="key=value overrides for every preset")
    args = parser.parse_args(argv)
    from flowrl.bench import bench_tree  # after the arguments: --help answers at once, before torch
    from flowrl.config import load_config
    from flowrl.trainer import Trainer

    results = []
    for name in args.presets:
        with tempfile.TemporaryDirectory() as out:
            cfg = load_config(REPO_ROOT / "configs" / f"{name}.yaml", [f"run.output_dir={out}", *args.overrides])
            if not cfg.sampling.tree.split_steps:
                raise SystemExit(f"preset {name!r} has no sampling.tree.split_steps: nothing to time")
            times = bench_tree(Trainer(cfg), repeats=args.repeats)
        row = {
            "preset": name,
            "prompts": cfg.sampling.prompts_per_iteration,
            "leaves": cfg.sampling.group_size,
            **times,
        }
        print(json.dumps(row), flush=True)
        results.append(row)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    main()
