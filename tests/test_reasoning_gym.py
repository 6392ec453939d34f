"""``reasoning_gym:<task>`` data sources and the verifier reward (lit_trainer.data.reasoning_gym, rewards).

The rows are reasoning-gym's own problems (``reasoning_gym.create_dataset``), compared here with the package called
directly; the verifier's scores are checked on answers whose value is known by hand (chain_sum: the expression's
value). The recipes that use them (configs/smollm2_*.yaml) parse, with and without the LoRA overlay.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import reasoning_gym
import torch
import yaml

from lit_trainer.cli import LitTrainerCLI
from lit_trainer.data import PreferenceDataModule, PromptDataModule, SFTDataModule
from lit_trainer.data.reasoning_gym import parse_source, problems, rows, score_answer, wrong_answer
from lit_trainer.data.unpaired import UnpairedPreferenceDataModule
from lit_trainer.rewards import call_reward_functions, reasoning_gym_reward

SOURCE = "reasoning_gym:chain_sum?min_terms=2&max_terms=2&min_digits=2&max_digits=2&size=40&validation_size=10"
CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def test_parse_source_splits_the_task_its_options_and_ours():
    task, options, ours = parse_source("reasoning_gym:chain_sum?max_terms=3&size=100&seed=7&allow_negation=true")
    assert task == "chain_sum"
    assert options == {"max_terms": 3, "allow_negation": True}
    assert ours == {"size": 100, "validation_size": 200, "seed": 7}
    assert parse_source("reasoning_gym:leg_counting") == (
        "leg_counting",
        {},
        {"size": 2000, "validation_size": 200, "seed": 1},
    )


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("reasoning_gym:", "names no task"),
        ("reasoning_gym:chain_sum?size=3&size=4", "gives an option twice"),
        ("reasoning_gym:no_such_task", "has no task 'no_such_task'"),
        ("reasoning_gym:chain_sum?no_such_option=1", "does not take these options"),
    ],
)
def test_bad_sources_are_named(source, message):
    with pytest.raises(ValueError, match=message):
        problems(source, "train")


def test_the_problems_are_reasoning_gyms_and_the_validation_split_is_held_out():
    direct = list(
        reasoning_gym.create_dataset("chain_sum", size=10, seed=2, min_terms=2, max_terms=2, min_digits=2, max_digits=2)
    )
    validation = problems(SOURCE, "validation")
    assert [e["question"] for e in validation] == [e["question"] for e in direct]  # validation: seed + 1
    train = problems(SOURCE, "train")
    assert 0 < len(train) <= 40
    assert not {e["question"] for e in train} & {e["question"] for e in validation}
    for entry in train + validation:  # the answer is the expression's value
        assert int(entry["answer"]) == eval(entry["metadata"]["expression"])


def test_rows_in_each_data_module_format():
    first = problems(SOURCE, "validation")[0]
    sft = rows(SOURCE, "validation", "sft")[0]
    assert sft["messages"] == [
        {"role": "user", "content": first["question"]},
        {"role": "assistant", "content": first["answer"]},
    ]
    prompt = rows(SOURCE, "validation", "prompt")[0]
    assert prompt["prompt"] == [{"role": "user", "content": first["question"]}] and prompt["answer"] == first["answer"]
    assert json.loads(prompt["rg_entry"])["metadata"]["expression"] == first["metadata"]["expression"]
    pairs = rows(SOURCE, "validation", "preference")
    for pair, entry in zip(pairs, problems(SOURCE, "validation")):
        assert pair["chosen"] == [{"role": "assistant", "content": entry["answer"]}]
        rejected = int(pair["rejected"][0]["content"])  # a near miss of an integer answer
        assert 1 <= abs(rejected - int(entry["answer"])) <= 10
    assert rows(SOURCE, "validation", "preference")["rejected"] == pairs["rejected"]  # the same pairs every time


def test_a_wrong_answer_that_is_not_a_number_is_another_problems_answer():
    entries = problems("reasoning_gym:spell_backward?size=5&validation_size=3", "validation")
    for index, entry in enumerate(entries):
        wrong = wrong_answer(entries, index, seed=1)
        assert wrong != entry["answer"] and wrong in {e["answer"] for e in entries}
        assert score_answer(wrong, entry) < 1.0


def test_the_verifier_scores_hand_checked_answers():
    entry = problems(SOURCE, "validation")[0]
    value = eval(entry["metadata"]["expression"])
    assert score_answer(str(value), entry) == 1.0
    assert score_answer(str(value + 1), json.dumps(entry)) == 0.0


def test_reasoning_gym_reward_scores_text_and_conversational_completions():
    entries = problems(SOURCE, "validation")[:2]
    right, other = (str(eval(e["metadata"]["expression"])) for e in entries)
    column = [json.dumps(e) for e in entries] + [None]
    completions = [f" {right}\n", [{"role": "assistant", "content": str(int(other) + 3)}], "7"]
    assert reasoning_gym_reward(["p"] * 3, completions, [[]] * 3, rg_entry=column) == [1.0, 0.0, None]
    matrix = call_reward_functions([reasoning_gym_reward], ["p"] * 2, [right, "x"], [[], []], {"rg_entry": column[:2]})
    assert torch.equal(matrix, torch.tensor([[1.0], [0.0]]))
    with pytest.raises(ValueError, match="rg_entry"):
        reasoning_gym_reward(["p"], ["1"], [[]], answer=["1"])


@pytest.mark.parametrize("module", [SFTDataModule, PromptDataModule, PreferenceDataModule])
def test_the_data_modules_read_a_reasoning_gym_source(module):
    data = module(tokenizer="tiny", dataset=SOURCE, batch_size=4, max_length=128)
    data.setup("fit")
    assert len(data.val_dataset) == 10 and 0 < len(data.train_dataset) <= 40
    if module is PromptDataModule:  # its loader needs a GRPO module; the reward's column is kept for it
        assert {"prompt_input_ids", "answer", "rg_entry"} <= set(data.train_dataset.column_names)
    else:
        batch = next(iter(data.train_dataloader()))
        rows_per_example = 2 if module is PreferenceDataModule else 1  # a pair is its chosen and its rejected row
        assert batch["input_ids"].shape[0] == 4 * rows_per_example and batch["num_items_in_batch"].sum() > 0


def test_a_data_module_without_such_rows_says_so():
    data = UnpairedPreferenceDataModule(tokenizer="tiny", dataset=SOURCE, batch_size=4)
    with pytest.raises(ValueError, match="does not read reasoning-gym tasks"):
        data.setup("fit")


def _printed(args: list[str], capsys) -> dict:
    with pytest.raises(SystemExit) as exit_info:
        LitTrainerCLI(args=["fit", *args, "--print_config"])
    assert exit_info.value.code in (None, 0)
    return yaml.safe_load(capsys.readouterr().out)


@pytest.mark.parametrize("stage", ["sft", "dpo", "grpo"])
def test_the_lora_overlay_adds_adapters_to_each_stage_and_keeps_the_rest(stage, capsys):
    config = str(CONFIGS / f"smollm2_{stage}.yaml")
    full = _printed(["--config", config], capsys)
    lora = _printed(["--config", config, "--config", str(CONFIGS / "overlays" / "smollm2_lora.yaml")], capsys)
    assert full["model"]["init_args"].get("peft_config") is None
    assert lora["model"]["init_args"]["peft_config"] == {"r": 16, "lora_alpha": 32, "target_modules": "all-linear"}
    assert lora["model"]["class_path"] == full["model"]["class_path"]
    assert lora["data"] == full["data"] and lora["trainer"]["max_steps"] == full["trainer"]["max_steps"]
    export = next(c for c in lora["trainer"]["callbacks"] if c["class_path"].endswith("HFExport"))
    assert export["init_args"]["merge_adapters"] is True  # the next stage loads the export as a plain model
