"""A scripted tool-using policy for GRPO tool tests: replaces ``model.generate`` with fixed replies chosen from the
context, so tool calls, tool results and final answers are known without training (the model's forward, log-probs and
gradients stay real).

Replies, for the presets' chat format (``<|user|>`` question ``"a+b=?"``, ``<tool_call>{json}</tool_call>`` calls):

* after the user turn, by the prompt's occurrence ``k`` in the batch (the ``k``-th generation of that prompt):
  ``k % 3 == 0`` calls ``add(a, b)``; ``1`` answers ``a + b + 1`` directly (wrong); ``2`` calls ``add`` with a missing
  argument (the tool raises: a failure);
* after a tool result: the result (or ``0`` after an error), then EOS.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from typing import Any

import torch

_QUESTION = re.compile(r"(\d+)\+(\d+)=\?")


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: first
        b: second
    """
    return a + b


def call(arguments: dict[str, int]) -> str:
    return "<tool_call>" + json.dumps({"name": "add", "arguments": arguments}) + "</tool_call></s>"


def reply(context: str, occurrence: int) -> str:
    """The scripted reply to a rendered context (see the module docstring)."""
    turns = context.split("<|")
    last_header = turns[-2] if len(turns) >= 2 else ""
    if last_header.startswith("tool|>"):
        result = last_header[len("tool|>\n") :].rstrip("\n")
        return ("0" if "error" in result else result) + "</s>"
    user = [t for t in turns if t.startswith("user|>")][-1]
    a, b = (int(x) for x in _QUESTION.search(user).groups())
    return [call({"a": a, "b": b}), f"{a + b + 1}</s>", call({"a": a})][occurrence % 3]


def scripted_replies(tokenizer: Any, contexts: list[str], choose: Any = reply) -> list[list[int]]:
    """Each context's reply tokens, ``choose(context, occurrence)`` with ``occurrence`` = how many earlier rows of this
    batch had the same context (a prompt's ``k``-th generation)."""
    seen: Counter = Counter()
    replies = []
    for context in contexts:
        replies.append(tokenizer(choose(context, seen[context]), add_special_tokens=False)["input_ids"])
        seen[context] += 1
    return replies


class AddEnv:
    """An environment whose tool is ``add``: ``reset`` returns :attr:`hint` (appended to the prompt), ``get_reward``
    rewards a call with the right sum."""

    hint = " Use add."

    def reset(self, **row: Any) -> str:
        self.answer, self.result = int(row["answer"]), None
        return self.hint

    def add(self, a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: first
            b: second
        """
        self.result = a + b
        return a + b

    def get_reward(self) -> float:
        return 1.0 if self.result == self.answer else 0.0


class ScriptedGenerate:
    """``model.generate`` replacement (see the module docstring; ``choose`` as :func:`reply`); records each call's
    batch size."""

    def __init__(self, model: Any, tokenizer: Any, choose: Any = reply) -> None:
        self.tokenizer, self.choose, self.calls = tokenizer, choose, []
        model.generate = self

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, generation_config: Any, **_: Any):
        contexts = [self.tokenizer.decode(ids[mask.bool()].tolist()) for ids, mask in zip(input_ids, attention_mask)]
        replies = scripted_replies(self.tokenizer, contexts, self.choose)
        new = [tokens[: generation_config.max_new_tokens] for tokens in replies]
        self.calls.append(len(new))
        width = max(len(t) for t in new)
        pad = generation_config.pad_token_id
        out = torch.full((len(new), width), pad, dtype=torch.long)
        for i, tokens in enumerate(new):
            out[i, : len(tokens)] = torch.tensor(tokens)
        return torch.cat([input_ids, out.to(input_ids.device)], dim=1)


class _ForceReplies:
    """A logits processor that leaves one token possible per row: the next token of the row's reply (EOS after it)."""

    def __init__(self, replies: list[list[int]], start: int, eos: int) -> None:
        self.replies, self.start, self.eos = replies, start, eos

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        step = input_ids.shape[1] - self.start
        forced = torch.full_like(scores, float("-inf"))
        for row, tokens in enumerate(self.replies):
            forced[row, tokens[step] if step < len(tokens) else self.eos] = 0.0
        return forced


class ForcedGenerate:
    """Scripted replies through the model's own ``generate``: every forward runs (under sharded weights each is a
    collective, so ranks generating different numbers of turns must stay in step exactly as with a real policy), and
    a logits processor forces each row's reply, chosen by ``choose(context, occurrence)`` as :func:`reply` chooses.
    ``calls`` records each call's batch size."""

    def __init__(self, model: Any, tokenizer: Any, choose: Any = reply) -> None:
        self.tokenizer, self.choose, self.calls = tokenizer, choose, []
        self.generate = model.generate  # the bound original, kept before the instance attribute replaces it
        model.generate = self

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, generation_config: Any, **kwargs: Any):
        from transformers import LogitsProcessorList

        contexts = [self.tokenizer.decode(ids[mask.bool()].tolist()) for ids, mask in zip(input_ids, attention_mask)]
        replies = scripted_replies(self.tokenizer, contexts, self.choose)
        self.calls.append(len(replies))
        force = _ForceReplies(replies, input_ids.shape[1], self.tokenizer.eos_token_id)
        return self.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            generation_config=generation_config,
            logits_processor=LogitsProcessorList([force]),
            **kwargs,
        )


class ScriptedGenerateBatch:
    """``model.generate_batch`` replacement (transformers' continuous-batching entry point) with the replies of
    :class:`ScriptedGenerate`: gets unpadded token lists, returns ``{request_id: output}`` whose outputs carry
    ``generated_tokens``; records each call's inputs."""

    def __init__(self, model: Any, tokenizer: Any) -> None:
        self.tokenizer, self.calls = tokenizer, []
        model.generate_batch = self

    def __call__(self, inputs: list[list[int]], generation_config: Any, **_: Any) -> dict[str, Any]:
        from types import SimpleNamespace

        self.calls.append([list(ids) for ids in inputs])
        replies = scripted_replies(self.tokenizer, [self.tokenizer.decode(ids) for ids in inputs])
        outputs = {}
        for k, tokens in enumerate(replies):
            outputs[f"req_{k}"] = SimpleNamespace(generated_tokens=tokens[: generation_config.max_new_tokens])
        return outputs
