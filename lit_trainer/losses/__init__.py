"""Pure tensor loss functions (torch only)."""

from lit_trainer.losses.causal_lm import causal_lm_loss
from lit_trainer.losses.dpo import dpo_loss
from lit_trainer.losses.grpo import grpo_policy_loss
from lit_trainer.losses.grpo_advantages import grpo_advantages
from lit_trainer.losses.reward import reward_loss

__all__ = ["causal_lm_loss", "dpo_loss", "grpo_advantages", "grpo_policy_loss", "reward_loss"]
