"""lit_trainer: Hugging Face Trainer / TRL recipes as PyTorch Lightning parts."""

from lit_trainer.modules import CausalLMModule, DPOModule, GRPOModule

__version__ = "0.1.0"

__all__ = ["CausalLMModule", "DPOModule", "GRPOModule"]
