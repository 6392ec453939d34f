"""LightningDataModules, collators and samplers over `datasets`."""

from lit_trainer.data.base import BaseDataModule
from lit_trainer.data.sft import SFTDataModule

__all__ = ["BaseDataModule", "SFTDataModule"]
