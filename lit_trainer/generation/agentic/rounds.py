"""Agentic rounds: tools, environments and ``rollout_func``, run by
:class:`~lit_trainer.generation.RolloutGenerator` (:meth:`~lit_trainer.generation.RolloutGenerator.tool_round`,
:meth:`~lit_trainer.generation.RolloutGenerator.custom_round`).

Each replaces the single ``generate`` of a round and hands back the same rows the single-turn path buffers
(``prompt_ids``/``prompt_mask`` left-padded, ``completion_ids``/``completion_mask`` right-padded), plus
``completion_attention_mask`` when some completion tokens are not the model's (tool results, or an ``env_mask`` of a
``rollout_func``): ``completion_mask`` then marks the tokens that get loss, advantage and a place in the token
normaliser, and ``completion_attention_mask`` every token the forward pass sees.

* Tools / environments (:func:`tool_round`): prompts are rendered here with the chat template and the tools' schemas
  (the prompt data module's ids, rendered without tools, are not used); environments are reset first (their text is
  appended to the last prompt message); then :func:`~lit_trainer.generation.agentic.multi_turn.multi_turn_rollouts`.
* ``rollout_func(prompts, module)`` (:func:`custom_round`) returns ``{"prompt_ids", "completion_ids", "logprobs",
  ...}`` (lists per row, as TRL 1.16); ``env_mask`` (1 = model token) becomes the loss mask, other keys reach the
  reward functions as keywords. The log-probs are checked and not used: old log-probs come from the policy, as on the
  ``generate`` path.

The pieces: :mod:`~lit_trainer.generation.agentic.tools` (schemas, parsing, calls),
:mod:`~lit_trainer.generation.agentic.environments` (``environment_factory``) and
:mod:`~lit_trainer.generation.agentic.multi_turn` (the batched loop).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

from lit_trainer.core import sharding
from lit_trainer.core.import_path import import_object
from lit_trainer.data.collate import pad_left
from lit_trainer.data.prompt import PROMPT_IDS, PROMPTS, REWARD_COLUMNS
from lit_trainer.generation import engines
from lit_trainer.generation.agentic.environments import environment_tools
from lit_trainer.generation.agentic.multi_turn import Generate, multi_turn_rollouts
from lit_trainer.generation.agentic.tools import parse_assistant_turn, tool_name

ROLLOUT_KEYS = ("prompt_ids", "completion_ids", "logprobs")
"""The keys a ``rollout_func`` output must hold."""

Reduce = Callable[[Tensor], Tensor]
"""``reduce(tensor) -> its sum over ranks`` (None on one process)."""


def resolve_rollout_func(func: str | Callable[..., Any] | None) -> Callable[..., Any] | None:
    """The ``rollout_func`` callable from a callable or its import path (only what the user names is imported).

    Raises:
        ValueError: for a path that does not import or an object that is not callable.
    """
    if isinstance(func, str):
        func = import_object(func, "rollout_func", "give 'package.module.function' of an importable function.")
    if func is not None and not callable(func):
        raise ValueError(f"rollout_func {func!r} is not callable: give a function or its import path.")
    return func


class AgenticRound(NamedTuple):
    """What an agentic round hands to scoring and the buffer."""

    rows: dict[str, Tensor]
    completions: engines.Completions  # ids, loss mask (model tokens), truncated: for the length metrics
    texts: list[Any]
    kept: list[list[int]]
    prompts: list[Any]
    reward_kwargs: dict[str, Any]
    tool_metrics: dict[str, Tensor]


def agentic_batch(batch: dict[str, Any], round_: AgenticRound) -> dict[str, Any]:
    """The batch the reward functions see: the prompts as the model saw them (after ``reset``)."""
    return {**batch, PROMPTS: round_.prompts, PROMPT_IDS: round_.rows["prompt_ids"]}


def prompt_rows(tokenizer: Any, prompt_ids: list[list[int]], device: Any) -> dict[str, Tensor]:
    """Left-padded ``prompt_ids`` and ``prompt_mask`` on ``device`` (padding: the tokenizer's pad id, else 0)."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    return {
        "prompt_ids": pad_left(prompt_ids, pad).to(device),
        "prompt_mask": pad_left([[1] * len(p) for p in prompt_ids], 0).to(device),
    }


