"""``builtin:subtraction``: the LoRA recipe's new task. Its rows are checked against differences computed here from the
prompts' own operands; it shares the addition task's operand pairs and held-out split; adding it left every existing
built-in dataset byte-for-byte unchanged."""

from __future__ import annotations

import hashlib
import json
import re

import pytest

from lit_trainer.data import builtin
from lit_trainer.data.preference import PreferenceDataModule
from lit_trainer.data.sft import SFTDataModule

_PROMPT = re.compile(r"(\d\d)([+-])(\d\d)=")


def _operands(prompts: list[str], op: str) -> list[tuple[int, int]]:
    pairs = []
    for prompt in prompts:
        match = _PROMPT.fullmatch(prompt)
        assert match and match.group(2) == op, prompt
        pairs.append((int(match.group(1)), int(match.group(3))))
    return pairs


def test_rows_are_the_differences_of_every_operand_pair_once() -> None:
    seen = []
    for split, size in (("train", 7600), ("validation", 500)):
        rows = builtin.subtraction_rows(split)
        pairs = _operands(rows["prompt"], "-")
        assert len(rows) == size
        assert rows["completion"] == rows["answer"] == [str(a - b) for a, b in pairs]
        seen += pairs
    assert sorted(seen) == [(a, b) for a in range(10, 100) for b in range(10, 100)]  # 8,100 problems, each once
    answers = [int(x) for x in builtin.subtraction_rows("train")["answer"]]
    assert min(answers) == -89 and max(answers) == 89 and 0 in answers


def test_held_out_pairs_are_the_addition_tasks_held_out_pairs() -> None:
    """A base trained on addition never saw the operand pairs the subtraction task is scored on."""
    for split in ("train", "validation"):
        addition = _operands(builtin.sft_rows(split)["prompt"], "+")
        assert _operands(builtin.subtraction_rows(split)["prompt"], "-") == addition
    fewer = _operands(builtin.subtraction_rows("validation", num_validation=100)["prompt"], "-")
    assert fewer == _operands(builtin.sft_rows("validation")["prompt"], "+")[:100]  # num_validation follows too


def test_preference_rows_reject_a_near_miss() -> None:
    rows = builtin.subtraction_preference_rows("train")
    pairs = _operands(rows["prompt"], "-")
    assert rows["chosen"] == rows["answer"] == [str(a - b) for a, b in pairs]
    kinds = set()
    for (a, b), rejected in zip(pairs, map(int, rows["rejected"])):
        diff = a - b
        assert rejected != diff
        swapped = (-1 if diff < 0 else 1) * int(str(abs(diff))[::-1])
        kind = {diff + 1: "+1", diff - 1: "-1", diff + 10: "+10", diff - 10: "-10", swapped: "swap", -diff: "sign"}
        assert rejected in kind, (a, b, rejected)
        kinds.add(kind[rejected])
    assert kinds == {"+1", "-1", "+10", "-10", "swap", "sign"}
    assert PreferenceDataModule.builtin["builtin:subtraction"] is builtin.subtraction_preference_rows


def test_existing_builtin_datasets_are_unchanged() -> None:
    digest = hashlib.sha256()
    for split in ("train", "validation"):
        for rows in (builtin.sft_rows, builtin.sft_chat_rows, builtin.preference_rows, builtin.prompt_rows):
            digest.update(json.dumps(rows(split).to_dict(), sort_keys=True).encode())
    assert digest.hexdigest() == "7f469ade2c142fbdeeb95af06743d77df111ed193fc5915c006837f946c6e1b9"


@pytest.mark.parametrize("module", [SFTDataModule, PreferenceDataModule])
def test_loads_through_the_data_modules(tokenizer, module) -> None:
    dm = module(tokenizer=tokenizer, dataset="builtin:subtraction", max_length=32)
    dm.setup("fit")
    assert len(dm.train_dataset) == 7600 and len(dm.val_dataset) == 500
    assert "builtin:subtraction" in builtin.BUILTIN_NAMES
    first = builtin.subtraction_rows("train")[0]  # "13-88=" -> "-75"
    ids = tokenizer(first["prompt"] + first["completion"], add_special_tokens=True)["input_ids"]
    if module is SFTDataModule:
        assert dm.train_dataset[0]["input_ids"] == ids
