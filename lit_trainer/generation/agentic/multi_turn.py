"""Multi-turn GRPO rollouts with tools, batched: every rollout of a round advances together.

One round (:func:`multi_turn_rollouts`):

1. all rows generate their first assistant turn in one batched ``generate`` (prompts rendered with the tools' schemas);
2. each turn is parsed (:func:`~lit_trainer.generation.agentic.tools.parse_assistant_turn`); the rows whose
   turn calls tools run them (:func:`~lit_trainer.generation.agentic.tools.run_tool_turns`: async tools of all
   rows awaited together), and the tokens of
   the tool messages plus the next assistant header (:func:`~lit_trainer.generation.agentic.tools.tool_suffix_ids`)
   are appended to the row;
3. those rows generate their next turn together, in one batched ``generate`` on ``prompt + completion so far``
   (left-padded, no re-tokenisation of what was generated), and step 2 repeats, at most ``max_iterations`` times.

A row's completion is everything after its prompt: generated tokens and tool-result tokens, in order. The
``completion_mask`` of the loss marks the generated tokens only (TRL's ``completion_mask * tool_mask``): tool results
are in the sequence, so the model conditions on them, but get no loss, no advantage and no place in the token
normaliser. ``attention_mask`` marks all of them. ``max_completion_length`` bounds the whole completion: a tool result
that would pass it is dropped and the row stops there (its messages roll back); a continuation is cut to what is left.

Under sharded weights every ``generate`` is a collective, so the ranks agree (``any_rank``) on whether another turn
runs, and a rank with no row that calls a tool generates one throwaway row to keep in step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lit_trainer.generation.agentic.tools import ToolStats, parse_assistant_turn, run_tool_turns, tool_suffix_ids

Generate = Callable[[list[list[int]], int], list[list[int]]]
"""``generate(token lists, max_new_tokens) -> kept ids per row`` (cut after the first EOS, EOS included)."""


@dataclass
class MultiTurnRollouts:
    """The completions of one round, right-padded.

    Attributes:
        completion_ids: (R, C) tokens after each prompt (generated and tool results), pad after the end.
        completion_mask: (R, C) 1 on generated tokens (the loss mask).
        attention_mask: (R, C) 1 on every token of the completion (generated and tool results).
        truncated: (R,) True when the completion does not end with an EOS.
        messages: per row, the assistant and tool messages of the completion (what reward functions get).
        stats: tool calls and failures of the round.
    """

    completion_ids: Tensor
    completion_mask: Tensor
    attention_mask: Tensor
    truncated: Tensor
    messages: list[list[dict[str, Any]]]
    stats: ToolStats


def multi_turn_rollouts(
    generate: Generate,
    tokenizer: Any,
    prompts: Sequence[list[int]],
    tools: Sequence[dict[str, Callable[..., Any]]],
    *,
    max_completion_length: int,
    max_iterations: int,
    eos_ids: Sequence[int],
    pad_token_id: int,
    any_rank: Callable[[bool], bool] = bool,
    chat_template_kwargs: dict | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> MultiTurnRollouts:
    """Generate, call tools and continue, for every row at once (see the module docstring).

    Args:
        generate: the batched generation (:data:`Generate`).
        tokenizer: renders the tool messages and parses the turns.
        prompts: per row, the prompt ids (no padding).
        tools: per row, ``{name: callable}`` the row's turns may call.
        max_completion_length: bound of each row's completion (generated and tool tokens).
        max_iterations: tool rounds at most (``max_tool_calling_iterations``).
        eos_ids: ids that end a turn.
        pad_token_id: padding of the returned ids.
        any_rank: True when the argument is True on any rank (identity on one process).
        chat_template_kwargs: extra ``apply_chat_template`` keywords for the tool messages.
        should_stop: a stop request (a signal): checked before each tool turn, and the loop ends when it is True on
            any rank (the caller drops the round); ``generate`` stops its own calls with it.
    """
    rows = len(prompts)
    stats = ToolStats(per_row=[0] * rows)
    schemas = [list(t.values()) for t in tools]
    first = generate([list(p) for p in prompts], max_completion_length)
    sequences = [ids[:max_completion_length] for ids in first]
    model_mask = [[1] * len(ids) for ids in sequences]
    messages = [[parse_assistant_turn(tokenizer, ids, list(p), s)] for ids, p, s in zip(sequences, prompts, schemas)]
    calling = [i for i in range(rows) if messages[i][-1].get("tool_calls")]
    for _ in range(max_iterations):
        if should_stop is not None and any_rank(should_stop()):
            break  # no tool runs for a round that is dropped
        continuing = []
        turns = [(messages[i][-1]["tool_calls"], tools[i]) for i in calling]
        for i, results in zip(calling, run_tool_turns(turns, stats, calling)):
            suffix = tool_suffix_ids(tokenizer, results, chat_template_kwargs)
            if len(sequences[i]) + len(suffix) > max_completion_length:
                continue  # the result does not fit: the row ends with its tool-calling turn
            messages[i].extend(results)
            sequences[i] = sequences[i] + suffix
            model_mask[i] = model_mask[i] + [0] * len(suffix)
            continuing.append(i)
        if not any_rank(bool(continuing)):
            break
        inputs = [list(prompts[i]) + sequences[i] for i in continuing] or [list(prompts[0])]  # a throwaway row
        budget = max([max_completion_length - len(sequences[i]) for i in continuing] or [1])
        new = generate(inputs, max(budget, 1))
        calling = []
        for i, ids in zip(continuing, new):
            ids = ids[: max_completion_length - len(sequences[i])]
            if not ids:
                continue
            prefix = list(prompts[i]) + sequences[i]
            sequences[i] = sequences[i] + ids
            model_mask[i] = model_mask[i] + [1] * len(ids)
            messages[i].append(parse_assistant_turn(tokenizer, ids, prefix, schemas[i]))
            if messages[i][-1].get("tool_calls"):
                calling.append(i)
    return _pack(sequences, model_mask, messages, stats, eos_ids, pad_token_id)


def _pack(
    sequences: list[list[int]],
    model_mask: list[list[int]],
    messages: list[list[dict[str, Any]]],
    stats: ToolStats,
    eos_ids: Sequence[int],
    pad_token_id: int,
) -> MultiTurnRollouts:
    width = max(1, max(len(s) for s in sequences))
    ids = torch.full((len(sequences), width), pad_token_id, dtype=torch.long)
    loss_mask = torch.zeros_like(ids)
    attention = torch.zeros_like(ids)
    for i, (seq, mask) in enumerate(zip(sequences, model_mask)):
        ids[i, : len(seq)] = torch.as_tensor(seq, dtype=torch.long)
        loss_mask[i, : len(seq)] = torch.as_tensor(mask, dtype=torch.long)
        attention[i, : len(seq)] = 1
    truncated = torch.tensor([not seq or seq[-1] not in eos_ids for seq in sequences])
    return MultiTurnRollouts(ids, loss_mask, attention, truncated, messages, stats)
