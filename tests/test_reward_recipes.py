"""``flowrl rewards`` (name, modality, weights of every reward), ``flowrl eval --reward`` on the shipped tiny model
against scoring its images directly, and the SD3.5-M reward recipes (configs/recipes/sd35m_{hpsv2,ocr,geneval}.yaml) shrunk
onto a tiny random pipeline for two iterations."""

import inspect
import json
from importlib import metadata

import pytest
import torch
from conftest import ASSETS, REPO, shape_overrides, tiny_overrides

from flowrl import cli
from flowrl.config import load_config
from flowrl.rewards import REWARDS, build_reward
from flowrl.rewards.base import MODALITIES
from flowrl.trainer import Trainer

PROMPTS = [  # tags as a GenEval or DrawBench file carries them
    {"tag": "shapes", "prompt": "a photo of a red star"},
    {"tag": "counting", "prompt": "a photo of two circles"},
    {"tag": "counting", "prompt": "a photo of three blue crosses"},
]
VIDEO_REWARDS = {
    "frames",
    "clip_temporal",
    "motion",
    "videoalign",
    "motion_world",
    "motion_world_strict",
    "motion_world_direction",
}


def _fails(capsys, *argv) -> str:
    """Run ``flowrl ARGV`` in-process; assert exit status 2 and return the one line it wrote on stderr."""
    with pytest.raises(SystemExit) as exit_info:
        cli.main([str(a) for a in argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


# --- flowrl rewards ------------------------------------------------------------------------------------------------


def test_rewards_lists_every_reward_with_its_modality_and_weights(capsys, monkeypatch):
    installed = [
        metadata.EntryPoint("sharpness", "flowrl.rewards.jpeg:jpeg_incompressibility", "flowrl.rewards"),
        metadata.EntryPoint("plain_fn", "flowrl.rewards.jpeg:jpeg_size_kb", "flowrl.rewards"),
        metadata.EntryPoint("clipscore", "other_pkg:clip", "flowrl.rewards"),
        metadata.EntryPoint("broken", "no_such_module_xyz:reward", "flowrl.rewards"),
    ]
    monkeypatch.setattr(
        metadata,
        "entry_points",
        lambda group=None: metadata.EntryPoints(ep for ep in installed if group in (None, ep.group)),
    )
    cli.main(["rewards"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["NAME", "MODALITY", "GRAD", "WEIGHTS", "IT", "NEEDS"]
    listed = {line.split()[0]: line for line in lines[1:]}
    assert set(listed) == set(REWARDS) | {"sharpness", "plain_fn", "broken"}  # a registered name wins, listed once
    for name, factory in REWARDS.items():
        assert factory.modality in MODALITIES and factory.weights, name  # every built-in declares both
        assert listed[name].split(None, 1)[1].strip().startswith(factory.modality)
        assert listed[name].rstrip().endswith(factory.weights)
        expected = "image, video" if name == "remote" else "video" if name in VIDEO_REWARDS else "image"
        assert factory.modality == expected, name
    assert "PickScore_v1" in listed["pickscore"] and "CLIP-ViT-H-14" in listed["pickscore"]
    assert "HPS_v2.1" in listed["hpsv2"] and listed["jpeg_compressibility"].split()[1:] == ["image", "-", "none"]
    assert "Mask2Former" in listed["geneval"] and listed["ocr"].split()[3] == "none"
    assert listed["sharpness"].split()[1:] == ["image", "-", "none"]  # a plug-in factory's own attributes
    assert listed["plain_fn"].split()[1:] == ["-", "-", "-"]  # a plug-in that declares none
    grad = {name for name, line in listed.items() if line.split()[2] == "yes"}  # the direct methods' rewards
    assert grad == {"clipscore", "pickscore", "hpsv2", "aesthetic", "imagereward", "mps"}
    assert "not loadable" in listed["broken"] and "no_such_module_xyz" in listed["broken"]
    rows = cli.cmd_rewards(None)
    by_name = {r["name"]: r for r in rows}
    assert by_name["broken"]["source"] == "entry point no_such_module_xyz:reward"
    assert by_name["broken"]["modality"] == "-" and by_name["pickscore"]["source"] == "built-in"


def test_register_reward_checks_the_modality():
    from flowrl.rewards import register_reward

    with pytest.raises(ValueError, match="'x': modality must be one of 'image', 'video', 'image, video', got 'audio'"):
        register_reward("x", modality="audio")


# --- flowrl eval --reward ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("eval_prompts") / "drawbench_like.jsonl"
    path.write_text("".join(json.dumps(m) + "\n" for m in PROMPTS))
    return path


def test_eval_reward_writes_the_means_of_scoring_the_images_directly(tmp_path, prompt_file, capsys, monkeypatch):
    """Means, std and per-tag means in the JSON equal those of the reward applied to the same images (image i of the
    prompt-major expansion drawn from seed ``seed + i``)."""
    from flowrl.evaluation import generate

    loaded, load = [], cli._model
    monkeypatch.setattr(cli, "_model", lambda args: loaded.append(load(args)) or loaded[-1])  # reused below
    model, clip, out = ASSETS / "tiny-sd3", str(ASSETS / "tiny-clip"), tmp_path / "eval.json"
    cli.main(
        [
            "eval",
            "--model",
            str(model),
            "--prompts",
            str(prompt_file),
            "--reward",
            "jpeg_compressibility,clipscore",
            "--option",
            f"clipscore.model_path={clip}",
            "--option",
            "jpeg_compressibility.quality=90",
            "--images-per-prompt",
            "2",
            "--num-steps",
            "2",
            "--seed",
            "7",
            "--no-bf16",
            "--device",
            "cpu",
            "--out",
            str(out),
        ]
    )
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())
    assert result["n_images"] == 6 and result["images_per_prompt"] == 2 and result["bf16"] is False
    assert result["rewards"]["clipscore"]["options"] == {"model_path": clip}
    assert result["rewards"]["jpeg_compressibility"]["options"] == {"quality": 90}

    metas = [m for m in PROMPTS for _ in range(2)]
    images = generate(loaded[0], [m["prompt"] for m in metas], [7 + i for i in range(6)], 2, 4.5)  # (6, 3, 64, 64)
    direct = {
        "jpeg_compressibility": build_reward("jpeg_compressibility", quality=90),
        "clipscore": build_reward("clipscore", model_path=clip),
    }
    for name, reward in direct.items():
        scores = reward(images, [m["prompt"] for m in metas], metas).double()  # (6,)
        stats = result["rewards"][name]
        assert stats["n_images"] == 6
        assert stats["mean"] == pytest.approx(scores.mean().item(), rel=1e-5, abs=1e-6)
        assert stats["std"] == pytest.approx(scores.std().item(), rel=1e-4, abs=1e-6)  # sample std (n - 1)
        assert stats["per_tag"] == pytest.approx(
            {"shapes": scores[:2].mean().item(), "counting": scores[2:].mean().item()}, rel=1e-5, abs=1e-6
        )
        assert f"{name}: mean {stats['mean']:.4f} (std {stats['std']:.4f}) over 6 images" in printed
    assert result["rewards"]["clipscore"]["std"] > 0  # the check is not vacuous: the images differ


@pytest.mark.parametrize(
    "argv,message",
    [
        (
            ["--reward", "clipscore,jpeg_compressibility", "--option", "model_path=x"],
            "--option 'model_path=x': with several rewards, name the reward: NAME.key=value (--reward lists clipscore, "
            "jpeg_compressibility)",
        ),
        (
            ["--reward", "clipscore", "--option", "pickscore.scale=26"],
            "--option 'pickscore.scale=26' is for reward 'pickscore', not one of this command's: clipscore",
        ),
        (
            ["--reward", "clipscore", "--option", "model_path"],
            "--option 'model_path' must look like key=value or NAME.key=value",
        ),
        (["--reward", "clipscore,clipscore"], "--reward 'clipscore,clipscore' names clipscore twice"),
        (["--reward", "clipscore,"], "--reward 'clipscore,': expected NAME or NAME,NAME,... with no empty name"),
        (
            ["--reward", "clipscore", "--images-per-tag", "4"],
            "--images-per-tag is for the GenEval accuracy (no --reward)",
        ),
        (["--option", "scale=2"], "--option sets a reward's option; give the reward with --reward NAME"),
        (["--format", "csv"], "--format is for --reward; the GenEval accuracy reads GenEval metadata (.jsonl)"),
        (["--images-per-prompt", "2"], "--images-per-prompt is for --reward"),
        (["--reward", "no_such_reward"], "unknown reward 'no_such_reward'; registered rewards: aesthetic,"),
        (
            ["--reward", "jpeg_compressibility", "--option", "qualty=90"],
            "reward 'jpeg_compressibility': got an unexpected",
        ),
    ],
)
def test_eval_reward_errors_are_one_line_before_the_model_loads(capsys, tmp_path, prompt_file, argv, message):
    line = _fails(
        capsys,
        "eval",
        "--model",
        tmp_path / "no_model_here",
        "--prompts",
        prompt_file,
        *argv,
        "--out",
        tmp_path / "e.json",
    )
    assert message in line and not (tmp_path / "e.json").exists()


def test_dotted_path_rewards_take_options_by_their_full_name():
    specs = ["flowrl.rewards.jpeg:jpeg_compressibility", "clipscore"]
    assert cli._reward_options(
        specs, ["flowrl.rewards.jpeg:jpeg_compressibility.quality=80", "clipscore.scale=2"]
    ) == {"flowrl.rewards.jpeg:jpeg_compressibility": {"quality": 80}, "clipscore": {"scale": 2}}
    assert cli._reward_options(["clipscore"], ["model_path=a.b", "clipscore.device=cpu"]) == {
        "clipscore": {"model_path": "a.b", "device": "cpu"}
    }


# --- the SD3.5-M reward recipes ------------------------------------------------------------------------------------

RECIPES = ["sd35m_hpsv2", "sd35m_ocr", "sd35m_geneval"]
OCR_PROMPTS = ['a shop sign that says "OPEN"', 'a poster with the words "Flow GRPO"', 'a mug printed with "tea"']


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_reward_options_are_the_factory_options(name):
    """Each recipe's reward options bind to its factory (what the test below swaps out is still checked)."""
    cfg = load_config(REPO / "configs" / "recipes" / f"{name}.yaml")
    for reward, rc in cfg.rewards.items():
        inspect.signature(REWARDS[reward]).bind(**rc.options)
    assert cfg.model.resolution == 512 and cfg.sampling.num_steps == 10 and cfg.sampling.group_size == 24
    assert cfg.train.kl_beta == {"sd35m_hpsv2": 0.01}.get(name, 0.04)  # Flow-GRPO's beta of each task


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_trains_two_iterations_on_a_tiny_pipeline(name, tmp_path, random_pipeline, prompt_files):
    """The recipe at the tiny size. Weights that cannot exist offline are swapped: HPS-v2.1 for the tiny CLIP score,
    GenEval's real backend for the tiny world's. OCR stays real (RapidOCR ships its models, ~0.1 s per 64 px image).
    The random model draws neither text nor tiny-world shapes, so a JPEG reward is added to those two for reward
    variance (as tests/test_presets.py does)."""
    train, test = prompt_files
    extra = {
        "run.mixed_precision": "no",
        "model.resolution": "null",
        "model.max_sequence_length": "null",
        "model.dtype": "float32",
        "sampling.batch_size": 4,
    }
    if name == "sd35m_hpsv2":
        extra |= {"rewards.hpsv2": "null", "rewards.clipscore.options.model_path": str(ASSETS / "tiny-clip")}
    elif name == "sd35m_ocr":
        train = test = tmp_path / "ocr.jsonl"
        train.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in OCR_PROMPTS))
        extra |= {"rewards.jpeg_compressibility.weight": 1.0}
    else:
        real = ("segmenter_path", "clip_path", "device", "batch_size")
        extra |= {f"rewards.geneval.options.{k}": "null" for k in real}  # the tiny world's detector
        extra |= {"rewards.jpeg_compressibility.weight": 1.0}
    cfg = load_config(
        REPO / "configs" / "recipes" / f"{name}.yaml",
        tiny_overrides(random_pipeline, train, test, tmp_path / "run", **extra),
    )
    cfg = load_config(
        REPO / "configs" / "recipes" / f"{name}.yaml",
        tiny_overrides(random_pipeline, train, test, tmp_path / "run", **extra, **shape_overrides(cfg)),
    )
    trainer = Trainer(cfg)
    before = {n: p.detach().clone() for n, p in trainer.policy.params.items()}
    result = trainer.train()
    metrics = [json.loads(line) for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 2 and all(m["policy/optimizer_steps"] > 0 for m in metrics)
    assert any(not torch.equal(p.detach(), before[n]) for n, p in trainer.policy.params.items())
    assert result["after"]["n_images"] > 0
    if name == "sd35m_ocr":  # the real OCR reward scored every rollout, in [0, 1]
        assert all(0.0 <= m["reward/ocr/mean"] <= 1.0 for m in metrics)
        assert set(result["after"]["per_reward"]) == {"ocr", "jpeg_compressibility"}
    if name == "sd35m_geneval":
        assert set(cfg.rewards["geneval"].options.values()) == {None} and 0 <= result["after"]["overall"] <= 1
