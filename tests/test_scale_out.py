"""Trackers (run.log_with): TensorBoard event files and an offline wandb run hold the metrics.jsonl scalars and the
images, read back; a tracker that is not installed or not known is one config error before anything loads."""

import json
from pathlib import Path

import pytest
import torch
from conftest import tiny_overrides

from flowrl.config import ConfigError, load_config
from flowrl.trackers import check_trackers, flat_config
from flowrl.trainer import Trainer


def _events(folder: Path):
    """The main writer's events in `folder` (the hyper-parameters go to a sub-folder of their own)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder), size_guidance={"images": 0, "scalars": 0})
    acc.Reload()
    return acc


def test_tensorboard_and_offline_wandb_receive_the_metrics_and_images(
    tmp_path, random_pipeline, prompt_files, monkeypatch
):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "run"
    cfg = load_config(
        None,
        tiny_overrides(
            random_pipeline,
            *prompt_files,
            out,
            **{"run.log_with": "[tensorboard,wandb]", "run.log_images_every": 1, "run.project": "tiny"},
        ),
    )
    Trainer(cfg).train()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    events = _events(out / "tensorboard" / "tiny")
    scalars = events.Scalars("reward/total/mean")
    assert [s.step for s in scalars] == [1, 2]
    assert [s.value for s in scalars] == pytest.approx([r["reward/total/mean"] for r in rows])
    assert [s.step for s in events.Scalars("eval/overall")] == [2]
    images = events.Tags()["images"]
    assert {"grid/before", "grid/after"} <= {t.split("/image/")[0] for t in images}
    assert any(t.startswith("rollout") for t in images)
    # the offline wandb run: a local run folder with its data file, ready for `wandb sync`
    runs = list((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))
    logged = {p.name.rsplit("_", 2)[0] for p in (runs[0] / "files" / "media" / "images").rglob("*.png")}
    assert logged >= {"rollout", "before", "after"}, logged


def test_unknown_or_missing_trackers_are_one_config_error(monkeypatch):
    with pytest.raises(ConfigError, match=r"run.log_with.*tensorboard\|wandb\|trackio.*'mlflow'"):
        load_config(None, ["run.log_with=[mlflow]"])
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "trackio" else real(name, *a))
    with pytest.raises(ValueError, match=r"run.log_with.*'trackio'.*pip install trackio"):
        check_trackers(["trackio"])
    with pytest.raises(ValueError, match="twice"):
        check_trackers(["tensorboard", "tensorboard"])


def test_flat_config_gives_scalar_hyperparameters():
    assert flat_config({"a": {"b": 1, "c": [1, 2]}, "d": None, "e": "x"}) == {
        "a.b": 1,
        "a.c": "[1, 2]",
        "d": "None",
        "e": "x",
    }


def _launch(kind: str, deepspeed_config: dict | None = None, **plugin):
    from types import SimpleNamespace

    from accelerate.utils import DistributedType

    return SimpleNamespace(
        distributed_type=DistributedType[kind],
        num_processes=1,
        state=SimpleNamespace(
            fsdp_plugin=SimpleNamespace(**plugin), deepspeed_plugin=SimpleNamespace(deepspeed_config=deepspeed_config)
        ),
    )


def test_the_shipped_fsdp2_launch_passes_and_other_sharded_launches_are_refused_in_one_line(monkeypatch):
    from accelerate import FullyShardedDataParallelPlugin
    from distributed_worker import fsdp2_launch_env

    from flowrl.policy import check_accelerate_engine

    for (
        key,
        value,
    ) in fsdp2_launch_env().items():  # what `accelerate launch --config_file configs/accelerate/fsdp2.yaml` sets
        monkeypatch.setenv(key, value)
    plugin = FullyShardedDataParallelPlugin()
    assert plugin.fsdp_version == 2 and plugin.reshard_after_forward is False
    check_accelerate_engine(_launch("FSDP", fsdp_version=2, reshard_after_forward=plugin.reshard_after_forward))
    check_accelerate_engine(_launch("MULTI_GPU"))  # DDP
    with pytest.raises(ConfigError, match="FSDP version 1.*fsdp_version.*configs/accelerate/fsdp2.yaml"):
        check_accelerate_engine(_launch("FSDP", fsdp_version=1, reshard_after_forward=False))
    for key, value in fsdp2_launch_env("fsdp2_full_shard.yaml").items():  # full shard: every process in lockstep
        monkeypatch.setenv(key, value)
    full = FullyShardedDataParallelPlugin().reshard_after_forward
    assert full is True
    check_accelerate_engine(_launch("FSDP", fsdp_version=2, reshard_after_forward=full))
    with pytest.raises(ConfigError, match="reshards after each forward.*train.method 'refl' does not.*fsdp2.yaml"):
        check_accelerate_engine(
            _launch("FSDP", fsdp_version=2, reshard_after_forward=True), lockstep_blocker="train.method 'refl'"
        )
    with pytest.raises(ConfigError, match="reshards after forward to 4 processes.*true.*false"):
        check_accelerate_engine(_launch("FSDP", fsdp_version=2, reshard_after_forward=4))
    with pytest.raises(ConfigError, match="train.step_grad_norms.*params.*velocity or none"):
        check_accelerate_engine(_launch("FSDP", fsdp_version=2, reshard_after_forward=False), "params")
    with pytest.raises(ConfigError, match="train.optimizer.*adamw_8bit.*use adamw under FSDP2"):
        check_accelerate_engine(_launch("FSDP", fsdp_version=2, reshard_after_forward=False), "none", "adamw_8bit")
    with pytest.raises(ConfigError, match="uses MEGATRON_LM.*ddp.yaml.*fsdp2.yaml.*deepspeed_zero2.yaml"):
        check_accelerate_engine(_launch("MEGATRON_LM"))


def test_full_shard_runs_every_method_and_engines_a_method_cannot_run_are_refused_before_loading():
    """Under FSDP2 full shard (every process calls the transformer alike) every method runs: GRPO on every rollout
    shape, Flow-DPPO, GARDO, Flow-OPD, the forward-process, direct-reward and few-step methods (no lockstep blocker);
    the few-step methods (their fake score's own AdamW) are refused under DeepSpeed in one line naming train.method
    and what runs it, before any weights load, and Flow-OPD runs under every engine; the refusals' list of what full
    sharding runs is the registry's."""
    from types import SimpleNamespace

    from flowrl.methods import METHODS
    from flowrl.policy import check_accelerate_engine, what_runs

    def cfg(method: str, shape: str = "flat"):
        return SimpleNamespace(train=SimpleNamespace(method=method), sampling=SimpleNamespace(shape=shape))

    lockstep = {"grpo", "flow_dppo", "gardo", "nft", "awm", "crd", "dgpo", "dpo", "dpo_offline", "sft", "opd"}
    lockstep |= {"refl", "draft", "alignprop", "srpo", "tdm", "dmd", "dmdr", "tdm_r1"}
    for method in lockstep:
        assert METHODS[method].lockstep_blocker(cfg(method)) is None, method
    for shape in ("tree", "g2rpo", "tempflow", "tp_grpo"):
        assert METHODS["grpo"].lockstep_blocker(cfg("grpo", shape)) is None, shape
    assert set(METHODS) == lockstep
    assert what_runs() == "full sharding runs train.method " + ", ".join(sorted(lockstep))
    blocked = {m: METHODS[m].engine_blockers(cfg(m)) for m in METHODS}
    deepspeed = {m: ["DeepSpeed"] for m in ("tdm", "dmd", "dmdr", "tdm_r1")}
    assert {m: sorted(b) for m, b in blocked.items() if b} == deepspeed
    fsdp2 = _launch("FSDP", fsdp_version=2, reshard_after_forward=False)
    for method in ("tdm_r1",):
        with pytest.raises(ConfigError, match=f"^config key 'train.method': {method} .*DDP.*ddp.yaml.*not DeepSpeed$"):
            check_accelerate_engine(_launch("DEEPSPEED", {}), engine_blockers=blocked[method])
        check_accelerate_engine(_launch("MULTI_GPU"), engine_blockers=blocked[method])  # DDP and FSDP2 run them
        check_accelerate_engine(fsdp2, engine_blockers=blocked[method])
    assert blocked["opd"] == {}


def test_padded_forwards_and_stand_ins_match_the_process_with_the_most_calls():
    """In lockstep a method's forwards over its own rows (``Method.chunked(..., pad=True)``) add a discarded call of
    their first row for each chunk the process with the most makes beyond theirs, and return the unpadded result; a
    process that kept no rows updates on a stand-in (sample 0, or the given spare) that counts as none; outside
    lockstep nothing changes."""
    from types import SimpleNamespace

    from flowrl.methods.base import Method
    from flowrl.methods.forward import ForwardProcess

    calls = []

    def fn(x, t, cond):
        calls.append(len(x))
        return x * 2 + t[:, None] + cond[:, None]

    x, t, cond = torch.arange(10.0).view(5, 2), torch.arange(5.0), torch.arange(5)
    most = SimpleNamespace(cfg=SimpleNamespace(sampling=SimpleNamespace(batch_size=2)))
    most.policy = SimpleNamespace(calls_owed=lambda n: 4 - n, lockstep=True)  # the process with the most: 4 chunks
    out = Method.chunked(most, fn, pad=True)(x, t, cond)
    assert calls == [2, 2, 1, 1] and torch.equal(out, fn(x, t, cond))  # 3 chunks and 1 padding call
    calls.clear()
    assert torch.equal(Method.chunked(most, fn)(x, t, cond), out) and calls == [2, 2, 1]  # pad off: as before
    with pytest.raises(RuntimeError, match="needs a row to repeat.*stand_in"):
        Method.chunked(most, fn, pad=True)(x[:0], t[:0], cond[:0])
    rows = torch.tensor([3, 4])
    kept, real = ForwardProcess.stand_in(most, rows)
    assert kept is rows and real
    stand_in, real = ForwardProcess.stand_in(most, rows[:0])
    assert stand_in.tolist() == [0] and not real
    assert ForwardProcess.stand_in(most, rows[:0], rows)[0] is rows
    alone = SimpleNamespace(policy=SimpleNamespace(lockstep=False))
    assert ForwardProcess.stand_in(alone, rows[:0])[0].numel() == 0  # outside lockstep: no rows, none stand in


def test_gardo_calls_its_reference_in_every_micro_batch_in_lockstep(monkeypatch):
    """GARDO in lockstep runs the reference in a micro-batch without a gated transition too (on its first, discarded:
    no KL), so every micro-batch makes two forwards on every process; outside lockstep it skips it. A padding
    micro-batch's KL leaves the reference's reset alone."""
    import contextlib
    from types import SimpleNamespace

    from flowrl.methods.gardo import GARDO
    from flowrl.methods.grpo import GRPO

    rows_seen = []
    monkeypatch.setattr(GRPO, "policy_log_prob", lambda self, velocity, sub: velocity(sub.state, None, None))
    sub = SimpleNamespace(leaf=torch.tensor([0, 1, 1]), state=torch.zeros(3, 2))
    sub.select = lambda idx: SimpleNamespace(state=sub.state[idx], sigma=None, cond=None)
    m = GARDO.__new__(GARDO)
    m.reference, m.gate, m.device = {}, torch.tensor([False, False]), torch.device("cpu")

    def velocity(state, sigma, cond):
        rows_seen.append(len(state))
        return state

    for lockstep, seen in ((True, [1, 3]), (False, [3])):
        null = contextlib.nullcontext
        m.policy = SimpleNamespace(lockstep=lockstep, holding=lambda w: null(), autocast=lambda: null())
        rows_seen.clear()
        m.policy_log_prob(velocity, sub)
        assert rows_seen == seen and m.v_ref is None
    m.gate = torch.tensor([False, True])
    m.policy_log_prob(velocity, sub)
    assert m.v_ref[0].tolist() == [False, True, True] and len(m.v_ref[1].state) == 2  # the gated transitions

    def exceeding(self, *args):
        self.exceeded = True
        return torch.zeros(()), {}

    monkeypatch.setattr(GRPO, "micro_batch_loss", exceeding)
    for pad in (True, False):
        m.exceeded = False
        m.micro_batch_loss(None, sub, None, None, SimpleNamespace(pad=pad), None)
        assert m.exceeded is not pad


def test_the_shipped_deepspeed_launch_passes_and_what_flowrl_cannot_run_is_refused_in_one_line(monkeypatch):
    import copy

    from accelerate import DeepSpeedPlugin
    from distributed_worker import deepspeed_launch_env

    from flowrl.policy import check_accelerate_engine
    from flowrl.zero import configure

    for (
        key,
        value,
    ) in deepspeed_launch_env().items():  # what `accelerate launch --config_file .../deepspeed_zero2.yaml` sets
        monkeypatch.setenv(key, value)
    shipped = DeepSpeedPlugin().deepspeed_config
    assert shipped["zero_optimization"]["stage"] == 2
    check_accelerate_engine(_launch("DEEPSPEED", shipped), max_grad_norm=0.5)
    filled = copy.deepcopy(shipped)
    configure(filled, 0.5, 8)
    assert filled["gradient_clipping"] == 0.5 and filled["managed_gradient_accumulation"] is False
    check_accelerate_engine(_launch("DEEPSPEED", filled), max_grad_norm=0.5)  # a filled config passes again

    def changed(**keys):
        config = copy.deepcopy(shipped)
        for dotted, value in keys.items():
            *parents, last = dotted.split("__")
            node = config
            for key in parents:
                node = node.setdefault(key, {})
            node[last] = value
        return _launch("DEEPSPEED", config)

    for key, value in deepspeed_launch_env("deepspeed_zero3.yaml").items():  # ZeRO-3 runs the lockstep methods
        monkeypatch.setenv(key, value)
    plugin = DeepSpeedPlugin()
    assert plugin.deepspeed_config["zero_optimization"]["stage"] == 3 and plugin.zero3_init_flag is False
    check_accelerate_engine(_launch("DEEPSPEED", plugin.deepspeed_config), max_grad_norm=0.5)
    with pytest.raises(ConfigError, match="stage is 3.*every process to call the transformer alike.*'refl' does not"):
        check_accelerate_engine(
            changed(zero_optimization__stage=3), max_grad_norm=0.5, lockstep_blocker="train.method 'refl'"
        )
    for key, value in deepspeed_launch_env("deepspeed_zero3_offload.yaml").items():  # the weights and AdamW on the CPU
        monkeypatch.setenv(key, value)
    offload = DeepSpeedPlugin().deepspeed_config["zero_optimization"]
    assert offload["offload_param"]["device"] == offload["offload_optimizer"]["device"] == "cpu"
    check_accelerate_engine(_launch("DEEPSPEED", DeepSpeedPlugin().deepspeed_config), max_grad_norm=0.5)
    zero3_init = changed(zero_optimization__stage=3)
    zero3_init.state.deepspeed_plugin.zero3_init_flag = True
    with pytest.raises(ConfigError, match="zero3_init_flag is true.*text encoders.*set it false"):
        check_accelerate_engine(zero3_init, max_grad_norm=0.5)
    cases = [
        (changed(zero_optimization__stage=4), "zero_optimization.stage is 4.*stage 1, 2 or 3"),
        (changed(zero_optimization__stage=0), "stage is 0.*ddp.yaml"),
        (changed(zero_optimization__offload_param__device="cpu"), "offload_param.device.*stage 2.*stage 3 only"),
        (changed(bf16__enabled=True), "enables bf16.*run.mixed_precision=bf16"),
        (changed(optimizer={"type": "AdamW"}), "'optimizer' block.*train.learning_rate"),
        (changed(gradient_clipping=2.0), "gradient_clipping is 2.0.*'train.max_grad_norm' is 0.5"),
    ]
    for launch, message in cases:
        with pytest.raises(ConfigError, match=message):
            check_accelerate_engine(launch, max_grad_norm=0.5)
    with pytest.raises(ConfigError, match="train.step_grad_norms.*params.*DeepSpeed"):
        check_accelerate_engine(_launch("DEEPSPEED", shipped), "params", max_grad_norm=0.5)
    with pytest.raises(ConfigError, match="train.optimizer.*adamw_8bit.*ZeRO partitions"):
        check_accelerate_engine(_launch("DEEPSPEED", shipped), "none", "adamw_8bit", max_grad_norm=0.5)
    # accelerate 1.15 on a machine without GPUs: DeepSpeed's group has every process, accelerate counts one
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda *a: 2)
    with pytest.raises(ConfigError, match="DEEPSPEED on 2 processes but accelerate counts 1.*ddp.yaml"):
        check_accelerate_engine(_launch("DEEPSPEED", shipped), max_grad_norm=0.5)
