"""Batch invariance: a sample's output with the same bits at any batch size (:func:`make_batch_invariant`), so that the
log-probs recomputed for training equal the rollout's and the PPO ratio is exactly 1 before the first optimizer step."""

from __future__ import annotations

from collections.abc import Callable

import torch

MIN_ROWS = {torch.nn.Linear: (2, 16), torch.nn.Conv2d: (4, 4)}
"""For each layer type: the input rank that carries one row per sample, and the fewest rows it runs at."""

MIN_ROWS_ONE_THREAD = {torch.nn.Linear: 16, torch.nn.Conv2d: 32}
"""The fewest rows on a CPU where torch runs one thread (``torch.get_num_threads() == 1``): there oneDNN picks other
convolution kernels for small batches (a sample's velocity in a batch of 4-15 differed in the last bit from its
velocity in a larger batch for an SD 1.5 UNet, and below 32 images for SANA's convolutions; with two threads they
agree from 4 images on)."""


def make_batch_invariant(module: torch.nn.Module, probe: Callable[[], object] | None) -> int:
    """Make the per-sample layers of `module` give each sample the same bits at any batch size.

    Matrix-product libraries pick a different kernel, with a different summation order, for a product
    of only a few rows: on an AVX-512 CPU, MKL's results for a linear layer on up to 5-10 rows, and
    oneDNN's for a convolution of a single image, differ in the last bits from those of larger batches.
    In an SD3 transformer that hits the conditioning path (timestep and pooled-text embedders and the
    AdaLayerNorm modulation run linear layers on `(N, features)`, one row per sample) and the patch
    embedding (a `Conv2d` on `(N, C, H, W)`). A sample's velocity would then depend on how many samples
    share its forward call, the log-probs recomputed for training (minibatches of any composition)
    would differ from the rollout's (a tree node evaluated with few rows), and the PPO ratio before the
    first optimizer step would not be exactly 1. Zero-padding such inputs up to the row counts of
    :data:`MIN_ROWS` (16 rows for a 2-D linear input, 4 images for a convolution) and dropping the
    padded outputs keeps every call on the large-batch kernel. Only the layers that `probe` shows
    receiving per-sample inputs are padded; the token-wise layers, whose inputs
    `(N, tokens, features)` are large already, get no hook. This is measured, not guaranteed: another
    BLAS or a GPU may switch kernels elsewhere.

    Args:
        module (`torch.nn.Module`): e.g. an `SD3Transformer2DModel`, with or without peft LoRA layers.
        probe (callable or None): runs one forward of `module` (any batch size); it is called once, under
            `torch.no_grad()`, to see which `torch.nn.Linear` and `torch.nn.Conv2d` layers receive
            inputs of the per-sample rank (2-D for a linear layer, 4-D for a convolution). None hooks every such
            layer (an input of another rank passes through untouched): for modules whose forward is not one call,
            such as the text encoders behind a family's ``encode``.

    Returns:
        `int`: the number of layers newly padded (a layer already padded is skipped, so calling it again
        after adding an adapter pads only the adapter's per-sample layers).
    """
    rules = {
        m: rule
        for m in module.modules()
        if not hasattr(m, "_flowrl_min_rows")
        for kind, rule in MIN_ROWS.items()
        if isinstance(m, kind)
    }  # layer -> (rank, min rows)
    seen: set[torch.nn.Module] = set()

    def record(layer, args):
        if args and torch.is_tensor(args[0]) and args[0].ndim == rules[layer][0]:
            seen.add(layer)

    if probe is None:
        seen.update(rules)
    handles = [m.register_forward_pre_hook(record) for m in rules] if probe is not None else []
    try:
        if probe is not None:
            with torch.no_grad():
                probe()
    finally:
        for handle in handles:
            handle.remove()
    for layer in seen:
        layer._flowrl_ndim, layer._flowrl_min_rows = rules[layer]
        layer._flowrl_min_rows_one_thread = next(
            n for kind, n in MIN_ROWS_ONE_THREAD.items() if isinstance(layer, kind)
        )
        layer._flowrl_rows = None
        layer.register_forward_pre_hook(_pad_rows)
        layer.register_forward_hook(_unpad_rows)
    return len(seen)


def _pad_rows(layer: torch.nn.Module, args: tuple):
    """Forward pre-hook: zero-pad a per-sample input of fewer than ``layer._flowrl_min_rows`` rows (on a CPU with one
    torch thread, ``layer._flowrl_min_rows_one_thread``: :data:`MIN_ROWS_ONE_THREAD`)."""
    x = args[0]
    least = layer._flowrl_min_rows
    if x.device.type == "cpu" and torch.get_num_threads() == 1:
        least = max(least, layer._flowrl_min_rows_one_thread)
    if x.ndim != layer._flowrl_ndim or x.shape[0] >= least:
        layer._flowrl_rows = None
        return None
    layer._flowrl_rows = x.shape[0]
    pad = x.new_zeros(least - x.shape[0], *x.shape[1:])
    # in the input's memory format: oneDNN runs a channels-last image batch (SANA's convolutions get their tokens
    # permuted into one) with other kernels than a contiguous one, so a padded batch must keep the unpadded one's
    channels_last = x.ndim == 4 and not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last)
    return (
        torch.cat([x, pad]).contiguous(
            memory_format=torch.channels_last if channels_last else torch.contiguous_format
        ),
    ) + args[1:]


def _unpad_rows(layer: torch.nn.Module, args: tuple, output: torch.Tensor):
    """Forward hook: drop the rows :func:`_pad_rows` added."""
    rows, layer._flowrl_rows = layer._flowrl_rows, None
    return output if rows is None else output[:rows]