def any_rank(reduce: Reduce | None, device: Any) -> Callable[[bool], bool]:
    """``flag -> True when it is True on any rank`` (the identity on one process, ``reduce`` None)."""
    if reduce is None:
        return lambda flag: flag
    return lambda flag: bool(reduce(torch.tensor(float(flag), device=device)) > 0)


def row_tools(
    tools: Sequence[Any], environments: Any, prompts: Sequence[Any], columns: dict[str, list[Any]]
) -> tuple[list[Any], list[list[Any]], Any]:
    """Per row: the prompt (after ``reset``), the tool callables, and the environment instances (or None)."""
    if environments is None:
        return list(prompts), [list(tools)] * len(prompts), None
    instances = environments.assign(columns, len(prompts))
    prompts = environments.reset(instances, list(prompts), columns)
    return prompts, [list(tools) + environment_tools(e) for e in instances], instances


def batched_generate(
    engine: engines.RolloutEngine,
    model: Any,
    config: Any,
    eos: list[int],
    device: Any,
    should_stop: Callable[[], bool] | None = None,
) -> Generate:
    """``generate(token lists, max_new_tokens) -> kept ids`` on ``model`` with ``engine``, batched (left-padded);
    ``should_stop`` ends a ``generate`` call early (the continuous-batching engine has no stopping criteria)."""

    def generate(inputs: list[list[int]], budget: int) -> list[list[int]]:
        ids = pad_left(inputs, config.pad_token_id).to(device)
        mask = pad_left([[1] * len(row) for row in inputs], 0).to(device)
        step = copy.deepcopy(config)
        step.max_new_tokens = budget
        sharded = sharding.is_sharded(model)
        out = engine.generate(model, ids, mask, step, eos, synced=sharded, should_stop=should_stop)
        return [row[m.bool()].tolist() for row, m in zip(out.ids.cpu(), out.mask.cpu())]

    return generate


def tool_round(
    engine: engines.RolloutEngine,
    model: Any,
    tokenizer: Any,
    batch: dict[str, Any],
    config: Any,
    eos: list[int],
    *,
    tools: Sequence[Any],
    environments: Any,
    chat_template_kwargs: dict[str, Any] | None,
    max_tool_calling_iterations: int | None,
    max_completion_length: int,
    device: Any,
    reduce: Reduce | None = None,
    owner: str = "GRPOModule",
    should_stop: Callable[[], bool] | None = None,
) -> AgenticRound:
    """Render, generate, call tools and continue (all rows together); see the module docstring. ``reduce`` sums over
    ranks (None on one process); ``owner`` names the class in the error for plain-text prompts; ``should_stop`` (a stop
    request) ends the generation calls early and the loop before the next tool turn."""
    columns = batch[REWARD_COLUMNS]
    prompts, per_row, instances = row_tools(tools, environments, batch[PROMPTS], columns)
    if not prompts or isinstance(prompts[0], str):
        raise ValueError(
            f"{owner}(tools=... / environment_factory=...) needs conversational prompts (lists of "
            "{'role', 'content'} messages): tools are described to the model by the chat template."
        )
    options = dict(chat_template_kwargs or {})
    prompt_ids = [
        list(tokenizer.apply_chat_template(
            p, tools=t or None, add_generation_prompt=True, tokenize=True, return_dict=False, **options
        ))
        for p, t in zip(prompts, per_row)
    ]  # fmt: skip
    iterations = max_tool_calling_iterations
    result = multi_turn_rollouts(
        batched_generate(engine, model, config, eos, device, should_stop), tokenizer, prompt_ids,
        [{tool_name(t): t for t in row} for row in per_row],
        max_completion_length=max_completion_length,
        max_iterations=2**31 if iterations is None else iterations,
        eos_ids=eos, pad_token_id=config.pad_token_id, any_rank=any_rank(reduce, device),
        chat_template_kwargs=options, should_stop=should_stop,
    )  # fmt: skip
    rows = prompt_rows(tokenizer, prompt_ids, device)
    rows["completion_ids"] = result.completion_ids.to(device)
    rows["completion_mask"] = result.completion_mask.to(device)
    rows["completion_attention_mask"] = result.attention_mask.to(device)
    completions = engines.Completions(rows["completion_ids"], rows["completion_mask"], result.truncated)
    kept = [row[m.bool()].tolist() for row, m in zip(result.completion_ids, result.attention_mask)]
    counts = torch.tensor([float(result.stats.calls), float(result.stats.failures), float(len(prompts))])
    counts = counts.to(device)
    if reduce is not None:
        counts = reduce(counts)
    metrics = {
        "tools/call_frequency": counts[0] / counts[2],
        "tools/failure_frequency": counts[1] / counts[0].clamp(min=1.0),
    }
    extra = {"environments": instances} if instances is not None else {}
    return AgenticRound(rows, completions, result.messages, kept, prompts, extra, metrics)


