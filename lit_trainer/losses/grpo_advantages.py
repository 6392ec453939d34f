"""GRPO group-relative advantages and reward metrics (TRL's GRPOTrainer, docs/design.md#trl-grpo).

Pure tensor functions.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal, get_args

import torch
from torch import Tensor

ScaleRewards = Literal["group", "batch", "none"]
Aggregation = Literal["sum_then_normalize", "normalize_then_sum"]

STD_EPS = 1e-4
"""Added to every standard deviation before dividing, as the reference does."""


def _check_choice(name: str, value: str, literal: object) -> None:
    choices = get_args(literal)
    if value not in choices:
        raise ValueError(f"`{name}={value!r}` is invalid: choose one of {', '.join(map(repr, choices))}.")


# ----------------------------------------------------------------------------------------------- NaN-aware stats
def nanstd(x: Tensor, dim: int | None = None) -> Tensor:
    """Bessel-corrected standard deviation ignoring NaNs; NaN where fewer than 2 values are valid.

    Args:
        x: values, NaN = missing.
        dim: reduce over this dimension, or over everything when None.

    Returns:
        ``sqrt(sum((x - nanmean)^2) / (n_valid - 1))``.
    """
    valid = ~torch.isnan(x)
    count = valid.sum() if dim is None else valid.sum(dim, keepdim=True)
    mean = (torch.nansum(x) if dim is None else torch.nansum(x, dim, keepdim=True)) / count
    sq = (x - mean).square()
    ss = torch.nansum(sq) if dim is None else torch.nansum(sq, dim)
    n = count if dim is None else count.squeeze(dim)
    return (ss / (n - 1)).sqrt()


def _prepare_rewards(
    rewards: Tensor, num_generations: int, reward_weights: Sequence[float] | Tensor | None
) -> tuple[Tensor, Tensor]:
    if rewards.dim() == 1:
        rewards = rewards.unsqueeze(1)
    if rewards.dim() != 2:
        raise ValueError(f"`rewards` has shape {tuple(rewards.shape)}: expected (N,) or (N, num_reward_funcs).")
    if num_generations < 1 or rewards.shape[0] % num_generations != 0:
        raise ValueError(
            f"`num_generations={num_generations}` is invalid for {rewards.shape[0]} rows: the row count must be a "
            "positive multiple of num_generations (each prompt's completions are consecutive rows)."
        )
    rewards = rewards if rewards.is_floating_point() else rewards.float()
    if reward_weights is None:
        weights = torch.ones(rewards.shape[1], dtype=rewards.dtype, device=rewards.device)
    else:
        weights = torch.as_tensor(reward_weights, dtype=rewards.dtype, device=rewards.device).reshape(-1)
        if weights.numel() != rewards.shape[1]:
            raise ValueError(
                f"`reward_weights` has {weights.numel()} entries but there are {rewards.shape[1]} reward functions: "
                "give one weight per function."
            )
    return rewards, weights


def _weighted_nansum(values: Tensor, weights: Tensor) -> Tensor:
    """``nansum_k w_k v_k`` per row, NaN for rows where every ``v_k`` is NaN."""
    total = torch.nansum(values * weights, dim=1)
    return total.masked_fill(torch.isnan(values).all(dim=1), float("nan"))


def _group_stats(r: Tensor, g: int) -> tuple[Tensor, Tensor]:
    """Per-row group nanmean and group nanstd of a (N,) tensor whose groups are consecutive blocks of ``g``."""
    grouped = r.reshape(-1, g)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(g)
    std = nanstd(grouped, dim=1).repeat_interleave(g)
    return mean, std


def _sigma(r: Tensor, g: int, scale_rewards: str) -> Tensor:
    """The per-row std used to scale advantages: group std ("group", "none") or batch std ("batch")."""
    if scale_rewards == "batch":
        return nanstd(r).expand_as(r)
    return _group_stats(r, g)[1]


def _sum_then_normalize(rewards: Tensor, weights: Tensor, g: int, scale_rewards: str) -> Tensor:
    r = _weighted_nansum(rewards, weights)
    centred = r - _group_stats(r, g)[0]
    if scale_rewards == "none":
        return centred
    return centred / (_sigma(r, g, scale_rewards) + STD_EPS)


def _normalize_then_sum(rewards: Tensor, weights: Tensor, g: int, scale_rewards: str) -> Tensor:
    del scale_rewards  # GDPO ignores it, as the reference does
    grouped = rewards.reshape(-1, g, rewards.shape[1])
    z = (grouped - torch.nanmean(grouped, dim=1, keepdim=True)) / (nanstd(grouped, dim=1).unsqueeze(1) + STD_EPS)
    r = _weighted_nansum(z.reshape_as(rewards), weights)  # NaN on unscorable rows: their z are all NaN
    return (r - torch.nanmean(r)) / (nanstd(r) + STD_EPS)


_AGGREGATIONS: dict[str, Callable[[Tensor, Tensor, int, str], Tensor]] = {
    "sum_then_normalize": _sum_then_normalize,
    "normalize_then_sum": _normalize_then_sum,
}


def grpo_advantages(
    rewards: Tensor,
    num_generations: int,
    *,
    reward_weights: Sequence[float] | Tensor | None = None,
    scale_rewards: ScaleRewards = "group",
    aggregation: Aggregation = "sum_then_normalize",
) -> Tensor:
    """Group-relative advantages of one (gathered) generation batch.

    Rows ``[k*G, (k+1)*G)`` are the ``G = num_generations`` completions of prompt ``k``. NaN = unscored.

    ``sum_then_normalize``: ``r = nansum_k w_k R_k`` (NaN if the whole row is NaN); ``A = r - groupmean(r)``, always
    centred on the group mean; then ``A /= sigma + 1e-4`` with sigma the Bessel nan-std of the group ("group") or of
    the whole batch ("batch"), no scaling for "none".
    ``normalize_then_sum`` (GDPO; ``scale_rewards`` ignored): ``z_k = (R_k - groupmean_k) / (groupstd_k + 1e-4)``,
    ``r = nansum_k w_k z_k``, ``A = (r - mean(r)) / (std(r) + 1e-4)`` over the batch.
    Finally NaN advantages (unscorable rows, all-NaN groups) become 0.

    Args:
        rewards: ``(N,)`` or ``(N, F)`` rewards of ``F`` reward functions; NaN = the function did not score the row.
        num_generations: completions per prompt ``G``; ``N`` must be a multiple of it.
        reward_weights: ``F`` weights, default all 1.
        scale_rewards: "group", "batch" or "none".
        aggregation: "sum_then_normalize" or "normalize_then_sum".

    Returns:
        ``(N,)`` advantages (float, same dtype as ``rewards`` when it is floating).

    Raises:
        ValueError: on an unknown option, a row count that is not a multiple of ``G``, or a weight count mismatch.

    Example:
        >>> grpo_advantages(torch.tensor([1.0, 0.0, 2.0, 2.0]), 2, scale_rewards="none")
        tensor([ 0.5000, -0.5000,  0.0000,  0.0000])
    """
    _check_choice("scale_rewards", scale_rewards, ScaleRewards)
    _check_choice("aggregation", aggregation, Aggregation)
    rewards, weights = _prepare_rewards(rewards, num_generations, reward_weights)
    advantages = _AGGREGATIONS[aggregation](rewards, weights, num_generations, scale_rewards)
    return torch.nan_to_num(advantages, nan=0.0)


def grpo_reward_metrics(
    rewards: Tensor,
    num_generations: int,
    *,
    reward_weights: Sequence[float] | Tensor | None = None,
    scale_rewards: ScaleRewards = "group",
    reward_names: Sequence[str] | None = None,
) -> dict[str, Tensor]:
    """Reward metrics of one gathered generation batch (TRL's GRPO reward metrics), as 0-dim tensors (no host sync).

    Keys: ``rewards/<name>/mean`` and ``rewards/<name>/std`` (nanmean / Bessel nanstd per function), ``reward``
    (nanmean of the weighted nansum, unscorable rows excluded), ``reward_std`` (its nanstd over the batch, not per
    group) and ``frac_reward_zero_std`` (fraction of rows whose scaling sigma, group or batch std of the weighted sum
    per ``scale_rewards``, is close to 0; a NaN sigma counts as non-zero). The same sigma is used for both
    aggregations.

    Args:
        rewards: ``(N,)`` or ``(N, F)``, NaN = unscored.
        num_generations: completions per prompt.
        reward_weights: ``F`` weights, default all 1.
        scale_rewards: decides which sigma ``frac_reward_zero_std`` looks at.
        reward_names: ``F`` names, default ``func_0 ... func_{F-1}``.

    Returns:
        Dict of metric name to 0-dim tensor.

    Raises:
        ValueError: as :func:`grpo_advantages`, or if the number of names differs from ``F``.
    """
    _check_choice("scale_rewards", scale_rewards, ScaleRewards)
    rewards, weights = _prepare_rewards(rewards, num_generations, reward_weights)
    names = list(reward_names) if reward_names is not None else [f"func_{k}" for k in range(rewards.shape[1])]
    if len(names) != rewards.shape[1]:
        raise ValueError(f"`reward_names` has {len(names)} names for {rewards.shape[1]} reward functions.")
    metrics: dict[str, Tensor] = {}
    for k, name in enumerate(names):
        metrics[f"rewards/{name}/mean"] = torch.nanmean(rewards[:, k])
        metrics[f"rewards/{name}/std"] = nanstd(rewards[:, k])
    r = _weighted_nansum(rewards, weights)
    metrics["reward"] = torch.nanmean(r)
    metrics["reward_std"] = nanstd(r)
    sigma = _sigma(r, num_generations, scale_rewards)
    zero = torch.isclose(sigma, torch.zeros_like(sigma))
    metrics["frac_reward_zero_std"] = zero.to(r.dtype).mean()
    return metrics
