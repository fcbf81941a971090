"""``flowrl memory`` (flowrl.plan): the trained weight counts read off a model folder on the meta device equal the
loaded model's, and the per-engine table follows docs/distributed.md's arithmetic."""

import json
from pathlib import Path

import pytest

from flowrl.cli import main
from flowrl.config import ConfigError, load_config
from flowrl.models import load_model
from flowrl.plan import ENGINES, engine_bytes, memory_plan

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "assets/tiny-sd3"


@pytest.mark.parametrize("rank", [0, 4])
def test_counts_equal_the_loaded_model(rank):
    plan = memory_plan(load_config(REPO / "configs/quickstart.yaml", [f"model.lora_rank={rank}"]), processes=2)
    model = load_model(TINY)
    network = sum(p.numel() for p in model.transformer.parameters())
    params = model.add_lora(rank, 2 * rank) if rank else model.full_finetune()
    trained = {id(p): p for p in params}
    assert plan["network_params"] == network and plan["trained_params"] == sum(p.numel() for p in trained.values())
    assert (plan["trained_params"] < network) == (rank > 0)
    blocks = [
        sum(p.numel() for p in block.parameters() if p.requires_grad) for block in model.transformer.transformer_blocks
    ]
    assert plan["largest_block"] == max(blocks) > 0
    frozen = {
        "text_encoder": model.pipe.text_encoder,
        "text_encoder_2": model.pipe.text_encoder_2,
        "vae": model.pipe.vae,
    }
    expected = {k: 4 * sum(t.numel() for t in m.state_dict().values()) for k, m in frozen.items()}
    if rank:  # LoRA: the base transformer is frozen, in model.dtype (float32 here), with its saved buffers
        expected["transformer"] = 4 * sum(
            t.numel() for n, t in model.transformer.state_dict().items() if "lora_" not in n
        )
    else:  # full fine-tuning: its buffers (SD3's positional table) are frozen, its weights the engine table's
        expected["transformer buffers"] = 4 * sum(b.numel() for b in model.transformer.buffers())
    assert plan["frozen_gpu_bytes"] == expected
    activations = plan["activations"]["without_checkpointing"]  # the preset trains without checkpointing
    assert 0 < plan["activations"]["with_checkpointing"] < activations
    for row in plan["engines"].values():
        assert row["total_gpu"] == row["gpu"] + sum(plan["frozen_gpu_bytes"].values()) + activations
    assert Path(plan["model"]["path"]).resolve() == TINY
    assert (plan["model"]["family"], plan["model"]["network"]) == ("SD3Model", "transformer")


def test_frozen_parts_follow_their_placement_and_dtype():
    plan = memory_plan(
        load_config(
            REPO / "configs/quickstart.yaml",
            ["model.dtype=bfloat16", "model.text_encoders=cpu", "model.vae_placement=cpu"],
        ),
        processes=2,
    )
    model = load_model(TINY)
    assert plan["frozen_gpu_bytes"] == {
        "transformer": 2 * sum(t.numel() for t in model.transformer.state_dict().values())
    }


def test_engine_table_is_the_docs_arithmetic():
    n, block, gb = 11_901_408_320, 339_831_296, 1e9  # FLUX.1-dev's transformer (docs/distributed.md)
    rows = engine_bytes(n, block, 8)
    assert set(rows) == set(ENGINES)
    assert rows["ddp"]["gpu"] == pytest.approx(20 * n)
    assert rows["fsdp2"]["gpu"] / gb == pytest.approx(72.8, abs=0.05)  # 6N + one block's gradient
    assert rows["zero1"]["gpu"] / gb == pytest.approx(113.1, abs=0.05)
    assert rows["zero2"]["gpu"] / gb == pytest.approx(73.4, abs=0.05)
    assert rows["zero2_offload"]["gpu"] / gb == pytest.approx(55.5, abs=0.1)
    assert rows["zero2_offload"]["host"] / gb == pytest.approx(23.8, abs=0.05)
    assert all(r["host"] == 0 for k, r in rows.items() if not k.endswith("_offload"))
    assert rows["fsdp2_full_shard"]["gpu"] / gb == pytest.approx(16 * n / 8 / gb + 12 * block / gb, abs=0.05)
    assert rows["zero3_offload"]["gpu"] < rows["zero3"]["gpu"] < rows["zero2"]["gpu"]
    one = engine_bytes(n, block, 1)  # one process: sharding saves nothing on the optimizer state
    assert one["fsdp2"]["optimizer"] == one["ddp"]["optimizer"] == 8 * n


