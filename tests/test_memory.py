"""Memory features: 8-bit AdamW (refused where it cannot run; its state survives a checkpoint), the prompt-embedding
cache (bit-equal to fresh encoding, no encoder call on a hit, a damaged file re-encoded with a warning, a training run
unchanged), text encoders and VAE placed on the CPU, and gradient checkpointing for every family's network."""

from __future__ import annotations

import inspect
import json
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from conftest import tiny_overrides  # noqa: E402

from flowrl.checkpoint import _flatten_optimizer, _unflatten_optimizer, load_checkpoint, save_checkpoint  # noqa: E402
from flowrl.config import ConfigError, load_config  # noqa: E402
from flowrl.models.memory import place_frozen  # noqa: E402
from flowrl.policy import build_optimizer, check_optimizer  # noqa: E402


# ------------------------------------------------------------------------------------------- optimizer
def test_adamw_8bit_is_refused_on_cpu_before_weights_load(tmp_path, prompt_files):
    from flowrl.trainer import Trainer

    with pytest.raises(ConfigError, match=r"'train.optimizer' is 'adamw_8bit'.*CUDA GPU only.*train.optimizer=adamw"):
        check_optimizer("adamw_8bit", "cpu")
    # a model folder that does not exist: the optimizer is refused first, so no weights were about to load
    cfg = load_config(
        None,
        tiny_overrides(tmp_path / "no-model", *prompt_files, tmp_path / "run", **{"train.optimizer": "adamw_8bit"}),
    )
    with pytest.raises(ConfigError) as err:
        Trainer(cfg)
    assert "train.optimizer" in str(err.value) and "\n" not in str(err.value)


def test_adamw_8bit_without_bitsandbytes_names_the_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # as if not installed: import raises ImportError
    with pytest.raises(
        ConfigError, match=r"'train.optimizer'.*bitsandbytes is not installed: pip install bitsandbytes"
    ):
        check_optimizer("adamw_8bit", "cuda")
    check_optimizer("adamw", "cpu")  # the default runs anywhere


def test_optimizer_key_is_checked_and_adamw_is_torch_adamw():
    with pytest.raises(ConfigError, match="train.optimizer"):
        load_config(None, ["train.optimizer=sgd"])
    train = load_config(None, ["train.learning_rate=0.01", "train.weight_decay=0.5"]).train
    opt = build_optimizer([torch.nn.Parameter(torch.ones(3))], train)
    assert type(opt) is torch.optim.AdamW
    assert opt.defaults["lr"] == 0.01 and opt.defaults["weight_decay"] == 0.5 and opt.defaults["eps"] == 1e-8


def test_nested_uint8_optimizer_state_round_trips_through_safetensors(tmp_path):
    """bitsandbytes' 8-bit optimizers nest uint8 moments and float32 block maxima under one key of a parameter's
    state; the checkpoint keeps every tensor with its dtype and the nesting."""
    from safetensors.torch import load_file, save_file

    state = {
        "state": {
            0: {
                "step": 3,
                "__bnb_optimizer_quant_state__": {
                    "state1": torch.randint(0, 255, (4096,), dtype=torch.uint8),
                    "absmax1": torch.rand(16),
                    "qmap1": torch.linspace(-1, 1, 256),
                },
            },
            1: {"step": torch.tensor(2.0), "exp_avg": torch.randn(3)},
        },
        "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": [0, 1]}],
    }
    tensors, meta = _flatten_optimizer(state)
    save_file(tensors, tmp_path / "o.safetensors")
    back = _unflatten_optimizer(load_file(tmp_path / "o.safetensors"), json.loads(json.dumps(meta)))
    quant = back["state"][0]["__bnb_optimizer_quant_state__"]
    assert back["state"][0]["step"] == 3 and quant["state1"].dtype == torch.uint8
    for key in ("state1", "absmax1", "qmap1"):
        assert torch.equal(quant[key], state["state"][0]["__bnb_optimizer_quant_state__"][key])
    assert torch.equal(back["state"][1]["exp_avg"], state["state"][1]["exp_avg"])


