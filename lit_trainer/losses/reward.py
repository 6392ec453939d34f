"""The Bradley-Terry reward-model loss (TRL 1.16's ``RewardTrainer``) and its per-batch metrics.

Notation (pair ``i``): ``r_c``, ``r_r`` are the scalar rewards the model gives the chosen and the rejected sequence,
``m`` the pair's optional margin, ``c`` the centring coefficient and ``σ`` the sigmoid.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def reward_loss(
    chosen_rewards: torch.Tensor,
    rejected_rewards: torch.Tensor,
    *,
    margin: torch.Tensor | None = None,
    center_rewards_coefficient: float | None = None,
) -> torch.Tensor:
    """Per-pair Bradley-Terry losses ``ℓ_i = −log σ(r_c − r_r − m) + c · (r_c + r_r)²``.

    The mean of the returned ``(B,)`` losses is TRL's loss: ``−mean(log σ(r_c − r_r − m)) + c · mean((r_c + r_r)²)``
    (both terms are means over the same pairs, so they add per pair). Returning them per pair lets a caller divide
    their sum by the pair count of a whole optimizer step (accumulation and ranks). The margin asks the chosen reward
    to beat the rejected one by at least ``m``; the centring term (``c`` recommended 0.01) pulls the rewards towards
    mean zero.

    Args:
        chosen_rewards: ``(B,)`` rewards of the chosen sequences.
        rejected_rewards: ``(B,)`` rewards of the rejected sequences.
        margin: ``(B,)`` per-pair margins, or None (no margin).
        center_rewards_coefficient: ``c``, or None (no centring term; 0.0 gives the same values).

    Returns:
        ``(B,)`` per-pair losses.

    Raises:
        ValueError: when the shapes do not match.

    Example:
        >>> reward_loss(torch.tensor([1.0]), torch.tensor([1.0]))  # equal rewards: log 2
        tensor([0.6931])
    """
    if chosen_rewards.shape != rejected_rewards.shape or (margin is not None and margin.shape != chosen_rewards.shape):
        shapes = [tuple(t.shape) for t in (chosen_rewards, rejected_rewards, margin) if t is not None]
        raise ValueError(f"reward_loss: chosen, rejected (and margin) need one value per pair, got shapes {shapes}.")
    difference = chosen_rewards - rejected_rewards
    if margin is not None:
        difference = difference - margin.to(difference.dtype)
    losses = -F.logsigmoid(difference)
    if center_rewards_coefficient is not None:
        losses = losses + center_rewards_coefficient * (chosen_rewards + rejected_rewards) ** 2
    return losses


@torch.no_grad()
def reward_metrics(chosen_rewards: torch.Tensor, rejected_rewards: torch.Tensor) -> dict[str, torch.Tensor]:
    """TRL's per-batch reward-model metrics (detached 0-d float tensors, no host sync), plus the side means.

    Returns:
        ``accuracy = mean(1[r_c > r_r])`` (strict: a tie counts as wrong), ``margin = mean(r_c − r_r)`` (the margin
        column plays no part), ``mean_reward``, ``min_reward`` and ``max_reward`` over all ``2B`` rewards, and
        ``chosen_reward = mean(r_c)``, ``rejected_reward = mean(r_r)``.

    Example:
        >>> m = reward_metrics(torch.tensor([2.0, 0.0]), torch.tensor([1.0, 1.0]))
        >>> m["accuracy"].item(), m["margin"].item(), m["min_reward"].item()
        (0.5, 0.0, 0.0)
    """
    chosen, rejected = chosen_rewards.detach().float(), rejected_rewards.detach().float()
    both = torch.cat([chosen, rejected])
    return {
        "accuracy": (chosen > rejected).float().mean(),
        "margin": (chosen - rejected).mean(),
        "mean_reward": both.mean(),
        "min_reward": both.min(),
        "max_reward": both.max(),
        "chosen_reward": chosen.mean(),
        "rejected_reward": rejected.mean(),
    }
