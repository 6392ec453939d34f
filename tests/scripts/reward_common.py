"""The reward model and preference data of ``reward_ranks.py`` and ``tests/test_reward_ranks.py`` (the same in 1 and
2 processes)."""

from __future__ import annotations

from typing import Any

import torch


def reward_model() -> torch.nn.Module:
    from lit_trainer.models import load_model

    torch.manual_seed(3)
    return load_model("tiny", task="sequence_classification")


def reward_module(learning_rate: float, **kwargs: Any) -> Any:
    from lit_trainer.models import load_tokenizer
    from lit_trainer.modules.reward import RewardModule

    return RewardModule(
        reward_model(),
        tokenizer=load_tokenizer("tiny"),
        learning_rate=learning_rate,
        center_rewards_coefficient=0.01,
        max_grad_norm=1.0,
        **kwargs,
    )


def datamodule(pairs: int, batch_size: int) -> Any:
    from lit_trainer.data import builtin
    from lit_trainer.data.preference import PreferenceDataModule
    from lit_trainer.models import load_tokenizer

    return PreferenceDataModule(
        tokenizer=load_tokenizer("tiny"),
        dataset=builtin.preference_rows("train").select(range(pairs)),
        val_size=0,
        batch_size=batch_size,
        max_length=32,
        truncation_mode="drop",
        sampling="sequential",
    )
