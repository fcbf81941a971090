"""Every preset in configs/ loads, and the tiny-world presets run two iterations on a random tiny model."""

import json
from pathlib import Path

import pytest

from conftest import tiny_overrides
from flowrl.config import ConfigError, load_config
from flowrl.trainer import Trainer

CONFIGS = sorted((Path(__file__).parent.parent / "configs").glob("*.yaml"))
TINY = [c for c in CONFIGS if c.name != "sd35m_pickscore.yaml"]


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_preset_loads(path):
    cfg = load_config(path)
    assert cfg.run.output_dir.endswith(path.stem)


@pytest.mark.parametrize("path", TINY, ids=lambda p: p.stem)
def test_preset_runs(path, tmp_path, random_pipeline, prompt_files):
    extra = {"run.mixed_precision": "no", "rewards.jpeg_compressibility.weight": 1.0}  # varies on random images
    if load_config(path).sampling.tree.split_steps:  # keep the preset's tree
        extra.update({"sampling.num_steps": 6, "sampling.group_size": 8})
    elif load_config(path).sampling.window.size:
        extra.update({"sampling.num_steps": 5})
    elif load_config(path).sampling.probe.method:  # keep the preset's probe steps
        extra.update({"sampling.num_steps": 8})
    train, test = prompt_files
    result = Trainer(load_config(path, tiny_overrides(random_pipeline, train, test, tmp_path / "run", **extra))).train()
    assert result["after"]["n_images"] > 0
    metrics = [json.loads(line) for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    assert all(m["cost/trained_transitions"] > 0 and m["policy/ratio_first_max_dev"] == 0.0 for m in metrics)


def test_base_chain_errors_name_the_file(tmp_path):
    (tmp_path / "a.yaml").write_text("base: b.yaml\n")
    (tmp_path / "b.yaml").write_text("base: a.yaml\n")
    with pytest.raises(ConfigError, match="cycle"):
        load_config(tmp_path / "a.yaml")
    (tmp_path / "c.yaml").write_text("base: missing.yaml\n")
    with pytest.raises(FileNotFoundError, match="missing.yaml.*the 'base' of"):
        load_config(tmp_path / "c.yaml")


def test_bench_runs_and_writes_the_table(tmp_path, random_pipeline, prompt_files):
    from flowrl.bench import run_bench

    train, test = prompt_files
    over = [o for o in tiny_overrides(random_pipeline, train, test, tmp_path / "unused") if not o.startswith("run.output_dir")]
    over += ["sampling.num_steps=6", "sampling.group_size=8", "sampling.prompts_per_iteration=2"]
    results = run_bench(["dance_grpo", "branch_grpo"], iterations=1, warmup=0, overrides=over, out=tmp_path / "b.json")
    assert results["dance_grpo"]["vs_dance_grpo"] == 1.0
    assert results["branch_grpo"]["cost/nfe"] < results["dance_grpo"]["cost/nfe"]  # shared prefixes
    assert results["branch_grpo"]["tree"]["speedup"] > 0
    assert "| branch_grpo |" in (tmp_path / "b.md").read_text()
