"""GRPO-Guard's per-step diagnostics (arXiv 2510.22319), an optional hook of the PPO update.

During an iteration's first PPO epoch the hook collects, per denoising step, the importance ratios and the
norm of the loss gradient (``train.step_grad_norms``: with respect to the predicted velocity, free; or to
the trained parameters, one extra backward per step on the first micro-batch). :meth:`StepDiagnostics.metrics`
summarises them as ``diag/step_KK/*``.
"""

from __future__ import annotations

from collections import defaultdict

import torch


def step_diagnostics(
    ratios: dict[int, list[torch.Tensor]], grad_norms: dict[int, list[torch.Tensor]], clip_range: float
) -> dict[str, float]:
    """Summaries of an iteration's first PPO epoch, per denoising step.

    Args:
        ratios: denoising step -> the ratios `(n,)` float of its transitions (in pieces, concatenated here).
        grad_norms: denoising step -> gradient norms `(n,)` float (``train.step_grad_norms``); may be empty.
        clip_range: the PPO clip range eps.

    Returns:
        ``diag/step_KK/{ratio_mean, ratio_std, clip_high, clip_low}`` (fractions of ratios above ``1 + eps``
        and below ``1 - eps``) per step present, and ``diag/step_KK/grad_norm`` (mean) per step in `grad_norms`.
    """
    out = {}
    for k, parts in sorted(ratios.items()):
        r = torch.cat(parts)
        out[f"diag/step_{k:02d}/ratio_mean"] = r.mean().item()
        out[f"diag/step_{k:02d}/ratio_std"] = r.std(unbiased=False).item()
        out[f"diag/step_{k:02d}/clip_high"] = (r > 1 + clip_range).float().mean().item()
        out[f"diag/step_{k:02d}/clip_low"] = (r < 1 - clip_range).float().mean().item()
    for k, parts in sorted(grad_norms.items()):
        out[f"diag/step_{k:02d}/grad_norm"] = torch.cat(parts).mean().item()
    return out


class StepDiagnostics:
    """Collects one iteration's per-step ratios and gradient norms (see the module docstring).

    Args:
        grad_norms (`str`): ``train.step_grad_norms``: ``none``, ``velocity`` or ``params``.
        clip_range (`float`): the PPO clip range (for the clip fractions).
    """

    def __init__(self, grad_norms: str, clip_range: float):
        self.mode, self.clip_range = grad_norms, clip_range
        self.ratios: dict[int, list[torch.Tensor]] = defaultdict(list)
        self.grad_norms: dict[int, list[torch.Tensor]] = defaultdict(list)

    def track_velocity(self, v: torch.Tensor, sub, scale: float) -> None:
        """With ``velocity`` norms: once the backward reaches the predicted velocity `v` `(m, ...)` of the `m`
        transitions `sub`, record the norm of d loss / d v per transition (undoing the ``1/m`` of the mean and the
        micro-batch's backward weight `scale`), per step."""
        if self.mode != "velocity" or not v.requires_grad:
            return

        def record(grad: torch.Tensor) -> None:
            norms = grad.float().flatten(1).norm(dim=1).cpu() * len(sub) / scale  # (m,)
            for k in sub.step.unique().tolist():
                self.grad_norms[k].append(norms[(sub.step == k).cpu()])

        v.register_hook(record)

    def record(self, sub, log_prob: torch.Tensor, first: bool, param_norms) -> None:
        """Record the ratios ``exp(log_prob - sub.log_prob)`` per step of the `m` transitions `sub`; on the
        iteration's `first` micro-batch with ``params``, the per-step parameter-gradient norms that
        ``param_norms()`` (a callable returning ``{step: [norm (1,)]}``) computes."""
        ratio = torch.exp(log_prob.detach() - sub.log_prob)
        for k in sub.step.unique().tolist():
            self.ratios[k].append(ratio[sub.step == k].cpu())
        if self.mode == "params" and first:
            self.grad_norms.update(param_norms())

    def metrics(self) -> dict[str, float]:
        """:func:`step_diagnostics` of what was recorded."""
        return step_diagnostics(self.ratios, self.grad_norms, self.clip_range)
