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
    for row in plan["engines"].values():
        assert row["total_gpu"] == row["gpu"] + sum(plan["frozen_gpu_bytes"].values())
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
    assert all(r["host"] == 0 for k, r in rows.items() if k != "zero2_offload")
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


def test_bad_input_is_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["memory", str(REPO / "configs/quickstart.yaml"), f"model.path={tmp_path}"])
    assert "flowrl memory: error:" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="--processes"):
        memory_plan(load_config(REPO / "configs/quickstart.yaml", []), processes=0)
