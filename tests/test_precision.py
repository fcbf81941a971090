"""Precision that fits the device: ``auto`` resolves to bf16 where the device computes it natively, float32 elsewhere;
an explicit bf16 on a CPU without it warns; the run records and prints its choice; float32 and bf16 runs both train."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import warnings

import pytest
import torch
import yaml
from conftest import REPO, tiny_overrides
from safetensors.torch import load_file

import flowrl.precision as precision
from flowrl.config import ConfigError, load_config
from flowrl.precision import autocast, native_bf16, resolve_precision


@pytest.fixture(params=[True, False], ids=["native", "emulated"])
def native(request, monkeypatch):
    """The CPU has native bf16 (True) or not (False), whatever this machine's CPU is."""
    monkeypatch.setattr(precision, "native_bf16", lambda device: request.param)
    return request.param


def test_auto_is_bf16_only_where_native(native):
    assert resolve_precision("auto", "cpu", "run.mixed_precision") == ("bf16" if native else "no")
    assert resolve_precision(None, "cpu", "--bf16") == ("bf16" if native else "no")  # a flag left unset
    assert resolve_precision("no", "cpu", "run.mixed_precision") == "no"
    assert resolve_precision(False, "cpu", "--bf16") == "no"


def test_explicit_bf16_runs_and_warns_once_where_emulated(native):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert resolve_precision("bf16", "cpu", "sampling.ode_precision") == "bf16"
        assert resolve_precision(True, "cpu", "--bf16") == "bf16"
    messages = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    if native:
        assert messages == []
    else:
        assert len(messages) == 2 and "sampling.ode_precision=bf16" in messages[0] and "emulated" in messages[0]
        assert "--bf16=bf16" in messages[1]


def test_unknown_values_are_refused_naming_the_setting():
    with pytest.raises(ValueError, match=r"^run.mixed_precision must be one of auto\|bf16\|no, got 'fp16'$"):
        resolve_precision("fp16", "cpu", "run.mixed_precision")
    with pytest.raises(ConfigError, match="run.mixed_precision"):
        load_config(None, ["run.mixed_precision=fp16"])
    with pytest.raises(ConfigError, match="sampling.ode_precision"):
        load_config(None, ["sampling.ode_precision=half"])


def test_defaults_are_auto_and_a_bare_no_reads_as_no():
    cfg = load_config(None, [])
    assert (cfg.run.mixed_precision, cfg.sampling.decode_precision, cfg.sampling.ode_precision) == ("auto",) * 3
    cfg = load_config(None, ["run.mixed_precision=no", "sampling.decode_precision=no"])  # YAML reads `no` as false
    assert (cfg.run.mixed_precision, cfg.sampling.decode_precision) == ("no", "no")


def test_native_bf16_on_this_cpu_is_onednns_answer():
    assert native_bf16("cpu") == torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert native_bf16("meta") is False


def test_autocast_context_follows_the_resolution(native):
    with autocast("cpu"):
        assert torch.is_autocast_enabled("cpu") == native
    with autocast("cpu", "no"):
        assert not torch.is_autocast_enabled("cpu")


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="AVX2 and oneDNN's ISA cap are x86's")
def test_the_avx2_emulation_turns_native_bf16_off():
    """``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2`` (docs/reliability.md) makes any x86 CPU look like an
    AVX2-only one: torch dispatches AVX2 kernels and oneDNN reports no native bf16, so ``auto`` picks float32."""
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    code = (
        "import torch; from flowrl.precision import native_bf16, resolve_precision; "
        "print(torch.backends.cpu.get_cpu_capability(), native_bf16('cpu'), resolve_precision('auto', 'cpu', 'k'))"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["AVX2", "False", "no"]


INTEL_AVX512 = "vendor_id\t: GenuineIntel\nflags\t\t: fpu sse2 avx avx2 fma avx512f avx512bw amx_tile\n"
INTEL_AVX2 = "vendor_id\t: GenuineIntel\nflags\t\t: fpu sse2 avx avx2 fma\n"
AMD_AVX2 = "vendor_id\t: AuthenticAMD\nflags\t\t: fpu sse2 avx avx2 fma\n"


@pytest.mark.parametrize(
    ("text", "environ", "expected"),
    [
        (INTEL_AVX2, {}, "AVX2,STRICT"),  # an Intel CPU without AVX-512: MKL's AVX2 code
        (INTEL_AVX512, {"MKL_ENABLE_INSTRUCTIONS": "AVX2"}, "AVX2,STRICT"),  # the emulation on an Intel Xeon
        (INTEL_AVX512, {}, None),  # MKL's AVX-512 code: batch-invariant as it is
        (AMD_AVX2, {}, None),  # MKL's code on AMD: batch-invariant as it is
        (AMD_AVX2, {"MKL_ENABLE_INSTRUCTIONS": "AVX2"}, None),
        (INTEL_AVX2, {"MKL_CBWR": "COMPATIBLE"}, "COMPATIBLE"),  # the user's choice is kept
        ("", {}, None),  # no /proc/cpuinfo (macOS, Windows)
    ],
)
def test_mkl_is_strict_exactly_where_it_runs_avx2_code_on_intel(text, environ, expected):
    """:func:`flowrl.cpu.strict_mkl_on_intel_avx2` sets ``MKL_CBWR=AVX2,STRICT`` on Intel CPUs running MKL's AVX2
    code (there its matrix products depend on the row count) and nowhere else, never over a value already set."""
    from flowrl.cpu import strict_mkl_on_intel_avx2, vendor

    env = dict(environ)
    assert strict_mkl_on_intel_avx2(env, text) == (expected == "AVX2,STRICT" and "MKL_CBWR" not in environ)
    assert env.get("MKL_CBWR") == expected
    assert vendor(text) == {INTEL_AVX2: "intel", INTEL_AVX512: "intel", AMD_AVX2: "amd", "": "unknown"}[text]


def test_a_linear_layer_is_batch_invariant_on_this_cpu_and_under_the_avx2_emulation():
    """With flowrl imported (:mod:`flowrl.cpu`), a linear layer's output for the first rows of a batch has the same bits
    as in the whole batch at every row count from 16 on, natively and under the AVX2 emulation (on an Intel Xeon the
    emulation's MKL AVX2 code differed at 3 of 39 row counts without strict mode)."""
    code = (
        "import flowrl, torch; torch.set_num_threads(1); torch.manual_seed(0); lin = torch.nn.Linear(32, 128); "
        "x = torch.randn(640, 32); full = lin(x).detach(); "
        "print(sum(not torch.equal(lin(x[:n]).detach(), full[:n]) for n in range(16, 640, 16)))"
    )
    emulated = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
    for extra in ({}, emulated):
        env = {k: v for k, v in os.environ.items() if k != "MKL_CBWR"} | extra
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True, check=True
        )
        assert out.stdout.split() == ["0"], extra


