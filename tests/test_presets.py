"""Every preset in configs/ and recipe in configs/recipes/ loads, and the tiny-world presets run two iterations on a random tiny model."""

import json
import math
from pathlib import Path

import pytest
from conftest import shape_overrides, tiny_overrides

from flowrl.config import ConfigError, load_config
from flowrl.methods import GRPO, METHODS
from flowrl.trainer import Trainer

CONFIG_DIR = Path(__file__).parent.parent / "configs"
PRESETS = sorted(CONFIG_DIR.glob("*.yaml"))  # the method presets on the tiny world
RECIPES = sorted((CONFIG_DIR / "recipes").glob("*.yaml"))  # real models' paths: run shrunk in their families' tests
CONFIGS = PRESETS + RECIPES
# the tiny video world's own model: test_tiny_video; Flow-OPD's teachers, LoRAs of the model: test_flow_opd; tdm:
# test_distill trains it two iterations (and resumes it)
TINY = [c for c in PRESETS if c.name not in ("tiny_video.yaml", "flow_opd.yaml", "tdm.yaml")]
SLOW_PRESETS = {"g2rpo", "branch_grpo", "branch_grpo_mix", "branch_grpo_mix_flash"}  # trees: run in CI (CI=true)
SLOW_PRESETS |= {"awm", "crd", "dgpo", "dpo_online", "flow_dppo", "gardo", "dpo_offline", "sft"}  # test_methods trains
SLOW_PRESETS |= {"refl", "draft", "alignprop", "srpo"}  # test_direct trains them: here in CI only


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_preset_loads(path):
    cfg = load_config(path)
    assert cfg.run.output_dir.endswith(path.stem)


