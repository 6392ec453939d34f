"""LightningModules, one per algorithm."""

from lit_trainer.modules.base import BaseModule
from lit_trainer.modules.causal_lm import CausalLMModule
from lit_trainer.modules.dpo import DPOModule
from lit_trainer.modules.grpo import GRPOModule
from lit_trainer.modules.reward import RewardModule

__all__ = ["BaseModule", "CausalLMModule", "DPOModule", "GRPOModule", "RewardModule"]
