"""The CPU this process runs on (vendor, instruction-set flags; stdlib only) and MKL's reproducible mode where its
matrix products would otherwise depend on the batch size (:func:`strict_mkl_on_intel_avx2`, applied when flowrl is
imported)."""

from __future__ import annotations

import functools
import os
from pathlib import Path

VENDORS = {"GenuineIntel": "intel", "AuthenticAMD": "amd"}
"""``/proc/cpuinfo``'s ``vendor_id`` -> the short name :func:`vendor` returns."""


@functools.cache
def _cpuinfo() -> str:
    """``/proc/cpuinfo``'s text, or ``""`` where there is none (macOS, Windows)."""
    try:
        return Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return ""


def _field(text: str, key: str) -> str:
    """The first value of `key` in cpuinfo-style `text` (``key : value`` lines), or ``""``."""
    for line in text.splitlines():
        name, _, value = (part.strip() for part in line.partition(":"))
        if name == key:
            return value
    return ""


def vendor(text: str | None = None) -> str:
    """The CPU's vendor: ``intel`` (GenuineIntel), ``amd`` (AuthenticAMD), another ``vendor_id`` in lower case, or
    ``unknown`` where there is none (macOS, Windows).

    Args:
        text (`str`, optional): cpuinfo-style text; this machine's ``/proc/cpuinfo`` by default.
    """
    value = _field(_cpuinfo() if text is None else text, "vendor_id")
    return VENDORS.get(value, value.lower() or "unknown")


def model_name(text: str | None = None) -> str:
    """The CPU's model name (``Intel(R) Xeon(R) Processor``, ``AMD EPYC ...``), or ``""`` where unknown.

    Args:
        text (`str`, optional): cpuinfo-style text; this machine's ``/proc/cpuinfo`` by default.
    """
    return _field(_cpuinfo() if text is None else text, "model name")


def flags(text: str | None = None) -> set[str]:
    """The CPU's instruction-set flags (``avx2``, ``avx512f``, ``amx_tile``, ...); empty where unknown.

    Args:
        text (`str`, optional): cpuinfo-style text; this machine's ``/proc/cpuinfo`` by default.
    """
    return set(_field(_cpuinfo() if text is None else text, "flags").split())


def strict_mkl_on_intel_avx2(environ: dict | None = None, text: str | None = None) -> bool:
    """Set ``MKL_CBWR=AVX2,STRICT`` (MKL's conditional numerical reproducibility, strict mode) where MKL runs its AVX2
    code on an Intel CPU: one without AVX-512, or one limited by ``MKL_ENABLE_INSTRUCTIONS=AVX2`` (the emulation of an
    AVX2-only CPU, docs/reliability.md). There MKL's float32 matrix product of a row depends on how many rows share
    the call (measured on an Intel Xeon: a linear layer's output for 16 of 640 rows differed in the last bits from the
    same rows within all 640, and SD3's token-wise layers with them), so the log-probs recomputed for training would
    not equal the rollout's and the PPO ratio before the first step would not be exactly 1; in strict mode they are
    equal at any row count, at the same speed (a 1024 x 1024 product: 21 ms either way, one thread). MKL's AVX-512
    code on an Intel Xeon and its code on AMD CPUs need nothing. A ``MKL_CBWR`` already set is kept. MKL reads the
    variable at its first call, so this runs when flowrl is imported, before any matrix product of flowrl's.

    Args:
        environ (`dict`, optional): the environment to read and change; ``os.environ`` by default.
        text (`str`, optional): cpuinfo-style text; this machine's ``/proc/cpuinfo`` by default.

    Returns:
        `bool`: whether ``MKL_CBWR`` was set.
    """
    env = os.environ if environ is None else environ
    if "MKL_CBWR" in env or vendor(text) != "intel":  # checked first: no more of /proc/cpuinfo read at import
        return False
    cpu_flags = flags(text)
    avx2_code = "avx512f" not in cpu_flags or env.get("MKL_ENABLE_INSTRUCTIONS", "").upper() == "AVX2"
    if "avx2" not in cpu_flags or not avx2_code:
        return False
    env["MKL_CBWR"] = "AVX2,STRICT"
    return True
