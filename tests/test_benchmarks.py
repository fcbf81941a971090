"""Every script under benchmarks/ runs from its command line at a tiny size, and the folder holds what the docs cite.

The scripts run as ``python benchmarks/NAME.py ARGS`` would (``runpy`` with ``__name__ == "__main__"`` and
``sys.argv`` set, in this process so torch is imported once; one of them in a fresh interpreter), on the
seeded random tiny pipeline of ``conftest.py`` with 2-4 denoising steps, and the tests read what they print
or write. They use the scripts' command-line options only, so they stay valid while the code under them moves.
"""

from __future__ import annotations

import json
import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import tiny_overrides

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "benchmarks"
SCRIPTS = (
    "base_headroom",
    "ddpo_tiny",
    "decode_precision_check",
    "failure_modes",
    "few_step_table",
    "fsdp2_units_memory",
    "gpu_scale",
    "gradient_snr",
    "methods_table",
    "memory_table",
    "nft_text_encoders",
    "overlap_rewards",
    "policy_step_check",
    "quickstart_profile",
    "reward_server_load",
    "seesaw",
    "step_influence",
    "tree_speedup",
    "video_vae_headroom",
)
"""The scripts this file runs; a new script under benchmarks/ needs a test here (checked below)."""


def run_script(name: str, args: list, monkeypatch) -> None:
    """Run ``benchmarks/NAME.py ARGS`` as its command line does, in this process."""
    script = BENCH / f"{name}.py"
    monkeypatch.setattr(sys, "argv", [str(script), *map(str, args)])
    runpy.run_path(str(script), run_name="__main__")


@pytest.fixture
def preset(tmp_path, random_pipeline, prompt_files) -> list[str]:
    """``[CONFIG, key=value ...]``: a preset with a reward that varies on random images (JPEG size), and the tiny
    overrides without ``run.output_dir`` (each test names its own)."""
    config = tmp_path / "jpeg.yaml"
    config.write_text("rewards:\n  jpeg_compressibility:\n    weight: 1.0\n")
    over = tiny_overrides(
        random_pipeline,
        *prompt_files,
        tmp_path / "unused",
        **{"run.mixed_precision": "no", "sampling.group_size": 4, "sampling.num_steps": 4},
    )
    return [str(config), *[o for o in over if not o.startswith("run.output_dir=")]]


def test_every_script_has_a_test_here():
    assert sorted(p.stem for p in BENCH.glob("*.py")) == sorted(SCRIPTS)
    assert not list(BENCH.rglob("*.sh")), "shell scripts under benchmarks/ are not run by any test"


