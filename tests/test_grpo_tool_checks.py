"""GRPO tools and environments are checked when the module is built, before any model or data setup: a tool whose
schema transformers cannot write (no docstring, an argument without a type hint) is refused naming the function, an
environment without tools is named, and a class without ``reset`` is told about the tools too.

The tool-result texts of failed calls are TRL 1.16's (``trl/trainer/grpo_trainer.py``, ``_tool_call_loop``); the
rollouts' tokens are compared with TRL's own in ``test_grpo_tools_trl.py``.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest

from helpers.tool_policy import AddEnv, add
from lit_trainer.generation.agentic.tools import ToolStats, parse_tool_calls, run_tool_turns
from lit_trainer.modules.grpo import GRPOModule
from lit_trainer.rewards import arithmetic_reward


def undocumented(a: int, b: int) -> int:
    return a + b


def unhinted(a, b: int) -> int:
    """Add two integers.

    Args:
        a: first
        b: second
    """
    return a + b


def no_args_section(a: int) -> int:
    """Return a."""
    return a


class UndocumentedEnv(AddEnv):
    def multiply(self, a: int, b: int) -> int:
        return a * b


class RewardOnlyEnv:
    """Makes the prompt and scores it, with no tool of its own."""

    def reset(self, **row: Any) -> str:
        return " Answer."

    def get_reward(self) -> float:
        return 1.0

    def _helper(self) -> None:  # private: not a tool
        pass


class Empty:
    pass


def grpo(**kwargs: Any) -> GRPOModule:
    return GRPOModule("tiny-64", reward_funcs=[arithmetic_reward], **kwargs)


@pytest.mark.parametrize(
    ("tool", "message"),
    [
        (undocumented, r"'undocumented'.*has no docstring"),
        (unhinted, r"'unhinted'.*Argument a is missing a type hint"),
        (no_args_section, r"'no_args_section'.*no description for the argument 'a'"),
    ],
)
def test_a_tool_transformers_cannot_describe_is_refused_at_construction(tool, message):
    with pytest.raises(ValueError, match=rf"(?s)Tool {message}.*type hint on every argument.*docstring.*Args:"):
        grpo(tools=[add, tool])


def test_an_environment_method_transformers_cannot_describe_is_refused_naming_the_class():
    with pytest.raises(ValueError, match=r"(?s)Tool 'UndocumentedEnv.multiply' \(a method of environment "):
        grpo(environment_factory=UndocumentedEnv)
    with pytest.raises(ValueError, match=r"UndocumentedEnv.multiply"):
        grpo(environment_factory={"fine": AddEnv, "bad": UndocumentedEnv})


def test_an_environment_without_tool_methods_is_named_unless_tools_are_given():
    with pytest.warns(UserWarning, match=r"(?s)RewardOnlyEnv.*no public method besides `reset` and `get_reward`"):
        grpo(environment_factory=RewardOnlyEnv)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # standalone tools: its rollouts have a tool to call
        grpo(environment_factory=RewardOnlyEnv, tools=[add])
        grpo(environment_factory=AddEnv)


def test_a_class_with_no_methods_is_told_about_reset_and_the_tools():
    with pytest.raises(ValueError, match=r"(?s)Empty.*no `reset` method.*public methods.*tools"):
        grpo(environment_factory=Empty)


def test_failed_calls_read_as_trls_error_texts():
    calls = [
        {"type": "function", "function": {"name": "nope", "arguments": {}}},
        {"type": "function", "function": {"name": "add", "arguments": [1, 2]}},
        {"type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}},
        {"type": "retrieval", "name": "search"},
    ]
    stats = ToolStats(per_row=[0])
    (results,) = run_tool_turns([(calls, {"add": add})], stats, [0])
    where = f"{add.__module__}.{add.__qualname__}"  # Python's TypeError of `add(**arguments)`, as TRL calls it
    assert [m["content"] for m in results] == [
        str({"error": "Tool nope not found."}),
        str({"error": f"{where}() argument after ** must be a mapping, not list"}),
        str({"error": f"{where}() argument after ** must be a mapping, not str"}),
        str({"error": "Unsupported tool call type: retrieval"}),
    ]
    assert [m["name"] for m in results] == ["nope", "add", "add", "search"] and stats.failures == 4
    # the fallback parser keeps non-object arguments as written (the response templates do), so they fail the same way
    assert parse_tool_calls('<tool_call>{"name": "add", "arguments": []}</tool_call>')[1][0]["function"] == {
        "name": "add",
        "arguments": [],
    }
