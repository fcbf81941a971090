"""The collapse signals: within-group CLIP diversity each iteration, and run.stop_if rules that end a run cleanly."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import REPO, tiny_overrides

from flowrl.config import ConfigError, load_config
from flowrl.diversity import StopRules, group_diversity, parse_stop_rule


def test_group_diversity_is_the_mean_pairwise_cosine_distance():
    e = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [2.0, 0.0], [3.0, 0.0]])
    group = torch.tensor([0, 0, 0, 1, 1])
    d = group_diversity(e, group)
    s = 2**-0.5
    expected0 = ((1 - 0.0) + (1 - s) + (1 - s)) / 3  # pairs (0,1), (0,2), (1,2)
    torch.testing.assert_close(d, torch.tensor([expected0, 0.0], dtype=torch.float64))  # group 1: one direction


def test_stop_rules_parse_count_consecutive_iterations_and_refuse_bad_text():
    rule = parse_stop_rule("diversity/clip < 0.05 for 3")
    assert (rule.metric, rule.op, rule.value, rule.count) == ("diversity/clip", "<", 0.05, 3)
    rules = StopRules(["diversity/clip < 0.05 for 2", "reward/total/mean >= 0.99"])
    assert rules.update({"iteration": 1, "diversity/clip": 0.01}) is None
    assert rules.update({"iteration": 2, "diversity/clip": 0.2}) is None  # the run of low values is broken
    assert rules.update({"iteration": 3, "diversity/clip": 0.01}) is None
    why = rules.update({"iteration": 4, "diversity/clip": 0.02})
    assert why == "run.stop_if 'diversity/clip < 0.05 for 2' held at iteration 4 (diversity/clip = 0.02)"
    assert "reward/total/mean >= 0.99 for 1" in StopRules(["reward/total/mean >= 0.99"]).update(
        {"iteration": 1, "reward/total/mean": 1.0}
    )
    with pytest.raises(ConfigError, match=r"config key 'run\.stop_if': stop rule 'clip is low'"):
        load_config(None, ["run.stop_if=[clip is low]"])


def test_training_logs_diversity_and_a_rule_stops_the_run_with_a_checkpoint(tmp_path, random_pipeline, prompt_files):
    from flowrl.trainer import Trainer

    over = tiny_overrides(random_pipeline, *prompt_files, tmp_path / "run", **{"run.iterations": 5})
    over += [f"run.diversity_model={REPO / 'assets' / 'tiny-clip'}", "run.stop_if=[diversity/clip >= 0 for 2]"]
    result = Trainer(load_config(None, over)).train()
    rows = [json.loads(line) for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(0 <= r["diversity/clip_min"] <= r["diversity/clip"] <= 2 for r in rows)
    assert result["iterations"] == 2 and result["stopped"].startswith("run.stop_if 'diversity/clip >= 0 for 2'")
    assert (tmp_path / "run/checkpoints/checkpoint-000002").is_dir()  # the stop checkpointed its iteration
    assert json.loads((tmp_path / "run/eval.json").read_text())["iterations"] == 2
    assert (tmp_path / "run/diagnostics.png").is_file()


def test_a_diversity_model_that_is_not_clip_is_refused_naming_the_key(tmp_path, random_pipeline, prompt_files):
    from flowrl.trainer import Trainer

    over = tiny_overrides(random_pipeline, *prompt_files, tmp_path / "run")
    with pytest.raises(ConfigError, match=r"config key 'run\.diversity_model'"):
        Trainer(load_config(None, over + [f"run.diversity_model={tmp_path / 'nothing'}"]))
