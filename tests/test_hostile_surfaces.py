"""Hostile inputs, third pass (docs/reliability.md): the surfaces of offline data sets, direct-reward and forward-process
presets, stop rules, `flowrl overopt`, `serve-reward FILE.py:factory`, the VLM and VideoAlign rewards and
image-to-video records, and the shipped presets run from a folder outside the repository. Each case ends in one line
naming the file, key, reward or server, or in the sensible behaviour."""

from __future__ import annotations

import pytest
import torch
from conftest import REPO, tiny_overrides

from flowrl.config import ConfigError, load_config
from flowrl.trainer import Trainer, iteration_seed


@pytest.mark.parametrize(
    "key,value",
    [
        ("train.awm.kl_beta", "inf"),
        ("train.awm.ema_beta", "inf"),
        ("train.dpo.beta", "inf"),
        ("train.dgpo.beta", "inf"),
        ("train.crd.kl_beta", "inf"),
        ("train.nft.beta", "inf"),
        ("train.direct.scale", "inf"),
        ("train.direct.margin", "-inf"),
        ("train.srpo.relative_weight", "nan"),
        ("train.srpo.discount_shift", "inf"),
        ("train.adv_clip_max", "inf"),
        ("rewards.geneval.weight", "inf"),
        ("train.crd.old_decay", "[0,0.25,.inf,0.999]"),
    ],
)
def test_every_number_of_a_config_is_finite(key, value):
    with pytest.raises(ConfigError, match=rf"config key '{key.replace('.', '[.]')}(\[2\])?' must be a finite number"):
        load_config(None, [f"{key}={value}"])


def test_a_reward_option_may_be_any_number():
    """The options a reward factory reads are its own to check."""
    assert load_config(None, ["rewards.geneval.options={bound: .inf}"]).rewards["geneval"].options["bound"] == float(
        "inf"
    )


def test_every_seed_in_the_range_of_run_seed_draws():
    """``run.seed`` up to 2^63 - 1 gives every iteration and process a generator (the seed times 1000003 overflowed
    int64 above 9.2e12); seeds that fitted before draw as before."""
    for seed in (0, 2**63 - 1):
        torch.Generator().manual_seed(iteration_seed(seed, 10**6, 7))
    assert iteration_seed(5, 3, 1) == 5 * 1_000_003 + 3 * 1009 + 1
    with pytest.raises(ConfigError, match=r"run\.seed' must be in \[0, 2\^63\)"):
        load_config(None, [f"run.seed={2**63}"])


@pytest.mark.parametrize(
    "rule,known",
    [
        ("diversity/clpi < 0.05 for 3", "known: diversity/clip, diversity/clip_min"),
        ("reward/clipscor/mean < 0.1", "known: reward/geneval/mean, reward/total/mean"),
    ],
)
def test_a_stop_rule_on_a_misspelt_metric_is_refused_at_start(rule, known):
    with pytest.raises(ConfigError, match=f"config key 'run.stop_if': rule .*{known}"):
        load_config(None, [f"run.stop_if=['{rule}']"])


def test_a_stop_rule_on_a_metric_the_first_iteration_does_not_log_is_named(
    tmp_path, random_pipeline, prompt_files, capsys
):
    """A metric only the loop knows (``policy/*`` is absent where every group had one reward) or a diversity metric
    without a diversity model is named at the first iteration, with the metrics that were logged; the evaluation's
    metrics count as logged."""
    rules = "['policy/clipfrc > 0.5', 'eval/overall > 2', 'reward/total/mean > 2', 'diversity/clip < 0']"
    cfg = load_config(None, tiny_overrides(random_pipeline, *prompt_files, tmp_path / "run", **{"run.stop_if": rules}))
    assert Trainer(cfg).train()["iterations"] == 2
    warnings = [line for line in capsys.readouterr().err.splitlines() if "warning: run.stop_if" in line]
    assert len(warnings) == 2, warnings  # the diversity model is off (tiny_overrides)
    assert "'policy/clipfrc' is not logged at this iteration" in warnings[0] and "reward/total/mean" in warnings[0]
    assert "'diversity/clip' is not logged" in warnings[1]


def test_image_to_video_records_without_their_source_are_refused_before_the_model_loads(
    tmp_path, video_prompts, i2v_prompts, monkeypatch
):
    """A record of an image-to-video run without ``image`` would train a video from a blank frame: named by file and
    line before any weight loads (``flowrl sample --prompt`` still draws from the blank frame)."""
    from tiny_pipelines.wan_i2v import build_random_wan_i2v_pipeline

    import flowrl.trainer as trainer_mod
    from flowrl.data import read_jsonl

    model = build_random_wan_i2v_pipeline(tmp_path / "wan21")
    monkeypatch.setattr(trainer_mod, "build_model", lambda *a: pytest.fail("the model loaded"))
    lines = i2v_prompts[0].read_text().splitlines()
    mixed = i2v_prompts[0].parent / "mixed.jsonl"  # beside the sources its records name
    mixed.write_text("\n".join([lines[0], '{"prompt": "a red circle moving up", "tag": "motion"}', *lines[1:]]) + "\n")
    for train, line in ((video_prompts[0], 1), (mixed, 2)):
        over = tiny_overrides(model, train, i2v_prompts[1], tmp_path / f"run{line}", **{"model.resolution": 16})
        with pytest.raises(ConfigError, match=rf"config key 'train_prompts': .*{train.name}:{line}: no 'image'"):
            Trainer(
                load_config(REPO / "configs" / "recipes" / "wan_i2v_flow_grpo.yaml", over + ["model.num_frames=5"])
            )
    assert len(read_jsonl(mixed)) == 4  # a text-to-image family reads the same file
