"""Built-in reward functions and call_reward_functions (None -> NaN, errors that name the function)."""

from __future__ import annotations

import functools
import math

import pytest
import torch

from lit_trainer.rewards import (
    RewardFunctionError,
    arithmetic_reward,
    call_reward_functions,
    format_reward,
    reward_function_name,
)

PROMPTS = ["37+45=", "37+45=", "10+10=", "10+10="]
COMPLETIONS = ["82", " 81 ", "20\n", "twenty"]
IDS = [[59, 53], [35, 59, 52, 35], [53, 51, 13], [1]]


def test_arithmetic_reward() -> None:
    # "82" == "82"; "81" != "82"; "20\n".strip() == "20"; "twenty" != "20"
    assert arithmetic_reward(PROMPTS, COMPLETIONS, IDS, answer=[82, 82, "20", 20]) == [1.0, 0.0, 1.0, 0.0]


def test_arithmetic_reward_conversational_and_missing_column() -> None:
    conv = [[{"role": "assistant", "content": " 82"}]]
    assert arithmetic_reward(["37+45="], conv, [[]], answer=["82"]) == [1.0]
    with pytest.raises(ValueError, match="`answer` column"):
        arithmetic_reward(PROMPTS, COMPLETIONS, IDS)


def test_format_reward() -> None:
    completions = ["82", " -7 ", "+3", "8 2", "82.0", "", "x1"]
    assert format_reward([""] * 7, completions, [[]] * 7) == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0]


def test_call_reward_functions_matrix_and_none() -> None:
    seen = {}

    def only_first_two(prompts, completions, completion_ids, answer, level, **kwargs):
        seen.update(kwargs, answer=answer, level=level, ids=completion_ids)
        return [0.5, None, None, None][: len(completions)] if len(completions) == 4 else []

    funcs = [arithmetic_reward, format_reward, only_first_two]
    columns = {"answer": [82, 82, 20, 20], "level": ["easy"] * 4}
    rewards = call_reward_functions(funcs, PROMPTS, COMPLETIONS, IDS, columns, extra_kwargs={"trainer_state": 7})
    assert rewards.shape == (4, 3) and rewards.dtype == torch.float32
    expected = torch.tensor([[1, 1, 0.5], [0, 1, math.nan], [1, 1, math.nan], [0, 0, math.nan]])
    torch.testing.assert_close(rewards, expected, equal_nan=True, atol=0, rtol=0)  # small integers and 0.5: exact
    assert seen["answer"] == [82, 82, 20, 20] and seen["level"] == ["easy"] * 4
    assert seen["ids"] == IDS and seen["trainer_state"] == 7


def test_raising_function_is_named_and_chained() -> None:
    def broken_reward(prompts, completions, completion_ids, **kwargs):
        raise KeyError("solution")

    with pytest.raises(RewardFunctionError, match="`broken_reward` raised KeyError") as info:
        call_reward_functions([format_reward, broken_reward], PROMPTS, COMPLETIONS, IDS)
    assert isinstance(info.value.__cause__, KeyError)
    # the built-in without its column is named too
    with pytest.raises(RewardFunctionError, match="`arithmetic_reward` raised ValueError.*answer"):
        call_reward_functions([arithmetic_reward], PROMPTS, COMPLETIONS, IDS)


@pytest.mark.parametrize(
    ("returned", "match"),
    [
        ([1.0, 2.0], "`short_reward` returned 2 values for 4 completions"),
        (3.0, "`short_reward` returned float"),
        ([1.0, "good", 0.0, 0.0], "`short_reward` returned 'good' for row 1"),
    ],
)
def test_bad_return_is_named(returned, match: str) -> None:
    def short_reward(prompts, completions, completion_ids, **kwargs):
        return returned

    with pytest.raises(RewardFunctionError, match=match):
        call_reward_functions([short_reward], PROMPTS, COMPLETIONS, IDS)


def test_names_and_input_validation() -> None:
    class Scorer:
        def __call__(self, prompts, completions, completion_ids, **kwargs):
            return [1.0] * len(completions)

    partial = functools.partial(arithmetic_reward, answer=[1])
    assert reward_function_name(partial) == "arithmetic_reward"
    assert reward_function_name(Scorer()) == "Scorer"
    assert call_reward_functions([Scorer()], PROMPTS, COMPLETIONS, IDS).sum().item() == 4.0
    with pytest.raises(ValueError, match="empty"):
        call_reward_functions([], PROMPTS, COMPLETIONS, IDS)
    with pytest.raises(ValueError, match="`completions` clashes"):
        call_reward_functions([format_reward], PROMPTS, COMPLETIONS, IDS, {"completions": [1] * 4})
    with pytest.raises(ValueError, match="Column `answer` has 2 values"):
        call_reward_functions([format_reward], PROMPTS, COMPLETIONS, IDS, {"answer": [1, 2]})
    with pytest.raises(ValueError, match="3 prompts"):
        call_reward_functions([format_reward], PROMPTS[:3], COMPLETIONS, IDS)