def test_adamw_8bit_state_survives_a_checkpoint(tmp_path):
    """A real ``bnb.optim.AdamW8bit`` (bitsandbytes runs its 8-bit optimizers on the CPU too; flowrl refuses that in
    runs, not here): two steps, save, restore into a new optimizer, one more step of each gives the same weights."""
    pytest.importorskip("bitsandbytes")
    train = SimpleNamespace(optimizer="adamw_8bit", learning_rate=1e-2, adam_betas=(0.9, 0.999), weight_decay=0.1)

    def setup():
        torch.manual_seed(0)
        return {"w": torch.nn.Parameter(torch.randn(64, 128)), "b": torch.nn.Parameter(torch.randn(16))}

    def step(params, opt):
        (params["w"].square().sum() + params["b"].sin().sum()).backward()
        opt.step()
        opt.zero_grad()

    params = setup()
    opt = build_optimizer(params.values(), train)
    assert type(opt).__name__ == "AdamW8bit"
    step(params, opt), step(params, opt)
    folder = save_checkpoint(tmp_path, 2, params, opt)
    assert any(
        v == "U8" for v in json.loads(_header(folder / "optimizer.safetensors")).values() if isinstance(v, str)
    )  # the uint8 moments are stored as uint8
    params2 = setup()
    opt2 = build_optimizer(params2.values(), train)
    load_checkpoint(folder, params2, opt2)
    step(params, opt), step(params2, opt2)
    for n in params:
        assert torch.equal(params[n], params2[n])


def _header(file: Path) -> str:
    """The dtypes of a safetensors file's header as ``{"name": "DTYPE"}`` JSON."""
    import struct

    raw = file.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + length])
    return json.dumps({k: v["dtype"] for k, v in header.items() if k != "__metadata__"})


# ------------------------------------------------------------------------------------------ prompt cache
def _count_calls(model) -> list[int]:
    """A list whose only item counts the forwards of every text encoder of ``model`` from now on."""
    from flowrl.models.memory import text_encoder_names

    calls = [0]
    for name in text_encoder_names(model.pipe):
        getattr(model.pipe, name).register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


@pytest.mark.parametrize("family", ["sd3", "flux"])
def test_cached_tables_equal_fresh_ones_and_hits_skip_the_encoder(
    family, tmp_path, random_pipeline, random_flux_pipeline
):
    from flowrl.models import load_model
    from flowrl.tiny.prompts import split

    folder = random_pipeline if family == "sd3" else random_flux_pipeline
    metas = split(0)[0][:6]
    fresh_model = load_model(folder, "cpu")
    fresh = fresh_model.prompt_table(metas)
    part = fresh_model.prompt_table(metas[2:4])  # another batch: the rows of a table do not depend on it
    model = load_model(folder, "cpu")
    cache = place_frozen(model, tmp_path / "cache")
    calls = _count_calls(model)
    cold = model.prompt_table(metas)  # 7 misses: encoded and written
    assert calls[0] > 0 and cache.misses == 7 and len(list(cache.folder.glob("*.safetensors"))) == 7
    calls[0] = 0
    warm, sub = model.prompt_table(metas), model.prompt_table(metas[2:4])
    assert calls[0] == 0 and cache.encoder_calls == 1  # every row read from disk
    for table in (cold, warm):
        assert type(table) is type(fresh)
        assert torch.equal(table.embeds, fresh.embeds) and torch.equal(table.pooled, fresh.pooled)
    assert torch.equal(sub.embeds, part.embeds) and torch.equal(sub.pooled, part.pooled)
    # another model folder state (a touched text-encoder file) is another identity: a miss, never a stale hit
    from flowrl.models.memory import encoder_identity

    first = encoder_identity(model)
    weights = next((Path(folder) / "text_encoder").glob("*.safetensors"))
    weights.touch()
    assert encoder_identity(model) != first


