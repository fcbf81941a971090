"""Hostile inputs, second pass (docs/reliability.md): a folder holding only a finished run's outputs is a run, an empty
or non-UTF-8 config, absurd ranges, a resume shorter than its checkpoint, standard-library reward specs, failing
reward modules, a taken port, an unreachable reward server, a read-only or full disk. Each ends in one line with exit
status 2, or in the sensible behaviour, before anything is overwritten."""

from __future__ import annotations

import errno
import socket
import time

import pytest
from conftest import REPO, cli_fails, tiny_overrides

from flowrl import cli
from flowrl.config import ConfigError, load_config
from flowrl.trainer import Trainer

_fails = cli_fails


@pytest.mark.parametrize("left", ["lora/pytorch_lora_weights.safetensors", "grid.png", "pipeline/model_index.json"])
def test_a_folder_with_only_a_finished_runs_outputs_is_a_run(left, tmp_path, random_pipeline, prompt_files):
    out = tmp_path / "run"
    (out / left).parent.mkdir(parents=True, exist_ok=True)
    (out / left).write_bytes(b"the earlier run's")
    with pytest.raises(FileExistsError, match=f"already holds a run \\({left.split('/')[0]}\\)"):
        Trainer(load_config(None, tiny_overrides(random_pipeline, *prompt_files, out)))
    assert (out / left).read_bytes() == b"the earlier run's"
    (out / left).unlink()  # an empty lora/ or pipeline/ folder is not a run
    Trainer(load_config(None, tiny_overrides(random_pipeline, *prompt_files, out)))


def test_empty_and_non_utf8_configs_are_refused_naming_the_file(tmp_path, capsys):
    (tmp_path / "empty.yaml").write_text("# nothing but a comment\n\n")
    assert "is empty: it names no model and no rewards" in _fails(capsys, "train", tmp_path / "empty.yaml")
    (tmp_path / "latin1.yaml").write_bytes("run:\n  output_dir: caf\xe9\n".encode("latin-1"))
    line = _fails(capsys, "train", tmp_path / "latin1.yaml")
    assert "latin1.yaml is not UTF-8 text" in line


def test_a_prompt_file_that_is_not_utf8_is_named(tmp_path):
    from flowrl.data import read_jsonl

    (tmp_path / "p.jsonl").write_bytes('{"prompt": "caf\xe9"}\n'.encode("latin-1"))
    with pytest.raises(ValueError, match=r"prompt file .*p\.jsonl is not UTF-8 text"):
        read_jsonl(tmp_path / "p.jsonl")


@pytest.mark.parametrize(
    "key,value",
    [
        ("sampling.guidance_scale", 1e30),
        ("eval.guidance_scale", 101),
        ("train.learning_rate", 1e30),
        ("run.seed", 2**64),
        ("run.seed", -1),
    ],
)
def test_absurd_values_are_refused_by_range(key, value):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, [f"{key}={value}"])


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--guidance-scale", "1e30"], "--guidance-scale: must be a finite number below 100"),
        (["--shift", "inf"], "--shift: must be a finite number"),
        (["--seed", str(2**64)], "--seed: must be a finite number below"),
    ],
)
def test_sample_flags_out_of_range_name_the_flag(argv, message, capsys):
    assert message in _fails(capsys, "sample", "--model", "assets/tiny-sd3", *argv)


def test_resuming_with_fewer_iterations_than_the_checkpoint_is_refused_before_anything_is_rewritten(
    tmp_path, random_pipeline, prompt_files
):
    out = tmp_path / "run"
    Trainer(load_config(None, tiny_overrides(random_pipeline, *prompt_files, out, **{"run.iterations": 2}))).train()
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir() if p.is_file() and p.name[0] != "."}
    over = tiny_overrides(random_pipeline, *prompt_files, out, **{"run.iterations": 1, "run.resume": "true"})
    with pytest.raises(ConfigError, match=r"'run\.iterations': 1 is below the iteration of the checkpoint .*: 2"):
        Trainer(load_config(None, over)).train()
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir() if p.is_file() and p.name[0] != "."} == before


@pytest.mark.parametrize("spec", ["os:system", "subprocess:run", "builtins:eval"])
def test_a_reward_spec_naming_the_standard_library_is_refused_before_it_runs(spec):
    from flowrl.rewards import build_reward

    with pytest.raises(ValueError, match="names a function of Python's standard library"):
        build_reward(spec, command="touch /tmp/flowrl-should-not-exist")


