"""LightningDataModules, collators and samplers over `datasets`."""

from lit_trainer.data.base import BaseDataModule
from lit_trainer.data.preference import PreferenceDataModule
from lit_trainer.data.prompt import PromptDataModule
from lit_trainer.data.rebalance_sampler import BatchRebalanceSampler
from lit_trainer.data.repeat_sampler import RepeatSampler
from lit_trainer.data.samplers import LengthGroupedSampler
from lit_trainer.data.sft import SFTDataModule

__all__ = [
    "BaseDataModule",
    "BatchRebalanceSampler",
    "LengthGroupedSampler",
    "PreferenceDataModule",
    "PromptDataModule",
    "RepeatSampler",
    "SFTDataModule",
]