class _Stub:
    """A stand-in adapter whose ``encode`` gives each prompt a row that depends on it alone, of a family's
    :class:`PromptEmbeds` subclass (counting its calls)."""

    PIPELINE, max_sequence_length, dtype, device = "Stub", 8, torch.float32, torch.device("cpu")

    def __init__(self, path: Path, kind: str, padding: str = "fixed"):
        (path / "text_encoder").mkdir(parents=True, exist_ok=True)
        (path / "text_encoder" / "config.json").write_text("{}")
        self.path, self.kind, self.PROMPT_PADDING, self.calls = path, kind, padding, 0
        self.pipe = SimpleNamespace(components={})

    def encode(self, prompts):
        from flowrl.models.hunyuan_video import HunyuanPromptEmbeds
        from flowrl.models.qwen_image import QwenPromptEmbeds

        self.calls += 1
        lengths = [1 + len(p) % 7 for p in prompts]
        T = self.max_sequence_length if self.PROMPT_PADDING == "fixed" else max(lengths)
        gens = [torch.Generator().manual_seed(sum(map(ord, p))) for p in prompts]
        embeds = torch.stack([torch.randn(T, 4, generator=g) for g in gens])  # (P, T, 4)
        pooled = torch.stack([torch.randn(3, generator=g) for g in gens])  # (P, 3)
        mask = torch.stack([(torch.arange(T) < n).long() for n in lengths])  # (P, T)
        embeds = embeds * mask[..., None]  # zero past each prompt, as the pipelines pad
        if self.kind == "hunyuan":
            return HunyuanPromptEmbeds(embeds, pooled, mask)
        return QwenPromptEmbeds(embeds, embeds.new_zeros(len(prompts), 0), mask)


@pytest.mark.parametrize("kind,padding", [("hunyuan", "fixed"), ("qwen", "longest")])
def test_cache_stores_every_field_of_a_family_table(kind, padding, tmp_path):
    from flowrl.models.memory import PromptCache

    stub = _Stub(tmp_path / "model", kind, padding)
    cache = PromptCache(stub, tmp_path / "cache")
    prompts = ["", "a red cube", "two dogs on grass", "a"]
    cache(prompts[:2])  # two rows cached from a batch padded to their own longest
    table = cache(prompts)  # two hits, two misses
    fresh = stub.encode(prompts)
    assert type(table) is type(fresh)
    assert cache(prompts[2:]).embeds.shape[1] == stub.encode(prompts[2:]).embeds.shape[1]
    for name in ("embeds", "pooled", "mask"):
        assert getattr(table, name).dtype == getattr(fresh, name).dtype
        assert torch.equal(getattr(table, name), getattr(fresh, name)), name


class _Bf16Stub(_Stub):
    """A stub whose encoders ran in bf16: float32 rows that bf16 holds exactly."""

    dtype = torch.bfloat16

    def encode(self, prompts):
        table = super().encode(prompts)
        table.embeds, table.pooled = table.embeds.bfloat16().float(), table.pooled.bfloat16().float()
        return table


def test_bf16_rows_are_stored_in_bf16_and_read_back_exactly(tmp_path):
    from safetensors import safe_open

    from flowrl.models.memory import PromptCache

    cache = PromptCache(_Bf16Stub(tmp_path / "model", "hunyuan"), tmp_path / "cache")
    first, again = cache(["a red cube", ""]), cache(["a red cube", ""])
    assert torch.equal(first.embeds, again.embeds) and again.embeds.dtype == torch.float32
    with safe_open(str(cache.file("a red cube")), framework="pt") as f:
        assert f.get_tensor("embeds").dtype == torch.bfloat16  # half the disk of float32
        assert f.get_tensor("mask").dtype == torch.int64


def test_damaged_cache_files_are_encoded_again_with_a_warning(tmp_path):
    from flowrl.models.memory import PromptCache

    stub = _Stub(tmp_path / "model", "hunyuan")
    cache = PromptCache(stub, tmp_path / "cache")
    good = cache(["a red cube", "two dogs"])
    file = cache.file("a red cube")
    raw = bytearray(file.read_bytes())
    raw[-3] ^= 0xFF  # one flipped byte in the tensor data: the file still parses
    file.write_bytes(bytes(raw))
    for damage, why in ((None, "SHA-256"), ("truncate", "unreadable"), ("swap", "another prompt")):
        if damage == "truncate":
            file.write_bytes(file.read_bytes()[:40])
        elif damage == "swap":
            file.write_bytes(cache.file("two dogs").read_bytes())
        calls = stub.calls
        with pytest.warns(UserWarning, match=f"prompt cache file .* is damaged .*{why}"):
            again = cache(["a red cube", "two dogs"])
        assert stub.calls == calls + 1  # encoded again, not used
        assert torch.equal(again.embeds, good.embeds) and torch.equal(again.mask, good.mask)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the file was replaced by a good one
            cache(["a red cube"])


