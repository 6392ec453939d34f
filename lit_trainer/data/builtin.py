"""The embedded default task: two-digit addition, generated deterministically (no download); and a second task on the
same operands, two-digit subtraction, for adapting a trained addition model (``configs/sft_lora.yaml``).

Every problem ``"a+b="`` with ``a, b`` in ``[10, 99]`` (8,100 problems) is shuffled once with a fixed seed; the first
``num_validation`` problems are held out and never appear in training. The same problems serve three formats:

* SFT rows: ``prompt="37+45="``, ``completion="82"``, ``answer="82"``;
* chat SFT rows (``builtin:addition_chat``): ``messages`` = a system turn, user ``"37+45=?"``, assistant ``"82"``
  (every fourth row asks an earlier problem first: two question/answer turns);
* preference rows (DPO): the same prompt, ``chosen`` = the correct sum, ``rejected`` = a near miss (off by 1, 10 or
  a swapped digit), chosen deterministically per problem;
* prompt rows (GRPO): ``prompt`` and ``answer`` for a correctness reward.

``builtin:tool_multiplication`` and ``builtin:tool_addition`` are tool-use tasks on the same four-digit operand pairs
(``"5821*7377=?"`` with a :func:`multiply` tool, ``"5821+7377=?"`` with an :func:`add` tool). The tiny presets cannot
multiply such numbers; they can learn some four-digit addition given enough steps (measured: 41% of held-out sums
after 1,200 SFT steps at one seed), which is why the GRPO tool recipe uses the products. Their chat SFT rows
(``builtin:tool_multiplication_chat``, ``builtin:tool_addition_chat``) are transcripts in which one row in
``tool_every`` calls the tool (assistant ``<tool_call>`` turn, ``tool`` result, assistant answer) and the others answer
directly; their prompt rows (GRPO) are the user turn and the ``answer``. Every chat row carries the tool's schema in
a ``tools`` column (JSON), as the GRPO prompts are rendered with it.

``builtin:subtraction`` asks ``"a-b="`` of the same shuffled operand pairs, with the same held-out split (a pair
held out of addition is held out of subtraction too): ``completion = answer = str(a - b)``, negative when ``a < b``
(``"37-45="`` -> ``"-8"``). Its preference rows reject a near miss of the difference (off by one, off by ten, its
digits swapped, or its sign flipped).
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from typing import Literal

from datasets import Dataset
from transformers.utils import get_json_schema

Split = Literal["train", "validation"]
BUILTIN_NAMES: tuple[str, ...] = (
    "builtin:addition",
    "builtin:addition_chat",
    "builtin:subtraction",
    "builtin:tool_addition",
    "builtin:tool_addition_chat",
    "builtin:tool_multiplication",
    "builtin:tool_multiplication_chat",
    "builtin:shapes",  # the image task (lit_trainer.data.builtin_shapes), for the tiny-vl preset
)
CHAT_SYSTEM = "Add the numbers."
_SEED = 1234


def addition_problems(
    split: Split, *, num_validation: int = 500, low: int = 10, high: int = 99
) -> list[tuple[int, int]]:
    """The ``(a, b)`` operand pairs of one split, in a fixed shuffled order.

    Raises:
        ValueError: for an unknown split or a ``num_validation`` that leaves no training problem.
    """
    problems = [(a, b) for a in range(low, high + 1) for b in range(low, high + 1)]
    if not 0 < num_validation < len(problems):
        raise ValueError(f"`num_validation={num_validation}` is invalid: it must be in [1, {len(problems) - 1}].")
    random.Random(_SEED).shuffle(problems)
    if split == "validation":
        return problems[:num_validation]
    if split == "train":
        return problems[num_validation:]
    raise ValueError(f"Unknown split {split!r}: use 'train' or 'validation'.")


def near_miss(a: int, b: int) -> int:
    """A plausible wrong sum for ``a + b`` (deterministic per problem): off by one, off by ten, or digits swapped."""
    total = a + b
    options = [total + 1, total - 1, total + 10, total - 10]
    swapped = int(str(total)[::-1])
    if swapped != total:
        options.append(swapped)
    return options[(a * 31 + b) % len(options)]


def near_miss_difference(a: int, b: int) -> int:
    """A plausible wrong difference for ``a - b`` (deterministic per problem): off by one, off by ten, its digits
    swapped (sign kept) or its sign flipped."""
    diff = a - b
    options = [diff + 1, diff - 1, diff + 10, diff - 10]
    sign = -1 if diff < 0 else 1
    for wrong in (sign * int(str(abs(diff))[::-1]), -diff):
        if wrong != diff:
            options.append(wrong)
    return options[(a * 31 + b) % len(options)]


def sft_rows(split: Split, num_validation: int = 500) -> Dataset:
    """Prompt/completion rows (loss on the completion only)."""
    problems = addition_problems(split, num_validation=num_validation)
    return Dataset.from_dict(
        {
            "prompt": [f"{a}+{b}=" for a, b in problems],
            "completion": [str(a + b) for a, b in problems],
            "answer": [str(a + b) for a, b in problems],
        }
    )


def subtraction_rows(split: Split, num_validation: int = 500) -> Dataset:
    """Prompt/completion rows of ``builtin:subtraction``: ``"a-b="`` -> ``str(a - b)`` on the addition split's pairs."""
    problems = addition_problems(split, num_validation=num_validation)
    return Dataset.from_dict(
        {
            "prompt": [f"{a}-{b}=" for a, b in problems],
            "completion": [str(a - b) for a, b in problems],
            "answer": [str(a - b) for a, b in problems],
        }
    )


