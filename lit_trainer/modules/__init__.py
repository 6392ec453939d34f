"""LightningModules, one per algorithm."""

from lit_trainer.modules.base import BaseModule
from lit_trainer.modules.causal_lm import CausalLMModule
from lit_trainer.modules.cpo import CPOModule
from lit_trainer.modules.distillation import DistillationModule
from lit_trainer.modules.dpo import DPOModule
from lit_trainer.modules.grpo import GRPOModule
from lit_trainer.modules.kto import KTOModule
from lit_trainer.modules.online_rl import OnlineRLModule
from lit_trainer.modules.orpo import ORPOModule
from lit_trainer.modules.reward import RewardModule
from lit_trainer.modules.rloo import RLOOModule

__all__ = [
    "BaseModule",
    "CPOModule",
    "CausalLMModule",
    "DPOModule",
    "DistillationModule",
    "GRPOModule",
    "KTOModule",
    "ORPOModule",
    "OnlineRLModule",
    "RLOOModule",
    "RewardModule",
]