def custom_round(
    rollout_func: Callable[..., Any],
    caller: Any,
    tokenizer: Any,
    batch: dict[str, Any],
    eos: list[int],
    pad: int,
    *,
    tools: Sequence[Any],
    device: Any,
) -> AgenticRound:
    """One round from the user's ``rollout_func(prompts, caller)`` (module docstring); ``caller`` is what the function
    gets as its second argument (the module)."""
    prompts = list(batch[PROMPTS])
    output = rollout_func(copy.deepcopy(prompts), caller)
    missing = sorted(set(ROLLOUT_KEYS) - set(output or {}))
    if missing:
        raise ValueError(f"rollout_func must return the keys {missing} in its output dict (lists, one per row).")
    rows_in = len(prompts)
    for key in ROLLOUT_KEYS:
        if len(output[key]) != rows_in:
            raise ValueError(
                f"rollout_func returned {len(output[key])} '{key}' rows for {rows_in} prompts: return one per "
                "prompt row (each prompt already appears num_generations times)."
            )
    extra = {k: v for k, v in output.items() if k not in ROLLOUT_KEYS}
    env_mask = extra.pop("env_mask", None)
    completion = [list(c) for c in output["completion_ids"]]
    width = max(1, max(len(c) for c in completion))
    ids = torch.full((rows_in, width), pad, dtype=torch.long)
    attention = torch.zeros_like(ids)
    loss = torch.zeros_like(ids)
    for i, c in enumerate(completion):
        ids[i, : len(c)] = torch.as_tensor(c, dtype=torch.long)
        attention[i, : len(c)] = 1
        loss[i, : len(c)] = torch.as_tensor(env_mask[i], dtype=torch.long) if env_mask is not None else 1
    rows = prompt_rows(tokenizer, [list(p) for p in output["prompt_ids"]], device)
    rows["completion_ids"], rows["completion_mask"] = ids.to(device), loss.to(device)
    if env_mask is not None:
        rows["completion_attention_mask"] = attention.to(device)
    truncated = torch.tensor([not c or c[-1] not in eos for c in completion])
    completions = engines.Completions(rows["completion_ids"], rows["completion_mask"], truncated)
    if isinstance(prompts[0], str):
        texts = tokenizer.batch_decode(completion, skip_special_tokens=True)
    else:
        texts = [
            [parse_assistant_turn(tokenizer, c, list(p), list(tools))] for c, p in zip(completion, output["prompt_ids"])
        ]
    return AgenticRound(rows, completions, texts, completion, prompts, extra, {})