def test_cli_prints_the_table_and_writes_json(tmp_path, capsys):
    main(
        [
            "memory",
            str(REPO / "configs/quickstart.yaml"),
            "model.lora_rank=0",
            "--processes",
            "4",
            "--json",
            str(tmp_path / "plan.json"),
        ]
    )
    out = capsys.readouterr().out
    assert "full fine-tuning" in out and "| fsdp2 |" in out and "| zero2_offload |" in out
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["processes"] == 4 and plan["engines"]["ddp"]["weights"] == 4 * plan["trained_params"]


def test_the_plan_counts_the_methods_held_copies_of_the_trained_weights():
    """A method's held copies (:meth:`Method.held_copies`: CRD's old and sampler copies, TDM-R1's fake score and
    surrogate with their moments and its slow surrogate, in full fine-tuning the teacher) and the policy's EMA enter
    each engine's bytes: 4 bytes per trained weight and copy, whole under DDP, FSDP2 and ZeRO-1/2, sharded under full
    sharding, on the host under ZeRO-3 offload; GRPO holds none."""
    from flowrl.methods import METHODS

    def held(preset: str, *over: str) -> int:
        cfg = load_config(REPO / "configs" / f"{preset}.yaml", list(over))
        return METHODS[cfg.train.method].held_copies(cfg)

    assert [held("crd"), held("tdm_r1"), held("dmd"), held("dmd", "model.lora_rank=0"), held("flow_grpo")] == [
        2, 7, 3, 4, 0
    ]  # fmt: skip
    plan = memory_plan(load_config(REPO / "configs/tdm_r1.yaml", ["train.ema_decay=0.9"]), 4)
    n, rows = plan["trained_params"], plan["engines"]
    assert plan["held_copies"] == 8  # TDM-R1's seven and the EMA
    assert rows["ddp"]["held"] == rows["fsdp2"]["held"] == rows["zero2"]["held"] == 4 * n * 8
    assert rows["fsdp2_full_shard"]["held"] == rows["zero3"]["held"] == 4 * n * 8 / 4
    assert rows["zero3_offload"]["held"] == 0 and rows["zero3_offload"]["host"] == (20 + 4 * 8) * n / 4
    assert rows["ddp"]["gpu"] == 20 * n + 4 * n * 8
    assert engine_bytes(n, 10, 4)["ddp"]["held"] == 0  # none by default


def test_the_plan_brackets_the_engines_flowrl_refuses_for_the_runs_method(tmp_path, capsys):
    """``flowrl memory`` of a few-step run (tdm_r1: its fake score's own AdamW) brackets the DeepSpeed engines and says
    why; a Flow-OPD run and a GRPO run bracket none; the JSON rows carry the reason (``refused``), None where the
    engine runs."""
    from flowrl.plan import ENGINES

    refused = {}
    for preset in ("tdm_r1", "flow_opd", "flow_grpo"):
        main(
            [
                "memory",
                str(REPO / "configs" / f"{preset}.yaml"),
                "--processes",
                "2",
                "--json",
                str(tmp_path / "p.json"),
            ]
        )
        out = capsys.readouterr().out
        rows = json.loads((tmp_path / "p.json").read_text())["engines"]
        refused[preset] = {e for e in ENGINES if rows[e]["refused"]}
        for e in ENGINES:
            assert (f"| ({e}) |" in out) == (e in refused[preset]) and (f"| {e} |" in out) != (e in refused[preset])
    zero = {e for e in ENGINES if e.startswith("zero")}
    assert refused == {"tdm_r1": zero, "flow_opd": set(), "flow_grpo": set()}


def test_bad_input_is_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["memory", str(REPO / "configs/quickstart.yaml"), f"model.path={tmp_path}"])
    assert "flowrl memory: error:" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="--processes"):
        memory_plan(load_config(REPO / "configs/quickstart.yaml", []), processes=0)


# ------------------------------------------------------------------------------ activations and published models
H200 = {4: "gpu_scale_sd35m_h200.json", 16: "gpu_scale_sd35m_mb16_h200.json"}
"""What one H200 measured for Flow-GRPO's update at SD3.5-Medium size (LoRA rank 32, 512 px, micro-batch 4 and 16):
``peak_gib_train`` in benchmarks/results/."""