def subtraction_preference_rows(split: Split, num_validation: int = 500) -> Dataset:
    """Prompt/chosen/rejected rows of ``builtin:subtraction``: chosen is the difference, rejected a near miss."""
    problems = addition_problems(split, num_validation=num_validation)
    return Dataset.from_dict(
        {
            "prompt": [f"{a}-{b}=" for a, b in problems],
            "chosen": [str(a - b) for a, b in problems],
            "rejected": [str(near_miss_difference(a, b)) for a, b in problems],
            "answer": [str(a - b) for a, b in problems],
        }
    )


def _turn(a: int, b: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"{a}+{b}=?"}, {"role": "assistant", "content": str(a + b)}]


def sft_chat_rows(split: Split, num_validation: int = 500) -> Dataset:
    """Conversations (``messages`` rows): a system turn, then one question and its answer; every fourth row has
    the previous problem as an earlier question/answer turn (multi-turn). ``answer`` is the last answer."""
    problems = addition_problems(split, num_validation=num_validation)
    conversations = []
    for i, (a, b) in enumerate(problems):
        earlier = _turn(*problems[i - 1]) if i % 4 == 3 else []
        conversations.append([{"role": "system", "content": CHAT_SYSTEM}, *earlier, *_turn(a, b)])
    return Dataset.from_dict({"messages": conversations, "answer": [str(a + b) for a, b in problems]})


def preference_rows(split: Split, num_validation: int = 500) -> Dataset:
    """Prompt/chosen/rejected rows: chosen is the correct sum, rejected a near miss."""
    problems = addition_problems(split, num_validation=num_validation)
    return Dataset.from_dict(
        {
            "prompt": [f"{a}+{b}=" for a, b in problems],
            "chosen": [str(a + b) for a, b in problems],
            "rejected": [str(near_miss(a, b)) for a, b in problems],
            "answer": [str(a + b) for a, b in problems],
        }
    )


def prompt_rows(split: Split, num_validation: int = 500) -> Dataset:
    """Prompt rows with the correct ``answer`` column, for reward functions."""
    problems = addition_problems(split, num_validation=num_validation)
    return Dataset.from_dict(
        {
            "prompt": [f"{a}+{b}=" for a, b in problems],
            "answer": [str(a + b) for a, b in problems],
        }
    )


# ------------------------------------------------------------------------------------------------ tool tasks
def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: first
        b: second
    """
    return int(a) + int(b)


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: first
        b: second
    """
    return int(a) * int(b)


ToolOperation = Literal["add", "multiply"]
_TOOL_OPERATIONS: dict[str, tuple[str, Callable[[int, int], int]]] = {"add": ("+", add), "multiply": ("*", multiply)}


