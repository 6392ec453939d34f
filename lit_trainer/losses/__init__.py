"""Pure tensor loss functions (torch only)."""

from lit_trainer.losses.causal_lm import causal_lm_loss
from lit_trainer.losses.distillation import generalized_jsd_loss
from lit_trainer.losses.dpo import dpo_loss
from lit_trainer.losses.grpo import grpo_policy_loss
from lit_trainer.losses.grpo_advantages import grpo_advantages
from lit_trainer.losses.kto import kto_loss
from lit_trainer.losses.reference_free import cpo_loss, orpo_loss
from lit_trainer.losses.reward import reward_loss
from lit_trainer.losses.rloo import rloo_advantages, rloo_policy_loss

__all__ = [
    "causal_lm_loss",
    "cpo_loss",
    "dpo_loss",
    "generalized_jsd_loss",
    "grpo_advantages",
    "grpo_policy_loss",
    "kto_loss",
    "orpo_loss",
    "reward_loss",
    "rloo_advantages",
    "rloo_policy_loss",
]