@pytest.mark.parametrize("name", SCRIPTS)
def test_help_answers_before_torch_imports(name, tmp_path):
    """``python benchmarks/NAME.py --help`` parses its arguments before torch and flowrl's heavy modules import: it
    prints the usage at once (``-X importtime`` lists every module imported; none is torch)."""
    out = subprocess.run(
        [sys.executable, "-X", "importtime", str(BENCH / f"{name}.py"), "--help"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    imported = [line.rpartition("|")[2].strip() for line in out.stderr.splitlines() if line.startswith("import time:")]
    assert out.returncode == 0 and out.stdout.startswith("usage: "), out.stderr[-2000:]
    assert not [m for m in imported if m == "torch" or m.startswith("torch.")]


def test_benchmarks_hold_no_run_folders_and_every_cited_file_exists():
    files = [p for p in BENCH.rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    assert not [p for p in files if p.name in ("metrics.jsonl", "config.yaml") or p.suffix == ".safetensors"]
    assert sum(p.stat().st_size for p in files) < 2_500_000
    for script in BENCH.glob("*.py"):  # nothing reads an untracked folder such as .gpu/ or .build-cache/
        assert not re.search(r"[\"'/]\.(gpu|build-cache)\b", script.read_text()), script.name
    docs = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    text = "\n".join(p.read_text() for p in docs if p.is_file())
    cited = set(re.findall(r"benchmarks/[\w./-]+\.(?:py|json|jsonl|yaml|png)\b", text))
    assert not sorted(c for c in cited if not (REPO / c).is_file()), "cited in README.md or docs/ but missing"
    uncited = sorted(
        str(p.relative_to(REPO))
        for p in (BENCH / "results").glob("*")
        if p.is_file() and str(p.relative_to(REPO)) not in cited
    )
    assert not uncited, "result files no page of docs/ or README.md cites"


@pytest.mark.slow  # a benchmark script's smoke run: CI (CI=true)
def test_failure_modes_in_a_fresh_interpreter(tmp_path, random_pipeline, prompt_files):
    """The script as the docs run it, in its own process and from another folder than the repository."""
    out = tmp_path / "modes.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(BENCH / "failure_modes.py"),
            "--model",
            str(random_pipeline),
            "--prompts",
            str(prompt_files[1]),
            "--max-prompts",
            "3",
            "-k",
            "2",
            "--num-steps",
            "2",
            "--device",
            "cpu",
            "--out",
            str(out),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "| tag | images | correct | empty | unread_shape | composition |" in proc.stdout
    per_tag = json.loads(out.read_text())["per_tag"]
    assert sum(row["images"] for row in per_tag.values()) == 3 * 2
    for row in per_tag.values():
        assert sum(row[m] for m in ("correct", "empty", "unread_shape", "composition")) == pytest.approx(1.0)


def test_base_headroom(tmp_path, random_pipeline, prompt_files, monkeypatch, capsys):
    out = tmp_path / "headroom.json"
    run_script(
        "base_headroom",
        [
            "--model",
            random_pipeline,
            "--prompts",
            prompt_files[1],
            "--max-prompts",
            2,
            "-k",
            2,
            "--num-steps",
            2,
            "--times",
            0,
            1,
            "--device",
            "cpu",
            "--out",
            out,
        ],
        monkeypatch,
    )
    result = json.loads(out.read_text())
    assert sum(tag["prompts"] for tag in result["pass_at_k"].values()) == 2
    assert all(0 <= tag["mean"] <= tag["pass_at_k"] <= 1 for tag in result["pass_at_k"].values())
    assert set(result["denoise_from_scenes"]) == {"0.0", "1.0"} and "denoised from t:" in capsys.readouterr().out


def test_decode_precision_check(random_pipeline, prompt_files, monkeypatch, capsys):
    over = [
        o
        for o in tiny_overrides(
            random_pipeline,
            *prompt_files,
            Path("unused"),
            **{"sampling.prompts_per_iteration": 1, "sampling.num_steps": 2},
        )
        if not o.startswith("run.output_dir=")
    ]
    run_script("decode_precision_check", ["--rollouts", 1, *over], monkeypatch)
    result = json.loads(capsys.readouterr().out)
    assert result["images"] == 2 and 0 <= result["identical_reward_frac"] <= 1
    assert result["decode_s_float32"] > 0 and result["decode_s_bf16"] > 0 and result["max_pixel_diff"] >= 0


def test_gradient_snr(tmp_path, preset, monkeypatch):
    out = tmp_path / "snr.json"
    run_script(
        "gradient_snr", [*preset, f"run.output_dir={tmp_path / 'run'}", "--batches", 2, "--out", out], monkeypatch
    )
    result = json.loads(out.read_text())
    assert len(result["pairwise_cosine"]) == 1 and -1 <= result["pairwise_cosine"][0] <= 1
    assert result["images_per_batch"] == 2 * 4 and all(n > 0 for n in result["grad_norms"])


def test_quickstart_profile_times_every_part(tmp_path, preset, monkeypatch):
    out = tmp_path / "profile.json"
    run_script("quickstart_profile", ["--config", *preset, "--iterations", 2, "--out", out], monkeypatch)
    result = json.loads(out.read_text())
    median = result["median"]
    parts = ("transformer in rollout and scoring", "transformer in update, with gradients", "VAE decode", "update")
    assert len(result["rows"]) == 2 and all(median[k] > 0 for k in parts)
    assert (
        median["transformer in rollout and scoring"] + median["VAE decode"] <= median["sample_s"]
    )  # within the whole
    assert result["eval_s"] > 0 and result["eval_parts"]["transformer in evaluation"] > 0


def test_step_influence(tmp_path, preset, monkeypatch):
    out = tmp_path / "influence.json"
    run_script(
        "step_influence",
        [*preset, "sampling.num_steps=3", f"run.output_dir={tmp_path / 'run'}", "--iterations", 1, "--out", out],
        monkeypatch,
    )
    result = json.loads(out.read_text())
    assert [row["step"] for row in result["per_step"]] == [0, 1]  # 3 steps; the last one is deterministic
    assert (
        all(row["within_group_var"] >= 0 for row in result["per_step"]) and result["full_sde"]["within_group_var"] > 0
    )


def test_policy_step_check(tmp_path, preset, monkeypatch):
    out = tmp_path / "step.json"
    run_script(
        "policy_step_check",
        [*preset, f"run.output_dir={tmp_path / 'run'}", "train.minibatch_size=1000", "--out", out],
        monkeypatch,
    )
    result = json.loads(out.read_text())
    assert result["optimizer_steps"] == 1 and -1 <= result["corr_change_advantage"] <= 1
    assert 0 <= result["clipfrac"] <= 1


def test_tree_speedup(tmp_path, random_pipeline, prompt_files, monkeypatch, capsys):
    out = tmp_path / "tree.json"
    over = [
        o
        for o in tiny_overrides(
            random_pipeline,
            *prompt_files,
            tmp_path / "unused",
            **{
                "sampling.prompts_per_iteration": 1,
                "sampling.num_steps": 3,
                "sampling.group_size": 4,
                "sampling.tree.split_steps": "[0,1]",
            },
        )
        if not o.startswith("run.output_dir=")
    ]
    run_script("tree_speedup", ["branch_grpo", "--repeats", 1, "--out", out, "--overrides", *over], monkeypatch)
    (row,) = json.loads(out.read_text())
    assert row["preset"] == "branch_grpo" and row["leaves"] == 4 and row["batched_s"] > 0 and row["node_by_node_s"] > 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1]) == row


def test_nft_text_encoders(tmp_path, preset, monkeypatch, capsys):
    run = tmp_path / "run"
    run_script(
        "nft_text_encoders",
        [preset[0], "--text-lr", 1e-2, *preset[1:], "train.method=nft", "run.iterations=1", f"run.output_dir={run}"],
        monkeypatch,
    )
    assert "GenEval strict accuracy:" in capsys.readouterr().out
    assert (run / "metrics.jsonl").is_file() and (run / "eval.json").is_file()


def test_gpu_scale_at_a_tiny_size_on_the_cpu(tmp_path, monkeypatch, capsys):
    """The GPU benchmark's whole path on a few-MB SD3: the stock pipeline and flowrl's rollout on the same
    transformer, one update, its counted FLOPs (MFU needs a GPU's peak, so it is left empty on a CPU)."""
    out = tmp_path / "gpu_scale.json"
    run_script(
        "gpu_scale",
        [
            "--family",
            "tiny",
            "--resolution",
            64,
            "--steps",
            3,
            "--device",
            "cpu",
            "--repeats",
            1,
            "--presets",
            "flow_grpo,mix_grpo_flash",
            "--folder",
            tmp_path,
            "--out",
            out,
        ],
        monkeypatch,
    )
    result = json.loads(out.read_text())
    assert [r["preset"] for r in result["rows"]] == ["flow_grpo", "mix_grpo_flash"]
    for row in result["rows"]:
        assert row["stock_s"] > 0 and row["rollout_s"] > 0 and row["trained_transitions"] > 0
        assert row["train_tflops"] > 0 and row["mfu"] is None and row["peak_gib_train"] is None
    assert result["meta"]["device"] == "cpu" and 0 < result["meta"]["transformer_params_b"] < 0.01
    assert "| flow_grpo | 8 |" in capsys.readouterr().out


@pytest.mark.slow  # a benchmark script's smoke run: CI (CI=true)
def test_ddpo_tiny(tmp_path, monkeypatch, capsys):
    """The CPU DDPO run at a tiny size: its seeded pipeline is the shared builder's, and the curve it reports is the
    run's logged JPEG reward in kB (minus the reward), start and end the means of the first and last iterations."""
    from safetensors.torch import load_file

    from flowrl.tiny.sd15 import build_random_sd15_pipeline

    work, out, plot = tmp_path / "work", tmp_path / "ddpo.json", tmp_path / "ddpo.png"
    run_script(
        "ddpo_tiny",
        [
            "--seeds",
            0,
            1,
            "--iterations",
            2,
            "--model-seed",
            3,
            "--workdir",
            work,
            "--out",
            out,
            "--plot",
            plot,
            "sampling.num_steps=3",
            "sampling.group_size=2",
            "model.resolution=32",
            "eval.num_steps=2",
            "train.minibatch_size=6",
        ],
        monkeypatch,
    )
    result = json.loads(out.read_text())
    assert [row["seed"] for row in result["rows"]] == [0, 1] and plot.stat().st_size > 0
    for row in result["rows"]:
        lines = (work / f"seed-{row['seed']}" / "metrics.jsonl").read_text().splitlines()
        metrics = [json.loads(line) for line in lines]
        assert row["jpeg_kb"] == [-m["reward/jpeg_compressibility/mean"] for m in metrics] and len(metrics) == 2
        assert row["start_kb"] == pytest.approx(sum(row["jpeg_kb"]) / 2) == row["end_kb"]
        assert all(m["policy/ratio_first_max_dev"] == 0.0 for m in metrics)
        assert all(m["cost/trained_transitions"] == 2 * 2 * 3 for m in metrics)  # 2 prompts x 2 images x 3 steps
        assert 0 < row["eval_before_kb"] < 10 and 0 < row["eval_after_kb"] < 10
    assert result["rows"][0]["jpeg_kb"] != result["rows"][1]["jpeg_kb"]  # run.seed differs
    built = load_file(work / "pipeline-3" / "unet" / "diffusion_pytorch_model.safetensors")
    again = build_random_sd15_pipeline(tmp_path / "again", seed=3, sample_size=16)
    reference = load_file(again / "unet" / "diffusion_pytorch_model.safetensors")
    assert built.keys() == reference.keys() and all(built[k].equal(reference[k]) for k in built)
    assert capsys.readouterr().out.count(" kB (first/last 2 iterations), evaluation ") == 2


def test_gpu_scale_on_a_tiny_wan(tmp_path, monkeypatch):
    """The video path of the GPU benchmark: a random Wan pipeline (UMT5, Wan VAE, Wan transformer), frames passed to
    the stock WanPipeline and to flowrl's rollout alike."""
    out = tmp_path / "gpu_scale_wan.json"
    run_script(
        "gpu_scale",
        [
            "--family",
            "tiny_wan",
            "--resolution",
            32,
            "--frames",
            5,
            "--steps",
            3,
            "--device",
            "cpu",
            "--repeats",
            1,
            "--presets",
            "flow_grpo",
            "--folder",
            tmp_path,
            "--out",
            out,
        ],
        monkeypatch,
    )
    (row,) = json.loads(out.read_text())["rows"]
    assert row["stock_s"] > 0 and row["rollout_s"] > 0 and row["trained_transitions"] > 0 and row["train_tflops"] > 0


def test_video_vae_headroom(tmp_path, monkeypatch):
    """Ground-truth clips of the held-out video prompts score 1 as rendered; the shipped tiny Wan VAE's round trip
    keeps some of them (the ceiling of the tiny video main job, docs/tiny_world.md)."""
    out = tmp_path / "headroom.json"
    run_script("video_vae_headroom", ["--clips", 1, "--out", out], monkeypatch)
    result = json.loads(out.read_text())
    assert result["clips"] == 80 and result["rendered"] == {"dense": 1.0, "motion": 1.0, "strict": 1.0}
    assert 0 < result["vae_round_trip"]["motion"] <= 1 and result["vae_round_trip"]["dense"] < 1


@pytest.mark.slow  # two two-process launches
def test_fsdp2_units_memory_on_a_tiny_sd3(tmp_path, monkeypatch):
    """Both FSDP2 runs of the memory benchmark on the few-MB SD3: the root and accelerate's tail unit (the final norm)
    against those and one unit per block, each process's peak resident memory read back."""
    out = tmp_path / "units.json"
    run_script(
        "fsdp2_units_memory", ["--family", "tiny", "--layers", 2, "--resolution", 64, "--out", out], monkeypatch
    )
    result = json.loads(out.read_text())
    assert 0 < result["block_params"] < result["trained_params"]
    one, per_block = result["runs"]
    assert (one["wrap"], per_block["wrap"]) == ("NO_WRAP", "TRANSFORMER_BASED_WRAP")
    assert (one["fsdp_units"], per_block["fsdp_units"]) == (2, 4)
    for run in result["runs"]:
        assert len(run["peak_rss_mib"]) == 2 and all(100 < x for x in run["peak_rss_mib"])
        assert all(100 < x <= y for x, y in zip(run["peak_rss_after_update_mib"], run["peak_rss_mib"]))


@pytest.mark.slow  # a benchmark script's smoke run: CI (CI=true)
def test_methods_table_runs_each_method_and_reruns_the_best(tmp_path, random_pipeline, monkeypatch):
    out = tmp_path / "table.json"
    over = ["model.path=" + str(random_pipeline), "run.device=cpu", "run.mixed_precision=no", "sampling.num_steps=2"]
    over += ["sampling.group_size=2", "sampling.prompts_per_iteration=2", "eval.images_per_tag=1", "eval.num_steps=2"]
    over += [
        "eval.held_out_images_per_tag=1",
        "train.minibatch_size=4",
        "model.lora_rank=2",
        "train.offline.batch_size=2",
    ]
    over += ["rewards.jpeg_compressibility.weight=1.0", "train.nft.timesteps=2"]
    args = ["--methods", "quickstart", "awm", "sft", "--budget-s", 0.01, "--seeds-for-best", 1, "--extra-seeds", 1]
    run_script("methods_table", [*args, "--overrides", *over, "--out", out], monkeypatch)
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert [(r["preset"], r["seed"]) for r in rows][:3] == [("quickstart", 0), ("awm", 0), ("sft", 0)]
    assert len(rows) == 5 and {(r["preset"], r["seed"]) for r in rows[3:]} >= {("quickstart", 1)}
    assert all(r["iterations"] == 1 and 0 <= r["held_out_accuracy"] <= 1 for r in rows)
    assert rows[2]["reward_first"] is None and rows[1]["reward_first"] is not None  # SFT scores nothing
    assert "| SFT (shipped images) | `sft` | 1 |" in out.with_suffix(".md").read_text()
    args = ["--methods", "sft", "--budget-s", 0.01, "--seeds", 3, "--append"]  # one more seed, same table
    run_script("methods_table", [*args, "--overrides", *over, "--out", out], monkeypatch)
    assert [(r["preset"], r["seed"]) for r in json.loads(out.read_text())["rows"]][5:] == [("sft", 3)]
    assert "| SFT (shipped images) | `sft` | 2 |" in out.with_suffix(".md").read_text()


@pytest.mark.slow  # a benchmark script's smoke run: CI (CI=true)
def test_few_step_table_runs_every_row_once_and_appends_a_seed(tmp_path, random_pipeline, prompt_files, monkeypatch):
    """A 1-iteration tdm student on the random pipeline; the table's five rows (the base and the student evaluated
    without a step, the three trained ones one iteration each), then one more seed of the trained rows appended."""
    from flowrl.config import load_config
    from flowrl.trainer import Trainer

    over = ["model.path=" + str(random_pipeline), "run.device=cpu", "run.mixed_precision=no", "sampling.num_steps=2"]
    over += ["sampling.group_size=2", "sampling.prompts_per_iteration=2", "eval.images_per_tag=1", "eval.num_steps=2"]
    over += ["eval.held_out_images_per_tag=1", "train.minibatch_size=4", "model.lora_rank=2", "run.diversity_model="]
    student = tmp_path / "tdm"
    tdm = [*over, "train_prompts=" + str(prompt_files[0]), "eval.prompts=" + str(prompt_files[1])]
    Trainer(load_config(REPO / "configs/tdm.yaml", [*tdm, "run.iterations=1", f"run.output_dir={student}"])).train()
    out = tmp_path / "few.json"
    args = ["--student", student / "lora", "--budget-s", 0.01, "--seeds", 0, "--overrides", *over, "--out", out]
    run_script("few_step_table", args, monkeypatch)
    rows = json.loads(out.read_text())["rows"]
    assert [(r["row"], r["preset"]) for r in rows] == [
        ("base", "dgpo"),
        ("student", "tdm_r1"),
        ("tdm_r1", "tdm_r1"),
        ("dmdr", "dmdr"),
        ("best", "dgpo"),
    ]
    assert [r["iterations"] for r in rows] == [0, 0, 1, 1, 1] and rows[0]["s_per_iteration"] is None
    assert all(0 <= r["held_out_accuracy"] <= 1 and r["eval_steps"] == 2 for r in rows)
    assert rows[2]["geneval_first"] is not None and rows[0]["geneval_first"] is None
    table = out.with_suffix(".md").read_text()
    assert "| 4-step student + TDM-R1 | `tdm_r1` | 2 steps, CFG 1 | 1 | 1 |" in table
    assert "| 10-step base + DGPO | `dgpo` | 2 steps, CFG 4.5 | 1 | 1 |" in table
    args[args.index("--seeds") + 1] = 1
    run_script("few_step_table", [*args, "--rows", "tdm_r1", "base", "--append"], monkeypatch)  # base: measured
    rows = json.loads(out.read_text())["rows"]
    assert [(r["row"], r["seed"]) for r in rows[5:]] == [("tdm_r1", 1)]
    assert "| 4-step student + TDM-R1 | `tdm_r1` | 2 steps, CFG 1 | 2 |" in out.with_suffix(".md").read_text()
    with pytest.raises(SystemExit):  # another budget: refused before any run
        run_script("few_step_table", [*args, "--budget-s", 1, "--append"], monkeypatch)
    with pytest.raises(SystemExit):
        run_script("few_step_table", ["--student", tmp_path / "none", "--out", out], monkeypatch)


def test_seesaw_refuses_bad_arguments_splits_the_prompts_and_writes_its_tables(monkeypatch, capsys):
    """The seesaw experiment's parts that need no model: its usage errors (before torch), the prompt split by tag
    groups, and the Markdown of a made-up result."""
    for args, words in [
        (["--method", "nope"], "unknown preset 'nope'"),
        (["--teacher-budget-s", 0], "--teacher-budget-s must be > 0"),
        (["--prompts-per-tag", 0], "--prompts-per-tag must be >= 1"),
        (["--groups", "a=colors", "b=colors,position"], "in several groups"),
        (["--groups", "a=colours"], "not tags of train.jsonl"),
        (["--groups", "1a=colors"], "letters, digits and _"),
        (["--overrides", "eval.num_steps"], "expected key=value"),
    ]:
        with pytest.raises(SystemExit):
            run_script("seesaw", [*args, "--out", "/nonexistent/x.json"], monkeypatch)
        assert words in capsys.readouterr().err
    seesaw = runpy.run_path(str(BENCH / "seesaw.py"), run_name="seesaw")
    groups = seesaw["GROUPS"]
    records = seesaw["read_records"](seesaw["TRAIN"])
    split = seesaw["split_prompts"](records, groups, 8)
    assert split == seesaw["split_prompts"](records, groups, 8)  # the same prompts every time
    counts = {
        g: sorted({r["tag"]: sum(x["tag"] == r["tag"] for x in rs) for r in rs}.items()) for g, rs in split.items()
    }
    assert counts == {
        "objects": [("counting", 8), ("single_object", 5), ("two_object", 8)],
        "colours": [("color_attr", 8), ("colors", 8)],
        "position": [("position", 8)],
    }
    assert seesaw["teacher_overrides"](["geneval", "objects"], {"objects": ("/t/o", ["counting", "colors"])}) == [
        "train.opd.teachers.geneval=null",
        "train.opd.teachers.objects.lora=/t/o",
        "train.opd.teachers.objects.tags=[counting,colors]",
    ]

    def acc(x):
        return {"overall": x, "per_tag": {"counting": x, "colors": x / 2}}

    meta = {"machine": "m", "method": "dgpo", "groups": {"objects": ["counting"], "colours": ["colors"]}}
    meta.update(prompts_per_tag=8, teacher_budget_s=10.0, student_budget_s=20.0, cold_start="merge")
    rows = [
        {"run": run, "seed": s, "iterations": 3, "train_s": 10.5, "trained": acc(x), "held_out": acc(x / 2)}
        for s in (0, 1)
        for run, x in [
            ("teacher:objects", 0.4),
            ("teacher:colours", 0.2),
            ("opd student", 0.6),
            ("baseline", 0.5 + s / 10),
        ]
    ]
    text = seesaw["markdown"](
        {"meta": meta, "rows": rows, "base": {"run": "base", "trained": acc(0.1), "held_out": acc(0.0)}}
    )
    assert "baseline: `dgpo`, 40 s on all of them" in text and "Seeds 0, 1" in text
    assert "| base | - | - | - | 0.100 | 0.050 | 0.100 |" in text
    assert "| baseline | 2 | 3 | 10 | 0.550 (0.500-0.600) | 0.275 (0.250-0.300) | 0.550 (0.500-0.600) |" in text
    assert (
        "| counting | objects | 0.600 | 0.550 (0.500-0.600) | +0.050 | 0.300 | 0.275 (0.250-0.300) | +0.025 |" in text
    )
    assert text.index("| teacher:objects |") < text.index("| teacher:colours |") < text.index("| opd student |")


def test_reward_server_load_checks_every_reply_and_survives_a_killed_client(tmp_path, monkeypatch):
    out = tmp_path / "load.json"
    args = ["--clients", 4, "--requests", 5, "--images", 2, "--side", 8, "--delay-s", 0, "--out", out]
    run_script("reward_server_load", args, monkeypatch)
    result = json.loads(out.read_text())
    assert result["answered"] == result["expected"] == 20 and result["mixed_replies"] == 0 and not result["failures"]
    assert result["killed_client"] and result["health_after"] == "ok" and result["unfinished_clients"] == 0
    assert result["latency_p50_ms"] <= result["latency_p99_ms"]


@pytest.mark.slow  # a benchmark script's smoke run: CI (CI=true)
def test_overlap_rewards_times_both_settings_against_a_served_reward(
    tmp_path, random_pipeline, prompt_files, monkeypatch
):
    out = tmp_path / "overlap.json"
    over = tiny_overrides(random_pipeline, *prompt_files, tmp_path / "unused", **{"sampling.num_steps": 2})
    args = ["--iterations", 2, "--repeats", 1, "--batch-size", 2, "--seconds-per-image", 0.01, "--out", out]
    run_script(
        "overlap_rewards",
        [*args, "--overrides", *[o for o in over if not o.startswith("run.output_dir=")]],
        monkeypatch,
    )
    result = json.loads(out.read_text())
    assert result["same_metrics"] and result["same_weights"] and result["machine"]["cores"] >= 1
    assert [r["overlap_rewards"] for r in result["runs"]] == [False, True]
    assert result["runs"][1]["time/score_worker_s"] > 0 and result["runs"][0]["time/score_worker_s"] == 0


def test_memory_table_plans_each_published_model_at_its_recipe(tmp_path, monkeypatch, capsys):
    """The memory table's rows (docs/distributed.md): an engine under 80 GB or "does not fit" with the best, for LoRA on
    one GPU and full fine-tuning on eight."""
    out = tmp_path / "table.json"
    run_script("memory_table", ["--names", "sd15", "flux2_klein_4b", "--out", out], monkeypatch)
    rows = json.loads(out.read_text())["rows"]
    assert [r["name"] for r in rows] == ["sd15", "flux2_klein_4b"]
    for r in rows:
        assert r["lora_1gpu"]["fits"] and r["lora_1gpu"]["total_gib"] < 81559 / 1024
        assert r["full_8gpu"]["trained_params"] > r["lora_1gpu"]["trained_params"]
    assert "| sd15 (`sd15_ddpo`) |" in capsys.readouterr().out