def tool_addition_problems(split: Split, *, num_validation: int = 200, count: int = 4000) -> list[tuple[int, int]]:
    """``count`` four-digit operand pairs in ``[5000, 9999]`` (so every sum has five digits and every product eight),
    seeded; the first ``num_validation`` are held out. Both tool tasks ask the same pairs.

    Raises:
        ValueError: for an unknown split or a ``num_validation`` outside ``[1, count - 1]``.
    """
    if not 0 < num_validation < count:
        raise ValueError(f"`num_validation={num_validation}` is invalid: it must be in [1, {count - 1}].")
    rng = random.Random(_SEED + 1)
    problems = [(rng.randint(5000, 9999), rng.randint(5000, 9999)) for _ in range(count)]
    if split == "validation":
        return problems[:num_validation]
    if split == "train":
        return problems[num_validation:]
    raise ValueError(f"Unknown split {split!r}: use 'train' or 'validation'.")


def _tools_json(operation: ToolOperation = "add") -> str:
    return json.dumps([get_json_schema(_TOOL_OPERATIONS[operation][1])])


def _question(a: int, b: int, operation: ToolOperation) -> str:
    return f"{a}{_TOOL_OPERATIONS[operation][0]}{b}=?"


def tool_call_transcript(a: int, b: int, operation: ToolOperation = "add") -> list[dict]:
    """A tool-use conversation: the question, a call of the operation's tool, its result, the answer."""
    result = str(_TOOL_OPERATIONS[operation][1](a, b))
    call = {"type": "function", "function": {"name": operation, "arguments": {"a": a, "b": b}}}
    return [
        {"role": "user", "content": _question(a, b, operation), "tool_calls": None, "name": None},
        {"role": "assistant", "content": "", "tool_calls": [call], "name": None},
        {"role": "tool", "content": result, "tool_calls": None, "name": operation},
        {"role": "assistant", "content": result, "tool_calls": None, "name": None},
    ]


def tool_chat_rows(
    split: Split, operation: ToolOperation = "add", num_validation: int = 200, tool_every: int = 2
) -> Dataset:
    """Chat SFT transcripts of a tool task: one row in ``tool_every`` calls the operation's tool (:func:`add` or
    :func:`multiply`), the others answer directly (the correct result); ``answer`` is the result, ``tools`` the
    tool's schema (JSON)."""
    problems = tool_addition_problems(split, num_validation=num_validation)
    tool = _TOOL_OPERATIONS[operation][1]
    conversations = []
    for i, (a, b) in enumerate(problems):
        transcript = tool_call_transcript(a, b, operation)
        conversations.append(transcript if i % tool_every == 0 else transcript[:1] + transcript[3:])
    tools = _tools_json(operation)
    return Dataset.from_dict(
        {
            "messages": conversations,
            "answer": [str(tool(a, b)) for a, b in problems],
            "tools": [tools] * len(problems),
        }
    )


def tool_prompt_rows(split: Split, operation: ToolOperation = "add", num_validation: int = 200) -> Dataset:
    """GRPO prompt rows of a tool task: the user turn and the correct ``answer``."""
    problems = tool_addition_problems(split, num_validation=num_validation)
    tool = _TOOL_OPERATIONS[operation][1]
    return Dataset.from_dict(
        {
            "prompt": [[{"role": "user", "content": _question(a, b, operation)}] for a, b in problems],
            "answer": [str(tool(a, b)) for a, b in problems],
        }
    )


def tool_addition_chat_rows(split: Split, num_validation: int = 200, tool_every: int = 2) -> Dataset:
    """``builtin:tool_addition_chat``: :func:`tool_chat_rows` of the sums."""
    return tool_chat_rows(split, "add", num_validation, tool_every)


def tool_addition_prompt_rows(split: Split, num_validation: int = 200) -> Dataset:
    """``builtin:tool_addition``: :func:`tool_prompt_rows` of the sums."""
    return tool_prompt_rows(split, "add", num_validation)


def tool_multiplication_chat_rows(split: Split, num_validation: int = 200, tool_every: int = 2) -> Dataset:
    """``builtin:tool_multiplication_chat``: :func:`tool_chat_rows` of the products."""
    return tool_chat_rows(split, "multiply", num_validation, tool_every)


def tool_multiplication_prompt_rows(split: Split, num_validation: int = 200) -> Dataset:
    """``builtin:tool_multiplication``: :func:`tool_prompt_rows` of the products."""
    return tool_prompt_rows(split, "multiply", num_validation)