def test_drop_after_cache_frees_the_encoders_and_refuses_a_new_prompt(tmp_path, random_pipeline):
    from flowrl.models import load_model

    model = load_model(random_pipeline, "cpu")
    fresh = model.encode(["", "a red cube", "a blue ball"])
    place_frozen(model, tmp_path / "cache", "drop_after_cache", prompts=["a red cube", "a blue ball"])
    assert model.pipe.text_encoder is None and model.pipe.text_encoder_2 is None
    table = model.encode(["", "a red cube", "a blue ball"])
    assert torch.equal(table.embeds, fresh.embeds) and torch.equal(table.pooled, fresh.pooled)
    with pytest.raises(RuntimeError, match=r"'a green cone' is not in the prompt cache.*model.text_encoders"):
        model.encode(["a green cone"])


def test_placement_config_is_checked():
    for overrides, key in (
        (["model.text_encoders=gpu"], "model.text_encoders"),
        (["model.text_encoders=drop_after_cache"], "model.prompt_cache is set"),
        (["model.text_encoders=drop_after_cache", "model.prompt_cache=c", "model.lora_rank=0"], "full fine-tuning"),
        (["model.vae_placement=disk"], "model.vae_placement"),
    ):
        with pytest.raises(ConfigError, match=key):
            load_config(None, overrides)


def test_offloaded_parts_move_to_the_device_only_for_their_call(tmp_path, random_pipeline):
    from flowrl.models import load_model
    from flowrl.models.memory import on_device

    moves = []

    class Recorder(torch.nn.Module):
        def to(self, *args, **kwargs):
            moves.append(str(args[0]))
            return self

    with on_device([Recorder()], torch.device("cuda")):
        assert moves == ["cuda"]
    assert moves == ["cuda", "cpu"]
    with on_device([Recorder()], torch.device("cpu")):
        pass
    assert moves == ["cuda", "cpu"]  # nothing moves on a CPU run
    # on the CPU the wrapped decode and encode give what the plain ones give
    model, plain = load_model(random_pipeline, "cpu"), load_model(random_pipeline, "cpu")
    place_frozen(model, None, "cpu", "cpu")
    z = torch.randn(2, *model.latent_shape, generator=torch.Generator().manual_seed(0))
    assert torch.equal(model.decode(z), plain.decode(z))
    assert torch.equal(model.encode(["a cube", ""]).embeds, plain.encode(["a cube", ""]).embeds)
    assert model.pipe.vae.device.type == "cpu" and model.pipe.text_encoder.device.type == "cpu"


def _run(tmp_path, model, prompt_files, name, **extra):
    """Two float32 iterations of the default (Flow-GRPO) config; metrics rows without ``time/*`` and ``memory/*``, final weights."""
    from flowrl.trainer import Trainer

    extra = {"run.mixed_precision": "no", "rewards.jpeg_compressibility.weight": 1.0, **extra}
    trainer = Trainer(load_config(None, tiny_overrides(model, *prompt_files, tmp_path / name, **extra)))
    trainer.train()
    rows = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    rows = [{k: v for k, v in r.items() if not k.startswith(("time/", "memory/"))} for r in rows]
    return trainer, rows, {n: p.detach().clone() for n, p in trainer.policy.params.items()}


def test_training_with_the_prompt_cache_is_bit_identical(tmp_path, random_pipeline, prompt_files):
    _, rows, weights = _run(tmp_path, random_pipeline, prompt_files, "plain")
    trainer, cached_rows, cached_weights = _run(
        tmp_path,
        random_pipeline,
        prompt_files,
        "cached",
        **{
            "model.prompt_cache": str(tmp_path / "cache"),
            "model.text_encoders": "drop_after_cache",
            "model.vae_placement": "cpu",
        },
    )
    assert trainer.model.pipe.text_encoder is None  # every prompt came from the cache
    assert trainer.model.encode.hits > 0
    assert cached_rows == rows
    for n in weights:
        assert torch.equal(weights[n], cached_weights[n]), n


# ------------------------------------------------------------------------------------ gradient checkpointing
def test_every_family_network_supports_gradient_checkpointing():
    import diffusers

    from flowrl.models import ADAPTERS

    for adapter in ADAPTERS:
        pipeline = getattr(diffusers, adapter.PIPELINE)
        annotation = inspect.signature(pipeline.__init__).parameters[adapter.NETWORK].annotation
        network = next(t for t in getattr(annotation, "__args__", (annotation,)) if t is not type(None))
        assert network._supports_gradient_checkpointing, f"{adapter.__name__}: {network.__name__}"


