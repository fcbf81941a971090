"""Watching for collapse and reward hacking while training: within-group diversity of the rollout images, and rules
that stop a run cleanly when a metric stays past a bound (``run.stop_if``).

- :func:`group_diversity`: the mean pairwise cosine distance of the image embeddings within each group (0: the group's
  images are one image to the embedder; DiffusionNFT and GRPO runs that hack a reward drift towards 0 well before the
  gold metric falls, as the group stops exploring).
- :class:`DiversityProbe`: CLIP image embeddings of a rollout's images (``run.diversity_model``: the shipped tiny CLIP
  by default, any transformers CLIP folder by option), logged each iteration as ``diversity/clip`` (mean over groups)
  and ``diversity/clip_min`` (the least diverse group).
- :class:`StopRules`: ``run.stop_if`` rules such as ``"diversity/clip < 0.05 for 3"``: after the iteration on which a
  rule has held for its count of consecutive iterations, the run checkpoints, evaluates and ends, saying why.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

_RULE = re.compile(r"^\s*([\w/.\-]+)\s*(<=|>=|<|>)\s*([-+0-9.eE]+)\s*(?:for\s+(\d+))?\s*$")


@dataclass(frozen=True)
class StopRule:
    """``metric op value for count`` (module docstring)."""

    metric: str
    op: str
    value: float
    count: int

    def holds(self, x: float) -> bool:
        """Whether `x` is past the bound."""
        return {"<": x < self.value, "<=": x <= self.value, ">": x > self.value, ">=": x >= self.value}[self.op]

    def __str__(self) -> str:
        return f"{self.metric} {self.op} {self.value:g} for {self.count}"


def parse_stop_rule(text: str) -> StopRule:
    """A rule from ``"METRIC OP VALUE [for N]"`` (OP one of ``< <= > >=``; N consecutive iterations, default 1).

    Raises:
        ValueError: for text of another form, naming it.
    """
    m = _RULE.match(str(text))
    if m is None:
        raise ValueError(f"stop rule {text!r} is not 'METRIC OP VALUE [for N]', e.g. 'diversity/clip < 0.05 for 3'")
    try:
        value = float(m.group(3))
    except ValueError:
        raise ValueError(f"stop rule {text!r}: {m.group(3)!r} is not a number") from None
    count = int(m.group(4) or 1)
    if count < 1:
        raise ValueError(f"stop rule {text!r}: the count of iterations must be >= 1")
    return StopRule(m.group(1), m.group(2), value, count)


DIVERSITY_METRICS = ("diversity/clip", "diversity/clip_min")
"""The metrics :class:`DiversityProbe` logs each iteration (``run.diversity_model``)."""


def check_stop_metrics(rules: list[str], rewards: list[str]) -> None:
    """Check the metrics of ``run.stop_if`` rules that can be known before a run starts: a ``diversity/`` metric must be
    one of :data:`DIVERSITY_METRICS`, and a ``reward/NAME/`` metric must name one of `rewards` (or ``total`` or
    ``tag``). The rest, and a diversity metric of a run without a diversity model, are compared with the first
    iteration's metrics (:meth:`StopRules.unlogged`).

    Raises:
        ValueError: naming the rule and the metrics it could have meant.
    """
    for rule in map(parse_stop_rule, rules):
        if rule.metric.startswith("diversity/") and rule.metric not in DIVERSITY_METRICS:
            raise ValueError(f"rule '{rule}': unknown metric {rule.metric!r}; known: {', '.join(DIVERSITY_METRICS)}")
        parts = rule.metric.split("/")
        if parts[0] == "reward" and len(parts) > 2 and parts[1] not in (*rewards, "total", "tag"):
            known = ", ".join(f"reward/{name}/mean" for name in (*rewards, "total"))
            raise ValueError(f"rule '{rule}': reward {parts[1]!r} is not one of the run's rewards; known: {known}")


class StopRules:
    """The run's ``run.stop_if`` rules and how long each has held.

    Args:
        rules (`list[str]`): rule texts (:func:`parse_stop_rule`).
    """

    def __init__(self, rules: list[str]):
        self.rules = [parse_stop_rule(r) for r in rules]
        self.held = [0] * len(self.rules)

    def unlogged(self, names) -> list[str]:
        """The rules whose metric is not among `names` (an iteration's metrics and the evaluation's), each as a line
        naming the rule and the metrics logged. Some metrics are absent from some iterations (``policy/*`` where every
        group had one reward, ``reward/tag/T/mean`` where no prompt of tag T was drawn), so this is a warning: what
        can be known before the run (:func:`check_stop_metrics`) is refused there."""
        names = set(names)
        return [
            f"run.stop_if rule '{rule}': {rule.metric!r} is not logged at this iteration (misspelt? it holds only where "
            f"it is logged); logged: {', '.join(sorted(names))}"
            for rule in self.rules
            if rule.metric not in names
        ]

    def update(self, metrics: dict) -> str | None:
        """Count one iteration's `metrics`; returns why the run stops (one line), or None. A metric absent from an
        iteration resets its rule."""
        why = None
        for i, rule in enumerate(self.rules):
            x = metrics.get(rule.metric)
            self.held[i] = self.held[i] + 1 if x is not None and rule.holds(float(x)) else 0
            if why is None and self.held[i] >= rule.count:
                why = f"run.stop_if '{rule}' held at iteration {metrics.get('iteration')} ({rule.metric} = {x:.4g})"
        return why


def group_diversity(embeddings: torch.Tensor, group: torch.Tensor) -> torch.Tensor:
    """Mean pairwise cosine distance ``1 - cos(e_i, e_j)`` over the pairs ``i < j`` of each group.

    Args:
        embeddings (`torch.Tensor` of shape `(B, D)`): image embeddings (any norm).
        group (`torch.Tensor` of shape `(B,)`, long): group ids.

    Returns:
        `torch.Tensor` of shape `(n,)`, float64, in [0, 2], one per group with at least two images (id order).
    """
    e = torch.nn.functional.normalize(embeddings.double(), dim=1)
    out = []
    for g in group.unique():
        rows = e[group == g]
        n = len(rows)
        if n < 2:
            continue
        cos = rows @ rows.T
        out.append((1 - cos[torch.triu_indices(n, n, 1).unbind()]).mean())
    return torch.stack(out) if out else torch.zeros(0, dtype=torch.float64)


class DiversityProbe:
    """CLIP image embeddings of rollout images and their within-group diversity.

    Args:
        model_path (`str`): a transformers CLIP folder (``run.diversity_model``).
        device: where CLIP runs.

    Raises:
        ValueError, FileNotFoundError: a folder that is not a CLIP model (from :func:`flowrl.rewards.clipscore.clipscore`).
    """

    def __init__(self, model_path: str, device="cpu"):
        from .rewards.clipscore import clipscore

        self.clip = clipscore(model_path, device=device)

    def __call__(self, images: torch.Tensor, group: torch.Tensor) -> torch.Tensor:
        """Per-group diversity `(n,)` float64 of `(B, 3, H, W)` images in [0, 1] (videos `(B, F, 3, H, W)`: their
        middle frames) grouped by `group` `(B,)`."""
        if images.ndim == 5:
            images = images[:, images.shape[1] // 2]
        with torch.no_grad():
            return group_diversity(self.clip.image_embeddings(images).cpu(), group.cpu())