@pytest.mark.parametrize("micro_batch", sorted(H200))
def test_the_plan_predicts_the_h200_update_peaks_within_15_percent(micro_batch):
    """The update's peak on the H200 (benchmarks/gpu_scale.py: the SD3.5-Medium transformer in bf16, tiny text
    encoders and VAE, 256 T5 tokens, CFG) against the plan's: the frozen transformer, the LoRA's DDP state and the
    activations of ``2 * micro_batch`` rows."""
    import torch

    from flowrl.activations import INPUTS, Shape, activation_bytes, latent_grid
    from flowrl.models import FAMILIES
    from flowrl.plan import build_network, load_published, network_counts

    run = json.loads((REPO / "benchmarks/results" / H200[micro_batch]).read_text())
    meta = run["meta"]
    assert meta["minibatch"] == micro_batch and meta["resolution"] == 512
    part = load_published("sd35_medium")["components"]["transformer"]
    targets = FAMILIES["StableDiffusion3Pipeline"].LORA_TARGETS
    net = build_network(
        part["class"], part["config"], meta["lora_rank"], 2 * meta["lora_rank"], targets, torch.bfloat16
    )
    total, trained, block = network_counts(net)
    assert total + sum(b.numel() for b in net.buffers()) == int(meta["transformer_params_b"] * 1e9)
    shape = Shape(2 * micro_batch, latent_grid("SD3Transformer2DModel", 512, 512), 77 + 256)
    counted = activation_bytes(net, INPUTS["SD3Transformer2DModel"](dict(net.config), shape))
    frozen = 2 * (total + sum(b.numel() for b in net.buffers()))
    predicted = frozen + engine_bytes(trained, block, 1)["ddp"]["gpu"] + counted.peak(False)
    measured = max(row["peak_gib_train"] for row in run["rows"]) * 2**30
    assert abs(predicted / measured - 1) < 0.15
    assert counted.blocks == 24 and counted.peak(True) < counted.peak(False) / 4  # one call per block


def test_activations_grow_with_the_rows_and_checkpointing_keeps_block_inputs():
    """Twice the rows save twice the activations; with checkpointing the blocks keep only their inputs (the hidden
    states between blocks), far below what they save, and the largest block is one of the counted calls."""
    import torch

    from flowrl.activations import INPUTS, Shape, activation_bytes
    from flowrl.plan import build_network

    config = json.loads((TINY / "transformer/config.json").read_text())
    net = build_network("SD3Transformer2DModel", config, 4, 8.0, ("to_q", "to_k", "to_v", "to_out.0"), torch.float32)
    one, two = (
        activation_bytes(net, INPUTS["SD3Transformer2DModel"](config, Shape(rows, (1, 8, 8), 16, torch.float32)), None)
        for rows in (2, 4)
    )
    assert two.total == pytest.approx(2 * one.total, rel=0.02)
    assert one.blocks == config["num_layers"] and 0 < one.block_inputs < one.total - one.outside
    assert one.largest_block <= one.total - one.outside


def test_published_models_name_their_source_and_family():
    from flowrl.models import FAMILIES
    from flowrl.plan import load_published, published_names

    names = published_names()
    assert {"flux2_dev", "sd35_medium", "qwen_image", "wan21_14b", "flux1_dev", "hunyuan_video15"} <= set(names)
    for name in names:
        spec = load_published(name)
        assert spec["name"] == name and spec["source"] and spec["pipeline"] in FAMILIES, name
        networks = spec["network"] if isinstance(spec["network"], list) else [spec["network"]]
        assert all(n in spec["components"] and n in spec["params"] for n in networks), name
        assert set(spec["params"]) == set(spec["components"]), name


def test_published_weight_counts_are_the_configs_built_on_meta():
    from flowrl.plan import component_count, load_published, published_names

    for name in published_names():
        spec = load_published(name)
        for part, c in spec["components"].items():
            if c["library"] in ("diffusers", "transformers"):
                try:
                    count = component_count(c["library"], c["class"], c["config"])
                except ValueError:  # LTX-2's connectors and vocoder live in their pipeline module, not at the top
                    continue
                assert count == spec["params"][part], (name, part)


def test_flux2_dev_full_fine_tuning_fits_eight_80gb_gpus_with_some_engine(tmp_path):
    """The plan the scale issue asks for: FLUX.2 [dev] (32B) fully fine-tuned on 8 GPUs of 80 GB with its text
    encoder on the CPU, and its LoRA on one GPU, each under an H100's 79.6 GiB with some engine, activations included
    (the recipe's micro-batch 1 at 512 px, checkpointing on)."""
    recipe = REPO / "configs/recipes/flux2_flow_grpo.yaml"
    over = ["model.text_encoders=cpu"]
    full = memory_plan(load_config(recipe, [*over, "model.lora_rank=0"]), processes=8, family="flux2_dev")
    lora = memory_plan(load_config(recipe, over), processes=1, family="flux2_dev")
    assert full["network_params"] > 32e9 and full["trained_params"] == full["network_params"]
    h100 = 81559 * 2**20
    assert min(r["total_gpu"] for r in full["engines"].values()) < h100
    assert min(r["total_gpu"] for r in lora["engines"].values()) < h100
    assert full["engines"]["ddp"]["total_gpu"] > h100  # the whole model on every GPU does not fit
    assert full["activations"]["with_checkpointing"] < full["activations"]["without_checkpointing"]


