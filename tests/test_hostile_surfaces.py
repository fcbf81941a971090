"""Hostile inputs, third pass (docs/reliability.md): the surfaces of offline data sets, direct-reward and forward-process
presets, stop rules, `flowrl overopt`, `serve-reward FILE.py:factory`, the VLM and VideoAlign rewards and
image-to-video records, and the shipped presets run from a folder outside the repository. Each case ends in one line
naming the file, key, reward or server, or in the sensible behaviour."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import REPO, cli_fails, tiny_overrides

from flowrl.config import ConfigError, load_config
from flowrl.prompt_sampler import iteration_seed
from flowrl.trainer import Trainer


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


@pytest.mark.parametrize(
    "preset,key,value,index,got",
    [
        ("crd", "train.crd.old_decay", "[0,0.25,inf,0.999]", 2, "inf"),
        ("crd", "train.crd.sampler_decay", "[75,nan,0.0075,0.999]", 1, "nan"),
        ("alignprop", "train.direct.alignprop_range", "[0,-inf]", 1, "-inf"),
        ("alignprop", "train.direct.alignprop_range", "[0,Infinity]", 1, "inf"),
    ],
)
def test_a_non_finite_number_in_a_list_from_the_command_line_is_refused_naming_the_key(
    preset, key, value, index, got, capsys
):
    """``inf`` / ``nan`` typed into a list on the command line (YAML reads them as strings) is refused as a scalar's
    is, with the key and the item, before any work; the lists' numbers are floats."""
    line = _fails(capsys, "train", REPO / "configs" / f"{preset}.yaml", f"{key}={value}")
    assert line == f"flowrl train: error: config key '{key}[{index}]' must be a finite number, got {got}"
    assert load_config(None, ["train.crd.old_decay=[0,1,0,1]"]).train.crd.old_decay == [0.0, 1.0, 0.0, 1.0]
    with pytest.raises(ConfigError, match=r"'train\.direct\.alignprop_range\[1\]'.*'high'"):
        load_config(None, ["train.direct.alignprop_range=[0,high]"])


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


@pytest.fixture(scope="module")
def tiny_wan_i2v(tmp_path_factory):
    """A random tiny Wan 2.1 image-to-video pipeline folder."""
    from tiny_pipelines.wan_i2v import build_random_wan_i2v_pipeline

    return build_random_wan_i2v_pipeline(tmp_path_factory.mktemp("wan21") / "pipeline")


@pytest.mark.parametrize(
    "command,suffix",
    [
        (("generate", "--out", "images"), ".jsonl"),
        (("eval", "--reward", "jpeg_compressibility", "--out", "r.json"), ".jsonl"),
        (("eval", "--out", "r.json"), ".jsonl"),  # the GenEval accuracy
        (("generate", "--out", "images"), ".txt"),
        (("eval", "--reward", "jpeg_compressibility", "--out", "r.json"), ".csv"),
    ],
)
def test_eval_and_generate_refuse_image_to_video_records_without_their_source_before_the_model_loads(
    command, suffix, tmp_path, tiny_wan_i2v, i2v_prompts, capsys, monkeypatch
):
    """As ``flowrl train`` does: a record without ``image`` (file and line), or a prompt format that names no source
    images, is refused before any weight loads; a file whose records all name theirs goes on to load the model."""
    import flowrl.models as models

    def loads(*args, **kwargs):
        raise RuntimeError("the model loads")

    monkeypatch.setattr(models, "build_adapter", loads)
    source = str(i2v_prompts[0].parent / json.loads(i2v_prompts[0].read_text().splitlines()[0])["image"])
    geneval = {"tag": "single_object", "include": [{"class": "circle", "count": 1}]}
    records = [{"prompt": "a red circle moving up", "image": source, **geneval}, {"prompt": "a circle", **geneval}]
    prompts = tmp_path / f"p{suffix}"
    if suffix == ".jsonl":
        prompts.write_text("".join(json.dumps(r) + "\n" for r in records))
    else:
        prompts.write_text("prompt\na red circle moving up\n" if suffix == ".csv" else "a red circle moving up\n")
    argv = [tmp_path / a if a in ("images", "r.json") else a for a in command]
    line = _fails(capsys, *argv, "--model", tiny_wan_i2v, "--prompts", prompts, "--device", "cpu")
    if suffix == ".jsonl":
        assert line == (
            f"flowrl {command[0]}: error: --prompts: {prompts}:2: no 'image'; this model starts each video from its "
            "record's source image (a path relative to the prompt file)"
        )
        prompts.write_text(json.dumps(records[0]) + "\n")
        with pytest.raises(RuntimeError, match="the model loads"):
            cli_main([str(a) for a in (*argv, "--model", tiny_wan_i2v, "--prompts", prompts, "--device", "cpu")])
    else:
        assert line.startswith(f"flowrl {command[0]}: error: --prompts: prompt file {prompts} is read as {suffix[1:]}")
        assert "give a JSON lines file (.jsonl)" in line


