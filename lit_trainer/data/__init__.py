"""LightningDataModules, collators and samplers over `datasets`."""

from lit_trainer.data.base import BaseDataModule
from lit_trainer.data.preference import PreferenceDataModule
from lit_trainer.data.prompt import PromptDataModule
from lit_trainer.data.samplers import BatchRebalanceSampler, LengthGroupedSampler, RepeatSampler
from lit_trainer.data.sft import SFTDataModule
from lit_trainer.data.unpaired import UnpairedPreferenceDataModule

__all__ = [
    "BaseDataModule",
    "BatchRebalanceSampler",
    "LengthGroupedSampler",
    "PreferenceDataModule",
    "PromptDataModule",
    "RepeatSampler",
    "SFTDataModule",
    "UnpairedPreferenceDataModule",
]
