"""Benchmark prompt files, ``flowrl generate`` in GenEval's folder layout, ``flowrl score`` of image folders, and
``flowrl serve-reward`` / ``flowrl train`` with the ``remote`` reward, on 127.0.0.1 and the random tiny pipeline."""

import csv
import json
import os
import re
import socket
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from conftest import REPO, tiny_overrides
from PIL import Image

from flowrl import cli
from flowrl.image_folders import load_image, read_image_folder
from flowrl.prompt_sets import read_prompt_set
from flowrl.rewards import RewardServer, build_reward

GENEVAL_LINES = [  # the format of GenEval's prompts/evaluation_metadata.jsonl
    {"tag": "single_object", "include": [{"class": "bench", "count": 1}], "prompt": "a photo of a bench"},
    {
        "tag": "color_attr",
        "include": [{"class": "car", "count": 1, "color": "red"}],
        "exclude": [],
        "prompt": "a photo of a red car",
    },
    {
        "tag": "position",
        "include": [{"class": "dog", "count": 1}, {"class": "cat", "count": 1, "position": ["left of", 0]}],
        "prompt": "a photo of a cat left of a dog",
    },
]


def _fails(capsys, *argv) -> str:
    """Run ``flowrl ARGV`` in-process; assert exit status 2 and return the one line it wrote on stderr."""
    with pytest.raises(SystemExit) as exit_info:
        cli.main([str(a) for a in argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


@pytest.fixture
def geneval_file(tmp_path) -> Path:
    path = tmp_path / "evaluation_metadata.jsonl"
    path.write_text("".join(json.dumps(m) + "\n" for m in GENEVAL_LINES))
    return path


def test_benchmark_prompt_files_are_read(tmp_path, geneval_file):
    assert read_prompt_set(geneval_file) == GENEVAL_LINES
    drawbench = tmp_path / "drawbench.csv"  # DrawBench's columns
    with drawbench.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerows(
            [
                ["Prompts", "Category"],
                ["A red colored car.", "Colors"],
                ['A storefront with "Text to Image" written on it.', "Text"],
            ]
        )
    assert read_prompt_set(drawbench) == [
        {"prompt": "A red colored car.", "tag": "Colors"},
        {"prompt": 'A storefront with "Text to Image" written on it.', "tag": "Text"},
    ]
    parti = tmp_path / "PartiPrompts.tsv"
    parti.write_text("Prompt\tCategory\tChallenge\tNote\nbond\tAbstract\tBasic\t\n")
    assert read_prompt_set(parti) == [{"prompt": "bond", "tag": "Abstract", "Challenge": "Basic"}]
    hpd = tmp_path / "anime.json"
    hpd.write_text(json.dumps(["a girl with a sword", "a castle"]))
    assert read_prompt_set(hpd) == [
        {"prompt": "a girl with a sword", "tag": "anime"},
        {"prompt": "a castle", "tag": "anime"},
    ]
    txt = tmp_path / "p.txt"
    txt.write_text("one\n\n two \n")
    assert read_prompt_set(txt) == [{"prompt": "one"}, {"prompt": "two"}]
    bad = tmp_path / "bad.csv"
    bad.write_text("Text,Kind\nx,y\n")
    with pytest.raises(ValueError, match=r"bad.csv: no prompt column; expected one of Prompts, Prompt"):
        read_prompt_set(bad)
    with pytest.raises(ValueError, match=r"prompt format must be one of auto, jsonl"):
        read_prompt_set(txt, "xml")


def _geneval_walk(imagedir: Path) -> list[tuple[str, dict]]:
    """The folder walk of GenEval's evaluation/evaluate_images.py ``main``: numbered subfolders, ``json.load`` of
    their ``metadata.jsonl``, the files of ``samples/`` named ``\\d+\\.png``."""
    found = []
    for subfolder in os.listdir(imagedir):
        folderpath = os.path.join(imagedir, subfolder)
        if not os.path.isdir(folderpath) or not subfolder.isdigit():
            continue
        with open(os.path.join(folderpath, "metadata.jsonl")) as fp:
            metadata = json.load(fp)
        for imagename in os.listdir(os.path.join(folderpath, "samples")):
            imagepath = os.path.join(folderpath, "samples", imagename)
            if os.path.isfile(imagepath) and re.match(r"\d+\.png", imagename):
                found.append((imagepath, metadata))
    return sorted(found, key=lambda item: item[0])


def test_generate_writes_geneval_layout_and_score_reads_it(
    tmp_path, random_pipeline, geneval_file, capsys, monkeypatch
):
    loaded = []
    load = cli._model
    monkeypatch.setattr(cli, "_model", lambda args: loaded[0] if loaded else loaded.append(load(args)) or loaded[0])
    common = [
        "--model",
        random_pipeline,
        "--prompts",
        geneval_file,
        "-n",
        2,
        "--num-steps",
        2,
        "--device",
        "cpu",
        "--no-bf16",
        "--resolution",
        64,
        "--batch-size",
        4,
        "--seed",
        7,
    ]
    cli.main([str(a) for a in ["generate", *common, "--out", tmp_path / "geneval"]])
    assert "wrote 6 images (3 prompts x 2)" in capsys.readouterr().out
    walked = _geneval_walk(tmp_path / "geneval")
    assert [Path(p).relative_to(tmp_path / "geneval").as_posix() for p, _ in walked] == [
        f"{i:05d}/samples/{j:04d}.png" for i in range(3) for j in range(2)
    ]
    assert [m for _, m in walked] == [m for m in GENEVAL_LINES for _ in range(2)]  # the records, unchanged
    assert Image.open(walked[0][0]).size == (64, 64)

    cli.main([str(a) for a in ["generate", *common, "--out", tmp_path / "flat", "--layout", "flat"]])
    lines = [json.loads(line) for line in (tmp_path / "flat" / "prompts.jsonl").read_text().splitlines()]
    assert [(d["file"], d["index"], d["sample"], d["seed"]) for d in lines] == [
        (f"{i * 2 + j:05d}.png", i, j, 7 + i * 2 + j) for i in range(3) for j in range(2)
    ]
    for n, (path, _) in enumerate(walked):  # same seeds, same images, whatever the layout
        assert torch.equal(load_image(path), load_image(tmp_path / "flat" / f"{n:05d}.png"))
    assert not torch.equal(load_image(walked[0][0]), load_image(walked[1][0]))  # a new seed per sample
    assert "exists and is not an empty folder" in _fails(capsys, "generate", *common, "--out", tmp_path / "flat")

    # flowrl score on both folders: the scores of the local reward, per-tag means from the records
    images = torch.stack([load_image(p) for p, _ in walked])
    expected = build_reward("jpeg_compressibility", quality=80)(
        images, [m["prompt"] for _, m in walked], [m for _, m in walked]
    )
    for folder, out in (("geneval", "s.jsonl"), ("flat", "s.csv")):
        summary = cli.cmd_score(
            cli._parser().parse_args(
                [
                    "score",
                    str(tmp_path / folder),
                    "--reward",
                    "jpeg_compressibility",
                    "--option",
                    "quality=80",
                    "--batch-size",
                    "4",
                    "--out",
                    str(tmp_path / folder / out),
                ]
            )
        )
        assert summary["mean"] == pytest.approx(expected.double().mean().item())
        assert set(summary["per_tag"]) == {"single_object", "color_attr", "position"}
        assert summary["per_tag"]["color_attr"] == pytest.approx(expected[2:4].double().mean().item())
    rows = [json.loads(line) for line in (tmp_path / "geneval" / "s.jsonl").read_text().splitlines()]
    assert torch.equal(torch.tensor([r["score"] for r in rows]), expected)
    assert rows[2]["prompt"] == "a photo of a red car" and rows[2]["tag"] == "color_attr"
    with open(tmp_path / "flat" / "s.csv", newline="") as f:
        table = list(csv.DictReader(f))
    assert [float(r["score"]) for r in table] == pytest.approx(expected.tolist())
    printed = capsys.readouterr().out
    assert "jpeg_compressibility: mean" in printed and "over 6 images" in printed and "color_attr:" in printed


def test_score_loose_images_with_a_prompt_file(tmp_path, capsys):
    folder = tmp_path / "imgs"
    folder.mkdir()
    for n, level in enumerate([0, 128, 255]):
        Image.new("RGB", (8, 8), (level, 0, 0)).save(folder / f"{n}.png")
    prompts = tmp_path / "p.txt"
    prompts.write_text("a\nb\nc\n")
    records = read_image_folder([folder], read_prompt_set(prompts))
    assert [(Path(r["file"]).name, r["prompt"]) for r in records] == [("0.png", "a"), ("1.png", "b"), ("2.png", "c")]
    by_name = tmp_path / "p.jsonl"
    by_name.write_text(
        '{"file": "2.png", "prompt": "z"}\n{"file": "0.png", "prompt": "x"}\n{"file": "1.png", "prompt": "y"}\n'
    )
    assert [r["prompt"] for r in read_image_folder([folder], read_prompt_set(by_name))] == ["x", "y", "z"]
    two = tmp_path / "two.txt"
    two.write_text("a\nb\n")
    line = _fails(capsys, "score", folder, "--reward", "jpeg_compressibility", "--prompts", two)
    assert line == (
        "flowrl score: error: --prompts holds 2 prompts for 3 images; give one per image (in the images' "
        "name order), one for all, or records with a 'file' key"
    )
    assert "p.txt is not an image file (expected .png" in _fails(
        capsys, "score", tmp_path / "p.txt", "--reward", "ocr"
    )
    (tmp_path / "empty").mkdir()
    assert "no images found in" in _fails(capsys, "score", tmp_path / "empty", "--reward", "jpeg_compressibility")
    assert "--option 'quality' must look like key=value" in _fails(
        capsys, "score", folder, "--reward", "jpeg_compressibility", "--option", "quality"
    )
    assert "unknown reward 'nope'" in _fails(capsys, "score", folder, "--reward", "nope")
    cli.main(["score", str(folder), "--reward", "jpeg_compressibility"])  # no prompts: a note, then the scores
    captured = capsys.readouterr()
    assert "no prompts for the 3 images" in captured.err and "over 3 images" in captured.out


def test_score_through_a_remote_reward_equals_local(tmp_path, capsys):
    folder = tmp_path / "imgs"
    folder.mkdir()
    g = torch.Generator().manual_seed(0)
    for n in range(3):
        Image.fromarray((torch.rand(16, 16, 3, generator=g) * 255 * (n / 2)).byte().numpy()).save(folder / f"{n}.png")
    local = cli.cmd_score(cli._parser().parse_args(["score", str(folder), "--reward", "jpeg_compressibility"]))
    with RewardServer(build_reward("jpeg_compressibility"), port=0) as server:
        remote = cli.cmd_score(
            cli._parser().parse_args(
                [
                    "score",
                    str(folder),
                    "--reward",
                    "remote",
                    "--option",
                    f"url={server.url}",
                    "--option",
                    "encoding=png",
                    "--out",
                    str(tmp_path / "r.jsonl"),
                ]
            )
        )
    assert remote["mean"] == local["mean"] and remote["std"] == local["std"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def _served(*args: str):
    """``flowrl serve-reward ARGS --port 0`` in a subprocess: yields the URL it prints; terminated on exit."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    command = [sys.executable, "-m", "flowrl.cli", "serve-reward", *args, "--port", "0"]
    process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = process.stdout.readline()
        match = re.search(r"serving reward .* on (http://127\.0\.0\.1:\d+)", line)
        assert match, line + process.stderr.read()
        yield match.group(1)
    finally:
        process.terminate()
        process.wait(timeout=30)


def test_serve_reward_command_serves_on_loopback():
    """A subprocess smoke run of ``flowrl serve-reward``: it prints its URL, serves /health and /score, and a bad
    option fails in one line."""
    with _served("jpeg_compressibility", "--option", "quality=80") as url:
        remote = build_reward("remote", url=url, timeout=30)
        assert remote.health()["reward"] == "jpeg_compressibility"
        images = torch.rand(2, 3, 16, 16, generator=torch.Generator().manual_seed(1))
        expected = build_reward("jpeg_compressibility", quality=80)(images, ["a", "b"], [{}, {}])
        assert torch.equal(remote(images, ["a", "b"], [{}, {}]), expected)


def test_serve_reward_serves_a_reward_module_file_without_the_trainers_libraries(tmp_path):
    """docs/rewards.md's recipe for a reward that pins old libraries (DeQA-Score and kin): a module file served by
    ``flowrl serve-reward FILE.py:function`` from the reward's own environment, which needs neither diffusers nor
    transformers: the stand-in refuses to score if the server process imported them."""
    (tmp_path / "stand_in.py").write_text(
        "import sys\n"
        "def score(offset=0.0):  # a factory: its options are the server's --option\n"
        "    def reward(images, prompts, metadata):\n"
        "        loaded = [m for m in ('diffusers', 'transformers', 'accelerate', 'peft') if m in sys.modules]\n"
        "        assert not loaded, loaded\n"
        "        return images.mean(dim=(1, 2, 3)) + float(offset)\n"
        "    return reward\n"
    )
    with _served(f"{tmp_path / 'stand_in.py'}:score", "--option", "offset=1.5") as url:
        images = torch.rand(3, 3, 8, 8, generator=torch.Generator().manual_seed(2))
        scores = build_reward("remote", url=url, timeout=30)(images, ["a", "b", "c"], [{}, {}, {}])
        torch.testing.assert_close(scores, images.mean(dim=(1, 2, 3)) + 1.5)
    with pytest.raises(ValueError, match=r"reward spec '.*missing.py:score': no Python file .*missing.py"):
        build_reward(f"{tmp_path / 'missing.py'}:score")


def test_serve_reward_options_are_checked_before_serving(capsys, monkeypatch):
    monkeypatch.setattr(RewardServer, "serve_forever", lambda self: pytest.fail("served"))
    line = _fails(capsys, "serve-reward", "jpeg_compressibility", "--port", _free_port(), "--option", "qualty=80")
    assert line.startswith(
        "flowrl serve-reward: error: reward 'jpeg_compressibility': got an unexpected keyword "
        "argument 'qualty'; accepted options: quality"
    ), line
    assert "--port: must be >= 0, got -1" in _fails(capsys, "serve-reward", "jpeg_compressibility", "--port", -1)


def _remote_config(path: Path, url: str) -> Path:
    path.write_text(f"rewards:\n  remote:\n    weight: 1.0\n    options:\n      url: {url}\n      retries: 0\n")
    return path


def test_train_stops_in_one_line_when_the_reward_server_is_down(tmp_path, random_pipeline, prompt_files, capsys):
    """The trainer's smoke call reaches the remote reward before any sampling: a server that is down stops
    training in one line naming the URL, and nothing is written."""
    url = f"http://127.0.0.1:{_free_port()}"
    line = _fails(
        capsys,
        "train",
        _remote_config(tmp_path / "remote.yaml", url),
        *tiny_overrides(random_pipeline, *prompt_files, tmp_path / "run"),
    )
    assert line.startswith(
        f"flowrl train: error: reward remote raised ConnectionError: remote reward: reward server "
        f"{url} is unreachable after 1 attempt(s)"
    ), line
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_train_with_a_remote_reward(tmp_path, random_pipeline, prompt_files):
    """The trainer uses the remote reward like a local one: its smoke call, then the rollouts' batches."""
    calls = []

    def counted(images, prompts, metadata):
        calls.append(len(prompts))
        return build_reward("jpeg_compressibility")(images, prompts, metadata)

    with RewardServer(counted, port=0) as server:
        cli.main(
            [
                str(a)
                for a in [
                    "train",
                    _remote_config(tmp_path / "remote.yaml", server.url),
                    *tiny_overrides(
                        random_pipeline,
                        *prompt_files,
                        tmp_path / "run",
                        **{"run.iterations": 1, "run.mixed_precision": "no"},
                    ),
                ]
            ]
        )
    assert len(calls) >= 2  # the smoke call and the rollouts' batch
    assert any((tmp_path / "run").rglob("*.safetensors"))


@pytest.mark.slow
def test_a_reward_server_dying_mid_run_loses_nothing_checkpointed(tmp_path, random_pipeline, prompt_files):
    """The server goes down right after checkpoint 1: iteration 2 stops with one error naming the URL, checkpoint 1
    verifies, and the run resumes from it against a server started again."""
    from flowrl.checkpoint import verify_checkpoint
    from flowrl.config import load_config
    from flowrl.trainer import Trainer

    server = RewardServer(build_reward("jpeg_compressibility"), port=0).start()
    overrides = tiny_overrides(
        random_pipeline, *prompt_files, tmp_path / "run", **{"run.iterations": 2, "run.mixed_precision": "no"}
    )
    trainer = Trainer(load_config(_remote_config(tmp_path / "remote.yaml", server.url), overrides))
    save = trainer.checkpointer.save

    def save_then_lose_the_server(iteration, elapsed):
        save(iteration, elapsed)
        server.close()

    trainer.checkpointer.save = save_then_lose_the_server
    with pytest.raises(RuntimeError, match=rf"reward remote raised ConnectionError: .*{server.url} is unreachable"):
        trainer.train()
    checkpoint = tmp_path / "run" / "checkpoints" / "checkpoint-000001"
    verify_checkpoint(checkpoint)  # raises if torn
    assert not (tmp_path / "run" / "checkpoints" / "checkpoint-000002").exists()
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 1
    with RewardServer(build_reward("jpeg_compressibility"), port=0) as again:
        resumed = Trainer(
            load_config(_remote_config(tmp_path / "remote2.yaml", again.url), [*overrides, "run.resume=true"])
        )
        assert resumed.train()["iterations"] == 2
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [1, 2]
