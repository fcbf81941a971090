"""The family contract itself, without weights: the registry, the declared capabilities and what the methods need, the
prompt batching and guidance of the base, prompt-length limits as data, and the layering (families import neither the
config nor the methods)."""

from __future__ import annotations

import ast
import inspect
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import flowrl.models as models
from flowrl.fields import ConfigError
from flowrl.methods import METHODS
from flowrl.models import FAMILIES, FlowModel, PromptEmbeds, register_family
from flowrl.models.base import CAPABILITIES
from flowrl.pairing import check_pairing

MODELS = Path(models.__file__).parent


def _imports(file: Path) -> set[str]:
    """Every module a file imports, anywhere in it (inside functions too), relative ones resolved against flowrl.models."""
    names = set()
    for node in ast.walk(ast.parse(file.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = ["flowrl", "models"][: max(0, 2 - (node.level - 1))] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            names.update([module] + [f"{module}.{alias.name}" for alias in node.names])
    return names


def test_families_import_neither_the_config_nor_the_methods():
    for file in sorted(MODELS.glob("*.py")):
        upward = {n for n in _imports(file) if n.startswith(("flowrl.config", "flowrl.methods", "flowrl.pairing"))}
        assert not upward, f"{file.name} imports {sorted(upward)}"


def test_no_function_in_the_families_is_over_100_lines():
    for file in sorted(MODELS.glob("*.py")):
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                assert node.end_lineno - node.lineno < 100, f"{file.name}:{node.name}"


def test_every_family_is_registered_by_its_pipeline_and_importable_by_name():
    assert len(FAMILIES) >= 20 and models.ADAPTERS == tuple(FAMILIES.values())
    for pipeline, cls in FAMILIES.items():
        assert cls.PIPELINE == pipeline and getattr(models, cls.__name__) is cls and cls.__name__ in models.__all__
    with pytest.raises(ValueError, match="pipeline StableDiffusion3Pipeline is registered already"):
        register_family(type("Again", (FlowModel,), {"PIPELINE": "StableDiffusion3Pipeline"}))
    with pytest.raises(ValueError, match="NoPipeline names no PIPELINE"):
        register_family(type("NoPipeline", (FlowModel,), {}))


def test_options_are_declared_with_a_check_and_a_default():
    for cls in FAMILIES.values():
        for name in cls.OPTIONS:
            assert hasattr(cls, name), f"{cls.__name__}.{name} has no class default"
            custom = cls.check_option.__func__ is not FlowModel.check_option.__func__
            assert custom or callable(getattr(cls, f"check_{name}", None)), f"{cls.__name__} has no check_{name}"


def test_the_capabilities_are_declared_and_the_vae_inverse_is_the_base_decode():
    for cls in FAMILIES.values():
        assert all(isinstance(cls.supports(c), bool) for c in CAPABILITIES)
        assert cls.VAE_INVERSE == (cls.decode is FlowModel.decode), cls.__name__
    assert not FAMILIES["StableDiffusionPipeline"].supports("forward_process")
    assert {cls.__name__ for cls in FAMILIES.values() if cls.VAE_INVERSE and cls.TEXT_ONLY} == {
        "SD3Model",
        "FluxModel",
        "ZImageModel",
    }
    with pytest.raises(KeyError, match="unknown family capability 'color'"):
        FlowModel.supports("color")


def test_each_method_names_known_needs_and_the_pairing_refuses_in_one_line():
    for method in METHODS.values():
        assert set(method.requires) <= set(CAPABILITIES), method.__name__
    forward = {name for name, m in METHODS.items() if "forward_process" in m.requires}
    assert {"nft", "awm", "crd", "dgpo", "dpo", "dpo_offline", "sft"} <= forward
    assert not forward & {"grpo", "flow_dppo", "gardo", "refl", "draft", "alignprop", "srpo"}
    sd15, kontext = FAMILIES["StableDiffusionPipeline"], FAMILIES["FluxKontextPipeline"]
    for name in sorted(forward):
        with pytest.raises(ConfigError, match=rf"^config key 'train\.method': '{name}' .* needs a flow-matching") as e:
            check_pairing(METHODS[name], sd15, "assets/sd15")
        assert "\n" not in str(e.value) and "grpo" in str(e.value)  # what the family runs instead
    with pytest.raises(
        ConfigError, match=r"^train\.method 'sft': FluxKontextModel edits source images.*built: .*SD3Model"
    ):
        check_pairing(METHODS["sft"], kontext, "kontext")
    for method in METHODS.values():  # every method runs on the flow families with text-only prompts
        check_pairing(method, FAMILIES["StableDiffusion3Pipeline"], "assets/tiny-sd3")


def test_prompt_lengths_are_data_with_one_message():
    flux, sana, qwen, sd15 = (
        FAMILIES[p] for p in ("FluxPipeline", "SanaPipeline", "QwenImagePipeline", "StableDiffusionPipeline")
    )
    with pytest.raises(ValueError, match=r"^max_sequence_length must be >= 1 for FLUX \(its T5 tokens condition"):
        flux.check_max_sequence_length(0)
    with pytest.raises(ValueError, match=r"^max_sequence_length must be >= 3 for SANA .* got 2$"):
        sana.check_max_sequence_length(2)
    with pytest.raises(ValueError, match=r"^max_sequence_length must be in 1\.\.1024 for Qwen-Image"):
        qwen.check_max_sequence_length(1025)
    with pytest.raises(ValueError, match=r"^max_sequence_length must be 0 for SD 1\.x"):
        sd15.check_max_sequence_length(77)
    with pytest.raises(ValueError, match=r"^max_sequence_length must be >= 0, got -1$"):
        FAMILIES["StableDiffusion3Pipeline"].check_max_sequence_length(-1)
    for cls in FAMILIES.values():  # one base implementation
        assert cls.check_max_sequence_length.__func__ is FlowModel.check_max_sequence_length.__func__


def test_at_most_four_family_files_override_the_velocity_and_none_the_velocity_fn():
    files = {inspect.getfile(cls) for cls in FAMILIES.values() if "velocity" in vars(cls)}  # sdxl.py, ltx2.py
    assert len(files) <= 4, sorted(files)
    for cls in FAMILIES.values():
        if "velocity" in vars(cls):
            assert "Overridden because" in cls.velocity.__doc__, cls.__name__
        assert "velocity_fn" not in vars(cls), cls.__name__


@dataclass
class SourcePromptEmbeds(PromptEmbeds):
    mask: torch.Tensor = None
    image: torch.Tensor = None

    SHARED = ("image",)


def _table() -> SourcePromptEmbeds:
    rows = torch.arange(3.0)  # row 0 the negative, rows 1 and 2 prompts
    return SourcePromptEmbeds(rows.view(3, 1, 1), -rows.view(3, 1), rows.long().view(3, 1), 10 + rows.view(3, 1))


def test_prompt_embeds_keep_every_field_when_indexed_batched_and_guided():
    table = _table()
    rows = table[torch.tensor([2, 1])]
    assert type(rows) is SourcePromptEmbeds and rows.mask.flatten().tolist() == [2, 1]
    both = PromptEmbeds.cat([rows, table[torch.tensor([0])]])
    assert both.image.flatten().tolist() == [12.0, 11.0, 10.0] and both.mask.shape == (3, 1)
    assert SourcePromptEmbeds.text_fields() == ("embeds", "pooled", "mask")
    negative = rows.negative(table[torch.zeros(2, dtype=torch.long)])  # the negative's text, each row's image
    assert negative.embeds.flatten().tolist() == [0.0, 0.0] and negative.image.flatten().tolist() == [12.0, 11.0]
    swapped = table.with_negative(SourcePromptEmbeds(torch.full((1, 1, 1), 7.0), torch.zeros(1, 1), torch.ones(1, 1)))
    assert swapped.embeds.flatten().tolist() == [7.0, 1.0, 2.0] and torch.equal(swapped.image, table.image)


class _Recorder(FlowModel):
    """A family without weights: its forward returns each row's embedding plus its source image, and records its
    batches."""

    negative_prompt = "blurry"

    def __init__(self):
        self.transformer, self.calls = torch.nn.Linear(1, 1), []

    def encode(self, prompts):
        return SourcePromptEmbeds(torch.full((1, 1, 1), 5.0), torch.zeros(1, 1), torch.ones(1, 1), torch.zeros(1, 1))

    def _forward(self, x, t, cond, dtype):
        self.calls.append(cond)
        return x + cond.embeds.view(-1, 1) + cond.image


def test_the_base_batches_the_cfg_pair_with_every_field_and_puts_the_negative_prompt_in():
    model, table = _Recorder(), _table()
    v = model.velocity_fn(table, 3.0)(torch.zeros(2, 1), torch.ones(2), torch.tensor([1, 2]))
    both = model.calls[-1]  # one forward of 2N rows: the negatives (the negative prompt's text, each row's image)
    assert both.embeds.flatten().tolist() == [5.0, 5.0, 1.0, 2.0] and both.image.flatten().tolist() == [11, 12, 11, 12]
    assert both.mask.shape == (4, 1)
    v_u, v_c = torch.tensor([[16.0], [17.0]]), torch.tensor([[12.0], [14.0]])
    torch.testing.assert_close(v, v_u + 3.0 * (v_c - v_u), rtol=0, atol=0)
    assert model.cfg_rows(3.0) == 2 and model.cfg_rows(1.0) == 1
    model.velocity_fn(table, 1.0)(torch.zeros(2, 1), torch.ones(2), torch.tensor([1, 2]))
    assert len(model.calls[-1].embeds) == 2  # no guidance: one row per sample
