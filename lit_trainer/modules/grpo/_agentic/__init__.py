"""The agentic rollouts of :class:`~lit_trainer.modules.grpo.GRPOModule`: tools, environments and ``rollout_func``.

Each replaces the single ``generate`` of a round and hands back the same rows the single-turn path buffers
(``prompt_ids``/``prompt_mask`` left-padded, ``completion_ids``/``completion_mask`` right-padded), plus
``completion_attention_mask`` when some completion tokens are not the model's (tool results, or an ``env_mask`` of a
``rollout_func``): ``completion_mask`` then marks the tokens that get loss, advantage and a place in the token
normaliser, and ``completion_attention_mask`` every token the forward pass sees.

* Tools / environments: prompts are rendered here with the chat template and the tools' schemas (the prompt data
  module's ids, rendered without tools, are not used); environments are reset first (their text is appended to the
  last prompt message); then :func:`~lit_trainer.modules.grpo._agentic._multi_turn.multi_turn_rollouts`.
* ``rollout_func(prompts, module)`` returns ``{"prompt_ids", "completion_ids", "logprobs", ...}`` (lists per row, as
  TRL 1.16); ``env_mask`` (1 = model token) becomes the loss mask, other keys reach the reward functions as keywords.
  The log-probs are checked and not used: old log-probs come from the policy, as on the ``generate`` path.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor

from lit_trainer.core import sharding as _sharding
from lit_trainer.core.import_path import import_object
from lit_trainer.data.collate import pad_left
from lit_trainer.data.prompt import PROMPT_IDS, PROMPTS, REWARD_COLUMNS
from lit_trainer.generation import engines as rollout
from lit_trainer.modules.grpo._agentic._environments import environment_tools
from lit_trainer.modules.grpo._agentic._multi_turn import multi_turn_rollouts
from lit_trainer.modules.grpo._agentic._tools import parse_assistant_turn, tool_name

_ROLLOUT_KEYS = ("prompt_ids", "completion_ids", "logprobs")


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
    completions: rollout.Completions  # ids, loss mask (model tokens), truncated: for the length metrics
    texts: list[Any]
    kept: list[list[int]]
    prompts: list[Any]
    reward_kwargs: dict[str, Any]
    tool_metrics: dict[str, Tensor]


class AgenticRolloutMixin:
    """Tool, environment and ``rollout_func`` rounds (reads ``self.tools``, ``self.environments``,
    ``self.rollout_func``, ``self.tokenizer``, ``self.model`` and the hyperparameters)."""

    def _row_tools(self, prompts: list[Any], columns: dict[str, list[Any]]) -> tuple[list[Any], list[list[Any]], Any]:
        """Per row: the prompt (after ``reset``), the tool callables, and the environment instances (or None)."""
        if self.environments is None:
            return list(prompts), [list(self.tools)] * len(prompts), None
        instances = self.environments.assign(columns, len(prompts))
        prompts = self.environments.reset(instances, list(prompts), columns)
        return prompts, [list(self.tools) + environment_tools(e) for e in instances], instances

    def _generator(self, config: Any, eos: list[int], should_stop: Callable[[], bool] | None = None):
        """``generate(token lists, max_new_tokens) -> kept ids`` on the policy, batched (left-padded); ``should_stop``
        ends a ``generate`` call early (the continuous-batching engine has no stopping criteria)."""

        def generate(inputs: list[list[int]], budget: int) -> list[list[int]]:
            ids = pad_left(inputs, config.pad_token_id).to(self.device)
            mask = pad_left([[1] * len(row) for row in inputs], 0).to(self.device)
            step = copy.deepcopy(config)
            step.max_new_tokens = budget
            sharded = _sharding.is_sharded(self.model)
            out = self.engine.generate(self.model, ids, mask, step, eos, synced=sharded, should_stop=should_stop)
            return [row[m.bool()].tolist() for row, m in zip(out.ids.cpu(), out.mask.cpu())]

        return generate

    def _any_rank(self, flag: bool) -> bool:
        if self.trainer.world_size == 1:
            return flag
        return bool(self.trainer.strategy.reduce(torch.tensor(float(flag), device=self.device), reduce_op="sum") > 0)

    def _tool_round(
        self, batch: dict[str, Any], config: Any, eos: list[int], should_stop: Callable[[], bool] | None = None
    ) -> AgenticRound:
        """Render, generate, call tools and continue (all rows together); see the module docstring. ``should_stop``
        (a stop request) ends the generation calls early and the loop before the next tool turn."""
        columns = batch[REWARD_COLUMNS]
        prompts, row_tools, instances = self._row_tools(batch[PROMPTS], columns)
        if not prompts or isinstance(prompts[0], str):
            raise ValueError(
                f"{type(self).__name__}(tools=... / environment_factory=...) needs conversational prompts (lists of "
                "{'role', 'content'} messages): tools are described to the model by the chat template."
            )
        options = dict(self.hparams.chat_template_kwargs or {})
        prompt_ids = [
            list(self.tokenizer.apply_chat_template(
                p, tools=t or None, add_generation_prompt=True, tokenize=True, return_dict=False, **options
            ))
            for p, t in zip(prompts, row_tools)
        ]  # fmt: skip
        iterations = self.hparams.max_tool_calling_iterations
        result = multi_turn_rollouts(
            self._generator(config, eos, should_stop), self.tokenizer, prompt_ids,
            [{tool_name(t): t for t in tools} for tools in row_tools],
            max_completion_length=self.hparams.max_completion_length,
            max_iterations=2**31 if iterations is None else iterations,
            eos_ids=eos, pad_token_id=config.pad_token_id, any_rank=self._any_rank, chat_template_kwargs=options,
            should_stop=should_stop,
        )  # fmt: skip
        rows = self._prompt_rows(prompt_ids)
        rows["completion_ids"] = result.completion_ids.to(self.device)
        rows["completion_mask"] = result.completion_mask.to(self.device)
        rows["completion_attention_mask"] = result.attention_mask.to(self.device)
        completions = rollout.Completions(rows["completion_ids"], rows["completion_mask"], result.truncated)
        kept = [row[m.bool()].tolist() for row, m in zip(result.completion_ids, result.attention_mask)]
        counts = torch.tensor([float(result.stats.calls), float(result.stats.failures), float(len(prompts))])
        counts = counts.to(self.device)
        if self.trainer.world_size > 1:
            counts = self.trainer.strategy.reduce(counts, reduce_op="sum")
        metrics = {
            "tools/call_frequency": counts[0] / counts[2],
            "tools/failure_frequency": counts[1] / counts[0].clamp(min=1.0),
        }
        extra = {"environments": instances} if instances is not None else {}
        return AgenticRound(rows, completions, result.messages, kept, prompts, extra, metrics)

    def _custom_round(self, batch: dict[str, Any], eos: list[int], pad: int) -> AgenticRound:
        """One round from the user's ``rollout_func`` (module docstring)."""
        prompts = list(batch[PROMPTS])
        output = self.rollout_func(copy.deepcopy(prompts), self)
        missing = sorted(set(_ROLLOUT_KEYS) - set(output or {}))
        if missing:
            raise ValueError(f"rollout_func must return the keys {missing} in its output dict (lists, one per row).")
        rows_in = len(prompts)
        for key in _ROLLOUT_KEYS:
            if len(output[key]) != rows_in:
                raise ValueError(
                    f"rollout_func returned {len(output[key])} '{key}' rows for {rows_in} prompts: return one per "
                    "prompt row (each prompt already appears num_generations times)."
                )
        extra = {k: v for k, v in output.items() if k not in _ROLLOUT_KEYS}
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
        rows = self._prompt_rows([list(p) for p in output["prompt_ids"]])
        rows["completion_ids"], rows["completion_mask"] = ids.to(self.device), loss.to(self.device)
        if env_mask is not None:
            rows["completion_attention_mask"] = attention.to(self.device)
        truncated = torch.tensor([not c or c[-1] not in eos for c in completion])
        completions = rollout.Completions(rows["completion_ids"], rows["completion_mask"], truncated)
        if isinstance(prompts[0], str):
            texts = self.tokenizer.batch_decode(completion, skip_special_tokens=True)
        else:
            texts = [
                [parse_assistant_turn(self.tokenizer, c, list(p), list(self.tools))]
                for c, p in zip(completion, output["prompt_ids"])
            ]
        return AgenticRound(rows, completions, texts, completion, prompts, extra, {})

    def _prompt_rows(self, prompt_ids: list[list[int]]) -> dict[str, Tensor]:
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        return {
            "prompt_ids": pad_left(prompt_ids, pad).to(self.device),
            "prompt_mask": pad_left([[1] * len(p) for p in prompt_ids], 0).to(self.device),
        }


def agentic_batch(batch: dict[str, Any], round_: AgenticRound) -> dict[str, Any]:
    """The batch the reward functions see: the prompts as the model saw them (after ``reset``)."""
    return {**batch, PROMPTS: round_.prompts, PROMPT_IDS: round_.rows["prompt_ids"]}