def cli_main(argv):
    """``flowrl ARGV`` in this process."""
    from flowrl import cli

    cli.main(argv)


# ------------------------------------------------------------------------------------------------ offline data sets
def _offline_rows(data, pairs=True):
    from types import SimpleNamespace

    from flowrl.methods.offline import offline_rows

    return offline_rows(SimpleNamespace(train=SimpleNamespace(offline=SimpleNamespace(data=str(data)))), pairs)


@pytest.mark.parametrize(
    "name,content,message",
    [
        ("latin1.jsonl", '{"prompt": "caf\xe9", "image_w": "a.png", "image_l": "b.png"}\n'.encode("latin-1"),
         r"data file .*latin1\.jsonl is not UTF-8 text \(byte 15"),
        ("html.jsonl", b"<!DOCTYPE html>\n<html><body>Not Found</body></html>\n", r"html\.jsonl line 1: not JSON"),
        ("empty.jsonl", b"\n\n", r"empty\.jsonl: no usable rows"),
        ("list.jsonl", b"[1, 2]\n", r"list\.jsonl line 1: expected a JSON object, got list"),
        ("torn.parquet", b"PAR1\x00\x01", r"torn\.parquet is not a readable parquet file"),
        ("null.jsonl", b'{"caption": "a cat", "jpg_0": null, "jpg_1": "b.png", "label_0": 1}\n',
         r"null\.jsonl row 1: 'jpg_0' is None; expected an image path"),
        ("caption.jsonl", b'{"caption": null, "jpg_0": "a.png", "jpg_1": "b.png", "label_0": 0}\n',
         r"caption\.jsonl row 1: 'caption' is None; expected the prompt's text"),
        ("number.jsonl", b'{"prompt": "x", "image_w": 3, "image_l": "b.png"}\n', r"number\.jsonl row 1: 'image_w' is 3"),
    ],
)  # fmt: skip
def test_a_bad_offline_data_file_is_named_with_its_row(name, content, message, tmp_path):
    (tmp_path / name).write_bytes(content)
    with pytest.raises(ConfigError, match=rf"^config key 'train\.offline\.data': .*{message}"):
        _offline_rows(tmp_path / name)


def test_a_pick_a_pic_parquet_row_with_a_null_image_is_named(tmp_path):
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    table = {"caption": ["a", "b"], "jpg_0": [b"\x89PNG", None], "jpg_1": [b"\x89PNG"] * 2, "label_0": [1, 0]}
    pq.write_table(pa.table(table), tmp_path / "pick.parquet")
    with pytest.raises(ConfigError, match=r"pick\.parquet row 2: 'jpg_0' is None"):
        _offline_rows(tmp_path / "pick.parquet")


def test_an_offline_data_path_resolves_as_a_prompt_file_does(tmp_path, monkeypatch):
    """``train.offline.data: assets/preferences/pairs.jsonl`` (the shipped preset's) is found from any working folder;
    a file of that name in the working folder comes first."""
    monkeypatch.chdir(tmp_path)
    assert len(_offline_rows("assets/preferences/pairs.jsonl")) == 229
    (tmp_path / "assets/preferences").mkdir(parents=True)
    (tmp_path / "assets/preferences/pairs.jsonl").write_text(
        '{"prompt": "x", "image_w": "a.png", "image_l": "b.png"}\n'
    )
    assert _offline_rows("assets/preferences/pairs.jsonl") == [("x", str(tmp_path / "assets/preferences/a.png"),
                                                                str(tmp_path / "assets/preferences/b.png"))]  # fmt: skip
    with pytest.raises(ConfigError, match=r"'train\.offline\.data': no file .*missing\.jsonl"):
        _offline_rows("missing.jsonl")


# ------------------------------------------------------------------------------------------------ paths
PRESETS = sorted((REPO / "configs").glob("*.yaml"))
TRAINED_ELSEWHERE = ["quickstart", "tiny_video", "dpo_offline", "sft", "refl", "pref_grpo"]
"""The presets trained from another folder: between them, every path a shipped preset reads (checked by
:func:`test_the_presets_trained_elsewhere_read_every_kind_of_path_the_presets_read`); ReFL by default, the rest in CI."""