def test_memory_takes_overrides_after_the_options(tmp_path, capsys):
    main(["memory", str(REPO / "configs/quickstart.yaml"), "--processes", "2", "model.lora_rank=0"])
    assert "full fine-tuning" in capsys.readouterr().out


def test_a_folder_of_configs_only_plans_as_the_whole_folder(tmp_path):
    """A configs-only download (model_index.json and every component's config.json, no weights) gives the plan of
    the whole folder."""
    import shutil

    folder = tmp_path / "configs-only"
    shutil.copytree(TINY, folder, ignore=shutil.ignore_patterns("*.safetensors"))
    config = load_config(REPO / "configs/quickstart.yaml", [])
    whole = memory_plan(config, processes=2)
    config.model.path = str(folder)
    assert memory_plan(config, processes=2)["frozen_gpu_bytes"] == whole["frozen_gpu_bytes"]


def test_an_unknown_published_model_is_one_line(capsys):
    with pytest.raises(SystemExit):
        main(["memory", str(REPO / "configs/quickstart.yaml"), "--family", "flux9"])
    err = capsys.readouterr().err
    assert "flowrl memory: error: --family 'flux9'" in err and "flux2_dev" in err


def _adapter_call(spec, folder):
    """The keyword arguments (tensor shapes) the family's adapter passes its network in one guided velocity call of
    3 rows on its tiny pipeline, with the latent grid and prompt length they were made for."""
    import torch

    from flowrl.models import load_model

    model = load_model(spec.build(folder), "cpu", **spec.load)
    net, seen = model.transformer, {}

    def hook(module, args, kwargs):
        names = ["x", "t", "cap_feats"] if type(net).__name__ == "ZImageTransformer2DModel" else ["hidden_states"]
        seen.update(dict(zip(names, args)), **kwargs)

    handle = net.register_forward_pre_hook(hook, with_kwargs=True)
    table = model.prompt_table([{"prompt": "a red cube"}, {"prompt": "two dogs"}])
    with torch.no_grad():
        model.velocity_fn(table, spec.guidance[0])(
            torch.randn(3, *model.latent_shape), torch.tensor([0.9, 0.5, 0.2]), torch.tensor([1, 2, 1])
        )
    handle.remove()
    pipe = model.pipe
    names = ("vae_scale_factor", "vae_scale_factor_spatial", "vae_spatial_compression_ratio")
    spatial = next(getattr(pipe, n) for n in names if hasattr(pipe, n))
    temporal = next(
        (
            getattr(pipe, n)
            for n in ("vae_scale_factor_temporal", "vae_temporal_compression_ratio")
            if hasattr(pipe, n)
        ),
        1,
    )
    frames, side = spec.load.get("num_frames", 1), spec.load["resolution"]
    return net, _shapes(seen), ((frames - 1) // temporal + 1, side // spatial, side // spatial)


def _shapes(kwargs: dict) -> dict:
    """Tensor shapes by argument name (a list of tensors: its length; a dict: its entries)."""
    import torch

    out = {}
    for k, v in kwargs.items():
        if torch.is_tensor(v):
            out[k] = tuple(v.shape)
        elif isinstance(v, list) and v and torch.is_tensor(v[0]):
            out[k] = len(v)
        elif isinstance(v, dict):
            out.update({f"{k}.{a}": tuple(b.shape) for a, b in v.items()})
    return out


def _input_families():
    import sys

    sys.path.insert(0, str(REPO / "tests"))
    from families import FAMILIES

    return [
        pytest.param(spec, id=spec.id)
        for spec in FAMILIES.values()
        if spec.prompts not in ("edit", "i2v", "references") and spec.id != "LTX2Model"
    ]


@pytest.mark.parametrize("spec", _input_families())
def test_activation_inputs_are_what_the_adapter_passes(spec, tmp_path):
    """:data:`flowrl.activations.INPUTS` builds, from the network's config, the arguments the family's adapter gives
    it: the same names and tensor shapes at the same rows, latent grid and prompt length (the image-to-video and edit
    entries share their text-to-image network class; LTX-2 is not modelled)."""
    from flowrl.activations import INPUTS, Shape

    net, seen, grid = _adapter_call(spec, tmp_path / spec.id)
    rows = seen["x"] if "x" in seen else seen.get("hidden_states", seen.get("sample"))[0]
    text = seen.get("encoder_hidden_states", (0, 0))[1] if "cap_feats" not in seen else 8
    built = _shapes(INPUTS[type(net).__name__](dict(net.config), Shape(rows, grid, text)))
    if "cap_feats" in seen:  # Z-Image's unpadded captions: one per row, of each prompt's own length
        assert built.pop("cap_feats") == seen.pop("cap_feats")
    assert built == seen