@pytest.mark.parametrize(
    "path",
    [pytest.param(c, marks=pytest.mark.slow) if c.stem in SLOW_PRESETS else c for c in TINY],
    ids=lambda p: p.stem,
)
def test_preset_runs(path, tmp_path, random_pipeline, prompt_files):
    extra = {
        "run.mixed_precision": "no",
        # varies on random images; the direct-reward presets keep their differentiable tiny CLIP score
        "rewards.jpeg_compressibility.weight": 0.0 if path.stem in ("refl", "draft", "alignprop", "srpo") else 1.0,
        **shape_overrides(load_config(path)),
    }  # keep the preset's tree, window or probe steps
    train, test = prompt_files
    result = Trainer(
        load_config(path, tiny_overrides(random_pipeline, train, test, tmp_path / "run", **extra))
    ).train()
    assert result["after"]["n_images"] > 0
    metrics = [json.loads(line) for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    if not issubclass(METHODS[load_config(path).train.method], GRPO):  # forward-process and offline methods
        assert all(m["cost/trained_transitions"] > 0 and m["policy/optimizer_steps"] > 0 for m in metrics)
        assert all(m.get("policy/ratio_first_max_dev", 0.0) == 0.0 for m in metrics)  # AWM's ratio
        return
    assert all(m["cost/trained_transitions"] > 0 and m["policy/ratio_first_max_dev"] == 0.0 for m in metrics)
    if path.stem == "pref_grpo":  # the Bradley-Terry judge scores each image once
        assert all(m["cost/judge_calls"] == m["cost/reward_calls"] > 0 for m in metrics)
    for m in metrics:  # every trained step has its ratio and gradient-norm diagnostics
        steps = {k.split("/")[1] for k in m if k.startswith("diag/step_")}
        assert steps and all(f"diag/{s}/grad_norm" in m and f"diag/{s}/ratio_std" in m for s in steps)


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
    over = [
        o
        for o in tiny_overrides(random_pipeline, train, test, tmp_path / "unused")
        if not o.startswith("run.output_dir")
    ]
    over += ["sampling.num_steps=6", "sampling.group_size=8", "sampling.prompts_per_iteration=2"]
    results = run_bench(["dance_grpo", "branch_grpo"], iterations=1, warmup=0, overrides=over, out=tmp_path / "b.json")
    assert results["dance_grpo"]["vs_dance_grpo"] == 1.0
    assert results["branch_grpo"]["cost/nfe"] < results["dance_grpo"]["cost/nfe"]  # shared prefixes
    assert results["branch_grpo"]["tree"]["speedup"] > 0
    assert "| branch_grpo |" in (tmp_path / "b.md").read_text()


def test_bench_names_the_unknown_preset_and_the_available_ones(capsys):
    from flowrl.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["bench", "--presets", "dance_grpo", "no_such_preset"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "no_such_preset" in err and "diffusion_nft" in err


def test_bench_budget_reports_base_half_and_full_budget_accuracy(tmp_path, random_pipeline, prompt_files):
    import json

    from flowrl.bench import run_bench

    train, test = prompt_files
    over = [
        o
        for o in tiny_overrides(random_pipeline, train, test, tmp_path / "unused")
        if not o.startswith("run.output_dir")
    ]
    lines = []
    results = run_bench(
        ["flow_grpo"],
        iterations=1,
        warmup=0,
        budget_s=1e-3,
        overrides=over,
        out=tmp_path / "b.json",
        progress=lines.append,
    )
    # a line for each piece of work as it starts or ends: never minutes without a word
    assert lines[0] == "flow_grpo (1/1): building the trainer" and lines[1].startswith("evaluating the base model (")
    assert lines[2].startswith("flow_grpo timed iteration 1/1: ") and lines[2].endswith(" s")
    assert lines[3].startswith("flow_grpo budget: ") and lines[-1] == "flow_grpo: evaluating after the budget"
    row = results["flow_grpo"]
    assert row["budget_iterations"] == 2  # one timed iteration, then one budget iteration (> 1 ms of training)
    assert 0.0 <= row["budget_half_accuracy"] <= 1.0 and 0.0 <= row["budget_accuracy"] <= 1.0
    meta = json.loads((tmp_path / "b.json").read_text())["meta"]
    assert 0.0 <= meta["base_accuracy"] <= 1.0 and meta["overrides"] == over
    table = (tmp_path / "b.md").read_text()
    assert (
        "accuracy, half budget | accuracy, budget |" in table and f"(base model {meta['base_accuracy']:.3f})" in table
    )


@pytest.mark.parametrize("preset", ["grpo_guard", pytest.param("refl", marks=pytest.mark.slow)])  # slow: in CI
def test_overopt_trains_on_the_proxy_and_scores_proxy_and_gold(
    preset, tmp_path, random_pipeline, prompt_files, monkeypatch, capsys
):
    """A GRPO preset and a direct-reward preset (ReFL back-propagates the proxy) train on the proxy alone and are
    scored by proxy and gold at every evaluation."""
    import flowrl.trainer as trainer_mod
    from flowrl.overopt import run_overopt

    seen, trainer_weights = [], []
    original = trainer_mod.Trainer.__init__

    def spy(self, cfg):
        seen.append(sorted(cfg.rewards))
        trainer_weights.append(cfg.rewards["geneval_strict"].weight)
        original(self, cfg)

    monkeypatch.setattr(trainer_mod.Trainer, "__init__", spy)
    train, test = prompt_files
    over = [
        o
        for o in tiny_overrides(random_pipeline, train, test, tmp_path / "unused")
        if not o.startswith("run.output_dir")
    ]
    results = run_overopt([preset], iterations=2, eval_every=1, overrides=over, out=tmp_path / "o.json")
    assert seen == [["clipscore", "geneval_strict"]]  # the preset's rewards swapped for the proxy, the gold watched
    assert trainer_weights == [0.0]  # the gold at weight 0: logged, not trained on
    rows = results[preset]
    assert [r["iteration"] for r in rows] == [0, 1, 2]
    assert all(math.isfinite(r["proxy"]) and 0 <= r["gold"] <= 1 for r in rows)
    assert rows[0]["proxy"] != rows[-1]["proxy"]  # the proxy's images changed: the preset trained
    assert f"| {preset} |" in (tmp_path / "o.md").read_text()
    rollouts = json.loads((tmp_path / "o.json").read_text())["rollouts"][preset]
    assert len(rollouts) == 2 and all(0 <= r["gold"] <= 1 for r in rollouts)  # the gold of every iteration
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("flowrl overopt: ")]
    assert f"flowrl overopt: {preset} (1/1): building the trainer" in said  # no silent minutes: a line per step
    assert sum(f"{preset} iteration {i}/2: rollout proxy" in line for line in said for i in (1, 2)) == 2
    assert sum("evaluating proxy and gold" in line for line in said) == 3


def test_bench_times_a_sliding_window_at_evenly_spaced_starts():
    from types import SimpleNamespace

    from flowrl.bench import _median_iteration
    from flowrl.samplers import SlidingWindow

    window = SlidingWindow(num_steps=10, size=3, interval=6)
    window.advance()
    starts = []

    def step(i):
        starts.append(window.start)
        return {
            "cost/nfe": 1,
            "cost/trained_transitions": 1,
            "cost/reward_calls": 1,
            "time/sample_s": float(window.start),
            "time/score_s": 0.0,
            "time/train_s": 0.0,
        }

    lines = []
    row = _median_iteration(SimpleNamespace(method=SimpleNamespace(window=window), step=step), 1, 3, lines.append, "w")
    assert starts == [0, 4, 8] and row["time/iteration_s"] == 4.0  # the median over the window's range
    assert lines == ["w timed iteration 1/3: 0.0 s", "w timed iteration 2/3: 4.0 s", "w timed iteration 3/3: 8.0 s"]
    assert window.state_dict() == {"start": 0, "count": 1, "iteration": 1}  # the run's schedule is restored


def test_preset_override_file_applies_all_then_the_preset_list(tmp_path, monkeypatch):
    import flowrl.bench as bench

    seen = {}

    class Stop(Exception):
        pass

    def spy(path, overrides):
        seen[Path(path).stem] = list(overrides)
        raise Stop

    monkeypatch.setattr(bench, "load_config", spy)
    f = tmp_path / "scale.yaml"
    f.write_text('all: ["sampling.num_steps=25"]\nmix_grpo: ["sampling.window.size=4"]\n')
    assert bench.load_preset_overrides(f) == {"all": ["sampling.num_steps=25"], "mix_grpo": ["sampling.window.size=4"]}
    for name in ("mix_grpo", "dance_grpo"):
        with pytest.raises(Stop):
            bench.run_bench([name], preset_overrides=f, overrides=["run.seed=3"], out=tmp_path / "b.json")
    assert seen["mix_grpo"][-3:] == ["sampling.num_steps=25", "sampling.window.size=4", "run.seed=3"]
    assert seen["dance_grpo"][-2:] == ["sampling.num_steps=25", "run.seed=3"]


@pytest.mark.parametrize(
    "text, match",
    [
        ("mixgrpo: [a=1]\n", "unknown key 'mixgrpo'"),
        ("mix_grpo: sampling.num_steps=25\n", "'mix_grpo' must be a list"),
        ("- a=1\n", "expected a mapping"),
    ],
)
def test_preset_override_file_errors_name_the_file_and_key(tmp_path, text, match):
    from flowrl.bench import load_preset_overrides

    f = tmp_path / "scale.yaml"
    f.write_text(text)
    with pytest.raises(ValueError, match=match):
        load_preset_overrides(f)
    with pytest.raises(FileNotFoundError, match="missing.yaml"):
        load_preset_overrides(tmp_path / "missing.yaml")


def test_shipped_scale_files_load_and_validate():
    from flowrl.bench import load_preset_overrides
    from flowrl.config import REPO_ROOT

    for f in sorted((REPO_ROOT / "benchmarks").glob("scale_*.yaml")):
        lists = load_preset_overrides(f)
        for preset in {"dance_grpo", *lists} - {"all"}:
            load_config(REPO_ROOT / "configs" / f"{preset}.yaml", lists.get("all", []) + lists.get(preset, []))


def test_bench_checks_every_preset_config_before_running_any(tmp_path, monkeypatch):
    import flowrl.trainer as trainer_mod
    from flowrl.bench import run_bench

    monkeypatch.setattr(
        trainer_mod, "Trainer", lambda cfg: pytest.fail("a preset ran before the bad override was found")
    )
    f = tmp_path / "scale.yaml"
    f.write_text('branch_grpo: ["sampling.tree.split_steps=[0,3,6,9]"]\n')  # 16 leaves but group_size 8
    with pytest.raises(ConfigError, match="sampling.group_size"):
        run_bench(["dance_grpo", "branch_grpo"], preset_overrides=f, out=tmp_path / "b.json")


def test_presets_and_recipes_apart():
    """configs/ holds the tiny world's presets (its model under assets/), configs/recipes/ the real models' recipes."""
    assert len(RECIPES) >= 15
    for path in PRESETS:
        assert not load_config(path).model.path.startswith("/"), path.name
    for path in RECIPES:
        assert not load_config(path).model.path.startswith("assets/"), path.name
