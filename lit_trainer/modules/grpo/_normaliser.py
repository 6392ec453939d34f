"""The dapo/cispo normaliser of one GRPO optimizer step: the completion tokens of the step's micro-batches over all
ranks, exact even when the step spans two generation rounds.

A step's micro-batches are served from the rollout buffer. When they all come from the current round, their token
counts are known at the step's first micro-batch and the normaliser is exact from the start. When the step reaches
into a round that is not generated yet (``steps_per_generation`` not a multiple of ``accumulate_grad_batches``), its
micro-batches divide by a provisional count (the reference's estimate ``N * length / steps_per_generation``, with
``N`` the current round's tokens) and the step's last micro-batch rescales the accumulated gradient by
``provisional / exact``: the loss is linear in ``1 / normaliser``, so the step gradient is the full-batch token-mean
gradient (the reference keeps the estimate).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class StepNormaliser:
    """The normaliser of the current optimizer step (see the module docstring).

    Attributes:
        provisional: what every micro-batch of the step divides by (``max(1, .)`` is applied by the loss).
        exact: True when ``provisional`` is already the step's token count.
        seen: completion tokens (over ranks) of the step's micro-batches served so far.
    """

    provisional: Tensor
    exact: bool
    seen: Tensor | float = 0.0

    @classmethod
    def start(cls, slice_tokens: Tensor, position: int, length: int, round_length: int) -> StepNormaliser:
        """The normaliser of a step of ``length`` micro-steps whose first one is at ``position`` in the round.

        Args:
            slice_tokens: ``(spg,)`` completion tokens of each buffered slice, summed over ranks.
            position: the step's first micro-step within the round (the round serves slice ``position % spg``).
            length: micro-steps in the step (from this one on).
            round_length: micro-steps per round (``steps_per_generation * num_iterations``).
        """
        spg = slice_tokens.numel()
        if position + length <= round_length:
            served = (position + torch.arange(length, device=slice_tokens.device)) % spg  # the step's slices
            return cls(slice_tokens[served].sum(), True)
        return cls(slice_tokens.sum() * length / spg, False)

    def add(self, tokens: Tensor) -> None:
        """Count a served micro-batch's completion tokens (over ranks)."""
        self.seen = self.seen + tokens

    def correction(self) -> Tensor | None:
        """``max(1, provisional) / max(1, exact count)`` at the step's end; None when nothing needs rescaling."""
        if self.exact:
            return None
        return self.provisional.clamp(min=1.0) / torch.as_tensor(self.seen).clamp(min=1.0)