def _read_paths(preset: str) -> set[str]:
    """``key=value`` of every relative path ``configs/PRESET.yaml`` reads (docs/reliability.md, "Paths"): the model,
    prompt files (named sets such as ``train`` excepted), the offline data set, the GARDO and diversity feature
    models, and the reward options whose names end as :data:`flowrl.files.PATH_OPTIONS` say, nested ones too."""
    from flowrl.files import PATH_OPTIONS

    cfg = load_config(REPO / "configs" / f"{preset}.yaml")
    found = {
        "model.path": cfg.model.path,
        "train_prompts": cfg.train_prompts,
        "eval.prompts": cfg.eval.prompts,
        "eval.held_out": cfg.eval.held_out,
        "train.offline.data": cfg.train.offline.data,
        "run.diversity_model": cfg.run.diversity_model,
        "train.gardo.feature_model": cfg.train.gardo.feature_model,
    }

    def options(prefix: str, values: dict) -> None:
        for key, value in values.items():
            if isinstance(value, dict):
                options(f"{prefix}.{key}", value)
            elif key.endswith(PATH_OPTIONS):
                found[f"{prefix}.{key}"] = value

    for name, reward in cfg.rewards.items():
        options(f"rewards.{name}.options", dict(reward.options or {}))
    return {f"{k}={v}" for k, v in found.items() if isinstance(v, str) and "/" in v}


@pytest.mark.parametrize("preset", [p.stem for p in PRESETS])
def test_every_shipped_preset_reads_its_paths_from_the_repository_anywhere(preset, tmp_path, monkeypatch):
    """From another working folder, every relative path a shipped preset reads resolves to the repository's file
    (``flowrl.files.resolve_path``, ``resolve_option_paths``: the rule the trainer applies)."""
    from flowrl.files import resolve_option_paths, resolve_path

    monkeypatch.chdir(tmp_path)
    for item in _read_paths(preset):
        key, value = item.split("=", 1)
        if key.startswith("rewards."):
            resolved = Path(resolve_option_paths({"model_path": value})["model_path"])
        else:
            resolved = resolve_path(value)
        assert resolved.exists() and REPO in resolved.resolve().parents, f"{preset}: {item} -> {resolved}"


def test_the_presets_trained_elsewhere_read_every_kind_of_path_the_presets_read():
    """Every path a shipped preset reads is read by one of :data:`TRAINED_ELSEWHERE` (so a new preset with a new
    kind of path fails here until it is trained from another folder too)."""
    read = set().union(*(_read_paths(p.stem) for p in PRESETS))
    trained = set().union(*(_read_paths(p) for p in TRAINED_ELSEWHERE))
    assert read - trained == set()
    assert {"model.path=assets/tiny-sd3", "train.offline.data=assets/preferences/pairs.jsonl"} <= trained


@pytest.mark.parametrize(
    "preset", [pytest.param(p, marks=[] if p == "refl" else pytest.mark.slow) for p in TRAINED_ELSEWHERE]
)
def test_every_shipped_preset_trains_from_a_folder_outside_the_repository(preset, tmp_path, monkeypatch):
    """``flowrl train <repo>/configs/PRESET.yaml`` from another working folder (in this process, its working folder
    changed: the CLI's own path rule, without a new interpreter's start-up per preset): the preset's model, prompt sets,
    data set and reward model folders (``assets/...``) are found in the repository; its run folder is made in the
    working folder (docs/reliability.md, "Paths"). The presets trained are those that read every kind of path the
    shipped presets read (:data:`TRAINED_ELSEWHERE`); the others' paths resolve alike
    (:func:`test_every_shipped_preset_reads_its_paths_from_the_repository_anywhere`)."""
    import json

    from conftest import FLOAT32, shape_overrides

    from flowrl import cli

    config = REPO / "configs" / f"{preset}.yaml"
    video = load_config(config).model.path.endswith("tiny-wan")
    sizes = {
        "run.iterations": 2, "run.save_every": 1, "run.device": "cpu", "sampling.num_steps": 3,
        "sampling.group_size": 2, "sampling.prompts_per_iteration": 2, "sampling.batch_size": 8,
        "eval.images_per_tag": 1, "eval.held_out_images_per_tag": 1, "eval.num_steps": 2, "train.minibatch_size": 4, "model.lora_rank": 2,
        "train.offline.batch_size": 4, "eval.every": 0, **FLOAT32, **shape_overrides(load_config(config)),
    }  # fmt: skip
    if video:
        sizes["model.num_frames"] = 5
    monkeypatch.chdir(tmp_path)
    cli.main(["train", str(config), *[f"{k}={v}" for k, v in sizes.items()]])  # exits 2 on a refusal
    run = tmp_path / load_config(config).run.output_dir  # relative: in the working folder
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [1, 2]
    assert (run / "eval.json").is_file() and not (REPO / load_config(config).run.output_dir / ".flowrl.lock").exists()


# ------------------------------------------------------------------------------------------------ commands
_fails = cli_fails


