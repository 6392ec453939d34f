"""Agentic rounds: tools, environments and ``rollout_func``, run by
:class:`~lit_trainer.generation.RolloutGenerator` (:meth:`~lit_trainer.generation.RolloutGenerator.tool_round`,
:meth:`~lit_trainer.generation.RolloutGenerator.custom_round`).

The code is in :mod:`lit_trainer.generation.agentic.rounds`;
its private parts are beside it in this folder."""

from lit_trainer.generation.agentic.rounds import (
    ROLLOUT_KEYS,
    AgenticRound,
    Reduce,
    agentic_batch,
    any_rank,
    batched_generate,
    custom_round,
    prompt_rows,
    resolve_rollout_func,
    row_tools,
    tool_round,
)

__all__ = [
    "ROLLOUT_KEYS",
    "AgenticRound",
    "Reduce",
    "agentic_batch",
    "any_rank",
    "batched_generate",
    "custom_round",
    "prompt_rows",
    "resolve_rollout_func",
    "row_tools",
    "tool_round",
]
