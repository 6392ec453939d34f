"""The optimizer-step windows Lightning steps on: the one place the loader, the modules and GRPO read them from.

In automatic optimization, Lightning runs ``backward`` on every micro-batch and steps the optimizer after the
micro-batch of epoch index ``i`` when ``(i + 1) % accumulate_grad_batches == 0``, or when ``i`` is the epoch's last
micro-batch. The epoch's length is ``trainer.num_training_batches``: ``min(len(loader), limit_train_batches)`` (a
float limit is a fraction of ``len(loader)``), infinite for a loader without a length, and the loader running out
ends it early too. ``accumulate_grad_batches`` is read live: Lightning's ``GradientAccumulationScheduler`` changes it
at every epoch start, before the epoch's first micro-batch is fetched. ``max_steps`` stops training right after an
optimizer step, so it never cuts a window.

So the window of micro-batch ``i`` is ``[i - i % N, min(i - i % N + N, epoch_length))`` with ``N`` the current
``accumulate_grad_batches``: windows are aligned to the epoch's start, and the last one may be shorter. Token-exact
accumulation divides every micro-batch of a window by the loss items of exactly these micro-batches.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StepWindows:
    """How an epoch's micro-batches group into optimizer steps.

    Args:
        accumulate: micro-batches per optimizer step (``Trainer.accumulate_grad_batches``), >= 1.
        epoch_length: micro-batches in the epoch (``Trainer.num_training_batches``); ``float("inf")`` when unknown
            (the loader's end then closes the last window).

    Example:
        >>> StepWindows(accumulate=4, epoch_length=6).bounds(5)
        (4, 6)
    """

    accumulate: int
    epoch_length: int | float = float("inf")

    def __post_init__(self) -> None:
        if self.accumulate < 1:
            raise ValueError(f"`accumulate_grad_batches={self.accumulate}` is invalid: it must be >= 1.")

    def bounds(self, index: int) -> tuple[int, int]:
        """``(start, stop)`` micro-batch indices of the optimizer step that micro-batch ``index`` belongs to.

        An ``index`` at or past the epoch's end gets an empty window (``stop <= index``): the epoch is over.
        """
        start = index - index % self.accumulate
        stop = start + self.accumulate
        if self.epoch_length != float("inf"):
            stop = min(stop, int(self.epoch_length))
        return start, stop

    def length(self, index: int) -> int:
        """Micro-batches in the optimizer step of micro-batch ``index`` (``accumulate``, fewer in a short last one)."""
        start, stop = self.bounds(index)
        return stop - start


def step_windows(trainer: Any) -> StepWindows:
    """The windows of the trainer's current training epoch, read from its live settings."""
    return StepWindows(int(trainer.accumulate_grad_batches), trainer.num_training_batches)
