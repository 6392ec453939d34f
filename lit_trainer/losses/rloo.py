"""RLOO (REINFORCE Leave-One-Out): advantages, sequence-level clipped policy loss and its metrics (TRL 1.16's
``RLOOTrainer`` numerics).

Pure tensor functions (torch only). RLOO differs from GRPO in three places, all here:

* the baseline of a completion is the mean reward of the OTHER completions of its prompt (no division by a group
  std), optionally followed by one whitening of the whole batch (``normalize_advantages``);
* the KL to the reference enters the reward, once per sequence, before the baseline (``r - beta * KL``, with the
  first-order estimate ``KL = sum_t (log pi_old - log pi_ref)``), not the loss;
* the importance ratio, its clipping and the loss are per sequence (``exp`` of the summed token log-ratio), and the
  loss is the plain mean over the micro-batch's sequences.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from lit_trainer.losses.grpo import _masked
from lit_trainer.losses.grpo_advantages import STD_EPS, _prepare_rewards, _weighted_nansum, nanstd

__all__ = ["rloo_advantages", "rloo_loss_metrics", "rloo_policy_loss", "rloo_rewards", "sequence_logps"]


def check_clip_range(reward_clip_range: Sequence[float] | None) -> None:
    """Refuse a ``reward_clip_range`` that is not ``None`` or ``(low, high)`` with ``low <= high``.

    Raises:
        ValueError: naming the bad range and the fix.
    """
    if reward_clip_range is None:
        return
    if len(reward_clip_range) != 2 or not reward_clip_range[0] <= reward_clip_range[1]:
        raise ValueError(
            f"`reward_clip_range={tuple(reward_clip_range)!r}` is invalid: give (low, high) with low <= high, "
            "e.g. (-1.0, 1.0), or None to leave rewards unclipped."
        )


def rloo_rewards(
    rewards: Tensor,
    *,
    reward_weights: Sequence[float] | Tensor | None = None,
    reward_clip_range: Sequence[float] | None = None,
    kl: Tensor | None = None,
    beta: float = 0.0,
) -> Tensor:
    """The scalar reward RLOO's baseline is computed on: ``clip(nansum_k w_k R_k, lo, hi) - beta * KL``.

    A row that no function scored (all NaN) stays NaN (clipping and the KL keep it NaN).

    Args:
        rewards: ``(N,)`` or ``(N, F)``; NaN = unscored by that function.
        reward_weights: ``F`` weights, default all 1.
        reward_clip_range: ``(lo, hi)`` applied to the weighted sum, before the KL; None = no clipping.
        kl: ``(N,)`` per-sequence KL (summed over the completion tokens), needed when ``beta != 0``.
        beta: KL coefficient.

    Returns:
        ``(N,)`` rewards.

    Raises:
        ValueError: on a bad clip range, a weight count mismatch, or ``beta != 0`` without ``kl``.
    """
    check_clip_range(reward_clip_range)
    rewards, weights = _prepare_rewards(rewards, 1, reward_weights)
    r = _weighted_nansum(rewards, weights)
    if reward_clip_range is not None:
        r = r.clamp(min=reward_clip_range[0], max=reward_clip_range[1])
    if beta != 0.0:
        if kl is None or kl.shape != r.shape:
            raise ValueError(
                f"`beta={beta}` needs `kl` of shape {tuple(r.shape)} (one summed KL per completion), got "
                f"{None if kl is None else tuple(kl.shape)}."
            )
        r = r - beta * kl.to(r.dtype)
    return r


def rloo_advantages(
    rewards: Tensor,
    num_generations: int,
    *,
    reward_weights: Sequence[float] | Tensor | None = None,
    reward_clip_range: Sequence[float] | None = None,
    kl: Tensor | None = None,
    beta: float = 0.0,
    normalize_advantages: bool = False,
) -> Tensor:
    """Leave-one-out advantages of one (gathered) generation batch.

    Rows ``[k*G, (k+1)*G)`` are the ``G = num_generations`` completions of prompt ``k``. With ``r`` from
    :func:`rloo_rewards` (weighted sum, clipped, minus ``beta * KL``) and ``n_k`` the scored rows of group ``k``::

        A_i = r_i - (sum_{j in group, j != i, scored} r_j) / (n_k - 1)

    Then, with ``normalize_advantages``, ``A = (A - nanmean(A)) / (nanstd(A) + 1e-4)`` over the whole batch (Bessel
    std, scored rows only). Finally NaN advantages (unscored rows, a group with one scored row) become 0.
    Example: rewards ``[1, 0, 0, 1]`` in one group: baselines ``[1/3, 2/3, 2/3, 1/3]``, advantages
    ``[2/3, -2/3, -2/3, 2/3]``.

    Args:
        rewards: ``(N,)`` or ``(N, F)`` rewards of ``F`` reward functions; NaN = the function did not score the row.
        num_generations: completions per prompt ``G`` (>= 2); ``N`` must be a multiple of it.
        reward_weights: ``F`` weights, default all 1.
        reward_clip_range: ``(lo, hi)`` clip of the weighted reward, None = off.
        kl: ``(N,)`` summed per-sequence KL ``sum_t (log pi_old - log pi_ref)``, needed when ``beta != 0``.
        beta: KL coefficient (the KL is a reward penalty).
        normalize_advantages: whiten the advantages over the batch.

    Returns:
        ``(N,)`` advantages.

    Raises:
        ValueError: on ``num_generations < 2``, a row count that is not a multiple of it, a weight count mismatch, a
            bad clip range, or ``beta != 0`` without ``kl``.

    Example:
        >>> rloo_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), 4)
        tensor([ 0.6667, -0.6667, -0.6667,  0.6667])
    """
    if num_generations < 2:
        raise ValueError(
            f"`num_generations={num_generations}` is invalid: the leave-one-out baseline needs at least 2 "
            "completions per prompt (e.g. 2 or 4)."
        )
    _prepare_rewards(rewards, num_generations, reward_weights)  # validates the shape against G and the weights
    r = rloo_rewards(rewards, reward_weights=reward_weights, reward_clip_range=reward_clip_range, kl=kl, beta=beta)
    grouped = r.reshape(-1, num_generations)
    scored = (~torch.isnan(grouped)).sum(dim=1, keepdim=True)
    others = torch.nansum(grouped, dim=1, keepdim=True) - grouped
    advantages = (grouped - others / (scored - 1)).reshape(-1)
    if normalize_advantages:
        advantages = (advantages - torch.nanmean(advantages)) / (nanstd(advantages) + STD_EPS)
    return torch.nan_to_num(advantages, nan=0.0)


def sequence_logps(per_token_logps: Tensor, mask: Tensor) -> Tensor:
    """``sum_t logp_t m_t`` per row: (B, C) -> (B,); exactly 0 where the mask is 0."""
    return _masked(per_token_logps, mask.to(per_token_logps.dtype)).sum(-1)


def _ratio(logps: Tensor, old_logps: Tensor | None, mask: Tensor) -> Tensor:
    seq = sequence_logps(logps, mask)
    old = seq.detach() if old_logps is None else sequence_logps(old_logps, mask)
    return torch.exp(seq - old)


def _check_inputs(logps: Tensor, advantages: Tensor, mask: Tensor, epsilon: float, epsilon_high: float | None) -> None:
    if logps.dim() != 2 or mask.shape != logps.shape or advantages.shape != logps.shape[:1]:
        raise ValueError(
            f"shapes: logps {tuple(logps.shape)} and mask {tuple(mask.shape)} must be the same (B, C), advantages "
            f"{tuple(advantages.shape)} must be (B,)."
        )
    if epsilon < 0 or (epsilon_high is not None and epsilon_high < 0):
        raise ValueError(f"`epsilon={epsilon}`, `epsilon_high={epsilon_high}` are invalid: use values >= 0 (e.g. 0.2).")


def rloo_policy_loss(
    logps: Tensor,
    old_logps: Tensor | None,
    advantages: Tensor,
    mask: Tensor,
    *,
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    importance_sampling_ratio: Tensor | None = None,
) -> Tensor:
    """Sequence-level clipped surrogate of one micro-batch, mean over its sequences::

        r_i = exp(sum_t m_it logp_it - sum_t m_it old_it)
        L = mean_i -rho_i min(r_i A_i, clamp(r_i, 1 - eps, 1 + eps_high) A_i)

    Every row counts in the mean, also a row whose mask is all 0 (a masked truncated completion: ``r = 1``, no
    gradient), as the reference does. ``rho_i`` is 1 unless ``importance_sampling_ratio`` is given: the sampler
    correction of rows sampled by an engine with other numerics than the policy's (vLLM), ``pi_old / pi_sampler`` of
    each sequence, truncated or masked (:func:`~lit_trainer.losses.grpo_masks.sampling_importance_ratio` in a sequence
    mode); a masked row (``rho_i = 0``) gives no gradient but still counts in the mean, as a masked row of GRPO's
    correction does.

    Args:
        logps: (B, C) per-token log-probs of the completion tokens under the policy (with grad).
        old_logps: (B, C) per-token log-probs at generation time, or None when on-policy (``logps.detach()``).
        advantages: (B,).
        mask: (B, C) 1 = completion token in the loss.
        epsilon: lower clip.
        epsilon_high: upper clip (None = ``epsilon``).
        importance_sampling_ratio: (B,) or (B, 1) sampler correction (no gradient), or None.

    Returns:
        0-dim loss (no gradient-accumulation factor).

    Raises:
        ValueError: on mismatched shapes or a negative epsilon.
    """
    _check_inputs(logps, advantages, mask, epsilon, epsilon_high)
    high = epsilon if epsilon_high is None else epsilon_high
    ratio = _ratio(logps, old_logps, mask)
    adv = advantages.to(ratio.dtype)
    clipped = torch.clamp(ratio, 1.0 - epsilon, 1.0 + high)
    per_row = -torch.min(ratio * adv, clipped * adv)
    if importance_sampling_ratio is not None:
        if importance_sampling_ratio.numel() != per_row.numel():
            raise ValueError(
                f"`importance_sampling_ratio` has shape {tuple(importance_sampling_ratio.shape)}: RLOO's correction "
                f"is one ratio per sequence, (B,) or (B, 1) with B = {per_row.numel()}."
            )
        per_row = per_row * importance_sampling_ratio.detach().reshape(-1).to(per_row.dtype)
    return per_row.mean()


@torch.no_grad()
def rloo_loss_metrics(
    logps: Tensor,
    old_logps: Tensor | None,
    advantages: Tensor,
    mask: Tensor,
    *,
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
) -> dict[str, Tensor]:
    """The reference's per-micro-step clip metrics, per sequence, as 0-dim tensors.

    ``clip_ratio/low_mean`` = fraction of rows with ``r < 1 - eps`` and ``A < 0``; ``clip_ratio/high_mean`` = with
    ``r > 1 + eps_high`` and ``A > 0``; ``clip_ratio/region_mean`` = either; ``clip_ratio/low_min`` /
    ``clip_ratio/high_max`` = min / max over the rows of the 0/1 flags.

    Args:
        logps: as :func:`rloo_policy_loss` (detached here).
        old_logps: as :func:`rloo_policy_loss`.
        advantages: as :func:`rloo_policy_loss`.
        mask: as :func:`rloo_policy_loss`.
        epsilon: as :func:`rloo_policy_loss`.
        epsilon_high: as :func:`rloo_policy_loss`.

    Returns:
        Dict of metric name to 0-dim tensor.
    """
    _check_inputs(logps, advantages, mask, epsilon, epsilon_high)
    high = epsilon if epsilon_high is None else epsilon_high
    ratio = _ratio(logps.detach(), old_logps, mask)
    low_flags = ((ratio < 1.0 - epsilon) & (advantages < 0)).to(ratio.dtype)
    high_flags = ((ratio > 1.0 + high) & (advantages > 0)).to(ratio.dtype)
    return {
        "clip_ratio/low_mean": low_flags.mean(),
        "clip_ratio/low_min": low_flags.min(),
        "clip_ratio/high_mean": high_flags.mean(),
        "clip_ratio/high_max": high_flags.max(),
        "clip_ratio/region_mean": torch.maximum(low_flags, high_flags).mean(),
    }