def _counting_checkpoint(monkeypatch) -> list[int]:
    """Count the calls of ``torch.utils.checkpoint.checkpoint`` (diffusers' checkpointing calls it per block)."""
    import torch.utils.checkpoint as ckpt

    calls, original = [0], ckpt.checkpoint

    def counted(*args, **kwargs):
        calls[0] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(ckpt, "checkpoint", counted)
    return calls


def _lora_grads(model, checkpointing: bool) -> dict[str, torch.Tensor]:
    """Gradients of the LoRA parameters for one CFG velocity loss on 3 samples."""
    torch.manual_seed(0)
    model.add_lora(2, 4.0)
    for p in model.transformer.parameters():  # the zero-initialised B would give A no gradient
        if p.requires_grad:
            p.data.normal_(0, 0.1)
    if checkpointing:
        model.transformer.enable_gradient_checkpointing()
    g = torch.Generator().manual_seed(1)
    table = model.prompt_table([{"prompt": "a red cube"}, {"prompt": "two dogs"}])
    x, t = torch.randn(3, *model.latent_shape, generator=g), torch.tensor([0.9, 0.5, 0.2])
    v = model.velocity_fn(table, 2.0)(x, t, torch.tensor([1, 2, 1]))
    v.square().mean().backward()
    trained = model.transformer.named_parameters()
    return {n: p.grad.clone() for n, p in trained if p.requires_grad and p.grad is not None}  # LoRA the call reaches


def _checkpointed_families():
    from families import FAMILIES

    return [
        pytest.param(spec, id=spec.id)
        for spec in FAMILIES.values()
        if spec.prompts not in ("edit", "i2v", "references")  # their networks are the text-to-image entries' classes
    ]


@pytest.mark.parametrize("spec", _checkpointed_families())
def test_gradient_checkpointing_keeps_the_update_on_every_family(spec, tmp_path, monkeypatch):
    """``train.gradient_checkpointing`` (diffusers' checkpointing of each transformer block, or a UNet's resnets and
    attentions) recomputes the blocks in the backward: the LoRA's gradient of a guided velocity loss is the one
    without it, float32, on each family's tiny pipeline."""
    from flowrl.models import load_model

    folder = spec.build(tmp_path / spec.id)
    plain = _lora_grads(load_model(folder, "cpu", **spec.load), False)
    calls = _counting_checkpoint(monkeypatch)
    ckpt = _lora_grads(load_model(folder, "cpu", **spec.load), True)
    assert calls[0] >= 1  # the blocks ran checkpointed (the tiny Qwen-Image and HunyuanVideo 1.5 have one)
    assert plain.keys() == ckpt.keys() and plain
    for n in plain:
        torch.testing.assert_close(ckpt[n], plain[n], rtol=1e-5, atol=1e-6)


def test_gradient_checkpointing_keeps_a_unet_gradient(monkeypatch):
    """SD 1.x / SDXL train a UNet: diffusers' own checkpointing of its blocks leaves the gradient as it is."""
    from diffusers import UNet2DConditionModel

    calls = _counting_checkpoint(monkeypatch)

    def grads(checkpointing: bool):
        torch.manual_seed(0)
        unet = UNet2DConditionModel(
            sample_size=8,
            in_channels=4,
            out_channels=4,
            layers_per_block=1,
            block_out_channels=(8, 16),
            norm_num_groups=4,
            cross_attention_dim=8,
            attention_head_dim=2,
            down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
            up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        )
        if checkpointing:
            unet.enable_gradient_checkpointing()
        g = torch.Generator().manual_seed(1)
        x, text = torch.randn(2, 4, 8, 8, generator=g), torch.randn(2, 5, 8, generator=g)
        unet(x, torch.tensor([10, 500]), encoder_hidden_states=text).sample.square().mean().backward()
        return {n: p.grad.clone() for n, p in unet.named_parameters()}, unet.is_gradient_checkpointing

    (plain, off) = grads(False)
    assert calls[0] == 0
    (ckpt, on) = grads(True)
    assert on and not off and calls[0] >= 2
    for n in plain:
        torch.testing.assert_close(ckpt[n], plain[n], rtol=0, atol=1e-7)
