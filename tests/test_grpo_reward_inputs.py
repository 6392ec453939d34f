"""What a reward model reads inside GRPO: the token ids it was trained on, and TRL 1.16's ``chat_template_kwargs``.

The chain checks run the reward model's training tokenisation (``PreferenceDataModule``, what ``RewardModule``
trains on) and GRPO's scoring tokenisation (completion ids decoded as GRPO decodes them, then the reward model's
forward pass, read with a hook) on the same texts, and require the same ids. ``reward_model_inputs="trl"`` must give
TRL's ``GRPOTrainer`` texts; ``chat_template_kwargs`` must reach the prompts and the reward model's texts as in TRL.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
from datasets import Dataset
from test_grpo_module import QUIET
from tokenizers.processors import TemplateProcessing

from lit_trainer.data.preference import PreferenceDataModule
from lit_trainer.data.prompt import PromptDataModule
from lit_trainer.generation import engines as rollout
from lit_trainer.models import CHAT_TEMPLATE, build_preset_model, build_tokenizer
from lit_trainer.modules.grpo import GRPOModule
from lit_trainer.modules.online_rl._reward_calls import resolve_reward_funcs
from lit_trainer.rewards import RewardModelScorer, call_reward_functions

PROMPTS = ["12+30=", "7+5=", "99+1="]
ANSWERS = ["42", "12", "100"]
GREETING = "{%- if greeting is defined %}<|greeting|>{{ greeting }}\n{% endif %}"  # a template variable


def reward_model(seed: int = 0) -> Any:
    torch.manual_seed(seed)
    return build_preset_model("tiny-64", task="sequence_classification")


def bos_tokenizer() -> Any:
    """The presets' tokenizer, but adding a BOS (``<extra_id_0>``) to every encoding, as Llama tokenizers do."""
    tokenizer = build_tokenizer()
    tokenizer.bos_token = "<extra_id_0>"
    tokenizer._tokenizer.post_processor = TemplateProcessing(
        single="<extra_id_0> $A", special_tokens=[("<extra_id_0>", tokenizer.bos_token_id)]
    )
    return tokenizer


def greeting_tokenizer() -> Any:
    """The presets' tokenizer whose chat template writes a ``greeting`` template variable first when it is given."""
    tokenizer = build_tokenizer()
    tokenizer.chat_template = GREETING + CHAT_TEMPLATE
    return tokenizer


def trained_rows(tokenizer: Any, rows: dict[str, list]) -> list[list[int]]:
    """The chosen rows a reward model trains on: ``prompt_ids + chosen_ids`` of ``PreferenceDataModule``."""
    dm = PreferenceDataModule(
        tokenizer=tokenizer, dataset=Dataset.from_dict(rows), batch_size=2, max_length=64, val_size=0,
        truncation_mode="drop", sampling="sequential",
    )  # fmt: skip
    dm.setup("fit")
    return [row["prompt_ids"] + row["chosen_ids"] for row in dm.train_dataset]


class InputRecorder:
    """Forward pre-hook on a reward model: the unpadded ``input_ids`` of every row it scores."""

    def __init__(self, model: Any) -> None:
        self.rows: list[list[int]] = []
        model.register_forward_pre_hook(self, with_kwargs=True)

    def __call__(self, module: Any, args: tuple, kwargs: dict) -> None:
        ids, mask = kwargs["input_ids"], kwargs["attention_mask"]
        assert mask[:, 0].all()  # right padding: every row starts with a real token
        self.rows += [row[m.bool()].tolist() for row, m in zip(ids, mask)]


