"""LightningModules, one per algorithm."""

from lit_trainer.modules.base import BaseModule
from lit_trainer.modules.causal_lm import CausalLMModule

__all__ = ["BaseModule", "CausalLMModule"]
