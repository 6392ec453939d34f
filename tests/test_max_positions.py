"""Sequences longer than the model's positions are named at setup, before the first step: refused when the model has a
learned table of positions (GPT-2's ``wpe``: a longer row fails with "index out of range" in the middle of training),
warned when its positions are rotary (Llama: it runs, but past what the model was trained for). Every module, with the
longest row of the data (and GRPO's ``max_completion_length``) counted by hand here: the presets' tokenizer has one
token per byte and the data modules end string rows with EOS.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

import lightning as L
import pytest
from datasets import Dataset
from transformers import GPT2Config, GPT2ForSequenceClassification, GPT2LMHeadModel, MistralConfig, MistralForCausalLM

from helpers.models import tiny_llama
from lit_trainer import CausalLMModule, DistillationModule, DPOModule, GRPOModule, RewardModule
from lit_trainer.data import PreferenceDataModule, PromptDataModule, SFTDataModule
from lit_trainer.models import build_tokenizer
from lit_trainer.rewards import arithmetic_reward

logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
PROMPT, ANSWER = "1234+4321=", "5555"  # 10 + 4 bytes: a row of 15 tokens with its EOS


class NoStep(L.Callback):
    """Fails the test if a training step starts (the refusal must come at setup)."""

    def on_train_batch_start(self, *args: Any) -> None:
        raise AssertionError("a training step ran before the refusal")


def gpt2(positions: int, classifier: bool = False) -> Any:
    config = GPT2Config(
        n_positions=positions, n_embd=16, n_layer=1, n_head=2, vocab_size=384, bos_token_id=None, eos_token_id=1,
        pad_token_id=0, num_labels=1,
    )  # fmt: skip
    return GPT2ForSequenceClassification(config) if classifier else GPT2LMHeadModel(config)


def fit(module: Any, data: Any, steps: int = 1) -> None:
    """``steps=0``: setup only (and a check that no step runs)."""
    L.Trainer(
        max_steps=steps, accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False, limit_val_batches=0, num_sanity_val_steps=0, callbacks=[] if steps else [NoStep()],
    ).fit(module, datamodule=data)  # fmt: skip


def sft_data(**kw: Any) -> SFTDataModule:
    rows = Dataset.from_dict({"prompt": [PROMPT, "1+2="], "completion": [ANSWER, "3"]})
    return SFTDataModule(tokenizer=build_tokenizer(), dataset=rows, val_size=0, **{"batch_size": 2, **kw})


def preference_data() -> PreferenceDataModule:
    rows = Dataset.from_dict({"prompt": [PROMPT] * 2, "chosen": [ANSWER] * 2, "rejected": ["5556", "55"]})
    return PreferenceDataModule(tokenizer=build_tokenizer(), dataset=rows, val_size=0, batch_size=2)


def ours(record: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in record if "max_position_embeddings" in str(w.message)]


@pytest.mark.parametrize("kind", ["sft", "dpo", "reward"])
def test_rows_past_a_learned_position_table_are_refused_at_setup(kind):
    tokenizer = build_tokenizer()
    if kind == "reward":
        module, data = RewardModule(gpt2(12, classifier=True), tokenizer=tokenizer), preference_data()
    elif kind == "dpo":
        module, data = DPOModule(gpt2(12), tokenizer=tokenizer), preference_data()
    else:
        module, data = CausalLMModule(gpt2(12), tokenizer=tokenizer), sft_data()
    with pytest.raises(ValueError, match=r"(?s)15 tokens.*max_position_embeddings=12.*max_length.*12") as raised:
        fit(module, data, steps=0)
    assert "transformer.wpe" in str(raised.value)  # names the table


def test_grpo_prompt_plus_completion_past_a_learned_table_is_refused_at_setup():
    rows = Dataset.from_dict({"prompt": [PROMPT, "1+2="], "answer": ["5555", "3"]})
    data = PromptDataModule(tokenizer=build_tokenizer(), dataset=rows, val_size=0, batch_size=4, max_length=16)
    # the longest prompt is 10 tokens (no EOS on prompts): 10 + 8 = 18 > 16
    module = GRPOModule(
        gpt2(16), tokenizer=build_tokenizer(), reward_funcs=[arithmetic_reward], num_generations=2,
        max_completion_length=8,
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"(?s)10 tokens.*max_completion_length=8.*18.*max_position_embeddings=16"):
        fit(module, data, steps=0)
    fits = GRPOModule(
        gpt2(18), tokenizer=build_tokenizer(), reward_funcs=[arithmetic_reward], num_generations=2,
        max_completion_length=8,
    )  # fmt: skip
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        fit(fits, data)  # exactly the positions: runs, silently
    assert ours(record) == []


def test_rows_past_rotary_positions_warn_and_train():
    with pytest.warns(UserWarning, match=r"(?s)15 tokens.*max_position_embeddings=14.*rotary.*max_length"):
        fit(CausalLMModule(tiny_llama(positions=14), tokenizer=build_tokenizer()), sft_data())


def test_rows_within_the_positions_are_silent_and_max_length_alone_does_not_count():
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        # max_length 512 is past the 15 positions, but no row is: nothing to say
        fit(CausalLMModule(tiny_llama(positions=15), tokenizer=build_tokenizer()), sft_data(max_length=512))
        fit(CausalLMModule(gpt2(15), tokenizer=build_tokenizer()), sft_data(max_length=512))
    assert ours(record) == []


def test_packed_rows_count_one_by_one():
    # bfd bins hold several rows whose positions restart at 0: the longest row counts, not the bin
    data = sft_data(packing="bfd", max_length=32, batch_size=1)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        fit(CausalLMModule(gpt2(15), tokenizer=build_tokenizer()), data)
    assert ours(record) == []


def test_distillation_counts_the_sampled_completions_against_the_positions():
    # on-policy distillation samples max_new_tokens after each prompt: the 10-token prompt + 8 = 18 > 16 positions,
    # although every dataset row (15 tokens) fits
    with pytest.raises(
        ValueError, match=r"(?s)10 tokens.*max_new_tokens=8 = 18.*max_position_embeddings=16.*at most 6"
    ):
        fit(
            DistillationModule(gpt2(16), teacher_model=gpt2(16), tokenizer=build_tokenizer(), max_new_tokens=8),
            sft_data(),
            steps=0,
        )
    # dataset completions only (lmbda=0, no seq_kd): the rows are what the models see, and they fit
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        fit(DistillationModule(gpt2(16), teacher_model=gpt2(16), tokenizer=build_tokenizer(), lmbda=0.0), sft_data())
    assert ours(record) == []


def test_distillation_checks_the_teachers_positions_too():
    student = tiny_llama(positions=64)
    with pytest.raises(
        ValueError, match=r"(?s)DistillationModule \(teacher\): the longest row of the data has 15 tokens.*=14"
    ):
        fit(
            DistillationModule(student, teacher_model=gpt2(14), tokenizer=build_tokenizer(), lmbda=0.0),
            sft_data(),
            steps=0,
        )


def mistral(positions: int, window: int | None) -> Any:
    config = MistralConfig(
        vocab_size=384, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=positions, sliding_window=window, pad_token_id=0,
        eos_token_id=1, bos_token_id=None,
    )  # fmt: skip
    return MistralForCausalLM(config)


def test_a_sliding_window_on_every_layer_has_no_position_limit():
    # each token attends to the last 8 only: relative distances stay within the 14 positions the model knows
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        fit(CausalLMModule(mistral(14, window=8), tokenizer=build_tokenizer()), sft_data())
    assert ours(record) == []
    with pytest.warns(UserWarning, match=r"(?s)15 tokens.*max_position_embeddings=14.*rotary"):  # full attention
        fit(CausalLMModule(mistral(14, window=None), tokenizer=build_tokenizer()), sft_data())
