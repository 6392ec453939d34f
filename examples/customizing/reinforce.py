"""A new online-RL method on OnlineRLModule: REINFORCE with a batch-mean baseline (Williams, 1992)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor

from lit_trainer.losses.grpo_advantages import grpo_reward_metrics
from lit_trainer.modules import OnlineRLModule


def reinforce_advantages(rewards: Tensor, weights: Sequence[float] | None = None) -> Tensor:
    """Per-completion ``r - mean(r)`` of ``(N, F)`` rewards: ``r`` the weighted sum over the ``F`` reward functions (an
    unscored reward, NaN, counts 0; ``weights`` default all 1) and the mean taken over the whole generation batch: one
    baseline for every prompt."""
    weights = torch.ones(rewards.shape[1]) if weights is None else torch.as_tensor(weights)
    total = torch.nansum(rewards * weights.to(rewards), dim=1)
    return total - total.mean()


def reinforce_loss(logps: Tensor, advantages: Tensor, mask: Tensor) -> Tensor:
    """``-mean_i A_i * sum_t log pi(y_it)`` over the micro-batch's completions (the score-function estimator)."""
    return -(advantages * (logps * mask).sum(dim=1)).mean()


class REINFORCEModule(OnlineRLModule):
    """REINFORCE: OnlineRLModule's rollouts, rewards, buffer, exact resume and validation, with its own advantages and
    loss. ``max_completion_length``, ``num_generations``, the rewards and the other options are the base's."""

    RUN_NAME: ClassVar[str] = "reinforce"  # lit-trainer writes runs/reinforce/

    def __init__(self, model: Any = "tiny", *, reward_funcs: Any, **kwargs: Any) -> None:
        super().__init__(model, reward_funcs=reward_funcs, **kwargs)  # every argument is saved in self.hparams

    @torch.no_grad()
    def _make_rollouts(self, batch: dict[str, Any], can_stop: bool = False, position: tuple[int, int] = (0, 0)) -> None:
        """One round: sample this rank's rows, score them over all ranks, advantages, buffer."""
        rows, completions, scoring_batch, decoded, tool_metrics = self._generate_rows(batch, can_stop)
        table, functions, texts, logged = self._gathered_scores(scoring_batch, completions, decoded)
        rewards = table[:, :functions]  # every rank's rows, rank order
        advantages = reinforce_advantages(rewards, self.reward_weights)
        local = len(texts)
        rows["advantages"] = advantages[self.global_rank * local : (self.global_rank + 1) * local]
        metrics = grpo_reward_metrics(  # `reward`, `reward_std` and one mean and std per function, as GRPO logs
            rewards, self.hparams.num_generations, reward_weights=self.reward_weights, reward_names=self.reward_names
        )
        self._buffer_round(rows, {**metrics, **logged, **tool_metrics})

    def compute_loss(self, batch: dict[str, Any], num_items_in_batch: Tensor | None) -> tuple[Tensor, dict]:
        """The micro-batch's REINFORCE loss (a per-micro-batch mean: ``num_items_in_batch`` is None)."""
        logps, _ = self.completion_logps(self.model, batch)
        return reinforce_loss(logps, batch["advantages"], batch["completion_mask"]), {}