def scored_rows(scorer: Any, tokenizer: Any, prompts: list, answers: list[str], conversational: bool) -> list:
    """The ids the reward model reads when GRPO scores ``answers`` generated (each ending with EOS) after ``prompts``:
    GRPO's own decoding of the completion ids, then the scorer as GRPO calls it."""
    ids = [tokenizer(a, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for a in answers]
    width = max(map(len, ids))
    completions = rollout.Completions(
        torch.tensor([row + [tokenizer.pad_token_id] * (width - len(row)) for row in ids]),
        torch.tensor([[1] * len(row) + [0] * (width - len(row)) for row in ids]),
        torch.zeros(len(ids), dtype=torch.bool),
    )
    texts, kept = rollout.decode_completions(tokenizer, completions, conversational)
    recorder = InputRecorder(scorer.model)
    call_reward_functions([scorer], prompts, texts, kept)
    return recorder.rows


@pytest.mark.parametrize("make_tokenizer", [build_tokenizer, bos_tokenizer], ids=["preset", "bos"])
def test_standard_text_is_scored_on_the_ids_the_reward_model_was_trained_on(make_tokenizer):
    tokenizer = make_tokenizer()
    trained = trained_rows(tokenizer, {"prompt": PROMPTS, "chosen": ANSWERS, "rejected": ["43", "13", "101"]})
    scorer = resolve_reward_funcs([reward_model()], [tokenizer])[0]  # GRPO's default
    assert scored_rows(scorer, tokenizer, PROMPTS, ANSWERS, False) == trained
    eos, bos = tokenizer.eos_token_id, tokenizer.bos_token_id
    assert all(row[-1] == eos for row in trained)  # the EOS the training rows end with (hand-checked ids below)
    if make_tokenizer is bos_tokenizer:
        assert all(row[0] == bos for row in trained)
    assert trained[1] == ([bos] if make_tokenizer is bos_tokenizer else []) + [58, 46, 56, 64, 52, 53, 1]  # 7+5=12


@pytest.mark.parametrize("make_tokenizer", [build_tokenizer, bos_tokenizer], ids=["preset", "bos"])
def test_trl_inputs_are_prompt_plus_completion_without_special_tokens(make_tokenizer):
    tokenizer = make_tokenizer()
    scorer = resolve_reward_funcs([reward_model()], [tokenizer], reward_model_inputs="trl")[0]
    expected = [tokenizer(p + a, add_special_tokens=False)["input_ids"] for p, a in zip(PROMPTS, ANSWERS)]
    assert scored_rows(scorer, tokenizer, PROMPTS, ANSWERS, False) == expected  # TRL's GRPOTrainer text and call


@pytest.mark.parametrize("template_kwargs", [None, {"greeting": "hello"}], ids=["plain", "kwargs"])
def test_conversational_text_is_scored_on_the_ids_the_reward_model_was_trained_on(template_kwargs):
    tokenizer = greeting_tokenizer()
    prompts = [[{"role": "user", "content": p}] for p in PROMPTS]
    rows: dict[str, list] = {
        "prompt": prompts,
        "chosen": [[{"role": "assistant", "content": a}] for a in ANSWERS],
        "rejected": [[{"role": "assistant", "content": "0"}]] * 3,
    }
    if template_kwargs:  # the reward data's per-row column, GRPO's module option: the same values
        rows["chat_template_kwargs"] = [template_kwargs] * 3
    trained = trained_rows(tokenizer, rows)
    module = GRPOModule(
        "tiny-64", tokenizer=tokenizer, reward_funcs=[reward_model()], reward_processing_classes=[tokenizer],
        chat_template_kwargs=template_kwargs,
    )  # fmt: skip
    assert scored_rows(module.reward_funcs[0], tokenizer, prompts, ANSWERS, True) == trained
    greeting = tokenizer("<|greeting|>hello\n", add_special_tokens=False)["input_ids"]
    assert (trained[0][: len(greeting)] == greeting) == bool(template_kwargs)  # the variable reached the template


def test_reward_model_inputs_is_checked():
    with pytest.raises(ValueError, match=r"reward_model_inputs='raw'.*'as_trained', 'trl'"):
        GRPOModule("tiny-64", reward_funcs=[reward_model()], reward_model_inputs="raw")
    with pytest.raises(ValueError, match=r"inputs='raw'.*'as_trained', 'trl'"):
        RewardModelScorer(reward_model(), build_tokenizer(), inputs="raw")


# ------------------------------------------------------------------------------------------- against TRL 1.16
def trl_trainer(tmp_path: Any, tokenizer: Any, reward: Any, prompts: list, **config: Any) -> Any:
    from trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(
        output_dir=str(tmp_path), report_to="none", per_device_train_batch_size=3, num_generations=3, use_cpu=True,
        **config,
    )  # fmt: skip
    return GRPOTrainer(
        model=build_preset_model("tiny-64"), reward_funcs=[reward], args=args, processing_class=tokenizer,
        train_dataset=Dataset.from_dict({"prompt": prompts}), reward_processing_classes=[tokenizer],
    )  # fmt: skip


@pytest.mark.slow  # importing trl takes several seconds
def test_as_trained_scores_equal_trl_on_the_text_with_eos(tmp_path):
    """The default scores equal TRL's GRPOTrainer scores of ``prompt + completion + EOS`` (the presets' tokenizer adds
    no special token), and differ from TRL's scores of the text without EOS (so the test sees the EOS)."""
    tokenizer, model = build_tokenizer(), reward_model()
    trainer = trl_trainer(tmp_path, tokenizer, model, PROMPTS)
    ids = [tokenizer(a, add_special_tokens=False)["input_ids"] for a in ANSWERS]
    inputs = [{"prompt": p} for p in PROMPTS]
    with_eos = trainer._calculate_rewards(inputs, PROMPTS, [a + "</s>" for a in ANSWERS], ids).cpu()
    without = trainer._calculate_rewards(inputs, PROMPTS, ANSWERS, ids).cpu()
    ours = call_reward_functions(resolve_reward_funcs([model], [tokenizer]), PROMPTS, ANSWERS, ids)
    assert torch.equal(ours, with_eos)  # the same ids through the same model in one padded pass
    assert (ours - without).abs().min() > 1e-3  # the EOS changes every score


@pytest.mark.slow
def test_chat_template_kwargs_reach_the_reward_model_as_in_trl(tmp_path):
    tokenizer, model = greeting_tokenizer(), reward_model()
    prompts = [[{"role": "user", "content": p}] for p in PROMPTS]
    completions = [[{"role": "assistant", "content": a}] for a in ANSWERS]
    ids = [tokenizer(a, add_special_tokens=False)["input_ids"] for a in ANSWERS]
    options = {"greeting": "hello"}
    trainer = trl_trainer(tmp_path, tokenizer, model, prompts, chat_template_kwargs=options)
    expected = trainer._calculate_rewards([{"prompt": p} for p in prompts], prompts, completions, ids).cpu()
    module = GRPOModule(
        "tiny-64", tokenizer=tokenizer, reward_funcs=[model], reward_processing_classes=[tokenizer],
        chat_template_kwargs=options,
    )  # fmt: skip
    ours = call_reward_functions(module.reward_funcs, prompts, completions, ids)
    assert torch.equal(ours, expected)
    plain = call_reward_functions(resolve_reward_funcs([model], [tokenizer]), prompts, completions, ids)
    assert (ours - plain).abs().min() > 1e-3  # without the option every score differs: the test sees the variable


class PromptSpy:
    """Wraps a model's ``generate``: the unpadded prompt ids of every call."""

    def __init__(self, model: Any) -> None:
        self.inner, self.rows = model.generate, []
        model.generate = self

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        ids, mask = kwargs["input_ids"], kwargs["attention_mask"]
        self.rows.append([row[m.bool()].tolist() for row, m in zip(ids, mask)])
        return self.inner(*args, **kwargs)


@pytest.mark.slow
def test_chat_template_kwargs_render_the_prompts_as_in_trl(tmp_path):
    """Training and validation prompts (conversational, no tools) are rendered with ``chat_template_kwargs``: the ids
    ``generate`` receives equal TRL's ``_tokenize_prompts``."""
    tokenizer, options = greeting_tokenizer(), {"greeting": "hello"}
    prompts = [[{"role": "user", "content": p}] for p in PROMPTS[:2]]
    rows = Dataset.from_dict({"prompt": prompts, "answer": ANSWERS[:2]})
    dm = PromptDataModule(
        tokenizer=tokenizer, dataset=rows, validation_dataset=rows, batch_size=4, max_length=64, sampling="sequential",
    )  # fmt: skip
    module = GRPOModule(
        "tiny-64", tokenizer=tokenizer, reward_funcs=["lit_trainer.rewards.arithmetic_reward"], num_generations=2,
        max_completion_length=2, chat_template_kwargs=options, generation_seed=0,
    )  # fmt: skip
    spy = PromptSpy(module.model)
    trainer = L.Trainer(max_steps=1, **{**QUIET, "limit_val_batches": 1})
    trainer.fit(module, datamodule=dm)
    trainer.validate(module, datamodule=dm, verbose=False)
    reference = trl_trainer(tmp_path, tokenizer, reward_model(), prompts, chat_template_kwargs=options)
    expected = reference._tokenize_prompts(prompts)[0]
    training, validation = spy.rows[0], spy.rows[-1]
    assert training == [list(expected[0])] * 2 + [list(expected[1])] * 2  # 2 prompts x num_generations
    assert validation == [list(e) for e in expected]
    greeting = tokenizer("<|greeting|>hello\n", add_special_tokens=False)["input_ids"]
    assert training[0][: len(greeting)] == greeting
