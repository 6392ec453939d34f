"""lit_trainer: Hugging Face Trainer / TRL recipes as PyTorch Lightning parts."""

__version__ = "0.1.0"
