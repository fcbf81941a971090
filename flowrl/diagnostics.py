"""What a run reports about itself beside its rewards: the rollouts' diversity, peak memory, the reward per prompt tag
and the precisions it computes in. Each is a small function the loop (:class:`flowrl.trainer.Trainer`) calls; those
that gather over processes are called by every process.
"""

from __future__ import annotations

import dataclasses
import sys
import time

import torch

from .config import REPO_ROOT, Config, config_key, resolve_path
from .diversity import DiversityProbe
from .precision import describe_device, resolve_precision

__all__ = [
    "diversity_metrics",
    "diversity_probe",
    "peak_memory",
    "precision_summary",
    "resolve_precisions",
    "tag_means",
]


def tag_means(rewards: torch.Tensor, tags: list[str]) -> dict[str, float]:
    """Mean reward per prompt tag, ``{"reward/tag/<tag>/mean": float}`` (an iteration's mean depends on which tags it
    drew, so the per-tag means are what shows learning). rewards: float ``(B,)``; tags: ``B`` names.

    Raises:
        ValueError: if ``len(tags) != B``.
    """
    if len(tags) != rewards.shape[0]:
        raise ValueError(f"{len(tags)} tags for {rewards.shape[0]} rewards")
    rewards = rewards.float().cpu()
    return {
        f"reward/tag/{tag}/mean": rewards[torch.tensor([t == tag for t in tags])].mean().item()
        for tag in sorted(set(tags))
    }


def peak_memory(accelerator) -> dict[str, float]:
    """The iteration's peak memory, the maximum over the processes (a gather: every process calls it).

    ``memory/gpu_peak_gib``: the most GPU memory tensors took since the last call (CUDA only, from
    ``torch.cuda.max_memory_allocated``, whose peak this resets); ``memory/host_peak_gib``: the most resident host
    memory of the process since it started (``ru_maxrss``; absent where the ``resource`` module is missing).

    Args:
        accelerator (`accelerate.Accelerator`): the run's processes (its ``device``, ``num_processes``, ``gather``).

    Returns:
        `dict[str, float]`: GiB by metric name; empty where neither is measured.
    """
    names, values, device = [], [], accelerator.device
    try:
        import resource

        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
        names.append("memory/host_peak_gib")
        values.append(rss / 2**30 if sys.platform == "darwin" else rss / 2**20)
    except ImportError:  # Windows
        pass
    if device.type == "cuda":
        names.append("memory/gpu_peak_gib")
        values.append(torch.cuda.max_memory_allocated(device) / 2**30)
        torch.cuda.reset_peak_memory_stats(device)
    if not names:
        return {}
    peak = torch.tensor(values, dtype=torch.float64, device=device)  # (metrics,)
    if accelerator.num_processes > 1:
        peak = accelerator.gather(peak[None]).amax(0)  # (processes, metrics) -> (metrics,)
    return dict(zip(names, peak.tolist()))


def resolve_precisions(cfg: Config, device: torch.device) -> Config:
    """A copy of `cfg` whose precision settings (``run.mixed_precision``, ``sampling.decode_precision``,
    ``sampling.ode_precision``) are ``bf16`` or ``no`` on `device` (:func:`flowrl.precision.resolve_precision`:
    ``auto`` is bf16 where `device` computes it natively; an explicit bf16 where it does not is kept, with a warning).
    `cfg` itself is not changed."""
    run = dataclasses.replace(
        cfg.run, mixed_precision=resolve_precision(cfg.run.mixed_precision, device, "run.mixed_precision")
    )
    s = cfg.sampling
    sampling = dataclasses.replace(
        s,
        decode_precision=resolve_precision(s.decode_precision, device, "sampling.decode_precision"),
        ode_precision=resolve_precision(s.ode_precision, device, "sampling.ode_precision"),
    )
    return dataclasses.replace(cfg, run=run, sampling=sampling)


def precision_summary(cfg: Config, device: torch.device) -> str:
    """One line on the run's resolved precisions and why, e.g. ``"precision float32 (run.mixed_precision, decode and
    ODE steps) on this CPU (no native bf16)"``.

    Args:
        cfg (:class:`flowrl.config.Config`): a config whose ``run.mixed_precision``, ``sampling.decode_precision`` and
            ``sampling.ode_precision`` are resolved (``bf16`` or ``no``: :func:`flowrl.trainer.resolve_precisions`).
        device (`torch.device`): the run's device.

    Raises:
        KeyError: a precision that is not resolved (``auto``).
    """
    names = {
        "run.mixed_precision": cfg.run.mixed_precision,
        "sampling.decode_precision": cfg.sampling.decode_precision,
        "sampling.ode_precision": cfg.sampling.ode_precision,
    }
    label = {"bf16": "bf16 autocast", "no": "float32"}
    groups = {v: [k for k, x in names.items() if x == v] for v in dict.fromkeys(names.values())}
    parts = [f"{label[v]} ({', '.join(keys)})" for v, keys in groups.items()]
    return f"precision {'; '.join(parts)} on {describe_device(device)}, log-probs float32"


def diversity_probe(name: str | None, device: torch.device) -> DiversityProbe | None:
    """The CLIP of config key ``run.diversity_model`` (:class:`flowrl.diversity.DiversityProbe`), or None: for
    ``''`` / None, or for ``auto`` where the shipped ``assets/tiny-clip`` is absent (an installed package).

    Raises:
        ConfigError: naming ``run.diversity_model``, for a folder that is not a CLIP model.
    """
    name = name or ""
    if name == "auto":
        shipped = REPO_ROOT / "assets" / "tiny-clip"
        name = str(shipped) if (shipped / "config.json").is_file() else ""
    if not name:
        return None
    with config_key("run.diversity_model", (ValueError, FileNotFoundError, OSError)):
        return DiversityProbe(str(resolve_path(name)), device)


def diversity_metrics(probe, images: torch.Tensor, image_prompt: torch.Tensor, accelerator) -> dict[str, float]:
    """The rollout's within-group diversity, over every process's groups (a gather: every process calls it).

    Args:
        probe: a :class:`flowrl.diversity.DiversityProbe` (``probe(images, group) -> (n,)`` per-group diversity), or
            None.
        images (`torch.Tensor` of shape `(B, 3, H, W)` or `(B, F, 3, H, W)`, in [0, 1]): this process's rollout.
        image_prompt (`torch.Tensor` of shape `(B,)`, long): each image's group.
        accelerator (`accelerate.Accelerator`): the run's processes.

    Returns:
        `dict[str, float]`: ``diversity/clip`` (the mean over the groups of their mean pairwise CLIP cosine distance,
        in [0, 2]), ``diversity/clip_min`` (the least diverse group) and ``time/diversity_s``; empty without a probe,
        images or groups.
    """
    if probe is None or len(images) == 0:
        return {}
    t0 = time.time()
    per_group = probe(images, image_prompt).float()  # (n,) this process's groups
    local = torch.tensor(
        [per_group.sum().item(), float(len(per_group)), per_group.min().item() if len(per_group) else 2.0]
    )  # (3,): sum, count, min
    if accelerator.num_processes > 1:
        local = accelerator.gather(local.to(accelerator.device)).cpu().view(-1, 3)  # (processes, 3)
    else:
        local = local.view(1, 3)
    count = local[:, 1].sum().item()
    if not count:
        return {}
    return {
        "diversity/clip": local[:, 0].sum().item() / count,
        "diversity/clip_min": local[:, 2].min().item(),
        "time/diversity_s": time.time() - t0,
    }
