"""Precision that fits the device: ``auto`` is bf16 autocast where the device computes bf16 natively, float32 elsewhere.

Every precision setting of flowrl (``run.mixed_precision``, ``sampling.decode_precision``, ``sampling.ode_precision``,
the ``--bf16 / --no-bf16`` flags of ``flowrl eval``, ``sample`` and ``generate``) takes ``auto`` (the default),
``bf16`` or ``no`` (float32). ``auto`` is resolved once per run against the device:

- a CUDA device: bf16 where ``torch.cuda.is_bf16_supported(including_emulation=False)`` (Ampere and newer);
- a CPU: bf16 where oneDNN reports native bf16 (``torch.ops.mkldnn._is_mkldnn_bf16_supported()``: AVX-512 BF16,
  AMX or Arm BF16). On a CPU without it (an AVX2-only AMD EPYC Zen 3, say) bf16 autocast is emulated: a matrix
  product ran about 160x slower than in float32 and the quick-start job 8x slower per iteration;
- any other device: float32.

An explicit ``bf16`` on a device without native bf16 runs, with one warning. Log-probs and PPO ratios are computed
in float32 under every setting (``samplers.kernels``); bf16 only touches the network's forward passes.

To see an AVX2-only CPU's behaviour on a CPU with native bf16, start the process with
``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2``: torch then dispatches its AVX2 kernels and oneDNN reports no
bf16 (``auto`` resolves to float32, and bf16 autocast is emulated, as on the slow machine).
"""

from __future__ import annotations

import contextlib
import warnings

import torch

PRECISIONS = ("auto", "bf16", "no")
"""The values of every precision setting: ``auto`` (by the device), ``bf16`` (autocast) or ``no`` (float32)."""


def native_bf16(device: torch.device | str) -> bool:
    """Whether `device` computes bf16 matrix products natively (not emulated).

    Args:
        device: a torch device or its name (``"cpu"``, ``"cuda"``, ``"cuda:1"``).

    Returns:
        `bool`: CUDA: ``torch.cuda.is_bf16_supported(including_emulation=False)``; CPU: oneDNN's
        ``torch.ops.mkldnn._is_mkldnn_bf16_supported()`` (False where torch has no oneDNN); other devices: False.
    """
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported(including_emulation=False)
    if device.type == "cpu":
        try:
            return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
        except (AttributeError, RuntimeError):  # a build without oneDNN
            return False
    return False


def describe_device(device: torch.device | str) -> str:
    """A few words on `device`'s bf16, for messages: ``"this CPU (native bf16)"``, ``"this CPU (no native bf16)"``,
    ``"cuda:0 (native bf16)"``."""
    device = torch.device(device)
    name = "this CPU" if device.type == "cpu" else str(device)
    return f"{name} ({'native' if native_bf16(device) else 'no native'} bf16)"


def resolve_precision(value: str | bool | None, device: torch.device | str, key: str) -> str:
    """The precision a setting means on `device`: ``"bf16"`` or ``"no"``.

    Args:
        value: ``"auto"`` (or None), ``"bf16"`` (or True), ``"no"`` (or False).
        device: where the model runs.
        key: the setting's name for the warning and the error (``"run.mixed_precision"``, ``"--bf16"``).

    Returns:
        ``"bf16"`` for ``auto`` on a device with native bf16 and for an explicit ``bf16``; ``"no"`` otherwise.

    Raises:
        ValueError: naming `key`, for a value outside :data:`PRECISIONS`.

    Warns:
        UserWarning: an explicit ``bf16`` on a device without native bf16 (emulated, slow).
    """
    value = {None: "auto", True: "bf16", False: "no"}.get(value, value)
    if value not in PRECISIONS:
        raise ValueError(f"{key} must be one of {'|'.join(PRECISIONS)}, got {value!r}")
    native = native_bf16(device)
    if value == "auto":
        return "bf16" if native else "no"
    if value == "bf16" and not native:
        warnings.warn(
            f"{key}=bf16 on {describe_device(device)}: bf16 is emulated here and runs many times slower than "
            f"float32 (set {key} to auto or no for float32)",
            UserWarning,
            stacklevel=2,
        )
    return value


def autocast(device: torch.device | str, precision: str | bool | None = "auto", key: str = "precision"):
    """A context that runs its forwards in `precision` on `device`: bf16 autocast for a precision that resolves to
    ``bf16`` (:func:`resolve_precision`), else nothing (float32, or the surrounding mode).

    Example::

        with flowrl.precision.autocast(model.device):  # bf16 where native, float32 elsewhere
            result = evaluate(model, metas)
    """
    device = torch.device(device)
    if resolve_precision(precision, device, key) == "no":
        return contextlib.nullcontext()
    return bf16_autocast(device.type)


FUSED_NORM_NOTICE = "Mismatch dtype between input and weight"
"""How torch's notice starts when a fused RMSNorm falls back to the unfused one for a bf16 input (autocast's output)
and a float32 weight (Wan's, LTX's and others' norms): the same norm, computed unfused; :func:`bf16_autocast` filters
it."""


@contextlib.contextmanager
def bf16_autocast(device_type: str):
    """``torch.autocast(device_type, dtype=torch.bfloat16)``, with torch's fused-RMSNorm fallback notice
    (:data:`FUSED_NORM_NOTICE`) filtered inside it: under autocast a float32 norm weight meets a bf16 input by design."""
    import warnings

    with warnings.catch_warnings(), torch.autocast(device_type, dtype=torch.bfloat16):
        warnings.filterwarnings("ignore", message=FUSED_NORM_NOTICE)
        yield
