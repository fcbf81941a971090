"""Bad input to the ``flowrl`` command and the config loader fails fast, in one line naming the culprit."""

import argparse
from pathlib import Path

import pytest
import torch

from flowrl import cli
from flowrl.config import ConfigError, load_config


def _fails(capsys, *argv) -> str:
    """Run ``flowrl ARGV`` in-process; assert exit status 2 and return the one line it wrote on stderr."""
    with pytest.raises(SystemExit) as exit_info:
        cli.main([str(a) for a in argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


def test_num_steps_error_names_num_steps_not_the_window():
    with pytest.raises(ConfigError, match=r"'sampling\.num_steps' must be >= 2, got 0"):
        load_config("configs/tiny_geneval.yaml", ["sampling.num_steps=0"])


def test_a_preset_that_is_not_yaml_or_not_a_mapping_is_named(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  learning_rate: [1\n")
    with pytest.raises(ConfigError, match=r"config file .*bad\.yaml is not valid YAML at line 3"):
        load_config(bad)
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    (tmp_path / "child.yaml").write_text("base: list.yaml\n")
    with pytest.raises(ConfigError, match=r"list\.yaml must hold a mapping of keys .*got a list"):
        load_config(tmp_path / "child.yaml")
    assert "bad.yaml is not valid YAML" in _fails(capsys, "train", bad)


@pytest.mark.parametrize("key", ["train_prompts", "eval.prompts"])
def test_train_refuses_an_empty_prompt_file_before_the_model_loads(tmp_path, capsys, key):
    (tmp_path / "empty.jsonl").write_text("\n")
    line = _fails(
        capsys,
        "train",
        "configs/tiny_geneval.yaml",
        f"{key}={tmp_path / 'empty.jsonl'}",
        f"run.output_dir={tmp_path / 'run'}",
    )
    assert f"config key '{key}'" in line and "holds no prompts" in line
    assert not (tmp_path / "run").exists()


def test_eval_refuses_an_empty_prompt_file(tmp_path, capsys):
    (tmp_path / "empty.jsonl").write_text("")
    line = _fails(capsys, "eval", "--prompts", tmp_path / "empty.jsonl", "--out", tmp_path / "e.json")
    assert line.startswith("flowrl eval: error: prompt file") and "holds no prompts" in line


@pytest.mark.parametrize(
    "argv, message",
    [
        (["-n", "0"], "argument -n: must be >= 1, got 0"),
        (["--num-steps", "0"], "argument --num-steps: must be >= 1, got 0"),
        (["--shift", "0"], "argument --shift: must be > 0, got 0"),
        (["--device", "gpu"], "argument --device: must be auto, cpu or cuda[:N], got 'gpu'"),
    ],
)
def test_sample_options_are_checked_before_the_model_loads(capsys, monkeypatch, argv, message):
    monkeypatch.setattr(cli, "_model", lambda args: pytest.fail("the model loaded"))
    assert _fails(capsys, "sample", "--prompt", "a photo of a star", *argv) == f"flowrl sample: error: {message}"


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_device_cuda_without_a_gpu_is_one_line(capsys, tmp_path):
    line = _fails(capsys, "sample", "--prompt", "x", "--device", "cuda", "--model", tmp_path / "nope")
    assert line == "flowrl sample: error: --device cuda: no CUDA device is available; use --device auto or cpu"


@pytest.mark.parametrize("command", ["eval", "sample"])
def test_output_folder_is_made_before_the_work(tmp_path, capsys, monkeypatch, command):
    def model(args):  # stands in for the model load: the output folder must already exist
        assert Path(args.out).parent.is_dir()
        raise ValueError("stop here")

    monkeypatch.setattr(cli, "_model", model)
    out = tmp_path / "new" / ("e.json" if command == "eval" else "g.png")
    extra = ["--prompts", "test"] if command == "eval" else ["--prompt", "x"]
    assert _fails(capsys, command, "--out", out, *extra) == f"flowrl {command}: error: stop here"


def test_a_key_error_is_a_bug_not_bad_input(capsys):
    """Bad input raises the documented types (ValueError and its kin); a KeyError is a bug and keeps its traceback."""

    def fn(args):
        raise KeyError("w")

    with pytest.raises(KeyError):
        cli._run(argparse.Namespace(fn=fn, command="train"))
    assert capsys.readouterr().err == ""


def test_generate_and_evaluate_refuse_no_prompts_before_sampling():
    from flowrl.evaluation import evaluate, generate

    with pytest.raises(ValueError, match="at least one prompt"):
        generate(None, [], [], 2, 1.0)
    with pytest.raises(ValueError, match="one seed .* per prompt; got 2 prompts, 1 seeds"):
        generate(None, ["a", "b"], [0], 2, 1.0)
    with pytest.raises(ValueError, match="evaluate needs at least one prompt"):
        evaluate(None, [])


def test_checkpoint_of_another_lora_rank_is_refused_not_broadcast(tmp_path):
    from flowrl.checkpoint import load_checkpoint, save_checkpoint

    w = torch.nn.Parameter(torch.ones(1, 2))  # a rank-1 LoRA matrix; rank 3 has the same name
    path = save_checkpoint(tmp_path, 1, {"lora_A": w}, torch.optim.AdamW([w]))
    w3 = torch.nn.Parameter(torch.zeros(3, 2))
    with pytest.raises(ValueError, match=r"'lora_A' of shape \(1, 2\), the model's is \(3, 2\).*model.lora_rank"):
        load_checkpoint(path, {"lora_A": w3}, torch.optim.AdamW([w3]))
    assert torch.equal(w3.detach(), torch.zeros(3, 2))  # nothing overwritten


def test_shift_defaults_to_the_model_schedulers(tmp_path):
    """`sampling.shift` / `--shift` left unset take the pipeline's scheduler shift (SD3.5: 3), which a preset pointed at
    SD3.5 used to replace silently by 1; a dynamically shifting scheduler is refused with the file named."""
    import json

    from flowrl.config import REPO_ROOT
    from flowrl.models import SD3Model

    assert SD3Model.scheduler_shift(REPO_ROOT / "assets" / "tiny-sd3") == 1.0
    with pytest.raises(FileNotFoundError, match="no model_index.json"):  # not a pipeline: the same error as loading
        SD3Model.scheduler_shift(tmp_path)
    (tmp_path / "model_index.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="sigma-schedule shift"):
        SD3Model.scheduler_shift(tmp_path)
    (tmp_path / "scheduler").mkdir()
    config = tmp_path / "scheduler" / "scheduler_config.json"
    config.write_text(json.dumps({"shift": 3.0, "use_dynamic_shifting": False}))
    assert SD3Model.scheduler_shift(tmp_path) == 3.0
    config.write_text(json.dumps({"shift": 3.0, "use_dynamic_shifting": True}))
    with pytest.raises(ValueError, match="scheduler_config.json shifts dynamically"):
        SD3Model.scheduler_shift(tmp_path)


def test_library_sampling_defaults_to_the_loaded_models_shift(random_pipeline):
    """`flowrl.evaluation.generate` (and `evaluate`, which calls it) given no shift samples with the loaded scheduler's
    shift, as the CLI and the trainer do; it used to default to 1 whatever the model (SD3.5's is 3)."""
    from flowrl.evaluation import generate
    from flowrl.models import SD3Model

    model = SD3Model(random_pipeline)
    assert model.shift == 1.0
    model.pipe.scheduler.register_to_config(shift=3.0)
    assert model.shift == 3.0
    args = (model, ["a photo of a red circle"], [0], 3, 2.0)
    default, three, one = generate(*args), generate(*args, shift=3.0), generate(*args, shift=1.0)
    assert torch.equal(default, three) and not torch.equal(default, one)
    model.pipe.scheduler.register_to_config(use_dynamic_shifting=True)
    with pytest.raises(ValueError, match="shifts dynamically"):
        generate(*args)


def test_decode_in_chunks_keeps_order_and_values(random_pipeline):
    """`SD3Model.decode` splits a batch into chunks of `decode_chunk` latents (diffusers' upsampler leaves the fast
    channels-last path from 64 images on); the images come back in order, as one call would decode them."""
    from flowrl.models import SD3Model

    model = SD3Model(random_pipeline)
    latents = torch.randn(5, *model.latent_shape, generator=torch.Generator().manual_seed(0))
    whole = model.decode(latents)
    model.decode_chunk = 2
    chunked = model.decode(latents)
    assert chunked.shape == (5, 3, model.resolution, model.resolution)
    torch.testing.assert_close(chunked, whole, atol=1e-5, rtol=0)
    assert not torch.allclose(chunked[1:], whole[:-1], atol=1e-3)  # not shifted


def test_t5_length_defaults_to_the_pipelines(tmp_path, random_pipeline):
    """With no `max_sequence_length`, a pipeline without T5 (the tiny model) is encoded with 0 T5 tokens, as it was
    trained, and one with T5 (SD3.5) with diffusers' 256; the CLI's default used to be 0 for every model (T5 dropped
    for SD3.5) and the library's 256 for every model (256 zero tokens added for the tiny one)."""
    import json

    from flowrl.config import REPO_ROOT, load_config
    from flowrl.models import SD3Model

    assert SD3Model.default_max_sequence_length(REPO_ROOT / "assets" / "tiny-sd3") == 0
    index = json.loads((REPO_ROOT / "assets" / "tiny-sd3" / "model_index.json").read_text())
    (tmp_path / "model_index.json").write_text(
        json.dumps({**index, "text_encoder_3": ["transformers", "T5EncoderModel"]})
    )
    assert SD3Model.default_max_sequence_length(tmp_path) == 256
    model = SD3Model(random_pipeline)
    padded = SD3Model(random_pipeline, max_sequence_length=5)  # what a length does without T5: zero tokens appended
    tokens = model.encode(["a photo of a star"]).embeds.shape[1]
    assert model.max_sequence_length == 0 and padded.encode(["a photo of a star"]).embeds.shape[1] == tokens + 5
    assert load_config(REPO_ROOT / "configs" / "tiny_geneval.yaml", []).model.max_sequence_length is None
    assert load_config(REPO_ROOT / "configs" / "recipes" / "sd35m_pickscore.yaml", []).model.max_sequence_length == 128


def test_readme_python_block_runs(monkeypatch):
    """The README's "Use from Python" block runs as written (less the LoRA of a run that does not exist here, and
    with one image per tag instead of 64), and its outputs have the shapes it states."""
    import re

    from flowrl.config import REPO_ROOT

    readme = (REPO_ROOT / "README.md").read_text()
    section = readme[readme.index("## Use from Python") :]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert "images_per_tag=64" in code and "model.load_lora(" in code
    code = code.replace("images_per_tag=64", "images_per_tag=1")
    code = "\n".join(line for line in code.splitlines() if not line.startswith("model.load_lora("))
    monkeypatch.chdir(REPO_ROOT)
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)
    assert scope["result"]["n_images"] == 6 and set(scope["result"]["per_tag"]) == {
        "single_object",
        "two_object",
        "counting",
        "colors",
        "position",
        "color_attr",
    }
    assert scope["images"].shape == (4, 3, 64, 64) and 0 <= scope["images"].min() <= scope["images"].max() <= 1
