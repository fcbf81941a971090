"""Group-relative advantages (GRPO as used by Flow-GRPO, arXiv 2505.05470, and DanceGRPO, 2505.07818)."""

from __future__ import annotations

import torch


def _check_vectors(**tensors: torch.Tensor) -> None:
    """Refuse, in one line naming every argument's shape, unless all `tensors` are 1-D of one length."""
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if any(len(shape) != 1 for shape in shapes.values()) or len(set(shapes.values())) > 1:
        named = [f"{name} {shape}" for name, shape in shapes.items()]
        raise ValueError(f"{', '.join(named[:-1])} and {named[-1]} must be 1-D tensors of one length (N,)")


def group_advantages(
    rewards: torch.Tensor, group: torch.Tensor, std: str = "global", clip: float = 5.0, eps: float = 1e-4
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-prompt z-scored advantages A = (r - mean_group) / (std + eps), clipped to +-clip.

    Args:
        rewards: float ``(B,)`` scalar rewards of the B samples, finite (any float dtype; computed in float64).
        group: long ``(B,)`` group (prompt) id of each sample.
        std: ``"group"`` (std within each group) or ``"global"`` (std over the whole batch, Flow-GRPO's
            default); both use the population std.
        clip: |A| bound (Flow-GRPO's ``adv_clip_max``, 5).
        eps: added to the std.

    Returns:
        ``(advantages, zero_variance)``: float32 ``(B,)`` and bool ``(B,)``, True for samples whose
        group has all rewards equal; their advantage is exactly 0.

    Raises:
        ValueError: for an unknown ``std``, mismatched shapes, ``clip <= 0`` or a NaN/inf reward.
    """
    if std not in ("group", "global"):
        raise ValueError(f"advantage std must be 'group' or 'global', got {std!r}")
    _check_vectors(rewards=rewards, group=group)
    if not clip > 0:
        raise ValueError(f"advantage clip must be > 0, got {clip}")
    if not bool(torch.isfinite(rewards).all()):
        raise ValueError("rewards must be finite; got NaN or inf")
    centred, group_std, zero_variance = _centred_by(rewards, group)  # (B,) each
    scale = group_std if std == "group" else rewards.double().std(unbiased=False).expand_as(centred)
    advantages = (centred / (scale + eps)).clamp(-clip, clip).float()
    return torch.where(zero_variance, torch.zeros_like(advantages), advantages), zero_variance


def _centred_by(values: torch.Tensor, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`values` `(B,)` centred on the mean of their `key` `(B,)`, the key's population std, and whether the
    key's values are flat (all equal, or std below 1e-6): three `(B,)` tensors (float64, float64, bool).

    In float64: float32 sums leave a spread of ~1e-6 in a group of equal rewards near 30 (CLIP scores).
    """
    values = values.double()
    _, inverse = torch.unique(key, return_inverse=True)  # (B,) dense key index
    n = torch.bincount(inverse).double()  # (K,)
    centred = values - (torch.bincount(inverse, values) / n)[inverse]  # (B,)
    std = (torch.bincount(inverse, centred**2) / n).sqrt()  # (K,)
    return centred, std[inverse], (_tied(values, inverse) | (std < 1e-6))[inverse]


def _tied(values: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """`(G,)` bool: True for each dense group index of `inverse` `(B,)` whose `values` `(B,)` are all equal."""
    groups = int(inverse.max()) + 1 if inverse.numel() else 0
    high = values.new_full((groups,), -torch.inf).scatter_reduce(0, inverse, values, "amax")
    low = values.new_full((groups,), torch.inf).scatter_reduce(0, inverse, values, "amin")
    return high == low


def _zscore_by(values: torch.Tensor, key: torch.Tensor, eps: float = 1e-4) -> torch.Tensor:
    """z-score `(B,)` float32 of `values` (B,) within each distinct `key` (B,) (population std, in float64); 0
    where a key's values are all equal (so also for a key with one value) or their std is below 1e-6."""
    centred, std, flat = _centred_by(values, key)  # (B,) each
    return torch.where(flat, torch.zeros_like(centred), centred / (std + eps)).float()


def _key(*columns: torch.Tensor) -> torch.Tensor:
    """One long key per row from several long columns (values >= -1)."""
    key = torch.zeros_like(columns[0], dtype=torch.long)
    for col in columns:
        key = key * (int(col.max()) + 2 if col.numel() else 1) + (col.long() + 1)
    return key


def tree_node_rewards(
    incidence: torch.Tensor,
    leaf_rewards: torch.Tensor,
    fusion: str = "mean",
    parent: torch.Tensor | None = None,
    log_prob: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reward of the node each tree transition leads to, fused from the leaves below it (BranchGRPO,
    arXiv 2509.06040, Sec. 3.3 "reward fusion").

    ``"mean"``: the mean reward of the node's leaves. ``"prob"``: bottom-up, a node with children takes
    ``sum_k softmax_k(log_prob_k) R(child_k)`` over its children's edge log-probs (one child: its reward);
    a node without stored children takes its (single) leaf's reward.

    Args:
        incidence (`torch.Tensor` of shape `(M, B)`, bool): :func:`samplers.leaf_incidence`.
        leaf_rewards (`torch.Tensor` of shape `(B,)`): the leaves' rewards.
        fusion (`str`): ``"mean"`` or ``"prob"``.
        parent, log_prob (`torch.Tensor` of shape `(M,)`): the rollout's ``parent`` (node ids = rows) and
            ``log_prob``; needed for ``"prob"``.

    Returns:
        `torch.Tensor` of shape `(M,)`, float32.

    Raises:
        ValueError: for an unknown `fusion`, mismatched shapes, a transition with no leaf, or ``"prob"`` without
            `parent`/`log_prob`.
    """
    if fusion not in ("mean", "prob"):
        raise ValueError(f"tree reward fusion must be 'mean' or 'prob', got {fusion!r}")
    if incidence.dim() != 2 or leaf_rewards.shape != incidence.shape[1:]:
        raise ValueError(
            f"incidence {tuple(incidence.shape)} must be (M, B) and leaf_rewards {tuple(leaf_rewards.shape)} (B,)"
        )
    inc = incidence.float()  # (M, B)
    count = inc.sum(1)  # (M,)
    if bool((count == 0).any()):
        raise ValueError("a transition has no leaf below it; pass the incidence of a full rollout")
    mean = inc @ leaf_rewards.float() / count  # (M,)
    if fusion == "mean":
        return mean
    if parent is None or log_prob is None:
        raise ValueError("fusion='prob' needs the rollout's parent and log_prob")
    m = incidence.shape[0]
    if parent.shape != (m,) or log_prob.shape != (m,):
        raise ValueError(
            f"parent {tuple(parent.shape)} and log_prob {tuple(log_prob.shape)} must be ({m},), one per "
            "row of incidence"
        )
    has_child = torch.zeros(m, dtype=torch.bool, device=inc.device)
    has_child[parent[parent >= 0]] = True
    reward = mean.clone()  # leaves' nodes (no stored children) keep their single leaf's reward
    depth_order = torch.zeros(m, dtype=torch.long, device=inc.device)  # distance to the root
    for i in range(m):  # rows are step-major, so a parent's row precedes its children's
        if parent[i] >= 0:
            depth_order[i] = depth_order[parent[i]] + 1
    for level in range(int(depth_order.max()), 0, -1):
        children = (depth_order == level).nonzero().squeeze(1)  # (K,)
        par = parent[children]  # (K,)
        lp = log_prob[children].float()
        top = torch.full((m,), -float("inf"), device=inc.device).scatter_reduce(0, par, lp, "amax")
        w = torch.exp(lp - top[par])  # (K,)
        total = torch.zeros(m, device=inc.device).index_add_(0, par, w)
        fused = torch.zeros(m, device=inc.device).index_add_(0, par, w * reward[children])
        parents = par.unique()
        reward[parents] = fused[parents] / total[parents]
    return torch.where(has_child, reward, mean)


def depthwise_advantages(
    node_rewards: torch.Tensor, group: torch.Tensor, step: torch.Tensor, clip: float = 5.0, eps: float = 1e-8
) -> torch.Tensor:
    """BranchGRPO depth-wise advantages (arXiv 2509.06040, Sec. 3.3): z-score each node's reward among the
    nodes of the same tree at the same step; a transition takes the advantage of the node it leads to.

    ``A = (R - mean) / (std + eps)`` with the population std; 0 where a (tree, step) holds one node or
    its rewards are all equal or their std is below 1e-6 (in float64); clipped to ``+-clip``. The published
    code uses the sample std (``torch.std``), which scales a depth of ``n`` nodes by ``sqrt((n - 1) / n)``
    (+-0.71 instead of +-1 for two nodes); flowrl keeps the population std of every other z-score here.

    Args:
        node_rewards (`torch.Tensor` of shape `(M,)`): :func:`tree_node_rewards`.
        group (`torch.Tensor` of shape `(M,)`, long): tree (group) id of each transition, `>= 0`.
        step (`torch.Tensor` of shape `(M,)`, long): the transition's denoising step, `>= 0`.
        clip (`float`): |A| bound.
        eps (`float`): added to the std (the published code's 1e-8).

    Returns:
        `torch.Tensor` of shape `(M,)`, float32.

    Raises:
        ValueError: for mismatched shapes.
    """
    _check_vectors(node_rewards=node_rewards, group=group, step=step)
    return _zscore_by(node_rewards, _key(group, step), eps).clamp(-clip, clip)


def width_prune(
    incidence: torch.Tensor,
    leaf_rewards: torch.Tensor,
    leaf_group: torch.Tensor,
    step: torch.Tensor,
    last_split: int,
    keep: int,
) -> torch.Tensor:
    """BranchGRPO width pruning (arXiv 2509.06040, Sec. 3.4): after the last split, train only the chains of
    the `keep` best and `keep` worst leaves of each tree. Cuts the backward pass only.

    Args:
        incidence (`torch.Tensor` of shape `(M, B)`, bool): :func:`samplers.leaf_incidence`.
        leaf_rewards (`torch.Tensor` of shape `(B,)`), leaf_group (`torch.Tensor` of shape `(B,)`, long).
        step (`torch.Tensor` of shape `(M,)`, long): each transition's step.
        last_split (`int`): the last split step; transitions at or before it are always kept.
        keep (`int`): leaves kept at each end of a tree's ranking, `>= 1`.

    Returns:
        `torch.Tensor` of shape `(M,)`, bool: True for transitions that stay in the loss.

    Raises:
        ValueError: if ``keep < 1`` or the shapes do not match.
    """
    if keep < 1:
        raise ValueError(f"width pruning keep must be >= 1, got {keep}")
    _check_vectors(leaf_rewards=leaf_rewards, leaf_group=leaf_group)
    if step.dim() != 1 or incidence.shape != (len(step), len(leaf_rewards)):
        raise ValueError(
            f"incidence {tuple(incidence.shape)} must be (M, B) for step {tuple(step.shape)} (M,) and "
            f"leaf_rewards {tuple(leaf_rewards.shape)} (B,)"
        )
    chosen = _extremes(leaf_rewards, leaf_group, keep, keep)  # (B,)
    on_chosen = (incidence & chosen[None, :]).any(1)  # (M,)
    return (step <= last_split) | on_chosen


def process_advantages(
    rewards: torch.Tensor, group: torch.Tensor, step: torch.Tensor, granularity: torch.Tensor, clip: float = 5.0
) -> torch.Tensor:
    """Per-step process-reward advantages of single-step branches.

    TempFlow-GRPO (arXiv 2508.04324, Sec. 3.2): the reward of a branch at step ``i`` (its SDE child
    completed by ODE) is z-scored among the branches of the same step in the same `group` -- the
    prompt group, or the 'seed group' of one trunk when `group` is the trunk id. G2RPO (arXiv 2510.01982,
    Eq. 9): the z-score is taken per granularity, and a branch's advantage is the SUM over granularities
    (call with one entry per (branch, granularity) and add them up with :func:`sum_by_node`).

    Args:
        rewards (`torch.Tensor` of shape `(P,)`): the probes' rewards.
        group, step, granularity (`torch.Tensor` of shape `(P,)`, long): the normalisation key.
        clip (`float`): |A| bound.

    Returns:
        `torch.Tensor` of shape `(P,)`, float32: 0 where a (group, step, granularity) has equal rewards.

    Raises:
        ValueError: for mismatched shapes.
    """
    _check_vectors(rewards=rewards, group=group, step=step, granularity=granularity)
    return _zscore_by(rewards, _key(group, step, granularity)).clamp(-clip, clip)


def sum_by_node(values: torch.Tensor, node: torch.Tensor, num_nodes: int) -> torch.Tensor:
    """Sum per-probe values by the transition each probe belongs to (G2RPO's sum over granularities).

    Args:
        values (`torch.Tensor` of shape `(P,)`): e.g. :func:`process_advantages`.
        node (`torch.Tensor` of shape `(P,)`, long): transition row of each probe in `[0, num_nodes)`, or `-1`
            for a probe without a trained transition (skipped).
        num_nodes (`int`): the rollout's transitions `M`.

    Returns:
        `torch.Tensor` of shape `(num_nodes,)`, float32: 0 for a transition without a probe.

    Raises:
        ValueError: for mismatched shapes or a `node` outside ``[-1, num_nodes)``.
    """
    _check_vectors(values=values, node=node)
    if len(node) and not (int(node.min()) >= -1 and int(node.max()) < num_nodes):
        raise ValueError(f"node ids must lie in [-1, {num_nodes}), got [{int(node.min())}, {int(node.max())}]")
    keep = node >= 0
    return torch.zeros(num_nodes, dtype=torch.float32, device=values.device).index_add_(
        0, node[keep], values[keep].float()
    )


def turning_point_rewards(returns: torch.Tensor, balance: bool = True) -> torch.Tensor:
    """TP-GRPO step rewards (arXiv 2602.06422, Sec. 3): from ``R_0`` (pure ODE from x_T) and ``R_t`` (ODE
    completion after the first ``t`` SDE steps, ``R_n`` = the SDE sample's reward).

    ``d_t = R_t - R_{t-1}``, ``D = R_n - R_0``. Step ``t`` is a turning point if ``t > 1`` and the sign of
    ``d`` flips there to agree with ``D`` (``sign(d_{t-1}) sign(D) < 0 < sign(d_t) sign(D)``) and the step
    also agrees with what remains (``sign(d_t) sign(R_n - R_t) > 0``, the 'consistent trajectory' rule;
    always false at ``t = n``); at ``t = 1`` only the latter rule. A turning point's reward is the
    long-term effect ``R_n - R_{t-1}``; elsewhere ``d_t``. With `balance` (the paper's balanced bonus), when
    the turning points of the batch have both signs of ``D``, only as many of each sign are kept as the
    rarer sign has, those of the largest ``|D|``; the others take ``d_t``.

    Args:
        returns (`torch.Tensor` of shape `(B, n + 1)`): ``R_0 .. R_n`` per trajectory.
        balance (`bool`): balance the positive and negative turning points over the batch.

    Returns:
        `torch.Tensor` of shape `(B, n)`, float32: the reward of SDE steps ``1 .. n``.

    Raises:
        ValueError: unless `returns` is 2-D with ``n >= 1``.
    """
    if returns.dim() != 2 or returns.shape[1] < 2:
        raise ValueError(f"returns must be (B, n + 1) with n >= 1 SDE steps (R_0 .. R_n), got {tuple(returns.shape)}")
    r = returns.float()
    d = r[:, 1:] - r[:, :-1]  # (B, n)
    trend = torch.sign(r[:, -1:] - r[:, :1])  # (B, 1)
    local = torch.sign(d) * trend  # (B, n)
    remaining = torch.sign(d) * torch.sign(r[:, -1:] - r[:, 1:])  # (B, n)
    flip = torch.zeros_like(local, dtype=torch.bool)
    flip[:, 1:] = (local[:, :-1] < 0) & (local[:, 1:] > 0)
    flip[:, 0] = True
    turning = flip & (remaining > 0)
    if balance:
        turning = _balanced(turning, (r[:, -1] - r[:, 0]).unsqueeze(1).expand_as(d))
    long_term = r[:, -1:] - r[:, :-1]  # (B, n): R_n - R_{t-1}
    return torch.where(turning, long_term, d)


def _balanced(turning: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """`turning` `(B, n)` bool with, when both signs of `total` `(B, n)` (``D`` per entry) occur among its True
    entries, only the ``min(#positive, #negative)`` entries of each sign with the largest ``|D|`` kept (ties:
    the first in row-major order)."""
    flat, value = turning.flatten(), total.flatten()
    kept = torch.zeros_like(flat)
    positive, negative = (flat & (value > 0)).nonzero().squeeze(1), (flat & (value < 0)).nonzero().squeeze(1)
    if len(positive) == 0 or len(negative) == 0:
        return turning
    count = min(len(positive), len(negative))
    for idx in (positive, negative):
        kept[idx[torch.argsort(-value[idx].abs(), stable=True)[:count]]] = True
    return kept.view_as(turning)


def aggregate_advantages(
    per_reward: dict[str, torch.Tensor],
    weights: dict[str, float],
    group: torch.Tensor,
    std: str = "global",
    clip: float = 5.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """'Advantage aggregation' of several rewards (MixGRPO, arXiv 2507.21802, Sec. 4.1):
    ``A = sum_k w_k z_k`` with each reward z-scored on its own (:func:`group_advantages`), instead of
    z-scoring the weighted sum ('reward aggregation'), so a reward with a large scale cannot drown the
    others. The sum is clipped to ``+-clip``. The weights are used as given: MixGRPO's code divides them by
    their sum first, so its three rewards at weight 1 are weights 1/3 here (with 1 each, advantages 3x larger
    and more often clipped).

    Args:
        per_reward (`dict[str, torch.Tensor]`): name -> `(B,)` raw scores.
        weights (`dict[str, float]`): name -> weight.
        group (`torch.Tensor` of shape `(B,)`, long), std, clip: as in :func:`group_advantages`.

    Returns:
        ``(advantages (B,), zero_variance (B,) bool)``: zero-variance where EVERY reward is constant in the group.

    Raises:
        ValueError: if `per_reward` is empty or names a reward without a weight; as :func:`group_advantages`.
    """
    if not per_reward:
        raise ValueError("advantage aggregation needs at least one reward in per_reward")
    missing = sorted(set(per_reward) - set(weights))
    if missing:
        raise ValueError(f"advantage aggregation: no weight for reward(s) {missing}; weights has {sorted(weights)}")
    total = torch.zeros_like(group, dtype=torch.float32)
    zero = torch.ones_like(group, dtype=torch.bool)
    for name, scores in per_reward.items():
        adv, z = group_advantages(scores, group, std, clip)
        total += weights[name] * adv
        zero &= z
    return total.clamp(-clip, clip), zero


def gdpo_advantages(
    per_reward: dict[str, torch.Tensor],
    weights: dict[str, float],
    group: torch.Tensor,
    clip: float = 5.0,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GDPO's multi-reward normalisation (Flow-Factory's ``advantage_aggregation: gdpo``,
    ``flow_factory/advantage/advantage_processor.py`` ``compute_gdpo``): each reward z-scored within its group,
    ``n_k = (r_k - mean_g r_k) / max(std_g r_k, eps)``; their weighted sum ``c = sum_k w_k n_k``; then ``c``
    normalised over the whole batch, ``A = (c - mean c) / max(std c, eps)``, and clipped to ``+-clip``. A reward
    with no variance in a group contributes 0 there (its numerator is 0), so one constant reward does not silence the
    others, and the batch normalisation gives every aggregate the same scale whatever the number of rewards.

    Args:
        per_reward (`dict[str, torch.Tensor]`): name -> `(B,)` raw scores, finite.
        weights (`dict[str, float]`): name -> weight.
        group (`torch.Tensor` of shape `(B,)`, long): group ids.
        clip (`float > 0`): the advantages' bound. eps (`float > 0`): the smallest std divided by.

    Returns:
        ``(advantages (B,) float32, zero_variance (B,) bool)``: zero-variance where every reward is constant in
        the group (their advantage is the batch's offset, not a signal: they leave the loss as elsewhere).

    Raises:
        ValueError: if `per_reward` is empty, names a reward without a weight, or a tensor's shape is not `(B,)`.
    """
    if not per_reward:
        raise ValueError("gdpo aggregation needs at least one reward in per_reward")
    missing = sorted(set(per_reward) - set(weights))
    if missing:
        raise ValueError(f"gdpo aggregation: no weight for reward(s) {missing}; weights has {sorted(weights)}")
    ids = torch.unique(group, return_inverse=True)[1]  # (B,) groups numbered 0..n-1
    total = torch.zeros(len(group), dtype=torch.float64)
    zero = torch.ones(len(group), dtype=torch.bool)
    for name, scores in per_reward.items():
        r = scores.double()
        if r.shape != group.shape:
            raise ValueError(
                f"gdpo aggregation: reward {name!r} has shape {tuple(r.shape)}, groups {tuple(group.shape)}"
            )
        count = torch.zeros(int(ids.max()) + 1, dtype=torch.float64).index_add_(0, ids, torch.ones_like(r))
        mean = torch.zeros_like(count).index_add_(0, ids, r) / count  # (n,)
        var = torch.zeros_like(count).index_add_(0, ids, (r - mean[ids]) ** 2) / count  # population variance
        std = var.sqrt()
        total += weights[name] * (r - mean[ids]) / std[ids].clamp(min=eps)
        zero &= std[ids] == 0
    adv = (total - total.mean()) / total.std(unbiased=False).clamp(min=eps)
    return adv.clamp(-clip, clip).float(), zero


def best_of_n(rewards: torch.Tensor, group: torch.Tensor, keep: int) -> torch.Tensor:
    """Best-of-N selection (DanceGRPO, arXiv 2505.07818, Sec. 3.4 on video): in each group keep only the
    ``keep // 2`` highest- and ``keep - keep // 2`` lowest-reward samples for the backward pass.

    As in DanceGRPO's published code, the advantages are z-scored over all N samples before the selection and
    not again over the kept ones; the trainer ranks by the unclipped advantage it trains with (with
    ``train.reward_aggregation: advantage``, ``sum_k w_k z_k``), so `rewards` is any `(B,)` ranking key.

    Args:
        rewards (`(B,)`), group (`(B,)` long), keep (`int`, `>= 2`): samples kept per group.

    Returns:
        `torch.Tensor` of shape `(B,)`, bool.

    Raises:
        ValueError: if ``keep < 2`` or the shapes do not match.
    """
    if keep < 2:
        raise ValueError(f"best-of-N keep must be >= 2, got {keep}")
    _check_vectors(rewards=rewards, group=group)
    return _extremes(rewards, group, keep - keep // 2, keep // 2)


def _extremes(values: torch.Tensor, group: torch.Tensor, low: int, high: int) -> torch.Tensor:
    """`(B,)` bool: in each `group` `(B,)`, the `low` smallest and the `high` largest `values` `(B,)` (ties: stable
    order of appearance; a group of fewer than ``low + high`` keeps all its members)."""
    mask = torch.zeros_like(values, dtype=torch.bool)
    for g in group.unique():
        idx = (group == g).nonzero().squeeze(1)
        order = idx[torch.argsort(values[idx], stable=True)]
        mask[order[:low]] = True
        mask[order[len(order) - high :]] = True
    return mask
