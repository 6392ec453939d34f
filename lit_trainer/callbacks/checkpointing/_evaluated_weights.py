"""The protocol between a callback that validates other weights than the live ones and a checkpoint callback.

A callback such as ``BEMA(evaluate_with_bema=True)`` swaps averaged weights into the module for validation, so the
monitored score belongs to those weights, not to the live ones a checkpoint's ``state_dict`` holds (and must hold,
to resume training). ``BestCheckpoint`` asks such a callback for the weights it scored and stores them beside the
live ones, under :data:`EVALUATED_WEIGHTS_KEY`; loading the best weights and the ``best/`` export use them.
Duck-typed: the callbacks do not import each other.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from torch import Tensor

# checkpoint entry: {state_dict key: tensor} for the entries whose scored value differs from the live `state_dict`
EVALUATED_WEIGHTS_KEY = "evaluated_weights"


@runtime_checkable
class EvaluatesOtherWeights(Protocol):
    """A callback whose validation during fit may score weights other than the live ones."""

    @property
    def evaluates_other_weights(self) -> bool:
        """Whether validation during fit scores other weights (known at setup)."""

    def evaluated_weights(self) -> dict[str, Tensor] | None:
        """The weights the latest validation scored, keyed like ``pl_module.state_dict()``; ``None`` when it scored
        the live weights or the scored weights are gone (changed since)."""


def weight_scorers(callbacks: list[Any]) -> list[EvaluatesOtherWeights]:
    """The callbacks that will score other weights than the live ones."""
    return [cb for cb in callbacks if isinstance(cb, EvaluatesOtherWeights) and cb.evaluates_other_weights]


def scored_state_dict(checkpoint: dict[str, Any]) -> dict[str, Tensor]:
    """The weights a checkpoint was scored with: its ``state_dict`` with the evaluated weights put in."""
    return {**checkpoint["state_dict"], **checkpoint.get(EVALUATED_WEIGHTS_KEY, {})}
