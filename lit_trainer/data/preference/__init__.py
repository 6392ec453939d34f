"""PreferenceDataModule: prompt/chosen/rejected rows for DPO, preprocessed and collated as TRL 1.16's DPOTrainer.

The code is in :mod:`lit_trainer.data.preference.preference_data_module`;
its private parts are beside it in this folder."""

from lit_trainer.data.preference.preference_data_module import (
    TOKEN_COLUMNS,
    PreferenceDataModule,
    PreferencePacking,
    end_with_eos,
    extract_prompt,
)

__all__ = ["TOKEN_COLUMNS", "PreferenceDataModule", "PreferencePacking", "end_with_eos", "extract_prompt"]