@pytest.mark.parametrize(
    "name,text",
    [
        ("p.txt", "un caf\xe9\n"),
        ("p.csv", "prompt,tag\nun caf\xe9,food\n"),
        ("p.json", '["un caf\xe9"]'),
        ("p.jsonl", '{"prompt": "un caf\xe9"}\n'),
    ],
)
def test_generate_names_a_prompt_file_that_is_not_utf8(name, text, tmp_path, capsys):
    (tmp_path / name).write_bytes(text.encode("latin-1"))
    line = _fails(capsys, "generate", "--prompts", tmp_path / name, "--out", tmp_path / "images")
    assert line.startswith("flowrl generate: error: prompt file ") and f"{name} is not UTF-8 text (byte" in line


def test_overopt_refuses_an_offline_preset_before_any_work(tmp_path, capsys, monkeypatch):
    import flowrl.trainer as trainer_mod

    monkeypatch.setattr(trainer_mod, "Trainer", lambda cfg: pytest.fail("a preset ran"))
    argv = ("overopt", "--presets", "flow_grpo", "dpo_offline", "sft", "--out", tmp_path / "o.json")
    line = _fails(capsys, *argv)
    assert line.startswith("flowrl overopt: error: preset(s) dpo_offline, sft train on a data set")


# ------------------------------------------------------------------------------------------------ reward models
HTML = b"<!DOCTYPE html>\n<html><head><title>502 Bad Gateway</title></head></html>\n"


@pytest.mark.parametrize(
    "content,message",
    [
        (HTML, "is an HTML page"),
        (b"", "is empty"),
        (b'{"a": ', "is not JSON"),
        (b"\xff\xfe{}", "is not JSON (not UTF-8"),
    ],
)
def test_videoalign_convert_names_a_model_config_that_is_not_json(content, message, tmp_path, capsys):
    from flowrl.rewards.videoalign_convert import main

    (tmp_path / "src").mkdir()
    (tmp_path / "src/model_config.json").write_bytes(content)
    (tmp_path / "base").mkdir()
    (tmp_path / "base/config.json").write_text("{}")
    assert main([str(tmp_path / "src"), str(tmp_path / "dst"), "--base", str(tmp_path / "base")]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("error: videoalign_convert: ") and f"src/model_config.json {message}" in line


def test_vqascore_names_a_config_json_that_is_an_html_page(tmp_path):
    from flowrl.rewards import build_reward

    (tmp_path / "vlm").mkdir()
    (tmp_path / "vlm/config.json").write_bytes(HTML)
    with pytest.raises(ValueError, match=r"^vqascore: .*vlm/config\.json is an HTML page \(a failed download\?\)"):
        build_reward("vqascore", model_path=str(tmp_path / "vlm"))


def test_serve_reward_names_a_factory_that_raises(tmp_path, capsys):
    (tmp_path / "mine.py").write_text(
        "def factory(device='cpu'):\n    raise RuntimeError('CUDA out of memory.\\nTried to allocate 20.00 GiB')\n"
    )
    spec = f"{tmp_path / 'mine.py'}:factory"
    line = _fails(capsys, "serve-reward", spec, "--port", "0", "--option", "device=cuda")
    assert line == (
        f"flowrl serve-reward: error: reward factory '{spec}' raised RuntimeError: CUDA out of memory. Tried to "
        "allocate 20.00 GiB"
    )


def test_a_silent_reward_server_is_named_while_it_is_awaited(capsys):
    """A server that accepts and never answers: a line after ``notice_after`` seconds names the server, the batch and
    the attempt (first attempts once per reward, every retry); the defaults give up within about a minute and a half."""
    import socket
    import time

    from flowrl.rewards import RemoteReward

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)  # the kernel accepts; nothing ever reads or answers
    url = f"http://127.0.0.1:{silent.getsockname()[1]}"
    try:
        reward = RemoteReward(url, timeout=0.6, retries=1, notice_after=0.2, batch_size=2)
        for call in (1, 2):
            start = time.monotonic()
            with pytest.raises(ConnectionError, match=rf"reward server {url} is unreachable after 2 attempt\(s\)"):
                reward(torch.rand(3, 3, 8, 8), ["a", "b", "c"], [{}] * 3)
            assert time.monotonic() - start < 3
            lines = capsys.readouterr().err.splitlines()
            waits = [f"remote reward: waiting for {url}/score (batch 1 of 2, 2 images; attempt {n} of 2): no answer "
                     "after 0.2 s; the attempt gives up after 0.6 s (option timeout)" for n in (1, 2)]  # fmt: skip
            assert lines == (waits if call == 1 else waits[1:])  # the first attempt's line once per reward
    finally:
        silent.close()
    default = RemoteReward(url)
    assert (default.retries + 1) * default.timeout + 0.5 + 1.0 <= 100 and default.notice_after == 5.0
