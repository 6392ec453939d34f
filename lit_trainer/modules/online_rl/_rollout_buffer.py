"""The GRPO rollout buffer: one generation batch, shuffled, cut into micro-batches and replayed (reference 2.4).

A round starts with :meth:`RolloutBuffer.fill` on the first micro-step; the next ``steps_per_generation *
num_iterations - 1`` micro-steps are served from the buffer, the ``steps_per_generation`` slices in the same order on
every pass. Rows are shuffled with a seeded ``torch.Generator`` (not the global RNG), so the groups are split up as in
the reference and a resumed run reproduces the order. Everything stored is tensors and ints, so the buffer can be
saved in a checkpoint that loads with ``weights_only=True``. The image inputs of prompts with images are stored per
row (:func:`~lit_trainer.data.vision.prompt.pack_row_images`), so they follow their rows through the shuffle.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lit_trainer.data.vision.prompt import PROMPT_PER_TOKEN_KEYS

PROMPT_KEYS = ("prompt_ids", "prompt_mask", *PROMPT_PER_TOKEN_KEYS)  # the last: per-token image inputs (left-padded)
ATTENTION = "completion_attention_mask"  # multi-turn rows: every completion token (completion_mask: the model's)
SAMPLING_LOGPS = "sampling_logps"  # the rollout worker's log-probs of a round the trainer corrects for (async GRPO)
COMPLETION_KEYS = ("completion_ids", "completion_mask", ATTENTION, "old_logps", "ref_logps", SAMPLING_LOGPS)


def trim_padding(rows: dict[str, Tensor]) -> dict[str, Tensor]:
    """Drop prompt columns that are padding in every row (left) and completion columns past the longest kept
    completion (right), so a micro-batch is as narrow as its own rows. At least one column of each is kept."""
    prompt_cols = rows["prompt_mask"].any(0).nonzero()
    start = int(prompt_cols[0]) if prompt_cols.numel() else rows["prompt_mask"].shape[1] - 1
    completion_cols = rows.get(ATTENTION, rows["completion_mask"]).any(0).nonzero()
    end = int(completion_cols[-1]) + 1 if completion_cols.numel() else 1
    out = dict(rows)
    for key in PROMPT_KEYS:
        if key in rows:
            out[key] = rows[key][:, start:]
    for key in COMPLETION_KEYS:
        if key in rows:
            out[key] = rows[key][:, :end]
    return out


class RolloutBuffer:
    """Serves the micro-batches of one generation round.

    Args:
        steps_per_generation: micro-batches per generation batch (``spg``).
        num_iterations: passes over each generation batch (``mu``).

    Example::

        buffer = RolloutBuffer(steps_per_generation=4, num_iterations=1)
        if buffer.needs_refill:
            slices = buffer.shuffle(rollouts, generator)
            buffer.fill(slices, all_reduced_token_counts(slices), metrics)
        micro_batch, slice_index = buffer.next()
    """

    def __init__(self, steps_per_generation: int, num_iterations: int) -> None:
        self.steps_per_generation = steps_per_generation
        self.num_iterations = num_iterations
        self.slices: list[dict[str, Tensor]] = []
        self.slice_tokens: Tensor | None = None
        self.metrics: dict[str, Tensor] = {}
        self.served = 0
        self.rounds = 0

    @property
    def round_length(self) -> int:
        """Micro-steps per generation round: ``steps_per_generation * num_iterations``."""
        return self.steps_per_generation * self.num_iterations

    @property
    def needs_refill(self) -> bool:
        """True on the first micro-step of a round, or when the buffer is empty (e.g. after a DDP resume)."""
        return not self.slices or self.served >= self.round_length

    @property
    def next_round_index(self) -> int:
        """The index of the round :meth:`fill` stores next: a new round, or the interrupted one when the buffer of a
        round in progress was not restored (a resume with another world size), which must be regenerated with its
        own seed, not the next round's."""
        return self.rounds if self.served >= self.round_length else max(self.rounds - 1, 0)

    def end_round(self) -> None:
        """Make the next micro-step start a new round (its first micro-step generates)."""
        self.served = self.round_length

    def fill(self, slices: list[dict[str, Tensor]], slice_tokens: Tensor, metrics: dict[str, Tensor]) -> None:
        """Store a scored generation batch, already cut by :meth:`shuffle`.

        Args:
            slices: the ``spg`` micro-batches of the round.
            slice_tokens: (spg,) completion tokens of each slice summed over ranks (the normaliser parts).
            metrics: the round's generation metrics (served with every micro-step of the round).
        """
        if self.served >= self.round_length:  # a new round; a refill of an emptied buffer (resume) keeps the position
            self.served = 0
            self.rounds += 1
        self.slices = slices
        self.slice_tokens = slice_tokens
        self.metrics = metrics

    def shuffle(self, rows: dict[str, Tensor], generator: torch.Generator) -> list[dict[str, Tensor]]:
        """Permute the rows with ``generator`` and cut them into ``spg`` equal, trimmed slices."""
        count = next(iter(rows.values())).shape[0]
        if count % self.steps_per_generation:
            raise ValueError(
                f"{count} rollout rows do not split into steps_per_generation="
                f"{self.steps_per_generation} equal micro-batches."
            )
        order = torch.randperm(count, generator=generator).to(next(iter(rows.values())).device)
        chunks = order.chunk(self.steps_per_generation)
        return [trim_padding({k: v[idx] for k, v in rows.items()}) for idx in chunks]

    def next(self) -> tuple[dict[str, Tensor], int]:
        """The micro-batch of this micro-step and its slice index (``served % spg``)."""
        index = self.served % self.steps_per_generation
        self.served += 1
        return self.slices[index], index

    # ---------------------------------------------------------------------------------------------- checkpoint
    def state_dict(self, *, with_rollouts: bool) -> dict[str, Any]:
        """Counters, and the stored rollouts when ``with_rollouts`` (tensors on CPU, ints and dicts only)."""
        state: dict[str, Any] = {"served": self.served, "rounds": self.rounds}
        if with_rollouts and self.slices:
            state["slices"] = [{k: v.cpu() for k, v in s.items()} for s in self.slices]
            state["slice_tokens"] = self.slice_tokens.cpu()
            state["metrics"] = {k: v.cpu() for k, v in self.metrics.items()}
        return state

    def load_state_dict(self, state: dict[str, Any], device: torch.device) -> None:
        """Restore counters (and rollouts, when saved); without rollouts the next micro-step regenerates."""
        self.served, self.rounds = int(state["served"]), int(state["rounds"])
        self.slices = [{k: v.to(device) for k, v in s.items()} for s in state.get("slices", [])]
        self.slice_tokens = state["slice_tokens"].to(device) if "slice_tokens" in state else None
        self.metrics = {k: v.to(device) for k, v in state.get("metrics", {}).items()}