def test_a_reward_module_that_fails_to_import_is_one_line(tmp_path, monkeypatch):
    from flowrl.rewards import build_reward

    (tmp_path / "broken_reward.py").write_text("import not_a_module_anywhere\n\ndef fn(i, p, m):\n    return i\n")
    (tmp_path / "raising_reward.py").write_text("raise RuntimeError('configured\\nbadly')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match="importing 'broken_reward' failed: No module named 'not_a_module_anywhere'"):
        build_reward("broken_reward:fn")
    with pytest.raises(ValueError, match="importing 'raising_reward' raised RuntimeError: configured badly"):
        build_reward("raising_reward:fn")


def test_a_reward_server_on_a_taken_port_is_one_line():
    from flowrl.rewards.server import RewardServer

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        with pytest.raises(ValueError, match=r"cannot listen on 127\.0\.0\.1:\d+ .*choose another --port"):
            RewardServer(lambda i, p, m: i.mean(dim=(1, 2, 3)), port=taken.getsockname()[1])
    finally:
        taken.close()


def test_an_unreachable_reward_server_fails_within_the_connect_timeouts():
    from flowrl.rewards.server import RemoteReward

    free = socket.socket()
    free.bind(("127.0.0.1", 0))
    port = free.getsockname()[1]
    free.close()  # nothing listens there now
    remote = RemoteReward(f"http://127.0.0.1:{port}", retries=1, connect_timeout=0.5)
    t0 = time.time()
    with pytest.raises(ConnectionError, match="unreachable after 2 attempt"):
        remote._request("/health")
    assert time.time() - t0 < 5
    with pytest.raises(ValueError, match="connect_timeout must be seconds > 0"):
        RemoteReward("http://127.0.0.1:1", connect_timeout=0)


@pytest.mark.parametrize("code,words", [(errno.EROFS, "read-only"), (errno.ENOSPC, "no space left")])
def test_a_read_only_or_full_disk_is_one_line(code, words, capsys, monkeypatch):
    def fail(args):
        raise OSError(code, "raised by the file system", "/some/out/grid.png")

    monkeypatch.setattr(cli, "_parser", lambda: _one_command_parser(fail))
    line = _fails(capsys, "sample")
    assert words in line and "/some/out/grid.png" in line


def _one_command_parser(fn):
    import argparse

    parser = argparse.ArgumentParser(prog="flowrl")
    sub = parser.add_subparsers(dest="command")
    sub.add_parser("sample").set_defaults(fn=fn)
    return parser


def test_reward_options_of_the_gardo_preset_name_unknown_auxiliaries():
    with pytest.raises(ConfigError, match=r"train\.gardo\.auxiliary"):
        load_config(REPO / "configs" / "gardo.yaml", ["train.gardo.auxiliary=[nope]"])


@pytest.mark.parametrize(
    "component,key,value", [("vae", "block_out_channels", None), ("transformer", "num_layers", "two")]
)
def test_a_component_config_that_does_not_build_is_one_line(component, key, value, tmp_path, random_pipeline, capsys):
    import json
    import shutil

    folder = tmp_path / "model"
    shutil.copytree(random_pipeline, folder)
    config = json.loads((folder / component / "config.json").read_text())
    if value is None:
        config.pop(key)
    else:
        config[key] = value
    (folder / component / "config.json").write_text(json.dumps(config))
    line = _fails(capsys, "sample", "--model", folder, "--prompt", "x", "--num-steps", 1, "--out", tmp_path / "x.png")
    assert f"model folder {folder}" in line and "does not build" in line


def test_the_shipped_video_models_defaults_are_the_size_it_was_trained_at(tmp_path):
    """``flowrl sample --model assets/tiny-wan`` with no size draws what the tiny world trained (build.json's
    ``sample``: 32 px, 9 frames, 16 tokens), not Wan's published 480 px x 81 frames; a folder without that record
    keeps the published defaults (capped by its rotary embedding)."""
    import shutil

    from flowrl.models import WanModel

    tiny = REPO / "assets" / "tiny-wan"
    default, unit, largest, _ = WanModel._resolution_grid(tiny)
    assert default <= largest and default % unit == 0
    assert WanModel.check_resolution(tiny, None) == 32 and WanModel.check_num_frames(tiny, None) == 9
    assert WanModel.default_max_sequence_length(tiny) == 16
    published = tmp_path / "no-record"
    shutil.copytree(tiny, published, ignore=shutil.ignore_patterns("build.json", "*.safetensors"))
    assert (
        WanModel.check_resolution(published, None) == min(480, largest)
        and WanModel.check_num_frames(published, None) == 81
    )
    assert WanModel.default_max_sequence_length(published) == 512


@pytest.mark.parametrize(
    "length,status",
    [("-1", b"400"), ("abc", b"400"), ("100", None)],  # None: sends 5 of 100 bytes, then stops
)
def test_the_reward_server_answers_bad_lengths_at_once_and_frees_a_stalled_client(length, status):
    from flowrl.rewards.server import RewardServer

    server = RewardServer(lambda i, p, m: i.mean(dim=(1, 2, 3)), port=0, read_timeout=1.0).start()
    try:
        host, port = server.httpd.server_address[:2]
        with socket.create_connection((host, port), timeout=10) as conn:
            head = f"POST /score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {length}\r\n\r\n"
            conn.sendall(head.encode() + (b"12345" if status is None else b""))
            t0 = time.time()
            reply = b""
            while chunk := conn.recv(4096):  # headers and body may come in separate packets; the server then closes
                reply += chunk
            assert time.time() - t0 < 5  # answered, or dropped after read_timeout: never held until the client's
            if status is not None:
                assert reply.split(b" ")[1] == status and b"Content-Length must be a byte count" in reply
        import urllib.request

        with urllib.request.urlopen(f"{server.url}/health", timeout=5) as r:  # still serving
            assert b'"status": "ok"' in r.read()
    finally:
        server.close()


def test_pickled_only_clip_and_lora_folders_say_why(tmp_path):
    import shutil

    from flowrl.rewards import build_reward

    clip = tmp_path / "clip"
    shutil.copytree(REPO / "assets" / "tiny-clip", clip)
    (clip / "model.safetensors").unlink()
    (clip / "pytorch_model.bin").write_bytes(b"a pickle")
    for reward in ("clipscore", "clip_temporal"):  # every reward model loads through rewards.base.load_pretrained
        with pytest.raises(ValueError, match=rf"{reward}: .*holds only pickled weights \(pytorch_model\.bin\)"):
            build_reward(reward, model_path=str(clip))
    lora = tmp_path / "lora"
    lora.mkdir()
    (lora / "adapter_model.bin").write_bytes(b"a pickle")
    from flowrl.models import load_model

    model = load_model(REPO / "assets" / "tiny-sd3")
    with pytest.raises(FileNotFoundError, match=r"adapter_model\.bin: pickles, which flowrl never loads"):
        model.load_lora(lora)


def test_eval_refuses_prompts_without_geneval_metadata_before_the_model_loads(tmp_path, capsys):
    (tmp_path / "plain.jsonl").write_text('{"prompt": "a cat"}\n{"prompt": "a dog"}\n')
    argv = ["eval", "--model", tmp_path / "no-such-model", "--prompts", tmp_path / "plain.jsonl"]
    line = _fails(capsys, *argv, "--out", tmp_path / "e.json")
    assert "line 1 (and 1 more) has no GenEval metadata" in line  # the missing model was not reached


def test_a_full_reward_server_answers_503_with_retry_after():
    import threading
    import urllib.error
    import urllib.request

    import torch

    from flowrl.rewards.server import RewardServer, encode_images

    def slow(images, prompts, metadata):
        time.sleep(1.0)
        return images.mean(dim=(1, 2, 3))

    server = RewardServer(slow, port=0, workers=1, max_queue=0).start()
    body = (
        __import__("json")
        .dumps({"images": encode_images(torch.zeros(1, 3, 4, 4)), "prompts": [""], "metadata": [{}]})
        .encode()
    )

    def post():
        request = urllib.request.Request(
            server.url + "/score", data=body, headers={"Content-Type": "application/json"}
        )
        return urllib.request.urlopen(request, timeout=10)

    try:
        first = threading.Thread(target=lambda: post().read())
        first.start()
        time.sleep(0.3)  # the first request is being scored
        with pytest.raises(urllib.error.HTTPError) as busy:
            post()
        assert busy.value.code == 503 and busy.value.headers["Retry-After"] == "1"
        first.join()
        assert post().status == 200  # free again
    finally:
        server.close()
    with pytest.raises(ValueError, match="workers must be an integer >= 1"):
        RewardServer(slow, port=0, workers=0)


def test_a_disk_that_fills_mid_run_names_the_checkpoint_to_resume_from(
    tmp_path, random_pipeline, prompt_files, capsys
):
    """The second checkpoint's write fails with ENOSPC: one line naming checkpoint 1, and the resume from it works."""
    from flowrl.checkpoint import DiskFullError

    out = tmp_path / "run"
    over = tiny_overrides(random_pipeline, *prompt_files, out)
    trainer = Trainer(load_config(REPO / "configs" / "flow_grpo.yaml", over))
    real = trainer.policy.save

    def save(directory, iteration, *args, **kwargs):
        if iteration == 2:
            raise OSError(errno.ENOSPC, "No space left on device", str(directory / "checkpoint-000002"))
        return real(directory, iteration, *args, **kwargs)

    trainer.policy.save = save
    with pytest.raises(DiskFullError, match=r"checkpoint-000001 \(iteration 1\) is verified and usable.*resume=true"):
        trainer.train()
    line = cli._machine_error(DiskFullError("x"))
    assert line == "x"  # the CLI prints the trainer's one line as it is
    Trainer(load_config(REPO / "configs" / "flow_grpo.yaml", over + ["run.resume=true"])).train()
    assert (out / "checkpoints" / "checkpoint-000002").is_dir()


@pytest.mark.parametrize("resume", [False, True])
def test_a_file_where_the_run_writes_a_folder_is_refused_before_any_work(resume, tmp_path):
    from types import SimpleNamespace

    from flowrl.run import RunFolder

    (tmp_path / "checkpoints").write_text("not a folder")
    error = FileExistsError if not resume else NotADirectoryError
    with pytest.raises(error, match="checkpoints"):
        RunFolder(tmp_path, SimpleNamespace(is_main_process=True, num_processes=1), resume=resume)


def test_flowrl_with_no_command_prints_usage_and_exits_2(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main([])
    assert exit_info.value.code == 2
    assert "usage: flowrl" in capsys.readouterr().err