def _trainer(tmp_path, random_pipeline, prompt_files, **extra):
    from flowrl.trainer import Trainer

    (tmp_path / "c.yaml").write_text("rewards:\n  jpeg_compressibility:\n    weight: 1.0\n")
    train, test = prompt_files
    auto = {"run.mixed_precision": "auto", "sampling.decode_precision": "auto", "sampling.ode_precision": "auto"}
    return Trainer(
        load_config(
            tmp_path / "c.yaml",
            tiny_overrides(random_pipeline, train, test, tmp_path / "run", **{**auto, "run.iterations": 1, **extra}),
        )
    )


def test_the_run_records_and_prints_its_resolved_precision(native, tmp_path, random_pipeline, prompt_files, capsys):
    trainer = _trainer(tmp_path, random_pipeline, prompt_files, **{"sampling.ode_precision": "no"})
    chosen = "bf16" if native else "no"
    cfg = trainer.cfg
    assert (cfg.run.mixed_precision, cfg.sampling.decode_precision, cfg.sampling.ode_precision) == (
        chosen,
        chosen,
        "no",
    )
    assert trainer.policy.precision == chosen
    trainer.train()
    line = [x for x in capsys.readouterr().err.splitlines() if x.startswith("flowrl train: precision")]
    label = "bf16 autocast" if native else "float32"
    assert len(line) == 1 and f"{label} (run.mixed_precision, sampling.decode_precision" in line[0], line
    assert ("(native bf16)" if native else "(no native bf16)") in line[0]
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert saved["run"]["mixed_precision"] == saved["sampling"]["decode_precision"] == chosen  # reloadable as run
    assert saved["sampling"]["ode_precision"] == "no"
    result = json.loads((tmp_path / "run" / "eval.json").read_text())
    assert result["after"]["bf16"] is native and "CPU" in result["after"]["machine"]


@pytest.mark.parametrize("mixed", ["no", "bf16"])
def test_float32_and_bf16_runs_both_train(mixed, tmp_path, random_pipeline, prompt_files):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # bf16 on a CPU without it natively: emulated, warned about, still correct
        trainer = _trainer(tmp_path, random_pipeline, prompt_files, **{"run.mixed_precision": mixed})
    before = {n: p.detach().clone() for n, p in trainer.policy.params.items()}
    trainer.train()
    after = load_file(tmp_path / "run/checkpoints/checkpoint-000001/trainable.safetensors")
    assert trainer.cfg.run.mixed_precision == mixed
    assert any(not torch.equal(before[n], after[n]) for n in before)  # the LoRA moved
    assert all(torch.isfinite(v).all() for v in after.values())


def test_cli_bf16_flag_defaults_to_auto(native, tmp_path, random_pipeline, prompt_files):
    from flowrl.cli import main

    out = tmp_path / "eval.json"
    base = [
        "eval",
        "--model",
        str(random_pipeline),
        "--prompts",
        str(prompt_files[1]),
        "--images-per-tag",
        "1",
        "--num-steps",
        "2",
        "--device",
        "cpu",
    ]
    main([*base, "--out", str(out)])
    assert json.loads(out.read_text())["bf16"] is native
    main([*base, "--no-bf16", "--out", str(out)])
    assert json.loads(out.read_text())["bf16"] is False


def test_bf16_autocast_silences_the_fused_norm_fallback_notice_only():
    """A bf16 autocast forward through an RMSNorm with a float32 weight (Wan's norms): torch's fallback notice is
    filtered inside flowrl's autocast (the same norm, unfused), and other warnings still pass (on a CPU without native
    bf16 flowrl's own slow-bf16 warning among them)."""
    import re
    import warnings

    from flowrl.precision import FUSED_NORM_NOTICE, autocast

    norm, x = torch.nn.RMSNorm(8, eps=1e-6), torch.randn(2, 8)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with autocast("cpu", "bf16"):
            out = norm(x.bfloat16())
            warnings.warn("another notice")
    assert out.shape == (2, 8)
    messages = [str(w.message) for w in seen]
    assert "another notice" in messages and not any(re.match(FUSED_NORM_NOTICE, m) for m in messages)
    assert all(m == "another notice" or m.startswith("precision=bf16 on this CPU (no native bf16)") for m in messages)
